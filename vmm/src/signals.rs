//! The signals amvm forwards to the workload (SIGINT, SIGTERM, SIGHUP), delivered as readable
//! events on a signalfd instead of asynchronous handlers.
//!
//! [`Signals::block`] must run before the process starts any thread: the blocked mask is
//! inherited, so no thread ever takes these signals asynchronously and they all wait in the
//! signalfd for the main loop.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Signals forwarded to the workload.
pub const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// A signalfd for [`FORWARDED`].
#[derive(Debug)]
pub struct Signals {
    fd: OwnedFd,
}

impl Signals {
    /// Block [`FORWARDED`] in the calling thread (and so in every thread it starts later) and
    /// open a non-blocking signalfd that receives them.
    pub fn block() -> io::Result<Signals> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t owned by this frame.
        unsafe { libc::sigemptyset(&mut set) };
        for sig in FORWARDED {
            // SAFETY: as above; `sig` is a valid signal number.
            unsafe { libc::sigaddset(&mut set, sig) };
        }
        // SAFETY: `set` is initialised; a null old-set pointer is allowed.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // SAFETY: -1 asks for a new descriptor; `set` is initialised. The result is checked.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Signals { fd })
    }

    /// The next pending signal, if any.
    pub fn next(&self) -> io::Result<Option<libc::c_int>> {
        // SAFETY: signalfd_siginfo is plain data; all-zero is a valid value.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let want = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: `info` is a writable buffer of exactly `want` bytes for the call's duration.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut info as *mut libc::signalfd_siginfo).cast(),
                want,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        if n as usize != want {
            return Ok(None);
        }
        Ok(Some(info.ssi_signo as libc::c_int))
    }

    /// Block until a signal comes; it.
    pub fn wait(&self) -> io::Result<libc::c_int> {
        loop {
            if let Some(sig) = self.wait_until(None)? {
                return Ok(sig);
            }
        }
    }

    /// Block until a signal comes (it) or `deadline` passes (None).
    pub fn wait_until(
        &self,
        deadline: Option<std::time::Instant>,
    ) -> io::Result<Option<libc::c_int>> {
        loop {
            let timeout = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return self.next();
                    }
                    // Rounded up, so that a wake-up is never before the deadline.
                    left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll(2) on one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, timeout) } < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
                continue;
            }
            if let Some(sig) = self.next()? {
                return Ok(Some(sig));
            }
        }
    }
}

/// Unblock every signal in the calling thread: a forked child that must take the default
/// actions its parent had blocked.
pub fn unblock_all() {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame.
    unsafe { libc::sigemptyset(&mut set) };
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) };
}

impl AsRawFd for Signals {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A signal's conventional name, for messages.
pub fn name(sig: libc::c_int) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}
