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


def rss_fields(pid):
    """RssAnon, RssFile, RssShmem of `pid` in KiB (None once it is gone)."""
    try:
        text = open(f"/proc/{pid}/status").read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "RssShmem"):
            out[k] = int(v.split()[0])
    return out if len(out) == 3 else None


def grandchild(pid):
    """The first child of pid's first child (amvm run -> its sandbox's supervisor -> the VMM)."""
    def children(p):
        try:
            return [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            return []
    for c in children(pid):
        for g in children(c):
            return g
    return None


def vmm_memory(argv, settle_s=3.0):
    """Run argv (a workload that prints a line, then sleeps), sampling the VMM's RSS every
    20 ms. Guest RAM is a shared memfd mapping (RssShmem); the VMM's own memory is the rest
    (RssAnon + RssFile). Returns (peak own KiB, steady own KiB: the median over `settle_s`
    from 0.5 s after the workload's line, peak shmem KiB = guest RAM the guest touched, peak
    anonymous KiB)."""
    import threading
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready = []
    threading.Thread(target=lambda: (p.stdout.readline(), ready.append(time.perf_counter()), p.stdout.read()),
                     daemon=True).start()
    samples = []
    vmm = None
    while p.poll() is None:
        # amvm run is a sandbox made for the command: the VMM is its supervisor's child.
        vmm = vmm or grandchild(p.pid)
        f = rss_fields(vmm) if vmm else None
        if f:
            samples.append((time.perf_counter(), f["RssAnon"] + f["RssFile"], f["RssShmem"], f["RssAnon"]))
        time.sleep(0.02)
    err = p.stderr.read().decode(errors="replace")
    if p.returncode != 0 or not samples or not ready:
        raise RuntimeError(f"{argv}: exit {p.returncode}\n{err[-2000:]}")
    t0 = ready[0] + 0.5
    steady = [x[1] for x in samples if t0 <= x[0] <= t0 + settle_s] or [samples[-1][1]]
    return (max(x[1] for x in samples), statistics.median(steady), max(x[2] for x in samples),
            max(x[3] for x in samples))


def mem_used_kib():
    info = {}
    for line in open("/proc/meminfo"):
        k, _, v = line.partition(":")
        info[k] = int(v.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def density(argv, n):
    """Start n copies of argv at once; wait for all. Returns (wall s, peak host memory taken
    in MiB (MemTotal - MemAvailable over its value before), sum of peak RSS MiB, failures)."""
    base = mem_used_kib()
    t0 = time.perf_counter()
    procs = [subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(n)]
    peak, rss, failed, left = base, 0, 0, {p.pid for p in procs}
    while left:
        peak = max(peak, mem_used_kib())
        pid, status, ru = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
            continue
        if pid in left:
            left.discard(pid)
            rss += ru.ru_maxrss
            failed += os.waitstatus_to_exitcode(status) != 0
    return time.perf_counter() - t0, (peak - base) / 1024, rss / 1024, failed


def qemu_argv(kernel, initrd, mem):
    """The peer: qemu's microvm booting KERNEL to the reboot-init initramfs (also tests/bench/jit)."""
    return [
        # Same kernel, PVH entry, KVM, 1 vCPU, same RAM; no ACPI (our kernel has none), serial
        # console like ours, triple-fault reboot (microvm has no i8042) with -no-reboot to exit.
        "qemu-system-x86_64", "-M", "microvm,acpi=off,x-option-roms=off", "-accel", "kvm", "-cpu", "host",
        "-m", str(mem), "-smp", "1", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-serial", "null", "-kernel", kernel, "-initrd", initrd,
        "-append", "console=ttyS0 reboot=t panic=-1 quiet rdinit=/init",
    ]


def firecracker_config(path, kernel, initrd, mem, vsock_uds=None):
    """Write Firecracker's config file to PATH: KERNEL booted to INITRD's /init on 1 vCPU and MEM
    MiB, reboot=k (the guest's keyboard-controller reset is Firecracker's exit); with VSOCK_UDS,
    a vsock device whose host side is that unix socket (tests/bench/sessions)."""
    import json
    cfg = {
        "boot-source": {"kernel_image_path": kernel, "initrd_path": initrd,
                        "boot_args": "console=ttyS0 reboot=k panic=-1 quiet rdinit=/init"},
        "drives": [],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": mem},
    }
    if vsock_uds:
        cfg["vsock"] = {"guest_cid": 3, "uds_path": vsock_uds}
    with open(path, "w") as f:
        json.dump(cfg, f)


def firecracker_argv(fc, kernel, initrd, mem, tmp):
    """The second peer: Firecracker (tests/bench/firecracker) booting KERNEL to the same
    initramfs, no API socket, its config in a file."""
    cfg = os.path.join(tmp, f"firecracker-{mem}.json")
    firecracker_config(cfg, kernel, initrd, mem)
    return [fc, "--no-api", "--config-file", cfg, "--level", "Error"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-initrd", nargs=2, metavar=("INIT", "OUT"))
    ap.add_argument("--amvm")
    ap.add_argument("--kernel")
    ap.add_argument("--initrd")
    ap.add_argument("--firecracker", help="a Firecracker binary: a third side in the first pass")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--mem", type=int, default=512)
    ap.add_argument("--density", default="", help="comma-separated N: start N VMs at once per side")
    a = ap.parse_args()
    if a.make_initrd:
        make_initrd(*a.make_initrd)
        return 0

    qemu = qemu_argv(a.kernel, a.initrd, a.mem)
    import tempfile
    tmp = tempfile.mkdtemp(prefix="amvm-bench-boot.")
    fc_name = "firecracker -> init reboots"
    firecracker = a.firecracker and firecracker_argv(a.firecracker, a.kernel, a.initrd, a.mem, tmp)
    amvm = [a.amvm, "run", "--mem", str(a.mem), "--kernel", a.kernel]
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    env = f"CPU: {model}; {os.cpu_count()} CPUs"
    # Two passes of two sides each: amvm's default, then its opt-in huge-page guest RAM, each
    # against the peer. Within a pass the order flips every round (A B, B A, A B, ...), so each
    # side follows itself as often as the other: in the emulated KVM host a run is measurably
    # slower after an amvm run than after a qemu run, whichever it is (docs/performance.md), and
    # a fixed order would hand that cost to one side. "after self" / "after other" split each
    # side's runs by what ran just before.
    peer = "qemu microvm -> init reboots"
    default = ("amvm run -- true", amvm + ["--", "true"])
    # With --firecracker, the first pass has it as a third side; the order then rotates
    # (A B C, B C A, C A B, ...).
    for label, ours, target in ((*default, "< 1.0"),
                                ("amvm run --huge-pages -- true", amvm + ["--huge-pages", "--", "true"], "")):
        sides = {label: ours, peer: qemu}
        if firecracker and ours is default[1]:
            sides[fc_name] = firecracker
        names = list(sides)
        results = {k: [] for k in sides}
        after = {(k, j): [] for k in sides for j in sides}
        rss = {k: [] for k in sides}
        prev = None
        for r in range(a.runs + 1):
            if len(names) == 2:
                order = names if r % 2 == 0 else names[::-1]
            else:
                order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                dt, code, maxrss, err = timed(sides[name])
                if code != 0:
                    print(f"{name}: exit {code}\n{err}", file=sys.stderr)
                    return 1
                if r > 0:  # round 0 warms the page cache
                    results[name].append(dt)
                    rss[name].append(maxrss)
                    after[(name, prev)].append(dt)
                prev = name
        print(f"\nboot benchmark: {a.runs} interleaved runs per side, {a.mem} MiB guest, 1 vCPU; {env}")
        print(f"{'side':34} {'median s':>9} {'min s':>7} {'max s':>7} {'stdev':>7} {'peak RSS MiB':>13}"
              f" {'after self':>11} {'after other':>12}")
        for name in names:
            xs = results[name]
            others = [x for j in names if j != name for x in after[(name, j)]]
            med = lambda v: f"{statistics.median(v):.3f}" if v else "-"
            print(f"{name:34} {statistics.median(xs):9.3f} {min(xs):7.3f} {max(xs):7.3f} {statistics.pstdev(xs):7.3f}"
                  f" {statistics.median(rss[name]) / 1024:13.1f} {med(after[(name, name)]):>11}"
                  f" {med(others):>12}")
        ratio = statistics.median(results[label]) / statistics.median(results[peer])
        print(f"{'ratio amvm / qemu microvm (median)':34} {ratio:9.2f}")
        print(f"SUMMARY|boot: {label} vs qemu microvm|{statistics.median(results[label]):.3f} s"
              f"|{statistics.median(results[peer]):.3f} s|{ratio:.2f}|{target}")
        if fc_name in results:
            fc_ratio = statistics.median(results[fc_name]) / statistics.median(results[peer])
            vs_fc = statistics.median(results[label]) / statistics.median(results[fc_name])
            print(f"{'ratio firecracker / qemu microvm':34} {fc_ratio:9.2f}")
            print(f"{'ratio amvm / firecracker':34} {vs_fc:9.2f}")
            print(f"SUMMARY|boot: firecracker vs qemu microvm|{statistics.median(results[fc_name]):.3f} s"
                  f"|{statistics.median(results[peer]):.3f} s|{fc_ratio:.2f}|")
            print(f"SUMMARY|boot: {label} vs firecracker|{statistics.median(results[label]):.3f} s"
                  f"|{statistics.median(results[fc_name]):.3f} s|{vs_fc:.2f}|<= 1.0")

    # Where a run's time goes: the guest's clock (/proc/uptime, from the kernel's timekeeping
    # start) when the workload runs, against the whole run measured outside.
    runs = max(1, min(a.runs, 5))
    wall, to_exec = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run([a.amvm, "run", "--mem", str(a.mem), "--kernel", a.kernel, "--", "cat", "/proc/uptime"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
        wall.append(time.perf_counter() - t0)
        if p.returncode != 0:
            print(f"amvm run -- cat /proc/uptime: exit {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
            return 1
        to_exec.append(float(p.stdout.split()[0]))
    rest = [w - e for w, e in zip(wall, to_exec)]
    print(f"\nwhere a run goes, amvm run -- cat /proc/uptime, {runs} runs (guest clock from its kernel's start)")
    print(f"{'':44} {'median s':>9} {'min s':>7} {'max s':>7}")
    for label, xs in [("whole run (outside)", wall),
                      ("guest kernel start -> workload exec (inside)", to_exec),
                      ("the rest: VMM set-up before, teardown after", rest)]:
        print(f"{label:44} {statistics.median(xs):9.3f} {min(xs):7.3f} {max(xs):7.3f}")
    print(f"SUMMARY|boot: guest kernel start -> workload exec, of the whole run|{statistics.median(to_exec):.3f} s"
          f"|{statistics.median(wall):.3f} s (whole)|{statistics.median(to_exec) / statistics.median(wall):.2f}|")

    # VMM memory beyond guest RAM: a 512 MiB guest whose workload sleeps 4 s (the steady state).
    runs = max(1, min(a.runs, 3))
    mem = [vmm_memory([a.amvm, "run", "--mem", "512", "--kernel", a.kernel, "--", "sh", "-c", "echo up; sleep 5"])
           for _ in range(runs)]
    print(f"\nVMM memory, amvm run --mem 512 -- sh -c 'echo up; sleep 5', {runs} runs (own = RssAnon + RssFile of the VMM "
          f"process; guest RAM is its shared memfd, RssShmem)")
    print(f"{'':34} {'median MiB':>10} {'min':>7} {'max':>7}")
    for label, i in (("VMM own memory, peak", 0), ("VMM own memory, steady", 1),
                     ("  of which anonymous, peak", 3), ("guest RAM touched (shmem)", 2)):
        xs = [m[i] / 1024 for m in mem]
        print(f"{label:34} {statistics.median(xs):10.1f} {min(xs):7.1f} {max(xs):7.1f}")
        if i in (0, 1):
            print(f"SUMMARY|{label}, 512 MiB guest|{statistics.median(xs):.1f} MiB||"
                  f"|{'< 5 MiB' if i == 1 else ''}")

    if a.density:
        print("\ndensity: N VMs started at once, until all have exited (wall s; host memory: peak of "
              "MemTotal-MemAvailable over before, MiB; sum of each process's peak RSS, MiB)")
        print(f"{'N, side':34} {'wall s':>9} {'host MiB':>9} {'sum RSS':>9} {'failed':>7}")
        sides = dict([default, (peer, qemu)])
        names = list(sides)
        for n in [int(x) for x in a.density.split(",") if x]:
            walls = {}
            for name in names:
                wall, host, rss_sum, failed = density(sides[name], n)
                walls[name] = wall
                print(f"{f'{n} x {name}':34} {wall:9.2f} {host:9.1f} {rss_sum:9.1f} {failed:7}")
            print(f"{f'{n}: wall ratio amvm / qemu':34} {walls[names[0]] / walls[names[1]]:9.2f}")
            print(f"SUMMARY|density: {n} VMs at once, wall|{walls[names[0]]:.1f} s|{walls[names[1]]:.1f} s"
                  f"|{walls[names[0]] / walls[names[1]]:.2f}|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
