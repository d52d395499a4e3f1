//! The workload's confinement inside the guest: no_new_privs, no supplementary groups, no
//! capabilities (not even in the bounding set) for the default user, and a seccomp filter that refuses (EPERM) vsock sockets, io_uring, eBPF, perf events,
//! userfaultfd, kexec, module loading, and tracing guest-init — for `--user 0:0` as well.
//! Each call is made for real in the guest (Python's ctypes on the host's /usr); without the
//! filter the kernel would answer differently (success, EFAULT, ENOSYS or ESRCH), so "refused"
//! here means the filter said no.

use amvm_tests::run_vm;

/// Prints `name refused` for each call that failed with EPERM, else what it returned.
const PROBE: &str = r#"
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    e = ctypes.get_errno()
    print(name, "refused" if r == -1 and e == errno.EPERM else "r=%d errno=%d" % (r, e))
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    print("vsock allowed")
except PermissionError:
    print("vsock refused")
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
print("inet allowed")
call("io_uring_setup", 425, 1, 0)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("userfaultfd", 323, 0)
call("kexec_load", 246, 0, 0, 0, 0)
call("init_module", 175, 0, 0, 0)
call("finit_module", 313, -1, 0, 0)
call("ptrace_peek_pid1", 101, 2, 1, 0, 0)
call("process_vm_readv_pid1", 310, 1, 0, 0, 0, 0, 0)
for line in open("/proc/self/status"):
    if line.split(":")[0] in ("NoNewPrivs", "Seccomp", "CapEff", "CapBnd", "Groups"):
        print(line.strip().replace("\t", " "))
"#;

const REFUSED: &[&str] = &[
    "vsock refused",
    "io_uring_setup refused",
    "bpf refused",
    "perf_event_open refused",
    "userfaultfd refused",
    "kexec_load refused",
    "init_module refused",
    "finit_module refused",
    "ptrace_peek_pid1 refused",
    "process_vm_readv_pid1 refused",
    "inet allowed",
    "NoNewPrivs: 1",
    "Seccomp: 2",
    "Groups:",
];

fn probe(opts: &[&str]) -> String {
    let o = run_vm(opts, &["python3", "-c", PROBE]);
    assert_eq!(o.code, 0, "{o:?}");
    o.stdout_str()
}

#[test]
fn the_default_user_is_confined_and_has_no_capabilities() {
    let out = probe(&[]);
    for want in REFUSED {
        assert!(
            out.lines().any(|l| l == *want),
            "no line {want:?} in:\n{out}"
        );
    }
    for none in ["CapEff: 0000000000000000", "CapBnd: 0000000000000000"] {
        assert!(
            out.lines().any(|l| l == none),
            "no line {none:?} in:\n{out}"
        );
    }
}

#[test]
fn root_in_the_guest_keeps_its_capabilities_but_not_these_calls() {
    let out = probe(&["--user", "0:0"]);
    for want in REFUSED {
        assert!(
            out.lines().any(|l| l == *want),
            "no line {want:?} in:\n{out}"
        );
    }
    assert!(
        !out.lines().any(|l| l == "CapEff: 0000000000000000"),
        "root has capabilities in the guest: {out}"
    );
}

#[test]
fn the_egress_relay_still_works_under_the_filter() {
    // The workload cannot open vsock itself, yet reaches the egress through guest-init's relay.
    let server = amvm_tests::egress_server::EgressServer::start(
        "sandbox",
        amvm_tests::egress_server::Pace::Fast,
    );
    let o = run_vm(
        &["--egress", server.path_str()],
        &[
            "sh",
            "-c",
            "echo DOWN 5 | busybox nc ${AMVM_EGRESS_ADDR%:*} ${AMVM_EGRESS_ADDR#*:} | wc -c",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str().trim(), "5");
}
