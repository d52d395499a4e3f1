//! Legacy PC devices on port I/O: 8250 UARTs (vm-superio) and the i8042 reset line.
//!
//! A UART's interrupt is an [`EventFd`] the VMM registers as an irqfd; the i8042 reset is an
//! [`EventFd`] the VMM waits on. Output bytes go to any `Write` the VMM chooses.

use crate::bus::BusDevice;
use std::io::{self, Write};
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

/// Standard PC port bases and IRQs.
pub const COM1_BASE: u64 = 0x3f8;
pub const COM1_IRQ: u32 = 4;
pub const COM2_BASE: u64 = 0x2f8;
pub const COM2_IRQ: u32 = 3;
pub const UART_PORTS: u64 = 8;
pub const I8042_BASE: u64 = 0x60;
pub const I8042_PORTS: u64 = 5;

/// An [`EventFd`] as a vm-superio trigger.
#[derive(Debug)]
pub struct EventFdTrigger(pub EventFd);

impl EventFdTrigger {
    pub fn new() -> io::Result<Self> {
        Ok(EventFdTrigger(EventFd::new(libc::EFD_NONBLOCK)?))
    }
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(EventFdTrigger(self.0.try_clone()?))
    }
}

impl Trigger for EventFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

impl crate::virtio::Interrupt for EventFdTrigger {
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
    fn eventfd(&self) -> Option<&vmm_sys_util::eventfd::EventFd> {
        Some(&self.0)
    }
}

/// An 8250 UART whose transmitted bytes go to `W`.
pub struct Uart<W: Write + Send> {
    inner: Serial<EventFdTrigger, vm_superio::serial::NoEvents, W>,
}

impl<W: Write + Send> Uart<W> {
    pub fn new(interrupt: EventFdTrigger, out: W) -> Self {
        Uart {
            inner: Serial::new(interrupt, out),
        }
    }
}

impl<W: Write + Send> BusDevice for Uart<W> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (data.len(), u8::try_from(offset)) {
            (1, Ok(off)) => data[0] = self.inner.read(off),
            _ => data.fill(0xff),
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (1, Ok(off)) = (data.len(), u8::try_from(offset)) {
            if let Err(e) = self.inner.write(off, data[0]) {
                tracing::debug!("uart write at offset {off}: {e:?}");
            }
        }
    }
}

/// The i8042 controller, emulated just enough for the guest's `reboot=k` to reach us.
pub struct ResetLine {
    inner: I8042Device<EventFdTrigger>,
}

impl ResetLine {
    pub fn new(reset: EventFdTrigger) -> Self {
        ResetLine {
            inner: I8042Device::new(reset),
        }
    }
}

impl BusDevice for ResetLine {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (data.len(), u8::try_from(offset)) {
            (1, Ok(off)) => data[0] = self.inner.read(off),
            _ => data.fill(0xff),
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (1, Ok(off)) = (data.len(), u8::try_from(offset)) {
            if let Err(e) = self.inner.write(off, data[0]) {
                tracing::debug!("i8042 write at offset {off}: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn uart_transmits_bytes_and_raises_its_interrupt() {
        let irq = EventFdTrigger::new().unwrap();
        let irq_probe = irq.try_clone().unwrap();
        let sink = Sink::default();
        let mut uart = Uart::new(irq, sink.clone());
        uart.write(1, &[0x02]); // IER: THR-empty interrupt on
        uart.write(0, b"h");
        uart.write(0, b"i");
        assert_eq!(&*sink.0.lock().unwrap(), b"hi");
        assert!(irq_probe.0.read().unwrap() >= 1);
        let mut lsr = [0u8];
        uart.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "THR empty");
    }

    #[test]
    fn i8042_reset_command_fires_the_reset_event() {
        let reset = EventFdTrigger::new().unwrap();
        let probe = reset.try_clone().unwrap();
        let mut dev = ResetLine::new(reset);
        let mut status = [0xffu8];
        dev.read(4, &mut status);
        assert_eq!(
            status[0] & 0x02,
            0,
            "input buffer empty, so the guest writes the command"
        );
        assert!(probe.0.read().is_err(), "no reset yet");
        dev.write(4, &[0xfe]);
        assert_eq!(probe.0.read().unwrap(), 1);
    }
}
