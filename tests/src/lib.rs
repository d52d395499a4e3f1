//! A small framework for integration tests that boot real microVMs with the `amvm` binary.
//!
//! Tests run on a machine with a hardware-virtualization /dev/kvm — directly, or inside the
//! emulated KVM host of `tests/kvm-host/run` (README.md's test command does that). Without a
//! usable KVM, [`require_kvm`] fails the test with the reason: no test passes by skipping.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Guard against a hung guest: every VM run gets this `--timeout` (not a speed assertion).
pub const RUN_TIMEOUT_SECS: &str = "300";

/// The `amvm` binary under test: `$AMVM_BIN`, else the one beside this test's build
/// (`target/<profile>/amvm`, this executable being `target/<profile>/deps/<test>-<hash>`).
pub fn amvm_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("AMVM_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .join("amvm");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build -p amvm` first (or set AMVM_BIN)",
        bin.display()
    );
    bin
}

/// Fail loudly unless this process can open a KVM device that can run guests.
pub fn require_kvm() {
    let path = std::env::var("AMVM_KVM_DEVICE").unwrap_or_else(|_| "/dev/kvm".into());
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        panic!("KVM is required and {path} cannot be opened ({e}): run the tests through tests/kvm-host/run (README.md's test command)");
    }
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        panic!("{path} is PVM (software-only KVM), which cannot run the guest: run the tests through tests/kvm-host/run (README.md's test command)");
    }
}

/// A Python script that forks children (each sleeping) until a fork fails; prints how many it
/// made and the errno (`forks N then errno 11` at a pids limit).
pub const FORK_UNTIL_REFUSED: &str = r#"
import os, time
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        n += 1
except OSError as e:
    print("forks", n, "then errno", e.errno)
"#;

/// What one `amvm` invocation produced.
#[derive(Debug)]
pub struct Outcome {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Outcome {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Run `amvm` with `args` and any extra environment, capturing everything.
pub fn amvm<I, S>(args: I, env: &[(&str, &str)]) -> Outcome
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(amvm_bin());
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Outcome::from(cmd.output().expect("spawning amvm"))
}

impl From<std::process::Output> for Outcome {
    fn from(out: std::process::Output) -> Outcome {
        Outcome {
            code: out
                .status
                .code()
                .unwrap_or_else(|| panic!("amvm killed by a signal: {:?}", out.status)),
            stdout: out.stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// `run [--timeout RUN_TIMEOUT_SECS] opts -- command`: the hang guard unless `opts` sets one.
pub fn run_args<'a>(opts: &[&'a str], command: &[&'a str]) -> Vec<&'a str> {
    let mut args: Vec<&str> = vec!["run"];
    if !opts.contains(&"--timeout") {
        args.extend_from_slice(&["--timeout", RUN_TIMEOUT_SECS]);
    }
    args.extend_from_slice(opts);
    args.push("--");
    args.extend_from_slice(command);
    args
}

/// Boot a VM that runs `command` (after `amvm run [opts] --`), with a hang guard.
pub fn run_vm(opts: &[&str], command: &[&str]) -> Outcome {
    require_kvm();
    amvm(run_args(opts, command), &[])
}

/// Start `amvm run [opts] -- command` with stdin, stdout and stderr piped, for tests that talk
/// to it while it runs (stdin, signals).
pub fn spawn_vm(opts: &[&str], command: &[&str]) -> std::process::Child {
    spawn_vm_env(opts, command, &[])
}

/// [`spawn_vm`] with extra environment variables for amvm.
pub fn spawn_vm_env(opts: &[&str], command: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    require_kvm();
    Command::new(amvm_bin())
        .args(run_args(opts, command))
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning amvm")
}

/// Like [`run_vm`], with a fresh workspace shared in (so its virtiofsd can be told apart from
/// other runs'), then checks that nothing of the run is left on the host: no virtiofsd of that
/// workspace, no socket directory of that amvm process.
pub fn run_vm_leaving_nothing(opts: &[&str], command: &[&str]) -> Outcome {
    run_vm_leaving_nothing_env(opts, command, &[])
}

/// [`run_vm_leaving_nothing`] with extra environment variables for amvm.
pub fn run_vm_leaving_nothing_env(
    opts: &[&str],
    command: &[&str],
    env: &[(&str, &str)],
) -> Outcome {
    let ws = std::env::temp_dir().join(format!(
        "amvm-tracked-{}-{}",
        std::process::id(),
        NEXT_WS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&ws).expect("creating the workspace");
    let ws_str = ws.to_str().expect("a UTF-8 temp dir").to_string();
    let mut all = vec!["--workspace", ws_str.as_str()];
    all.extend_from_slice(opts);
    let child = spawn_vm_env(&all, command, env);
    let pid = child.id();
    let out = child.wait_with_output().expect("waiting for amvm");
    leftovers::nothing_left(&ws_str, pid);
    let _ = std::fs::remove_dir_all(&ws);
    Outcome::from(out)
}

static NEXT_WS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// What a run may leave on the host, and the check that it left none of it.
pub mod world;

pub mod cri;

/// A root file system: the host's static busybox with every applet linked, and a user database.
pub fn busybox_root(root: &std::path::Path) {
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    for d in ["proc", "sys", "dev", "tmp", "root", "data"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("the host's static busybox (images/setup installs busybox-static)");
    let list = std::process::Command::new("/bin/busybox")
        .arg("--list")
        .output()
        .unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    )
    .unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").unwrap();
}

pub mod leftovers {
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    /// Processes whose command line mentions `needle`, other than ourselves.
    pub fn processes_with(needle: &str) -> Vec<String> {
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == std::process::id() {
                continue;
            }
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains(needle) {
                    found.push(format!("{pid}: {cmd}"));
                }
            }
        }
        found
    }

    /// Within a few seconds, no process mentions `workspace` (its virtiofsd), no sandbox
    /// state directory (a run is a sandbox) names it, and no socket directory of amvm `pid`
    /// (the run's process) nor of any VMM that has ended exists.
    pub fn nothing_left(workspace: &str, pid: u32) {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let procs = processes_with(workspace);
            let dirs: Vec<PathBuf> = [std::env::temp_dir(), PathBuf::from("/run/user")]
                .iter()
                .filter_map(|d| std::fs::read_dir(d).ok())
                .flat_map(|r| r.flatten().map(|e| e.path()))
                .filter(|p| {
                    let Some(n) = p.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                        return false;
                    };
                    // amvm-PID-NONCE: a VMM's private socket directory.
                    let owner = n
                        .strip_prefix("amvm-")
                        .and_then(|r| r.split_once('-'))
                        .and_then(|(p, _)| p.parse::<u32>().ok());
                    owner.is_some_and(|o| {
                        o == pid || !std::path::Path::new(&format!("/proc/{o}")).exists()
                    })
                })
                .collect();
            let sandboxes = sandboxes_naming(workspace);
            if procs.is_empty() && dirs.is_empty() && sandboxes.is_empty() {
                return;
            }
            assert!(
                Instant::now() < until,
                "left behind: {procs:?} {dirs:?} {sandboxes:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The sandbox state directories (of any user amvm's base directories) whose state.json
    /// mentions `needle`.
    pub fn sandboxes_naming(needle: &str) -> Vec<PathBuf> {
        let mut bases = vec![PathBuf::from("/run/amvm")];
        if let Ok(x) = std::env::var("XDG_RUNTIME_DIR") {
            bases.push(PathBuf::from(x).join("amvm"));
        }
        for d in [std::env::temp_dir(), PathBuf::from("/run/user")] {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("amvm-") && n[5..].parse::<u32>().is_ok() {
                    bases.push(e.path());
                } else if n.parse::<u32>().is_ok() {
                    bases.push(e.path().join("amvm"));
                }
            }
        }
        bases
            .iter()
            .filter_map(|b| std::fs::read_dir(b).ok())
            .flat_map(|r| r.flatten().map(|e| e.path()))
            .filter(|d| {
                std::fs::read_to_string(d.join("state.json")).is_ok_and(|s| s.contains(needle))
            })
            .collect()
    }

    /// The pid of the VMM under `amvm run` process `run` (its sandbox's supervisor's child),
    /// waiting up to 10 s for it.
    pub fn vmm_of(run: u32) -> u32 {
        let children = |p: u32| -> Vec<u32> {
            std::fs::read_to_string(format!("/proc/{p}/task/{p}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect()
        };
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = children(run).into_iter().flat_map(children).next() {
                return v;
            }
            assert!(Instant::now() < until, "amvm run {run} has no VMM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `sh -c SCRIPT` in a VM with default options.
pub fn sh(script: &str) -> Outcome {
    run_vm(&[], &["sh", "-c", script])
}

/// A stand-in egress endpoint: a unix socket server in this test process that speaks a tiny
/// line protocol, so both ends of every stream can be hashed and compared.
///
/// * `UP n` then n bytes: the server reads exactly n bytes and answers their SHA-256 (hex).
/// * `UPEOF`: the server reads until the client half-closes, then answers the SHA-256.
/// * `DOWN n`: the server sends n bytes (a fixed pattern) and closes.
/// * `DIE`: the server closes at once without answering (an endpoint dying mid-stream).
/// * An HTTP/1.1 request line: the server answers `200 ok` to each request (headers, then a
///   `Content-Length` body) until the client closes, and records `"HTTP <requests>"`.
///
/// Pacing: `Pace::Slow` reads in 1000-byte pieces with 1 ms pauses and stops for 2 s once;
/// `Pace::Fast` reads 1 MiB at a time. Every stream's result goes to [`EgressServer::records`]
/// as `"UP <n> <sha>"`, `"UPEOF <n> <sha>"` or `"DOWN <n> <sha>"`.
pub mod egress_server {
    use sha2::{Digest, Sha256};
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Pace {
        Fast,
        Slow,
    }

    #[derive(Debug)]
    pub struct EgressServer {
        pub dir: PathBuf,
        pub path: PathBuf,
        records: Arc<Mutex<Vec<String>>>,
    }

    pub fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The bytes `DOWN n` sends: `pattern_at(0, n)`.
    pub fn pattern(n: usize) -> Vec<u8> {
        pattern_at(0, n)
    }

    /// Bytes `offset..offset+n` of the `DOWN` pattern (it repeats every 251 bytes).
    pub fn pattern_at(offset: usize, n: usize) -> Vec<u8> {
        (offset..offset + n)
            .map(|i| ((i % 251) * 7 % 251) as u8)
            .collect()
    }

    /// SHA-256 (hex) of the first `n` bytes of the pattern, computed piecewise.
    pub fn pattern_sha(n: usize) -> String {
        let mut h = Sha256::new();
        let mut off = 0;
        while off < n {
            let k = (n - off).min(PIECE);
            h.update(pattern_at(off, k));
            off += k;
        }
        hex(&h.finalize())
    }

    /// Pattern pieces are a multiple of the period, so every piece is the same bytes.
    const PIECE: usize = 251 * 4096;

    impl EgressServer {
        pub fn start(name: &str, pace: Pace) -> EgressServer {
            let dir =
                std::env::temp_dir().join(format!("amvm-egress-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("egress.sock");
            let listener = UnixListener::bind(&path).unwrap();
            let records: Arc<Mutex<Vec<String>>> = Arc::default();
            let recs = records.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let recs = recs.clone();
                    std::thread::spawn(move || serve(conn, pace, &recs));
                }
            });
            EgressServer { dir, path, records }
        }

        pub fn records(&self) -> Vec<String> {
            self.records.lock().unwrap().clone()
        }

        pub fn path_str(&self) -> &str {
            self.path.to_str().unwrap()
        }
    }

    impl Drop for EgressServer {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn serve(conn: UnixStream, pace: Pace, recs: &Mutex<Vec<String>>) {
        let mut w = conn.try_clone().unwrap();
        let mut r = BufReader::with_capacity(1 << 20, conn);
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return; // amvm's start-up probe: connect and close
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let piece = if pace == Pace::Slow { 1000 } else { 1 << 20 };
        let mut buf = vec![0u8; piece];
        let limit: Option<usize> = match words.as_slice() {
            ["UP", n] => Some(n.parse().unwrap()),
            _ => None,
        };
        match words.as_slice() {
            ["UP", _] | ["UPEOF"] => {
                let (mut h, mut got, mut paused) = (Sha256::new(), 0usize, false);
                loop {
                    let want = limit.map_or(piece, |l| (l - got).min(piece));
                    if want == 0 {
                        break;
                    }
                    let k = r.read(&mut buf[..want]).unwrap_or(0);
                    if k == 0 {
                        break;
                    }
                    h.update(&buf[..k]);
                    got += k;
                    if pace == Pace::Slow {
                        std::thread::sleep(Duration::from_millis(1));
                        if !paused && got > 100_000 {
                            paused = true;
                            std::thread::sleep(Duration::from_secs(2));
                        }
                    }
                }
                let digest = hex(&h.finalize());
                recs.lock()
                    .unwrap()
                    .push(format!("{} {got} {digest}", words[0]));
                let _ = w.write_all(format!("{digest}\n").as_bytes());
            }
            ["DOWN", n] => {
                let n: usize = n.parse().unwrap();
                let piece = pattern_at(0, PIECE.min(n));
                let (mut h, mut off, mut ok) = (Sha256::new(), 0, true);
                while off < n && ok {
                    let k = (n - off).min(PIECE);
                    ok = w.write_all(&piece[..k]).is_ok();
                    h.update(&piece[..k]);
                    off += k;
                }
                recs.lock().unwrap().push(format!(
                    "DOWN {n} {}{}",
                    hex(&h.finalize()),
                    if ok { "" } else { " (write failed)" }
                ));
            }
            // The endpoint dies mid-stream: close without answering.
            ["DIE"] => recs.lock().unwrap().push("DIE".into()),
            [_, _, "HTTP/1.1"] => {
                let mut requests = 0;
                loop {
                    // `line` holds this request's request line; read its headers and body.
                    let mut length = 0usize;
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 {
                            break;
                        }
                        if h == "\r\n" {
                            break;
                        }
                        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0u8; length];
                    if r.read_exact(&mut body).is_err() {
                        break;
                    }
                    requests += 1;
                    let _ = w.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                    line.clear();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                }
                recs.lock().unwrap().push(format!("HTTP {requests}"));
            }
            _ => panic!("egress server: bad request line {line:?}"),
        }
    }
}

/// tests/standin/tls_upstream.py on 127.0.0.1 in `dir`, behind a certificate for localhost from
/// a throw-away CA that tests/standin/test-ca makes there first (`dir/ca.pem`); killed and
/// reaped on drop.
pub struct TlsUpstream {
    child: std::process::Child,
    /// Its port, as it wrote it to `dir/port`.
    pub port: String,
}

impl TlsUpstream {
    /// Start it with `env` (its keys and modes: the script's docstring) and wait until it
    /// listens.
    pub fn start(dir: &std::path::Path, env: &[(&str, &str)]) -> TlsUpstream {
        let standin = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("standin");
        let st = Command::new(standin.join("test-ca"))
            .arg(dir)
            .status()
            .expect("tests/standin/test-ca");
        assert!(st.success(), "tests/standin/test-ca failed");
        let child = Command::new("python3")
            .arg(standin.join("tls_upstream.py"))
            .args(["up.pem", "up.key", "port", "records", "go"])
            .envs(env.iter().copied())
            .current_dir(dir)
            .spawn()
            .expect("python3 tests/standin/tls_upstream.py");
        let mut up = TlsUpstream {
            child,
            port: String::new(),
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        up.port = loop {
            if let Ok(p) = std::fs::read_to_string(dir.join("port")) {
                break p.trim().to_string();
            }
            assert!(
                std::time::Instant::now() < until,
                "the stand-in TLS upstream did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        up
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
