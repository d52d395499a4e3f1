//! The sandbox subcommands of the CLI, on top of [`client`](super::client).

use super::api::ExecRequest;
use super::client::{Event, Sandbox};
use super::{Info, SandboxError};
use crate::cli::ExecArgs;
use std::io::{Read, Write};

/// `amvm exec`: the command's exit status.
pub fn exec(args: ExecArgs) -> Result<u8, SandboxError> {
    let sb = Sandbox::open(&args.sandbox)?;
    // Ctrl-C and friends go to the command, not to us: blocked here, read from a signalfd.
    let signals = crate::signals::Signals::block()
        .map_err(|e| SandboxError::Io("blocking signals".into(), e))?;
    exec_in(&sb, args, signals, None)
}

/// How long a run's command has to exit after the run forwarded it a signal, before the run
/// ends the VM itself (a second signal does that at once).
const SIGNAL_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// `amvm run`'s way with signals: the first is forwarded to the command; a second, or the
/// command still running [`SIGNAL_GRACE`] after it, ends the VM (its VMM killed) and the run
/// with 128+N for the first signal N. `amvm exec` forwards every signal and nothing more.
pub(crate) struct RunSignals {
    vmm: (u32, u64),
    /// The first signal, and why the VM was ended under the command, once it was.
    ended: std::sync::Mutex<Option<(i32, &'static str)>>,
}

impl RunSignals {
    pub(crate) fn new(info: &Info) -> std::sync::Arc<RunSignals> {
        std::sync::Arc::new(RunSignals {
            vmm: (info.vmm_pid, info.vmm_start),
            ended: std::sync::Mutex::new(None),
        })
    }

    fn end(&self, sig: i32, why: &'static str) {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some((sig, why));
        if super::is_ours(self.vmm.0, self.vmm.1) {
            // SAFETY: kill(2) of the sandbox's own VMM (its start time checked just before).
            unsafe { libc::kill(self.vmm.0 as libc::pid_t, libc::SIGKILL) };
        }
    }

    /// The first signal and why, if the VM was ended under the command.
    pub(crate) fn ended(&self) -> Option<(i32, &'static str)> {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Run `args`'s command in `sb`, its streams relayed to ours; its exit status. `signals` (blocked
/// by the caller) are forwarded to it: each one, or as `run` says.
pub(crate) fn exec_in(
    sb: &Sandbox,
    args: ExecArgs,
    signals: crate::signals::Signals,
    run: Option<std::sync::Arc<RunSignals>>,
) -> Result<u8, SandboxError> {
    use std::os::unix::ffi::OsStrExt;
    let argv = args
        .command
        .iter()
        .map(|a| super::api::Arg::from_bytes(a.as_bytes()))
        .collect();
    let mut env = Vec::with_capacity(args.env.len() + 1);
    let tty = if args.tty {
        // The caller's TERM, as docker exec -t passes it; an explicit -e wins.
        if let Some(term) = std::env::var("TERM").ok().filter(|t| !t.is_empty()) {
            env.push(format!("TERM={term}"));
        }
        let (rows, cols) = window_size().unwrap_or((24, 80));
        Some(super::api::TtySize { rows, cols })
    } else {
        None
    };
    env.extend(args.env);
    let mut stream = sb.exec(&ExecRequest {
        argv,
        env,
        workdir: args.workdir,
        user: args.user,
        stdin: args.interactive,
        tty,
        clear_env: args.clear_env,
        capabilities: args.capabilities,
        groups: args.groups,
        rlimits: args.rlimits,
        root: args.root,
    })?;
    // Raw mode on the caller's terminal while the command has one of its own (restored when
    // this returns), and its window size kept up to date.
    let _raw = if args.tty && args.interactive {
        RawMode::enter()
    } else {
        None
    };
    if args.tty {
        let tx = stream.sender();
        std::thread::spawn(move || {
            let mut last = window_size();
            loop {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let now = window_size();
                if now != last {
                    if let Some((rows, cols)) = now {
                        if tx.resize(rows, cols).is_err() {
                            return;
                        }
                    }
                    last = now;
                }
            }
        });
    }
    let tx = stream.sender();
    std::thread::spawn(move || {
        let mut first: Option<(i32, std::time::Instant)> = None;
        loop {
            let sig = match signals.wait_until(first.map(|f| f.1)) {
                Ok(sig) => sig,
                Err(_) => return,
            };
            match (sig, first, &run) {
                (Some(sig), None, Some(_)) => {
                    let _ = tx.signal(sig as u8);
                    first = Some((sig, std::time::Instant::now() + SIGNAL_GRACE));
                }
                (Some(sig), None, None) if tx.signal(sig as u8).is_err() => return,
                (Some(_), Some((sig, _)), Some(r)) => {
                    return r.end(sig, "a second signal arrived before the workload exited");
                }
                (None, Some((sig, _)), Some(r)) => {
                    return r.end(sig, "the workload did not exit within 10 s of it");
                }
                _ => {}
            }
        }
    });
    if args.interactive {
        let tx = stream.sender();
        std::thread::spawn(move || {
            let mut input = std::io::stdin().lock();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match input.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.stdin(&buf[..n]).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("reading stdin: {e}; the command sees EOF");
                        break;
                    }
                }
            }
            let _ = tx.stdin_end();
        });
    }
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    loop {
        match stream.next_event()? {
            // A reader that went away must not stop the command; its bytes are dropped.
            Some(Event::Stdout(b)) => {
                let _ = out.write_all(&b).and_then(|()| out.flush());
            }
            Some(Event::Stderr(b)) => {
                let _ = err.write_all(&b).and_then(|()| err.flush());
            }
            Some(Event::Exit(c)) => return Ok(c),
            None => unreachable!("next_event() errs at a stream without Exit"),
        }
    }
}

/// The caller's terminal window (of stdout, else stdin), if either is a terminal.
fn window_size() -> Option<(u16, u16)> {
    for fd in [1, 0, 2] {
        // SAFETY: winsize is plain data; all-zero is a valid value.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: ioctl(2) TIOCGWINSZ writes the winsize it is pointed at.
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_row > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}

/// The caller's terminal (stdin) in raw mode until dropped.
struct RawMode(libc::termios);

impl RawMode {
    fn enter() -> Option<RawMode> {
        // SAFETY: termios is plain data; all-zero is a valid value before tcgetattr fills it.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: tcgetattr(3) on descriptor 0 into a local; fails when stdin is no terminal.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return None;
        }
        let saved = t;
        // SAFETY: cfmakeraw(3) edits the local termios.
        unsafe { libc::cfmakeraw(&mut t) };
        // SAFETY: tcsetattr(3) on descriptor 0 from a local.
        if unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) } != 0 {
            return None;
        }
        Some(RawMode(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: tcsetattr(3) on descriptor 0 from the saved termios.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.0) };
    }
}

/// The sandbox's overlay scratch directory, as this process reaches it, and the workspace's DIR.
pub(crate) fn scratch_of(
    sb: &Sandbox,
) -> Result<(std::path::PathBuf, std::path::PathBuf), SandboxError> {
    let info = sb.info()?;
    let running = info.live();
    let (Some(lower), Some(scratch)) = (info.config.overlay_lower, info.config.overlay_scratch)
    else {
        return Err(SandboxError::NoOverlay(sb.shown().into()));
    };
    let capped = info.config.overlay_size.is_some();
    if capped && !(running && super::is_ours(info.pid, info.pid_start)) {
        return Err(SandboxError::Changes(format!(
            "{} has ended, and with it its workspace changes: with --overlay-size they live in its supervisor's memory (take them with amvm diff or commit before amvm stop)",
            sb.shown()
        )));
    }
    Ok((
        crate::overlay::scratch_seen_from_outside(&scratch, capped, info.pid),
        lower,
    ))
}

/// What the sandbox's guest wrote to its workspace so far, as a layer tar in its state
/// directory (the caller removes it); and the workspace's DIR.
fn changes_of(sb: &Sandbox) -> Result<(std::path::PathBuf, std::path::PathBuf), SandboxError> {
    let (scratch, lower) = scratch_of(sb)?;
    let tmp = sb.dir().join(format!("changes-{}.tar", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .map_err(|e| SandboxError::Io(tmp.display().to_string(), e))
        .and_then(|f| {
            crate::changes::layer::write_layer(
                &crate::overlay::upper(&scratch),
                std::io::BufWriter::new(f),
            )
            .map_err(|e| SandboxError::Changes(format!("reading the sandbox's changes: {e}")))
        })
        .and_then(|(out, _)| {
            out.into_inner()
                .map_err(|e| SandboxError::Io(tmp.display().to_string(), e.into_error()))
        });
    match written {
        Ok(_) => Ok((tmp, lower)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `amvm diff SANDBOX`: what its guest changed in the workspace, as a unified diff against DIR.
pub fn diff(sandbox: &str, out: &mut dyn Write) -> Result<(), SandboxError> {
    let sb = Sandbox::open(sandbox)?;
    let (tar, lower) = changes_of(&sb)?;
    let r = crate::changes::diff::print(&tar, Some(&lower), out)
        .map_err(|e| SandboxError::Changes(format!("diff: {e}")));
    let _ = std::fs::remove_file(&tar);
    r
}

/// `amvm commit SANDBOX DIR`: apply its guest's workspace changes to DIR, as `amvm apply` does
/// (whatever could reach outside DIR refused, and then nothing applied). Whether all applied.
pub fn commit(sandbox: &str, dir: &std::path::Path) -> Result<(), SandboxError> {
    use crate::changes::apply::{apply, Options};
    let sb = Sandbox::open(sandbox)?;
    let (tar, _) = changes_of(&sb)?;
    let mut say = |line: String| eprintln!("amvm: commit: {line}");
    let r = apply(&tar, dir, Options::default(), &mut say);
    let _ = std::fs::remove_file(&tar);
    match r {
        Ok(r) => {
            eprintln!(
                "amvm: commit: applied {} entries to {} ({} neutralised)",
                r.applied,
                dir.display(),
                r.neutralised
            );
            Ok(())
        }
        Err(e) => Err(SandboxError::Changes(format!("commit: {e}"))),
    }
}

/// `amvm ls`.
pub fn ls(json: bool, out: &mut impl Write) -> Result<(), SandboxError> {
    // The sandboxes of runs killed outright go first: nothing of them is the user's to take
    // (but an overlay's changes, which stay listed until amvm rm).
    super::run::sweep_dead_runs();
    let all = super::list()?;
    let io = |e| SandboxError::Io("stdout".into(), e);
    if json {
        serde_json::to_writer_pretty(&mut *out, &all).map_err(|e| io(e.into()))?;
        return writeln!(out).map_err(io);
    }
    writeln!(
        out,
        "{:12}  {:16}  {:8}  {:>5}  {:>8}  CREATED",
        "ID", "NAME", "STATE", "EXECS", "MEM"
    )
    .map_err(io)?;
    for i in all {
        writeln!(
            out,
            "{:12}  {:16}  {:8}  {:>5}  {:>5}MiB  {}",
            i.id,
            i.name.as_deref().unwrap_or("-"),
            i.state,
            i.execs,
            i.config.mem_mib,
            i.created
        )
        .map_err(io)?;
    }
    Ok(())
}

/// Print `info` as JSON.
pub fn print_info(info: &Info, out: &mut impl Write) -> Result<(), SandboxError> {
    serde_json::to_writer_pretty(&mut *out, info)
        .map_err(|e| SandboxError::Io("stdout".into(), e.into()))?;
    writeln!(out).map_err(|e| SandboxError::Io("stdout".into(), e))
}

/// Remove sandbox `id`, stopping it first if it runs (the OCI runtime's `delete`). A sandbox
/// that is gone already is fine.
pub fn rm_quietly(id: &str) -> Result<(), SandboxError> {
    let sb = match Sandbox::open(id) {
        Ok(sb) => sb,
        Err(SandboxError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    let info = sb.info()?;
    if info.live() {
        sb.stop(0)?;
    }
    sb.remove()
}

/// `amvm rm [-f] SANDBOX...`: every one is tried, each failure said on stderr; whether all
/// were removed.
pub fn rm(force: bool, sandboxes: &[String]) -> bool {
    let mut ok = true;
    for s in sandboxes {
        let r = Sandbox::open(s).and_then(|sb| {
            if force {
                let info = sb.info()?;
                if info.live() {
                    sb.stop(0)?;
                }
            }
            sb.remove()?;
            println!("{}", sb.id);
            Ok(())
        });
        if let Err(e) = r {
            eprintln!("amvm: {e}");
            ok = false;
        }
    }
    ok
}

/// `amvm fork SANDBOX -n N`: N new sandboxes from its current state (a snapshot into a private
/// directory inside the sandbox's own, restored N times, then removed); their ids. If one
/// cannot be made, the ones already made are removed: all N or none.
pub fn fork(sandbox: &str, n: u32) -> Result<Vec<String>, SandboxError> {
    let sb = Sandbox::open(sandbox)?;
    let dir = sb.dir().join(format!("fork-{}", std::process::id()));
    crate::snapshot::tree::remove(&dir);
    let made = (|| {
        sb.snapshot(&dir, false)?;
        let mut ids = Vec::with_capacity(n as usize);
        for _ in 0..n {
            match super::supervisor::create_from_snapshot(&dir) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for id in &ids {
                        let _ = rm_quietly(id);
                    }
                    return Err(e);
                }
            }
        }
        Ok(ids)
    })();
    crate::snapshot::tree::remove(&dir);
    made
}
