#!/usr/bin/env python3
"""Boot benchmark driver (see tests/bench/boot). Prints one table.

Each round runs both sides once, alternating which goes first; a side's time is the wall time
of its whole process, from spawn to exit. Peak RSS is the process's ru_maxrss (it includes the
guest RAM the guest touched, which lives in the VMM's address space for both VMMs).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def newc(entries):
    """A newc cpio archive from (name, mode, data, rdev_major, rdev_minor) entries."""
    out = bytearray()

    def add(ino, name, mode, data=b"", rmaj=0, rmin=0):
        nonlocal out
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rmaj, rmin, len(name) + 1, 0]
        out += b"070701" + b"".join(b"%08x" % f for f in fields) + name.encode() + b"\0"
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)

    for i, (name, mode, data, rmaj, rmin) in enumerate(entries, 1):
        add(i, name, mode, data, rmaj, rmin)
    add(0, "TRAILER!!!", 0)
    return bytes(out)


def make_initrd(init_path, out_path):
    init = open(init_path, "rb").read()
    archive = newc([
        ("dev", 0o040755, b"", 0, 0),
        ("dev/console", 0o020600, b"", 5, 1),
        ("init", 0o100755, init, 0, 0),
    ])
    with open(out_path + ".part", "wb") as f:
        f.write(archive)
    os.rename(out_path + ".part", out_path)


def timed(argv):
    """Run argv to completion; return (seconds, exit code, peak RSS KiB, stderr tail)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return dt, p.returncode, ru.ru_maxrss, err.decode(errors="replace")[-2000:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-initrd", nargs=2, metavar=("INIT", "OUT"))
    ap.add_argument("--amvm")
    ap.add_argument("--kernel")
    ap.add_argument("--initrd")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--mem", type=int, default=512)
    a = ap.parse_args()
    if a.make_initrd:
        make_initrd(*a.make_initrd)
        return 0

    sides = {
        "amvm run -- true": [a.amvm, "run", "--mem", str(a.mem), "--kernel", a.kernel, "--", "true"],
        # Same kernel, PVH entry, KVM, 1 vCPU, same RAM; no ACPI (our kernel has none), serial
        # console like ours, triple-fault reboot (microvm has no i8042) with -no-reboot to exit.
        "qemu microvm -> init reboots": [
            "qemu-system-x86_64", "-M", "microvm,acpi=off,x-option-roms=off", "-accel", "kvm", "-cpu", "host",
            "-m", str(a.mem), "-smp", "1", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-serial", "null", "-kernel", a.kernel, "-initrd", a.initrd,
            "-append", "console=ttyS0 reboot=t panic=-1 quiet rdinit=/init",
        ],
    }
    results = {k: [] for k in sides}
    rss = {k: [] for k in sides}
    names = list(sides)
    for r in range(a.runs + 1):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            dt, code, maxrss, err = timed(sides[name])
            if code != 0:
                print(f"{name}: exit {code}\n{err}", file=sys.stderr)
                return 1
            if r > 0:  # round 0 warms the page cache
                results[name].append(dt)
                rss[name].append(maxrss)

    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    env = f"CPU: {model}; {os.cpu_count()} CPUs"
    print(f"\nboot benchmark: {a.runs} interleaved runs per side, {a.mem} MiB guest, 1 vCPU; {env}")
    print(f"{'side':34} {'median s':>9} {'min s':>7} {'max s':>7} {'stdev':>7} {'peak RSS MiB':>13}")
    for name in names:
        xs = results[name]
        print(f"{name:34} {statistics.median(xs):9.3f} {min(xs):7.3f} {max(xs):7.3f} {statistics.pstdev(xs):7.3f} {statistics.median(rss[name]) / 1024:13.1f}")
    ratio = statistics.median(results[names[0]]) / statistics.median(results[names[1]])
    print(f"{'ratio amvm / qemu microvm (median)':34} {ratio:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
