//! The control channel's inputs: the workload's stdin with `-i` (exact bytes, then EOF), none
//! without it, and SIGINT/SIGTERM sent to amvm reaching the workload.

use amvm_tests::egress_server::{hex, pattern};
use amvm_tests::spawn_vm;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout};
use std::time::Duration;

/// Feed `input` to `amvm run [opts] -- command`, return (status, stdout, stderr).
fn with_stdin(opts: &[&str], command: &[&str], input: Vec<u8>) -> (i32, String, String) {
    let mut child = spawn_vm(opts, command);
    let mut stdin = child.stdin.take().unwrap();
    // A workload that stops reading early closes the stream: the rest is refused (EPIPE).
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    (
        out.status.code().expect("amvm exited"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn stdin_reaches_the_workload_byte_exact_then_eof() {
    let input = pattern(8 << 20 | 4097);
    let want = hex(&Sha256::digest(&input));
    // sha256sum prints only after EOF: the hash proves every byte and the end arrived.
    let (code, out, err) = with_stdin(&["-i"], &["sha256sum"], input);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.split(' ').next(), Some(want.as_str()), "{out}");
}

#[test]
fn a_workload_that_reads_part_of_stdin_ends_the_run_cleanly() {
    let (code, out, err) = with_stdin(
        &["-i"],
        &["sh", "-c", "head -c 5; echo; echo done"],
        pattern(4 << 20),
    );
    assert_eq!(code, 0, "{err}");
    let p = pattern(5);
    assert_eq!(out.as_bytes()[..5], p[..], "{out:?}");
    assert!(out.ends_with("\ndone\n"), "{out:?}");
}

#[test]
fn without_i_the_workload_reads_nothing() {
    let (code, out, err) = with_stdin(
        &[],
        &["sh", "-c", "echo \"[$(cat)]\""],
        b"host stdin".to_vec(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "[]\n");
}

/// Wait until the workload prints `ready` (it has started and set its traps).
fn wait_ready(child: &mut Child) -> BufReader<ChildStdout> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("amvm ended before the workload was ready: {err}");
        }
        if line == "ready\n" {
            return out;
        }
    }
}

fn kill(child: &Child, sig: i32) {
    // SAFETY: kill(2) with plain integers on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
}

fn finish(mut child: Child, mut out: BufReader<ChildStdout>) -> (i32, String, String) {
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    (status.code().expect("amvm exited"), rest, err)
}

#[test]
fn sigterm_reaches_the_workload_which_decides_the_status() {
    let mut child = spawn_vm(
        &[],
        &[
            "sh",
            "-c",
            "trap 'echo got TERM; exit 42' TERM; echo ready; while true; do sleep 1; done",
        ],
    );
    let out = wait_ready(&mut child);
    kill(&child, libc::SIGTERM);
    let (code, rest, err) = finish(child, out);
    assert_eq!((code, rest.as_str()), (42, "got TERM\n"), "{err}");
}

#[test]
fn sigint_ends_a_default_workload_with_130() {
    let mut child = spawn_vm(&[], &["sh", "-c", "echo ready; exec sleep 1000"]);
    let out = wait_ready(&mut child);
    kill(&child, libc::SIGINT);
    let (code, _, err) = finish(child, out);
    assert_eq!(code, 130, "{err}");
}

#[test]
fn a_second_signal_tears_the_vm_down_when_the_workload_ignores_the_first() {
    let mut child = spawn_vm(
        &[],
        &[
            "sh",
            "-c",
            "trap '' TERM; echo ready; while true; do sleep 1; done",
        ],
    );
    let out = wait_ready(&mut child);
    kill(&child, libc::SIGTERM);
    std::thread::sleep(Duration::from_secs(1));
    kill(&child, libc::SIGTERM);
    let (code, _, err) = finish(child, out);
    assert_eq!(code, 143, "{err}");
    assert!(
        err.contains("interrupted by SIGTERM: a second signal arrived"),
        "{err}"
    );
}
