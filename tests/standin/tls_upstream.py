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
With $UPSTREAM_MODEL set, it is instead a stand-in of three model APIs, each answering
"hello from the stand-in model" (streamed as the real one streams it) to the right key and the
API's own 401 error to any other:
  /v1/messages                    Anthropic Messages, key in x-api-key ($UPSTREAM_KEY)
  /v1/responses                   OpenAI Responses, "Authorization: Bearer" ($UPSTREAM_OPENAI_KEY)
  /v1beta/models/M:ACTION         Gemini (streamGenerateContent, generateContent, countTokens),
                                  key in x-goog-api-key ($UPSTREAM_GEMINI_KEY)
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
            self.refuse({"type": "error", "error": {
                "type": "authentication_error", "message": "stand-in model: wrong key"}},
                x_should_retry="false")
            return
        usage = {"input_tokens": 1, "output_tokens": 1}
        self.events([
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
        ])

    def refuse(self, body, **headers):
        body = json.dumps(body).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def events(self, events):
        """Server-sent events, chunked: (name or None, data) pairs."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for name, data in events:
            head = b"event: %s\n" % name.encode() if name else b""
            self.chunk(head + b"data: %s\n\n" % json.dumps(data).encode())
        self.wfile.write(b"0\r\n\r\n")

    def openai(self):
        if self.headers.get("authorization") != "Bearer " + (os.environ.get("UPSTREAM_OPENAI_KEY") or "\0"):
            self.refuse({"error": {"message": "stand-in model: wrong key", "type":
                                   "invalid_request_error", "code": "invalid_api_key"}})
            return
        text = "hello from the stand-in model"
        item = {"type": "message", "id": "msg_standin", "role": "assistant", "status":
                "completed", "content": [{"type": "output_text", "text": text,
                                          "annotations": []}]}
        response = {"id": "resp_standin", "object": "response", "model": "gpt-standin",
                    "status": "completed", "output": [item], "usage": {
                        "input_tokens": 1, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": 7}}
        started = dict(item, status="in_progress", content=[])
        self.events([
            ("response.created", {"type": "response.created", "response": dict(
                response, status="in_progress", output=[], usage=None)}),
            ("response.output_item.added", {"type": "response.output_item.added",
                                            "output_index": 0, "item": started}),
            ("response.output_text.delta", {"type": "response.output_text.delta",
                                            "item_id": "msg_standin", "output_index": 0,
                                            "content_index": 0, "delta": text}),
            ("response.output_item.done", {"type": "response.output_item.done",
                                           "output_index": 0, "item": item}),
            ("response.completed", {"type": "response.completed", "response": response}),
        ])

    def gemini(self, action):
        if self.headers.get("x-goog-api-key") != (os.environ.get("UPSTREAM_GEMINI_KEY") or "\0"):
            self.refuse({"error": {"code": 401, "message": "stand-in model: wrong key",
                                   "status": "UNAUTHENTICATED"}})
            return
        if action == "countTokens":
            answer = {"totalTokens": 1}
        else:
            answer = {"candidates": [{"content": {"role": "model", "parts": [
                {"text": "hello from the stand-in model"}]}, "finishReason": "STOP",
                "index": 0}], "usageMetadata": {"promptTokenCount": 1,
                                                "candidatesTokenCount": 6,
                                                "totalTokenCount": 7},
                "modelVersion": "gemini-standin"}
        if action == "streamGenerateContent":
            self.events([(None, answer)])
            return
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_one(self):
        self.record()
        data = self.body()
        path = self.path.split("?")[0]
        if os.environ.get("UPSTREAM_MODEL"):
            if path == "/v1/messages":
                self.model()
                return
            if path == "/v1/responses":
                self.openai()
                return
            if path.startswith("/v1beta/models/") and ":" in path:
                self.gemini(path.rsplit(":", 1)[1])
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
