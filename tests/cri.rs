//! Kubernetes through containerd's CRI (issue 41), with the real engine: Debian's containerd
//! and its CRI plugin, started by the test on a socket of its own, driven by a CRI client on
//! the published protobufs (tests/src/cri.rs) the way a kubelet drives it.
//!
//! Two runtime handlers, both as docs/engines.md configures them: `amvm`, amvm's pod-aware shim
//! (containerd-shim-amvm-v2: a pod is one microVM), and `amvm-runc`, containerd's runc shim with
//! amvm-runc as its runtime binary (each container of a pod, its sandbox container too, a
//! microVM of its own).

use amvm_tests::cri::{log_lines, pod_config, Containerd, OrLog};
use amvm_tests::{amvm_bin, leftovers, require_kvm, run_vm};
use std::time::{Duration, Instant};

/// `uname -r` of amvm's guest kernel.
fn amvms_kernel() -> String {
    let o = run_vm(&[], &["uname", "-r"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    o.stdout_str().trim().to_string()
}

/// Nothing of `base`'s pods is left: no process names it (VMMs, virtiofsd, shims, amvm-runc
/// workers) and no amvm sandbox state mentions it.
fn nothing_left_of(base: &std::path::Path) {
    let needle = base.display().to_string();
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let procs: Vec<String> = leftovers::processes_with(&needle)
            .into_iter()
            .filter(|p| !p.contains("/usr/bin/containerd --config"))
            .collect();
        let sandboxes = leftovers::sandboxes_naming(&needle);
        if procs.is_empty() && sandboxes.is_empty() {
            return;
        }
        assert!(
            Instant::now() < until,
            "left behind: {procs:?} {sandboxes:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// A pod with runtime handler `amvm-runc`: a container's stdout and stderr reach its CRI log and
/// its exit status its ContainerStatus, it runs on amvm's kernel (not the host's), ExecSync
/// into a running container returns output and status, a container whose command is not
/// there ends 127 saying so in its log, and stopping and removing the pod leaves no VMM,
/// virtiofsd, shim or sandbox behind.
#[test]
fn a_pod_runs_through_the_runc_shim_with_amvm_runc_a_vm_per_container() {
    require_kvm();
    let kernel = amvms_kernel();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let ctd = Containerd::start("pod", &amvm_bin());
    ctd.import_busybox();
    let mut cri = ctd.client();
    let v = cri.version();
    assert_eq!(v.runtime_name, "containerd", "{v:?}");

    let logs = ctd.base.join("logs/pod");
    let config = pod_config("pod", &logs, &[]);
    let pod = cri
        .run_pod(&config, "amvm-runc")
        .or_log(&ctd, "RunPodSandbox");

    let once = cri
        .create(
            &pod,
            &config,
            "once",
            &[
                "sh",
                "-c",
                "echo to stdout; echo to stderr >&2; uname -r; exit 3",
            ],
        )
        .or_log(&ctd, "CreateContainer");
    cri.start(&once).or_log(&ctd, "StartContainer");
    let code = cri
        .wait_exited(&once, Duration::from_secs(300))
        .unwrap_or_else(|s| panic!("not exited: {s:?}\n{}", ctd.log()));
    assert_eq!(code, 3, "{}", ctd.log());
    let lines = log_lines(&logs.join("once.log"));
    assert!(
        lines.contains(&("stdout".into(), "to stdout".into())),
        "{lines:?}"
    );
    assert!(
        lines.contains(&("stderr".into(), "to stderr".into())),
        "{lines:?}"
    );
    assert!(
        lines.contains(&("stdout".into(), kernel.clone())),
        "{lines:?}"
    );
    assert_ne!(kernel, host_kernel.trim());

    let long = cri
        .create(&pod, &config, "long", &["sleep", "600"])
        .or_log(&ctd, "CreateContainer");
    cri.start(&long).or_log(&ctd, "StartContainer");
    let (code, out, err) = cri
        .exec_sync(
            &long,
            &[
                "sh",
                "-c",
                "echo in the container; uname -r; echo oops >&2; exit 4",
            ],
            300,
        )
        .or_log(&ctd, "ExecSync");
    assert_eq!(code, 4, "{out} {err}");
    assert_eq!(out, format!("in the container\n{kernel}\n"));
    assert_eq!(err, "oops\n");

    // A command that is not there: the container fails, saying why.
    let missing = cri
        .create(&pod, &config, "missing", &["/no/such/command"])
        .or_log(&ctd, "CreateContainer");
    cri.start(&missing).or_log(&ctd, "StartContainer");
    let code = cri
        .wait_exited(&missing, Duration::from_secs(300))
        .unwrap_or_else(|s| panic!("not exited: {s:?}\n{}", ctd.log()));
    assert_eq!(code, 127, "{}", ctd.log());
    let lines = log_lines(&logs.join("missing.log"));
    assert!(
        lines
            .iter()
            .any(|(stream, l)| stream == "stderr"
                && l.ends_with("/no/such/command: command not found")),
        "{lines:?}"
    );

    cri.stop_pod(&pod).or_log(&ctd, "StopPodSandbox");
    let s = cri.status(&long);
    assert_eq!(
        s.state,
        k8s_cri::v1::ContainerState::ContainerExited as i32,
        "{s:?}"
    );
    cri.remove_pod(&pod).or_log(&ctd, "RemovePodSandbox");
    assert!(cri.pods().is_empty());
    nothing_left_of(&ctd.base);
}

/// A pod's `io.amvm.egress` annotation (passed on by the runtime's `pod_annotations`) gives its
/// containers amvm's egress, with either handler: 100,000 bytes come through it whole; a
/// container of a pod without the annotation has no way out.
#[test]
fn a_pods_egress_annotation_gives_its_containers_the_egress() {
    use amvm_tests::egress_server::{EgressServer, Pace};
    require_kvm();
    let egress = EgressServer::start("cri-pod", Pace::Fast);
    let ctd = Containerd::start("egress", &amvm_bin());
    ctd.import_busybox();
    let mut cri = ctd.client();
    let fetch = [
        "sh",
        "-c",
        "printf 'DOWN 100000\\n' | nc 127.0.0.1 4700 | wc -c",
    ];
    for (handler, name, annotations) in [
        ("amvm", "with", vec![("io.amvm.egress", egress.path_str())]),
        (
            "amvm-runc",
            "with-runc",
            vec![("io.amvm.egress", egress.path_str())],
        ),
        ("amvm", "without", vec![]),
    ] {
        let logs = ctd.base.join("logs").join(name);
        let config = pod_config(name, &logs, &annotations);
        let pod = cri.run_pod(&config, handler).or_log(&ctd, "RunPodSandbox");
        let c = cri
            .create(&pod, &config, "fetch", &fetch)
            .or_log(&ctd, "CreateContainer");
        cri.start(&c).or_log(&ctd, "StartContainer");
        let code = cri
            .wait_exited(&c, Duration::from_secs(300))
            .unwrap_or_else(|s| panic!("not exited: {s:?}\n{}", ctd.log()));
        assert_eq!(code, 0, "{}", ctd.log());
        let want = if annotations.is_empty() {
            "0"
        } else {
            "100000"
        };
        let lines = log_lines(&logs.join("fetch.log"));
        let stdout: Vec<&str> = lines
            .iter()
            .filter(|(stream, _)| stream == "stdout")
            .map(|(_, l)| l.as_str())
            .collect();
        assert_eq!(stdout, [want], "{name}: {lines:?}");
        if annotations.is_empty() {
            assert!(
                lines.iter().any(|(_, l)| l.contains("Connection refused")),
                "{lines:?}"
            );
        }
        cri.stop_pod(&pod).or_log(&ctd, "StopPodSandbox");
        cri.remove_pod(&pod).or_log(&ctd, "RemovePodSandbox");
    }
    nothing_left_of(&ctd.base);
}

/// What a pod-aware runtime stands on: a root file system mounted on the host under a VM's
/// share *after* the VM started reaches the guest (amvm's and virtiofsd's mounts are slaves of
/// the host's), and `amvm exec --root` runs a command chrooted into such a root with /proc,
/// /sys and /dev inside it: two roots in one VM, each with its own files; a root that is not
/// there, or not absolute, is refused with 125 and the reason.
#[test]
fn exec_root_runs_commands_in_roots_mounted_on_the_host_after_the_vm_started() {
    require_kvm();
    struct Cleanup {
        base: std::path::PathBuf,
        xdg: std::path::PathBuf,
    }
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::process::Command::new(amvm_bin())
                .args(["rm", "-f", "roots"])
                .env("XDG_RUNTIME_DIR", &self.xdg)
                .output();
            amvm_tests::cri::unmount_all_under(&self.base);
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }
    let base = std::path::PathBuf::from(format!("/dev/shm/amvm-roots-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (xdg, pod) = (base.join("xdg"), base.join("pod"));
    std::fs::create_dir_all(&xdg).unwrap();
    std::fs::create_dir_all(&pod).unwrap();
    let _cleanup = Cleanup {
        base: base.clone(),
        xdg: xdg.clone(),
    };
    let sh = |script: &str| {
        let st = std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .status()
            .unwrap();
        assert!(st.success(), "{script}");
    };
    // The pod's directory as a shared mount: what is mounted under it later propagates.
    let p = pod.display();
    sh(&format!("mount --bind {p} {p} && mount --make-shared {p}"));
    let amvm = |args: &[&str]| {
        amvm_tests::Outcome::from(
            std::process::Command::new(amvm_bin())
                .args(args)
                .env("XDG_RUNTIME_DIR", &xdg)
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap(),
        )
    };
    let share = format!("{p}:/pod:rw");
    let o = amvm(&[
        "create",
        "--name",
        "roots",
        "--timeout",
        "600",
        "-v",
        &share,
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    for c in ["c1", "c2"] {
        let r = pod.join(c).join("rootfs");
        std::fs::create_dir_all(&r).unwrap();
        sh(&format!("mount -t tmpfs {c} {}", r.display()));
        amvm_tests::busybox_root(&r);
        std::fs::write(r.join("etc/marker"), format!("I am {c}\n")).unwrap();
    }
    let script = "cat /etc/marker; test -e /proc/self/status && echo proc; \
                  test -c /dev/null && echo dev; test -d /sys/kernel && echo sys; \
                  test -e /pod || echo no pod";
    for c in ["c1", "c2"] {
        let root = format!("/pod/{c}/rootfs");
        // Twice: the second exec finds the root set up already.
        for _ in 0..2 {
            let o = amvm(&[
                "exec", "--root", &root, "-w", "/", "roots", "--", "sh", "-c", script,
            ]);
            assert_eq!(o.code, 0, "{}", o.stderr);
            assert_eq!(
                o.stdout_str(),
                format!("I am {c}\nproc\ndev\nsys\nno pod\n")
            );
        }
    }
    let o = amvm(&[
        "exec",
        "--root",
        "/pod/c3/rootfs",
        "-w",
        "/",
        "roots",
        "--",
        "true",
    ]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("the root /pod/c3/rootfs: No such file or directory"),
        "{}",
        o.stderr
    );
    let o = amvm(&["exec", "--root", "pod/c1", "roots", "--", "true"]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(
        o.stderr.contains("--root pod/c1: say an absolute"),
        "{}",
        o.stderr
    );
}

/// `cat /proc/sys/kernel/random/boot_id` differs from kernel to kernel: the same value from two
/// containers means one VM.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// Runtime handler `amvm`, amvm's pod-aware shim: a pod is one microVM. Its two containers run
/// on one kernel (one boot id, not the host's), each in its own root, and reach each other on
/// `localhost` and through an emptyDir; exit codes and logs are each container's own; ExecSync
/// runs in a container; StopContainer's SIGTERM reaches the process in the guest; ContainerStats
/// are each container's own; a container with `tty: true` runs on a terminal; a missing command fails its container alone (127, said in its log); a
/// pod without limits gets amvm's default VM, a second pod at the same time a VM of its own
/// sized by its resources; stopping and removing both leaves no VMM, virtiofsd, shim, mount or
/// sandbox behind.
#[test]
fn a_pod_is_one_microvm_whose_containers_share_localhost_and_an_emptydir() {
    require_kvm();
    let host_boot = std::fs::read_to_string(BOOT_ID).unwrap();
    let ctd = Containerd::start("shim", &amvm_bin());
    ctd.import_busybox();
    let mut cri = ctd.client();
    let logs = ctd.base.join("logs/pod");
    let config = pod_config("pod", &logs, &[]);
    let pod = cri.run_pod(&config, "amvm").or_log(&ctd, "RunPodSandbox");
    let empty = ctd.base.join("emptydir");
    std::fs::create_dir_all(&empty).unwrap();
    let mounts = [(empty.as_path(), "/shared")];
    let server = cri
        .create_mounting(
            &pod,
            &config,
            "server",
            &[
                "sh",
                "-c",
                "cat /proc/sys/kernel/random/boot_id; touch /only-in-server; \
                 echo ready > /shared/greeting; nc -l -p 7070 > /shared/got; echo server done",
            ],
            &mounts,
        )
        .or_log(&ctd, "CreateContainer");
    let client = cri
        .create_mounting(
            &pod,
            &config,
            "client",
            &[
                "sh",
                "-c",
                "while ! test -e /shared/greeting; do sleep 0.1; done; sleep 1; \
                 cat /proc/sys/kernel/random/boot_id; \
                 echo over localhost | nc 127.0.0.1 7070; \
                 test -e /only-in-server && echo one root || echo own root; exit 5",
            ],
            &mounts,
        )
        .or_log(&ctd, "CreateContainer");
    for c in [&server, &client] {
        cri.start(c).or_log(&ctd, "StartContainer");
    }
    let wait = |cri: &mut amvm_tests::cri::Cri, id: &str| {
        cri.wait_exited(id, Duration::from_secs(300))
            .unwrap_or_else(|s| panic!("not exited: {s:?}\n{}", ctd.log()))
    };
    assert_eq!(wait(&mut cri, &server), 0, "{}", ctd.log());
    assert_eq!(wait(&mut cri, &client), 5, "{}", ctd.log());
    let out = |name: &str| -> Vec<String> {
        log_lines(&logs.join(format!("{name}.log")))
            .into_iter()
            .filter(|(s, _)| s == "stdout")
            .map(|(_, l)| l)
            .collect()
    };
    // Waits until a running container has written its first line.
    let first_output = |name: &str| {
        let until = Instant::now() + Duration::from_secs(300);
        while out(name).is_empty() {
            assert!(
                Instant::now() < until,
                "no output from {name}: {}",
                ctd.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let (s, c) = (out("server"), out("client"));
    assert_eq!(s.len(), 2, "{s:?}");
    assert_eq!(s[1], "server done");
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(s[0], c[0], "two kernels: {s:?} {c:?}");
    assert_ne!(s[0], host_boot.trim(), "the host's kernel");
    assert_eq!(c[1], "own root");
    assert_eq!(
        std::fs::read_to_string(empty.join("got")).unwrap(),
        "over localhost\n"
    );

    // ExecSync into a running container, on the same kernel.
    let long = cri
        .create(&pod, &config, "long", &["sleep", "600"])
        .or_log(&ctd, "CreateContainer");
    cri.start(&long).or_log(&ctd, "StartContainer");
    let (code, stdout, stderr) = cri
        .exec_sync(
            &long,
            &[
                "sh",
                "-c",
                "cat /proc/sys/kernel/random/boot_id; echo oops >&2; exit 4",
            ],
            300,
        )
        .or_log(&ctd, "ExecSync");
    assert_eq!(
        (code, stdout.trim(), stderr.as_str()),
        (4, s[0].as_str(), "oops\n")
    );
    // A pod that sets no limits gets amvm's default VM: 512 MiB, 1 vCPU.
    let (code, stdout, _) = cri
        .exec_sync(
            &long,
            &["sh", "-c", "nproc; grep MemTotal /proc/meminfo"],
            300,
        )
        .or_log(&ctd, "ExecSync");
    assert_eq!(code, 0);
    let (cpus, mem) = size_of(&stdout);
    assert_eq!(cpus, 1, "{stdout}");
    assert!((400..=512).contains(&mem), "{stdout}");

    // StopContainer: its SIGTERM reaches the process in the guest, which ends as it chooses.
    let trap = cri
        .create(
            &pod,
            &config,
            "trap",
            &[
                "sh",
                "-c",
                "trap 'echo got TERM; exit 7' TERM; echo waiting; while :; do sleep 1; done",
            ],
        )
        .or_log(&ctd, "CreateContainer");
    cri.start(&trap).or_log(&ctd, "StartContainer");
    first_output("trap");
    cri.stop(&trap, 60).or_log(&ctd, "StopContainer");
    assert_eq!(wait(&mut cri, &trap), 7, "{}", ctd.log());
    assert_eq!(out("trap"), ["waiting", "got TERM"]);

    // ContainerStats: the container's own CPU time and memory (a 20 MB string held by awk).
    let busy = cri
        .create(
            &pod,
            &config,
            "busy",
            &[
                "sh",
                "-c",
                "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; \
                 exec awk 'BEGIN { s = sprintf(\"%20000000s\", \"\"); print \"ready\"; \
                 fflush(); system(\"sleep 600\") }'",
            ],
        )
        .or_log(&ctd, "CreateContainer");
    cri.start(&busy).or_log(&ctd, "StartContainer");
    first_output("busy");
    let (cpu_ns, working_set) = cri.stats(&busy).or_log(&ctd, "ContainerStats");
    assert!(cpu_ns > 1_000_000, "{cpu_ns} ns");
    assert!(
        (19_000_000..200_000_000).contains(&working_set),
        "{working_set} bytes"
    );
    // The sleeping container's are its own: far less memory.
    let (_, long_set) = cri.stats(&long).or_log(&ctd, "ContainerStats");
    assert!(long_set < 10_000_000, "{long_set} bytes");

    // A container with a terminal (`tty: true`): its process runs on one, 24x80 until resized.
    let tty = cri
        .create_tty(
            &pod,
            &config,
            "tty",
            &[
                "sh",
                "-c",
                "tty; test -t 1 && echo on a terminal; stty size",
            ],
        )
        .or_log(&ctd, "CreateContainer");
    cri.start(&tty).or_log(&ctd, "StartContainer");
    assert_eq!(wait(&mut cri, &tty), 0, "{}", ctd.log());
    let lines: Vec<String> = out("tty")
        .iter()
        .map(|l| l.trim_end().to_string())
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].starts_with("/dev/pts/"), "{lines:?}");
    assert_eq!(lines[1..], ["on a terminal", "24 80"], "{lines:?}");

    // A command that is not there fails that container, and only it.
    let missing = cri
        .create(&pod, &config, "missing", &["/no/such/command"])
        .or_log(&ctd, "CreateContainer");
    cri.start(&missing).or_log(&ctd, "StartContainer");
    assert_eq!(wait(&mut cri, &missing), 127, "{}", ctd.log());
    let lines = log_lines(&logs.join("missing.log"));
    assert!(
        lines
            .iter()
            .any(|(stream, l)| stream == "stderr"
                && l.ends_with("/no/such/command: command not found")),
        "{lines:?}"
    );
    let s = cri.status(&long);
    assert_eq!(
        s.state,
        k8s_cri::v1::ContainerState::ContainerRunning as i32,
        "{s:?}"
    );

    // A second pod, at the same time: a VM of its own, sized by the pod's resources (what a
    // kubelet passes: the sum of its containers' limits and the pod's overhead).
    let logs2 = ctd.base.join("logs/other");
    let mut config2 = pod_config("other", &logs2, &[]);
    config2.linux.as_mut().unwrap().resources = Some(k8s_cri::v1::LinuxContainerResources {
        memory_limit_in_bytes: 256 << 20,
        cpu_quota: 150_000,
        cpu_period: 100_000,
        ..Default::default()
    });
    let other = cri.run_pod(&config2, "amvm").or_log(&ctd, "RunPodSandbox");
    let one = cri
        .create(
            &other,
            &config2,
            "one",
            &[
                "sh",
                "-c",
                "cat /proc/sys/kernel/random/boot_id; nproc; grep MemTotal /proc/meminfo",
            ],
        )
        .or_log(&ctd, "CreateContainer");
    cri.start(&one).or_log(&ctd, "StartContainer");
    assert_eq!(wait(&mut cri, &one), 0, "{}", ctd.log());
    let o = log_lines(&logs2.join("one.log"));
    assert_eq!(o.len(), 3, "{o:?}");
    assert_ne!(o[0].1, s_boot(&logs), "one VM for two pods");
    // 256 MiB and 1.5 CPUs: a VM of 256 + 64 MiB (amvm's headroom) and 2 vCPUs.
    let (cpus, mem) = size_of(&format!("{}\n{}", o[1].1, o[2].1));
    assert_eq!(cpus, 2, "{o:?}");
    assert!((256..=320).contains(&mem), "{o:?}");

    for p in [&pod, &other] {
        cri.stop_pod(p).or_log(&ctd, "StopPodSandbox");
    }
    let s = cri.status(&long);
    assert_eq!(
        s.state,
        k8s_cri::v1::ContainerState::ContainerExited as i32,
        "{s:?}"
    );
    for p in [&pod, &other] {
        cri.remove_pod(p).or_log(&ctd, "RemovePodSandbox");
    }
    assert!(cri.pods().is_empty());
    nothing_left_of(&ctd.base);
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let state = ctd.base.join("state").display().to_string();
    assert!(!mounts.contains(&state), "mounts left: {mounts}");
}

/// `nproc` and MemTotal (in MiB) from `nproc; grep MemTotal /proc/meminfo`.
fn size_of(out: &str) -> (u32, u64) {
    let mut lines = out.lines();
    let cpus = lines.next().and_then(|l| l.trim().parse().ok()).expect(out);
    let kib: u64 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect(out);
    (cpus, kib / 1024)
}

/// The boot id the first pod's server container printed.
fn s_boot(logs: &std::path::Path) -> String {
    log_lines(&logs.join("server.log"))[0].1.clone()
}
