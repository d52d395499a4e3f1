#!/usr/bin/env python3
"""Egress throughput benchmark (see tests/bench/egress). Prints one table.

Rows: one stream of N bytes guest->host and host->guest through amvm's egress (a client in the
guest on its loopback, the relay, vsock, the VMM, the host unix socket), with two guest clients:
Python moving 1 MiB per call as the baseline does, and busybox nc; the same N bytes over a unix
socket pair on the host (the baseline, Python, 1 MiB per call); and through a pipe inside the guest
(what the guest itself can move: on an emulated KVM host the nested guest is the bottleneck). Then
latency: K round trips of one byte each way (a request, its response) through the egress,
over a host unix socket pair, and over TCP on the guest's own loopback (what the guest alone
costs), the same Python on both ends, each round trip timed where the responses are sent
(between two requests' arrivals). Same environment, interleaved.
"""
import argparse, os, shlex, socket, statistics, subprocess, sys, tempfile, threading, time

CHUNK = 1 << 20

# The guest side of a stream, in Python: `up N` sends N zero bytes after "SINK", `down N` asks for N
# and counts them (printing the count); 1 MiB pieces, as the host baseline.
GUEST_CLIENT = r"""
import os, socket, sys, threading, time
way, n = sys.argv[1], int(sys.argv[2])
if way == "loop":
    # No egress: n one-byte round trips over the guest's own loopback TCP, two threads of one
    # process as the host baseline does; the gaps between requests' arrivals in microseconds.
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    e, _ = srv.accept()
    for x in (c, e):
        x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    arrivals = []
    def echo():
        for _ in range(n):
            if e.recv(1) != b"x":
                return
            arrivals.append(time.perf_counter())
            e.sendall(b"y")
    t = threading.Thread(target=echo)
    t.start()
    for i in range(n):
        c.sendall(b"x")
        if c.recv(1) != b"y":
            sys.exit("loop %d: no response" % i)
    t.join()
    print(" ".join("%.1f" % ((b - a) * 1e6) for a, b in zip(arrivals, arrivals[1:])))
    sys.exit(0)
host, port = os.environ["AMVM_EGRESS_ADDR"].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
if way == "up":
    s.sendall(b"SINK\n")
    buf = memoryview(bytes(1 << 20))
    while n:
        k = min(n, len(buf))
        s.sendall(buf[:k])
        n -= k
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
elif way == "ping":
    # Like an HTTP client (Node sets it by default): no Nagle delay on small writes.
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"ECHO %d\n" % n)
    for i in range(n):
        s.sendall(b"x")
        if s.recv(1) != b"y":
            sys.exit("ping %d: no response" % i)
    print(n)
else:
    s.sendall(b"SOURCE %d\n" % n)
    buf = bytearray(1 << 20)
    got = 0
    while True:
        k = s.recv_into(buf)
        if not k:
            break
        got += k
    print(got)
"""


def send_zeros(sock, n):
    """Send n zero bytes in 1 MiB pieces."""
    buf = bytes(CHUNK)
    left = n
    while left:
        k = min(left, CHUNK)
        sock.sendall(buf[:k])
        left -= k


def echo(c, k):
    """Answer k one-byte requests with one byte each; the gaps between requests' arrivals (each
    a whole round trip: our response out, the next request back), in seconds."""
    arrivals = []
    for _ in range(k):
        if c.recv(1) != b"x":
            break
        arrivals.append(time.perf_counter())
        c.sendall(b"y")
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def serve(path, results):
    """Unix socket server: 'SINK' -> read to EOF; 'SOURCE n' -> send n zero bytes; 'ECHO k' ->
    k one-byte round trips."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def one(c):
        f = c.makefile("rb", buffering=0)
        line = b""
        while not line.endswith(b"\n"):
            b = c.recv(1)
            if not b:
                return
            line += b
        words = line.split()
        t0 = time.perf_counter()
        if words[0] == b"SINK":
            n = 0
            while True:
                d = c.recv(CHUNK)
                if not d:
                    break
                n += len(d)
            results.append(("sink", n, time.perf_counter() - t0))
        elif words[0] == b"ECHO":
            gaps = echo(c, int(words[1]))
            results.append(("echo", len(gaps) + 1, gaps))
        else:
            n = int(words[1])
            send_zeros(c, n)
            results.append(("source", n, time.perf_counter() - t0))
        c.close()

    def loop():
        while True:
            c, _ = srv.accept()
            threading.Thread(target=one, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


def host_pair(n):
    """The baseline: n bytes through a unix socket pair, one thread each side."""
    a, b = socket.socketpair()
    got = [0]

    def reader():
        while True:
            d = b.recv(CHUNK)
            if not d:
                break
            got[0] += len(d)

    t = threading.Thread(target=reader)
    t0 = time.perf_counter()
    t.start()
    send_zeros(a, n)
    a.shutdown(socket.SHUT_WR)
    t.join()
    dt = time.perf_counter() - t0
    assert got[0] == n
    return dt


def host_pair_pings(k):
    """The baseline's latency: k one-byte round trips over a unix socket pair, one thread each side."""
    a, b = socket.socketpair()
    gaps = []
    t = threading.Thread(target=lambda: gaps.extend(echo(b, k)))
    t.start()
    for _ in range(k):
        a.sendall(b"x")
        assert a.recv(1) == b"y"
    t.join()
    return gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pings", type=int, default=1000)
    a = ap.parse_args()
    n = a.bytes
    d = tempfile.mkdtemp()
    path = os.path.join(d, "egress.sock")
    results = []
    serve(path, results)
    # Two guest clients: Python with the baseline's own 1 MiB reads and writes (the same code on
    # both sides of the ratio), and busybox nc (small buffers: what a shell user gets).
    py = f"python3 -c {shlex.quote(GUEST_CLIENT)}"
    nc = "busybox nc ${AMVM_EGRESS_ADDR%:*} ${AMVM_EGRESS_ADDR#*:}"
    streams = (
        ("guest -> host (amvm egress)", f"{py} up {n}"),
        ("host -> guest (amvm egress)", f"{py} down {n}"),
        ("guest -> host, busybox nc", f"(echo SINK; head -c {n} /dev/zero) | {nc}"),
        ("host -> guest, busybox nc", f"echo SOURCE {n} | {nc} | wc -c"),
    )
    times = {name: [] for name, _ in streams}
    times.update({"unix socket pair (host)": [], "pipe inside the guest": []})
    pings = {"amvm egress": [], "unix socket pair (host)": [], "loopback TCP inside the guest": []}
    for r in range(a.runs):
        for name, script in streams:
            results.clear()
            p = subprocess.run([a.amvm, "run", "--egress", path, "--", "sh", "-c", script], capture_output=True, text=True)
            if p.returncode != 0 or not results:
                print(f"{name}: exit {p.returncode}: {p.stderr}", file=sys.stderr)
                return 1
            kind, got, dt = results[-1]
            if got != n or (kind == "source" and p.stdout.strip() != str(n)):
                print(f"{name}: moved {got} / guest saw {p.stdout.strip()} of {n} bytes", file=sys.stderr)
                return 1
            times[name].append(dt)
        times["unix socket pair (host)"].append(host_pair(n))
        # The guest's own speed at moving bytes through a pipe: under an emulated KVM host the
        # nested guest is far slower than the host, and this row shows how much.
        p = subprocess.run([a.amvm, "run", "--", "sh", "-c", f"cut -d' ' -f1 /proc/uptime; head -c {n} /dev/zero | cat > /dev/null; cut -d' ' -f1 /proc/uptime"], capture_output=True, text=True)
        start, end = (float(x) for x in p.stdout.split())
        times["pipe inside the guest"].append(end - start)
        results.clear()
        p = subprocess.run([a.amvm, "run", "--egress", path, "--", "sh", "-c", f"{py} ping {a.pings}"], capture_output=True, text=True)
        if p.returncode != 0 or p.stdout.strip() != str(a.pings) or not results or results[-1][1] != a.pings:
            print(f"1-byte round trips: exit {p.returncode}: {p.stdout} {p.stderr} {results[-1:]}", file=sys.stderr)
            return 1
        pings["amvm egress"].extend(results[-1][2])
        pings["unix socket pair (host)"].extend(host_pair_pings(a.pings))
        # What the guest alone costs per round trip (the egress path crosses its loopback TCP
        # once each way, besides vsock and the host).
        p = subprocess.run([a.amvm, "run", "--", "sh", "-c", f"{py} loop {a.pings}"], capture_output=True, text=True)
        gaps = p.stdout.split()
        if p.returncode != 0 or len(gaps) != a.pings - 1:
            print(f"1-byte round trips in the guest: exit {p.returncode}: {len(gaps)} gaps {p.stderr}", file=sys.stderr)
            return 1
        pings["loopback TCP inside the guest"].extend(float(g) / 1e6 for g in gaps)
    mib = n / (1 << 20)
    print(f"\negress benchmark: {a.runs} runs of {mib:.0f} MiB per row (server-side time, first byte to EOF)")
    print(f"{'row':32} {'median MiB/s':>13} {'min':>8} {'max':>8}")
    base = statistics.median([mib / t for t in times["unix socket pair (host)"]])
    for name, ts in times.items():
        rates = [mib / t for t in ts]
        print(f"{name:32} {statistics.median(rates):13.1f} {min(rates):8.1f} {max(rates):8.1f}")
    guest_pipe = statistics.median([mib / t for t in times["pipe inside the guest"]])
    for i, name in enumerate(list(times)[:4]):
        rate = statistics.median([mib / t for t in times[name]])
        label = name.split(" (")[0]
        print(f"ratio {label:26} / host pair {rate / base:5.2f}   / guest pipe {rate / guest_pipe:5.2f}")
        if i < 2:
            print(f"SUMMARY|egress {label}, {mib:.0f} MiB|{rate:.1f} MiB/s|{base:.1f} MiB/s (unix pair)"
                  f"|{rate / base:.2f}|>= 0.5")
    print(f"\n1-byte request/response: {a.runs} x {a.pings} round trips per row (time between requests, at the server)")
    print(f"{'row':32} {'median us':>10} {'p10':>8} {'p90':>8} {'p99':>8}")
    med = {}
    for name, gaps in pings.items():
        us = sorted(g * 1e6 for g in gaps)
        q = lambda f: us[min(len(us) - 1, int(f * len(us)))]
        med[name] = statistics.median(us)
        print(f"{name:32} {med[name]:10.0f} {q(0.1):8.0f} {q(0.9):8.0f} {q(0.99):8.0f}")
    ours, base = med["amvm egress"], med["unix socket pair (host)"]
    print(f"ratio amvm egress / host pair {ours / base:5.2f}   / guest loopback {ours / med['loopback TCP inside the guest']:5.2f}")
    print(f"SUMMARY|egress 1-byte request/response|{ours:.0f} us|{base:.0f} us (unix pair)|{ours / base:.2f}|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
