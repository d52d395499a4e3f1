//! The host side of the guest's egress streams: what a published guest vsock port connects to,
//! the egress policy, per-stream accounting and the audit log. Knows unix sockets, never virtio.
//!
//! Empty until the vsock device lands (issue 3): the guest of this version has no egress at all,
//! and `amvm run --egress` says so and exits 125.
