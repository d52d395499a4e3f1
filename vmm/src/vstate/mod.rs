//! The one room where amvm talks to KVM: everything that calls kvm-ioctls lives here
//! (Firecracker's `vstate/` split: the KVM handle, the VM, its vCPUs, guest memory).
//! The rest of the VMM computes values (`arch`), builds guest memory contents (`boot`) and
//! emulates devices (`amvm-devices`), then hands them to these wrappers.

pub mod kvm;
pub mod memory;
pub mod pause;
pub mod vcpu;
pub mod vm;
