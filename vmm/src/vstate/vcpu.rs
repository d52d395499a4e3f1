//! One vCPU: its boot-time state (CPUID, MSRs, LAPIC, FPU, registers) and its KVM_RUN loop,
//! which sends port I/O to the device bus and returns when the guest stops.

use super::kvm::Kvm;
use super::pause::Pauser;
use crate::arch::x86_64::{cpuid, regs};
use amvm_devices::bus::Bus;
use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};

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
    #[error("vCPU {0}: saving its state: {1}: {2}")]
    Save(u8, &'static str, String),
    #[error("vCPU {0}: restoring its state: {1}: {2}")]
    Restore(u8, &'static str, String),
    #[error("vCPU {0}: the snapshot's CPU differs from this host's: {1}")]
    OtherCpu(u8, String),
}

/// MSRs a snapshot carries, where KVM lists them as supported: what the guest kernel sets up
/// and expects back (Firecracker's serializable ranges, cut to what an x86 Linux guest on amvm
/// uses). `IA32_TSC_DEADLINE` is not here: it goes last (see `save_state`).
const SAVED_MSRS: &[(u32, u32)] = &[
    (0x10, 0x10),   // IA32_TSC
    (0x11, 0x12),   // KVM's old wall clock and system time
    (0x1b, 0x1b),   // IA32_APICBASE
    (0x3b, 0x3b),   // IA32_TSC_ADJUST
    (0x48, 0x48),   // IA32_SPEC_CTRL
    (0x174, 0x176), // SYSENTER CS/ESP/EIP
    (0x1a0, 0x1a0), // IA32_MISC_ENABLE
    (0x200, 0x20f), // variable MTRRs
    (0x250, 0x250), // fixed MTRRs
    (0x258, 0x259),
    (0x268, 0x26f),
    (0x277, 0x277),             // PAT
    (0x2ff, 0x2ff),             // MTRR default type
    (0xda0, 0xda0),             // IA32_XSS
    (0x4b56_4d00, 0x4b56_4dff), // KVM's paravirtual MSRs (kvmclock, async PF, steal time, PV EOI)
    (0xc000_0080, 0xc000_0084), // EFER, STAR, LSTAR, CSTAR, SFMASK
    (0xc000_0100, 0xc000_0103), // FS/GS base, KERNEL_GS_BASE, TSC_AUX
];
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// One vCPU's state, as KVM gives it (kvm-bindings' serde: each struct its bytes).
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    /// In the order they are restored: `IA32_TSC_DEADLINE` after `IA32_TSC`, last.
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("id", &self.id)
            .field("rip", &self.regs.rip)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
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

    /// The vCPU's state, read in the order KVM needs (Firecracker's): MP state first (reading
    /// it may change the LAPIC), vCPU events last. The vCPU must not be in KVM_RUN (paused).
    pub fn save_state(&self, kvm: &Kvm) -> Result<VcpuState, VcpuError> {
        let id = self.id;
        let e = |what: &'static str| {
            move |err: kvm_ioctls::Error| VcpuError::Save(id, what, err.to_string())
        };
        let mp_state = self.fd.get_mp_state().map_err(e("KVM_GET_MP_STATE"))?;
        let regs = self.fd.get_regs().map_err(e("KVM_GET_REGS"))?;
        let sregs = self.fd.get_sregs().map_err(e("KVM_GET_SREGS"))?;
        let xsave = self.fd.get_xsave().map_err(e("KVM_GET_XSAVE"))?;
        let xcrs = self.fd.get_xcrs().map_err(e("KVM_GET_XCRS"))?;
        let debugregs = self.fd.get_debug_regs().map_err(e("KVM_GET_DEBUGREGS"))?;
        let lapic = self.fd.get_lapic().map_err(e("KVM_GET_LAPIC"))?;
        let cpuid = distinct_leaves(
            self.fd
                .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
                .map_err(e("KVM_GET_CPUID2"))?
                .as_slice(),
        );
        let mut wanted: Vec<u32> = SAVED_MSRS
            .iter()
            .flat_map(|&(a, b)| a..=b)
            .filter(|&i| kvm.msr_supported(i))
            .collect();
        let mut msrs = self.read_msrs(&mut wanted)?;
        // The TSC deadline after the TSC, so that its timer is armed against the restored
        // count; a deadline of 0 (none armed) becomes the TSC itself, so that a timer the guest
        // arms meanwhile is not lost (Firecracker's fix).
        if kvm.msr_supported(MSR_IA32_TSC_DEADLINE) {
            let mut d = self.read_msrs(&mut vec![MSR_IA32_TSC_DEADLINE])?;
            if let Some(deadline) = d.first_mut() {
                if deadline.data == 0 {
                    if let Some(tsc) = msrs.iter().find(|m| m.index == MSR_IA32_TSC) {
                        deadline.data = tsc.data;
                    }
                }
            }
            msrs.extend(d);
        }
        let events = self
            .fd
            .get_vcpu_events()
            .map_err(e("KVM_GET_VCPU_EVENTS"))?;
        Ok(VcpuState {
            id,
            cpuid,
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            lapic,
            msrs,
            events,
        })
    }

    /// Read the MSRs `indices` names; one KVM will not read is dropped (and the rest read).
    fn read_msrs(&self, indices: &mut Vec<u32>) -> Result<Vec<kvm_msr_entry>, VcpuError> {
        let id = self.id;
        let mut out = Vec::with_capacity(indices.len());
        let mut start = 0;
        while start < indices.len() {
            let chunk: Vec<kvm_msr_entry> = indices[start..]
                .iter()
                .take(kvm_bindings::KVM_MAX_MSR_ENTRIES)
                .map(|&index| kvm_msr_entry {
                    index,
                    ..Default::default()
                })
                .collect();
            let mut msrs = Msrs::from_entries(&chunk)
                .map_err(|e| VcpuError::Save(id, "MSR list", format!("{e:?}")))?;
            let n = self
                .fd
                .get_msrs(&mut msrs)
                .map_err(|e| VcpuError::Save(id, "KVM_GET_MSRS", e.to_string()))?;
            out.extend_from_slice(&msrs.as_slice()[..n]);
            start += n;
            if n < chunk.len() {
                // Entry `n` of the chunk is one KVM would not read: skip it.
                tracing::debug!(
                    "vCPU {id}: MSR {:#x} not readable: not saved",
                    indices[start]
                );
                indices.remove(start);
            }
        }
        Ok(out)
    }

    /// Put `state` back into this freshly created vCPU, in the order KVM needs (Firecracker's):
    /// CPUID first (it must be this host's, as the boot path computes it), then MP state,
    /// registers, special registers (the APIC base, before the LAPIC), XSAVE, XCRs, debug
    /// registers, the LAPIC (before the MSRs: the TSC deadline needs it), the MSRs, and the
    /// vCPU events last (setting the registers clears pending exceptions).
    pub fn restore_state(
        &self,
        kvm: &Kvm,
        cpu_count: u8,
        state: &VcpuState,
    ) -> Result<(), VcpuError> {
        let id = self.id;
        let mut cpuid = kvm.supported_cpuid().clone();
        cpuid::for_vcpu(cpuid.as_mut_slice(), id, cpu_count);
        if let Some(why) = cpuid_difference(&state.cpuid, &distinct_leaves(cpuid.as_slice())) {
            return Err(VcpuError::OtherCpu(id, why));
        }
        let saved = CpuId::from_entries(&state.cpuid)
            .map_err(|e| VcpuError::Restore(id, "CPUID list", format!("{e:?}")))?;
        let e = |what: &'static str| {
            move |err: kvm_ioctls::Error| VcpuError::Restore(id, what, err.to_string())
        };
        self.fd.set_cpuid2(&saved).map_err(e("KVM_SET_CPUID2"))?;
        self.fd
            .set_mp_state(state.mp_state)
            .map_err(e("KVM_SET_MP_STATE"))?;
        self.fd.set_regs(&state.regs).map_err(e("KVM_SET_REGS"))?;
        self.fd
            .set_sregs(&state.sregs)
            .map_err(e("KVM_SET_SREGS"))?;
        // SAFETY: KVM reads a `kvm_xsave` (4 KiB) from this reference. The guest's XSAVE area
        // fits in it: amvm never asks for the dynamically enabled features (AMX's tile data,
        // arch_prctl ARCH_REQ_XCOMP_GUEST_PERM) that make it larger, so KVM's CPUID for the
        // guest does not offer them (checked against this host's above).
        unsafe { self.fd.set_xsave(&state.xsave) }.map_err(e("KVM_SET_XSAVE"))?;
        self.fd.set_xcrs(&state.xcrs).map_err(e("KVM_SET_XCRS"))?;
        self.fd
            .set_debug_regs(&state.debugregs)
            .map_err(e("KVM_SET_DEBUGREGS"))?;
        self.fd
            .set_lapic(&state.lapic)
            .map_err(e("KVM_SET_LAPIC"))?;
        for chunk in state.msrs.chunks(kvm_bindings::KVM_MAX_MSR_ENTRIES) {
            let msrs = Msrs::from_entries(chunk)
                .map_err(|e| VcpuError::Restore(id, "MSR list", format!("{e:?}")))?;
            let n = self.fd.set_msrs(&msrs).map_err(e("KVM_SET_MSRS"))?;
            if n != chunk.len() {
                return Err(VcpuError::Restore(
                    id,
                    "KVM_SET_MSRS",
                    format!("KVM refused MSR {:#x}", chunk[n].index),
                ));
            }
        }
        self.fd
            .set_vcpu_events(&state.events)
            .map_err(e("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }

    /// Run the guest until it stops. Port I/O goes to `pio`, MMIO to `mmio` (where nothing
    /// answers, reads float to all ones and writes are dropped). Between KVM_RUNs the vCPU
    /// parks while `pauser` says so.
    pub fn run(
        mut self,
        kvm: &Kvm,
        pio: &Bus,
        mmio: &Bus,
        pauser: &Pauser,
    ) -> Result<VcpuStop, VcpuError> {
        pauser.enter();
        let r = self.run_loop(kvm, pio, mmio, pauser);
        pauser.leave();
        r
    }

    fn run_loop(
        &mut self,
        kvm: &Kvm,
        pio: &Bus,
        mmio: &Bus,
        pauser: &Pauser,
    ) -> Result<VcpuStop, VcpuError> {
        let id = self.id;
        loop {
            // Parked: the guest's kvmclock is told it was stopped, so its soft-lockup and RCU
            // watchdogs do not take the pause for a hang (EINVAL before the guest enabled
            // kvmclock: nothing to tell). A snapshot has the parked thread save its state.
            let fd = &self.fd;
            pauser.gate(
                id,
                || {
                    let _ = fd.kvmclock_ctrl();
                },
                || self.save_state(kvm).map_err(|e| e.to_string()),
            );
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

/// Each leaf once, as KVM finds it (the first entry of a function and index wins): the table
/// the boot path sets is the supported one's whole buffer, KVM_MAX_CPUID_ENTRIES entries of
/// which those past the last leaf are zeros (leaf 0 again, never consulted).
fn distinct_leaves(entries: &[kvm_cpuid_entry2]) -> Vec<kvm_cpuid_entry2> {
    let mut out: Vec<kvm_cpuid_entry2> = Vec::with_capacity(entries.len());
    for e in entries {
        if !out
            .iter()
            .any(|o| (o.function, o.index) == (e.function, e.index))
        {
            out.push(*e);
        }
    }
    out
}

/// Why the CPUID a snapshot was taken with is not the one this host gives the same vCPU
/// (another CPU model, other host kernel, other amvm), or `None` when they are the same.
/// Bits KVM changes as the guest runs (kvm_update_cpuid_runtime) are not compared: leaf 1's
/// OSXSAVE and APIC, leaf 7's OSPKE, and leaf 0xd's XSAVE sizes (they follow XCR0 and XSS).
fn cpuid_difference(saved: &[kvm_cpuid_entry2], here: &[kvm_cpuid_entry2]) -> Option<String> {
    let key = |e: &kvm_cpuid_entry2| (e.function, e.index);
    let stable = |e: &kvm_cpuid_entry2| match (e.function, e.index) {
        (1, _) => (e.eax, e.ebx, e.ecx & !(1 << 27), e.edx & !(1 << 9)),
        (7, 0) => (e.eax, e.ebx, e.ecx & !(1 << 4), e.edx),
        (0xd, 0 | 1) => (e.eax, 0, e.ecx, e.edx),
        _ => (e.eax, e.ebx, e.ecx, e.edx),
    };
    for s in saved {
        let Some(h) = here.iter().find(|h| key(h) == key(s)) else {
            return Some(format!(
                "leaf {:#x}.{} is not offered here",
                s.function, s.index
            ));
        };
        if stable(s) != stable(h) {
            return Some(format!(
                "leaf {:#x}.{}: snapshot {:08x} {:08x} {:08x} {:08x}, here {:08x} {:08x} {:08x} {:08x}",
                s.function, s.index, s.eax, s.ebx, s.ecx, s.edx, h.eax, h.ebx, h.ecx, h.edx
            ));
        }
    }
    if let Some(h) = here
        .iter()
        .find(|h| !saved.iter().any(|s| key(s) == key(h)))
    {
        return Some(format!("leaf {:#x}.{} is new here", h.function, h.index));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32, eax: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ..Default::default()
        }
    }

    #[test]
    fn another_cpu_is_told_apart_by_its_cpuid() {
        let a = [leaf(0, 0, 0xd), leaf(7, 0, 1)];
        assert_eq!(cpuid_difference(&a, &a), None);
        // What the running guest changed is not a difference.
        let mut running = a;
        running[1].ecx |= 1 << 4;
        assert_eq!(cpuid_difference(&running, &a), None);
        let b = [leaf(0, 0, 0xd), leaf(7, 0, 3)];
        assert!(cpuid_difference(&a, &b)
            .unwrap()
            .starts_with("leaf 0x7.0: snapshot 00000001"));
        assert!(cpuid_difference(&a, &a[..1])
            .unwrap()
            .contains("not offered here"));
        assert!(cpuid_difference(&a[..1], &a).unwrap().contains("new here"));
    }
}
