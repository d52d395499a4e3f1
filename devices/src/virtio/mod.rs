//! virtio: what every virtio device shares, and the MMIO transport that puts one on the bus.
//!
//! A device ([`VirtioDevice`]) is pure logic: it offers features, a config space and some
//! queues, and once the driver says DRIVER_OK it gets the negotiated queues, guest memory and an
//! [`InterruptStatus`] to raise its interrupt with. The transport ([`mmio::MmioTransport`]) owns
//! everything the driver programs through registers — feature words, queue sizes and ring
//! addresses, the device-status byte — and enforces the device-status state machine, so a device
//! only ever sees a driver that has finished negotiating.
//!
//! The driver's side of a device's life, as the transport enforces it (virtio 1.2, 3.1.1):
//! write 0 to Status (reset) → ACKNOWLEDGE → DRIVER → read DeviceFeatures, write DriverFeatures
//! → FEATURES_OK (refused unless the acked set is a subset of the offered one and includes
//! VIRTIO_F_VERSION_1) → program the queues → DRIVER_OK, which hands the queues to
//! [`VirtioDevice::activate`]. Nothing here talks to KVM: the interrupt is an [`Interrupt`] the
//! VMM implements (with an irqfd), and queue notifications arrive on event fds the VMM registers
//! as ioeventfds.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

pub mod block;
pub mod fs;
#[doc(hidden)]
pub mod fs_relay;
pub mod hold;
pub mod mmio;
#[cfg(test)]
pub(crate) mod test_utils;

pub use mmio::{MmioError, MmioState, MmioTransport, QueueConfig};

// --- The MMIO register layout, version 2 ("modern"): include/uapi/linux/virtio_mmio.h ---------
// Every register below 0x100 is 32 bits wide and must be accessed as an aligned 32-bit word.

/// `MagicValue`'s contents: "virt" read as a little-endian u32.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The register-layout version this transport implements (1 is the legacy layout).
pub const MMIO_VERSION: u32 = 2;
/// `VendorID`: the kernel only prints it; 0 like Firecracker.
pub const MMIO_VENDOR_ID: u32 = 0;

/// R: [`MMIO_MAGIC_VALUE`].
pub const VIRTIO_MMIO_MAGIC_VALUE: u64 = 0x000;
/// R: [`MMIO_VERSION`].
pub const VIRTIO_MMIO_VERSION: u64 = 0x004;
/// R: the virtio device type (`include/uapi/linux/virtio_ids.h`; 0 means "no device").
pub const VIRTIO_MMIO_DEVICE_ID: u64 = 0x008;
/// R: [`MMIO_VENDOR_ID`].
pub const VIRTIO_MMIO_VENDOR_ID: u64 = 0x00c;
/// R: 32 bits of the device's features, the word chosen by `DeviceFeaturesSel`.
pub const VIRTIO_MMIO_DEVICE_FEATURES: u64 = 0x010;
/// W: which 32-bit word `DeviceFeatures` shows (0: bits 0-31, 1: bits 32-63).
pub const VIRTIO_MMIO_DEVICE_FEATURES_SEL: u64 = 0x014;
/// W: 32 bits of the features the driver accepts, the word chosen by `DriverFeaturesSel`.
pub const VIRTIO_MMIO_DRIVER_FEATURES: u64 = 0x020;
/// W: which 32-bit word `DriverFeatures` writes.
pub const VIRTIO_MMIO_DRIVER_FEATURES_SEL: u64 = 0x024;
/// W, legacy (version 1) only: the guest page size. Ignored here.
pub const VIRTIO_MMIO_GUEST_PAGE_SIZE: u64 = 0x028;
/// W: which queue the `Queue*` registers address.
pub const VIRTIO_MMIO_QUEUE_SEL: u64 = 0x030;
/// R: the selected queue's maximum size; 0 if the queue does not exist.
pub const VIRTIO_MMIO_QUEUE_NUM_MAX: u64 = 0x034;
/// W: the selected queue's size (a power of two, at most `QueueNumMax`).
pub const VIRTIO_MMIO_QUEUE_NUM: u64 = 0x038;
/// W, legacy only: the used ring's alignment. Ignored here.
pub const VIRTIO_MMIO_QUEUE_ALIGN: u64 = 0x03c;
/// RW, legacy only: the queue's page frame number. Ignored here.
pub const VIRTIO_MMIO_QUEUE_PFN: u64 = 0x040;
/// RW: 1 once the driver has programmed the selected queue.
pub const VIRTIO_MMIO_QUEUE_READY: u64 = 0x044;
/// W: "queue N has new buffers", N the value written. The VMM catches these with ioeventfds.
pub const VIRTIO_MMIO_QUEUE_NOTIFY: u64 = 0x050;
/// R: pending interrupt causes ([`VIRTIO_MMIO_INT_VRING`], [`VIRTIO_MMIO_INT_CONFIG`]).
pub const VIRTIO_MMIO_INTERRUPT_STATUS: u64 = 0x060;
/// W: the causes the driver has handled; their bits are cleared.
pub const VIRTIO_MMIO_INTERRUPT_ACK: u64 = 0x064;
/// RW: the device-status byte (`VIRTIO_CONFIG_S_*`); writing 0 resets the device.
pub const VIRTIO_MMIO_STATUS: u64 = 0x070;
/// W: the selected queue's descriptor table address, low and high 32 bits.
pub const VIRTIO_MMIO_QUEUE_DESC_LOW: u64 = 0x080;
pub const VIRTIO_MMIO_QUEUE_DESC_HIGH: u64 = 0x084;
/// W: the selected queue's available ring ("driver area") address.
pub const VIRTIO_MMIO_QUEUE_AVAIL_LOW: u64 = 0x090;
pub const VIRTIO_MMIO_QUEUE_AVAIL_HIGH: u64 = 0x094;
/// W: the selected queue's used ring ("device area") address.
pub const VIRTIO_MMIO_QUEUE_USED_LOW: u64 = 0x0a0;
pub const VIRTIO_MMIO_QUEUE_USED_HIGH: u64 = 0x0a4;
/// W: selects a shared-memory region; R: its length and base. We have none, so the lengths
/// and bases read as all ones, which the spec defines as "no such region".
pub const VIRTIO_MMIO_SHM_SEL: u64 = 0x0ac;
pub const VIRTIO_MMIO_SHM_LEN_LOW: u64 = 0x0b0;
pub const VIRTIO_MMIO_SHM_LEN_HIGH: u64 = 0x0b4;
pub const VIRTIO_MMIO_SHM_BASE_LOW: u64 = 0x0b8;
pub const VIRTIO_MMIO_SHM_BASE_HIGH: u64 = 0x0bc;
/// R: changes whenever the device changed its config space (see [`InterruptStatus`]).
pub const VIRTIO_MMIO_CONFIG_GENERATION: u64 = 0x0fc;
/// The device-specific config space starts here and runs to the end of the window.
pub const VIRTIO_MMIO_CONFIG: u64 = 0x100;

/// `InterruptStatus` bits (virtio_mmio.h): a queue has new used buffers ("used buffer
/// notification") / the config space changed ("configuration change notification").
pub const VIRTIO_MMIO_INT_VRING: u32 = 1 << 0;
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 1 << 1;

// --- Device status bits: include/uapi/linux/virtio_config.h ----------------------------------

/// The guest has noticed the device.
pub const VIRTIO_CONFIG_S_ACKNOWLEDGE: u32 = 1;
/// The guest has a driver for it.
pub const VIRTIO_CONFIG_S_DRIVER: u32 = 2;
/// The driver is set up and the device may use its queues.
pub const VIRTIO_CONFIG_S_DRIVER_OK: u32 = 4;
/// Feature negotiation is complete (the device refuses it by not keeping the bit).
pub const VIRTIO_CONFIG_S_FEATURES_OK: u32 = 8;
/// Set by the device: it hit an error and needs the driver to reset it.
pub const VIRTIO_CONFIG_S_NEEDS_RESET: u32 = 0x40;
/// Set by the driver: it gave up on the device.
pub const VIRTIO_CONFIG_S_FAILED: u32 = 0x80;

// --- Feature bits (bit numbers, as in the kernel headers) ------------------------------------

/// virtio_ring.h: `used_event`/`avail_event` notification suppression. When negotiated, the
/// transport turns it on in the queues it hands to [`VirtioDevice::activate`].
pub const VIRTIO_RING_F_EVENT_IDX: u32 = 29;
/// virtio_config.h: the device follows virtio 1.x (not legacy). Every device must offer it and
/// the transport refuses FEATURES_OK unless the driver accepts it.
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// How a device raises its interrupt line (the VMM implements it with an irqfd).
pub trait Interrupt: Send + Sync + std::fmt::Debug {
    fn trigger(&self) -> io::Result<()>;
    /// The event fd that raises the line when written, if it is one (an irqfd): a vhost-user
    /// backend gets it as its call fd and interrupts the guest without passing through us.
    fn eventfd(&self) -> Option<&EventFd> {
        None
    }
}

/// A virtio device behind a transport.
///
/// The transport calls these from the vCPU thread that made the MMIO access, with the device's
/// lock held; none of them may block on the guest.
pub trait VirtioDevice: Send {
    /// The virtio device type (`include/uapi/linux/virtio_ids.h`), e.g. 19 for vsock.
    fn device_type(&self) -> u32;
    /// One entry per queue: its maximum size, a power of two in `1..=32768`.
    fn queue_max_sizes(&self) -> &[u16];
    /// The features the device offers. Must include `1 << VIRTIO_F_VERSION_1`.
    fn device_features(&self) -> u64;
    /// The features the driver accepted, called once FEATURES_OK is accepted. Always a subset of
    /// [`VirtioDevice::device_features`].
    fn ack_features(&mut self, acked: u64);
    /// Read config space at `offset` (relative to its start). `data` arrives zeroed, of any
    /// length the guest chose: the device must bounds-check and leave out-of-range bytes alone.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Write config space at `offset`; the same bounds rule applies.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// DRIVER_OK: the queues are ready; the device starts using them.
    ///
    /// `queues` has one entry per [`VirtioDevice::queue_max_sizes`] entry, in order. Each queue
    /// the driver marked ready has passed `Queue::is_valid` against `mem`; a queue the driver
    /// left unready comes with `ready() == false`, and the device decides whether it can do
    /// without it. `queue_evts[i]` is a duplicate of the transport's notification fd for queue
    /// `i` (the one the VMM registered as an ioeventfd): the device's worker waits on it, or a
    /// vhost-user device passes it to its backend as the kick fd.
    fn activate(
        &mut self,
        mem: vm_memory::GuestMemoryMmap,
        queues: Vec<virtio_queue::Queue>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError>;
    /// The driver wrote 0 to status. Return true if the device could reset: it has dropped the
    /// queues, memory and interrupt `activate` gave it and is ready to be activated again.
    fn reset(&mut self) -> bool {
        false
    }
}

/// Serve every chain the driver has made available on `queue`: `serve` each (it returns how
/// many bytes it wrote into the chain), put it in the used ring, then ask for the next kick and
/// look again if chains came in meanwhile, but only when the last look found one (a ring index
/// the device cannot use ends the pass: it costs the guest its next kick, not a spinning
/// thread). `device` names the device in warnings. Returns whether any chain was used; the
/// caller then interrupts the driver if it is due ([`InterruptStatus::signal_used_if_due`]).
pub fn serve_available(
    queue: &mut virtio_queue::Queue,
    mem: &vm_memory::GuestMemoryMmap,
    device: &str,
    mut serve: impl FnMut(virtio_queue::DescriptorChain<&vm_memory::GuestMemoryMmap>) -> u32,
) -> bool {
    use virtio_queue::QueueT;
    let mut used = false;
    // A chain was taken since we last asked for a kick (the first pass always may retry).
    let mut progressed = true;
    loop {
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let len = serve(chain);
            if let Err(e) = queue.add_used(mem, head, len) {
                tracing::warn!("{device}: used ring: {e:?}");
            }
            used = true;
            progressed = true;
        }
        let more = match queue.enable_notification(mem) {
            Ok(more) => more,
            Err(e) => {
                tracing::warn!("{device}: notification: {e:?}");
                false
            }
        };
        if !(more && progressed) {
            return used;
        }
        progressed = false;
    }
}

/// Copy the part of config space `cfg` that lies at `offset` into `data`; bytes beyond `cfg`
/// (and any offset past its end) leave `data` as it came. For [`VirtioDevice::read_config`].
pub fn read_config_bytes(cfg: &[u8], offset: u64, data: &mut [u8]) {
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= cfg.len() {
        return;
    }
    let n = data.len().min(cfg.len() - start);
    data[..n].copy_from_slice(&cfg[start..start + n]);
}

/// Why a device could not start.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error(
        "queue {index} is marked ready but its size or ring addresses do not fit guest memory; \
         the guest driver must set the queue up again after a reset"
    )]
    InvalidQueue { index: usize },
    #[error("queue {index} is not ready, and the device cannot work without it")]
    QueueNotReady { index: usize },
    #[error("the device expects {expected} queues but was given {got}")]
    QueueCount { expected: usize, got: usize },
    #[error("the device is already active; the driver must reset it first")]
    AlreadyActivated,
    #[error("could not duplicate queue {index}'s event fd: {source}; check the open-file limit")]
    QueueEvent {
        index: usize,
        #[source]
        source: io::Error,
    },
    #[error("the device's backend failed to start: {0}")]
    Backend(#[from] io::Error),
}

/// The interrupt side of a transport, shared between the transport and an active device.
///
/// Holds the `InterruptStatus` register (which causes are pending), the config generation
/// counter and the line itself. A device sets a cause and triggers the line; the guest reads the
/// register, handles the causes and acknowledges them through `InterruptACK`, which clears them.
/// The line is triggered on every signal, pending or not: with an edge-style irqfd a skipped
/// trigger could be a lost interrupt, while a spurious one costs the guest a register read.
#[derive(Debug)]
pub struct InterruptStatus {
    status: AtomicU32,
    config_generation: AtomicU32,
    /// Set while a device's backend raises the line itself (see [`InterruptStatus::backend_line`]).
    vring_always: AtomicBool,
    line: Arc<dyn Interrupt>,
}

impl InterruptStatus {
    pub fn new(line: Arc<dyn Interrupt>) -> Self {
        InterruptStatus {
            status: AtomicU32::new(0),
            config_generation: AtomicU32::new(0),
            vring_always: AtomicBool::new(false),
            line,
        }
    }

    /// Hand the line to a backend that raises it directly (vhost-user's call fd): it cannot set
    /// [`VIRTIO_MMIO_INT_VRING`] first, so from now until [`InterruptStatus::reset`] the register
    /// always shows that cause, and every interrupt makes the driver look at its used rings (the
    /// cost of a spurious one: a ring check). `None` if the line is not an event fd.
    pub fn backend_line(&self) -> Option<&EventFd> {
        let fd = self.line.eventfd()?;
        self.vring_always.store(true, Ordering::SeqCst);
        Some(fd)
    }

    /// The device was reset: causes cleared, the line ours again.
    pub fn reset(&self) {
        self.vring_always.store(false, Ordering::SeqCst);
        self.status.store(0, Ordering::SeqCst);
    }

    /// The device put buffers in a used ring: set [`VIRTIO_MMIO_INT_VRING`] and trigger.
    pub fn signal_used_queue(&self) -> io::Result<()> {
        self.status
            .fetch_or(VIRTIO_MMIO_INT_VRING, Ordering::SeqCst);
        self.line.trigger()
    }

    /// The device just used buffers on `queue`: interrupt if the driver asked for it (always
    /// without `EVENT_IDX`; with it, when this batch passed its `used_event`). `device` names
    /// the device in a warning.
    pub fn signal_used_if_due(
        &self,
        queue: &mut virtio_queue::Queue,
        mem: &vm_memory::GuestMemoryMmap,
        device: &str,
    ) {
        use virtio_queue::QueueT;
        let due = queue.needs_notification(mem).unwrap_or_else(|e| {
            tracing::warn!("{device}: used_event: {e:?}");
            true
        });
        if due {
            if let Err(e) = self.signal_used_queue() {
                tracing::warn!("{device}: interrupt: {e}");
            }
        }
    }

    /// The device changed its config space: bump the generation (so a driver reading the config
    /// across the change notices), set [`VIRTIO_MMIO_INT_CONFIG`] and trigger.
    pub fn signal_config_change(&self) -> io::Result<()> {
        self.config_generation.fetch_add(1, Ordering::SeqCst);
        self.status
            .fetch_or(VIRTIO_MMIO_INT_CONFIG, Ordering::SeqCst);
        self.line.trigger()
    }

    /// A restored device (a snapshot's): its pending causes and config generation as they were;
    /// pending causes are raised again, so the driver sees the interrupt it had not handled.
    pub fn restore(&self, status: u32, config_generation: u32) -> io::Result<()> {
        let status = status & (VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG);
        self.config_generation
            .store(config_generation, Ordering::SeqCst);
        self.status.store(status, Ordering::SeqCst);
        if status != 0 {
            self.line.trigger()?;
        }
        Ok(())
    }

    /// The driver's `InterruptACK` write: clear `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The pending causes, as `InterruptStatus` reads.
    pub fn status(&self) -> u32 {
        let always = if self.vring_always.load(Ordering::SeqCst) {
            VIRTIO_MMIO_INT_VRING
        } else {
            0
        };
        self.status.load(Ordering::SeqCst) | always
    }

    /// The value `ConfigGeneration` reads.
    pub fn config_generation(&self) -> u32 {
        self.config_generation.load(Ordering::SeqCst)
    }
}
