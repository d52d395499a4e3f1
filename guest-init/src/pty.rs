//! A pseudo-terminal pair from /dev/ptmx, for the guest's terminal execs and the OCI runtime's
//! console on the host.

use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;

/// A new (master, slave) pair, both close-on-exec, neither becoming a controlling terminal.
/// The slave is reached through the master (TIOCGPTPEER), so no /dev/pts path is looked up.
pub fn open_pair() -> io::Result<(File, File)> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: open(2) of a literal path; the result is checked.
    let m = unsafe { libc::open(c"/dev/ptmx".as_ptr(), flags) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let master = unsafe { File::from_raw_fd(m) };
    let unlock: libc::c_int = 0;
    // SAFETY: ioctl(2) TIOCSPTLCK reads the int it is pointed at.
    if unsafe { libc::ioctl(m, libc::TIOCSPTLCK, &unlock) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ioctl(2) TIOCGPTPEER with open flags: a new descriptor for the peer, checked.
    let s = unsafe { libc::ioctl(m, libc::TIOCGPTPEER, flags) };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let slave = unsafe { File::from_raw_fd(s) };
    Ok((master, slave))
}
