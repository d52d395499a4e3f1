//! Boot-time vCPU state as values: the PVH entry registers (32-bit protected mode, flat
//! segments, paging off, %ebx -> hvm_start_info), the GDT they refer to, MSRs, FPU, LAPIC LINTs.
//! See <https://xenbits.xen.org/docs/unstable/misc/pvh.html> for the PVH entry contract.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};

use super::layout::{GDT_START, IDT_START};

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;

// GDT access+flags words (bits 8..15 of the high dword = access, 20..23 = flags).
const GDT_CODE32: u16 = 0xc09b; // G=1 D=1 P=1 DPL0 S=1 type=execute/read/accessed
const GDT_DATA32: u16 = 0xc093; // G=1 D=1 P=1 DPL0 S=1 type=read/write/accessed
const GDT_TSS: u16 = 0x008b; // P=1 type=busy 32-bit TSS

/// The boot GDT: null, code, data, TSS. Selectors are index * 8.
pub fn gdt() -> [u64; 4] {
    [
        0,
        gdt_entry(GDT_CODE32, 0, 0xfffff),
        gdt_entry(GDT_DATA32, 0, 0xfffff),
        gdt_entry(GDT_TSS, 0, 0x67),
    ]
}

fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// The KVM segment register matching GDT entry `index`.
fn segment(table: &[u64], index: usize) -> kvm_segment {
    let e = table[index];
    let g = ((e >> 55) & 1) as u8;
    let raw_limit = (((e >> 48) & 0xf) << 16) | (e & 0xffff);
    let present = ((e >> 47) & 1) as u8;
    kvm_segment {
        base: ((e >> 32) & 0xff00_0000) | ((e >> 16) & 0x00ff_ffff),
        limit: if g == 1 {
            ((raw_limit << 12) | 0xfff) as u32
        } else {
            raw_limit as u32
        },
        selector: (index * 8) as u16,
        type_: ((e >> 40) & 0xf) as u8,
        present,
        dpl: ((e >> 45) & 3) as u8,
        db: ((e >> 54) & 1) as u8,
        s: ((e >> 44) & 1) as u8,
        l: ((e >> 53) & 1) as u8,
        g,
        avl: ((e >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// Segment and control registers for the PVH entry.
pub fn pvh_sregs(sregs: &mut kvm_sregs) {
    let table = gdt();
    let code = segment(&table, 1);
    let data = segment(&table, 2);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(&table, 3);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (table.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
    sregs.cr3 = 0;
    sregs.cr4 = 0;
    sregs.efer = 0;
}

/// General registers for the PVH entry.
pub fn pvh_regs(entry: u64, start_info: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rbx: start_info,
        ..Default::default()
    }
}

/// x87 and SSE control words at their reset values.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs on, default type write-back: without it the guest would treat all RAM as uncached.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// MSRs as a reset BIOS would leave them (the caller drops those KVM does not support).
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// LINT0 takes the PIC's interrupts (ExtINT), LINT1 takes NMIs, as a PC BIOS leaves them.
pub fn set_lint_modes(lapic: &mut kvm_lapic_state) {
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let v = lapic_reg(lapic, reg);
        set_lapic_reg(lapic, reg, (v & !0x700) | (mode << 8));
    }
}

fn lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let b = &lapic.regs[offset..offset + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        lapic.regs[offset + i] = *byte as _;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_code_and_data_segments() {
        let t = gdt();
        let cs = segment(&t, 1);
        assert_eq!(
            (cs.base, cs.limit, cs.selector, cs.type_),
            (0, 0xffff_ffff, 8, 0xb)
        );
        assert_eq!(
            (cs.present, cs.db, cs.s, cs.g, cs.l, cs.unusable),
            (1, 1, 1, 1, 0, 0)
        );
        let ds = segment(&t, 2);
        assert_eq!((ds.limit, ds.selector, ds.type_), (0xffff_ffff, 0x10, 0x3));
        let tr = segment(&t, 3);
        assert_eq!(
            (tr.limit, tr.selector, tr.type_, tr.s, tr.g),
            (0x67, 0x18, 0xb, 0, 0)
        );
        assert_eq!(segment(&t, 0).unusable, 1);
    }

    #[test]
    fn pvh_entry_state() {
        let mut s = kvm_sregs::default();
        pvh_sregs(&mut s);
        assert_eq!(s.cr0 & X86_CR0_PE, 1);
        assert_eq!(
            (s.cr4, s.efer, s.gdt.base, s.gdt.limit),
            (0, 0, GDT_START, 31)
        );
        let r = pvh_regs(0x1234, 0x6000);
        assert_eq!((r.rip, r.rbx, r.rflags), (0x1234, 0x6000, 2));
    }

    #[test]
    fn lints_get_extint_and_nmi() {
        let mut l = kvm_lapic_state::default();
        set_lapic_reg(&mut l, APIC_LVT0, 0x0001_0700);
        set_lint_modes(&mut l);
        assert_eq!(lapic_reg(&l, APIC_LVT0), 0x0001_0700);
        assert_eq!(lapic_reg(&l, APIC_LVT1), 0x400);
    }
}
