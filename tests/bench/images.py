#!/usr/bin/env python3
"""Image benchmark (see tests/bench/images).

`pull` (on the host): a three-layer image (a busybox base, Python's standard library, Perl's) built
with podman, pushed to a docker-registry on loopback, then RUNS times each, from a fresh store or
directory: `amvm image pull` (fetch, digest checks, unpack by chain), `skopeo copy docker://... dir:`
(fetch and digest checks, no unpack), `podman pull` (fetch, checks, unpack into vfs storage). It
leaves the image in WORK/store for `start`.

`start` (in the KVM host): `amvm run --image IMAGE -- true` versus `amvm run --rootfs ROOT -- true`,
ROOT being that image's root in the store: what resolving an image costs a start.
"""
import argparse, os, shutil, socket, statistics, subprocess, sys, time

IMAGE = "localhost/amvm-bench-image:1"


def med(xs):
    return statistics.median(xs)


def fmt(xs):
    return f"{med(xs):8.2f} ({min(xs):.2f}-{max(xs):.2f})"


def podman_cmd(work):
    return ["/usr/bin/podman", "--root", f"{work}/podman", "--runroot", f"{work}/podman-run",
            "--tmpdir", f"{work}/libpod", "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs",
            "--events-backend", "file", "--network-config-dir", f"{work}/networks"]


def env_for(work):
    return dict(os.environ, TMPDIR=f"{work}/tmp", CONTAINERS_CONF=f"{work}/containers.conf")


def build(work, podman, env):
    ctx = f"{work}/ctx"
    os.makedirs(f"{ctx}/root/bin")
    os.makedirs(f"{ctx}/root/etc")
    shutil.copy("/bin/busybox", f"{ctx}/root/bin/busybox")
    for a in ("sh", "true", "ls", "cat"):
        os.symlink("busybox", f"{ctx}/root/bin/{a}")
    with open(f"{ctx}/root/etc/passwd", "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")
    shutil.copytree("/usr/lib/python3.11", f"{ctx}/python3.11", symlinks=True)
    shutil.copytree("/usr/share/perl", f"{ctx}/perl", symlinks=True)
    with open(f"{ctx}/Containerfile", "w") as f:
        f.write("FROM scratch\nCOPY root/ /\nCOPY python3.11/ /usr/lib/python3.11/\nCOPY perl/ /usr/share/perl/\n")
    subprocess.run(podman + ["build", "-q", "--isolation", "chroot", "-t", IMAGE, ctx], env=env, check=True,
                   capture_output=True)


def pull(a):
    work = a.work
    for d in ("tmp", "libpod", "networks", "registry"):
        os.makedirs(f"{work}/{d}", exist_ok=True)
    with open(f"{work}/containers.conf", "w") as f:
        f.write(f'[engine]\nlock_type = "file"\nimage_copy_tmp_dir = "{work}/tmp"\n')
    env = env_for(work)
    podman = podman_cmd(work)
    build(work, podman, env)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with open(f"{work}/registry/config.yml", "w") as f:
        f.write(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {work}/registry/data\n"
                f"http:\n  addr: 127.0.0.1:{port}\n")
    reg = subprocess.Popen(["/usr/bin/docker-registry", "serve", f"{work}/registry/config.yml"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        remote = f"127.0.0.1:{port}/amvm/bench:1"
        subprocess.run(podman + ["push", "-q", "--tls-verify=false", IMAGE, f"docker://{remote}"], env=env,
                       check=True, capture_output=True)
        rows = {"amvm image pull": [], "skopeo copy (no unpack)": [], "podman pull (vfs)": []}
        for i in range(a.runs):
            order = list(rows)
            order = order[i % 3:] + order[:i % 3]
            for row in order:
                scratch = f"{work}/run-{i}-{row.split()[0]}"
                if row.startswith("amvm"):
                    cmd = [a.amvm, "image", "pull", remote]
                    e = dict(os.environ, AMVM_CACHE=scratch)
                elif row.startswith("skopeo"):
                    cmd = ["skopeo", "copy", "-q", "--src-tls-verify=false", f"docker://{remote}", f"dir:{scratch}"]
                    e = env
                else:
                    cmd = ["/usr/bin/podman", "--root", f"{scratch}/storage", "--runroot", f"{scratch}/run",
                           "--tmpdir", f"{work}/libpod", "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs",
                           "--events-backend", "file", "--network-config-dir", f"{work}/networks",
                           "pull", "-q", "--tls-verify=false", remote]
                    e = env
                t0 = time.monotonic()
                p = subprocess.run(cmd, env=e, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{row}: exit {p.returncode}: {p.stderr}", file=sys.stderr)
                    return 1
                rows[row].append(time.monotonic() - t0)
                if i + 1 < a.runs or not row.startswith("amvm"):
                    subprocess.run(["rm", "-rf", scratch])
                else:
                    os.rename(scratch, f"{work}/store")
        size = subprocess.run(["du", "-sh", f"{work}/registry/data"], capture_output=True, text=True).stdout.split()[0]
        print(f"\nImage pull from docker-registry on loopback ({size} in the registry, 3 layers), "
              f"{a.runs} runs each from empty, medians (min-max), s")
        print(f"{'row':28} {'seconds':>24} {'vs amvm':>8}")
        ours = med(rows["amvm image pull"])
        for row, xs in rows.items():
            print(f"{row:28} {fmt(xs):>24} {med(xs) / ours:8.2f}")
        for row in ("skopeo copy (no unpack)", "podman pull (vfs)"):
            print(f"SUMMARY|images: pull vs {row}|{ours:.2f} s|{med(rows[row]):.2f} s|{ours / med(rows[row]):.2f}|")
        with open(f"{work}/remote", "w") as f:
            f.write(remote)
    finally:
        reg.kill()
    return 0


def start(a):
    work = a.work
    remote = open(f"{work}/remote").read()
    # The store is the pull's; the kernel and virtiofsd stay the user's own (or root's for all).
    cache = os.environ.get("AMVM_CACHE") or os.path.expanduser("~/.cache/amvm")
    e = dict(os.environ, AMVM_CACHE=f"{work}/store")
    for var, path in (("AMVM_KERNEL", f"{cache}/kernel/vmlinux"), ("AMVM_VIRTIOFSD", f"{cache}/virtiofsd/bin/virtiofsd")):
        if var not in e and os.path.exists(path):
            e[var] = path
    root = subprocess.run([a.amvm, "image", "path", remote], env=e, check=True, capture_output=True,
                          text=True).stdout.strip()
    sides = {"run --image IMAGE -- true": ["--image", remote, "--pull", "never"],
             "run --rootfs ROOT -- true": ["--rootfs", root]}
    res = {k: [] for k in sides}
    for i in range(a.runs + 1):
        for k in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            t0 = time.monotonic()
            p = subprocess.run([a.amvm, "run"] + sides[k] + ["--", "true"], env=e, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{k}: {p.stderr}", file=sys.stderr)
                return 1
            if i > 0:  # the first round warms the caches
                res[k].append(time.monotonic() - t0)
    print(f"\nStart of the same root, {a.runs} runs each, medians (min-max), s")
    print(f"{'row':28} {'seconds':>24} {'ratio':>8}")
    base = med(res["run --rootfs ROOT -- true"])
    for k, xs in res.items():
        print(f"{k:28} {fmt(xs):>24} {med(xs) / base:8.2f}")
    print(f"SUMMARY|images: run --image vs --rootfs|{med(res['run --image IMAGE -- true']):.2f} s|{base:.2f} s|"
          f"{med(res['run --image IMAGE -- true']) / base:.2f}|")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["pull", "start"])
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    return pull(a) if a.mode == "pull" else start(a)


if __name__ == "__main__":
    sys.exit(main())
