//! Limits and faults, and how they end: the workload's cgroup bounds its tasks (`--pids`,
//! default 4096); a full /tmp or a closed stdout fails only what the workload does; running the
//! guest out of memory kills the workload — not guest-init — with 137 and "killed: out of
//! memory" on stderr, while an ordinary SIGKILL is 137 without that line. After every run here,
//! nothing of it is left on the host (`run_vm_leaving_nothing`).

use amvm_tests::run_vm_leaving_nothing as run_vm;

#[test]
fn pids_stops_a_fork_bomb_at_the_limit() {
    // The limit the workload sees, then the fork loop.
    let script = format!(
        "print(open('/sys/fs/cgroup/workload/pids.max').read().strip()){}",
        amvm_tests::FORK_UNTIL_REFUSED
    );
    let o = run_vm(&["--pids", "50"], &["python3", "-c", &script]);
    assert_eq!(o.code, 0, "{o:?}");
    // The workload itself is one of the 50 tasks; EAGAIN (11) refuses the 50th fork.
    assert_eq!(o.stdout_str(), "50\nforks 49 then errno 11\n", "{o:?}");
}

#[test]
fn the_default_task_limit_is_4096() {
    let o = run_vm(&[], &["cat", "/sys/fs/cgroup/workload/pids.max"]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), "4096\n");
}

#[test]
fn out_of_memory_kills_the_workload_with_137_and_says_so() {
    // 1 GiB in 64 MiB pieces, each filled, in a 256 MiB guest.
    let o = run_vm(
        &["--mem", "256"],
        &[
            "python3",
            "-c",
            "l = []\nfor i in range(16):\n    l.append(b'x' * (64 << 20))\nprint('all allocated')",
        ],
    );
    assert_eq!(o.code, 137, "{o:?}");
    assert!(o.stderr.contains("amvm: killed: out of memory"), "{o:?}");
    assert!(!o.stdout_str().contains("all allocated"), "{o:?}");
}

#[test]
fn an_ordinary_sigkill_is_137_without_the_oom_line() {
    let o = run_vm(&[], &["sh", "-c", "kill -9 $$"]);
    assert_eq!(o.code, 137, "{o:?}");
    assert!(!o.stderr.contains("out of memory"), "{o:?}");
}

#[test]
fn filling_tmp_fails_the_write_not_the_run() {
    // /tmp is a tmpfs capped at half the guest's RAM: 128 MiB of 256.
    let o = run_vm(
        &["--mem", "256"],
        &[
            "sh",
            "-c",
            "head -c 1000000000 /dev/zero > /tmp/fill; echo \"write status $?\"; \
             rm /tmp/fill; echo x > /tmp/after && echo tmp-usable-again",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(
        o.stdout_str(),
        "write status 1\ntmp-usable-again\n",
        "{o:?}"
    );
    assert!(o.stderr.contains("No space left on device"), "{o:?}");
}

#[test]
fn a_workload_that_closes_stdout_early_still_reports_stderr_and_status() {
    let o = run_vm(
        &[],
        &["sh", "-c", "exec >&-; echo to-stderr >&2; sleep 1; exit 3"],
    );
    assert_eq!(o.code, 3, "{o:?}");
    assert_eq!(o.stderr, "to-stderr\n", "{o:?}");
    assert!(o.stdout.is_empty(), "{o:?}");
}

#[test]
fn a_guest_kernel_panic_is_125_with_the_panic_on_stderr() {
    let o = run_vm(
        &["--user", "0:0"],
        &["sh", "-c", "echo c > /proc/sysrq-trigger; sleep 100"],
    );
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr.starts_with(
            "amvm: the guest stopped (its kernel panicked) without reporting an exit status"
        ),
        "{o:?}"
    );
    assert!(
        o.stderr
            .contains("Kernel panic - not syncing: sysrq triggered crash"),
        "{o:?}"
    );
}
