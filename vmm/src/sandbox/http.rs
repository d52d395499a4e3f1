//! The server side of the API's HTTP/1.1 subset (api.rs has the wire format), shared by a
//! sandbox's supervisor and `amvm serve`: read a request's head and its `Content-Length` body,
//! answer with JSON.

use super::api;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// An error to answer with: its status code and its message.
pub type Refusal = (u16, String);

/// The request's head and what came after it. `None`: the client left before a whole head;
/// `Some(Err)`: a head to refuse.
pub async fn read_head(
    conn: &mut UnixStream,
) -> Result<Option<Result<(api::Head, Vec<u8>), Refusal>>, String> {
    Ok(read_head_with_fds(conn)
        .await?
        .map(|r| r.map(|(head, rest, _fds)| (head, rest))))
}

/// [`read_head`], and the descriptors that came with the head's bytes (SCM_RIGHTS: `POST
/// /v1/snapshot`'s files; at most `scm::MAX_FDS`, close-on-exec).
pub async fn read_head_with_fds(
    conn: &mut UnixStream,
) -> Result<Option<Result<(api::Head, Vec<u8>, Vec<std::os::fd::OwnedFd>), Refusal>>, String> {
    let mut buf = Vec::with_capacity(4096);
    let mut fds = Vec::new();
    let end = loop {
        if let Some(end) = api::head_end(&buf) {
            break end;
        }
        if buf.len() > api::MAX_HEAD {
            return Ok(Some(Err((413, "the request head is too large".into()))));
        }
        let mut chunk = [0u8; 4096];
        let n = loop {
            conn.readable().await.map_err(|e| e.to_string())?;
            match conn.try_io(tokio::io::Interest::READABLE, || {
                crate::scm::recv(&*conn, &mut chunk)
            }) {
                Ok((n, more)) => {
                    fds.extend(more);
                    break n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.to_string()),
            }
        };
        if n == 0 {
            return Ok(None);
        }
        if fds.len() > crate::scm::MAX_FDS {
            return Ok(Some(Err((400, "too many descriptors".into()))));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let rest = buf.split_off(end);
    Ok(Some(
        api::parse_head(&buf)
            .map(|h| (h, rest, fds))
            .map_err(|e| (400, e)),
    ))
}

/// The body `head` announces (at most [`api::MAX_BODY`]), starting with `rest`, and whatever
/// came after it. `None`: the client left before the whole body.
pub async fn read_body(
    conn: &mut UnixStream,
    head: &api::Head,
    mut rest: Vec<u8>,
) -> Result<Option<Result<(Vec<u8>, Vec<u8>), Refusal>>, String> {
    let len = match head.content_length() {
        Ok(n) => n,
        Err(e) => return Ok(Some(Err((413, e)))),
    };
    while rest.len() < len {
        let mut chunk = vec![0u8; (len - rest.len()).min(64 * 1024)];
        let n = conn.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Ok(None);
        }
        rest.extend_from_slice(&chunk[..n]);
    }
    let leftover = rest.split_off(len);
    Ok(Some(Ok((rest, leftover))))
}

/// A JSON body (an empty one is `{}`).
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    serde_json::from_slice(body).map_err(|e| format!("the request body: {e}"))
}

/// Answer with `v` as JSON, then close.
pub async fn reply_json<T: serde::Serialize>(
    conn: &mut UnixStream,
    code: u16,
    v: &T,
) -> Result<(), String> {
    let body = serde_json::to_vec(v).map_err(|e| e.to_string())?;
    conn.write_all(&api::response(code, &body))
        .await
        .map_err(|e| e.to_string())?;
    let _ = conn.shutdown().await;
    Ok(())
}

/// Answer with `{"error": msg}`, then close.
pub async fn reply_error(conn: &mut UnixStream, code: u16, msg: &str) -> Result<(), String> {
    reply_json(conn, code, &api::ErrorBody { error: msg.into() }).await
}
