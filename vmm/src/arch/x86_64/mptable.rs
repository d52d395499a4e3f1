//! The Intel MultiProcessor table (MP spec 1.4), which is how a guest without ACPI learns its
//! CPUs, its IOAPIC and how ISA IRQs reach it. Written at the start of the EBDA, where Linux
//! scans for the `_MP_` floating pointer.
//!
//! Layout: floating pointer (16 bytes) -> configuration table header (44 bytes) followed by
//! entries: one processor (20 bytes) per vCPU, an ISA bus, the IOAPIC, one I/O interrupt per
//! IOAPIC pin (ISA IRQ n -> pin n, as KVM's default GSI routing does), and the two local
//! interrupts (ExtINT on LINT0, NMI on LINT1). Both structures checksum to zero.

use super::layout::{EBDA_END, EBDA_START, IOAPIC_ADDR, LAPIC_ADDR};

/// The most vCPUs whose table fits between EBDA_START and EBDA_END.
pub const MAX_CPUS: u8 = 32;
const IOAPIC_PINS: u8 = 24;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOT: u8 = 2;
const CPU_STEPPING_FAMILY: u32 = 0x600;
const CPU_FEATURE_FPU_APIC: u32 = 0x201;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MptableError {
    #[error("{0} vCPUs: the MP table holds 1 to {MAX_CPUS}")]
    CpuCount(u8),
}

/// The table's bytes, to be written at `EBDA_START`.
pub fn build(cpus: u8) -> Result<Vec<u8>, MptableError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(MptableError::CpuCount(cpus));
    }
    let table_addr = EBDA_START as u32 + 16;
    let ioapic_id = cpus;

    let mut entries = Vec::new();
    for id in 0..cpus {
        entries.push(0u8); // processor
        entries.push(id);
        entries.push(APIC_VERSION);
        entries.push(CPU_ENABLED | if id == 0 { CPU_BOOT } else { 0 });
        entries.extend_from_slice(&CPU_STEPPING_FAMILY.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURE_FPU_APIC.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
    }
    entries.extend_from_slice(&[1, 0]); // bus 0
    entries.extend_from_slice(b"ISA   ");
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]); // IOAPIC, enabled
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    for pin in 0..IOAPIC_PINS {
        // I/O interrupt: type, flags (conforming), source bus, source IRQ, IOAPIC, pin.
        entries.extend_from_slice(&[3, INT_TYPE_INT, 0, 0, 0, pin, ioapic_id, pin]);
    }
    // Local interrupts to every LAPIC (0xff): ExtINT on LINT0, NMI on LINT1.
    entries.extend_from_slice(&[4, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    let entry_count = u16::from(cpus) + 1 + 1 + u16::from(IOAPIC_PINS) + 2;

    let mut header = Vec::with_capacity(44);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    header.push(4); // spec revision 1.4
    header.push(0); // checksum, below
    header.extend_from_slice(b"AMVM    "); // OEM id
    header.extend_from_slice(b"microVM     "); // product id
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&entry_count.to_le_bytes());
    header.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    let mut table = header;
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut out = Vec::with_capacity(16 + table.len());
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&table_addr.to_le_bytes());
    out.push(1); // length in 16-byte units
    out.push(4); // spec revision
    out.push(0); // checksum, below
    out.extend_from_slice(&[0; 5]); // feature bytes: 0 = a configuration table is present
    out[10] = checksum(&out[..16]);
    out.extend_from_slice(&table);
    debug_assert!(EBDA_START + out.len() as u64 <= EBDA_END);
    Ok(out)
}

/// The byte that makes `bytes` sum to zero modulo 256.
fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_counts() {
        for cpus in [1, 2, 7, MAX_CPUS] {
            let t = build(cpus).unwrap();
            assert_eq!(&t[..4], b"_MP_");
            assert_eq!(sum(&t[..16]), 0);
            let addr = u32::from_le_bytes([t[4], t[5], t[6], t[7]]) as u64;
            assert_eq!(addr, EBDA_START + 16);
            let table = &t[16..];
            assert_eq!(&table[..4], b"PCMP");
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0);
            let count = u16::from_le_bytes([table[34], table[35]]);
            assert_eq!(count, u16::from(cpus) + 28);
            assert!(
                EBDA_START + t.len() as u64 <= EBDA_END,
                "{cpus} cpus overflow the EBDA"
            );
            // Exactly one boot processor, and it is APIC 0.
            let procs: Vec<_> = (0..cpus as usize)
                .map(|i| &table[44 + 20 * i..44 + 20 * (i + 1)])
                .collect();
            assert!(procs.iter().all(|p| p[0] == 0));
            assert_eq!(procs.iter().filter(|p| p[3] & CPU_BOOT != 0).count(), 1);
            assert_eq!(procs[0][3] & CPU_BOOT, CPU_BOOT);
        }
    }

    #[test]
    fn refuses_impossible_cpu_counts() {
        assert_eq!(build(0), Err(MptableError::CpuCount(0)));
        assert_eq!(
            build(MAX_CPUS + 1),
            Err(MptableError::CpuCount(MAX_CPUS + 1))
        );
    }
}
