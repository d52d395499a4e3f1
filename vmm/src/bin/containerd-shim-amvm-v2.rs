//! `containerd-shim-amvm-v2`: containerd's runtime v2 shim for amvm (runtime type
//! `io.containerd.amvm.v2`), pod-aware: one microVM per Kubernetes pod.
//!
//! containerd starts one shim per pod (the CRI plugin's containers carry the pod's sandbox id
//! in `io.kubernetes.cri.sandbox-id`, and every container of the pod is given this shim's
//! socket). The pod's sandbox ("pause") container is no process at all: starting it creates
//! the pod's amvm sandbox (`amvm create`), one VM with the pod's directory shared at `/pod`
//! (read-write), and its task is an `amvm wait` on that sandbox. Each of the pod's containers
//! gets its root file system mounted on the host under the pod's directory (a shared mount, so
//! the mount reaches the running VM's virtiofsd) and runs as an `amvm exec --root
//! /pod/ID/rootfs` into the pod's VM, its stdio the FIFOs containerd gave; so do its execs.
//! The containers of a pod share the VM: its kernel, its `localhost`, its processes.
//!
//! Every task here is a host process the shim spawned (`amvm wait` or `amvm exec`): its pid is
//! the task's, its exit status the task's, and a signal sent to it reaches the command in the
//! guest (`amvm exec` forwards TERM, INT and HUP; killed outright, it kills its command).

use containerd_shim as shim;
use shim::api;
use shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskStart,
};
use shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use shim::protos::protobuf::{MessageDyn, MessageField};
use shim::protos::ttrpc;
use shim::publisher::RemotePublisher;
use shim::{Config, DeleteResponse, ExitSignal, Flags, StartOpts, TtrpcContext, TtrpcResult};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};

/// Where a pod's directory is shared in its VM.
const POD_IN_GUEST: &str = "/pod";
/// The CRI plugin's annotations.
const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The pod's resources as the CRI plugin passes them to its sandbox (the kubelet's sum of the
/// pod's limits and its overhead): memory in bytes, CPU quota and period.
const SANDBOX_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";
const SANDBOX_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
const SANDBOX_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";

/// The pod VM's size from its sandbox's annotations: `--mem` (MiB: the pod's memory limit plus
/// amvm's headroom, as amvm-runc sizes a container's VM) and `--cpus` (the quota over the period,
/// rounded up), each `None` when the pod sets no limit (amvm's defaults then).
fn pod_size(annotations: &HashMap<String, String>) -> (Option<u64>, Option<u64>) {
    let num = |k: &str| {
        annotations
            .get(k)
            .and_then(|v| v.trim().parse::<i64>().ok())
            .filter(|&v| v > 0)
            .map(|v| v as u64)
    };
    let mem = num(SANDBOX_MEMORY).map(|bytes| {
        (bytes.div_ceil(1 << 20) + amvm::oci::spec::MEM_HEADROOM_MIB).max(amvm::config::MIN_MEM_MIB)
    });
    let cpus = match (num(SANDBOX_CPU_QUOTA), num(SANDBOX_CPU_PERIOD)) {
        (Some(q), Some(p)) => Some(q.div_ceil(p).max(1)),
        _ => None,
    };
    (mem, cpus)
}

fn err(code: ttrpc::Code, msg: impl Into<String>) -> ttrpc::Error {
    let msg = msg.into();
    shim::warn!("{msg}");
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

fn not_found(what: &str) -> ttrpc::Error {
    err(ttrpc::Code::NOT_FOUND, format!("{what}: not found"))
}

/// The parts of an OCI bundle's config.json (or an exec's process) the shim uses.
#[derive(Debug, Default, Clone, serde::Deserialize)]
struct Process {
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    cwd: String,
    #[serde(default)]
    user: User,
    #[serde(default)]
    terminal: bool,
}

#[derive(Debug, Default, Clone, serde::Deserialize)]
struct User {
    #[serde(default)]
    uid: u32,
    #[serde(default)]
    gid: u32,
}

#[derive(Debug, Default, serde::Deserialize)]
struct Spec {
    #[serde(default)]
    process: Process,
    #[serde(default)]
    annotations: HashMap<String, String>,
    #[serde(default)]
    mounts: Vec<SpecMount>,
    #[serde(default)]
    root: Option<SpecRoot>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct SpecMount {
    destination: String,
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    source: String,
    #[serde(default)]
    options: Vec<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct SpecRoot {
    path: String,
}

fn load_spec(bundle: &Path) -> Result<Spec, String> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Created,
    Running,
    Stopped,
}

/// One task process: a container's or an exec's.
struct Task {
    process: Process,
    stdio: [String; 3],
    pid: u32,
    state: State,
    exit: Option<(u32, Timestamp)>,
    /// With a terminal: the master of the host pseudo-terminal `amvm exec -t` runs on
    /// (ResizePty sets its window size; `amvm exec` passes it on into the guest).
    pty: Option<Arc<std::fs::File>>,
}

impl Task {
    fn new(process: Process, stdin: &str, stdout: &str, stderr: &str) -> Task {
        Task {
            process,
            stdio: [stdin.into(), stdout.into(), stderr.into()],
            pid: 0,
            state: State::Created,
            exit: None,
            pty: None,
        }
    }
}

struct Container {
    bundle: PathBuf,
    /// The pod's sandbox container (no process of its own: the pod's VM).
    is_sandbox: bool,
    /// The pod's sandbox container id.
    pod: String,
    /// Its root file system's mount point on the host (under the pod's directory).
    root: Option<PathBuf>,
    init: Task,
    execs: HashMap<String, Task>,
}

/// A pod: its amvm sandbox and its directory on the host.
struct Pod {
    name: String,
    dir: PathBuf,
}

#[derive(Default)]
struct Inner {
    containers: HashMap<String, Container>,
    pods: HashMap<String, Pod>,
}

#[derive(Clone)]
struct Service {
    state: Arc<(Mutex<Inner>, Condvar)>,
    exit: Arc<ExitSignal>,
    namespace: String,
    publisher: Option<Arc<RemotePublisher>>,
}

/// The amvm binary beside this one (they are installed together), else `amvm` on PATH.
fn amvm_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("amvm"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("amvm"))
}

fn now() -> Timestamp {
    Timestamp::now()
}

/// Run `amvm ARGS` to its end; its stdout, or its stderr as the error.
fn amvm(args: &[&str]) -> Result<String, String> {
    let out = Command::new(amvm_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {}: {e}", amvm_bin().display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "amvm {}: {}",
            args.first().copied().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn mount(source: &str, target: &Path, fstype: &str, options: &[String]) -> Result<(), String> {
    let mut flags: libc::c_ulong = 0;
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            "bind" => flags |= libc::MS_BIND,
            "rbind" => flags |= libc::MS_BIND | libc::MS_REC,
            "ro" => flags |= libc::MS_RDONLY,
            "rw" => {}
            "nosuid" => flags |= libc::MS_NOSUID,
            "nodev" => flags |= libc::MS_NODEV,
            "noexec" => flags |= libc::MS_NOEXEC,
            "private" | "rprivate" | "slave" | "rslave" | "shared" | "rshared" => {}
            other => data.push(other.to_string()),
        }
    }
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| format!("a NUL in {s:?}"));
    let (src, dst, ty) = (
        c(source)?,
        c(&target.to_string_lossy())?,
        c(if flags & libc::MS_BIND != 0 {
            ""
        } else {
            fstype
        })?,
    );
    let data = c(&data.join(","))?;
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            ty.as_ptr(),
            flags & !libc::MS_RDONLY,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(format!(
            "mount {source} on {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        ));
    }
    if flags & libc::MS_RDONLY != 0 && flags & libc::MS_BIND != 0 {
        // A bind mount is made read-only by a remount.
        // SAFETY: as above.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                dst.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(format!(
                "read-only {}: {}",
                target.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Detach `path` and everything mounted below it.
fn unmount(path: &Path) {
    if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) {
        // SAFETY: umount2(2) of a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Remove `dir` and the directories below it, but never a file and never across a mount point:
/// if an unmount did not happen, what is still mounted there (a container's files, a volume's)
/// is left alone.
fn remove_empty_dirs(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dev) = std::fs::symlink_metadata(dir).map(|m| m.dev()) else {
        return;
    };
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let same_fs =
                std::fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_dir() && m.dev() == dev);
            if same_fs {
                remove_empty_dirs(&e.path());
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        shim::warn!("leaving {}: {e}", dir.display());
    }
}

/// In the child, before exec: a session of its own whose controlling terminal is its stdin
/// (the pseudo-terminal's slave).
fn controlling_tty() -> std::io::Result<()> {
    // SAFETY: setsid(2) takes nothing.
    if unsafe { libc::setsid() } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: ioctl(2) TIOCSCTTY on fd 0 with an integer argument.
    if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A pseudo-terminal pair (master, slave), 24x80 until ResizePty says otherwise.
fn open_pty() -> std::io::Result<(std::fs::File, std::fs::File)> {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    let size = libc::winsize {
        ws_row: 24,
        ws_col: 80,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty(3) writes two descriptors into our locals; no name buffer, termios
    // default, the window size read from a local.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just opened for us and is owned by nothing else.
    let master = unsafe { std::fs::File::from_raw_fd(master) };
    // SAFETY: as above.
    let slave = unsafe { std::fs::File::from_raw_fd(slave) };
    let pair = (master, slave);
    for f in [&pair.0, &pair.1] {
        // SAFETY: fcntl(2) setting close-on-exec on a descriptor we own.
        unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(f),
                libc::F_SETFD,
                libc::FD_CLOEXEC,
            )
        };
    }
    Ok(pair)
}

/// Copy a terminal's output to containerd's FIFO (none: drop it) until the terminal's last
/// user is gone (the master then reads EIO).
fn copy_out(mut from: std::fs::File, mut to: Option<std::fs::File>) {
    use std::io::{Read, Write};
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if let Some(t) = to.as_mut() {
                    if t.write_all(&buf[..n]).is_err() {
                        to = None;
                    }
                }
            }
        }
    }
}

/// Open a FIFO containerd gave for writing (it holds the reading end open already).
fn open_out(path: &str) -> Result<Stdio, String> {
    if path.is_empty() {
        return Ok(Stdio::null());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map(Stdio::from)
        .map_err(|e| format!("{path}: {e}"))
}

fn open_in(path: &str) -> Result<Stdio, String> {
    if path.is_empty() {
        return Ok(Stdio::null());
    }
    std::fs::OpenOptions::new()
        .read(true)
        .open(path)
        .map(Stdio::from)
        .map_err(|e| format!("{path}: {e}"))
}

impl Service {
    fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Some(p) = &self.publisher {
            if let Err(e) = p.publish(shim::Context::default(), topic, &self.namespace, event) {
                shim::warn!("publishing {topic}: {e}");
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start the pod's VM: `amvm create` with the pod's directory shared at /pod.
    fn start_pod(&self, id: &str) -> Result<u32, String> {
        let (bundle, egress, (mem, cpus)) = {
            let inner = self.lock();
            let c = inner.containers.get(id).ok_or("no such container")?;
            let spec = load_spec(&c.bundle)?;
            (
                c.bundle.clone(),
                spec.annotations.get("io.amvm.egress").cloned(),
                pod_size(&spec.annotations),
            )
        };
        let dir = bundle.join("pod");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // A shared mount: the containers' roots mounted under it later reach the VM.
        let d = dir.to_string_lossy().into_owned();
        mount(&d, &dir, "", &["bind".into()])?;
        let c = std::ffi::CString::new(d.clone()).map_err(|_| "a NUL in the bundle path")?;
        // SAFETY: mount(2) changing the propagation of a NUL-terminated path.
        if unsafe {
            libc::mount(
                std::ptr::null(),
                c.as_ptr(),
                std::ptr::null(),
                libc::MS_SHARED,
                std::ptr::null(),
            )
        } != 0
        {
            let e = std::io::Error::last_os_error();
            unmount(&dir);
            return Err(format!("making {d} shared: {e}"));
        }
        let name = pod_name(id);
        let share = format!("{d}:{POD_IN_GUEST}:rw");
        let mut args = vec!["create", "--name", &name, "-v", &share, "--user", "0:0"];
        if let Some(e) = &egress {
            args.extend(["--egress", e]);
        }
        let (mem, cpus) = (mem.map(|m| m.to_string()), cpus.map(|c| c.to_string()));
        if let Some(m) = &mem {
            args.extend(["--mem", m]);
        }
        if let Some(c) = &cpus {
            args.extend(["--cpus", c]);
        }
        if let Err(e) = amvm(&args) {
            unmount(&dir);
            return Err(e);
        }
        let child = match Command::new(amvm_bin())
            .args(["wait", &name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                let _ = amvm(&["rm", "-f", &name]);
                unmount(&dir);
                return Err(format!("amvm wait: {e}"));
            }
        };
        self.lock().pods.insert(id.into(), Pod { name, dir });
        Ok(self.watch(id, "", child))
    }

    /// Start a container's process or an exec: `amvm exec --root` into the pod's VM.
    fn start_process(&self, id: &str, exec_id: &str) -> Result<u32, String> {
        let (pod, root, task) = {
            let inner = self.lock();
            let c = inner.containers.get(id).ok_or("no such container")?;
            let pod = inner
                .pods
                .get(&c.pod)
                .ok_or("the pod's VM is not running")?;
            let t = if exec_id.is_empty() {
                &c.init
            } else {
                c.execs.get(exec_id).ok_or("no such exec")?
            };
            let root = guest_root(c, pod).ok_or("the container has no root in the pod")?;
            (pod.name.clone(), root, (t.process.clone(), t.stdio.clone()))
        };
        let (p, stdio) = task;
        if p.args.is_empty() {
            return Err("the process has no args".into());
        }
        let cwd = if p.cwd.is_empty() {
            "/".into()
        } else {
            p.cwd.clone()
        };
        let user = format!("{}:{}", p.user.uid, p.user.gid);
        let mut cmd = Command::new(amvm_bin());
        cmd.args(["exec", "--root", &root, "-w", &cwd, "--user", &user]);
        if !stdio[0].is_empty() {
            cmd.arg("-i");
        }
        if p.terminal {
            cmd.arg("-t");
        }
        for e in &p.env {
            cmd.args(["-e", e]);
        }
        cmd.arg(&pod).arg("--").args(&p.args);
        let master = if p.terminal {
            // `amvm exec -t` on a host pseudo-terminal of its own (its controlling terminal, so a
            // window size set on the master reaches it as SIGWINCH); containerd's FIFOs are
            // copied to and from the master.
            let (master, slave) = open_pty().map_err(|e| format!("a pseudo-terminal: {e}"))?;
            let dup = |f: &std::fs::File| f.try_clone().map_err(|e| format!("the terminal: {e}"));
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
            // SAFETY: the hook runs between fork and exec and makes only async-signal-safe
            // system calls (below) with no memory of ours.
            unsafe { std::os::unix::process::CommandExt::pre_exec(&mut cmd, controlling_tty) };
            Some(Arc::new(master))
        } else {
            cmd.stdin(open_in(&stdio[0])?)
                .stdout(open_out(&stdio[1])?)
                .stderr(open_out(&stdio[2])?);
            None
        };
        let child = cmd.spawn().map_err(|e| format!("amvm exec: {e}"))?;
        // Our copies of the terminal's slave end go with `cmd`: the master sees EOF (EIO) when
        // the process is gone.
        drop(cmd);
        if let Some(m) = &master {
            let out = if stdio[1].is_empty() {
                None
            } else {
                Some(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&stdio[1])
                        .map_err(|e| format!("{}: {e}", stdio[1]))?,
                )
            };
            let from = m.try_clone().map_err(|e| format!("the terminal: {e}"))?;
            std::thread::spawn(move || copy_out(from, out));
            if !stdio[0].is_empty() {
                let input =
                    std::fs::File::open(&stdio[0]).map_err(|e| format!("{}: {e}", stdio[0]))?;
                let to = m.try_clone().map_err(|e| format!("the terminal: {e}"))?;
                std::thread::spawn(move || {
                    let (mut input, mut to) = (input, to);
                    let _ = std::io::copy(&mut input, &mut to);
                });
            }
            let mut inner = self.lock();
            if let Some(t) = task_mut(&mut inner, id, exec_id) {
                t.pty = master.clone();
            }
        }
        Ok(self.watch(id, exec_id, child))
    }

    /// Record `child` as the running task and wait for it on a thread of its own; its end is
    /// the task's (state, exit status, TaskExit).
    fn watch(&self, id: &str, exec_id: &str, mut child: std::process::Child) -> u32 {
        let pid = child.id();
        {
            let mut inner = self.lock();
            if let Some(t) = task_mut(&mut inner, id, exec_id) {
                t.pid = pid;
                t.state = State::Running;
            }
        }
        let me = self.clone();
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        std::thread::spawn(move || {
            let status = match child.wait() {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    s.code()
                        .map(|c| c as u32)
                        .or_else(|| s.signal().map(|n| 128 + n as u32))
                        .unwrap_or(255)
                }
                Err(_) => 255,
            };
            let at = now();
            {
                let mut inner = me.lock();
                if let Some(t) = task_mut(&mut inner, &id, &exec_id) {
                    t.state = State::Stopped;
                    t.exit = Some((status, at.clone()));
                }
                me.state.1.notify_all();
            }
            let event = TaskExit {
                container_id: id.clone(),
                id: if exec_id.is_empty() { id } else { exec_id },
                pid,
                exit_status: status,
                exited_at: MessageField::some(at),
                ..Default::default()
            };
            me.publish("/tasks/exit", Box::new(event));
        });
        pid
    }

    /// Mount a container's root file system (and its bind mounts) under its pod's directory.
    fn mount_root(&self, id: &str, rootfs: &[shim::protos::api::Mount]) -> Result<PathBuf, String> {
        let (bundle, dir) = {
            let inner = self.lock();
            let c = inner.containers.get(id).ok_or("no such container")?;
            let pod = inner
                .pods
                .get(&c.pod)
                .ok_or("the pod's VM is not running (start its sandbox first)")?;
            (c.bundle.clone(), pod.dir.clone())
        };
        let spec = load_spec(&bundle)?;
        let root = dir.join(id).join("rootfs");
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        let done = (|| {
            if rootfs.is_empty() {
                let p = spec
                    .root
                    .as_ref()
                    .map(|r| r.path.clone())
                    .unwrap_or_default();
                let p = bundle.join(p);
                mount(&p.to_string_lossy(), &root, "", &["rbind".into()])?;
            }
            for m in rootfs {
                mount(&m.source, &root, &m.type_, &m.options)?;
            }
            for m in &spec.mounts {
                let skip = ["/proc", "/sys", "/dev"]
                    .iter()
                    .any(|p| m.destination == *p || m.destination.starts_with(&format!("{p}/")));
                if skip || m.kind != "bind" && !m.options.iter().any(|o| o.ends_with("bind")) {
                    continue;
                }
                let rel = m.destination.trim_start_matches('/');
                if rel.split('/').any(|c| c == "..") {
                    return Err(format!("mount destination {}", m.destination));
                }
                let target = root.join(rel);
                let src = Path::new(&m.source);
                if src.is_dir() {
                    std::fs::create_dir_all(&target).map_err(|e| format!("{rel}: {e}"))?;
                } else if !target.exists() {
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent).map_err(|e| format!("{rel}: {e}"))?;
                    }
                    std::fs::write(&target, b"").map_err(|e| format!("{rel}: {e}"))?;
                }
                let mut opts = m.options.clone();
                if !opts.iter().any(|o| o.ends_with("bind")) {
                    opts.push("rbind".into());
                }
                mount(&m.source, &target, "", &opts)?;
            }
            Ok(())
        })();
        if let Err(e) = done {
            unmount(&root);
            return Err(e);
        }
        Ok(root)
    }
}

/// A container's root as the pod's VM sees it (under [`POD_IN_GUEST`]); none for the pod's
/// sandbox or a root outside the pod's directory.
fn guest_root(c: &Container, pod: &Pod) -> Option<String> {
    let rel = c.root.as_ref()?.strip_prefix(&pod.dir).ok()?;
    Some(format!("{POD_IN_GUEST}/{}", rel.display()))
}

/// The container `id`, or containerd's NOT_FOUND.
fn container<'a>(inner: &'a Inner, id: &str) -> Result<&'a Container, ttrpc::Error> {
    inner.containers.get(id).ok_or_else(|| not_found(id))
}

fn task_mut<'a>(inner: &'a mut Inner, id: &str, exec_id: &str) -> Option<&'a mut Task> {
    let c = inner.containers.get_mut(id)?;
    if exec_id.is_empty() {
        Some(&mut c.init)
    } else {
        c.execs.get_mut(exec_id)
    }
}

impl shim::Shim for Service {
    type T = Service;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Service {
            state: Arc::default(),
            exit: Arc::default(),
            namespace: args.namespace.clone(),
            publisher: None,
        }
    }

    fn start_shim(&mut self, opts: StartOpts) -> Result<String, shim::Error> {
        start_pod_shim(opts)
    }

    fn delete_shim(&mut self) -> Result<DeleteResponse, shim::Error> {
        // containerd's clean-up after a shim that died: the pod's VM and directory.
        let bundle = std::env::current_dir().unwrap_or_default();
        let dir = bundle.join("pod");
        if dir.exists() {
            if let Some(id) = bundle.file_name().and_then(|n| n.to_str()) {
                let name = pod_name(id);
                let _ = amvm(&["rm", "-f", &name]);
            }
            unmount(&dir);
        }
        Ok(DeleteResponse {
            exit_status: 137,
            exited_at: MessageField::some(now()),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let mut s = self.clone();
        s.publisher = Some(Arc::new(publisher));
        s
    }
}

impl shim::Task for Service {
    fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let bundle = PathBuf::from(&req.bundle);
        let spec = load_spec(&bundle).map_err(|e| err(ttrpc::Code::INVALID_ARGUMENT, e))?;
        let is_sandbox = spec
            .annotations
            .get(CONTAINER_TYPE)
            .is_none_or(|t| t == "sandbox");
        let pod = if is_sandbox {
            req.id.clone()
        } else {
            spec.annotations.get(SANDBOX_ID).cloned().ok_or_else(|| {
                err(
                    ttrpc::Code::INVALID_ARGUMENT,
                    format!("{SANDBOX_ID} is not set: amvm's shim runs pods (containerd's CRI)"),
                )
            })?
        };
        let mut process = spec.process;
        process.terminal |= req.terminal;
        {
            let mut inner = self.lock();
            if inner.containers.contains_key(&req.id) {
                return Err(err(
                    ttrpc::Code::ALREADY_EXISTS,
                    format!("container {} exists already", req.id),
                ));
            }
            inner.containers.insert(
                req.id.clone(),
                Container {
                    bundle: bundle.clone(),
                    is_sandbox,
                    pod,
                    root: None,
                    init: Task::new(process, &req.stdin, &req.stdout, &req.stderr),
                    execs: HashMap::new(),
                },
            );
        }
        let pid = if is_sandbox {
            // The pod's VM starts now: containerd waits for the sandbox to be running.
            self.start_pod(&req.id)
        } else {
            self.mount_root(&req.id, &req.rootfs).map(|root| {
                if let Some(c) = self.lock().containers.get_mut(&req.id) {
                    c.root = Some(root);
                }
                0
            })
        };
        let pid = match pid {
            Ok(p) => p,
            Err(e) => {
                self.lock().containers.remove(&req.id);
                return Err(err(ttrpc::Code::UNKNOWN, e));
            }
        };
        self.publish(
            "/tasks/create",
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                pid,
                ..Default::default()
            }),
        );
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        let (is_sandbox, pid) = {
            let mut inner = self.lock();
            let c = container(&inner, &req.id)?;
            let is_sandbox = c.is_sandbox;
            let t = task_mut(&mut inner, &req.id, &req.exec_id)
                .ok_or_else(|| not_found(&req.exec_id))?;
            if t.state != State::Created && !(is_sandbox && req.exec_id.is_empty()) {
                return Err(err(
                    ttrpc::Code::FAILED_PRECONDITION,
                    format!("{} started already", req.id),
                ));
            }
            (is_sandbox, t.pid)
        };
        let pid = if is_sandbox && req.exec_id.is_empty() {
            // Running since create.
            pid
        } else {
            self.start_process(&req.id, &req.exec_id)
                .map_err(|e| err(ttrpc::Code::UNKNOWN, e))?
        };
        if req.exec_id.is_empty() {
            self.publish(
                "/tasks/start",
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        } else {
            self.publish(
                "/tasks/exec-started",
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
        }
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let mut inner = self.lock();
        let bundle = container(&inner, &req.id)?.bundle.display().to_string();
        let t =
            task_mut(&mut inner, &req.id, &req.exec_id).ok_or_else(|| not_found(&req.exec_id))?;
        let status = match t.state {
            State::Created => api::Status::CREATED,
            State::Running => api::Status::RUNNING,
            State::Stopped => api::Status::STOPPED,
        };
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle,
            pid: t.pid,
            status: status.into(),
            stdin: t.stdio[0].clone(),
            stdout: t.stdio[1].clone(),
            stderr: t.stdio[2].clone(),
            exit_status: t.exit.as_ref().map_or(0, |e| e.0),
            exited_at: t.exit.as_ref().map(|e| e.1.clone()).into(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let (pid, state, pod) = {
            let mut inner = self.lock();
            let c = container(&inner, &req.id)?;
            let pod = (c.is_sandbox && req.exec_id.is_empty())
                .then(|| inner.pods.get(&req.id).map(|p| p.name.clone()))
                .flatten();
            let t = task_mut(&mut inner, &req.id, &req.exec_id)
                .ok_or_else(|| not_found(&req.exec_id))?;
            (t.pid, t.state, pod)
        };
        if state != State::Running {
            return Err(err(
                ttrpc::Code::NOT_FOUND,
                format!("process already finished: {}", req.id),
            ));
        }
        if let Some(name) = pod {
            // The pod's sandbox: its VM stops (its `amvm wait` ends with it).
            let grace = if req.signal == libc::SIGKILL as u32 {
                "0"
            } else {
                "10"
            };
            amvm(&["stop", "--time", grace, &name]).map_err(|e| err(ttrpc::Code::UNKNOWN, e))?;
            return Ok(api::Empty::default());
        }
        // SAFETY: kill(2) of a child of ours that has not been waited for (it is running).
        if unsafe { libc::kill(pid as libc::pid_t, req.signal as libc::c_int) } != 0 {
            return Err(err(
                ttrpc::Code::NOT_FOUND,
                format!(
                    "process already finished: {}",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        Ok(api::Empty::default())
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let mut process: Process = serde_json::from_slice(&req.spec.value).map_err(|e| {
            err(
                ttrpc::Code::INVALID_ARGUMENT,
                format!("the exec's process: {e}"),
            )
        })?;
        process.terminal |= req.terminal;
        {
            let mut inner = self.lock();
            let c = inner
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            if c.execs.contains_key(&req.exec_id) {
                return Err(err(
                    ttrpc::Code::ALREADY_EXISTS,
                    format!("exec {} exists already", req.exec_id),
                ));
            }
            c.execs.insert(
                req.exec_id.clone(),
                Task::new(process, &req.stdin, &req.stdout, &req.stderr),
            );
        }
        self.publish(
            "/tasks/exec-added",
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        Ok(api::Empty::default())
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut inner = self.lock();
        loop {
            let t =
                task_mut(&mut inner, &req.id, &req.exec_id).ok_or_else(|| not_found(&req.id))?;
            if let Some((status, at)) = &t.exit {
                return Ok(api::WaitResponse {
                    exit_status: *status,
                    exited_at: MessageField::some(at.clone()),
                    ..Default::default()
                });
            }
            inner = self.state.1.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let mut inner = self.lock();
        if !req.exec_id.is_empty() {
            let c = inner
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(&req.id))?;
            let t = c
                .execs
                .remove(&req.exec_id)
                .ok_or_else(|| not_found(&req.exec_id))?;
            let (status, at) = t.exit.unwrap_or((0, now()));
            return Ok(api::DeleteResponse {
                pid: t.pid,
                exit_status: status,
                exited_at: MessageField::some(at),
                ..Default::default()
            });
        }
        let c = container(&inner, &req.id)?;
        if c.init.state == State::Running {
            return Err(err(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("container {} is running", req.id),
            ));
        }
        let c = inner
            .containers
            .remove(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        let pod = if c.is_sandbox {
            inner.pods.remove(&req.id)
        } else {
            None
        };
        drop(inner);
        if let Some(root) = &c.root {
            unmount(root);
            if let Some(dir) = root.parent() {
                remove_empty_dirs(dir);
            }
        }
        if let Some(pod) = pod {
            let _ = amvm(&["rm", "-f", &pod.name]);
            unmount(&pod.dir);
            remove_empty_dirs(&pod.dir);
        }
        let (status, at) = c.init.exit.clone().unwrap_or((0, now()));
        self.publish(
            "/tasks/delete",
            Box::new(TaskDelete {
                container_id: req.id.clone(),
                pid: c.init.pid,
                exit_status: status,
                exited_at: MessageField::some(at.clone()),
                id: req.id.clone(),
                ..Default::default()
            }),
        );
        Ok(api::DeleteResponse {
            pid: c.init.pid,
            exit_status: status,
            exited_at: MessageField::some(at),
            ..Default::default()
        })
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let inner = self.lock();
        let c = container(&inner, &req.id)?;
        let processes = std::iter::once(&c.init)
            .chain(c.execs.values())
            .filter(|t| t.state == State::Running)
            .map(|t| shim::protos::api::ProcessInfo {
                pid: t.pid,
                ..Default::default()
            })
            .collect();
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let (pod, root) = {
            let inner = self.lock();
            let c = container(&inner, &req.id)?;
            let pod = inner.pods.get(&c.pod).ok_or_else(|| {
                err(
                    ttrpc::Code::FAILED_PRECONDITION,
                    "the pod's VM is not running",
                )
            })?;
            (pod.name.clone(), guest_root(c, pod))
        };
        let Some(root) = root else {
            return Err(err(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("{} has no processes of its own (a pod's sandbox)", req.id),
            ));
        };
        let out = amvm(&[
            "exec",
            "--user",
            "0:0",
            "-w",
            "/",
            &pod,
            "--",
            "sh",
            "-c",
            STATS_SCRIPT,
            "stats",
            &root,
        ])
        .map_err(|e| err(ttrpc::Code::UNKNOWN, e))?;
        let m = metrics(&out).map_err(|e| err(ttrpc::Code::UNKNOWN, e))?;
        let any = shim::protos::protobuf::well_known_types::any::Any {
            type_url: "io.containerd.cgroups.v1.Metrics".into(),
            value: shim::protos::protobuf::Message::write_to_bytes(&m)
                .map_err(|e| err(ttrpc::Code::UNKNOWN, e.to_string()))?,
            ..Default::default()
        };
        Ok(api::StatsResponse {
            stats: MessageField::some(any),
            ..Default::default()
        })
    }

    fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let mut inner = self.lock();
        let t = task_mut(&mut inner, &req.id, &req.exec_id).ok_or_else(|| not_found(&req.id))?;
        let Some(master) = &t.pty else {
            return Err(err(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("{} has no terminal", req.id),
            ));
        };
        let size = libc::winsize {
            ws_row: req.height.min(u32::from(u16::MAX)) as u16,
            ws_col: req.width.min(u32::from(u16::MAX)) as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ on a terminal master we own, reading a local winsize.
        let r = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(master.as_ref()),
                libc::TIOCSWINSZ,
                &size,
            )
        };
        if r != 0 {
            return Err(err(
                ttrpc::Code::UNKNOWN,
                format!("resizing {}: {}", req.id, std::io::Error::last_os_error()),
            ));
        }
        Ok(api::Empty::default())
    }

    fn close_io(&self, _ctx: &TtrpcContext, _req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        Ok(api::Empty::default())
    }

    fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let inner = self.lock();
        let task_pid = inner.containers.get(&req.id).map_or(0, |c| c.init.pid);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        if self.lock().containers.is_empty() {
            self.exit.signal();
        }
        Ok(api::Empty::default())
    }
}

/// Run in the pod's VM as `sh -c SCRIPT stats ROOT`: over the processes chrooted into ROOT (the
/// container's), their resident memory, and the CPU time of the cgroup guest-init made for
/// their exec, as `KEY VALUE` lines.
const STATS_SCRIPT: &str = r#"
root=$1 cg= pages=0
for p in /proc/[0-9]*; do
  [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] || continue
  [ -n "$cg" ] || cg=$(sed -n 's/^0:://p' "$p/cgroup" 2>/dev/null)
  set -- $(cat "$p/statm" 2>/dev/null)
  pages=$((pages + ${2:-0}))
done
[ -n "$cg" ] || { echo "no process of the container is running" >&2; exit 1; }
sed -n 's/^usage_usec /usage_usec /p' "/sys/fs/cgroup$cg/cpu.stat"
echo "rss_bytes $((pages * 4096))"
"#;

/// cgroup v1's Metrics (what containerd's CRI plugin reads a container's CPU and memory from)
/// out of [`STATS_SCRIPT`]'s lines: CPU time, and resident memory as the usage (no page cache:
/// the working set the CRI plugin reports is that).
fn metrics(out: &str) -> Result<shim::protos::cgroups::metrics::Metrics, String> {
    use shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics};
    let get = |k: &str| -> Result<u64, String> {
        out.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.trim().parse().ok())
            .ok_or_else(|| format!("the guest's stats lack {k}: {out:?}"))
    };
    let cpu = CPUStat {
        usage: MessageField::some(CPUUsage {
            total: get("usage_usec")?.saturating_mul(1000),
            ..Default::default()
        }),
        ..Default::default()
    };
    let rss = get("rss_bytes")?;
    let memory = MemoryStat {
        usage: MessageField::some(MemoryEntry {
            usage: rss,
            ..Default::default()
        }),
        rss,
        total_rss: rss,
        ..Default::default()
    };
    Ok(Metrics {
        cpu: MessageField::some(cpu),
        memory: MessageField::some(memory),
        ..Default::default()
    })
}

/// The amvm sandbox of the pod whose sandbox container is `id`: `pod-` and its first 12
/// characters (`amvm ls` shows it).
fn pod_name(id: &str) -> String {
    format!("pod-{}", id.chars().take(12).collect::<String>())
}

/// Start (or find) the shim of this container's pod: its address. One shim per pod: the
/// containers of a pod name its sandbox (the bundle, our working directory, says which).
fn start_pod_shim(opts: StartOpts) -> Result<String, shim::Error> {
    let spec = load_spec(Path::new(".")).unwrap_or_default();
    let grouping = spec
        .annotations
        .get(SANDBOX_ID)
        .cloned()
        .unwrap_or_else(|| opts.id.clone());
    let (_, address) = shim::spawn(opts, &grouping, Vec::new())?;
    Ok(address)
}

fn main() {
    // No reaper of the crate's: every child is waited for by the thread that started it (a
    // reaper's waitpid(-1) would take their statuses). Given here, not in `Shim::new`: the
    // crate sets its signals up before it calls that.
    let config = Config {
        no_reaper: true,
        ..Default::default()
    };
    shim::run::<Service>("io.containerd.amvm.v2", Some(config));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guests_cgroup_figures_become_cgroup_v1_metrics() {
        let m = metrics("usage_usec 1500\nrss_bytes 4096000\n").unwrap();
        assert_eq!(m.cpu.usage.total, 1_500_000);
        assert_eq!(m.memory.usage.usage, 4_096_000);
        assert_eq!(m.memory.total_rss, 4_096_000);
        assert_eq!(m.memory.total_inactive_file, 0);
        assert!(metrics("usage_usec 1\n")
            .unwrap_err()
            .contains("stats lack"));
        assert!(metrics("usage_usec x\nrss_bytes 1").is_err());
    }

    #[test]
    fn a_pods_resources_size_its_vm() {
        let a = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        };
        assert_eq!(pod_size(&a(&[])), (None, None));
        let limits = a(&[
            (SANDBOX_MEMORY, "268435456"),
            (SANDBOX_CPU_QUOTA, "150000"),
            (SANDBOX_CPU_PERIOD, "100000"),
        ]);
        assert_eq!(pod_size(&limits), (Some(256 + 64), Some(2)));
        // No limit (0, -1 or nonsense) leaves amvm's defaults; a tiny one still gets the minimum.
        let none = a(&[
            (SANDBOX_MEMORY, "0"),
            (SANDBOX_CPU_QUOTA, "-1"),
            (SANDBOX_CPU_PERIOD, "100000"),
        ]);
        assert_eq!(pod_size(&none), (None, None));
        assert_eq!(pod_size(&a(&[(SANDBOX_MEMORY, "lots")])), (None, None));
        assert_eq!(pod_size(&a(&[(SANDBOX_MEMORY, "1")])), (Some(65), None));
    }
}
