//! The API's wire types and its small HTTP/1.1 subset (docs/api.md): one request per
//! connection (`Connection: close`), bodies by `Content-Length` only, JSON both ways. `POST
//! /v1/exec` with `Upgrade: amvm-exec/1` answers `101 Switching Protocols`, after which the
//! connection carries the exec's frames (guest_init::protocol: Stdout, Stderr and Exit from the
//! sandbox; Stdin, StdinEnd and Signal to it).

use serde::{Deserialize, Serialize};

/// The upgrade token of an exec stream.
pub const EXEC_UPGRADE: &str = "amvm-exec/1";
/// Largest request or response head.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request or response body.
pub const MAX_BODY: usize = 4 << 20;

/// One argument of a command: a JSON string, or `{"hex": "..."}` for bytes that are not UTF-8
/// (a file name from a Linux file system need not be).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Arg {
    Text(String),
    Hex { hex: String },
}

impl Arg {
    /// `b` as a string where it is UTF-8, else as hex.
    pub fn from_bytes(b: &[u8]) -> Arg {
        match std::str::from_utf8(b) {
            Ok(s) => Arg::Text(s.to_string()),
            Err(_) => Arg::Hex {
                hex: b.iter().map(|x| format!("{x:02x}")).collect(),
            },
        }
    }

    /// Its bytes; an error for hex that is not.
    pub fn bytes(&self) -> Result<Vec<u8>, String> {
        match self {
            Arg::Text(s) => Ok(s.as_bytes().to_vec()),
            Arg::Hex { hex } => {
                let bad = || format!("{{\"hex\": {hex:?}}}: not pairs of hex digits");
                if hex.len() % 2 != 0 || !hex.is_ascii() {
                    return Err(bad());
                }
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|_| bad()))
                    .collect()
            }
        }
    }
}

impl From<&str> for Arg {
    fn from(s: &str) -> Arg {
        Arg::Text(s.to_string())
    }
}

impl From<String> for Arg {
    fn from(s: String) -> Arg {
        Arg::Text(s)
    }
}

/// `POST /v1/exec`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecRequest {
    /// The command and its arguments.
    pub argv: Vec<Arg>,
    /// `KEY=VAL`, on top of the sandbox's environment.
    #[serde(default)]
    pub env: Vec<String>,
    /// Default: the sandbox's working directory.
    #[serde(default)]
    pub workdir: Option<String>,
    /// `UID[:GID]`; default: the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
    /// The stream carries the command's stdin (else it reads /dev/null).
    #[serde(default)]
    pub stdin: bool,
    /// A pseudo-terminal of this size for the command (its output then all comes as stdout
    /// frames); `TERM` defaults to `xterm`.
    #[serde(default)]
    pub tty: Option<TtySize>,
    /// `env` is the command's whole environment, not added to the sandbox's and amvm's
    /// defaults (`PATH`, `HOME`, ...).
    #[serde(default)]
    pub clear_env: bool,
    /// The capabilities a command run as uid 0 keeps, bit N for capability N (default: all;
    /// a command of another uid has none).
    #[serde(default)]
    pub capabilities: Option<u64>,
    /// Supplementary groups (default: none).
    #[serde(default)]
    pub groups: Vec<u32>,
    /// Resource limits (default: the sandbox's).
    #[serde(default)]
    pub rlimits: Vec<Rlimit>,
    /// A directory of the guest (absolute) to run the command chrooted into, with /proc, /sys
    /// and /dev mounted inside it on first use: a root file system on a share. Default: the
    /// sandbox's root.
    #[serde(default)]
    pub root: Option<String>,
}

/// A resource limit, in OCI's form: `{"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 4096}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Rlimit {
    #[serde(rename = "type")]
    pub kind: String,
    pub soft: u64,
    pub hard: u64,
}

/// A terminal's window.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct TtySize {
    pub rows: u16,
    pub cols: u16,
}

/// `POST /v1/stop`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StopRequest {
    /// Seconds between SIGTERM and SIGKILL.
    #[serde(default = "default_grace")]
    pub grace_seconds: u32,
}

fn default_grace() -> u32 {
    10
}

/// `POST /v1/snapshot` (its two files come with the request: SCM_RIGHTS).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SnapshotRequest {
    /// End the sandbox once the snapshot is written.
    #[serde(default)]
    pub stop: bool,
}

/// Its answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotAnswer {
    /// Bytes of the state file, of guest RAM, and of guest RAM actually written (the rest are
    /// holes).
    pub state_bytes: u64,
    pub memory_bytes: u64,
    pub memory_written: u64,
    /// Every exec id the guest has seen is below this: a restore's execs start here (their ids
    /// name cgroups and streams in the guest, where the snapshot's own execs may still run).
    #[serde(default)]
    pub next_exec_id: u64,
    /// The sandbox after: running, paused (as it was), or stopped (`stop`).
    pub sandbox: super::Info,
}

/// Every error body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: String,
}

/// A parsed request or response head.
#[derive(Debug, PartialEq)]
pub struct Head {
    /// Request: method, path. Response: "HTTP/1.1", the status code.
    pub first: (String, String),
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body's length: `Content-Length`, 0 without it; an error past [`MAX_BODY`].
    pub fn content_length(&self) -> Result<usize, String> {
        match self.declared_length()? {
            n if n <= MAX_BODY as u64 => Ok(n as usize),
            n => Err(format!("a body of {n} bytes (at most {MAX_BODY})")),
        }
    }

    /// `Content-Length` whatever its size (a body the server streams), 0 without it; a
    /// chunked body is refused (the server reads none).
    pub fn declared_length(&self) -> Result<u64, String> {
        if self.header("transfer-encoding").is_some() {
            return Err("a chunked request body: send Content-Length".into());
        }
        match self.header("content-length") {
            None => Ok(0),
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("Content-Length {v:?}")),
        }
    }
}

/// A request's query: its `key=value` pairs, decoded, in order.
pub type Query = Vec<(String, String)>;

/// A request target split into its path and its query's `key=value` pairs, percent-decoded
/// (`+` is a space); an error for a bad escape or a value that is not UTF-8.
pub fn split_target(target: &str) -> Result<(&str, Query), String> {
    let Some((path, query)) = target.split_once('?') else {
        return Ok((target, Vec::new()));
    };
    let decode = |s: &str| -> Result<String, String> {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'%' => {
                    let hex = b
                        .get(i + 1..i + 3)
                        .and_then(|h| std::str::from_utf8(h).ok())
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .ok_or_else(|| format!("a bad %-escape in the query {query:?}"))?;
                    out.push(hex);
                    i += 3;
                }
                b'+' => {
                    out.push(b' ');
                    i += 1;
                }
                c => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        String::from_utf8(out).map_err(|_| format!("the query {query:?} is not UTF-8"))
    };
    let pairs = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Ok((decode(k)?, decode(v)?))
        })
        .collect::<Result<_, String>>()?;
    Ok((path, pairs))
}

/// A response head whose body follows in chunks (`Transfer-Encoding: chunked`): a body whose
/// length is not known up front, and whose truncation the client can tell (no last chunk).
pub fn chunked_head(code: u16, content_type: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        reason(code)
    )
    .into_bytes()
}

/// One chunk of a chunked body (`data` not empty: the empty chunk ends the body, [`LAST_CHUNK`]).
pub fn chunk(data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Where a head ends in `buf` (the index just past its blank line), if it is all there.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Parse a head (request or response line, then headers), without its blank line.
pub fn parse_head(raw: &[u8]) -> Result<Head, String> {
    let text = std::str::from_utf8(raw).map_err(|_| "a head that is not UTF-8".to_string())?;
    let mut lines = text.split("\r\n").filter(|l| !l.is_empty());
    let first = lines.next().ok_or("an empty head")?;
    let mut parts = first.splitn(3, ' ');
    let (a, b) = match (parts.next(), parts.next()) {
        (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => (a.to_string(), b.to_string()),
        _ => return Err(format!("a bad first line {first:?}")),
    };
    let mut headers = Vec::new();
    for l in lines {
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| format!("a bad header line {l:?}"))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok(Head {
        first: (a, b),
        headers,
    })
}

/// The reason phrase of the status codes the API uses.
pub fn reason(code: u16) -> &'static str {
    match code {
        101 => "Switching Protocols",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        _ => "Internal Server Error",
    }
}

/// A whole response with a JSON body.
pub fn response(code: u16, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason(code),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_split_into_path_and_decoded_query() {
        assert_eq!(split_target("/v1/archive"), Ok(("/v1/archive", vec![])));
        assert_eq!(
            split_target("/v1/archive?path=%2Ftmp%2Fa%20b&x=1+2&flag"),
            Ok((
                "/v1/archive",
                vec![
                    ("path".into(), "/tmp/a b".into()),
                    ("x".into(), "1 2".into()),
                    ("flag".into(), String::new())
                ]
            ))
        );
        assert_eq!(
            split_target("/a?p=%C3%A9"),
            Ok(("/a", vec![("p".into(), "é".into())]))
        );
        for bad in ["/a?p=%", "/a?p=%2", "/a?p=%zz", "/a?p=%ff"] {
            assert!(split_target(bad).is_err(), "{bad}");
        }
        let mut out = Vec::new();
        chunk(b"hello, chunks", &mut out);
        assert_eq!(out, b"d\r\nhello, chunks\r\n");
        let h = parse_head(b"PUT /v1/archive HTTP/1.1\r\nContent-Length: 99999999999\r\n").unwrap();
        assert_eq!(h.declared_length(), Ok(99_999_999_999));
        assert!(h.content_length().is_err());
        let h = parse_head(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n").unwrap();
        assert!(h
            .declared_length()
            .unwrap_err()
            .contains("send Content-Length"));
    }

    #[test]
    fn heads_parse_and_bad_ones_are_refused() {
        let raw = b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nUpgrade: amvm-exec/1\r\n\r\n{}";
        let end = head_end(raw).unwrap();
        let h = parse_head(&raw[..end]).unwrap();
        assert_eq!(h.first, ("POST".into(), "/v1/exec".into()));
        assert_eq!(h.header("upgrade"), Some(EXEC_UPGRADE));
        assert_eq!(h.content_length(), Ok(12));
        assert_eq!(&raw[end..], b"{}");
        assert!(head_end(b"GET / HTTP/1.1\r\n").is_none());
        assert!(parse_head(b"").is_err());
        assert!(parse_head(b"GET\r\n").is_err());
        assert!(parse_head(b"GET / HTTP/1.1\r\nno colon\r\n").is_err());
        assert!(parse_head(b"GET / HTTP/1.1\r\n\xff: x\r\n").is_err());
        let big = parse_head(b"GET / HTTP/1.1\r\nContent-Length: 99999999999\r\n").unwrap();
        assert!(big.content_length().is_err());
        let r = response(404, b"{\"error\":\"x\"}");
        let end = head_end(&r).unwrap();
        let h = parse_head(&r[..end]).unwrap();
        assert_eq!(h.first, ("HTTP/1.1".into(), "404".into()));
        assert_eq!(h.content_length(), Ok(13));
    }

    #[test]
    fn arguments_are_strings_or_hex_bytes() {
        for b in [&b"plain"[..], b"", b"\xff\xfe/x", "é".as_bytes()] {
            let a = Arg::from_bytes(b);
            assert_eq!(a.bytes().unwrap(), b);
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(serde_json::from_str::<Arg>(&json).unwrap(), a, "{json}");
        }
        assert_eq!(
            serde_json::to_string(&Arg::from_bytes(b"\xffa")).unwrap(),
            r#"{"hex":"ff61"}"#
        );
        assert_eq!(
            serde_json::to_string(&Arg::from_bytes(b"a b")).unwrap(),
            r#""a b""#
        );
        for bad in ["f", "zz", "fff", "ééé"] {
            let a: Arg = serde_json::from_str(&format!(r#"{{"hex": "{bad}"}}"#)).unwrap();
            assert!(a.bytes().is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<Arg>("3").is_err());
    }

    #[test]
    fn an_exec_request_takes_defaults() {
        let r: ExecRequest = serde_json::from_str(r#"{"argv":["true"]}"#).unwrap();
        assert_eq!(
            r,
            ExecRequest {
                argv: vec!["true".into()],
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
            }
        );
        let s: StopRequest = serde_json::from_str("{}").unwrap();
        assert_eq!(s.grace_seconds, 10);
    }
}
