//! The host side of the guest's egress streams. Every stream the guest opens to the egress port
//! becomes one connection to the unix socket the user named (`--egress SOCKET`), byte for byte;
//! this crate opens those connections, counts what each carried, and writes the audit log
//! (`--egress-log FILE`: one JSON line per HTTP/1.x request as it is sent, and one per stream
//! when it closes). It knows unix sockets, never virtio.

pub mod gateway;
pub mod http;

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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
    log: Option<Log>,
    next_id: u64,
}

/// The audit log, shared by the streams (each writes its request lines as they happen).
#[derive(Debug, Clone)]
struct Log(Arc<Mutex<(PathBuf, File)>>);

impl Log {
    fn line(&self, json: &str) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (path, f) = &mut *g;
        if let Err(e) = writeln!(f, "{json}") {
            tracing::warn!("egress log {}: {e}", path.display());
        }
    }
}

/// One open egress stream's bookkeeping: its id, when it opened, and the HTTP requests seen in
/// what the guest sent.
#[derive(Debug)]
pub struct EgressStream {
    pub id: u64,
    pub opened_ms: u128,
    sniffer: http::HttpSniffer,
    requests: u64,
    log: Option<Log>,
}

impl EgressStream {
    /// Bytes the guest sent on this stream, as they are forwarded (for the request log).
    pub fn sent(&mut self, data: &[u8]) {
        let (id, log, requests) = (self.id, &self.log, &mut self.requests);
        self.sniffer.feed(data, |line| {
            *requests += 1;
            if let Some(log) = log {
                let mut json =
                    format!("{{\"stream\":{id},\"at_ms\":{},\"http_request\":", now_ms());
                json_string(line, &mut json);
                json.push('}');
                log.line(&json);
            }
        });
    }
}

/// One stream's life, as the audit log records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRecord {
    pub id: u64,
    pub opened_ms: u128,
    pub closed_ms: u128,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// How many HTTP/1.x requests the stream carried (each has its own log line).
    pub http_requests: u64,
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
            Some(p) => Some(Log(Arc::new(Mutex::new((
                p.to_owned(),
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| EgressError::Log(p.to_owned(), e))?,
            ))))),
            None => None,
        };
        Ok(Egress {
            socket: socket.to_owned(),
            log,
            next_id: 1,
        })
    }

    /// From now on reach the socket [`Egress::new`] checked through `path` (the same socket, as
    /// a process that moved into another root sees it).
    pub fn connect_through(&mut self, path: &Path) {
        self.socket = path.to_owned();
    }

    /// A new stream: a non-blocking connection to the egress socket, and its bookkeeping.
    pub fn connect(&mut self) -> io::Result<(EgressStream, UnixStream)> {
        let s = UnixStream::connect(&self.socket)?;
        s.set_nonblocking(true)?;
        let id = self.next_id;
        self.next_id += 1;
        let stream = EgressStream {
            id,
            opened_ms: now_ms(),
            sniffer: http::HttpSniffer::default(),
            requests: 0,
            log: self.log.clone(),
        };
        Ok((stream, s))
    }

    /// A stream ended: `counts` are (bytes the guest sent, bytes it received); `error` says why
    /// it was reset if it did not close cleanly. Logged, and returned.
    pub fn close(
        &mut self,
        stream: EgressStream,
        counts: (u64, u64),
        error: Option<String>,
    ) -> StreamRecord {
        let rec = StreamRecord {
            id: stream.id,
            opened_ms: stream.opened_ms,
            closed_ms: now_ms(),
            bytes_out: counts.0,
            bytes_in: counts.1,
            http_requests: stream.requests,
            error,
        };
        tracing::debug!(
            "egress stream {}: {} bytes out, {} bytes in",
            rec.id,
            rec.bytes_out,
            rec.bytes_in
        );
        if let Some(log) = &self.log {
            log.line(&rec.to_json());
        }
        rec
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

impl StreamRecord {
    /// One JSON object on one line.
    pub fn to_json(&self) -> String {
        let mut out = format!(
            "{{\"stream\":{},\"opened_ms\":{},\"closed_ms\":{},\"bytes_out\":{},\"bytes_in\":{}",
            self.id, self.opened_ms, self.closed_ms, self.bytes_out, self.bytes_in
        );
        if self.http_requests > 0 {
            out.push_str(&format!(",\"http_requests\":{}", self.http_requests));
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
        let (mut stream, _s) = e.connect().unwrap();
        assert_eq!(stream.id, 1);
        stream.sent(b"GET /\"x\" HTTP/1.1\r\nHost: h\r\n\r\nPOST /y HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi");
        let rec = e.close(stream, (3, 4), Some("reset".into()));
        assert_eq!((rec.bytes_out, rec.bytes_in, rec.http_requests), (3, 4, 2));
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("{\"stream\":1,\"at_ms\":"), "{text}");
        assert!(
            lines[0].ends_with(",\"http_request\":\"GET /\\\"x\\\" HTTP/1.1\"}"),
            "{text}"
        );
        assert!(
            lines[1].ends_with(",\"http_request\":\"POST /y HTTP/1.1\"}"),
            "{text}"
        );
        let opened = rec.opened_ms;
        let closed = rec.closed_ms;
        assert_eq!(
            lines[2],
            format!("{{\"stream\":1,\"opened_ms\":{opened},\"closed_ms\":{closed},\"bytes_out\":3,\"bytes_in\":4,\"http_requests\":2,\"error\":\"reset\"}}")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
