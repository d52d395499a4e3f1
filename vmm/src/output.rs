//! Where the guest's output goes on the host.
//!
//! * The control channel carries guest-init's frames ([`guest_init::protocol`]): [`ChannelSink`]
//!   parses them (hostile input: a malformed frame ends the channel, never the VMM), writes the
//!   workload's stdout and stderr to ours, and records its exit status.
//! * COM1 is the kernel console: [`ConsoleSink`] shows it with `--console` and always keeps
//!   its tail, so a guest that dies before reporting can be explained.

use guest_init::protocol::{Direction, Frame, FrameParser, ProtocolError};
use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

/// How many bytes of console output are kept for error reports.
const CONSOLE_TAIL_BYTES: usize = 4096;

/// What the guest reported over the channel.
#[derive(Debug, Default)]
pub struct Report {
    pub exit: Option<u8>,
    pub protocol_error: Option<ProtocolError>,
}

/// Frames in, stdout/stderr/exit status out.
#[derive(Debug)]
pub struct ChannelSink<O: Write, E: Write> {
    parser: FrameParser,
    stdout: O,
    stderr: E,
    report: Arc<Mutex<Report>>,
}

impl<O: Write, E: Write> ChannelSink<O, E> {
    pub fn new(stdout: O, stderr: E, report: Arc<Mutex<Report>>) -> Self {
        ChannelSink {
            parser: FrameParser::new(Direction::ToHost),
            stdout,
            stderr,
            report,
        }
    }
}

impl<O: Write, E: Write> Write for ChannelSink<O, E> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (stdout, stderr, report) = (&mut self.stdout, &mut self.stderr, &self.report);
        let fed = self.parser.feed(buf, |frame| {
            // A reader that went away (EPIPE) must not stop the guest; its bytes are dropped.
            let _ = match frame {
                Frame::Stdout(b) => stdout.write_all(&b).and_then(|_| stdout.flush()),
                Frame::Stderr(b) => stderr.write_all(&b).and_then(|_| stderr.flush()),
                Frame::Exit(code) => {
                    lock(report).exit.get_or_insert(code);
                    Ok(())
                }
                // Session frames mean nothing in a one-shot run; the ToHost parser yields no
                // others.
                _ => Ok(()),
            };
        });
        if let Err(e) = fed {
            let mut r = lock(report);
            if r.protocol_error.is_none() {
                tracing::warn!("guest channel: {e}");
                r.protocol_error = Some(e);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The kernel console: optionally echoed to stderr, its tail always kept.
#[derive(Debug, Clone)]
pub struct ConsoleSink {
    echo: bool,
    kept: Arc<Mutex<Kept>>,
}

/// What the console keeps for an error report: its last bytes, and the kernel's panic line even
/// when a long call trace after it (or a warning's) pushed it out of those.
#[derive(Debug, Default)]
struct Kept {
    tail: VecDeque<u8>,
    /// The line being written, up to [`MAX_LINE`] bytes (the rest of a longer line is dropped).
    line: Vec<u8>,
    /// The first line that said [`PANIC_MARK`].
    panic: Option<String>,
}

/// What Linux prints first when it panics, even with `quiet`.
pub const PANIC_MARK: &str = "Kernel panic - not syncing";
/// Longest console line looked at for [`PANIC_MARK`].
const MAX_LINE: usize = 1024;

impl ConsoleSink {
    pub fn new(echo: bool) -> Self {
        ConsoleSink {
            echo,
            kept: Arc::new(Mutex::new(Kept {
                tail: VecDeque::with_capacity(CONSOLE_TAIL_BYTES),
                ..Kept::default()
            })),
        }
    }

    /// The last lines the guest kernel printed (at most a few KiB); when the kernel panicked
    /// and its panic line is no longer among them, that line first, then `...`.
    pub fn tail(&self) -> String {
        let k = lock(&self.kept);
        let bytes: Vec<u8> = k.tail.iter().copied().collect();
        let tail = String::from_utf8_lossy(&bytes).replace('\r', "");
        match &k.panic {
            Some(p) if !tail.contains(p.as_str()) => format!("{p}\n...\n{tail}"),
            _ => tail,
        }
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.echo {
            let _ = io::stderr().write_all(buf);
        }
        let mut k = lock(&self.kept);
        for &b in buf {
            if k.tail.len() == CONSOLE_TAIL_BYTES {
                k.tail.pop_front();
            }
            k.tail.push_back(b);
            match b {
                b'\n' => {
                    if !self.echo {
                        tracing::debug!(target: "amvm::console", "{}", String::from_utf8_lossy(&k.line).trim_end());
                    }
                    if k.panic.is_none() {
                        let line = String::from_utf8_lossy(&k.line).replace('\r', "");
                        if line.contains(PANIC_MARK) {
                            k.panic = Some(line);
                        }
                    }
                    k.line.clear();
                }
                _ if k.line.len() < MAX_LINE => k.line.push(b),
                _ => {}
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_init::protocol::{encode_frame, FrameKind};

    #[test]
    fn frames_split_into_stdout_stderr_and_status() {
        let report = Arc::new(Mutex::new(Report::default()));
        let (mut out, mut err) = (Vec::new(), Vec::new());
        {
            let mut sink = ChannelSink::new(&mut out, &mut err, report.clone());
            let mut wire = Vec::new();
            encode_frame(FrameKind::Stdout, b"hello\n", &mut wire);
            encode_frame(FrameKind::Stderr, b"oops\n", &mut wire);
            encode_frame(FrameKind::Exit, &[7], &mut wire);
            encode_frame(FrameKind::Exit, &[9], &mut wire); // a second status is ignored
            for b in &wire {
                sink.write_all(std::slice::from_ref(b)).unwrap(); // one byte per UART write
            }
        }
        assert_eq!(
            (out.as_slice(), err.as_slice()),
            (&b"hello\n"[..], &b"oops\n"[..])
        );
        assert_eq!(report.lock().unwrap().exit, Some(7));
    }

    #[test]
    fn garbage_from_the_guest_is_recorded_not_fatal() {
        let report = Arc::new(Mutex::new(Report::default()));
        let mut sink = ChannelSink::new(Vec::new(), Vec::new(), report.clone());
        assert_eq!(sink.write(&[0xee, 1, 2, 3, 4, 5, 6]).unwrap(), 7);
        assert_eq!(sink.write(&[3, 1, 0, 0, 0, 0]).unwrap(), 6);
        let r = report.lock().unwrap();
        assert!(r.protocol_error.is_some());
        assert_eq!(r.exit, None, "nothing after a framing error is trusted");
    }

    #[test]
    fn console_keeps_only_its_tail() {
        let mut c = ConsoleSink::new(false);
        c.write_all(&vec![b'a'; CONSOLE_TAIL_BYTES]).unwrap();
        c.write_all(b"\r\nlast line").unwrap();
        let t = c.tail();
        assert_eq!(t.len(), CONSOLE_TAIL_BYTES - 1);
        assert!(t.ends_with("a\nlast line"));
    }

    #[test]
    fn console_keeps_the_panic_line_however_long_the_trace_after_it() {
        let mut c = ConsoleSink::new(false);
        c.write_all(b"[    1.0] WARNING: something\r\n").unwrap();
        c.write_all(b"[    2.0] Kernel panic - not syncing: sysrq triggered crash\r\n")
            .unwrap();
        // A call trace many times the kept tail, written in odd pieces.
        for i in 0..400 {
            c.write_all(format!("[    2.1]  frame_{i:04}+0x1c/0x30\r").as_bytes())
                .unwrap();
            c.write_all(b"\n").unwrap();
        }
        let t = c.tail();
        assert!(
            t.starts_with("[    2.0] Kernel panic - not syncing: sysrq triggered crash\n...\n"),
            "{t}"
        );
        assert!(t.ends_with("frame_0399+0x1c/0x30\n"), "{t}");
        // While the panic line is still in the tail, it is not repeated.
        let mut c = ConsoleSink::new(false);
        c.write_all(b"x\nKernel panic - not syncing: Attempted to kill init!\nend\n")
            .unwrap();
        assert_eq!(
            c.tail(),
            "x\nKernel panic - not syncing: Attempted to kill init!\nend\n"
        );
    }
}
