//! amvm as an OCI runtime (issue 25), driven by the real engines of Debian 12 (`images/setup`
//! installs them): podman, and dockerd with its containerd, each started by the test inside the
//! test bed with storage of its own, on an image imported from a busybox root file system the
//! test builds (no registry is reachable). Every container is a microVM: its kernel is amvm's
//! guest kernel, not the host's. The engines are named by their Debian paths: another `docker`
//! earlier on PATH (a newer client) is not what is tested.

use amvm_tests::{amvm_bin, busybox_root, leftovers, require_kvm, run_vm, Outcome};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const IMAGE: &str = "localhost/amvm-busybox:latest";

/// One podman of the test's own: storage, run and temp directories under /dev/shm (the test
/// bed's /tmp is an overlayfs), and the runtime: a link named amvm-runc to the amvm under test.
struct Podman {
    base: PathBuf,
}

/// [`busybox_root`] at `base/rootfs`, and packed as `base/rootfs.tar` for an engine's import.
fn busybox_tar(base: &Path) -> PathBuf {
    let root = base.join("rootfs");
    busybox_root(&root);
    let tar = base.join("rootfs.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    tar
}

impl Podman {
    fn new(name: &str) -> Podman {
        require_kvm();
        assert!(
            Path::new("/usr/bin/podman").exists(),
            "podman is not installed: images/setup installs it (Debian's podman)"
        );
        let base = PathBuf::from(format!("/dev/shm/amvm-oci-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        for d in ["bin", "tmp", "libpod-tmp", "networks"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        std::os::unix::fs::symlink(amvm_bin(), base.join("bin/amvm-runc")).unwrap();
        // File locks of its own: podmans side by side would otherwise share /dev/shm/libpod_lock.
        std::fs::write(
            base.join("containers.conf"),
            "[engine]\nlock_type = \"file\"\n",
        )
        .unwrap();
        let tar = busybox_tar(&base);
        let p = Podman { base };
        let out = p.podman(&["import", "-q", tar.to_str().unwrap(), IMAGE]);
        assert_eq!(out.code, 0, "podman import: {}", out.stderr);
        p
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let b = |d: &str| self.base.join(d).display().to_string();
        let mut c = Command::new("/usr/bin/podman");
        c.args(["--root", &b("storage"), "--runroot", &b("run")])
            .args(["--tmpdir", &b("libpod-tmp"), "--storage-driver", "vfs"])
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            // Its network configuration and lock of its own: the emulated host's /etc, where
            // podman keeps them by default, is read-only (and nothing is left in the host's).
            .args(["--network-config-dir", &b("networks")])
            .args(["--runtime", &b("bin/amvm-runc")])
            .args(args)
            .env("TMPDIR", self.base.join("tmp"))
            .env("CONTAINERS_CONF", self.base.join("containers.conf"))
            .stdin(Stdio::null());
        c
    }

    fn podman(&self, args: &[&str]) -> Outcome {
        Outcome::from(self.cmd(args).output().expect("spawning podman"))
    }

    /// `podman run --rm --network none [opts] IMAGE sh -c script`.
    fn run_sh(&self, opts: &[&str], script: &str) -> Outcome {
        let mut args = vec!["run", "--rm", "--network", "none"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[IMAGE, "sh", "-c", script]);
        self.podman(&args)
    }
}

impl Podman {
    /// `podman ARGS` on a pseudo-terminal of ROWS x COLS (tests/standin/pty_run.py): its exit
    /// status and what it wrote to the terminal (without carriage returns).
    fn on_terminal(&self, rows: u16, cols: u16, args: &[&str]) -> (Option<i32>, String) {
        let pty_run = concat!(env!("CARGO_MANIFEST_DIR"), "/standin/pty_run.py");
        let c = self.cmd(args);
        let out = Command::new("python3")
            .arg(pty_run)
            .args([rows.to_string(), cols.to_string()])
            .arg("--")
            .arg("/usr/bin/podman")
            .args(c.get_args())
            .env("TMPDIR", self.base.join("tmp"))
            .env("CONTAINERS_CONF", self.base.join("containers.conf"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
        (out.status.code(), text)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.podman(&["rm", "--all", "--force", "--time", "0"]);
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// Within a few seconds, nothing of the container is left: no process mentions its storage
/// (its VMM's virtiofsd serves the root from there), no state under amvm-runc's root.
fn nothing_left_of(p: &Podman, id: &str) {
    let needle = p.base.join("storage").display().to_string();
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let procs = leftovers::processes_with(&needle);
        let state = Path::new("/run/amvm-runc").join(id);
        if procs.is_empty() && !state.exists() {
            return;
        }
        assert!(
            Instant::now() < until,
            "left behind: {procs:?} {}",
            state.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn podman_runs_a_container_on_amvms_kernel_with_its_output_and_exit_status() {
    let p = Podman::new("run");
    let guest_kernel = run_vm(&[], &["uname", "-r"]);
    assert_eq!(guest_kernel.code, 0, "{}", guest_kernel.stderr);
    let guest_kernel = guest_kernel.stdout_str();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(guest_kernel, host_kernel, "the guest kernel is amvm's own");
    let out = p.run_sh(
        &[],
        "echo out; echo err >&2; uname -r; cat /proc/net/dev | tail -n +3 | cut -d: -f1; exit 3",
    );
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert_eq!(
        out.stdout_str(),
        format!("out\n{guest_kernel}    lo\n"),
        "stdout (the VM has no network interface but lo): {}",
        out.stderr
    );
    assert!(out.stderr.contains("err\n"), "{}", out.stderr);
    // Root keeps the capabilities the engine gives it (podman's default set), none with
    // --cap-drop ALL; the environment is the engine's, exactly (nothing of amvm's defaults).
    let caps = |opts: &[&str]| {
        let out = p.run_sh(
            opts,
            "grep CapBnd /proc/self/status; env | grep -c -e ^LANG= -e ^TERM=dumb; true",
        );
        assert_eq!(out.code, 0, "{}", out.stderr);
        out.stdout_str()
    };
    assert_eq!(
        caps(&["--cap-drop", "ALL"]),
        "CapBnd:\t0000000000000000\n0\n"
    );
    let default = caps(&[]);
    let mask = u64::from_str_radix(
        default
            .lines()
            .next()
            .unwrap()
            .trim_start_matches("CapBnd:\t"),
        16,
    )
    .unwrap();
    assert!(
        mask & 1 != 0 && mask & (1 << 21) == 0,
        "CHOWN, not SYS_ADMIN: {default}"
    );
    // A command that is not there: 127, as with runc.
    let out = p.podman(&["run", "--rm", "--network", "none", IMAGE, "no-such-command"]);
    assert_eq!(out.code, 127, "{}", out.stderr);
}

#[test]
fn a_read_only_root_tmpfs_user_groups_ulimits_and_volume_are_honoured() {
    let p = Podman::new("ro");
    let vol = p.base.join("vol");
    std::fs::create_dir_all(&vol).unwrap();
    std::fs::write(vol.join("in"), "written before start\n").unwrap();
    let st = Command::new("chmod").arg("777").arg(&vol).status().unwrap();
    assert!(st.success());
    let v = format!("{}:/data", vol.display());
    let out = p.run_sh(
        &[
            "--read-only",
            "--tmpfs",
            "/tmp:rw,noexec,nosuid,size=64m",
            "--user",
            "65534:65534",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "--group-add",
            "4242",
            "--ulimit",
            "nofile=321:654",
            "-v",
            &v,
        ],
        r#"touch /x 2>&1; id -u; id -g; id -G | tr ' ' '\n' | grep -x 4242
           grep 'open files' /proc/self/limits | tr -s ' ' | cut -d' ' -f4,5
           grep ' /tmp ' /proc/mounts | cut -d' ' -f4
           grep NoNewPrivs /proc/self/status
           cat /data/in; echo "written inside" > /data/out
           printf '#!/bin/sh\necho ran\n' > /tmp/s; chmod +x /tmp/s; /tmp/s 2>/dev/null || echo noexec
           dd if=/dev/zero of=/tmp/big bs=1M count=80 2>/dev/null || echo full at $(stat -c %s /tmp/big)"#,
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = out.stdout_str();
    let (head, _) = text.rsplit_once("full at ").unwrap_or((&text, ""));
    assert_eq!(
        head,
        "touch: /x: Read-only file system\n65534\n65534\n4242\n321 654\n\
         rw,nosuid,nodev,noexec,relatime,size=65536k\nNoNewPrivs:\t1\n\
         written before start\nnoexec\n",
        "{}",
        out.stderr
    );
    // The 64 MiB cap: the write stopped there (a little below: tmpfs keeps some for itself).
    let full: u64 = text
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("full at "))
        .unwrap_or_else(|| panic!("the 80 MiB write was not stopped: {text}"))
        .parse()
        .unwrap();
    assert!(
        (60 << 20..=64 << 20).contains(&full),
        "stopped at {full} bytes"
    );
    assert_eq!(
        std::fs::read_to_string(vol.join("out")).unwrap(),
        "written inside\n"
    );
}

#[test]
fn exec_stop_and_kill_work_on_a_running_container() {
    let p = Podman::new("exec");
    let out = p.podman(&[
        "run",
        "-d",
        "--name",
        "long",
        "--network",
        "none",
        IMAGE,
        "sleep",
        "600",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let id = out.stdout_str().trim().to_string();
    let out = p.podman(&[
        "exec",
        "long",
        "sh",
        "-c",
        "echo in the container; ps -o comm | grep -c sleep; exit 4",
    ]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (4, "in the container\n1\n"),
        "{}",
        out.stderr
    );
    // podman cp (put_archive / get_archive) into and out of the running container: the files
    // are the container's, in the root its VM sees, and nothing lands in the host's own /.
    let file = p.base.join("to-copy");
    std::fs::write(&file, "copied in\n").unwrap();
    let host_tmp_before = Path::new("/tmp/amvm-oci-copied").exists();
    let out = p.podman(&["cp", file.to_str().unwrap(), "long:/tmp/amvm-oci-copied"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        Path::new("/tmp/amvm-oci-copied").exists(),
        host_tmp_before,
        "podman cp wrote into the host's /tmp"
    );
    let out = p.podman(&[
        "exec",
        "long",
        "sh",
        "-c",
        "cat /tmp/amvm-oci-copied; echo made inside > /root/out",
    ]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "copied in\n"),
        "{}",
        out.stderr
    );
    let back = p.base.join("copied-out");
    let out = p.podman(&["cp", "long:/root/out", back.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "made inside\n");
    // podman exec -it: a terminal of the caller's size.
    let (code, text) = p.on_terminal(
        33,
        90,
        &["exec", "-it", "long", "sh", "-c", "tty; stty size; exit 3"],
    );
    assert_eq!(code, Some(3), "{text}");
    assert!(
        text.contains("/dev/pts/") && text.contains("33 90\n"),
        "{text}"
    );
    // podman pause / unpause: runc's pause and resume, the sandbox's vCPUs stopped and let go;
    // state says paused meanwhile, and the container's process is the same after.
    let out = p.podman(&["pause", "long"]);
    assert_eq!(out.code, 0, "podman pause: {}", out.stderr);
    let out = p.podman(&["inspect", "long", "--format", "{{.State.Status}}"]);
    assert_eq!(out.stdout_str().trim(), "paused", "{}", out.stderr);
    let out = p.podman(&["unpause", "long"]);
    assert_eq!(out.code, 0, "podman unpause: {}", out.stderr);
    let out = p.podman(&["exec", "long", "sh", "-c", "ps -o comm | grep -c sleep"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "1\n"),
        "{}",
        out.stderr
    );
    // docker stop / podman stop: SIGTERM reaches the process (sleep dies of it: 143).
    let out = p.podman(&["stop", "--time", "20", "long"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = p.podman(&["inspect", "long", "--format", "{{.State.ExitCode}}"]);
    assert_eq!(out.stdout_str().trim(), "143", "{}", out.stderr);
    let out = p.podman(&["rm", "long"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    nothing_left_of(&p, &id);

    // podman kill: SIGKILL, 137.
    let out = p.podman(&[
        "run",
        "-d",
        "--name",
        "killme",
        "--network",
        "none",
        IMAGE,
        "sleep",
        "600",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let id = out.stdout_str().trim().to_string();
    let out = p.podman(&["kill", "killme"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = p.podman(&["wait", "killme"]);
    assert_eq!(out.stdout_str().trim(), "137", "{}", out.stderr);
    let out = p.podman(&["rm", "killme"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    nothing_left_of(&p, &id);
}

#[test]
fn pids_memory_and_cpu_limits_size_the_vm() {
    let p = Podman::new("limits");
    // Forks sleepers until a fork fails (the subshell dies of it), then reads how many it made
    // without forking again.
    let out = p.run_sh(
        &["--pids-limit", "64", "--memory", "128m", "--cpus", "2"],
        r#"(i=0; while [ $i -lt 200 ]; do sleep 60 & i=$((i+1)); echo $i > /tmp/n; done) 2>/dev/null
           read n < /tmp/n; echo made $n
           while read k v u; do [ "$k" = MemTotal: ] && echo $((v >> 10)); done < /proc/meminfo
           n=0; while read k rest; do [ "$k" = processor ] && n=$((n+1)); done < /proc/cpuinfo; echo $n"#,
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = out.stdout_str();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let made: u32 = lines[0].strip_prefix("made ").unwrap().parse().unwrap();
    assert!(
        (40..64).contains(&made),
        "the fork loop stops before 64: {made}"
    );
    // Guest RAM is the limit plus amvm's headroom (64 MiB); the kernel keeps some.
    let mem: u32 = lines[1].parse().unwrap();
    assert!((128..192).contains(&mem), "MemTotal {mem} MiB");
    assert_eq!(lines[2], "2", "vCPUs from --cpus 2");
}

/// docs/engines.md: the `io.amvm.egress` annotation names a host unix socket the container
/// reaches through amvm's egress relay (127.0.0.1:4700 in the guest), and nothing else.
#[test]
fn the_egress_annotation_gives_the_container_its_egress() {
    use amvm_tests::egress_server::{EgressServer, Pace};
    let p = Podman::new("egress");
    let egress = EgressServer::start("oci-annotation", Pace::Fast);
    let annotation = format!("io.amvm.egress={}", egress.path_str());
    let out = p.run_sh(
        &["--annotation", &annotation],
        "printf 'DOWN 100000\\n' | nc 127.0.0.1 4700 | wc -c",
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout_str().trim(), "100000", "{}", out.stderr);
    // Without the annotation there is no egress at all.
    let out = p.run_sh(&[], "printf 'DOWN 10\\n' | nc 127.0.0.1 4700 | wc -c");
    assert_eq!(out.stdout_str().trim(), "0", "{}", out.stderr);
}

#[test]
fn run_it_gives_a_terminal_of_the_callers_size() {
    let p = Podman::new("tty");
    let (code, text) = p.on_terminal(
        30,
        100,
        &[
            "run",
            "--rm",
            "-it",
            "--network",
            "none",
            IMAGE,
            "sh",
            "-c",
            "tty; stty size; exit 5",
        ],
    );
    assert_eq!(code, Some(5), "{text}");
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("30 100\n"), "{text}");
}

#[test]
fn amvm_run_rootfs_runs_on_a_whole_root_of_its_own() {
    let p = Podman::new("rootfs");
    let root = p.base.join("rootfs");
    let r = root.display().to_string();
    let out = run_vm(
        &["--rootfs", &r, "--user", "0:0"],
        &[
            "sh",
            "-c",
            "cat /etc/passwd | cut -d: -f1; ls /bin/busybox; touch /x 2>&1; echo $PWD",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        out.stdout_str(),
        "root\nnobody\n/bin/busybox\ntouch: /x: Read-only file system\n/\n"
    );
    // :rw lets the guest write the root itself.
    let out = run_vm(
        &["--rootfs", &format!("{r}:rw"), "--user", "0:0"],
        &["sh", "-c", "echo kept > /root/note"],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        std::fs::read_to_string(root.join("root/note")).unwrap(),
        "kept\n"
    );
    // Bad input: one line, 125.
    let out = amvm_tests::amvm(["run", "--rootfs", "/nonexistent", "--", "true"], &[]);
    assert_eq!(out.code, 125);
    assert!(
        out.stderr.contains("--rootfs /nonexistent"),
        "{}",
        out.stderr
    );
}

/// A dockerd of the test's own (with the containerd it starts), amvm registered as the runtime
/// `amvm`. dockerd insists on writing /etc/docker/key.json: it runs in a mount namespace of its
/// own whose /etc is an overlay over the real one, so nothing of the host's /etc changes.
struct Docker {
    base: PathBuf,
    daemon: std::process::Child,
}

impl Docker {
    fn new(name: &str) -> Docker {
        require_kvm();
        assert!(
            Path::new("/usr/sbin/dockerd").exists() && Path::new("/usr/bin/containerd").exists(),
            "dockerd or containerd is not installed: images/setup installs them (Debian's docker.io)"
        );
        let base = PathBuf::from(format!(
            "/dev/shm/amvm-docker-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&base);
        for d in ["bin", "tmp", "etc-up", "etc-work", "client"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        std::os::unix::fs::symlink(amvm_bin(), base.join("bin/amvm-runc")).unwrap();
        let b = |d: &str| base.join(d).display().to_string();
        let script = format!(
            "mount -t overlay overlay -o lowerdir=/etc,upperdir={up},workdir={work} /etc && \
             mkdir -p /etc/docker && exec /usr/sbin/dockerd --data-root {data} --exec-root {exec} \
             --pidfile {pid} -H unix://{sock} --bridge none --iptables=false --ip-masq=false \
             --ip-forward=false --storage-driver vfs --add-runtime amvm={runtime}",
            up = b("etc-up"),
            work = b("etc-work"),
            data = b("data"),
            exec = b("exec"),
            pid = b("dockerd.pid"),
            sock = b("docker.sock"),
            runtime = b("bin/amvm-runc"),
        );
        let log = std::fs::File::create(base.join("dockerd.log")).unwrap();
        let daemon = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env("TMPDIR", base.join("tmp"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting dockerd");
        let d = Docker { base, daemon };
        let until = Instant::now() + Duration::from_secs(120);
        loop {
            if d.docker(&["version", "--format", "{{.Server.Version}}"])
                .code
                == 0
            {
                break;
            }
            assert!(
                Instant::now() < until,
                "dockerd did not come up: {}",
                std::fs::read_to_string(d.base.join("dockerd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        let tar = busybox_tar(&d.base);
        let out = d.docker(&["import", tar.to_str().unwrap(), "amvm-busybox"]);
        assert_eq!(out.code, 0, "docker import: {}", out.stderr);
        d
    }

    fn docker(&self, args: &[&str]) -> Outcome {
        let sock = format!("unix://{}", self.base.join("docker.sock").display());
        Outcome::from(
            Command::new("/usr/bin/docker")
                .args(["-H", &sock])
                .args(args)
                .env("DOCKER_CONFIG", self.base.join("client"))
                .stdin(Stdio::null())
                .output()
                .expect("spawning docker"),
        )
    }
}

impl Drop for Docker {
    fn drop(&mut self) {
        let ps = self.docker(&["ps", "-aq"]);
        for id in ps.stdout_str().split_whitespace() {
            let _ = self.docker(&["rm", "-f", id]);
        }
        if let Ok(pid) = std::fs::read_to_string(self.base.join("dockerd.pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                // SAFETY: kill(2) of the dockerd this test started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        let until = Instant::now() + Duration::from_secs(20);
        while self.daemon.try_wait().ok().flatten().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

#[test]
fn docker_runs_execs_stops_and_kills_containers_in_amvm() {
    let d = Docker::new("basic");
    let out = d.docker(&[
        "run",
        "--rm",
        "--runtime",
        "amvm",
        "--network",
        "none",
        "amvm-busybox",
        "sh",
        "-c",
        "echo out; echo err >&2; uname -r; exit 3",
    ]);
    assert_eq!(out.code, 3, "{}", out.stderr);
    let text = out.stdout_str();
    assert!(text.starts_with("out\n"), "{text}");
    assert_eq!(
        &text[4..],
        amvms_kernel(),
        "the kernel amvm boots, not another"
    );
    assert!(out.stderr.contains("err\n"), "{}", out.stderr);

    let out = d.docker(&[
        "run",
        "-d",
        "--name",
        "long",
        "--runtime",
        "amvm",
        "--network",
        "none",
        "amvm-busybox",
        "sleep",
        "600",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = d.docker(&["exec", "long", "sh", "-c", "echo in the container; exit 4"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (4, "in the container\n"),
        "{}",
        out.stderr
    );
    let out = d.docker(&["stop", "-t", "20", "long"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = d.docker(&["inspect", "long", "--format", "{{.State.ExitCode}}"]);
    assert_eq!(out.stdout_str().trim(), "143", "{}", out.stderr);
    let out = d.docker(&[
        "run",
        "-d",
        "--name",
        "killme",
        "--runtime",
        "amvm",
        "--network",
        "none",
        "amvm-busybox",
        "sleep",
        "600",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = d.docker(&["kill", "killme"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = d.docker(&["wait", "killme"]);
    assert_eq!(out.stdout_str().trim(), "137", "{}", out.stderr);
    for c in ["long", "killme"] {
        let out = d.docker(&["rm", c]);
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    // The VMs' virtiofsd serve the roots from the vfs store: none may be left.
    let needle = d.base.join("data/vfs/").display().to_string();
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let procs = leftovers::processes_with(&needle);
        if procs.is_empty() {
            break;
        }
        assert!(Instant::now() < until, "left behind: {procs:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The seed platform's sandbox, as its Docker backend starts it (`SANDBOX_RUNTIME=amvm`): every
/// setting at once, in one container run by dockerd with `--runtime=amvm`.
#[test]
fn docker_runs_the_seed_platforms_sandbox_settings_together() {
    let d = Docker::new("seed");
    let ws = d.base.join("workspace");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("task.txt"), "fix the test\n").unwrap();
    let st = Command::new("chmod").arg("777").arg(&ws).status().unwrap();
    assert!(st.success());
    let v = format!("{}:/workspace", ws.display());
    let out = d.docker(&[
        "run",
        "--rm",
        "--runtime=amvm",
        "--network",
        "none",
        "--read-only",
        "--tmpfs",
        "/tmp:rw,noexec,nosuid,size=64m",
        "--user",
        "65534:65534",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--memory",
        "256m",
        "--cpus",
        "1",
        "--pids-limit",
        "64",
        "-v",
        &v,
        "-w",
        "/workspace",
        "amvm-busybox",
        "sh",
        "-c",
        r#"id -u; pwd; cat task.txt; echo done > result.txt
           touch /x 2>/dev/null || echo read-only root
           grep NoNewPrivs /proc/self/status; grep CapEff /proc/self/status
           grep ' /tmp ' /proc/mounts | cut -d' ' -f4
           cat /sys/class/net/*/operstate 2>/dev/null | wc -l
           (i=0; while [ $i -lt 200 ]; do sleep 60 & i=$((i+1)); echo $i > /tmp/n; done) 2>/dev/null
           read n < /tmp/n; [ "$n" -lt 64 ] && echo forks stopped below 64
           while read k v u; do [ "$k" = MemTotal: ] && echo mem $((v >> 10)); done < /proc/meminfo
           n=0; while read k rest; do [ "$k" = processor ] && n=$((n+1)); done < /proc/cpuinfo
           echo cpus $n"#,
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = out.stdout_str();
    let (head, sizes) = text.split_at(text.find("mem ").unwrap_or(text.len()));
    assert_eq!(
        head,
        "65534\n/workspace\nfix the test\nread-only root\nNoNewPrivs:\t1\n\
         CapEff:\t0000000000000000\nrw,nosuid,nodev,noexec,relatime,size=65536k\n1\n\
         forks stopped below 64\n",
        "{}",
        out.stderr
    );
    // --memory 256m and --cpus 1 size the VM: its RAM is the limit plus amvm's headroom
    // (64 MiB), less what the kernel keeps.
    let mem: u32 = sizes
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("mem "))
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        (256..320).contains(&mem),
        "MemTotal {mem} MiB from --memory 256m"
    );
    assert!(sizes.ends_with("cpus 1\n"), "{text}");
    assert_eq!(
        std::fs::read_to_string(ws.join("result.txt")).unwrap(),
        "done\n"
    );
}

/// containerd's own client: `ctr run` with the runc shim (io.containerd.runc.v2) pointed at
/// amvm-runc, on a root file system given directly (`--rootfs`), against a containerd the test
/// starts with state of its own.
#[test]
fn containerd_runs_a_container_in_amvm_through_the_runc_shim() {
    require_kvm();
    assert!(
        Path::new("/usr/bin/containerd").exists() && Path::new("/usr/bin/ctr").exists(),
        "containerd is not installed: images/setup installs it (Debian's containerd)"
    );
    let base = PathBuf::from(format!("/dev/shm/amvm-ctr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("bin")).unwrap();
    std::os::unix::fs::symlink(amvm_bin(), base.join("bin/amvm-runc")).unwrap();
    let root = base.join("rootfs");
    busybox_root(&root);
    let sock = base.join("containerd.sock");
    let log = std::fs::File::create(base.join("containerd.log")).unwrap();
    let mut daemon = Command::new("/usr/bin/containerd")
        .arg("--address")
        .arg(&sock)
        .arg("--root")
        .arg(base.join("root"))
        .arg("--state")
        .arg(base.join("state"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting containerd");
    let ctr = |args: &[&str]| {
        Outcome::from(
            Command::new("/usr/bin/ctr")
                .arg("--address")
                .arg(&sock)
                .args(args)
                .stdin(Stdio::null())
                .output()
                .expect("spawning ctr"),
        )
    };
    let until = Instant::now() + Duration::from_secs(60);
    while ctr(&["version"]).code != 0 {
        assert!(Instant::now() < until, "containerd did not come up");
        std::thread::sleep(Duration::from_millis(300));
    }
    let runtime = base.join("bin/amvm-runc").display().to_string();
    let r = root.display().to_string();
    let out = ctr(&[
        "run",
        "--rm",
        "--runtime",
        "io.containerd.runc.v2",
        "--runc-binary",
        &runtime,
        "--rootfs",
        &r,
        "ctr-amvm",
        "sh",
        "-c",
        "echo from ctr; uname -r; exit 6",
    ]);
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let text = out.stdout_str();
    let _ = std::fs::remove_dir_all(&base);
    assert_eq!(out.code, 6, "{text} {}", out.stderr);
    assert!(text.starts_with("from ctr\n"), "{text}");
    assert_ne!(&text["from ctr\n".len()..], host_kernel);
    assert_eq!(
        &text["from ctr\n".len()..],
        amvms_kernel(),
        "the kernel amvm boots"
    );
}

/// `uname -r` of amvm's own guest kernel (one `amvm run`), once per test binary.
fn amvms_kernel() -> String {
    static KERNEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    KERNEL
        .get_or_init(|| {
            let o = run_vm(&[], &["uname", "-r"]);
            assert_eq!(o.code, 0, "{}", o.stderr);
            let k = o.stdout_str();
            let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
            assert_ne!(k, host, "amvm's guest kernel is its own");
            k
        })
        .clone()
}
