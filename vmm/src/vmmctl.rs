//! The supervisor's channel to its VMM: a unix stream socket pair made before the VMM is
//! forked. The supervisor asks, the VMM's main thread answers, one request at a time.
//!
//! Request: one byte ([`Request`]); a snapshot's comes with two descriptors (SCM_RIGHTS: the
//! state file, then the memory file). Reply: `+` (done) or `-` (why not), then a little-endian
//! u16 length and that many bytes of UTF-8. Nothing on this channel comes from the guest.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Every vCPU out of KVM_RUN and parked.
    Pause,
    /// The vCPUs run again.
    Resume,
    /// The machine's state and guest memory written to the two files that come with it.
    Snapshot,
}

impl Request {
    pub fn byte(self) -> u8 {
        match self {
            Request::Pause => b'P',
            Request::Resume => b'R',
            Request::Snapshot => b'S',
        }
    }

    pub fn from_byte(b: u8) -> Option<Request> {
        match b {
            b'P' => Some(Request::Pause),
            b'R' => Some(Request::Resume),
            b'S' => Some(Request::Snapshot),
            _ => None,
        }
    }
}

/// A reply's bytes.
pub fn encode_reply(r: &Result<String, String>) -> Vec<u8> {
    let (mark, text) = match r {
        Ok(t) => (b'+', t),
        Err(t) => (b'-', t),
    };
    let text = &text.as_bytes()[..text.len().min(u16::MAX as usize)];
    let mut v = Vec::with_capacity(3 + text.len());
    v.push(mark);
    v.extend_from_slice(&(text.len() as u16).to_le_bytes());
    v.extend_from_slice(text);
    v
}

/// The VMM's side: read one request (with the descriptors that came with it) and answer it
/// with `handle`. `false` once the supervisor is gone (end of stream).
pub fn serve_one<S: AsRawFd + Write>(
    s: &mut S,
    handle: impl FnOnce(Request, Vec<OwnedFd>) -> Result<String, String>,
) -> io::Result<bool> {
    let mut b = [0u8; 1];
    let (n, fds) = crate::scm::recv(s, &mut b)?;
    if n == 0 {
        return Ok(false);
    }
    let reply = match Request::from_byte(b[0]) {
        Some(req) => handle(req, fds),
        None => Err(format!("unknown request {:#04x}", b[0])),
    };
    s.write_all(&encode_reply(&reply))?;
    Ok(true)
}

/// The supervisor's side: ask (with `fds`, for a snapshot), and wait for the answer's text.
pub async fn ask(
    s: &mut tokio::net::UnixStream,
    req: Request,
    fds: &[std::os::fd::RawFd],
) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let lost = |e: io::Error| format!("the VMM's control channel: {e}");
    if fds.is_empty() {
        s.write_all(&[req.byte()]).await.map_err(lost)?;
    } else {
        loop {
            s.writable().await.map_err(lost)?;
            let fd = s.as_raw_fd();
            match s.try_io(tokio::io::Interest::WRITABLE, || {
                crate::scm::send_with_fds(fd, &[req.byte()], fds)
            }) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(lost(e)),
            }
        }
    }
    let mark = s.read_u8().await.map_err(lost)?;
    let len = s.read_u16_le().await.map_err(lost)?;
    let mut text = vec![0u8; len.into()];
    s.read_exact(&mut text).await.map_err(lost)?;
    let text = String::from_utf8_lossy(&text).into_owned();
    match mark {
        b'+' => Ok(text),
        b'-' => Err(text),
        other => Err(format!("the VMM answered {other:#04x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_and_its_answers_round_trip() {
        use std::os::fd::AsRawFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut a = tokio::net::UnixStream::from_std(a).unwrap();
        let vmm = std::thread::spawn(move || {
            let mut b = b;
            let mut seen = Vec::new();
            assert!(serve_one(&mut b, |r, fds| {
                seen.push((r, fds.len()));
                Ok(String::new())
            })
            .unwrap());
            assert!(serve_one(&mut b, |r, fds| {
                seen.push((r, fds.len()));
                Err("vCPU 1 is stuck".into())
            })
            .unwrap());
            assert!(serve_one(&mut b, |r, fds| {
                seen.push((r, fds.len()));
                Ok("{\"memory_bytes\": 4096}".into())
            })
            .unwrap());
            // An unknown byte is answered, not taken for the end.
            assert!(serve_one(&mut b, |_, _| unreachable!()).unwrap());
            // The supervisor gone: the end.
            assert!(!serve_one(&mut b, |_, _| unreachable!()).unwrap());
            seen
        });
        assert_eq!(ask(&mut a, Request::Pause, &[]).await, Ok(String::new()));
        assert_eq!(
            ask(&mut a, Request::Resume, &[]).await,
            Err("vCPU 1 is stuck".into())
        );
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(
            ask(&mut a, Request::Snapshot, &[f.as_raw_fd(), f.as_raw_fd()]).await,
            Ok("{\"memory_bytes\": 4096}".into())
        );
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            a.write_all(b"x").await.unwrap();
            let mut reply = [0u8; 3 + 20];
            a.read_exact(&mut reply).await.unwrap();
            assert_eq!(&reply, b"-\x14\0unknown request 0x78");
        }
        drop(a);
        assert_eq!(
            vmm.join().unwrap(),
            vec![
                (Request::Pause, 0),
                (Request::Resume, 0),
                (Request::Snapshot, 2)
            ]
        );
    }
}
