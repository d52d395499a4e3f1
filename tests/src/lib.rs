//! A small framework for integration tests that boot real microVMs with the `amvm` binary.
//!
//! Tests run on a machine with a hardware-virtualization /dev/kvm — directly, or inside the
//! emulated KVM host of `tests/kvm-host/run` (README.md's test command does that). Without a
//! usable KVM, [`require_kvm`] fails the test with the reason: no test passes by skipping.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Guard against a hung guest: every VM run gets this `--timeout` (not a speed assertion).
pub const RUN_TIMEOUT_SECS: &str = "300";

/// The `amvm` binary under test: `$AMVM_BIN`, else the one beside this test's build
/// (`target/<profile>/amvm`, this executable being `target/<profile>/deps/<test>-<hash>`).
pub fn amvm_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("AMVM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .join("amvm");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build -p amvm` first (or set AMVM_BIN)",
        bin.display()
    );
    bin
}

/// Fail loudly unless this process can open a KVM device that can run guests.
pub fn require_kvm() {
    let path = std::env::var("AMVM_KVM_DEVICE").unwrap_or_else(|_| "/dev/kvm".into());
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        panic!("KVM is required and {path} cannot be opened ({e}): run the tests through tests/kvm-host/run (README.md's test command)");
    }
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        panic!("{path} is PVM (software-only KVM), which cannot run the guest: run the tests through tests/kvm-host/run (README.md's test command)");
    }
}

/// What one `amvm` invocation produced.
#[derive(Debug)]
pub struct Outcome {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Outcome {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Run `amvm` with `args` and any extra environment, capturing everything.
pub fn amvm<I, S>(args: I, env: &[(&str, &str)]) -> Outcome
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(amvm_bin());
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawning amvm");
    Outcome {
        code: out
            .status
            .code()
            .unwrap_or_else(|| panic!("amvm killed by a signal: {:?}", out.status)),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Boot a VM that runs `command` (after `amvm run [opts] --`), with a hang guard.
pub fn run_vm(opts: &[&str], command: &[&str]) -> Outcome {
    require_kvm();
    let mut args: Vec<&str> = vec!["run"];
    if !opts.contains(&"--timeout") {
        args.extend_from_slice(&["--timeout", RUN_TIMEOUT_SECS]);
    }
    args.extend_from_slice(opts);
    args.push("--");
    args.extend_from_slice(command);
    amvm(args, &[])
}

/// `sh -c SCRIPT` in a VM with default options.
pub fn sh(script: &str) -> Outcome {
    run_vm(&[], &["sh", "-c", script])
}
