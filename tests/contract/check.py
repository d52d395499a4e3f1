#!/usr/bin/env python3
"""The sandbox contract: what a workload in amvm may and may not do, one assertion per line.

Prints `ok NAME` or `FAIL NAME: why` for each assertion, then exits 0 when all hold, 1 otherwise.
Run inside a VM (`amvm run --workspace DIR --egress SOCK -- python3 check.py`) every line must be
`ok`; run unconfined on a host, as a control, the network and file assertions must fail.

It sends no traffic: the route check is a UDP connect(2) (a route lookup, no packet), the name
check only queries when no name server is configured (glibc then asks 127.0.0.1), and the egress
checks talk only to the sockets amvm names in the environment.

Environment: AMVM_CONTRACT_MARKER, the path of a marker file planted in the host's home (its
name must appear nowhere in the guest); AMVM_EGRESS_ADDR / AMVM_EGRESS_SOCK (set by amvm), whose
server must answer `DOWN 5` with 5 bytes (tests/src/lib.rs's EgressServer does).

A check that gets no answer in CHECK_SECONDS fails as `FAIL NAME: no answer in N s` instead of
holding up the rest; stderr says when Python started and each check's start and time, so a run
that stops early shows where.
"""
import time

T0 = time.monotonic()
print("contract: python started", file=__import__("sys").stderr, flush=True)

import ctypes  # noqa: E402 (imported after the first line, to time the imports)
import errno  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

RESULTS = []
CHECK_SECONDS = 30


class NoAnswer(Exception):
    pass


def _no_answer(signum, frame):
    raise NoAnswer()


signal.signal(signal.SIGALRM, _no_answer)
print(f"contract: imports took {time.monotonic() - T0:.1f} s", file=sys.stderr, flush=True)


def check(name):
    def wrap(fn):
        start = time.monotonic()
        print(f"contract: {name}...", file=sys.stderr, flush=True)
        signal.alarm(CHECK_SECONDS)
        try:
            why = fn()
        except NoAnswer:
            why = f"no answer in {CHECK_SECONDS} s"
        except Exception as e:  # an assertion that cannot even run has failed
            why = f"{type(e).__name__}: {e}"
        finally:
            signal.alarm(0)
        print(f"contract: {name} took {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        RESULTS.append((name, why))
        print(f"ok {name}" if why is None else f"FAIL {name}: {why}", flush=True)
        return fn
    return wrap


@check("only_lo")
def _():
    links = sorted(os.listdir("/sys/class/net"))
    return None if links == ["lo"] else f"interfaces {links}"


@check("no_route_out")
def _():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("198.51.100.1", 9))  # TEST-NET-2; connect(2) on UDP sends nothing
    except OSError as e:
        return None if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) else f"connect: {e}"
    finally:
        s.close()
    return "a UDP socket could connect to 198.51.100.1: there is a route out"


@check("no_name_resolution")
def _():
    try:
        servers = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")]
    except FileNotFoundError:
        servers = []
    if servers:
        return f"name servers configured: {servers}"
    try:
        socket.getaddrinfo("example.com", 443)
    except socket.gaierror:
        return None
    return "example.com resolved"


@check("vsock_refused")
def _():
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except PermissionError:
        return None
    except OSError as e:
        return f"refused, but not by the sandbox: {e}"
    return "an AF_VSOCK socket was created"


@check("no_io_uring")
def _():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(ctypes.c_long(425), ctypes.c_long(1), ctypes.c_long(0))  # io_uring_setup(1, NULL)
    e = ctypes.get_errno()
    return None if r == -1 and e in (errno.EPERM, errno.ENOSYS) else f"io_uring_setup: r={r} errno={e}"


def read_only_by_mount_flag(path):
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.statvfs(path).f_flag & os.ST_RDONLY:
        return f"{path} is not on a read-only mount"
    d = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        open(os.path.join(d, ".amvm-contract-write"), "x").close()
    except OSError as e:
        return None if e.errno == errno.EROFS else f"writing under {d}: {e} (not EROFS)"
    os.unlink(os.path.join(d, ".amvm-contract-write"))
    return f"wrote a file under {d}"


@check("workspace_read_only")
def _():
    return read_only_by_mount_flag("/workspace")


@check("usr_read_only")
def _():
    return read_only_by_mount_flag("/usr")


@check("tools_read_only")
def _():
    for tool in ("sh", "python3", sys.executable):
        p = shutil.which(tool) or tool
        why = read_only_by_mount_flag(os.path.realpath(p))
        if why:
            return why
    return None


@check("no_rw_mount_under_usr")
def _():
    rw = []
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        point, opts = f[4], f[5].split(",")
        if (point == "/usr" or point.startswith("/usr/")) and "ro" not in opts:
            rw.append(point)
    mounted = any(l.split()[4] == "/usr" for l in open("/proc/self/mountinfo"))
    if rw:
        return f"read-write mounts: {rw}"
    return None if mounted else "/usr is not a mount of its own"


@check("host_home_marker_invisible")
def _():
    marker = os.environ.get("AMVM_CONTRACT_MARKER")
    if not marker:
        return "AMVM_CONTRACT_MARKER is not set"
    if os.path.exists(marker):
        return f"{marker} is visible"
    name = os.path.basename(marker)
    skip = {"/proc", "/sys", "/dev", "/usr"}  # /usr is the system root, checked read-only above
    for top in os.listdir("/"):
        top = "/" + top
        if top in skip or os.path.islink(top) or not os.path.isdir(top):
            continue
        for dirpath, _, files in os.walk(top):
            if name in files:
                return f"found {os.path.join(dirpath, name)}"
    return None


def writable(d):
    p = os.path.join(d, ".amvm-contract-probe")
    with open(p, "w") as f:
        f.write("x")
    ok = open(p).read() == "x"
    os.unlink(p)
    return None if ok else f"{d}: read back differs"


@check("tmp_writable")
def _():
    return writable("/tmp")


@check("home_writable")
def _():
    return writable(os.path.expanduser("~"))


@check("not_root")
def _():
    return None if os.geteuid() != 0 else "running as root"


def status_field(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None


@check("no_capabilities")
def _():
    eff = status_field("CapEff")
    return None if eff and int(eff, 16) == 0 else f"CapEff {eff}"


@check("no_new_privs")
def _():
    v = status_field("NoNewPrivs")
    return None if v == "1" else f"NoNewPrivs {v}"


def egress(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.connect(addr)
        s.sendall(b"DOWN 5\n")
        s.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            b = s.recv(64)
            if not b:
                break
            got += b
    finally:
        s.close()
    return None if len(got) == 5 else f"got {len(got)} bytes, not 5"


@check("egress_at_addr")
def _():
    a = os.environ.get("AMVM_EGRESS_ADDR")
    if not a:
        return "AMVM_EGRESS_ADDR is not set"
    host, port = a.rsplit(":", 1)
    if host != "127.0.0.1":
        return f"AMVM_EGRESS_ADDR {a} is not on loopback"
    return egress(socket.AF_INET, (host, int(port)))


@check("egress_at_sock")
def _():
    p = os.environ.get("AMVM_EGRESS_SOCK")
    return egress(socket.AF_UNIX, p) if p else "AMVM_EGRESS_SOCK is not set"


failed = [n for n, why in RESULTS if why is not None]
print(f"contract: {len(RESULTS) - len(failed)} held, {len(failed)} broken", flush=True)
sys.exit(1 if failed else 0)
