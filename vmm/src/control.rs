//! The host side of the control channel and the vsock ports amvm publishes: the control port,
//! and with `--egress` the egress port, whose streams each become a connection to the egress
//! socket (accounted and logged by `amvm-egress`).
//!
//! guest-init connects to [`CONTROL_PORT`]; the vsock device hands that stream to one end of a
//! unix socket pair, and two threads here use the other end:
//! * "control-tx" writes the run spec, then each signal [`Control::signal`] forwards;
//! * "control" reads frames through [`ChannelSink`](crate::output::ChannelSink) to our
//!   stdout/stderr and the exit status into the [`Report`]. Once the exit frame is in, it closes
//!   the stream; the guest sees EOF, which is its signal that everything arrived and it may
//!   reboot.
//!
//! With `-i`, [`STDIN_PORT`] is published too: a "stdin" thread copies our stdin into it and
//! half-closes at EOF, so the workload reads exactly our stdin and then EOF.

use crate::output::{ChannelSink, Report};
use crate::seccomp::{Policy, ThreadKind};
use amvm_devices::vsock::connection::HostStream;
use amvm_devices::vsock::muxer::Backend;
use amvm_egress::{Egress, EgressStream};
use guest_init::protocol::{
    encode_frame, FrameKind, CONTROL_PORT, EGRESS_PORT, EXEC_PORT, STDIN_PORT,
};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// What the guest's vsock ports connect to: the control channel (once), and, with `--egress`,
/// a fresh connection to the egress socket per stream.
#[derive(Debug)]
pub struct Ports {
    /// The device's end of the control channel, until guest-init connects (once).
    control: Option<UnixStream>,
    /// The device's end of the stdin stream (`-i` only), until guest-init connects (once).
    stdin: Option<UnixStream>,
    egress: Option<Egress>,
    /// A session: the control stream (once) and every exec stream connect to the supervisor's
    /// socket, at [`GUEST_IN_ROOT`](crate::jail::GUEST_IN_ROOT) once amvm is in its empty root.
    session: bool,
    control_opened: bool,
}

/// The first byte the VMM writes on each stream it opens to a session's supervisor: which port
/// the guest connected to. The supervisor trusts it (it comes from the VMM, not the guest).
pub const SESSION_TAG_CONTROL: u8 = b'C';
pub const SESSION_TAG_EXEC: u8 = b'E';

/// The VMM's side of the control channel: forwards signals to the workload.
#[derive(Debug)]
pub struct Control {
    tx: mpsc::Sender<u8>,
}

impl Control {
    /// Forward signal `sig` to the workload (queued behind the run spec; never blocks).
    pub fn signal(&self, sig: i32) {
        if let Ok(sig) = u8::try_from(sig) {
            let _ = self.tx.send(sig);
        }
    }
}

/// A published port's host stream, with the egress bookkeeping when it is an egress stream.
#[derive(Debug)]
pub struct PortStream {
    sock: UnixStream,
    egress: Option<EgressStream>,
}

impl HostStream for PortStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.sock, buf)
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = io::Write::write(&mut self.sock, buf)?;
        if let Some(e) = &mut self.egress {
            e.sent(&buf[..n]);
        }
        Ok(n)
    }
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.sock.shutdown(std::net::Shutdown::Write)
    }
}

impl AsRawFd for PortStream {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

impl Backend for Ports {
    type Stream = PortStream;

    fn connect(&mut self, port: u32) -> Option<io::Result<PortStream>> {
        let once = |slot: &mut Option<UnixStream>, what: &str| {
            slot.take()
                .map(|sock| PortStream { sock, egress: None })
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::AddrInUse, format!("{what} is already open"))
                })
        };
        let to_supervisor = |tag: u8| -> io::Result<PortStream> {
            let mut sock = UnixStream::connect(crate::jail::GUEST_IN_ROOT)?;
            sock.write_all(&[tag])?;
            sock.set_nonblocking(true)?;
            Ok(PortStream { sock, egress: None })
        };
        match port {
            CONTROL_PORT if self.session => Some(if self.control_opened {
                Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "the control channel is already open",
                ))
            } else {
                self.control_opened = true;
                to_supervisor(SESSION_TAG_CONTROL)
            }),
            EXEC_PORT if self.session => Some(to_supervisor(SESSION_TAG_EXEC)),
            CONTROL_PORT => Some(once(&mut self.control, "the control channel")),
            STDIN_PORT if self.stdin.is_some() => Some(once(&mut self.stdin, "the stdin stream")),
            EGRESS_PORT => self.egress.as_mut().map(|e| {
                let (egress, sock) = e.connect()?;
                Ok(PortStream {
                    sock,
                    egress: Some(egress),
                })
            }),
            _ => None,
        }
    }

    fn closed(
        &mut self,
        _port: u32,
        stream: PortStream,
        counts: (u64, u64),
        error: Option<String>,
    ) {
        if let (Some(e), Some(egress)) = (stream.egress, &mut self.egress) {
            egress.close(e, counts, error);
        }
    }
}

/// A session's ports: control and exec streams go to its supervisor; no control threads here
/// (the returned [`Control`] forwards nothing: the supervisor signals execs itself).
pub fn session(egress: Option<Egress>) -> (Ports, Control) {
    let (tx, _) = mpsc::channel();
    (
        Ports {
            control: None,
            stdin: None,
            egress,
            session: true,
            control_opened: false,
        },
        Control { tx },
    )
}

/// Start the control channel's threads (and, with `stdin`, the stdin copier); returns the ports
/// for the vsock device and the handle that forwards signals.
pub fn start(
    policy: &Policy,
    report: Arc<Mutex<Report>>,
    egress: Option<Egress>,
    spec: &[u8],
    stdin: bool,
) -> io::Result<(Ports, Control)> {
    let (mut ours, device_end) = UnixStream::pair()?;
    device_end.set_nonblocking(true)?;

    let mut first = Vec::with_capacity(spec.len() + 8);
    encode_frame(FrameKind::Spec, spec, &mut first);
    let (tx, rx) = mpsc::channel::<u8>();
    let mut writer = ours.try_clone()?;
    let p = policy.clone();
    policy.expect_thread();
    std::thread::Builder::new()
        .name("control-tx".into())
        .stack_size(amvm_devices::THREAD_STACK_SIZE)
        .spawn(move || {
            p.enter(ThreadKind::Helper);
            if writer.write_all(&first).is_err() {
                return;
            }
            for sig in rx {
                let mut frame = Vec::with_capacity(8);
                encode_frame(FrameKind::Signal, &[sig], &mut frame);
                if writer.write_all(&frame).is_err() {
                    return;
                }
            }
        })?;

    let p = policy.clone();
    policy.expect_thread();
    std::thread::Builder::new()
        .name("control".into())
        .stack_size(amvm_devices::THREAD_STACK_SIZE)
        .spawn(move || {
            p.enter(ThreadKind::Helper);
            let mut sink = ChannelSink::new(io::stdout(), io::stderr(), report.clone());
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match Read::read(&mut ours, &mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let _ = sink.write(&buf[..n]);
                        let r = report.lock().unwrap_or_else(|p| p.into_inner());
                        if r.exit.is_some() || r.protocol_error.is_some() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = ours.shutdown(std::net::Shutdown::Both);
        })?;

    let stdin = if stdin {
        let (mut ours, device_end) = UnixStream::pair()?;
        device_end.set_nonblocking(true)?;
        let p = policy.clone();
        policy.expect_thread();
        std::thread::Builder::new()
            .name("stdin".into())
            .stack_size(amvm_devices::THREAD_STACK_SIZE)
            .spawn(move || {
                p.enter(ThreadKind::Helper);
                let mut input = io::stdin().lock();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match Read::read(&mut input, &mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            // The workload is gone (EPIPE): nobody wants the rest.
                            if ours.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            tracing::warn!("reading stdin: {e}; the workload sees EOF");
                            break;
                        }
                    }
                }
                let _ = ours.shutdown(std::net::Shutdown::Write);
            })?;
        Some(device_end)
    } else {
        None
    };

    Ok((
        Ports {
            control: Some(device_end),
            stdin,
            egress,
            session: false,
            control_opened: false,
        },
        Control { tx },
    ))
}
