//! The virtio-fs shares' backends: one `virtiofsd` per share, started read-only with its own
//! namespace sandbox and seccomp filter, connected over a socket that never stays in the
//! filesystem, and killed on every way amvm ends.
//!
//! * The socket: amvm binds a listener in a fresh 0700 directory, connects to it (the connection
//!   waits in the backlog), removes the socket and the directory, and hands the listener to
//!   virtiofsd (`--fd`). Nothing is left on disk even if amvm is killed a moment later.
//! * Lifetime: virtiofsd gets `PR_SET_PDEATHSIG` = SIGKILL (it dies with amvm's main thread,
//!   whatever kills amvm), and [`Virtiofsd`]'s drop kills and reaps it on every return path.
//! * Errors: its stderr is collected, so a backend that fails to start is reported with its own
//!   words.

use crate::seccomp::{Policy, ThreadKind};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The virtiofsd release amvm is built and tested against (`images/install-virtiofsd` pins it;
/// amvm refuses another: its command line and sandbox flags are those of this version).
pub const VIRTIOFSD_VERSION: &str = "1.14.0";
/// How much of virtiofsd's stderr is kept for error reports.
const STDERR_KEEP: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("virtiofsd not found at {0} nor in /usr/local/lib/amvm (run images/setup: as root it installs it there for every user; or set AMVM_VIRTIOFSD)")]
    NotFound(PathBuf),
    #[error("{bin} is {found:?}, not the virtiofsd {VIRTIOFSD_VERSION} amvm was built and tested with (run images/setup, or point AMVM_VIRTIOFSD at that version)")]
    Version { bin: PathBuf, found: String },
    #[error("the socket for virtiofsd: {0}")]
    Socket(io::Error),
    #[error("starting virtiofsd ({bin}) for {dir}: {source}")]
    Spawn {
        bin: PathBuf,
        dir: PathBuf,
        source: io::Error,
    },
    #[error("virtiofsd for {dir} failed: {detail}{}", stderr_note(.stderr))]
    Failed {
        dir: PathBuf,
        detail: String,
        stderr: String,
    },
}

fn stderr_note(stderr: &str) -> String {
    let s = stderr.trim();
    if s.is_empty() {
        String::new()
    } else {
        format!("; its stderr:\n{s}")
    }
}

/// The virtiofsd binary: `$AMVM_VIRTIOFSD`, else the one images/setup installs in the cache,
/// else root's copy for every user in [`crate::config::SYSTEM_DIR`].
pub fn virtiofsd_path(cache: &Path) -> PathBuf {
    std::env::var_os("AMVM_VIRTIOFSD")
        .map(PathBuf::from)
        .or_else(|| crate::config::installed(Some(cache), "virtiofsd/bin/virtiofsd", "virtiofsd"))
        .unwrap_or_else(|| cache.join("virtiofsd/bin/virtiofsd"))
}

/// `bin --version` must say `virtiofsd VIRTIOFSD_VERSION`. Once per run, before the first
/// share's virtiofsd starts (every share uses the same binary). Running it costs a fork and
/// an exec on every boot (0.46 s in the emulated KVM host), so a passed check is remembered in
/// `stamps` (amvm's cache) under the binary's identity: path, device, inode, size, and its
/// modification and change times. Replacing or touching the binary changes the identity
/// (the change time cannot be set back by anyone), and the next run asks it again.
pub fn check_version(bin: &Path, stamps: Option<&Path>) -> Result<(), FsError> {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::metadata(bin) {
        Ok(m) if m.is_file() => m,
        _ => return Err(FsError::NotFound(bin.to_owned())),
    };
    let identity = format!(
        "virtiofsd {VIRTIOFSD_VERSION} dev={} ino={} size={} mtime={}.{} ctime={}.{} path={}\n",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
        bin.display()
    );
    let stamp = stamps.map(|d| {
        d.join(format!(
            "{:016x}",
            fnv1a(bin.as_os_str().as_encoded_bytes())
        ))
    });
    if let Some(stamp) = &stamp {
        if std::fs::read_to_string(stamp).is_ok_and(|s| s == identity) {
            return Ok(());
        }
    }
    let out = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|source| FsError::Spawn {
            bin: bin.to_owned(),
            dir: PathBuf::from("--version"),
            source,
        })?;
    let found = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if found != format!("virtiofsd {VIRTIOFSD_VERSION}") {
        return Err(FsError::Version {
            bin: bin.to_owned(),
            found,
        });
    }
    if let (Some(dir), Some(stamp)) = (stamps, &stamp) {
        // Best effort (a read-only cache only costs the exec next time): written aside, then
        // renamed, so a reader never sees half a stamp.
        let tmp = stamp.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, &identity))
            .and_then(|()| std::fs::rename(&tmp, stamp));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!("virtiofsd version stamp {}: {e}", stamp.display());
        }
    }
    Ok(())
}

/// 64-bit FNV-1a: a stamp's file name from the binary's path (not a security boundary: the
/// stamp's content is the whole identity, compared exactly).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One kind of id (uids or gids) for [`translate_ids`]: the workspace's owner, whoever runs
/// amvm (and so virtiofsd), and the workload's user in the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ids {
    pub owner: u32,
    pub runner: u32,
    pub workload: u32,
}

/// virtiofsd's arguments that make the workspace's owner appear in the guest as the workload's
/// user, and the workload's files come back owned by whoever runs amvm, with `flag`
/// (`--translate-uid` or `--translate-gid`):
/// * `map:WORKLOAD:RUNNER:1`: the workload's user and amvm's user are one (both ways): what the
///   workload creates is the runner's on the host, the runner's files are the workload's;
/// * `host:OWNER:WORKLOAD:1` where the owner is someone else (root's run of a user's checkout):
///   their files show as the workload's too (one way: a new file is still the runner's).
///
/// Every other id passes unchanged, as without translation. Nothing when all three are one.
/// (As root, virtiofsd then does the workload's requests as root, inside the one shared tree:
/// the workspace that was the workload's to read, or an overlay's merged view that is its to
/// write.)
pub fn translate_ids(flag: &str, ids: Ids) -> Vec<String> {
    let mut out = Vec::new();
    if ids.workload != ids.runner {
        out.push(format!("{flag}=map:{}:{}:1", ids.workload, ids.runner));
    }
    if ids.owner != ids.runner && ids.owner != ids.workload {
        out.push(format!("{flag}=host:{}:{}:1", ids.owner, ids.workload));
    }
    out
}

/// A running virtiofsd.
#[derive(Debug)]
pub struct Virtiofsd {
    child: Child,
    dir: PathBuf,
    stderr: Arc<Mutex<String>>,
}

impl Virtiofsd {
    /// Start virtiofsd serving `dir` read-only; returns it and our end of its vhost-user socket.
    /// `stable`: the tree does not change while the guest runs (a system root), so the guest
    /// may cache names and attributes for good (`--cache=always`); otherwise (a workspace the
    /// user may be editing) for about a second (`--cache=auto`).
    /// `ids`: `--translate-uid`/`--translate-gid` arguments ([`translate_ids`]), for the
    /// workspace.
    /// `socket_dir`: a directory private to this VM that goes with it (a sandbox's own), where
    /// the vhost-user socket is bound for a moment; without one, a directory of its own is made
    /// (see [`private_socket`]).
    pub fn spawn(
        bin: &Path,
        dir: &Path,
        stable: bool,
        writable: bool,
        ids: &[String],
        policy: &Policy,
        socket_dir: Option<&Path>,
    ) -> Result<(Virtiofsd, UnixStream), FsError> {
        if !bin.is_file() {
            return Err(FsError::NotFound(bin.to_owned()));
        }
        let (listener, stream) = private_socket(socket_dir).map_err(FsError::Socket)?;
        let fd = listener.as_raw_fd();
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--fd={fd}"))
            .arg("--shared-dir")
            .arg(dir)
            // Read-only, unless this is an overlay workspace's merged directory, whose writes
            // land in the overlay's upper layer (DIR itself is the lower: never written).
            .args(if writable {
                &[][..]
            } else {
                &["--readonly"][..]
            })
            .args([
                "--sandbox=namespace",
                "--seccomp=kill",
                if stable {
                    "--cache=always"
                } else {
                    "--cache=auto"
                },
                "--inode-file-handles=never",
                "--log-level=error",
            ])
            .args(ids)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: `in_child` runs between fork and exec and only makes async-signal-safe calls
        // on plain data (see there).
        unsafe { cmd.pre_exec(move || in_child(fd)) };
        let mut child = cmd.spawn().map_err(|source| FsError::Spawn {
            bin: bin.to_owned(),
            dir: dir.to_owned(),
            source,
        })?;
        drop(listener);
        let stderr: Arc<Mutex<String>> = Arc::default();
        if let Some(mut pipe) = child.stderr.take() {
            let keep = stderr.clone();
            let p = policy.clone();
            policy.expect_thread();
            let spawned = std::thread::Builder::new()
                .name("virtiofsd-err".into())
                .stack_size(amvm_devices::THREAD_STACK_SIZE)
                .spawn(move || {
                    p.enter(ThreadKind::Helper);
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = pipe.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let text = String::from_utf8_lossy(&buf[..n]);
                        tracing::debug!("virtiofsd: {}", text.trim_end());
                        let mut k = keep.lock().unwrap_or_else(|p| p.into_inner());
                        if k.len() < STDERR_KEEP {
                            k.push_str(&text);
                        }
                    }
                });
            if spawned.is_err() {
                // Without the thread virtiofsd's stderr goes unread (its messages are lost, it
                // still runs); the seccomp gate must not wait for it.
                policy.forget_thread();
            }
        }
        Ok((
            Virtiofsd {
                child,
                dir: dir.to_owned(),
                stderr,
            },
            stream,
        ))
    }

    /// The error to report when talking to this virtiofsd failed with `detail`: waits briefly
    /// for it to exit so its last words are in.
    pub fn failure(&mut self, detail: String) -> FsError {
        let until = Instant::now() + Duration::from_secs(2);
        let mut detail = detail;
        while Instant::now() < until {
            if let Ok(Some(status)) = self.child.try_wait() {
                detail = format!("{detail} (virtiofsd exited: {status})");
                // Let the stderr thread drain the pipe.
                std::thread::sleep(Duration::from_millis(100));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        FsError::Failed {
            dir: self.dir.clone(),
            detail,
            stderr: self
                .stderr
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}

/// In the forked child, before exec: keep the listener `fd` across exec, die with amvm's main
/// thread, and take back the signals amvm blocked for its signalfd. Async-signal-safe only.
fn in_child(fd: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl(2) on a descriptor this process owns, with plain integer arguments.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: prctl(2) with plain integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut none: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `none` is a valid sigset_t on this stack frame.
    unsafe { libc::sigemptyset(&mut none) };
    // SAFETY: `none` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A listening socket and a connection to it, with no trace left in the filesystem.
///
/// In `dir` (private to this VM and removed with it: a sandbox's directory) the socket is bound
/// there for a moment, so even a VMM killed in that moment leaves nothing its sandbox's removal
/// does not take. Without one, a directory of its own is made for it in [`socket_base`] and
/// removed at once.
fn private_socket(dir: Option<&Path>) -> io::Result<(UnixListener, UnixStream)> {
    if let Some(dir) = dir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let path = dir.join(format!("fs-{}.sock", N.fetch_add(1, Ordering::Relaxed)));
        // Nothing else binds in a sandbox's directory; a file of that name is a leftover.
        let _ = std::fs::remove_file(&path);
        let result =
            UnixListener::bind(&path).and_then(|l| UnixStream::connect(&path).map(|s| (l, s)));
        let _ = std::fs::remove_file(&path);
        return result;
    }
    let base = socket_base();
    let mut last = None;
    for _ in 0..16 {
        let dir = base.join(format!("amvm-{}-{:08x}", std::process::id(), nonce()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        }
        let path = dir.join("vhost-user.sock");
        let result =
            UnixListener::bind(&path).and_then(|l| UnixStream::connect(&path).map(|s| (l, s)));
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&dir);
        return result;
    }
    Err(last.unwrap_or_else(|| io::Error::other("no private directory for the socket")))
}

/// Where the short-lived socket directory goes: `$XDG_RUNTIME_DIR`, else the temp dir.
fn socket_base() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// A few bits that differ between calls, for unique directory names.
fn nonce() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ N.fetch_add(0x9e37_79b9, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::{translate_ids, Ids};

    #[test]
    fn the_workspace_owner_appears_as_the_workload_user() {
        let t = |owner, runner, workload| {
            translate_ids(
                "--translate-uid",
                Ids {
                    owner,
                    runner,
                    workload,
                },
            )
        };
        // A user's own checkout, the workload as that user: nothing to translate.
        assert!(t(1000, 1000, 1000).is_empty());
        // Root's run of root's checkout (CI): root's files are the workload's and back.
        assert_eq!(t(0, 0, 1000), ["--translate-uid=map:1000:0:1"]);
        // A user 1001's own checkout, the workload 1000.
        assert_eq!(t(1001, 1001, 1000), ["--translate-uid=map:1000:1001:1"]);
        // Root's run of user 1001's checkout: 1001's files show as the workload's too.
        assert_eq!(
            t(1001, 0, 1000),
            [
                "--translate-uid=map:1000:0:1",
                "--translate-uid=host:1001:1000:1"
            ]
        );
        // The workload as root (--user 0) on a user's checkout run by root.
        assert_eq!(t(1001, 0, 0), ["--translate-uid=host:1001:0:1"]);
        // A checkout already the workload's, run by root: the map only.
        assert_eq!(t(1000, 0, 1000), ["--translate-uid=map:1000:0:1"]);
    }

    #[test]
    fn the_expected_virtiofsd_is_the_one_images_setup_installs() {
        let script = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../images/install-virtiofsd"
        ))
        .unwrap();
        assert!(
            script
                .lines()
                .any(|l| l == format!("version={}", super::VIRTIOFSD_VERSION)),
            "images/install-virtiofsd pins another version than fs.rs expects"
        );
    }

    #[test]
    fn a_virtiofsd_of_another_version_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("amvm-fake-vfsd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("virtiofsd");
        std::fs::write(&fake, "#!/bin/sh\necho virtiofsd 1.7.0\n").unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let stamps = dir.join("stamps");
        let e = super::check_version(&fake, Some(&stamps))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is \"virtiofsd 1.7.0\", not the virtiofsd 1.14.0"),
            "{e}"
        );
        // A refused binary leaves no stamp: it is asked again, and refused again.
        assert!(!stamps.exists());
        assert!(super::check_version(&fake, Some(&stamps)).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_passed_version_check_is_remembered_until_the_binary_changes() {
        let dir = std::env::temp_dir().join(format!("amvm-stamp-vfsd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("virtiofsd");
        let calls = dir.join("calls");
        let script = |version: &str| {
            let body = format!(
                "#!/bin/sh\necho x >> {}\necho virtiofsd {version}\n",
                calls.display()
            );
            // Written aside and renamed in, as an install does (a new inode).
            let tmp = dir.join("new");
            std::fs::write(&tmp, body).unwrap();
            std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
            std::fs::rename(&tmp, &fake).unwrap();
        };
        let ncalls = || {
            std::fs::read_to_string(&calls)
                .map(|s| s.lines().count())
                .unwrap_or(0)
        };
        let stamps = dir.join("stamps");
        script(super::VIRTIOFSD_VERSION);
        super::check_version(&fake, Some(&stamps)).unwrap();
        super::check_version(&fake, Some(&stamps)).unwrap();
        super::check_version(&fake, Some(&stamps)).unwrap();
        assert_eq!(ncalls(), 1, "asked once, then remembered");
        // Without a cache it is asked every time.
        super::check_version(&fake, None).unwrap();
        assert_eq!(ncalls(), 2);
        // Another binary at the same path (another version): asked again, and refused.
        script("1.7.0");
        assert!(super::check_version(&fake, Some(&stamps)).is_err());
        assert_eq!(ncalls(), 3);
        // A stamp with another identity is not trusted (e.g. copied from another machine).
        script(super::VIRTIOFSD_VERSION);
        super::check_version(&fake, Some(&stamps)).unwrap();
        assert_eq!(ncalls(), 4);
        let stamp = std::fs::read_dir(&stamps)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        std::fs::write(&stamp, "virtiofsd 1.14.0 dev=0 ino=0\n").unwrap();
        super::check_version(&fake, Some(&stamps)).unwrap();
        assert_eq!(ncalls(), 5);
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    #[test]
    fn the_private_socket_connects_and_leaves_nothing_behind() {
        let ours = || {
            std::fs::read_dir(socket_base())
                .unwrap()
                .flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!("amvm-{}-", std::process::id()))
                })
                .count()
        };
        assert_eq!(ours(), 0);
        let sandbox = std::env::temp_dir().join(format!("amvm-fs-sock-{}", std::process::id()));
        std::fs::create_dir_all(&sandbox).unwrap();
        for dir in [None, Some(sandbox.as_path())] {
            let (l, mut s) = private_socket(dir).unwrap();
            let (mut peer, _) = l.accept().unwrap();
            use std::io::Write;
            s.write_all(b"x").unwrap();
            let mut b = [0u8; 1];
            peer.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"x");
            assert_eq!(ours(), 0);
        }
        assert_eq!(std::fs::read_dir(&sandbox).unwrap().count(), 0);
        std::fs::remove_dir(&sandbox).unwrap();
    }

    #[test]
    fn a_missing_virtiofsd_is_named() {
        let e = Virtiofsd::spawn(
            Path::new("/nonexistent/virtiofsd"),
            Path::new("/"),
            true,
            false,
            &[],
            &Policy::new(false).unwrap(),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/virtiofsd"), "{e}");
    }
}
