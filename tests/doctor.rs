//! `amvm doctor` (issue 23): on a host that can run a sandbox every check is `ok` and the smoke
//! VM boots our guest kernel; where something is missing the failing check says what to do and
//! the exit status is 1. (On a PVM host, tests/run checks that the doctor names PVM.)

use amvm_tests::{amvm_bin, require_kvm};
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Output, Stdio};

fn doctor(wrap: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    require_kvm();
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(amvm_bin());
            c
        }
        None => Command::new(amvm_bin()),
    };
    let Output {
        status,
        stdout,
        stderr,
    } = cmd
        .arg("doctor")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("running amvm doctor");
    (
        status.code(),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// The line of check `name` (its status word first).
fn line<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| l.get(6..).is_some_and(|rest| rest.starts_with(name)))
        .unwrap_or_else(|| panic!("no {name} line in\n{out}"))
}

#[test]
fn the_doctor_passes_where_a_sandbox_can_run_and_boots_our_kernel() {
    let (code, out, err) = doctor(&[], &[]);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    for name in [
        "kvm kind",
        "kvm access",
        "guest kernel",
        "virtiofsd",
        "namespaces",
        "cgroup v2",
        "smoke VM",
    ] {
        assert!(line(&out, name).starts_with("ok "), "{name}:\n{out}");
    }
    let smoke = line(&out, "smoke VM");
    // Our guest kernel (6.12), not the emulated host's Debian 6.1.
    assert!(smoke.contains("(guest kernel 6.12."), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
    assert!(out.ends_with("doctor: a sandbox can run here\n"), "{out}");
}

#[test]
fn the_doctor_names_the_kvm_group_to_a_user_outside_it_and_boots_nothing() {
    require_kvm();
    let kvm = std::fs::metadata("/dev/kvm").expect("/dev/kvm");
    assert_eq!(
        kvm.mode() & 0o006,
        0,
        "/dev/kvm must not be open to all for this test"
    );
    let (code, out, err) = doctor(
        &[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ],
        &[("HOME", "/nonexistent")],
    );
    assert_eq!(code, Some(1), "stdout:\n{out}\nstderr:\n{err}");
    let access = line(&out, "kvm access");
    assert!(access.starts_with("FAIL"), "{out}");
    assert!(access.contains("no permission to open /dev/kvm"), "{out}");
    assert!(
        out.contains("fix: sudo usermod -aG kvm $USER, then log in again"),
        "{out}"
    );
    // The kernel and virtiofsd root installed are found for this user too.
    assert!(line(&out, "guest kernel").starts_with("ok "), "{out}");
    assert!(line(&out, "virtiofsd").starts_with("ok "), "{out}");
    assert!(
        line(&out, "smoke VM").contains("not tried: a check above failed"),
        "{out}"
    );
    assert!(out.ends_with("doctor: a sandbox cannot run here yet (see FAIL above)\n"));
}

#[test]
fn the_doctor_says_how_to_get_a_missing_kernel() {
    let (code, out, err) = doctor(&[], &[("AMVM_KERNEL", "/nonexistent/vmlinux")]);
    assert_eq!(code, Some(1), "stdout:\n{out}\nstderr:\n{err}");
    let kernel = line(&out, "guest kernel");
    assert!(
        kernel.starts_with("FAIL") && kernel.contains("/nonexistent/vmlinux does not exist"),
        "{out}"
    );
    assert!(out.contains("fix: run images/setup"), "{out}");
    assert!(line(&out, "kvm access").starts_with("ok "), "{out}");
    assert!(line(&out, "smoke VM").contains("not tried"), "{out}");
}
