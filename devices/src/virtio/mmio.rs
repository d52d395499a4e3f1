//! The virtio-mmio transport, version 2 ("modern"): a 4 KiB window of registers that puts one
//! [`VirtioDevice`] on the guest's memory bus.
//!
//! The guest kernel finds the window through its command line ([`MmioTransport::cmdline_entry`],
//! which needs `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`). Every access comes from a vCPU on behalf of
//! a guest we do not trust: any offset, any size, any value, in any order. Accesses the spec does
//! not allow are ignored with a warning and reads of them return zero; nothing here panics.
//!
//! The device-status byte moves through these states, one bit at a time (virtio 1.2, 2.1 and
//! 3.1.1); a write that skips a state, or clears a bit, is ignored:
//!
//! | status                           | what the driver may do now                                  |
//! |----------------------------------|-------------------------------------------------------------|
//! | 0 (reset)                        | set ACKNOWLEDGE                                             |
//! | ACKNOWLEDGE                      | set DRIVER                                                  |
//! | + DRIVER                         | write DriverFeatures; set FEATURES_OK, which is refused (the bit reads back clear) unless the acked features are offered and include VIRTIO_F_VERSION_1 |
//! | + FEATURES_OK                    | program queues (QueueNum, ring addresses, QueueReady); set DRIVER_OK, which validates every ready queue and calls [`VirtioDevice::activate`] once |
//! | + DRIVER_OK                      | use the device; queue registers are frozen                  |
//! | + DEVICE_NEEDS_RESET (device's)  | activation failed (or the device could not reset): only a reset helps |
//! | + FAILED (driver's, from any state) | nothing but a reset                                      |
//!
//! Writing 0 resets: queues, features, status and interrupt status go back to their initial
//! values — once the device agrees ([`VirtioDevice::reset`]) if it was active.
//!
//! The device is held as `Arc<Mutex<dyn VirtioDevice>>` rather than owned, so the VMM can keep
//! a typed handle to the same object (to drive it from an event loop, read its state or stop it)
//! while the transport sees it as `dyn VirtioDevice`. A device that runs its own worker (vsock)
//! gets everything that worker needs in `activate`: queues, duplicates of the queue event fds,
//! memory and the interrupt. The transport locks the device only for config space, feature
//! acknowledgement, activation and reset, and caches what never changes (type, offered
//! features, queue sizes) so register reads take no lock.

use std::sync::{Arc, Mutex, MutexGuard};

use tracing::warn;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::*;

/// The size of the register window; the kernel's `4K` in [`MmioTransport::cmdline_entry`].
pub const MMIO_LEN: u64 = 0x1000;

/// Why a transport could not be built. All of them are bugs in the device or limits of the host,
/// never the guest's doing.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    #[error(
        "virtio device type {device_type} does not offer VIRTIO_F_VERSION_1; the modern MMIO \
         transport only serves virtio 1.x devices"
    )]
    MissingVersion1 { device_type: u32 },
    #[error(
        "queue {index}'s maximum size {size} is not a power of two in 1..=32768; fix the device"
    )]
    QueueMaxSize { index: usize, size: u16 },
    #[error("could not create a queue event fd: {0}; check the process's open-file limit")]
    EventFd(#[source] std::io::Error),
}

/// One queue as the driver configured it (a snapshot's).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueConfig {
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

/// A transport's state as the driver left it (a snapshot's): its registers, its interrupt
/// state and its queues' configuration. Where each queue stood is not here: the used ring's
/// index in guest memory says it (the devices finish every chain they take before a snapshot).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MmioState {
    pub device_type: u32,
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub acked_beyond_64: bool,
    pub queue_sel: u32,
    pub activated: bool,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueueConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the state is for device type {state}, this device is type {device}")]
    DeviceType { state: u32, device: u32 },
    #[error("the state has {state} queues, this device {device}")]
    QueueCount { state: usize, device: usize },
    #[error(
        "queue {index}: size {size} is not one this device takes (at most {max}, a power of two)"
    )]
    QueueSize { index: usize, size: u16, max: u16 },
    #[error("queue {index}: its used ring at {addr:#x} is not in guest memory")]
    UsedRing { index: usize, addr: u64 },
    #[error("activating the device: {0}")]
    Activate(#[from] ActivateError),
    #[error("raising the interrupt: {0}")]
    Interrupt(std::io::Error),
}

/// One virtio device behind one MMIO register window. See the module doc for the state machine.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    // Cached from the device at construction: they never change.
    device_type: u32,
    device_features: u64,

    mem: GuestMemoryMmap,
    /// The driver's configuration of each queue. Activation hands the device fresh copies; these
    /// stay here so the registers keep reading back what the driver wrote.
    queues: Vec<Queue>,
    /// One per queue, written on QueueNotify (by KVM as an ioeventfd, or by us). The device gets
    /// duplicates at activation.
    queue_evts: Vec<EventFd>,
    interrupt: Arc<InterruptStatus>,

    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    /// The driver wrote nonzero bits to a DriverFeatures word past the second: features no
    /// device here offers, so FEATURES_OK must be refused.
    acked_beyond_64: bool,
    queue_sel: u32,
    /// `activate` succeeded and no reset has happened since.
    activated: bool,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device_type)
            .field("status", &self.status)
            .field("activated", &self.activated)
            .field("driver_features", &self.driver_features)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// Put `device` behind a register window. `line` is the device's interrupt (an irqfd); the
    /// transport wraps it in the [`InterruptStatus`] it shares with the device.
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        line: Arc<dyn Interrupt>,
    ) -> Result<Self, MmioError> {
        let (device_type, device_features, max_sizes) = {
            let dev = lock(&device);
            (
                dev.device_type(),
                dev.device_features(),
                dev.queue_max_sizes().to_vec(),
            )
        };
        if device_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(MmioError::MissingVersion1 { device_type });
        }
        let queues = max_sizes
            .iter()
            .enumerate()
            .map(|(index, &size)| {
                Queue::new(size).map_err(|_| MmioError::QueueMaxSize { index, size })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let queue_evts = (0..queues.len())
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(MmioError::EventFd))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            device,
            device_type,
            device_features,
            mem,
            queues,
            queue_evts,
            interrupt: Arc::new(InterruptStatus::new(line)),
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            acked_beyond_64: false,
            queue_sel: 0,
            activated: false,
        })
    }

    /// The size of the register window to map on the bus.
    pub const fn mmio_len() -> u64 {
        MMIO_LEN
    }

    /// The kernel command-line entry that tells the guest about a window at `base` with `irq`:
    /// `virtio_mmio.device=4K@0x<base>:<irq>`.
    pub fn cmdline_entry(base: u64, irq: u32) -> String {
        format!("virtio_mmio.device={}K@{base:#x}:{irq}", MMIO_LEN / 1024)
    }

    /// One event fd per queue, in queue order. The VMM registers queue `i`'s as an ioeventfd on
    /// `base + VIRTIO_MMIO_QUEUE_NOTIFY` with datamatch `i` (4 bytes) and waits on it to run the
    /// device.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The interrupt status shared with the device.
    pub fn interrupt_status(&self) -> &Arc<InterruptStatus> {
        &self.interrupt
    }

    /// The device behind this window.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The device-status byte, as the guest reads it.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device has been activated since the last reset.
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// A guest read of `data.len()` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= VIRTIO_MMIO_CONFIG {
            match config_offset(offset, data.len()) {
                Some(off) => lock(&self.device).read_config(off, data),
                None => warn!(
                    offset,
                    len = data.len(),
                    "virtio-mmio: config read out of range"
                ),
            }
            return;
        }
        if data.len() != 4 || offset & 3 != 0 {
            warn!(
                offset,
                len = data.len(),
                "virtio-mmio: register read not an aligned u32"
            );
            return;
        }
        match self.read_reg(offset) {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => warn!(
                offset,
                "virtio-mmio: read of a register that cannot be read"
            ),
        }
    }

    /// A guest write of `data` at `offset` in the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= VIRTIO_MMIO_CONFIG {
            let Some(off) = config_offset(offset, data.len()) else {
                warn!(
                    offset,
                    len = data.len(),
                    "virtio-mmio: config write out of range"
                );
                return;
            };
            if !self.has(VIRTIO_CONFIG_S_DRIVER) || self.has(VIRTIO_CONFIG_S_FAILED) {
                warn!(
                    offset,
                    status = self.status,
                    "virtio-mmio: config write with no live driver"
                );
                return;
            }
            lock(&self.device).write_config(off, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            warn!(
                offset,
                len = data.len(),
                "virtio-mmio: register write not a u32"
            );
            return;
        };
        if offset & 3 != 0 {
            warn!(offset, "virtio-mmio: unaligned register write");
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }

    fn read_reg(&self, offset: u64) -> Option<u32> {
        let v = match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC_VALUE,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device_type,
            VIRTIO_MMIO_VENDOR_ID => MMIO_VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device_features as u32,
                1 => (self.device_features >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size().into()),
            VIRTIO_MMIO_QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready().into()),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_SHM_LEN_LOW
            | VIRTIO_MMIO_SHM_LEN_HIGH
            | VIRTIO_MMIO_SHM_BASE_LOW
            | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            VIRTIO_MMIO_CONFIG_GENERATION => self.interrupt.config_generation(),
            _ => return None,
        };
        Some(v)
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(v),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = v,
            VIRTIO_MMIO_QUEUE_NUM
            | VIRTIO_MMIO_QUEUE_READY
            | VIRTIO_MMIO_QUEUE_DESC_LOW
            | VIRTIO_MMIO_QUEUE_DESC_HIGH
            | VIRTIO_MMIO_QUEUE_AVAIL_LOW
            | VIRTIO_MMIO_QUEUE_AVAIL_HIGH
            | VIRTIO_MMIO_QUEUE_USED_LOW
            | VIRTIO_MMIO_QUEUE_USED_HIGH => self.write_queue_reg(offset, v),
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(v),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(v),
            VIRTIO_MMIO_STATUS => self.write_status(v),
            // No shared-memory regions: the selector is accepted and every region reads absent.
            VIRTIO_MMIO_SHM_SEL => {}
            _ => warn!(
                offset,
                value = v,
                "virtio-mmio: write to a register that cannot be written"
            ),
        }
    }

    fn has(&self, bits: u32) -> bool {
        self.status & bits == bits
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(usize::try_from(self.queue_sel).ok()?)
    }

    /// DriverFeatures: only between DRIVER and FEATURES_OK.
    fn write_driver_features(&mut self, v: u32) {
        let bad =
            VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_FAILED | VIRTIO_CONFIG_S_NEEDS_RESET;
        if !self.has(VIRTIO_CONFIG_S_DRIVER) || self.status & bad != 0 {
            warn!(
                status = self.status,
                "virtio-mmio: feature write outside feature negotiation"
            );
            return;
        }
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v),
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | u64::from(v) << 32,
            sel => {
                if v != 0 {
                    warn!(
                        sel,
                        value = v,
                        "virtio-mmio: driver acked features past bit 63"
                    );
                    self.acked_beyond_64 = true;
                }
            }
        }
    }

    /// Queue registers: only between FEATURES_OK and DRIVER_OK, and only for a queue that exists.
    fn write_queue_reg(&mut self, offset: u64, v: u32) {
        let bad = VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_FAILED | VIRTIO_CONFIG_S_NEEDS_RESET;
        if !self.has(VIRTIO_CONFIG_S_FEATURES_OK) || self.status & bad != 0 {
            warn!(
                offset,
                status = self.status,
                "virtio-mmio: queue write outside queue setup"
            );
            return;
        }
        let sel = self.queue_sel;
        let Some(q) = usize::try_from(sel)
            .ok()
            .and_then(|i| self.queues.get_mut(i))
        else {
            warn!(
                queue = sel,
                offset, "virtio-mmio: queue write to a queue that does not exist"
            );
            return;
        };
        let low = |old: u64| (old & !0xffff_ffff) | u64::from(v);
        let high = |old: u64| (old & 0xffff_ffff) | u64::from(v) << 32;
        let result = match offset {
            VIRTIO_MMIO_QUEUE_NUM => match u16::try_from(v) {
                Ok(size) => q.try_set_size(size),
                Err(_) => Err(virtio_queue::Error::InvalidSize),
            },
            VIRTIO_MMIO_QUEUE_READY => match v {
                0 | 1 => {
                    q.set_ready(v == 1);
                    Ok(())
                }
                _ => Err(virtio_queue::Error::QueueNotReady),
            },
            VIRTIO_MMIO_QUEUE_DESC_LOW => {
                q.try_set_desc_table_address(GuestAddress(low(q.desc_table())))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                q.try_set_desc_table_address(GuestAddress(high(q.desc_table())))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => {
                q.try_set_avail_ring_address(GuestAddress(low(q.avail_ring())))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                q.try_set_avail_ring_address(GuestAddress(high(q.avail_ring())))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => {
                q.try_set_used_ring_address(GuestAddress(low(q.used_ring())))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH => {
                q.try_set_used_ring_address(GuestAddress(high(q.used_ring())))
            }
            _ => Ok(()),
        };
        if let Err(e) = result {
            warn!(queue = sel, offset, value = v, error = %e, "virtio-mmio: bad queue setting ignored");
        }
    }

    /// QueueNotify that reached us (no ioeventfd matched): do what KVM would have done.
    fn notify(&self, v: u32) {
        match usize::try_from(v).ok().and_then(|i| self.queue_evts.get(i)) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    warn!(queue = v, error = %e, "virtio-mmio: could not signal a queue event");
                }
            }
            None => warn!(
                queue = v,
                "virtio-mmio: notify for a queue that does not exist"
            ),
        }
    }

    /// Status: see the state table in the module doc.
    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // DEVICE_NEEDS_RESET is ours to set; the driver's read-modify-write carries it along.
        let current = self.status & !VIRTIO_CONFIG_S_NEEDS_RESET;
        let requested = v & !VIRTIO_CONFIG_S_NEEDS_RESET;
        if current & !requested != 0 {
            warn!(
                status = self.status,
                value = v,
                "virtio-mmio: driver cleared status bits"
            );
            return;
        }
        let added = requested & !current;
        const ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
        const DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
        const FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
        const DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
        match added {
            0 => {}
            ACK if current == 0 => self.status |= ACK,
            DRIVER if current == ACK => self.status |= DRIVER,
            FEATURES_OK if current == ACK | DRIVER => self.features_ok(),
            DRIVER_OK if current == ACK | DRIVER | FEATURES_OK => self.driver_ok(),
            _ if added & VIRTIO_CONFIG_S_FAILED != 0 => {
                warn!(
                    status = self.status,
                    "virtio-mmio: the guest driver gave up on the device"
                );
                self.status |= VIRTIO_CONFIG_S_FAILED;
            }
            _ => warn!(
                status = self.status,
                value = v,
                "virtio-mmio: status change out of order"
            ),
        }
    }

    /// FEATURES_OK: keep the bit only if the acked set is one the device can honour.
    fn features_ok(&mut self) {
        let acked = self.driver_features;
        let unknown = acked & !self.device_features;
        if unknown != 0 || self.acked_beyond_64 {
            warn!(
                acked,
                unknown, "virtio-mmio: FEATURES_OK refused: driver acked features not offered"
            );
            return;
        }
        if acked & (1 << VIRTIO_F_VERSION_1) == 0 {
            warn!(
                acked,
                "virtio-mmio: FEATURES_OK refused: driver did not accept VIRTIO_F_VERSION_1"
            );
            return;
        }
        self.status |= VIRTIO_CONFIG_S_FEATURES_OK;
        lock(&self.device).ack_features(acked);
    }

    /// DRIVER_OK: the bit is kept either way (the driver is done); a device that cannot start
    /// adds DEVICE_NEEDS_RESET and, as the spec asks, a config-change interrupt.
    fn driver_ok(&mut self) {
        self.status |= VIRTIO_CONFIG_S_DRIVER_OK;
        match self.activate() {
            Ok(()) => self.activated = true,
            Err(e) => {
                warn!(error = %e, "virtio-mmio: device activation failed");
                self.set_needs_reset();
            }
        }
    }

    /// DEVICE_NEEDS_RESET while DRIVER_OK is set comes with a config-change interrupt
    /// (virtio 1.2, 2.1.2), so a running driver notices.
    fn set_needs_reset(&mut self) {
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        if let Err(e) = self.interrupt.signal_config_change() {
            warn!(error = %e, "virtio-mmio: could not raise the interrupt");
        }
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        let event_idx = self.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        for (index, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                return Err(ActivateError::InvalidQueue { index });
            }
            let state = QueueState {
                event_idx_enabled: event_idx,
                ..q.state()
            };
            queues.push(Queue::try_from(state).map_err(|_| ActivateError::InvalidQueue { index })?);
        }
        let queue_evts = self
            .queue_evts
            .iter()
            .enumerate()
            .map(|(index, evt)| {
                evt.try_clone()
                    .map_err(|source| ActivateError::QueueEvent { index, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        lock(&self.device).activate(self.mem.clone(), queues, queue_evts, self.interrupt.clone())
    }

    /// The transport's state for a snapshot (the guest paused).
    pub fn save_state(&self) -> MmioState {
        MmioState {
            device_type: self.device_type,
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            acked_beyond_64: self.acked_beyond_64,
            queue_sel: self.queue_sel,
            activated: self.activated,
            interrupt_status: self.interrupt.status(),
            config_generation: self.interrupt.config_generation(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueConfig {
                    size: q.size(),
                    ready: q.ready(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                })
                .collect(),
        }
    }

    /// Put this freshly made transport (its device new, never activated) into `state`: the
    /// registers read back what the driver wrote, and a device that was active is activated
    /// again with its queues where their used rings (in the restored guest memory) say they
    /// stood. The state is checked as input: a queue size the device does not take, a ring
    /// outside guest memory or a device of another type is an error, never a panic.
    pub fn restore_state(&mut self, state: &MmioState) -> Result<(), RestoreError> {
        use vm_memory::Bytes;
        if state.device_type != self.device_type {
            return Err(RestoreError::DeviceType {
                state: state.device_type,
                device: self.device_type,
            });
        }
        if state.queues.len() != self.queues.len() {
            return Err(RestoreError::QueueCount {
                state: state.queues.len(),
                device: self.queues.len(),
            });
        }
        for (index, (q, c)) in self.queues.iter_mut().zip(&state.queues).enumerate() {
            let max = q.max_size();
            if c.size > max || (c.size != 0 && !c.size.is_power_of_two()) {
                return Err(RestoreError::QueueSize {
                    index,
                    size: c.size,
                    max,
                });
            }
            if c.size != 0 {
                q.set_size(c.size);
            }
            q.set_desc_table_address(Some(c.desc_table as u32), Some((c.desc_table >> 32) as u32));
            q.set_avail_ring_address(Some(c.avail_ring as u32), Some((c.avail_ring >> 32) as u32));
            q.set_used_ring_address(Some(c.used_ring as u32), Some((c.used_ring >> 32) as u32));
            q.set_ready(c.ready);
            if state.activated && c.ready {
                // used.idx, after the used ring's 2-byte flags: how far the device had gone.
                let at = c.used_ring.checked_add(2).ok_or(RestoreError::UsedRing {
                    index,
                    addr: c.used_ring,
                })?;
                let used: u16 =
                    self.mem
                        .read_obj(GuestAddress(at))
                        .map_err(|_| RestoreError::UsedRing {
                            index,
                            addr: c.used_ring,
                        })?;
                let used = u16::from_le(used);
                q.set_next_used(used);
                q.set_next_avail(used);
            }
        }
        self.status = state.status;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.driver_features = state.driver_features & self.device_features;
        self.acked_beyond_64 = state.acked_beyond_64;
        self.queue_sel = state.queue_sel;
        if state.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            lock(&self.device).ack_features(self.driver_features);
        }
        // The interrupt state before the device runs: an activated device may signal at once
        // (the vsock device's TRANSPORT_RESET, from its own thread), and a restore after that
        // would overwrite the cause the guest's handler reads, losing the event.
        self.interrupt
            .restore(state.interrupt_status, state.config_generation)
            .map_err(RestoreError::Interrupt)?;
        if state.activated {
            self.activate()?;
            self.activated = true;
        }
        Ok(())
    }

    /// The driver wrote 0. An active device must agree; if it cannot, nothing changes except
    /// DEVICE_NEEDS_RESET. A device that never started (or failed to) has nothing to undo.
    fn reset(&mut self) {
        if self.activated && !lock(&self.device).reset() {
            warn!("virtio-mmio: the device cannot reset; it keeps running and needs a VM restart");
            self.set_needs_reset();
            return;
        }
        self.activated = false;
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.acked_beyond_64 = false;
        self.queue_sel = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.reset();
        // Notifications from before the reset mean nothing to the next activation. The fds are
        // non-blocking: an empty one just says EAGAIN.
        for evt in &self.queue_evts {
            let _ = evt.read();
        }
    }
}

/// `offset` (≥ VIRTIO_MMIO_CONFIG) as a config-space offset, if `len` bytes there stay inside
/// the window.
fn config_offset(offset: u64, len: usize) -> Option<u64> {
    let end = offset.checked_add(u64::try_from(len).ok()?)?;
    (end <= MMIO_LEN).then(|| offset - VIRTIO_MMIO_CONFIG)
}

/// A device whose lock was poisoned by a panicking thread is still usable: the panic itself is
/// reported by that thread, and the guest deserves an answer.
fn lock(dev: &Mutex<dyn VirtioDevice>) -> MutexGuard<'_, dyn VirtioDevice + 'static> {
    dev.lock().unwrap_or_else(|p| p.into_inner())
}

impl crate::bus::BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        MmioTransport::read(self, offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        MmioTransport::write(self, offset, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_utils::*;
    use proptest::prelude::*;

    const ACK: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
    const DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
    const FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
    const DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
    const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;

    /// Where queue `i` lives in [`test_mem`]: the last one in the second region.
    fn ring_addrs(i: usize) -> (u64, u64, u64) {
        let base = if i == 2 {
            0x20_0000
        } else {
            0x1_0000 * (i as u64 + 1)
        };
        (base, base + 0x1000, base + 0x2000)
    }

    struct Rig {
        t: MmioTransport,
        dev: Arc<Mutex<DummyDevice>>,
        irq: Arc<CountingInterrupt>,
    }

    fn rig_with(mem: GuestMemoryMmap, dev: DummyDevice) -> Rig {
        let dev = Arc::new(Mutex::new(dev));
        let irq = Arc::new(CountingInterrupt::default());
        let t = MmioTransport::new(mem, dev.clone(), irq.clone()).expect("transport");
        Rig { t, dev, irq }
    }

    fn rig() -> Rig {
        rig_with(test_mem(), DummyDevice::default())
    }

    impl Rig {
        fn rd(&mut self, offset: u64) -> u32 {
            let mut b = [0u8; 4];
            self.t.read(offset, &mut b);
            u32::from_le_bytes(b)
        }
        fn wr(&mut self, offset: u64, v: u32) {
            self.t.write(offset, &v.to_le_bytes());
        }
        fn save_state_for_test(&self) -> MmioState {
            self.t.save_state()
        }
        fn dev(&self) -> MutexGuard<'_, DummyDevice> {
            self.dev.lock().unwrap()
        }
        /// Add `bit` to the status the way Linux does: read, or, write.
        fn add_status(&mut self, bit: u32) {
            let s = self.rd(VIRTIO_MMIO_STATUS);
            self.wr(VIRTIO_MMIO_STATUS, s | bit);
        }
        fn read_device_features(&mut self) -> u64 {
            self.wr(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
            let high = self.rd(VIRTIO_MMIO_DEVICE_FEATURES);
            self.wr(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
            let low = self.rd(VIRTIO_MMIO_DEVICE_FEATURES);
            u64::from(high) << 32 | u64::from(low)
        }
        fn write_driver_features(&mut self, f: u64) {
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES, (f >> 32) as u32);
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES, f as u32);
        }
        /// Reset, ACKNOWLEDGE, DRIVER, ack `features`, try FEATURES_OK.
        fn negotiate(&mut self, features: u64) {
            self.wr(VIRTIO_MMIO_STATUS, 0);
            self.add_status(ACK);
            self.add_status(DRIVER);
            self.write_driver_features(features);
            self.add_status(FEATURES_OK);
        }
        fn setup_queue(&mut self, i: u32, size: u32, (desc, avail, used): (u64, u64, u64)) {
            self.wr(VIRTIO_MMIO_QUEUE_SEL, i);
            self.wr(VIRTIO_MMIO_QUEUE_NUM, size);
            self.wr(VIRTIO_MMIO_QUEUE_DESC_LOW, desc as u32);
            self.wr(VIRTIO_MMIO_QUEUE_DESC_HIGH, (desc >> 32) as u32);
            self.wr(VIRTIO_MMIO_QUEUE_AVAIL_LOW, avail as u32);
            self.wr(VIRTIO_MMIO_QUEUE_AVAIL_HIGH, (avail >> 32) as u32);
            self.wr(VIRTIO_MMIO_QUEUE_USED_LOW, used as u32);
            self.wr(VIRTIO_MMIO_QUEUE_USED_HIGH, (used >> 32) as u32);
            self.wr(VIRTIO_MMIO_QUEUE_READY, 1);
        }
        fn setup_all_queues(&mut self) {
            for i in 0..DUMMY_MAX_SIZES.len() {
                self.setup_queue(i as u32, 16 << i, ring_addrs(i));
            }
        }
        /// The whole init sequence up to an active device.
        fn activate(&mut self) {
            self.negotiate(VERSION_1);
            self.setup_all_queues();
            self.add_status(DRIVER_OK);
            assert!(self.t.is_activated());
        }
    }

    /// A snapshot's transport state, put into a new transport and device: the registers read
    /// back the same, the device is activated with the same queues, each where its used ring
    /// in guest memory says it stood; a state that does not fit the device is refused.
    #[test]
    fn a_saved_transport_restores_into_a_new_one() {
        use vm_memory::Bytes;
        let mem = test_mem();
        let mut r = rig_with(mem.clone(), DummyDevice::default());
        r.activate();
        // The device had used 5, 0 and 3 buffers of its three queues.
        for (i, used) in [5u16, 0, 3].into_iter().enumerate() {
            let (_, _, used_ring) = ring_addrs(i);
            mem.write_obj(used.to_le(), GuestAddress(used_ring + 2))
                .unwrap();
        }
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 1);
        let state = r.save_state_for_test();
        assert!(state.activated);

        let mut n = rig_with(mem.clone(), DummyDevice::default());
        n.t.restore_state(&state).unwrap();
        assert!(n.t.is_activated());
        assert_eq!(n.t.save_state(), state);
        for reg in [
            VIRTIO_MMIO_STATUS,
            VIRTIO_MMIO_QUEUE_NUM_MAX,
            VIRTIO_MMIO_QUEUE_READY,
        ] {
            assert_eq!(n.rd(reg), r.rd(reg), "register {reg:#x}");
        }
        assert_eq!(n.dev().acked, r.dev().acked);
        let activation = n.dev().activations.last().unwrap().clone();
        let before = r.dev().activations.last().unwrap().clone();
        for (i, (q, b)) in activation.iter().zip(&before).enumerate() {
            assert_eq!(
                (q.size, q.desc_table, q.avail_ring, q.used_ring),
                (b.size, b.desc_table, b.avail_ring, b.used_ring),
                "queue {i}"
            );
            let used = [5u16, 0, 3][i];
            assert_eq!((q.next_used, q.next_avail), (used, used), "queue {i}");
        }

        // A device that signals as it activates (the restored vsock device's transport reset):
        // its cause survives the restore of the saved (empty) interrupt state.
        assert_eq!(state.interrupt_status, 0);
        let signalling = DummyDevice {
            signal_on_activate: true,
            ..DummyDevice::default()
        };
        let mut s = rig_with(mem.clone(), signalling);
        s.t.restore_state(&state).unwrap();
        assert_eq!(
            s.rd(VIRTIO_MMIO_INTERRUPT_STATUS) & VIRTIO_MMIO_INT_VRING,
            VIRTIO_MMIO_INT_VRING,
            "the restore lost the cause of the device's first interrupt"
        );

        // What does not fit is refused.
        let mut other = state.clone();
        other.device_type = 26;
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::DeviceType { .. })
        ));
        let mut other = state.clone();
        other.queues[2].size = 128;
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::QueueSize { index: 2, .. })
        ));
        let mut other = state.clone();
        other.queues[0].size = 3;
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::QueueSize { .. })
        ));
        let mut other = state.clone();
        other.queues[1].used_ring = u64::MAX - 1;
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::UsedRing { index: 1, .. })
        ));
        other.queues.pop();
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::QueueCount { .. })
        ));
        // A ring outside guest memory is the activation's error, as for a driver's.
        let mut other = state.clone();
        other.queues[0].desc_table = 0x7fff_ffff_0000;
        assert!(matches!(
            rig().t.restore_state(&other),
            Err(RestoreError::Activate(_))
        ));
    }

    #[test]
    fn driver_init_sequence_activates_once_with_the_programmed_queues() {
        let mut r = rig();
        assert_eq!(r.rd(VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
        assert_eq!(r.rd(VIRTIO_MMIO_VERSION), 2);
        assert_eq!(r.rd(VIRTIO_MMIO_DEVICE_ID), DUMMY_TYPE);
        assert_eq!(r.rd(VIRTIO_MMIO_VENDOR_ID), 0);

        r.wr(VIRTIO_MMIO_STATUS, 0);
        r.add_status(ACK);
        r.add_status(DRIVER);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER);
        let offered = r.read_device_features();
        assert_eq!(offered, VERSION_1 | DUMMY_FEATURE_LOW);
        r.write_driver_features(offered);
        r.add_status(FEATURES_OK);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER | FEATURES_OK);
        assert_eq!(r.dev().acked, Some(offered));

        for (i, &max) in DUMMY_MAX_SIZES.iter().enumerate() {
            r.wr(VIRTIO_MMIO_QUEUE_SEL, i as u32);
            assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 0);
            assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_NUM_MAX), u32::from(max));
        }
        r.setup_all_queues();
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 1);
        assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 1);
        assert!(
            r.dev().activations.is_empty(),
            "nothing starts before DRIVER_OK"
        );

        r.add_status(DRIVER_OK);
        assert_eq!(
            r.rd(VIRTIO_MMIO_STATUS),
            ACK | DRIVER | FEATURES_OK | DRIVER_OK
        );
        // Writing the same status again (a read-modify-write of a set bit) changes nothing.
        r.add_status(DRIVER_OK);
        let dev = r.dev();
        assert_eq!(dev.activations.len(), 1, "activate is called exactly once");
        let queues = &dev.activations[0];
        assert_eq!(queues.len(), DUMMY_MAX_SIZES.len());
        for (i, q) in queues.iter().enumerate() {
            let (desc, avail, used) = ring_addrs(i);
            assert!(q.ready);
            assert_eq!(q.size, 16 << i);
            assert_eq!(q.max_size, DUMMY_MAX_SIZES[i]);
            assert_eq!(
                (q.desc_table, q.avail_ring, q.used_ring),
                (desc, avail, used)
            );
            assert!(!q.event_idx_enabled);
        }
        assert!(dev.interrupt.is_some());
    }

    #[test]
    fn unready_queues_are_handed_over_unready() {
        let mut r = rig();
        r.negotiate(VERSION_1);
        r.setup_queue(0, 256, ring_addrs(0));
        r.add_status(DRIVER_OK);
        let dev = r.dev();
        let q = &dev.activations[0];
        assert!(q[0].ready);
        assert!(!q[1].ready && !q[2].ready);
    }

    #[test]
    fn event_idx_reaches_the_queues_when_negotiated() {
        let features = VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX;
        let mut r = rig_with(
            test_mem(),
            DummyDevice {
                features,
                ..DummyDevice::default()
            },
        );
        r.negotiate(features);
        r.setup_all_queues();
        r.add_status(DRIVER_OK);
        assert!(r.dev().activations[0].iter().all(|q| q.event_idx_enabled));
    }

    #[test]
    fn features_ok_refused_for_features_not_offered() {
        let mut r = rig();
        r.negotiate(VERSION_1 | 1 << 40);
        assert_eq!(
            r.rd(VIRTIO_MMIO_STATUS),
            ACK | DRIVER,
            "FEATURES_OK does not stick"
        );
        assert_eq!(r.dev().acked, None);
        // The driver gives up; nothing but a reset moves it on.
        r.add_status(VIRTIO_CONFIG_S_FAILED);
        r.add_status(FEATURES_OK);
        assert_eq!(
            r.rd(VIRTIO_MMIO_STATUS),
            ACK | DRIVER | VIRTIO_CONFIG_S_FAILED
        );

        // Bits past 63 are just as unknown.
        r.wr(VIRTIO_MMIO_STATUS, 0);
        r.add_status(ACK);
        r.add_status(DRIVER);
        r.write_driver_features(VERSION_1);
        r.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 2);
        r.wr(VIRTIO_MMIO_DRIVER_FEATURES, 1);
        r.add_status(FEATURES_OK);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER);

        // ... but zero words past 63 are fine.
        r.wr(VIRTIO_MMIO_STATUS, 0);
        r.add_status(ACK);
        r.add_status(DRIVER);
        r.write_driver_features(VERSION_1);
        r.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 3);
        r.wr(VIRTIO_MMIO_DRIVER_FEATURES, 0);
        r.add_status(FEATURES_OK);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER | FEATURES_OK);
    }

    #[test]
    fn features_ok_refused_without_version_1() {
        let mut r = rig();
        r.negotiate(DUMMY_FEATURE_LOW);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER);
        assert_eq!(r.dev().acked, None);
        // A second try with VERSION_1 succeeds without a reset.
        r.write_driver_features(VERSION_1);
        r.add_status(FEATURES_OK);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER | FEATURES_OK);
        assert_eq!(r.dev().acked, Some(VERSION_1));
    }

    #[test]
    fn feature_writes_outside_negotiation_are_ignored() {
        let mut r = rig();
        r.add_status(ACK);
        r.write_driver_features(u64::MAX); // before DRIVER
        r.add_status(DRIVER);
        r.write_driver_features(VERSION_1);
        r.add_status(FEATURES_OK);
        r.write_driver_features(u64::MAX); // after FEATURES_OK
        r.setup_all_queues();
        r.add_status(DRIVER_OK);
        assert_eq!(r.dev().acked, Some(VERSION_1));
        assert_eq!(r.t.driver_features, VERSION_1);
    }

    #[test]
    fn status_changes_out_of_order_are_ignored() {
        let mut r = rig();
        r.wr(VIRTIO_MMIO_STATUS, DRIVER); // DRIVER before ACKNOWLEDGE
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), 0);
        r.wr(VIRTIO_MMIO_STATUS, ACK | DRIVER); // two steps at once
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), 0);
        r.add_status(ACK);
        r.add_status(DRIVER_OK); // skipping ahead
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK);
        r.add_status(DRIVER);
        r.wr(VIRTIO_MMIO_STATUS, DRIVER); // clearing ACKNOWLEDGE
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER);
        r.wr(VIRTIO_MMIO_STATUS, ACK | DRIVER | 0x100); // a bit that does not exist
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER);
        r.write_driver_features(VERSION_1);
        r.add_status(FEATURES_OK);
        r.setup_all_queues();
        // The device's own bit in a driver write is neither set nor a step.
        r.wr(
            VIRTIO_MMIO_STATUS,
            ACK | DRIVER | FEATURES_OK | VIRTIO_CONFIG_S_NEEDS_RESET,
        );
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), ACK | DRIVER | FEATURES_OK);
        assert!(r.dev().activations.is_empty());
    }

    #[test]
    fn queue_writes_outside_queue_setup_are_ignored() {
        let mut r = rig();
        // Before FEATURES_OK.
        r.add_status(ACK);
        r.add_status(DRIVER);
        r.setup_queue(0, 16, ring_addrs(0));
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 0);

        // After DRIVER_OK.
        r.activate();
        r.setup_queue(0, 32, (0x8_0000, 0x8_1000, 0x8_2000));
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 0);
        r.wr(VIRTIO_MMIO_QUEUE_READY, 0);
        assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 1);
        let q = r.t.queues[0].state();
        assert_eq!(q.size, 16);
        assert_eq!(q.desc_table, ring_addrs(0).0);
        assert_eq!(r.dev().activations.len(), 1);
    }

    #[test]
    fn bad_queue_settings_are_ignored() {
        let mut r = rig();
        r.negotiate(VERSION_1);
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 2); // max 64
        r.wr(VIRTIO_MMIO_QUEUE_NUM, 32);
        for bad in [0, 3, 48, 128, 0x1_0000, u32::MAX] {
            r.wr(VIRTIO_MMIO_QUEUE_NUM, bad);
        }
        r.wr(VIRTIO_MMIO_QUEUE_DESC_LOW, 0x1000);
        r.wr(VIRTIO_MMIO_QUEUE_DESC_LOW, 0x1008); // desc table: 16-byte aligned
        r.wr(VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x2000);
        r.wr(VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x2001); // avail ring: 2-byte aligned
        r.wr(VIRTIO_MMIO_QUEUE_USED_LOW, 0x3000);
        r.wr(VIRTIO_MMIO_QUEUE_USED_LOW, 0x3002); // used ring: 4-byte aligned
        r.wr(VIRTIO_MMIO_QUEUE_READY, 2); // only 0 and 1 mean anything
        let q = r.t.queues[2].state();
        assert_eq!(q.size, 32);
        assert_eq!(
            (q.desc_table, q.avail_ring, q.used_ring),
            (0x1000, 0x2000, 0x3000)
        );
        assert!(!q.ready);

        // A selector past the last queue: reads say "no such queue", writes go nowhere.
        for sel in [3, 0x1_0000, u32::MAX] {
            r.wr(VIRTIO_MMIO_QUEUE_SEL, sel);
            assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
            r.setup_queue(sel, 16, ring_addrs(0));
            assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 0);
        }
    }

    #[test]
    fn a_ready_queue_outside_guest_memory_fails_activation() {
        let mut r = rig();
        r.negotiate(VERSION_1);
        r.setup_all_queues();
        // Queue 1's descriptor table runs into the hole between the two RAM regions.
        r.setup_queue(1, 256, (0x10_0000 - 0x800, 0x1_1000, 0x1_2000));
        r.add_status(DRIVER_OK);
        assert!(!r.t.is_activated());
        assert!(r.dev().activations.is_empty());
        let status = r.rd(VIRTIO_MMIO_STATUS);
        assert_eq!(
            status,
            ACK | DRIVER | FEATURES_OK | DRIVER_OK | VIRTIO_CONFIG_S_NEEDS_RESET
        );
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r.irq.count(), 1);
        // A reset recovers without asking the device (it never started).
        r.activate();
        assert_eq!(r.dev().resets, 0);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    }

    #[test]
    fn ring_addresses_at_the_top_of_the_address_space_do_not_overflow() {
        let mut r = rig();
        r.negotiate(VERSION_1);
        let top = !0xf_u64;
        r.setup_queue(0, 256, (top, top, top));
        r.add_status(DRIVER_OK);
        assert!(r.t.status() & VIRTIO_CONFIG_S_NEEDS_RESET != 0);
    }

    #[test]
    fn a_device_that_cannot_start_needs_reset() {
        let mut r = rig_with(
            test_mem(),
            DummyDevice {
                fail_activate: true,
                ..DummyDevice::default()
            },
        );
        r.negotiate(VERSION_1);
        r.setup_all_queues();
        r.add_status(DRIVER_OK);
        assert!(!r.t.is_activated());
        assert!(r.rd(VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET != 0);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r.rd(VIRTIO_MMIO_CONFIG_GENERATION), 1);
    }

    #[test]
    fn queue_notify_writes_the_matching_event_fd() {
        let mut r = rig();
        r.activate();
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 1);
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 1);
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 2);
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 3); // no such queue
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, u32::MAX);
        let evts = r.t.queue_evts();
        assert_eq!(evts.len(), DUMMY_MAX_SIZES.len());
        assert!(evts[0].read().is_err(), "queue 0 was not notified");
        assert_eq!(evts[1].read().unwrap(), 2);
        assert_eq!(evts[2].read().unwrap(), 1);
        // The device's duplicates share the counters: what KVM or we write, the device reads.
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        let dev = r.dev();
        assert_eq!(dev.queue_evts.len(), DUMMY_MAX_SIZES.len());
        assert_eq!(dev.queue_evts[0].read().unwrap(), 1);
        assert!(dev.queue_evts[1].read().is_err());
    }

    #[test]
    fn interrupt_status_and_ack() {
        let mut r = rig();
        r.activate();
        let irq = r.dev().interrupt.clone().unwrap();
        assert!(Arc::ptr_eq(&irq, r.t.interrupt_status()));

        irq.signal_used_queue().unwrap();
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        assert_eq!(r.irq.count(), 1);
        assert_eq!(r.rd(VIRTIO_MMIO_CONFIG_GENERATION), 0);
        irq.signal_config_change().unwrap();
        assert_eq!(
            r.rd(VIRTIO_MMIO_INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG
        );
        assert_eq!(r.rd(VIRTIO_MMIO_CONFIG_GENERATION), 1);
        assert_eq!(r.irq.count(), 2);

        r.wr(VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
        r.wr(VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        // Signalling a pending cause still raises the line.
        irq.signal_used_queue().unwrap();
        irq.signal_used_queue().unwrap();
        assert_eq!(r.irq.count(), 4);
    }

    #[test]
    fn reset_returns_everything_to_its_initial_state() {
        let mut r = rig();
        r.activate();
        r.t.interrupt_status().signal_used_queue().unwrap();
        r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        r.wr(VIRTIO_MMIO_QUEUE_SEL, 2);

        r.wr(VIRTIO_MMIO_STATUS, 0);
        assert_eq!(r.dev().resets, 1);
        assert!(r.dev().interrupt.is_none());
        assert!(!r.t.is_activated());
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), 0);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        assert_eq!(r.t.driver_features, 0);
        assert!(
            r.t.queue_evts()[0].read().is_err(),
            "stale notifications drained"
        );
        for (i, &max) in DUMMY_MAX_SIZES.iter().enumerate() {
            r.wr(VIRTIO_MMIO_QUEUE_SEL, i as u32);
            assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_READY), 0);
            assert_eq!(r.t.queues[i].size(), max);
        }

        // And the device comes up again.
        r.activate();
        assert_eq!(r.dev().activations.len(), 2);
    }

    #[test]
    fn reset_refused_by_the_device_leaves_it_running() {
        let mut r = rig_with(
            test_mem(),
            DummyDevice {
                can_reset: false,
                ..DummyDevice::default()
            },
        );
        r.activate();
        r.wr(VIRTIO_MMIO_STATUS, 0);
        assert_eq!(r.dev().resets, 1);
        assert!(r.t.is_activated());
        let all = ACK | DRIVER | FEATURES_OK | DRIVER_OK;
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), all | VIRTIO_CONFIG_S_NEEDS_RESET);
        assert_eq!(r.rd(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
        // Re-running the init sequence does not activate it a second time.
        r.negotiate(VERSION_1);
        r.setup_all_queues();
        r.add_status(DRIVER_OK);
        assert_eq!(r.dev().activations.len(), 1);
    }

    #[test]
    fn reset_before_activation_does_not_ask_the_device() {
        let mut r = rig_with(
            test_mem(),
            DummyDevice {
                can_reset: false,
                ..DummyDevice::default()
            },
        );
        r.negotiate(VERSION_1);
        r.wr(VIRTIO_MMIO_STATUS, 0);
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), 0);
        assert_eq!(r.dev().resets, 0);
    }

    #[test]
    fn config_space_round_trip() {
        let mut r = rig();
        let mut b = [0u8; 4];
        r.t.read(VIRTIO_MMIO_CONFIG + 2, &mut b);
        assert_eq!(&b, b"2345");
        // Writes need a driver.
        r.t.write(VIRTIO_MMIO_CONFIG, b"XY");
        assert_eq!(&r.dev().config[..2], b"01");
        r.add_status(ACK);
        r.add_status(DRIVER);
        r.t.write(VIRTIO_MMIO_CONFIG + 1, b"XY");
        assert_eq!(&r.dev().config[..4], b"0XY3");
        let mut b = [0u8; 1];
        r.t.read(VIRTIO_MMIO_CONFIG + 2, &mut b);
        assert_eq!(&b, b"Y");
        // Past the device's config: zeros. Past the window: nothing reaches the device.
        let mut b = [0xaau8; 8];
        r.t.read(VIRTIO_MMIO_CONFIG + 12, &mut b);
        assert_eq!(&b, b"cdef\0\0\0\0");
        let mut b = [0xaau8; 8];
        r.t.read(MMIO_LEN - 4, &mut b);
        assert_eq!(b, [0; 8]);
        r.t.read(u64::MAX - 1, &mut b);
        r.t.write(u64::MAX - 1, &b);
    }

    #[test]
    fn register_accesses_must_be_aligned_u32() {
        let mut r = rig();
        let mut b = [0xaau8; 2];
        r.t.read(VIRTIO_MMIO_MAGIC_VALUE, &mut b);
        assert_eq!(b, [0, 0]);
        let mut b = [0xaau8; 4];
        r.t.read(VIRTIO_MMIO_MAGIC_VALUE + 1, &mut b);
        assert_eq!(b, [0; 4]);
        let mut b = [0xaau8; 8];
        r.t.read(VIRTIO_MMIO_MAGIC_VALUE, &mut b);
        assert_eq!(b, [0; 8]);
        r.t.write(VIRTIO_MMIO_STATUS, &[ACK as u8]);
        r.t.write(VIRTIO_MMIO_STATUS, &u64::from(ACK).to_le_bytes());
        r.t.write(VIRTIO_MMIO_STATUS + 1, &ACK.to_le_bytes());
        assert_eq!(r.rd(VIRTIO_MMIO_STATUS), 0);
        // Write-only and legacy registers read as zero; read-only ones ignore writes.
        assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_NOTIFY), 0);
        assert_eq!(r.rd(VIRTIO_MMIO_QUEUE_PFN), 0);
        r.wr(VIRTIO_MMIO_DEVICE_ID, 7);
        assert_eq!(r.rd(VIRTIO_MMIO_DEVICE_ID), DUMMY_TYPE);
    }

    #[test]
    fn feature_words_past_the_second_read_zero_and_shared_memory_is_absent() {
        let mut r = rig();
        r.wr(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
        assert_eq!(r.rd(VIRTIO_MMIO_DEVICE_FEATURES), 0);
        r.wr(VIRTIO_MMIO_SHM_SEL, 0);
        assert_eq!(r.rd(VIRTIO_MMIO_SHM_LEN_LOW), u32::MAX);
        assert_eq!(r.rd(VIRTIO_MMIO_SHM_LEN_HIGH), u32::MAX);
    }

    #[test]
    fn construction_checks_the_device() {
        let irq: Arc<dyn Interrupt> = Arc::new(CountingInterrupt::default());
        let legacy = DummyDevice {
            features: DUMMY_FEATURE_LOW,
            ..DummyDevice::default()
        };
        let err = MmioTransport::new(test_mem(), Arc::new(Mutex::new(legacy)), irq.clone());
        assert!(matches!(
            err,
            Err(MmioError::MissingVersion1 {
                device_type: DUMMY_TYPE
            })
        ));
        for bad in [0, 3, 65535] {
            let dev = DummyDevice {
                max_sizes: vec![256, bad],
                ..DummyDevice::default()
            };
            let err = MmioTransport::new(test_mem(), Arc::new(Mutex::new(dev)), irq.clone());
            assert!(matches!(err, Err(MmioError::QueueMaxSize { index: 1, size }) if size == bad));
        }
    }

    #[test]
    fn cmdline_entry_and_window_size() {
        assert_eq!(MmioTransport::mmio_len(), 0x1000);
        assert_eq!(
            MmioTransport::cmdline_entry(0xd000_0000, 5),
            "virtio_mmio.device=4K@0xd0000000:5"
        );
    }

    /// The phases the hostile tests start from.
    fn rig_in_phase(mem: &GuestMemoryMmap, phase: usize) -> Rig {
        let mut r = rig_with(
            mem.clone(),
            DummyDevice {
                fail_activate: phase == 7,
                ..DummyDevice::default()
            },
        );
        let steps: [&dyn Fn(&mut Rig); 8] = [
            &|_| {},
            &|r| r.add_status(ACK),
            &|r| r.add_status(DRIVER),
            &|r| {
                r.write_driver_features(VERSION_1 | DUMMY_FEATURE_LOW);
                r.add_status(FEATURES_OK);
            },
            &|r| r.setup_all_queues(),
            &|r| r.add_status(DRIVER_OK),
            &|r| r.add_status(VIRTIO_CONFIG_S_FAILED),
            &|_| {},
        ];
        let last = if phase == 7 { 5 } else { phase };
        for step in &steps[..=last] {
            step(&mut r);
        }
        let all = ACK | DRIVER | FEATURES_OK | DRIVER_OK;
        let expected = [
            0,
            ACK,
            ACK | DRIVER,
            ACK | DRIVER | FEATURES_OK,
            ACK | DRIVER | FEATURES_OK,
            all,
            all | VIRTIO_CONFIG_S_FAILED,
            all | VIRTIO_CONFIG_S_NEEDS_RESET,
        ];
        assert_eq!(r.t.status(), expected[phase], "phase {phase}");
        r
    }

    const GARBAGE: [u64; 14] = [
        0,
        1,
        2,
        3,
        0xf,
        0x40,
        0x80,
        0xff,
        0x1000,
        0x8000_0000,
        0xffff_ffff,
        0xdead_beef_cafe_f00d,
        0x0000_0001_0000_0000,
        u64::MAX,
    ];

    #[test]
    fn hostile_guest_cannot_panic_the_transport() {
        let mem = test_mem();
        for phase in 0..8 {
            for offset in 0..0x200u64 {
                let mut r = rig_in_phase(&mem, phase);
                for len in [1usize, 2, 4, 8] {
                    for v in GARBAGE {
                        let mut b = [0u8; 8];
                        r.t.read(offset, &mut b[..len]);
                        r.t.write(offset, &v.to_le_bytes()[..len]);
                        // Also through the side doors a guest reaches indirectly.
                        r.t.interrupt_status().ack(v as u32);
                    }
                }
                // Whatever happened, the window still answers and a reset brings it back.
                assert_eq!(r.rd(VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC_VALUE);
                r.dev().fail_activate = false;
                r.activate();
            }
        }
    }

    /// Registers worth aiming at, so random sequences reach deep states.
    const TARGETS: [u64; 14] = [
        VIRTIO_MMIO_DEVICE_FEATURES_SEL,
        VIRTIO_MMIO_DRIVER_FEATURES,
        VIRTIO_MMIO_DRIVER_FEATURES_SEL,
        VIRTIO_MMIO_QUEUE_SEL,
        VIRTIO_MMIO_QUEUE_NUM,
        VIRTIO_MMIO_QUEUE_READY,
        VIRTIO_MMIO_QUEUE_NOTIFY,
        VIRTIO_MMIO_INTERRUPT_ACK,
        VIRTIO_MMIO_STATUS,
        VIRTIO_MMIO_QUEUE_DESC_LOW,
        VIRTIO_MMIO_QUEUE_DESC_HIGH,
        VIRTIO_MMIO_QUEUE_AVAIL_LOW,
        VIRTIO_MMIO_QUEUE_USED_HIGH,
        VIRTIO_MMIO_CONFIG,
    ];

    fn op() -> impl Strategy<Value = (bool, u64, usize, u64)> {
        let offset = prop_oneof![0u64..0x1100, prop::sample::select(TARGETS.to_vec())];
        let value = prop_oneof![
            any::<u64>(),
            0u64..0x100,
            prop::sample::select(GARBAGE.to_vec())
        ];
        let len = prop_oneof![Just(4usize), prop::sample::select(vec![0usize, 1, 2, 3, 8])];
        (any::<bool>(), offset, len, value)
    }

    proptest! {
        #[test]
        fn random_access_sequences_keep_the_transport_consistent(
            phase in 0usize..8,
            ops in prop::collection::vec(op(), 1..200),
        ) {
            let mem = test_mem();
            let mut r = rig_in_phase(&mem, phase);
            for (write, offset, len, v) in ops {
                let mut b = [0u8; 8];
                if write {
                    r.t.write(offset, &v.to_le_bytes()[..len]);
                } else {
                    r.t.read(offset, &mut b[..len]);
                }
                // Invariants: at most one activation per reset, never one without DRIVER_OK.
                let dev = r.dev.lock().unwrap();
                prop_assert!(dev.activations.len() <= 1 + dev.resets);
                if r.t.is_activated() {
                    prop_assert!(r.t.status() & DRIVER_OK != 0);
                    prop_assert!(dev.acked.is_some());
                }
            }
        }
    }
}
