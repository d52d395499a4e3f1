//! x86_64: guest layout, CPUID shaping, boot registers, the MP table.

pub mod cpuid;
pub mod layout;
pub mod mptable;
pub mod regs;
