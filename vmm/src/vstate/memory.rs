//! Guest RAM: one memfd, mapped shared and lazily faulted, laid out by `arch::x86_64::layout`.
//!
//! A memfd rather than anonymous memory because vhost-user backends (virtiofsd) map the same
//! pages: each region is (memfd, offset) in `VHOST_USER_SET_MEM_TABLE`.
//! Pages are not touched here: the host commits them only when the guest (or a backend) first
//! uses them.

use crate::arch::x86_64::layout;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create {mib} MiB of guest memory (memfd): {source}")]
    Memfd { mib: u64, source: io::Error },
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        mib: u64,
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Map `mib` MiB of guest RAM backed by a fresh memfd.
pub fn create(mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let memfd = |source| MemoryError::Memfd { mib, source };
    // SAFETY: the name is a NUL-terminated literal; the result is checked before use.
    let fd = unsafe { libc::memfd_create(c"amvm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(memfd(io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let file = Arc::new(unsafe { File::from_raw_fd(fd) });
    let ranges = layout::ram_ranges(mib << 20);
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    file.set_len(total).map_err(memfd)?;
    let mut offset = 0u64;
    let with_files: Vec<(GuestAddress, usize, Option<FileOffset>)> = ranges
        .into_iter()
        .map(|(start, len)| {
            let r = (
                GuestAddress(start),
                len as usize,
                Some(FileOffset::from_arc(file.clone(), offset)),
            );
            offset += len;
            r
        })
        .collect();
    GuestMemoryMmap::from_ranges_with_files(with_files)
        .map_err(|source| MemoryError::Map { mib, source })
}
