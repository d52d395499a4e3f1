//! The virtio-vsock device: the guest's only way out.
//!
//! Split as the style guide asks: pure logic that needs no KVM and no event loop —
//! [`defs`] (protocol constants), [`packet`] (packets from and to descriptor chains of any
//! shape, validated against guest memory), [`connection`] (one stream's state machine with
//! credit accounting and a TX buffer for short host writes) — and, later, the muxer and the
//! event glue that drive them.

pub mod connection;
pub mod defs;
pub mod device;
pub mod muxer;
pub mod packet;
