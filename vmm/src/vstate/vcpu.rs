//! One vCPU: its boot-time state (CPUID, MSRs, LAPIC, FPU, registers) and its KVM_RUN loop,
//! which sends port I/O to the device bus and returns when the guest stops.

use super::kvm::Kvm;
use super::pause::Pauser;
use crate::arch::x86_64::{cpuid, regs};
use amvm_devices::bus::Bus;
use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {0}: KVM_SET_CPUID2: {1}")]
    Cpuid(u8, kvm_ioctls::Error),
    #[error("vCPU {0}: KVM_SET_MSRS: {1}")]
    Msrs(u8, String),
    #[error("vCPU {0}: LAPIC set-up: {1}")]
    Lapic(u8, kvm_ioctls::Error),
    #[error("vCPU {0}: register set-up: {1}")]
    Regs(u8, kvm_ioctls::Error),
    #[error("vCPU {0}: KVM_RUN: {1}")]
    Run(u8, kvm_ioctls::Error),
    #[error("vCPU {0}: KVM could not enter the guest (hardware reason {1:#x})")]
    FailEntry(u8, u64),
    #[error("vCPU {0}: KVM internal error (emulation failure in the guest)")]
    InternalError(u8),
    #[error("vCPU {0}: unexpected exit {1}")]
    UnexpectedExit(u8, String),
}

/// Why a vCPU stopped running the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VcpuStop {
    /// Triple fault (KVM_EXIT_SHUTDOWN): the guest is gone. `rip` is where it was, if KVM
    /// still reports it. After a `reboot=k` reset this is the kernel's fallback, not a crash.
    Shutdown { rip: Option<u64> },
    /// KVM_EXIT_SYSTEM_EVENT (shutdown/reset/crash) with its type.
    SystemEvent(u32),
    /// HLT reached userspace (cannot happen with the in-kernel LAPIC; treated as the end).
    Halt,
}

#[derive(Debug)]
pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
}

/// Where the boot vCPU starts.
#[derive(Debug, Clone, Copy)]
pub struct BootEntry {
    /// PVH entry point (32-bit protected mode, paging off).
    pub entry: u64,
    /// Guest-physical address of the `hvm_start_info`, passed in %ebx.
    pub start_info: u64,
}

impl Vcpu {
    pub(super) fn new(id: u8, fd: VcpuFd) -> Self {
        Vcpu { id, fd }
    }

    /// Give the vCPU its CPUID, MSRs, LAPIC and FPU state; the boot vCPU also gets its entry
    /// registers. Application processors wait for INIT/SIPI from the guest, in-kernel.
    pub fn configure(
        &self,
        kvm: &Kvm,
        cpu_count: u8,
        boot: Option<BootEntry>,
    ) -> Result<(), VcpuError> {
        let id = self.id;
        let mut cpuid = kvm.supported_cpuid().clone();
        cpuid::for_vcpu(cpuid.as_mut_slice(), id, cpu_count);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(|e| VcpuError::Cpuid(id, e))?;

        let entries: Vec<kvm_msr_entry> = regs::boot_msrs()
            .into_iter()
            .filter(|m| kvm.msr_supported(m.index))
            .collect();
        let msrs =
            Msrs::from_entries(&entries).map_err(|e| VcpuError::Msrs(id, format!("{e:?}")))?;
        let set = self
            .fd
            .set_msrs(&msrs)
            .map_err(|e| VcpuError::Msrs(id, e.to_string()))?;
        if set != entries.len() {
            let failed = entries[set].index;
            return Err(VcpuError::Msrs(id, format!("KVM refused MSR {failed:#x}")));
        }

        let mut lapic = self.fd.get_lapic().map_err(|e| VcpuError::Lapic(id, e))?;
        regs::set_lint_modes(&mut lapic);
        self.fd
            .set_lapic(&lapic)
            .map_err(|e| VcpuError::Lapic(id, e))?;

        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(|e| VcpuError::Regs(id, e))?;
        if let Some(b) = boot {
            let mut sregs = self.fd.get_sregs().map_err(|e| VcpuError::Regs(id, e))?;
            regs::pvh_sregs(&mut sregs);
            self.fd
                .set_sregs(&sregs)
                .map_err(|e| VcpuError::Regs(id, e))?;
            self.fd
                .set_regs(&regs::pvh_regs(b.entry, b.start_info))
                .map_err(|e| VcpuError::Regs(id, e))?;
        }
        Ok(())
    }

    /// Run the guest until it stops. Port I/O goes to `pio`, MMIO to `mmio` (where nothing
    /// answers, reads float to all ones and writes are dropped). Between KVM_RUNs the vCPU
    /// parks while `pauser` says so.
    pub fn run(mut self, pio: &Bus, mmio: &Bus, pauser: &Pauser) -> Result<VcpuStop, VcpuError> {
        pauser.enter();
        let r = self.run_loop(pio, mmio, pauser);
        pauser.leave();
        r
    }

    fn run_loop(&mut self, pio: &Bus, mmio: &Bus, pauser: &Pauser) -> Result<VcpuStop, VcpuError> {
        let id = self.id;
        loop {
            // Parked: the guest's kvmclock is told it was stopped, so its soft-lockup and RCU
            // watchdogs do not take the pause for a hang (EINVAL before the guest enabled
            // kvmclock: nothing to tell).
            pauser.gate(|| {
                let _ = self.fd.kvmclock_ctrl();
            });
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => pio.read(port.into(), data),
                Ok(VcpuExit::IoOut(port, data)) => pio.write(port.into(), data),
                Ok(VcpuExit::MmioRead(addr, data)) => mmio.read(addr, data),
                Ok(VcpuExit::MmioWrite(addr, data)) => mmio.write(addr, data),
                Ok(VcpuExit::Shutdown) => {
                    let rip = self.fd.get_regs().ok().map(|r| r.rip);
                    return Ok(VcpuStop::Shutdown { rip });
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => return Ok(VcpuStop::SystemEvent(kind)),
                Ok(VcpuExit::Hlt) => return Ok(VcpuStop::Halt),
                Ok(VcpuExit::FailEntry(reason, _)) => return Err(VcpuError::FailEntry(id, reason)),
                Ok(VcpuExit::InternalError) => return Err(VcpuError::InternalError(id)),
                Ok(VcpuExit::Intr) => {}
                Ok(other) => return Err(VcpuError::UnexpectedExit(id, format!("{other:?}"))),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => return Err(VcpuError::Run(id, e)),
            }
        }
    }
}
