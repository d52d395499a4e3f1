//! The VM: in-kernel interrupt controllers and PIT, guest memory slots, irqfds, vCPU creation.

use super::kvm::Kvm;
use super::vcpu::Vcpu;
use crate::arch::x86_64::layout;
use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, kvm_userspace_memory_region,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{IoEventAddress, VmFd};
use serde::{Deserialize, Serialize};
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
    #[error("saving the VM's state: {0}: {1}")]
    Save(&'static str, kvm_ioctls::Error),
    #[error("restoring the VM's state: {0}: {1}")]
    Restore(&'static str, kvm_ioctls::Error),
    #[error("KVM_CREATE_VCPU {0}: {1}")]
    CreateVcpu(u8, kvm_ioctls::Error),
}

/// The VM's own state beside its vCPUs': the PIT, the KVM clock and the three in-kernel
/// interrupt controllers (Firecracker's set).
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmState")
            .field("clock", &self.clock.clock)
            .finish_non_exhaustive()
    }
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

    /// The VM's state (its vCPUs paused).
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let e = |what: &'static str| move |err: kvm_ioctls::Error| VmError::Save(what, err);
        let pit = self.fd.get_pit2().map_err(e("KVM_GET_PIT2"))?;
        let clock = self.fd.get_clock().map_err(e("KVM_GET_CLOCK"))?;
        let chip = |id: u32| -> Result<kvm_irqchip, VmError> {
            let mut c = kvm_irqchip {
                chip_id: id,
                ..Default::default()
            };
            self.fd.get_irqchip(&mut c).map_err(e("KVM_GET_IRQCHIP"))?;
            Ok(c)
        };
        Ok(VmState {
            pit,
            clock,
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
        })
    }

    /// Put `state` back into this freshly created VM. The clock's flags are cleared: with
    /// KVM_CLOCK_REALTIME passed back, KVM would move the guest's monotonic clock on by the
    /// time since the snapshot (Firecracker #5809); the guest's wall clock is set by its init
    /// instead.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        let e = |what: &'static str| move |err: kvm_ioctls::Error| VmError::Restore(what, err);
        self.fd.set_pit2(&state.pit).map_err(e("KVM_SET_PIT2"))?;
        let clock = kvm_clock_data {
            flags: 0,
            ..state.clock
        };
        self.fd.set_clock(&clock).map_err(e("KVM_SET_CLOCK"))?;
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            self.fd.set_irqchip(chip).map_err(e("KVM_SET_IRQCHIP"))?;
        }
        Ok(())
    }

    pub fn create_vcpu(&self, id: u8) -> Result<Vcpu, VmError> {
        let fd = self
            .fd
            .create_vcpu(u64::from(id))
            .map_err(|e| VmError::CreateVcpu(id, e))?;
        Ok(Vcpu::new(id, fd))
    }
}
