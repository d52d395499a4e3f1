//! The vsock muxer: which guest packet goes to which connection, and which connection speaks
//! next. Pure logic over a [`Backend`] that says what each published host port connects to.
//!
//! Rules: only guest-initiated streams (`REQUEST` from the guest's CID to `HOST_CID`) to ports
//! the backend publishes are accepted; a request to any other port, a non-stream type, or a
//! packet for a connection that does not exist gets RST at once. Packets claiming another
//! source CID are dropped (the guest cannot speak for anyone else).

use super::connection::{rst_for, Connection, HostStream, Outgoing, ResetReason, State};
use super::defs::*;
use super::packet::{Header, TxPacket};
use std::collections::{BTreeMap, VecDeque};
use std::io;

/// What published host ports connect to.
pub trait Backend {
    type Stream: HostStream;
    /// `None`: nothing is published at `port` (the guest gets RST). `Some(Err)`: the port is
    /// published but its endpoint could not be reached (RST too, and the owner is told).
    fn connect(&mut self, port: u32) -> Option<io::Result<Self::Stream>>;
    /// A connection on `port` ended: its stream, byte counts (to the host, to the guest), and
    /// why it was reset if it did not close cleanly.
    fn closed(
        &mut self,
        _port: u32,
        _stream: Self::Stream,
        _counts: (u64, u64),
        _error: Option<String>,
    ) {
    }
}

/// (guest port, host port).
pub type ConnKey = (u32, u32);

/// Most resets waiting for the guest at once (each is one 44-byte header).
pub const MAX_PENDING_RSTS: usize = 1024;

#[derive(Debug)]
pub struct Muxer<B: Backend> {
    backend: B,
    guest_cid: u64,
    buf_alloc: u32,
    conns: BTreeMap<ConnKey, Connection<B::Stream>>,
    rsts: VecDeque<Header>,
    /// Resets not queued because the queue was full (see `push_rst`).
    dropped_rsts: u64,
    /// Where the round-robin over connections resumes.
    cursor: Option<ConnKey>,
}

impl<B: Backend> Muxer<B>
where
    B::Stream: std::fmt::Debug,
{
    pub fn new(backend: B, guest_cid: u64, buf_alloc: u32) -> Self {
        Muxer {
            backend,
            guest_cid,
            buf_alloc,
            conns: BTreeMap::new(),
            rsts: VecDeque::new(),
            dropped_rsts: 0,
            cursor: None,
        }
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn connections(&self) -> impl Iterator<Item = (&ConnKey, &Connection<B::Stream>)> {
        self.conns.iter()
    }

    pub fn connection_mut(&mut self, key: &ConnKey) -> Option<&mut Connection<B::Stream>> {
        self.conns.get_mut(key)
    }

    /// A packet the guest sent.
    pub fn recv_from_guest(&mut self, pkt: &TxPacket) {
        let h = &pkt.hdr;
        if h.src_cid != self.guest_cid {
            tracing::debug!("vsock: dropped a packet claiming source CID {}", h.src_cid);
            return;
        }
        if h.dst_cid != HOST_CID || h.type_ != TYPE_STREAM {
            if h.op != OP_RST {
                self.push_rst(h);
            }
            return;
        }
        let key = (h.src_port, h.dst_port);
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.recv_from_guest(pkt);
            return;
        }
        match h.op {
            OP_REQUEST => match self.connect(h) {
                Some(Ok(stream)) => {
                    self.conns
                        .insert(key, Connection::accept(stream, h, self.buf_alloc));
                }
                Some(Err(e)) => {
                    tracing::warn!(
                        "vsock: port {} could not reach its endpoint: {e}",
                        h.dst_port
                    );
                    self.push_rst(h);
                }
                None => self.push_rst(h),
            },
            OP_RST => {}
            _ => self.push_rst(h),
        }
    }

    /// The guest's connection request `h`, to its port's endpoint.
    fn connect(&mut self, h: &Header) -> Option<std::io::Result<B::Stream>> {
        tracing::debug!(
            "vsock: the guest connects from port {} to port {}",
            h.src_port,
            h.dst_port
        );
        self.backend.connect(h.dst_port)
    }

    /// Queue a reset answering `h`. The queue is bounded: a guest that sends packets for
    /// connections that do not exist, faster than it takes the resets back (or while it gives
    /// no RX buffers at all), would otherwise grow it without limit. A reset dropped here costs
    /// the guest nothing it is owed: its side of a connection that does not exist times out.
    fn push_rst(&mut self, h: &Header) {
        if self.rsts.len() >= MAX_PENDING_RSTS {
            self.dropped_rsts += 1;
            if self.dropped_rsts.is_power_of_two() {
                tracing::debug!(
                    "vsock: {} resets dropped (the guest is not taking them back)",
                    self.dropped_rsts
                );
            }
            return;
        }
        self.rsts.push_back(rst_for(h));
    }

    /// True if a packet is certainly waiting for the guest (RSTs and control packets; data
    /// readiness is known from polling the host streams).
    pub fn has_control_for_guest(&self) -> bool {
        !self.rsts.is_empty() || self.conns.values().any(Connection::has_control_for_guest)
    }

    /// The next packet for the guest, taking connections in turn so none starves the others.
    pub fn next_for_guest(&mut self, max_payload: usize) -> Option<Outgoing> {
        if let Some(h) = self.rsts.pop_front() {
            return Some((h, Vec::new()));
        }
        let keys: Vec<ConnKey> = match self.cursor {
            Some(c) => self
                .conns
                .range((std::ops::Bound::Excluded(c), std::ops::Bound::Unbounded))
                .chain(self.conns.range(..=c))
                .map(|(k, _)| *k)
                .collect(),
            None => self.conns.keys().copied().collect(),
        };
        let mut found = None;
        for key in keys {
            let conn = self.conns.get_mut(&key).expect("key from the map");
            if let Some(p) = conn.next_for_guest(max_payload) {
                self.cursor = Some(key);
                found = Some(p);
                break;
            }
        }
        self.reap();
        found
    }

    /// Forget closed connections, telling the backend.
    pub fn reap(&mut self) {
        let closed: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state() == State::Closed)
            .map(|(k, _)| *k)
            .collect();
        for key in closed {
            if let Some(c) = self.conns.remove(&key) {
                let counts = c.byte_counts();
                let error = match c.reset_reason() {
                    None | Some(ResetReason::Closed) => None,
                    Some(why) => Some(format!("{why:?}")),
                };
                self.backend.closed(key.1, c.into_stream(), counts, error);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Debug, Default)]
    struct Pipe {
        written: Vec<u8>,
        to_read: Vec<u8>,
    }
    impl HostStream for Pipe {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.to_read.is_empty() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.to_read.len());
            buf[..n].copy_from_slice(&self.to_read[..n]);
            self.to_read.drain(..n);
            Ok(n)
        }
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.written.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn shutdown_write(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[derive(Debug, Default)]
    struct Ports {
        published: HashMap<u32, bool>, // port -> reachable
        closed: Vec<(u32, (u64, u64), Option<String>)>,
        reply: Vec<u8>,
    }
    impl Backend for Ports {
        type Stream = Pipe;
        fn connect(&mut self, port: u32) -> Option<io::Result<Pipe>> {
            self.published.get(&port).map(|&ok| {
                if ok {
                    Ok(Pipe {
                        to_read: self.reply.clone(),
                        ..Pipe::default()
                    })
                } else {
                    Err(io::ErrorKind::ConnectionRefused.into())
                }
            })
        }
        fn closed(&mut self, port: u32, _stream: Pipe, counts: (u64, u64), error: Option<String>) {
            self.closed.push((port, counts, error));
        }
    }

    fn pkt(src_port: u32, dst_port: u32, op: u16, data: &[u8]) -> TxPacket {
        TxPacket {
            hdr: Header {
                src_cid: 3,
                dst_cid: HOST_CID,
                src_port,
                dst_port,
                len: data.len() as u32,
                type_: TYPE_STREAM,
                op,
                flags: 0,
                buf_alloc: 65536,
                fwd_cnt: 0,
            },
            data: data.to_vec(),
        }
    }

    fn muxer() -> Muxer<Ports> {
        let mut ports = Ports {
            reply: b"pong".to_vec(),
            ..Ports::default()
        };
        ports.published.insert(1024, true);
        ports.published.insert(1025, false);
        Muxer::new(ports, 3, 65536)
    }

    #[test]
    fn resets_the_guest_does_not_take_back_stay_bounded() {
        // A guest that floods packets for connections that do not exist and never reads.
        let mut m = muxer();
        for i in 0..100_000u32 {
            m.recv_from_guest(&pkt(i, 9999, OP_REQUEST, b""));
        }
        let mut n = 0;
        while m.next_for_guest(MAX_PKT_PAYLOAD).is_some() {
            n += 1;
        }
        assert_eq!(n, MAX_PENDING_RSTS);
        // Once taken back, new resets are queued again.
        m.recv_from_guest(&pkt(1, 9999, OP_REQUEST, b""));
        assert_eq!(m.next_for_guest(MAX_PKT_PAYLOAD).unwrap().0.op, OP_RST);
    }

    #[test]
    fn unpublished_and_unreachable_ports_get_rst_at_once() {
        let mut m = muxer();
        m.recv_from_guest(&pkt(5000, 9999, OP_REQUEST, b""));
        m.recv_from_guest(&pkt(5001, 1025, OP_REQUEST, b""));
        for (src, dst) in [(5000, 9999), (5001, 1025)] {
            let (h, _) = m.next_for_guest(MAX_PKT_PAYLOAD).unwrap();
            assert_eq!(
                (h.op, h.src_port, h.dst_port, h.dst_cid),
                (OP_RST, dst, src, 3)
            );
        }
        assert!(m.next_for_guest(MAX_PKT_PAYLOAD).is_none());
        assert_eq!(m.connections().count(), 0);
    }

    #[test]
    fn packets_for_unknown_connections_and_foreign_types_get_rst_spoofed_cids_are_dropped() {
        let mut m = muxer();
        m.recv_from_guest(&pkt(5000, 1024, OP_RW, b"x"));
        let mut seqpacket = pkt(5000, 1024, OP_REQUEST, b"");
        seqpacket.hdr.type_ = 2;
        m.recv_from_guest(&seqpacket);
        let mut spoofed = pkt(5000, 1024, OP_REQUEST, b"");
        spoofed.hdr.src_cid = 7;
        m.recv_from_guest(&spoofed);
        m.recv_from_guest(&pkt(5000, 1024, OP_RST, b"")); // RST for nothing: silence
        assert_eq!(m.next_for_guest(MAX_PKT_PAYLOAD).unwrap().0.op, OP_RST);
        assert_eq!(m.next_for_guest(MAX_PKT_PAYLOAD).unwrap().0.op, OP_RST);
        assert!(m.next_for_guest(MAX_PKT_PAYLOAD).is_none());
        assert_eq!(m.connections().count(), 0);
    }

    #[test]
    fn a_published_port_carries_a_whole_exchange_and_is_reaped() {
        let mut m = muxer();
        m.recv_from_guest(&pkt(5000, 1024, OP_REQUEST, b""));
        assert_eq!(m.next_for_guest(MAX_PKT_PAYLOAD).unwrap().0.op, OP_RESPONSE);
        m.recv_from_guest(&pkt(5000, 1024, OP_RW, b"ping"));
        assert_eq!(
            m.connection_mut(&(5000, 1024)).unwrap().stream().written,
            b"ping"
        );
        let (h, data) = m.next_for_guest(MAX_PKT_PAYLOAD).unwrap();
        assert_eq!((h.op, data.as_slice()), (OP_RW, &b"pong"[..]));
        let mut close = pkt(5000, 1024, OP_SHUTDOWN, b"");
        close.hdr.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        m.recv_from_guest(&close);
        let mut ops = Vec::new();
        while let Some((h, _)) = m.next_for_guest(MAX_PKT_PAYLOAD) {
            ops.push(h.op);
        }
        assert_eq!(ops.last(), Some(&OP_RST));
        assert_eq!(m.connections().count(), 0);
        assert_eq!(m.backend_mut().closed, vec![(1024, (4, 4), None)]);
    }

    #[test]
    fn connections_take_turns() {
        let mut m = muxer();
        for p in [1, 2, 3] {
            m.recv_from_guest(&pkt(p, 1024, OP_REQUEST, b""));
        }
        let order: Vec<u32> = (0..6)
            .map(|_| m.next_for_guest(1).unwrap().0.dst_port)
            .collect();
        // RESPONSEs for 1, 2, 3, then one data byte each, in turn.
        assert_eq!(order, vec![1, 2, 3, 1, 2, 3]);
    }
}
