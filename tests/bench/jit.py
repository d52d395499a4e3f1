#!/usr/bin/env python3
"""What the test bed's emulator spends per run (tests/bench/jit; docs/performance.md).

Outside: starts tests/kvm-host/run with the emulating QEMU's monitor on a socket, runs this file
inside it (--inner), and after each inner run reads `info jit` (code TCG translated, TB count,
TB flushes) and the emulating QEMU process's CPU time. Inside: runs the two sides in alternating
order (A B B A ...) and prints a line after each, then idles 2 s so the snapshot falls between runs.
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import boot  # the peer's command line, the same as the boot benchmark's


def inner(a):
    sides = {"amvm": [a.amvm, "run", "--mem", "512", "--kernel", a.kernel, "--", "true"],
             "qemu": boot.qemu_argv(a.kernel, a.initrd, 512)}
    order = []
    for r in range(a.rounds):
        order += ["amvm", "qemu"] if r % 2 == 0 else ["qemu", "amvm"]
    print("READY", flush=True)
    time.sleep(2)
    for i, side in enumerate(order):
        t0 = time.perf_counter()
        rc = subprocess.run(sides[side], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        print(f"DONE {i} {side} {(time.perf_counter() - t0) * 1000:.0f} {rc}", flush=True)
        time.sleep(2)
    return 0


class Monitor:
    def __init__(self, path):
        self.path = path

    def cmd(self, line):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(self.path)
            self._read(s)
            s.sendall(line.encode() + b"\n")
            return self._read(s)

    @staticmethod
    def _read(s):
        buf = b""
        while not buf.endswith(b"(qemu) "):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf.decode(errors="replace")


def qemu_pid(sock):
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if sock.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    return int(pid)
            except OSError:
                pass
    raise SystemExit("jit: cannot find the emulating qemu process")


def snapshot(mon, pid):
    j = mon.cmd("info jit")
    val = lambda name: int(re.search(name + r"\s+(\d+)", j).group(1))
    st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
    return val("gen code size"), val("TB count"), val("TB flush count"), cpu


def outer(a):
    d = tempfile.mkdtemp(prefix="amvm-jit.")
    sock = os.path.join(d, "monitor.sock")
    env = dict(os.environ, AMVM_KVMHOST_MONITOR=sock)
    p = subprocess.Popen([a.runner, "--", sys.executable, os.path.abspath(__file__), "--inner", "--amvm", a.amvm,
                          "--kernel", a.kernel, "--initrd", a.initrd, "--rounds", str(a.rounds)],
                         env=env, stdout=subprocess.PIPE, text=True)
    mon = pid = prev = None
    rows = []
    for line in p.stdout:
        w = line.split()
        if not w:
            continue
        if w[0] == "READY":
            if not os.path.exists(sock):
                p.kill()
                raise SystemExit("jit: tests/kvm-host/run ran the command directly (hardware KVM): "
                                 "there is no emulator to measure")
            mon, pid = Monitor(sock), qemu_pid(sock)
            prev = snapshot(mon, pid)
        elif w[0] == "DONE":
            now = snapshot(mon, pid)
            side, ms, rc = w[2], int(w[3]), int(w[4])
            if rc != 0:
                print(f"jit: run {w[1]} ({side}) exited {rc}", file=sys.stderr)
            after = rows[-1]["side"] if rows else None
            rows.append(dict(side=side, ms=ms, after=after, flush=now[2] - prev[2],
                             mb=(now[0] - prev[0]) / 1e6, tbs=now[1] - prev[1], cpu=now[3] - prev[3]))
            prev = now
    rc = p.wait()
    if rc != 0:
        raise SystemExit(f"jit: tests/kvm-host/run exited {rc}")
    print(f"{'side':6} {'runs':>4} {'wall ms':>8} {'TCG code MB':>11} {'TBs':>7} {'emulator CPU s':>14}"
          f" {'CPU after self':>14} {'CPU after other':>15}")
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    for side in ("amvm", "qemu"):
        rs = [r for r in rows if r["side"] == side and r["flush"] == 0]
        selfs = [r["cpu"] for r in rs if r["after"] == side]
        others = [r["cpu"] for r in rs if r["after"] not in (side, None)]
        print(f"{side:6} {len(rs):4} {med([r['ms'] for r in rs]):8.0f} {med([r['mb'] for r in rs]):11.1f}"
              f" {med([r['tbs'] for r in rs]):7.0f} {med([r['cpu'] for r in rs]):14.2f}"
              f" {med(selfs):14.2f} {med(others):15.2f}")
    flushed = sum(r["flush"] > 0 for r in rows)
    print(f"(medians; each run's CPU includes its 2 s idle after it; {flushed} run(s) with a TB flush left out)")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--runner")
    ap.add_argument("--amvm", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    return inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    sys.exit(main())
