//! The guest-init <-> VMM protocol.
//!
//! Two pieces, both little-endian and length-prefixed:
//!
//! * **Run spec** (VMM -> guest): written by the VMM into the in-memory initramfs at [`SPEC_PATH`].
//!   Layout: magic [`SPEC_MAGIC`], `uid: u32`, `gid: u32`, `flags: u32` (bit 0: egress relay),
//!   `cwd: bytes`, `argv: list`, `env: list`,
//!   where `bytes` is `len: u32` followed by `len` bytes and `list` is `count: u32` followed by
//!   `count` `bytes`. Environment entries are `KEY=VALUE`.
//! * **Frames** (guest -> VMM) on the control channel, a vsock stream guest-init opens to
//!   [`CONTROL_PORT`] on the host:
//!   `kind: u8`, `len: u32`, then `len` payload bytes, `len <= MAX_FRAME_PAYLOAD`.
//!   Kinds: [`FrameKind::Stdout`], [`FrameKind::Stderr`] (workload output, in order) and
//!   [`FrameKind::Exit`] (payload: one byte, the exit status amvm should return).
//!
//! The VMM treats every byte from the guest as hostile: [`FrameParser`] rejects unknown kinds and
//! oversized frames instead of trusting them.

/// The vsock port (on the host, CID 2) where guest-init opens the control channel.
pub const CONTROL_PORT: u32 = 1024;
/// The vsock port each egress stream connects to.
pub const EGRESS_PORT: u32 = 1025;

/// Where the run spec sits in the initramfs.
pub const SPEC_PATH: &str = "/amvm/spec";
/// First bytes of an encoded run spec (the trailing digit is the version).
pub const SPEC_MAGIC: &[u8; 8] = b"AMVMSPC2";
/// Largest payload one frame may carry.
pub const MAX_FRAME_PAYLOAD: usize = 64 * 1024;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 5;
/// Upper bound on the number of argv/env entries a spec may hold.
const MAX_LIST_ITEMS: usize = 64 * 1024;

/// Errors of this module.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("run spec is truncated")]
    Truncated,
    #[error("run spec has a bad magic (guest-init and amvm are from different builds?)")]
    BadMagic,
    #[error("run spec list has {0} entries, more than allowed")]
    TooManyItems(usize),
    #[error("run spec has {0} trailing bytes")]
    TrailingBytes(usize),
    #[error("run spec has an empty argv")]
    EmptyArgv,
    #[error("frame of unknown kind {0:#04x}")]
    UnknownFrameKind(u8),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_PAYLOAD}-byte limit")]
    FrameTooLarge(usize),
    #[error("exit frame with a {0}-byte payload (want 1)")]
    BadExitFrame(usize),
}

/// What the workload is and how to run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSpec {
    pub argv: Vec<Vec<u8>>,
    /// `KEY=VALUE` entries, the workload's whole environment.
    pub env: Vec<Vec<u8>>,
    pub cwd: Vec<u8>,
    pub uid: u32,
    pub gid: u32,
    /// Run the egress relay (the host has an egress socket).
    pub egress: bool,
}

const FLAG_EGRESS: u32 = 1;

impl RunSpec {
    /// Serialize to the layout in the module docs.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(SPEC_MAGIC);
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        let flags = if self.egress { FLAG_EGRESS } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        put_bytes(&mut out, &self.cwd);
        for list in [&self.argv, &self.env] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for item in list {
                put_bytes(&mut out, item);
            }
        }
        out
    }

    /// Parse and validate an encoded spec.
    pub fn decode(buf: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        if r.take(SPEC_MAGIC.len())? != SPEC_MAGIC {
            return Err(ProtocolError::BadMagic);
        }
        let uid = r.u32()?;
        let gid = r.u32()?;
        let flags = r.u32()?;
        let cwd = r.bytes()?.to_vec();
        let argv = r.list()?;
        let env = r.list()?;
        if !r.buf.is_empty() {
            return Err(ProtocolError::TrailingBytes(r.buf.len()));
        }
        if argv.is_empty() {
            return Err(ProtocolError::EmptyArgv);
        }
        Ok(RunSpec {
            argv,
            env,
            cwd,
            uid,
            gid,
            egress: flags & FLAG_EGRESS != 0,
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.buf.len() < n {
            return Err(ProtocolError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, ProtocolError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn bytes(&mut self) -> Result<&'a [u8], ProtocolError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn list(&mut self) -> Result<Vec<Vec<u8>>, ProtocolError> {
        let n = self.u32()? as usize;
        if n > MAX_LIST_ITEMS {
            return Err(ProtocolError::TooManyItems(n));
        }
        (0..n).map(|_| self.bytes().map(<[u8]>::to_vec)).collect()
    }
}

/// Frame kinds on the guest -> VMM channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Stdout = 1,
    Stderr = 2,
    Exit = 3,
}

impl TryFrom<u8> for FrameKind {
    type Error = ProtocolError;
    fn try_from(b: u8) -> Result<Self, ProtocolError> {
        match b {
            1 => Ok(FrameKind::Stdout),
            2 => Ok(FrameKind::Stderr),
            3 => Ok(FrameKind::Exit),
            other => Err(ProtocolError::UnknownFrameKind(other)),
        }
    }
}

/// Append one frame (header and payload) to `out`. Panics only on a caller bug: a payload over
/// [`MAX_FRAME_PAYLOAD`] (use [`encode_chunks`] for arbitrary data).
pub fn encode_frame(kind: FrameKind, payload: &[u8], out: &mut Vec<u8>) {
    assert!(
        payload.len() <= MAX_FRAME_PAYLOAD,
        "frame payload too large"
    );
    out.push(kind as u8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Append `data` as as many frames of `kind` as it needs.
pub fn encode_chunks(kind: FrameKind, data: &[u8], out: &mut Vec<u8>) {
    for chunk in data.chunks(MAX_FRAME_PAYLOAD) {
        encode_frame(kind, chunk, out);
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(u8),
}

/// Incremental frame decoder: bytes go in as they arrive (one at a time from a UART, or in
/// bursts), whole frames come out. After an error it stays failed: the stream is desynchronized.
#[derive(Debug, Default)]
pub struct FrameParser {
    header: Vec<u8>,
    payload: Vec<u8>,
    want: Option<(FrameKind, usize)>,
    failed: Option<ProtocolError>,
}

impl FrameParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed `data`; call `on_frame` for each frame completed by it.
    pub fn feed(
        &mut self,
        mut data: &[u8],
        mut on_frame: impl FnMut(Frame),
    ) -> Result<(), ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        while !data.is_empty() {
            match self.want {
                None => {
                    let n = (FRAME_HEADER_LEN - self.header.len()).min(data.len());
                    self.header.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.header.len() == FRAME_HEADER_LEN {
                        let h = std::mem::take(&mut self.header);
                        let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
                        let parsed = FrameKind::try_from(h[0]).and_then(|k| {
                            if len > MAX_FRAME_PAYLOAD {
                                Err(ProtocolError::FrameTooLarge(len))
                            } else if k == FrameKind::Exit && len != 1 {
                                Err(ProtocolError::BadExitFrame(len))
                            } else {
                                Ok(k)
                            }
                        });
                        match parsed {
                            Ok(kind) => self.want = Some((kind, len)),
                            Err(e) => {
                                self.failed = Some(e.clone());
                                return Err(e);
                            }
                        }
                    }
                }
                Some((_, len)) => {
                    let n = (len - self.payload.len()).min(data.len());
                    self.payload.extend_from_slice(&data[..n]);
                    data = &data[n..];
                }
            }
            if let Some((kind, len)) = self.want {
                if self.payload.len() == len {
                    self.want = None;
                    let p = std::mem::take(&mut self.payload);
                    on_frame(match kind {
                        FrameKind::Stdout => Frame::Stdout(p),
                        FrameKind::Stderr => Frame::Stderr(p),
                        FrameKind::Exit => Frame::Exit(p[0]),
                    });
                }
            }
        }
        Ok(())
    }

    /// True when no partial frame is pending.
    pub fn is_idle(&self) -> bool {
        self.want.is_none() && self.header.is_empty() && self.failed.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RunSpec {
        RunSpec {
            argv: vec![b"sh".to_vec(), b"-c".to_vec(), b"echo 'a\nb'".to_vec()],
            env: vec![b"PATH=/bin".to_vec(), b"X=\xff\x00".to_vec()],
            cwd: b"/".to_vec(),
            uid: 1000,
            gid: 1001,
            egress: true,
        }
    }

    #[test]
    fn spec_round_trips() {
        assert_eq!(RunSpec::decode(&spec().encode()).unwrap(), spec());
    }

    #[test]
    fn spec_rejects_every_truncation_and_garbage() {
        let enc = spec().encode();
        for n in 0..enc.len() {
            assert!(RunSpec::decode(&enc[..n]).is_err(), "prefix {n} accepted");
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert_eq!(
            RunSpec::decode(&extra),
            Err(ProtocolError::TrailingBytes(1))
        );
        let mut bad = enc;
        bad[0] = b'X';
        assert_eq!(RunSpec::decode(&bad), Err(ProtocolError::BadMagic));
    }

    #[test]
    fn spec_rejects_empty_argv_and_huge_lists() {
        let mut s = spec();
        s.argv.clear();
        assert_eq!(RunSpec::decode(&s.encode()), Err(ProtocolError::EmptyArgv));
        let mut raw = SPEC_MAGIC.to_vec();
        raw.extend_from_slice(&[0; 12]); // uid, gid, flags
        raw.extend_from_slice(&0u32.to_le_bytes()); // cwd
        raw.extend_from_slice(&u32::MAX.to_le_bytes()); // argv count
        assert!(matches!(
            RunSpec::decode(&raw),
            Err(ProtocolError::TooManyItems(_))
        ));
    }

    #[test]
    fn frames_survive_any_split() {
        let mut stream = Vec::new();
        encode_chunks(FrameKind::Stdout, b"hello\n", &mut stream);
        encode_chunks(
            FrameKind::Stderr,
            &vec![7u8; MAX_FRAME_PAYLOAD + 3],
            &mut stream,
        );
        encode_frame(FrameKind::Stdout, b"", &mut stream);
        encode_frame(FrameKind::Exit, &[7], &mut stream);
        for step in [1, 2, 5, 4096, stream.len()] {
            let mut p = FrameParser::new();
            let mut got = Vec::new();
            for piece in stream.chunks(step) {
                p.feed(piece, |f| got.push(f)).unwrap();
            }
            assert!(p.is_idle());
            let mut err = Vec::new();
            for f in &got[1..3] {
                if let Frame::Stderr(b) = f {
                    err.extend_from_slice(b);
                }
            }
            assert_eq!(got[0], Frame::Stdout(b"hello\n".to_vec()));
            assert_eq!(err, vec![7u8; MAX_FRAME_PAYLOAD + 3]);
            assert_eq!(got[3], Frame::Stdout(Vec::new()));
            assert_eq!(got[4], Frame::Exit(7));
            assert_eq!(got.len(), 5);
        }
    }

    #[test]
    fn hostile_frames_are_rejected_and_stay_rejected() {
        let mut p = FrameParser::new();
        assert_eq!(
            p.feed(&[9, 0, 0, 0, 0], |_| {}),
            Err(ProtocolError::UnknownFrameKind(9))
        );
        assert!(p
            .feed(&[1, 0, 0, 0, 0], |_| panic!("frame after error"))
            .is_err());

        let mut p = FrameParser::new();
        let huge = ((MAX_FRAME_PAYLOAD + 1) as u32).to_le_bytes();
        let r = p.feed(&[1, huge[0], huge[1], huge[2], huge[3]], |_| {});
        assert_eq!(r, Err(ProtocolError::FrameTooLarge(MAX_FRAME_PAYLOAD + 1)));

        let mut p = FrameParser::new();
        assert_eq!(
            p.feed(&[3, 2, 0, 0, 0], |_| {}),
            Err(ProtocolError::BadExitFrame(2))
        );
    }
}
