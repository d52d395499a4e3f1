#!/usr/bin/env python3
"""A second-language client of a sandbox's API socket (docs/api.md), on Python's http.client.

    amvm_api.py SOCKET info
    amvm_api.py SOCKET exec [--stdin] ARG...    (stdin forwarded with --stdin; exits with the
                                                command's status)
    amvm_api.py SOCKET put-archive DIR          (a tar on stdin, unpacked into DIR in the sandbox)
    amvm_api.py SOCKET get-archive PATH         (PATH in the sandbox, as a tar on stdout)
    amvm_api.py SOCKET pause|resume             (prints the sandbox's state after)
    amvm_api.py SOCKET snapshot DIR [--stop]    (DIR new: its state and memory files go to the
                                                sandbox with the request, as SCM_RIGHTS)

With `amvm serve`'s socket (all of a user's sandboxes):
    amvm_api.py SOCKET create [--name NAME] -- FLAG...   (amvm create's flags; prints the sandbox)
    amvm_api.py SOCKET ls
    amvm_api.py SOCKET rm [--force] SANDBOX
    amvm_api.py --sandbox SANDBOX SOCKET info|exec|put-archive|get-archive|pause|resume ...
                                                (one sandbox's calls, through the server)
    amvm_api.py --sandbox SANDBOX SOCKET snapshot DIR [--stop]
                                                (the server writes DIR; prints its answer)
    amvm_api.py --sandbox SANDBOX SOCKET fork [N]
                                                (prints the new sandboxes)
    amvm_api.py SOCKET create [--name NAME] -- --from DIR
                                                (a sandbox from a snapshot)

Frames (after `101 Switching Protocols`): kind (1 byte), length (u32 little-endian), payload.
From the sandbox: 1 stdout, 2 stderr, 3 exit (1 byte). To it: 32 stdin, 33 end of stdin,
17 signal (1 byte).
"""

import http.client
import json
import os
import socket
import struct
import sys
import threading
import urllib.parse


# "/v1" on a sandbox's own socket; "/v1/sandboxes/ID" through amvm serve's.
PREFIX = "/v1"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("amvm")
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def info(path):
    c = UnixConnection(path)
    c.request("GET", PREFIX + "/sandbox" if PREFIX == "/v1" else PREFIX)
    r = c.getresponse()
    body = json.loads(r.read())
    if r.status != 200:
        sys.exit(f"amvm_api: {r.status}: {body['error']}")
    print(json.dumps(body, indent=1))


def frame(kind, payload):
    return struct.pack("<BI", kind, len(payload)) + payload


def read_exact(f, n):
    b = b""
    while len(b) < n:
        chunk = f.read(n - len(b))
        if not chunk:
            return None
        b += chunk
    return b


def arg(a):
    """An argument as the API takes it: a string, or {"hex": ...} for bytes that are not UTF-8."""
    b = os.fsencode(a)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": b.hex()}


def exec_(path, argv, with_stdin):
    c = UnixConnection(path)
    body = json.dumps({"argv": [arg(a) for a in argv], "stdin": with_stdin})
    c.request("POST", PREFIX + "/exec", body=body,
              headers={"Upgrade": "amvm-exec/1", "Connection": "Upgrade",
                       "Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 101:
        sys.exit(f"amvm_api: {r.status}: {json.loads(r.read())['error']}")
    sock = c.sock
    if with_stdin:
        def feed():
            while True:
                data = sys.stdin.buffer.read1(65536)
                if not data:
                    break
                sock.sendall(frame(32, data))
            sock.sendall(frame(33, b""))
        threading.Thread(target=feed, daemon=True).start()
    # http.client has buffered what came after the head: read the frames through its reader.
    f = r.fp
    while True:
        head = read_exact(f, 5)
        if head is None:
            sys.exit("amvm_api: the stream ended without an exit status")
        kind, n = struct.unpack("<BI", head)
        payload = read_exact(f, n) if n else b""
        if kind == 1:
            sys.stdout.buffer.write(payload)
            sys.stdout.buffer.flush()
        elif kind == 2:
            sys.stderr.buffer.write(payload)
            sys.stderr.buffer.flush()
        elif kind == 3:
            sys.exit(payload[0])


def put_archive(path, guest_dir):
    # http.client sends a file body with the Content-Length it is given, in blocks.
    body = sys.stdin.buffer
    size = os.fstat(body.fileno()).st_size
    c = UnixConnection(path)
    c.request("PUT", PREFIX + "/archive?" + urllib.parse.urlencode({"path": guest_dir}), body=body,
              headers={"Content-Length": str(size), "Content-Type": "application/x-tar"})
    r = c.getresponse()
    answer = json.loads(r.read())
    if r.status != 200:
        sys.exit(f"amvm_api: {r.status}: {answer['error']}")


def get_archive(path, guest_path):
    c = UnixConnection(path)
    c.request("GET", PREFIX + "/archive?" + urllib.parse.urlencode({"path": guest_path}))
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"amvm_api: {r.status}: {json.loads(r.read())['error']}")
    try:
        while True:
            data = r.read(65536)
            if not data:
                break
            sys.stdout.buffer.write(data)
    except http.client.IncompleteRead:
        sys.exit("amvm_api: the archive was cut short")
    sys.stdout.buffer.flush()


def call(path, method, target, body=None):
    c = UnixConnection(path)
    c.request(method, target, body=None if body is None else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    answer = json.loads(r.read())
    if r.status >= 300:
        sys.exit(f"amvm_api: {r.status}: {answer['error']}")
    return answer


def snapshot(path, directory, stop):
    """POST /v1/snapshot with the two files it writes (state, memory) passed along with the
    request's bytes (SCM_RIGHTS): the supervisor cannot open a path of ours."""
    os.mkdir(directory, 0o700)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    state = os.open(os.path.join(directory, "state"), flags, 0o600)
    memory = os.open(os.path.join(directory, "memory"), flags, 0o600)
    body = json.dumps({"stop": stop}).encode()
    head = (f"POST {PREFIX}/snapshot HTTP/1.1\r\nHost: amvm\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socket.send_fds(s, [head + body], [state, memory])
    os.close(state)
    os.close(memory)
    answer = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        answer += b
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if status != 200:
        sys.exit(f"amvm_api: {status}: {json.loads(body)['error']}")
    print(body.decode())


def main():
    global PREFIX
    argv = sys.argv[1:]
    if argv[:1] == ["--sandbox"] and len(argv) >= 2:
        PREFIX = "/v1/sandboxes/" + urllib.parse.quote(argv[1], safe="")
        argv = argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    sys.argv = [sys.argv[0]] + argv
    path, what = argv[0], argv[1]
    if what == "create":
        rest = argv[2:]
        name = None
        if rest[:1] == ["--name"]:
            name, rest = rest[1], rest[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        print(json.dumps(call(path, "POST", "/v1/sandboxes", {"args": rest, "name": name})))
        return
    if what == "ls":
        print(json.dumps(call(path, "GET", "/v1/sandboxes")))
        return
    if what == "rm":
        force = argv[2:3] == ["--force"]
        sandbox = argv[3] if force else argv[2]
        target = "/v1/sandboxes/" + urllib.parse.quote(sandbox, safe="")
        print(json.dumps(call(path, "DELETE", target + ("?force=true" if force else ""))))
        return
    if what == "info":
        info(path)
    elif what == "exec":
        args = sys.argv[3:]
        with_stdin = bool(args) and args[0] == "--stdin"
        exec_(path, args[1:] if with_stdin else args, with_stdin)
    elif what == "snapshot" and len(sys.argv) in (4, 5) and PREFIX != "/v1":
        body = {"dir": os.path.abspath(sys.argv[3]), "stop": sys.argv[4:] == ["--stop"]}
        print(json.dumps(call(path, "POST", PREFIX + "/snapshot", body)))
    elif what == "snapshot" and len(sys.argv) in (4, 5):
        snapshot(path, sys.argv[3], sys.argv[4:] == ["--stop"])
    elif what == "fork" and len(sys.argv) in (3, 4) and PREFIX != "/v1":
        n = int(sys.argv[3]) if len(sys.argv) == 4 else 1
        print(json.dumps(call(path, "POST", PREFIX + "/fork", {"n": n})))
    elif what in ("pause", "resume") and len(sys.argv) == 3:
        print(json.dumps(call(path, "POST", PREFIX + "/" + what)))
    elif what == "put-archive" and len(sys.argv) == 4:
        put_archive(path, sys.argv[3])
    elif what == "get-archive" and len(sys.argv) == 4:
        get_archive(path, sys.argv[3])
    else:
        sys.exit(__doc__)


main()
