#!/usr/bin/env python3
"""Overlay-workspace benchmark (see tests/bench/overlay). Prints one table.

The same shell commands run on the host, in a directory of their own, and in the guest, in
/workspace shared with --workspace DIR:overlay (writes go to the overlay's upper layer on the host,
through virtio-fs), over the same tree: the seed platform's small-files task (N files written, read
back and removed) and `git status` on a committed N-file repository. Guest times come from
/proc/uptime inside the guest (boot excluded); the host's from the same clock around the same
commands. Everything lives in /dev/shm: in the emulated KVM host /tmp is itself an overlayfs.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile

SMALL = ("mkdir sf && i=0 && while [ $i -lt {n} ]; do echo \"file $i\" > sf/f$i; i=$((i+1)); done"
         " && cat sf/* > /dev/null && rm -r sf")
GIT = "git -c safe.directory='*' status --porcelain > /dev/null"


def timed(cmd):
    return f"a=$(cut -d' ' -f1 /proc/uptime); {cmd}; b=$(cut -d' ' -f1 /proc/uptime); echo \"$a $b\""


def seconds(out):
    a, b = out.split()[-2:]
    return float(b) - float(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--files", type=int, default=10000)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="amvm-bench-overlay-", dir="/dev/shm")
    try:
        repo = os.path.join(base, "repo")
        os.mkdir(repo)
        for i in range(a.files):
            d = os.path.join(repo, f"d{i // 100:03}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i:05}.txt"), "w") as f:
                f.write(f"file {i}\n")
        git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
        subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
        subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
        subprocess.run(git + ["commit", "-qm", "tree"], cwd=repo, check=True)
        subprocess.run(["chown", "-R", "1000:1000", repo], check=True)  # the workload's user
        host_dir = os.path.join(base, "host")
        shutil.copytree(repo, host_dir, symlinks=True)
        small = SMALL.format(n=a.files)
        rows = {f"{a.files} files write+read+rm": (small, [], []),
                f"git status, {a.files}-file repo": (GIT, [], [])}
        for _ in range(a.runs):
            for name, (cmd, host, guest) in rows.items():
                p = subprocess.run(["sh", "-c", timed(cmd)], cwd=host_dir, capture_output=True,
                                   text=True, check=True)
                host.append(seconds(p.stdout))
                p = subprocess.run([a.amvm, "run", "--workspace", f"{repo}:overlay", "--timeout", "3600",
                                    "--", "sh", "-c", timed(cmd)], capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{name}: amvm exited {p.returncode}: {p.stderr}", file=sys.stderr)
                    return 1
                guest.append(seconds(p.stdout))
        print(f"\noverlay workspace benchmark: {a.runs} runs, medians (min-max), seconds")
        print(f"{'row':32} {'host':>20} {'guest (overlay)':>22} {'guest/host':>11}")
        for name, (_, host, guest) in rows.items():
            h, g = statistics.median(host), statistics.median(guest)
            print(f"{name:32} {h:8.3f} ({min(host):.3f}-{max(host):.3f}) {g:9.3f} ({min(guest):.3f}-{max(guest):.3f}) {g / h:11.2f}")
            print(f"SUMMARY|overlay: {name}|{g:.3f} s|{h:.3f} s (host)|{g / h:.2f}|")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
