//! The framed channel to the VMM on the guest's second UART (see `guest_init::protocol`).

use guest_init::protocol::{encode_chunks, encode_frame, FrameKind};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

/// The UART the VMM listens on for frames (COM2, port 0x2f8).
pub const CHANNEL_TTY: &str = "/dev/ttyS1";

/// A raw-mode tty carrying frames.
pub struct Channel {
    tty: File,
    buf: Vec<u8>,
}

impl Channel {
    pub fn open(path: &str) -> io::Result<Self> {
        let tty = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("open {path}: {e}")))?;
        make_raw(&tty)?;
        Ok(Channel {
            tty,
            buf: Vec::with_capacity(4096),
        })
    }

    pub fn stdout(&mut self, data: &[u8]) {
        self.send(FrameKind::Stdout, data);
    }

    pub fn stderr(&mut self, data: &[u8]) {
        self.send(FrameKind::Stderr, data);
    }

    /// Report the exit status and wait until every byte has left the UART.
    pub fn exit(&mut self, status: u8) {
        self.buf.clear();
        encode_frame(FrameKind::Exit, &[status], &mut self.buf);
        self.flush_buf();
        // SAFETY: tcdrain on a valid, open tty descriptor.
        unsafe { libc::tcdrain(self.tty.as_raw_fd()) };
    }

    fn send(&mut self, kind: FrameKind, data: &[u8]) {
        self.buf.clear();
        encode_chunks(kind, data, &mut self.buf);
        self.flush_buf();
    }

    fn flush_buf(&mut self) {
        // If the channel is gone there is nobody left to tell; the VMM will report a missing status.
        let _ = self.tty.write_all(&self.buf);
    }
}

/// Raw mode: no echo, no line discipline, no \n -> \r\n: bytes pass unchanged.
fn make_raw(tty: &File) -> io::Result<()> {
    let fd = tty.as_raw_fd();
    // SAFETY: termios is plain data; zeroed is a valid value that tcgetattr overwrites.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: fd is an open tty and `t` a valid, writable termios.
    if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `t` is a valid termios obtained above.
    unsafe { libc::cfmakeraw(&mut t) };
    // SAFETY: fd is an open tty and `t` a valid termios.
    if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
