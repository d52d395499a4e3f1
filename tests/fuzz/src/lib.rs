//! Shared pieces of amvm's fuzz targets: a byte reader with an explicit, documented format (so
//! seeds can be written by hand or by `seeds/gen.py`), a small guest memory with a hole, biased
//! address and length generators, a scripted host stream, and models that check what a vsock
//! connection sends against what the guest allowed.
//!
//! Every target reads its input through [`Input`]: fixed-width little-endian integers, and zeros
//! once the input runs out (so every input is valid and a short seed still says something).

use amvm_devices::vsock::connection::{HostStream, Outgoing};
use amvm_devices::vsock::defs::*;
use amvm_devices::vsock::muxer::Backend;
use amvm_devices::vsock::packet::{Header, PacketError};
use std::collections::VecDeque;
use std::io;
use std::num::Wrapping;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// `AMVM_FUZZ_DEBUG=1`: targets print what each input did (to check seeds and crashes).
pub fn debug() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("AMVM_FUZZ_DEBUG").is_some())
}

/// `eprintln!` when [`debug`] is on.
#[macro_export]
macro_rules! trace {
    ($($t:tt)*) => {
        if $crate::debug() {
            eprintln!($($t)*);
        }
    };
}

// --- Input -----------------------------------------------------------------------------------

/// Fuzz input as a stream of little-endian integers; reads past the end give zeros.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    /// Up to `n` bytes (fewer if the input ends).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let got = self.bytes(N);
        b[..got.len()].copy_from_slice(got);
        b
    }
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }
}

// --- Guest memory ----------------------------------------------------------------------------

/// Guest RAM for the targets: two 64 KiB regions with a 64 KiB hole between them.
pub const REGION0: (u64, u64) = (0, 0x1_0000);
pub const REGION1: (u64, u64) = (0x2_0000, 0x1_0000);

pub fn guest_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[
        (GuestAddress(REGION0.0), REGION0.1 as usize),
        (GuestAddress(REGION1.0), REGION1.1 as usize),
    ])
    .expect("fuzz guest memory")
}

/// Both regions' bytes, for before/after comparisons.
pub fn snapshot(mem: &GuestMemoryMmap) -> Vec<u8> {
    let mut out = vec![0u8; (REGION0.1 + REGION1.1) as usize];
    let (a, b) = out.split_at_mut(REGION0.1 as usize);
    mem.read_slice(a, GuestAddress(REGION0.0))
        .expect("region 0");
    mem.read_slice(b, GuestAddress(REGION1.0))
        .expect("region 1");
    out
}

/// The snapshot index of a guest address, if it is RAM.
pub fn snap_index(addr: u64) -> Option<usize> {
    if addr < REGION0.0 + REGION0.1 {
        Some((addr - REGION0.0) as usize)
    } else if (REGION1.0..REGION1.0 + REGION1.1).contains(&addr) {
        Some((addr - REGION1.0 + REGION0.1) as usize)
    } else {
        None
    }
}

/// Is `addr..addr+len` entirely RAM (one region: they are not adjacent)?
pub fn in_ram(addr: u64, len: u64) -> bool {
    if len == 0 {
        return true;
    }
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    [REGION0, REGION1]
        .iter()
        .any(|&(s, l)| addr >= s && end <= s + l)
}

/// Write fuzz-chosen bytes at fuzz-chosen places: `count: u8`, then per write
/// `addr` (see [`addr`]), `len: u8`, `len` bytes. Writes outside RAM are skipped.
pub fn scribble(mem: &GuestMemoryMmap, inp: &mut Input) {
    let count = inp.u8() % 16;
    for _ in 0..count {
        let a = addr(inp);
        let n = inp.u8() as usize;
        let data = inp.bytes(n);
        let _ = mem.write_slice(data, GuestAddress(a));
    }
}

/// A guest-physical address, biased to the interesting places. `class: u8` then a value.
pub fn addr(inp: &mut Input) -> u64 {
    let class = inp.u8();
    match class % 10 {
        0 => REGION0.0 + u64::from(inp.u16()) % REGION0.1,
        1 => REGION1.0 + u64::from(inp.u16()) % REGION1.1,
        // Just below a region's end: a range that runs off it.
        2 => REGION0.0 + REGION0.1 - 1 - u64::from(inp.u8()),
        3 => REGION1.0 + REGION1.1 - 1 - u64::from(inp.u8()),
        // In the hole.
        4 => REGION0.0 + REGION0.1 + u64::from(inp.u16()),
        5 => inp.u64(),
        6 => u64::MAX - u64::from(inp.u8()),
        // Page-aligned in RAM.
        7 => REGION0.0 + (u64::from(inp.u8() & 0xf) << 12),
        8 => REGION1.0 + (u64::from(inp.u8() & 0xf) << 12),
        _ => u64::from(inp.u8()),
    }
}

/// A descriptor length, biased. `class: u8` then a value.
pub fn len(inp: &mut Input) -> u32 {
    let class = inp.u8();
    match class % 8 {
        0 => 0,
        1 => u32::from(inp.u8()),
        2 => u32::from(inp.u16()),
        3 => inp.u32(),
        4 => HDR_LEN as u32 + u32::from(inp.u8() % 8) - 4,
        5 => u32::from(inp.u8()) << 8,
        6 => u32::MAX - u32::from(inp.u8()),
        _ => (HDR_LEN + MAX_PKT_PAYLOAD) as u32 + u32::from(inp.u8() % 4) - 2,
    }
}

/// A queue of at most `max_size` entries as a driver could program it: a size class `u8` (then
/// `u8` or `u16`), three ring addresses ([`addr`], aligned down as split rings need),
/// `event_idx: bool`; `None` unless it passes `Queue::is_valid`, as the transport requires.
pub fn driver_queue(mem: &GuestMemoryMmap, inp: &mut Input, max_size: u16) -> Option<Queue> {
    let mut q = Queue::new(max_size).expect("queue");
    let size = match inp.u8() % 4 {
        0..=2 => 1u16 << (inp.u8() % 9),
        _ => inp.u16(),
    };
    q.try_set_size(size).ok()?;
    // Split-ring alignment: 16 for the table, 2 for avail, 4 for used.
    let _ = q.try_set_desc_table_address(GuestAddress(addr(inp) & !0xf));
    let _ = q.try_set_avail_ring_address(GuestAddress(addr(inp) & !0x1));
    let _ = q.try_set_used_ring_address(GuestAddress(addr(inp) & !0x3));
    q.set_event_idx(inp.bool());
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

/// Descriptor flags (virtio_ring.h).
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// Descriptor flags, biased: `class: u8`, then for the last class a raw `u16`.
pub fn flags(inp: &mut Input) -> u16 {
    match inp.u8() % 6 {
        0 => 0,
        1 => F_NEXT,
        2 => F_WRITE,
        3 => F_WRITE | F_NEXT,
        4 => F_INDIRECT,
        _ => inp.u16(),
    }
}

/// One descriptor: [`addr`], [`len`], [`flags`], `next: u16`.
pub fn descriptor(inp: &mut Input) -> Descriptor {
    let a = addr(inp);
    let l = len(inp);
    let f = flags(inp);
    let next = inp.u16();
    Descriptor::new(a, l, f, next)
}

/// Where [`one_chain_queue`] puts its rings: the top pages of region 1.
pub const TABLE: u64 = REGION1.0 + 0xf000;
pub const AVAIL: u64 = REGION1.0 + 0xe000;
pub const USED: u64 = REGION1.0 + 0xe800;

/// A ready queue of `1 << (size_log: u8 % 9)` entries whose descriptor table (at [`TABLE`]) gets
/// `count: u8 % 32` entries `(index: u8, descriptor)`, with one available chain whose head is
/// `head` (`class: u8`, then `u8` modulo the size or a raw `u16`). Chains may loop, point
/// anywhere, or go through indirect tables: the guest wrote them.
pub fn one_chain_queue(mem: &GuestMemoryMmap, inp: &mut Input) -> Queue {
    let size = 1u16 << (inp.u8() % 9);
    let mut q = Queue::new(256).expect("queue");
    q.try_set_size(size).expect("power of two");
    q.try_set_desc_table_address(GuestAddress(TABLE))
        .expect("aligned");
    q.try_set_avail_ring_address(GuestAddress(AVAIL))
        .expect("aligned");
    q.try_set_used_ring_address(GuestAddress(USED))
        .expect("aligned");
    q.set_ready(true);
    assert!(q.is_valid(mem));
    let count = inp.u8() % 32;
    for _ in 0..count {
        let i = u64::from(inp.u8()) % u64::from(size);
        let d = descriptor(inp);
        mem.write_obj(RawDescriptor::from(d), GuestAddress(TABLE + i * 16))
            .expect("table in RAM");
    }
    let head = match inp.u8() % 4 {
        0..=2 => u16::from(inp.u8()) % size,
        _ => inp.u16(),
    };
    mem.write_obj(head.to_le(), GuestAddress(AVAIL + 4))
        .expect("ring in RAM");
    mem.write_obj(1u16.to_le(), GuestAddress(AVAIL + 2))
        .expect("ring in RAM");
    q
}

// --- Reference packet code -------------------------------------------------------------------

/// What `read_tx` must return, written the obvious way: flatten the chain byte by byte.
pub fn reference_read_tx(
    mem: &GuestMemoryMmap,
    descs: &[Descriptor],
) -> Result<(Header, Vec<u8>), PacketError> {
    let mut bytes: Vec<u8> = Vec::new();
    let mut seen = 0usize;
    let mut hdr: Option<Header> = None;
    for d in descs {
        if d.is_write_only() {
            return Err(PacketError::WritableInTx);
        }
        if !in_ram(d.addr().0, u64::from(d.len())) {
            return Err(PacketError::BadAddress {
                addr: d.addr().0,
                len: d.len(),
            });
        }
        seen = seen.saturating_add(d.len() as usize);
        // Never read more than the packet needs (the header's claim is checked first).
        let mut off = 0u64;
        while off < u64::from(d.len()) {
            let need = match hdr {
                None => HDR_LEN - bytes.len(),
                Some(h) => HDR_LEN + h.len as usize - bytes.len(),
            };
            if need == 0 {
                break;
            }
            let n = (u64::from(d.len()) - off).min(need as u64) as usize;
            let start = bytes.len();
            bytes.resize(start + n, 0);
            mem.read_slice(&mut bytes[start..], GuestAddress(d.addr().0 + off))
                .expect("range checked");
            off += n as u64;
            if hdr.is_none() && bytes.len() == HDR_LEN {
                let h = Header::from_bytes(bytes[..HDR_LEN].try_into().expect("44 bytes"));
                if h.len as usize > MAX_PKT_PAYLOAD {
                    return Err(PacketError::PayloadTooLarge(h.len));
                }
                hdr = Some(h);
            }
        }
        if let Some(h) = hdr {
            if bytes.len() == HDR_LEN + h.len as usize {
                return Ok((h, bytes[HDR_LEN..].to_vec()));
            }
        }
    }
    Err(PacketError::Truncated {
        got: seen,
        need: HDR_LEN + hdr.map_or(0, |h| h.len as usize),
    })
}

/// What `write_rx` must return, and the guest memory it must leave (`snap` is the memory before).
pub fn reference_write_rx(
    snap: &[u8],
    descs: &[Descriptor],
    hdr: &Header,
    data: &[u8],
) -> (Result<u32, PacketError>, Vec<u8>) {
    let mut h = *hdr;
    h.len = data.len() as u32;
    let mut wire = h.to_bytes().to_vec();
    wire.extend_from_slice(data);
    let need = wire.len();
    let mut room = 0usize;
    let mut used = Vec::new();
    for d in descs {
        if !d.is_write_only() {
            return (Err(PacketError::ReadOnlyInRx), snap.to_vec());
        }
        if !in_ram(d.addr().0, u64::from(d.len())) {
            return (
                Err(PacketError::BadAddress {
                    addr: d.addr().0,
                    len: d.len(),
                }),
                snap.to_vec(),
            );
        }
        room = room.saturating_add(d.len() as usize);
        used.push(*d);
        if room >= need {
            break;
        }
    }
    if room < need {
        return (Err(PacketError::RxTooSmall { room, need }), snap.to_vec());
    }
    let mut after = snap.to_vec();
    let mut pos = 0usize;
    for d in used {
        for i in 0..u64::from(d.len()) {
            if pos == need {
                break;
            }
            let at = snap_index(d.addr().0 + i).expect("range checked");
            after[at] = wire[pos];
            pos += 1;
        }
    }
    (Ok(need as u32), after)
}

// --- A scripted host stream ------------------------------------------------------------------

/// What one read or write call on a [`FakeStream`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoStep {
    /// Transfer up to this many bytes (at least 1).
    Bytes(usize),
    WouldBlock,
    Interrupted,
    /// `Ok(0)`: EOF for a read; a write that took nothing.
    Zero,
    Fail(io::ErrorKind),
}

impl IoStep {
    /// `kind: u8`, then for `Bytes` a `u16` count.
    pub fn parse(inp: &mut Input) -> IoStep {
        match inp.u8() % 8 {
            0..=2 => IoStep::Bytes(usize::from(inp.u16()).max(1)),
            3 => IoStep::Bytes(usize::MAX),
            4 => IoStep::WouldBlock,
            5 => IoStep::Interrupted,
            6 => IoStep::Zero,
            _ => IoStep::Fail(match inp.u8() % 4 {
                0 => io::ErrorKind::BrokenPipe,
                1 => io::ErrorKind::ConnectionReset,
                2 => io::ErrorKind::NotConnected,
                _ => io::ErrorKind::Other,
            }),
        }
    }
}

/// A host endpoint that does exactly what its scripts say; with an empty script every call is
/// `WouldBlock` (and `shutdown_write` succeeds). It records everything that crossed it.
#[derive(Debug, Default)]
pub struct FakeStream {
    /// Which `connect` made it (for [`Ports`]).
    pub id: u64,
    pub reads: VecDeque<IoStep>,
    pub writes: VecDeque<IoStep>,
    pub shutdowns: VecDeque<IoStep>,
    /// Bytes the host accepted from the guest.
    pub written: Vec<u8>,
    /// Bytes the host produced for the guest.
    pub produced: Vec<u8>,
    pub shut_wr: bool,
    pub eof_returned: bool,
    pub write_calls: usize,
}

impl HostStream for FakeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.reads.pop_front().unwrap_or(IoStep::WouldBlock) {
            IoStep::Bytes(n) => {
                let k = n.min(buf.len());
                for b in buf.iter_mut().take(k) {
                    // A recognizable, position-dependent pattern.
                    *b = (self.produced.len() as u8).wrapping_mul(31) ^ 0x5a;
                    self.produced.push(*b);
                }
                Ok(k)
            }
            IoStep::WouldBlock => Err(io::ErrorKind::WouldBlock.into()),
            IoStep::Interrupted => Err(io::ErrorKind::Interrupted.into()),
            IoStep::Zero => {
                self.eof_returned = true;
                Ok(0)
            }
            IoStep::Fail(k) => Err(k.into()),
        }
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        assert!(
            !self.shut_wr,
            "write to the host stream after shutdown(SHUT_WR)"
        );
        self.write_calls += 1;
        assert!(
            self.write_calls < 1 << 20,
            "flush_to_host does not terminate"
        );
        match self.writes.pop_front().unwrap_or(IoStep::WouldBlock) {
            IoStep::Bytes(n) => {
                let k = n.min(buf.len());
                self.written.extend_from_slice(&buf[..k]);
                Ok(k)
            }
            IoStep::WouldBlock => Err(io::ErrorKind::WouldBlock.into()),
            IoStep::Interrupted => Err(io::ErrorKind::Interrupted.into()),
            IoStep::Zero => Ok(0),
            IoStep::Fail(k) => Err(k.into()),
        }
    }
    fn shutdown_write(&mut self) -> io::Result<()> {
        assert!(!self.shut_wr, "shutdown(SHUT_WR) twice");
        match self.shutdowns.pop_front() {
            Some(IoStep::Fail(k)) => Err(k.into()),
            _ => {
                self.shut_wr = true;
                Ok(())
            }
        }
    }
}

// --- What a connection may send -------------------------------------------------------------

/// A guest packet for a connection: `op: u8` (biased to the real ops), `flags` (class `u8`,
/// raw `u32` for the last), `buf_alloc` (class `u8`, then `u16` or `u32` for two of them),
/// `fwd_cnt: u32`, the payload length (class `u8`: 0, a `u8` or a `u16`), then the payload
/// (padded with a pattern if the input ends first).
pub fn guest_packet(inp: &mut Input, base: &Header) -> (Header, Vec<u8>) {
    let op_byte = inp.u8();
    let op = if op_byte < 0xf0 {
        [
            OP_RW,
            OP_RW,
            OP_RW,
            OP_CREDIT_UPDATE,
            OP_CREDIT_REQUEST,
            OP_SHUTDOWN,
            OP_RST,
            OP_REQUEST,
            OP_RESPONSE,
        ][usize::from(op_byte) % 9]
    } else {
        u16::from(op_byte & 0xf) << (op_byte & 3)
    };
    let flags = match inp.u8() % 4 {
        0 => 0,
        1 => SHUTDOWN_SEND,
        2 => SHUTDOWN_RCV | SHUTDOWN_SEND,
        _ => inp.u32(),
    };
    let buf_alloc = match inp.u8() % 4 {
        0 => 256 * 1024,
        1 => u32::from(inp.u16()),
        2 => inp.u32(),
        _ => 0,
    };
    let fwd_cnt = inp.u32();
    let n = match inp.u8() % 4 {
        0 => 0,
        1 | 2 => usize::from(inp.u8()),
        _ => usize::from(inp.u16()),
    };
    let mut data = inp.bytes(n).to_vec();
    // A short input still says "a big packet": pad with a pattern.
    while data.len() < n {
        data.push(data.len() as u8);
    }
    let mut h = *base;
    h.op = op;
    h.flags = flags;
    h.buf_alloc = buf_alloc;
    h.fwd_cnt = fwd_cnt;
    h.len = data.len() as u32;
    (h, data)
}

/// The guest's view of one stream, enough to check every packet the host sends on it.
#[derive(Debug)]
pub struct StreamModel {
    pub guest_cid: u64,
    pub guest_port: u32,
    pub host_port: u32,
    pub our_buf_alloc: u32,
    /// The guest's last advertised receive buffer and consumed count.
    pub peer_buf_alloc: u32,
    pub peer_fwd: Wrapping<u32>,
    /// Payload bytes the host has sent in RW packets.
    pub sent: Wrapping<u32>,
    /// Every RW payload the guest sent, concatenated.
    pub guest_rw: Vec<u8>,
    /// Every RW payload the host sent, concatenated.
    pub delivered: Vec<u8>,
    pub rst_out: bool,
    pub eof_out: bool,
    pub guest_shut_rcv: bool,
    pub packets_out: usize,
    /// How far [`StreamModel::check_stream`] has compared (the streams only grow): checking
    /// only the new bytes keeps long inputs linear.
    written_checked: usize,
    delivered_checked: usize,
}

impl StreamModel {
    pub fn new(req: &Header, our_buf_alloc: u32) -> Self {
        StreamModel {
            guest_cid: req.src_cid,
            guest_port: req.src_port,
            host_port: req.dst_port,
            our_buf_alloc,
            peer_buf_alloc: req.buf_alloc,
            peer_fwd: Wrapping(req.fwd_cnt),
            sent: Wrapping(0),
            guest_rw: Vec::new(),
            delivered: Vec::new(),
            rst_out: false,
            eof_out: false,
            guest_shut_rcv: false,
            packets_out: 0,
            written_checked: 0,
            delivered_checked: 0,
        }
    }

    /// The guest sent `h` (with `data`) to this stream.
    pub fn guest_sent(&mut self, h: &Header, data: &[u8]) {
        self.peer_buf_alloc = h.buf_alloc;
        self.peer_fwd = Wrapping(h.fwd_cnt);
        match h.op {
            OP_RW => self.guest_rw.extend_from_slice(data),
            OP_SHUTDOWN if h.flags & SHUTDOWN_RCV != 0 => self.guest_shut_rcv = true,
            _ => {}
        }
    }

    /// The credit the guest granted: what the host may still send.
    pub fn credit(&self) -> u32 {
        self.peer_buf_alloc
            .saturating_sub((self.sent - self.peer_fwd).0)
    }

    /// Check a packet the host sent on this stream. `strict`: the packet certainly came from the
    /// connection (not a muxer RST for the same ports), so ordering rules apply too.
    pub fn host_sent(&mut self, (h, data): &Outgoing, max_payload: usize, strict: bool) {
        assert_eq!(h.src_cid, HOST_CID, "{h:?}");
        assert_eq!(h.dst_cid, self.guest_cid, "{h:?}");
        assert_eq!((h.src_port, h.dst_port), (self.host_port, self.guest_port));
        assert_eq!(h.type_, TYPE_STREAM);
        assert_eq!(h.len as usize, data.len(), "header length is the payload's");
        if h.op != OP_RW {
            assert!(data.is_empty(), "control packet with payload: {h:?}");
        }
        if strict {
            assert!(!self.rst_out, "packet after RST: {h:?}");
            if self.packets_out == 0 {
                // A guest that broke the protocol before our RESPONSE gets RST instead.
                assert!(
                    h.op == OP_RESPONSE || h.op == OP_RST,
                    "first packet must be RESPONSE or RST: {h:?}"
                );
            } else {
                assert_ne!(h.op, OP_RESPONSE, "second RESPONSE");
            }
        }
        if h.op != OP_RST {
            assert_eq!(h.buf_alloc, self.our_buf_alloc);
        }
        match h.op {
            OP_RW => {
                assert!(!data.is_empty(), "empty RW packet");
                assert!(
                    data.len() <= max_payload && data.len() <= MAX_PKT_PAYLOAD,
                    "RW of {} bytes, max_payload {max_payload}",
                    data.len()
                );
                assert!(
                    data.len() as u64 <= u64::from(self.credit()),
                    "host overran the guest's credit: sent {} with credit {} (buf_alloc {}, \
                     fwd_cnt {}, sent {})",
                    data.len(),
                    self.credit(),
                    self.peer_buf_alloc,
                    self.peer_fwd,
                    self.sent
                );
                assert!(!self.eof_out, "data after SHUTDOWN(SEND)");
                assert!(!self.guest_shut_rcv, "data after the guest's SHUTDOWN(RCV)");
                self.sent += data.len() as u32;
                self.delivered.extend_from_slice(data);
            }
            OP_SHUTDOWN => {
                assert_eq!(h.flags, SHUTDOWN_SEND);
                if strict {
                    assert!(!self.eof_out, "second SHUTDOWN(SEND)");
                }
                self.eof_out = true;
            }
            OP_RST => self.rst_out = true,
            OP_RESPONSE | OP_CREDIT_UPDATE => {}
            op => panic!("host sent op {op}: {h:?}"),
        }
        self.packets_out += 1;
    }

    /// Check the host stream against what the guest sent and the host produced.
    pub fn check_stream(&mut self, s: &FakeStream, counts: (u64, u64)) {
        let (w, d) = (self.written_checked, self.delivered_checked);
        assert!(
            s.written.len() <= self.guest_rw.len()
                && s.written[w..] == self.guest_rw[w..s.written.len()],
            "the host stream got bytes the guest did not send, or out of order"
        );
        self.written_checked = s.written.len();
        assert_eq!(counts.0, s.written.len() as u64, "bytes_to_host");
        assert_eq!(counts.1, self.delivered.len() as u64, "bytes_to_guest");
        assert!(
            self.delivered.len() == s.produced.len() && self.delivered[d..] == s.produced[d..],
            "the guest got other bytes than the host produced"
        );
        self.delivered_checked = self.delivered.len();
    }
}

// --- A muxer backend -------------------------------------------------------------------------

/// The ports amvm publishes, as the muxer sees them: 1024 and 1026 connect (to a
/// [`FakeStream`]), 1025 is published but its endpoint refuses, everything else is unpublished.
#[derive(Debug, Default)]
pub struct Ports {
    pub connects: u64,
    pub closed: Vec<Closed>,
}

/// One `Backend::closed` call: port, stream, byte counts (to host, to guest), error.
pub type Closed = (u32, FakeStream, (u64, u64), Option<String>);

impl Backend for Ports {
    type Stream = FakeStream;
    fn connect(&mut self, port: u32) -> Option<io::Result<FakeStream>> {
        match port {
            1024 | 1026 => {
                self.connects += 1;
                Some(Ok(FakeStream {
                    id: self.connects,
                    ..FakeStream::default()
                }))
            }
            1025 => Some(Err(io::ErrorKind::ConnectionRefused.into())),
            _ => None,
        }
    }
    fn closed(&mut self, port: u32, stream: FakeStream, counts: (u64, u64), error: Option<String>) {
        self.closed.push((port, stream, counts, error));
    }
}

/// A host port, biased to the published ones: `class: u8`, then maybe a raw `u32`.
pub fn host_port(inp: &mut Input) -> u32 {
    match inp.u8() % 6 {
        0 | 1 => 1024,
        2 => 1025,
        3 => 1026,
        4 => 9999,
        _ => inp.u32(),
    }
}

/// A guest port: one of four, or a raw `u32` (`class: u8`).
pub fn guest_port(inp: &mut Input) -> u32 {
    match inp.u8() % 5 {
        c @ 0..=3 => 50000 + u32::from(c),
        _ => inp.u32(),
    }
}

/// Script `count: u8 % 8` steps for one of a stream's calls: `which: u8` (0 read, 1 write,
/// 2 shutdown), then [`IoStep::parse`] each.
pub fn script(s: &mut FakeStream, inp: &mut Input) {
    let which = inp.u8() % 3;
    let count = inp.u8() % 8;
    for _ in 0..count {
        let step = IoStep::parse(inp);
        match which {
            0 => s.reads.push_back(step),
            1 => s.writes.push_back(step),
            _ => s.shutdowns.push_back(step),
        }
    }
}

/// A driver's write to its queue of `size` entries (descriptor table at `table`, available
/// ring at `avail`): `kind` 1 bumps the available index (`delta: u8`), 2 writes a descriptor
/// (`index: u16`, [`descriptor`]), 3 an available entry (`pos: u16`, `head: u16`); any other
/// kind writes nothing. Writes outside RAM are skipped.
pub fn driver_write(
    mem: &GuestMemoryMmap,
    inp: &mut Input,
    kind: u8,
    (size, table, avail): (u16, u64, u64),
) {
    match kind {
        1 => {
            let idx: u16 = mem.read_obj(GuestAddress(avail + 2)).unwrap_or(0);
            let idx = idx.wrapping_add(u16::from(inp.u8()));
            let _ = mem.write_obj(idx.to_le(), GuestAddress(avail + 2));
        }
        2 => {
            let i = u64::from(inp.u16() % size);
            let d = descriptor(inp);
            let _ = mem.write_obj(RawDescriptor::from(d), GuestAddress(table + i * 16));
        }
        3 => {
            let pos = u64::from(inp.u16() % size);
            let head = inp.u16();
            let _ = mem.write_obj(head.to_le(), GuestAddress(avail + 4 + 2 * pos));
        }
        _ => {}
    }
}
