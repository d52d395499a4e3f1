//! Architecture facts as plain values: the guest-physical layout, CPUID and register contents,
//! the MP table. No KVM calls here (those are in `vstate`).

pub mod x86_64;
