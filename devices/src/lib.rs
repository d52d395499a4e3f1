//! amvm's emulated devices. Pure device logic plus thin glue; this crate never touches KVM:
//! devices get event fds (interrupts out, resets out, queue notifications in) and are driven
//! through buses the VMM dispatches vCPU exits to.
//!
//! - [`bus`], [`legacy`]: the port-I/O devices a Linux guest needs to boot and leave (two 8250
//!   UARTs, the i8042 reset line).
//! - [`virtio`]: the virtio-mmio transport.
//! - [`vsock`]: the virtio-vsock device — packets, connections with credit, the muxer, the worker.

pub mod bus;
pub mod legacy;
pub mod virtio;
pub mod vsock;
