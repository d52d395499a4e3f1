//! The workload's confinement inside the guest.
//!
//! [`Cgroup`]: the workload lives in its own cgroup v2, `/sys/fs/cgroup/workload`, whose
//! `pids.max` bounds its tasks (a fork bomb stops there) and whose `memory.events` tells an
//! out-of-memory kill apart from any other SIGKILL.
//!
//! [`Confinement::enter`], between fork and exec, as root: join that cgroup; give up
//! supplementary groups; for a non-root user drop every capability from the bounding set and
//! switch to the user (which clears the rest); lead a new session; set `no_new_privs`; then
//! install a seccomp filter that refuses with EPERM the system calls a workload has no business
//! making here:
//! * `socket(AF_VSOCK, ...)`: the egress goes through guest-init's relay, nothing else reaches
//!   the host;
//! * io_uring, eBPF, perf events, userfaultfd: large kernel attack surface no workload needs here;
//! * kexec and module loading;
//! * `ptrace` and `process_vm_readv`/`process_vm_writev` aimed at guest-init (PID 1).
//!
//! Other system-call ABIs (i386 `int 0x80`, x32) are refused whole, so the list cannot be
//! sidestepped through another syscall table. `--user 0:0` keeps root's capabilities (the VM is
//! the boundary) and everything else here.
//!
//! The program is classic BPF over `struct seccomp_data` (include/uapi/linux/seccomp.h):
//! `nr` at offset 0, `arch` at 4, `args[i]` at 16 + 8i (little-endian: the low 32 bits first).

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;

/// Where the workload's cgroup lives.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const CGROUP: &str = "/sys/fs/cgroup/workload";

/// The workload's cgroup.
pub struct Cgroup {
    /// `cgroup.procs`, open for writing: a child writes "0" to it to join.
    procs: File,
}

impl Cgroup {
    /// Mount cgroup2, enable the pids and memory controllers below the root, and create the
    /// workload's cgroup with `pids.max`.
    pub fn create(pids_max: u32) -> io::Result<Cgroup> {
        let ctx = |what: &'static str| {
            move |e: io::Error| io::Error::new(e.kind(), format!("{what}: {e}"))
        };
        crate::sys::mount(
            "cgroup2",
            CGROUP_ROOT,
            "cgroup2",
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )
        .map_err(ctx("mount cgroup2 on /sys/fs/cgroup"))?;
        fs::write(
            format!("{CGROUP_ROOT}/cgroup.subtree_control"),
            "+pids +memory",
        )
        .map_err(ctx("enabling the pids and memory controllers"))?;
        fs::create_dir(CGROUP).map_err(ctx("creating /sys/fs/cgroup/workload"))?;
        fs::write(format!("{CGROUP}/pids.max"), pids_max.to_string())
            .map_err(ctx("setting pids.max"))?;
        let procs = fs::OpenOptions::new()
            .write(true)
            .open(format!("{CGROUP}/cgroup.procs"))
            .map_err(ctx("opening the workload cgroup's cgroup.procs"))?;
        Ok(Cgroup { procs })
    }

    /// The `cgroup.procs` a child writes "0" to, to join.
    pub fn procs(&self) -> &File {
        &self.procs
    }

    /// A cgroup of its own below the workload's, for one exec of a session: its processes
    /// count against the workload's `pids.max`, and [`ExecCgroup::kill`] ends all of them.
    pub fn exec(&self, id: u64) -> io::Result<ExecCgroup> {
        let path = format!("{CGROUP}/e{id}");
        fs::create_dir(&path)?;
        let procs = fs::OpenOptions::new()
            .write(true)
            .open(format!("{path}/cgroup.procs"))?;
        Ok(ExecCgroup { path, procs })
    }

    /// How many of its processes any OOM killer has killed (`memory.events`, `oom_kill`).
    pub fn oom_kills(&self) -> u64 {
        let events = fs::read_to_string(format!("{CGROUP}/memory.events")).unwrap_or_default();
        events
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// One exec's cgroup (`/sys/fs/cgroup/workload/eID`), removed when dropped.
pub struct ExecCgroup {
    path: String,
    procs: File,
}

impl ExecCgroup {
    pub fn procs(&self) -> &File {
        &self.procs
    }

    /// SIGKILL every process left in it (`cgroup.kill`).
    pub fn kill(&self) {
        let _ = fs::write(format!("{}/cgroup.kill", self.path), "1");
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        // Busy while a killed process is not yet reaped: then the next exec's drop, or none
        // (an empty cgroup costs a directory).
        let _ = fs::remove_dir(&self.path);
    }
}

/// Everything [`Confinement::enter`] needs, built before the fork (the child may not allocate).
pub struct Confinement {
    /// Make stdin (a pseudo-terminal) the controlling terminal of the new session.
    pub ctty: bool,
    /// The capabilities a uid-0 process keeps (its bounding set: what exec gives root);
    /// `None`: all.
    pub caps: Option<u64>,
    /// Supplementary groups (none when empty).
    pub groups: Vec<libc::gid_t>,
    /// Resource limits: (RLIMIT_*, soft, hard).
    pub rlimits: Vec<(u32, u64, u64)>,
    /// A container's root to chroot into, and the working directory inside it.
    root: Option<(std::ffi::CString, std::ffi::CString)>,
    procs_fd: i32,
    uid: u32,
    gid: u32,
    last_cap: u32,
    filter: Filter,
}

impl Confinement {
    /// Confinement into the cgroup whose `cgroup.procs` is `procs`, as `uid`:`gid`.
    pub fn new(procs: &File, uid: u32, gid: u32) -> Self {
        let last_cap = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(63);
        Confinement {
            ctty: false,
            caps: None,
            groups: Vec::new(),
            rlimits: Vec::new(),
            root: None,
            procs_fd: procs.as_raw_fd(),
            uid,
            gid,
            last_cap,
            filter: Filter::new(),
        }
    }

    /// Chroot into `root` (a container's, when not empty) and enter `cwd` inside it.
    pub fn in_root(&mut self, root: &[u8], cwd: &[u8]) -> io::Result<()> {
        if root.is_empty() {
            return Ok(());
        }
        let c = |b: &[u8]| {
            std::ffi::CString::new(b).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
        };
        self.root = Some((c(root)?, c(cwd)?));
        Ok(())
    }

    /// Confine the calling process; runs between fork and exec, as root. Only system calls on
    /// memory built before the fork: async-signal-safe.
    pub fn enter(&self) -> io::Result<()> {
        let check = |rc: libc::c_int| {
            if rc < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        // SAFETY: write(2) of a 1-byte buffer that outlives the call, to a descriptor the
        // `Cgroup` keeps open.
        let n = unsafe { libc::write(self.procs_fd, b"0".as_ptr().cast(), 1) };
        if n != 1 {
            return Err(io::Error::last_os_error());
        }
        if let Some((root, cwd)) = &self.root {
            // SAFETY: chroot(2) and chdir(2) of NUL-terminated strings built before the fork.
            check(unsafe { libc::chroot(root.as_ptr()) })?;
            // SAFETY: as above.
            check(unsafe { libc::chdir(cwd.as_ptr()) })?;
        }
        // SAFETY: setgroups(2) with the list built before the fork (its length and pointer
        // agree; a null pointer is allowed for length 0).
        check(unsafe { libc::setgroups(self.groups.len(), self.groups.as_ptr()) })?;
        for &(resource, soft, hard) in &self.rlimits {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: setrlimit(2) from a local; still root, so a hard limit may also rise.
            check(unsafe { libc::setrlimit(resource as libc::__rlimit_resource_t, &lim) })?;
        }
        // SAFETY: setgid takes a plain integer.
        check(unsafe { libc::setgid(self.gid) })?;
        if let (0, Some(keep)) = (self.uid, self.caps) {
            // Root regains at exec exactly the bounding set (no_new_privs caps it at what it
            // had, which is everything): dropping the rest leaves it `keep`.
            for cap in 0..=self.last_cap {
                if cap < 64 && keep & (1 << cap) == 0 {
                    // SAFETY: prctl with plain integers.
                    check(unsafe {
                        libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0)
                    })?;
                }
            }
        }
        if self.uid != 0 {
            for cap in 0..=self.last_cap {
                // SAFETY: prctl with plain integers; EINVAL past the kernel's last capability
                // is harmless.
                unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            }
            // Leaving uid 0 clears the permitted, effective and ambient sets.
            // SAFETY: setuid takes a plain integer.
            check(unsafe { libc::setuid(self.uid) })?;
        }
        // The workload leads its own session: no controlling terminal, its own process group.
        // SAFETY: setsid(2) takes no arguments.
        check(unsafe { libc::setsid() })?;
        if self.ctty {
            // SAFETY: ioctl(2) TIOCSCTTY on descriptor 0 with an integer argument.
            check(unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) })?;
        }
        self.filter.install()
    }
}

/// include/uapi/linux/audit.h: AUDIT_ARCH_X86_64 = EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// arch/x86/include/uapi/asm/unistd.h: system calls of the x32 ABI have this bit set.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const fn off_arg_low(i: u32) -> u32 {
    16 + 8 * i
}

/// Refused outright, whatever the arguments.
const DENIED: &[libc::c_long] = &[
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
];

/// Refused when argument `arg` (its low 32 bits, as the kernel reads an int) equals `value`.
const DENIED_WITH: &[(libc::c_long, u32, u32)] = &[
    (libc::SYS_socket, 0, libc::AF_VSOCK as u32),
    (libc::SYS_ptrace, 1, 1),
    (libc::SYS_process_vm_readv, 0, 1),
    (libc::SYS_process_vm_writev, 0, 1),
];

/// A built filter, ready to install in a freshly forked child.
pub struct Filter {
    program: Vec<libc::sock_filter>,
}

impl Filter {
    pub fn new() -> Self {
        Filter { program: program() }
    }

    /// Set `no_new_privs` and install the filter on the calling thread. Async-signal-safe (two
    /// system calls on memory built before the fork), so it may run between fork and exec.
    pub fn install(&self) -> io::Result<()> {
        // SAFETY: prctl with plain integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let prog = libc::sock_fprog {
            len: self.program.len() as libc::c_ushort,
            // The kernel only reads the program; the cast to *mut is what the C type asks for.
            filter: self.program.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: `prog` points at `len` valid instructions that outlive the call; the kernel
        // copies them.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Where a jump goes: the next instruction, or a label further on (cBPF jumps only forward).
#[derive(Clone, Copy)]
enum To {
    Next,
    Label(&'static str),
}

enum Insn {
    Label(&'static str),
    Stmt(u16, u32),
    /// `if A == k goto jt else goto jf`, or `A >= k` for `BPF_JGE`.
    Jump(u16, u32, To, To),
}

fn load(offset: u32) -> Insn {
    Insn::Stmt((libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16, offset)
}
fn ret(value: u32) -> Insn {
    Insn::Stmt((libc::BPF_RET | libc::BPF_K) as u16, value)
}
fn jeq(k: u32, jt: To, jf: To) -> Insn {
    Insn::Jump(
        (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        k,
        jt,
        jf,
    )
}

fn program() -> Vec<libc::sock_filter> {
    let allow = libc::SECCOMP_RET_ALLOW;
    let deny = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let mut p = vec![
        load(OFF_ARCH),
        jeq(AUDIT_ARCH_X86_64, To::Next, To::Label("deny")),
        load(OFF_NR),
        Insn::Jump(
            (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16,
            X32_SYSCALL_BIT,
            To::Label("deny"),
            To::Next,
        ),
    ];
    p.extend(
        DENIED
            .iter()
            .map(|&nr| jeq(nr as u32, To::Label("deny"), To::Next)),
    );
    const CHECKS: [&str; 4] = ["check0", "check1", "check2", "check3"];
    assert_eq!(
        DENIED_WITH.len(),
        CHECKS.len(),
        "one label per argument check"
    );
    for (&(nr, _, _), label) in DENIED_WITH.iter().zip(CHECKS) {
        p.push(jeq(nr as u32, To::Label(label), To::Next));
    }
    p.push(ret(allow));
    for (&(_, arg, value), label) in DENIED_WITH.iter().zip(CHECKS) {
        p.push(Insn::Label(label));
        p.push(load(off_arg_low(arg)));
        p.push(jeq(value, To::Label("deny"), To::Next));
        p.push(ret(allow));
    }
    p.push(Insn::Label("deny"));
    p.push(ret(deny));
    assemble(&p)
}

/// Resolve labels into the relative jump offsets cBPF uses.
fn assemble(p: &[Insn]) -> Vec<libc::sock_filter> {
    let mut at = std::collections::HashMap::new();
    let mut n = 0usize;
    for insn in p {
        match insn {
            Insn::Label(l) => {
                at.insert(*l, n);
            }
            _ => n += 1,
        }
    }
    let mut out = Vec::with_capacity(n);
    for insn in p {
        let here = out.len();
        let rel = |t: To| -> u8 {
            match t {
                To::Next => 0,
                To::Label(l) => {
                    let target = at[l];
                    u8::try_from(target - here - 1).expect("a jump of at most 255 instructions")
                }
            }
        };
        match *insn {
            Insn::Label(_) => {}
            Insn::Stmt(code, k) => out.push(libc::sock_filter {
                code,
                jt: 0,
                jf: 0,
                k,
            }),
            Insn::Jump(code, k, jt, jf) => out.push(libc::sock_filter {
                code,
                jt: rel(jt),
                jf: rel(jf),
                k,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cBPF interpreter for the instructions the filter uses, over a `seccomp_data`.
    fn run(p: &[libc::sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&nr.to_le_bytes());
        data.extend_from_slice(&arch.to_le_bytes());
        data.extend_from_slice(&0u64.to_le_bytes()); // instruction pointer
        for a in args {
            data.extend_from_slice(&a.to_le_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = p[pc];
            let code = u32::from(i.code);
            if code == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS {
                let o = i.k as usize;
                acc = u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
                pc += 1;
            } else if code == libc::BPF_RET | libc::BPF_K {
                return i.k;
            } else {
                let taken = if code == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K {
                    acc == i.k
                } else if code == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K {
                    acc >= i.k
                } else {
                    panic!("unexpected instruction {code:#x}");
                };
                pc += 1 + usize::from(if taken { i.jt } else { i.jf });
            }
        }
    }

    const DENY: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;

    fn x86(nr: libc::c_long, args: [u64; 6]) -> u32 {
        run(&program(), nr as u32, AUDIT_ARCH_X86_64, args)
    }

    #[test]
    fn the_listed_calls_are_refused_and_others_allowed() {
        for &nr in DENIED {
            assert_eq!(x86(nr, [0; 6]), DENY, "syscall {nr}");
        }
        for nr in [
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_clone,
            libc::SYS_execve,
            libc::SYS_connect,
        ] {
            assert_eq!(x86(nr, [0; 6]), ALLOW, "syscall {nr}");
        }
    }

    #[test]
    fn vsock_sockets_are_refused_other_families_allowed() {
        let vsock = libc::AF_VSOCK as u64;
        assert_eq!(x86(libc::SYS_socket, [vsock, 1, 0, 0, 0, 0]), DENY);
        // The kernel reads the family as an int: high bits do not hide it.
        assert_eq!(
            x86(libc::SYS_socket, [vsock | 1 << 32, 1, 0, 0, 0, 0]),
            DENY
        );
        for family in [
            libc::AF_INET,
            libc::AF_INET6,
            libc::AF_UNIX,
            libc::AF_NETLINK,
        ] {
            assert_eq!(x86(libc::SYS_socket, [family as u64, 1, 0, 0, 0, 0]), ALLOW);
        }
    }

    #[test]
    fn tracing_pid_1_is_refused_tracing_others_allowed() {
        assert_eq!(x86(libc::SYS_ptrace, [16, 1, 0, 0, 0, 0]), DENY);
        assert_eq!(x86(libc::SYS_ptrace, [16, 2, 0, 0, 0, 0]), ALLOW);
        assert_eq!(x86(libc::SYS_process_vm_readv, [1, 0, 0, 0, 0, 0]), DENY);
        assert_eq!(x86(libc::SYS_process_vm_writev, [1, 0, 0, 0, 0, 0]), DENY);
        assert_eq!(x86(libc::SYS_process_vm_writev, [7, 0, 0, 0, 0, 0]), ALLOW);
    }

    /// The same filter installed for real (in a forked child, on this host's kernel).
    #[test]
    fn the_kernel_enforces_it() {
        let filter = Filter::new();
        let errno = || io::Error::last_os_error().raw_os_error();
        // SAFETY: the child makes only system calls on memory built before the fork, then
        // _exits; the parent waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let code = (|| {
                if filter.install().is_err() {
                    return 10;
                }
                // SAFETY: socket(2) with constant arguments.
                if unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0) } >= 0
                    || errno() != Some(libc::EPERM)
                {
                    return 11;
                }
                // SAFETY: as above.
                if unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) } < 0 {
                    return 12;
                }
                // SAFETY: io_uring_setup with a NULL params pointer; the filter answers first.
                if unsafe { libc::syscall(libc::SYS_io_uring_setup, 1, 0) } != -1
                    || errno() != Some(libc::EPERM)
                {
                    return 13;
                }
                0
            })();
            // SAFETY: leaves the child at once, without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "which check failed (10-13)");
    }

    #[test]
    fn other_abis_are_refused_whole() {
        let p = program();
        // i386 (AUDIT_ARCH_I386) read(2) is number 3.
        assert_eq!(run(&p, 3, 0x4000_0003, [0; 6]), DENY);
        // x32 read(2).
        assert_eq!(run(&p, X32_SYSCALL_BIT, AUDIT_ARCH_X86_64, [0; 6]), DENY);
    }
}
