//! amvm's emulated devices. Pure device logic plus thin glue; this crate never touches KVM:
//! devices get event fds (interrupts out, resets out) and are driven through [`bus::PioBus`].
//!
//! Today: the legacy port-I/O devices a Linux guest needs to boot and leave (two 8250 UARTs,
//! the i8042 reset line). Next: the virtio-mmio transport and the vsock device.

pub mod bus;
pub mod legacy;
pub mod vsock;
