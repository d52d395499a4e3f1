//! What the amvm process gives up before it starts anything: descriptors it inherited, the
//! host's network (an empty network namespace: only a `lo` that is down) and mount
//! propagation out (a mount namespace of its own, its mounts slaves of the host's). It needs no root: a user in the `kvm` group gets
//! the same namespaces through a user namespace that maps only their own uid and gid.
//!
//! Egress still works: streams go to a unix socket *path*, which the filesystem resolves
//! whatever the network namespace. virtiofsd, started later, inherits both namespaces.
//!
//! Once everything it needs from the host's tree is open (the kernel read, /dev/kvm open,
//! virtiofsd in a sandbox of its own), amvm leaves that tree: [`enter_empty_root`] pivots it
//! into a read-only tmpfs that holds nothing but, with `--egress`, the egress socket (bound in
//! as [`EGRESS_IN_ROOT`]), and detaches the host's tree from its mount namespace. A thread that
//! escaped its seccomp filter finds an empty root; the one connect(2) the event loop may make
//! reaches only the egress socket (abstract sockets belong to the network namespace, and amvm's
//! is empty).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// Where the egress socket is once amvm is in its empty root ([`enter_empty_root`]).
pub const EGRESS_IN_ROOT: &str = "/egress.sock";
/// Where a session's socket to its supervisor (exec and control streams) appears in the root.
pub const GUEST_IN_ROOT: &str = "/guest.sock";

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("cannot enter a new mount namespace: {0} (as root this needs CAP_SYS_ADMIN; inside a container, allow unshare, e.g. docker run --privileged or --security-opt seccomp=unconfined)")]
    UnshareRoot(io::Error),
    #[error("cannot create a user namespace for amvm's isolation: {0} (unprivileged user namespaces are disabled here: set sysctl user.max_user_namespaces above 0, and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0; or run amvm as root)")]
    UnshareUser(io::Error),
    #[error("mapping uid/gid into amvm's user namespace: {what}: {source}")]
    IdMap {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("making amvm's mounts slaves of the host's: {0}")]
    Propagation(io::Error),
    #[error("closing inherited descriptors: {0}")]
    CloseFds(io::Error),
    #[error("setting no_new_privs: {0}")]
    NoNewPrivs(io::Error),
    #[error("dropping amvm's capabilities: {0}")]
    DropCaps(io::Error),
    #[error("moving amvm into its empty root: {step}: {source}")]
    EmptyRoot {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

/// A descriptor the kernel just returned (`r >= 0`), or the error it set.
fn owned(r: libc::c_long) -> io::Result<OwnedFd> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `r` is a descriptor the kernel just returned to us and nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r as libc::c_int) })
}

fn check(r: libc::c_long) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A new tmpfs instance with `options` (fsconfig key/value strings), mounted nowhere: the
/// mount API (fsopen, fsconfig, fsmount, Linux 5.2) returns it as a descriptor of its root.
/// Needs CAP_SYS_ADMIN in the user namespace that owns amvm's mount namespace.
pub fn detached_tmpfs(options: &[(&CStr, &CStr)]) -> io::Result<OwnedFd> {
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSCONFIG_SET_STRING: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    // SAFETY: fsopen(2) with a NUL-terminated literal; the result is checked.
    let fs = owned(unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), FSOPEN_CLOEXEC) })?;
    let config = |cmd: libc::c_uint, key: *const libc::c_char, value: *const libc::c_char| {
        // SAFETY: fsconfig(2) on our fs context with NUL-terminated strings (or null where the
        // command takes none); the result is checked.
        check(unsafe { libc::syscall(libc::SYS_fsconfig, fs.as_raw_fd(), cmd, key, value, 0) })
    };
    for (key, value) in options {
        config(FSCONFIG_SET_STRING, key.as_ptr(), value.as_ptr())?;
    }
    config(FSCONFIG_CMD_CREATE, std::ptr::null(), std::ptr::null())?;
    // SAFETY: fsmount(2) of our configured context; the result is checked.
    owned(unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, 0) })
}

/// Leave the host's tree for good: pivot into a new, read-only tmpfs root that holds only the
/// `sockets` (each `(host path as the user named it, path in the root)`: the egress socket at
/// [`EGRESS_IN_ROOT`], a session's supervisor socket at [`GUEST_IN_ROOT`]), and detach
/// the old root from amvm's mount namespace. Call once nothing needs a path any more: the
/// kernel loaded, every virtiofsd past its handshake (so in a mount namespace of its own; a
/// process still in ours would be moved too), and before capabilities are dropped (mounting
/// needs CAP_SYS_ADMIN, in amvm's user namespace for a non-root user). Threads that exist
/// already move with this one (they share its root).
///
/// The socket is bound by inode: streams reach the socket amvm checked at start. An egress
/// proxy that re-creates its socket while a run lasts is not reached by later streams (each
/// fails, and the guest sees a reset).
pub fn enter_empty_root(sockets: &[(&Path, &str)]) -> Result<(), JailError> {
    let entries: Vec<(&Path, &Path, Kind)> = sockets
        .iter()
        .map(|&(path, in_root)| (path, Path::new(in_root), Kind::File))
        .collect();
    let root = detached_tmpfs(&[(c"mode", c"0500"), (c"size", c"4k"), (c"nr_inodes", c"8")])
        .map_err(|source| JailError::EmptyRoot {
            step: "a tmpfs for the new root",
            source,
        })?;
    pivot_into(root, &entries)
}

/// A sandbox's supervisor leaves the host's tree the same way: its new root (a read-only
/// tmpfs) holds only `dirs`, each bind-mounted at its own absolute path (its state directory;
/// with `--overlay-size`, the overlay's scratch tmpfs, which `amvm diff` reads through
/// `/proc/PID/root` at that path). Same preconditions as [`enter_empty_root`].
pub fn enter_root_of_dirs(dirs: &[&Path]) -> Result<(), JailError> {
    let entries: Vec<(&Path, &Path, Kind)> = dirs.iter().map(|&d| (d, d, Kind::Dir)).collect();
    // Room for the directories leading to each bind (a few inodes each).
    let root = detached_tmpfs(&[
        (c"mode", c"0755"),
        (c"size", c"64k"),
        (c"nr_inodes", c"256"),
    ])
    .map_err(|source| JailError::EmptyRoot {
        step: "a tmpfs for the new root",
        source,
    })?;
    pivot_into(root, &entries)
}

/// What a bind in the new root is mounted on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
}

/// Bind each `(host path, path in root, kind)` into `root` (a detached tmpfs) and pivot into
/// it: see [`enter_empty_root`].
fn pivot_into(root: OwnedFd, entries: &[(&Path, &Path, Kind)]) -> Result<(), JailError> {
    use std::os::unix::ffi::OsStrExt;
    let step = |step: &'static str| move |source| JailError::EmptyRoot { step, source };
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let cstr = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| step("a path with a NUL byte")(io::ErrorKind::InvalidInput.into()))
    };
    // The binds first, while their paths still mean what the user meant: a bind mount of
    // each, not yet attached anywhere (open_tree follows symlinks in the path, as connect(2)
    // does).
    let mut bound = Vec::with_capacity(entries.len());
    for &(path, in_root, kind) in entries {
        let c = cstr(path)?;
        let flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
        // SAFETY: open_tree(2) with a NUL-terminated path; the result is checked.
        let r = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c.as_ptr(), flags) };
        let what = if kind == Kind::File {
            "binding a socket"
        } else {
            "binding a directory"
        };
        bound.push((owned(r).map_err(step(what))?, in_root, kind));
    }
    // pivot_root(2) wants the new root attached in our tree: over /dev, which amvm no longer
    // needs (/dev/kvm is open) and which exists wherever /dev/kvm does. Only amvm's own,
    // private mount namespace sees this.
    // SAFETY: move_mount(2) of our detached mount onto a literal path; the result is checked.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            root.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            c"/dev".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })
    .map_err(step("attaching the new root"))?;
    for (tree, in_root, kind) in bound {
        // The mount point, named relative to the new root: its parent directories made as
        // plain directories (only normal components: an in-root path is absolute and clean).
        let mut rel = std::path::PathBuf::new();
        for c in in_root.components() {
            match c {
                std::path::Component::RootDir | std::path::Component::CurDir => {}
                std::path::Component::Normal(n) => rel.push(n),
                _ => return Err(step("a path with ..")(io::ErrorKind::InvalidInput.into())),
            }
        }
        let mut at = std::path::PathBuf::new();
        let parts: Vec<_> = rel.components().collect();
        for (i, part) in parts.iter().enumerate() {
            at.push(part);
            let last = i + 1 == parts.len();
            let name = cstr(&at)?;
            if last && kind == Kind::File {
                let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDONLY | libc::O_CLOEXEC;
                // SAFETY: openat(2) relative to the new root with a NUL-terminated name;
                // checked.
                let point = owned(
                    unsafe { libc::openat(root.as_raw_fd(), name.as_ptr(), flags, 0o600) }.into(),
                )
                .map_err(step("a mount point for a socket"))?;
                drop(point);
            } else {
                // SAFETY: mkdirat(2) relative to the new root with a NUL-terminated name.
                let r = unsafe { libc::mkdirat(root.as_raw_fd(), name.as_ptr(), 0o755) };
                if r != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                    return Err(step("a mount point for a directory")(
                        io::Error::last_os_error(),
                    ));
                }
            }
        }
        let name = cstr(&rel)?;
        // SAFETY: move_mount(2) of the detached bind mount onto the point just made, named
        // relative to the new root; the result is checked.
        check(unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                root.as_raw_fd(),
                name.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        })
        .map_err(step("attaching a bind"))?;
    }
    let flags = libc::O_DIRECTORY | libc::O_PATH | libc::O_CLOEXEC;
    // SAFETY: open(2) of a literal path; the result is checked.
    let old = owned(unsafe { libc::open(c"/".as_ptr(), flags) }.into());
    let old = old.map_err(step("the old root"))?;
    // The pivot_root(".", ".") idiom: the new root becomes "/", the old one is stacked on it
    // and then detached from where we stand.
    // SAFETY: fchdir(2) to a descriptor we own; checked.
    let r = unsafe { libc::fchdir(root.as_raw_fd()) };
    check(r.into()).map_err(step("entering the new root"))?;
    // SAFETY: pivot_root(2) with two literal paths; checked.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) };
    check(r).map_err(step("pivot_root"))?;
    // SAFETY: fchdir(2) to a descriptor we own; checked.
    let r = unsafe { libc::fchdir(old.as_raw_fd()) };
    check(r.into()).map_err(step("entering the old root"))?;
    // SAFETY: umount2(2) of a literal path; checked.
    let r = unsafe { libc::umount2(c".".as_ptr(), libc::MNT_DETACH) };
    check(r.into()).map_err(step("detaching the host's tree"))?;
    // SAFETY: chdir(2) to a literal path; checked.
    let r = unsafe { libc::chdir(c"/".as_ptr()) };
    check(r.into()).map_err(step("entering /"))?;
    let ro = libc::MS_REMOUNT
        | libc::MS_BIND
        | libc::MS_RDONLY
        | libc::MS_NOSUID
        | libc::MS_NODEV
        | libc::MS_NOEXEC;
    let none = std::ptr::null();
    // SAFETY: mount(2) remounting "/" with flags only (no source, type or data). The binds
    // under it keep their own flags.
    let r = unsafe { libc::mount(none, c"/".as_ptr(), none, ro, std::ptr::null()) };
    check(r.into()).map_err(step("making the new root read-only"))?;
    Ok(())
}

/// Close every descriptor above stderr. amvm opens nothing before this and expects nothing
/// from its parent, so a leaked descriptor of the caller (a socket, a secret file) never
/// reaches the VMM's threads or virtiofsd.
pub fn close_inherited_fds() -> Result<(), JailError> {
    // SAFETY: close_range(2) on descriptors this process owns and does not use; no pointers.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::ENOSYS) {
        return Err(JailError::CloseFds(e));
    }
    // Kernels before 5.9: close what /proc lists.
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map_err(JailError::CloseFds)?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: as above; the read_dir's own descriptor is closed already (EBADF is fine).
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// No exec by amvm or its children (virtiofsd) can gain privileges (setuid bits, file
/// capabilities) from here on.
pub fn no_new_privs() -> Result<(), JailError> {
    // SAFETY: prctl(2) with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(JailError::NoNewPrivs(io::Error::last_os_error()));
    }
    Ok(())
}

/// Enter an empty network namespace and a private mount namespace. Must run while the process
/// has one thread (a user namespace requires it).
pub fn enter_namespaces() -> Result<(), JailError> {
    unshare_as_self(libc::CLONE_NEWNET)
}

/// Enter a private mount namespace of its own (and, for a non-root user, the user namespace
/// that lets it mount there, mapping exactly its own ids), plus the namespaces in `extra`.
/// Nothing mounted in it afterwards propagates back to the host. Must run while the process
/// has one thread (a user namespace requires it); may be called again, nesting.
pub fn unshare_as_self(extra: libc::c_int) -> Result<(), JailError> {
    // SAFETY: geteuid cannot fail and takes no pointers.
    let uid = unsafe { libc::geteuid() };
    // SAFETY: as geteuid.
    let gid = unsafe { libc::getegid() };
    if uid == 0 {
        // SAFETY: unshare(2) with namespace flags only.
        if unsafe { libc::unshare(extra | libc::CLONE_NEWNS) } != 0 {
            return Err(JailError::UnshareRoot(io::Error::last_os_error()));
        }
    } else {
        // SAFETY: as above.
        if unsafe { libc::unshare(libc::CLONE_NEWUSER | extra | libc::CLONE_NEWNS) } != 0 {
            return Err(JailError::UnshareUser(io::Error::last_os_error()));
        }
        // Map exactly our own ids: inside, amvm is who it was outside, and its supplementary
        // groups (kvm) still count for /dev/kvm. setgroups must be denied before gid_map.
        let write = |what: &'static str, path: &str, text: String| {
            std::fs::write(path, text).map_err(|source| JailError::IdMap { what, source })
        };
        write("setgroups", "/proc/self/setgroups", "deny".into())?;
        write("uid_map", "/proc/self/uid_map", format!("{uid} {uid} 1"))?;
        write("gid_map", "/proc/self/gid_map", format!("{gid} {gid} 1"))?;
    }
    // Nothing amvm (or virtiofsd) mounts may propagate back to the host. Slave, not private:
    // what the host mounts later under a shared mount still shows here, and so to virtiofsd
    // (whose own namespace is a slave of this one): a pod's container roots, mounted on the
    // host after its VM started, reach the guest that way.
    set_propagation(libc::MS_SLAVE).map_err(JailError::Propagation)
}

/// In a fresh mount namespace: make every mount private, so nothing mounted from here on
/// propagates back to the host's namespace, nor from there to here.
pub fn make_mounts_private() -> io::Result<()> {
    set_propagation(libc::MS_PRIVATE)
}

/// Set every mount's propagation to `kind` (MS_PRIVATE or MS_SLAVE), recursively from `/`.
fn set_propagation(kind: libc::c_ulong) -> io::Result<()> {
    // SAFETY: mount(2) with a static, NUL-terminated path and no data.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | kind,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Give up every capability (effective, permitted, inheritable, ambient) once the namespaces
/// exist: the VMM needs none to run a guest. A non-root user holds all of them inside the user
/// namespace it just made; root holds them on the host. (virtiofsd, exec'd later, gets what an
/// exec by its uid gets: as root, the capabilities its sandbox needs; as a user, none.)
pub fn drop_capabilities() -> Result<(), JailError> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [Data::default(); 2];
    // SAFETY: prctl(2) with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    // SAFETY: capset(2) reads a version-3 header and two data words, which live on our stack.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if r != 0 {
        return Err(JailError::DropCaps(io::Error::last_os_error()));
    }
    Ok(())
}
