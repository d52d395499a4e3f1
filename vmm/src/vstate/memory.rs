//! Guest RAM: one shared-memory file, mapped shared and lazily faulted, laid out by
//! `arch::x86_64::layout`.
//!
//! A file rather than anonymous memory because vhost-user backends (virtiofsd) map the same
//! pages: each region is (file, offset) in `VHOST_USER_SET_MEM_TABLE`.
//! Pages are not touched here: the host commits them only when the guest (or a backend) first
//! uses them.
//!
//! With `--huge-pages` the file is an unlinked one in a tmpfs instance of amvm's own, mounted
//! nowhere, with transparent huge pages (`huge=within_size`); by default it is a memfd, which
//! gets huge pages only where the host's `shmem_enabled` says so (Debian's default: never).
//! Without them every 4 KiB page the guest touches is its own nested-paging fault and TLB entry.
//! Measured in the emulated KVM host (docs/performance.md): qemu's own microvm boot of our kernel
//! took 3.0-3.6 s on its default THP-backed anonymous RAM and 3.5-5.3 s on a memfd, and a
//! memory-heavy workload took about two thirds of the time on the huge-page file. Not the default
//! because, with it, one nested guest of the emulated test bed died of an unexplained kernel
//! panic, and in one test-suite run a 1 GiB egress upload ran past its 1500 s limit (a stall or
//! a slow test bed: one run cannot tell; docs/performance.md).

use crate::arch::x86_64::layout;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create {mib} MiB of guest memory: {source}")]
    Memfd { mib: u64, source: io::Error },
    #[error("--huge-pages: cannot make the huge-page tmpfs for guest RAM: {source} (it needs the mount API, Linux 5.2 or later, and a user namespace amvm may mount tmpfs in; run without --huge-pages for a memfd)")]
    HugeTmpfs { source: io::Error },
    #[error("cannot map the snapshot's {mib} MiB of guest memory: {detail}")]
    Private { mib: u64, detail: String },
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        mib: u64,
        source: vm_memory::mmap::FromRangesError,
    },
}

/// How guest RAM is backed (see the module's comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// A file in a private `huge=within_size` tmpfs: transparent huge pages.
    HugeTmpfs,
    /// A memfd: huge pages only if the host's `shmem_enabled` allows them.
    Memfd,
}

/// Map `mib` MiB of guest RAM backed by a fresh shared-memory file: the huge-page tmpfs file if
/// `huge`, else a memfd.
pub fn create(mib: u64, huge: bool) -> Result<(GuestMemoryMmap, Backing), MemoryError> {
    let memfd = |source| MemoryError::Memfd { mib, source };
    let (file, backing) = if huge {
        let file = huge_tmpfs_file().map_err(|source| MemoryError::HugeTmpfs { source })?;
        (file, Backing::HugeTmpfs)
    } else {
        (new_memfd().map_err(memfd)?, Backing::Memfd)
    };
    let file = Arc::new(file);
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
    let mem = GuestMemoryMmap::from_ranges_with_files(with_files)
        .map_err(|source| MemoryError::Map { mib, source })?;
    Ok((mem, backing))
}

/// A restored guest's RAM: the snapshot's memory file mapped `MAP_PRIVATE` (copy-on-write), so
/// a restore copies nothing and sandboxes restored from one snapshot share every page none of
/// them wrote (the file's page cache); what the guest writes becomes its own anonymous memory.
/// Nothing else may map this RAM (a vhost-user backend would not see the private copies):
/// virtio-fs relays through a shadow region instead (devices' `fs_relay.rs`). `file` must stay
/// as it is while the guest runs (the CLI checked its length; a file cut short under the guest
/// would fault the VMM).
pub fn restore_private(mib: u64, file: &File) -> Result<GuestMemoryMmap, MemoryError> {
    use vm_memory::mmap::MmapRegionBuilder;
    use vm_memory::GuestRegionMmap;
    let map = |detail: String| MemoryError::Private { mib, detail };
    let mut offset = 0u64;
    let mut regions = Vec::new();
    for (start, len) in layout::ram_ranges(mib << 20) {
        let fo = FileOffset::new(file.try_clone().map_err(|e| map(e.to_string()))?, offset);
        let region = MmapRegionBuilder::new(len as usize)
            .with_file_offset(fo)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| map(e.to_string()))?;
        regions.push(
            GuestRegionMmap::new(region, GuestAddress(start))
                .ok_or_else(|| map(format!("a region at {start:#x} overflows")))?,
        );
        offset += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| map(e.to_string()))
}

/// `len` bytes of shared memory at address 0, backed by a memfd: the region a relaying
/// virtio-fs device shares with its backend.
pub fn shared(len: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let mib = len >> 20;
    let memfd = |source| MemoryError::Memfd { mib, source };
    let file = new_memfd().map_err(memfd)?;
    file.set_len(len).map_err(memfd)?;
    GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        len as usize,
        Some(FileOffset::new(file, 0)),
    )])
    .map_err(|source| MemoryError::Map { mib, source })
}

/// Guest RAM is a private mapping of a snapshot ([`restore_private`]).
pub fn is_private(mem: &GuestMemoryMmap) -> bool {
    use vm_memory::GuestMemoryBackend;
    mem.iter().any(|r| r.flags() & libc::MAP_PRIVATE != 0)
}

/// Write guest RAM to `out` for a snapshot, sparse: a shared mapping's file where it holds data
/// (`copy_sparse`); a private one's ([`restore_private`]) file where it holds data and then every
/// page the guest wrote since (present and anonymous, or swapped out, in `pagemap`:
/// `/proc/self/pagemap`, opened before the VMM left the host's tree). Returns the bytes written.
pub fn write_snapshot(
    mem: &GuestMemoryMmap,
    out: &File,
    pagemap: Option<&File>,
) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};
    let (file, len) =
        backing(mem).ok_or_else(|| io::Error::other("guest memory is not file-backed"))?;
    let mut written = copy_sparse(file, out, len)?;
    if !is_private(mem) {
        return Ok(written);
    }
    let pagemap =
        pagemap.ok_or_else(|| io::Error::other("no /proc/self/pagemap to find written pages"))?;
    const PAGE: u64 = 4096;
    /// pagemap(5): present, swapped, and "a file page or shared anonymous".
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE: u64 = 1 << 61;
    let mut entries = vec![0u8; 8 * 4096];
    for region in mem.iter() {
        let host = region.as_ptr() as u64;
        let at_file = region.file_offset().map_or(0, |f| f.start());
        let pages = region.len() / PAGE;
        let mut page = 0u64;
        while page < pages {
            let n = (pages - page).min(4096);
            let bytes = &mut entries[..8 * n as usize];
            pagemap.read_exact_at(bytes, (host / PAGE + page) * 8)?;
            let mut run: Option<u64> = None;
            for i in 0..=n {
                let own = i < n && {
                    let e = u64::from_ne_bytes(
                        bytes[8 * i as usize..8 * i as usize + 8]
                            .try_into()
                            .unwrap_or_default(),
                    );
                    (e & PRESENT != 0 && e & FILE == 0) || e & SWAPPED != 0
                };
                match (own, run) {
                    (true, None) => run = Some(i),
                    (false, Some(first)) => {
                        let (from, count) = ((page + first) * PAGE, (i - first) * PAGE);
                        let mut data = vec![0u8; count as usize];
                        region
                            .read_slice(&mut data, vm_memory::MemoryRegionAddress(from))
                            .map_err(io::Error::other)?;
                        out.write_all_at(&data, at_file + from)?;
                        written += count;
                        run = None;
                    }
                    _ => {}
                }
            }
            page += n;
        }
    }
    Ok(written)
}

/// The one file that backs all of guest RAM (each region at its offset in it, in address
/// order, as `create` lays them out), and its length.
pub fn backing(mem: &GuestMemoryMmap) -> Option<(&File, u64)> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let first = mem.iter().next()?.file_offset()?.file();
    let len = mem.iter().map(|r| r.len()).sum();
    Some((first, len))
}

/// Copy `len` bytes of `from` into `to` at the same offsets, only where `from` holds data
/// (SEEK_DATA / SEEK_HOLE): a guest's untouched RAM stays a hole in a snapshot's memory file,
/// and a hole in the file stays untouched RAM. `to` is made `len` long. Returns the bytes
/// copied.
pub fn copy_sparse(from: &File, to: &File, len: u64) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let have = from.metadata()?.len();
    if have < len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{have} bytes where guest RAM is {len}"),
        ));
    }
    to.set_len(len)?;
    let seek = |off: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        let off = libc::off_t::try_from(off).map_err(io::Error::other)?;
        // SAFETY: lseek(2) on an open descriptor; no pointers.
        let r = unsafe { libc::lseek(from.as_raw_fd(), off, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        match io::Error::last_os_error() {
            // No data at or after `off`.
            e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
            e => Err(e),
        }
    };
    let mut copied = 0u64;
    let mut at = 0u64;
    let mut buf = Vec::new();
    let mut kernel_copy = true;
    while at < len {
        let Some(start) = seek(at, libc::SEEK_DATA)? else {
            break;
        };
        if start >= len {
            break;
        }
        let end = seek(start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut pos = start;
        while pos < end {
            let want = (end - pos).min(64 << 20);
            if kernel_copy {
                let mut off_in = pos as libc::loff_t;
                let mut off_out = pos as libc::loff_t;
                // SAFETY: copy_file_range(2) between two open descriptors with offsets this
                // frame owns; the kernel writes only those two offsets.
                let n = unsafe {
                    libc::copy_file_range(
                        from.as_raw_fd(),
                        &mut off_in,
                        to.as_raw_fd(),
                        &mut off_out,
                        want as usize,
                        0,
                    )
                };
                if n > 0 {
                    pos += n as u64;
                    copied += n as u64;
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // Across file systems (or where the kernel cannot): read and write instead.
                    Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) if n < 0 => {
                        kernel_copy = false;
                    }
                    Some(libc::EINTR) if n < 0 => continue,
                    _ if n == 0 => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("the file ends at {pos}, before {len}"),
                        ))
                    }
                    _ => return Err(e),
                }
            }
            buf.resize(want.min(1 << 20) as usize, 0);
            let n = from.read_at(&mut buf, pos)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file ends at {pos}, before {len}"),
                ));
            }
            to.write_all_at(&buf[..n], pos)?;
            pos += n as u64;
            copied += n as u64;
        }
        at = end;
    }
    Ok(copied)
}

fn new_memfd() -> io::Result<File> {
    // SAFETY: the name is a NUL-terminated literal; the result is checked before use.
    let fd = unsafe { libc::memfd_create(c"amvm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// An unlinked file in a new tmpfs instance with `huge=within_size`, built with the mount API
/// (fsopen, fsconfig, fsmount) and attached to no directory, so nothing in the mount namespace
/// changes, not even for a moment. `size=0` leaves the instance unlimited, as a memfd is (the
/// host's memory and overcommit policy still apply). Needs CAP_SYS_ADMIN in the user namespace
/// that owns amvm's mount namespace (jail.rs makes one for a non-root user).
fn huge_tmpfs_file() -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let mnt = crate::jail::detached_tmpfs(&[
        (c"huge", c"within_size"),
        (c"size", c"0"),
        (c"mode", c"0700"),
    ])?;
    let flags = libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC;
    // SAFETY: openat(2) relative to our mount's root with a NUL-terminated literal; checked.
    let raw = unsafe { libc::openat(mnt.as_raw_fd(), c".".as_ptr(), flags, 0o600) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a descriptor the kernel just returned to us and nothing else owns.
    let file = unsafe { File::from_raw_fd(raw) };
    // The file keeps its tmpfs alive; the mount's descriptor closes here.
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;

    /// Guest RAM written out keeps its untouched pages holes, and read back into new guest RAM
    /// gives the same bytes everywhere (the file crosses file systems: memfd to the temp dir's).
    #[test]
    fn guest_ram_round_trips_through_a_sparse_file() {
        use vm_memory::Bytes;
        let (mem, _) = create(64, false).unwrap();
        let marks: [(u64, &[u8]); 3] = [
            (0x1000, b"first page"),
            (0x20_0000 + 7, b"two MiB in, unaligned"),
            ((64 << 20) - 5, b"end!!"),
        ];
        for (addr, bytes) in marks {
            mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        }
        let (file, len) = backing(&mem).unwrap();
        assert_eq!(len, 64 << 20);
        let dir = std::env::temp_dir().join(format!("amvm-mem-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("memory"))
            .unwrap();
        let copied = copy_sparse(file, &out, len).unwrap();
        assert!(copied <= 4 * (2 << 20), "{copied} bytes copied for 3 pages");
        assert_eq!(out.metadata().unwrap().len(), len);
        assert!(
            out.metadata().unwrap().blocks() * 512 < (8 << 20),
            "the file is not sparse: {} blocks",
            out.metadata().unwrap().blocks()
        );

        let (back, _) = create(64, false).unwrap();
        let (to, _) = backing(&back).unwrap();
        copy_sparse(&out, to, len).unwrap();
        for (addr, bytes) in marks {
            let mut got = vec![0u8; bytes.len()];
            back.read_slice(&mut got, GuestAddress(addr)).unwrap();
            assert_eq!(got, bytes, "at {addr:#x}");
        }
        let mut zero = vec![1u8; 4096];
        back.read_slice(&mut zero, GuestAddress(0x30_0000)).unwrap();
        assert!(zero.iter().all(|&b| b == 0));
        // A file shorter than guest RAM says so.
        out.set_len(len / 2).unwrap();
        let (short, _) = create(64, false).unwrap();
        let e = copy_sparse(&out, backing(&short).unwrap().0, len).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A restored guest's RAM reads the snapshot's file, keeps its writes to itself, and a
    /// snapshot of it holds both: the file's data and the pages written since.
    #[test]
    fn a_private_mapping_of_a_snapshot_is_copy_on_write_and_snapshots_its_own_writes() {
        use std::os::unix::fs::FileExt;
        use vm_memory::Bytes;
        let dir = std::env::temp_dir().join(format!("amvm-private-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let open = |name: &str| {
            File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(name))
                .unwrap()
        };
        let snap = open("memory");
        snap.set_len(64 << 20).unwrap();
        snap.write_all_at(b"from the snapshot", 0x1000).unwrap();
        snap.write_all_at(b"overwritten", 0x3000).unwrap();
        let mem = restore_private(64, &snap).unwrap();
        assert!(is_private(&mem));
        let mut got = [0u8; 17];
        mem.read_slice(&mut got, GuestAddress(0x1000)).unwrap();
        assert_eq!(&got, b"from the snapshot");
        mem.write_slice(b"the guest's", GuestAddress(0x3000))
            .unwrap();
        mem.write_slice(b"written in a hole", GuestAddress(0x20_0000))
            .unwrap();
        // The file is untouched: a second restore sees the snapshot, not this guest.
        let mut file_bytes = [0u8; 11];
        snap.read_exact_at(&mut file_bytes, 0x3000).unwrap();
        assert_eq!(&file_bytes, b"overwritten");

        let pagemap = File::open("/proc/self/pagemap").unwrap();
        let out = open("memory2");
        let written = write_snapshot(&mem, &out, Some(&pagemap)).unwrap();
        assert!(written < (8 << 20), "{written} bytes written");
        let again = restore_private(64, &out).unwrap();
        for (addr, want) in [
            (0x1000, &b"from the snapshot"[..]),
            (0x3000, b"the guest's"),
            (0x20_0000, b"written in a hole"),
        ] {
            let mut got = vec![0u8; want.len()];
            again.read_slice(&mut got, GuestAddress(addr)).unwrap();
            assert_eq!(got, want, "at {addr:#x}");
        }
        // Without pagemap a private mapping's own pages could not be found: refused.
        assert!(write_snapshot(&mem, &open("memory3"), None).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn guest_ram_is_a_memfd_by_default() {
        use vm_memory::GuestMemoryBackend;
        let (mem, backing) = create(64, false).unwrap();
        assert_eq!((mem.num_regions(), backing), (1, Backing::Memfd));
    }

    #[test]
    fn huge_pages_put_guest_ram_in_an_unlinked_tmpfs_file() {
        use vm_memory::GuestMemoryBackend;
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            // Outside amvm's user namespace (jail.rs) a non-root process may not mount tmpfs:
            // the run fails, saying why, rather than silently using a memfd.
            let e = create(64, true).unwrap_err();
            assert!(matches!(e, MemoryError::HugeTmpfs { .. }), "{e}");
            return;
        }
        let (mem, backing) = create(64, true).unwrap();
        assert_eq!((mem.num_regions(), backing), (1, Backing::HugeTmpfs));
        // The file that backs guest RAM, as virtiofsd would be given it.
        use vm_memory::GuestMemoryRegion;
        let region = mem.find_region(GuestAddress(0)).unwrap();
        let f = region.file_offset().unwrap().file();
        assert_eq!(
            f.metadata().unwrap().nlink(),
            0,
            "the file has no name anywhere"
        );
        // SAFETY: statfs is plain data; all zeroes is a valid value.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs(2) on an open descriptor into a correctly sized struct.
        let r = unsafe { libc::fstatfs(f.as_raw_fd(), &mut st) };
        assert_eq!(r, 0);
        assert_eq!(st.f_type, libc::TMPFS_MAGIC);
        // Nothing was mounted where anyone can see it.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains("huge=within_size"), "{mounts}");
    }
}
