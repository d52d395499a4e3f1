#!/usr/bin/env python3
"""OCI runtime benchmark (see tests/bench/oci). Prints one table.

Rows, each a median over RUNS, wall clock on the host, for amvm-runc and for runc under the same
podman (its own storage on /dev/shm, vfs, no network):
* `podman run --rm IMAGE true`: create (for amvm: boot the VM), start, the process, delete;
* `podman exec CONTAINER true` into a running container.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time


def busybox_root(root):
    os.makedirs(os.path.join(root, "bin"))
    for d in ("etc", "proc", "sys", "dev", "tmp", "root"):
        os.makedirs(os.path.join(root, d))
    shutil.copy("/bin/busybox", os.path.join(root, "bin/busybox"))
    for applet in subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True, check=True).stdout.split():
        if applet != "busybox":
            os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="amvm-bench-oci-", dir="/dev/shm")
    try:
        os.makedirs(os.path.join(base, "tmp"))
        os.makedirs(os.path.join(base, "networks"))
        os.symlink(a.amvm, os.path.join(base, "amvm-runc"))
        with open(os.path.join(base, "containers.conf"), "w") as f:
            f.write('[engine]\nlock_type = "file"\n')
        env = dict(os.environ, TMPDIR=os.path.join(base, "tmp"), CONTAINERS_CONF=os.path.join(base, "containers.conf"))
        podman = ["/usr/bin/podman", "--root", f"{base}/storage", "--runroot", f"{base}/run", "--tmpdir", f"{base}/libpod",
                  "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                  # its network configuration and lock of its own (the emulated host's /etc is read-only)
                  "--network-config-dir", f"{base}/networks"]
        busybox_root(f"{base}/rootfs")
        subprocess.run(["tar", "-C", f"{base}/rootfs", "-cf", f"{base}/rootfs.tar", "."], check=True)
        image = "localhost/amvm-bench:latest"
        subprocess.run(podman + ["import", "-q", f"{base}/rootfs.tar", image], env=env, check=True, capture_output=True)
        runtimes = {"amvm-runc": os.path.join(base, "amvm-runc"), "runc": "/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else "/usr/bin/runc"}
        res = {}
        for name, path in runtimes.items():
            pm = podman + ["--runtime", path]
            runs, execs = [], []
            for _ in range(a.runs):
                t0 = time.monotonic()
                p = subprocess.run(pm + ["run", "--rm", "--network", "none", image, "true"], env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"{name}: podman run: {p.stderr}", file=sys.stderr)
                    return 1
                runs.append(time.monotonic() - t0)
            subprocess.run(pm + ["run", "-d", "--name", "b", "--network", "none", image, "sleep", "3600"], env=env, check=True, capture_output=True)
            for _ in range(a.runs):
                t0 = time.monotonic()
                subprocess.run(pm + ["exec", "b", "true"], env=env, check=True, capture_output=True)
                execs.append(time.monotonic() - t0)
            subprocess.run(pm + ["rm", "-f", "-t", "0", "b"], env=env, capture_output=True)
            res[name] = (runs, execs)
        ms = lambda xs: f"{statistics.median(xs) * 1e3:9.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"
        print(f"\nOCI runtime benchmark: podman, {a.runs} runs each, medians (min-max), ms")
        print(f"{'row':36} {'amvm-runc':>26} {'runc':>26} {'ratio':>6}")
        for i, row in enumerate(["podman run --rm IMAGE true", "podman exec CONTAINER true"]):
            ours, peer = res["amvm-runc"][i], res["runc"][i]
            r = statistics.median(ours) / statistics.median(peer)
            print(f"{row:36} {ms(ours):>26} {ms(peer):>26} {r:6.1f}")
            print(f"SUMMARY|oci: {row}|{statistics.median(ours) * 1e3:.1f} ms|{statistics.median(peer) * 1e3:.1f} ms (runc)|{r:.1f}|")
        return 0
    finally:
        subprocess.run(["rm", "-rf", base])


if __name__ == "__main__":
    sys.exit(main())
