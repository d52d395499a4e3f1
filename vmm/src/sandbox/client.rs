//! A client of a sandbox's API socket (docs/api.md): what the CLI uses, and the Rust library
//! face ([`Sandbox`]) for programs that drive sandboxes themselves.
//!
//! ```no_run
//! use amvm::sandbox::client::Sandbox;
//! let sb = Sandbox::create("amvm", &["--mem", "256"]).unwrap();
//! let out = sb.exec_output(&["sh", "-c", "echo hi > /tmp/f; cat /tmp/f"]).unwrap();
//! assert_eq!((out.status, &out.stdout[..]), (0, &b"hi\n"[..]));
//! sb.stop(10).unwrap();
//! sb.remove().unwrap();
//! ```

use super::api::{self, ErrorBody, ExecRequest, StopRequest, EXEC_UPGRADE};
use super::{Info, SandboxError};
use guest_init::protocol::{encode_chunks, encode_frame, Direction, Frame, FrameKind, FrameParser};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One sandbox, by id.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    /// What the caller called it (its name or id), for messages.
    shown: String,
    dir: PathBuf,
}

/// What [`Sandbox::exec_output`] collects.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub status: u8,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// The frames one exec sends back, as they come.
pub enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(u8),
}

/// An exec in progress: read its events; send stdin and signals from any thread
/// ([`ExecStream::sender`]).
pub struct ExecStream {
    id: String,
    reader: UnixStream,
    parser: FrameParser,
    queued: std::collections::VecDeque<Event>,
    writer: Sender,
    buf: Vec<u8>,
}

/// The client-to-sandbox half of an exec stream.
#[derive(Clone)]
pub struct Sender(Arc<Mutex<UnixStream>>);

impl Sender {
    fn send(&self, kind: FrameKind, data: &[u8]) -> std::io::Result<()> {
        let mut f = Vec::with_capacity(data.len() + 16);
        if kind == FrameKind::Stdin {
            encode_chunks(kind, data, &mut f);
        } else {
            encode_frame(kind, data, &mut f);
        }
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .write_all(&f)
    }

    /// Bytes for the command's stdin (an exec made with `stdin: true`).
    pub fn stdin(&self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.send(FrameKind::Stdin, data)
    }

    /// The end of the command's stdin.
    pub fn stdin_end(&self) -> std::io::Result<()> {
        self.send(FrameKind::StdinEnd, &[])
    }

    /// The terminal's new window size (an exec made with `tty`).
    pub fn resize(&self, rows: u16, cols: u16) -> std::io::Result<()> {
        self.send(
            FrameKind::Resize,
            &guest_init::protocol::resize_payload(rows, cols),
        )
    }

    /// Signal `sig` to the command's process group.
    pub fn signal(&self, sig: u8) -> std::io::Result<()> {
        self.send(FrameKind::Signal, &[sig])
    }
}

impl ExecStream {
    pub fn sender(&self) -> Sender {
        self.writer.clone()
    }

    /// The next event; `None` when the stream ended (after Exit, or without it if the sandbox
    /// went away: then [`ExecStream::next_event`] says so as an error).
    pub fn next_event(&mut self) -> Result<Option<Event>, SandboxError> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Ok(Some(e));
            }
            let mut chunk = [0u8; 64 * 1024];
            let n = if self.buf.is_empty() {
                match self.reader.read(&mut chunk) {
                    Ok(0) => {
                        return Err(SandboxError::Protocol(
                            self.id.clone(),
                            "the sandbox ended the command's stream before its exit status".into(),
                        ))
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(SandboxError::Io(format!("sandbox {}", self.id), e)),
                }
            } else {
                let b = std::mem::take(&mut self.buf);
                chunk[..b.len()].copy_from_slice(&b);
                b.len()
            };
            let q = &mut self.queued;
            self.parser
                .feed(&chunk[..n], |f| match f {
                    Frame::Stdout(b) => q.push_back(Event::Stdout(b)),
                    Frame::Stderr(b) => q.push_back(Event::Stderr(b)),
                    Frame::Exit(c) => q.push_back(Event::Exit(c)),
                    _ => {}
                })
                .map_err(|e| SandboxError::Protocol(self.id.clone(), e.to_string()))?;
        }
    }
}

impl Sandbox {
    /// The sandbox `id_or_name` of this user.
    pub fn open(id_or_name: &str) -> Result<Sandbox, SandboxError> {
        let (id, dir) = super::resolve(id_or_name)?;
        Ok(Sandbox {
            id,
            shown: id_or_name.to_string(),
            dir,
        })
    }

    /// Its state directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// What the caller called it (its name or id).
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// Boot a sandbox with `amvm create ARGS` (`amvm` is the binary to run: a path, or a name
    /// found on $PATH) and open it.
    pub fn create(amvm: &str, args: &[&str]) -> Result<Sandbox, SandboxError> {
        let out = std::process::Command::new(amvm)
            .arg("create")
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| SandboxError::Io(amvm.into(), e))?;
        if !out.status.success() {
            let msg = String::from_utf8_lossy(&out.stderr);
            return Err(SandboxError::Start(
                msg.trim().trim_start_matches("amvm: ").to_string(),
            ));
        }
        Sandbox::open(String::from_utf8_lossy(&out.stdout).trim())
    }

    /// Its state as the supervisor sees it, or as it left it.
    pub fn info(&self) -> Result<Info, SandboxError> {
        let state = super::read_state(&self.dir)?;
        if !state.live() {
            return Ok(state);
        }
        match self.call("GET", "/v1/sandbox", None) {
            Ok(body) => self.json(&body),
            // Between the state file and the call, it ended.
            Err(SandboxError::Io(..)) => super::read_state(&self.dir),
            Err(e) => Err(e),
        }
    }

    /// Stop it (SIGTERM to everything, SIGKILL after `grace` s); its final state.
    pub fn stop(&self, grace: u32) -> Result<Info, SandboxError> {
        let state = super::read_state(&self.dir)?;
        if !state.live() {
            return Ok(state);
        }
        let body = serde_json::to_vec(&StopRequest {
            grace_seconds: grace,
        })
        .expect("serializable");
        match self.call("POST", "/v1/stop", Some(&body)) {
            Ok(b) => self.json(&b),
            Err(SandboxError::Io(..)) => super::read_state(&self.dir),
            Err(e) => Err(e),
        }
    }

    /// Pause it: its vCPUs stop where they are (its processes, memory and open streams are
    /// kept); its state after.
    pub fn pause(&self) -> Result<Info, SandboxError> {
        self.must_be_up()?;
        let body = self.call("POST", "/v1/pause", None)?;
        self.json(&body)
    }

    /// Let a paused sandbox run again; its state after.
    pub fn resume(&self) -> Result<Info, SandboxError> {
        self.must_be_up()?;
        let body = self.call("POST", "/v1/resume", None)?;
        self.json(&body)
    }

    /// Snapshot it into `dir`, a new directory (0700) holding `state` and `memory` (0600, the
    /// memory file sparse: untouched guest RAM takes no disk), `sandbox.json` (what it was
    /// made with, its kernel's SHA-256, its workspace's fingerprint) and, with an overlay
    /// workspace, `upper/` and `upper.json`: the overlay's upper layer (its special files and
    /// extended attributes in the JSON), copied while the guest is paused (it is
    /// paused for that, and resumed after, when it was running), so that it and the guest's
    /// memory are of one instant. The sandbox goes on as it was, or ends with `stop`. On
    /// failure nothing is left of `dir`.
    pub fn snapshot(&self, dir: &Path, stop: bool) -> Result<api::SnapshotAnswer, SandboxError> {
        use std::os::unix::fs::DirBuilderExt;
        let info = super::read_state(&self.dir)?;
        if !info.live() {
            return Err(SandboxError::NotRunning(self.shown.clone(), info.state));
        }
        let bad = |what: String| SandboxError::Snapshot(what);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => bad(format!(
                    "{} exists: a snapshot goes into a new directory",
                    dir.display()
                )),
                _ => bad(format!("{}: {e}", dir.display())),
            })?;
        let overlay = info.config.overlay_scratch.is_some();
        let paused_here = overlay && info.state == "running";
        let mut r = if paused_here {
            self.pause().map(drop)
        } else {
            Ok(())
        }
        .and_then(|()| self.snapshot_into(dir, &info, stop && !overlay));
        if overlay {
            r = match r {
                Ok(mut a) if stop => self.stop(0).map(|i| {
                    a.sandbox = i;
                    a
                }),
                Ok(mut a) if paused_here => self.resume().map(|i| {
                    a.sandbox = i;
                    a
                }),
                Err(e) if paused_here => {
                    let _ = self.resume();
                    Err(e)
                }
                r => r,
            };
        }
        if r.is_err() {
            crate::snapshot::tree::remove(dir);
        }
        r
    }

    fn snapshot_into(
        &self,
        dir: &Path,
        info: &Info,
        stop: bool,
    ) -> Result<api::SnapshotAnswer, SandboxError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let file = |name: &str| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.join(name))
                .map_err(|e| SandboxError::Snapshot(format!("{}: {e}", dir.join(name).display())))
        };
        let (state, memory) = (file("state")?, file("memory")?);
        let kernel_sha256 = match &info.config.kernel {
            Some(k) => Some(sha256_remembered(k).map_err(|e| {
                SandboxError::Snapshot(format!("the guest kernel {}: {e}", k.display()))
            })?),
            None => None,
        };
        let mut described = serde_json::json!({
            "amvm": env!("CARGO_PKG_VERSION"),
            "kernel_sha256": kernel_sha256,
            "sandbox": info,
        });
        let mut description = file("sandbox.json")?;
        description
            .write_all(&serde_json::to_vec_pretty(&described).expect("serializable"))
            .map_err(|e| SandboxError::Snapshot(format!("{}: {e}", dir.display())))?;
        let body = serde_json::to_vec(&api::SnapshotRequest { stop }).expect("serializable");
        let head = format!(
            "POST /v1/snapshot HTTP/1.1\r\nHost: amvm\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let mut sock = self.connect()?;
        let io = |e| SandboxError::Io(format!("sandbox {}", self.id), e);
        let sent = crate::scm::send_with_fds(
            sock.as_raw_fd(),
            head.as_bytes(),
            &[state.as_raw_fd(), memory.as_raw_fd()],
        )
        .map_err(io)?;
        sock.write_all(&head.as_bytes()[sent..]).map_err(io)?;
        sock.write_all(&body).map_err(io)?;
        let (code, head, rest) = self.read_head(&mut sock)?;
        let body = self.read_body(&mut sock, &head, rest)?;
        if code != 200 {
            return Err(self.api_error(code, &body));
        }
        use std::os::unix::fs::FileExt;
        let answer: api::SnapshotAnswer = self.json(&body)?;
        // The overlay's upper layer, while the guest is still paused (`snapshot` paused it).
        if let (Some(scratch), Some(_)) = (&info.config.overlay_scratch, &info.config.overlay_lower)
        {
            let seen = crate::overlay::scratch_seen_from_outside(
                scratch,
                info.config.overlay_size.is_some(),
                info.pid,
            );
            let copied = crate::snapshot::tree::save(
                &crate::overlay::upper(&seen),
                &dir.join("upper"),
                &dir.join("upper.json"),
            )
            .map_err(|e| SandboxError::Snapshot(format!("copying the workspace's changes: {e}")))?;
            described["upper"] = serde_json::json!({
                "entries": copied.entries,
                "bytes": copied.bytes,
            });
        }
        // What the workspace looks like on the host: a restore says so when it changed.
        if let Some(w) = workspace_dir(&info.config) {
            let f = crate::snapshot::tree::fingerprint(&w)
                .map_err(|e| SandboxError::Snapshot(format!("the workspace: {e}")))?;
            described["workspace"] = serde_json::json!({ "dir": w, "fingerprint": f });
        }
        // Last: the mark of a finished snapshot, and where a restore's exec ids start.
        described["next_exec_id"] = answer.next_exec_id.into();
        let bytes = serde_json::to_vec_pretty(&described).expect("serializable");
        description
            .set_len(0)
            .and_then(|()| description.write_all_at(&bytes, 0))
            .and_then(|()| description.sync_all())
            .map_err(|e| SandboxError::Snapshot(format!("{}: {e}", dir.display())))?;
        Ok(answer)
    }

    /// A sandbox whose supervisor is gone is said to be so, not "connection refused".
    fn must_be_up(&self) -> Result<(), SandboxError> {
        let state = super::read_state(&self.dir)?;
        if state.live() {
            return Ok(());
        }
        Err(SandboxError::NotRunning(self.shown.clone(), state.state))
    }

    /// Wait until it has stopped; its final state.
    pub fn wait(&self) -> Result<Info, SandboxError> {
        let state = super::read_state(&self.dir)?;
        if !state.live() {
            return Ok(state);
        }
        match self.call("GET", "/v1/wait", None) {
            Ok(b) => self.json(&b),
            Err(SandboxError::Io(..)) => super::read_state(&self.dir),
            Err(e) => Err(e),
        }
    }

    /// Remove it (it must have stopped).
    pub fn remove(&self) -> Result<(), SandboxError> {
        super::remove(&self.id, &self.dir)
    }

    /// Start `req`; its stream.
    pub fn exec(&self, req: &ExecRequest) -> Result<ExecStream, SandboxError> {
        let state = super::read_state(&self.dir)?;
        if state.state == "paused" {
            return Err(SandboxError::Paused(self.shown.clone()));
        }
        if state.state != "running" {
            return Err(SandboxError::NotRunning(self.shown.clone(), state.state));
        }
        let body = serde_json::to_vec(req).expect("serializable");
        let mut sock = self.connect()?;
        let head = format!(
            "POST /v1/exec HTTP/1.1\r\nHost: amvm\r\nUpgrade: {EXEC_UPGRADE}\r\nConnection: Upgrade\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let io = |e| SandboxError::Io(format!("sandbox {}", self.id), e);
        sock.write_all(head.as_bytes()).map_err(io)?;
        sock.write_all(&body).map_err(io)?;
        let (code, head, rest) = self.read_head(&mut sock)?;
        if code != 101 {
            let body = self.read_body(&mut sock, &head, rest)?;
            return Err(self.api_error(code, &body));
        }
        let writer = sock.try_clone().map_err(io)?;
        Ok(ExecStream {
            id: self.id.clone(),
            reader: sock,
            parser: FrameParser::new(Direction::ToHost),
            queued: Default::default(),
            writer: Sender(Arc::new(Mutex::new(writer))),
            buf: rest,
        })
    }

    /// Run `argv` (no stdin) and collect its output and status.
    pub fn exec_output(&self, argv: &[&str]) -> Result<Output, SandboxError> {
        let mut s = self.exec(&ExecRequest {
            argv: argv.iter().map(|&a| a.into()).collect(),
            env: vec![],
            workdir: None,
            user: None,
            stdin: false,
            tty: None,
            clear_env: false,
            capabilities: None,
            groups: vec![],
            rlimits: vec![],
            root: None,
        })?;
        let mut out = Output {
            status: 0,
            stdout: vec![],
            stderr: vec![],
        };
        loop {
            match s.next_event()? {
                Some(Event::Stdout(b)) => out.stdout.extend_from_slice(&b),
                Some(Event::Stderr(b)) => out.stderr.extend_from_slice(&b),
                Some(Event::Exit(c)) => {
                    out.status = c;
                    return Ok(out);
                }
                None => unreachable!("next_event() errs at a stream without Exit"),
            }
        }
    }

    fn connect(&self) -> Result<UnixStream, SandboxError> {
        // (A snapshot's files travel on this socket too: see `snapshot_into`.)
        let path = self.dir.join("api.sock");
        UnixStream::connect(&path).map_err(|e| SandboxError::Io(format!("sandbox {}", self.id), e))
    }

    fn json<T: serde::de::DeserializeOwned>(&self, body: &[u8]) -> Result<T, SandboxError> {
        serde_json::from_slice(body)
            .map_err(|e| SandboxError::Protocol(self.id.clone(), e.to_string()))
    }

    fn api_error(&self, code: u16, body: &[u8]) -> SandboxError {
        let msg = serde_json::from_slice::<ErrorBody>(body)
            .map(|b| b.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned());
        if code == 409 {
            return SandboxError::Api(self.shown.clone(), code, msg);
        }
        SandboxError::Api(self.id.clone(), code, msg)
    }

    /// One request, its 200 body (any other status is an error).
    fn call(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<Vec<u8>, SandboxError> {
        let mut sock = self.connect()?;
        let body = body.unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: amvm\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let io = |e| SandboxError::Io(format!("sandbox {}", self.id), e);
        sock.write_all(head.as_bytes()).map_err(io)?;
        sock.write_all(body).map_err(io)?;
        let (code, head, rest) = self.read_head(&mut sock)?;
        let body = self.read_body(&mut sock, &head, rest)?;
        if code != 200 {
            return Err(self.api_error(code, &body));
        }
        Ok(body)
    }

    fn read_head(&self, sock: &mut UnixStream) -> Result<(u16, api::Head, Vec<u8>), SandboxError> {
        let mut buf = Vec::with_capacity(1024);
        let bad = |m: String| SandboxError::Protocol(self.id.clone(), m);
        let end = loop {
            if let Some(end) = api::head_end(&buf) {
                break end;
            }
            if buf.len() > api::MAX_HEAD {
                return Err(bad("a response head that never ends".into()));
            }
            let mut chunk = [0u8; 4096];
            let n = sock
                .read(&mut chunk)
                .map_err(|e| SandboxError::Io(format!("sandbox {}", self.id), e))?;
            if n == 0 {
                return Err(SandboxError::Io(
                    format!("sandbox {}", self.id),
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the supervisor closed the connection without an answer",
                    ),
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = api::parse_head(&buf[..end]).map_err(bad)?;
        let code = head
            .first
            .1
            .parse::<u16>()
            .map_err(|_| bad(format!("status {:?}", head.first.1)))?;
        Ok((code, head, buf.split_off(end)))
    }

    fn read_body(
        &self,
        sock: &mut UnixStream,
        head: &api::Head,
        mut body: Vec<u8>,
    ) -> Result<Vec<u8>, SandboxError> {
        let len = head
            .content_length()
            .map_err(|e| SandboxError::Protocol(self.id.clone(), e))?;
        while body.len() < len {
            let mut chunk = vec![0u8; len - body.len()];
            let n = sock
                .read(&mut chunk)
                .map_err(|e| SandboxError::Io(format!("sandbox {}", self.id), e))?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
        body.truncate(len);
        Ok(body)
    }
}

/// The host directory a sandbox's workspace is (its overlay's lower directory, or its plain
/// `--workspace DIR`), if it has one.
pub fn workspace_dir(c: &super::Config) -> Option<std::path::PathBuf> {
    c.overlay_lower.clone().or_else(|| c.workspace.clone())
}

/// The SHA-256 of the file at `path`, remembered in `$AMVM_CACHE/sha256/` under the file's
/// identity (device, inode, size, modification and change times: any write or replacement
/// changes the change time): a guest kernel is hashed once, not at every snapshot and restore
/// (0.4 s of each on the test bed). Without a usable cache it is hashed every time.
pub fn sha256_remembered(path: &Path) -> std::io::Result<String> {
    sha256_remembered_in(crate::config::cache_dir().as_deref(), path)
}

fn sha256_remembered_in(cache: Option<&Path>, path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    let canonical = path.canonicalize()?;
    let identity = format!(
        "{}\0{}\0{}\0{}\0{}.{}\0{}.{}",
        canonical.display(),
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    );
    let key = hex(&Sha256::digest(identity.as_bytes()));
    let stamp = cache.map(|c| c.join("sha256").join(key));
    if let Some(known) = stamp.as_ref().and_then(|s| std::fs::read_to_string(s).ok()) {
        if known.len() == 64 && known.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(known);
        }
    }
    let sum = sha256_of(path)?;
    if let Some(stamp) = stamp {
        // Best effort, whole or not at all: written aside, renamed into place.
        let tmp = stamp.with_extension(format!("tmp{}", std::process::id()));
        let kept = stamp
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &sum))
            .and_then(|()| std::fs::rename(&tmp, &stamp));
        if kept.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(sum)
}

/// Bytes as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of the file at `path`, hex.
pub fn sha256_of(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remembered_sha256_is_the_file_s_and_follows_a_write() {
        let base = std::env::temp_dir().join(format!("amvm-sha-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let (cache, file) = (base.join("cache"), base.join("kernel"));
        std::fs::write(&file, b"one").unwrap();
        let first = sha256_remembered_in(Some(&cache), &file).unwrap();
        assert_eq!(first, sha256_of(&file).unwrap());
        let stamps: Vec<_> = std::fs::read_dir(cache.join("sha256")).unwrap().collect();
        assert_eq!(stamps.len(), 1, "one stamp, nothing left aside");
        assert_eq!(sha256_remembered_in(Some(&cache), &file).unwrap(), first);
        // A write changes the file's identity (size, times): hashed again.
        std::fs::write(&file, b"two").unwrap();
        let second = sha256_remembered_in(Some(&cache), &file).unwrap();
        assert_eq!(second, sha256_of(&file).unwrap());
        assert_ne!(second, first);
        // A stamp that is not a SHA-256 is not believed.
        for s in std::fs::read_dir(cache.join("sha256")).unwrap() {
            std::fs::write(s.unwrap().path(), b"garbage").unwrap();
        }
        assert_eq!(sha256_remembered_in(Some(&cache), &file).unwrap(), second);
        assert_eq!(sha256_remembered_in(None, &file).unwrap(), second);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
