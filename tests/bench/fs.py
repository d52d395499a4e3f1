#!/usr/bin/env python3
"""virtio-fs benchmark (see tests/bench/fs). Prints one table.

The same shell commands run on the host and in the guest against the same directory (shared with
--workspace): `cat big > /dev/null` and `find small -type f -exec cat {} + > /dev/null` (a stat
and a read of every file). Guest times come from /proc/uptime inside the guest, so they exclude
boot; the host's from the same clock around the same commands.

Then the relay rows: a restored sandbox's virtio-fs requests go through the VMM's relay (two
copies and two thread wake-ups each; docs/DESIGN.md, "Snapshots"), a booted one's go to virtiofsd
directly. One sandbox (512 MiB, the same workspace) is booted, snapshotted and restored; per run
each of the two, its guest's caches and the host's dropped, walks RELAY_TREE twice over the system
root (cold, warm) and reads `big` cold; the restored figure against the booted one's.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile

READ_BIG = "cat big > /dev/null"
READ_SMALL = "find small -type f -exec cat {} + > /dev/null"


def timed(cmd):
    """A script that prints the seconds `cmd` took (uptime clock)."""
    return f"a=$(cut -d' ' -f1 /proc/uptime); {cmd}; b=$(cut -d' ' -f1 /proc/uptime); echo \"$a $b\""


def seconds(out):
    a, b = out.split()
    return float(b) - float(a)


def drop_host_cache(path):
    """Evict the files from the host's page cache (root only) so both sides start cold-ish."""
    try:
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False,
                       stderr=subprocess.DEVNULL)
    except OSError:
        pass


def shape_of(src, dst):
    """The tree at `src` again at `dst`: its directories, symbolic links and empty files (the
    metadata walk reads names and types, not contents)."""
    for top, dirs, files in os.walk(src):
        here = os.path.join(dst, os.path.relpath(top, src))
        os.makedirs(here, exist_ok=True)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            path = os.path.join(top, name)
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(here, name))
            else:
                open(os.path.join(here, name), "w").close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--big", type=int, default=1 << 30)
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--tree", default="/usr", help="the tree the metadata rows walk")
    ap.add_argument("--relay-tree", default="/usr/share", help="the tree the relay rows walk")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="amvm-bench-fs-")
    os.chmod(d, 0o755)  # the guest's workload is not root: it must be able to enter it
    try:
        with open(os.path.join(d, "big"), "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(a.big // len(chunk)):
                f.write(chunk)
            f.write(chunk[: a.big % len(chunk)])
        os.mkdir(os.path.join(d, "small"))
        for i in range(a.small):
            with open(os.path.join(d, "small", f"f{i:05}"), "w") as f:
                f.write(f"file {i}\n" * 10)
        big_row = f"{a.big / (1 << 20):.0f} MiB read"
        rows = {big_row: ([], []), f"{a.small} files stat+read": ([], [])}
        for r in range(a.runs):
            for name, cmd in zip(rows, (READ_BIG, READ_SMALL)):
                drop_host_cache(d)
                p = subprocess.run(["sh", "-c", timed(cmd)], cwd=d, capture_output=True, text=True, check=True)
                rows[name][0].append(seconds(p.stdout))
                drop_host_cache(d)
                p = subprocess.run([a.amvm, "run", "--workspace", d, "--timeout", "3600", "--", "sh", "-c", timed(cmd)],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{name}: amvm exited {p.returncode}: {p.stderr}", file=sys.stderr)
                    return 1
                rows[name][1].append(seconds(p.stdout))
        # Metadata: a walk of a whole tree (names and types, a readdir per directory and a lookup
        # per name), cold (host cache dropped, a fresh guest) then warm (the same walk again at
        # once), over the system root's share (--cache=always) and over a workspace
        # (--cache=auto) holding a copy of the same tree.
        ws_tree = os.path.join(d, "tree")
        shape_of(a.tree, ws_tree)
        # The same shape as an EROFS image on a read-only virtio-blk disk (`-v IMAGE:/img`):
        # the guest's own page cache holds its metadata, no FUSE round trip.
        image = os.path.join(d, "tree.erofs")
        subprocess.run(["mkfs.erofs", "--quiet", image, ws_tree], check=True)
        n = subprocess.run(["sh", "-c", f"find {a.tree} | wc -l"], capture_output=True, text=True).stdout.strip()
        walks = {"system root": (a.tree, []), "workspace": ("tree", []),
                 "EROFS disk": ("/img", ["-v", f"{image}:/img"])}
        temps = ("cold", "warm")
        key = lambda where, temp: f"find {n} entries, {where}, {temp}"
        for where in walks:
            for temp in temps:
                rows[key(where, temp)] = ([], [])
        for r in range(a.runs):
            for where, (path, opts) in walks.items():
                walk = f"find {path} > /dev/null"
                twice = timed(walk) + "; " + timed(walk)
                # The host walks the path itself; for the disk's rows, the shape the image was
                # made of (the host's own local copy, as for the workspace's rows).
                host_walk = f"find {'tree' if opts else path} > /dev/null"
                drop_host_cache(d)
                p = subprocess.run(["sh", "-c", timed(host_walk) + "; " + timed(host_walk)], cwd=d,
                                   capture_output=True, text=True, check=True)
                host = [seconds(l) for l in p.stdout.splitlines()]
                drop_host_cache(d)
                p = subprocess.run([a.amvm, "run", "--workspace", d, *opts, "--timeout", "3600", "--", "sh", "-c", twice],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"find: amvm exited {p.returncode}: {p.stderr}", file=sys.stderr)
                    return 1
                guest = [seconds(l) for l in p.stdout.splitlines()]
                for temp, h, g in zip(temps, host, guest):
                    rows[key(where, temp)][0].append(h)
                    rows[key(where, temp)][1].append(g)
        relay = relay_rows(a, d)
        if relay is None:
            return 1
        print(f"\nvirtio-fs benchmark: {a.runs} runs, medians (min-max), seconds")
        print(f"{'row':44} {'host':>20} {'guest (virtio-fs)':>22} {'guest/host':>11}")
        for name, (host, guest) in rows.items():
            h, g = statistics.median(host), statistics.median(guest)
            print(f"{name:44} {h:8.3f} ({min(host):.3f}-{max(host):.3f}) {g:9.3f} ({min(guest):.3f}-{max(guest):.3f}) {g / h:11.2f}")
            print(f"SUMMARY|files: {name}|{g:.3f} s|{h:.3f} s (host)|{g / h:.2f}|")
        mib = a.big / (1 << 20)
        h, g = statistics.median(rows[big_row][0]), statistics.median(rows[big_row][1])
        print(f"sequential read throughput: host {mib / h:.1f} MiB/s, guest {mib / g:.1f} MiB/s")
        print(f"\n{'row':44} {'booted sandbox':>20} {'restored (relay)':>22} {'relay/booted':>13}")
        for name, (booted, restored) in relay.items():
            b, r = statistics.median(booted), statistics.median(restored)
            print(f"{name:44} {b:8.3f} ({min(booted):.3f}-{max(booted):.3f}) {r:9.3f} ({min(restored):.3f}-{max(restored):.3f}) {r / b:13.2f}")
            print(f"SUMMARY|files: relay, {name}|{r:.3f} s|{b:.3f} s (booted sandbox)|{r / b:.2f}|")
        return 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def relay_rows(a, d):
    """The relay rows (see the module's doc): {row: (booted seconds, restored seconds)}, or None
    after saying what failed."""
    xdg = tempfile.mkdtemp(prefix="amvm-bench-relay-")
    env = dict(os.environ, XDG_RUNTIME_DIR=xdg)
    amvm = lambda *args: subprocess.run([a.amvm, *args], env=env, capture_output=True, text=True)
    n = subprocess.run(["sh", "-c", f"find {a.relay_tree} | wc -l"], capture_output=True, text=True).stdout.strip()
    walk, cold, warm, big = f"find {n} entries, system root", "cold", "warm", f"{a.big / (1 << 20):.0f} MiB read, cold"
    rows = {f"{walk}, {cold}": ([], []), f"{walk}, {warm}": ([], []), big: ([], [])}
    try:
        for step in (["create", "--name", "booted", "--mem", "512", "--timeout", "3600", "--workspace", d],
                     ["exec", "booted", "--", "true"], ["snapshot", "booted", os.path.join(xdg, "snap")],
                     ["create", "--from", os.path.join(xdg, "snap"), "--name", "restored"]):
            p = amvm(*step)
            if p.returncode != 0:
                print(f"relay rows: amvm {' '.join(step)}: exited {p.returncode}: {p.stderr}", file=sys.stderr)
                return None
        find = f"find {a.relay_tree} > /dev/null"
        for _ in range(a.runs):
            for side, sandbox in enumerate(("booted", "restored")):
                for cmd, names in ((timed(find) + "; " + timed(find), (f"{walk}, {cold}", f"{walk}, {warm}")),
                                   (timed("cat /workspace/big > /dev/null"), (big,))):
                    drop = amvm("exec", sandbox, "--user", "0", "--", "sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches")
                    drop_host_cache(d)
                    p = amvm("exec", sandbox, "--", "sh", "-c", cmd)
                    if drop.returncode != 0 or p.returncode != 0:
                        print(f"relay rows: {sandbox}: {drop.stderr}{p.stderr}", file=sys.stderr)
                        return None
                    for name, line in zip(names, p.stdout.splitlines()):
                        rows[name][side].append(seconds(line))
        return rows
    finally:
        for sandbox in ("booted", "restored"):
            amvm("rm", "-f", sandbox)
        shutil.rmtree(xdg, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
