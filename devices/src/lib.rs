//! amvm's emulated devices. Pure device logic plus thin glue; this crate never touches KVM:
//! devices get event fds (interrupts out, resets out, queue notifications in) and are driven
//! through buses the VMM dispatches vCPU exits to.
//!
//! - [`bus`], [`legacy`]: the port-I/O devices a Linux guest needs to boot and leave (two 8250
//!   UARTs, the i8042 reset line).
//! - [`virtio`]: the virtio-mmio transport.
//! - [`vsock`]: the virtio-vsock device — packets, connections with credit, the muxer, the worker.

/// Stack size of amvm's own threads (vCPUs, vsock worker, control, stdin, virtiofsd's stderr
/// reader): 1 MiB, far more than any of them uses, and less than one 2 MiB huge page, so a host
/// with transparent huge pages on (`always`) cannot back such a stack with one (2 MiB resident
/// for a few KiB used: seen while guest RAM's mapping was 2 MiB-aligned, with the huge-page RAM
/// tried on 2026-12-01, and the next stack below it was too).
pub const THREAD_STACK_SIZE: usize = 1 << 20;

pub mod bus;
pub mod legacy;
pub mod virtio;
pub mod vsock;
