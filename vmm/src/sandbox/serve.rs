//! `amvm serve`: one API socket for all of this user's sandboxes (docs/api.md), for callers that
//! create, list and remove sandboxes over HTTP rather than with the CLI. Each sandbox keeps
//! its own supervisor and its own socket; this server adds what no single sandbox can answer
//! and passes the rest through:
//!
//! | request | what it does |
//! |---|---|
//! | `GET /v1/sandboxes` | every sandbox, as `amvm ls --json` |
//! | `POST /v1/sandboxes` | `amvm create` with the body's flags: 201 and the sandbox |
//! | `GET /v1/sandboxes/ID` | the sandbox, as `amvm inspect` |
//! | `DELETE /v1/sandboxes/ID[?force=true]` | `amvm rm [-f]` |
//! | any other `/v1/sandboxes/ID/REST` | the sandbox's own `/v1/REST` (exec, stop, wait, archive), passed through byte for byte |
//!
//! A create runs `amvm create` as a child process: a sandbox's supervisor must be forked from a
//! process with one thread, which a server is not. Everything that blocks (a create's boot, an
//! `rm`) runs off the event loop.

use super::api::{self, Head};
use super::client::Sandbox;
use super::http::{parse_body, read_body, read_head, reply_error, reply_json};
use super::SandboxError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CreateRequest {
    /// `amvm create`'s flags, as on its command line: `["--mem", "256", "--workspace", "/src"]`.
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `POST /v1/sandboxes/ID/snapshot` through the server, which writes the files itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotToRequest {
    /// The snapshot's new directory: an absolute path the server (running as the same user)
    /// makes.
    pub dir: PathBuf,
    #[serde(default)]
    pub stop: bool,
}

/// `POST /v1/sandboxes/ID/fork`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ForkRequest {
    /// How many (1 to 64; 1 when absent).
    #[serde(default = "one")]
    pub n: u32,
}

fn one() -> u32 {
    1
}

/// Where `amvm serve` listens by default: `api.sock` beside this user's sandboxes.
pub fn default_socket() -> PathBuf {
    super::base_dir().join("api.sock")
}

/// Serve until SIGINT or SIGTERM; then the socket is removed.
pub fn serve(socket: Option<PathBuf>) -> Result<(), SandboxError> {
    let socket = match socket {
        Some(s) => s,
        None => {
            super::private_dir(&super::base_dir())?;
            default_socket()
        }
    };
    // A socket left by a server that is gone is replaced; one that answers is not.
    if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        return Err(SandboxError::Serve(format!(
            "{}: another amvm serve is listening there",
            socket.display()
        )));
    }
    let _ = std::fs::remove_file(&socket);
    // Made 0600 from the start (still one thread here, so the umask is ours alone): only this
    // user reaches it, wherever it is.
    // SAFETY: umask(2) cannot fail and takes no pointers.
    let umask = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(&socket);
    // SAFETY: as above, restoring the caller's.
    unsafe { libc::umask(umask) };
    let listener = bound.map_err(super::io_err(socket.display()))?;
    listener
        .set_nonblocking(true)
        .map_err(super::io_err(socket.display()))?;
    let amvm = std::env::current_exe().map_err(super::io_err("the amvm binary"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(super::io_err("starting the server's runtime"))?;
    let signals = crate::signals::Signals::block().map_err(super::io_err("blocking signals"))?;
    // SIGINT, SIGTERM or SIGHUP ends the server: a thread waits for them on the signalfd.
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = signals.wait();
        let _ = stop_tx.send(());
    });
    eprintln!(
        "amvm: serving this user's sandboxes on {}",
        socket.display()
    );
    let r = rt.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(listener)
            .map_err(super::io_err(socket.display()))?;
        loop {
            tokio::select! {
                conn = listener.accept() => {
                    let conn = match conn {
                        Ok((conn, _)) => conn,
                        Err(e) => {
                            // Out of descriptors fails again at once while it lasts: no spin.
                            tracing::warn!("accepting on {}: {e}", socket.display());
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let amvm = amvm.clone();
                    tokio::spawn(async move {
                        if let Err(e) = connection(&amvm, conn).await {
                            tracing::debug!("an API connection: {e}");
                        }
                    });
                }
                _ = &mut stop_rx => break,
            }
        }
        let _ = std::fs::remove_file(&socket);
        Ok(())
    });
    r
}

/// The sandbox and the rest of the path of `/v1/sandboxes/ID[/REST]`.
fn sandbox_path(path: &str) -> Option<(&str, Option<&str>)> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    match rest.split_once('/') {
        Some((id, more)) if !id.is_empty() && !more.is_empty() => Some((id, Some(more))),
        None if !rest.is_empty() => Some((rest, None)),
        _ => None,
    }
}

/// A blocking call off the event loop.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SandboxError> + Send + 'static,
) -> Result<T, SandboxError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(SandboxError::Serve(format!("a worker failed: {e}"))))
}

/// The status code for a sandbox error.
fn code_of(e: &SandboxError) -> u16 {
    match e {
        SandboxError::NotFound(_) => 404,
        SandboxError::Running(_) | SandboxError::NotRunning(..) | SandboxError::Paused(_) => 409,
        SandboxError::Io(..) | SandboxError::Serve(_) => 500,
        // The flags were fine; the VM was not.
        SandboxError::CreateFailed(why) if why.starts_with("the sandbox did not start") => 500,
        _ => 400,
    }
}

async fn connection(amvm: &Path, mut conn: UnixStream) -> Result<(), String> {
    let (head, rest) = match read_head(&mut conn).await? {
        Some(Ok(h)) => h,
        Some(Err((code, e))) => return reply_error(&mut conn, code, &e).await,
        None => return Ok(()),
    };
    let method = head.first.0.clone();
    let (path, query) = match api::split_target(&head.first.1) {
        Ok((p, q)) => (p.to_string(), q),
        Err(e) => return reply_error(&mut conn, 400, &e).await,
    };
    // A snapshot or a fork is the server's own work (it opens the paths, forks the processes);
    // everything else of a sandbox is its own socket's.
    if let Some((id, Some(more))) = sandbox_path(&path) {
        if !(method == "POST" && matches!(more, "snapshot" | "fork")) {
            return pass_through(conn, &head, id, more, rest).await;
        }
    }
    let (body, _) = match read_body(&mut conn, &head, rest).await? {
        Some(Ok(b)) => b,
        Some(Err((code, e))) => return reply_error(&mut conn, code, &e).await,
        None => return Ok(()),
    };
    let answer = match (method.as_str(), sandbox_path(&path)) {
        ("GET", _) if path == "/v1/sandboxes" => {
            blocking(super::list).await.map(|l| (200, json(&l)))
        }
        ("POST", _) if path == "/v1/sandboxes" => match parse_body::<CreateRequest>(&body) {
            Ok(req) => {
                let amvm = amvm.to_owned();
                blocking(move || create(&amvm, &req))
                    .await
                    .map(|i| (201, json(&i)))
            }
            Err(e) => return reply_error(&mut conn, 400, &e).await,
        },
        ("GET", Some((id, None))) => {
            let id = id.to_string();
            blocking(move || Sandbox::open(&id)?.info())
                .await
                .map(|i| (200, json(&i)))
        }
        ("DELETE", Some((id, None))) => {
            let id = id.to_string();
            let force = query
                .iter()
                .any(|(k, v)| k == "force" && matches!(v.as_str(), "true" | "1"));
            blocking(move || delete(&id, force))
                .await
                .map(|id| (200, json(&serde_json::json!({ "removed": id }))))
        }
        ("POST", Some((id, Some("snapshot")))) => match parse_body::<SnapshotToRequest>(&body) {
            Ok(req) if !req.dir.is_absolute() => {
                let e = format!("dir {}: say an absolute path", req.dir.display());
                return reply_error(&mut conn, 400, &e).await;
            }
            Ok(req) => {
                let id = id.to_string();
                blocking(move || Sandbox::open(&id)?.snapshot(&req.dir, req.stop))
                    .await
                    .map(|a| (200, json(&a)))
            }
            Err(e) => return reply_error(&mut conn, 400, &e).await,
        },
        ("POST", Some((id, Some("fork")))) => match parse_body::<ForkRequest>(&body) {
            Ok(req) if !(1..=64).contains(&req.n) => {
                let e = format!("n {}: say 1 to 64", req.n);
                return reply_error(&mut conn, 400, &e).await;
            }
            Ok(req) => {
                let (amvm, id) = (amvm.to_owned(), id.to_string());
                blocking(move || fork(&amvm, &id, req.n))
                    .await
                    .map(|l| (201, json(&l)))
            }
            Err(e) => return reply_error(&mut conn, 400, &e).await,
        },
        _ if path == "/v1/sandboxes" || sandbox_path(&path).is_some() => {
            return reply_error(&mut conn, 405, &format!("{method} {path}: wrong method")).await
        }
        _ => return reply_error(&mut conn, 404, &format!("no such endpoint {path}")).await,
    };
    match answer {
        Ok((code, body)) => reply_json(&mut conn, code, &body).await,
        Err(e) => reply_error(&mut conn, code_of(&e), &e.to_string()).await,
    }
}

fn json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// `amvm create` with the request's flags, as a child process; the new sandbox.
fn create(amvm: &Path, req: &CreateRequest) -> Result<super::Info, SandboxError> {
    let mut cmd = std::process::Command::new(amvm);
    cmd.arg("create").args(&req.args);
    if let Some(n) = &req.name {
        cmd.arg("--name").arg(n);
    }
    for (k, v) in &req.labels {
        cmd.arg("--label").arg(format!("{k}={v}"));
    }
    let id = child(amvm, cmd)?;
    Sandbox::open(id.trim())?.info()
}

/// `amvm fork -n N ID` as a child process (a sandbox's supervisor must be forked from a process
/// with one thread); the new sandboxes.
fn fork(amvm: &Path, id: &str, n: u32) -> Result<Vec<super::Info>, SandboxError> {
    // Said here, as the other calls on a sandbox say it: not as a failed create.
    let sb = Sandbox::open(id)?;
    let info = sb.info()?;
    if !info.live() {
        return Err(SandboxError::NotRunning(info.id, info.state));
    }
    let mut cmd = std::process::Command::new(amvm);
    cmd.args(["fork", "-n", &n.to_string(), &info.id]);
    child(amvm, cmd)?
        .lines()
        .map(|id| Sandbox::open(id.trim())?.info())
        .collect()
}

/// Run `cmd` (amvm's own), its stdout; a failure is its last line on stderr.
fn child(amvm: &Path, mut cmd: std::process::Command) -> Result<String, SandboxError> {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(super::io_err(format!("running {}", amvm.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .trim_start_matches("amvm: ");
        return Err(SandboxError::CreateFailed(line.to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `amvm rm [-f] ID`: its id once removed.
fn delete(id_or_name: &str, force: bool) -> Result<String, SandboxError> {
    let sb = Sandbox::open(id_or_name)?;
    let info = sb.info()?;
    let running = info.live();
    if running && !force {
        return Err(SandboxError::Running(info.id));
    }
    super::commands::rm_quietly(&info.id)?;
    Ok(info.id)
}

/// Pass `METHOD /v1/sandboxes/ID/REST` to the sandbox's own socket as `METHOD /v1/REST`, with the
/// same headers and whatever follows, and its answer back, byte for byte both ways (an exec's
/// frames, an archive's stream).
async fn pass_through(
    mut conn: UnixStream,
    head: &Head,
    id: &str,
    more: &str,
    rest: Vec<u8>,
) -> Result<(), String> {
    let id_owned = id.to_string();
    let sandbox = match blocking(move || {
        let sb = Sandbox::open(&id_owned)?;
        let info = sb.info()?;
        Ok((sb.dir().join("api.sock"), info))
    })
    .await
    {
        Ok(s) => s,
        Err(e) => return reply_error(&mut conn, code_of(&e), &e.to_string()).await,
    };
    let (sock, info) = sandbox;
    let mut upstream = match UnixStream::connect(&sock).await {
        Ok(u) => u,
        Err(_) => {
            let e = SandboxError::NotRunning(info.id, info.state);
            return reply_error(&mut conn, 409, &e.to_string()).await;
        }
    };
    let query = head.first.1.split_once('?').map(|(_, q)| q);
    let mut out = format!("{} /v1/{more}", head.first.0);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out.push_str(" HTTP/1.1\r\n");
    for (k, v) in &head.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut first = out.into_bytes();
    first.extend_from_slice(&rest);
    upstream
        .write_all(&first)
        .await
        .map_err(|e| e.to_string())?;
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths_split() {
        assert_eq!(sandbox_path("/v1/sandboxes/abc"), Some(("abc", None)));
        assert_eq!(
            sandbox_path("/v1/sandboxes/abc/exec"),
            Some(("abc", Some("exec")))
        );
        assert_eq!(
            sandbox_path("/v1/sandboxes/abc/archive"),
            Some(("abc", Some("archive")))
        );
        assert_eq!(sandbox_path("/v1/sandboxes"), None);
        assert_eq!(sandbox_path("/v1/sandboxes/"), None);
        assert_eq!(sandbox_path("/v1/sandboxes/abc/"), None);
        assert_eq!(sandbox_path("/v1/other/abc"), None);
        let req: CreateRequest = parse_body(br#"{"args": ["--mem", "256"], "name": "a"}"#).unwrap();
        assert_eq!(req.args, ["--mem", "256"]);
        assert_eq!(req.name.as_deref(), Some("a"));
        assert!(req.labels.is_empty());
        assert!(parse_body::<CreateRequest>(br#"{"args": "--mem"}"#).is_err());
    }
}
