#!/usr/bin/env python3
"""tests/run's rerun rule, one test at a time, and each test's one final result.

    tests/rerun.py decide TRY1_LOG LIST       the tests to run again, one per line: NAME<TAB>WHY
                                              (LIST: the binary's `--list` output)
    tests/rerun.py merge TRY1_LOG [TRY2_LOG]  each test's final result: NAME<TAB>ok|FAILED|ignored
    tests/rerun.py excuse TRY_LOG LIST        why a failed attempt is the test bed's alone, or nothing
    tests/rerun.py selftest                   the rule checked on made-up logs

A test is run again (once) only when the test bed, not amvm, is to blame for it:
- the emulated KVM host's own kernel died (a panic or BUG on its console) or wedged (no heartbeat)
  while the test was still running: every test with no result yet is run again; a test that had
  already failed stays failed. A wedge is blamed on amvm instead, and nothing is run again, when
  the emulated host's last heartbeat counted leaked VMMs or virtiofsd (processes of amvm's left
  without their parent), which can starve its one CPU;
- a nested guest's kernel panicked on its entry trampoline stack (a timer interrupt at its iret
  to user mode: the test bed's interrupt delivery, tests/kvm-host/README.md): only a failed test
  whose own failure report holds all three marks of that panic.
Every other failure is final: a rerun never hides an assertion that failed elsewhere in the
binary. The merge takes a rerun test's second result; all others keep their first.

An attempt whose every test has passed while its emulated host then died or wedged (by the first
rule: there is nothing left to run again) is excused: the unit's result is its tests'. Its log
and the time table say so.
"""
import re
import sys

RESULT = re.compile(r"^test (\S+) \.\.\. (ok|FAILED|ignored)\b")
BLOCK = re.compile(r"^---- (\S+) stdout ----$")
TRAMPOLINE = (
    "</ENTRY_TRAMPOLINE>",
    "CR2: fffffe0000",
    "Kernel panic - not syncing: Fatal exception in interrupt",
)
HOST_DIED = "kvm-host: the emulated host ended without an exit status"
HOST_CRASH = re.compile(r"kvm-host: console: .*(Kernel panic|BUG:)")
STALLED = "kvm-host: the emulated host stopped responding"
HEARTBEAT = re.compile(r"kvm-host: last heartbeat: alive leaked=(\d+)(.*)")


def read(path):
    with open(path, errors="replace") as f:
        return f.read().splitlines()


def results(lines):
    out = {}
    for line in lines:
        m = RESULT.match(line)
        if m:
            out[m[1]] = m[2]
    return out


def failure_blocks(lines):
    blocks, name = {}, None
    for line in lines:
        m = BLOCK.match(line)
        if m:
            name = m[1]
            blocks[name] = []
        elif line == "failures:" or line.startswith("test result:"):
            name = None
        elif name:
            blocks[name].append(line)
    return {k: "\n".join(v) for k, v in blocks.items()}


def host_fault(lines):
    """Why the emulated host failed on its own (it died or wedged), or None."""
    text = "\n".join(lines)
    died = HOST_DIED in text and bool(HOST_CRASH.search(text))
    stalled = STALLED in text
    if stalled:
        beats = HEARTBEAT.findall(text)
        leaked = int(beats[-1][0]) if beats else 0
        if leaked:
            print(
                f"# not run again: the emulated host wedged with {leaked} leaked VMM or virtiofsd "
                f"process(es) of amvm's running{beats[-1][1]}",
                file=sys.stderr,
            )
            stalled = False
    if died or stalled:
        return "the emulated KVM host's kernel " + ("died" if died else "wedged")
    return None


def decide(lines, all_tests):
    got = results(lines)
    rerun = {}
    why = host_fault(lines)
    if why:
        for t in all_tests:
            if t not in got:
                rerun[t] = why
    for name, block in failure_blocks(lines).items():
        if got.get(name) == "FAILED" and all(m in block for m in TRAMPOLINE):
            rerun[name] = "a nested guest's kernel panicked on its entry trampoline stack"
    return rerun


def excuse(lines, tests):
    """Why this attempt's failure is the test bed's alone: every test passed, then its host failed."""
    got = results(lines)
    why = host_fault(lines)
    if why and tests and all(got.get(t) in ("ok", "ignored") for t in tests):
        return why + " after every test of the attempt had passed"
    return None


def selftest():
    """The rule on made-up logs: what it reruns and what it never may."""
    listing = ["a", "b", "c", "d"]
    tramp = ["    </ENTRY_TRAMPOLINE>", "CR2: fffffe0000001ff8",
             "Kernel panic - not syncing: Fatal exception in interrupt"]
    # A trampoline panic in b, a real assertion in c: only b again.
    log = ["test a ... ok", "test b ... FAILED", "test c ... FAILED", "test d ... ok", "",
           "failures:", "", "---- b stdout ----", *tramp, "", "---- c stdout ----",
           "assertion `left == right` failed", "", "failures:", "    b", "    c",
           "test result: FAILED. 2 passed; 2 failed"]
    assert decide(log, listing) == {"b": "a nested guest's kernel panicked on its entry trampoline stack"}, decide(log, listing)
    # The host died under c and d: those two again; b's assertion stays.
    log = ["test a ... ok", "test b ... FAILED", HOST_DIED, "kvm-host: console: [ 9.1] Kernel panic - x"]
    assert sorted(decide(log, listing)) == ["c", "d"], decide(log, listing)
    # The host wedged: the unfinished again, unless amvm had leaked processes.
    log = ["test a ... ok", STALLED + ": no heartbeat", "kvm-host: last heartbeat: alive leaked=0"]
    assert sorted(decide(log, listing)) == ["b", "c", "d"]
    log = ["test a ... ok", STALLED + ": no heartbeat", "kvm-host: last heartbeat: alive leaked=2 7:amvm 9:virtiofsd"]
    assert decide(log, listing) == {}
    # A plain failure: nothing again. A died host without a crash on its console: nothing.
    assert decide(["test a ... FAILED", "failures:", "---- a stdout ----", "boom"], listing) == {}
    assert decide(["test a ... ok", HOST_DIED], listing) == {}
    # The merge: a rerun test's second result, the rest their first.
    first = results(["test a ... ok", "test b ... FAILED", "test c ... FAILED"])
    first.update(results(["test b ... ok"]))
    assert first == {"a": "ok", "b": "ok", "c": "FAILED"}
    # Excused: every test passed, then the host died; never when one failed, one has no result,
    # the host only ended (no crash on its console) or wedged with leaked processes.
    crash = [HOST_DIED, "kvm-host: console: [ 9.1] Kernel panic - x"]
    assert excuse(["test a ... ok", "test b ... ok", *crash], ["a", "b"])
    assert excuse(["test a ... ok", "test b ... ok", STALLED, "kvm-host: last heartbeat: alive leaked=0"], ["a", "b"])
    assert not excuse(["test a ... ok", "test b ... FAILED", *crash], ["a", "b"])
    assert not excuse(["test a ... ok", *crash], ["a", "b"])
    assert not excuse(["test a ... ok", "test b ... ok", HOST_DIED], ["a", "b"])
    assert not excuse(["test a ... ok", STALLED, "kvm-host: last heartbeat: alive leaked=1 7:amvm"], ["a"])
    assert not excuse([*crash], [])
    print("tests/rerun.py: the rerun rule holds on its made-up logs")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "selftest":
        selftest()
        return
    if cmd == "decide":
        # decide TRY1_LOG LIST_FILE: LIST_FILE holds the binary's tests (its `--list` output).
        lines = read(args[0])
        all_tests = [l[: -len(": test")] for l in read(args[1]) if l.endswith(": test")]
        for name, why in sorted(decide(lines, all_tests).items()):
            print(f"{name}\t{why}")
    elif cmd == "merge":
        final = results(read(args[0]))
        if len(args) > 1:
            final.update(results(read(args[1])))
        for name, res in sorted(final.items()):
            print(f"{name}\t{res}")
    elif cmd == "excuse":
        # excuse TRY_LOG LIST_FILE: LIST_FILE holds the attempt's tests (`--list` output).
        tests = [l[: -len(": test")] for l in read(args[1]) if l.endswith(": test")]
        why = excuse(read(args[0]), tests)
        if why:
            print(why)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
