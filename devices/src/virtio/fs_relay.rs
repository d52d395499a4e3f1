//! virtio-fs through bounce buffers, for a guest whose RAM the backend must not map.
//!
//! A restored or forked sandbox maps its guest RAM `MAP_PRIVATE` from the snapshot's memory file
//! (copy-on-write: forks share every page none of them wrote, and a restore copies nothing). A
//! vhost-user backend that mapped that file would not see the guest's private copies, so here
//! the backend (virtiofsd) maps only a small shared region of ours (the "shadow"), and this
//! worker serves the guest's queues itself: each request's readable bytes are copied into the
//! shadow and offered to the backend on a shadow ring of the same queue, as one readable and one
//! writable descriptor; when the backend has used them, what it wrote is copied back into the
//! guest's writable descriptors and the guest's chain is used with that length.
//!
//! Everything read from the guest's rings goes through `virtio_queue` (chain length, loops and
//! indirect tables bounded there); a chain this relay cannot forward (a readable descriptor
//! after a writable one, more bytes than the shadow holds, an address outside guest RAM) is
//! used with nothing written, an error for that request only. The backend is checked too: a
//! used entry naming a request it was not given is ignored, and it can never write more than
//! the request's writable bytes back.

use super::hold::WorkerHold;
use super::InterruptStatus;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use virtio_queue::{desc::split::Descriptor, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Each shadow ring's size: two descriptors per request, so half as many requests in flight.
pub const RING_SIZE: u16 = 256;
/// Requests in flight per ring, at most.
pub const SLOTS: u16 = RING_SIZE / 2;
/// Ring `q` lives at `q * RING_AREA` in the shadow: its descriptor table, then the available
/// ring (4 + 2 * 256 + 2 bytes), then the used ring (4 + 8 * 256 + 2 bytes).
const RING_AREA: u64 = 16 << 10;
pub const AVAIL_OFF: u64 = 4 << 10;
pub const USED_OFF: u64 = 8 << 10;
/// Request data lives after the rings.
pub const DATA_START: u64 = 64 << 10;
/// What may be in flight at once. A FUSE request is at most a megabyte and some headers
/// (virtiofsd's largest read or write); a request larger than this whole area is refused.
pub const DATA_LEN: u64 = 16 << 20;
/// The shadow region's length, as the VMM makes it (a memfd the backend maps).
pub const SHADOW_LEN: u64 = DATA_START + DATA_LEN;
// The rings fit their areas, and the data follows them.
const _: () = {
    let n = RING_SIZE as u64;
    assert!(16 * n <= AVAIL_OFF);
    assert!(AVAIL_OFF + 4 + 2 * n + 2 <= USED_OFF);
    assert!(USED_OFF + 4 + 8 * n + 2 <= RING_AREA);
    assert!(2 * RING_AREA <= DATA_START);
};
/// Data allocations are rounded up to this.
const ALIGN: u64 = 64;
/// `virtio_ring.h`.
const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;

/// Where ring `q`'s parts are, as shadow addresses: (descriptors, available, used).
pub fn ring_addresses(q: usize) -> (u64, u64, u64) {
    let base = q as u64 * RING_AREA;
    (base, base + AVAIL_OFF, base + USED_OFF)
}

/// First-fit allocation of the data area, freed ranges merged with their neighbours.
#[derive(Debug)]
struct Space {
    /// start -> length of each free range.
    free: BTreeMap<u64, u64>,
}

impl Space {
    fn new(start: u64, len: u64) -> Self {
        Space {
            free: BTreeMap::from([(start, len)]),
        }
    }

    fn take(&mut self, len: u64) -> Option<u64> {
        let (&at, &have) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&at);
        if have > len {
            self.free.insert(at + len, have - len);
        }
        Some(at)
    }

    fn give(&mut self, mut at: u64, mut len: u64) {
        if let Some((&prev, &plen)) = self.free.range(..at).next_back() {
            if prev + plen == at {
                self.free.remove(&prev);
                at = prev;
                len += plen;
            }
        }
        if let Some(&next_len) = self.free.get(&(at + len)) {
            self.free.remove(&(at + len));
            len += next_len;
        }
        self.free.insert(at, len);
    }
}

/// A guest request the backend has.
#[derive(Debug)]
struct Pending {
    /// The guest chain's head, to use it with.
    head: u16,
    /// Its data in the shadow: `rlen` readable bytes, then `wlen` writable ones.
    off: u64,
    rlen: u64,
    wlen: u64,
    /// Where the reply goes in the guest, in order.
    writes: Vec<(GuestAddress, u32)>,
}

impl Pending {
    fn span(&self) -> u64 {
        (self.rlen + self.wlen).div_ceil(ALIGN) * ALIGN
    }
}

/// One queue: the guest's ring and its shadow twin.
pub(crate) struct Ring {
    pub(crate) guest: Queue,
    /// The guest's notifications (the transport's ioeventfd).
    pub(crate) guest_kick: EventFd,
    /// The backend says it used shadow buffers.
    pub(crate) call: EventFd,
    /// We say the backend has new shadow buffers.
    pub(crate) kick: EventFd,
    base: u64,
    next_avail: u16,
    next_used: u16,
    slots: Vec<Option<Pending>>,
    free: Vec<u16>,
}

impl Ring {
    pub(crate) fn new(
        q: usize,
        guest: Queue,
        guest_kick: EventFd,
        call: EventFd,
        kick: EventFd,
    ) -> Self {
        Ring {
            guest,
            guest_kick,
            call,
            kick,
            base: ring_addresses(q).0,
            next_avail: 0,
            next_used: 0,
            slots: (0..SLOTS).map(|_| None).collect(),
            free: (0..SLOTS).rev().collect(),
        }
    }

    fn in_flight(&self) -> usize {
        usize::from(SLOTS) - self.free.len()
    }
}

impl Relay {
    /// A relay with no thread, backend or events of its own, for driving it by hand
    /// ([`Relay::pass`]): the fuzz target `tests/fuzz/fuzz_targets/fs_relay.rs`.
    pub fn standalone(
        mem: GuestMemoryMmap,
        shadow: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Arc<InterruptStatus>,
    ) -> io::Result<Self> {
        let ev = || EventFd::new(libc::EFD_NONBLOCK);
        let rings = queues
            .into_iter()
            .enumerate()
            .map(|(i, q)| Ok(Ring::new(i, q, ev()?, ev()?, ev()?)))
            .collect::<io::Result<_>>()?;
        Ok(Relay::new(
            mem,
            shadow,
            rings,
            interrupt,
            WorkerHold::new()?,
            ev()?,
            Epoll::new()?,
        ))
    }

    /// The requests ring `i` has given the backend and not had back.
    pub fn in_flight(&self, i: usize) -> usize {
        self.rings.get(i).map_or(0, Ring::in_flight)
    }
}

/// Why a chain was not forwarded.
enum Refused {
    /// Not now: no slot or no room in the shadow until the backend finishes something.
    Later,
    /// Never: the chain is unusable; it is used with nothing written.
    Bad(String),
}

const TOKEN_KILL: u64 = 1 << 32;
const TOKEN_HOLD: u64 = (1 << 32) + 1;

/// The worker: serves every ring until killed.
pub struct Relay {
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) shadow: GuestMemoryMmap,
    pub(crate) rings: Vec<Ring>,
    pub(crate) interrupt: Arc<InterruptStatus>,
    pub(crate) hold: WorkerHold,
    pub(crate) kill: EventFd,
    /// Made before the thread's seccomp filter, which has no epoll_create1.
    epoll: Epoll,
    space: Space,
    /// A snapshot asked us to stop: take no more requests, stop once none is in flight.
    draining: bool,
    buf: Vec<u8>,
}

impl Relay {
    pub(crate) fn new(
        mem: GuestMemoryMmap,
        shadow: GuestMemoryMmap,
        rings: Vec<Ring>,
        interrupt: Arc<InterruptStatus>,
        hold: WorkerHold,
        kill: EventFd,
        epoll: Epoll,
    ) -> Self {
        Relay {
            mem,
            shadow,
            rings,
            interrupt,
            hold,
            kill,
            epoll,
            space: Space::new(DATA_START, DATA_LEN),
            draining: false,
            buf: Vec::new(),
        }
    }

    pub(crate) fn run(mut self) {
        if let Err(e) = self.run_inner() {
            tracing::error!("virtio-fs relay stopped: {e}");
        }
    }

    fn run_inner(&mut self) -> io::Result<()> {
        let mut fds = vec![
            (self.kill.as_raw_fd(), TOKEN_KILL),
            (self.hold.wake_fd(), TOKEN_HOLD),
        ];
        for (i, r) in self.rings.iter().enumerate() {
            fds.push((r.guest_kick.as_raw_fd(), 2 * i as u64));
            fds.push((r.call.as_raw_fd(), 2 * i as u64 + 1));
        }
        for (fd, token) in fds {
            self.epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        let mut events = vec![EpollEvent::default(); 16];
        // Requests the driver queued before we started (a restored guest's) are looked at once.
        self.pass();
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_KILL => return Ok(()),
                    TOKEN_HOLD => {
                        if self.hold.requested() {
                            self.draining = true;
                        }
                    }
                    t => {
                        let Some(r) = self.rings.get(usize::try_from(t / 2).unwrap_or(usize::MAX))
                        else {
                            continue;
                        };
                        let _ = if t % 2 == 0 {
                            r.guest_kick.read()
                        } else {
                            r.call.read()
                        };
                    }
                }
            }
            self.pass();
        }
    }

    /// Take what the backend finished, then (unless draining) what the guest queued; a drained
    /// relay parks until the snapshot lets it go.
    pub fn pass(&mut self) {
        for i in 0..self.rings.len() {
            self.complete(i);
        }
        if self.draining && self.rings.iter().all(|r| r.in_flight() == 0) {
            self.hold.wait_if_held();
            self.draining = false;
        }
        if !self.draining {
            for i in 0..self.rings.len() {
                self.pump(i);
            }
        }
    }

    /// Forward the guest's queued requests on ring `i` while there is room.
    fn pump(&mut self, i: usize) {
        let Relay {
            mem,
            shadow,
            rings,
            space,
            buf,
            interrupt,
            ..
        } = self;
        let ring = &mut rings[i];
        let (mut forwarded, mut used) = (false, false);
        // A chain was taken since we last asked for a kick (see the vsock worker's process_tx
        // on rings whose index we cannot use).
        let mut progressed = true;
        'ask: loop {
            while !ring.free.is_empty() {
                let Some(chain) = ring.guest.pop_descriptor_chain(&*mem) else {
                    break;
                };
                progressed = true;
                let head = chain.head_index();
                match forward(mem, shadow, ring, space, buf, head, chain) {
                    Ok(()) => forwarded = true,
                    Err(Refused::Later) => {
                        // The backend's next used buffer brings us back here.
                        ring.guest.go_to_previous_position();
                        break 'ask;
                    }
                    Err(Refused::Bad(e)) => {
                        tracing::warn!("virtio-fs: refused a request: {e}");
                        if let Err(e) = ring.guest.add_used(&*mem, head, 0) {
                            tracing::warn!("virtio-fs: used ring: {e:?}");
                        }
                        used = true;
                    }
                }
            }
            if ring.free.is_empty() {
                break;
            }
            let more = match ring.guest.enable_notification(&*mem) {
                Ok(more) => more,
                Err(e) => {
                    tracing::warn!("virtio-fs: notification: {e:?}");
                    false
                }
            };
            if !(more && progressed) {
                break;
            }
            progressed = false;
        }
        if forwarded {
            let idx = GuestAddress(ring.base + AVAIL_OFF + 2);
            if let Err(e) = shadow.store(ring.next_avail.to_le(), idx, Ordering::Release) {
                tracing::warn!("virtio-fs: shadow ring: {e}");
            }
            if let Err(e) = ring.kick.write(1) {
                tracing::warn!("virtio-fs: kicking the backend: {e}");
            }
        }
        if used {
            interrupt.signal_used_if_due(&mut ring.guest, mem, "virtio-fs");
        }
    }

    /// Copy back what the backend finished on ring `i` and use the guest's chains.
    fn complete(&mut self, i: usize) {
        let Relay {
            mem,
            shadow,
            rings,
            space,
            buf,
            interrupt,
            ..
        } = self;
        let ring = &mut rings[i];
        let used_idx =
            match shadow.load::<u16>(GuestAddress(ring.base + USED_OFF + 2), Ordering::Acquire) {
                Ok(v) => u16::from_le(v),
                Err(e) => {
                    tracing::warn!("virtio-fs: shadow used ring: {e}");
                    return;
                }
            };
        if used_idx.wrapping_sub(ring.next_used) > RING_SIZE {
            tracing::warn!(
                "virtio-fs: the backend's used index jumped from {} to {used_idx}; ignored",
                ring.next_used
            );
            ring.next_used = used_idx;
            return;
        }
        let mut used = false;
        while ring.next_used != used_idx {
            let entry = ring.base + USED_OFF + 4 + 8 * u64::from(ring.next_used % RING_SIZE);
            ring.next_used = ring.next_used.wrapping_add(1);
            let (Ok(id), Ok(len)) = (
                shadow.read_obj::<u32>(GuestAddress(entry)),
                shadow.read_obj::<u32>(GuestAddress(entry + 4)),
            ) else {
                continue;
            };
            let (id, len) = (u32::from_le(id), u32::from_le(len));
            let slot = usize::try_from(id / 2).unwrap_or(usize::MAX);
            let Some(p) = (id % 2 == 0)
                .then(|| ring.slots.get_mut(slot))
                .flatten()
                .and_then(Option::take)
            else {
                tracing::warn!("virtio-fs: the backend used a buffer it was not given ({id})");
                continue;
            };
            ring.free.push(slot as u16);
            let written = copy_back(mem, shadow, buf, &p, u64::from(len).min(p.wlen));
            space.give(p.off, p.span());
            if let Err(e) = ring.guest.add_used(&*mem, p.head, written) {
                tracing::warn!("virtio-fs: used ring: {e:?}");
            }
            used = true;
        }
        if used {
            interrupt.signal_used_if_due(&mut ring.guest, mem, "virtio-fs");
        }
    }
}

/// Offer the guest's chain `head` to the backend on `ring`'s shadow.
fn forward(
    mem: &GuestMemoryMmap,
    shadow: &GuestMemoryMmap,
    ring: &mut Ring,
    space: &mut Space,
    buf: &mut Vec<u8>,
    head: u16,
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
) -> Result<(), Refused> {
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    let (mut rlen, mut wlen) = (0u64, 0u64);
    for d in chain {
        if d.is_write_only() {
            writes.push((d.addr(), d.len()));
            wlen += u64::from(d.len());
        } else if !writes.is_empty() {
            return Err(Refused::Bad(
                "a readable descriptor after a writable one".into(),
            ));
        } else {
            reads.push((d.addr(), d.len()));
            rlen += u64::from(d.len());
        }
    }
    if rlen + wlen == 0 {
        return Err(Refused::Bad("a chain of no bytes".into()));
    }
    if rlen + wlen > DATA_LEN {
        return Err(Refused::Bad(format!(
            "{} bytes, more than the {DATA_LEN} this device relays at once",
            rlen + wlen
        )));
    }
    let mut p = Pending {
        head,
        off: 0,
        rlen,
        wlen,
        writes,
    };
    let Some(slot) = ring.free.last().copied() else {
        return Err(Refused::Later);
    };
    let Some(off) = space.take(p.span()) else {
        return Err(Refused::Later);
    };
    p.off = off;
    let mut at = off;
    for (addr, len) in reads {
        buf.resize(len as usize, 0);
        let copied = mem
            .read_slice(buf, addr)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                shadow
                    .write_slice(buf, GuestAddress(at))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = copied {
            space.give(p.off, p.span());
            return Err(Refused::Bad(format!("reading the request: {e}")));
        }
        at += u64::from(len);
    }
    ring.free.pop();
    // Slot k's descriptors are 2k (what the backend reads) and 2k + 1 (where it writes).
    let (first, second) = (2 * slot, 2 * slot + 1);
    let table = ring.base;
    let desc = |i: u16, addr: u64, len: u64, flags: u16, next: u16| {
        let d = Descriptor::new(addr, len as u32, flags, next);
        shadow.write_obj(d, GuestAddress(table + 16 * u64::from(i)))
    };
    let written = match (rlen, wlen) {
        (0, w) => desc(first, off, w, VRING_DESC_F_WRITE, 0),
        (r, 0) => desc(first, off, r, 0, 0),
        (r, w) => desc(first, off, r, VRING_DESC_F_NEXT, second)
            .and_then(|()| desc(second, off + r, w, VRING_DESC_F_WRITE, 0)),
    };
    let entry = ring.base + AVAIL_OFF + 4 + 2 * u64::from(ring.next_avail % RING_SIZE);
    let offered = written.and_then(|()| shadow.write_obj(first.to_le(), GuestAddress(entry)));
    if let Err(e) = offered {
        // The shadow is ours and large enough: this cannot happen short of a bug.
        ring.free.push(slot);
        space.give(p.off, p.span());
        return Err(Refused::Bad(format!("the shadow ring: {e}")));
    }
    ring.slots[usize::from(slot)] = Some(p);
    ring.next_avail = ring.next_avail.wrapping_add(1);
    Ok(())
}

/// Copy `len` bytes of the backend's reply into the request's writable descriptors; returns
/// how many reached the guest.
fn copy_back(
    mem: &GuestMemoryMmap,
    shadow: &GuestMemoryMmap,
    buf: &mut Vec<u8>,
    p: &Pending,
    len: u64,
) -> u32 {
    let mut left = len;
    let mut from = p.off + p.rlen;
    let mut done = 0u64;
    for &(addr, dlen) in &p.writes {
        if left == 0 {
            break;
        }
        let n = left.min(u64::from(dlen));
        buf.resize(n as usize, 0);
        let r = shadow
            .read_slice(buf, GuestAddress(from))
            .map_err(|e| e.to_string())
            .and_then(|()| mem.write_slice(buf, addr).map_err(|e| e.to_string()));
        if let Err(e) = r {
            tracing::warn!("virtio-fs: writing a reply into the guest: {e}");
            break;
        }
        left -= n;
        from += n;
        done += n;
    }
    // At most DATA_LEN.
    done as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::virtio::test_utils::{test_mem, CountingInterrupt};

    /// The guest's ring (16 entries) and where its parts are.
    const SIZE: u16 = 16;
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;

    fn relay() -> (Relay, Arc<CountingInterrupt>) {
        let mut q = Queue::new(SIZE).unwrap();
        q.try_set_desc_table_address(GuestAddress(DESC)).unwrap();
        q.try_set_avail_ring_address(GuestAddress(AVAIL)).unwrap();
        q.try_set_used_ring_address(GuestAddress(USED)).unwrap();
        q.set_ready(true);
        let shadow =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), SHADOW_LEN as usize)]).unwrap();
        let ev = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let line = Arc::new(CountingInterrupt::default());
        let relay = Relay::new(
            test_mem(),
            shadow,
            vec![Ring::new(0, q, ev(), ev(), ev())],
            Arc::new(InterruptStatus::new(line.clone())),
            WorkerHold::new().unwrap(),
            ev(),
            Epoll::new().unwrap(),
        );
        (relay, line)
    }

    /// The guest driver offers a chain of descriptors `first..` (address, length, writable).
    fn offer(r: &Relay, first: u16, chain: &[(u64, u32, bool)]) {
        for (k, &(addr, len, write)) in chain.iter().enumerate() {
            let i = first + k as u16;
            let mut flags = if write { VRING_DESC_F_WRITE } else { 0 };
            if k + 1 < chain.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            let d = Descriptor::new(addr, len, flags, i + 1);
            r.mem
                .write_obj(d, GuestAddress(DESC + 16 * u64::from(i)))
                .unwrap();
        }
        let idx: u16 = r.mem.read_obj(GuestAddress(AVAIL + 2)).unwrap();
        let slot = AVAIL + 4 + 2 * u64::from(idx % SIZE);
        r.mem.write_obj(first, GuestAddress(slot)).unwrap();
        r.mem
            .write_obj(idx.wrapping_add(1), GuestAddress(AVAIL + 2))
            .unwrap();
    }

    /// The guest's used ring: its index and entries (head, length).
    fn guest_used(r: &Relay) -> Vec<(u32, u32)> {
        let idx: u16 = r.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = USED + 4 + 8 * u64::from(i % SIZE);
                (
                    r.mem.read_obj(GuestAddress(at)).unwrap(),
                    r.mem.read_obj(GuestAddress(at + 4)).unwrap(),
                )
            })
            .collect()
    }

    /// The backend's view: the heads offered on shadow ring 0, and descriptor `i`.
    fn offered(r: &Relay) -> Vec<u16> {
        let idx: u16 = r.shadow.read_obj(GuestAddress(AVAIL_OFF + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = AVAIL_OFF + 4 + 2 * u64::from(i % RING_SIZE);
                r.shadow.read_obj(GuestAddress(at)).unwrap()
            })
            .collect()
    }
    fn shadow_desc(r: &Relay, i: u16) -> Descriptor {
        r.shadow.read_obj(GuestAddress(16 * u64::from(i))).unwrap()
    }

    /// The backend used shadow chain `id`, having written `len` bytes.
    fn backend_uses(r: &Relay, id: u32, len: u32) {
        let idx: u16 = r.shadow.read_obj(GuestAddress(USED_OFF + 2)).unwrap();
        let at = USED_OFF + 4 + 8 * u64::from(idx % RING_SIZE);
        r.shadow.write_obj(id, GuestAddress(at)).unwrap();
        r.shadow.write_obj(len, GuestAddress(at + 4)).unwrap();
        r.shadow
            .write_obj(idx.wrapping_add(1), GuestAddress(USED_OFF + 2))
            .unwrap();
    }

    #[test]
    fn a_request_and_its_reply_cross_the_shadow_and_the_reply_is_bounded() {
        let (mut r, line) = relay();
        r.mem
            .write_slice(b"a FUSE request", GuestAddress(0x8000))
            .unwrap();
        // The reply's room in two descriptors, the second in the other RAM region.
        offer(
            &r,
            0,
            &[
                (0x8000, 14, false),
                (0x9000, 4, true),
                (0x20_0000, 100, true),
            ],
        );
        r.pass();
        assert_eq!(offered(&r), [0]);
        let (d0, d1) = (shadow_desc(&r, 0), shadow_desc(&r, 1));
        assert_eq!((d0.len(), d0.has_next(), d0.next()), (14, true, 1));
        assert_eq!(
            (d1.len(), d1.is_write_only(), d1.has_next()),
            (104, true, false)
        );
        let mut got = [0u8; 14];
        r.shadow.read_slice(&mut got, d0.addr()).unwrap();
        assert_eq!(&got, b"a FUSE request");
        assert!(r.rings[0].kick.read().is_ok(), "the backend was not kicked");

        r.shadow.write_slice(b"the reply!", d1.addr()).unwrap();
        // The backend claims more than the request had room for: only the room is copied.
        backend_uses(&r, 0, 4096);
        r.pass();
        assert_eq!(guest_used(&r), [(0, 104)]);
        let (mut a, mut b) = ([0u8; 4], [0u8; 6]);
        r.mem.read_slice(&mut a, GuestAddress(0x9000)).unwrap();
        r.mem.read_slice(&mut b, GuestAddress(0x20_0000)).unwrap();
        assert_eq!((&a, &b), (b"the ", b"reply!"));
        // Each descriptor got only its own length: the byte after the first is untouched.
        let mut after = [0xffu8; 1];
        r.mem.read_slice(&mut after, GuestAddress(0x9004)).unwrap();
        assert_eq!(after, [0]);
        assert_eq!(line.count(), 1);
        assert_eq!(r.rings[0].in_flight(), 0);
        assert_eq!(r.space.free, BTreeMap::from([(DATA_START, DATA_LEN)]));
    }

    #[test]
    fn unusable_chains_are_used_empty_and_a_lying_backend_is_ignored() {
        let (mut r, _) = relay();
        // Readable after writable; a request outside guest RAM; one larger than the shadow.
        offer(&r, 0, &[(0x8000, 8, true), (0x9000, 8, false)]);
        offer(&r, 2, &[(0x50_0000, 8, false), (0x9000, 8, true)]);
        offer(
            &r,
            4,
            &[(0x8000, 8, false), (0x20_0000, DATA_LEN as u32, true)],
        );
        r.pass();
        assert_eq!(guest_used(&r), [(0, 0), (2, 0), (4, 0)]);
        assert!(offered(&r).is_empty());
        // A backend that names chains it was not given, or jumps its index, changes nothing.
        offer(&r, 6, &[(0x8000, 8, false), (0x9000, 8, true)]);
        r.pass();
        assert_eq!(offered(&r), [0]);
        backend_uses(&r, 1, 8);
        backend_uses(&r, 40, 8);
        r.pass();
        assert_eq!(guest_used(&r).len(), 3);
        r.shadow
            .write_obj(1000u16, GuestAddress(USED_OFF + 2))
            .unwrap();
        r.pass();
        assert_eq!(guest_used(&r).len(), 3);
        assert_eq!(r.rings[0].in_flight(), 1);
    }

    #[test]
    fn a_full_shadow_holds_requests_back_until_the_backend_frees_room() {
        let (mut r, _) = relay();
        let big = (DATA_LEN / 2 + 4096) as u32;
        offer(&r, 0, &[(0x8000, 8, false), (0x20_0000, big, true)]);
        offer(&r, 2, &[(0x8000, 8, false), (0x20_0000, big, true)]);
        r.pass();
        // Only one fits; the other waits in the guest's ring, not dropped.
        assert_eq!(offered(&r), [0]);
        assert!(guest_used(&r).is_empty());
        backend_uses(&r, 0, 0);
        r.pass();
        // The freed slot carries the second request.
        assert_eq!(offered(&r), [0, 0]);
        assert_eq!(guest_used(&r), [(0, 0)]);
        backend_uses(&r, 0, 3);
        r.pass();
        assert_eq!(guest_used(&r), [(0, 0), (2, 3)]);
    }

    #[test]
    fn space_is_taken_first_fit_and_given_back_merged() {
        let mut s = Space::new(100, 1000);
        let a = s.take(300).unwrap();
        let b = s.take(300).unwrap();
        let c = s.take(300).unwrap();
        assert_eq!((a, b, c), (100, 400, 700));
        assert_eq!(s.take(200), None);
        s.give(b, 300);
        assert_eq!(s.take(301), None);
        s.give(a, 300);
        assert_eq!(s.take(600), Some(100));
        s.give(100, 600);
        s.give(c, 300);
        assert_eq!(s.free, BTreeMap::from([(100, 1000)]));
    }
}
