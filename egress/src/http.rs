//! Finds the HTTP/1.x request lines in a guest->host byte stream, for the audit log: every
//! request of a keep-alive or pipelined stream, not only the first. It follows the framing that
//! decides where the next request starts (RFC 9112 §6: `Content-Length`, or
//! `Transfer-Encoding: chunked` with its trailers) and gives up for good — the stream is then
//! opaque, and still forwarded byte for byte — at the first thing it does not understand: TLS,
//! HTTP/2, a malformed head, a head over [`MAX_HEAD`], `CONNECT` or an `Upgrade`.
//!
//! It only watches: what it makes of the bytes never changes what is forwarded.

/// Longest request head (request line and headers) we look through.
pub const MAX_HEAD: usize = 64 * 1024;
/// Longest chunk-size or trailer line.
const MAX_LINE: usize = 4096;

#[derive(Debug)]
enum State {
    /// Collecting a request head up to its blank line.
    Head(Vec<u8>),
    /// Skipping `n` more bytes of a `Content-Length` body.
    Body(u64),
    /// Reading a chunk-size line.
    ChunkSize(Vec<u8>),
    /// Skipping `n` more bytes of chunk data, then its CRLF.
    ChunkData(u64),
    /// Expecting the CRLF after chunk data (`n` bytes of it still to come).
    ChunkEnd(u8),
    /// Reading trailer lines after the last chunk, up to a blank line.
    Trailers(Vec<u8>),
    /// Not (or no longer) HTTP/1.x we can follow.
    Opaque,
}

/// The sniffer for one stream.
#[derive(Debug)]
pub struct HttpSniffer {
    state: State,
}

impl Default for HttpSniffer {
    fn default() -> Self {
        HttpSniffer {
            state: State::Head(Vec::new()),
        }
    }
}

impl HttpSniffer {
    /// Feed the next bytes; `on_request` gets each request line completed by them.
    pub fn feed(&mut self, mut data: &[u8], mut on_request: impl FnMut(&str)) {
        while !data.is_empty() {
            match &mut self.state {
                State::Opaque => return,
                State::Head(buf) => {
                    // Copy up to the end of the head (or all of `data`).
                    let start = buf.len().saturating_sub(3);
                    let take = data.len().min(MAX_HEAD - buf.len());
                    buf.extend_from_slice(&data[..take]);
                    match find(&buf[start..], b"\r\n\r\n") {
                        Some(i) => {
                            let end = start + i + 4;
                            let consumed = take - (buf.len() - end);
                            let head = std::mem::take(buf);
                            data = &data[consumed..];
                            self.state = match parse_head(&head[..end]) {
                                Some((line, next)) => {
                                    on_request(&line);
                                    next
                                }
                                None => State::Opaque,
                            };
                        }
                        None if buf.len() >= MAX_HEAD => self.state = State::Opaque,
                        None => {
                            // A head must start with a request line; stop early on binary.
                            if !plausible_start(buf) {
                                self.state = State::Opaque;
                            }
                            return;
                        }
                    }
                }
                State::Body(left) | State::ChunkData(left) => {
                    let n = (*left).min(data.len() as u64);
                    *left -= n;
                    data = &data[n as usize..];
                    if *left == 0 {
                        self.state = match self.state {
                            State::ChunkData(_) => State::ChunkEnd(2),
                            _ => State::Head(Vec::new()),
                        };
                    }
                }
                State::ChunkEnd(left) => {
                    let want = &b"\r\n"[2 - *left as usize..];
                    if data[0] != want[0] {
                        self.state = State::Opaque;
                        continue;
                    }
                    data = &data[1..];
                    *left -= 1;
                    if *left == 0 {
                        self.state = State::ChunkSize(Vec::new());
                    }
                }
                State::ChunkSize(line) | State::Trailers(line) => {
                    let Some((text, rest)) = take_line(line, data) else {
                        if line.len() > MAX_LINE {
                            self.state = State::Opaque;
                        }
                        return;
                    };
                    data = rest;
                    self.state = match &self.state {
                        State::ChunkSize(_) => match parse_chunk_size(&text) {
                            Some(0) => State::Trailers(Vec::new()),
                            Some(n) => State::ChunkData(n),
                            None => State::Opaque,
                        },
                        _ if text.is_empty() => State::Head(Vec::new()),
                        _ => State::Trailers(Vec::new()),
                    };
                }
            }
        }
    }
}

/// Append `data` to `line` up to and including a CRLF; on a complete line return it (without
/// the CRLF) and the rest of `data`. Without one, everything is kept in `line`.
fn take_line<'a>(line: &mut Vec<u8>, data: &'a [u8]) -> Option<(Vec<u8>, &'a [u8])> {
    match data.iter().position(|&b| b == b'\n') {
        Some(i) => {
            line.extend_from_slice(&data[..=i]);
            let mut text = std::mem::take(line);
            text.pop();
            if text.last() == Some(&b'\r') {
                text.pop();
            }
            Some((text, &data[i + 1..]))
        }
        None => {
            line.extend_from_slice(&data[..data.len().min(MAX_LINE + 1)]);
            None
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The first bytes of a head: an upper-case method, then a space.
fn plausible_start(buf: &[u8]) -> bool {
    let method_len = buf.iter().take_while(|b| b.is_ascii_uppercase()).count();
    match buf.get(method_len) {
        None => method_len < 32,
        Some(b' ') => (1..32).contains(&method_len),
        Some(_) => false,
    }
}

/// Parse a complete head (ending in CRLF CRLF): its request line, and what follows it.
fn parse_head(head: &[u8]) -> Option<(String, State)> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let line = parse_request_line(lines.next()?)?;
    let (mut length, mut chunked, mut upgrade) = (None::<u64>, false, false);
    for h in lines.filter(|l| !l.is_empty()) {
        let (name, value) = h.split_once(':')?;
        let value = value.trim();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => {
                let n: u64 = value.parse().ok()?;
                if length.is_some_and(|l| l != n) {
                    return None; // conflicting lengths: a smuggling attempt or a broken client
                }
                length = Some(n);
            }
            "transfer-encoding" => {
                chunked = value
                    .rsplit(',')
                    .next()
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("chunked"));
                if !chunked {
                    return None;
                }
            }
            "upgrade" => upgrade = true,
            _ => {}
        }
    }
    let next = if line.starts_with("CONNECT ") || upgrade || (chunked && length.is_some()) {
        State::Opaque
    } else if chunked {
        State::ChunkSize(Vec::new())
    } else {
        match length {
            Some(n) if n > 0 => State::Body(n),
            _ => State::Head(Vec::new()),
        }
    };
    Some((line, next))
}

/// `METHOD SP TARGET SP HTTP/1.x`, tokens of visible ASCII.
fn parse_request_line(s: &str) -> Option<String> {
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

/// A chunk-size line: hex digits, optionally `;extensions`.
fn parse_chunk_size(line: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(line).ok()?;
    let hex = s.split(';').next()?.trim();
    if hex.is_empty() || hex.len() > 15 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(stream: &[u8], step: usize) -> Vec<String> {
        let mut s = HttpSniffer::default();
        let mut got = Vec::new();
        for piece in stream.chunks(step.max(1)) {
            s.feed(piece, |l| got.push(l.to_string()));
        }
        got
    }

    #[test]
    fn every_request_of_a_keep_alive_stream_at_any_split() {
        let mut stream = Vec::new();
        stream.extend_from_slice(
            b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nhello\r\n\r\nGET",
        );
        stream.extend_from_slice(b" /a HTTP/1.1\r\nHost: x\r\n\r\n");
        stream.extend_from_slice(
            b"PUT /chunked HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        );
        stream.extend_from_slice(
            b"5;ext=1\r\nGET /\r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: 1\r\n\r\n",
        );
        stream.extend_from_slice(b"DELETE /b HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
        let want = vec![
            "POST /v1/messages HTTP/1.1",
            "GET /a HTTP/1.1",
            "PUT /chunked HTTP/1.1",
            "DELETE /b HTTP/1.0",
        ];
        for step in [1, 2, 3, 7, 64, stream.len()] {
            assert_eq!(lines(&stream, step), want, "split every {step} bytes");
        }
    }

    #[test]
    fn opaque_streams_log_nothing_and_stop_looking() {
        for not_http in [
            &b"\x16\x03\x01\x02\x00 TLS hello\r\n\r\n"[..],
            b"GET / HTTP/2\r\n\r\n",
            b"get / HTTP/1.1\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            assert!(
                lines(not_http, 1).is_empty(),
                "{:?}",
                String::from_utf8_lossy(not_http)
            );
        }
        // After CONNECT, an Upgrade, or conflicting framing, the rest is opaque.
        for first in [
            &b"CONNECT api:443 HTTP/1.1\r\n\r\n"[..],
            b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
        ] {
            let mut s = first.to_vec();
            s.extend_from_slice(b"GET /hidden HTTP/1.1\r\n\r\n");
            assert_eq!(lines(&s, 5).len(), 1);
        }
        let smuggle = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcGET /x HTTP/1.1\r\n\r\n";
        assert!(lines(smuggle, 1).is_empty());
        let both = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /x HTTP/1.1\r\n\r\n";
        assert_eq!(lines(both, 1), vec!["POST / HTTP/1.1"]);
    }

    #[test]
    fn a_body_that_looks_like_a_request_is_not_one() {
        let s = b"POST /up HTTP/1.1\r\nContent-Length: 24\r\n\r\nGET /fake HTTP/1.1\r\n\r\n\r\nGET /real HTTP/1.1\r\n\r\n";
        assert_eq!(lines(s, 1), vec!["POST /up HTTP/1.1", "GET /real HTTP/1.1"]);
    }

    #[test]
    fn huge_heads_and_lines_are_bounded() {
        let mut s = b"GET /".to_vec();
        s.extend(std::iter::repeat_n(b'a', MAX_HEAD * 2));
        assert!(lines(&s, 4096).is_empty());
        let mut c = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        c.extend(std::iter::repeat_n(b'1', MAX_LINE * 4));
        c.extend_from_slice(b"\r\n");
        assert_eq!(lines(&c, 100), vec!["POST / HTTP/1.1"]);
    }

    proptest::proptest! {
        /// Whatever the guest sends, in whatever pieces: no panic, and the same request lines
        /// as when it arrives in one piece.
        #[test]
        fn any_bytes_any_split_same_lines(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::collection::vec(proptest::num::u8::ANY, 0..64),
                    proptest::sample::select(vec![
                        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
                        b"POST /p HTTP/1.1\r\nContent-Length: 3\r\n\r\n".to_vec(),
                        b"PUT /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
                        b"3\r\nabc\r\n".to_vec(),
                        b"0\r\n\r\n".to_vec(),
                        b"\r\n".to_vec(),
                    ]),
                ],
                0..12,
            ),
            step in 1usize..40,
        ) {
            let stream: Vec<u8> = parts.concat();
            proptest::prop_assert_eq!(lines(&stream, step), lines(&stream, stream.len()));
        }
    }
}
