//! What the amvm process gives up before it starts anything: descriptors it inherited, the
//! host's network (an empty network namespace: only a `lo` that is down) and mount
//! propagation (a private mount namespace). It needs no root: a user in the `kvm` group gets
//! the same namespaces through a user namespace that maps only their own uid and gid.
//!
//! Egress still works: streams go to a unix socket *path*, which the filesystem resolves
//! whatever the network namespace. virtiofsd, started later, inherits both namespaces.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("cannot enter a new network and mount namespace: {0} (as root this needs CAP_SYS_ADMIN; inside a container, allow unshare, e.g. docker run --privileged or --security-opt seccomp=unconfined)")]
    UnshareRoot(io::Error),
    #[error("cannot create a user namespace for amvm's isolation: {0} (unprivileged user namespaces are disabled here: set sysctl user.max_user_namespaces above 0, and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0; or run amvm as root)")]
    UnshareUser(io::Error),
    #[error("mapping uid/gid into amvm's user namespace: {what}: {source}")]
    IdMap {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("making amvm's mounts private: {0}")]
    Propagation(io::Error),
    #[error("closing inherited descriptors: {0}")]
    CloseFds(io::Error),
    #[error("setting no_new_privs: {0}")]
    NoNewPrivs(io::Error),
    #[error("dropping amvm's capabilities: {0}")]
    DropCaps(io::Error),
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
    // SAFETY: geteuid cannot fail and takes no pointers.
    let uid = unsafe { libc::geteuid() };
    // SAFETY: as geteuid.
    let gid = unsafe { libc::getegid() };
    if uid == 0 {
        // SAFETY: unshare(2) with namespace flags only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
            return Err(JailError::UnshareRoot(io::Error::last_os_error()));
        }
    } else {
        // SAFETY: as above.
        if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::CLONE_NEWNS) }
            != 0
        {
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
    // Nothing amvm (or virtiofsd) mounts may propagate back to the host.
    // SAFETY: mount(2) with a static, NUL-terminated path and no data.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(JailError::Propagation(io::Error::last_os_error()));
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
