//! An address bus: maps address ranges to devices. vCPU threads dispatch their exits here —
//! one bus for port I/O (addresses are port numbers), one for MMIO.
//!
//! Reads of addresses nobody claims return all ones (what an empty ISA bus floats to); writes
//! to them are dropped. Neither is an error: guests probe for devices that are not there.

use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("range {base:#x}+{len:#x} overlaps a device already on the bus")]
    Overlap { base: u64, len: u64 },
    #[error("range {base:#x}+{len:#x} is empty or wraps")]
    BadRange { base: u64, len: u64 },
}

struct Slot {
    base: u64,
    len: u64,
    dev: Arc<Mutex<dyn BusDevice>>,
}

/// The bus. Built once before the vCPUs start, then shared read-only between them.
#[derive(Default)]
pub struct Bus {
    slots: Vec<Slot>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<_> = self.slots.iter().map(|s| (s.base, s.len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = match base.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => return Err(BusError::BadRange { base, len }),
        };
        if self
            .slots
            .iter()
            .any(|s| base < s.base + s.len && s.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        self.slots.push(Slot { base, len, dev });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(&Slot, u64)> {
        self.slots
            .iter()
            .find(|s| addr >= s.base && addr - s.base < s.len)
            .map(|s| (s, addr - s.base))
    }

    pub fn read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((slot, off)) => lock(&slot.dev).read(off, data),
            None => data.fill(0xff),
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        if let Some((slot, off)) = self.find(addr) {
            lock(&slot.dev).write(off, data);
        }
    }
}

/// A device whose lock was poisoned by a panicking vCPU thread is still usable: device state is
/// plain data, and the panic itself is reported by that thread.
fn lock(dev: &Mutex<dyn BusDevice>) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    dev.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn dispatches_by_range_and_floats_unclaimed_addresses() {
        let mut bus = Bus::new();
        bus.insert(0x3f8, 8, Arc::new(Mutex::new(Reg(1)))).unwrap();
        let mut b = [0u8; 1];
        bus.read(0x3f9, &mut b);
        assert_eq!(b, [2]);
        bus.write(0x3f8, &[10]);
        bus.read(0x3ff, &mut b);
        assert_eq!(b, [17]);
        bus.read(0x400, &mut b);
        assert_eq!(b, [0xff]);
        bus.write(0x400, &[1]); // dropped, no panic
    }

    #[test]
    fn rejects_overlaps_and_bad_ranges() {
        let mut bus = Bus::new();
        bus.insert(0x60, 5, Arc::new(Mutex::new(Reg(0)))).unwrap();
        let r = bus.insert(0x64, 1, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(r, Err(BusError::Overlap { base: 0x64, len: 1 }));
        let r = bus.insert(u64::MAX, 2, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(
            r,
            Err(BusError::BadRange {
                base: u64::MAX,
                len: 2
            })
        );
        let r = bus.insert(0x10, 0, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(r, Err(BusError::BadRange { base: 0x10, len: 0 }));
    }
}
