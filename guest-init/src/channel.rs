//! The framed control channel to the VMM (see `guest_init::protocol`): a vsock stream to the
//! host's [`CONTROL_PORT`]. The VMM's first frame is the run spec; signal frames may follow at
//! any time; guest-init sends the workload's output and its exit status.
//!
//! Ending it is a handshake, so nothing is lost when the guest reboots right after: guest-init
//! sends the exit frame, shuts down its write side, and waits until the host closes the
//! stream — which the host does only after it has read every frame.

use guest_init::protocol::{
    encode_chunks, encode_frame, Direction, Frame, FrameKind, FrameParser, RunSpec, CONTROL_PORT,
};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The host's vsock CID.
pub const HOST_CID: u32 = 2;

/// The control stream.
pub struct Channel {
    sock: File,
    buf: Vec<u8>,
    parser: FrameParser,
    /// Signals received and not yet taken.
    signals: Vec<u8>,
    /// A session's requests (Exec, ExecSignal, Shutdown) received and not yet taken.
    requests: Vec<Frame>,
    /// The host closed its side (or the stream failed): nothing more will come in.
    closed: bool,
}

/// What [`Channel::receive`] saw.
pub enum Incoming {
    /// Bytes arrived (maybe no whole frame yet).
    Some,
    /// The host closed its side or broke the stream.
    Closed,
    /// The stream was reset under us (ENOTCONN or ECONNRESET): in a session, the VM was restored from a
    /// snapshot (the device's TRANSPORT_RESET) and the host waits for a new control stream.
    Reset,
}

impl Channel {
    pub fn open() -> io::Result<Self> {
        let sock = vsock_connect(HOST_CID, CONTROL_PORT).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("connecting to the host's control port {CONTROL_PORT}: {e}"),
            )
        })?;
        Ok(Channel {
            sock: File::from(sock),
            buf: Vec::with_capacity(64 * 1024),
            parser: FrameParser::new(Direction::ToGuest),
            signals: Vec::new(),
            requests: Vec::new(),
            closed: false,
        })
    }

    /// Wait for the VMM's first frame, the run spec.
    pub fn run_spec(&mut self) -> Result<RunSpec, String> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut spec = None;
        while spec.is_none() {
            let n = match self.sock.read(&mut buf) {
                Ok(0) => {
                    return Err("the host closed the control channel before the run spec".into())
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("reading the run spec: {e}")),
            };
            let signals = &mut self.signals;
            self.parser
                .feed(&buf[..n], |f| match f {
                    Frame::Spec(raw) if spec.is_none() => spec = Some(RunSpec::decode(&raw)),
                    Frame::Signal(s) => signals.push(s),
                    _ => {}
                })
                .map_err(|e| format!("control channel: {e}"))?;
        }
        spec.expect("loop ends with a spec")
            .map_err(|e| e.to_string())
    }

    /// The socket, for poll(2): readable means [`Channel::receive`] has something.
    pub fn fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }

    /// Read what the host sent (once poll says it is readable); signals queue up for
    /// [`Channel::take_signals`].
    pub fn receive(&mut self) -> Incoming {
        if self.closed {
            return Incoming::Closed;
        }
        let mut buf = [0u8; 4096];
        match self.sock.read(&mut buf) {
            // A transport reset closes the socket under us: reads then fail with ENOTCONN
            // (SO_ERROR holds ECONNRESET); a host that closes or resets its end gives EOF.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNRESET | libc::ENOTCONN)) => {
                self.closed = true;
                Incoming::Reset
            }
            Ok(0) | Err(_) => {
                self.closed = true;
                Incoming::Closed
            }
            Ok(n) => {
                let (signals, requests) = (&mut self.signals, &mut self.requests);
                if self
                    .parser
                    .feed(&buf[..n], |f| match f {
                        Frame::Signal(s) => signals.push(s),
                        f @ (Frame::Exec(_)
                        | Frame::ExecSignal { .. }
                        | Frame::ExecResize { .. }
                        | Frame::Shutdown { .. }) => requests.push(f),
                        _ => {}
                    })
                    .is_err()
                {
                    self.closed = true;
                    return Incoming::Closed;
                }
                Incoming::Some
            }
        }
    }

    /// A restored session's new control stream: connect again, and wait for the host's
    /// Restored frame (its wall clock and randomness).
    pub fn reconnect(&mut self) -> Result<(u64, Vec<u8>), String> {
        let sock = vsock_connect(HOST_CID, CONTROL_PORT).map_err(|e| {
            format!("connecting to the host's control port {CONTROL_PORT} again: {e}")
        })?;
        self.sock = File::from(sock);
        self.parser = FrameParser::new(Direction::ToGuest);
        self.closed = false;
        let mut buf = vec![0u8; 4096];
        let mut restored = None;
        while restored.is_none() {
            let n = match self.sock.read(&mut buf) {
                Ok(0) => return Err("the host closed the new control stream".into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("reading the new control stream: {e}")),
            };
            let (signals, requests) = (&mut self.signals, &mut self.requests);
            self.parser
                .feed(&buf[..n], |f| match f {
                    Frame::Restored {
                        unix_nanos,
                        entropy,
                    } if restored.is_none() => restored = Some((unix_nanos, entropy)),
                    Frame::Signal(s) => signals.push(s),
                    f @ (Frame::Exec(_)
                    | Frame::ExecSignal { .. }
                    | Frame::ExecResize { .. }
                    | Frame::Shutdown { .. }) => requests.push(f),
                    _ => {}
                })
                .map_err(|e| format!("control channel: {e}"))?;
        }
        Ok(restored.expect("loop ends with it"))
    }

    /// Signals the host forwarded, oldest first.
    pub fn take_signals(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.signals)
    }

    /// A session's requests, oldest first.
    pub fn take_requests(&mut self) -> Vec<Frame> {
        std::mem::take(&mut self.requests)
    }

    /// Tell the host that the session is set up and takes execs.
    pub fn ready(&mut self) {
        self.buf.clear();
        encode_frame(FrameKind::Ready, &[], &mut self.buf);
        self.flush_buf();
    }

    pub fn stdout(&mut self, data: &[u8]) {
        self.send(FrameKind::Stdout, data);
    }

    pub fn stderr(&mut self, data: &[u8]) {
        self.send(FrameKind::Stderr, data);
    }

    /// Report the exit status, then wait until the host has read everything and closed.
    pub fn exit(&mut self, status: u8) {
        self.buf.clear();
        encode_frame(FrameKind::Exit, &[status], &mut self.buf);
        self.flush_buf();
        // SAFETY: shutdown(2) on a socket descriptor we own.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_WR) };
        let mut sink = [0u8; 64];
        while matches!(self.sock.read(&mut sink), Ok(n) if n > 0) {}
    }

    fn send(&mut self, kind: FrameKind, data: &[u8]) {
        self.buf.clear();
        encode_chunks(kind, data, &mut self.buf);
        self.flush_buf();
    }

    fn flush_buf(&mut self) {
        // If the channel is gone the VMM will report a missing status; say why on the console,
        // which it keeps the tail of for that report.
        if let Err(e) = self.sock.write_all(&self.buf) {
            if !self.closed {
                eprintln!("guest-init: the control channel failed: {e}");
            }
            self.closed = true;
        }
    }
}

/// A connected AF_VSOCK stream socket.
/// `<linux/vm_sockets.h>`: SO_VM_SOCKETS_CONNECT_TIMEOUT (the 64-bit `timeval` one on x86_64).
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;
/// How long a connect to the host may take before it fails.
const CONNECT_TIMEOUT_SECS: libc::time_t = 60;

pub fn vsock_connect(cid: u32, port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel gives a vsock connect 2 s by default; a host that is busy (a loaded machine, or
    // an emulated one) can take longer to answer, and a timed-out control channel fails the
    // whole run. Wait up to CONNECT_TIMEOUT instead.
    let tv = libc::timeval {
        tv_sec: CONNECT_TIMEOUT_SECS,
        tv_usec: 0,
    };
    // SAFETY: setsockopt(2) reads `tv`, a timeval of the given size that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            owned.as_raw_fd(),
            libc::AF_VSOCK,
            SO_VM_SOCKETS_CONNECT_TIMEOUT,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: sockaddr_vm is plain data; all-zero is a valid value before we fill it in.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes that outlives the call.
    let rc = unsafe {
        libc::connect(
            owned.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(owned)
}
