#!/usr/bin/env python3
"""A TLS upstream for amvm gateway's tests: Python's http.server behind its ssl module, on
127.0.0.1 (a real TLS server with a certificate the test's own CA signed). Keeps connections
alive (HTTP/1.1); each new connection is a line in RECORDS.connections.

    tls_upstream.py CERT KEY PORTFILE RECORDS GOFILE

Writes its port to PORTFILE once it listens. Each request's method, path and headers go to
RECORDS, one JSON line each. Paths:
  /v1/messages  server-sent events, chunked: one event, then (once GOFILE exists) four more and
                the end; 401 unless the x-api-key header is the one in $UPSTREAM_KEY
  /echo         the request body back
  /die          chunked: one chunk, then the connection is cut without the last chunk
  /bytes/N      N bytes (a fixed pattern), with their length
  /stall        chunked: one chunk, then nothing for two minutes
With $UPSTREAM_MODEL set, /v1/messages (any query) is instead a stand-in of the Anthropic
Messages API: with the right key, a streamed answer whose text is "hello from the stand-in
model"; without it, the API's 401 error.
"""

import http.server
import json
import os
import ssl
import sys
import threading
import time

cert, key, portfile, records, gofile = sys.argv[1:6]
lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Head and body go out as separate writes: without this, Nagle holds the body for the
    # client's delayed ACK (40 ms a request).
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        with lock, open(records + ".connections", "a") as f:
            f.write("1\n")

    def record(self):
        with lock, open(records, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "headers": [[k.lower(), v] for k, v in self.headers.items()]}) + "\n")

    def body(self):
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def model(self):
        if self.headers.get("x-api-key") != os.environ["UPSTREAM_KEY"]:
            body = json.dumps({"type": "error", "error": {
                "type": "authentication_error", "message": "stand-in model: wrong key"}}).encode()
            self.send_response(401)
            self.send_header("content-type", "application/json")
            self.send_header("x-should-retry", "false")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        usage = {"input_tokens": 1, "output_tokens": 1}
        events = [
            ("message_start", {"type": "message_start", "message": {
                "id": "msg_standin", "type": "message", "role": "assistant",
                "model": "claude-standin", "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": usage}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                "type": "text_delta", "text": "hello from the stand-in model"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 6}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for name, data in events:
            self.chunk(b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode()))
        self.wfile.write(b"0\r\n\r\n")

    def handle_one(self):
        self.record()
        data = self.body()
        if os.environ.get("UPSTREAM_MODEL") and self.path.split("?")[0] == "/v1/messages":
            self.model()
            return
        if self.path == "/echo":
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.path == "/v1/messages":
            if self.headers.get("x-api-key") != os.environ["UPSTREAM_KEY"]:
                self.send_response(401)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.chunk(b"event: first\ndata: 0\n\n")
            until = time.monotonic() + 60
            while not os.path.exists(gofile) and time.monotonic() < until:
                time.sleep(0.02)
            for i in range(1, 5):
                self.chunk(b"event: more\ndata: %d\n\n" % i)
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path.startswith("/bytes/"):
            n = int(self.path[len("/bytes/"):])
            self.send_response(200)
            self.send_header("content-length", str(n))
            self.end_headers()
            piece = bytes(range(256)) * 1024
            while n > 0:
                k = min(n, len(piece))
                self.wfile.write(piece[:k])
                n -= k
            return
        if self.path == "/stall":
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.chunk(b"first")
            time.sleep(120)
            return
        if self.path == "/die":
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.chunk(b"partial")
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST = handle_one


ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(portfile + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(portfile + ".tmp", portfile)
server.serve_forever()
