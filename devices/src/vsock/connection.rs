//! One guest-initiated vsock stream and the host endpoint it is connected to.
//!
//! ## Credit, in one paragraph (virtio 1.2 §5.10.6.3)
//! Each side advertises `buf_alloc` (its receive buffer) and `fwd_cnt` (bytes it has consumed
//! from that buffer) in every packet header. A sender may have at most
//! `peer_free = peer_buf_alloc - (tx_cnt - peer_fwd_cnt)` bytes in flight (all counters wrap at
//! 2^32). Linux additionally caps its TX credit at its *own* `buf_alloc` (min of both), so we
//! report `fwd_cnt` by that smaller buffer: once half of it has been forwarded since the last
//! report (every packet to the guest reports it too). That can never stall the guest: it waits
//! only with the whole smaller buffer in flight, and once our TX buffer has drained all of it
//! is forwarded and unreported, past the half. Reporting more often (say, whenever the TX
//! buffer drains) costs the guest one more packet and interrupt per 64 KiB it sends.
//!
//! ## Guest -> host
//! Payload is written to the host stream non-blocking, straight from the packet when `tx_buf` is
//! empty, else appended to it. `WouldBlock` means nothing was written; the rest waits in `tx_buf`
//! until the stream is writable again.
//! `fwd_cnt` advances only by bytes the host stream accepted. A guest that sends beyond the
//! credit we advertised broke the protocol and gets RST — never silent loss. A guest
//! SHUTDOWN(SEND) becomes `shutdown(SHUT_WR)` on the host stream once `tx_buf` is empty.
//!
//! ## Host -> guest
//! Read from the host stream only while the guest has credit (`peer_free > 0`), in packets as
//! large as credit, the RX buffer and [`MAX_PKT_PAYLOAD`] allow (few large packets, not many tiny
//! ones). Host EOF becomes SHUTDOWN(SEND) to the guest.
//!
//! ## Closing
//! The guest's `close()` sends SHUTDOWN(RCV|SEND) and waits for our RST; we send it once every
//! byte it sent has reached the host. Host errors and guest protocol violations end in RST; a
//! guest RST ends the connection at once.

use super::defs::*;
use super::packet::{Header, TxPacket};
use std::collections::VecDeque;
use std::io;
use std::num::Wrapping;

/// The host side of a stream: a non-blocking socket in production, a scripted fake in tests.
pub trait HostStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    fn write(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// `shutdown(SHUT_WR)`: the guest will send no more.
    fn shutdown_write(&mut self) -> io::Result<()>;
}

impl HostStream for std::os::unix::net::UnixStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(self, buf)
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        io::Write::write(self, buf)
    }
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// The host endpoint is connected; the guest has not yet been sent RESPONSE.
    Accepted,
    /// RESPONSE sent: data moves both ways, subject to the half-close flags.
    Established,
    /// An RST is due to the guest; no data moves any more.
    Resetting,
    /// Finished: nothing more will be sent; the owner drops the connection.
    Closed,
}

/// Why a connection was reset (for logs and accounting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetReason {
    CreditExceeded {
        buffered: usize,
        incoming: usize,
        buf_alloc: u32,
    },
    DataAfterShutdown,
    UnexpectedOp(u16),
    HostError(io::ErrorKind),
    Closed,
}

/// One stream. `S` is the host endpoint.
#[derive(Debug)]
pub struct Connection<S> {
    stream: S,
    guest_cid: u64,
    guest_port: u32,
    host_port: u32,
    state: State,
    reset_reason: Option<ResetReason>,
    buf_alloc: u32,
    // Guest -> host.
    tx_buf: VecDeque<u8>,
    fwd_cnt: Wrapping<u32>,
    reported_fwd_cnt: Wrapping<u32>,
    credit_requested: bool,
    guest_shut_send: bool,
    host_shut_wr: bool,
    // Host -> guest.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    rx_cnt: Wrapping<u32>,
    guest_shut_rcv: bool,
    host_eof: bool,
    eof_sent: bool,
    // Accounting.
    bytes_to_host: u64,
    bytes_to_guest: u64,
}

/// A packet for the guest: header and payload (payload empty for control packets).
pub type Outgoing = (Header, Vec<u8>);

impl<S: HostStream> Connection<S> {
    /// A guest REQUEST (`req`) was accepted and `stream` connected: RESPONSE is due.
    pub fn accept(stream: S, req: &Header, buf_alloc: u32) -> Self {
        Connection {
            stream,
            guest_cid: req.src_cid,
            guest_port: req.src_port,
            host_port: req.dst_port,
            state: State::Accepted,
            reset_reason: None,
            buf_alloc,
            tx_buf: VecDeque::new(),
            fwd_cnt: Wrapping(0),
            reported_fwd_cnt: Wrapping(0),
            credit_requested: false,
            guest_shut_send: false,
            host_shut_wr: false,
            peer_buf_alloc: req.buf_alloc,
            peer_fwd_cnt: Wrapping(req.fwd_cnt),
            rx_cnt: Wrapping(0),
            guest_shut_rcv: false,
            host_eof: false,
            eof_sent: false,
            bytes_to_host: 0,
            bytes_to_guest: 0,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }
    pub fn reset_reason(&self) -> Option<&ResetReason> {
        self.reset_reason.as_ref()
    }
    pub fn stream(&self) -> &S {
        &self.stream
    }
    pub fn stream_mut(&mut self) -> &mut S {
        &mut self.stream
    }
    pub fn into_stream(self) -> S {
        self.stream
    }
    /// (guest port, host port): the connection's key.
    pub fn ports(&self) -> (u32, u32) {
        (self.guest_port, self.host_port)
    }
    /// Bytes delivered to the host stream, and to the guest.
    pub fn byte_counts(&self) -> (u64, u64) {
        (self.bytes_to_host, self.bytes_to_guest)
    }
    /// Bytes from the guest still waiting for the host stream.
    pub fn buffered(&self) -> usize {
        self.tx_buf.len()
    }

    /// How many bytes the guest can take now.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// The host stream should be polled for reading.
    pub fn wants_host_read(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && !self.guest_shut_rcv
            && self.peer_credit() > 0
    }

    /// The host stream should be polled for writing (bytes are waiting for it).
    pub fn wants_host_write(&self) -> bool {
        matches!(self.state, State::Accepted | State::Established) && !self.tx_buf.is_empty()
    }

    /// A control packet is due to the guest (data readiness comes from polling the stream).
    pub fn has_control_for_guest(&self) -> bool {
        match self.state {
            State::Accepted | State::Resetting => true,
            State::Closed => false,
            State::Established => (self.host_eof && !self.eof_sent) || self.credit_update_due(),
        }
    }

    fn credit_update_due(&self) -> bool {
        let unreported = (self.fwd_cnt - self.reported_fwd_cnt).0;
        let threshold = (self.buf_alloc.min(self.peer_buf_alloc) / 2).max(1);
        self.credit_requested || unreported >= threshold
    }

    fn reset(&mut self, why: ResetReason) {
        if matches!(self.state, State::Accepted | State::Established) {
            tracing::debug!(
                "vsock {}->{}: reset: {why:?}",
                self.guest_port,
                self.host_port
            );
            self.reset_reason = Some(why);
            self.state = State::Resetting;
            self.tx_buf = VecDeque::new();
        }
    }

    /// A packet from the guest for this connection.
    pub fn recv_from_guest(&mut self, pkt: &TxPacket) {
        let hdr = &pkt.hdr;
        if matches!(self.state, State::Closed) {
            return;
        }
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        match hdr.op {
            OP_RW => {
                if self.state == State::Resetting {
                    return;
                }
                if self.guest_shut_send {
                    return self.reset(ResetReason::DataAfterShutdown);
                }
                if self.tx_buf.len() + pkt.data.len() > self.buf_alloc as usize {
                    return self.reset(ResetReason::CreditExceeded {
                        buffered: self.tx_buf.len(),
                        incoming: pkt.data.len(),
                        buf_alloc: self.buf_alloc,
                    });
                }
                // Nothing waiting: write straight from the packet and keep only what the
                // host stream does not take now (one copy fewer on the common path).
                let mut rest = &pkt.data[..];
                if self.tx_buf.is_empty() {
                    let n = self.write_to_host(rest);
                    rest = &rest[n..];
                }
                if matches!(self.state, State::Accepted | State::Established) {
                    self.tx_buf.extend(rest);
                }
                self.flush_to_host();
            }
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.credit_requested = true,
            OP_SHUTDOWN => {
                self.guest_shut_rcv |= hdr.flags & SHUTDOWN_RCV != 0;
                self.guest_shut_send |= hdr.flags & SHUTDOWN_SEND != 0;
                self.flush_to_host();
            }
            OP_RST => {
                self.state = State::Closed;
                self.reset_reason.get_or_insert(ResetReason::Closed);
                self.tx_buf = VecDeque::new();
            }
            other => self.reset(ResetReason::UnexpectedOp(other)),
        }
    }

    /// Write `buf` to the host stream as far as it takes it now; returns how much it took
    /// (counted as forwarded). A host error resets the connection (the rest is not taken).
    fn write_to_host(&mut self, buf: &[u8]) -> usize {
        let mut done = 0;
        while done < buf.len() && matches!(self.state, State::Accepted | State::Established) {
            match self.stream.write(&buf[done..]) {
                Ok(0) => break,
                Ok(n) => {
                    let n = n.min(buf.len() - done);
                    done += n;
                    self.fwd_cnt += n as u32;
                    self.bytes_to_host += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.reset(ResetReason::HostError(e.kind()));
                    break;
                }
            }
        }
        done
    }

    /// Write buffered guest bytes to the host stream, as far as it takes them.
    pub fn flush_to_host(&mut self) {
        while matches!(self.state, State::Accepted | State::Established) && !self.tx_buf.is_empty()
        {
            let mut tx_buf = std::mem::take(&mut self.tx_buf);
            let (front, _) = tx_buf.as_slices();
            let n = self.write_to_host(front);
            let whole = n == front.len();
            tx_buf.drain(..n);
            if matches!(self.state, State::Accepted | State::Established) {
                self.tx_buf = tx_buf;
            }
            if !whole {
                break;
            }
        }
        if self.tx_buf.is_empty()
            && self.guest_shut_send
            && !self.host_shut_wr
            && self.state != State::Resetting
        {
            self.host_shut_wr = true;
            if let Err(e) = self.stream.shutdown_write() {
                if e.kind() != io::ErrorKind::NotConnected {
                    return self.reset(ResetReason::HostError(e.kind()));
                }
            }
        }
        // The guest closed both ways and everything it sent has been delivered: RST ends it.
        if self.tx_buf.is_empty()
            && self.guest_shut_send
            && self.guest_shut_rcv
            && self.state == State::Established
        {
            self.reset_reason = Some(ResetReason::Closed);
            self.state = State::Resetting;
        }
    }

    /// The next packet for the guest, if any: control packets first, then data read from the
    /// host stream (at most `max_payload` bytes, bounded by the guest's credit).
    pub fn next_for_guest(&mut self, max_payload: usize) -> Option<Outgoing> {
        let (op, flags, data) = match self.state {
            State::Closed => return None,
            State::Resetting => {
                self.state = State::Closed;
                (OP_RST, 0, Vec::new())
            }
            State::Accepted => {
                self.state = State::Established;
                (OP_RESPONSE, 0, Vec::new())
            }
            State::Established => {
                if let Some(data) = self.read_host(max_payload) {
                    (OP_RW, 0, data)
                } else if self.state == State::Resetting {
                    self.state = State::Closed;
                    (OP_RST, 0, Vec::new())
                } else if self.host_eof && !self.eof_sent {
                    self.eof_sent = true;
                    (OP_SHUTDOWN, SHUTDOWN_SEND, Vec::new())
                } else if self.credit_update_due() {
                    (OP_CREDIT_UPDATE, 0, Vec::new())
                } else {
                    return None;
                }
            }
        };
        self.credit_requested = false;
        self.reported_fwd_cnt = self.fwd_cnt;
        if op == OP_RW {
            self.rx_cnt += data.len() as u32;
            self.bytes_to_guest += data.len() as u64;
        }
        let hdr = Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.host_port,
            dst_port: self.guest_port,
            len: data.len() as u32,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt.0,
        };
        Some((hdr, data))
    }

    fn read_host(&mut self, max_payload: usize) -> Option<Vec<u8>> {
        if !self.wants_host_read() {
            return None;
        }
        let n = (self.peer_credit() as usize)
            .min(max_payload)
            .min(MAX_PKT_PAYLOAD);
        if n == 0 {
            return None;
        }
        let mut buf = vec![0u8; n];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    self.host_eof = true;
                    return None;
                }
                Ok(k) => {
                    buf.truncate(k.min(n));
                    return Some(buf);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.reset(ResetReason::HostError(e.kind()));
                    return None;
                }
            }
        }
    }
}

/// The RST for a REQUEST nobody serves (or any packet for an unknown connection).
pub fn rst_for(pkt: &Header) -> Header {
    Header {
        src_cid: HOST_CID,
        dst_cid: pkt.src_cid,
        src_port: pkt.dst_port,
        dst_port: pkt.src_port,
        len: 0,
        type_: TYPE_STREAM,
        op: OP_RST,
        flags: 0,
        buf_alloc: 0,
        fwd_cnt: 0,
    }
}

#[cfg(test)]
mod tests;
