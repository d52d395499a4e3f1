//! [`WorkerHold`]: how a snapshot stops a device's worker thread, and lets it go.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// Stops a device's worker between two passes of its loop and lets it go again, for a snapshot:
/// while held it touches neither guest memory nor the queues (the guest is paused too), so what
/// it had done is all in guest memory. The vsock worker's host streams wait in their sockets
/// meanwhile; the virtio-fs relay (`fs_relay.rs`) first lets the requests it forwarded finish.
#[derive(Debug, Clone)]
pub struct WorkerHold {
    inner: Arc<HoldInner>,
}

#[derive(Debug)]
struct HoldInner {
    /// (hold asked for, the worker is held)
    state: std::sync::Mutex<(bool, bool)>,
    changed: std::sync::Condvar,
    wake: EventFd,
    /// The worker has its queues (the device was activated); before that it touches nothing.
    active: std::sync::atomic::AtomicBool,
}

impl WorkerHold {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(WorkerHold {
            inner: Arc::new(HoldInner {
                state: std::sync::Mutex::new((false, false)),
                changed: std::sync::Condvar::new(),
                wake: EventFd::new(libc::EFD_NONBLOCK)?,
                active: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (bool, bool)> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold the worker; returns once it is held (at once if it never started), or fails after
    /// `limit` (and lets it go).
    pub fn hold(&self, limit: std::time::Duration) -> io::Result<()> {
        if !self.inner.active.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let mut s = self.lock();
        s.0 = true;
        self.inner.wake.write(1)?;
        let deadline = std::time::Instant::now() + limit;
        while !s.1 {
            let now = std::time::Instant::now();
            if now >= deadline {
                s.0 = false;
                self.inner.changed.notify_all();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the device's worker did not stop within {limit:?}"),
                ));
            }
            s = self
                .inner
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// Let the worker go on.
    pub fn release(&self) {
        self.lock().0 = false;
        self.inner.changed.notify_all();
    }

    /// The worker's side: if a hold is asked for, stay here until released.
    pub(crate) fn wait_if_held(&self) {
        let _ = self.inner.wake.read();
        let mut s = self.lock();
        if !s.0 {
            return;
        }
        s.1 = true;
        self.inner.changed.notify_all();
        while s.0 {
            s = self
                .inner
                .changed
                .wait(s)
                .unwrap_or_else(|p| p.into_inner());
        }
        s.1 = false;
        self.inner.changed.notify_all();
    }
}

impl WorkerHold {
    /// The event fd the worker polls: readable when a hold is asked for.
    pub(crate) fn wake_fd(&self) -> RawFd {
        self.inner.wake.as_raw_fd()
    }

    /// The worker has its queues: from now on a hold waits for it.
    pub(crate) fn set_active(&self) {
        self.inner
            .active
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The worker's side, for a worker that must finish something before it stops: whether a
    /// hold is asked for (the wake-up is consumed).
    pub(crate) fn requested(&self) -> bool {
        let _ = self.inner.wake.read();
        self.lock().0
    }
}
