//! The host side of the control channel and the vsock ports amvm publishes: the control port,
//! and with `--egress` the egress port, whose streams each become a connection to the egress
//! socket (accounted and logged by `amvm-egress`).
//!
//! guest-init connects to [`CONTROL_PORT`]; the vsock device hands that stream to one end of a
//! unix socket pair, and a thread here reads the other end: frames go through
//! [`ChannelSink`](crate::output::ChannelSink) to our stdout/stderr and the exit status into the
//! [`Report`]. Once the exit frame is in, the thread closes its end; the guest sees EOF, which
//! is its signal that everything arrived and it may reboot.

use crate::output::{ChannelSink, Report};
use amvm_devices::vsock::connection::HostStream;
use amvm_devices::vsock::muxer::Backend;
use amvm_egress::{Egress, RequestLineSniffer, StreamRecord};
use guest_init::protocol::{CONTROL_PORT, EGRESS_PORT};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What the guest's vsock ports connect to: the control channel (once), and, with `--egress`,
/// a fresh connection to the egress socket per stream.
#[derive(Debug)]
pub struct Ports {
    /// The device's end of the control channel, until guest-init connects (once).
    control: Option<UnixStream>,
    egress: Option<Egress>,
}

/// A published port's host stream, with the egress bookkeeping when it is an egress stream.
#[derive(Debug)]
pub struct PortStream {
    sock: UnixStream,
    egress: Option<EgressStream>,
}

#[derive(Debug)]
struct EgressStream {
    id: u64,
    opened_ms: u128,
    sniffer: RequestLineSniffer,
}

impl HostStream for PortStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.sock, buf)
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = io::Write::write(&mut self.sock, buf)?;
        if let Some(e) = &mut self.egress {
            e.sniffer.feed(&buf[..n]);
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
        match port {
            CONTROL_PORT => Some(
                self.control
                    .take()
                    .map(|sock| PortStream { sock, egress: None })
                    .ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::AddrInUse,
                            "the control channel is already open",
                        )
                    }),
            ),
            EGRESS_PORT => self.egress.as_mut().map(|e| {
                let (id, sock) = e.connect()?;
                let egress = EgressStream {
                    id,
                    opened_ms: amvm_egress::now_ms(),
                    sniffer: RequestLineSniffer::default(),
                };
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
            egress.record(&StreamRecord {
                id: e.id,
                opened_ms: e.opened_ms,
                closed_ms: amvm_egress::now_ms(),
                bytes_out: counts.0,
                bytes_in: counts.1,
                http_request: e.sniffer.request_line().map(str::to_string),
                error,
            });
        }
    }
}

/// Start the control channel's reader; returns the ports for the vsock device.
pub fn start(
    report: Arc<Mutex<Report>>,
    egress: Option<Egress>,
) -> io::Result<(Ports, JoinHandle<()>)> {
    let (mut ours, device_end) = UnixStream::pair()?;
    device_end.set_nonblocking(true)?;
    let reader = std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            let mut sink = ChannelSink::new(io::stdout(), io::stderr(), report.clone());
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match io::Read::read(&mut ours, &mut buf) {
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
    Ok((
        Ports {
            control: Some(device_end),
            egress,
        },
        reader,
    ))
}
