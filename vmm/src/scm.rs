//! Descriptors passed over unix sockets (SCM_RIGHTS): `amvm snapshot` hands the files it made
//! to the sandbox's supervisor, which hands them to its VMM (vmmctl.rs). Neither can open
//! them itself: each lives in a root of its own (jail.rs).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// At most this many descriptors travel with one message.
pub const MAX_FDS: usize = 4;

/// Send `data` (at least one byte) with `fds` on the stream socket `sock`. Returns the bytes
/// sent (the descriptors go with the first of them).
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if data.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let fd_bytes = std::mem::size_of_val(fds);
    // Room for one control message of up to MAX_FDS descriptors, aligned for cmsghdr.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is "no name, no control" and is filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE computes a size from a length; no memory is touched.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        // SAFETY: msg_control points at `control` (64 bytes, 8-aligned), which holds
        // CMSG_SPACE(4 * 4) = 32 bytes, so the first header is inside it.
        let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: CMSG_LEN computes a size from a length; no memory is touched.
        let cmsg_len = unsafe { libc::CMSG_LEN(fd_bytes as u32) } as usize;
        // SAFETY: `cmsg` points into `control` (above), aligned for a cmsghdr, and nothing
        // else refers to it while this reference lives.
        let header = unsafe { &mut *cmsg };
        header.cmsg_level = libc::SOL_SOCKET;
        header.cmsg_type = libc::SCM_RIGHTS;
        header.cmsg_len = cmsg_len;
        // SAFETY: the data of the header above, inside `control`.
        let data = unsafe { libc::CMSG_DATA(cmsg) };
        // SAFETY: that data has room for `fds` (CMSG_SPACE above); the copy does not overlap
        // (`fds` is the caller's slice).
        unsafe { std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), data, fd_bytes) };
    }
    // SAFETY: sendmsg(2) with a message whose pointers (iov, control) all point at live
    // buffers of this frame; MSG_NOSIGNAL: a gone peer is EPIPE, not SIGPIPE.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receive into `buf` from the stream socket `sock`, with the descriptors that came with
/// those bytes (close-on-exec; at most MAX_FDS: a message with more is refused, and all of
/// them closed).
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as in `send_with_fds`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: recvmsg(2) into `buf` and `control`, both live buffers of the sizes given.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by the kernel; CMSG_FIRSTHDR reads its control fields.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a header the kernel wrote inside `control`, aligned; read only.
        let header = unsafe { &*cmsg };
        let (level, kind, len) = (header.cmsg_level, header.cmsg_type, header.cmsg_len);
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN computes a size; no memory is touched.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / std::mem::size_of::<RawFd>();
            // SAFETY: the header's data holds `count` descriptors, inside `control`.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count` (above): inside the header's data.
                let at = unsafe { data.add(i) };
                // SAFETY: a descriptor's bytes inside `control`; read unaligned: CMSG_DATA
                // need not be aligned for RawFd on every ABI.
                let fd = unsafe { at.read_unaligned() };
                // SAFETY: a descriptor the kernel just installed in this process for us.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: the next header after `cmsg` within `msg`'s control buffer, or null.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
        // The descriptors that did arrive close here.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("more than {MAX_FDS} descriptors came with one message"),
        ));
    }
    Ok((n as usize, fds))
}

/// `recv_with_fds` on anything with a descriptor.
pub fn recv(sock: &impl AsRawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    recv_with_fds(sock.as_raw_fd(), buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn files_travel_with_the_bytes_and_too_many_are_refused() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut f = tempfile();
        f.write_all(b"through the socket").unwrap();
        let n = send_with_fds(a.as_raw_fd(), b"S", &[f.as_raw_fd(), f.as_raw_fd()]).unwrap();
        assert_eq!(n, 1);
        let mut buf = [0u8; 8];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!((n, &buf[..1], fds.len()), (1, &b"S"[..], 2));
        let mut got = std::fs::File::from(fds.into_iter().next().unwrap());
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through the socket");
        // Close-on-exec, as every descriptor amvm holds.
        // SAFETY: fcntl(2) F_GETFD on an open descriptor.
        let flags = unsafe { libc::fcntl(got.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        // Plain bytes: no descriptors.
        (&a).write_all(b"xy").unwrap();
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!((n, fds.len()), (2, 0));
        assert!(send_with_fds(a.as_raw_fd(), b"S", &[0; 5]).is_err());
        assert!(send_with_fds(a.as_raw_fd(), b"", &[]).is_err());
    }

    fn tempfile() -> std::fs::File {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("amvm-scm-{}", std::process::id()));
        let f = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }
}
