#!/usr/bin/env python3
"""The gateway benchmark (tests/bench/gateway): what `amvm gateway` adds to a request.

Peer, measured in the same run: a client speaking TLS to the upstream itself (what a guest's
CONNECT tunnel or a host process does). Through the gateway the client speaks plain HTTP on the
unix socket and the gateway speaks TLS upstream (its kept connection). Rows: the median time of
one small request (REQUESTS in a row on one kept-alive connection, after a warm-up), and the
throughput of one BYTES download.
"""

import argparse
import http.client
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("gateway", timeout=120)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def small(conn, prefix, n):
    times = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        conn.request("POST", prefix + "/echo", body=b"ping %d" % i)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200 and body == b"ping %d" % i, (r.status, body)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def large(conn, prefix, nbytes):
    t0 = time.perf_counter()
    conn.request("GET", prefix + "/bytes/%d" % nbytes)
    r = conn.getresponse()
    got = 0
    while True:
        b = r.read(1 << 20)
        if not b:
            break
        got += len(b)
    assert r.status == 200 and got == nbytes, (r.status, got)
    return nbytes / (time.perf_counter() - t0) / (1 << 20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--bytes", type=int, default=64 << 20)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    a.amvm = os.path.abspath(a.amvm)
    d = tempfile.mkdtemp(prefix="amvm-bench-gateway-")
    subprocess.run([os.path.join(ROOT, "tests/standin/test-ca"), d], check=True)
    env = dict(os.environ, UPSTREAM_KEY="unused")
    up = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/standin/tls_upstream.py"),
                           "up.pem", "up.key", "port", "records", "go"], cwd=d, env=env)
    procs = [up]
    try:
        while not os.path.exists(os.path.join(d, "port")):
            time.sleep(0.05)
        port = int(open(os.path.join(d, "port")).read())
        sock = os.path.join(d, "gw.sock")
        gw = subprocess.Popen([a.amvm, "gateway", "--listen", sock, "--allow", f"up=localhost:{port}",
                               "--ca", "ca.pem", "--log", os.devnull], cwd=d,
                              stderr=subprocess.DEVNULL)
        procs.append(gw)
        while not os.path.exists(sock):
            time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=os.path.join(d, "ca.pem"))
        rows = {"direct_ms": [], "gw_ms": [], "direct_mbs": [], "gw_mbs": []}
        for _ in range(a.runs):
            direct = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=120)
            rows["direct_ms"].append(small(direct, "", a.requests))
            rows["direct_mbs"].append(large(direct, "", a.bytes))
            direct.close()
            through = UnixHTTP(sock)
            rows["gw_ms"].append(small(through, "/up", a.requests))
            rows["gw_mbs"].append(large(through, "/up", a.bytes))
            through.close()
        med = {k: statistics.median(v) for k, v in rows.items()}
        rng = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in rows.items()}
        print(f"\ngateway benchmark: {a.runs} runs, {a.requests} small requests and one "
              f"{a.bytes >> 20} MiB download each; medians (min-max)")
        print(f"{'row':46} {'value':>24}")
        print(f"{'one request, direct TLS client, ms':46} {med['direct_ms']:>8.2f} ({rng['direct_ms']})")
        print(f"{'one request, through amvm gateway, ms':46} {med['gw_ms']:>8.2f} ({rng['gw_ms']})")
        print(f"{'download, direct TLS client, MiB/s':46} {med['direct_mbs']:>8.1f} ({rng['direct_mbs']})")
        print(f"{'download, through amvm gateway, MiB/s':46} {med['gw_mbs']:>8.1f} ({rng['gw_mbs']})")
        print(f"SUMMARY|gateway: one small request|{med['gw_ms']:.2f} ms|"
              f"{med['direct_ms']:.2f} ms (direct TLS)|{med['gw_ms'] / med['direct_ms']:.2f}|")
        print(f"SUMMARY|gateway: download throughput|{med['gw_mbs']:.1f} MiB/s|"
              f"{med['direct_mbs']:.1f} MiB/s (direct TLS)|{med['gw_mbs'] / med['direct_mbs']:.2f}|")
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        subprocess.run(["rm", "-rf", d])


main()
