//! `--console-socket`: a pseudo-terminal on the host whose master goes to the engine (over the
//! unix socket, SCM_RIGHTS, as runc sends it) and whose slave is the container process's stdio;
//! the exec in the guest gets a terminal of its own, and amvm copies between the two in raw mode.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

pub struct Pty {
    pub master: File,
    slave: File,
}

impl Pty {
    /// A new pair from /dev/ptmx.
    pub fn open() -> io::Result<Pty> {
        let (master, slave) = guest_init::pty::open_pair()?;
        Ok(Pty { master, slave })
    }

    /// Make the slave this process's controlling terminal and its stdin, stdout and stderr
    /// (in a session of its own); the master is closed here (the engine holds it).
    pub fn make_stdio(self) -> io::Result<()> {
        drop(self.master);
        let fd = self.slave.as_raw_fd();
        // SAFETY: setsid(2) takes nothing (failing only for a group leader, which a forked
        // child is not).
        unsafe { libc::setsid() };
        // SAFETY: ioctl(2) TIOCSCTTY on a descriptor we hold, with an integer argument.
        if unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        for target in 0..3 {
            // SAFETY: dup2(2) from a descriptor we hold onto a standard one.
            if unsafe { libc::dup2(fd, target) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Send `master` to the engine listening on `socket`, as runc does: one message whose data is
/// the terminal's name and whose SCM_RIGHTS control message carries the descriptor.
pub fn send_master(socket: &Path, master: &File) -> io::Result<()> {
    let sock = std::os::unix::net::UnixStream::connect(socket)?;
    let name = b"/dev/ptmx";
    let mut iov = libc::iovec {
        iov_base: name.as_ptr() as *mut libc::c_void,
        iov_len: name.len(),
    };
    // SAFETY: CMSG_SPACE computes a size from a constant.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is plain data; all-zero is valid before the fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer is CMSG_SPACE(int) bytes and set in `msg`, so its first header
    // exists (CMSG_FIRSTHDR is then not null) and has room for one int.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    let header = libc::cmsghdr {
        // SAFETY: CMSG_LEN computes a size from a constant.
        cmsg_len: unsafe { libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) } as usize,
        cmsg_level: libc::SOL_SOCKET,
        cmsg_type: libc::SCM_RIGHTS,
    };
    // SAFETY: `cmsg` points at the start of `control`, which holds a header (see above).
    unsafe { std::ptr::write_unaligned(cmsg, header) };
    // SAFETY: CMSG_DATA of that header points inside `control`, with room for one int.
    let data = unsafe { libc::CMSG_DATA(cmsg) };
    // SAFETY: as above.
    unsafe { std::ptr::write_unaligned(data.cast::<libc::c_int>(), master.as_raw_fd()) };
    // SAFETY: sendmsg(2) with the message built above, whose buffers outlive the call.
    if unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
