//! Snapshots (issue 37): a sandbox's state written to disk and read back.
//!
//! This step holds the state file's format ([`format`]) and what goes in it: the KVM state of
//! the VM and its vCPUs (`vstate::vm::VmState`, `vstate::vcpu::VcpuState`), with what a
//! restore must match (amvm's version, the guest kernel, the vCPU count and memory size). The
//! devices' state and guest memory come next; see docs/DESIGN.md "Snapshots".

pub mod format;
pub mod restore;
pub mod take;
pub mod tree;

use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;
use serde::{Deserialize, Serialize};

/// What a restore checks before anything runs (the guest kernel is checked by `amvm create
/// --from`, which reads the snapshot's `sandbox.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// `CARGO_PKG_VERSION` of the amvm that wrote it: another amvm's snapshot is refused.
    pub amvm: String,
    pub mem_mib: u64,
    pub cpus: u8,
    /// Seconds since the epoch.
    pub created: u64,
}

/// The machine's state: the VM's, each vCPU's in id order, and the devices'.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub meta: Meta,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub devices: DevicesState,
}

/// The devices' part.
#[derive(Debug, Serialize, Deserialize)]
pub struct DevicesState {
    /// Each virtio-mmio transport, in slot order (the vsock device's, then each share's).
    pub transports: Vec<amvm_devices::virtio::MmioState>,
    /// Each share's mount tag and its backend's (virtiofsd's) state, in slot order.
    pub shares: Vec<(String, amvm_devices::virtio::fs::BackendState)>,
    /// Each read-only disk, in slot order (after the shares): which image it read. The guest's
    /// page cache holds the image's blocks, so a restore needs the very same image.
    #[serde(default)]
    pub disks: Vec<DiskState>,
}

/// A read-only disk's image as it was: a restore refuses one that changed since.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskState {
    /// The serial the guest knows it by.
    pub id: String,
    pub image: std::path::PathBuf,
    pub len: u64,
    /// Its modification time, seconds and nanoseconds since the epoch.
    pub mtime: i64,
    pub mtime_nsec: i64,
}

impl DiskState {
    /// `file`'s identity as the disk `id` reads it.
    pub fn of(id: &str, image: &std::path::Path, file: &std::fs::File) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(DiskState {
            id: id.into(),
            image: image.into(),
            len: m.len(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MismatchError {
    #[error("it was written by amvm {0}; this is amvm {1}")]
    Amvm(String, String),
    #[error("it holds {0} vCPU states for {1} vCPUs")]
    VcpuCount(usize, u8),
    #[error("vCPU state {0} is for vCPU {1}")]
    VcpuOrder(usize, u8),
    #[error("it holds {0} device states for {1} shares and {2} disks")]
    DeviceCount(usize, usize, usize),
}

impl MachineState {
    /// Whether this amvm can restore it (CPU features are compared per vCPU when they are
    /// restored).
    pub fn check(&self) -> Result<(), MismatchError> {
        let here = env!("CARGO_PKG_VERSION");
        if self.meta.amvm != here {
            return Err(MismatchError::Amvm(self.meta.amvm.clone(), here.into()));
        }
        if self.vcpus.len() != usize::from(self.meta.cpus) {
            return Err(MismatchError::VcpuCount(self.vcpus.len(), self.meta.cpus));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if usize::from(v.id) != i {
                return Err(MismatchError::VcpuOrder(i, v.id));
            }
        }
        let d = &self.devices;
        if d.transports.len() != d.shares.len() + d.disks.len() + 1 {
            return Err(MismatchError::DeviceCount(
                d.transports.len(),
                d.shares.len(),
                d.disks.len(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz target's seed (tests/fuzz/seeds/gen.py) is a state this decoder reads, and a
    /// restore checks it against this amvm and kernel before anything else.
    #[test]
    fn the_fuzz_seed_decodes_and_is_checked() {
        let file = include_bytes!("../../../tests/fuzz/seeds/snapshot_state/file");
        let state: MachineState = format::decode(&file[1..]).unwrap();
        assert_eq!((state.meta.cpus, state.vcpus.len()), (1, 1));
        assert_eq!(state.check(), Ok(()));
        let mut other = state;
        other.meta.amvm = "0.0.9".into();
        assert!(matches!(other.check(), Err(MismatchError::Amvm(..))));
        other.meta.amvm = env!("CARGO_PKG_VERSION").into();
        other.meta.cpus = 2;
        assert_eq!(other.check(), Err(MismatchError::VcpuCount(1, 2)));
        other.meta.cpus = 1;
        other.devices.transports.clear();
        assert_eq!(other.check(), Err(MismatchError::DeviceCount(0, 1, 0)));
    }
}
