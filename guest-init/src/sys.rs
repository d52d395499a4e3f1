//! The few raw system calls guest-init needs that std does not wrap.

use std::ffi::CString;
use std::io;

/// mount(2) with no data.
pub fn mount(source: &str, target: &str, fstype: &str, flags: libc::c_ulong) -> io::Result<()> {
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (src, tgt, fst) = (c(source)?, c(target)?, c(fstype)?);
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; data is NULL.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
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
