//! Test fixtures for virtio: a dummy device that records what the transport does to it, an
//! interrupt line that counts its triggers, and a small guest memory.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueState};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateError, Interrupt, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1};

/// The dummy's device type (virtio_ids.h: 19 is vsock; the transport does not care).
pub const DUMMY_TYPE: u32 = 19;
/// An offered feature besides VERSION_1, in the low word: bit 3.
pub const DUMMY_FEATURE_LOW: u64 = 1 << 3;
/// The dummy's queue maximum sizes.
pub const DUMMY_MAX_SIZES: [u16; 3] = [256, 256, 64];

/// Guest RAM for tests: two regions with a hole between them, 0..1 MiB and 2..3 MiB.
pub fn test_mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x10_0000),
        (GuestAddress(0x20_0000), 0x10_0000),
    ])
    .expect("test guest memory")
}

/// An interrupt line that counts how often it was raised.
#[derive(Debug, Default)]
pub struct CountingInterrupt {
    count: AtomicUsize,
}

impl CountingInterrupt {
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

impl Interrupt for CountingInterrupt {
    fn trigger(&self) -> io::Result<()> {
        self.count.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// A device with a 16-byte config space that records every call.
#[derive(Debug)]
pub struct DummyDevice {
    pub features: u64,
    pub max_sizes: Vec<u16>,
    pub config: [u8; 16],
    /// What `reset` answers.
    pub can_reset: bool,
    /// Make `activate` fail.
    pub fail_activate: bool,
    /// Signal a used buffer from `activate` (as the restored vsock device's transport reset).
    pub signal_on_activate: bool,
    pub acked: Option<u64>,
    /// One entry per `activate` call: the queues it was given.
    pub activations: Vec<Vec<QueueState>>,
    /// The queue event fds of the last activation.
    pub queue_evts: Vec<EventFd>,
    pub interrupt: Option<Arc<InterruptStatus>>,
    pub resets: usize,
}

impl Default for DummyDevice {
    fn default() -> Self {
        DummyDevice {
            features: (1 << VIRTIO_F_VERSION_1) | DUMMY_FEATURE_LOW,
            max_sizes: DUMMY_MAX_SIZES.to_vec(),
            config: *b"0123456789abcdef",
            can_reset: true,
            fail_activate: false,
            signal_on_activate: false,
            acked: None,
            activations: Vec::new(),
            queue_evts: Vec::new(),
            interrupt: None,
            resets: 0,
        }
    }
}

impl VirtioDevice for DummyDevice {
    fn device_type(&self) -> u32 {
        DUMMY_TYPE
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.max_sizes
    }
    fn device_features(&self) -> u64 {
        self.features
    }
    fn ack_features(&mut self, acked: u64) {
        self.acked = Some(acked);
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            if let Some(v) = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| self.config.get(o))
            {
                *b = *v;
            }
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(v) = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| self.config.get_mut(o))
            {
                *v = *b;
            }
        }
    }
    fn activate(
        &mut self,
        _mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError> {
        if self.fail_activate {
            return Err(ActivateError::Backend(io::Error::other("dummy refuses")));
        }
        if queue_evts.len() != queues.len() {
            return Err(ActivateError::QueueCount {
                expected: queues.len(),
                got: queue_evts.len(),
            });
        }
        self.activations
            .push(queues.iter().map(Queue::state).collect());
        self.queue_evts = queue_evts;
        if self.signal_on_activate {
            interrupt
                .signal_used_queue()
                .map_err(ActivateError::Backend)?;
        }
        self.interrupt = Some(interrupt);
        Ok(())
    }
    fn reset(&mut self) -> bool {
        self.resets += 1;
        if self.can_reset {
            self.interrupt = None;
            self.queue_evts.clear();
        }
        self.can_reset
    }
}
