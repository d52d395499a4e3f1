//! The host side of the guest's egress streams. Every stream the guest opens to the egress port
//! becomes one connection to the unix socket the user named (`--egress SOCKET`), byte for byte;
//! this crate opens those connections, counts what each carried, and writes the audit log
//! (`--egress-log FILE`: one JSON line per stream). It knows unix sockets, never virtio.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("egress socket {0}: no such file (start the egress proxy first, or drop --egress)")]
    Missing(PathBuf),
    #[error("egress socket {0} is not a unix socket")]
    NotASocket(PathBuf),
    #[error("egress socket {0}: cannot connect: {1} (is the egress proxy listening?)")]
    Unreachable(PathBuf, io::Error),
    #[error("egress log {0}: {1}")]
    Log(PathBuf, io::Error),
}

/// Where egress streams go, and the record of them.
#[derive(Debug)]
pub struct Egress {
    socket: PathBuf,
    log: Option<(PathBuf, File)>,
    next_id: u64,
}

/// One stream's life, as the audit log records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRecord {
    pub id: u64,
    pub opened_ms: u128,
    pub closed_ms: u128,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// The first request line, when the stream starts as HTTP/1.x.
    pub http_request: Option<String>,
    pub error: Option<String>,
}

impl Egress {
    /// Check that `socket` is a unix socket that accepts connections, and open the log.
    pub fn new(socket: &Path, log: Option<&Path>) -> Result<Self, EgressError> {
        let meta =
            std::fs::metadata(socket).map_err(|_| EgressError::Missing(socket.to_owned()))?;
        if !meta.file_type().is_socket() {
            return Err(EgressError::NotASocket(socket.to_owned()));
        }
        UnixStream::connect(socket).map_err(|e| EgressError::Unreachable(socket.to_owned(), e))?;
        let log = match log {
            Some(p) => Some((
                p.to_owned(),
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| EgressError::Log(p.to_owned(), e))?,
            )),
            None => None,
        };
        Ok(Egress {
            socket: socket.to_owned(),
            log,
            next_id: 1,
        })
    }

    /// A new stream: a non-blocking connection to the egress socket, and its id.
    pub fn connect(&mut self) -> io::Result<(u64, UnixStream)> {
        let s = UnixStream::connect(&self.socket)?;
        s.set_nonblocking(true)?;
        let id = self.next_id;
        self.next_id += 1;
        Ok((id, s))
    }

    /// Record a finished stream in the audit log (if one was asked for).
    pub fn record(&mut self, rec: &StreamRecord) {
        tracing::debug!(
            "egress stream {}: {} bytes out, {} bytes in",
            rec.id,
            rec.bytes_out,
            rec.bytes_in
        );
        if let Some((path, f)) = &mut self.log {
            if let Err(e) = writeln!(f, "{}", rec.to_json()) {
                tracing::warn!("egress log {}: {e}", path.display());
            }
        }
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// Sniffs the start of a guest->host byte stream for an HTTP/1.x request line.
#[derive(Debug, Default)]
pub struct RequestLineSniffer {
    head: Vec<u8>,
    done: bool,
    line: Option<String>,
}

/// Longest request line we look for.
const MAX_REQUEST_LINE: usize = 8192;

impl RequestLineSniffer {
    pub fn feed(&mut self, data: &[u8]) {
        if self.done {
            return;
        }
        let room = MAX_REQUEST_LINE - self.head.len();
        self.head.extend_from_slice(&data[..data.len().min(room)]);
        if let Some(end) = self.head.windows(2).position(|w| w == b"\r\n") {
            self.done = true;
            self.line = parse_request_line(&self.head[..end]);
        } else if self.head.len() >= MAX_REQUEST_LINE {
            self.done = true;
        }
    }

    pub fn request_line(&self) -> Option<&str> {
        self.line.as_deref()
    }
}

/// `METHOD SP TARGET SP HTTP/1.x`, tokens of visible ASCII.
fn parse_request_line(line: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(line).ok()?;
    let mut parts = s.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic());
    if parts.next().is_some()
        || !token(method)
        || !token(target)
        || !method.bytes().all(|b| b.is_ascii_uppercase())
    {
        return None;
    }
    matches!(version, "HTTP/1.0" | "HTTP/1.1").then(|| s.to_string())
}

impl StreamRecord {
    /// One JSON object on one line.
    pub fn to_json(&self) -> String {
        let mut out = format!(
            "{{\"stream\":{},\"opened_ms\":{},\"closed_ms\":{},\"bytes_out\":{},\"bytes_in\":{}",
            self.id, self.opened_ms, self.closed_ms, self.bytes_out, self.bytes_in
        );
        if let Some(r) = &self.http_request {
            out.push_str(",\"http_request\":");
            json_string(r, &mut out);
        }
        if let Some(e) = &self.error {
            out.push_str(",\"error\":");
            json_string(e, &mut out);
        }
        out.push('}');
        out
    }
}

fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn missing_and_wrong_sockets_are_refused_with_the_path() {
        let e = Egress::new(Path::new("/nonexistent/egress.sock"), None).unwrap_err();
        assert!(
            matches!(e, EgressError::Missing(_))
                && e.to_string().contains("/nonexistent/egress.sock")
        );
        let e = Egress::new(Path::new("/proc/self/status"), None).unwrap_err();
        assert!(matches!(e, EgressError::NotASocket(_)));
        let dir = std::env::temp_dir().join(format!("amvm-egress-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dead.sock");
        drop(UnixListener::bind(&path).unwrap()); // a socket file nobody listens on
        let e = Egress::new(&path, None).unwrap_err();
        assert!(matches!(e, EgressError::Unreachable(..)), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn connects_and_logs_json_lines() {
        let dir = std::env::temp_dir().join(format!("amvm-egress-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.sock");
        let _l = UnixListener::bind(&path).unwrap();
        let log = dir.join("log.jsonl");
        let mut e = Egress::new(&path, Some(&log)).unwrap();
        let (id, _s) = e.connect().unwrap();
        assert_eq!(id, 1);
        e.record(&StreamRecord {
            id,
            opened_ms: 1,
            closed_ms: 2,
            bytes_out: 3,
            bytes_in: 4,
            http_request: Some("GET /\"x\" HTTP/1.1".into()),
            error: None,
        });
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(text, "{\"stream\":1,\"opened_ms\":1,\"closed_ms\":2,\"bytes_out\":3,\"bytes_in\":4,\"http_request\":\"GET /\\\"x\\\" HTTP/1.1\"}\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn request_lines_are_recognised_across_splits() {
        let mut s = RequestLineSniffer::default();
        for b in b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n" {
            s.feed(std::slice::from_ref(b));
        }
        assert_eq!(s.request_line(), Some("POST /v1/messages HTTP/1.1"));
        for not_http in [
            &b"\x16\x03\x01 TLS hello\r\n"[..],
            b"GET / HTTP/2\r\n",
            b"get / HTTP/1.1\r\n",
            b"GET  / HTTP/1.1\r\n",
        ] {
            let mut s = RequestLineSniffer::default();
            s.feed(not_http);
            assert_eq!(
                s.request_line(),
                None,
                "{:?}",
                String::from_utf8_lossy(not_http)
            );
        }
    }
}
