//! A sandbox's supervisor: the process `amvm create` leaves behind.
//!
//! `create` checks the flags, makes the state directory, and forks; the child leads a session
//! of its own (no terminal reaches it), binds `guest.sock` and `api.sock`, and forks the VMM
//! (the same boot recipe as `amvm run`, in session mode: builder.rs), which dies with it
//! (PR_SET_PDEATHSIG). All that happens while the process has one thread, as fork and the
//! VMM's namespaces require; only then does the supervisor start tokio, on one thread.
//!
//! The guest's streams arrive on `guest.sock`, each behind the VMM's one-byte tag
//! (control.rs): the control stream, on which the supervisor sends the run spec and then Exec,
//! ExecSignal and Shutdown frames and receives Ready; and one stream per exec, which the
//! supervisor pairs with the API connection that asked for it by the id in its Attach frame.
//! Every frame from the guest goes through a `FrameParser` for its direction: the guest is not
//! trusted, and a lie breaks only its own stream.
//!
//! `create` learns through a pipe whether the guest reached Ready (then it prints the id) or
//! why not (then it removes the directory and fails with the reason).

use super::api::{self, ExecRequest, StopRequest, EXEC_UPGRADE};
use super::http::{self, parse_body, reply_error, reply_json};
use super::{io_err, now, write_state, Config, Info, SandboxError};
use crate::cli::CreateArgs;
use crate::config::RunConfig;
use crate::control::{SESSION_TAG_CONTROL, SESSION_TAG_EXEC};
use guest_init::protocol::{
    encode_chunks, encode_frame, exec_resize_payload, exec_signal_payload, restored_payload,
    Direction, ExecSpec, Frame, FrameKind, FrameParser, RESTORED_ENTROPY,
};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};

mod archive;

/// How long a guest may take from the VMM's start to Ready.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an exec may take to connect its stream: as long as a boot may take, since a guest
/// on a loaded host (twenty of them on one emulated CPU, in the test bed) can take over a minute
/// to fork the command; a guest that ends meanwhile fails the exec at once.
const ATTACH_TIMEOUT: Duration = BOOT_TIMEOUT;
/// After `stop`'s grace, how long the guest has to end before the VMM is killed.
const STOP_MARGIN: Duration = Duration::from_secs(20);

/// `amvm create`: boot the sandbox; its id once it is ready.
pub fn create(args: CreateArgs) -> Result<String, SandboxError> {
    create_with(args, false)
}

/// `create` for a sandbox that lives no longer than this process (`amvm run -t`): its
/// supervisor gets SIGKILL when this process ends, and its VMM goes with it.
pub fn create_tied(args: CreateArgs) -> Result<String, SandboxError> {
    create_with(args, true)
}

fn create_with(args: CreateArgs, tied: bool) -> Result<String, SandboxError> {
    if let Some(from) = args.from.clone() {
        return create_restored(args, &from);
    }
    if args.vm.changes.is_some() {
        return Err(SandboxError::Unsupported(
            "--changes (a sandbox's changes come from amvm diff ID and amvm commit ID DIR)",
        ));
    }
    let c = check(args, None).map_err(|e| match e {
        SandboxError::Config(e) => SandboxError::Start(format!("{:#}", anyhow::Error::from(e))),
        e => e,
    })?;
    create_from(c.cfg, c.config, c.name, c.labels, tied)
}

/// A new sandbox that continues the snapshot in `dir` with its settings (`amvm fork`); its id.
pub fn create_from_snapshot(dir: &Path) -> Result<String, SandboxError> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Line {
        #[command(flatten)]
        args: CreateArgs,
    }
    let args = Line::try_parse_from([
        std::ffi::OsStr::new("create"),
        "--from".as_ref(),
        dir.as_os_str(),
    ])
    .map_err(|e| SandboxError::Snapshot(e.kind().to_string()))?
    .args;
    create_restored(args, dir)
}

/// `amvm create --from DIR`: a new sandbox that continues the snapshot in DIR, with the
/// snapshot's settings (its egress socket may be given anew).
fn create_restored(args: CreateArgs, from: &Path) -> Result<String, SandboxError> {
    use clap::Parser;
    /// `amvm create`'s flags alone.
    #[derive(clap::Parser)]
    struct Line {
        #[command(flatten)]
        args: CreateArgs,
    }
    let vm = &args.vm;
    let defaults = Line::try_parse_from(["create"])
        .expect("no arguments parse")
        .args;
    let d = &defaults.vm;
    if vm.workspace.is_some()
        || !vm.volumes.is_empty()
        || !vm.tmpfs.is_empty()
        || vm.changes.is_some()
        || vm.overlay_size.is_some()
        || vm.egress_log.is_some()
        || !vm.egress_allow.is_empty()
        || vm.system != d.system
        || vm.rootfs.is_some()
        || vm.image.is_some()
        || vm.kernel.is_some()
        || vm.mem != d.mem
        || vm.cpus != d.cpus
        || vm.pids != d.pids
        || vm.timeout.is_some()
        || !vm.env.is_empty()
        || vm.workdir.is_some()
        || vm.user != d.user
        || vm.huge_pages
        || vm.no_huge_pages
    {
        return Err(SandboxError::Snapshot(
            "--from takes the sandbox's settings from the snapshot: with it only --name, \
             --label, --idle-timeout and --egress may be given"
                .into(),
        ));
    }
    let opened =
        crate::snapshot::restore::open(from).map_err(|e| SandboxError::Snapshot(e.to_string()))?;
    let was = &opened.sandbox.config;
    // The snapshot's sandbox, as its own flags would have made it.
    let mut argv: Vec<std::ffi::OsString> = vec!["create".into()];
    let mut flag = |k: &str, v: std::ffi::OsString| {
        argv.push(k.into());
        argv.push(v);
    };
    flag("--mem", was.mem_mib.to_string().into());
    flag("--cpus", was.cpus.to_string().into());
    match &was.image {
        Some(image) => flag("--image", image.clone().into()),
        None => flag("--system", was.system.clone().into()),
    }
    flag("--user", was.user.clone().into());
    flag("--workdir", was.workdir.clone().into());
    if let Some(k) = &was.kernel {
        flag("--kernel", k.clone().into());
    }
    if let Some(w) = &was.workspace {
        flag("--workspace", w.clone().into());
    }
    if let Some(size) = was.overlay_size {
        flag("--overlay-size", size.to_string().into());
    }
    for v in &was.volumes {
        flag("--volume", v.into());
    }
    match (&vm.egress, &was.egress_gateway) {
        (Some(e), _) => flag("--egress", e.clone().into()),
        // Its own gateway, started anew with the same rules.
        (None, Some(g)) => {
            for r in &g.allow {
                flag("--egress-allow", r.into());
            }
            for c in &g.credentials {
                flag("--egress-credential", c.into());
            }
            if let Some(ca) = &g.ca {
                flag("--egress-ca", ca.into());
            }
            if let Some(log) = &g.log {
                flag("--egress-log", log.into());
            }
        }
        (None, None) => {
            if let Some(e) = &was.egress {
                flag("--egress", e.clone().into());
            }
        }
    }
    if let Some(t) = was.timeout_seconds {
        flag("--timeout", t.to_string().into());
    }
    for e in &was.env {
        flag("--env", e.clone().into());
    }
    if vm.no_seccomp {
        argv.push("--no-seccomp".into());
    }
    if vm.console {
        argv.push("--console".into());
    }
    let mut rebuilt = Line::try_parse_from(argv)
        .map_err(|e| SandboxError::Snapshot(format!("the snapshot's settings: {}", e.kind())))?
        .args;
    rebuilt.vm.restoring = true;
    let c = check(
        CreateArgs {
            name: args.name,
            labels: args.labels,
            idle_timeout: args.idle_timeout,
            from: None,
            ..rebuilt
        },
        None,
    )
    .map_err(|e| match e {
        SandboxError::Config(e) => SandboxError::Snapshot(format!(
            "its sandbox cannot be made again here: {:#}",
            anyhow::Error::from(e)
        )),
        e => e,
    })?;
    for w in &opened.warnings {
        eprintln!("amvm: warning: {w}");
    }
    let mut cfg = c.cfg;
    cfg.restore = Some(std::sync::Arc::new(opened.restore));
    create_from(cfg, c.config, c.name, c.labels, false)
}

/// What `create` checked before anything is made: the VMM's config (its session path still
/// unset) and what `state.json` will say of the sandbox.
pub(crate) struct Checked {
    pub cfg: RunConfig,
    /// A run's command, with an `--image`'s Entrypoint and Cmd applied.
    pub command: Vec<std::ffi::OsString>,
    pub config: Config,
    pub name: Option<String>,
    pub labels: std::collections::BTreeMap<String, String>,
}

/// Check `create`'s flags without touching anything; a bad flag is `SandboxError::Config`.
/// `command`: a run's, checked with them (its size with the environment's), not kept: it is
/// the run's exec. `--changes` (a run's) is checked into `cfg.overlay`.
pub(crate) fn check(
    mut args: CreateArgs,
    run: Option<Vec<std::ffi::OsString>>,
) -> Result<Checked, SandboxError> {
    args.vm = args.vm.resolve_image()?;
    let command = match run {
        Some(command) => args.vm.run_argv(command, true)?,
        None => Vec::new(),
    };
    let mut labels = std::collections::BTreeMap::new();
    for l in &args.labels {
        match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                labels.insert(k.to_string(), v.to_string());
            }
            _ => return Err(SandboxError::BadLabel(l.clone())),
        }
    }
    let config = Config {
        mem_mib: args.vm.mem,
        cpus: args.vm.cpus,
        system: args.vm.system.clone(),
        // Absolute: a snapshot's restore, from wherever it is run, makes it again.
        workspace: args
            .vm
            .workspace
            .as_ref()
            .map(|w| std::path::absolute(w).unwrap_or_else(|_| w.clone())),
        egress: args.vm.egress.clone(),
        timeout_seconds: args.vm.timeout,
        overlay_lower: None,
        overlay_scratch: None,
        overlay_size: None,
        idle_timeout_seconds: args.idle_timeout,
        kernel: None,
        user: args
            .vm
            .user
            .clone()
            .unwrap_or_else(|| crate::cli::DEFAULT_USER.into()),
        workdir: String::new(),
        env: args.vm.env.clone(),
        egress_gateway: None,
        image: args.vm.image.clone(),
        volumes: args
            .vm
            .volumes
            .iter()
            .map(|v| match v.split_once(':') {
                Some((host, rest)) => match std::path::absolute(host) {
                    Ok(h) => format!("{}:{rest}", h.display()),
                    Err(_) => v.clone(),
                },
                None => v.clone(),
            })
            .collect(),
    };
    // Everything checkable is checked before anything is made; the session path is set once
    // the directory exists.
    let mut cfg = args
        .vm
        .into_config_resolved(command.clone(), false, Some(PathBuf::from("/")))?;
    cfg.spec.argv.clear();
    Ok(Checked {
        config: Config {
            egress_gateway: cfg.gateway.clone(),
            ..config
        },
        cfg,
        command,
        name: args.name,
        labels,
    })
}

/// Boot a sandbox from a checked session config (`cfg.session` is set here) and what
/// `state.json` says of it; its id once it is ready.
///
/// A `tied` sandbox is a run's (`amvm run`): its supervisor dies with this process, its VMM
/// writes to this process's stderr (its errors, `--console`'s kernel log and `RUST_LOG`'s
/// lines reach the user as they happen, as when the VMM was the run's own process), and a VMM
/// that ends before the guest is ready is `SandboxError::Ended` with the VMM's exit status
/// (it said why on that stderr).
pub fn create_from(
    mut cfg: RunConfig,
    config: Config,
    name: Option<String>,
    labels: std::collections::BTreeMap<String, String>,
    tied: bool,
) -> Result<String, SandboxError> {
    let (id, dir) = super::make_dir(name.as_deref())?;
    cfg.session = Some(dir.join("guest.sock"));
    // A writable workspace: its upper layer on the host, kept until `rm` (diff and commit
    // read it).
    let mut config = config;
    if let Some(ov) = cfg.overlay.as_mut() {
        let made = crate::overlay::make_scratch(ov).and_then(|s| {
            // A restore's upper layer: the snapshot's, copied before the overlay is mounted.
            let Some(from) = cfg.restore.as_ref().and_then(|r| r.upper.as_ref()) else {
                return Ok(s);
            };
            let manifest = from.with_file_name("upper.json");
            match crate::snapshot::tree::load(from, &manifest, &crate::overlay::upper(&s)) {
                Ok(_) => Ok(s),
                Err(e) => {
                    crate::overlay::remove_scratch(&s);
                    Err(crate::overlay::OverlayError::Restore(e))
                }
            }
        });
        match made {
            Ok(s) => {
                ov.scratch = Some(s.clone());
                config.overlay_lower = Some(ov.lower.clone());
                config.overlay_scratch = Some(s);
                config.overlay_size = ov.size;
            }
            Err(e) => {
                let _ = super::remove_dir_and_name(&id, &dir, name.as_deref());
                return Err(SandboxError::Start(e.to_string()));
            }
        }
    }
    let info = Info {
        id: id.clone(),
        name,
        labels,
        state: "starting".into(),
        created: now(),
        pid: 0,
        vmm_pid: 0,
        pid_start: 0,
        vmm_start: 0,
        execs: 0,
        ended: None,
        vmm_exit: None,
        run: tied,
        config: Config {
            workdir: String::from_utf8_lossy(&cfg.spec.cwd).into_owned(),
            kernel: Some(cfg.kernel.clone()),
            ..config
        },
    };
    let fail = |e: SandboxError| {
        let _ = super::remove_dir_and_name(&id, &dir, info.name.as_deref());
        if let Some(s) = &info.config.overlay_scratch {
            crate::overlay::remove_scratch(s);
        }
        e
    };
    write_state(&dir, &info)
        .map_err(io_err(dir.display()))
        .map_err(fail)?;
    let (read_end, write_end) = pipe().map_err(io_err("pipe")).map_err(fail)?;
    let creator = std::process::id();
    // SAFETY: fork(2) from amvm's main thread before it started any other thread; the child
    // continues as an ordinary single-threaded process.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(fail(io_err("fork")(std::io::Error::last_os_error())));
    }
    if pid == 0 {
        drop(read_end);
        if tied {
            // SAFETY: prctl(2) with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            if std::os::unix::process::parent_id() != creator {
                // SAFETY: _exit(2): the creator is gone already.
                unsafe { libc::_exit(1) };
            }
        }
        let code = supervise(cfg, info.clone(), &dir, write_end, tied);
        // SAFETY: _exit(2) ends the supervisor without running anything of `create`'s.
        unsafe { libc::_exit(code) };
    }
    drop(write_end);
    let mut said = String::new();
    let _ = std::fs::File::from(read_end).read_to_string(&mut said);
    match said.strip_prefix("ok\n") {
        Some(_) => Ok(id),
        None => {
            // The supervisor is gone or going (it killed its VMM before saying so).
            let mut status = 0;
            // SAFETY: waitpid(2) for our own child into a local.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            let why = said.trim();
            if let Some(code) = why.strip_prefix("exit ").and_then(|c| c.parse().ok()) {
                return Err(fail(SandboxError::Ended(code)));
            }
            Err(fail(SandboxError::Start(if why.is_empty() {
                // Its last word, if it wrote one (a seccomp report, a panic).
                std::fs::read_to_string(dir.join("supervisor.log"))
                    .ok()
                    .and_then(|l| {
                        l.lines()
                            .rev()
                            .find(|l| !l.trim().is_empty())
                            .map(str::to_string)
                    })
                    .map(|l| format!("its supervisor died: {}", l.trim_start_matches("amvm: ")))
                    .unwrap_or_else(|| "its supervisor died without saying why".into())
            } else {
                why.to_string()
            })))
        }
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) fills the two-int array it is given; the result is checked.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let r = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as above.
    let w = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    Ok((r, w))
}

/// Point descriptor `target` at `path` (opened for writing, appended) or at /dev/null.
fn redirect(target: i32, path: Option<&Path>) {
    let f = match path {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p),
        None => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null"),
    };
    if let Ok(f) = f {
        // SAFETY: dup2(2) onto one of the standard descriptors; `f` stays valid for the call.
        unsafe { libc::dup2(f.as_raw_fd(), target) };
    }
}

/// The supervisor process; its exit status.
fn supervise(mut cfg: RunConfig, mut info: Info, dir: &Path, notify: OwnedFd, tied: bool) -> i32 {
    // Absolute: the supervisor leaves this working directory when it enters its own root.
    let dir = &std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    // SAFETY: setsid(2) takes nothing; the forked child is not a group leader.
    unsafe { libc::setsid() };
    // The creator may have blocked signals (a run does, for its command); this process
    // takes the default actions.
    crate::signals::unblock_all();
    // A run's VMM writes to the run's stderr (create_from).
    let user_stderr = if tied {
        // SAFETY: fcntl(2) duplicating descriptor 2; the result is checked.
        let fd = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
        // SAFETY: a fresh descriptor that nothing else owns.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    } else {
        None
    };
    redirect(0, None);
    redirect(1, None);
    redirect(2, Some(&dir.join("supervisor.log")));
    let mut notify = std::fs::File::from(notify);
    let bind = |name: &str| -> Result<std::os::unix::net::UnixListener, String> {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        let l = std::os::unix::net::UnixListener::bind(&path)
            .map_err(|e| format!("binding {}: {e}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        l.set_nonblocking(true)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(l)
    };
    let (guest, api) = match (bind("guest.sock"), bind("api.sock")) {
        (Ok(g), Ok(a)) => (g, a),
        (Err(e), _) | (_, Err(e)) => {
            let _ = notify.write_all(e.as_bytes());
            return 1;
        }
    };
    // `--egress-allow`: the sandbox's own gateway, listening before the VMM starts (which
    // binds its socket into the VMM's root); it ends with this process.
    let _gateway = match &cfg.gateway {
        Some(g) => match start_gateway(g, dir) {
            Ok(child) => {
                cfg.egress = Some(dir.join(GATEWAY_SOCK));
                Some(child)
            }
            Err(e) => {
                let _ = notify.write_all(e.as_bytes());
                return 1;
            }
        },
        None => None,
    };
    // The channel to the VMM (vmmctl.rs: pause, resume); close-on-exec, so virtiofsd never
    // holds it.
    let (ctl, vmm_ctl) = match std::os::unix::net::UnixStream::pair() {
        Ok(p) => p,
        Err(e) => {
            let _ = writeln!(notify, "the VMM's control channel: {e}");
            return 1;
        }
    };
    let me = std::process::id();
    // SAFETY: fork(2) while this process has one thread (tokio starts below).
    let vmm = unsafe { libc::fork() };
    if vmm < 0 {
        let _ = writeln!(notify, "fork: {}", std::io::Error::last_os_error());
        return 1;
    }
    if vmm == 0 {
        // SAFETY: prctl(2) with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
        if std::os::unix::process::parent_id() != me {
            // SAFETY: leaves at once.
            unsafe { libc::_exit(i32::from(crate::exit::AMVM_FAILURE)) };
        }
        drop((guest, api, notify, ctl));
        redirect(1, Some(&dir.join("vmm.log")));
        match &user_stderr {
            // SAFETY: dup2(2) of a descriptor this process owns onto descriptor 2.
            Some(fd) => unsafe {
                libc::dup2(fd.as_raw_fd(), 2);
            },
            None => redirect(2, Some(&dir.join("vmm.log"))),
        }
        drop(user_stderr);
        // Asked now: once the VMM's filters are in, isatty's ioctl is refused.
        // SAFETY: isatty(3) of a descriptor number.
        let on_terminal = unsafe { libc::isatty(2) } == 1;
        let t = crate::builder::Timeline::start();
        let code = match crate::builder::run(&cfg, &t, Some(OwnedFd::from(vmm_ctl))) {
            Ok(code) => code,
            Err(e) => {
                // 124 for its --timeout, as a run's (describe_end says "timed out").
                let code = e.exit_code();
                let text = format!("amvm: {:#}\n", anyhow::Error::from(e));
                // On a terminal (a run's, maybe raw under `-it`), CR LF: the line starts at
                // its left margin either way.
                let text = if on_terminal {
                    text.replace('\n', "\r\n")
                } else {
                    text
                };
                let _ = std::io::stderr().write_all(text.as_bytes());
                code
            }
        };
        // SAFETY: _exit(2) ends the VMM with its status (its vCPU threads may be in KVM_RUN).
        unsafe { libc::_exit(i32::from(code)) };
    }
    drop((user_stderr, vmm_ctl));
    info.pid = me;
    info.vmm_pid = vmm as u32;
    // Recorded so that `rm` never kills a stranger that reused a pid.
    info.pid_start = super::start_time(me).unwrap_or(0);
    info.vmm_start = super::start_time(vmm as u32).unwrap_or(0);
    let _ = write_state(dir, &info);
    let fail = |mut notify: std::fs::File, what: String| {
        let _ = notify.write_all(what.as_bytes());
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(vmm, libc::SIGKILL) };
        1
    };
    // Before the first byte from the guest: this process's namespaces and root (jail.rs),
    // then its runtime, then its seccomp filter (seccomp.rs), which every thread the runtime
    // starts later inherits.
    let held = info
        .config
        .overlay_size
        .and(info.config.overlay_scratch.as_deref());
    if let Err(e) = confine(dir, held) {
        return fail(notify, format!("confining the supervisor: {e}"));
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(notify, format!("starting the supervisor's runtime: {e}")),
    };
    if let Err(e) =
        crate::seccomp::confine_process(crate::seccomp::ThreadKind::Supervisor, cfg.seccomp)
    {
        return fail(notify, e.to_string());
    }
    let spec = cfg.spec.clone();
    let restored = match cfg.restore.is_some().then(host_entropy).transpose() {
        Ok(r) => r,
        Err(e) => return fail(notify, format!("randomness for the restored guest: {e}")),
    };
    let code = rt.block_on(serve(ServeArgs {
        dir: dir.to_path_buf(),
        info,
        spec,
        restored,
        first_exec_id: cfg.restore.as_ref().map_or(1, |r| r.next_exec_id),
        vmm,
        ctl,
        guest,
        api,
        notify,
        tied,
    }));
    let _ = std::fs::remove_file(dir.join("api.sock"));
    let _ = std::fs::remove_file(dir.join("guest.sock"));
    code
}

/// A sandbox's own gateway's socket, in its directory.
const GATEWAY_SOCK: &str = "egress.sock";
/// How long its gateway may take to listen.
const GATEWAY_START: Duration = Duration::from_secs(30);

/// Start `amvm gateway` for `spec` on `DIR/egress.sock` (its audit to the spec's log, else
/// `DIR/gateway.jsonl`; its stderr this process's, supervisor.log) and wait until it
/// listens. It gets SIGTERM when this process ends, and then removes its socket.
fn start_gateway(
    spec: &crate::config::GatewaySpec,
    dir: &Path,
) -> Result<std::process::Child, String> {
    use std::os::unix::process::CommandExt;
    let sock = dir.join(GATEWAY_SOCK);
    let log = spec
        .log
        .clone()
        .unwrap_or_else(|| dir.join("gateway.jsonl"));
    let me = std::process::id();
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0("amvm")
        .args(spec.args(&sock, &log))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    let hook = move || -> std::io::Result<()> {
        // SAFETY: prctl(2) with integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: getppid(2) takes nothing and cannot fail.
        if unsafe { libc::getppid() } as u32 != me {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the hook runs between fork and exec in the child; it calls only prctl(2) and
    // getppid(2), which are async-signal-safe, and allocates nothing.
    unsafe { cmd.pre_exec(hook) };
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting the egress gateway: {e}"))?;
    let until = std::time::Instant::now() + GATEWAY_START;
    loop {
        if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
            return Ok(child);
        }
        if let Ok(Some(status)) = child.try_wait() {
            // It said why on our stderr.
            let why = std::fs::read_to_string(dir.join("supervisor.log"))
                .ok()
                .and_then(|l| last_word(&l))
                .map(|w| w.trim_start_matches("amvm: ").to_string())
                .unwrap_or_else(|| format!("it ended ({status})"));
            return Err(format!("the egress gateway did not start: {why}"));
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the egress gateway did not listen within {} s",
                GATEWAY_START.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The supervisor's jail, entered once its VMM is forked (which jails itself): an empty
/// network namespace (it only accepts on the sockets it has bound), a private mount namespace
/// whose root holds its state directory and nothing else (and, with `--overlay-size`, the
/// overlay's scratch tmpfs at its own path, which `amvm diff` and a run's `--changes` read
/// through `/proc/PID/root`), no new privileges, no capabilities. Must run while the process
/// has one thread.
fn confine(dir: &Path, held_scratch: Option<&Path>) -> Result<(), crate::jail::JailError> {
    crate::jail::unshare_as_self(libc::CLONE_NEWNET)?;
    let mut dirs = vec![dir];
    dirs.extend(held_scratch);
    crate::jail::enter_root_of_dirs(&dirs)?;
    crate::jail::no_new_privs()?;
    crate::jail::drop_capabilities()
}

/// The host's randomness for a restored guest (getrandom(2): the kernel's CRNG).
fn host_entropy() -> std::io::Result<[u8; RESTORED_ENTROPY]> {
    let mut b = [0u8; RESTORED_ENTROPY];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: getrandom(2) writes at most `len - got` bytes into `b[got..]`, which is ours.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    Ok(b)
}

struct ServeArgs {
    dir: PathBuf,
    info: Info,
    spec: guest_init::protocol::RunSpec,
    /// A sandbox restored from a snapshot: its guest gets a Restored frame (the clock and this
    /// randomness) on its new control stream instead of the spec.
    restored: Option<[u8; RESTORED_ENTROPY]>,
    /// The first exec id (1, or a restored guest's next: snapshot/restore.rs).
    first_exec_id: u64,
    vmm: libc::pid_t,
    ctl: std::os::unix::net::UnixStream,
    guest: std::os::unix::net::UnixListener,
    api: std::os::unix::net::UnixListener,
    notify: std::fs::File,
    tied: bool,
}

/// What the tasks share.
struct Sup {
    dir: PathBuf,
    info: Mutex<Info>,
    spec: guest_init::protocol::RunSpec,
    restored: Option<[u8; RESTORED_ENTROPY]>,
    vmm: libc::pid_t,
    /// The channel to the VMM (vmmctl.rs), one request at a time; held across a state change
    /// it makes (pause, resume), so that those never interleave.
    vmm_ctl: tokio::sync::Mutex<UnixStream>,
    /// Frames for the guest's control stream.
    control: mpsc::UnboundedSender<Vec<u8>>,
    control_taken: AtomicBool,
    /// Execs waiting for their stream, by id.
    pending: Mutex<HashMap<u64, oneshot::Sender<UnixStream>>>,
    next_id: AtomicU64,
    /// Set once the VM has ended (and state.json says how).
    ended: watch::Sender<bool>,
    stopping: AtomicBool,
    /// Why it is stopping, when not by `amvm stop`.
    stop_reason: Mutex<Option<String>>,
    /// Execs running, and when the last one ended (for `--idle-timeout`).
    active_execs: AtomicUsize,
    last_active: Mutex<std::time::Instant>,
    /// API connections being served.
    connections: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sup {
    fn send_control(&self, kind: FrameKind, payload: &[u8]) {
        let mut f = Vec::with_capacity(payload.len() + 5);
        encode_frame(kind, payload, &mut f);
        let _ = self.control.send(f);
    }

    fn update(&self, f: impl FnOnce(&mut Info)) -> Info {
        let mut info = lock(&self.info);
        f(&mut info);
        if let Err(e) = write_state(&self.dir, &info) {
            tracing::warn!("writing state.json: {e}");
        }
        info.clone()
    }

    fn snapshot(&self) -> Info {
        lock(&self.info).clone()
    }
}

async fn serve(a: ServeArgs) -> i32 {
    let vmm_ctl = match a
        .ctl
        .set_nonblocking(true)
        .and_then(|()| UnixStream::from_std(a.ctl))
    {
        Ok(c) => c,
        Err(e) => {
            let mut n = a.notify;
            let _ = writeln!(n, "the VMM's control channel: {e}");
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(a.vmm, libc::SIGKILL) };
            return 1;
        }
    };
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (ended, _) = watch::channel(false);
    let sup = Arc::new(Sup {
        dir: a.dir,
        info: Mutex::new(a.info),
        spec: a.spec,
        restored: a.restored,
        vmm: a.vmm,
        vmm_ctl: tokio::sync::Mutex::new(vmm_ctl),
        control: control_tx,
        control_taken: AtomicBool::new(false),
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(a.first_exec_id),
        ended,
        stopping: AtomicBool::new(false),
        stop_reason: Mutex::new(None),
        active_execs: AtomicUsize::new(0),
        last_active: Mutex::new(std::time::Instant::now()),
        connections: AtomicUsize::new(0),
    });
    let vmm = a.vmm;
    let mut vmm_exit = tokio::task::spawn_blocking(move || {
        let mut status = 0;
        loop {
            // SAFETY: waitpid(2) for our own child into a local.
            let r = unsafe { libc::waitpid(vmm, &mut status, 0) };
            if r == vmm
                || (r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR))
            {
                return status;
            }
        }
    });
    let (guest, api) = match (
        tokio::net::UnixListener::from_std(a.guest),
        tokio::net::UnixListener::from_std(a.api),
    ) {
        (Ok(g), Ok(a)) => (g, a),
        (Err(e), _) | (_, Err(e)) => {
            let mut n = a.notify;
            let _ = writeln!(n, "the supervisor's sockets: {e}");
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(vmm, libc::SIGKILL) };
            return 1;
        }
    };
    let (ready_tx, ready_rx) = oneshot::channel::<Result<(), String>>();
    let mut control_rx = Some(control_rx);
    let mut ready_tx = Some(ready_tx);
    let s = sup.clone();
    tokio::spawn(async move {
        loop {
            let conn = match guest.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    accept_failed("guest.sock", &e).await;
                    continue;
                }
            };
            let s = s.clone();
            // The control stream takes the channel's receiver and the readiness sender.
            let control = if s.control_taken.load(Ordering::Relaxed) {
                None
            } else {
                Some((control_rx.take(), ready_tx.take()))
            };
            tokio::spawn(guest_stream(s, conn, control));
        }
    });

    // Boot: Ready, or the VMM's end, or the boot timeout.
    let mut notify = a.notify;
    let mut exited = None;
    let started = tokio::select! {
        r = ready_rx => r.unwrap_or_else(|_| Err("the guest's control stream ended".into())),
        s = &mut vmm_exit => {
            exited = Some(s.unwrap_or(0));
            Err("the VMM exited".into())
        }
        _ = tokio::time::sleep(BOOT_TIMEOUT) => Err(format!("the guest was not ready within {} s", BOOT_TIMEOUT.as_secs())),
    };
    if let Err(why) = started {
        let msg = match exited {
            // A run's VMM said why on the run's stderr: its status is all the run needs.
            Some(s) if a.tied && libc::WIFEXITED(s) => format!("exit {}\n", libc::WEXITSTATUS(s)),
            Some(s) if a.tied => describe_end(s, &sup.dir),
            _ => {
                let log = std::fs::read_to_string(sup.dir.join("vmm.log")).unwrap_or_default();
                let log = log.trim();
                if log.is_empty() {
                    why
                } else {
                    log.trim_start_matches("amvm: ").to_string()
                }
            }
        };
        let _ = notify.write_all(msg.as_bytes());
        if exited.is_none() {
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(vmm, libc::SIGKILL) };
            let _ = vmm_exit.await;
        }
        return 1;
    }
    sup.update(|i| i.state = "running".into());
    *lock(&sup.last_active) = std::time::Instant::now();
    let _ = notify.write_all(b"ok\n");
    drop(notify);

    let s = sup.clone();
    tokio::spawn(async move {
        loop {
            let conn = match api.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    accept_failed("api.sock", &e).await;
                    continue;
                }
            };
            let s = s.clone();
            s.connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if let Err(e) = api_connection(&s, conn).await {
                    tracing::debug!("API connection: {e}");
                }
                s.connections.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });

    if let Some(idle) = sup.snapshot().config.idle_timeout_seconds {
        let s = sup.clone();
        tokio::spawn(async move {
            let idle = Duration::from_secs(idle);
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let quiet = lock(&s.last_active).elapsed();
                // A paused sandbox is kept as it is, however long (resume restarts the clock).
                let paused = lock(&s.info).state == "paused";
                if s.active_execs.load(Ordering::SeqCst) == 0 && quiet >= idle && !paused {
                    *lock(&s.stop_reason) = Some(format!(
                        "stopped after {} s without an exec (--idle-timeout)",
                        idle.as_secs()
                    ));
                    stop(&s, 10);
                    return;
                }
            }
        });
    }

    let status = vmm_exit.await.unwrap_or(0);
    let stopped = sup.stopping.load(Ordering::SeqCst);
    let how = describe_end(status, &sup.dir);
    let reason = lock(&sup.stop_reason).take();
    sup.update(|i| {
        i.vmm_exit = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status) as u8);
        i.state = if stopped { "stopped" } else { "exited" }.into();
        i.ended = Some(if stopped {
            reason.unwrap_or_else(|| "stopped by amvm stop".into())
        } else {
            how
        });
    });
    lock(&sup.pending).clear();
    let _ = sup.ended.send(true);
    // Let the waiting API calls answer before the process goes.
    for _ in 0..500 {
        if sup.connections.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if a.tied {
        // A run's sandbox stays until the run removed it and ended (this process dies with
        // it): with `--overlay-size` its workspace changes live in this process's mounts, and
        // the run writes them out after the VM ended (a timeout, a crash) too.
        std::future::pending::<()>().await;
    }
    0
}

/// An accept that failed (out of descriptors: EMFILE, ENFILE; out of memory) fails again at
/// once while its cause lasts: wait a little rather than spin, and say so.
async fn accept_failed(socket: &str, e: &std::io::Error) {
    tracing::warn!("accepting on {socket}: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// How the VMM ended, in words (with the last line it wrote, when it failed).
fn describe_end(status: i32, dir: &Path) -> String {
    let last = std::fs::read_to_string(dir.join("vmm.log"))
        .ok()
        .and_then(|l| last_word(&l));
    let with_last = |s: String| match &last {
        Some(l) => format!("{s}: {}", l.trim_start_matches("amvm: ")),
        None => s,
    };
    if libc::WIFSIGNALED(status) {
        format!("the VMM was killed by signal {}", libc::WTERMSIG(status))
    } else {
        match libc::WEXITSTATUS(status) {
            0 => "the guest shut down".into(),
            124 => with_last("timed out".into()),
            n => with_last(format!("the VMM failed (status {n})")),
        }
    }
}

/// What the VMM's log says last: its last report (the last line that begins `amvm: `), cut
/// before the guest console's lines it quotes, and the guest kernel's panic line wherever it
/// is among them (a long call trace after it does not push it out); else its last line.
fn last_word(log: &str) -> Option<String> {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let Some(at) = lines.iter().rposition(|l| l.starts_with("amvm: ")) else {
        return lines.last().map(|l| l.to_string());
    };
    let head = lines[at];
    let head = head
        .split_once("; the guest console's last lines:")
        .map_or(head, |(h, _)| h);
    Some(
        match lines[at..]
            .iter()
            .find(|l| l.contains(crate::output::PANIC_MARK))
        {
            Some(panic) => format!("{head}: {}", panic.trim()),
            None => head.to_string(),
        },
    )
}

type ControlParts = (
    Option<mpsc::UnboundedReceiver<Vec<u8>>>,
    Option<oneshot::Sender<Result<(), String>>>,
);

/// One stream from `guest.sock`: the control stream or an exec's.
async fn guest_stream(sup: Arc<Sup>, mut conn: UnixStream, control: Option<ControlParts>) {
    let Ok(tag) = conn.read_u8().await else {
        return;
    };
    match tag {
        SESSION_TAG_CONTROL => {
            let Some((Some(rx), Some(ready))) = control else {
                return;
            };
            if sup.control_taken.swap(true, Ordering::SeqCst) {
                return;
            }
            control_stream(&sup, conn, rx, ready).await;
        }
        SESSION_TAG_EXEC => {
            // Exactly the Attach frame (5-byte header, 8-byte id): what follows is the exec's.
            let mut head = [0u8; 13];
            if tokio::time::timeout(ATTACH_TIMEOUT, conn.read_exact(&mut head))
                .await
                .is_err()
            {
                return;
            }
            let mut id = None;
            let mut p = FrameParser::new(Direction::ToHost);
            let parsed = p.feed(&head, |f| {
                if let Frame::Attach(i) = f {
                    id = Some(i);
                }
            });
            match (parsed, id) {
                (Ok(()), Some(id)) => {
                    if let Some(waiting) = lock(&sup.pending).remove(&id) {
                        let _ = waiting.send(conn);
                    }
                }
                (r, _) => tracing::warn!("an exec stream that did not attach: {r:?}"),
            }
        }
        _ => {}
    }
}

async fn control_stream(
    sup: &Sup,
    conn: UnixStream,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let (mut r, mut w) = conn.into_split();
    let mut first = Vec::new();
    match &sup.restored {
        // A restored guest is set up already: it needs the time and its own randomness.
        Some(entropy) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            encode_frame(
                FrameKind::Restored,
                &restored_payload(now, entropy),
                &mut first,
            );
        }
        None => encode_frame(FrameKind::Spec, &sup.spec.encode(), &mut first),
    }
    if w.write_all(&first).await.is_err() {
        let _ = ready.send(Err("the guest's control stream broke".into()));
        return;
    }
    let mut ready = Some(ready);
    let mut said = Vec::new();
    let mut parser = FrameParser::new(Direction::ToHost);
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            frame = rx.recv() => match frame {
                Some(f) => if w.write_all(&f).await.is_err() { break },
                None => break,
            },
            n = r.read(&mut buf) => {
                let n = match n { Ok(0) | Err(_) => break, Ok(n) => n };
                let mut is_ready = false;
                let fed = parser.feed(&buf[..n], |f| match f {
                    Frame::Ready => is_ready = true,
                    Frame::Stderr(b) if said.len() < 64 * 1024 => said.extend_from_slice(&b),
                    _ => {}
                });
                if let Err(e) = fed {
                    tracing::warn!("the guest's control stream: {e}");
                    break;
                }
                if is_ready {
                    if let Some(t) = ready.take() { let _ = t.send(Ok(())); }
                }
            }
        }
    }
    if let Some(t) = ready.take() {
        let said = String::from_utf8_lossy(&said);
        let said = said.trim();
        let _ = t.send(Err(if said.is_empty() {
            "the guest closed its control stream before it was ready".into()
        } else {
            said.trim_start_matches("amvm: ").to_string()
        }));
    }
    let _ = w.shutdown().await;
}

/// Serve one API request.
async fn api_connection(sup: &Arc<Sup>, mut conn: UnixStream) -> Result<(), String> {
    let (head, rest, fds) = match http::read_head_with_fds(&mut conn).await? {
        Some(Ok(h)) => h,
        Some(Err((code, e))) => return reply_error(&mut conn, code, &e).await,
        None => return Ok(()),
    };
    let method = head.first.0.as_str();
    let (path, query) = match api::split_target(&head.first.1) {
        Ok(t) => t,
        Err(e) => return reply_error(&mut conn, 400, &e).await,
    };
    if path == "/v1/archive" {
        // Its body (a tar of any size) is streamed, not read here.
        return match method {
            "PUT" => match head.declared_length() {
                Ok(len) => {
                    // curl asks before a large body; the body is wanted whatever it holds.
                    if head
                        .header("expect")
                        .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
                    {
                        conn.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    archive::put(sup, conn, &query, len, rest).await
                }
                Err(e) => reply_error(&mut conn, 400, &e).await,
            },
            "GET" => archive::get(sup, conn, &query).await,
            _ => reply_error(&mut conn, 405, &format!("{method} {path}: wrong method")).await,
        };
    }
    let (body, leftover) = match http::read_body(&mut conn, &head, rest).await? {
        Some(Ok(b)) => b,
        Some(Err((code, e))) => return reply_error(&mut conn, code, &e).await,
        None => return Ok(()),
    };
    match (method, path) {
        ("GET", "/v1/sandbox") => reply_json(&mut conn, 200, &sup.snapshot()).await,
        ("GET", "/v1/wait") => {
            let mut ended = sup.ended.subscribe();
            let _ = ended.wait_for(|e| *e).await;
            reply_json(&mut conn, 200, &sup.snapshot()).await
        }
        ("POST", "/v1/stop") => {
            let req: StopRequest = match parse_body(&body) {
                Ok(r) => r,
                Err(e) => return reply_error(&mut conn, 400, &e).await,
            };
            stop(sup, req.grace_seconds);
            let mut ended = sup.ended.subscribe();
            let _ = ended.wait_for(|e| *e).await;
            reply_json(&mut conn, 200, &sup.snapshot()).await
        }
        ("POST", "/v1/snapshot") => {
            let req: api::SnapshotRequest = match parse_body(&body) {
                Ok(r) => r,
                Err(e) => return reply_error(&mut conn, 400, &e).await,
            };
            match snapshot(sup, fds, req.stop).await {
                Ok(answer) => reply_json(&mut conn, 200, &answer).await,
                Err((code, e)) => reply_error(&mut conn, code, &e).await,
            }
        }
        ("POST", "/v1/pause") => match pause(sup).await {
            Ok(info) => reply_json(&mut conn, 200, &info).await,
            Err((code, e)) => reply_error(&mut conn, code, &e).await,
        },
        ("POST", "/v1/resume") => match resume(sup).await {
            Ok(info) => reply_json(&mut conn, 200, &info).await,
            Err((code, e)) => reply_error(&mut conn, code, &e).await,
        },
        ("POST", "/v1/exec") => {
            let req: ExecRequest = match parse_body(&body) {
                Ok(r) => r,
                Err(e) => return reply_error(&mut conn, 400, &e).await,
            };
            if !head
                .header("upgrade")
                .is_some_and(|u| u.eq_ignore_ascii_case(EXEC_UPGRADE))
            {
                let msg = format!("an exec needs the header `Upgrade: {EXEC_UPGRADE}`");
                return reply_error(&mut conn, 400, &msg).await;
            }
            exec(sup, conn, req, leftover).await
        }
        (
            _,
            "/v1/sandbox" | "/v1/wait" | "/v1/stop" | "/v1/exec" | "/v1/pause" | "/v1/resume"
            | "/v1/snapshot",
        ) => reply_error(&mut conn, 405, &format!("{method} {path}: wrong method")).await,
        _ => reply_error(&mut conn, 404, &format!("no such endpoint {path}")).await,
    }
}

/// Ask the guest to stop (SIGTERM, `grace` s, SIGKILL); kill the VMM if it has not ended
/// `STOP_MARGIN` after that.
fn stop(sup: &Arc<Sup>, grace: u32) {
    if sup.stopping.swap(true, Ordering::SeqCst) || *sup.ended.borrow() {
        return;
    }
    let was_paused = lock(&sup.info).state == "paused";
    sup.update(|i| i.state = "stopping".into());
    sup.send_control(FrameKind::Shutdown, &grace.to_le_bytes());
    let s = sup.clone();
    tokio::spawn(async move {
        // A paused guest reads its Shutdown once its vCPUs run again.
        if was_paused {
            let mut ctl = s.vmm_ctl.lock().await;
            if let Err(e) = crate::vmmctl::ask(&mut ctl, crate::vmmctl::Request::Resume, &[]).await
            {
                tracing::warn!("resuming the paused guest to stop it: {e}");
            }
        }
        let mut ended = s.ended.subscribe();
        let limit = Duration::from_secs(u64::from(grace)) + STOP_MARGIN;
        if tokio::time::timeout(limit, ended.wait_for(|e| *e))
            .await
            .is_err()
        {
            tracing::warn!("the guest did not stop within {limit:?}: killing the VMM");
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(s.vmm, libc::SIGKILL) };
        }
    });
}

/// `amvm pause`: the vCPUs stopped (the VMM parks them), the sandbox `paused`. Pausing a
/// paused sandbox changes nothing.
async fn pause(sup: &Arc<Sup>) -> Result<Info, (u16, String)> {
    let mut ctl = sup.vmm_ctl.lock().await;
    let info = sup.snapshot();
    match info.state.as_str() {
        "paused" => return Ok(info),
        "running" => {}
        other => {
            return Err((
                409,
                format!(
                    "sandbox {} is {other}: only a running sandbox can be paused",
                    info.id
                ),
            ))
        }
    }
    crate::vmmctl::ask(&mut ctl, crate::vmmctl::Request::Pause, &[])
        .await
        .map_err(|e| (500, format!("pausing sandbox {}: {e}", info.id)))?;
    // A stop that came meanwhile (it waited for nothing) wins: let the guest read it.
    if sup.stopping.load(Ordering::SeqCst) {
        let _ = crate::vmmctl::ask(&mut ctl, crate::vmmctl::Request::Resume, &[]).await;
        return Err((409, format!("sandbox {} is stopping", info.id)));
    }
    Ok(sup.update(|i| i.state = "paused".into()))
}

/// `amvm snapshot`: the VMM writes the machine's state and guest RAM to the two files the
/// request brought (state, memory); the sandbox goes on as it was (running or paused), or,
/// with `stop`, ends.
async fn snapshot(
    sup: &Arc<Sup>,
    fds: Vec<OwnedFd>,
    stop: bool,
) -> Result<api::SnapshotAnswer, (u16, String)> {
    if fds.len() != 2 {
        return Err((
            400,
            format!(
                "a snapshot needs its two files sent with the request (SCM_RIGHTS: the state \
                 file, then the memory file; amvm snapshot does this); {} came",
                fds.len()
            ),
        ));
    }
    let mut ctl = sup.vmm_ctl.lock().await;
    let info = sup.snapshot();
    if !matches!(info.state.as_str(), "running" | "paused") {
        return Err((
            409,
            format!(
                "sandbox {} is {}: only a running or paused sandbox can be snapshotted",
                info.id, info.state
            ),
        ));
    }
    if info.config.overlay_scratch.is_some() && info.state != "paused" {
        return Err((
            409,
            format!(
                "sandbox {} has an overlay workspace: pause it first, and copy its upper layer \
                 while it is paused (amvm snapshot does both)",
                info.id
            ),
        ));
    }
    let raw: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let summary = crate::vmmctl::ask(&mut ctl, crate::vmmctl::Request::Snapshot, &raw)
        .await
        .map_err(|e| (500, format!("snapshot of sandbox {}: {e}", info.id)))?;
    drop(fds);
    // Read after the VMM's answer: an exec id handed out before the guest was paused is below.
    let next_exec_id = sup.next_id.load(Ordering::SeqCst);
    #[derive(serde::Deserialize)]
    struct Summary {
        state_bytes: u64,
        memory_bytes: u64,
        memory_written: u64,
    }
    let s: Summary = serde_json::from_str(&summary)
        .map_err(|e| (500, format!("the VMM's answer {summary:?}: {e}")))?;
    let sandbox = if stop {
        sup.stopping.store(true, Ordering::SeqCst);
        *lock(&sup.stop_reason) = Some("stopped by amvm snapshot --stop".into());
        sup.update(|i| i.state = "stopping".into());
        // The snapshot holds the guest: nothing of it needs to end gracefully.
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(sup.vmm, libc::SIGKILL) };
        drop(ctl);
        let mut ended = sup.ended.subscribe();
        let _ = ended.wait_for(|e| *e).await;
        sup.snapshot()
    } else {
        sup.snapshot()
    };
    Ok(api::SnapshotAnswer {
        state_bytes: s.state_bytes,
        memory_bytes: s.memory_bytes,
        memory_written: s.memory_written,
        next_exec_id,
        sandbox,
    })
}

/// `amvm resume`: the vCPUs run again. Resuming a running sandbox changes nothing.
async fn resume(sup: &Arc<Sup>) -> Result<Info, (u16, String)> {
    let mut ctl = sup.vmm_ctl.lock().await;
    let info = sup.snapshot();
    match info.state.as_str() {
        "running" => return Ok(info),
        "paused" => {}
        other => {
            return Err((
                409,
                format!(
                    "sandbox {} is {other}: only a paused sandbox can be resumed",
                    info.id
                ),
            ))
        }
    }
    crate::vmmctl::ask(&mut ctl, crate::vmmctl::Request::Resume, &[])
        .await
        .map_err(|e| (500, format!("resuming sandbox {}: {e}", info.id)))?;
    *lock(&sup.last_active) = std::time::Instant::now();
    Ok(sup.update(|i| i.state = "running".into()))
}

/// An exec's resource limits as numbers, or what is wrong with one.
fn rlimits(limits: &[api::Rlimit]) -> Result<Vec<(u32, u64, u64)>, String> {
    limits
        .iter()
        .map(|l| {
            let n = guest_init::protocol::rlimit_number(&l.kind)
                .ok_or_else(|| format!("the resource limit {:?} is unknown", l.kind))?;
            if l.soft > l.hard {
                return Err(format!(
                    "the resource limit {}: soft {} is above hard {}",
                    l.kind, l.soft, l.hard
                ));
            }
            Ok((n, l.soft, l.hard))
        })
        .collect()
}

/// The exec spec of `req` on top of the sandbox's defaults, or what is wrong with it.
fn exec_spec(sup: &Sup, id: u64, req: &ExecRequest) -> Result<ExecSpec, String> {
    if req.argv.is_empty() {
        return Err("an exec needs a command (argv is empty)".into());
    }
    if req.groups.len() > guest_init::protocol::MAX_GROUPS {
        return Err(format!(
            "{} supplementary groups: too many",
            req.groups.len()
        ));
    }
    let info = sup.snapshot();
    let user = req.user.as_deref().unwrap_or(&info.config.user);
    let (uid, gid) = crate::config::parse_user(user).map_err(|e| e.to_string())?;
    let root = match &req.root {
        Some(r) if r.starts_with('/') && !r.contains('\0') && r != "/" => r.clone(),
        Some(r) => {
            return Err(format!(
                "--root {r}: say an absolute directory of the guest other than /"
            ))
        }
        None => String::new(),
    };
    let cwd = match &req.workdir {
        Some(w) if w.starts_with('/') => w.clone(),
        Some(w) => return Err(format!("-w {w}: the working directory must be absolute")),
        None => info.config.workdir.clone(),
    };
    let env = if req.clear_env {
        for kv in &req.env {
            if !matches!(kv.split_once('='), Some((k, _)) if !k.is_empty()) {
                return Err(format!("-e {kv}: say KEY=VAL"));
            }
        }
        req.env.iter().map(|kv| kv.as_bytes().to_vec()).collect()
    } else {
        let mut extra = info.config.env.clone();
        if req.tty.is_some() {
            extra.push("TERM=xterm".into());
        }
        extra.extend(req.env.iter().cloned());
        crate::config::workload_env(uid, &extra).map_err(|e| e.to_string())?
    };
    let spec = ExecSpec {
        id,
        argv: req
            .argv
            .iter()
            .map(super::api::Arg::bytes)
            .collect::<Result<_, _>>()?,
        env,
        cwd: cwd.into_bytes(),
        uid,
        gid,
        stdin: req.stdin,
        tty: req.tty.map(|t| (t.rows, t.cols)),
        caps: req.capabilities,
        groups: req.groups.clone(),
        rlimits: rlimits(&req.rlimits)?,
        root: root.into_bytes(),
    };
    let len = spec.encode().len();
    if len > guest_init::protocol::MAX_SPEC_LEN {
        return Err(format!(
            "the command and its environment take {len} bytes, more than the {} allowed",
            guest_init::protocol::MAX_SPEC_LEN
        ));
    }
    Ok(spec)
}

async fn exec(
    sup: &Arc<Sup>,
    mut conn: UnixStream,
    req: ExecRequest,
    leftover: Vec<u8>,
) -> Result<(), String> {
    let (id, guest) = match start_exec(sup, &req).await {
        Ok(started) => started,
        Err((code, msg)) => return reply_error(&mut conn, code, &msg).await,
    };
    let head = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: {EXEC_UPGRADE}\r\nConnection: Upgrade\r\n\r\n"
    );
    conn.write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let _busy = Busy::new(sup);
    relay(sup, id, conn, guest, leftover).await;
    Ok(())
}

/// Start `req` in the guest: its id and its stream, once attached; else the status code and
/// error to answer with.
async fn start_exec(sup: &Arc<Sup>, req: &ExecRequest) -> Result<(u64, UnixStream), (u16, String)> {
    let info = sup.snapshot();
    if info.state == "paused" {
        return Err((
            409,
            format!(
                "sandbox {} is paused: `amvm resume {}` first",
                info.id,
                info.name.as_deref().unwrap_or(&info.id)
            ),
        ));
    }
    if info.state != "running" {
        return Err((
            409,
            format!("sandbox {} is not running ({})", info.id, info.state),
        ));
    }
    let id = sup.next_id.fetch_add(1, Ordering::SeqCst);
    let spec = exec_spec(sup, id, req).map_err(|e| (400, e))?;
    let (tx, rx) = oneshot::channel();
    lock(&sup.pending).insert(id, tx);
    sup.update(|i| i.execs += 1);
    sup.send_control(FrameKind::Exec, &spec.encode());
    let mut ended = sup.ended.subscribe();
    let guest = tokio::select! {
        g = tokio::time::timeout(ATTACH_TIMEOUT, rx) => g.ok().and_then(Result::ok),
        _ = ended.wait_for(|e| *e) => None,
    };
    match guest {
        Some(g) => Ok((id, g)),
        None => {
            lock(&sup.pending).remove(&id);
            Err((500, "the sandbox did not start the command".into()))
        }
    }
}

/// An exec (or archive transfer) in progress, for `--idle-timeout`: the sandbox is not idle
/// while one lives, and its end counts as the last activity.
struct Busy<'a>(&'a Sup);

impl<'a> Busy<'a> {
    fn new(sup: &'a Sup) -> Busy<'a> {
        sup.active_execs.fetch_add(1, Ordering::SeqCst);
        Busy(sup)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        *lock(&self.0.last_active) = std::time::Instant::now();
        self.0.active_execs.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Move one exec's frames: the guest's output to the client (validated, re-encoded), the
/// client's stdin and signals to the guest. The client leaving kills the process.
async fn relay(sup: &Sup, id: u64, client: UnixStream, guest: UnixStream, leftover: Vec<u8>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut gr, mut gw) = guest.into_split();
    let to_client = async {
        let mut parser = FrameParser::new(Direction::ToHost);
        let mut buf = vec![0u8; 64 * 1024];
        let mut out = Vec::with_capacity(64 * 1024 + 16);
        loop {
            let n = match gr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            out.clear();
            let (mut exited, mut bad) = (false, false);
            let fed = parser.feed(&buf[..n], |f| match f {
                Frame::Stdout(b) if !exited => encode_chunks(FrameKind::Stdout, &b, &mut out),
                Frame::Stderr(b) if !exited => encode_chunks(FrameKind::Stderr, &b, &mut out),
                Frame::Exit(c) if !exited => {
                    encode_frame(FrameKind::Exit, &[c], &mut out);
                    exited = true;
                }
                _ => bad = true,
            });
            if let Err(e) = fed {
                tracing::warn!("exec {id}: the guest's stream: {e}");
                return;
            }
            if bad {
                tracing::warn!("exec {id}: the guest sent a frame that has no place here");
                return;
            }
            if cw.write_all(&out).await.is_err() || exited {
                return;
            }
        }
    };
    let from_client = async {
        let mut parser = FrameParser::new(Direction::ToSandbox);
        let mut pending = leftover;
        let mut buf = vec![0u8; 64 * 1024];
        let mut stdin_open = true;
        loop {
            let mut frames = Vec::new();
            if parser.feed(&pending, |f| frames.push(f)).is_err() {
                return;
            }
            for f in frames {
                match f {
                    Frame::Stdin(b) if stdin_open => {
                        // The command no longer reads stdin: the rest is dropped.
                        stdin_open = gw.write_all(&b).await.is_ok();
                    }
                    Frame::StdinEnd if stdin_open => {
                        stdin_open = false;
                        let _ = gw.shutdown().await;
                    }
                    Frame::Resize { rows, cols } => sup
                        .send_control(FrameKind::ExecResize, &exec_resize_payload(id, rows, cols)),
                    Frame::Signal(s) => {
                        sup.send_control(FrameKind::ExecSignal, &exec_signal_payload(id, s))
                    }
                    _ => {}
                }
            }
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending = buf[..n].to_vec();
        }
    };
    tokio::select! {
        () = to_client => {}
        () = from_client => {
            // The client is gone (or broke the protocol): so is its command.
            sup.send_control(FrameKind::ExecSignal, &exec_signal_payload(id, libc::SIGKILL as u8));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::last_word;

    #[test]
    fn the_panic_line_is_kept_whatever_the_tail() {
        let mut log = String::from(
            "amvm: the guest stopped (its kernel panicked) without reporting an exit status; the guest console's last lines:\n\
             [    2.0] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000009\n",
        );
        for i in 0..40 {
            log.push_str(&format!("[    2.1] trace line {i}\n"));
        }
        assert_eq!(
            last_word(&log).unwrap(),
            "amvm: the guest stopped (its kernel panicked) without reporting an exit status: [    2.0] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000009"
        );
        // A report without a panic: the report itself, not the console's last line.
        assert_eq!(
            last_word("amvm: timed out after 3 s\n\n").unwrap(),
            "amvm: timed out after 3 s"
        );
        assert_eq!(
            last_word("amvm: the guest failed: x; the guest console's last lines:\nboot\nend\n")
                .unwrap(),
            "amvm: the guest failed: x"
        );
        // No report at all: the last line.
        assert_eq!(last_word("a\nb\n").unwrap(), "b");
        assert_eq!(last_word(""), None);
    }
}
