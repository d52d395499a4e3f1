//! The connection state machine against a model: scripted host streams with arbitrary
//! partial writes/reads and EAGAIN, guests that follow the credit rules (and one that does not).

use super::*;
use proptest::prelude::*;

const OUR_BUF: u32 = 256 * 1024;

/// A host stream that accepts/produces bytes only as its budget allows.
#[derive(Debug, Default)]
struct Fake {
    written: Vec<u8>,
    write_budget: usize,
    write_cap: usize,
    to_read: VecDeque<u8>,
    read_budget: usize,
    read_cap: usize,
    eof: bool,
    shut_wr: bool,
    fail_writes: bool,
}

impl HostStream for Fake {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.to_read.is_empty() && self.eof {
            return Ok(0);
        }
        let n = buf
            .len()
            .min(self.to_read.len())
            .min(self.read_budget)
            .min(self.read_cap.max(1));
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        for b in buf.iter_mut().take(n) {
            *b = self.to_read.pop_front().unwrap();
        }
        self.read_budget -= n;
        Ok(n)
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.fail_writes {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        assert!(!self.shut_wr, "write after shutdown(SHUT_WR)");
        let n = buf.len().min(self.write_budget).min(self.write_cap.max(1));
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.written.extend_from_slice(&buf[..n]);
        self.write_budget -= n;
        Ok(n)
    }
    fn shutdown_write(&mut self) -> io::Result<()> {
        self.shut_wr = true;
        Ok(())
    }
}

fn request(guest_buf: u32) -> Header {
    Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 50000,
        dst_port: 1024,
        len: 0,
        type_: TYPE_STREAM,
        op: OP_REQUEST,
        flags: 0,
        buf_alloc: guest_buf,
        fwd_cnt: 0,
    }
}

/// The guest's side of one stream, obeying the credit rules as Linux does.
struct Guest {
    buf_alloc: u32,
    peer_buf_alloc: u32,
    peer_fwd: Wrapping<u32>,
    tx_cnt: Wrapping<u32>,
    // Receive side.
    received: Vec<u8>,
    consumed: usize,
    got_eof: bool,
    got_rst: bool,
    established: bool,
}

impl Guest {
    fn new(buf_alloc: u32) -> Self {
        Guest {
            buf_alloc,
            peer_buf_alloc: 0,
            peer_fwd: Wrapping(0),
            tx_cnt: Wrapping(0),
            received: Vec::new(),
            consumed: 0,
            got_eof: false,
            got_rst: false,
            established: false,
        }
    }
    fn credit(&self) -> usize {
        let cap = self.peer_buf_alloc.min(self.buf_alloc);
        cap.saturating_sub((self.tx_cnt - self.peer_fwd).0) as usize
    }
    fn fwd_cnt(&self) -> u32 {
        self.consumed as u32
    }
    fn hdr(&self, op: u16, flags: u32, len: usize) -> Header {
        let mut h = request(self.buf_alloc);
        h.op = op;
        h.flags = flags;
        h.len = len as u32;
        h.fwd_cnt = self.fwd_cnt();
        h
    }
    fn take(&mut self, (h, data): Outgoing) {
        assert_eq!(
            (h.src_cid, h.dst_cid, h.src_port, h.dst_port),
            (HOST_CID, 3, 1024, 50000)
        );
        assert_eq!(h.len as usize, data.len());
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd = Wrapping(h.fwd_cnt);
        match h.op {
            OP_RESPONSE => self.established = true,
            OP_RW => {
                assert!(!self.got_eof, "data after SHUTDOWN(SEND)");
                self.received.extend_from_slice(&data);
                let queued = self.received.len() - self.consumed;
                assert!(
                    queued <= self.buf_alloc as usize,
                    "host overran the guest's buffer: {queued} > {}",
                    self.buf_alloc
                );
            }
            OP_SHUTDOWN => {
                assert_eq!(h.flags, SHUTDOWN_SEND);
                self.got_eof = true;
            }
            OP_CREDIT_UPDATE => {}
            OP_RST => self.got_rst = true,
            op => panic!("unexpected op {op}"),
        }
    }
}

fn drain(conn: &mut Connection<Fake>, g: &mut Guest, max_payload: usize) {
    // Bounded: at one byte per packet a 1 MiB exchange is a million packets; more means a loop.
    for _ in 0..2_000_000 {
        match conn.next_for_guest(max_payload) {
            Some(p) => g.take(p),
            None => return,
        }
    }
    panic!("connection produced packets without end");
}

/// The guest writes up to `want` more bytes of `data`, as far as its credit allows.
fn guest_send(
    conn: &mut Connection<Fake>,
    g: &mut Guest,
    data: &[u8],
    sent: &mut usize,
    want: usize,
) {
    let n = want
        .min(g.credit())
        .min(MAX_PKT_PAYLOAD)
        .min(data.len() - *sent);
    if n > 0 {
        conn.recv_from_guest(&TxPacket {
            hdr: g.hdr(OP_RW, 0, n),
            data: data[*sent..*sent + n].to_vec(),
        });
        g.tx_cnt += n as u32;
        *sent += n;
    }
}

#[derive(Debug, Clone)]
enum TxStep {
    /// The guest writes up to this many bytes (bounded by its credit).
    Send(usize),
    /// The host becomes writable for this many bytes, taking at most `cap` per write call.
    Grant(usize, usize),
}

fn tx_step() -> impl Strategy<Value = TxStep> {
    prop_oneof![
        (1usize..=70_000).prop_map(TxStep::Send),
        (0usize..=150_000, 1usize..=70_000).prop_map(|(k, c)| TxStep::Grant(k, c)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Guest -> host: whatever the host's partial writes and pauses, every byte arrives once,
    /// in order, the TX buffer never exceeds what we advertised, and the stream never stalls.
    #[test]
    fn guest_to_host_loses_nothing(total in 0usize..600_000, guest_buf in 4096u32..=(1 << 20), steps in prop::collection::vec(tx_step(), 0..60)) {
        let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        let mut conn = Connection::accept(Fake::default(), &request(guest_buf), OUR_BUF);
        let mut g = Guest::new(guest_buf);
        drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
        prop_assert!(g.established);
        let mut sent = 0usize;
        for step in steps {
            match step {
                TxStep::Send(n) => guest_send(&mut conn, &mut g, &data, &mut sent, n),
                TxStep::Grant(k, cap) => {
                    conn.stream_mut().write_budget += k;
                    conn.stream_mut().write_cap = cap;
                    conn.flush_to_host();
                }
            }
            drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
            prop_assert_eq!(conn.state(), State::Established);
            prop_assert!(conn.buffered() <= OUR_BUF as usize);
            let w = &conn.stream().written;
            prop_assert_eq!(&w[..], &data[..w.len()], "host got bytes out of order");
            prop_assert_eq!(w.len() + conn.buffered(), sent);
        }
        // Then the host drains freely: the rest must go through without a stall.
        let mut rounds = 0;
        while conn.stream().written.len() < total {
            rounds += 1;
            prop_assert!(rounds < 10_000, "stalled at {} of {total}", conn.stream().written.len());
            conn.stream_mut().write_budget = usize::MAX;
            conn.stream_mut().write_cap = 1 << 20;
            conn.flush_to_host();
            drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
            guest_send(&mut conn, &mut g, &data, &mut sent, usize::MAX);
        }
        prop_assert_eq!(&conn.stream().written, &data);
        prop_assert_eq!(conn.byte_counts().0, total as u64);
    }

    /// Host -> guest: whatever the host's read pattern and however slowly the guest reads, the
    /// guest's buffer is never overrun, data arrives complete and in order, then EOF.
    #[test]
    fn host_to_guest_respects_credit(total in 0usize..600_000, guest_buf in 1u32..=(1 << 18), steps in prop::collection::vec((0u8..3, 1usize..=100_000), 0..80)) {
        let data: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
        let fake = Fake { to_read: data.iter().copied().collect(), eof: true, ..Fake::default() };
        let mut conn = Connection::accept(fake, &request(guest_buf), OUR_BUF);
        let mut g = Guest::new(guest_buf);
        drain(&mut conn, &mut g, 0);
        for (kind, n) in steps {
            match kind {
                // The host produces up to n more bytes, in reads of up to n/3+1.
                0 => {
                    conn.stream_mut().read_budget += n;
                    conn.stream_mut().read_cap = n / 3 + 1;
                }
                // The guest application reads n bytes and the guest reports it.
                1 => {
                    g.consumed = (g.consumed + n).min(g.received.len());
                    conn.recv_from_guest(&TxPacket { hdr: g.hdr(OP_CREDIT_UPDATE, 0, 0), data: Vec::new() });
                }
                // The device has RX room for n bytes of payload.
                _ => drain(&mut conn, &mut g, n),
            }
            prop_assert!(!g.got_rst);
            prop_assert_eq!(&g.received[..], &data[..g.received.len()]);
        }
        // A stall is rounds that move nothing (not a count of rounds: with a guest buffer of one
        // byte each round moves one byte, and 600,000 rounds are not a stall).
        let mut idle = 0;
        while !g.got_eof {
            let before = g.received.len();
            conn.stream_mut().read_budget = usize::MAX;
            conn.stream_mut().read_cap = 1 << 20;
            drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
            g.consumed = g.received.len();
            conn.recv_from_guest(&TxPacket { hdr: g.hdr(OP_CREDIT_UPDATE, 0, 0), data: Vec::new() });
            idle = if g.received.len() > before || g.got_eof { 0 } else { idle + 1 };
            prop_assert!(idle < 3, "stalled at {} of {total}", g.received.len());
        }
        prop_assert_eq!(&g.received, &data);
    }
}

#[test]
fn a_guest_that_exceeds_its_credit_is_reset_and_nothing_extra_reaches_the_host() {
    let mut conn = Connection::accept(Fake::default(), &request(1 << 20), OUR_BUF);
    let mut g = Guest::new(1 << 20);
    drain(&mut conn, &mut g, 0);
    let chunk = vec![7u8; MAX_PKT_PAYLOAD];
    for _ in 0..(OUR_BUF as usize / MAX_PKT_PAYLOAD) {
        conn.recv_from_guest(&TxPacket {
            hdr: g.hdr(OP_RW, 0, chunk.len()),
            data: chunk.clone(),
        });
    }
    assert_eq!(conn.state(), State::Established);
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_RW, 0, 1),
        data: vec![1],
    });
    assert!(matches!(
        conn.reset_reason(),
        Some(ResetReason::CreditExceeded { .. })
    ));
    conn.stream_mut().write_budget = usize::MAX;
    conn.stream_mut().write_cap = usize::MAX;
    conn.flush_to_host();
    assert!(conn.stream().written.is_empty(), "no data moves once reset");
    drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
    assert!(g.got_rst);
    assert_eq!(conn.state(), State::Closed);
}

#[test]
fn half_close_both_ways_then_rst_after_the_guest_closes() {
    let fake = Fake {
        to_read: b"reply".iter().copied().collect(),
        read_budget: usize::MAX,
        read_cap: 64,
        write_budget: 3,
        write_cap: 64,
        ..Fake::default()
    };
    let mut conn = Connection::accept(fake, &request(65536), OUR_BUF);
    let mut g = Guest::new(65536);
    drain(&mut conn, &mut g, 0);
    // HTTP/1.0 style: the guest writes the request and shuts down its write side.
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_RW, 0, 8),
        data: b"GET /\r\n\r".to_vec(),
    });
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_SHUTDOWN, SHUTDOWN_SEND, 0),
        data: vec![],
    });
    assert!(
        !conn.stream().shut_wr,
        "SHUT_WR waits until the buffered bytes are written"
    );
    conn.stream_mut().write_budget = 100;
    conn.flush_to_host();
    assert_eq!(conn.stream().written, b"GET /\r\n\r");
    assert!(conn.stream().shut_wr);
    // The reply still flows to the guest, then the host's EOF.
    conn.stream_mut().eof = true;
    drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
    assert_eq!(g.received, b"reply");
    assert!(g.got_eof && !g.got_rst);
    // The guest closes: RST from us ends it.
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND, 0),
        data: vec![],
    });
    drain(&mut conn, &mut g, MAX_PKT_PAYLOAD);
    assert!(g.got_rst);
    assert_eq!(conn.state(), State::Closed);
}

#[test]
fn host_errors_and_guest_rst_end_the_connection() {
    let mut conn = Connection::accept(
        Fake {
            fail_writes: true,
            ..Fake::default()
        },
        &request(4096),
        OUR_BUF,
    );
    let mut g = Guest::new(4096);
    drain(&mut conn, &mut g, 0);
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_RW, 0, 1),
        data: vec![1],
    });
    assert_eq!(
        conn.reset_reason(),
        Some(&ResetReason::HostError(io::ErrorKind::BrokenPipe))
    );
    drain(&mut conn, &mut g, 0);
    assert!(g.got_rst);

    let mut conn = Connection::accept(Fake::default(), &request(4096), OUR_BUF);
    let mut g = Guest::new(4096);
    drain(&mut conn, &mut g, 0);
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_RST, 0, 0),
        data: vec![],
    });
    assert_eq!(conn.state(), State::Closed);
    assert!(
        conn.next_for_guest(MAX_PKT_PAYLOAD).is_none(),
        "nothing is sent after the guest's RST"
    );
}

#[test]
fn credit_request_gets_an_update_and_unknown_ops_reset() {
    let mut conn = Connection::accept(Fake::default(), &request(4096), OUR_BUF);
    let mut g = Guest::new(4096);
    drain(&mut conn, &mut g, 0);
    assert!(conn.next_for_guest(MAX_PKT_PAYLOAD).is_none());
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_CREDIT_REQUEST, 0, 0),
        data: vec![],
    });
    let (h, _) = conn
        .next_for_guest(MAX_PKT_PAYLOAD)
        .expect("a credit update");
    assert_eq!((h.op, h.buf_alloc), (OP_CREDIT_UPDATE, OUR_BUF));
    conn.recv_from_guest(&TxPacket {
        hdr: g.hdr(OP_REQUEST, 0, 0),
        data: vec![],
    });
    assert_eq!(
        conn.reset_reason(),
        Some(&ResetReason::UnexpectedOp(OP_REQUEST))
    );
}

#[test]
fn rst_for_swaps_the_addresses() {
    let r = rst_for(&request(4096));
    assert_eq!(
        (r.src_cid, r.dst_cid, r.src_port, r.dst_port, r.op),
        (HOST_CID, 3, 1024, 50000, OP_RST)
    );
}
