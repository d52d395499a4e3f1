//! A session (`amvm create`): guest-init stays up and runs the execs the host asks for, many at
//! once, each confined as a one-shot workload is (sandbox.rs), until the host says stop.
//!
//! The main thread owns the control channel and reaping: it reads Exec, ExecSignal and
//! Shutdown frames, and reaps every child (PID 1 inherits orphans), handing each exec's status
//! to the thread that runs it. One thread per exec: it connects its own vsock stream to
//! [`EXEC_PORT`], announces itself with an Attach frame, spawns the process in a cgroup of its
//! own, relays its stdout and stderr as frames and the stream's raw bytes to its stdin, and
//! ends with an Exit frame. Each stream flows under its own vsock credit, so a process whose
//! reader is slow blocks in its own write and no other exec notices.
//!
//! When an exec's process exits, whatever it left running is killed (its cgroup's
//! `cgroup.kill`), so an exec ends with its process as a one-shot run does.
//!
//! A session restored from a snapshot (`amvm create --from`) finds every vsock stream reset:
//! the control stream is connected again (the host sends the time and fresh randomness, which
//! set the clock and reseed the RNG), and the execs that were running keep running with their
//! output dropped (their streams, and whoever read them, are gone with the old host).

use crate::channel::{vsock_connect, Channel, Incoming, HOST_CID};
use crate::sandbox::{Cgroup, Confinement};
use crate::workload::{can_enter, command, prepare_home_for, spawn_failure, status_byte};
use guest_init::protocol::{encode_chunks, encode_frame, ExecSpec, Frame, FrameKind, EXEC_PORT};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the main loop reaps, and an exec's relay checks for its status.
const TICK_MS: i32 = 50;

/// Set once the control stream was reset: this guest was restored from a snapshot.
static RESTORED: AtomicBool = AtomicBool::new(false);

/// The running execs: who to tell when a process exits, and whom a signal is for.
#[derive(Default)]
struct Procs {
    by_pid: HashMap<libc::pid_t, mpsc::Sender<u8>>,
    by_id: HashMap<u64, libc::pid_t>,
    /// Terminal execs' pseudo-terminal masters, for their window size.
    ttys: HashMap<u64, Arc<File>>,
}

struct Shared {
    /// Held across spawn and registration, and by the reaper around waitpid: a process that
    /// exits at once is still reaped into its exec's channel, never lost.
    procs: Mutex<Procs>,
    /// Exec threads that have not yet sent their Exit frame.
    active: Mutex<usize>,
    cgroup: Cgroup,
    /// Variables every exec gets on top of its own (the egress relay's addresses).
    extra_env: Vec<Vec<u8>>,
    /// A container's root every exec is chrooted into (empty: none).
    root: Vec<u8>,
    /// The roots execs named of their own ([`ExecSpec::root`]), each set up once.
    exec_roots: Mutex<std::collections::HashSet<Vec<u8>>>,
}

/// Serve the session until the host asks it to stop (or goes away); then every process is
/// gone and the caller reboots.
pub fn serve(
    pids_max: u32,
    extra_env: Vec<Vec<u8>>,
    root: Vec<u8>,
    chan: &mut Channel,
) -> Result<(), String> {
    let cgroup = Cgroup::create(pids_max).map_err(|e| format!("the workload's cgroup: {e}"))?;
    let shared = Arc::new(Shared {
        procs: Mutex::new(Procs::default()),
        active: Mutex::new(0),
        cgroup,
        extra_env,
        root,
        exec_roots: Mutex::default(),
    });
    chan.ready();
    loop {
        let mut pfd = libc::pollfd {
            fd: chan.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, TICK_MS) };
        if n > 0 && pfd.revents != 0 {
            match chan.receive() {
                Incoming::Closed => {
                    // The host is gone: nobody can use the sandbox any more.
                    stop(&shared, Duration::ZERO);
                    return Ok(());
                }
                Incoming::Reset => {
                    RESTORED.store(true, Ordering::SeqCst);
                    if let Err(e) = restored(chan) {
                        eprintln!("guest-init: after a restore: {e}");
                        stop(&shared, Duration::ZERO);
                        return Ok(());
                    }
                }
                Incoming::Some => {}
            }
        }
        for req in chan.take_requests() {
            match req {
                Frame::Exec(raw) => match ExecSpec::decode(&raw) {
                    Ok(spec) => start(spec, &shared),
                    Err(e) => eprintln!("guest-init: an exec spec: {e}"),
                },
                Frame::ExecSignal { id, signal } => {
                    let procs = lock(&shared.procs);
                    if let (Some(&pid), 1..=64) = (procs.by_id.get(&id), signal) {
                        // SAFETY: kill(2) with plain integers, to the exec's process group (it
                        // leads its own session); a vanished group gives ESRCH.
                        unsafe { libc::kill(-pid, libc::c_int::from(signal)) };
                    }
                }
                Frame::ExecResize { id, rows, cols } => {
                    if let Some(master) = lock(&shared.procs).ttys.get(&id) {
                        let _ = set_window(master, rows, cols);
                    }
                }
                Frame::Shutdown { grace_seconds } => {
                    stop(&shared, Duration::from_secs(u64::from(grace_seconds)));
                    return Ok(());
                }
                _ => {}
            }
        }
        reap(&shared);
    }
}

/// This guest continues a snapshot: a new control stream, the host's clock, the RNG reseeded
/// with the host's randomness (two restores of one snapshot must not draw the same bytes), and
/// Ready again.
fn restored(chan: &mut Channel) -> Result<(), String> {
    let (unix_nanos, entropy) = chan.reconnect()?;
    crate::sys::set_clock(unix_nanos).map_err(|e| format!("setting the clock: {e}"))?;
    crate::sys::reseed_rng(&entropy).map_err(|e| format!("reseeding the RNG: {e}"))?;
    chan.ready();
    Ok(())
}

/// Whether a write error on an exec's stream is the restore's reset: then the process keeps
/// running. The main loop notices the reset on its control stream within a tick or two.
fn reset_by_restore(e: &io::Error) -> bool {
    if !matches!(e.raw_os_error(), Some(libc::ECONNRESET | libc::ENOTCONN)) {
        return false;
    }
    let end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < end {
        if RESTORED.load(Ordering::SeqCst) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reap every exited child; tell the exec threads whose process it was. Whether any child
/// remains.
fn reap(shared: &Shared) -> bool {
    let mut procs = lock(&shared.procs);
    loop {
        let mut wstatus = 0;
        // SAFETY: waitpid with a valid pointer to an int.
        let r = unsafe { libc::waitpid(-1, &mut wstatus, libc::WNOHANG) };
        if r < 0 {
            return false;
        }
        if r == 0 {
            return true;
        }
        if let Some(status) = status_byte(wstatus) {
            if let Some(tx) = procs.by_pid.remove(&r) {
                procs.by_id.retain(|_, p| *p != r);
                let _ = tx.send(status);
            }
        }
    }
}

/// SIGTERM everything, wait up to `grace` for it to end, SIGKILL what is left, and give the
/// exec threads a moment to send their Exit frames.
fn stop(shared: &Shared, grace: Duration) {
    let signal_all = |sig| {
        // SAFETY: kill(-1, sig) from PID 1 signals every other process; no memory involved.
        unsafe { libc::kill(-1, sig) };
    };
    signal_all(libc::SIGTERM);
    let end = Instant::now() + grace;
    while reap(shared) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(TICK_MS as u64));
    }
    signal_all(libc::SIGKILL);
    let end = Instant::now() + Duration::from_secs(2);
    while (reap(shared) || *lock(&shared.active) > 0) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn start(spec: ExecSpec, shared: &Arc<Shared>) {
    *lock(&shared.active) += 1;
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("exec{}", spec.id))
        .spawn(move || {
            if let Err(e) = exec(&spec, &s) {
                eprintln!("guest-init: exec {}: {e}", spec.id);
            }
            *lock(&s.active) -= 1;
        });
    if let Err(e) = spawned {
        eprintln!("guest-init: starting an exec thread: {e}");
        *lock(&shared.active) -= 1;
    }
}

/// A pseudo-terminal of `rows` x `cols`: its master, and its peer (the slave) owned by
/// `uid`:`gid`.
fn open_pty(rows: u16, cols: u16, uid: u32, gid: u32) -> io::Result<(File, File)> {
    let (master, slave) = guest_init::pty::open_pair()?;
    let s = slave.as_raw_fd();
    // SAFETY: fchown(2) on a descriptor we own.
    unsafe { libc::fchown(s, uid, gid) };
    set_window(&master, rows, cols)?;
    Ok((master, slave))
}

fn set_window(master: &File, rows: u16, cols: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: ioctl(2) TIOCSWINSZ reads the winsize it is pointed at.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The exec's stream to the host: frames out.
struct Stream {
    sock: File,
    buf: Vec<u8>,
}

impl Stream {
    fn send(&mut self, kind: FrameKind, data: &[u8]) -> io::Result<()> {
        self.buf.clear();
        if matches!(kind, FrameKind::Stdout | FrameKind::Stderr) {
            encode_chunks(kind, data, &mut self.buf);
        } else {
            encode_frame(kind, data, &mut self.buf);
        }
        self.sock.write_all(&self.buf)
    }
}

fn exec(spec: &ExecSpec, shared: &Shared) -> io::Result<()> {
    let sock = File::from(vsock_connect(HOST_CID, EXEC_PORT)?);
    let mut stream = Stream {
        sock,
        buf: Vec::with_capacity(64 * 1024 + 16),
    };
    stream.send(FrameKind::Attach, &spec.id.to_le_bytes())?;
    let (status, stdin_thread) = run(spec, shared, &mut stream)?;
    stream.send(FrameKind::Exit, &[status])?;
    // The same handshake as the control channel's: the host closes the stream once it has
    // read the Exit frame. Until then, the stdin copier (or this loop) drains what it sends.
    // SAFETY: shutdown(2) on a socket descriptor we own.
    unsafe { libc::shutdown(stream.sock.as_raw_fd(), libc::SHUT_WR) };
    match stdin_thread {
        Some(t) => {
            let _ = t.join();
        }
        None => {
            let mut sink = [0u8; 4096];
            while matches!(stream.sock.read(&mut sink), Ok(n) if n > 0) {}
        }
    }
    Ok(())
}

/// Make `root` ready for execs chrooted into it, once: a directory with the kernel's file
/// systems mounted inside, as a session's container root has them.
fn exec_root(shared: &Shared, root: &[u8]) -> io::Result<()> {
    let mut done = lock(&shared.exec_roots);
    if done.contains(root) {
        return Ok(());
    }
    let path = std::path::Path::new(OsStr::from_bytes(root));
    if !std::fs::metadata(path)?.is_dir() {
        return Err(io::Error::other("not a directory"));
    }
    crate::mounts::container_root(path)?;
    done.insert(root.to_vec());
    Ok(())
}

/// Spawn the exec's process and relay it to the end; its status, and the stdin copier.
fn run(
    spec: &ExecSpec,
    shared: &Shared,
    stream: &mut Stream,
) -> io::Result<(u8, Option<std::thread::JoinHandle<()>>)> {
    let mut env = spec.env.clone();
    for kv in &shared.extra_env {
        let key = &kv[..=kv.iter().position(|&b| b == b'=').unwrap_or(kv.len() - 1)];
        if !env.iter().any(|e| e.starts_with(key)) {
            env.push(kv.clone());
        }
    }
    // The exec's own root (a pod's container), else the session's.
    let root = if spec.root.is_empty() {
        &shared.root
    } else {
        if let Err(e) = exec_root(shared, &spec.root) {
            let root = String::from_utf8_lossy(&spec.root);
            let msg = format!("amvm: the root {root}: {e}\n");
            stream.send(FrameKind::Stderr, msg.as_bytes())?;
            return Ok((crate::workload::EXIT_SETUP_FAILURE, None));
        }
        &spec.root
    };
    if root.is_empty() {
        prepare_home_for(&env, spec.uid, spec.gid);
    }
    let cwd_seen = crate::workload::in_root(root, &spec.cwd);
    if let Err(e) = can_enter(&cwd_seen, spec.uid, spec.gid) {
        let cwd = String::from_utf8_lossy(&spec.cwd);
        let msg = format!("amvm: cannot enter the working directory {cwd}: {e}\n");
        stream.send(FrameKind::Stderr, msg.as_bytes())?;
        return Ok((crate::workload::EXIT_SETUP_FAILURE, None));
    }
    let cgroup = match shared.cgroup.exec(spec.id) {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("amvm: the exec's cgroup: {e}\n");
            stream.send(FrameKind::Stderr, msg.as_bytes())?;
            return Ok((crate::workload::EXIT_SETUP_FAILURE, None));
        }
    };
    let mut cmd = command(&spec.argv, &env);
    if root.is_empty() {
        cmd.current_dir(OsStr::from_bytes(&spec.cwd));
    }
    let mut confinement = Confinement::new(cgroup.procs(), spec.uid, spec.gid);
    confinement.caps = spec.caps;
    confinement.groups = spec.groups.clone();
    confinement.rlimits = spec.rlimits.clone();
    if let Err(e) = confinement.in_root(root, &spec.cwd) {
        let msg = format!("amvm: the root or working directory: {e}\n");
        stream.send(FrameKind::Stderr, msg.as_bytes())?;
        return Ok((crate::workload::EXIT_SETUP_FAILURE, None));
    }
    let master = match spec.tty {
        Some((rows, cols)) => {
            let (master, slave) = match open_pty(rows, cols, spec.uid, spec.gid) {
                Ok(p) => p,
                Err(e) => {
                    let msg = format!("amvm: a pseudo-terminal: {e}\n");
                    stream.send(FrameKind::Stderr, msg.as_bytes())?;
                    return Ok((crate::workload::EXIT_SETUP_FAILURE, None));
                }
            };
            cmd.stdin(slave.try_clone()?)
                .stdout(slave.try_clone()?)
                .stderr(slave);
            confinement.ctty = true;
            Some(Arc::new(master))
        }
        None => {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            None
        }
    };
    // SAFETY: the hook runs between fork and exec and only makes async-signal-safe system calls
    // on memory built before the fork (see `Confinement::enter`).
    unsafe { cmd.pre_exec(move || confinement.enter()) };
    let oom_before = shared.cgroup.oom_kills();
    let (tx, rx) = mpsc::channel();
    let mut child = {
        let mut procs = lock(&shared.procs);
        match cmd.spawn() {
            Ok(child) => {
                let pid = child.id() as libc::pid_t;
                procs.by_pid.insert(pid, tx);
                procs.by_id.insert(spec.id, pid);
                if let Some(m) = &master {
                    procs.ttys.insert(spec.id, m.clone());
                }
                child
            }
            Err(e) => {
                drop(procs);
                let (status, why) = spawn_failure(&String::from_utf8_lossy(&spec.argv[0]), &e);
                stream.send(FrameKind::Stderr, why.as_bytes())?;
                return Ok((status, None));
            }
        }
    };
    // The terminal's peer lives on only in the child.
    drop(cmd);
    let stdin_to: Option<Box<dyn Write + Send>> = match (&master, child.stdin.take()) {
        (Some(m), _) if spec.stdin => Some(Box::new(m.try_clone()?)),
        (_, Some(pipe)) => Some(Box::new(pipe)),
        _ => None,
    };
    let stdin_thread = match stdin_to {
        Some(mut to) => {
            let mut from = stream.sock.try_clone()?;
            Some(
                std::thread::Builder::new()
                    .name("exec-stdin".into())
                    .spawn(move || {
                        // Ends at the host's EOF (the process then sees EOF), or when the
                        // process is gone and the host closes the stream.
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            match from.read(&mut buf) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => {
                                    if to.write_all(&buf[..n]).is_err() {
                                        // Nobody reads stdin any more: drain until the end.
                                        while matches!(from.read(&mut buf), Ok(n) if n > 0) {}
                                        return;
                                    }
                                }
                            }
                        }
                    })?,
            )
        }
        None => None,
    };
    // Output: the terminal's master (all of it Stdout), or the two pipes.
    let (mut out, mut err): (File, Option<File>) = match &master {
        Some(m) => (m.try_clone()?, None),
        None => (
            File::from(std::os::fd::OwnedFd::from(
                child.stdout.take().expect("piped stdout"),
            )),
            Some(File::from(std::os::fd::OwnedFd::from(
                child.stderr.take().expect("piped stderr"),
            ))),
        ),
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = [true, err.is_some()];
    let mut status: Option<u8> = None;
    // The stream was reset by a restore: the process goes on, its output goes nowhere.
    let mut detached = false;
    loop {
        if status.is_none() {
            if let Ok(s) = rx.try_recv() {
                status = Some(s);
                cgroup.kill();
            }
        }
        if !open[0] && !open[1] {
            if let Some(s) = status {
                if detached {
                    lock(&shared.procs).ttys.remove(&spec.id);
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("its stream was reset by a restore; it exited with {s}"),
                    ));
                }
                if s == 128 + libc::SIGKILL as u8 && shared.cgroup.oom_kills() > oom_before {
                    stream.send(FrameKind::Stderr, b"amvm: killed: out of memory\n")?;
                }
                lock(&shared.procs).ttys.remove(&spec.id);
                return Ok((s, stdin_thread));
            }
        }
        let mut fds = [
            libc::pollfd {
                fd: if open[0] { out.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: match (&err, open[1]) {
                    (Some(e), true) => e.as_raw_fd(),
                    _ => -1,
                },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, TICK_MS) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for (i, pfd) in fds.iter().enumerate() {
            if !open[i] || pfd.revents == 0 {
                continue;
            }
            let r = match (i, &mut err) {
                (0, _) => out.read(&mut buf),
                (_, Some(e)) => e.read(&mut buf),
                _ => continue,
            };
            let kind = if i == 0 {
                FrameKind::Stdout
            } else {
                FrameKind::Stderr
            };
            match r {
                // A terminal's master reads EIO once every holder of its peer is gone.
                Ok(0) | Err(_) => open[i] = false,
                Ok(_) if detached => {}
                Ok(n) => {
                    if let Err(e) = stream.send(kind, &buf[..n]) {
                        if reset_by_restore(&e) {
                            detached = true;
                            continue;
                        }
                        // The host is gone: the process goes too.
                        cgroup.kill();
                        lock(&shared.procs).ttys.remove(&spec.id);
                        return Err(e);
                    }
                }
            }
        }
    }
}
