//! Run the workload: spawn it as the spec's user in its own session and cgroup, confined (see
//! `sandbox.rs`), relay its stdout and stderr to the channel as they arrive, feed it the stdin
//! stream (`-i`), pass on the signals the host forwards (to its whole process group, as a
//! terminal would), and turn its end into one exit status byte.
//!
//! Exit status (shell convention): its own code; 128+N if signal N killed it (137 with
//! "killed: out of memory" on stderr when the OOM killer did it); 127 if the command was not
//! found; 126 if it could not be executed.
//! When the workload exits, whatever it left running (background children still holding its
//! pipes) is killed, so the run ends with the workload as it does in a container.

use crate::channel::{vsock_connect, Channel, HOST_CID};
use crate::sandbox::{Cgroup, Confinement};
use guest_init::protocol::{RunSpec, STDIN_PORT};
use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::{ChildStderr, ChildStdout, Command, Stdio};

/// How often the relay checks whether the workload has exited while its pipes stay open.
const REAP_INTERVAL_MS: i32 = 50;

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("poll: {0}")]
    Poll(io::Error),
    #[error("connecting the stdin stream (port {STDIN_PORT}): {0}")]
    Stdin(io::Error),
    #[error("the workload's cgroup: {0}")]
    Cgroup(io::Error),
}

pub fn run(spec: &RunSpec, chan: &mut Channel) -> Result<u8, WorkloadError> {
    let mut cmd = command(&spec.argv, &spec.env);
    if spec.root.is_empty() {
        prepare_home(spec);
    }
    // A working directory the user cannot enter would surface as a spawn error that reads like
    // the command's; check it as the workload's user first and say what is wrong.
    if let Err(e) = can_enter(&in_root(&spec.root, &spec.cwd), spec.uid, spec.gid) {
        let cwd = String::from_utf8_lossy(&spec.cwd);
        chan.stderr(format!("amvm: cannot enter the working directory {cwd}: {e}\n").as_bytes());
        return Ok(EXIT_SETUP_FAILURE);
    }
    if spec.root.is_empty() {
        cmd.current_dir(OsStr::from_bytes(&spec.cwd));
    }
    let stdin_stream = if spec.stdin {
        let sock = vsock_connect(HOST_CID, STDIN_PORT).map_err(WorkloadError::Stdin)?;
        cmd.stdin(Stdio::piped());
        Some(std::fs::File::from(sock))
    } else {
        cmd.stdin(Stdio::null());
        None
    };
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let cgroup = Cgroup::create(spec.pids_max).map_err(WorkloadError::Cgroup)?;
    // Built before the fork: the child may not allocate.
    let mut confinement = Confinement::new(cgroup.procs(), spec.uid, spec.gid);
    if let Err(e) = confinement.in_root(&spec.root, &spec.cwd) {
        chan.stderr(format!("amvm: the root or working directory: {e}\n").as_bytes());
        return Ok(EXIT_SETUP_FAILURE);
    }
    // SAFETY: the hook runs between fork and exec and only makes async-signal-safe system calls
    // on memory built before the fork (see `Confinement::enter`).
    unsafe { cmd.pre_exec(move || confinement.enter()) };
    let name = String::from_utf8_lossy(&spec.argv[0]).into_owned();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let (status, why) = spawn_failure(&name, &e);
            chan.stderr(why.as_bytes());
            return Ok(status);
        }
    };
    let pid = child.id() as libc::pid_t;
    if let (Some(mut from), Some(mut to)) = (stdin_stream, child.stdin.take()) {
        // Its own thread: a workload that does not read stdin must not stall its output. The
        // copy ends at the host's EOF (then the workload sees EOF) or when the workload is gone.
        let _ = std::thread::Builder::new()
            .name("stdin".into())
            .spawn(move || {
                let _ = io::copy(&mut from, &mut to);
            });
    }
    let out = child.stdout.take().expect("piped stdout");
    let err = child.stderr.take().expect("piped stderr");
    let status = relay(pid, out, err, chan)?;
    if status == 128 + libc::SIGKILL as u8 && cgroup.oom_kills() > 0 {
        chan.stderr(b"amvm: killed: out of memory\n");
    }
    Ok(status)
}

/// `argv` with exactly the environment `env` (`KEY=VALUE` entries).
pub(crate) fn command(argv: &[Vec<u8>], env: &[Vec<u8>]) -> Command {
    let mut cmd = Command::new(OsStr::from_bytes(&argv[0]));
    cmd.args(argv[1..].iter().map(|a| OsStr::from_bytes(a)));
    cmd.env_clear();
    for kv in env {
        let (k, v) = match kv.iter().position(|&b| b == b'=') {
            Some(i) => (&kv[..i], &kv[i + 1..]),
            None => (&kv[..], &b""[..]),
        };
        cmd.env(OsStr::from_bytes(k), OsStr::from_bytes(v));
    }
    cmd
}

/// The exit status and the stderr line for a command that could not be started.
pub(crate) fn spawn_failure(name: &str, e: &io::Error) -> (u8, String) {
    let (status, why) = match e.raw_os_error() {
        Some(libc::ENOENT) => (127, "command not found".to_string()),
        Some(libc::EACCES) | Some(libc::ENOEXEC) | Some(libc::EISDIR) => {
            (126, format!("cannot execute: {e}"))
        }
        _ => (126, format!("cannot start: {e}")),
    };
    (status, format!("amvm: {name}: {why}\n"))
}

/// The shell-convention status of a `waitpid` status: the code, or 128+N for signal N.
pub(crate) fn status_byte(wstatus: libc::c_int) -> Option<u8> {
    if libc::WIFEXITED(wstatus) {
        Some(libc::WEXITSTATUS(wstatus) as u8)
    } else if libc::WIFSIGNALED(wstatus) {
        Some((128 + libc::WTERMSIG(wstatus)) as u8)
    } else {
        None
    }
}

/// amvm's own failure status (design.md): the workload could not be started as asked.
pub(crate) const EXIT_SETUP_FAILURE: u8 = 125;

/// Whether `uid`/`gid` may enter directory `dir` (search permission on it and every parent),
/// checked with the file-system ids switched to them for the duration of the check.
pub(crate) fn can_enter(dir: &[u8], uid: u32, gid: u32) -> io::Result<()> {
    let path =
        std::ffi::CString::new(dir).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if !std::path::Path::new(OsStr::from_bytes(dir)).is_dir() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"));
    }
    // The file-system ids below change only this thread's, and are restored before its next
    // file access.
    // SAFETY: setfsgid takes a plain integer.
    let old_gid = unsafe { libc::setfsgid(gid) };
    // SAFETY: setfsuid takes a plain integer.
    let old_uid = unsafe { libc::setfsuid(uid) };
    // access(2) would check the real ids; with AT_EACCESS the check uses the file-system ids
    // set above (and the capabilities they leave).
    // SAFETY: `path` is a valid NUL-terminated string for the call's duration.
    let rc =
        unsafe { libc::faccessat(libc::AT_FDCWD, path.as_ptr(), libc::X_OK, libc::AT_EACCESS) };
    let err = io::Error::last_os_error();
    // SAFETY: setfsuid takes a plain integer.
    unsafe { libc::setfsuid(old_uid as libc::uid_t) };
    // SAFETY: setfsgid takes a plain integer.
    unsafe { libc::setfsgid(old_gid as libc::gid_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(err)
    }
}

/// Give the workload a `$HOME` it owns (on the in-memory root; it vanishes with the VM).
fn prepare_home(spec: &RunSpec) {
    prepare_home_for(&spec.env, spec.uid, spec.gid);
}

/// `path` (absolute, inside the processes' root) as the guest sees it: under `root` when that
/// is a container's.
pub(crate) fn in_root(root: &[u8], path: &[u8]) -> Vec<u8> {
    if root.is_empty() {
        return path.to_vec();
    }
    let mut p = root.to_vec();
    if !path.starts_with(b"/") {
        p.push(b'/');
    }
    p.extend_from_slice(path);
    p
}

/// Create `$HOME` of `env` for `uid`:`gid` when it does not exist yet.
pub(crate) fn prepare_home_for(env: &[Vec<u8>], uid: u32, gid: u32) {
    let Some(home) = env.iter().find_map(|kv| kv.strip_prefix(b"HOME=")) else {
        return;
    };
    let home = std::path::Path::new(OsStr::from_bytes(home));
    if home.is_absolute() && !home.exists() && std::fs::create_dir_all(home).is_ok() {
        let _ = std::os::unix::fs::chown(home, Some(uid), Some(gid));
    }
}

/// Forward output until the workload has exited and both pipes are closed.
fn relay(
    pid: libc::pid_t,
    mut out: ChildStdout,
    mut err: ChildStderr,
    chan: &mut Channel,
) -> Result<u8, WorkloadError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = [true, true];
    let mut status: Option<u8> = None;
    let mut chan_open = true;
    loop {
        if status.is_none() {
            status = reap(pid);
            if status.is_some() {
                // The workload is gone: end whatever it left behind so its pipes close.
                // SAFETY: kill(-1, SIGKILL) from PID 1 signals every other process; no memory involved.
                unsafe { libc::kill(-1, libc::SIGKILL) };
            }
        }
        if !open[0] && !open[1] {
            if let Some(s) = status {
                return Ok(s);
            }
        }
        for sig in chan.take_signals() {
            forward_signal(pid, sig, status.is_some());
        }
        let mut fds = [
            libc::pollfd {
                fd: if chan_open { chan.fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if open[0] { out.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if open[1] { err.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of three pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, REAP_INTERVAL_MS) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(WorkloadError::Poll(e));
        }
        if fds[0].revents != 0 {
            // Closed or broken: poll keeps reporting it, so stop watching it.
            if let crate::channel::Incoming::Closed = chan.receive() {
                chan_open = false;
            }
        }
        for (i, pfd) in fds[1..].iter().enumerate() {
            if !open[i] || pfd.revents == 0 {
                continue;
            }
            let r = if i == 0 {
                out.read(&mut buf)
            } else {
                err.read(&mut buf)
            };
            match r {
                Ok(0) | Err(_) => open[i] = false,
                Ok(n) if i == 0 => chan.stdout(&buf[..n]),
                Ok(n) => chan.stderr(&buf[..n]),
            }
        }
    }
}

/// Send `sig` to the workload's process group (it leads its own session), unless it is gone.
fn forward_signal(pid: libc::pid_t, sig: u8, exited: bool) {
    let sig = libc::c_int::from(sig);
    if exited || !(1..=64).contains(&sig) {
        return;
    }
    // SAFETY: kill(2) with plain integers; a vanished group gives ESRCH, which is fine.
    unsafe { libc::kill(-pid, sig) };
}

/// Reap every exited child (PID 1 inherits orphans); return the workload's status once it exits.
fn reap(pid: libc::pid_t) -> Option<u8> {
    let mut found = None;
    loop {
        let mut wstatus = 0;
        // SAFETY: waitpid with a valid pointer to an int.
        let r = unsafe { libc::waitpid(-1, &mut wstatus, libc::WNOHANG) };
        if r <= 0 {
            return found;
        }
        if r == pid {
            if let Some(s) = status_byte(wstatus) {
                found = Some(s);
            }
        }
    }
}
