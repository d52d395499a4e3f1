#!/usr/bin/env python3
"""Run the commands that README.md and docs/*.md show, so the docs cannot drift from the code.

    tests/docs/commands.py --list
    tests/docs/commands.py --where kvm|host

Every fenced code block in those files must name its language. A block whose info string is
`sh` is a command to run where /dev/kvm is real (tests/docs.rs runs them through
tests/kvm-host/run); `sh host` runs on this machine as it is (tests/run runs those); `sh no-run:
REASON` is not run, and the reason is printed. ` exit=N` after any of them: the block must exit
N (default 0). ` prints` after `sh` or `sh host` (last): the next block of the file, a `text` one,
is exactly what the block prints, its stdout and stderr together in the order written (trailing
spaces and blank lines at the end aside), and the block fails if it prints anything else. Other
languages (text, ini, yaml, ...) are not commands.

Each block runs whole with `bash -e -o pipefail`, from the repository's root, with the `amvm`
under test ($AMVM_BIN's directory) first on PATH and a fresh $AMVM_DOC_TMP directory. The report
is one line per block; the exit status is 0 only if every block that ran gave its status.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = 900


def doc_files():
    yield "README.md"
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if name.endswith(".md"):
            yield os.path.join("docs", name)


class DocError(Exception):
    pass


def blocks(path):
    """(line, info, text) for each fenced block of `path`."""
    out = []
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        start = i + 1
        body = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*" + fence + r"\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise DocError(f"{path}:{start}: unclosed code block")
        i += 1
        out.append((start, info, "\n".join(body) + "\n"))
    return out


def classify(path, line, info):
    """-> (where, expected_exit, reason) for a sh block, None for other languages."""
    if not info:
        raise DocError(f"{path}:{line}: a code block without a language (use sh, text, ...)")
    m = re.match(r"^sh(?:\s+(host|no-run:\s*(.+?)))?(?:\s+exit=(\d+))?(\s+prints)?\s*$", info)
    if not info.split()[0].startswith("sh"):
        return None
    if not m or info.split()[0] != "sh":
        raise DocError(f"{path}:{line}: cannot read the block's info string {info!r}")
    where = "kvm"
    reason = None
    if m.group(1) == "host":
        where = "host"
    elif m.group(1):
        where, reason = "no-run", m.group(2)
    if m.group(4) and where == "no-run":
        raise DocError(f"{path}:{line}: a block that is not run cannot promise what it prints")
    return where, int(m.group(3) or 0), reason, bool(m.group(4))


def collect():
    """(path, line, where, exit, reason, text, output): `output` is what a `prints` block must
    print (the next block's text), else None."""
    found = []
    for path in doc_files():
        bl = blocks(path)
        for k, (line, info, text) in enumerate(bl):
            c = classify(path, line, info)
            if not c:
                continue
            where, code, reason, prints = c
            output = None
            if prints:
                if k + 1 == len(bl) or bl[k + 1][1] != "text":
                    raise DocError(f"{path}:{line}: `prints`, but no text block follows")
                output = bl[k + 1][2]
            found.append((path, line, where, code, reason, text, output))
    return found


def same_output(got, want):
    norm = lambda t: "\n".join(l.rstrip() for l in t.splitlines()).rstrip("\n")
    return norm(got) == norm(want)


def run(text, expected, output=None):
    env = dict(os.environ)
    amvm = os.environ.get("AMVM_BIN")
    if amvm:
        env["PATH"] = os.path.dirname(os.path.abspath(amvm)) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="amvm-doc.") as tmp:
        env["AMVM_DOC_TMP"] = tmp
        # A block that promises its output writes stdout and stderr to one pipe, in order.
        err = subprocess.STDOUT if output is not None else subprocess.PIPE
        try:
            p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=ROOT, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                               timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False, f"did not end within {TIMEOUT_S} s", b"", b""
    stderr = p.stderr or b""
    if p.returncode != expected:
        return False, f"exit {p.returncode}, expected {expected}", p.stdout, stderr
    if output is not None and not same_output(p.stdout.decode(errors="replace"), output):
        return False, f"it printed other than the text block after it, which is:\n{output}", p.stdout, stderr
    return True, "", p.stdout, stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--where", choices=["kvm", "host"])
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    try:
        found = collect()
    except DocError as e:
        print(f"docs: {e}", file=sys.stderr)
        return 1
    if args.list or not args.where:
        for path, line, where, expected, reason, _, output in found:
            shown = "\tprints" if output is not None else ""
            print(f"{path}:{line}\t{where}\texit={expected}{shown}\t{reason or ''}")
        return 0
    passed = failed = 0
    for path, line, where, expected, reason, text, output in found:
        if where == "no-run":
            print(f"skip {path}:{line}: not run here: {reason}")
            continue
        if where != args.where:
            continue
        ok, why, out, err = run(text, expected, output)
        if ok:
            passed += 1
            print(f"ok   {path}:{line}")
        else:
            failed += 1
            print(f"FAIL {path}:{line}: {why}\n--- the block:\n{text}--- stdout:\n"
                  f"{out.decode(errors='replace')[-4000:]}--- stderr:\n{err.decode(errors='replace')[-4000:]}---")
        sys.stdout.flush()
    print(f"doc commands ({args.where}): {passed} passed, {failed} failed")
    if passed + failed == 0:
        print(f"docs: no block runs {args.where}: the extraction is broken", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
