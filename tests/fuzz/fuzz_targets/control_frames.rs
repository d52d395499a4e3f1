//! The control channel's framing (`guest-init/src/protocol.rs`) and the VMM's consumer of it
//! (`vmm/src/output.rs`'s `ChannelSink`), over arbitrary bytes cut at arbitrary points, and
//! `RunSpec::decode` over arbitrary bytes. Checked:
//!
//! * a `FrameParser` (any direction) yields the same frames and the same error however the
//!   stream is cut, stays failed after an error, yields only its direction's kinds within their
//!   size limits, and re-encoding its frames gives back the bytes it consumed;
//! * `ChannelSink` writes exactly the Stdout/Stderr payloads to stdout/stderr, records the
//!   first Exit status and the first protocol error, and always accepts every byte;
//! * a spec that decodes re-encodes to one that decodes to the same spec (run specs and a
//!   session's exec specs).
//!
//! Input: `mode: u8 % 5` (0 guest->VMM frames, also through `ChannelSink`; 1 VMM->guest
//! frames, each Spec and Exec payload also decoded; 2 `RunSpec::decode`; 3 an API client's
//! frames to a sandbox's supervisor; 4 `ExecSpec::decode`), `cuts: u8 % 16` cut lengths (`u16`
//! each; the last piece is the rest), then the stream itself.
#![no_main]

use amvm::output::{ChannelSink, Report};
use guest_init::protocol::*;
use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::sync::{Arc, Mutex};

fn kind_of(f: &Frame) -> (FrameKind, &[u8]) {
    match f {
        Frame::Stdout(b) => (FrameKind::Stdout, b),
        Frame::Stderr(b) => (FrameKind::Stderr, b),
        Frame::Exit(c) => (FrameKind::Exit, std::slice::from_ref(c)),
        Frame::Spec(b) => (FrameKind::Spec, b),
        Frame::Signal(s) => (FrameKind::Signal, std::slice::from_ref(s)),
        Frame::Ready => (FrameKind::Ready, &[]),
        Frame::Attach(_) => (FrameKind::Attach, &[]),
        Frame::Exec(b) => (FrameKind::Exec, b),
        Frame::ExecSignal { .. } => (FrameKind::ExecSignal, &[]),
        Frame::Shutdown { .. } => (FrameKind::Shutdown, &[]),
        Frame::ExecResize { .. } => (FrameKind::ExecResize, &[]),
        Frame::Restored { .. } => (FrameKind::Restored, &[]),
        Frame::Resize { .. } => (FrameKind::Resize, &[]),
        Frame::Stdin(b) => (FrameKind::Stdin, b),
        Frame::StdinEnd => (FrameKind::StdinEnd, &[]),
    }
}

/// A frame's payload as it is on the wire.
fn payload_of(f: &Frame) -> Vec<u8> {
    match f {
        Frame::Attach(id) => id.to_le_bytes().to_vec(),
        Frame::ExecSignal { id, signal } => exec_signal_payload(*id, *signal).to_vec(),
        Frame::Shutdown { grace_seconds } => grace_seconds.to_le_bytes().to_vec(),
        Frame::ExecResize { id, rows, cols } => exec_resize_payload(*id, *rows, *cols).to_vec(),
        Frame::Resize { rows, cols } => resize_payload(*rows, *cols).to_vec(),
        Frame::Restored {
            unix_nanos,
            entropy,
        } => {
            let mut p = unix_nanos.to_le_bytes().to_vec();
            p.extend_from_slice(entropy);
            p
        }
        f => kind_of(f).1.to_vec(),
    }
}

fn check_exec_spec(raw: &[u8]) {
    let decoded = ExecSpec::decode(raw);
    amvm_fuzz::trace!("exec spec: {decoded:?}");
    if let Ok(spec) = decoded {
        assert!(!spec.argv.is_empty());
        let again = spec.encode();
        assert!(again.len() <= raw.len());
        assert_eq!(ExecSpec::decode(&again).as_ref(), Ok(&spec));
    }
}

fn parse(dir: Direction, pieces: &[&[u8]]) -> (Vec<Frame>, Option<ProtocolError>, bool) {
    let mut p = FrameParser::new(dir);
    let mut frames = Vec::new();
    let mut err = None;
    for piece in pieces {
        match p.feed(piece, |f| frames.push(f)) {
            Ok(()) => assert!(err.is_none(), "a failed parser accepted more bytes"),
            Err(e) => {
                if let Some(first) = &err {
                    assert_eq!(&e, first, "a failed parser changed its error");
                }
                err = Some(e);
            }
        }
    }
    (frames, err, p.is_idle())
}

fn check_spec(raw: &[u8]) {
    let decoded = RunSpec::decode(raw);
    amvm_fuzz::trace!("spec: {decoded:?}");
    if let Ok(spec) = decoded {
        // Only a session's spec (`amvm create`) comes without a command.
        assert!(!spec.argv.is_empty() || spec.session);
        let again = spec.encode();
        assert!(again.len() <= raw.len());
        assert_eq!(RunSpec::decode(&again).as_ref(), Ok(&spec));
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = amvm_fuzz::Input::new(data);
    let mode = inp.u8() % 5;
    let cuts: Vec<usize> = (0..inp.u8() % 16).map(|_| usize::from(inp.u16())).collect();
    let stream = inp.rest();
    if mode == 2 {
        check_spec(stream);
        return;
    }
    if mode == 4 {
        check_exec_spec(stream);
        return;
    }
    let mut pieces: Vec<&[u8]> = Vec::new();
    let mut rest = stream;
    for c in cuts {
        let (a, b) = rest.split_at(c.min(rest.len()));
        pieces.push(a);
        rest = b;
    }
    pieces.push(rest);
    let dir = match mode {
        0 => Direction::ToHost,
        1 => Direction::ToGuest,
        _ => Direction::ToSandbox,
    };
    let (frames, err, idle) = parse(dir, &pieces);
    let (whole_frames, whole_err, whole_idle) = parse(dir, &[stream]);
    amvm_fuzz::trace!("{} pieces: {frames:?} {err:?} idle {idle}", pieces.len());
    assert_eq!(
        frames, whole_frames,
        "frames depend on where the stream was cut"
    );
    assert_eq!(err, whole_err);
    assert_eq!(idle, whole_idle);
    let mut wire = Vec::new();
    for f in &frames {
        let kind = kind_of(f).0;
        let payload = payload_of(f);
        let allowed: &[FrameKind] = match dir {
            Direction::ToHost => &[
                FrameKind::Stdout,
                FrameKind::Stderr,
                FrameKind::Exit,
                FrameKind::Ready,
                FrameKind::Attach,
            ],
            Direction::ToGuest => &[
                FrameKind::Spec,
                FrameKind::Signal,
                FrameKind::Exec,
                FrameKind::ExecSignal,
                FrameKind::ExecResize,
                FrameKind::Restored,
                FrameKind::Shutdown,
            ],
            Direction::ToSandbox => &[
                FrameKind::Stdin,
                FrameKind::StdinEnd,
                FrameKind::Signal,
                FrameKind::Resize,
            ],
        };
        assert!(allowed.contains(&kind), "{kind:?} in the wrong direction");
        let want_len = match kind {
            FrameKind::Stdout | FrameKind::Stderr | FrameKind::Stdin => {
                assert!(payload.len() <= MAX_FRAME_PAYLOAD);
                None
            }
            FrameKind::Spec | FrameKind::Exec => {
                assert!(payload.len() <= MAX_SPEC_LEN);
                None
            }
            FrameKind::Ready | FrameKind::StdinEnd => Some(0),
            FrameKind::Attach => Some(8),
            FrameKind::ExecSignal => Some(9),
            FrameKind::Shutdown | FrameKind::Resize => Some(4),
            FrameKind::ExecResize => Some(12),
            FrameKind::Restored => Some(8 + RESTORED_ENTROPY),
            FrameKind::Exit | FrameKind::Signal => Some(1),
        };
        if let Some(n) = want_len {
            assert_eq!(payload.len(), n, "{kind:?}");
        }
        encode_frame(kind, &payload, &mut wire);
        match f {
            Frame::Spec(raw) => check_spec(raw),
            Frame::Exec(raw) => check_exec_spec(raw),
            _ => {}
        }
    }
    assert!(
        stream.starts_with(&wire),
        "re-encoded frames differ from the stream"
    );
    if idle {
        assert_eq!(wire.len(), stream.len(), "idle with bytes unaccounted for");
    }
    if mode == 0 {
        let report = Arc::new(Mutex::new(Report::default()));
        let (mut out, mut errout) = (Vec::new(), Vec::new());
        {
            let mut sink = ChannelSink::new(&mut out, &mut errout, report.clone());
            for piece in &pieces {
                assert_eq!(sink.write(piece).expect("never fails"), piece.len());
            }
        }
        let (mut want_out, mut want_err, mut want_exit) = (Vec::new(), Vec::new(), None);
        for f in &frames {
            match f {
                Frame::Stdout(b) => want_out.extend_from_slice(b),
                Frame::Stderr(b) => want_err.extend_from_slice(b),
                Frame::Exit(c) => {
                    want_exit.get_or_insert(*c);
                }
                // Session frames: a one-shot run ignores them.
                _ => {}
            }
        }
        assert_eq!(out, want_out);
        assert_eq!(errout, want_err);
        let r = report.lock().unwrap();
        assert_eq!(r.exit, want_exit);
        assert_eq!(r.protocol_error, err);
    }
});
