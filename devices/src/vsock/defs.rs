//! virtio-vsock protocol constants, from Linux's `include/uapi/linux/virtio_vsock.h` and the
//! virtio 1.2 specification, section 5.10 ("Socket Device").

/// virtio device ID of a socket device.
pub const VIRTIO_ID_VSOCK: u32 = 19;

/// Queue indices: guest-bound packets, host-bound packets, events.
pub const RX_QUEUE: usize = 0;
pub const TX_QUEUE: usize = 1;
pub const EVENT_QUEUE: usize = 2;
pub const QUEUE_SIZE: u16 = 256;

/// The host's CID, as the guest addresses it.
pub const HOST_CID: u64 = 2;

/// `struct virtio_vsock_hdr` is packed: 8+8+4+4+4+2+2+4+4+4 bytes.
pub const HDR_LEN: usize = 44;

/// The most payload one packet may carry (Linux: `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`, 64 KiB).
pub const MAX_PKT_PAYLOAD: usize = 64 * 1024;

/// `hdr.type`.
pub const TYPE_STREAM: u16 = 1;

/// `hdr.op`.
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// `hdr.flags` of a SHUTDOWN: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;
