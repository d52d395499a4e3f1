//! An OCI bundle's `config.json` as a sandbox: the container's root file system becomes the
//! guest processes' root (`--rootfs`), its process the sandbox's first exec, its mounts virtio-fs
//! shares, tmpfs mounts and copied files, its resources the VM's size.
//!
//! What the guest makes itself (proc, sysfs, /dev with its pts and shm, mqueue, cgroups) is not
//! taken from the engine; the network the engine set up is not used: the VM has no NIC.

use super::OciError;
use crate::cli::VmArgs;
use crate::config::{self, RunConfig, ROOTFS_PATH};
use guest_init::protocol::{Mount, SpecFile, Tmpfs};
use oci_spec::runtime::Spec;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// Annotations that carry amvm's own options.
pub const ANNOTATION_EGRESS: &str = "io.amvm.egress";
pub const ANNOTATION_KERNEL: &str = "io.amvm.kernel";
/// Guest RAM over the container's memory limit: the guest kernel, guest-init and page cache.
pub const MEM_HEADROOM_MIB: u64 = 64;
/// Guest RAM without a memory limit.
pub const DEFAULT_MEM_MIB: u64 = 512;
/// The largest file a bind mount of a single file may copy into the guest.
const MAX_FILE_BIND: u64 = 1 << 20;

/// Where the engine's kernel file systems go: made by guest-init, not from the spec.
const GUEST_MADE: &[&str] = &[
    "/proc",
    "/sys",
    "/sys/fs/cgroup",
    "/dev",
    "/dev/pts",
    "/dev/shm",
    "/dev/mqueue",
];

/// The container's first process, as the sandbox's exec gets it.
#[derive(Debug, Clone)]
pub struct Process {
    pub args: Vec<String>,
    pub terminal: bool,
    /// Its whole environment.
    pub env: Vec<String>,
    /// The capabilities it keeps when it runs as uid 0.
    pub capabilities: Option<u64>,
    /// `user.additionalGids`.
    pub groups: Vec<u32>,
    /// `rlimits`.
    pub rlimits: Vec<crate::sandbox::api::Rlimit>,
}

/// A process's supplementary groups and resource limits, as an exec takes them.
pub fn groups_and_rlimits(
    p: &oci_spec::runtime::Process,
) -> (Vec<u32>, Vec<crate::sandbox::api::Rlimit>) {
    let groups = p.user().additional_gids().clone().unwrap_or_default();
    let rlimits = p
        .rlimits()
        .iter()
        .flatten()
        .map(|l| crate::sandbox::api::Rlimit {
            kind: l.typ().to_string(),
            soft: l.soft(),
            hard: l.hard(),
        })
        .collect();
    (groups, rlimits)
}

/// Capability names, by number (include/uapi/linux/capability.h).
const CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// A process's capabilities (its bounding set, which is what uid 0 holds after exec) as a
/// mask. As with runc, what the spec leaves out the process does not get: no set, none (engines
/// omit an empty list).
pub fn capabilities(p: &oci_spec::runtime::Process) -> Result<Option<u64>, OciError> {
    let Some(set) = p.capabilities().as_ref().and_then(|c| c.bounding().clone()) else {
        return Ok(Some(0));
    };
    let mut mask = 0u64;
    for cap in set {
        let name = serde_json::to_value(cap)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let bare = name.strip_prefix("CAP_").unwrap_or(&name);
        match CAPABILITIES.iter().position(|c| *c == bare) {
            Some(n) => mask |= 1 << n,
            None => tracing::warn!("capability {name} is unknown to amvm: left out"),
        }
    }
    Ok(Some(mask))
}

/// A bundle, loaded and mapped.
pub struct Bundle {
    pub cfg: RunConfig,
    pub state: crate::sandbox::Config,
    pub process: Process,
    pub annotations: BTreeMap<String, String>,
}

fn bad(what: impl Into<String>) -> OciError {
    OciError::Spec(what.into())
}

/// Load `bundle/config.json` and map it (module docs).
pub fn load(bundle: &Path) -> Result<Bundle, OciError> {
    let path = bundle.join("config.json");
    let spec = Spec::load(&path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let annotations: BTreeMap<String, String> = spec
        .annotations()
        .as_ref()
        .map(|a| a.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| bad("config.json has no root"))?;
    let rootfs = if root.path().is_absolute() {
        root.path().clone()
    } else {
        bundle.join(root.path())
    };
    let rootfs = rootfs
        .canonicalize()
        .map_err(|e| bad(format!("root {}: {e}", rootfs.display())))?;
    let readonly = root.readonly().unwrap_or(false);
    let proc = spec
        .process()
        .as_ref()
        .ok_or_else(|| bad("config.json has no process"))?;
    let args = proc.args().clone().unwrap_or_default();
    if args.is_empty() {
        return Err(bad("process.args is empty"));
    }
    let cwd = proc.cwd().to_string_lossy().into_owned();
    if !cwd.starts_with('/') {
        return Err(bad(format!("process.cwd {cwd:?} is not absolute")));
    }
    let (uid, gid) = (proc.user().uid(), proc.user().gid());
    let mut env = proc.env().clone().unwrap_or_default();
    if !env.iter().any(|e| e.starts_with("HOME=")) {
        env.push(format!("HOME={}", if uid == 0 { "/root" } else { "/" }));
    }
    for e in &env {
        if !e.contains('=') || e.starts_with('=') {
            return Err(bad(format!("process.env entry {e:?} is not KEY=VALUE")));
        }
    }
    let (mem_mib, cpus, pids) = resources(&spec)?;

    // The mount points the guest needs, made in the root on the host as runc makes them.
    for d in ["proc", "sys", "dev"] {
        mount_point(&rootfs, Path::new(d), true)?;
    }
    let mut shares = Vec::new();
    let mut mounts = Vec::new();
    let mut tmpfs = Vec::new();
    let mut files = Vec::new();
    for m in spec.mounts().as_deref().unwrap_or_default() {
        let dest = m.destination().to_string_lossy().into_owned();
        let dest = normal(&dest).ok_or_else(|| bad(format!("mount destination {dest:?}")))?;
        let options = m.options().clone().unwrap_or_default();
        let typ = m.typ().clone().unwrap_or_default();
        let is_bind = typ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        if GUEST_MADE.contains(&dest.as_str())
            || ["proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2"].contains(&typ.as_str())
        {
            continue;
        }
        let guest = format!("{ROOTFS_PATH}{dest}");
        if is_bind {
            let src = m
                .source()
                .clone()
                .ok_or_else(|| bad(format!("bind mount on {dest} has no source")))?;
            let meta = std::fs::metadata(&src)
                .map_err(|e| bad(format!("bind mount source {}: {e}", src.display())))?;
            let writable = !options.iter().any(|o| o == "ro");
            if meta.is_dir() {
                mount_point(&rootfs, Path::new(&dest[1..]), true)?;
                let tag = format!("vol{}", shares.len());
                shares.push((tag.clone(), src.canonicalize().unwrap_or(src), writable));
                mounts.push(Mount {
                    tag: tag.into_bytes(),
                    path: guest.into_bytes(),
                    writable,
                });
            } else if meta.is_file() {
                // A file (the engine's /etc/hosts, resolv.conf, hostname): copied in, read-only.
                if meta.len() > MAX_FILE_BIND {
                    return Err(bad(format!(
                        "bind mount of the file {} on {dest}: larger than {MAX_FILE_BIND} bytes",
                        src.display()
                    )));
                }
                if !mount_point(&rootfs, Path::new(&dest[1..]), false)? {
                    tracing::warn!(
                        "{dest} is a symlink in the root: the engine's file is not put there"
                    );
                    continue;
                }
                let data = std::fs::read(&src)
                    .map_err(|e| bad(format!("bind mount source {}: {e}", src.display())))?;
                files.push(SpecFile::File {
                    path: guest.into_bytes(),
                    data,
                });
            } else {
                return Err(bad(format!(
                    "bind mount of {} on {dest}: only directories and regular files",
                    src.display()
                )));
            }
        } else if typ == "tmpfs" {
            mount_point(&rootfs, Path::new(&dest[1..]), true)?;
            tmpfs.push(Tmpfs {
                path: guest.into_bytes(),
                options: tmpfs_options(&dest, &options)?.into_bytes(),
            });
        } else {
            return Err(bad(format!(
                "mount type {typ:?} on {dest} is not supported (bind, tmpfs)"
            )));
        }
    }

    let vm = VmArgs {
        workspace: None,
        volumes: Vec::new(),
        tmpfs: Vec::new(),
        changes: None,
        overlay_size: None,
        egress: annotations.get(ANNOTATION_EGRESS).map(PathBuf::from),
        egress_log: None,
        egress_allow: Vec::new(),
        egress_credential: Vec::new(),
        egress_ca: None,
        system: "host".into(),
        rootfs: Some(format!(
            "{}:{}",
            rootfs.display(),
            if readonly { "ro" } else { "rw" }
        )),
        kernel: annotations.get(ANNOTATION_KERNEL).map(PathBuf::from),
        mem: mem_mib,
        cpus,
        pids,
        timeout: None,
        env: Vec::new(),
        workdir: Some(cwd.clone()),
        user: Some(format!("{uid}:{gid}")),
        image: None,
        pull: crate::cli::Pull::Missing,
        image_command: None,
        console: false,
        huge_pages: false,
        no_huge_pages: false,
        no_seccomp: false,
        restoring: false,
        rootfs_image: None,
    };
    if let Some(e) = &vm.egress {
        if !e.exists() {
            return Err(bad(format!(
                "the {ANNOTATION_EGRESS} annotation names {}, which does not exist",
                e.display()
            )));
        }
    }
    let state = crate::sandbox::Config {
        mem_mib,
        cpus,
        system: format!("rootfs {}", rootfs.display()),
        workspace: None,
        egress: vm.egress.clone(),
        timeout_seconds: None,
        overlay_lower: None,
        overlay_scratch: None,
        overlay_size: None,
        idle_timeout_seconds: None,
        kernel: None,
        user: format!("{uid}:{gid}"),
        workdir: cwd,
        env: env.clone(),
        egress_gateway: None,
        image: None,
        // The container's mounts are its bundle's, made again from it; never restored.
        volumes: Vec::new(),
    };
    let mut cfg = vm
        .into_config(Vec::new(), false, Some(PathBuf::from("/")))
        .map_err(|e| bad(e.to_string()))?;
    cfg.shares.extend(shares);
    cfg.spec.mounts.extend(mounts);
    cfg.spec.tmpfs.extend(tmpfs);
    cfg.spec.files.extend(files);
    cfg.spec.env = env.into_iter().map(String::into_bytes).collect();
    if let Some(h) = spec.hostname() {
        if h.len() > 64 {
            return Err(bad(format!("hostname {h:?} is longer than 64 bytes")));
        }
        cfg.spec.hostname = h.clone().into_bytes();
    }
    let len = cfg.spec.encode().len();
    if len > guest_init::protocol::MAX_SPEC_LEN {
        return Err(bad(format!(
            "the spec takes {len} bytes, more than the {} allowed",
            guest_init::protocol::MAX_SPEC_LEN
        )));
    }
    let process_env = cfg
        .spec
        .env
        .iter()
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect();
    let (groups, rlimits) = groups_and_rlimits(proc);
    Ok(Bundle {
        cfg,
        state,
        process: Process {
            args,
            terminal: proc.terminal().unwrap_or(false),
            env: process_env,
            capabilities: capabilities(proc)?,
            groups,
            rlimits,
        },
        annotations,
    })
}

/// Guest RAM (MiB), vCPUs and the workload's pids.max from `linux.resources`.
fn resources(spec: &Spec) -> Result<(u64, u8, u32), OciError> {
    let res = spec.linux().as_ref().and_then(|l| l.resources().as_ref());
    let mut mem = DEFAULT_MEM_MIB;
    let mut cpus: u8 = 1;
    let mut pids = crate::cli::DEFAULT_PIDS;
    let Some(res) = res else {
        return Ok((mem, cpus, pids));
    };
    if let Some(limit) = res.memory().as_ref().and_then(|m| m.limit()) {
        if limit > 0 {
            let mib = (limit as u64).div_ceil(1 << 20);
            mem = (mib + MEM_HEADROOM_MIB).max(config::MIN_MEM_MIB);
        }
    }
    if let Some(cpu) = res.cpu() {
        let mut want = None;
        if let (Some(q), Some(p)) = (cpu.quota(), cpu.period()) {
            if q > 0 && p > 0 {
                want = Some((q as u64).div_ceil(p));
            }
        }
        if let Some(set) = cpu.cpus().as_deref().filter(|s| !s.is_empty()) {
            let n = cpuset_len(set).ok_or_else(|| bad(format!("cpuset {set:?}")))?;
            want = Some(want.map_or(n, |w: u64| w.min(n)));
        }
        if let Some(w) = want {
            // More than the host has is allowed (KVM schedules vCPUs as threads); amvm's own
            // bound is checked with the rest of the config.
            cpus = w.clamp(1, u64::from(u8::MAX)) as u8;
        }
    }
    if let Some(p) = res.pids() {
        let limit = p.limit();
        if limit > 0 {
            pids = u32::try_from(limit).unwrap_or(u32::MAX).min(4_194_304);
        }
    }
    Ok((mem, cpus, pids))
}

/// How many CPUs a cpuset list (`0-3,6`) names.
fn cpuset_len(set: &str) -> Option<u64> {
    let mut n = 0;
    for part in set.split(',') {
        let part = part.trim();
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
                n += b.checked_sub(a)? + 1;
            }
            None => {
                part.parse::<u64>().ok()?;
                n += 1;
            }
        }
    }
    Some(n)
}

/// An absolute destination without `.`, `..` or empty components, as `/a/b`.
fn normal(dest: &str) -> Option<String> {
    if !dest.starts_with('/') {
        return None;
    }
    let mut out = String::new();
    for c in Path::new(dest).components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => {
                out.push('/');
                out.push_str(n.to_str()?);
            }
            _ => return None,
        }
    }
    if out.is_empty() {
        return None;
    }
    Some(out)
}

/// A tmpfs mount's options as amvm's `--tmpfs` takes them (engines add propagation and
/// atime flags that mean nothing to a fresh tmpfs in the guest).
fn tmpfs_options(dest: &str, options: &[String]) -> Result<String, OciError> {
    let mut keep = Vec::new();
    for o in options {
        match o.split_once('=') {
            Some((k, v)) if ["size", "mode", "nr_inodes", "uid", "gid"].contains(&k) => {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'%') {
                    return Err(bad(format!("tmpfs on {dest}: bad value for {k}: {v:?}")));
                }
                keep.push(o.as_str());
            }
            Some(_) => {}
            None if ["ro", "noexec"].contains(&o.as_str()) => keep.push(o.as_str()),
            None => {}
        }
    }
    Ok(keep.join(","))
}

/// Make `rel` (relative, normal) exist in `root` as a directory (`dir`) or a file, without
/// following a symlink anywhere on the way: the root is the container's, and may hold links
/// that point out of it. `false` when the last component is a symlink (left alone).
pub fn mount_point(root: &Path, rel: &Path, dir: bool) -> Result<bool, OciError> {
    use std::ffi::CString;
    let fail = |what: &str, e: std::io::Error| {
        bad(format!(
            "making the mount point {}/{}: {what}: {e}",
            root.display(),
            rel.display()
        ))
    };
    let c = |s: &std::ffi::OsStr| {
        CString::new(std::os::unix::ffi::OsStrExt::as_bytes(s))
            .map_err(|_| bad(format!("a NUL in {}", rel.display())))
    };
    let open_dir = |at: i32, name: &CString| -> std::io::Result<OwnedFd> {
        // SAFETY: openat(2) of a NUL-terminated name relative to a descriptor we hold.
        let fd = unsafe {
            libc::openat(
                at,
                name.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    let mut cur = open_dir(libc::AT_FDCWD, &c(root.as_os_str())?).map_err(|e| fail("root", e))?;
    let parts: Vec<_> = rel.components().collect();
    for (i, part) in parts.iter().enumerate() {
        let Component::Normal(name) = part else {
            return Err(bad(format!(
                "mount point {}: not a normal path",
                rel.display()
            )));
        };
        let name = c(name)?;
        let last = i + 1 == parts.len();
        if !last || dir {
            match open_dir(cur.as_raw_fd(), &name) {
                Ok(fd) => cur = fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    // SAFETY: mkdirat(2) of a NUL-terminated name relative to our descriptor.
                    if unsafe { libc::mkdirat(cur.as_raw_fd(), name.as_ptr(), 0o755) } != 0 {
                        return Err(fail("mkdir", std::io::Error::last_os_error()));
                    }
                    cur = open_dir(cur.as_raw_fd(), &name).map_err(|e| fail("open", e))?;
                }
                Err(e) if last && is_symlink_at(cur.as_raw_fd(), &name) => {
                    let _ = e;
                    return Ok(false);
                }
                Err(e) => return Err(fail("a symlink or not a directory on the way", e)),
            }
            continue;
        }
        if is_symlink_at(cur.as_raw_fd(), &name) {
            return Ok(false);
        }
        // SAFETY: openat(2) creating a NUL-terminated name relative to our descriptor; the
        // descriptor is closed at once.
        let fd = unsafe {
            libc::openat(
                cur.as_raw_fd(),
                name.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            // A read-only root (or a directory there) is fine when the file exists.
            if e.raw_os_error() == Some(libc::EROFS) && exists_at(cur.as_raw_fd(), &name) {
                return Ok(true);
            }
            return Err(fail("create", e));
        }
        // SAFETY: closing the descriptor openat returned.
        unsafe { libc::close(fd) };
    }
    Ok(true)
}

fn stat_at(at: i32, name: &std::ffi::CString) -> Option<libc::stat> {
    // SAFETY: stat is plain data; all-zero is a valid value before fstatat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat(2) of a NUL-terminated name into a local, not following a symlink.
    let rc = unsafe { libc::fstatat(at, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    (rc == 0).then_some(st)
}

fn is_symlink_at(at: i32, name: &std::ffi::CString) -> bool {
    stat_at(at, name).is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK)
}

fn exists_at(at: i32, name: &std::ffi::CString) -> bool {
    stat_at(at, name).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_size_the_vm() {
        let spec: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","linux":{"resources":{
                "memory":{"limit":134217728},"cpu":{"quota":200000,"period":100000},
                "pids":{"limit":64}}}}"#,
        )
        .unwrap();
        assert_eq!(resources(&spec).unwrap(), (128 + MEM_HEADROOM_MIB, 2, 64));
        let spec: Spec = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","linux":{"resources":{"cpu":{"cpus":"0-3"}}}}"#,
        )
        .unwrap();
        assert_eq!(
            resources(&spec).unwrap(),
            (DEFAULT_MEM_MIB, 4, crate::cli::DEFAULT_PIDS)
        );
    }

    #[test]
    fn cpusets_and_destinations() {
        assert_eq!(cpuset_len("0-3,6"), Some(5));
        assert_eq!(cpuset_len("2"), Some(1));
        assert_eq!(cpuset_len("3-1"), None);
        assert_eq!(cpuset_len("x"), None);
        assert_eq!(normal("/etc//hosts").as_deref(), Some("/etc/hosts"));
        assert_eq!(normal("/a/../b"), None);
        assert_eq!(normal("rel"), None);
        assert_eq!(normal("/"), None);
    }

    #[test]
    fn tmpfs_options_keep_what_a_fresh_tmpfs_means() {
        let o: Vec<String> = ["rw", "noexec", "nosuid", "nodev", "size=65536k", "rprivate"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(tmpfs_options("/tmp", &o).unwrap(), "noexec,size=65536k");
        assert!(tmpfs_options("/tmp", &["size=1m,uid=0".into()]).is_err());
    }

    #[test]
    fn mount_points_never_follow_a_symlink() {
        let root = std::env::temp_dir().join(format!("amvm-oci-mp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let outside = root.with_extension("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/resolv.conf")).unwrap();
        assert!(mount_point(&root, Path::new("data/deep"), true).unwrap());
        assert!(root.join("data/deep").is_dir());
        assert!(mount_point(&root, Path::new("etc/hosts"), false).unwrap());
        assert!(root.join("etc/hosts").is_file());
        assert!(!mount_point(&root, Path::new("etc/resolv.conf"), false).unwrap());
        assert!(mount_point(&root, Path::new("escape/x"), true).is_err());
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_dir_all(&outside);
    }
}
