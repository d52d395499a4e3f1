//! Shape KVM's supported CPUID for one vCPU of an N-vCPU guest.
//!
//! We start from what KVM reports as supported (we run nested: never offer what KVM did not)
//! and only *narrow* or *describe*: the APIC ID and topology fields, the hypervisor bit, and no
//! PMU (leaf 0xa) so the guest does not program counters we do not virtualize. The one bit KVM
//! reports by a capability instead of in that list, the TSC-deadline timer, is added where the
//! capability is present ([`offer_tsc_deadline`]).

use kvm_bindings::kvm_cpuid_entry2;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_AMD_SIZE: u32 = 0x8000_0008;
const LEAF_AMD_EXT_APIC: u32 = 0x8000_001e;

const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;

/// Offer the LAPIC's TSC-deadline timer mode (leaf 1, ECX bit 24), for a KVM with
/// `KVM_CAP_TSC_DEADLINE_TIMER`. The guest then arms its timer with one MSR write instead of
/// programming a count, and skips calibrating the LAPIC timer against another clock at boot
/// (a busy wait of about 100 ms of guest time). qemu's `-cpu host` offers it the same way.
pub fn offer_tsc_deadline(entries: &mut [kvm_cpuid_entry2]) {
    for e in entries.iter_mut().filter(|e| e.function == LEAF_FEATURES) {
        e.ecx |= ECX_TSC_DEADLINE;
    }
}

/// Topology: one socket, `count` cores, one thread each; APIC ID == vCPU index.
pub fn for_vcpu(entries: &mut [kvm_cpuid_entry2], id: u8, count: u8) {
    let id = u32::from(id);
    let count = u32::from(count);
    // Bits needed to number `count` cores.
    let core_bits = 32 - (count.max(1) - 1).leading_zeros();
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                // EBX: [31:24] initial APIC ID, [23:16] logical processors per package,
                // [15:8] CLFLUSH line size in 8-byte units.
                e.ebx = (id << 24) | (count << 16) | (8 << 8) | (e.ebx & 0xff);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            // EAX[31:26]: cores per package - 1; [25:14]: threads sharing this cache - 1.
            // A cache type of 0 ends the list.
            LEAF_CACHE_PARAMS if e.eax & 0x1f != 0 => {
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { count - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | ((count - 1) << 26) | (sharing << 14);
            }
            LEAF_PMU => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => {
                // Level 0: SMT (1 thread per core); level 1: core (count per package).
                let (shift, n, kind) = match e.index {
                    0 => (0, 1, 1),
                    1 => (core_bits, count, 2),
                    _ => (0, 0, 0),
                };
                e.eax = shift;
                e.ebx = n;
                e.ecx = (kind << 8) | (e.index & 0xff);
                e.edx = id;
            }
            LEAF_AMD_SIZE => {
                // ECX[15:12]: APIC ID bits for cores; [7:0]: cores per package - 1.
                e.ecx = (e.ecx & !0xf0ff) | (core_bits << 12) | (count - 1);
            }
            LEAF_AMD_EXT_APIC => {
                e.eax = id; // extended APIC ID
                e.ebx = id & 0xff; // one thread per core, core id = vCPU
                e.ecx = 0; // one node
                e.edx = 0;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0xffff_ffff,
            eax: 0xffff_ffff,
            ..Default::default()
        }
    }

    #[test]
    fn apic_ids_and_counts_follow_the_vcpu() {
        let mut e = vec![
            leaf(1, 0),
            leaf(0xb, 0),
            leaf(0xb, 1),
            leaf(0xb, 2),
            leaf(0xa, 0),
        ];
        for_vcpu(&mut e, 3, 4);
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_eq!((e[1].ebx, e[1].edx), (1, 3));
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx >> 8), (2, 4, 2));
        assert_eq!(e[3].ecx >> 8, 0, "level 2 terminates the list");
        assert_eq!((e[4].eax, e[4].ebx, e[4].ecx, e[4].edx), (0, 0, 0, 0));
    }

    #[test]
    fn tsc_deadline_is_offered_in_leaf_1_only() {
        let mut e = vec![leaf(1, 0), leaf(7, 0)];
        offer_tsc_deadline(&mut e);
        assert_eq!((e[0].ecx, e[1].ecx), (ECX_TSC_DEADLINE, 0));
        for_vcpu(&mut e, 0, 1);
        assert_ne!(e[0].ecx & ECX_TSC_DEADLINE, 0, "kept by for_vcpu");
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let mut e = vec![leaf(1, 0)];
        e[0].edx = EDX_HTT;
        for_vcpu(&mut e, 0, 1);
        assert_eq!(e[0].edx & EDX_HTT, 0);
        assert_eq!((e[0].ebx >> 16) & 0xff, 1);
    }
}
