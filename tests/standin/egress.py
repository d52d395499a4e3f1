#!/usr/bin/env python3
"""A stand-in egress for tests and examples: an HTTP/1.1 server on a unix socket.

    tests/standin/egress.py SOCKET [--log FILE] [--background]

With --background it returns once the socket is listening, printing the server's PID.

It logs every request as one JSON line (to FILE, else stderr): method, path, the headers of
interest (host, user-agent, content-type, the names of auth headers present, never their
values), and the body's size. It answers the agent harnesses' API endpoints with a fixed,
well-formed error a client reports and stops on (401, "stand-in egress: no real API here", with
`x-should-retry: false`, the header by which the providers' SDKs are told not to retry: Claude Code
retries a bare 401 with back-off for minutes), `GET /v1/ping` with `pong`, and everything else
with 404. It never reaches the network.

amvm run --egress SOCKET makes it the workload's only way out: a request the workload sends to
http://$AMVM_EGRESS_ADDR/... arrives here.
"""

import argparse
import json
import os
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

AUTH_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key")
SHOWN_HEADERS = ("host", "user-agent", "content-type", "anthropic-version", "openai-beta")

# Paths the harnesses call (prefix match), and the provider whose error shape they get.
API_PREFIXES = (
    ("/v1/messages", "anthropic"),
    ("/v1/responses", "openai"),
    ("/v1/chat/completions", "openai"),
    ("/v1/models", "openai"),
    ("/v1beta/models", "google"),
    ("/v1/models/", "google"),
)


def api_error(provider):
    msg = "stand-in egress: no real API here"
    if provider == "anthropic":
        return {"type": "error", "error": {"type": "authentication_error", "message": msg}}
    if provider == "google":
        return {"error": {"code": 401, "message": msg, "status": "UNAUTHENTICATED"}}
    return {"error": {"message": msg, "type": "invalid_request_error", "code": "invalid_api_key"}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "amvm-standin-egress"

    def address_string(self):  # a unix socket peer has no address
        return "unix"

    def log_message(self, fmt, *args):  # the JSON log replaces http.server's own
        pass

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body_size = 0
        if length:
            body_size = len(self.rfile.read(length))
        elif self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body_size += len(self.rfile.read(size))
                self.rfile.readline()
        path = self.path
        provider = next((p for prefix, p in API_PREFIXES if path.startswith(prefix)), None)
        entry = {
            "at": round(time.time(), 3),
            "method": self.command,
            "path": path,
            "headers": {k: self.headers[k] for k in SHOWN_HEADERS if k in self.headers},
            "auth": sorted(h for h in AUTH_HEADERS if h in self.headers),
            "body_bytes": body_size,
        }
        self.server.log(entry)
        if path == "/v1/ping":
            status, payload, ctype = 200, b"pong\n", "text/plain"
        elif provider:
            status, ctype = 401, "application/json"
            payload = json.dumps(api_error(provider)).encode()
        else:
            status, ctype = 404, "application/json"
            payload = json.dumps({"error": {"message": f"stand-in egress: no route {path}"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        if status == 401:
            self.send_header("x-should-retry", "false")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path, log_file):
        self._lock = threading.Lock()
        self._log = log_file
        super().__init__(path, Handler)

    def log(self, entry):
        with self._lock:
            self._log.write(json.dumps(entry) + "\n")
            self._log.flush()


def stop(_sig, _frame):
    raise KeyboardInterrupt


def main():
    signal.signal(signal.SIGTERM, stop)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("--log", help="append JSON lines here (default: stderr)")
    ap.add_argument("--background", action="store_true",
                    help="return once listening, printing the server's PID")
    args = ap.parse_args()
    if os.path.exists(args.socket):
        os.unlink(args.socket)
    log = open(args.log, "a", buffering=1) if args.log else sys.stderr
    with Server(args.socket, log) as srv:
        if args.background:
            pid = os.fork()
            if pid:
                print(pid, flush=True)
                os._exit(0)
            os.setsid()
            # Keep none of the caller's pipes open (a caller waiting for their EOF, as a test
            # harness capturing output does, would wait for this server's end): stderr stays
            # only when it is the log.
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1) if log is sys.stderr else (0, 1, 2):
                os.dup2(devnull, fd)
        else:
            print(f"stand-in egress listening on {args.socket}", file=sys.stderr, flush=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            os.unlink(args.socket)


if __name__ == "__main__":
    main()
