//! virtio-fs (device type 26) as a vhost-user frontend: the guest's FUSE requests never pass
//! through the VMM. The backend (virtiofsd, a separate process) maps guest RAM from the file
//! regions we send it, reads the queues directly, is kicked by the same ioeventfds the transport
//! registered, and interrupts the guest through the irqfd itself. What stays here is the
//! config space (the mount tag) and the vhost-user set-up on DRIVER_OK.
//!
//! The backend's features are filtered to the ring features we know to be safe for a
//! transport without an IOMMU; nothing else the backend offers reaches the guest.
//!
//! A device may instead relay (`VhostUserFs::relay_through`, `fs_relay.rs`): the backend then
//! maps only a small shared region of ours and never guest RAM, for a guest whose RAM is a
//! private (copy-on-write) mapping of a snapshot.

pub use super::fs_relay::SHADOW_LEN;
use super::hold::WorkerHold;
use super::{
    ActivateError, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// `include/uapi/linux/virtio_ids.h`.
pub const VIRTIO_ID_FS: u32 = 26;
/// Queue 0 is the high-priority queue, queue 1 the one request queue.
const NUM_QUEUES: usize = 2;
/// virtiofsd's own maximum.
const QUEUE_SIZE: u16 = 1024;
/// The tag field of the config space (`struct virtio_fs_config`).
pub const TAG_LEN: usize = 36;
/// virtio_ring.h: indirect descriptors.
const VIRTIO_RING_F_INDIRECT_DESC: u32 = 28;
/// The only features a guest may see from the backend.
const ALLOWED_FEATURES: u64 =
    (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << VIRTIO_RING_F_INDIRECT_DESC);

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("mount tag {0:?} must be 1 to {TAG_LEN} bytes")]
    Tag(String),
    #[error("vhost-user {step}: {detail}")]
    Vhost { step: &'static str, detail: String },
    #[error("the vhost-user backend does not offer VIRTIO_F_VERSION_1")]
    NoVersion1,
    #[error("the vhost-user backend cannot save or load its state (VHOST_USER_PROTOCOL_F_DEVICE_STATE; virtiofsd 1.11 or later has it)")]
    NoDeviceState,
    #[error("the backend's state: {0}")]
    StateIo(io::Error),
    #[error("the backend's state is {0} bytes, more than {MAX_BACKEND_STATE}")]
    StateTooLarge(u64),
}

/// virtiofsd's state is a path per inode the guest holds: megabytes at most.
pub const MAX_BACKEND_STATE: u64 = 256 << 20;

/// The backend's part of a snapshot: where each ring stood, and its own state (virtiofsd's:
/// the inodes and open files the guest holds, as paths), opaque to us.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BackendState {
    pub ring_bases: Vec<u32>,
    pub blob: Vec<u8>,
}

fn vhost(step: &'static str) -> impl FnOnce(vhost::Error) -> FsError {
    move |e| FsError::Vhost {
        step,
        detail: e.to_string(),
    }
}

/// A virtio-fs device whose backend is at the other end of a vhost-user socket.
pub struct VhostUserFs {
    tag: [u8; TAG_LEN],
    frontend: Frontend,
    backend_features: u64,
    acked: u64,
    protocol: bool,
    /// The backend can save and load its state (snapshots).
    device_state: bool,
    queue_sizes: [u16; NUM_QUEUES],
    active: bool,
    /// The rings' kick fds and the interrupt, to start them again after a snapshot stopped
    /// them (GET_VRING_BASE drops the backend's kick and call fds).
    kicks: Vec<EventFd>,
    interrupt: Option<Arc<InterruptStatus>>,
    /// Set when the device relays its requests through a shadow region (see the module's
    /// comment); `None` when the backend maps guest RAM itself.
    relay: Option<RelaySide>,
}

/// A relaying device's side of its worker (`fs_relay.rs`).
struct RelaySide {
    shadow: GuestMemoryMmap,
    /// Per ring: the backend's call fd (it used buffers) and its kick fd (we offered some).
    calls: Vec<EventFd>,
    kicks: Vec<EventFd>,
    hold: WorkerHold,
    kill: EventFd,
    activate: Option<std::sync::mpsc::SyncSender<RelayStart>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

/// What the guest's DRIVER_OK hands the relay's worker.
struct RelayStart {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<InterruptStatus>,
}

impl Drop for RelaySide {
    fn drop(&mut self) {
        let _ = self.kill.write(1);
        self.activate.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// How long a snapshot waits for the relay's requests in flight to finish.
const RELAY_HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

impl std::fmt::Debug for VhostUserFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserFs")
            .field("tag", &String::from_utf8_lossy(&self.tag))
            .field("backend_features", &self.backend_features)
            .field("active", &self.active)
            .finish()
    }
}

impl VhostUserFs {
    /// Take over the backend at the other end of `stream` and learn what it offers.
    pub fn new(tag: &str, stream: UnixStream) -> Result<Self, FsError> {
        if tag.is_empty() || tag.len() > TAG_LEN {
            return Err(FsError::Tag(tag.into()));
        }
        let mut t = [0u8; TAG_LEN];
        t[..tag.len()].copy_from_slice(tag.as_bytes());
        let mut frontend = Frontend::from_stream(stream, NUM_QUEUES as u64);
        frontend.set_owner().map_err(vhost("SET_OWNER"))?;
        let backend_features = frontend.get_features().map_err(vhost("GET_FEATURES"))?;
        if backend_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(FsError::NoVersion1);
        }
        let protocol = backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        let mut device_state = false;
        if protocol {
            // GET_FEATURES and GET_PROTOCOL_FEATURES both before SET_PROTOCOL_FEATURES (Cloud
            // Hypervisor #6931: otherwise a backend may not take what is set).
            let offered = frontend
                .get_protocol_features()
                .map_err(vhost("GET_PROTOCOL_FEATURES"))?;
            let wanted = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::DEVICE_STATE;
            device_state = offered.contains(VhostUserProtocolFeatures::DEVICE_STATE);
            frontend
                .set_protocol_features(offered & wanted)
                .map_err(vhost("SET_PROTOCOL_FEATURES"))?;
        }
        Ok(VhostUserFs {
            tag: t,
            frontend,
            backend_features,
            acked: 0,
            protocol,
            device_state,
            queue_sizes: [QUEUE_SIZE; NUM_QUEUES],
            active: false,
            kicks: Vec::new(),
            interrupt: None,
            relay: None,
        })
    }

    /// Relay the guest's requests through `shadow` (a shared region of at least
    /// [`SHADOW_LEN`] bytes from guest address 0, file-backed) instead of letting the backend
    /// map guest RAM. Call before the guest activates the device. The worker thread starts now
    /// and runs `on_start` first (the VMM's seccomp filter for it).
    pub fn relay_through(
        &mut self,
        shadow: GuestMemoryMmap,
        on_start: Box<dyn FnOnce() + Send>,
    ) -> io::Result<()> {
        use vm_memory::GuestMemoryRegion;
        let len: u64 = shadow.iter().map(|r| r.len()).sum();
        if len < SHADOW_LEN || shadow.iter().any(|r| r.file_offset().is_none()) {
            return Err(io::Error::other(format!(
                "the relay's shadow must be {SHADOW_LEN} bytes of file-backed memory"
            )));
        }
        let fds = || -> io::Result<Vec<EventFd>> {
            (0..NUM_QUEUES)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK))
                .collect()
        };
        let (calls, kicks) = (fds()?, fds()?);
        let dup = |v: &Vec<EventFd>| -> io::Result<Vec<EventFd>> {
            v.iter().map(EventFd::try_clone).collect()
        };
        let (worker_calls, worker_kicks) = (dup(&calls)?, dup(&kicks)?);
        let kill = EventFd::new(libc::EFD_NONBLOCK)?;
        let worker_kill = kill.try_clone()?;
        let hold = WorkerHold::new()?;
        let worker_hold = hold.clone();
        let worker_shadow = shadow.clone();
        let epoll = vmm_sys_util::epoll::Epoll::new()?;
        let (activate, activation) = std::sync::mpsc::sync_channel::<RelayStart>(1);
        let worker = std::thread::Builder::new()
            .name("virtio-fs relay".into())
            .stack_size(crate::THREAD_STACK_SIZE)
            .spawn(move || {
                on_start();
                // The sender goes away without activating when the device is dropped first.
                let Ok(a) = activation.recv() else { return };
                let rings = a
                    .queues
                    .into_iter()
                    .zip(a.queue_evts)
                    .zip(worker_calls.into_iter().zip(worker_kicks))
                    .enumerate()
                    .map(|(i, ((q, evt), (call, kick)))| {
                        super::fs_relay::Ring::new(i, q, evt, call, kick)
                    })
                    .collect();
                super::fs_relay::Relay::new(
                    a.mem,
                    worker_shadow,
                    rings,
                    a.interrupt,
                    worker_hold,
                    worker_kill,
                    epoll,
                )
                .run();
            })?;
        self.relay = Some(RelaySide {
            shadow,
            calls,
            kicks,
            hold,
            kill,
            activate: Some(activate),
            worker: Some(worker),
        });
        Ok(())
    }

    /// For a snapshot (the guest paused): stop the rings (GET_VRING_BASE: the backend finishes
    /// what it took and says where each ring stands), then read the backend's state to its end
    /// and have it confirm the save. The rings stay stopped: [`VhostUserFs::restart_rings`]
    /// starts them again where they stood if the guest goes on.
    pub fn save_backend_state(&mut self) -> Result<BackendState, FsError> {
        if !self.device_state {
            return Err(FsError::NoDeviceState);
        }
        // A relay first lets what it forwarded finish, and takes nothing more.
        if let Some(r) = &self.relay {
            r.hold.hold(RELAY_HOLD_LIMIT).map_err(FsError::StateIo)?;
        }
        let saved = self.save_stopped();
        if saved.is_err() {
            if let Some(r) = &self.relay {
                r.hold.release();
            }
        }
        saved
    }

    fn save_stopped(&mut self) -> Result<BackendState, FsError> {
        use std::io::Read;
        let mut ring_bases = Vec::with_capacity(NUM_QUEUES);
        if self.active {
            for i in 0..NUM_QUEUES {
                ring_bases.push(
                    self.frontend
                        .get_vring_base(i)
                        .map_err(vhost("GET_VRING_BASE"))?,
                );
            }
        }
        let (read_end, write_end) = pipe().map_err(FsError::StateIo)?;
        // The backend writes in a thread of its own and closes its end when done: read to EOF.
        let mut from = self.transfer(VhostTransferStateDirection::SAVE, write_end, read_end)?;
        let mut blob = Vec::new();
        (&mut from)
            .take(MAX_BACKEND_STATE + 1)
            .read_to_end(&mut blob)
            .map_err(FsError::StateIo)?;
        if blob.len() as u64 > MAX_BACKEND_STATE {
            return Err(FsError::StateTooLarge(blob.len() as u64));
        }
        self.frontend
            .check_device_state()
            .map_err(vhost("CHECK_DEVICE_STATE (save)"))?;
        Ok(BackendState { ring_bases, blob })
    }

    /// SET_DEVICE_STATE_FD: `give` (one end of a pipe) to the backend; the descriptor to move
    /// the state through: the one the backend gave back, if it gave one, else `keep`.
    fn transfer(
        &self,
        direction: VhostTransferStateDirection,
        give: std::os::fd::OwnedFd,
        keep: std::os::fd::OwnedFd,
    ) -> Result<std::fs::File, FsError> {
        let theirs = self
            .frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, give)
            .map_err(vhost("SET_DEVICE_STATE_FD"))?;
        Ok(theirs.unwrap_or_else(|| std::fs::File::from(keep)))
    }

    /// The guest goes on after a snapshot: each ring starts again where it stood, with its
    /// interrupt and kick fds given back (GET_VRING_BASE dropped both), and is kicked once in
    /// case the driver queued something meanwhile.
    pub fn restart_rings(&mut self, ring_bases: &[u32]) -> Result<(), FsError> {
        let restarted = self.restart(ring_bases);
        // A relay goes on (it was held since the save), whatever happened.
        if let Some(r) = &self.relay {
            r.hold.release();
        }
        restarted
    }

    fn restart(&mut self, ring_bases: &[u32]) -> Result<(), FsError> {
        if !self.active {
            return Ok(());
        }
        let fds: Vec<(&EventFd, &EventFd)> = match &self.relay {
            Some(r) => r.calls.iter().zip(&r.kicks).collect(),
            None => {
                let call = self
                    .interrupt
                    .as_ref()
                    .and_then(|i| i.backend_line())
                    .ok_or_else(|| FsError::Vhost {
                        step: "SET_VRING_CALL",
                        detail: "the interrupt line is not an event fd".into(),
                    })?;
                self.kicks.iter().map(|k| (call, k)).collect()
            }
        };
        for (i, (&base, (call, kick))) in ring_bases.iter().zip(fds).enumerate() {
            let base = u16::try_from(base).map_err(|_| FsError::Vhost {
                step: "SET_VRING_BASE",
                detail: format!("ring {i}: base {base} is not a ring index"),
            })?;
            start_ring(&mut self.frontend, self.protocol, i, base, call, kick)?;
            kick.write(1).map_err(FsError::StateIo)?;
        }
        Ok(())
    }

    /// A restored device's new backend takes the snapshot's state, before the guest's queues
    /// are handed to it (the restored transport activates the device after this).
    pub fn load_backend_state(&mut self, blob: &[u8]) -> Result<(), FsError> {
        use std::io::Write;
        if !self.device_state {
            return Err(FsError::NoDeviceState);
        }
        let (read_end, write_end) = pipe().map_err(FsError::StateIo)?;
        let mut to = self.transfer(VhostTransferStateDirection::LOAD, read_end, write_end)?;
        to.write_all(blob).map_err(FsError::StateIo)?;
        // End of the state: the backend's reader sees EOF and applies it.
        drop(to);
        self.frontend
            .check_device_state()
            .map_err(vhost("CHECK_DEVICE_STATE (load)"))
    }

    /// Program the backend with the negotiated features, guest memory and the queues.
    fn start(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &[Queue],
        queue_evts: &[EventFd],
        call: &EventFd,
    ) -> Result<(), FsError> {
        self.set_features_and_memory(self.acked, mem)?;
        for (i, (q, kick)) in queues.iter().zip(queue_evts).enumerate() {
            // The transport checked the rings lie in guest memory (Queue::is_valid).
            let rings = (q.desc_table(), q.avail_ring(), q.used_ring());
            self.set_ring(mem, i, q.size(), rings)?;
            // 0 at the guest's activation; where the queue stood for a restored device.
            start_ring(
                &mut self.frontend,
                self.protocol,
                i,
                q.next_avail(),
                call,
                kick,
            )?;
        }
        Ok(())
    }

    /// Program the backend for a relay: the shadow region is its memory, the shadow rings its
    /// queues (neither `EVENT_IDX` nor indirect descriptors: the relay uses neither), and our
    /// event fds its call and kick fds.
    fn start_relay(&mut self) -> Result<(), FsError> {
        let Some(relay) = self.relay.take() else {
            return Ok(());
        };
        let started = (|| {
            self.set_features_and_memory(self.acked & (1 << VIRTIO_F_VERSION_1), &relay.shadow)?;
            for (i, (call, kick)) in relay.calls.iter().zip(&relay.kicks).enumerate() {
                let size = super::fs_relay::RING_SIZE;
                self.set_ring(&relay.shadow, i, size, super::fs_relay::ring_addresses(i))?;
                start_ring(&mut self.frontend, self.protocol, i, 0, call, kick)?;
            }
            Ok(())
        })();
        self.relay = Some(relay);
        started
    }

    fn set_features_and_memory(
        &mut self,
        acked: u64,
        mem: &GuestMemoryMmap,
    ) -> Result<(), FsError> {
        let mut features = acked;
        if self.protocol {
            features |= VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        self.frontend
            .set_features(features)
            .map_err(vhost("SET_FEATURES"))?;
        let regions = mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<Result<Vec<_>, _>>()
            .map_err(vhost("guest memory (it must be file-backed)"))?;
        self.frontend
            .set_mem_table(&regions)
            .map_err(vhost("SET_MEM_TABLE"))?;
        Ok(())
    }

    /// Ring `i`: its size and where its parts are (`mem`'s addresses: descriptors, available,
    /// used), as host addresses for the backend.
    fn set_ring(
        &mut self,
        mem: &GuestMemoryMmap,
        i: usize,
        size: u16,
        (desc, avail, used): (u64, u64, u64),
    ) -> Result<(), FsError> {
        let hva = |a: u64| -> Result<u64, FsError> {
            mem.get_host_address(GuestAddress(a))
                .map(|p| p as u64)
                .map_err(|e| FsError::Vhost {
                    step: "ring address",
                    detail: e.to_string(),
                })
        };
        let config = VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: size,
            flags: 0,
            desc_table_addr: hva(desc)?,
            used_ring_addr: hva(used)?,
            avail_ring_addr: hva(avail)?,
            log_addr: None,
        };
        self.frontend
            .set_vring_num(i, size)
            .map_err(vhost("SET_VRING_NUM"))?;
        self.frontend
            .set_vring_addr(i, &config)
            .map_err(vhost("SET_VRING_ADDR"))
    }
}

impl VirtioDevice for VhostUserFs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn device_features(&self) -> u64 {
        self.backend_features & ALLOWED_FEATURES
    }

    fn ack_features(&mut self, acked: u64) {
        self.acked = acked;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config(&self.tag, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The config space is read-only.
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError> {
        if self.active {
            return Err(ActivateError::AlreadyActivated);
        }
        if queues.len() != NUM_QUEUES {
            return Err(ActivateError::QueueCount {
                expected: NUM_QUEUES,
                got: queues.len(),
            });
        }
        if let Some(index) = queues.iter().position(|q| !q.ready()) {
            return Err(ActivateError::QueueNotReady { index });
        }
        if self.relay.is_some() {
            self.start_relay()
                .map_err(|e| ActivateError::Backend(io::Error::other(e.to_string())))?;
            let relay = self.relay.as_mut().expect("checked above");
            let start = relay
                .activate
                .take()
                .ok_or(ActivateError::AlreadyActivated)?;
            start
                .send(RelayStart {
                    mem,
                    queues,
                    queue_evts,
                    interrupt,
                })
                .map_err(|_| {
                    ActivateError::Backend(io::Error::other(
                        "the virtio-fs relay thread has stopped",
                    ))
                })?;
            relay.hold.set_active();
            self.active = true;
            return Ok(());
        }
        let call = interrupt.backend_line().ok_or_else(|| {
            ActivateError::Backend(io::Error::other(
                "the interrupt line is not an event fd a backend could use",
            ))
        })?;
        self.start(&mem, &queues, &queue_evts, call)
            .map_err(|e| ActivateError::Backend(io::Error::other(e.to_string())))?;
        self.kicks = queue_evts;
        self.interrupt = Some(interrupt);
        self.active = true;
        Ok(())
    }
}

/// Ring `i` starts at `base`, with its interrupt and kick fds, enabled (`protocol`: the
/// backend takes SET_VRING_ENABLE).
fn start_ring(
    frontend: &mut Frontend,
    protocol: bool,
    i: usize,
    base: u16,
    call: &EventFd,
    kick: &EventFd,
) -> Result<(), FsError> {
    frontend
        .set_vring_base(i, base)
        .map_err(vhost("SET_VRING_BASE"))?;
    frontend
        .set_vring_call(i, call)
        .map_err(vhost("SET_VRING_CALL"))?;
    frontend
        .set_vring_kick(i, kick)
        .map_err(vhost("SET_VRING_KICK"))?;
    if protocol {
        frontend
            .set_vring_enable(i, true)
            .map_err(vhost("SET_VRING_ENABLE"))?;
    }
    Ok(())
}

/// A pipe, both ends close-on-exec.
fn pipe() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2(2) writes two descriptors into the array this frame owns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let read = unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as above.
    let write = unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[1]) };
    Ok((read, write))
}

/// `struct virtio_fs_config { u8 tag[36]; le32 num_request_queues; }` at `offset`: the bytes
/// that exist are copied, the rest of `data` is left as it came (zeroed).
fn read_config(tag: &[u8; TAG_LEN], offset: u64, data: &mut [u8]) {
    let mut config = [0u8; TAG_LEN + 4];
    config[..TAG_LEN].copy_from_slice(tag);
    config[TAG_LEN..].copy_from_slice(&1u32.to_le_bytes());
    super::read_config_bytes(&config, offset, data);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_reads_are_bounded() {
        let mut tag = [0u8; TAG_LEN];
        tag[..9].copy_from_slice(b"workspace");
        let read = |offset: u64, len: usize| {
            let mut data = vec![0u8; len];
            read_config(&tag, offset, &mut data);
            data
        };
        assert_eq!(&read(0, 9), b"workspace");
        assert_eq!(read(0, TAG_LEN + 8)[TAG_LEN..], [1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(read(TAG_LEN as u64, 4), 1u32.to_le_bytes());
        assert_eq!(read(38, 8), vec![0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(read(u64::MAX, 4), vec![0; 4]);
    }
}
