//! The VMM's own confinement (issue 8): while a VM runs, every thread of the amvm process is
//! under its seccomp filter, the process sits in an empty network namespace of its own and a
//! mount namespace of its own, and it runs as whoever started it (a non-root member of the kvm
//! group will do); a forbidden system call on any kind of thread kills amvm with a report
//! naming the call.

use amvm_tests::egress_server::{EgressServer, Pace};
use amvm_tests::{amvm_bin, leftovers, require_kvm, run_args, run_vm_leaving_nothing_env};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

/// What the test saw of a running amvm process.
struct Seen {
    threads: Vec<(String, String)>,
    net_ns: String,
    mnt_ns: String,
    interfaces: Vec<String>,
    /// What amvm's root directory holds (/proc/PID/root), sorted.
    root: Vec<String>,
    /// The mount points amvm's mount namespace holds (/proc/PID/mountinfo).
    mounts: Vec<String>,
    /// The sandbox's supervisor (the VMM's parent): the one host process that parses the
    /// guest's frames.
    supervisor: Confinement,
    /// The threads of the `amvm run` process itself (it reads the command's frames).
    run_threads: Vec<(String, String)>,
}

/// What the test saw of the supervisor.
struct Confinement {
    threads: Vec<(String, String)>,
    net_ns: String,
    mnt_ns: String,
    /// Its mount points, and what its root directory holds.
    mounts: Vec<String>,
    root: Vec<String>,
    /// Whether its state directory (the mount that is not /) holds state.json, seen through
    /// /proc/PID/root.
    state_seen: bool,
}

fn ls(dir: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn mount_points(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .map(|l| l.split(' ').nth(4).unwrap_or_default().to_string())
        .collect()
}

fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // pid (comm) state ppid ...: comm may hold spaces, so after the last ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split(' ').nth(1).unwrap().parse().unwrap()
}

fn confinement_of(pid: u32) -> Confinement {
    let p = pid.to_string();
    let mounts = mount_points(pid);
    let state_seen = mounts.iter().any(|m| {
        m != "/" && std::path::Path::new(&format!("/proc/{pid}/root{m}/state.json")).exists()
    });
    Confinement {
        threads: threads(pid),
        net_ns: ns(&p, "net"),
        mnt_ns: ns(&p, "mnt"),
        mounts,
        root: ls(&format!("/proc/{pid}/root")),
        state_seen,
    }
}

fn ns(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/ns/{kind}: {e}"))
        .to_string_lossy()
        .into_owned()
}

/// (thread name, its /proc status) for each thread of `pid`.
fn threads(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the amvm process") {
        let dir = t.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        out.push((comm.trim().to_string(), status));
    }
    out
}

fn field<'a>(status: &'a str, name: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {name} in\n{status}"))
}

/// Start a VM with every kind of thread (a workspace: virtiofsd's stderr readers; `-i`: the
/// stdin copier), wait until the workload runs, look at amvm's process, then let it finish.
/// `wrap`: a command amvm is started under (setpriv, to run it as another user).
fn inspect_running_vm(wrap: &[&str], env: &[(&str, &str)], extra: &[&str]) -> Seen {
    require_kvm();
    let ws = std::env::temp_dir().join(format!(
        "amvm-hardening-{}-{}",
        std::process::id(),
        extra.len() + wrap.len()
    ));
    std::fs::create_dir_all(&ws).unwrap();
    // An egress every user may reach (the non-root runs too): its socket is the one thing amvm's
    // empty root holds.
    let egress = EgressServer::start(
        &format!("hardening-{}", extra.len() + wrap.len()),
        Pace::Fast,
    );
    std::fs::set_permissions(&egress.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&egress.path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut opts = vec![
        "-i",
        "--workspace",
        ws.to_str().unwrap(),
        "--egress",
        egress.path_str(),
    ];
    opts.extend_from_slice(extra);
    // One egress stream first (5 bytes back), made after amvm moved into its empty root.
    let fetch = "import os, socket\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.connect(os.environ['AMVM_EGRESS_SOCK'])\n\
        s.sendall(b'DOWN 5\\n')\n\
        s.shutdown(socket.SHUT_WR)\n\
        got = b''\n\
        while b := s.recv(64): got += b\n\
        print('egress', len(got))\n";
    let script = format!("python3 -c \"{fetch}\" && echo ready; read x; echo got $x");
    let args = run_args(&opts, &["sh", "-c", &script]);
    let bin = amvm_bin();
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&bin);
            c
        }
        None => Command::new(&bin),
    };
    let mut child = cmd
        .args(&args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning amvm");
    // setpriv execs amvm in the same process: the pid is amvm's.
    let pid = child.id();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    if line == "egress 5\n" {
        line.clear();
        stdout.read_line(&mut line).unwrap();
    }
    if line != "ready\n" {
        let out = child.wait_with_output().unwrap();
        panic!(
            "the workload did not start: {line:?} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // amvm run is a sandbox made for the command: its VMM is the sandbox supervisor's child.
    let run_pid = pid;
    let pid = amvm_tests::leftovers::vmm_of(run_pid);
    let p = pid.to_string();
    let supervisor = parent_of(pid);
    assert_ne!(supervisor, run_pid, "the VMM is not the supervisor's child");
    let seen = Seen {
        supervisor: confinement_of(supervisor),
        run_threads: threads(run_pid),
        threads: threads(pid),
        net_ns: ns(&p, "net"),
        mnt_ns: ns(&p, "mnt"),
        interfaces: std::fs::read_to_string(format!("/proc/{pid}/net/dev"))
            .unwrap()
            .lines()
            .skip(2)
            .filter_map(|l| l.split(':').next())
            .map(|n| n.trim().to_string())
            .collect(),
        root: {
            let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
                .unwrap_or_else(|e| panic!("/proc/{pid}/root: {e}"))
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        },
        mounts: std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap()
            .lines()
            .map(|l| l.split(' ').nth(4).unwrap_or_default().to_string())
            .collect(),
    };
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(rest, "got go\n");
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    leftovers::nothing_left(ws.to_str().unwrap(), pid);
    let _ = std::fs::remove_dir_all(&ws);
    seen
}

fn assert_confined(seen: &Seen) {
    let names: Vec<&str> = seen.threads.iter().map(|(n, _)| n.as_str()).collect();
    // A run is a sandbox's VMM: the control and exec streams are its supervisor's, which the
    // event loop ("vsock") connects to guest.sock, so there are no control or stdin threads.
    for expected in ["amvm", "vcpu0", "vsock", "virtiofsd-err"] {
        assert!(
            names.contains(&expected),
            "no {expected} thread among {names:?}"
        );
    }
    for (name, status) in &seen.threads {
        assert_eq!(
            field(status, "Seccomp:"),
            "2",
            "thread {name} is not filtered"
        );
        assert_eq!(field(status, "NoNewPrivs:"), "1", "thread {name}");
        assert_eq!(
            field(status, "CapEff:"),
            "0000000000000000",
            "thread {name}"
        );
        assert_eq!(
            field(status, "CapPrm:"),
            "0000000000000000",
            "thread {name}"
        );
    }
    assert_ne!(
        seen.net_ns,
        ns("self", "net"),
        "amvm shares our network namespace"
    );
    assert_ne!(
        seen.mnt_ns,
        ns("self", "mnt"),
        "amvm shares our mount namespace"
    );
    assert_eq!(seen.interfaces, ["lo"], "amvm's network namespace");
    // Issue 26: the host's tree is gone from amvm's mount namespace; its root holds only the
    // egress socket and its supervisor's guest socket.
    assert_eq!(
        seen.root,
        ["egress.sock", "guest.sock"],
        "amvm's root directory"
    );
    assert_eq!(
        seen.mounts,
        ["/", "/egress.sock", "/guest.sock"],
        "amvm's mounts"
    );
    // Issue 36: the supervisor, which parses the guest's frames, is confined as the VMM is:
    // every thread filtered, no privileges, no network, and a root that holds its state
    // directory (at its own path) and nothing else.
    let sup = &seen.supervisor;
    assert!(!sup.threads.is_empty());
    for (name, status) in &sup.threads {
        assert_eq!(
            field(status, "Seccomp:"),
            "2",
            "supervisor thread {name} is not filtered"
        );
        assert_eq!(
            field(status, "NoNewPrivs:"),
            "1",
            "supervisor thread {name}"
        );
        assert_eq!(
            field(status, "CapEff:"),
            "0000000000000000",
            "supervisor thread {name}"
        );
    }
    assert_ne!(
        sup.net_ns,
        ns("self", "net"),
        "the supervisor shares our network namespace"
    );
    assert_ne!(
        sup.mnt_ns,
        ns("self", "mnt"),
        "the supervisor shares our mount namespace"
    );
    assert_eq!(
        sup.mounts.len(),
        2,
        "the supervisor's mounts: {:?}",
        sup.mounts
    );
    assert_eq!(
        sup.mounts[0], "/",
        "the supervisor's mounts: {:?}",
        sup.mounts
    );
    assert!(
        sup.state_seen,
        "the supervisor's one bind is not its state directory: {:?}",
        sup.mounts
    );
    // Its root holds only the first directory on the way to its state directory.
    let first = sup.mounts[1]
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap();
    assert_eq!(sup.root, [first], "the supervisor's root directory");
    // And the run process, which reads the command's frames, is filtered on every thread.
    assert!(seen.run_threads.len() >= 2, "{:?}", seen.run_threads.len());
    for (name, status) in &seen.run_threads {
        assert_eq!(
            field(status, "Seccomp:"),
            "2",
            "run thread {name} is not filtered"
        );
        assert_eq!(field(status, "NoNewPrivs:"), "1", "run thread {name}");
    }
}

#[test]
fn every_thread_of_amvm_is_filtered_in_an_empty_network_namespace() {
    let seen = inspect_running_vm(&[], &[], &[]);
    assert_confined(&seen);
}

#[test]
fn no_seccomp_leaves_the_threads_unfiltered() {
    // The control for the test above: the field reads 0 when amvm installs nothing.
    let seen = inspect_running_vm(&[], &[], &["--no-seccomp"]);
    assert!(seen.threads.len() >= 5, "{:?}", seen.threads);
    for (name, status) in &seen.threads {
        assert_eq!(field(status, "Seccomp:"), "0", "thread {name}");
    }
    for (name, status) in seen.supervisor.threads.iter().chain(&seen.run_threads) {
        assert_eq!(
            field(status, "Seccomp:"),
            "0",
            "supervisor or run thread {name}"
        );
    }
}

/// A non-root member of /dev/kvm's group runs everything, virtiofsd included, and every
/// process of the run is that user: amvm needs no root.
#[test]
fn a_non_root_member_of_the_kvm_group_runs_amvm() {
    require_kvm();
    let kvm = std::fs::metadata("/dev/kvm").expect("/dev/kvm");
    assert!(
        kvm.mode() & 0o060 == 0o060 && kvm.gid() != 0,
        "/dev/kvm is not group read-write for a kvm group (mode {:o}, gid {}): on a real host \
         set it up as docs/hosts.md says; the emulated host's init does it",
        kvm.mode(),
        kvm.gid()
    );
    // The user's own copies of the kernel and virtiofsd (root's cache is not theirs to read).
    let dir = std::env::temp_dir().join(format!("amvm-nonroot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cache = std::env::var("AMVM_CACHE").map_or_else(
        |_| std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/amvm"),
        std::path::PathBuf::from,
    );
    let kernel = dir.join("vmlinux");
    let virtiofsd = dir.join("virtiofsd");
    std::fs::copy(cache.join("kernel/vmlinux"), &kernel).expect("the cached kernel");
    std::fs::copy(cache.join("virtiofsd/bin/virtiofsd"), &virtiofsd).expect("virtiofsd");
    let gid = kvm.gid().to_string();
    let (k, v) = (kernel.to_str().unwrap(), virtiofsd.to_str().unwrap());
    let seen = inspect_running_vm(
        &[
            "setpriv",
            "--reuid=1000",
            "--regid=1000",
            &format!("--groups={gid}"),
            "--inh-caps=-all",
        ],
        &[("AMVM_KERNEL", k), ("AMVM_VIRTIOFSD", v), ("HOME", "/tmp")],
        &[],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_confined(&seen);
    for (name, status) in &seen.threads {
        assert_eq!(
            field(status, "Uid:"),
            "1000\t1000\t1000\t1000",
            "thread {name}"
        );
        assert_eq!(
            field(status, "CapEff:"),
            "0000000000000000",
            "thread {name}"
        );
    }
}

/// Issue 26: a user with no set-up of their own (uid 65534, no home) finds what root's
/// `images/setup` installed for every user (/usr/local/lib/amvm): no AMVM_KERNEL, no
/// AMVM_VIRTIOFSD, no cache. Before, amvm looked only in the user's own cache and refused.
#[test]
fn a_user_without_a_set_up_of_their_own_uses_the_one_root_installed() {
    require_kvm();
    for piece in ["vmlinux", "virtiofsd"] {
        let p = std::path::Path::new("/usr/local/lib/amvm").join(piece);
        assert!(
            p.exists(),
            "{} missing: images/setup, run as root (tests/run does), installs it",
            p.display()
        );
    }
    let gid = std::fs::metadata("/dev/kvm").expect("/dev/kvm").gid();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            &format!("--groups={gid}"),
            "--inh-caps=-all",
        ])
        .arg(amvm_bin())
        .args(run_args(
            &[],
            &["sh", "-c", "echo \"uid $(id -u)\"; uname -r"],
        ))
        .env_remove("AMVM_KERNEL")
        .env_remove("AMVM_VIRTIOFSD")
        .env_remove("AMVM_CACHE")
        .env_remove("XDG_RUNTIME_DIR")
        .env("HOME", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .expect("setpriv (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.starts_with("uid 1000\n"), "{stdout}");
    // The guest kernel, not the emulated host's own (Debian 6.1) nor this machine's.
    assert!(stdout.contains("\n6.12."), "{stdout}");
}

/// The test-only hook `AMVM_TEST_SECCOMP_TRIP=KIND` makes the first thread of KIND call
/// ptrace(2) right after filtering itself: amvm must die at once with exit 125, naming the
/// thread kind and the call, and leave nothing behind.
#[test]
fn a_forbidden_call_on_any_thread_kills_amvm_and_names_the_call() {
    for (kind, shown) in [
        ("vmm", "vmm"),
        ("vcpu", "vcpu"),
        ("event-loop", "vsock event loop"),
        ("helper", "helper"),
        ("supervisor", "supervisor"),
    ] {
        let o = run_vm_leaving_nothing_env(
            &[],
            &["sh", "-c", "echo should-not-run"],
            &[("AMVM_TEST_SECCOMP_TRIP", kind)],
        );
        assert_eq!(o.code, 125, "{kind}: {o:?}");
        let want =
            format!("seccomp: the {shown} thread made a forbidden system call: ptrace (101)");
        assert!(o.stderr.contains(&want), "{kind}: {}", o.stderr);
        assert!(
            !o.stdout_str().contains("should-not-run"),
            "{kind}: the workload ran"
        );
    }
    // A read-only disk's worker, which only a run with a disk has.
    let dir = std::env::temp_dir().join(format!("amvm-trip-blk-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("tree")).unwrap();
    std::fs::write(dir.join("tree/f"), "x").unwrap();
    let image = dir.join("tree.erofs");
    let made = std::process::Command::new("mkfs.erofs")
        .arg(&image)
        .arg(dir.join("tree"))
        .output()
        .expect("mkfs.erofs (erofs-utils; images/setup installs it)");
    assert!(made.status.success(), "mkfs.erofs: {made:?}");
    let o = run_vm_leaving_nothing_env(
        &["-v", &format!("{}:/data", image.display())],
        &["sh", "-c", "echo should-not-run"],
        &[("AMVM_TEST_SECCOMP_TRIP", "block")],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(o.code, 125, "block: {o:?}");
    assert!(
        o.stderr.contains(
            "seccomp: the virtio-blk worker thread made a forbidden system call: ptrace (101)"
        ),
        "block: {}",
        o.stderr
    );
    assert!(
        !o.stdout_str().contains("should-not-run"),
        "block: the workload ran"
    );
    // The run process itself: it dies at once as the others do, taking its sandbox's
    // supervisor and VMM with it; what it leaves (its state directory) goes with the next
    // amvm ls.
    let ws = std::env::temp_dir().join(format!("amvm-trip-run-{}", std::process::id()));
    std::fs::create_dir_all(&ws).unwrap();
    let child = amvm_tests::spawn_vm_env(
        &["--workspace", ws.to_str().unwrap()],
        &["sh", "-c", "echo should-not-run"],
        &[("AMVM_TEST_SECCOMP_TRIP", "run")],
    );
    let pid = child.id();
    let o = amvm_tests::Outcome::from(child.wait_with_output().unwrap());
    assert_eq!(o.code, 125, "run: {o:?}");
    assert!(
        o.stderr
            .contains("amvm: seccomp: the run thread made a forbidden system call: ptrace (101)"),
        "run: {}",
        o.stderr
    );
    assert!(
        !o.stdout_str().contains("should-not-run"),
        "run: the workload ran"
    );
    let ls = amvm_tests::amvm(["ls"], &[]);
    assert_eq!(ls.code, 0, "{ls:?}");
    leftovers::nothing_left(ws.to_str().unwrap(), pid);
    let _ = std::fs::remove_dir_all(&ws);
}

/// Issue 36: the supervisor parses what the guest sends on its control and exec streams. Those
/// reach it on `guest.sock`, each behind the VMM's one-byte tag, the guest's bytes after it
/// relayed as they are; this test speaks there as a hostile guest's streams would arrive
/// (the VMM's relay itself is byte-exact: tests/egress.rs): a second control stream, an exec
/// stream whose first frame is not its Attach, a truncated Attach, an oversized frame, an
/// Attach to an exec nobody asked for followed by megabytes, an unknown tag, and a flood of
/// such streams at once. Each is closed by the supervisor, and the sandbox serves on: an exec
/// that was running throughout gets its input and gives its output and status, and a new one
/// after it works.
#[test]
fn hostile_guest_streams_are_refused_and_the_supervisor_serves_on() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    require_kvm();
    let runtime = std::env::temp_dir().join(format!("amvm-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&runtime).unwrap();
    let env = [("XDG_RUNTIME_DIR", runtime.to_str().unwrap())];
    let c = amvm_tests::amvm(["create", "--mem", "256"], &env);
    assert_eq!(c.code, 0, "{c:?}");
    let id = c.stdout_str().trim().to_string();
    let guest_sock = runtime.join("amvm").join(&id).join("guest.sock");
    // An exec that runs throughout: it waits for a line on stdin.
    let mut waiting = Command::new(amvm_bin())
        .args([
            "exec",
            "-i",
            &id,
            "--",
            "sh",
            "-c",
            "read x; echo got $x; exit 5",
        ])
        .env("XDG_RUNTIME_DIR", &runtime)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let frame = |kind: u8, len: u32, payload: &[u8]| {
        let mut f = vec![kind];
        f.extend_from_slice(&len.to_le_bytes());
        f.extend_from_slice(payload);
        f
    };
    let attach = |id: u64| frame(5, 8, &id.to_le_bytes());
    let stdout_frames: Vec<u8> = (0..128)
        .flat_map(|_| frame(1, 64 * 1024, &[b'x'; 64 * 1024]))
        .collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a second control stream",
            [&[b'C'][..], &frame(1, 3, b"abc")].concat(),
        ),
        (
            "an exec stream opening with Stdout",
            [&[b'E'][..], &frame(1, 8, &[0; 8])].concat(),
        ),
        (
            "an exec stream opening with a Spec",
            [&[b'E'][..], &frame(16, 8, &[0; 8])].concat(),
        ),
        ("a truncated Attach", vec![b'E', 5, 8, 0]),
        (
            "an oversized frame",
            [&[b'E'][..], &frame(5, u32::MAX, &[0; 8])].concat(),
        ),
        (
            "an Attach to no exec, then 8 MiB",
            [&[b'E'][..], &attach(u64::MAX), &stdout_frames].concat(),
        ),
        ("an unknown tag", vec![b'Z'; 4096]),
    ];
    let closed = |conn: &mut UnixStream, what: &str| {
        conn.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut b = [0u8; 64];
        match conn.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("{what}: the supervisor did not close the stream: {other:?}"),
        }
    };
    for (what, bytes) in &cases {
        let mut conn = UnixStream::connect(&guest_sock).unwrap();
        // A stream the supervisor closes while we write is refused: that is the point.
        let _ = conn.write_all(bytes);
        let _ = conn.shutdown(std::net::Shutdown::Write);
        closed(&mut conn, what);
    }
    // A flood: 200 streams at once, half of them lying in their first frame, half holding an
    // unfinished Attach open.
    let mut flood = Vec::new();
    for i in 0..200 {
        let mut conn = UnixStream::connect(&guest_sock).unwrap();
        if i % 2 == 0 {
            let _ = conn.write_all(&[&[b'E'][..], &frame(3, 8, &[9; 8])].concat());
        } else {
            let _ = conn.write_all(&[b'E', 5]);
        }
        flood.push(conn);
    }
    for (i, conn) in flood.iter_mut().enumerate().filter(|(i, _)| i % 2 == 0) {
        closed(conn, &format!("flood stream {i}"));
    }
    // The sandbox serves on: a new exec, and the one that waited throughout.
    let o = amvm_tests::amvm(["exec", &id, "--", "sh", "-c", "echo still; exit 3"], &env);
    assert_eq!((o.code, o.stdout_str().as_str()), (3, "still\n"), "{o:?}");
    waiting
        .stdin
        .take()
        .unwrap()
        .write_all(b"through\n")
        .unwrap();
    let w = waiting.wait_with_output().unwrap();
    assert_eq!(w.status.code(), Some(5), "{w:?}");
    assert_eq!(String::from_utf8_lossy(&w.stdout), "got through\n");
    drop(flood);
    let info = amvm_tests::amvm(["inspect", &id], &env);
    assert!(
        info.stdout_str().contains("\"state\": \"running\""),
        "{info:?}"
    );
    let rm = amvm_tests::amvm(["rm", "-f", &id], &env);
    assert_eq!(rm.code, 0, "{rm:?}");
    let _ = std::fs::remove_dir_all(&runtime);
}
