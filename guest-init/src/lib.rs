//! What guest-init and the VMM agree on: the run spec the VMM hands to the guest, and the framed
//! channel on which the guest streams the workload's stdout/stderr and exit status back.
//!
//! The VMM depends on this library; the `guest-init` binary (PID 1 in the guest) uses it too.

pub mod protocol;
pub mod pty;
