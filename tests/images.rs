//! OCI images without an engine (issue 39): `amvm image import` of what Debian's podman saves
//! (docker-archive, oci-archive, an OCI layout with zstd layers, a multi-arch index), the
//! store (a base layer shared by two images stored once, a tampered blob refused with nothing
//! of it kept, rm and prune), and `amvm run|create --image` honouring the image's
//! Entrypoint, Cmd, Env, WorkingDir and User. The images are built by the test with podman
//! (`--isolation chroot`: no OCI runtime needed) from a root of the host's static busybox:
//! nothing comes from the internet. Each test has a store of its own (`AMVM_CACHE`).

use amvm_tests::{amvm_bin, require_kvm, Outcome};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BASE: &str = "localhost/amvm-base:1";
const APP: &str = "localhost/amvm-app:1";

/// What the test builds: a base image (busybox, a user database with `app`, /etc/motd,
/// /etc/issue, /data/{a,b}) and an app image on it whose second layer deletes /etc/motd, adds
/// /etc/motd2, replaces /data with /data/c and rewrites /etc/issue, with a config.
const APP_FILE: &str = r#"FROM localhost/amvm-base:1
RUN rm /etc/motd && echo new > /etc/motd2 && rm -rf /data && mkdir /data && echo c > /data/c && echo app > /etc/issue
ENV GREETING=hello PATH=/bin
WORKDIR /data
USER app
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["echo $GREETING from $(pwd) as $(id -u):$(id -g) home $HOME; cat /data/c /etc/motd2 /etc/issue"]
"#;

struct Images {
    base: PathBuf,
    kernel: PathBuf,
    virtiofsd: PathBuf,
}

impl Images {
    /// Podman storage of the test's own under /dev/shm (the test bed's /tmp is an overlayfs),
    /// both images built and saved as `docker.tar` (app), `base.oci.tar` (base, oci-archive),
    /// `zstd/` (app, an OCI layout with zstd layers), `multi/` (an index of app and an arm64
    /// image) and `arm/` (the arm64 image alone).
    /// `all`: also the multi-arch and zstd layouts and the base's oci-archive (else only the
    /// two images and `docker.tar`).
    fn new(name: &str, all: bool) -> Images {
        assert!(
            Path::new("/usr/bin/podman").exists(),
            "podman is not installed: images/setup installs it (Debian's podman)"
        );
        let base = PathBuf::from(format!(
            "/dev/shm/amvm-images-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&base);
        for d in [
            "tmp",
            "libpod-tmp",
            "networks",
            "ctx/root/bin",
            "ctx/root/etc",
            "arm/root",
        ] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        let cache = std::env::var("AMVM_CACHE").map_or_else(
            |_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/amvm"),
            PathBuf::from,
        );
        let i = Images {
            kernel: std::env::var_os("AMVM_KERNEL")
                .map_or_else(|| cache.join("kernel/vmlinux"), PathBuf::from),
            virtiofsd: std::env::var_os("AMVM_VIRTIOFSD")
                .map_or_else(|| cache.join("virtiofsd/bin/virtiofsd"), PathBuf::from),
            base,
        };
        // File locks of its own, and its copies' temporary files under its own directory (the
        // test bed's /var/tmp, podman's default, is read-only).
        std::fs::write(
            i.base.join("containers.conf"),
            format!(
                "[engine]\nlock_type = \"file\"\nimage_copy_tmp_dir = \"{}\"\n",
                i.base.join("tmp").display()
            ),
        )
        .unwrap();
        let root = i.base.join("ctx/root");
        std::fs::copy("/bin/busybox", root.join("bin/busybox"))
            .expect("the host's static busybox (images/setup installs busybox-static)");
        for a in [
            "sh", "ls", "cat", "rm", "echo", "id", "pwd", "mkdir", "printf", "chmod", "touch",
        ] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
        }
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1002:app:/home/app:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\napp:x:1002:\n").unwrap();
        std::fs::write(root.join("etc/motd"), "old\n").unwrap();
        std::fs::write(root.join("etc/issue"), "base\n").unwrap();
        std::fs::create_dir_all(root.join("data")).unwrap();
        std::fs::write(root.join("data/a"), "a\n").unwrap();
        std::fs::write(root.join("data/b"), "b\n").unwrap();
        std::fs::write(i.base.join("ctx/Base"), "FROM scratch\nCOPY root/ /\n").unwrap();
        std::fs::write(i.base.join("ctx/App"), APP_FILE).unwrap();
        std::fs::write(i.base.join("arm/root/which"), "arm\n").unwrap();
        std::fs::write(
            i.base.join("arm/Containerfile"),
            "FROM scratch\nCOPY root/ /\n",
        )
        .unwrap();
        let ctx = i.base.join("ctx").display().to_string();
        let arm = i.base.join("arm").display().to_string();
        let f = |n: &str| i.base.join("ctx").join(n).display().to_string();
        let p = |s: &str| i.base.join(s).display().to_string();
        let steps: Vec<Vec<String>> = vec![
            vec![
                "build",
                "-q",
                "--isolation",
                "chroot",
                "-f",
                &f("Base"),
                "-t",
                BASE,
                &ctx,
            ],
            vec![
                "build",
                "-q",
                "--isolation",
                "chroot",
                "--layers=false",
                "-f",
                &f("App"),
                "-t",
                APP,
                &ctx,
            ],
            vec![
                "save",
                "-q",
                "--format",
                "docker-archive",
                "-o",
                &p("docker.tar"),
                APP,
            ],
            vec![
                "build",
                "-q",
                "--isolation",
                "chroot",
                "--arch",
                "arm64",
                "-t",
                "localhost/amvm-arm:1",
                &arm,
            ],
            vec![
                "save",
                "-q",
                "--format",
                "oci-archive",
                "-o",
                &p("base.oci.tar"),
                BASE,
            ],
            vec![
                "push",
                "-q",
                "--compression-format",
                "zstd",
                APP,
                &format!("oci:{}:localhost/amvm-app:zstd", p("zstd")),
            ],
            vec![
                "push",
                "-q",
                "localhost/amvm-arm:1",
                &format!("oci:{}:localhost/amvm-arm:1", p("armdir")),
            ],
            vec!["manifest", "create", "localhost/amvm-multi:1"],
            vec![
                "manifest",
                "add",
                "localhost/amvm-multi:1",
                "containers-storage:localhost/amvm-arm:1",
            ],
            vec![
                "manifest",
                "add",
                "localhost/amvm-multi:1",
                &format!("containers-storage:{APP}"),
            ],
            vec![
                "manifest",
                "push",
                "-q",
                "--all",
                "localhost/amvm-multi:1",
                &format!("oci:{}:localhost/amvm-multi:1", p("multi")),
            ],
        ]
        .into_iter()
        .map(|v| v.into_iter().map(String::from).collect())
        .collect();
        let needed = if all { steps.len() } else { 3 };
        for s in steps.into_iter().take(needed) {
            let out = i.podman(&s);
            assert_eq!(out.code, 0, "podman {s:?}: {}", out.stderr);
        }
        i
    }

    fn podman(&self, args: &[String]) -> Outcome {
        let b = |d: &str| self.base.join(d).display().to_string();
        let out = Command::new("/usr/bin/podman")
            .args(["--root", &b("storage"), "--runroot", &b("run")])
            .args(["--tmpdir", &b("libpod-tmp"), "--storage-driver", "vfs"])
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .args(["--network-config-dir", &b("networks")])
            .args(args)
            .env("TMPDIR", self.base.join("tmp"))
            .env("CONTAINERS_CONF", self.base.join("containers.conf"))
            .stdin(Stdio::null())
            .output()
            .expect("spawning podman");
        Outcome::from(out)
    }

    fn path(&self, p: &str) -> String {
        self.base.join(p).display().to_string()
    }

    /// `amvm ARGS` with the store in `cache` (under the test's directory).
    fn amvm_in(&self, cache: &str, args: &[&str]) -> Outcome {
        let out = Command::new(amvm_bin())
            .args(args)
            .env("AMVM_CACHE", self.base.join(cache))
            .env("AMVM_KERNEL", &self.kernel)
            .env("AMVM_VIRTIOFSD", &self.virtiofsd)
            .stdin(Stdio::null())
            .output()
            .expect("spawning amvm");
        Outcome::from(out)
    }

    fn amvm(&self, args: &[&str]) -> Outcome {
        self.amvm_in("cache", args)
    }

    /// Every entry of the store's directories (what an import left), sorted.
    fn store_entries(&self, cache: &str) -> Vec<String> {
        let mut out = Vec::new();
        for sub in ["blobs/sha256", "snapshots", "refs", "tmp"] {
            let d = self.base.join(cache).join("oci").join(sub);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd {
                    out.push(format!(
                        "{sub}/{}",
                        e.unwrap().file_name().to_string_lossy()
                    ));
                }
            }
        }
        out.sort();
        out
    }
}

impl Drop for Images {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

fn ok(out: &Outcome, what: &str) -> String {
    assert_eq!(out.code, 0, "{what}: {}", out.stderr);
    out.stdout_str()
}

fn one_line_125(out: &Outcome, needle: &str) {
    assert_eq!(out.code, 125, "expected 125: {}", out.stderr);
    assert!(
        out.stderr.contains(needle) && out.stderr.trim().lines().count() == 1,
        "expected one line with {needle:?}: {}",
        out.stderr
    );
}

#[test]
fn import_takes_what_podman_saves_shares_layers_and_keeps_nothing_of_a_tampered_blob() {
    let i = Images::new("import", true);
    // docker save's format: the name from RepoTags, both layers unpacked.
    let out = i.amvm(&["image", "import", &i.path("docker.tar")]);
    assert_eq!(ok(&out, "import docker.tar"), format!("{APP}\n"));
    assert!(out.stderr.contains("2 layers"), "{}", out.stderr);
    let app_root = ok(&i.amvm(&["image", "path", APP]), "path")
        .trim()
        .to_string();
    let app_root = Path::new(&app_root);
    // The second layer's whiteouts and replacements, as OCI says.
    assert!(
        !app_root.join("etc/motd").exists(),
        "a whiteout removes /etc/motd"
    );
    assert_eq!(
        std::fs::read_to_string(app_root.join("etc/motd2")).unwrap(),
        "new\n"
    );
    let mut data: Vec<_> = std::fs::read_dir(app_root.join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    data.sort();
    assert_eq!(data, ["c"], "/data replaced whole");
    assert_eq!(
        std::fs::read_to_string(app_root.join("etc/issue")).unwrap(),
        "app\n"
    );
    assert_eq!(
        i.store_entries("cache")
            .iter()
            .filter(|e| e.starts_with("snapshots/") && !e.ends_with(".size"))
            .count(),
        2
    );
    // The base image (oci-archive, gzip layers) shares its one layer with the app: no new
    // snapshot, and its files are the app's own (one inode).
    let out = i.amvm(&["image", "import", &i.path("base.oci.tar")]);
    assert_eq!(ok(&out, "import base.oci.tar"), format!("{BASE}\n"));
    let snaps = |i: &Images| {
        i.store_entries("cache")
            .into_iter()
            .filter(|e| e.starts_with("snapshots/") && !e.ends_with(".size"))
            .count()
    };
    assert_eq!(snaps(&i), 2, "the shared base layer is stored once");
    let base_root = ok(&i.amvm(&["image", "path", BASE]), "path")
        .trim()
        .to_string();
    let base_root = Path::new(&base_root);
    assert_eq!(
        std::fs::metadata(base_root.join("bin/busybox"))
            .unwrap()
            .ino(),
        std::fs::metadata(app_root.join("bin/busybox"))
            .unwrap()
            .ino(),
        "one copy of busybox for both images"
    );
    assert_eq!(
        std::fs::read_to_string(base_root.join("etc/motd")).unwrap(),
        "old\n"
    );
    assert_eq!(
        std::fs::read_to_string(base_root.join("etc/issue")).unwrap(),
        "base\n"
    );
    assert!(base_root.join("data/a").exists() && !base_root.join("data/c").exists());
    // zstd layers and a multi-arch index: the same image (same id), nothing unpacked again.
    assert_eq!(
        ok(&i.amvm(&["image", "import", &i.path("zstd")]), "zstd"),
        "localhost/amvm-app:zstd\n"
    );
    assert_eq!(
        ok(&i.amvm(&["image", "import", &i.path("multi")]), "multi"),
        "localhost/amvm-multi:1\n"
    );
    assert_eq!(snaps(&i), 2);
    let list = ok(&i.amvm(&["image", "list"]), "list");
    let ids: Vec<(&str, &str)> = list
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0], f[1])
        })
        .collect();
    assert_eq!(ids.len(), 4, "{list}");
    let app_id = ids.iter().find(|(n, _)| *n == APP).unwrap().1;
    for n in ["localhost/amvm-app:zstd", "localhost/amvm-multi:1"] {
        assert_eq!(
            ids.iter().find(|(m, _)| *m == n).unwrap().1,
            app_id,
            "{list}"
        );
    }
    // An image for another platform is refused, naming it, and changes nothing.
    let before = i.store_entries("cache");
    one_line_125(
        &i.amvm(&["image", "import", &i.path("armdir")]),
        "linux/arm64",
    );
    assert_eq!(i.store_entries("cache"), before);
    // A tampered layer: refused, and nothing of it stays (a fresh store stays empty).
    let tampered = i.base.join("tampered");
    let st = Command::new("cp")
        .arg("-a")
        .arg(i.path("zstd"))
        .arg(&tampered)
        .status()
        .unwrap();
    assert!(st.success());
    let mut biggest: Option<(u64, PathBuf)> = None;
    for e in std::fs::read_dir(tampered.join("blobs/sha256")).unwrap() {
        let e = e.unwrap();
        let len = e.metadata().unwrap().len();
        if biggest.as_ref().is_none_or(|(l, _)| len > *l) {
            biggest = Some((len, e.path()));
        }
    }
    let (len, blob) = biggest.unwrap();
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[len as usize / 2] ^= 0x55;
    std::fs::write(&blob, bytes).unwrap();
    let out = i.amvm_in("fresh", &["image", "import", tampered.to_str().unwrap()]);
    one_line_125(&out, "its digest is sha256:");
    assert!(
        out.stderr.contains("nothing of it was kept"),
        "{}",
        out.stderr
    );
    assert_eq!(
        i.store_entries("fresh"),
        Vec::<String>::new(),
        "a refused import left something"
    );
    // Bad input: one line, exit 125.
    one_line_125(
        &i.amvm(&["image", "import", "/nonexistent/x.tar"]),
        "/nonexistent/x.tar",
    );
    std::fs::write(i.base.join("junk.tar"), "not a tar at all").unwrap();
    one_line_125(
        &i.amvm(&["image", "import", &i.path("junk.tar")]),
        "junk.tar",
    );
    one_line_125(
        &i.amvm(&[
            "run",
            "--pull",
            "never",
            "--image",
            "localhost/nope:1",
            "--",
            "true",
        ]),
        "--image localhost/nope:1: no image localhost/nope:1 in the store",
    );
    // rm: a name goes; the layers another name needs stay; the last name frees everything.
    for n in [APP, "localhost/amvm-app:zstd", "localhost/amvm-multi:1"] {
        ok(&i.amvm(&["image", "rm", n]), "rm");
    }
    assert_eq!(snaps(&i), 1, "the base's chain stays");
    assert!(base_root.join("bin/busybox").exists());
    let out = i.amvm(&["image", "rm", BASE]);
    ok(&out, "rm base");
    assert!(out.stderr.contains("freed"), "{}", out.stderr);
    assert_eq!(
        i.store_entries("cache"),
        Vec::<String>::new(),
        "an empty store after the last rm"
    );
}

#[test]
fn run_and_create_with_image_honour_its_entrypoint_cmd_env_workdir_and_user() {
    require_kvm();
    let i = Images::new("run", false);
    ok(
        &i.amvm(&["image", "import", &i.path("docker.tar")]),
        "import",
    );
    // The image's Entrypoint and Cmd, as its User in its WorkingDir with its Env.
    let out = i.amvm(&["run", "--timeout", "120", "--image", APP]);
    assert_eq!(
        ok(&out, "run"),
        "hello from /data as 1001:1002 home /home/app\nc\nnew\napp\n"
    );
    // Arguments replace Cmd (the Entrypoint stays); the exit status comes back; the root is
    // read-only (an EROFS disk the store made of it) and /tmp is writable.
    let out = i.amvm(&[
        "run",
        "--timeout",
        "120",
        "--image",
        APP,
        "--",
        "echo x > /tmp/y && cat /tmp/y; touch /etc/z 2>/dev/null || echo read-only; \
         awk '$2 == \"/\" { print $3, substr($4, 1, 2) }' /proc/mounts; exit 3",
    ]);
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert_eq!(out.stdout_str(), "x\nread-only\nerofs ro\n");
    let erofs: Vec<_> = std::fs::read_dir(i.base.join("cache/oci/snapshots"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".erofs"))
        .collect();
    assert_eq!(
        erofs.len(),
        1,
        "the store's EROFS image of the root: {erofs:?}"
    );
    // Flags win over the config.
    let out = i.amvm(&[
        "run",
        "--timeout",
        "120",
        "--image",
        APP,
        "--user",
        "0",
        "-w",
        "/",
        "-e",
        "GREETING=bye",
        "--",
        "echo $GREETING $(id -u) $(pwd) $HOME",
    ]);
    assert_eq!(ok(&out, "run with flags"), "bye 0 / /root\n");
    // A sandbox of the image: its execs get the image's user, directory and environment.
    let out = i.amvm(&["create", "--timeout", "300", "--image", APP]);
    let id = ok(&out, "create").trim().to_string();
    let exec = i.amvm(&[
        "exec",
        &id,
        "sh",
        "-c",
        "echo $GREETING $(id -u):$(id -g) $(pwd)",
    ]);
    let inspect = i.amvm(&["inspect", &id]);
    // Its snapshot comes back on the same EROFS root (the store's image of it, unchanged).
    let snap = i.path("snap");
    ok(&i.amvm(&["snapshot", &id, &snap, "--stop"]), "snapshot");
    let back = ok(&i.amvm(&["create", "--from", &snap]), "create --from")
        .trim()
        .to_string();
    let again = i.amvm(&["exec", &back, "sh", "-c", "echo $GREETING; cat /etc/issue"]);
    let _ = i.amvm(&["rm", "-f", &back]);
    let _ = i.amvm(&["rm", "-f", &id]);
    assert_eq!(ok(&again, "exec in the restored sandbox"), "hello\napp\n");
    assert_eq!(ok(&exec, "exec"), "hello 1001:1002 /data\n");
    assert!(
        ok(&inspect, "inspect").contains(&format!("\"image\": \"{APP}\"")),
        "{}",
        inspect.stdout_str()
    );
}

/// A `docker-registry` (Debian's, the reference registry) of the test's own on a free loopback
/// port: plain HTTP, or TLS with a certificate from a CA the test makes and htpasswd auth.
struct Registry {
    child: std::process::Child,
    addr: String,
    data: PathBuf,
}

impl Registry {
    fn start(dir: &Path, tls: bool) -> Registry {
        assert!(
            Path::new("/usr/bin/docker-registry").exists(),
            "docker-registry is not installed: images/setup installs it (Debian's docker-registry)"
        );
        std::fs::create_dir_all(dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let data = dir.join("data");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {addr}\n",
            data.display()
        );
        if tls {
            let d = |f: &str| dir.join(f).display().to_string();
            let script = format!(
                "set -e; cd {dir}; \
                 openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=amvm-test-ca; \
                 openssl req -newkey rsa:2048 -nodes -keyout key.pem -out srv.csr -subj /CN=127.0.0.1; \
                 printf 'subjectAltName=IP:127.0.0.1\\n' > ext; \
                 openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out cert.pem -days 2 -extfile ext; \
                 htpasswd -Bbn amvm s3cret > htpasswd",
                dir = dir.display()
            );
            let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            config.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\nauth:\n  htpasswd:\n    realm: amvm-test\n    path: {}\n",
                d("cert.pem"),
                d("key.pem"),
                d("htpasswd")
            ));
        }
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let child = Command::new("/usr/bin/docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("log")).unwrap())
            .spawn()
            .unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                std::time::Instant::now() < until,
                "docker-registry did not listen"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Registry { child, addr, data }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn pull_from_the_reference_registry_plain_and_behind_tls_with_htpasswd_checking_every_blob() {
    require_kvm();
    let i = Images::new("pull", true);
    let plain = Registry::start(&i.base.join("registry"), false);
    let secure = Registry::start(&i.base.join("registry-tls"), true);
    let at = |r: &Registry, path: &str| format!("docker://{}/{path}", r.addr);
    let push = |args: &[&str]| {
        // After the subcommand (`push`, or `manifest push`).
        let at = if args[0] == "manifest" { 2 } else { 1 };
        let mut a: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        a.insert(at, "--tls-verify=false".into());
        a.insert(at, "-q".into());
        let out = i.podman(&a);
        assert_eq!(out.code, 0, "podman {a:?}: {}", out.stderr);
    };
    push(&["push", APP, &at(&plain, "amvm/app:1")]);
    push(&[
        "push",
        "--compression-format",
        "zstd",
        APP,
        &at(&plain, "amvm/app:zstd"),
    ]);
    push(&[
        "manifest",
        "push",
        "--all",
        "localhost/amvm-multi:1",
        &at(&plain, "amvm/multi:1"),
    ]);
    push(&[
        "push",
        "--creds",
        "amvm:s3cret",
        APP,
        &at(&secure, "amvm/app:1"),
    ]);
    // Plain HTTP on loopback (HTTPS first, as Docker does), gzip and zstd layers, an index.
    let name = |r: &Registry, p: &str| format!("{}/{p}", r.addr);
    let out = i.amvm(&["image", "pull", &name(&plain, "amvm/app:1")]);
    assert_eq!(
        ok(&out, "pull"),
        format!("{}\n", name(&plain, "amvm/app:1"))
    );
    assert!(out.stderr.contains("2 layers"), "{}", out.stderr);
    ok(
        &i.amvm(&["image", "pull", &name(&plain, "amvm/app:zstd")]),
        "pull zstd",
    );
    ok(
        &i.amvm(&["image", "pull", &name(&plain, "amvm/multi:1")]),
        "pull index",
    );
    let list = ok(&i.amvm(&["image", "list"]), "list");
    let ids: std::collections::BTreeSet<&str> = list
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "one image under three names: {list}");
    // Two pulls of one image into one store at once: both succeed, one copy of everything.
    let both: Vec<_> = (0..2)
        .map(|_| {
            Command::new(amvm_bin())
                .args(["image", "pull", &name(&plain, "amvm/app:1")])
                .env("AMVM_CACHE", i.base.join("together"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in both {
        ok(
            &Outcome::from(c.wait_with_output().unwrap()),
            "a pull beside another",
        );
    }
    let together = i.store_entries("together");
    let count = |p: &str| together.iter().filter(|e| e.starts_with(p)).count();
    assert_eq!(
        (
            count("refs/"),
            count("tmp/"),
            count("snapshots/"),
            count("blobs/")
        ),
        (1, 0, 4, 4),
        "{together:?}"
    );
    // TLS and htpasswd: the CA and the credentials are needed, each refusal one line.
    let tls_app = name(&secure, "amvm/app:1");
    let ca = i.base.join("registry-tls/ca.pem").display().to_string();
    one_line_125(
        &i.amvm_in("tls", &["image", "pull", &tls_app]),
        "UnknownIssuer",
    );
    one_line_125(
        &i.amvm_in("tls", &["image", "pull", "--ca", &ca, &tls_app]),
        "credentials come from",
    );
    let auth = i.base.join("auth.json");
    std::fs::write(
        &auth,
        // base64 of amvm:s3cret
        r#"{"auths": {"ADDR": {"auth": "YW12bTpzM2NyZXQ="}}}"#.replace("ADDR", &secure.addr),
    )
    .unwrap();
    let out = Command::new(amvm_bin())
        .args(["image", "pull", "--ca", &ca, &tls_app])
        .env("AMVM_CACHE", i.base.join("tls"))
        .env("REGISTRY_AUTH_FILE", &auth)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        ok(&Outcome::from(out), "pull with credentials"),
        format!("{tls_app}\n")
    );
    // run --image pulls what is missing (saying so), or refuses with --pull never.
    let zstd = name(&plain, "amvm/app:zstd");
    one_line_125(
        &i.amvm_in(
            "run",
            &["run", "--pull", "never", "--image", &zstd, "--", "true"],
        ),
        "no image",
    );
    let out = i.amvm_in(
        "run",
        &[
            "run",
            "--timeout",
            "120",
            "--image",
            &zstd,
            "--",
            "cat /etc/issue",
        ],
    );
    assert_eq!(ok(&out, "run --image pulling"), "app\n");
    assert!(
        out.stderr.contains("is not in the store: pulling it"),
        "{}",
        out.stderr
    );
    // Blobs the registry serves tampered (every layer): refused, nothing of the pull kept.
    let mut blobs = Vec::new();
    let mut stack = vec![plain.data.join("docker/registry/v2/blobs/sha256")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if e.file_name() == "data" {
                blobs.push((e.metadata().unwrap().len(), e.path()));
            }
        }
    }
    let layers: Vec<_> = blobs.into_iter().filter(|(len, _)| *len > 4096).collect();
    assert!(layers.len() >= 2, "the registry's layers");
    for (len, path) in layers {
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[len as usize / 2] ^= 0x55;
        std::fs::write(&path, bytes).unwrap();
    }
    let out = i.amvm_in("fresh", &["image", "pull", &name(&plain, "amvm/app:1")]);
    assert_eq!(out.code, 125, "{}", out.stderr);
    assert!(out.stderr.contains("digest"), "{}", out.stderr);
    assert_eq!(
        i.store_entries("fresh"),
        Vec::<String>::new(),
        "a refused pull left something"
    );
}
