//! The vsock device behind the virtio-mmio transport, and its worker thread: the thin event
//! glue around the [`Muxer`]. The worker waits (epoll) on the TX and RX queue notifications,
//! on every host stream that has something to do, and on a kill event; it moves guest packets
//! into the muxer, fills guest RX buffers from it, and raises the interrupt when it used any.

use super::defs::*;
use super::muxer::{Backend, ConnKey, Muxer};
use super::packet::{read_tx, write_rx};
use crate::virtio::{ActivateError, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1};
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
    _backend: std::marker::PhantomData<fn() -> B>,
}

/// What the guest's DRIVER_OK hands the worker.
struct Activation {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<InterruptStatus>,
}

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
                let (Some(rx), Some(tx), Some(rx_evt), Some(tx_evt), Some(evq_evt)) = (
                    queues.next(),
                    queues.next(),
                    evts.next(),
                    evts.next(),
                    evts.next(),
                ) else {
                    return;
                };
                Worker {
                    mem: a.mem,
                    rx,
                    tx,
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
            _backend: std::marker::PhantomData,
        })
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
    fn device_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
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
            })
            .map_err(|_| {
                ActivateError::Backend(io::Error::other("the vsock worker thread has stopped"))
            })?;
        Ok(())
    }
}

struct Worker<B: Backend> {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
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
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_KILL => return Ok(()),
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
            self.process_tx();
            self.fill_rx();
            self.muxer.reap();
            self.sync_interest()?;
        }
    }

    /// Every packet the guest queued goes to the muxer; malformed chains are dropped (logged).
    fn process_tx(&mut self) {
        let mut used = false;
        while let Some(chain) = self.tx.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            match read_tx(&self.mem, chain) {
                Ok(pkt) => self.muxer.recv_from_guest(&pkt),
                Err(e) => tracing::warn!("vsock: dropped a malformed TX chain: {e}"),
            }
            if let Err(e) = self.tx.add_used(&self.mem, head, 0) {
                tracing::warn!("vsock: TX used ring: {e:?}");
            }
            used = true;
        }
        if used {
            self.signal();
        }
    }

    /// Fill guest RX buffers while the muxer has packets for them.
    fn fill_rx(&mut self) {
        let mut used = false;
        loop {
            let Some(chain) = self.rx.pop_descriptor_chain(&self.mem) else {
                self.rx_starved = true;
                break;
            };
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
            self.signal();
        }
    }

    fn signal(&self) {
        if let Err(e) = self.interrupt.signal_used_queue() {
            tracing::warn!("vsock: interrupt: {e}");
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
