//! `amvm run`: a sandbox made for one exec. `create` (tied to this process: the sandbox's
//! supervisor dies with it, and its VMM writes to this process's stderr), `exec` of the command
//! with this process's streams (`-i`: stdin; `-t`: a pseudo-terminal, the caller's terminal in
//! raw mode with -i, the window size and its changes passed on), then `--changes FILE` written
//! from the sandbox's overlay, and `rm`. The exit status is a run's: the command's own (128+N
//! for signal N), 124 when `--timeout` ended it, 125 when amvm or the VM failed (the VMM says
//! why on stderr), 128+N when signal N ended the run before the command did.
//!
//! While it runs the sandbox is listed by `amvm ls` like any other. If this process is killed
//! outright (SIGKILL), the sandbox's supervisor and VM die with it, and the next `amvm ls` or
//! `amvm run` removes what is left; but for a sandbox whose overlay holds changes, which stays
//! (dead) for `amvm diff` and `amvm commit` until `amvm rm`.

use super::client::Sandbox;
use super::commands::RunSignals;
use super::SandboxError;
use crate::cli::{CreateArgs, ExecArgs, RunArgs};
use crate::exit;
use std::time::{Duration, Instant};

/// How long the sandbox may take to say how it ended, once its command's stream broke.
const END_WAIT: Duration = Duration::from_secs(30);

/// `amvm run`: the run's exit status.
pub fn run(args: RunArgs) -> Result<u8, SandboxError> {
    let RunArgs {
        vm,
        interactive,
        command,
        tty,
    } = args;
    let mut checked = match super::supervisor::check(
        CreateArgs {
            vm,
            name: None,
            labels: Vec::new(),
            idle_timeout: None,
            from: None,
        },
        Some(command),
    ) {
        Ok(c) => c,
        Err(SandboxError::Config(e)) => {
            eprintln!("amvm: {:#}", anyhow::Error::from(e));
            return Ok(exit::AMVM_FAILURE);
        }
        Err(e) => return Err(e),
    };
    let command = std::mem::take(&mut checked.command);
    // Written from the sandbox's overlay before the sandbox goes.
    let changes = checked.cfg.overlay.as_ref().and_then(|o| o.changes.clone());
    sweep_dead_runs();
    // Blocked before the VM is made (its processes unblock them), so that a signal while it
    // boots waits for the command, as it would for a VMM run in this process.
    let signals = crate::signals::Signals::block()
        .map_err(|e| SandboxError::Io("blocking signals".into(), e))?;
    let seccomp = checked.cfg.seccomp;
    let id = match super::supervisor::create_from(
        checked.cfg,
        checked.config,
        checked.name,
        checked.labels,
        true,
    ) {
        Ok(id) => id,
        // The VMM ended while the guest booted (its --timeout: 124; a failure: 125), and said
        // why on our stderr.
        Err(SandboxError::Ended(code)) => return Ok(code),
        Err(e) => return Err(e),
    };
    let sb = Sandbox::open(&id)?;
    let info = sb.info()?;
    let _supervisor = Reap(info.pid);
    // From here on this process reads the guest's bytes (the command's frames, the overlay's
    // upper layer): confined first, while it still has one thread.
    if let Err(e) = confine(seccomp) {
        eprintln!("amvm: confining the run: {e}");
        let _ = sb.stop(0);
        let _ = super::commands::rm_quietly(&id);
        return Ok(exit::AMVM_FAILURE);
    }
    let run = RunSignals::new(&info);
    let exec = super::commands::exec_in(
        &sb,
        ExecArgs {
            interactive,
            tty,
            env: Vec::new(),
            workdir: None,
            user: None,
            sandbox: id.clone(),
            clear_env: false,
            capabilities: None,
            groups: Vec::new(),
            rlimits: Vec::new(),
            root: None,
            command,
        },
        signals,
        Some(run.clone()),
    );
    let mut code = match (exec, run.ended()) {
        (_, Some((sig, why))) => {
            eprintln!("amvm: interrupted by {}: {why}", crate::signals::name(sig));
            (128 + sig).clamp(0, 255) as u8
        }
        (Ok(code), None) => code,
        (Err(e), None) => ended_under(&sb, e),
    };
    if let Some(file) = &changes {
        let written = super::commands::scratch_of(&sb).and_then(|(scratch, _)| {
            crate::overlay::write_changes(&scratch, file)
                .map_err(|e| SandboxError::Changes(e.to_string()))
        });
        if let Err(e) = written {
            // The sandbox stays (stopped), so that what it wrote is not lost with it.
            eprintln!("amvm: {e}");
            let _ = sb.stop(0);
            eprintln!(
                "amvm: sandbox {id} is kept: its changes are in its overlay (amvm diff, amvm commit; amvm rm {id} when done)"
            );
            return Ok(exit::AMVM_FAILURE);
        }
    }
    if let Err(e) = super::commands::rm_quietly(&id) {
        eprintln!("amvm: removing sandbox {id}: {e}");
        code = exit::AMVM_FAILURE;
    }
    Ok(code)
}

/// A run's jail once its sandbox is up: a private mount namespace (for a non-root user, in a
/// user namespace mapping only their own ids: the `--overlay-size` tmpfs it detaches at the end
/// is its own view's), no new privileges, no capabilities, and the `run` seccomp filter
/// (seccomp.rs): no exec, no ptrace, no sockets but unix streams, no mounts. It keeps its
/// capabilities (root's, or none): see `confine_process`.
fn confine(seccomp: bool) -> Result<(), crate::seccomp::SeccompError> {
    crate::jail::unshare_as_self(0)?;
    crate::jail::no_new_privs()?;
    crate::seccomp::confine_process(crate::seccomp::ThreadKind::Run, seccomp)
}

/// The command's stream broke without an exit status: the VM ended under it. Its VMM said why
/// on our stderr and its status is the run's (124 for `--timeout`, 125 for a failure); a VMM
/// killed by a signal, or a guest that shut down under the command, is 125 with that said.
fn ended_under(sb: &Sandbox, e: SandboxError) -> u8 {
    let t0 = Instant::now();
    let info = loop {
        match sb.info() {
            Ok(i) if !i.live() => break Some(i),
            Ok(_) if t0.elapsed() < END_WAIT => std::thread::sleep(Duration::from_millis(50)),
            _ => break None,
        }
    };
    match info.as_ref().map(|i| (i.vmm_exit, i.ended.as_deref())) {
        Some((Some(code), _)) if code != 0 => code,
        Some((Some(_), _)) => {
            eprintln!("amvm: the guest shut down before the command's exit status arrived");
            exit::AMVM_FAILURE
        }
        Some((None, Some(how))) => {
            eprintln!("amvm: {how}");
            exit::AMVM_FAILURE
        }
        _ => {
            eprintln!("amvm: {e}");
            exit::AMVM_FAILURE
        }
    }
}

/// Remove the sandboxes of runs that were killed outright (`dead`), but for those that hold an
/// overlay's changes, which are the user's to take (`amvm diff`, `commit`) or drop (`amvm rm`).
pub(crate) fn sweep_dead_runs() {
    for info in super::list().unwrap_or_default() {
        // pid 0: one being made this moment (its supervisor not yet forked), not a dead one.
        let dead = info.state == "dead" && info.pid != 0;
        if info.run && dead && info.config.overlay_scratch.is_none() {
            if let Ok((id, dir)) = super::resolve(&info.id) {
                match super::remove(&id, &dir) {
                    Ok(()) => tracing::debug!("removed the sandbox of a run killed outright: {id}"),
                    Err(e) => tracing::debug!("sandbox {id} of a dead run: {e}"),
                }
            }
        }
    }
}

/// The run's sandbox supervisor, our child: it waits for us after its VM ended (with
/// `--overlay-size` its mounts hold the changes), so we end it and reap it when we go. Reaped, its
/// resource use (and its VMM's, which it reaped) counts as ours, as it did when the VMM was this
/// process.
struct Reap(u32);

impl Drop for Reap {
    fn drop(&mut self) {
        let pid = self.0 as libc::pid_t;
        if pid <= 0 {
            return;
        }
        // SAFETY: kill(2) and waitpid(2) of our own child (it cannot have been reaped by
        // anyone else, so the pid is still its).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let mut status = 0;
        // SAFETY: as above; `status` is a local.
        unsafe { libc::waitpid(pid, &mut status, 0) };
    }
}
