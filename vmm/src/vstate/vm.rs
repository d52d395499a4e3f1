//! The VM: in-kernel interrupt controllers and PIT, guest memory slots, irqfds, vCPU creation.

use super::kvm::Kvm;
use super::vcpu::Vcpu;
use crate::arch::x86_64::layout;
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("KVM_CREATE_VM: {0}")]
    Create(kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR: {0}")]
    Tss(kvm_ioctls::Error),
    #[error("KVM_CREATE_IRQCHIP: {0}")]
    Irqchip(kvm_ioctls::Error),
    #[error("KVM_CREATE_PIT2: {0}")]
    Pit(kvm_ioctls::Error),
    #[error("KVM_SET_USER_MEMORY_REGION (slot {0}): {1}")]
    MemoryRegion(u32, kvm_ioctls::Error),
    #[error("KVM_IRQFD (gsi {0}): {1}")]
    Irqfd(u32, kvm_ioctls::Error),
    #[error("KVM_IOEVENTFD at {0:#x}: {1}")]
    Ioeventfd(u64, kvm_ioctls::Error),
    #[error("KVM_CREATE_VCPU {0}: {1}")]
    CreateVcpu(u8, kvm_ioctls::Error),
}

#[derive(Debug)]
pub struct Vm {
    fd: VmFd,
}

impl Vm {
    /// Create the VM with its in-kernel IOAPIC/PIC/LAPICs and PIT, and give it `mem`.
    /// The irqchip must exist before any vCPU is created.
    pub fn new(kvm: &Kvm, mem: &GuestMemoryMmap) -> Result<Vm, VmError> {
        let fd = kvm.fd.create_vm().map_err(VmError::Create)?;
        fd.set_tss_address(layout::KVM_TSS_ADDRESS as usize)
            .map_err(VmError::Tss)?;
        fd.create_irq_chip().map_err(VmError::Irqchip)?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(VmError::Pit)?;
        for (slot, region) in mem.iter().enumerate() {
            let slot = slot as u32;
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .expect("a region of a memory collection maps its own start");
            let r = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: `host` is the start of a live mapping of `region.len()` bytes owned by
            // `mem`, which the caller keeps alive for as long as the VM runs (builder.rs holds it
            // until the process exits). Slots do not overlap: regions of one collection never do.
            unsafe { fd.set_user_memory_region(r) }.map_err(|e| VmError::MemoryRegion(slot, e))?;
        }
        Ok(Vm { fd })
    }

    /// Interrupt line `gsi` fires whenever `evt` is written.
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(|e| VmError::Irqfd(gsi, e))
    }

    /// A guest write of the 4-byte value `datamatch` at MMIO address `addr` signals `evt`
    /// inside KVM, without an exit to the VMM (virtio queue notifications).
    pub fn register_mmio_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), VmError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(|e| VmError::Ioeventfd(addr, e))
    }

    pub fn create_vcpu(&self, id: u8) -> Result<Vcpu, VmError> {
        let fd = self
            .fd
            .create_vcpu(u64::from(id))
            .map_err(|e| VmError::CreateVcpu(id, e))?;
        Ok(Vcpu::new(id, fd))
    }
}
