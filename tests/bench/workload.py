#!/usr/bin/env python3
"""Workload overhead (see tests/bench/workload): the same tasks on the host and in the guest.

Tasks (the kinds on which gVisor measured 1.2x-6.2x of runc): Node start N times, writing,
reading and removing many small files in /tmp, copying a node_modules-sized tree within /tmp,
and a CPU loop in Node. Each runs as one shell script timed from inside (the /proc/uptime clock
around the task only: the guest's boot is not counted); the host runs it in a fresh /tmp
directory of its own. Interleaved, medians, one table with guest/host ratios.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

NODE = "/usr/bin/node"

# A node_modules-like tree: many directories, mostly small files, a few larger ones.
MAKE_TREE = r"""
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = os.path.join(root, f"pkg{i // 20:04}", "lib" if i % 3 else "dist")
    os.makedirs(d, exist_ok=True)
    size = 32768 if i % 50 == 0 else 600 + (i * 37) % 3000
    with open(os.path.join(d, f"m{i}.js"), "wb") as f:
        f.write(b"x" * size)
"""

SMALL_FILES = r"""
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
os.makedirs(d)
for i in range(n):
    with open(f"{d}/f{i}", "w") as f:
        f.write("small file %d\n" % i)
for i in range(n):
    with open(f"{d}/f{i}") as f:
        f.read()
for i in range(n):
    os.unlink(f"{d}/f{i}")
os.rmdir(d)
"""


def tasks(a):
    """(row name, setup script (untimed), timed script), all run with $T a fresh dir in /tmp."""
    return [
        (f"node start x{a.node_starts}", "true",
         f"i=0; while [ $i -lt {a.node_starts} ]; do {NODE} -e 0; i=$((i+1)); done"),
        (f"{a.files} small files write+read+rm in /tmp", "true",
         f"python3 -c '{SMALL_FILES}' $T/small {a.files}"),
        (f"copy a {a.tree}-file tree in /tmp", f"python3 -c '{MAKE_TREE}' $T/tree {a.tree}",
         "cp -r $T/tree $T/copy"),
        ("CPU loop in Node", "true",
         f"{NODE} -e 'let x = 0; for (let i = 0; i < {a.loop}; i++) x = (x + i * i) % 1000003; "
         "if (x < 0) console.log(x)'"),
    ]


def image_tasks(a):
    """The rows repeated on a built image (--image): its own binaries on both sides."""
    return [
        (f"{a.image}: claude --version x{a.claude_runs}", "true",
         f"i=0; while [ $i -lt {a.claude_runs} ]; do claude --version >/dev/null; i=$((i+1)); done"),
        (f"{a.image}: node start x{a.node_starts}", "true",
         f"i=0; while [ $i -lt {a.node_starts} ]; do node -e 0; i=$((i+1)); done"),
    ]


# The host side of an image's rows: the same script with the image as its root (chroot), in a
# mount namespace of its own with /proc, /dev and a fresh /tmp, HOME in /tmp as in the guest.
CHROOT = ('r=$1; shift; mount -t proc proc "$r/proc" && mount -t tmpfs tmpfs "$r/tmp" && '
          'mount --rbind /dev "$r/dev" && exec chroot "$r" /usr/bin/env -i HOME=/tmp '
          'PATH=/usr/local/bin:/usr/bin:/bin /bin/sh -c "$1"')


def script(setup, body):
    """Run setup, then print the seconds body took (uptime clock)."""
    return ("set -e; T=$(mktemp -d /tmp/amvm-bench.XXXXXX); " + setup + "; "
            "a=$(cut -d' ' -f1 /proc/uptime); " + body + "; b=$(cut -d' ' -f1 /proc/uptime); "
            "rm -rf $T; echo \"$a $b\"")


def seconds(out):
    a, b = out.split()[-2:]
    return float(b) - float(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--node-starts", type=int, default=20)
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--tree", type=int, default=5000)
    ap.add_argument("--loop", type=int, default=20_000_000)
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--image", help="instead: the image's rows (claude --version, Node start) "
                    "on this built image (amvm image list), the host side chrooted into it")
    ap.add_argument("--claude-runs", type=int, default=5)
    a = ap.parse_args()
    system = []
    if a.image:
        p = subprocess.run([a.amvm, "image", "path", a.image], capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr.strip(), file=sys.stderr)
            return 1
        rootfs = p.stdout.strip()
        if "amvm.job=" in open("/proc/cmdline").read():
            # In the emulated KVM host the image is on the real host's disk over virtio-fs without
            # caching (every open of a file reads it again), while amvm's guest gets it cached:
            # the host side runs from a copy in this host's tmpfs /tmp instead, as a real host
            # would from its page cache.
            local = tempfile.mkdtemp(prefix="amvm-bench-image.", dir="/tmp")
            subprocess.run(["cp", "-a", rootfs + "/.", local], check=True)
            rootfs = local
        system = ["--system", a.image]
        todo = image_tasks(a)
    elif not os.access(NODE, os.X_OK):
        print(f"{NODE} missing: images/setup installs Debian's nodejs", file=sys.stderr)
        return 1
    else:
        todo = tasks(a)
    rows = {name: ([], []) for name, _, _ in todo}
    for r in range(a.runs):
        for name, setup, body in todo:
            sides = ["host", "guest"] if r % 2 == 0 else ["guest", "host"]
            for side in sides:
                s = script(setup, body)
                if side == "host" and a.image:
                    p = subprocess.run(["unshare", "-m", "sh", "-c", CHROOT, "chroot", rootfs, s],
                                       capture_output=True, text=True)
                elif side == "host":
                    p = subprocess.run(["sh", "-c", s], capture_output=True, text=True)
                else:
                    p = subprocess.run([a.amvm, "run", "--mem", str(a.mem), "--timeout", "3600", *system,
                                        "--", "sh", "-c", s], capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{name} ({side}): exit {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
                    return 1
                rows[name][0 if side == "host" else 1].append(seconds(p.stdout))
    if a.image and rootfs.startswith("/tmp/amvm-bench-image."):
        shutil.rmtree(rootfs, ignore_errors=True)
    where = f" --system {a.image}; host: chrooted into the image" if a.image else ""
    print(f"\nworkload overhead: {a.runs} interleaved runs, medians (min-max), seconds; guest: amvm run "
          f"--mem {a.mem}{where}, the task timed inside the guest")
    print(f"{'task':40} {'host':>20} {'guest':>20} {'guest/host':>11}")
    for name, (host, guest) in rows.items():
        h, g = statistics.median(host), statistics.median(guest)
        print(f"{name:40} {h:8.3f} ({min(host):.2f}-{max(host):.2f}) {g:8.3f} ({min(guest):.2f}-{max(guest):.2f})"
              f" {g / h:11.2f}")
        print(f"SUMMARY|workload: {name}|{g:.3f} s|{h:.3f} s (host)|{g / h:.2f}|<= 1.3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
