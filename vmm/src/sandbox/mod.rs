//! Long-lived sandboxes (`amvm create`, `exec`, `ls`, `inspect`, `stop`, `rm`, `wait`).
//!
//! Each sandbox is one supervisor process ([`supervisor`]) with a state directory
//! `$XDG_RUNTIME_DIR/amvm/ID` (else `/run/amvm/ID` for root, `/tmp/amvm-UID/ID` for others),
//! mode 0700 so only its owner reaches it:
//! * `api.sock`: the JSON API over HTTP/1.1 (docs/api.md), which the CLI and [`client`] use;
//! * `guest.sock`: where the VMM child connects the guest's control and exec streams;
//! * `state.json`: the [`Info`] the supervisor last wrote, read by `ls` and after it is gone;
//! * `vmm.log`: the VMM's stderr.
//!
//! Names live in `names/NAME`, a symlink to the id made with `symlink(2)` (atomic: two creates
//! of one name cannot both win).

pub mod api;
pub mod client;
pub mod commands;
pub mod copy;
pub mod http;
pub mod run;
pub mod serve;
pub mod supervisor;

use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("no sandbox {0} (amvm ls lists them)")]
    NotFound(String),
    #[error("the name {0} is in use by sandbox {1}")]
    NameInUse(String, String),
    #[error("--name {0}: use letters, digits, '.', '_' and '-' (at most 64, not starting with '.' or '-')")]
    BadName(String),
    #[error("--label {0}: say KEY=VAL")]
    BadLabel(String),
    #[error("sandbox {0} is not running ({1})")]
    NotRunning(String, String),
    #[error("sandbox {0} is running: stop it first, or rm -f")]
    Running(String),
    #[error("sandbox {0} is paused: `amvm resume {0}` first")]
    Paused(String),
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("{0}: {1}")]
    Io(String, io::Error),
    #[error("sandbox {0}: the API answered {1}: {2}")]
    Api(String, u16, String),
    #[error("sandbox {0}: {1}")]
    Protocol(String, String),
    #[error("the sandbox did not start: {0}")]
    Start(String),
    #[error("cp: {0}")]
    Copy(String),
    #[error(
        "sandbox {0} has no writable workspace (amvm create --workspace DIR:overlay makes one)"
    )]
    NoOverlay(String),
    #[error("{0}")]
    Changes(String),
    #[error("{0} is not supported by amvm create yet")]
    Unsupported(&'static str),
    /// A run's VMM ended before its guest was ready, with this status (it said why).
    #[error("the VM ended with status {0} before it was ready")]
    Ended(u8),
    #[error("serve: {0}")]
    Serve(String),
    #[error("create: {0}")]
    CreateFailed(String),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

impl Info {
    /// Its supervisor is up: starting, running, paused or stopping.
    pub fn live(&self) -> bool {
        matches!(
            self.state.as_str(),
            "starting" | "running" | "paused" | "stopping"
        )
    }
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> SandboxError {
    let what = what.to_string();
    move |e| SandboxError::Io(what, e)
}

/// What a sandbox is and how it is doing: `state.json`, `GET /v1/sandbox`, `amvm inspect`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Info {
    pub id: String,
    pub name: Option<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    /// "starting", "running", "paused" (`amvm pause`: its vCPUs stopped), "stopping", "stopped"
    /// (by `amvm stop`), "exited" (the VM ended
    /// on its own: --timeout, a crash, the VMM killed), or "dead" (`ls`: the supervisor is gone
    /// without saying so).
    pub state: String,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// The supervisor's pid, and the VMM's.
    pub pid: u32,
    pub vmm_pid: u32,
    /// Their start times (clock ticks after boot, /proc/PID/stat), which tell them from a
    /// process that reused the pid.
    #[serde(default)]
    pub pid_start: u64,
    #[serde(default)]
    pub vmm_start: u64,
    /// How many execs have started.
    pub execs: u64,
    /// How the VM ended (once it has), in words.
    pub ended: Option<String>,
    /// The VMM's exit status once it exited (absent while it runs, or when a signal killed
    /// it): 0 when the guest shut down, 124 for `--timeout`, 125 for a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm_exit: Option<u8>,
    /// Made by `amvm run` for its command, and removed by it; one whose run was killed
    /// outright (`dead`) is removed by the next `amvm run`, unless it holds an overlay's
    /// changes (then `amvm diff`/`commit` read them and `amvm rm` removes it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub run: bool,
    pub config: Config,
}

/// The sandbox's configuration, as `amvm create` was given it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Config {
    pub mem_mib: u64,
    pub cpus: u8,
    pub system: String,
    pub workspace: Option<PathBuf>,
    pub egress: Option<PathBuf>,
    pub timeout_seconds: Option<u64>,
    /// With `--workspace DIR:overlay`: DIR (canonical) and the overlay's scratch directory on
    /// the host (its `upper/` holds what the guest wrote).
    #[serde(default)]
    pub overlay_lower: Option<PathBuf>,
    #[serde(default)]
    pub overlay_scratch: Option<PathBuf>,
    /// `--overlay-size` in bytes: the scratch directory is then a tmpfs in the supervisor's own
    /// mount namespace, seen by others through `/proc/PID/root` (overlay.rs).
    #[serde(default)]
    pub overlay_size: Option<u64>,
    /// Stopped once no exec has run for this long (`--idle-timeout`).
    #[serde(default)]
    pub idle_timeout_seconds: Option<u64>,
    /// The guest kernel it booted (a snapshot records its SHA-256; a restore needs the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// The execs' defaults.
    pub user: String,
    pub workdir: String,
    pub env: Vec<String>,
    /// `--egress-allow`: the gateway its supervisor runs for it (instead of `egress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_gateway: Option<crate::config::GatewaySpec>,
    /// `--image`: the image's whole name (its root is the sandbox's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// `-v HOST:GUEST[:ro|rw]`, each HOST absolute (a snapshot's restore makes them again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
}

/// Where this user's sandboxes live.
pub fn base_dir() -> PathBuf {
    if let Some(d) = BASE_DIR.get() {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Path::new(&d).join("amvm");
    }
    // SAFETY: getuid(2) takes nothing and cannot fail.
    match unsafe { libc::getuid() } {
        0 => PathBuf::from("/run/amvm"),
        uid => PathBuf::from(format!("/tmp/amvm-{uid}")),
    }
}

static BASE_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Keep this process's sandboxes in `dir` instead (the OCI runtime's, under its `--root`).
pub fn set_base_dir(dir: PathBuf) {
    let _ = BASE_DIR.set(dir);
}

/// `dir` as a 0700 directory of ours (made if missing).
fn private_dir(dir: &Path) -> Result<(), SandboxError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) => return Err(io_err(dir.display())(e)),
    }
    let md = std::fs::symlink_metadata(dir).map_err(io_err(dir.display()))?;
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !md.is_dir() || md.uid() != me || md.mode() & 0o077 != 0 {
        return Err(SandboxError::Io(
            dir.display().to_string(),
            io::Error::other("not a private directory of this user (want mode 0700, ours)"),
        ));
    }
    Ok(())
}

/// A fresh id: 12 hex digits from the kernel's random pool.
fn new_id() -> Result<String, SandboxError> {
    let mut b = [0u8; 6];
    // SAFETY: getrandom(2) fills the 6-byte buffer it is given.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(io_err("getrandom")(io::Error::last_os_error()));
    }
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && !n.starts_with(['.', '-'])
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

fn valid_id(id: &str) -> bool {
    id.len() == 12 && id.bytes().all(|c| c.is_ascii_hexdigit())
}

/// A sandbox's state directory, made: its id, its path. The name (if any) is claimed too.
pub fn make_dir(name: Option<&str>) -> Result<(String, PathBuf), SandboxError> {
    let base = base_dir();
    private_dir(&base)?;
    if let Some(n) = name {
        if !valid_name(n) {
            return Err(SandboxError::BadName(n.into()));
        }
    }
    let id = new_id()?;
    let dir = base.join(&id);
    std::fs::create_dir(&dir).map_err(io_err(dir.display()))?;
    if let Some(n) = name {
        let names = base.join("names");
        private_dir(&names)?;
        if let Err(e) = std::os::unix::fs::symlink(&id, names.join(n)) {
            let _ = std::fs::remove_dir(&dir);
            if e.kind() == io::ErrorKind::AlreadyExists {
                let other = std::fs::read_link(names.join(n))
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                return Err(SandboxError::NameInUse(n.into(), other));
            }
            return Err(io_err(names.join(n).display())(e));
        }
    }
    Ok((id, dir))
}

/// The id that `id_or_name` means, and its directory.
pub fn resolve(id_or_name: &str) -> Result<(String, PathBuf), SandboxError> {
    let base = base_dir();
    let not_found = || SandboxError::NotFound(id_or_name.into());
    let id = if valid_id(id_or_name) && base.join(id_or_name).is_dir() {
        id_or_name.to_string()
    } else if valid_name(id_or_name) {
        let link =
            std::fs::read_link(base.join("names").join(id_or_name)).map_err(|_| not_found())?;
        let id = link.to_string_lossy().into_owned();
        if !valid_id(&id) {
            return Err(not_found());
        }
        id
    } else {
        return Err(not_found());
    };
    let dir = base.join(&id);
    if !dir.join("state.json").is_file() {
        return Err(not_found());
    }
    Ok((id, dir))
}

/// Write `info` as `dir/state.json`, whole or not at all (a temporary file renamed over it).
pub fn write_state(dir: &Path, info: &Info) -> io::Result<()> {
    let tmp = dir.join("state.json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(info).map_err(io::Error::other)?,
    )?;
    std::fs::rename(&tmp, dir.join("state.json"))
}

/// `dir/state.json`, with "dead" for a sandbox whose supervisor is gone while it said running.
pub fn read_state(dir: &Path) -> Result<Info, SandboxError> {
    let path = dir.join("state.json");
    let raw = std::fs::read(&path).map_err(io_err(path.display()))?;
    let mut info: Info = serde_json::from_slice(&raw)
        .map_err(|e| SandboxError::Io(path.display().to_string(), io::Error::other(e)))?;
    let supervised = if info.pid_start != 0 {
        is_ours(info.pid, info.pid_start)
    } else {
        alive(info.pid)
    };
    if info.live() && !supervised {
        info.state = "dead".into();
        info.ended
            .get_or_insert_with(|| "its supervisor is gone".into());
    }
    Ok(info)
}

/// Whether process `pid` exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the field after the parenthesised command name.
        Ok(s) => s
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Every sandbox of this user, oldest first.
pub fn list() -> Result<Vec<Info>, SandboxError> {
    let base = base_dir();
    let entries = match std::fs::read_dir(&base) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(base.display())(e)),
    };
    let mut all = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if valid_id(&name) {
            if let Ok(info) = read_state(&e.path()) {
                all.push(info);
            }
        }
    }
    all.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
    Ok(all)
}

/// Remove a sandbox that is not running: its directory and its name.
pub fn remove(id: &str, dir: &Path) -> Result<(), SandboxError> {
    let info = read_state(dir)?;
    if info.live() {
        return Err(SandboxError::Running(id.into()));
    }
    // A VMM left behind by a supervisor killed outright dies with it (PR_SET_PDEATHSIG); make
    // sure of it before the directory goes.
    if is_ours(info.vmm_pid, info.vmm_start) {
        // SAFETY: kill(2) with plain integers.
        unsafe { libc::kill(info.vmm_pid as libc::pid_t, libc::SIGKILL) };
    }
    remove_dir_and_name(id, dir, info.name.as_deref())?;
    if let Some(scratch) = &info.config.overlay_scratch {
        crate::overlay::remove_scratch(scratch);
    }
    Ok(())
}

/// Remove `dir` and the name that points at `id`.
fn remove_dir_and_name(id: &str, dir: &Path, name: Option<&str>) -> Result<(), SandboxError> {
    if let Some(n) = name {
        let link = base_dir().join("names").join(n);
        if std::fs::read_link(&link).is_ok_and(|t| t.as_os_str() == id) {
            let _ = std::fs::remove_file(&link);
        }
    }
    std::fs::remove_dir_all(dir).map_err(io_err(dir.display()))
}

/// Whether `pid` is still the process this sandbox started (it started when the sandbox
/// recorded), not an unrelated one that reused the number.
pub(crate) fn is_ours(pid: u32, start: u64) -> bool {
    pid != 0 && start != 0 && start_time(pid) == Some(start)
}

/// When process `pid` started (clock ticks after boot: /proc/PID/stat's 22nd field); `None`
/// when there is no such process, or only its zombie.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (2nd field) may hold spaces and parentheses: count from its end.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split(' ');
    if fields.next()? == "Z" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Seconds since the Unix epoch.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids() {
        for good in ["a", "agent-1", "x.y_z", &"n".repeat(64)] {
            assert!(valid_name(good), "{good}");
        }
        for bad in ["", ".x", "-x", "a/b", "a b", "..", &"n".repeat(65), "é"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(valid_id("0123456789ab"));
        assert!(!valid_id("0123456789a") && !valid_id("0123456789ag"));
        let a = new_id().unwrap();
        assert!(valid_id(&a) && a != new_id().unwrap());
    }
}
