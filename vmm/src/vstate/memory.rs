//! Guest RAM: anonymous, lazily-faulted mappings laid out by `arch::x86_64::layout`.

use crate::arch::x86_64::layout;
use vm_memory::{GuestAddress, GuestMemoryMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        mib: u64,
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Map `mib` MiB of guest RAM. Pages are not touched here: the host commits them only when the
/// guest first uses them.
pub fn create(mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let ranges: Vec<(GuestAddress, usize)> = layout::ram_ranges(mib << 20)
        .into_iter()
        .map(|(start, len)| (GuestAddress(start), len as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Map { mib, source })
}
