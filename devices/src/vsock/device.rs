//! The vsock device behind the virtio-mmio transport, and its worker thread: the thin event
//! glue around the [`Muxer`]. The worker waits (epoll) on the TX and RX queue notifications,
//! on every host stream that has something to do, and on a kill event; it moves guest packets
//! into the muxer, fills guest RX buffers from it, and raises the interrupt when it used any
//! and the driver asked for one (`EVENT_IDX`).

use super::defs::*;
use super::muxer::{Backend, ConnKey, Muxer};
use super::packet::{read_tx, write_rx};
pub use crate::virtio::hold::WorkerHold;
use crate::virtio::{
    ActivateError, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Our receive buffer per connection (the credit we grant the guest).
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_EVQ: u64 = 2;
const TOKEN_KILL: u64 = 3;
const TOKEN_HOLD: u64 = 4;
const FIRST_CONN_TOKEN: u64 = 16;

/// A virtio-vsock device for one guest CID, serving the ports its backend publishes.
pub struct VsockDevice<B: Backend> {
    guest_cid: u64,
    queue_sizes: [u16; 3],
    acked_features: u64,
    kill: EventFd,
    /// The worker thread exists from the start (so it is filtered before the guest runs, see
    /// [`VsockDevice::with_thread_hook`]) and waits here for the device's activation.
    activate: Option<std::sync::mpsc::SyncSender<Activation>>,
    worker: Option<JoinHandle<()>>,
    /// A restored device (a snapshot's): on activation the guest is told every connection it
    /// had is gone (`VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`); the host's ends did not survive.
    restored: bool,
    hold: WorkerHold,
    _backend: std::marker::PhantomData<fn() -> B>,
}

/// What the guest's DRIVER_OK hands the worker.
struct Activation {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<InterruptStatus>,
    restored: bool,
}

/// `struct virtio_vsock_event`'s only id: every connection of the guest is reset, and the guest
/// reads the CID again (a restored snapshot, or a migration).
const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

impl<B: Backend> std::fmt::Debug for VsockDevice<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VsockDevice")
            .field("guest_cid", &self.guest_cid)
            .finish_non_exhaustive()
    }
}

impl<B> VsockDevice<B>
where
    B: Backend + Send + 'static,
    B::Stream: AsRawFd + Send + std::fmt::Debug,
{
    pub fn new(guest_cid: u64, backend: B) -> io::Result<Self> {
        Self::with_thread_hook(guest_cid, backend, Box::new(|| {}))
    }

    /// Like [`VsockDevice::new`]; the worker thread starts now and runs `on_start` first (the
    /// VMM installs the thread's seccomp filter there), then waits for the guest to activate
    /// the device.
    pub fn with_thread_hook(
        guest_cid: u64,
        backend: B,
        on_start: Box<dyn FnOnce() + Send>,
    ) -> io::Result<Self> {
        let kill = EventFd::new(libc::EFD_NONBLOCK)?;
        let worker_kill = kill.try_clone()?;
        let hold = WorkerHold::new()?;
        let worker_hold = hold.clone();
        let epoll = Epoll::new()?;
        let (activate, activation) = std::sync::mpsc::sync_channel::<Activation>(1);
        let worker = std::thread::Builder::new()
            .name("vsock".into())
            .stack_size(crate::THREAD_STACK_SIZE)
            .spawn(move || {
                on_start();
                // The sender goes away without activating when the device is dropped first.
                let Ok(a) = activation.recv() else { return };
                let mut queues = a.queues.into_iter();
                let mut evts = a.queue_evts.into_iter();
                let (Some(rx), Some(tx), Some(evq), Some(rx_evt), Some(tx_evt), Some(evq_evt)) = (
                    queues.next(),
                    queues.next(),
                    queues.next(),
                    evts.next(),
                    evts.next(),
                    evts.next(),
                ) else {
                    return;
                };
                if a.restored {
                    // The rings' avail_event may ask for kicks the restored driver already
                    // sent: look at both queues once before waiting for any.
                    let _ = rx_evt.write(1);
                    let _ = tx_evt.write(1);
                }
                Worker {
                    mem: a.mem,
                    rx,
                    tx,
                    evq,
                    reset_pending: a.restored,
                    hold: worker_hold,
                    rx_evt,
                    tx_evt,
                    evq_evt,
                    kill: worker_kill,
                    interrupt: a.interrupt,
                    muxer: Muxer::new(backend, guest_cid, CONN_BUF_ALLOC),
                    epoll,
                    polled: HashMap::new(),
                    tokens: HashMap::new(),
                    next_token: FIRST_CONN_TOKEN,
                    rx_starved: false,
                    passes: 0,
                }
                .run()
            })?;
        Ok(VsockDevice {
            guest_cid,
            queue_sizes: [QUEUE_SIZE; 3],
            acked_features: 0,
            kill,
            activate: Some(activate),
            worker: Some(worker),
            restored: false,
            hold,
            _backend: std::marker::PhantomData,
        })
    }

    /// This device continues a snapshot's: see [`VsockDevice::restored`]'s field.
    pub fn set_restored(&mut self) {
        self.restored = true;
    }

    /// What holds the worker for a snapshot.
    pub fn hold(&self) -> WorkerHold {
        self.hold.clone()
    }
}

impl<B: Backend> Drop for VsockDevice<B> {
    fn drop(&mut self) {
        let _ = self.kill.write(1);
        self.activate.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl<B> VirtioDevice for VsockDevice<B>
where
    B: Backend + Send + 'static,
    B::Stream: AsRawFd + Send + std::fmt::Debug,
{
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }
    /// `EVENT_IDX`: the driver says how far we may go before it wants an interrupt or a kick
    /// (Linux suppresses both while its RX and TX work runs), instead of one of each per batch.
    fn device_features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX)
    }
    fn ack_features(&mut self, acked: u64) {
        self.acked_features = acked;
    }
    /// Config space: `le64 guest_cid`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::virtio::read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 3 || queue_evts.len() != 3 {
            return Err(ActivateError::QueueCount {
                expected: 3,
                got: queues.len().min(queue_evts.len()),
            });
        }
        for (index, q) in queues.iter().enumerate().take(2) {
            if !q.ready() {
                return Err(ActivateError::QueueNotReady { index });
            }
        }
        let activate = self
            .activate
            .take()
            .ok_or(ActivateError::AlreadyActivated)?;
        activate
            .send(Activation {
                mem,
                queues,
                queue_evts,
                interrupt,
                restored: self.restored,
            })
            .map_err(|_| {
                ActivateError::Backend(io::Error::other("the vsock worker thread has stopped"))
            })?;
        self.hold.set_active();
        Ok(())
    }
}

struct Worker<B: Backend> {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
    /// The event queue: used once, for a restored device's transport reset.
    evq: Queue,
    /// That reset is still to be sent (it waits for the driver's first event buffer).
    reset_pending: bool,
    hold: WorkerHold,
    rx_evt: EventFd,
    tx_evt: EventFd,
    evq_evt: EventFd,
    kill: EventFd,
    interrupt: Arc<InterruptStatus>,
    muxer: Muxer<B>,
    epoll: Epoll,
    /// Host streams registered with epoll: key -> (fd, token, interest).
    polled: HashMap<ConnKey, (RawFd, u64, EventSet)>,
    tokens: HashMap<u64, ConnKey>,
    next_token: u64,
    /// The guest has given us no RX buffers: stop polling host streams for input until it does.
    rx_starved: bool,
    /// Event-loop passes so far (each one an epoll wake-up): what shows a spinning worker.
    passes: u64,
}

impl<B> Worker<B>
where
    B: Backend,
    B::Stream: AsRawFd + std::fmt::Debug,
{
    fn run(mut self) {
        if let Err(e) = self.run_inner() {
            tracing::error!("vsock worker stopped: {e}");
        }
    }

    fn run_inner(&mut self) -> io::Result<()> {
        for (fd, token) in [
            (self.rx_evt.as_raw_fd(), TOKEN_RX),
            (self.tx_evt.as_raw_fd(), TOKEN_TX),
            (self.evq_evt.as_raw_fd(), TOKEN_EVQ),
            (self.kill.as_raw_fd(), TOKEN_KILL),
            (self.hold.wake_fd(), TOKEN_HOLD),
        ] {
            self.epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.passes += 1;
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_KILL => return Ok(()),
                    TOKEN_HOLD => self.hold.wait_if_held(),
                    TOKEN_RX | TOKEN_TX | TOKEN_EVQ => {
                        let evt = match ev.data() {
                            TOKEN_RX => &self.rx_evt,
                            TOKEN_TX => &self.tx_evt,
                            _ => &self.evq_evt,
                        };
                        let _ = evt.read();
                        if ev.data() == TOKEN_RX {
                            self.rx_starved = false;
                        }
                    }
                    token => {
                        if let Some(key) = self.tokens.get(&token).copied() {
                            if let Some(conn) = self.muxer.connection_mut(&key) {
                                conn.flush_to_host();
                            }
                        }
                    }
                }
            }
            if self.reset_pending {
                self.send_transport_reset();
            }
            self.process_tx();
            self.fill_rx();
            self.muxer.reap();
            self.sync_interest()?;
        }
    }

    /// Put `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` in the driver's first event buffer (a 4-byte
    /// device-writable one; a chain that is not is used with nothing written, and the next one
    /// tried), and interrupt. Without a buffer it waits for the driver's kick on the queue.
    fn send_transport_reset(&mut self) {
        while let Some(chain) = self.evq.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let mut written = 0;
            for d in chain {
                if d.is_write_only() && d.len() >= 4 {
                    let id = VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le_bytes();
                    if vm_memory::Bytes::write_slice(&self.mem, &id, d.addr()).is_ok() {
                        written = 4;
                    }
                    break;
                }
            }
            if let Err(e) = self.evq.add_used(&self.mem, head, written) {
                tracing::warn!("vsock: event queue: {e:?}");
                return;
            }
            if written == 4 {
                self.reset_pending = false;
                if let Err(e) = self.interrupt.signal_used_queue() {
                    tracing::warn!("vsock: interrupt: {e}");
                }
                tracing::debug!("vsock: transport reset sent to the guest");
                return;
            }
            tracing::warn!("vsock: an event buffer the device cannot write: used empty");
        }
        // No buffer yet: the driver's kick on the event queue brings this back.
        if let Err(e) = self.evq.enable_notification(&self.mem) {
            tracing::warn!("vsock: event queue: {e:?}");
        }
    }

    /// Every packet the guest queued goes to the muxer; malformed chains are dropped (logged).
    /// Before returning, ask the driver for a kick at its next packet (with `EVENT_IDX` it
    /// sends none unless asked), and drain again if packets came while asking. A pass that
    /// finds none although the ring says there are (an index we cannot use) ends it: a broken
    /// ring costs the guest its next kick, not a spinning VMM thread.
    fn process_tx(&mut self) {
        let (mem, muxer) = (&self.mem, &mut self.muxer);
        let used = crate::virtio::serve_available(&mut self.tx, mem, "vsock TX", |chain| {
            match read_tx(mem, chain) {
                Ok(pkt) => muxer.recv_from_guest(&pkt),
                Err(e) => tracing::warn!("vsock: dropped a malformed TX chain: {e}"),
            }
            0
        });
        if used {
            self.interrupt
                .signal_used_if_due(&mut self.tx, &self.mem, "vsock");
        }
    }

    /// Fill guest RX buffers while the muxer has packets for them.
    fn fill_rx(&mut self) {
        let mut used = false;
        // A buffer was taken since we last asked for a kick (see `process_tx` on broken rings).
        let mut progressed = true;
        loop {
            let Some(chain) = self.rx.pop_descriptor_chain(&self.mem) else {
                // Out of buffers: ask for a kick when the driver adds one (with `EVENT_IDX` it
                // sends none unless asked); if some came while asking, go on.
                match self.rx.enable_notification(&self.mem) {
                    Ok(true) if progressed => {
                        progressed = false;
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("vsock: RX notification: {e:?}"),
                }
                self.rx_starved = true;
                break;
            };
            progressed = true;
            let head = chain.head_index();
            let descs: Vec<_> = chain.collect();
            let room: usize = descs
                .iter()
                .filter(|d| d.is_write_only())
                .map(|d| d.len() as usize)
                .sum();
            if room < HDR_LEN || descs.iter().any(|d| !d.is_write_only()) {
                tracing::warn!("vsock: dropped an unusable RX chain ({room} writable bytes)");
                let _ = self.rx.add_used(&self.mem, head, 0);
                used = true;
                continue;
            }
            let Some((hdr, data)) = self.muxer.next_for_guest(room - HDR_LEN) else {
                if room == HDR_LEN {
                    // Room for a header and no payload: only header-only packets fit, and none
                    // is pending. Hand the buffer back unused instead of waiting on it: host
                    // bytes pending for a data packet would wake the worker at once, over and
                    // over, so a guest posting such buffers could make it spin (Linux's driver
                    // never does: it posts 4 KiB). The guest gets it back empty and we go on to
                    // the next one.
                    tracing::debug!("vsock: returned an RX buffer with no room for payload");
                    let _ = self.rx.add_used(&self.mem, head, 0);
                    used = true;
                    continue;
                }
                self.rx.go_to_previous_position();
                break;
            };
            let len = match write_rx(&self.mem, descs, &hdr, &data) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!("vsock: RX chain: {e}");
                    0
                }
            };
            let _ = self.rx.add_used(&self.mem, head, len);
            used = true;
        }
        if used {
            self.interrupt
                .signal_used_if_due(&mut self.rx, &self.mem, "vsock");
        }
    }

    /// Poll each host stream for exactly what its connection needs now; a stream that needs
    /// nothing is not polled at all (epoll would report its hang-up over and over).
    fn sync_interest(&mut self) -> io::Result<()> {
        let mut live = Vec::new();
        for (key, conn) in self.muxer.connections() {
            let mut want = EventSet::empty();
            if conn.wants_host_read() && !self.rx_starved {
                want |= EventSet::IN;
            }
            if conn.wants_host_write() {
                want |= EventSet::OUT;
            }
            if !want.is_empty() {
                live.push((*key, conn.stream().as_raw_fd(), want));
            }
        }
        let live_keys: Vec<ConnKey> = live.iter().map(|l| l.0).collect();
        let gone: Vec<ConnKey> = self
            .polled
            .keys()
            .filter(|k| !live_keys.contains(k))
            .copied()
            .collect();
        for key in gone {
            if let Some((fd, token, _)) = self.polled.remove(&key) {
                let _ = self
                    .epoll
                    .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                self.tokens.remove(&token);
            }
        }
        for (key, fd, want) in live {
            match self.polled.get_mut(&key) {
                Some((_, token, interest)) if *interest != want => {
                    self.epoll
                        .ctl(ControlOperation::Modify, fd, EpollEvent::new(want, *token))?;
                    *interest = want;
                }
                Some(_) => {}
                None => {
                    let token = self.next_token;
                    self.next_token += 1;
                    self.epoll
                        .ctl(ControlOperation::Add, fd, EpollEvent::new(want, token))?;
                    self.polled.insert(key, (fd, token, want));
                    self.tokens.insert(token, key);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The worker's notification handling against rings laid out by hand, as a driver would
    //! (or a hostile one): with `EVENT_IDX` the device must ask for each kick it needs and
    //! interrupt only when asked, and a ring index it cannot use must not make it spin.
    use super::*;
    use crate::virtio::Interrupt;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use vm_memory::{Bytes, GuestAddress};

    const SIZE: u16 = 16;
    const GUEST_CID: u64 = 3;
    // Per queue: descriptor table, avail ring, used ring, and one 4 KiB page per buffer.
    const TX_BASE: u64 = 0x10000;
    const RX_BASE: u64 = 0x40000;
    const EVQ_BASE: u64 = 0x70000;
    const DESC: u64 = 0;
    const AVAIL: u64 = 0x1000;
    const USED: u64 = 0x2000;
    const BUFS: u64 = 0x3000;

    #[derive(Debug, Default)]
    struct Counter(AtomicUsize);
    impl Interrupt for Counter {
        fn trigger(&self) -> io::Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// Publishes nothing: every REQUEST gets a RST, which is all these tests need to move.
    struct NoPorts;
    impl Backend for NoPorts {
        type Stream = UnixStream;
        fn connect(&mut self, _port: u32) -> Option<io::Result<UnixStream>> {
            None
        }
    }

    fn queue(base: u64) -> Queue {
        let mut q = Queue::new(SIZE).unwrap();
        q.try_set_desc_table_address(GuestAddress(base + DESC))
            .unwrap();
        q.try_set_avail_ring_address(GuestAddress(base + AVAIL))
            .unwrap();
        q.try_set_used_ring_address(GuestAddress(base + USED))
            .unwrap();
        q.set_event_idx(true);
        q.set_ready(true);
        q
    }

    fn worker(counter: Arc<Counter>) -> Worker<NoPorts> {
        worker_with(counter, NoPorts)
    }

    fn worker_with<B: Backend<Stream = UnixStream>>(
        counter: Arc<Counter>,
        backend: B,
    ) -> Worker<B> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        Worker {
            mem,
            rx: queue(RX_BASE),
            tx: queue(TX_BASE),
            evq: queue(EVQ_BASE),
            reset_pending: false,
            hold: WorkerHold::new().unwrap(),
            rx_evt: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            tx_evt: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            evq_evt: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            kill: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            interrupt: Arc::new(InterruptStatus::new(counter)),
            muxer: Muxer::new(backend, GUEST_CID, CONN_BUF_ALLOC),
            epoll: Epoll::new().unwrap(),
            polled: HashMap::new(),
            tokens: HashMap::new(),
            next_token: FIRST_CONN_TOKEN,
            rx_starved: false,
            passes: 0,
        }
    }

    fn u16_at<B: Backend<Stream = UnixStream>>(w: &Worker<B>, addr: u64) -> u16 {
        w.mem.read_obj::<u16>(GuestAddress(addr)).unwrap()
    }
    fn set_u16<B: Backend<Stream = UnixStream>>(w: &Worker<B>, addr: u64, v: u16) {
        w.mem.write_obj(v, GuestAddress(addr)).unwrap();
    }
    /// `avail.idx`, `used_event` (after the avail ring), `used.idx`, `avail_event`.
    fn avail_idx(base: u64) -> u64 {
        base + AVAIL + 2
    }
    fn used_event(base: u64) -> u64 {
        base + AVAIL + 4 + 2 * u64::from(SIZE)
    }
    fn used_idx(base: u64) -> u64 {
        base + USED + 2
    }
    fn avail_event(base: u64) -> u64 {
        base + USED + 4 + 8 * u64::from(SIZE)
    }

    /// Descriptor `i` of the queue at `base`: one buffer of `len` bytes at its own page.
    fn put_desc<B: Backend<Stream = UnixStream>>(
        w: &Worker<B>,
        base: u64,
        i: u16,
        len: u32,
        flags: u16,
    ) -> u64 {
        let buf = base + BUFS + 0x1000 * u64::from(i);
        let d = base + DESC + 16 * u64::from(i);
        w.mem.write_obj(buf, GuestAddress(d)).unwrap();
        w.mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        w.mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
        w.mem.write_obj(0u16, GuestAddress(d + 14)).unwrap();
        buf
    }

    /// Make descriptor `i` available at ring slot `slot` and publish `avail.idx = slot + 1`.
    fn offer<B: Backend<Stream = UnixStream>>(w: &Worker<B>, base: u64, slot: u16, i: u16) {
        set_u16(w, base + AVAIL + 4 + 2 * u64::from(slot % SIZE), i);
        set_u16(w, avail_idx(base), slot + 1);
    }

    /// A REQUEST from the guest to `port` in TX descriptor `i`, offered at ring slot `slot`.
    fn send_request<B: Backend<Stream = UnixStream>>(w: &Worker<B>, slot: u16, i: u16, port: u32) {
        let hdr = super::super::packet::Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: 50000 + u32::from(slot),
            dst_port: port,
            len: 0,
            type_: TYPE_STREAM,
            op: OP_REQUEST,
            flags: 0,
            buf_alloc: 1 << 20,
            fwd_cnt: 0,
        };
        let buf = put_desc(w, TX_BASE, i, HDR_LEN as u32, 0);
        w.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(buf))
            .unwrap();
        offer(w, TX_BASE, slot, i);
    }

    /// A held worker (a snapshot's) leaves the rings alone, whatever the guest queued and
    /// kicked, until released; before activation a hold has nothing to wait for.
    #[test]
    fn a_held_worker_touches_no_ring_until_released() {
        let w = worker(Arc::new(Counter::default()));
        let mut dev = VsockDevice::new(GUEST_CID, NoPorts).unwrap();
        let hold = dev.hold();
        hold.hold(std::time::Duration::from_millis(10)).unwrap();
        hold.release();
        let evts: Vec<EventFd> = (0..3)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect();
        let tx_kick = evts[1].try_clone().unwrap();
        dev.activate(
            w.mem.clone(),
            vec![queue(RX_BASE), queue(TX_BASE), queue(EVQ_BASE)],
            evts,
            Arc::new(InterruptStatus::new(Arc::new(Counter::default()))),
        )
        .unwrap();
        hold.hold(std::time::Duration::from_secs(5)).unwrap();
        send_request(&w, 0, 0, 1234);
        tx_kick.write(1).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(
            u16_at(&w, used_idx(TX_BASE)),
            0,
            "a held worker took a packet"
        );
        hold.release();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while u16_at(&w, used_idx(TX_BASE)) == 0 {
            assert!(
                std::time::Instant::now() < until,
                "the released worker did not go on"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A restored device tells the guest its connections are gone: the transport reset goes
    /// into the first writable event buffer, once there is one, with an interrupt.
    #[test]
    fn a_restored_device_sends_one_transport_reset() {
        let counter = Arc::new(Counter::default());
        let mut w = worker(counter.clone());
        w.reset_pending = true;
        // No event buffer yet: nothing sent, still pending.
        w.send_transport_reset();
        assert!(w.reset_pending);
        assert_eq!(u16_at(&w, used_idx(EVQ_BASE)), 0);
        // A buffer the device may not write is used empty; the next one gets the event.
        put_desc(&w, EVQ_BASE, 0, 4, 0);
        offer(&w, EVQ_BASE, 0, 0);
        let buf = put_desc(&w, EVQ_BASE, 1, 4, 2);
        w.mem.write_obj(0xffff_ffffu32, GuestAddress(buf)).unwrap();
        offer(&w, EVQ_BASE, 1, 1);
        w.send_transport_reset();
        assert!(!w.reset_pending);
        assert_eq!(u16_at(&w, used_idx(EVQ_BASE)), 2);
        assert_eq!(w.mem.read_obj::<u32>(GuestAddress(buf)).unwrap(), 0);
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn with_event_idx_the_device_asks_for_each_kick_and_interrupts_only_when_asked() {
        let counter = Arc::new(Counter::default());
        let mut w = worker(counter.clone());
        // The driver wants an interrupt after the first used TX buffer (used_event = 0).
        set_u16(&w, used_event(TX_BASE), 0);
        send_request(&w, 0, 0, 1);
        w.process_tx();
        assert_eq!(u16_at(&w, used_idx(TX_BASE)), 1);
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            1,
            "asked for: interrupted"
        );
        assert_eq!(
            u16_at(&w, avail_event(TX_BASE)),
            1,
            "the device asks for a kick at the next packet"
        );
        // Now the driver asks for no interrupt before its fifth used buffer.
        set_u16(&w, used_event(TX_BASE), 4);
        send_request(&w, 1, 1, 2);
        send_request(&w, 2, 2, 3);
        w.process_tx();
        assert_eq!(u16_at(&w, used_idx(TX_BASE)), 3);
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "not asked for: none");
        assert_eq!(u16_at(&w, avail_event(TX_BASE)), 3);

        // The three resets wait for RX buffers; there are none: the device asks for a kick at
        // the driver's next one, and interrupts for nothing.
        w.fill_rx();
        assert!(w.rx_starved);
        assert_eq!(u16_at(&w, avail_event(RX_BASE)), 0);
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
        // Two buffers, used_event = 0: the first fill interrupts once for both.
        set_u16(&w, used_event(RX_BASE), 0);
        for i in 0..2 {
            put_desc(&w, RX_BASE, i, 4096, 2 /* VRING_DESC_F_WRITE */);
            offer(&w, RX_BASE, i, i);
        }
        w.fill_rx();
        assert_eq!(u16_at(&w, used_idx(RX_BASE)), 2);
        assert_eq!(counter.0.load(Ordering::SeqCst), 2);
        // Starved again with one reset left: the kick is asked for at the new position.
        assert!(w.rx_starved);
        assert_eq!(u16_at(&w, avail_event(RX_BASE)), 2);
        let mut raw = [0u8; HDR_LEN];
        w.mem
            .read_slice(&mut raw, GuestAddress(RX_BASE + BUFS))
            .unwrap();
        let rst = super::super::packet::Header::from_bytes(&raw);
        assert_eq!((rst.op, rst.dst_port), (OP_RST, 50000));
    }

    #[test]
    fn an_avail_index_the_device_cannot_use_does_not_make_it_spin() {
        let counter = Arc::new(Counter::default());
        let mut w = worker(counter.clone());
        // avail.idx 1000 ahead of a 16-entry ring: not a ring any driver could have made.
        set_u16(&w, avail_idx(TX_BASE), 1000);
        set_u16(&w, avail_idx(RX_BASE), 1000);
        w.process_tx();
        w.fill_rx();
        assert_eq!(u16_at(&w, used_idx(TX_BASE)), 0);
        assert_eq!(u16_at(&w, used_idx(RX_BASE)), 0);
        assert_eq!(counter.0.load(Ordering::SeqCst), 0);
        // The driver repairs its ring: the device goes on from where it was.
        set_u16(&w, avail_idx(TX_BASE), 0);
        set_u16(&w, used_event(TX_BASE), 0);
        send_request(&w, 0, 0, 1);
        w.process_tx();
        assert_eq!(u16_at(&w, used_idx(TX_BASE)), 1);
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
    }

    /// Publishes port 1, whose host end is a stream the test holds the other end of.
    struct OnePort(Option<UnixStream>);
    impl Backend for OnePort {
        type Stream = UnixStream;
        fn connect(&mut self, port: u32) -> Option<io::Result<UnixStream>> {
            (port == 1).then(|| self.0.take().ok_or_else(|| io::ErrorKind::AddrInUse.into()))
        }
    }

    /// CPU time this thread has used.
    fn thread_cpu() -> std::time::Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec, which `ts` is, and reads nothing else.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime");
        std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[test]
    fn rx_buffers_too_small_for_pending_data_do_not_make_the_worker_spin() {
        // Issue 26: host bytes pending, the guest posts 44-byte RX buffers (a header, no room
        // for payload). The worker used to leave such a buffer in the ring and keep the host
        // stream polled, so its pending bytes woke it at once, forever: a host CPU burnt.
        let (host_end, mut far_end) = UnixStream::pair().unwrap();
        host_end.set_nonblocking(true).unwrap();
        let counter = Arc::new(Counter::default());
        let mut w = worker_with(counter, OnePort(Some(host_end)));
        send_request(&w, 0, 0, 1);
        w.process_tx();
        // The RESPONSE is header-only: a 44-byte buffer carries it.
        put_desc(
            &w,
            RX_BASE,
            0,
            HDR_LEN as u32,
            2, /* VRING_DESC_F_WRITE */
        );
        offer(&w, RX_BASE, 0, 0);
        w.fill_rx();
        assert_eq!(u16_at(&w, used_idx(RX_BASE)), 1);
        let mut raw = [0u8; HDR_LEN];
        w.mem
            .read_slice(&mut raw, GuestAddress(RX_BASE + BUFS))
            .unwrap();
        assert_eq!(
            super::super::packet::Header::from_bytes(&raw).op,
            OP_RESPONSE
        );
        // Now host data is pending, and the ring holds only buffers that cannot carry any.
        std::io::Write::write_all(&mut far_end, &[7u8; 1000]).unwrap();
        for i in 1..SIZE {
            put_desc(&w, RX_BASE, i, HDR_LEN as u32, 2);
            offer(&w, RX_BASE, i, i);
        }
        // The driver kicks RX; the worker's own loop runs on a thread of its own for 500 ms.
        w.rx_evt.write(1).unwrap();
        let kill = w.kill.try_clone().unwrap();
        let worker = std::thread::spawn(move || {
            let t0 = thread_cpu();
            w.run_inner().unwrap();
            (thread_cpu() - t0, w)
        });
        std::thread::sleep(std::time::Duration::from_millis(500));
        kill.write(1).unwrap();
        let (cpu, mut w) = worker.join().unwrap();
        // Idle: two wake-ups, the kick and the kill. (Spinning, it woke about 92,000 times
        // and used all of its CPU: the pass count holds even when the machine is loaded.)
        assert!(
            w.passes <= 3 && cpu < std::time::Duration::from_millis(100),
            "the worker woke {} times and used {cpu:?} of CPU in 500 ms with nothing it could do",
            w.passes
        );
        // The tiny buffers came back unused; the bytes wait, and go out in a real buffer.
        assert_eq!(u16_at(&w, used_idx(RX_BASE)), SIZE);
        assert!(w.rx_starved);
        put_desc(&w, RX_BASE, 0, 4096, 2);
        offer(&w, RX_BASE, SIZE, 0);
        w.rx_starved = false;
        w.fill_rx();
        assert_eq!(u16_at(&w, used_idx(RX_BASE)), SIZE + 1);
        w.mem
            .read_slice(&mut raw, GuestAddress(RX_BASE + BUFS))
            .unwrap();
        let hdr = super::super::packet::Header::from_bytes(&raw);
        assert_eq!((hdr.op, hdr.len), (OP_RW, 1000));
    }
}
