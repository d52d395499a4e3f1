//! The guest-physical address map.
//!
//! ```text
//! 0x0000_0500  GDT (4 entries)            0x0000_0520  IDT (empty)
//! 0x0000_6000  hvm_start_info (PVH)       0x0000_6040  module list (the initramfs)
//! 0x0000_7000  PVH memory map             0x0002_0000  kernel command line
//! 0x0009_fc00  MP table (EBDA; not RAM in the memory map, up to 0xa_0000)
//! 0x0010_0000  kernel (ELF vmlinux, loaded at its physical addresses)
//! ...          initramfs at the top of low RAM
//! 0xc000_0000  MMIO gap up to 4 GiB: virtio-mmio windows from 0xd000_0000, IOAPIC 0xfec0_0000, LAPIC 0xfee0_0000, TSS 0xfffb_d000
//! 0x1_0000_0000 RAM above the gap, when the guest has more than 3 GiB
//! ```

pub const GDT_START: u64 = 0x500;
pub const IDT_START: u64 = 0x520;
pub const PVH_INFO_START: u64 = 0x6000;
pub const MODLIST_START: u64 = 0x6040;
pub const MEMMAP_START: u64 = 0x7000;
pub const CMDLINE_START: u64 = 0x20000;
/// Linux's x86 COMMAND_LINE_SIZE.
pub const CMDLINE_MAX_SIZE: usize = 2048;
pub const EBDA_START: u64 = 0x9fc00;
pub const EBDA_END: u64 = 0xa0000;
pub const HIMEM_START: u64 = 0x100000;
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const LAPIC_ADDR: u32 = 0xfee0_0000;
/// virtio-mmio register windows (4 KiB each) start here, inside the gap.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// The first IRQ (IOAPIC pin) for virtio devices; ISA devices use 3, 4 and the legacy lines.
pub const VIRTIO_IRQ_START: u32 = 5;
/// Three pages KVM needs for its real-mode TSS, inside the gap, clear of the APICs.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;

// The fixed areas must not overlap (checked at compile time).
const _: () = {
    assert!(GDT_START + 4 * 8 <= IDT_START);
    assert!(PVH_INFO_START + 56 <= MODLIST_START);
    assert!(MODLIST_START + 32 <= MEMMAP_START);
    assert!(MEMMAP_START + 8 * 24 <= CMDLINE_START);
    assert!(CMDLINE_START + CMDLINE_MAX_SIZE as u64 <= EBDA_START);
    assert!(EBDA_END <= HIMEM_START);
    assert!(KVM_TSS_ADDRESS > LAPIC_ADDR as u64 && KVM_TSS_ADDRESS + 3 * 4096 <= MMIO_GAP_END);
};

/// The RAM ranges (start, length) for a guest of `bytes` bytes: below the MMIO gap first,
/// the rest above 4 GiB.
pub fn ram_ranges(bytes: u64) -> Vec<(u64, u64)> {
    if bytes <= MMIO_GAP_START {
        vec![(0, bytes)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, bytes - MMIO_GAP_START)]
    }
}

/// End of the RAM below the gap.
pub fn low_ram_end(bytes: u64) -> u64 {
    bytes.min(MMIO_GAP_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_splits_around_the_mmio_gap() {
        assert_eq!(ram_ranges(512 << 20), vec![(0, 512 << 20)]);
        assert_eq!(ram_ranges(MMIO_GAP_START), vec![(0, MMIO_GAP_START)]);
        assert_eq!(
            ram_ranges(4 << 30),
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
        assert_eq!(low_ram_end(4 << 30), MMIO_GAP_START);
    }
}
