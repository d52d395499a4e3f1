//! Kubernetes' Container Runtime Interface, driven for real: Debian's containerd with its CRI
//! plugin, started by the test with state, socket and configuration of its own, and a CRI
//! client on the published protobufs (the `k8s-cri` crate over tonic): what a kubelet sends,
//! without a kubelet.
//!
//! The pod sandbox image and the containers' image are one image the test builds from the
//! host's static busybox and imports with `ctr` (no registry is reachable here).

use crate::Outcome;
use k8s_cri::v1 as api;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The image every pod and container here runs: busybox with a command that never ends by
/// itself, so it serves as the pod's sandbox ("pause") image too.
pub const IMAGE: &str = "localhost/amvm-cri-busybox:latest";

/// A containerd of the test's own under `base`, with three CRI runtime handlers: `runc`
/// (Debian's runc), `amvm` (amvm's pod-aware shim, containerd-shim-amvm-v2: one VM per pod)
/// and `amvm-runc` (the runc shim pointed at amvm-runc: one VM per container), as
/// docs/engines.md shows.
pub struct Containerd {
    pub base: PathBuf,
    pub sock: PathBuf,
    daemon: Child,
}

impl Containerd {
    /// Start it and wait until its CRI service answers; `amvm` is the amvm binary under test.
    pub fn start(name: &str, amvm: &Path) -> Containerd {
        assert!(
            Path::new("/usr/bin/containerd").exists() && Path::new("/usr/bin/ctr").exists(),
            "containerd is not installed: images/setup installs it (Debian's containerd)"
        );
        // /dev/shm: the test bed's /tmp is an overlayfs, where the overlayfs snapshotter cannot
        // stack its layers.
        let base = PathBuf::from(format!("/dev/shm/amvm-cri-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        for d in ["bin", "cni", "logs"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        let runc = base.join("bin/amvm-runc");
        std::os::unix::fs::symlink(amvm, &runc).unwrap();
        // The shim beside the amvm under test; it finds that amvm beside itself.
        let shim = amvm.with_file_name("containerd-shim-amvm-v2");
        assert!(
            shim.exists(),
            "{} not built: cargo build -p amvm builds it",
            shim.display()
        );
        std::os::unix::fs::symlink(&shim, base.join("bin/containerd-shim-amvm-v2")).unwrap();
        let sock = base.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{b}/root"
state = "{b}/state"
[grpc]
  address = "{s}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  disable_tcp_service = true
  # Pods here share the node's network namespace (amvm gives a VM no NIC at all): no CNI.
  [plugins."io.containerd.grpc.v1.cri".cni]
    conf_dir = "{b}/cni"
    bin_dir = "{b}/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    # amvm's pod-aware shim (containerd-shim-amvm-v2, found on containerd's PATH): one VM
    # per pod.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.amvm]
      runtime_type = "io.containerd.amvm.v2"
      # A pod's io.amvm.* annotations (its egress) reach its sandbox's and containers' specs.
      pod_annotations = ["io.amvm.*"]
    # The runc shim with amvm-runc: one VM per container.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.amvm-runc]
      runtime_type = "io.containerd.runc.v2"
      pod_annotations = ["io.amvm.*"]
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.amvm-runc.options]
        BinaryName = "{r}"
"#,
            b = base.display(),
            s = sock.display(),
            r = runc.display(),
        );
        std::fs::write(base.join("config.toml"), config).unwrap();
        let log = std::fs::File::create(base.join("containerd.log")).unwrap();
        let path = format!(
            "{}:{}",
            base.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let daemon = Command::new("/usr/bin/containerd")
            .arg("--config")
            .arg(base.join("config.toml"))
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting containerd");
        let c = Containerd { base, sock, daemon };
        let until = Instant::now() + Duration::from_secs(120);
        while c.ctr(&["plugins", "ls"]).code != 0 || !c.sock.exists() {
            assert!(
                Instant::now() < until,
                "containerd did not come up: {}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        c
    }

    /// `ctr --address SOCK -n k8s.io ARGS` (k8s.io: the namespace the CRI plugin uses).
    pub fn ctr(&self, args: &[&str]) -> Outcome {
        Outcome::from(
            Command::new("/usr/bin/ctr")
                .arg("--address")
                .arg(&self.sock)
                .args(["-n", "k8s.io"])
                .args(args)
                .stdin(Stdio::null())
                .output()
                .expect("spawning ctr"),
        )
    }

    /// For failure messages: the end of containerd's log, the processes naming this
    /// containerd's directory, and the containers' logs.
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.base.join("containerd.log")).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        let mut out = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        out.push_str("\n-- processes:\n");
        for p in crate::leftovers::processes_with(&self.base.display().to_string()) {
            out.push_str(&p);
            out.push('\n');
        }
        let logs = self.base.join("logs");
        for pod in std::fs::read_dir(&logs).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                out.push_str(&format!("-- {}:\n", f.path().display()));
                out.push_str(&std::fs::read_to_string(f.path()).unwrap_or_default());
            }
        }
        out
    }

    /// Build [`IMAGE`] and import it.
    pub fn import_busybox(&self) {
        let archive = busybox_archive(&self.base.join("image"));
        let o = self.ctr(&["images", "import", archive.to_str().unwrap()]);
        assert_eq!(o.code, 0, "ctr images import: {}", o.stderr);
    }

    /// A CRI client on this containerd's socket.
    pub fn client(&self) -> Cri {
        Cri::connect(&self.sock)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        // Whatever containerd mounted under its root (snapshots, the sandboxes' /dev/shm).
        unmount_all_under(&self.base);
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// A CRI call's result or the test's failure, with containerd's log (what it said about it).
pub trait OrLog<T> {
    fn or_log(self, ctd: &Containerd, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrLog<T> for Result<T, E> {
    #[track_caller]
    fn or_log(self, ctd: &Containerd, what: &str) -> T {
        self.unwrap_or_else(|e| panic!("{what}: {e}\n{}", ctd.log()))
    }
}

/// Lazily unmounts every mount at or below `base`, deepest first (a test's clean-up: errors
/// are ignored, what stays is found by the next run's checks).
pub fn unmount_all_under(base: &Path) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "grep -o ' {}[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l",
            base.display()
        ))
        .status();
}

/// A docker-archive (what `docker save` writes) of busybox at `dir/rootfs`: one layer, a
/// config whose command sleeps for ever.
fn busybox_archive(dir: &Path) -> PathBuf {
    use sha2::Digest;
    let root = dir.join("rootfs");
    crate::busybox_root(&root);
    let out = dir.join("archive");
    std::fs::create_dir_all(&out).unwrap();
    let layer = out.join("layer.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let diff = crate::egress_server::hex(&sha2::Sha256::digest(std::fs::read(&layer).unwrap()));
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin"],
            "Cmd": ["sleep", "1000000000"],
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{diff}")] },
    });
    let config = serde_json::to_vec(&config).unwrap();
    let config_name = format!(
        "{}.json",
        crate::egress_server::hex(&sha2::Sha256::digest(&config))
    );
    std::fs::write(out.join(&config_name), &config).unwrap();
    let manifest = serde_json::json!([{
        "Config": config_name,
        "RepoTags": [IMAGE],
        "Layers": ["layer.tar"],
    }]);
    std::fs::write(out.join("manifest.json"), manifest.to_string()).unwrap();
    let archive = dir.join("busybox.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&out)
        .arg("-cf")
        .arg(&archive)
        .args(["manifest.json", &config_name, "layer.tar"])
        .status()
        .unwrap();
    assert!(st.success());
    archive
}

/// A blocking CRI client (runtime and image services) on a unix socket.
pub struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: api::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>,
}

/// How long any one CRI call may take before the test fails (a hang guard, not a speed bound:
/// starting a container boots a VM in the emulated host).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

impl Cri {
    pub fn connect(sock: &Path) -> Cri {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let path = sock.to_path_buf();
        let channel = rt
            .block_on(
                tonic::transport::Endpoint::try_from("http://[::]")
                    .unwrap()
                    .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                                tokio::net::UnixStream::connect(path).await?,
                            ))
                        }
                    })),
            )
            .expect("connecting to containerd's CRI socket");
        let runtime = api::runtime_service_client::RuntimeServiceClient::new(channel);
        Cri { rt, runtime }
    }

    fn call<T, F>(
        &mut self,
        what: &str,
        f: impl FnOnce(
            api::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>,
        ) -> F,
    ) -> Result<T, tonic::Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.runtime.clone();
        let fut = f(client);
        // The timer is made inside the runtime, which it needs.
        match self
            .rt
            .block_on(async move { tokio::time::timeout(CALL_TIMEOUT, fut).await })
        {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => panic!("CRI {what} did not answer in {CALL_TIMEOUT:?}"),
        }
    }

    /// The CRI version containerd reports.
    pub fn version(&mut self) -> api::VersionResponse {
        self.call("Version", |mut c| async move {
            c.version(api::VersionRequest::default()).await
        })
        .expect("CRI Version")
    }

    /// RunPodSandbox with `handler`; the pod shares the node's network namespace.
    pub fn run_pod(
        &mut self,
        config: &api::PodSandboxConfig,
        handler: &str,
    ) -> Result<String, tonic::Status> {
        let req = api::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        };
        self.call("RunPodSandbox", |mut c| async move {
            c.run_pod_sandbox(req).await
        })
        .map(|r| r.pod_sandbox_id)
    }

    /// CreateContainer `name` in `pod` running `command` of [`IMAGE`], logging to `name.log`
    /// in the pod's log directory.
    pub fn create(
        &mut self,
        pod: &str,
        pod_config: &api::PodSandboxConfig,
        name: &str,
        command: &[&str],
    ) -> Result<String, tonic::Status> {
        self.create_mounting(pod, pod_config, name, command, &[])
    }

    /// [`Cri::create`] with host directories mounted: `(host path, container path)`, as a
    /// kubelet passes a pod's volumes (an emptyDir is a host directory of the pod's).
    pub fn create_mounting(
        &mut self,
        pod: &str,
        pod_config: &api::PodSandboxConfig,
        name: &str,
        command: &[&str],
        mounts: &[(&Path, &str)],
    ) -> Result<String, tonic::Status> {
        self.create_with(pod, pod_config, name, command, mounts, false)
    }

    /// [`Cri::create`] with a terminal (`tty: true` in a pod spec): its output all comes as
    /// stdout in its log.
    pub fn create_tty(
        &mut self,
        pod: &str,
        pod_config: &api::PodSandboxConfig,
        name: &str,
        command: &[&str],
    ) -> Result<String, tonic::Status> {
        self.create_with(pod, pod_config, name, command, &[], true)
    }

    fn create_with(
        &mut self,
        pod: &str,
        pod_config: &api::PodSandboxConfig,
        name: &str,
        command: &[&str],
        mounts: &[(&Path, &str)],
        tty: bool,
    ) -> Result<String, tonic::Status> {
        let req = api::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(api::ContainerConfig {
                metadata: Some(api::ContainerMetadata {
                    name: name.into(),
                    attempt: 0,
                }),
                image: Some(api::ImageSpec {
                    image: IMAGE.into(),
                    ..Default::default()
                }),
                command: command.iter().map(|s| s.to_string()).collect(),
                mounts: mounts
                    .iter()
                    .map(|(host, path)| api::Mount {
                        host_path: host.display().to_string(),
                        container_path: path.to_string(),
                        ..Default::default()
                    })
                    .collect(),
                log_path: format!("{name}.log"),
                tty,
                ..Default::default()
            }),
            sandbox_config: Some(pod_config.clone()),
        };
        self.call("CreateContainer", |mut c| async move {
            c.create_container(req).await
        })
        .map(|r| r.container_id)
    }

    pub fn start(&mut self, id: &str) -> Result<(), tonic::Status> {
        let req = api::StartContainerRequest {
            container_id: id.into(),
        };
        self.call("StartContainer", |mut c| async move {
            c.start_container(req).await
        })
        .map(|_| ())
    }

    pub fn status(&mut self, id: &str) -> api::ContainerStatus {
        let req = api::ContainerStatusRequest {
            container_id: id.into(),
            verbose: false,
        };
        self.call("ContainerStatus", |mut c| async move {
            c.container_status(req).await
        })
        .expect("CRI ContainerStatus")
        .status
        .expect("a status")
    }

    /// Poll ContainerStatus until the container has exited; its exit code, or its last status
    /// once `timeout` has passed.
    pub fn wait_exited(
        &mut self,
        id: &str,
        timeout: Duration,
    ) -> Result<i32, Box<api::ContainerStatus>> {
        let until = Instant::now() + timeout;
        loop {
            let s = self.status(id);
            if s.state == api::ContainerState::ContainerExited as i32 {
                return Ok(s.exit_code);
            }
            if Instant::now() > until {
                return Err(Box::new(s));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// ExecSync: exit code, stdout, stderr.
    pub fn exec_sync(
        &mut self,
        id: &str,
        cmd: &[&str],
        timeout_s: i64,
    ) -> Result<(i32, String, String), tonic::Status> {
        let req = api::ExecSyncRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: timeout_s,
        };
        self.call("ExecSync", |mut c| async move { c.exec_sync(req).await })
            .map(|r| {
                (
                    r.exit_code,
                    String::from_utf8_lossy(&r.stdout).into_owned(),
                    String::from_utf8_lossy(&r.stderr).into_owned(),
                )
            })
    }

    /// ContainerStats: (CPU time in ns, working set in bytes).
    pub fn stats(&mut self, id: &str) -> Result<(u64, u64), tonic::Status> {
        let req = api::ContainerStatsRequest {
            container_id: id.into(),
        };
        self.call("ContainerStats", |mut c| async move {
            c.container_stats(req).await
        })
        .map(|r| {
            let s = r.stats.unwrap_or_default();
            (
                s.cpu
                    .and_then(|c| c.usage_core_nano_seconds)
                    .map_or(0, |v| v.value),
                s.memory
                    .and_then(|m| m.working_set_bytes)
                    .map_or(0, |v| v.value),
            )
        })
    }

    /// StopContainer: SIGTERM (the image's stop signal), SIGKILL after `timeout_s`.
    pub fn stop(&mut self, id: &str, timeout_s: i64) -> Result<(), tonic::Status> {
        let req = api::StopContainerRequest {
            container_id: id.into(),
            timeout: timeout_s,
        };
        self.call("StopContainer", |mut c| async move {
            c.stop_container(req).await
        })
        .map(|_| ())
    }

    pub fn stop_pod(&mut self, pod: &str) -> Result<(), tonic::Status> {
        let req = api::StopPodSandboxRequest {
            pod_sandbox_id: pod.into(),
        };
        self.call("StopPodSandbox", |mut c| async move {
            c.stop_pod_sandbox(req).await
        })
        .map(|_| ())
    }

    pub fn remove_pod(&mut self, pod: &str) -> Result<(), tonic::Status> {
        let req = api::RemovePodSandboxRequest {
            pod_sandbox_id: pod.into(),
        };
        self.call("RemovePodSandbox", |mut c| async move {
            c.remove_pod_sandbox(req).await
        })
        .map(|_| ())
    }

    /// The pods containerd knows.
    pub fn pods(&mut self) -> Vec<api::PodSandbox> {
        self.call("ListPodSandbox", |mut c| async move {
            c.list_pod_sandbox(api::ListPodSandboxRequest::default())
                .await
        })
        .expect("CRI ListPodSandbox")
        .items
    }
}

/// A pod's configuration: `name` in namespace `amvm-test`, logs under `logs`, the node's
/// network namespace (no CNI), `annotations` as a kubelet passes them.
pub fn pod_config(name: &str, logs: &Path, annotations: &[(&str, &str)]) -> api::PodSandboxConfig {
    api::PodSandboxConfig {
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}-{}", std::process::id()),
            namespace: "amvm-test".into(),
            attempt: 0,
        }),
        // None: a pod in the node's network namespace is in its UTS namespace too (runc
        // refuses to set a hostname there; a kubelet leaves it to the node's).
        hostname: String::new(),
        log_directory: logs.display().to_string(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>(),
        linux: Some(api::LinuxPodSandboxConfig {
            security_context: Some(api::LinuxSandboxSecurityContext {
                namespace_options: Some(api::NamespaceOption {
                    network: api::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The lines a container wrote to its CRI log (`TIME STREAM TAG LINE` per line), without
/// the prefixes: `(stream, line)`.
pub fn log_lines(path: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(4, ' ');
            let _time = it.next()?;
            let stream = it.next()?;
            let _tag = it.next()?;
            Some((stream.to_string(), it.next().unwrap_or("").to_string()))
        })
        .collect()
}
