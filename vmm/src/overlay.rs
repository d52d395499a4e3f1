//! `--workspace DIR:overlay`: a writable /workspace whose writes never reach DIR.
//!
//! amvm mounts an overlayfs in its own private mount namespace (jail.rs), before virtiofsd
//! starts: DIR is the lower layer (overlayfs never writes a lower layer), and the upper and
//! work directories live in a scratch directory on the host (beside `--changes FILE`, else in
//! the runtime directory, `/dev/shm` or the temp dir). virtiofsd serves the merged directory read-write; the guest mounts it
//! writable. Whatever the guest writes is in the upper directory on the host as soon as
//! virtiofsd has written it, so a guest that crashes loses nothing it had written.
//!
//! The scratch directory is made by the sandbox's supervisor (sandbox/supervisor.rs; a run is a
//! sandbox too), which stays outside the VMM's confinement and forks the VMM (which jails
//! itself). `amvm run --changes FILE` writes the upper directory as a layer to FILE
//! (changes/layer.rs, [`write_changes`]) once its command ended; `amvm diff` and `commit` read
//! it while the sandbox lives; `amvm rm` removes the scratch directory.
//!
//! `--overlay-size SIZE` caps the upper layer: the supervisor enters a private mount namespace
//! of its own (jail::unshare_as_self) and mounts a tmpfs of SIZE on the scratch directory before
//! it forks the VMM, which inherits it. A full upper layer then gives the guest's writes ENOSPC
//! (overlayfs and virtiofsd pass the error on) and the run goes on. The layer lives in memory
//! for as long as the supervisor does: it survives a guest crash or the VMM's death, not the
//! supervisor's. Others reach it through `/proc/SUPERVISOR/root` (`amvm diff` of a sandbox).

use crate::changes::layer::{write_layer, LayerError, LayerReport};
use crate::config::Overlay;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("making the overlay's scratch directory in {0}: {1}")]
    Scratch(PathBuf, io::Error),
    #[error("mounting the overlay (lower {lower}, upper in {scratch}): {error}{}", hint(.error))]
    Mount {
        lower: PathBuf,
        scratch: PathBuf,
        error: io::Error,
    },
    #[error("--overlay-size: {0}")]
    CapNamespace(#[from] crate::jail::JailError),
    #[error("--overlay-size: mounting a tmpfs of {size} bytes on {dir}: {error}")]
    CapMount {
        size: u64,
        dir: PathBuf,
        error: io::Error,
    },
    #[error("--overlay-size: this kernel's tmpfs holds no user extended attributes, which overlayfs needs for a user other than root ({0}): use Linux 6.6 or later, run amvm as root, or leave out --overlay-size")]
    CapXattr(io::Error),
    #[error("writing the changes to {0}: {1} (the upper layer is kept in {2})")]
    Changes(PathBuf, LayerError, PathBuf),
    #[error("writing the changes to {0}: {1} (the upper layer is kept in {2})")]
    ChangesIo(PathBuf, io::Error, PathBuf),
    #[error("the snapshot's workspace changes: {0}")]
    Restore(#[from] crate::snapshot::tree::TreeError),
}

fn hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
            " (the scratch directory, beside --changes FILE or in the runtime directory, must be on a filesystem overlayfs can write its upper layer to: not an overlayfs itself, and with extended attributes (user.* for a non-root user, as ext4 and xfs have; Linux 5.11 or later): put FILE elsewhere)"
        }
        Some(libc::ENODEV) => " (this kernel has no overlayfs: modprobe overlay)",
        _ => "",
    }
}

/// The scratch directory's parts.
pub fn upper(scratch: &Path) -> PathBuf {
    scratch.join("upper")
}
pub fn merged(scratch: &Path) -> PathBuf {
    scratch.join("merged")
}

/// Make the scratch directory (mode 0700): beside `--changes FILE` when given (on the
/// filesystem the user chose for the result) unless that is an overlayfs (which cannot hold an
/// upper layer), else in `$XDG_RUNTIME_DIR`, `/dev/shm` or the temp dir.
pub fn make_scratch(ov: &Overlay) -> Result<PathBuf, OverlayError> {
    use std::os::unix::fs::DirBuilderExt;
    let beside = ov
        .changes
        .as_ref()
        .and_then(|f| f.parent().map(Path::to_owned))
        .filter(|d| !is_overlayfs(d));
    let base = beside
        .or_else(|| std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from))
        .into_iter()
        .chain([PathBuf::from("/dev/shm"), std::env::temp_dir()])
        .find(|d| d.is_dir() && !is_overlayfs(d))
        .unwrap_or_else(std::env::temp_dir);
    let name = format!(
        ".amvm-overlay-{}-{:08x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    // Absolute: a sandbox's supervisor holds it at this path in a root of its own.
    let base = std::path::absolute(&base).unwrap_or(base);
    let scratch = base.join(name);
    let err = |e| OverlayError::Scratch(base.clone(), e);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&scratch)
        .map_err(err)?;
    if let Some(size) = ov.size {
        if let Err(e) = cap(&scratch, size) {
            let _ = std::fs::remove_dir(&scratch);
            return Err(e);
        }
    }
    for part in ["upper", "work", "merged"] {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(scratch.join(part))
            .map_err(err)?;
    }
    // The overlay's root takes its owner and mode from the upper directory's: make them DIR's,
    // so /workspace is whoever's DIR is, as without the overlay.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(&ov.lower).map_err(err)?;
    let up = upper(&scratch);
    // As another user than DIR's owner this cannot change the owner; the mode still applies.
    let _ = std::os::unix::fs::chown(&up, Some(meta.uid()), Some(meta.gid()));
    std::fs::set_permissions(&up, std::fs::Permissions::from_mode(meta.mode() & 0o7777))
        .map_err(err)?;
    Ok(scratch)
}

/// `--overlay-size`: this process (the supervisor, single-threaded still) moves into a private
/// mount namespace and mounts a tmpfs of `size` bytes, mode 0700, on the scratch directory.
fn cap(scratch: &Path, size: u64) -> Result<(), OverlayError> {
    crate::jail::unshare_as_self(0)?;
    let err = |error| OverlayError::CapMount {
        size,
        dir: scratch.to_owned(),
        error,
    };
    mount_nosuid(c"tmpfs", scratch, &format!("size={size},mode=0700")).map_err(err)?;
    // A user other than root: overlayfs keeps its markers (opaque directories) in user.*
    // extended attributes, which tmpfs holds only from Linux 6.6 on.
    // SAFETY: geteuid cannot fail and takes no pointers.
    if unsafe { libc::geteuid() } != 0 {
        let target = CString::new(scratch.as_os_str().as_bytes())
            .map_err(|_| err(io::ErrorKind::InvalidInput.into()))?;
        // SAFETY: setxattr(2) on a NUL-terminated path with a 1-byte value; checked.
        let r = unsafe {
            libc::setxattr(
                target.as_ptr(),
                c"user.amvm.probe".as_ptr(),
                c"1".as_ptr().cast(),
                1,
                0,
            )
        };
        if r != 0 {
            return Err(OverlayError::CapXattr(io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Where a sandbox's scratch directory is seen from another process: through its supervisor's
/// root when the upper layer is a tmpfs in the supervisor's mount namespace (`--overlay-size`).
pub fn scratch_seen_from_outside(scratch: &Path, capped: bool, supervisor: u32) -> PathBuf {
    if capped {
        Path::new(&format!("/proc/{supervisor}/root"))
            .join(scratch.strip_prefix("/").unwrap_or(scratch))
    } else {
        scratch.to_owned()
    }
}

fn is_overlayfs(dir: &Path) -> bool {
    const OVERLAYFS_SUPER_MAGIC: libc::c_long = 0x794c_7630;
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs(2) of a NUL-terminated path into a local.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    r == 0 && st.f_type as libc::c_long == OVERLAYFS_SUPER_MAGIC
}

/// Mount the overlay on `scratch/merged` in amvm's own mount namespace (after
/// `jail::enter_namespaces`, from which no mount propagates to the host).
pub fn mount(ov: &Overlay, scratch: &Path) -> Result<(), OverlayError> {
    // SAFETY: geteuid cannot fail and takes no pointers.
    let root = unsafe { libc::geteuid() } == 0;
    let mut opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        ov.lower.display(),
        upper(scratch).display(),
        scratch.join("work").display()
    );
    // In a user namespace overlayfs keeps its xattrs in user.overlay.* (Linux 5.11).
    if !root {
        opts.push_str(",userxattr");
    }
    let err = |error| OverlayError::Mount {
        lower: ov.lower.clone(),
        scratch: scratch.to_owned(),
        error,
    };
    mount_nosuid(c"overlay", &merged(scratch), &opts).map_err(err)
}

/// mount(2) of a filesystem of type `fs` (also its source name) on `target`, nosuid and nodev,
/// with the options `data`.
fn mount_nosuid(fs: &std::ffi::CStr, target: &Path, data: &str) -> io::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let data = CString::new(data).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call; checked.
    let r = unsafe {
        libc::mount(
            fs.as_ptr(),
            target.as_ptr(),
            fs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Write the upper directory of `scratch` as a layer to `file`: beside it (the same
/// filesystem), then renamed into place, so FILE is either the old one or the whole new one.
/// An error names `scratch`, which the caller keeps.
pub fn write_changes(scratch: &Path, file: &Path) -> Result<LayerReport, OverlayError> {
    let keep = || scratch.to_owned();
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(format!(".amvm-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written: Result<LayerReport, OverlayError> = (|| {
        let out = std::fs::File::create(&tmp)
            .map_err(|e| OverlayError::ChangesIo(file.to_owned(), e, keep()))?;
        let (out, report) = write_layer(&upper(scratch), io::BufWriter::new(out))
            .map_err(|e| OverlayError::Changes(file.to_owned(), e, keep()))?;
        let out = out
            .into_inner()
            .map_err(|e| OverlayError::ChangesIo(file.to_owned(), e.into_error(), keep()))?;
        out.sync_all()
            .and_then(|()| std::fs::rename(&tmp, file))
            .map_err(|e| OverlayError::ChangesIo(file.to_owned(), e, keep()))?;
        Ok(report)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Remove the scratch directory; overlayfs leaves its work directory without permissions, so
/// each directory is opened up before its contents go.
pub fn remove_scratch(scratch: &Path) {
    // An `--overlay-size` tmpfs, where this process is in the namespace that has it: detached
    // (its memory freed) rather than emptied; elsewhere (EINVAL: not a mount point here) nothing.
    if let Ok(c) = CString::new(scratch.as_os_str().as_bytes()) {
        // SAFETY: umount2(2) of a NUL-terminated path; failure is harmless and ignored.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    crate::snapshot::tree::make_removable(scratch);
    if let Err(e) = std::fs::remove_dir_all(scratch) {
        eprintln!(
            "amvm: could not remove the overlay's scratch directory {}: {e}",
            scratch.display()
        );
    }
}
