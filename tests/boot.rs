//! Boot real microVMs and check what comes back: exit statuses, stdout/stderr separation,
//! vCPUs, the workload's user, environment and working directory, a pseudo-terminal, the
//! loopback interface, and repeated runs.

use amvm_tests::{amvm, require_kvm, run_args, run_vm, sh};

#[test]
fn stdout_stderr_and_status_come_back_separately() {
    let o = sh("echo hello; echo oops >&2; exit 7");
    assert_eq!(o.code, 7, "{o:?}");
    assert_eq!(o.stdout_str(), "hello\n");
    assert_eq!(o.stderr, "oops\n");
}

#[test]
fn exit_status_0() {
    let o = run_vm(&[], &["true"]);
    assert_eq!(
        (o.code, o.stdout.len(), o.stderr.as_str()),
        (0, 0, ""),
        "{o:?}"
    );
}

#[test]
fn exit_status_1() {
    let o = run_vm(&[], &["false"]);
    assert_eq!(o.code, 1, "{o:?}");
}

#[test]
fn exit_status_255() {
    let o = sh("exit 255");
    assert_eq!(o.code, 255, "{o:?}");
}

#[test]
fn death_by_signal_is_128_plus_n() {
    let o = sh("kill -9 $$");
    assert_eq!(o.code, 137, "{o:?}");
}

#[test]
fn missing_command_is_127_with_a_message() {
    let o = run_vm(&[], &["no-such-command-anywhere"]);
    assert_eq!(o.code, 127, "{o:?}");
    assert!(
        o.stderr.contains("no-such-command-anywhere") && o.stderr.contains("not found"),
        "{o:?}"
    );
}

#[test]
fn two_vcpus_are_two_processors() {
    let o = run_vm(
        &["--cpus", "2"],
        &["sh", "-c", "nproc; grep -c ^processor /proc/cpuinfo"],
    );
    assert_eq!((o.code, o.stdout_str().as_str()), (0, "2\n2\n"), "{o:?}");
}

#[test]
fn one_vcpu_by_default_and_memory_as_asked() {
    let o = run_vm(
        &["--mem", "256"],
        &["sh", "-c", "nproc; grep MemTotal /proc/meminfo"],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("1"));
    let kib: u64 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    // MemTotal is RAM minus what the kernel reserves for itself: within 256 MiB, above 200 MiB.
    assert!(
        (200 * 1024..=256 * 1024).contains(&kib),
        "MemTotal {kib} kB for --mem 256"
    );
}

#[test]
fn workload_runs_as_the_requested_user_with_env_and_cwd() {
    let o = run_vm(
        &["-e", "GREETING=hi there", "-w", "/tmp"],
        &[
            "sh",
            "-c",
            "id -u; id -g; pwd; echo \"$GREETING\"; echo $HOME; touch $HOME/f; stat -c %u:%g $HOME/f",
        ],
    );
    assert_eq!(
        (o.code, o.stdout_str().as_str()),
        (0, "1000\n1000\n/tmp\nhi there\n/home/agent\n1000:1000\n"),
        "{o:?}"
    );
    let o = run_vm(&["--user", "0:0"], &["id", "-u"]);
    assert_eq!((o.code, o.stdout_str().as_str()), (0, "0\n"), "{o:?}");
}

/// The workload can open a pseudo-terminal (devpts on /dev/pts), as `script`, Python's pty
/// module and node-pty do, and bytes written to its master side come out of its slave side.
#[test]
fn the_workload_can_open_a_pseudo_terminal() {
    let o = run_vm(
        &[],
        &[
            "python3",
            "-c",
            "import os, tty\n\
             m, s = os.openpty()\n\
             tty.setraw(s)\n\
             os.write(m, b'through the pty')\n\
             print(os.ttyname(s), os.read(s, 64).decode(), os.stat(os.ttyname(s)).st_uid)",
        ],
    );
    assert_eq!(
        (o.code, o.stdout_str().as_str()),
        (0, "/dev/pts/0 through the pty 1000\n"),
        "{o:?}"
    );
}

/// `lo` is up on every run, not only with `--egress`: a workload can serve on 127.0.0.1 and
/// reach itself there, as test suites with a local server do.
#[test]
fn the_workload_has_a_loopback_without_egress() {
    let o = run_vm(
        &[],
        &[
            "python3",
            "-c",
            "import socket\n\
             srv = socket.create_server(('127.0.0.1', 0))\n\
             c = socket.create_connection(srv.getsockname())\n\
             a, _ = srv.accept()\n\
             c.sendall(b'over lo')\n\
             print(a.recv(64).decode())",
        ],
    );
    assert_eq!((o.code, o.stdout_str().as_str()), (0, "over lo\n"), "{o:?}");
}

#[test]
fn output_arrives_complete_and_in_order() {
    // 20,000 numbered lines on stdout, interleaved with stderr lines: both streams byte-exact.
    let o = sh("i=0; while [ $i -lt 20000 ]; do echo $i; [ $((i % 1000)) = 0 ] && echo e$i >&2; i=$((i+1)); done");
    assert_eq!(o.code, 0, "{}", o.stderr);
    let want: String = (0..20000).map(|i| format!("{i}\n")).collect();
    assert_eq!(o.stdout_str(), want);
    let want_err: String = (0..20).map(|i| format!("e{}\n", i * 1000)).collect();
    assert_eq!(o.stderr, want_err);
}

#[test]
fn guest_ram_is_a_memfd_by_default_and_on_huge_pages_when_asked() {
    require_kvm();
    // 32 MiB written to the guest's /tmp, a tmpfs in guest RAM.
    let script = "dd if=/dev/zero of=/tmp/f bs=1M count=32 2>/dev/null && wc -c < /tmp/f";
    let (memfd, huge) = (
        "guest memory created (memfd)",
        "guest memory created (huge-page tmpfs)",
    );
    // AMVM_HUGE_PAGES is set in every case, so the suite's own environment does not decide.
    let cases: [(&[&str], &str, &str); 4] = [
        (&[], "", memfd),
        (&["--huge-pages"], "", huge),
        (&[], "1", huge),
        (&["--no-huge-pages"], "1", memfd),
    ];
    for (opts, var, mark) in cases {
        let env = [
            ("AMVM_HUGE_PAGES", var),
            ("RUST_LOG", "amvm::timeline=debug"),
        ];
        let o = amvm(run_args(opts, &["sh", "-c", script]), &env);
        assert_eq!(
            (o.code, o.stdout_str().as_str()),
            (0, "33554432\n"),
            "{opts:?} AMVM_HUGE_PAGES={var:?}: {o:?}"
        );
        assert!(
            o.stderr.contains(mark),
            "{opts:?} AMVM_HUGE_PAGES={var:?}: no {mark:?} in {o:?}"
        );
    }
}

#[test]
fn timeout_exits_124() {
    let o = run_vm(&["--timeout", "3"], &["sleep", "100"]);
    assert_eq!(o.code, 124, "{o:?}");
    assert!(o.stderr.contains("timed out after 3 s"), "{o:?}");
}

#[test]
fn twenty_runs_in_a_row() {
    for i in 0..20 {
        let o = sh(&format!("echo run {i}; exit {}", i % 3));
        assert_eq!(
            (o.code, o.stdout_str()),
            (i % 3, format!("run {i}\n")),
            "run {i}: {o:?}"
        );
    }
}

#[test]
fn a_100_mib_stdout_arrives_complete_and_separate_from_stderr() {
    // The guest hashes what it writes; the test hashes what arrived.
    let o = sh("head -c 104857600 /dev/urandom > /tmp/big; sha256sum < /tmp/big | cut -d' ' -f1 >&2; cat /tmp/big; echo done >&2");
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stdout.len(), 104_857_600);
    use sha2::Digest;
    let got: String = sha2::Sha256::digest(&o.stdout)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(o.stderr, format!("{got}\ndone\n"));
}
