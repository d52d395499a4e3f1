//! The supervisor's channel to its VMM: a unix stream socket pair made before the VMM is
//! forked. The supervisor asks, the VMM's main thread answers, one request at a time.
//!
//! Request: one byte ([`Request`]). Reply: `+`, or `-` then a little-endian u16 length and
//! that many bytes of UTF-8 saying why not. Nothing on this channel comes from the guest.

use std::io::{self, Read, Write};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Every vCPU out of KVM_RUN and parked.
    Pause,
    /// The vCPUs run again.
    Resume,
}

impl Request {
    pub fn byte(self) -> u8 {
        match self {
            Request::Pause => b'P',
            Request::Resume => b'R',
        }
    }

    pub fn from_byte(b: u8) -> Option<Request> {
        match b {
            b'P' => Some(Request::Pause),
            b'R' => Some(Request::Resume),
            _ => None,
        }
    }
}

/// A reply's bytes.
pub fn encode_reply(r: &Result<(), String>) -> Vec<u8> {
    match r {
        Ok(()) => vec![b'+'],
        Err(why) => {
            let why = &why.as_bytes()[..why.len().min(u16::MAX as usize)];
            let mut v = Vec::with_capacity(3 + why.len());
            v.push(b'-');
            v.extend_from_slice(&(why.len() as u16).to_le_bytes());
            v.extend_from_slice(why);
            v
        }
    }
}

/// The VMM's side: read one request and answer it with `handle`. `false` once the supervisor
/// is gone (end of stream).
pub fn serve_one<S: Read + Write>(
    s: &mut S,
    handle: impl FnOnce(Request) -> Result<(), String>,
) -> io::Result<bool> {
    let mut b = [0u8; 1];
    if s.read(&mut b)? == 0 {
        return Ok(false);
    }
    let reply = match Request::from_byte(b[0]) {
        Some(req) => handle(req),
        None => Err(format!("unknown request {:#04x}", b[0])),
    };
    s.write_all(&encode_reply(&reply))?;
    Ok(true)
}

/// The supervisor's side: ask, and wait for the answer.
pub async fn ask(s: &mut tokio::net::UnixStream, req: Request) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let lost = |e: io::Error| format!("the VMM's control channel: {e}");
    s.write_all(&[req.byte()]).await.map_err(lost)?;
    match s.read_u8().await.map_err(lost)? {
        b'+' => Ok(()),
        b'-' => {
            let len = s.read_u16_le().await.map_err(lost)?;
            let mut why = vec![0u8; len.into()];
            s.read_exact(&mut why).await.map_err(lost)?;
            Err(String::from_utf8_lossy(&why).into_owned())
        }
        other => Err(format!("the VMM answered {other:#04x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_and_its_answers_round_trip() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut a = tokio::net::UnixStream::from_std(a).unwrap();
        let vmm = std::thread::spawn(move || {
            let mut b = b;
            let mut seen = Vec::new();
            assert!(serve_one(&mut b, |r| {
                seen.push(r);
                Ok(())
            })
            .unwrap());
            assert!(serve_one(&mut b, |r| {
                seen.push(r);
                Err("vCPU 1 is stuck".into())
            })
            .unwrap());
            // An unknown byte is answered, not taken for the end.
            assert!(serve_one(&mut b, |_| unreachable!()).unwrap());
            // The supervisor gone: the end.
            assert!(!serve_one(&mut b, |_| unreachable!()).unwrap());
            seen
        });
        assert_eq!(ask(&mut a, Request::Pause).await, Ok(()));
        assert_eq!(
            ask(&mut a, Request::Resume).await,
            Err("vCPU 1 is stuck".into())
        );
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            a.write_all(b"x").await.unwrap();
            let mut reply = [0u8; 3 + 20];
            a.read_exact(&mut reply).await.unwrap();
            assert_eq!(&reply, b"-\x14\0unknown request 0x78");
        }
        drop(a);
        assert_eq!(vmm.join().unwrap(), vec![Request::Pause, Request::Resume]);
    }
}
