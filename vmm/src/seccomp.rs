//! Per-thread seccomp filters (built with `seccompiler`): every thread of amvm installs the
//! filter of its kind before the guest runs its first instruction, and anything else it asks
//! the kernel for kills the process with a report naming the system call.
//!
//! Kinds: the main thread (`vmm`: waits for the guest, forwards signals, reaps virtiofsd), the
//! vCPU threads (`KVM_RUN` and the devices' register handlers), the vsock device's event loop
//! (guest packets, host streams, new egress connections) and the helper threads (the control
//! channel's reader and writer, stdin, virtiofsd's stderr). The lists are what each kind was
//! measured to use (`strace -f` of the test suite's scenarios, docs/threat-model.md) and nothing
//! more; ioctl is narrowed to its request numbers, socket(2) to AF_UNIX.
//!
//! Each thread also drops every capability it holds before it filters itself (jail.rs).
//!
//! Ordering: threads that exist before the guest starts install theirs as their first act and
//! count themselves in with [`Gate`]; the vCPU threads install theirs, then wait at the gate
//! until the main thread, last, has installed its own. So no guest instruction runs while any
//! thread of amvm is unfiltered.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the {0} thread's seccomp filter: {1}")]
    Build(&'static str, seccompiler::BackendError),
    #[error("compiling the {0} thread's seccomp filter: {1}")]
    Compile(&'static str, seccompiler::BackendError),
    #[error("installing the {0} thread's seccomp filter: {1}")]
    Install(&'static str, seccompiler::Error),
    #[error("installing the SIGSYS handler: {0}")]
    Handler(std::io::Error),
    #[error(transparent)]
    Jail(#[from] crate::jail::JailError),
}

/// The kinds of thread amvm has, each with its own filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    Vmm,
    Vcpu,
    EventLoop,
    /// A read-only disk's worker (virtio-blk): its queue, reads of its image, nothing else.
    Block,
    Helper,
    /// Every thread of a sandbox's supervisor (sandbox/supervisor.rs): the one host process
    /// that parses the guest's control and exec frames. One filter for the whole process,
    /// installed while it has one thread; the threads it starts later inherit it.
    Supervisor,
    /// Every thread of an `amvm run` process once its sandbox is up (sandbox/run.rs): it reads
    /// the command's frames (the guest's bytes, relayed by the supervisor), writes `--changes`
    /// from the overlay's upper layer (a tree the guest wrote) and removes the sandbox.
    Run,
}

impl ThreadKind {
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::EventLoop => "vsock event loop",
            ThreadKind::Block => "virtio-blk worker",
            ThreadKind::Helper => "helper",
            ThreadKind::Supervisor => "supervisor",
            ThreadKind::Run => "run",
        }
    }

    /// For the test-only hook `AMVM_TEST_SECCOMP_TRIP`.
    fn from_env_name(s: &str) -> Option<ThreadKind> {
        match s {
            "vmm" => Some(ThreadKind::Vmm),
            "vcpu" => Some(ThreadKind::Vcpu),
            "event-loop" => Some(ThreadKind::EventLoop),
            "block" => Some(ThreadKind::Block),
            "helper" => Some(ThreadKind::Helper),
            "supervisor" => Some(ThreadKind::Supervisor),
            "run" => Some(ThreadKind::Run),
            _ => None,
        }
    }
}

// What every thread needs: its own memory (the allocator), locks, time, signal returns, and
// ending. No file opening, no process creation, no new sockets.
const COMMON: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_close,
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // std's HashMap seeds its hasher from getrandom(2) on a thread's first map.
    libc::SYS_getrandom,
    // A panic's abort() signals the thread itself: let it report the panic, not this filter.
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_tgkill,
];

const VMM: &[i64] = &[
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    // Reaping virtiofsd on the way out (Child::kill, then wait).
    libc::SYS_kill,
    libc::SYS_wait4,
    // A snapshot (snapshot/take.rs): its two files arrive over the supervisor's channel
    // (recvmsg); the shares' backends are asked for their state over vhost-user (sendmsg,
    // recvmsg, a pipe); guest RAM is copied where it holds data (lseek's SEEK_DATA/SEEK_HOLE,
    // copy_file_range, else pread/pwrite), the files sized and synced.
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_pipe2,
    libc::SYS_lseek,
    libc::SYS_copy_file_range,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_ftruncate,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    libc::SYS_fsync,
];

const VCPU: &[i64] = &[
    // vhost-user messages to virtiofsd when the guest activates a virtio-fs device (the
    // memory table and the queues' eventfds travel as SCM_RIGHTS).
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
];

const EVENT_LOOP: &[i64] = &[
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    // Egress streams: connect(2) on the unix socket socket(2) made (narrowed below), then
    // send/recv/shutdown on the streams.
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
];

// A disk's worker: its queue's kick, kill and hold events (epoll), the image read at an offset
// (pread64) into a buffer it copies into guest RAM. It opens nothing and writes no file.
const BLOCK: &[i64] = &[libc::SYS_epoll_ctl, libc::SYS_epoll_wait, libc::SYS_pread64];

const HELPER: &[i64] = &[libc::SYS_shutdown, libc::SYS_sendto, libc::SYS_recvfrom];

// The supervisor: tokio's event loop over sockets it already has (accept4 on its two
// listeners), state.json rewritten in its state directory (open, rename, unlink; the only
// directory its root holds), the VMM waited for and killed, and the threads tokio's blocking
// pool starts (clone narrowed below; clone3 answered ENOSYS by a first filter, so glibc falls
// back to clone).
// A run: the supervisor's set but accept4 (it connects instead: socket narrowed below), and
// what writing `--changes` and removing the sandbox take: walking the upper layer without
// following symlinks (getdents64, readlink, xattrs of overlayfs' whiteouts and opaque
// directories), the layer file written, synced and renamed, the state directory and the
// scratch directory removed (chmod first: overlayfs leaves its work directory without
// permissions; umount2 detaches an `--overlay-size` tmpfs, in this process's own mount
// namespace), the supervisor killed and reaped, and the signals it forwards (signalfd).
const RUN: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_connect,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_shutdown,
    libc::SYS_openat,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_lseek,
    libc::SYS_getdents64,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_lgetxattr,
    libc::SYS_llistxattr,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_rename,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_umount2,
    libc::SYS_kill,
    libc::SYS_wait4,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getcwd,
];

const SUPERVISOR: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_openat,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_lseek,
    libc::SYS_rename,
    libc::SYS_unlink,
    libc::SYS_kill,
    libc::SYS_wait4,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
];

// ioctl request numbers, narrowed per kind (arg 1). From <linux/kvm.h>.
const KVM_RUN: u64 = 0xae80;
const KVM_GET_REGS: u64 = 0x8090_ae81;
const KVM_KVMCLOCK_CTRL: u64 = 0xaead;

/// `_IOR(KVMIO, nr, T)` and `_IOWR(KVMIO, nr, T)` of <linux/ioctl.h>, from the struct's size.
const fn kvm_ior<T>(nr: u64) -> u64 {
    (2 << 30) | ((std::mem::size_of::<T>() as u64) << 16) | (0xae << 8) | nr
}
const fn kvm_iowr<T>(nr: u64) -> u64 {
    (3 << 30) | ((std::mem::size_of::<T>() as u64) << 16) | (0xae << 8) | nr
}

/// What a parked vCPU reads to save its state for a snapshot (vcpu.rs `save_state`): reads
/// only, of the vCPU's own state.
/// What the VMM's main thread reads of the VM for a snapshot (vm.rs `save_state`).
const VM_SAVE_IOCTLS: &[u64] = &[
    kvm_ior::<kvm_bindings::kvm_pit_state2>(0x9f),
    kvm_ior::<kvm_bindings::kvm_clock_data>(0x7c),
    kvm_iowr::<kvm_bindings::kvm_irqchip>(0x62),
];

const VCPU_SAVE_IOCTLS: &[u64] = &[
    kvm_ior::<kvm_bindings::kvm_mp_state>(0x98),
    kvm_ior::<kvm_bindings::kvm_sregs>(0x83),
    kvm_ior::<kvm_bindings::kvm_xsave>(0xa4),
    kvm_ior::<kvm_bindings::kvm_xcrs>(0xa6),
    kvm_ior::<kvm_bindings::kvm_debugregs>(0xa1),
    kvm_ior::<kvm_bindings::kvm_lapic_state>(0x8e),
    kvm_iowr::<kvm_bindings::kvm_cpuid2>(0x91),
    kvm_iowr::<kvm_bindings::kvm_msrs>(0x88),
    kvm_ior::<kvm_bindings::kvm_vcpu_events>(0x9f),
];

fn cond(arg: u8, value: u64) -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        value,
    )?])
}

/// socket(2) for a unix stream socket (any flags), nothing else.
fn unix_stream_socket() -> Result<SeccompRule, seccompiler::BackendError> {
    SeccompRule::new(vec![
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            libc::AF_UNIX as u64,
        )?,
        SeccompCondition::new(
            1,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(0xf),
            libc::SOCK_STREAM as u64,
        )?,
    ])
}

fn rules(kind: ThreadKind) -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    let extra = match kind {
        ThreadKind::Vmm => VMM,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::EventLoop => EVENT_LOOP,
        ThreadKind::Block => BLOCK,
        ThreadKind::Helper => HELPER,
        ThreadKind::Supervisor => SUPERVISOR,
        ThreadKind::Run => RUN,
    };
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = COMMON
        .iter()
        .chain(extra)
        .map(|&nr| (nr, Vec::new()))
        .collect();
    // fcntl: std checks a descriptor with F_GETFD before closing it; try_clone() of an fd is
    // F_DUPFD_CLOEXEC (the vCPU hands eventfds to virtiofsd that way).
    map.insert(
        libc::SYS_fcntl,
        vec![
            cond(1, libc::F_GETFD as u64)?,
            cond(1, libc::F_DUPFD_CLOEXEC as u64)?,
        ],
    );
    match kind {
        ThreadKind::Vcpu => {
            map.insert(
                libc::SYS_ioctl,
                // KVM_RUN; the registers for a crash report; a parked vCPU tells the guest's
                // kvmclock it was stopped, and reads its own state for a snapshot (pause.rs).
                [KVM_RUN, KVM_GET_REGS, KVM_KVMCLOCK_CTRL]
                    .iter()
                    .chain(VCPU_SAVE_IOCTLS)
                    .map(|&nr| cond(1, nr))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        ThreadKind::EventLoop => {
            // A new egress stream: a unix socket, made non-blocking.
            map.insert(libc::SYS_socket, vec![unix_stream_socket()?]);
            map.insert(libc::SYS_ioctl, vec![cond(1, libc::FIONBIO)?]);
        }
        ThreadKind::Supervisor | ThreadKind::Run => {
            // A new thread only (CLONE_THREAD set): never a new process.
            map.insert(
                libc::SYS_clone,
                vec![SeccompRule::new(vec![SeccompCondition::new(
                    0,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
                    libc::CLONE_THREAD as u64,
                )?])?],
            );
            // glibc's first pthread_create installs its handlers for SIGCANCEL and SIGSETXID
            // (SIGRTMIN and SIGRTMIN+1): no other signal's action may change.
            map.insert(libc::SYS_rt_sigaction, vec![cond(0, 32)?, cond(0, 33)?]);
            // A thread's name (std names tokio's workers) and nothing else of prctl.
            map.insert(libc::SYS_prctl, vec![cond(0, libc::PR_SET_NAME as u64)?]);
            map.insert(
                libc::SYS_fcntl,
                vec![
                    cond(1, libc::F_GETFD as u64)?,
                    cond(1, libc::F_DUPFD_CLOEXEC as u64)?,
                    cond(1, libc::F_GETFL as u64)?,
                    cond(1, libc::F_SETFL as u64)?,
                    // std's read_dir marks its directory descriptor close-on-exec (a run's
                    // walk of the upper layer).
                    cond(1, libc::F_SETFD as u64)?,
                ],
            );
            if kind == ThreadKind::Supervisor {
                map.insert(libc::SYS_ioctl, vec![cond(1, libc::FIONBIO)?]);
            } else {
                // The caller's terminal: its size (kept up to date for -t), raw mode and back.
                map.insert(
                    libc::SYS_ioctl,
                    vec![
                        cond(1, libc::FIONBIO)?,
                        cond(1, libc::TIOCGWINSZ)?,
                        cond(1, libc::TCGETS)?,
                        cond(1, libc::TCSETS)?,
                        cond(1, libc::TCSETSW)?,
                        cond(1, libc::TCSETSF)?,
                    ],
                );
                // The API socket: a unix stream socket, nothing else.
                map.insert(libc::SYS_socket, vec![unix_stream_socket()?]);
            }
        }
        ThreadKind::Vmm => {
            map.insert(
                libc::SYS_ioctl,
                VM_SAVE_IOCTLS
                    .iter()
                    .map(|&nr| cond(1, nr))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        ThreadKind::Helper | ThreadKind::Block => {}
    }
    Ok(map)
}

/// The compiled filter for `kind`. `audit`: log what the filter would refuse instead of
/// refusing it (AMVM_SECCOMP_AUDIT=1, for measuring the lists; never the default).
pub fn program(kind: ThreadKind, audit: bool) -> Result<BpfProgram, SeccompError> {
    let mismatch = if audit {
        SeccompAction::Log
    } else {
        SeccompAction::Trap
    };
    let filter = SeccompFilter::new(
        rules(kind).map_err(|e| SeccompError::Build(kind.name(), e))?,
        mismatch,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| SeccompError::Build(kind.name(), e))?;
    filter
        .try_into()
        .map_err(|e| SeccompError::Compile(kind.name(), e))
}

thread_local! {
    // The kind this thread filtered itself as, for the SIGSYS report. Const-initialized: reading
    // it in the signal handler allocates nothing and takes no lock.
    static KIND: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

/// How amvm filters its threads: on (the default), audit-only, or off (`--no-seccomp`).
#[derive(Clone, Debug)]
pub struct Policy {
    enabled: bool,
    audit: bool,
    trip: Option<ThreadKind>,
    gate: Arc<Gate>,
}

impl Policy {
    /// `enabled`: false for `--no-seccomp`. Installs the SIGSYS handler when enabled.
    pub fn new(enabled: bool) -> Result<Policy, SeccompError> {
        let audit = std::env::var_os("AMVM_SECCOMP_AUDIT").is_some_and(|v| v == "1");
        let trip = std::env::var("AMVM_TEST_SECCOMP_TRIP")
            .ok()
            .and_then(|s| ThreadKind::from_env_name(&s));
        if enabled {
            install_sigsys_handler().map_err(SeccompError::Handler)?;
        }
        Ok(Policy {
            enabled,
            audit,
            trip,
            gate: Arc::new(Gate::default()),
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Filter the calling thread as `kind`. With the test-only hook `AMVM_TEST_SECCOMP_TRIP=KIND`
    /// the first thread of that kind then makes a forbidden call (ptrace), to show the report.
    pub fn apply(&self, kind: ThreadKind) -> Result<(), SeccompError> {
        KIND.with(|k| k.set(Some(kind)));
        // Capabilities are per thread: each one gives up its own (a no-op when already none).
        crate::jail::drop_capabilities()?;
        if !self.enabled {
            return Ok(());
        }
        let prog = program(kind, self.audit)?;
        seccompiler::apply_filter(&prog).map_err(|e| SeccompError::Install(kind.name(), e))?;
        if self.trip == Some(kind) {
            // SAFETY: a ptrace(PTRACE_TRACEME) attempt with no pointers; the filter traps it.
            unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
        }
        Ok(())
    }

    /// For a thread that exists before the guest starts: filter it and count it in. A thread
    /// that cannot be filtered stops the process (it must not run unfiltered beside a guest).
    pub fn enter(&self, kind: ThreadKind) {
        if let Err(e) = self.apply(kind) {
            fatal(&e);
        }
        self.gate.arrived();
    }

    /// Count a thread that [`Policy::enter`] will count in (call before spawning it).
    pub fn expect_thread(&self) {
        self.gate.expect();
    }

    /// Undo [`Policy::expect_thread`] for a thread that could not be spawned.
    pub fn forget_thread(&self) {
        self.gate.forget();
    }

    /// The main thread, last: wait until every expected thread has filtered itself, filter
    /// this one, and let the vCPUs run.
    pub fn seal(&self) -> Result<(), SeccompError> {
        self.gate.wait_arrivals();
        let r = self.apply(ThreadKind::Vmm);
        self.gate.open();
        r
    }

    /// A vCPU thread: filter it, then wait until the main thread has sealed.
    pub fn enter_vcpu(&self) {
        if let Err(e) = self.apply(ThreadKind::Vcpu) {
            fatal(&e);
        }
        self.gate.wait_open();
    }
}

/// Filter this whole process as `kind` (a supervisor's or a run's): call while it has one
/// thread (every thread it starts later inherits the filters). Capabilities go first (they are
/// per thread). Two filters: the first answers clone3(2) with ENOSYS, whose flags a filter
/// cannot see, so that glibc starts threads with clone(2), whose flags the second, the
/// allow-list, checks (the stricter action of the two wins: clone3 is allowed by the second
/// only to reach the first's ENOSYS). `enabled`: false for `--no-seccomp`. A supervisor also
/// gives up every capability; a run keeps them (below).
pub fn confine_process(kind: ThreadKind, enabled: bool) -> Result<(), SeccompError> {
    KIND.with(|k| k.set(Some(kind)));
    // A run keeps root's capabilities where it has them: the upper layer it writes out and
    // removes holds what the guest's users made (their owners and modes), and detaching an
    // `--overlay-size` tmpfs takes CAP_SYS_ADMIN (in its own mount namespace).
    if kind != ThreadKind::Run {
        crate::jail::drop_capabilities()?;
    }
    if !enabled {
        return Ok(());
    }
    install_sigsys_handler().map_err(SeccompError::Handler)?;
    let no_clone3: BpfProgram = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| SeccompError::Build(kind.name(), e))?
    .try_into()
    .map_err(|e| SeccompError::Compile(kind.name(), e))?;
    let audit = std::env::var_os("AMVM_SECCOMP_AUDIT").is_some_and(|v| v == "1");
    let prog = program(kind, audit)?;
    seccompiler::apply_filter(&no_clone3).map_err(|e| SeccompError::Install(kind.name(), e))?;
    seccompiler::apply_filter(&prog).map_err(|e| SeccompError::Install(kind.name(), e))?;
    let trip = std::env::var("AMVM_TEST_SECCOMP_TRIP").ok();
    if trip.as_deref().and_then(ThreadKind::from_env_name) == Some(kind) {
        // SAFETY: a ptrace(PTRACE_TRACEME) attempt with no pointers; the filter traps it.
        unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
    }
    Ok(())
}

fn fatal(e: &SeccompError) -> ! {
    eprintln!("amvm: {e}");
    std::process::exit(i32::from(crate::exit::AMVM_FAILURE));
}

/// Counts the threads that filter themselves, and holds the vCPUs until all have.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    expected: usize,
    arrived: usize,
    open: bool,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn expect(&self) {
        self.lock().expected += 1;
    }
    fn forget(&self) {
        let mut s = self.lock();
        s.expected = s.expected.saturating_sub(1);
        drop(s);
        self.changed.notify_all();
    }
    fn arrived(&self) {
        self.lock().arrived += 1;
        self.changed.notify_all();
    }
    fn wait_arrivals(&self) {
        let mut s = self.lock();
        while s.arrived < s.expected {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
    fn open(&self) {
        self.lock().open = true;
        self.changed.notify_all();
    }
    fn wait_open(&self) {
        let mut s = self.lock();
        while !s.open {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

include!(concat!(env!("OUT_DIR"), "/syscall_names.rs"));

/// The name of x86_64 system call `nr`, from the kernel headers amvm was built with.
pub fn syscall_name(nr: i64) -> Option<&'static str> {
    SYSCALL_NAMES
        .binary_search_by_key(&nr, |&(n, _)| n)
        .ok()
        .map(|i| SYSCALL_NAMES[i].1)
}

fn install_sigsys_handler() -> std::io::Result<()> {
    // SAFETY: sigaction is plain data; all zeroes is "no flags, empty mask, SIG_DFL".
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_sigsys as *const () as usize;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: installs `on_sigsys`, which only makes async-signal-safe calls, for SIGSYS.
    if unsafe { libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A small buffer on the stack for the report (no allocation in a signal handler).
struct Msg {
    buf: [u8; 256],
    len: usize,
}

impl Msg {
    fn push(&mut self, s: &[u8]) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }
    fn push_num(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

/// SIGSYS from the filter: name the thread kind and the system call, then end the process with
/// amvm's failure status. Only write(2) and exit_group(2), which every filter allows.
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // The kernel's siginfo for SIGSYS (`_sigsys`): after si_signo, si_errno, si_code (3 ints
    // and 4 bytes of padding) come `void *_call_addr` at 16 and `int _syscall` at 24.
    // SAFETY: `info` is the kernel's siginfo for this signal (SA_SIGINFO), at least 128 bytes;
    // offset 24 holds the 4-byte syscall number for SIGSYS.
    let at = (info as *const u8).wrapping_add(24) as *const i32;
    // SAFETY: see above: `at` is inside the kernel's siginfo, 4 readable bytes.
    let nr = unsafe { std::ptr::read_unaligned(at) };
    let kind = KIND
        .with(|k| k.get())
        .map_or("unfiltered", ThreadKind::name);
    let mut m = Msg {
        buf: [0; 256],
        len: 0,
    };
    m.push(b"amvm: seccomp: the ");
    m.push(kind.as_bytes());
    m.push(b" thread made a forbidden system call: ");
    match syscall_name(i64::from(nr)) {
        Some(name) => m.push(name.as_bytes()),
        None => m.push(b"unknown"),
    }
    m.push(b" (");
    m.push_num(nr as u64);
    m.push(b"); amvm stopped the VM (--no-seccomp turns the filters off, for debugging only)\n");
    // SAFETY: write(2) of our own stack buffer: async-signal-safe.
    unsafe { libc::write(2, m.buf.as_ptr().cast(), m.len) };
    // SAFETY: exit_group(2) ends the process; nothing runs after it.
    unsafe { libc::syscall(libc::SYS_exit_group, i32::from(crate::exit::AMVM_FAILURE)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers computed from the structs' sizes are the kernel's (<linux/kvm.h>).
    #[test]
    fn vcpu_save_ioctl_numbers_are_the_kernels() {
        assert_eq!(kvm_ior::<kvm_bindings::kvm_regs>(0x81), KVM_GET_REGS);
        assert_eq!(
            VM_SAVE_IOCTLS,
            &[
                0x8070_ae9f, // KVM_GET_PIT2
                0x8030_ae7c, // KVM_GET_CLOCK
                0xc208_ae62, // KVM_GET_IRQCHIP
            ]
        );
        assert_eq!(
            VCPU_SAVE_IOCTLS,
            &[
                0x8004_ae98, // KVM_GET_MP_STATE
                0x8138_ae83, // KVM_GET_SREGS
                0x9000_aea4, // KVM_GET_XSAVE
                0x8188_aea6, // KVM_GET_XCRS
                0x8080_aea1, // KVM_GET_DEBUGREGS
                0x8400_ae8e, // KVM_GET_LAPIC
                0xc008_ae91, // KVM_GET_CPUID2
                0xc008_ae88, // KVM_GET_MSRS
                0x8040_ae9f, // KVM_GET_VCPU_EVENTS
            ]
        );
    }

    #[test]
    fn every_kind_compiles() {
        for kind in [
            ThreadKind::Vmm,
            ThreadKind::Vcpu,
            ThreadKind::EventLoop,
            ThreadKind::Block,
            ThreadKind::Helper,
            ThreadKind::Supervisor,
            ThreadKind::Run,
        ] {
            let p = program(kind, false).unwrap();
            assert!(p.len() > 10, "{kind:?}: {} instructions", p.len());
        }
    }

    #[test]
    fn syscall_names_come_from_the_headers() {
        assert_eq!(syscall_name(libc::SYS_read), Some("read"));
        assert_eq!(syscall_name(libc::SYS_ptrace), Some("ptrace"));
        assert_eq!(
            syscall_name(libc::SYS_io_uring_setup),
            Some("io_uring_setup")
        );
        assert_eq!(syscall_name(100_000), None);
        assert!(SYSCALL_NAMES.windows(2).all(|w| w[0].0 < w[1].0));
    }

    /// A filtered thread may do what its list says and is refused the rest: run in a forked
    /// child (a filter cannot be removed), with the trap turned into an exit status.
    #[test]
    fn a_forbidden_call_is_trapped_and_named() {
        // SAFETY: fork in a test; the child only installs a filter, makes syscalls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let policy = Policy {
                enabled: true,
                audit: false,
                trip: None,
                gate: Arc::default(),
            };
            if install_sigsys_handler().is_err() || policy.apply(ThreadKind::Helper).is_err() {
                // SAFETY: ending the forked child.
                unsafe { libc::_exit(3) };
            }
            // Allowed: write. Forbidden for a helper: getppid.
            // SAFETY: a zero-length write.
            unsafe { libc::write(1, std::ptr::null(), 0) };
            // SAFETY: a syscall without arguments.
            unsafe { libc::syscall(libc::SYS_getppid) };
            // SAFETY: ending the forked child.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 125, "the SIGSYS handler's exit");
    }
}
