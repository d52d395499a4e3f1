#!/usr/bin/env python3
"""Long-lived sandbox benchmark (see tests/bench/sessions). Prints one table.

Rows, each a median over RUNS (a fresh sandbox per run):
* `amvm exec ID -- true`, wall clock on the host, EXECS in a row: the API round trip, the exec
  stream through the VMM's vsock, the spawn in the guest, the exit status back;
* `amvm run -- true`, wall clock: what the same command costs without a sandbox kept up (a VM
  booted and torn down per command);
* `true` spawned EXECS times inside the guest by its shell (its own clock): the floor;
* an idle sandbox's host memory: the PSS of its supervisor, its VMM and its virtiofsd
  (/proc/PID/smaps_rollup), after one exec, against the guest RAM it was given;
* pause + resume, EXECS round trips on the API socket (`POST /v1/pause`, `POST /v1/resume`: the
  supervisor asks its VMM, every vCPU kicked out of KVM_RUN and parked, then let go), and the
  same through the CLI (`amvm pause`, `amvm resume`: two processes);
* the VMM's CPU time over 2 s of an idle guest, running and paused;
* `amvm snapshot ID DIR` of the idle sandbox (wall clock, the CLI's), and what it wrote: the
  state file and the memory file's allocated size (it is sparse: guest RAM never touched is a
  hole), against the guest RAM;
* cold start vs restore, to the first exec's exit: `amvm create` + `amvm exec ID -- true` against
  `amvm create --from SNAPSHOT` + `amvm exec ID -- true` (the snapshot of the idle sandbox);
* `amvm fork -n 5` of the idle sandbox (once, the first run): its wall clock, and the five forks'
  host PSS together against one sandbox's;
* with --firecracker, each run also boots Firecracker (tests/bench/firecracker) on the same kernel
  with a static init that answers on vsock port 52 from a forked child (tests/bench/vsock-init.c),
  to that first answer; pauses it, writes a Full snapshot, resumes it (timed together); kills it;
  and starts a new Firecracker that loads the snapshot (its memory file mapped) to the first
  answer: Firecracker's restore against its own cold start, and ours against Firecracker's.
"""
import argparse, json, os, shutil, socket, statistics, subprocess, sys, tempfile, time

from boot import firecracker_config  # tests/bench/boot.py: the boot bench's Firecracker config


def http(sock_path, method, path, body=None):
    """One HTTP/1.1 request on a unix socket (amvm's API, Firecracker's); the answer's body. The
    answer ends where its Content-Length says, at its head for a 204, else where the server
    closes (Firecracker keeps a connection open)."""
    data = json.dumps(body).encode() if body is not None else b""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    answer, want = b"", None
    while want is None or len(answer) < want:
        b = s.recv(65536)
        if not b:
            break
        answer += b
        head, sep, _ = answer.partition(b"\r\n\r\n")
        if sep and want is None:
            lines = head.split(b"\r\n")
            length = [l.split(b":", 1)[1] for l in lines[1:] if l.lower().startswith(b"content-length:")]
            if length:
                want = len(head) + 4 + int(length[0])
            elif lines[0].split(b" ")[1:2] == [b"204"]:
                want = len(head) + 4
    s.close()
    status = answer.split(b" ", 2)[1:2]
    if status not in ([b"200"], [b"204"]):
        raise RuntimeError(f"{method} {path}: {answer[:300]!r}")
    return answer.partition(b"\r\n\r\n")[2]


def post(sock_path, path):
    http(sock_path, "POST", path)


def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pss_kib(pid):
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def shmem_mib():
    """The host's shared memory (memfds, tmpfs) in use, MiB: /proc/meminfo's Shmem."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_api(path, proc, what, timeout=60):
    """Until Firecracker's API socket takes a connection (it exists a moment before it listens)."""
    until = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: firecracker exited with {proc.returncode}")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                return
        except OSError as e:
            if time.monotonic() > until:
                raise RuntimeError(f"{what}: {path}: {e} after {timeout} s") from None
        time.sleep(0.002)


def first_answer(uds, proc, what, timeout=120):
    """Connect through Firecracker's vsock socket (`CONNECT 52`) until the guest's init answers
    "ok" (tests/bench/vsock-init.c): the peer's first exec output."""
    until = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: firecracker exited with {proc.returncode}")
        if time.monotonic() > until:
            raise RuntimeError(f"{what}: no answer on vsock port 52 after {timeout} s")
        buf = b""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(uds)
                s.sendall(b"CONNECT 52\n")
                while b"\nok\n" not in buf:
                    b = s.recv(4096)
                    if not b:
                        break
                    buf += b
        except OSError:
            pass
        if buf.startswith(b"OK ") and buf.endswith(b"\nok\n"):
            return
        time.sleep(0.005)


def firecracker_round(fc, kernel, initrd, mem, tmp, n):
    """Firecracker on the same guest kernel, its init answering on vsock: boot to the first
    answer; pause + Full snapshot + resume; the original killed (its vsock socket is the path the
    snapshot names); then a new Firecracker loading the snapshot (its memory file mapped, as ours)
    to the first answer. Returns (cold s, snapshot s, memory file MiB on disk, restore s)."""
    d = os.path.join(tmp, f"fc{n}")
    os.makedirs(d)
    api, uds, cfg = (os.path.join(d, f) for f in ("api.sock", "v.sock", "config.json"))
    firecracker_config(cfg, kernel, initrd, mem, vsock_uds=uds)
    log = open(os.path.join(d, "log"), "w")
    procs = []
    try:
        t0 = time.monotonic()
        p = subprocess.Popen([fc, "--api-sock", api, "--config-file", cfg, "--level", "Error"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        procs.append(p)
        first_answer(uds, p, "firecracker boot")
        cold = time.monotonic() - t0
        time.sleep(1)
        wait_api(api, p, "firecracker snapshot")
        state, memory = os.path.join(d, "state"), os.path.join(d, "memory")
        t0 = time.monotonic()
        http(api, "PATCH", "/vm", {"state": "Paused"})
        http(api, "PUT", "/snapshot/create",
             {"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": memory})
        http(api, "PATCH", "/vm", {"state": "Resumed"})
        snap = time.monotonic() - t0
        size = os.stat(memory).st_blocks * 512 / (1 << 20)
        p.kill()
        p.wait()
        for f in (api, uds):
            os.unlink(f)
        t0 = time.monotonic()
        q = subprocess.Popen([fc, "--api-sock", api, "--level", "Error"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        procs.append(q)
        wait_api(api, q, "firecracker restore")
        http(api, "PUT", "/snapshot/load",
             {"snapshot_path": state, "mem_backend": {"backend_type": "File", "backend_path": memory},
              "resume_vm": True})
        first_answer(uds, q, "firecracker restore")
        restored = time.monotonic() - t0
        return cold, snap, size, restored
    except Exception as e:
        log.flush()
        raise RuntimeError(f"{e}; its log: {open(log.name).read()[-2000:]}") from None
    finally:
        for p in procs:
            p.kill()
            p.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--execs", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", type=int, default=256)
    ap.add_argument("--firecracker", help="a Firecracker binary: its own snapshot restore beside ours")
    ap.add_argument("--kernel", help="with --firecracker: the guest kernel it boots (ours)")
    ap.add_argument("--initrd", help="with --firecracker: its guest's initramfs (vsock-init)")
    a = ap.parse_args()
    xdg = tempfile.mkdtemp(prefix="amvm-bench-sessions-")
    env = dict(os.environ, XDG_RUNTIME_DIR=xdg)
    run = lambda *args, **kw: subprocess.run([a.amvm, *args], env=env, capture_output=True, text=True, **kw)
    execs, runs, inside, mem = [], [], [], []
    api_pr, cli_pr, cpu_run, cpu_paused = [], [], [], []
    snap_s, snap_state, snap_mem = [], [], []
    cold, restored, fork_s, fork_pss, fork_shmem = [], [], [], [], []
    fc_cold, fc_snap, fc_size, fc_restored = [], [], [], []
    try:
        for n in range(a.runs):
            if a.firecracker:
                for into, x in zip((fc_cold, fc_snap, fc_size, fc_restored),
                                   firecracker_round(a.firecracker, a.kernel, a.initrd, a.mem, xdg, n)):
                    into.append(x)
            t0 = time.monotonic()
            p = run("create", "--mem", str(a.mem), "--timeout", "3600")
            if p.returncode != 0:
                print(f"create: {p.stderr}", file=sys.stderr)
                return 1
            sid = p.stdout.strip()
            run("exec", sid, "--", "true", check=True)
            cold.append(time.monotonic() - t0)
            time.sleep(1)
            info = json.loads(run("inspect", sid, check=True).stdout)
            mem.append(sum(pss_kib(p) for p in descendants(info["pid"])) / 1024)
            t0 = time.monotonic()
            for _ in range(a.execs):
                run("exec", sid, "--", "true", check=True)
            execs.append((time.monotonic() - t0) / a.execs)
            loop = (f"a=$(cut -d' ' -f1 /proc/uptime); i=0; while [ $i -lt {a.execs} ]; do /bin/true; i=$((i+1)); done;"
                    " b=$(cut -d' ' -f1 /proc/uptime); echo $a $b")
            s, e = map(float, run("exec", sid, "--", "sh", "-c", loop, check=True).stdout.split())
            inside.append((e - s) / a.execs)
            api = os.path.join(xdg, "amvm", sid, "api.sock")
            t0 = time.monotonic()
            for _ in range(a.execs):
                post(api, "/v1/pause")
                post(api, "/v1/resume")
            api_pr.append((time.monotonic() - t0) / a.execs)
            t0 = time.monotonic()
            for _ in range(a.execs):
                run("pause", sid, check=True)
                run("resume", sid, check=True)
            cli_pr.append((time.monotonic() - t0) / a.execs)
            vmm = info["vmm_pid"]
            for paused, into in ((False, cpu_run), (True, cpu_paused)):
                if paused:
                    post(api, "/v1/pause")
                c0 = cpu_s(vmm)
                time.sleep(2)
                into.append((cpu_s(vmm) - c0) / 2)
                if paused:
                    post(api, "/v1/resume")
            snap = os.path.join(xdg, "snapshot")
            t0 = time.monotonic()
            run("snapshot", sid, snap, check=True)
            snap_s.append(time.monotonic() - t0)
            snap_state.append(os.stat(os.path.join(snap, "state")).st_size / 1024)
            snap_mem.append(os.stat(os.path.join(snap, "memory")).st_blocks * 512 / (1 << 20))
            t0 = time.monotonic()
            p = run("create", "--from", snap)
            if p.returncode != 0:
                print(f"create --from: {p.stderr}", file=sys.stderr)
                return 1
            rid = p.stdout.strip()
            run("exec", rid, "--", "true", check=True)
            restored.append(time.monotonic() - t0)
            run("rm", "-f", rid, check=True)
            shutil.rmtree(snap)
            if not fork_s:
                shm0 = shmem_mib()
                t0 = time.monotonic()
                p = run("fork", "-n", "5", sid)
                if p.returncode != 0:
                    print(f"fork: {p.stderr}", file=sys.stderr)
                    return 1
                fork_s.append(time.monotonic() - t0)
                forks = p.stdout.split()
                for f in forks:
                    run("exec", f, "--", "true", check=True)
                time.sleep(1)
                total = 0.0
                for f in forks:
                    fi = json.loads(run("inspect", f, check=True).stdout)
                    total += sum(pss_kib(q) for q in descendants(fi["pid"])) / 1024
                fork_pss.append(total)
                fork_shmem.append(shmem_mib() - shm0)
                for f in forks:
                    run("rm", "-f", f, check=True)
            run("rm", "-f", sid, check=True)
            t0 = time.monotonic()
            p = subprocess.run([a.amvm, "run", "--mem", str(a.mem), "--", "true"], capture_output=True, text=True)
            if p.returncode != 0:
                print(f"run: {p.stderr}", file=sys.stderr)
                return 1
            runs.append(time.monotonic() - t0)
        ms = lambda xs: f"{statistics.median(xs) * 1e3:9.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"
        e, r, i, m = (statistics.median(x) for x in (execs, runs, inside, mem))
        print(f"\nsandbox benchmark: {a.runs} runs of {a.execs} execs, medians (min-max)")
        print(f"{'row':44} {'value':>24}")
        print(f"{'amvm exec ID -- true, ms':44} {ms(execs):>24}")
        print(f"{'amvm run -- true (a fresh VM), ms':44} {ms(runs):>24}")
        print(f"{'true spawned inside the guest, ms':44} {ms(inside):>24}")
        print(f"{'idle sandbox host PSS, MiB':44} {m:9.1f} ({min(mem):.1f}-{max(mem):.1f})")
        print(f"{'pause + resume on the API socket, ms':44} {ms(api_pr):>24}")
        print(f"{'amvm pause + amvm resume (CLI), ms':44} {ms(cli_pr):>24}")
        pct = lambda xs: f"{statistics.median(xs) * 100:9.1f} ({min(xs) * 100:.1f}-{max(xs) * 100:.1f})"
        print(f"{'VMM CPU, idle guest running, % of a core':44} {pct(cpu_run):>24}")
        print(f"{'VMM CPU, paused, % of a core':44} {pct(cpu_paused):>24}")
        print(f"{'amvm snapshot (idle sandbox), ms':44} {ms(snap_s):>24}")
        kib = lambda xs: f"{statistics.median(xs):9.1f} ({min(xs):.1f}-{max(xs):.1f})"
        print(f"{'snapshot state file, KiB':44} {kib(snap_state):>24}")
        print(f"{'snapshot memory file on disk, MiB':44} {kib(snap_mem):>24}")
        print(f"{'create + first exec (cold), ms':44} {ms(cold):>24}")
        print(f"{'create --from snapshot + first exec, ms':44} {ms(restored):>24}")
        print(f"{'amvm fork -n 5, ms':44} {ms(fork_s):>24}")
        print(f"{'5 forks host PSS together, MiB':44} {kib(fork_pss):>24}")
        print(f"{'5 forks: host Shmem grew by, MiB':44} {kib(fork_shmem):>24}")
        if a.firecracker:
            print(f"{'firecracker: boot + first vsock answer, ms':44} {ms(fc_cold):>24}")
            print(f"{'firecracker: pause + snapshot + resume, ms':44} {ms(fc_snap):>24}")
            print(f"{'firecracker: snapshot memory on disk, MiB':44} {kib(fc_size):>24}")
            print(f"{'firecracker: load + first vsock answer, ms':44} {ms(fc_restored):>24}")
        print(f"exec vs a fresh VM: {r / e:.1f}x faster; exec vs an in-guest spawn: {e / i:.1f}x; "
              f"idle PSS is {m / a.mem * 100:.1f}% of the {a.mem} MiB guest")
        print(f"SUMMARY|sandbox: amvm exec -- true|{e * 1e3:.1f} ms|{r * 1e3:.1f} ms (amvm run -- true)|{e / r:.2f}|")
        print(f"SUMMARY|sandbox: exec vs in-guest spawn|{e * 1e3:.1f} ms|{i * 1e3:.2f} ms (in guest)|{e / i:.1f}|")
        print(f"SUMMARY|sandbox: idle host PSS|{m:.1f} MiB|{a.mem} MiB (guest RAM)|{m / a.mem:.3f}|")
        pr = statistics.median(api_pr)
        print(f"SUMMARY|sandbox: pause + resume (API)|{pr * 1e3:.1f} ms|{e * 1e3:.1f} ms (amvm exec -- true)|{pr / e:.2f}|")
        c, rs = statistics.median(cold), statistics.median(restored)
        print(f"SUMMARY|sandbox: restore to first exec ({a.mem} MiB)|{rs * 1e3:.1f} ms|{c * 1e3:.1f} ms (cold create to first exec)|{rs / c:.2f}|")
        if a.firecracker:
            fc, fr = statistics.median(fc_cold), statistics.median(fc_restored)
            print(f"SUMMARY|sandbox: firecracker restore to first answer ({a.mem} MiB)|{fr * 1e3:.1f} ms|{fc * 1e3:.1f} ms (its boot to first answer)|{fr / fc:.2f}|")
            print(f"SUMMARY|sandbox: amvm restore vs firecracker's ({a.mem} MiB)|{rs * 1e3:.1f} ms|{fr * 1e3:.1f} ms (firecracker load to first answer)|{rs / fr:.2f}|")
        # PSS counts the pages a process maps, shared ones divided among their mappers (a
        # fork's RAM is the fork snapshot's file mapped copy-on-write); Shmem adds what sits in
        # tmpfs files and memfds mapped by no one (that file's pages no fork touched, if the
        # sandboxes' directory is a tmpfs; each relay's shadow): count both (an upper bound).
        fp = statistics.median(fork_pss) + statistics.median(fork_shmem)
        print(f"SUMMARY|sandbox: 5 forks' PSS + new Shmem ({a.mem} MiB)|{fp:.1f} MiB|{m:.1f} MiB (one sandbox's PSS)|{fp / m:.2f}|")
        sm = statistics.median(snap_mem)
        print(f"SUMMARY|sandbox: snapshot memory on disk|{sm:.1f} MiB|{a.mem} MiB (guest RAM)|{sm / a.mem:.3f}|")
        return 0
    finally:
        for d in os.listdir(os.path.join(xdg, "amvm")) if os.path.isdir(os.path.join(xdg, "amvm")) else []:
            if len(d) == 12:
                run("rm", "-f", d)
        shutil.rmtree(xdg, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
