#!/usr/bin/env python3
"""Run a command on a pseudo-terminal of a given size, as a person at a terminal would.

    pty_run.py [--after MARKER --resize ROWS COLS --type TEXT] ROWS COLS -- CMD...

Everything the command writes to the terminal is copied to stdout. Once MARKER has appeared,
the terminal is resized (if asked), and a second later TEXT is typed (if asked). Exits with the
command's status.
"""
import argparse, fcntl, os, struct, subprocess, sys, termios, time


def set_size(fd, rows, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", type=int)
    ap.add_argument("cols", type=int)
    ap.add_argument("--after")
    ap.add_argument("--resize", type=int, nargs=2)
    ap.add_argument("--type")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    master, slave = os.openpty()
    set_size(master, a.rows, a.cols)

    def controlling():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling)
    os.close(slave)
    seen, acted = b"", False
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        seen += chunk
        if a.after and not acted and a.after.encode() in seen:
            acted = True
            if a.resize:
                set_size(master, *a.resize)
            time.sleep(1)
            if a.type:
                os.write(master, a.type.encode())
    sys.exit(p.wait())


main()
