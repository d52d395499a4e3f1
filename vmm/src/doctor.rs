//! `amvm doctor`: can a sandbox run on this host, and if not, what to do about it.
//!
//! Each check prints one line (`ok`, `warn` or `FAIL`, what it looked at, what it found) and,
//! when it is not `ok`, a `fix:` line. The last check boots a real VM (a child `amvm run` of
//! this same binary, so the doctor's own process enters no namespace): it is tried only when
//! every check before it that a run needs passed. The exit status is 0 only when that VM ran.

use crate::vstate::kvm::{self, Kvm, KvmError};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// Not needed for a run, but worth knowing.
    Warn,
    /// A run cannot work until this is fixed.
    Fail,
}

/// One check's outcome.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub found: String,
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, found: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            found: found.into(),
            fix: None,
        }
    }

    fn bad(name: &'static str, status: Status, found: impl Into<String>, fix: &str) -> Check {
        Check {
            name,
            status,
            found: found.into(),
            fix: Some(fix.into()),
        }
    }
}

/// How long the smoke VM may take before the doctor gives up on it (a hang guard: an emulated
/// or loaded host boots in seconds, not minutes).
const SMOKE_TIMEOUT_SECS: u64 = 120;

/// Run every check, print each as it completes, return whether a sandbox can run here.
pub fn run(out: &mut impl Write) -> bool {
    let mut all = Vec::new();
    let mut report = |c: Check, out: &mut dyn Write| {
        let tag = match c.status {
            Status::Ok => "ok  ",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        };
        let _ = writeln!(out, "{tag}  {:<12}  {}", c.name, c.found);
        if let Some(fix) = &c.fix {
            let _ = writeln!(out, "      {:<12}  fix: {fix}", "");
        }
        let _ = out.flush();
        all.push(c.status);
    };
    let kvm_ok = {
        let (kind, open) = kvm_checks();
        let ok = open.status == Status::Ok;
        report(kind, out);
        report(open, out);
        ok
    };
    let kernel = kernel_check();
    let kernel_ok = kernel.status == Status::Ok;
    report(kernel, out);
    let virtiofsd = virtiofsd_check();
    let virtiofsd_ok = virtiofsd.status == Status::Ok;
    report(virtiofsd, out);
    let ns = namespaces_check();
    let ns_ok = ns.status == Status::Ok;
    report(ns, out);
    report(cgroup_check(), out);
    let smoke = if kvm_ok && kernel_ok && virtiofsd_ok && ns_ok {
        smoke_check()
    } else {
        Check::bad(
            "smoke VM",
            Status::Fail,
            "not tried: a check above failed",
            "fix those first, then run amvm doctor again",
        )
    };
    let ran = smoke.status == Status::Ok;
    report(smoke, out);
    let _ = writeln!(
        out,
        "{}",
        if ran {
            "doctor: a sandbox can run here"
        } else {
            "doctor: a sandbox cannot run here yet (see FAIL above)"
        }
    );
    ran && !all.contains(&Status::Fail)
}

/// What kind of KVM this is, and whether amvm can open and use it.
fn kvm_checks() -> (Check, Check) {
    let path = kvm::device_path();
    let shown = path.display().to_string();
    let kind = match kvm::virtualization() {
        kvm::Virtualization::Pvm => Check::bad(
            "kvm kind",
            Status::Fail,
            format!("{shown} is PVM, a software-only KVM (no vmx/svm CPU flag): guests run emulated and a stock guest kernel crashes"),
            "use a host with VT-x or AMD-V (nested virtualization enabled, in a VM); here, run amvm through tests/kvm-host/run",
        ),
        kvm::Virtualization::None => Check::bad(
            "kvm kind",
            Status::Fail,
            "no vmx or svm flag in /proc/cpuinfo: no hardware virtualization",
            "enable VT-x/AMD-V in the firmware, or nested virtualization for this VM (WSL2: nestedVirtualization=true)",
        ),
        kvm::Virtualization::Hardware(flag) => {
            Check::ok("kvm kind", format!("hardware virtualization ({flag})"))
        }
    };
    let open = match Kvm::open_path(&path) {
        Ok(_) => Check::ok(
            "kvm access",
            format!("{shown} opens read-write and has what amvm needs"),
        ),
        Err(e @ KvmError::NoDevice(_)) => Check::bad(
            "kvm access",
            Status::Fail,
            e.to_string(),
            "load kvm_intel or kvm_amd (modprobe), after enabling virtualization",
        ),
        Err(e @ KvmError::NoPermission(_)) => Check::bad(
            "kvm access",
            Status::Fail,
            e.to_string(),
            "sudo usermod -aG kvm $USER, then log in again (or run `newgrp kvm`)",
        ),
        Err(KvmError::Pvm(_) | KvmError::NoHardwareVirt(_)) => Check {
            name: "kvm access",
            status: Status::Fail,
            found: format!("{shown} opens, but cannot run amvm's guest (see kvm kind)"),
            fix: None,
        },
        Err(e) => Check::bad(
            "kvm access",
            Status::Fail,
            e.to_string(),
            "a newer host kernel with KVM built in full",
        ),
    };
    (kind, open)
}

fn kernel_check() -> Check {
    match crate::config::default_kernel() {
        Ok(k) if k.is_file() => Check::ok("guest kernel", k.display().to_string()),
        Ok(k) => Check::bad(
            "guest kernel",
            Status::Fail,
            format!("{} does not exist", k.display()),
            "run images/setup (as root it installs for every user), or point AMVM_KERNEL at a kernel",
        ),
        Err(e) => Check::bad(
            "guest kernel",
            Status::Fail,
            e.to_string(),
            "run images/setup (as root it installs for every user)",
        ),
    }
}

fn virtiofsd_check() -> Check {
    let cache = crate::config::cache_dir().unwrap_or_default();
    let bin = crate::fs::virtiofsd_path(&cache);
    match crate::fs::check_version(&bin, None) {
        Ok(()) => Check::ok(
            "virtiofsd",
            format!("{} ({})", bin.display(), crate::fs::VIRTIOFSD_VERSION),
        ),
        Err(e) => Check::bad(
            "virtiofsd",
            Status::Fail,
            e.to_string(),
            "run images/setup (as root it installs for every user), or point AMVM_VIRTIOFSD at virtiofsd",
        ),
    }
}

/// The namespaces every run enters (jail.rs), tried for real in a child process that exits
/// at once.
fn namespaces_check() -> Check {
    // SAFETY: geteuid cannot fail and takes no pointers.
    let root = unsafe { libc::geteuid() } == 0;
    let flags = if root {
        libc::CLONE_NEWNET | libc::CLONE_NEWNS
    } else {
        libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::CLONE_NEWNS
    };
    // SAFETY: fork(2) in the doctor, which has started no thread of its own; the child makes
    // one system call and _exits, touching no lock or allocation.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: unshare(2) with flags only: async-signal-safe.
        let r = unsafe { libc::unshare(flags) };
        // Reading errno allocates nothing.
        let code = match r {
            0 => 0,
            _ => std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(255),
        };
        // SAFETY: _exit(2) ends the child without running anything of the parent's.
        unsafe { libc::_exit(code) };
    }
    let what = if root {
        "network and mount namespaces"
    } else {
        "user, network and mount namespaces"
    };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        return Check::bad(
            "namespaces",
            Status::Fail,
            format!("fork: {e}"),
            "free a process slot",
        );
    }
    let mut status = 0;
    // SAFETY: waitpid(2) for the child just forked, into a local.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    let code = if r == pid && libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    if code == 0 {
        return Check::ok("namespaces", format!("{what} can be made"));
    }
    let why = if code > 0 {
        std::io::Error::from_raw_os_error(code).to_string()
    } else {
        "the probe did not exit".into()
    };
    let fix = if root {
        "inside a container, allow unshare (docker run --privileged, or --security-opt seccomp=unconfined)"
    } else {
        "set sysctl user.max_user_namespaces above 0 (and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0), or run amvm as root"
    };
    Check::bad(
        "namespaces",
        Status::Fail,
        format!("cannot make {what}: {why}"),
        fix,
    )
}

/// cgroup v2 is not needed by `amvm run` today (limits are set inside the guest), but the
/// sandboxes' host-side limits will want it: a warning, never a failure.
fn cgroup_check() -> Check {
    let controllers = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers");
    match controllers {
        Ok(c) => Check::ok(
            "cgroup v2",
            format!("/sys/fs/cgroup (controllers: {})", c.trim()),
        ),
        Err(_) => Check::bad(
            "cgroup v2",
            Status::Warn,
            "no unified cgroup hierarchy at /sys/fs/cgroup (not needed by amvm run)",
            "boot with systemd.unified_cgroup_hierarchy=1 (Debian 11 and later do by default)",
        ),
    }
}

/// Boot a VM that prints its kernel release, as a child `amvm run` of this binary.
fn smoke_check() -> Check {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let start = Instant::now();
    let out = Command::new(&exe)
        .args([
            "run",
            "--timeout",
            &SMOKE_TIMEOUT_SECS.to_string(),
            "--",
            "uname",
            "-r",
        ])
        .stdin(Stdio::null())
        .output();
    let took = start.elapsed();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            return Check::bad(
                "smoke VM",
                Status::Fail,
                format!("cannot start {}: {e}", exe.display()),
                "reinstall amvm",
            )
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => Check::ok(
            "smoke VM",
            format!(
                "booted and ran `uname -r` (guest kernel {}) in {}",
                stdout.trim(),
                seconds(took)
            ),
        ),
        code => {
            let first = stderr.lines().next().unwrap_or("no message");
            Check::bad(
                "smoke VM",
                Status::Fail,
                format!(
                    "`amvm run -- uname -r` exited {} after {}: {first}",
                    code.map_or("on a signal".into(), |c| c.to_string()),
                    seconds(took)
                ),
                "run `amvm run --console -- uname -r` to see the guest's kernel log",
            )
        }
    }
}

fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}
