//! amvm as an OCI runtime (`amvm-runc`, or `amvm oci`): the runc command line that Docker,
//! podman and containerd drive, each container one sandbox (one microVM).
//!
//! `create` maps the bundle (spec.rs), boots the sandbox and leaves behind the container's
//! process: a small process of ours, holding the stdio the engine gave `create`, that waits on
//! `start.fifo` until `start`, then runs the container's process as the sandbox's first exec,
//! with the same stdio, and exits with its status; the engine waits for it as for runc's
//! container init. Signals sent to it (`kill`) are forwarded to that exec in the guest; SIGKILL
//! ends it, and with it the exec. `exec` is one more exec in the same sandbox; `delete` removes
//! the sandbox and the container's state.
//!
//! State lives under `--root` (default `/run/amvm-runc`, or `$XDG_RUNTIME_DIR/amvm-runc` for
//! others than root): `ID/state.json`, `ID/start.fifo`, `ID/started`, and the sandboxes under
//! `sb/` (apart from `amvm ls`'s).

pub mod console;
pub mod spec;

use crate::sandbox::{self, SandboxError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The OCI runtime spec version amvm implements.
pub const OCI_VERSION: &str = "1.0.2";

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{0}")]
    Spec(String),
    #[error("container {0} does not exist")]
    NoContainer(String),
    #[error("container {0} exists already")]
    Exists(String),
    #[error("container id {0:?}: use letters, digits, '.', '_', '+' and '-' (not first)")]
    BadId(String),
    #[error("container {0} is {1}")]
    State(String, &'static str),
    /// runc's words for it ("container not running"): containerd's runc shim takes an error
    /// holding them from `kill` as "the process has finished already", not as a failure.
    #[error("container {0}: container not running")]
    NotRunning(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("{0} is not supported by amvm")]
    Unsupported(String),
    #[error("signal {0:?}: say a number or a name such as TERM or SIGKILL")]
    BadSignal(String),
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> OciError {
    let what = what.to_string();
    move |e| OciError::Io(what, e)
}

/// runc's command line, the part engines use.
#[derive(Debug, clap::Parser)]
#[command(
    name = "amvm-runc",
    version,
    about = "amvm as an OCI runtime: each container in a microVM of its own"
)]
pub struct OciCli {
    /// Where containers' state is kept.
    #[arg(long, global = true, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Append errors to FILE (as well as stderr).
    #[arg(long, global = true, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// The --log file's format: text or json.
    #[arg(long = "log-format", global = true, default_value = "text")]
    pub log_format: String,
    /// Accepted for engines that pass it: the VM is the container's cgroup boundary.
    #[arg(long = "systemd-cgroup", global = true)]
    pub systemd_cgroup: bool,
    /// Accepted for engines that pass it (RUST_LOG raises amvm's logging).
    #[arg(long, global = true)]
    pub debug: bool,
    #[command(subcommand)]
    pub command: OciCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum OciCommand {
    /// Boot the container's VM; its process waits for `start`.
    Create {
        #[arg(long, short = 'b', default_value = ".", value_name = "DIR")]
        bundle: PathBuf,
        #[arg(long = "pid-file", value_name = "FILE")]
        pid_file: Option<PathBuf>,
        #[arg(long = "console-socket", value_name = "SOCKET")]
        console_socket: Option<PathBuf>,
        #[arg(long = "no-pivot")]
        no_pivot: bool,
        #[arg(long = "no-new-keyring")]
        no_new_keyring: bool,
        #[arg(long = "preserve-fds", default_value_t = 0)]
        preserve_fds: u32,
        id: String,
    },
    /// Start the container's process.
    Start { id: String },
    /// Print the container's state (OCI state JSON).
    State { id: String },
    /// Send SIGNAL (default TERM) to the container's process.
    Kill {
        #[arg(long, short = 'a')]
        all: bool,
        id: String,
        signal: Option<String>,
    },
    /// Stop the container's vCPUs where they are (its processes, memory and files are kept).
    Pause { id: String },
    /// Let a paused container run again.
    Resume { id: String },
    /// Remove the container (with --force even while it runs).
    Delete {
        #[arg(long, short = 'f')]
        force: bool,
        id: String,
    },
    /// Run one more process in the container.
    Exec {
        #[arg(long, short = 'p', value_name = "FILE")]
        process: Option<PathBuf>,
        #[arg(long, short = 'd')]
        detach: bool,
        #[arg(long = "pid-file", value_name = "FILE")]
        pid_file: Option<PathBuf>,
        #[arg(long = "console-socket", value_name = "SOCKET")]
        console_socket: Option<PathBuf>,
        #[arg(long, short = 't')]
        tty: bool,
        #[arg(long, value_name = "DIR")]
        cwd: Option<String>,
        #[arg(long = "env", short = 'e', value_name = "KEY=VAL")]
        env: Vec<String>,
        #[arg(long, short = 'u', value_name = "UID[:GID]")]
        user: Option<String>,
        id: String,
        #[arg(trailing_var_arg = true)]
        command: Vec<String>,
    },
    /// The container's processes (as host pids: the container's process).
    Ps {
        #[arg(long, short = 'f', default_value = "table")]
        format: String,
        id: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        ps_args: Vec<String>,
    },
    /// What this runtime supports (JSON).
    Features,
    /// runc's other commands (pause, resume, update, checkpoint, ...): refused.
    #[command(external_subcommand)]
    Other(Vec<String>),
}

/// `ID/state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Container {
    id: String,
    bundle: PathBuf,
    rootfs: PathBuf,
    sandbox: String,
    /// The container's process (ours) and its start time (tells it from a reused pid).
    pid: u32,
    pid_start: u64,
    created: String,
    annotations: BTreeMap<String, String>,
}

/// OCI state, as `state` prints it.
#[derive(Debug, Serialize)]
struct State<'a> {
    #[serde(rename = "ociVersion")]
    oci_version: &'a str,
    id: &'a str,
    status: &'a str,
    pid: u32,
    bundle: &'a Path,
    rootfs: &'a Path,
    created: &'a str,
    annotations: &'a BTreeMap<String, String>,
}

struct Runtime {
    root: PathBuf,
}

impl Runtime {
    fn new(root: Option<PathBuf>) -> Result<Runtime, OciError> {
        let root = root.unwrap_or_else(default_root);
        std::fs::create_dir_all(&root).map_err(io_err(root.display()))?;
        sandbox::set_base_dir(root.join("sb"));
        Ok(Runtime { root })
    }

    fn dir(&self, id: &str) -> Result<PathBuf, OciError> {
        let ok = !id.is_empty()
            && id.len() <= 1024
            && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
        if !ok {
            return Err(OciError::BadId(id.into()));
        }
        Ok(self.root.join(id))
    }

    fn load(&self, id: &str) -> Result<(PathBuf, Container), OciError> {
        let dir = self.dir(id)?;
        let raw = match std::fs::read(dir.join("state.json")) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OciError::NoContainer(id.into()))
            }
            Err(e) => return Err(io_err(dir.display())(e)),
        };
        let c = serde_json::from_slice(&raw)
            .map_err(|e| io_err(dir.display())(std::io::Error::other(e)))?;
        Ok((dir, c))
    }

    /// created, running, paused or stopped.
    fn status(&self, dir: &Path, c: &Container) -> &'static str {
        if !process_is(c.pid, c.pid_start) {
            "stopped"
        } else if crate::sandbox::client::Sandbox::open(&c.sandbox)
            .and_then(|sb| crate::sandbox::read_state(sb.dir()))
            .is_ok_and(|i| i.state == "paused")
        {
            "paused"
        } else if dir.join("started").exists() {
            "running"
        } else {
            "created"
        }
    }
}

fn default_root() -> PathBuf {
    // SAFETY: getuid(2) takes nothing and cannot fail.
    if unsafe { libc::getuid() } == 0 {
        return PathBuf::from("/run/amvm-runc");
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => Path::new(&d).join("amvm-runc"),
        None => std::env::temp_dir().join(format!(
            "amvm-runc-{}",
            // SAFETY: as above.
            unsafe { libc::getuid() }
        )),
    }
}

fn process_is(pid: u32, start: u64) -> bool {
    pid != 0 && start != 0 && sandbox::start_time(pid) == Some(start)
}

/// Run one runtime command; its exit status. Errors go to stderr and the --log file.
pub fn main(cli: OciCli) -> u8 {
    let log = cli.log.clone();
    let json = cli.log_format == "json";
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let msg = e.to_string();
            eprintln!("amvm-runc: {msg}");
            if let Some(log) = log {
                if let Ok(mut f) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                {
                    let line = if json {
                        serde_json::json!({"level": "error", "msg": msg, "time": rfc3339_now()})
                            .to_string()
                    } else {
                        format!("amvm-runc: {msg}")
                    };
                    let _ = writeln!(f, "{line}");
                }
            }
            1
        }
    }
}

fn run(cli: OciCli) -> Result<u8, OciError> {
    if let OciCommand::Features = cli.command {
        println!("{}", features());
        return Ok(0);
    }
    if let OciCommand::Other(args) = &cli.command {
        return Err(OciError::Unsupported(format!(
            "`{}`",
            args.first().map_or("", String::as_str)
        )));
    }
    let rt = Runtime::new(cli.root)?;
    match cli.command {
        OciCommand::Create {
            bundle,
            pid_file,
            console_socket,
            id,
            ..
        } => create(
            &rt,
            &id,
            &bundle,
            pid_file.as_deref(),
            console_socket.as_deref(),
        ),
        OciCommand::Start { id } => start(&rt, &id),
        OciCommand::State { id } => {
            let (dir, c) = rt.load(&id)?;
            let status = rt.status(&dir, &c);
            let s = State {
                oci_version: OCI_VERSION,
                id: &c.id,
                status,
                pid: if status == "stopped" { 0 } else { c.pid },
                bundle: &c.bundle,
                rootfs: &c.rootfs,
                created: &c.created,
                annotations: &c.annotations,
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&s).expect("serializable")
            );
            Ok(0)
        }
        OciCommand::Kill { all, id, signal } => kill(&rt, &id, signal.as_deref(), all),
        OciCommand::Delete { force, id } => delete(&rt, &id, force),
        OciCommand::Pause { id } => pause_or_resume(&rt, &id, true),
        OciCommand::Resume { id } => pause_or_resume(&rt, &id, false),
        OciCommand::Exec {
            process,
            detach,
            pid_file,
            console_socket,
            tty,
            cwd,
            env,
            user,
            id,
            command,
        } => {
            let (dir, c) = rt.load(&id)?;
            match rt.status(&dir, &c) {
                "running" => {}
                "paused" => return Err(OciError::State(id, "paused (resume it first)")),
                _ => return Err(OciError::NotRunning(id)),
            }
            let args = match process {
                Some(p) => exec_args_from(&p, &c.sandbox)?,
                None => {
                    if command.is_empty() {
                        return Err(OciError::Spec(
                            "exec: say --process FILE or a command".into(),
                        ));
                    }
                    crate::cli::ExecArgs {
                        interactive: true,
                        tty,
                        env,
                        workdir: cwd,
                        user,
                        sandbox: c.sandbox.clone(),
                        command: command.into_iter().map(Into::into).collect(),
                        clear_env: false,
                        capabilities: None,
                        groups: Vec::new(),
                        rlimits: Vec::new(),
                        root: None,
                    }
                }
            };
            exec(args, detach, pid_file.as_deref(), console_socket.as_deref())
        }
        OciCommand::Ps { format, id, .. } => {
            let (dir, c) = rt.load(&id)?;
            let pids: Vec<u32> = if rt.status(&dir, &c) == "stopped" {
                Vec::new()
            } else {
                vec![c.pid]
            };
            if format == "json" {
                println!("{}", serde_json::to_string(&pids).expect("serializable"));
            } else {
                println!("PID");
                for p in pids {
                    println!("{p}");
                }
            }
            Ok(0)
        }
        OciCommand::Features | OciCommand::Other(_) => unreachable!("handled above"),
    }
}

fn create(
    rt: &Runtime,
    id: &str,
    bundle: &Path,
    pid_file: Option<&Path>,
    console_socket: Option<&Path>,
) -> Result<u8, OciError> {
    let dir = rt.dir(id)?;
    let bundle = bundle
        .canonicalize()
        .map_err(io_err(format!("bundle {}", bundle.display())))?;
    let b = spec::load(&bundle)?;
    if b.process.terminal && console_socket.is_none() {
        return Err(OciError::Spec(
            "process.terminal is set but no --console-socket was given".into(),
        ));
    }
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(OciError::Exists(id.into()))
        }
        Err(e) => return Err(io_err(dir.display())(e)),
    }
    let fail = |e: OciError| {
        let _ = std::fs::remove_dir_all(&dir);
        e
    };
    let fifo = dir.join("start.fifo");
    let cfifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes())
        .map_err(|_| fail(OciError::Spec("a NUL in --root".into())))?;
    // SAFETY: mkfifo(3) of a NUL-terminated path.
    if unsafe { libc::mkfifo(cfifo.as_ptr(), 0o600) } != 0 {
        return Err(fail(
            io_err(fifo.display())(std::io::Error::last_os_error()),
        ));
    }
    let rootfs = b
        .cfg
        .shares
        .first()
        .map(|s| s.1.clone())
        .unwrap_or_default();
    let c_rootfs = rootfs.clone();
    let mut labels = b.annotations.clone();
    labels.insert("io.amvm.oci.id".into(), id.into());
    let sandbox = sandbox::supervisor::create_from(b.cfg, b.state, None, labels, false)
        .map_err(|e| fail(e.into()))?;
    let remove_sandbox = |e: OciError| {
        let _ = crate::sandbox::commands::rm_quietly(&sandbox);
        fail(e)
    };
    let tty = match console_socket.filter(|_| b.process.terminal) {
        Some(sock) => {
            Some(console::Pty::open().map_err(|e| remove_sandbox(io_err("a pseudo-terminal")(e)))?)
                .map(|pty| (pty, sock))
        }
        None => None,
    };
    let tty = match tty {
        Some((pty, sock)) => {
            console::send_master(sock, &pty.master).map_err(|e| {
                remove_sandbox(io_err(format!("console socket {}", sock.display()))(e))
            })?;
            Some(pty)
        }
        None => None,
    };
    let args = crate::cli::ExecArgs {
        interactive: true,
        tty: b.process.terminal,
        env: b.process.env.clone(),
        workdir: None,
        user: None,
        sandbox: sandbox.clone(),
        command: b.process.args.iter().map(Into::into).collect(),
        clear_env: true,
        capabilities: b.process.capabilities,
        groups: b.process.groups.clone(),
        rlimits: b.process.rlimits.clone(),
        root: None,
    };
    // SAFETY: fork(2) from this single-threaded process (the sandbox's supervisor was forked
    // off before, and nothing here started a thread); the child only waits and execs.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(remove_sandbox(io_err("fork")(
            std::io::Error::last_os_error(),
        )));
    }
    if pid == 0 {
        let code = container_process(&fifo, tty, args, &c_rootfs);
        // SAFETY: _exit(2) with the container's status.
        unsafe { libc::_exit(i32::from(code)) };
    }
    let pid = pid as u32;
    let c = Container {
        id: id.into(),
        bundle,
        rootfs,
        sandbox: sandbox.clone(),
        pid,
        pid_start: sandbox::start_time(pid).unwrap_or(0),
        created: rfc3339_now(),
        annotations: b.annotations,
    };
    let kill_child = |e: OciError| {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        remove_sandbox(e)
    };
    write_json(&dir.join("state.json"), &c).map_err(kill_child)?;
    if let Some(p) = pid_file {
        write_atomically(p, pid.to_string().as_bytes()).map_err(kill_child)?;
    }
    Ok(0)
}

/// The container's process, the one the engine waits for: it forks the worker below, then
/// chroots into the container's root on the host (engines reach a running container's files
/// through /proc/PID/root: `podman cp` lands in the root the guest sees, not in the host's /),
/// forwards the signals it gets (`kill`) to the worker, and ends with the worker's status.
fn container_process(
    fifo: &Path,
    tty: Option<console::Pty>,
    args: crate::cli::ExecArgs,
    rootfs: &Path,
) -> u8 {
    if let Some(pty) = tty {
        if pty.make_stdio().is_err() {
            return crate::exit::AMVM_FAILURE;
        }
    }
    // Blocked before the fork, so a signal sent meanwhile waits for the loop below.
    let Ok(signals) = crate::signals::Signals::block() else {
        return crate::exit::AMVM_FAILURE;
    };
    let me = std::process::id();
    // SAFETY: fork(2) from this single-threaded process.
    let worker = unsafe { libc::fork() };
    if worker < 0 {
        return crate::exit::AMVM_FAILURE;
    }
    if worker == 0 {
        drop(signals);
        // SAFETY: prctl(2) with integer arguments: the worker dies with the container's process.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
        if std::os::unix::process::parent_id() != me {
            return crate::exit::AMVM_FAILURE;
        }
        return container_worker(fifo, args);
    }
    // Without the privilege (a rootless engine) this process keeps the host's root, which only
    // matters to `cp`.
    if let Err(e) = enter_root(rootfs) {
        tracing::warn!("the container's process stays in the host's root: {e}");
    }
    loop {
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&signals),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 100) };
        while let Ok(Some(sig)) = signals.next() {
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(worker, sig) };
        }
        let mut status = 0;
        // SAFETY: waitpid(2) of our own child into a local.
        if unsafe { libc::waitpid(worker, &mut status, libc::WNOHANG) } == worker {
            return if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status) as u8
            } else {
                128u8.wrapping_add(libc::WTERMSIG(status) as u8)
            };
        }
    }
}

/// Make `rootfs` this process's root in a mount namespace of its own, as runc leaves a
/// container's init: an engine that joins that namespace (`podman cp` into a running
/// container) finds the container's files at `/`. The sandbox's virtiofsd, in the host's
/// namespace, serves the same directory.
fn enter_root(rootfs: &Path) -> std::io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let root = std::ffi::CString::new(rootfs.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: unshare(2) with a flag, from this single-threaded process.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
    crate::jail::make_mounts_private()?;
    // SAFETY: mount(2) binding the root onto itself (pivot_root needs a mount point).
    check(unsafe {
        libc::mount(
            root.as_ptr(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        )
    })?;
    // SAFETY: chdir(2) of a NUL-terminated string.
    check(unsafe { libc::chdir(root.as_ptr()) })?;
    // pivot_root(".", "."): the old root ends up stacked on the new one, then detached.
    // SAFETY: the pivot_root system call with two literal paths.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) } as i32)?;
    // SAFETY: umount2(2) of a literal path.
    check(unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) })?;
    // SAFETY: chdir(2) of a literal.
    check(unsafe { libc::chdir(c"/".as_ptr()) })
}

/// Wait for `start`, run the container's exec with our stdio, stop the sandbox, and end with
/// the exec's status.
fn container_worker(fifo: &Path, args: crate::cli::ExecArgs) -> u8 {
    // Until `start`, the forwarded signals do what they do by default (end us).
    // SAFETY: sigset_t is plain data; sigemptyset(3) makes the local a valid empty set.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::sigemptyset(&mut set) };
    for sig in crate::signals::FORWARDED {
        // SAFETY: sigaddset(3) on a local set.
        unsafe { libc::sigaddset(&mut set, sig) };
    }
    // SAFETY: pthread_sigmask(3) with a local set.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    // Blocks until `start` opens the other end (or we are killed first).
    let started = std::fs::File::open(fifo).and_then(|mut f| {
        let mut b = [0u8; 1];
        std::io::Read::read(&mut f, &mut b)
    });
    if !matches!(started, Ok(1)) {
        return crate::exit::AMVM_FAILURE;
    }
    let sandbox = args.sandbox.clone();
    let code = match crate::sandbox::commands::exec(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("amvm-runc: {e}");
            crate::exit::AMVM_FAILURE
        }
    };
    // The container ends with its process: whatever else runs in it is stopped now.
    if let Ok(sb) = crate::sandbox::client::Sandbox::open(&sandbox) {
        let _ = sb.stop(0);
    }
    code
}

fn start(rt: &Runtime, id: &str) -> Result<u8, OciError> {
    use std::os::unix::fs::OpenOptionsExt;
    let (dir, c) = rt.load(id)?;
    match rt.status(&dir, &c) {
        "created" => {}
        "running" | "paused" => return Err(OciError::State(id.into(), "running already")),
        _ => return Err(OciError::State(id.into(), "stopped")),
    }
    std::fs::write(dir.join("started"), b"").map_err(io_err(dir.display()))?;
    let fifo = dir.join("start.fifo");
    // Non-blocking: with nobody at the other end (the process is gone) this fails at once.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo);
    match f.and_then(|mut f| f.write_all(b"1")) {
        Ok(()) => Ok(0),
        Err(e) => {
            let _ = std::fs::remove_file(dir.join("started"));
            Err(io_err(format!("starting {id}"))(e))
        }
    }
}

fn kill(rt: &Runtime, id: &str, signal: Option<&str>, all: bool) -> Result<u8, OciError> {
    let sig = parse_signal(signal.unwrap_or("TERM"))?;
    let (dir, c) = rt.load(id)?;
    if rt.status(&dir, &c) == "stopped" {
        return Err(OciError::NotRunning(id.into()));
    }
    // SAFETY: kill(2) of the container's process, checked to be ours by its start time.
    if unsafe { libc::kill(c.pid as libc::pid_t, sig) } != 0 {
        return Err(io_err(format!("signalling {id}"))(
            std::io::Error::last_os_error(),
        ));
    }
    if all && sig == libc::SIGKILL {
        // Everything in it: the sandbox goes down at once.
        if let Ok(sb) = crate::sandbox::client::Sandbox::open(&c.sandbox) {
            let _ = sb.stop(0);
        }
    }
    Ok(0)
}

/// runc's `pause` / `resume` (`podman pause` / `unpause`): the container's sandbox paused or
/// resumed (its vCPUs stopped, as runc's freezer stops its processes).
fn pause_or_resume(rt: &Runtime, id: &str, pause: bool) -> Result<u8, OciError> {
    let (dir, c) = rt.load(id)?;
    match (rt.status(&dir, &c), pause) {
        ("running", true) | ("paused", false) => {}
        ("paused", true) => return Err(OciError::State(id.into(), "paused already")),
        ("running", false) => return Err(OciError::State(id.into(), "not paused")),
        _ => return Err(OciError::NotRunning(id.into())),
    }
    let sb = crate::sandbox::client::Sandbox::open(&c.sandbox)?;
    if pause {
        sb.pause()?;
    } else {
        sb.resume()?;
    }
    Ok(0)
}

fn delete(rt: &Runtime, id: &str, force: bool) -> Result<u8, OciError> {
    let (dir, c) = match rt.load(id) {
        Ok(x) => x,
        Err(OciError::NoContainer(_)) if force => return Ok(0),
        Err(e) => return Err(e),
    };
    match rt.status(&dir, &c) {
        "running" if !force => {
            return Err(OciError::State(
                id.into(),
                "running (delete --force kills it)",
            ))
        }
        "paused" if !force => {
            return Err(OciError::State(
                id.into(),
                "paused (delete --force kills it)",
            ))
        }
        _ => {}
    }
    if process_is(c.pid, c.pid_start) {
        // SAFETY: kill(2) of the container's process, checked to be ours by its start time.
        unsafe { libc::kill(c.pid as libc::pid_t, libc::SIGKILL) };
    }
    crate::sandbox::commands::rm_quietly(&c.sandbox)?;
    std::fs::remove_dir_all(&dir).map_err(io_err(dir.display()))?;
    Ok(0)
}

/// `exec --process FILE`: the process JSON as an exec.
fn exec_args_from(path: &Path, sandbox: &str) -> Result<crate::cli::ExecArgs, OciError> {
    let raw = std::fs::read(path).map_err(io_err(path.display()))?;
    let p: oci_spec::runtime::Process = serde_json::from_slice(&raw)
        .map_err(|e| OciError::Spec(format!("{}: {e}", path.display())))?;
    let args = p.args().clone().unwrap_or_default();
    if args.is_empty() {
        return Err(OciError::Spec(format!("{}: args is empty", path.display())));
    }
    let cwd = p.cwd().to_string_lossy().into_owned();
    let (groups, rlimits) = spec::groups_and_rlimits(&p);
    Ok(crate::cli::ExecArgs {
        interactive: true,
        tty: p.terminal().unwrap_or(false),
        env: p.env().clone().unwrap_or_default(),
        workdir: (!cwd.is_empty()).then_some(cwd),
        user: Some(format!("{}:{}", p.user().uid(), p.user().gid())),
        sandbox: sandbox.into(),
        command: args.into_iter().map(Into::into).collect(),
        clear_env: true,
        capabilities: spec::capabilities(&p)?,
        groups,
        rlimits,
        root: None,
    })
}

fn exec(
    args: crate::cli::ExecArgs,
    detach: bool,
    pid_file: Option<&Path>,
    console_socket: Option<&Path>,
) -> Result<u8, OciError> {
    let pty = match console_socket.filter(|_| args.tty) {
        Some(sock) => {
            let pty = console::Pty::open().map_err(io_err("a pseudo-terminal"))?;
            console::send_master(sock, &pty.master)
                .map_err(io_err(format!("console socket {}", sock.display())))?;
            Some(pty)
        }
        None => None,
    };
    let run = |pty: Option<console::Pty>, args: crate::cli::ExecArgs| -> u8 {
        if let Some(pty) = pty {
            if pty.make_stdio().is_err() {
                return crate::exit::AMVM_FAILURE;
            }
        }
        match crate::sandbox::commands::exec(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("amvm-runc: {e}");
                crate::exit::AMVM_FAILURE
            }
        }
    };
    if !detach {
        if let Some(p) = pid_file {
            write_atomically(p, std::process::id().to_string().as_bytes())?;
        }
        return Ok(run(pty, args));
    }
    // SAFETY: fork(2) from this single-threaded process; the child runs the exec and exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io_err("fork")(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        let code = run(pty, args);
        // SAFETY: _exit(2) with the exec's status.
        unsafe { libc::_exit(i32::from(code)) };
    }
    if let Some(p) = pid_file {
        write_atomically(p, pid.to_string().as_bytes())?;
    }
    Ok(0)
}

fn parse_signal(s: &str) -> Result<i32, OciError> {
    if let Ok(n) = s.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
        return Err(OciError::BadSignal(s.into()));
    }
    let name = s.strip_prefix("SIG").unwrap_or(s).to_ascii_uppercase();
    let n = match name.as_str() {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "WINCH" => libc::SIGWINCH,
        "ALRM" => libc::SIGALRM,
        "PIPE" => libc::SIGPIPE,
        _ => return Err(OciError::BadSignal(s.into())),
    };
    Ok(n)
}

fn features() -> String {
    serde_json::json!({
        "ociVersionMin": "1.0.0",
        "ociVersionMax": OCI_VERSION,
        "hooks": [],
        "mountOptions": ["ro", "rw", "bind", "rbind", "noexec", "size", "mode"],
        "linux": {
            "namespaces": [],
            "capabilities": [],
            "cgroup": {"v1": false, "v2": false, "systemd": false, "systemdUser": false},
            "seccomp": {"enabled": false},
            "apparmor": {"enabled": false},
            "selinux": {"enabled": false}
        },
        "annotations": {
            "io.amvm.network": "none: the container's VM has no network interface, whatever the engine set up; io.amvm.egress names a host unix socket it may reach",
            spec::ANNOTATION_EGRESS: "a host unix socket the container reaches through amvm's egress relay (AMVM_EGRESS_ADDR in the guest)",
            spec::ANNOTATION_KERNEL: "the guest kernel to boot"
        }
    })
    .to_string()
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), OciError> {
    write_atomically(path, &serde_json::to_vec_pretty(v).expect("serializable"))
}

fn write_atomically(path: &Path, data: &[u8]) -> Result<(), OciError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err(path.display())(e)
        })
}

/// Now, as RFC 3339 in UTC (what Go's time.Time parses).
pub(crate) fn rfc3339_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(now.as_secs(), now.subsec_nanos())
}

fn rfc3339(secs: u64, nanos: u32) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_signals_and_ids() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(rfc3339(1_796_342_400, 5), "2026-12-04T00:00:00.000000005Z");
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00.000000000Z");
        assert_eq!(parse_signal("9").unwrap(), libc::SIGKILL);
        assert_eq!(parse_signal("SIGTERM").unwrap(), libc::SIGTERM);
        assert_eq!(parse_signal("hup").unwrap(), libc::SIGHUP);
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("NOPE").is_err());
        let rt = Runtime {
            root: PathBuf::from("/nonexistent"),
        };
        assert!(rt.dir("abc-1.2_3+x").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "-x"] {
            assert!(rt.dir(bad).is_err(), "{bad}");
        }
    }
}
