//! `amvm run -t`: a run with a pseudo-terminal is a sandbox made for one exec: `create` (tied to
//! this process: the sandbox's supervisor dies with it), `exec -t` of the command with this
//! process's terminal (raw mode with -i, the window size and its changes passed on), then
//! `--changes FILE` written from the sandbox's overlay, and `rm`. The exit status is what a run
//! gives: the command's own (128+N for signal N), 124 when `--timeout` ended it, 125 when amvm
//! or the VM failed.
//!
//! While it runs the sandbox is listed by `amvm ls` like any other. If this process is killed
//! outright (SIGKILL), the sandbox's supervisor and VM die with it; `amvm ls` then shows it dead
//! and `amvm rm` removes what is left.

use super::client::Sandbox;
use super::SandboxError;
use crate::cli::{CreateArgs, ExecArgs, RunArgs};
use std::time::{Duration, Instant};

/// How long the sandbox may take to say how it ended, once its command's stream broke.
const END_WAIT: Duration = Duration::from_secs(30);

/// `amvm run -t`: the run's exit status.
pub fn run_with_tty(args: RunArgs) -> Result<u8, SandboxError> {
    let RunArgs {
        mut vm,
        interactive,
        command,
        tty: _,
    } = args;
    if vm.console {
        return Err(SandboxError::RunTty(
            "--console: the guest's kernel log goes to the sandbox's vmm.log (amvm create; then amvm exec -t)",
        ));
    }
    let timeout = vm.timeout;
    // --changes is checked now (and refused by `create`), and written before the sandbox goes.
    let changes = match vm.changes.take() {
        Some(file) => {
            let overlay = match vm.workspace.as_deref() {
                Some(w) => crate::config::workspace_arg(w)?.1,
                None => false,
            };
            if !overlay {
                return Err(crate::config::ConfigError::ChangesWithoutOverlay.into());
            }
            crate::config::overlay(std::path::Path::new("/"), Some(&file), None)?.changes
        }
        None => None,
    };
    let t0 = Instant::now();
    let created = super::supervisor::create_tied(CreateArgs {
        vm,
        name: None,
        labels: Vec::new(),
        idle_timeout: None,
    });
    let id = match created {
        Ok(id) => id,
        // Its --timeout ran out while it booted: as for any run, 124.
        Err(SandboxError::Start(_)) if timeout.is_some_and(|t| t0.elapsed().as_secs() >= t) => {
            eprintln!("amvm: timed out after {} s", timeout.unwrap_or(0));
            return Ok(crate::exit::TIMEOUT);
        }
        Err(e) => return Err(e),
    };
    let exec = super::commands::exec(ExecArgs {
        interactive,
        tty: true,
        env: Vec::new(),
        workdir: None,
        user: None,
        sandbox: id.clone(),
        clear_env: false,
        capabilities: None,
        groups: Vec::new(),
        rlimits: Vec::new(),
        command,
    });
    let sb = Sandbox::open(&id)?;
    let mut code = match exec {
        Ok(code) => code,
        Err(e) => ended_under(&sb, e, timeout),
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
            return Ok(crate::exit::AMVM_FAILURE);
        }
    }
    if let Err(e) = super::commands::rm_quietly(&id) {
        eprintln!("amvm: removing sandbox {id}: {e}");
        code = crate::exit::AMVM_FAILURE;
    }
    Ok(code)
}

/// The command's stream broke without an exit status: the VM ended under it (its `--timeout`:
/// 124; a failure: 125, with how it ended), or something else went wrong (125).
fn ended_under(sb: &Sandbox, e: SandboxError, timeout: Option<u64>) -> u8 {
    let t0 = Instant::now();
    let ended = loop {
        match sb.info() {
            Ok(i) if !matches!(i.state.as_str(), "running" | "stopping" | "starting") => {
                break i.ended
            }
            Ok(_) if t0.elapsed() < END_WAIT => std::thread::sleep(Duration::from_millis(100)),
            _ => break None,
        }
    };
    match ended {
        Some(how) if how.starts_with("timed out") => {
            eprintln!("amvm: timed out after {} s", timeout.unwrap_or(0));
            crate::exit::TIMEOUT
        }
        Some(how) => {
            eprintln!("amvm: {how}");
            crate::exit::AMVM_FAILURE
        }
        None => {
            eprintln!("amvm: {e}");
            crate::exit::AMVM_FAILURE
        }
    }
}
