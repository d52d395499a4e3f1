//! A port-I/O bus: maps port ranges to devices. vCPU threads dispatch their I/O exits here.
//!
//! Reads of ports nobody claims return all ones (what an empty ISA bus floats to); writes to
//! them are dropped. Neither is an error: guests probe ports that are not there.

use std::sync::{Arc, Mutex};

/// A device on the port-I/O bus. `offset` is relative to the start of its range.
pub trait PioDevice: Send {
    fn read(&mut self, offset: u16, data: &mut [u8]);
    fn write(&mut self, offset: u16, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("port range {base:#x}+{len} overlaps a device already on the bus")]
    Overlap { base: u16, len: u16 },
    #[error("port range {base:#x}+{len} is empty or wraps")]
    BadRange { base: u16, len: u16 },
}

struct Slot {
    base: u16,
    len: u16,
    dev: Arc<Mutex<dyn PioDevice>>,
}

/// The bus. Built once before the vCPUs start, then shared read-only between them.
#[derive(Default)]
pub struct PioBus {
    slots: Vec<Slot>,
}

impl std::fmt::Debug for PioBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<_> = self.slots.iter().map(|s| (s.base, s.len)).collect();
        f.debug_struct("PioBus").field("ranges", &ranges).finish()
    }
}

impl PioBus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        base: u16,
        len: u16,
        dev: Arc<Mutex<dyn PioDevice>>,
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

    fn find(&self, port: u16) -> Option<(&Slot, u16)> {
        self.slots
            .iter()
            .find(|s| port >= s.base && port - s.base < s.len)
            .map(|s| (s, port - s.base))
    }

    pub fn read(&self, port: u16, data: &mut [u8]) {
        match self.find(port) {
            Some((slot, off)) => lock(&slot.dev).read(off, data),
            None => data.fill(0xff),
        }
    }

    pub fn write(&self, port: u16, data: &[u8]) {
        if let Some((slot, off)) = self.find(port) {
            lock(&slot.dev).write(off, data);
        }
    }
}

/// A device whose lock was poisoned by a panicking vCPU thread is still usable: device state is
/// plain data, and the panic itself is reported by that thread.
fn lock(dev: &Mutex<dyn PioDevice>) -> std::sync::MutexGuard<'_, dyn PioDevice + 'static> {
    dev.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl PioDevice for Reg {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u16, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn dispatches_by_range_and_floats_unclaimed_ports() {
        let mut bus = PioBus::new();
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
        let mut bus = PioBus::new();
        bus.insert(0x60, 5, Arc::new(Mutex::new(Reg(0)))).unwrap();
        let r = bus.insert(0x64, 1, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(r, Err(BusError::Overlap { base: 0x64, len: 1 }));
        let r = bus.insert(0xffff, 2, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(
            r,
            Err(BusError::BadRange {
                base: 0xffff,
                len: 2
            })
        );
        let r = bus.insert(0x10, 0, Arc::new(Mutex::new(Reg(0))));
        assert_eq!(r, Err(BusError::BadRange { base: 0x10, len: 0 }));
    }
}
