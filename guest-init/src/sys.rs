//! The few raw system calls guest-init needs that std does not wrap.

use std::ffi::CString;
use std::io;

/// mount(2), with the file system's options as `data`.
pub fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (src, tgt, fst) = (c(source)?, c(target)?, c(fstype)?);
    let data = data.map(c).transpose()?;
    let data_ptr = data
        .as_ref()
        .map_or(std::ptr::null(), |d| d.as_ptr().cast::<libc::c_void>());
    // SAFETY: all pointers are valid NUL-terminated strings (or NULL for no data) that outlive
    // the call.
    let rc = unsafe { libc::mount(src.as_ptr(), tgt.as_ptr(), fst.as_ptr(), flags, data_ptr) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bind-mount `source` on `target` (with the mounts beneath it when `recursive`).
pub fn bind(source: &str, target: &str, recursive: bool) -> io::Result<()> {
    let rec = if recursive { libc::MS_REC } else { 0 };
    mount(source, target, "", libc::MS_BIND | rec, None)
}

/// Make the mount at `target` read-only, keeping `flags`.
pub fn remount_readonly(target: &str, flags: libc::c_ulong) -> io::Result<()> {
    mount(
        "none",
        target,
        "",
        libc::MS_REMOUNT | libc::MS_RDONLY | flags,
        None,
    )
}

/// Flush file systems and reset the machine. Never returns.
pub fn reboot() -> ! {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    // SAFETY: reboot(2) with a valid command; as PID 1 we hold CAP_SYS_BOOT.
    unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    // Only reached if reboot failed; PID 1 must not exit.
    loop {
        std::thread::park();
    }
}

/// Bring the loopback interface up (the kernel then gives it 127.0.0.1/8).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    // SAFETY: ifreq is plain data; all-zero is a valid value before we fill it in.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the flags of the interface named in `req` into `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the ioctl above filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCSIFFLAGS takes the same ifreq with the new flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A restored guest's clock: the host's wall clock, `unix_nanos` since the epoch.
pub fn set_clock(unix_nanos: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: (unix_nanos / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_nanos % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime(2) reads the timespec it is pointed at; PID 1 holds CAP_SYS_TIME.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `<linux/random.h>`: RNDADDENTROPY (`_IOW('R', 0x03, int[2])`) and RNDRESEEDCRNG
/// (`_IO('R', 0x07)`).
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Mix `bytes` (the host's randomness) into the kernel's pool, credited as entropy, and reseed
/// its CRNG at once: a restored or forked guest's next random bytes are its own, not the
/// snapshot's.
pub fn reseed_rng(bytes: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let urandom = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow its header, all
    // within `info`, which outlives the call; PID 1 holds CAP_SYS_ADMIN.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
