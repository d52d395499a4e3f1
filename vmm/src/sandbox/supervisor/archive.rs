//! `PUT /v1/archive?path=DIR` and `GET /v1/archive?path=PATH` (docs/api.md): Docker's
//! put_archive and get_archive, for clients of the API in any language. Like `amvm cp`
//! (copy.rs), each is an exec of the guest's own `tar`, as the sandbox's user, so it reaches
//! what that user may. The supervisor only moves bytes: in, the request body (`Content-Length`
//! of any size, streamed) becomes tar's stdin; out, tar's stdout becomes a chunked response
//! body, so a client can tell a complete archive (the last chunk came) from one cut short.
//! Both move at the slower side's pace: vsock's credit on one side, the socket on the other.
//! What the guest sends out is the guest's: a client unpacks it as untrusted (`amvm cp` does).

use super::{start_exec, Busy, Sup};
use crate::sandbox::api;
use crate::sandbox::copy::{check_guest_path, script_exec, PACK};
use crate::sandbox::http::{reply_error, reply_json};
use guest_init::protocol::{exec_signal_payload, Direction, Frame, FrameKind, FrameParser};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// The status the scripts (this one and copy.rs's PACK) exit with when PATH is not there
/// (answered 404).
const NOT_FOUND: u8 = 44;
/// Unpack stdin (a tar) into the existing directory $1.
const UNPACK_INTO: &str = r#"[ -d "$1" ] || { echo "$1: no such directory" >&2; exit 44; }
exec tar -x -f - -C "$1""#;
/// How much of tar's stderr is kept for the error answer.
const MAX_STDERR: usize = 16 * 1024;

/// The `path` parameter: absolute, without `..`.
fn path_param(query: &[(String, String)]) -> Result<&str, String> {
    let p = query
        .iter()
        .find(|(k, _)| k == "path")
        .map(|(_, v)| v.as_str())
        .ok_or("say which path: ?path=/dir")?;
    check_guest_path(p).map_err(|e| format!("path {p:?}: {e}"))?;
    Ok(p)
}

/// What tar said and how it ended, for the answer when it failed.
fn failure(exit: Option<u8>, stderr: &[u8]) -> (u16, String) {
    let said = String::from_utf8_lossy(stderr).trim().to_string();
    match exit {
        Some(NOT_FOUND) => (404, said),
        Some(c) if said.is_empty() => (400, format!("tar in the sandbox failed (status {c})")),
        Some(_) => (400, said),
        None => (500, "the sandbox's stream ended before tar did".into()),
    }
}

/// `PUT /v1/archive?path=DIR`: the body, a tar of `len` bytes, unpacked into DIR.
pub(super) async fn put(
    sup: &Arc<Sup>,
    mut conn: UnixStream,
    query: &[(String, String)],
    len: u64,
    leftover: Vec<u8>,
) -> Result<(), String> {
    let dir = match path_param(query) {
        Ok(d) => d.to_string(),
        Err(e) => return reply_error(&mut conn, 400, &e).await,
    };
    let (id, guest) = match start_exec(sup, &script_exec(UNPACK_INTO, &[&dir], true)).await {
        Ok(started) => started,
        Err((code, msg)) => return reply_error(&mut conn, code, &msg).await,
    };
    let _busy = Busy::new(sup);
    let (mut gr, mut gw) = guest.into_split();
    let (mut cr, _) = conn.split();
    // The body to tar's stdin. Once tar stops reading (it failed), the rest is read and
    // dropped, so the client gets to read the answer.
    let feed = async {
        let mut left = len;
        let mut buf = vec![0u8; 64 * 1024];
        let mut first = leftover;
        first.truncate(usize::try_from(left).unwrap_or(usize::MAX));
        let mut tar_reads = gw.write_all(&first).await.is_ok();
        left -= first.len() as u64;
        while left > 0 {
            let want = usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()));
            let n = match cr.read(&mut buf[..want]).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => n,
            };
            if tar_reads {
                tar_reads = gw.write_all(&buf[..n]).await.is_ok();
            }
            left -= n as u64;
        }
        let _ = gw.shutdown().await;
        true
    };
    let collect = collect_exit(&mut gr);
    let (whole, (exit, stderr)) = tokio::join!(
        async {
            let whole = feed.await;
            if !whole {
                // The client left before its body ended: tar must not finish a cut archive.
                sup.send_control(
                    FrameKind::ExecSignal,
                    &exec_signal_payload(id, libc::SIGKILL as u8),
                );
            }
            whole
        },
        collect
    );
    if !whole {
        return Ok(());
    }
    match exit {
        Some(0) => reply_json(&mut conn, 200, &serde_json::json!({ "path": dir })).await,
        _ => {
            let (code, msg) = failure(exit, &stderr);
            reply_error(&mut conn, code, &msg).await
        }
    }
}

/// Read an exec's frames to its exit: its status (None if the stream broke or lied) and the
/// start of its stderr; stdout is dropped.
async fn collect_exit(gr: &mut tokio::net::unix::OwnedReadHalf) -> (Option<u8>, Vec<u8>) {
    let mut parser = FrameParser::new(Direction::ToHost);
    let mut buf = vec![0u8; 16 * 1024];
    let mut stderr = Vec::new();
    let mut exit = None;
    while exit.is_none() {
        let n = match gr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let fed = parser.feed(&buf[..n], |f| match f {
            Frame::Stderr(b) if stderr.len() < MAX_STDERR => stderr.extend_from_slice(&b),
            Frame::Exit(c) => exit = Some(c),
            _ => {}
        });
        if fed.is_err() {
            return (None, stderr);
        }
    }
    (exit, stderr)
}

/// `GET /v1/archive?path=PATH`: PATH (a file or a tree) as a tar, in a chunked body. Until
/// tar's first bytes an error is an error answer; after them, a tar that fails ends the body
/// without its last chunk.
pub(super) async fn get(
    sup: &Arc<Sup>,
    mut conn: UnixStream,
    query: &[(String, String)],
) -> Result<(), String> {
    let path = match path_param(query) {
        Ok(p) => p.to_string(),
        Err(e) => return reply_error(&mut conn, 400, &e).await,
    };
    let (id, mut guest) = match start_exec(sup, &script_exec(PACK, &[&path], false)).await {
        Ok(started) => started,
        Err((code, msg)) => return reply_error(&mut conn, code, &msg).await,
    };
    let _busy = Busy::new(sup);
    let mut parser = FrameParser::new(Direction::ToHost);
    let mut buf = vec![0u8; 64 * 1024];
    let mut out = Vec::with_capacity(buf.len() + 32);
    let (mut started, mut stderr, mut exit) = (false, Vec::new(), None);
    let kill = || {
        sup.send_control(
            FrameKind::ExecSignal,
            &exec_signal_payload(id, libc::SIGKILL as u8),
        )
    };
    while exit.is_none() {
        let n = match guest.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        out.clear();
        let fed = parser.feed(&buf[..n], |f| match f {
            Frame::Stdout(b) if !b.is_empty() => {
                if !started {
                    out.extend_from_slice(&api::chunked_head(200, "application/x-tar"));
                    started = true;
                }
                api::chunk(&b, &mut out);
            }
            Frame::Stderr(b) if stderr.len() < MAX_STDERR => stderr.extend_from_slice(&b),
            Frame::Exit(c) => exit = Some(c),
            _ => {}
        });
        if fed.is_err() {
            kill();
            break;
        }
        if !out.is_empty() && conn.write_all(&out).await.is_err() {
            // The client is gone.
            kill();
            return Ok(());
        }
    }
    match (started, exit) {
        (true, Some(0)) => {
            let _ = conn.write_all(api::LAST_CHUNK).await;
            let _ = conn.shutdown().await;
            Ok(())
        }
        // Cut short: no last chunk, so the client knows.
        (true, _) => {
            tracing::warn!(
                "archive of {path}: tar failed after it began: {}",
                String::from_utf8_lossy(&stderr).trim()
            );
            let _ = conn.shutdown().await;
            Ok(())
        }
        (false, _) => {
            let (code, msg) = failure(exit.filter(|&c| c != 0), &stderr);
            reply_error(&mut conn, code, &msg).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_parameter_is_absolute_and_has_no_dot_dot() {
        let q = |v: &str| vec![("path".to_string(), v.to_string())];
        assert_eq!(path_param(&q("/tmp/x")), Ok("/tmp/x"));
        assert!(path_param(&q("tmp/x")).unwrap_err().contains("absolute"));
        assert!(path_param(&q("/tmp/../etc")).unwrap_err().contains("`..`"));
        assert!(path_param(&[]).unwrap_err().contains("?path="));
        assert_eq!(failure(Some(44), b"/x: no such directory\n").0, 404);
        assert_eq!(failure(Some(2), b"tar: bad\n"), (400, "tar: bad".into()));
        assert_eq!(failure(None, b"").0, 500);
    }
}
