//! amvm: run one command in one fresh microVM and hand back its output and exit status.
//!
//! A run starts in `main.rs` (CLI), becomes a [`config::RunConfig`], and `builder::run` boots
//! the VM: memory, devices, kernel, initramfs, command line, vCPUs, then waits for the guest.
//! `docs/DESIGN.md` walks the boot in order.

pub mod arch;
pub mod boot;
pub mod builder;
pub mod changes;
pub mod cli;
pub mod config;
pub mod control;
pub mod doctor;
pub mod fs;
pub mod image;
pub mod jail;
pub mod oci;
pub mod output;
pub mod overlay;
pub mod sandbox;
pub mod scm;
pub mod seccomp;
pub mod signals;
pub mod snapshot;
pub mod store;
pub mod vmmctl;
pub mod vstate;

/// The static guest-init binary, built by build.rs, embedded so there is no image to keep in sync.
pub const GUEST_INIT: &[u8] = include_bytes!(env!("AMVM_GUEST_INIT_PATH"));

/// Exit statuses amvm itself produces (otherwise the workload's own status is returned).
pub mod exit {
    /// amvm failed (bad input, no KVM, guest crashed before reporting a status).
    pub const AMVM_FAILURE: u8 = 125;
    /// `--timeout` expired.
    pub const TIMEOUT: u8 = 124;
}
