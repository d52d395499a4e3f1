//! Pausing the guest: every vCPU thread out of KVM_RUN and parked, then let go again
//! (`amvm pause` / `amvm resume`).
//!
//! A vCPU thread checks the gate before each KVM_RUN. To stop one that is inside KVM_RUN (an
//! idle guest sits there in HLT for as long as it likes), the pauser sends the thread
//! [`kick_signal`], whose handler does nothing: KVM_RUN returns EINTR and the thread reaches
//! the gate. A kick that lands between the thread's check and its KVM_RUN is lost, so the
//! pauser repeats the kick until every live vCPU has parked (Cloud Hypervisor's approach;
//! Firecracker's sets `immediate_exit` from the handler instead).

use super::vcpu::VcpuState;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("installing the vCPU kick signal's handler: {0}")]
    Handler(std::io::Error),
    #[error("{parked} of {live} vCPUs stopped within {waited:?}")]
    Stuck {
        parked: usize,
        live: usize,
        waited: Duration,
    },
    #[error("the vCPUs are not paused")]
    NotPaused,
    #[error("{answered} of {live} vCPUs saved their state within {waited:?}")]
    SaveStuck {
        answered: usize,
        live: usize,
        waited: Duration,
    },
    #[error("{0}")]
    Save(String),
}

/// The real-time signal that interrupts a vCPU's KVM_RUN: the first one glibc leaves to
/// applications (it keeps 32 and 33 for itself).
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

extern "C" fn on_kick(_sig: libc::c_int) {}

/// Install the kick signal's (empty) handler, without SA_RESTART so that KVM_RUN returns
/// EINTR. Once per process, before the seccomp filters (they refuse rt_sigaction).
pub fn install_kick_handler() -> Result<(), PauseError> {
    // SAFETY: sigaction is plain data; zeroed is a valid "no flags, empty mask" value.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_kick as extern "C" fn(libc::c_int) as usize;
    // SAFETY: `act` is initialised; a null old-action pointer is allowed.
    let r = unsafe { libc::sigaction(kick_signal(), &act, std::ptr::null_mut()) };
    if r != 0 {
        return Err(PauseError::Handler(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[derive(Debug, Default)]
struct State {
    /// Pause asked for: vCPU threads park at their next gate.
    paused: bool,
    /// Kernel thread ids of the vCPU threads still running the guest (a thread removes its
    /// own before it ends, under the lock, so a kick never reaches a reused id).
    live: Vec<libc::pid_t>,
    parked: usize,
    /// A request to every parked vCPU to save its state (a snapshot's): its number, and each
    /// vCPU's answer by id.
    save_round: u64,
    saved: std::collections::BTreeMap<u8, Result<VcpuState, String>>,
}

/// Shared by the vCPU threads and whoever pauses them.
#[derive(Debug, Default)]
pub struct Pauser {
    state: Mutex<State>,
    changed: Condvar,
}

impl Pauser {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A vCPU thread starts: it may be kicked from now on.
    pub fn enter(&self) {
        // SAFETY: gettid(2) takes nothing and cannot fail.
        let tid = unsafe { libc::gettid() };
        self.lock().live.push(tid);
    }

    /// A vCPU thread ends (the guest stopped): nothing waits for it to park any more.
    pub fn leave(&self) {
        // SAFETY: as in `enter`.
        let tid = unsafe { libc::gettid() };
        self.lock().live.retain(|&t| t != tid);
        self.changed.notify_all();
    }

    /// Called by vCPU `id`'s thread between KVM_RUNs: returns at once unless a pause is asked
    /// for, else parks until resumed. `on_park` runs once parked (KVM_KVMCLOCK_CTRL: the
    /// guest's watchdogs are told the time it spends stopped is not a hang); `save` whenever
    /// [`Pauser::save_states`] asks, while parked (the vCPU's own thread reads its state: it
    /// owns the vCPU, and it is out of KVM_RUN).
    pub fn gate(
        &self,
        id: u8,
        on_park: impl FnOnce(),
        mut save: impl FnMut() -> Result<VcpuState, String>,
    ) {
        let mut s = self.lock();
        if !s.paused {
            return;
        }
        on_park();
        s.parked += 1;
        let mut round = s.save_round;
        self.changed.notify_all();
        while s.paused {
            if s.save_round != round {
                round = s.save_round;
                let state = save();
                s.saved.insert(id, state);
                self.changed.notify_all();
                continue;
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.parked -= 1;
        self.changed.notify_all();
    }

    /// Every live vCPU's state, saved by its own parked thread, in id order. The vCPUs must be
    /// paused ([`Pauser::pause`]) and stay so.
    pub fn save_states(&self, limit: Duration) -> Result<Vec<VcpuState>, PauseError> {
        let start = Instant::now();
        let mut s = self.lock();
        if !s.paused || s.parked < s.live.len() {
            return Err(PauseError::NotPaused);
        }
        s.save_round += 1;
        s.saved.clear();
        self.changed.notify_all();
        while s.saved.len() < s.live.len() {
            let waited = start.elapsed();
            if waited >= limit {
                return Err(PauseError::SaveStuck {
                    answered: s.saved.len(),
                    live: s.live.len(),
                    waited,
                });
            }
            s = self
                .changed
                .wait_timeout(s, limit - waited)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        std::mem::take(&mut s.saved)
            .into_values()
            .map(|r| r.map_err(PauseError::Save))
            .collect()
    }

    /// Stop every vCPU; returns once each live one has parked, or fails after `limit` (the
    /// vCPUs are then let go again).
    pub fn pause(&self, limit: Duration) -> Result<(), PauseError> {
        let start = Instant::now();
        let mut s = self.lock();
        s.paused = true;
        loop {
            if s.parked >= s.live.len() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= limit {
                let (parked, live) = (s.parked, s.live.len());
                s.paused = false;
                self.changed.notify_all();
                return Err(PauseError::Stuck {
                    parked,
                    live,
                    waited,
                });
            }
            // SAFETY: getpid(2) takes nothing.
            let pid = unsafe { libc::getpid() };
            for &tid in &s.live {
                // SAFETY: tgkill(2) of a thread of this process that is alive (it is in `live`,
                // and leaves it under this lock before it ends). A parked thread ignores it.
                unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, kick_signal()) };
            }
            s = self
                .changed
                .wait_timeout(s, Duration::from_millis(2))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Let the vCPUs run again.
    pub fn resume(&self) {
        self.lock().paused = false;
        self.changed.notify_all();
    }

    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Threads that block in a syscall a signal interrupts (as KVM_RUN is) park when asked,
    /// make no progress while parked, and go on after resume.
    #[test]
    fn blocked_threads_are_kicked_parked_and_let_go() {
        install_kick_handler().unwrap();
        let p = Arc::new(Pauser::default());
        let progress = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for _ in 0..3 {
            let (p, progress) = (p.clone(), progress.clone());
            threads.push(std::thread::spawn(move || {
                p.enter();
                for _ in 0..400 {
                    p.gate(0, || {}, || Err("not asked".into()));
                    // Stands in for KVM_RUN: a blocking call the kick interrupts (EINTR).
                    // SAFETY: poll(2) of no descriptors: a 5 ms sleep.
                    unsafe { libc::poll(std::ptr::null_mut(), 0, 5) };
                    progress.fetch_add(1, Ordering::SeqCst);
                }
                p.leave();
            }));
        }
        std::thread::sleep(Duration::from_millis(30));
        p.pause(Duration::from_secs(5)).unwrap();
        let at = progress.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(progress.load(Ordering::SeqCst), at, "a parked thread ran");
        assert!(p.is_paused());
        p.resume();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(progress.load(Ordering::SeqCst), 1200);
        // With no live vCPU a pause is immediate.
        p.pause(Duration::from_millis(1)).unwrap();
    }
}
