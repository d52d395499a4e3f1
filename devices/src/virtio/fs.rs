//! virtio-fs (device type 26) as a vhost-user frontend: the guest's FUSE requests never pass
//! through the VMM. The backend (virtiofsd, a separate process) maps guest RAM from the file
//! regions we send it, reads the queues directly, is kicked by the same ioeventfds the transport
//! registered, and interrupts the guest through the irqfd itself. What stays here is the
//! config space (the mount tag) and the vhost-user set-up on DRIVER_OK.
//!
//! The backend's features are filtered to the ring features we know to be safe for a
//! transport without an IOMMU; nothing else the backend offers reaches the guest.

use super::{
    ActivateError, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
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
    queue_sizes: [u16; NUM_QUEUES],
    active: bool,
}

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
        if protocol {
            let offered = frontend
                .get_protocol_features()
                .map_err(vhost("GET_PROTOCOL_FEATURES"))?;
            frontend
                .set_protocol_features(offered & VhostUserProtocolFeatures::MQ)
                .map_err(vhost("SET_PROTOCOL_FEATURES"))?;
        }
        Ok(VhostUserFs {
            tag: t,
            frontend,
            backend_features,
            acked: 0,
            protocol,
            queue_sizes: [QUEUE_SIZE; NUM_QUEUES],
            active: false,
        })
    }

    /// Program the backend with the negotiated features, guest memory and the queues.
    fn start(
        &mut self,
        mem: &GuestMemoryMmap,
        queues: &[Queue],
        queue_evts: &[EventFd],
        call: &EventFd,
    ) -> Result<(), FsError> {
        let mut features = self.acked;
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
        for (i, (q, kick)) in queues.iter().zip(queue_evts).enumerate() {
            // The transport checked the rings lie in guest memory (Queue::is_valid).
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
                queue_size: q.size(),
                flags: 0,
                desc_table_addr: hva(q.desc_table())?,
                used_ring_addr: hva(q.used_ring())?,
                avail_ring_addr: hva(q.avail_ring())?,
                log_addr: None,
            };
            self.frontend
                .set_vring_num(i, q.size())
                .map_err(vhost("SET_VRING_NUM"))?;
            self.frontend
                .set_vring_addr(i, &config)
                .map_err(vhost("SET_VRING_ADDR"))?;
            self.frontend
                .set_vring_base(i, 0)
                .map_err(vhost("SET_VRING_BASE"))?;
            self.frontend
                .set_vring_call(i, call)
                .map_err(vhost("SET_VRING_CALL"))?;
            self.frontend
                .set_vring_kick(i, kick)
                .map_err(vhost("SET_VRING_KICK"))?;
            if self.protocol {
                self.frontend
                    .set_vring_enable(i, true)
                    .map_err(vhost("SET_VRING_ENABLE"))?;
            }
        }
        Ok(())
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
        let call = interrupt.backend_line().ok_or_else(|| {
            ActivateError::Backend(io::Error::other(
                "the interrupt line is not an event fd a backend could use",
            ))
        })?;
        self.start(&mem, &queues, &queue_evts, call)
            .map_err(|e| ActivateError::Backend(io::Error::other(e.to_string())))?;
        self.active = true;
        Ok(())
    }
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
