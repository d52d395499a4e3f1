//! What one `amvm run` needs, validated: the machine (kernel, memory, vCPUs), what the guest
//! runs (the [`RunSpec`] guest-init receives) and how the run is supervised.

use crate::arch::x86_64::mptable;
use guest_init::protocol::{RunSpec, SpecFile};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const MIN_MEM_MIB: u64 = 64;
pub const MAX_MEM_MIB: u64 = 256 * 1024;
/// The workload's default PATH; the last entry holds amvm's own guest tools (`amvm-connect`).
pub const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/amvm/bin";
/// Where `--workspace` appears in the guest (and the default working directory with it).
pub const WORKSPACE_PATH: &str = "/workspace";
/// The virtio-fs tags of the shares.
pub const TAG_SYSTEM: &str = "system";
pub const TAG_ROOT: &str = "root";
/// Where a container's root (`--rootfs`) is mounted in the guest; its processes are chrooted
/// into it and never see the path.
pub const ROOTFS_PATH: &str = "/rootfs";
pub const TAG_WORKSPACE: &str = "workspace";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--mem {0}: must be between {MIN_MEM_MIB} and {MAX_MEM_MIB} MiB")]
    Mem(u64),
    #[error("--cpus {0}: must be between 1 and {max}", max = mptable::MAX_CPUS)]
    Cpus(u8),
    #[error("--image {0}: {1}")]
    Image(String, String),
    #[error("--user {0:?}: expected UID or UID:GID (numbers)")]
    User(String),
    #[error("-e {0:?}: expected KEY=VALUE with a non-empty KEY")]
    Env(String),
    #[error("-w {0:?}: the working directory must be an absolute path")]
    Workdir(String),
    #[error("--timeout 0: the limit must be at least 1 second")]
    Timeout,
    #[error("{0}")]
    Gateway(String),
    #[error("the command and its environment take {0} bytes, more than the {max} allowed", max = guest_init::protocol::MAX_SPEC_LEN)]
    SpecTooLarge(usize),
    #[error("no default kernel: run images/setup (as root it installs one for every user in /usr/local/lib/amvm), set AMVM_KERNEL, AMVM_CACHE or HOME, or pass --kernel")]
    NoDefaultKernel,
    #[error("--workspace {0}: {1}")]
    Workspace(PathBuf, String),
    #[error("--system {0}: {1}")]
    System(PathBuf, String),
    #[error("--rootfs {0}: {1}")]
    Rootfs(String, String),
    #[error("AMVM_HUGE_PAGES={0:?}: say 1 (on) or 0 (off)")]
    HugePagesEnv(String),
    #[error("--changes needs a writable workspace: --workspace DIR:overlay")]
    ChangesWithoutOverlay,
    #[error("--overlay-size needs a writable workspace: --workspace DIR:overlay")]
    SizeWithoutOverlay,
    #[error("--overlay-size {0:?}: {1}")]
    OverlaySize(String, &'static str),
    #[error("--workspace {0}:overlay: {1}")]
    Overlay(PathBuf, String),
    #[error("--changes {0}: {1}")]
    Changes(PathBuf, String),
    #[error("--tmpfs {0}: {1}")]
    Tmpfs(String, String),
    #[error("-v {0}: {1}")]
    Volume(String, String),
}

/// A guest path to mount on: absolute, without `.`, `..` or empty components, and not `/` or
/// under the system's own trees (`/usr`, `/etc`, `/proc`, `/sys`, `/dev`), which are the
/// guest's read-only userland or the kernel's.
pub fn guest_mount_point(p: &str) -> Result<String, String> {
    if !p.starts_with('/') {
        return Err("the guest path must be absolute".into());
    }
    let parts: Vec<&str> = p.split('/').skip(1).collect();
    if parts
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == "..")
        && p != "/"
    {
        return Err("the guest path has an empty, `.` or `..` component".into());
    }
    let top = parts.first().copied().unwrap_or("");
    if p == "/"
        || [
            "usr", "etc", "proc", "sys", "dev", "bin", "sbin", "lib", "lib64",
        ]
        .contains(&top)
    {
        return Err(format!("cannot mount over {p}: it is the guest's own"));
    }
    Ok(p.to_string())
}

/// `--tmpfs PATH[:OPTIONS]`, docker's syntax: OPTIONS a comma list of `size=`, `mode=`,
/// `nr_inodes=`, `uid=`, `gid=` and the flags `rw`, `ro`, `exec`, `noexec`, `nosuid`, `nodev`
/// (amvm always mounts nosuid and nodev).
pub fn tmpfs(arg: &str) -> Result<guest_init::protocol::Tmpfs, ConfigError> {
    let bad = |why: String| ConfigError::Tmpfs(arg.to_string(), why);
    let (path, options) = arg.split_once(':').unwrap_or((arg, ""));
    let path = guest_mount_point(path).map_err(bad)?;
    for o in options.split(',').filter(|o| !o.is_empty()) {
        match o.split_once('=') {
            Some((k, v)) if ["size", "mode", "nr_inodes", "uid", "gid"].contains(&k) => {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'%') {
                    return Err(bad(format!("bad value for {k}: {v:?}")));
                }
            }
            None if ["rw", "ro", "exec", "noexec", "nosuid", "nodev"].contains(&o) => {}
            None if ["suid", "dev"].contains(&o) => {
                return Err(bad(format!("{o}: amvm always mounts a tmpfs nosuid,nodev")))
            }
            _ => return Err(bad(format!("unknown option {o:?} (size=, mode=, nr_inodes=, uid=, gid=, rw, ro, exec, noexec, nosuid, nodev)"))),
        }
    }
    Ok(guest_init::protocol::Tmpfs {
        path: path.into_bytes(),
        options: options.as_bytes().to_vec(),
    })
}

/// What a volume's host side is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeSource {
    /// A directory, shared over virtio-fs.
    Dir(PathBuf),
    /// An EROFS image file, a read-only virtio-blk disk the guest mounts.
    Image(PathBuf),
}

/// EROFS's superblock magic, at byte 1024 of an image (`fs/erofs/erofs_fs.h`).
pub const EROFS_MAGIC: u32 = 0xE0F5_E1E2;
const EROFS_MAGIC_AT: u64 = 1024;

/// Whether `file` starts as an EROFS image does (its superblock's magic).
pub fn is_erofs(file: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file)?;
    let mut magic = [0u8; 4];
    match f.read_exact_at(&mut magic, EROFS_MAGIC_AT) {
        Ok(()) => Ok(u32::from_le_bytes(magic) == EROFS_MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// `-v HOST:GUEST[:ro|rw]`: an existing host directory or EROFS image (canonical), the guest
/// path, writable (never for an image).
pub fn volume(arg: &str) -> Result<(VolumeSource, String, bool), ConfigError> {
    let bad = |why: String| ConfigError::Volume(arg.to_string(), why);
    let parts: Vec<&str> = arg.split(':').collect();
    let (host, guest, writable) = match parts[..] {
        [h, g] => (h, g, false),
        [h, g, "ro"] => (h, g, false),
        [h, g, "rw"] => (h, g, true),
        [_, _, m] => return Err(bad(format!("mode {m:?}: say ro or rw"))),
        _ => return Err(bad("say HOST:GUEST[:ro|rw]".into())),
    };
    let path = Path::new(host)
        .canonicalize()
        .map_err(|e| bad(format!("{host}: {e}")))?;
    let guest = guest_mount_point(guest).map_err(bad)?;
    if path.is_dir() {
        return Ok((VolumeSource::Dir(path), guest, writable));
    }
    if !path.is_file() {
        return Err(bad(format!(
            "{host}: neither a directory nor an EROFS image file"
        )));
    }
    match is_erofs(&path) {
        Ok(true) => {}
        Ok(false) => {
            return Err(bad(format!(
                "{host}: not a directory, and not an EROFS image (make one with mkfs.erofs)"
            )))
        }
        Err(e) => return Err(bad(format!("{host}: {e}"))),
    }
    if writable {
        return Err(bad(format!(
            "{host}: an EROFS image is read-only; drop :rw"
        )));
    }
    Ok((VolumeSource::Image(path), guest, false))
}

/// `--rootfs DIR[:rw]`: an existing directory (canonical) and whether the guest may write it.
pub fn rootfs(arg: &str) -> Result<(PathBuf, bool), ConfigError> {
    let bad = |why: String| ConfigError::Rootfs(arg.to_string(), why);
    let (dir, writable) = match arg.rsplit_once(':') {
        Some((d, "rw")) => (d, true),
        Some((d, "ro")) => (d, false),
        _ => (arg, false),
    };
    let dir = Path::new(dir)
        .canonicalize()
        .map_err(|e| bad(e.to_string()))?;
    if !dir.is_dir() {
        return Err(bad("not a directory".into()));
    }
    Ok((dir, writable))
}

/// `path` (a guest path, absolute) where the guest sees it: under [`ROOTFS_PATH`] when the
/// processes' root is a container's.
pub fn guest_path(rootfs: bool, path: &str) -> String {
    if rootfs {
        format!("{ROOTFS_PATH}{path}")
    } else {
        path.to_string()
    }
}

/// `--workspace DIR:overlay`: the workspace writable over DIR, which is never written; the
/// writes go to a layer in a scratch directory on the host (made at run time).
#[derive(Debug, Clone)]
pub struct Overlay {
    /// DIR, canonical.
    pub lower: PathBuf,
    /// Where the changes go at exit (`--changes`).
    pub changes: Option<PathBuf>,
    /// The scratch directory (`upper/`, `work/`, `merged/`), once made (`amvm run` makes it,
    /// beside FILE or in the runtime directory, before the VM starts).
    pub scratch: Option<PathBuf>,
    /// `--overlay-size`: the upper layer's cap in bytes (the scratch directory is then a tmpfs
    /// of that size in the supervisor's own mount namespace: overlay.rs).
    pub size: Option<u64>,
}

/// `--overlay-size SIZE`: bytes, or a number with a binary suffix `k`, `m`, `g` (either case,
/// an optional `b` or `ib` after it: `64m`, `64MiB`), at least 1 MiB.
pub fn overlay_size(arg: &str) -> Result<u64, ConfigError> {
    let bad = |why| ConfigError::OverlaySize(arg.to_string(), why);
    let lower = arg.trim().to_ascii_lowercase();
    let digits = lower.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad("say a size such as 64m or 1g"));
    }
    let shift = match lower[digits..].trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        _ => return Err(bad("the suffix is one of k, m, g")),
    };
    let n: u64 = lower[..digits].parse().map_err(|_| bad("too large"))?;
    let bytes = n.checked_mul(1u64 << shift).ok_or(bad("too large"))?;
    if bytes < 1 << 20 {
        return Err(bad("at least 1m"));
    }
    Ok(bytes)
}

/// `--workspace` as given: `DIR`, or `DIR:overlay` (unless a directory of that whole name
/// exists, which is then DIR).
pub fn workspace_arg(arg: &Path) -> Result<(PathBuf, bool), ConfigError> {
    use std::os::unix::ffi::OsStrExt;
    let b = arg.as_os_str().as_bytes();
    match b.strip_suffix(b":overlay") {
        Some(dir) if !arg.is_dir() => Ok((PathBuf::from(std::ffi::OsStr::from_bytes(dir)), true)),
        _ => Ok((arg.to_owned(), false)),
    }
}

/// Check an overlay's DIR and `--changes` FILE: overlayfs's option syntax cannot name a DIR
/// with `,`, `:` or `\\`; FILE's directory must exist, and FILE must not be a directory.
pub fn overlay(
    lower: &Path,
    changes: Option<&Path>,
    size: Option<u64>,
) -> Result<Overlay, ConfigError> {
    use std::os::unix::ffi::OsStrExt;
    if lower
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| b",:\\".contains(b))
    {
        return Err(ConfigError::Overlay(
            lower.to_owned(),
            "a path with ',', ':' or '\\' cannot be an overlay's lower directory (rename or move it)".into(),
        ));
    }
    let changes = match changes {
        Some(f) => {
            let bad = |why: &str| ConfigError::Changes(f.to_owned(), why.into());
            if f.is_dir() {
                return Err(bad("is a directory"));
            }
            let parent = match f.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
                _ => PathBuf::from("."),
            };
            let parent = parent
                .canonicalize()
                .map_err(|e| bad(&format!("its directory: {e}")))?;
            let name = f.file_name().ok_or_else(|| bad("names no file"))?;
            Some(parent.join(name))
        }
        None => None,
    };
    Ok(Overlay {
        lower: lower.to_owned(),
        changes,
        scratch: None,
        size,
    })
}

/// A validated run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub kernel: PathBuf,
    pub mem_mib: u64,
    pub cpus: u8,
    /// Show the guest's kernel console on stderr.
    pub console: bool,
    /// Guest RAM on transparent huge pages (`--huge-pages`, `AMVM_HUGE_PAGES=1`), else a memfd.
    pub huge_pages: bool,
    /// Filter amvm's own threads with seccomp (off only with `--no-seccomp`).
    pub seccomp: bool,
    pub timeout: Option<Duration>,
    pub spec: RunSpec,
    /// virtio-fs shares: (tag, host directory, writable), each served by its own virtiofsd,
    /// read-only unless writable (an `rw` volume; an overlay workspace is served from its merged
    /// directory instead).
    pub shares: Vec<(String, PathBuf, bool)>,
    pub virtiofsd: PathBuf,
    /// Read-only disks (`-v IMAGE:GUEST`): EROFS images, each a virtio-blk device after the
    /// shares, which the guest finds by its serial and mounts read-only.
    pub disks: Vec<Disk>,
    /// The host unix socket egress streams go to (`--egress`, or the gateway's), and their log.
    pub egress: Option<PathBuf>,
    pub egress_log: Option<PathBuf>,
    /// `--egress-allow`: the sandbox's own gateway, which its supervisor starts (its socket is
    /// then `egress`).
    pub gateway: Option<GatewaySpec>,
    /// `--workspace DIR:overlay`.
    pub overlay: Option<Overlay>,
    /// A session (`amvm create`): the unix socket of its supervisor, which the guest's control
    /// and exec streams connect to (`spec.session` is set too).
    pub session: Option<PathBuf>,
    /// `amvm create --from DIR`: continue a snapshot's machine instead of booting one (a
    /// session's; the state checked, the memory file open, both by the caller).
    pub restore: Option<std::sync::Arc<Restore>>,
}

/// A read-only disk: its image file and the serial the guest finds it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disk {
    pub id: String,
    pub image: PathBuf,
}

/// The serial of the `i`th disk (`-v IMAGE:GUEST`; at most 20 bytes:
/// `VIRTIO_BLK_ID_BYTES`).
pub fn disk_id(i: usize) -> String {
    format!("amvm-disk{i}")
}

/// The serial of an image root's disk.
pub const DISK_ROOT_ID: &str = "amvm-root";

/// A snapshot to continue from (snapshot/): its decoded state and its memory file.
#[derive(Debug)]
pub struct Restore {
    pub state: crate::snapshot::MachineState,
    pub memory: std::fs::File,
    /// The snapshot's next exec id: the restored sandbox's execs start there.
    pub next_exec_id: u64,
    /// An overlay workspace's upper layer in the snapshot (`DIR/upper`): copied into the new
    /// sandbox's scratch directory before its overlay is mounted.
    pub upper: Option<PathBuf>,
}

/// Where `images/setup`, run as root, also installs the guest kernel and virtiofsd, for every
/// user (root's own cache is out of other users' reach).
pub const SYSTEM_DIR: &str = "/usr/local/lib/amvm";

/// A piece `images/setup` installs: `cache/in_cache` when it exists (this user's own set-up),
/// else `SYSTEM_DIR/name` when that exists (root's, for every user), else `cache/in_cache`
/// (whose absence the caller reports, saying both places). `None` without a cache or a system
/// copy.
pub fn installed(cache: Option<&Path>, in_cache: &str, name: &str) -> Option<PathBuf> {
    let own = cache.map(|c| c.join(in_cache));
    if let Some(own) = own.as_ref().filter(|p| p.exists()) {
        return Some(own.clone());
    }
    let system = Path::new(SYSTEM_DIR).join(name);
    if system.exists() {
        return Some(system);
    }
    own
}

/// The kernel `images/build-kernel` builds: `$AMVM_KERNEL`, else the `vmlinux` link in the
/// cache (`$AMVM_CACHE`, default `~/.cache/amvm`), else root's copy for every user in
/// [`SYSTEM_DIR`].
pub fn default_kernel() -> Result<PathBuf, ConfigError> {
    if let Some(k) = std::env::var_os("AMVM_KERNEL") {
        return Ok(PathBuf::from(k));
    }
    installed(cache_dir().as_deref(), "kernel/vmlinux", "vmlinux")
        .ok_or(ConfigError::NoDefaultKernel)
}

/// Guest RAM on huge pages, from `--huge-pages` / `--no-huge-pages` (at most one: clap says so)
/// and `AMVM_HUGE_PAGES` (`1`: as `--huge-pages`; `0`, empty or unset: not). A flag wins over
/// the variable, but a malformed variable is an error either way.
pub fn huge_pages(on: bool, off: bool, env: Option<&std::ffi::OsStr>) -> Result<bool, ConfigError> {
    let from_env = match env {
        None => false,
        Some(v) if v.is_empty() || v == "0" => false,
        Some(v) if v == "1" => true,
        Some(v) => return Err(ConfigError::HugePagesEnv(v.to_string_lossy().into_owned())),
    };
    Ok(on || (!off && from_env))
}

/// amvm's cache: `$AMVM_CACHE`, else `~/.cache/amvm`.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("AMVM_CACHE") {
        Some(c) => Some(PathBuf::from(c)),
        None => Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache/amvm")),
    }
}

/// `--workspace DIR`: an existing directory, made absolute.
pub fn workspace(dir: &Path) -> Result<PathBuf, ConfigError> {
    let bad = |why: String| ConfigError::Workspace(dir.to_owned(), why);
    let abs = dir.canonicalize().map_err(|e| bad(e.to_string()))?;
    if !abs.is_dir() {
        return Err(bad("not a directory".into()));
    }
    Ok(abs)
}

/// `--system host|NAME|DIR`: the root whose `/usr` the guest gets. `host` is `/`; a bare NAME
/// (no `/`) is a built image (`crate::image`); a DIR must be a merged-/usr root (`bin` a link to
/// `usr/bin`, as Debian has been since 12) with a `/bin/sh`. An image's rootfs is checked as a DIR.
pub fn system_root(system: &str) -> Result<PathBuf, ConfigError> {
    if system == "host" {
        return Ok(PathBuf::from("/"));
    }
    if crate::image::is_name(system) {
        let bad = |e: crate::image::ImageError| ConfigError::System(system.into(), e.to_string());
        let image =
            crate::image::find(&crate::image::images_dir().map_err(bad)?, system).map_err(bad)?;
        return check_root(&image.rootfs);
    }
    check_root(Path::new(system))
}

fn check_root(dir: &Path) -> Result<PathBuf, ConfigError> {
    let bad = |why: &str| ConfigError::System(dir.to_owned(), why.to_string());
    let root = dir.canonicalize().map_err(|e| bad(&e.to_string()))?;
    if !root.join("usr").is_dir() {
        return Err(bad("no usr directory: not an unpacked root filesystem"));
    }
    let sh = root.join("usr/bin/sh");
    // `sh` is often a link (to dash or busybox): resolve it inside the root, not on the host.
    let target = resolve_in(&root, &sh).ok_or_else(|| bad("has no usable /bin/sh"))?;
    let meta = std::fs::metadata(&target).map_err(|_| bad("has no usable /bin/sh"))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(bad("has no usable /bin/sh (not an executable file)"));
    }
    for link in ["bin", "sbin", "lib"] {
        let p = root.join(link);
        if p.exists() && !p.is_symlink() {
            return Err(bad(&format!(
                "/{link} is a directory, not a link into /usr: amvm needs a merged-/usr root"
            )));
        }
    }
    Ok(root)
}

/// Follow `path`'s symlinks (at most 16) with absolute targets taken inside `root`.
fn resolve_in(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut p = path.to_owned();
    for _ in 0..16 {
        match std::fs::read_link(&p) {
            Ok(t) if t.is_absolute() => p = root.join(t.strip_prefix("/").ok()?),
            Ok(t) => p = p.parent()?.join(t),
            Err(_) => return p.exists().then_some(p),
        }
    }
    None
}

/// The guest's `/etc`: a user database with the workload's user, localhost, name lookup from
/// files only; from the system root its dynamic-linker cache and the `alternatives` links
/// (how Debian names `awk`, `nc`, ...); and the host's CA certificates. Nothing else of the
/// host's `/etc` (no shadow, no keys) reaches the guest.
pub fn etc_files(root: &Path, uid: u32, gid: u32) -> Vec<SpecFile> {
    let file = |path: &str, data: Vec<u8>| SpecFile::File {
        path: path.as_bytes().to_vec(),
        data,
    };
    let mut passwd = String::from("root:x:0:0:root:/root:/bin/sh\n");
    let mut group = String::from("root:x:0:\n");
    if uid != 0 {
        passwd.push_str(&format!("agent:x:{uid}:{gid}:agent:/home/agent:/bin/sh\n"));
    }
    if gid != 0 {
        group.push_str(&format!("agent:x:{gid}:\n"));
    }
    passwd.push_str("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
    group.push_str("nogroup:x:65534:\n");
    let mut files = vec![
        file("/etc/passwd", passwd.into_bytes()),
        file("/etc/group", group.into_bytes()),
        file(
            "/etc/hosts",
            b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n".to_vec(),
        ),
        file(
            "/etc/nsswitch.conf",
            b"passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\n\
              protocols: files\nservices: files\n"
                .to_vec(),
        ),
        file("/etc/hostname", b"amvm\n".to_vec()),
    ];
    if let Ok(cache) = std::fs::read(root.join("etc/ld.so.cache")) {
        files.push(file("/etc/ld.so.cache", cache));
    }
    if let Ok(dir) = std::fs::read_dir(root.join("etc/alternatives")) {
        let mut links: Vec<(Vec<u8>, Vec<u8>)> = dir
            .flatten()
            .filter_map(|e| {
                let target = std::fs::read_link(e.path()).ok()?;
                let mut path = b"/etc/alternatives/".to_vec();
                path.extend_from_slice(e.file_name().as_bytes());
                Some((path, target.into_os_string().into_vec()))
            })
            .collect();
        // A stable order (the directory's is not), by name.
        links.sort_unstable();
        files.extend(
            links
                .into_iter()
                .map(|(path, target)| SpecFile::Symlink { path, target }),
        );
    }
    if let Ok(certs) = std::fs::read("/etc/ssl/certs/ca-certificates.crt") {
        files.push(file("/etc/ssl/certs/ca-certificates.crt", certs));
    }
    files
}

pub fn check_mem(mib: u64) -> Result<u64, ConfigError> {
    if (MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mib) {
        Ok(mib)
    } else {
        Err(ConfigError::Mem(mib))
    }
}

pub fn check_cpus(n: u8) -> Result<u8, ConfigError> {
    if (1..=mptable::MAX_CPUS).contains(&n) {
        Ok(n)
    } else {
        Err(ConfigError::Cpus(n))
    }
}

/// `UID` or `UID:GID` (GID defaults to UID).
pub fn parse_user(s: &str) -> Result<(u32, u32), ConfigError> {
    let bad = || ConfigError::User(s.to_string());
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?),
        None => {
            let u = s.parse().map_err(|_| bad())?;
            (u, u)
        }
    };
    Ok((u, g))
}

/// The workload's environment: a fixed base, then `-e` entries (later ones win).
pub fn workload_env(uid: u32, extra: &[String]) -> Result<Vec<Vec<u8>>, ConfigError> {
    let home = if uid == 0 { "/root" } else { "/home/agent" };
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), home.into()),
        ("TERM".into(), "dumb".into()),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    for kv in extra {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                env.retain(|(ek, _)| ek != k);
                env.push((k.into(), v.into()));
            }
            _ => return Err(ConfigError::Env(kv.clone())),
        }
    }
    Ok(env
        .into_iter()
        .map(|(k, v)| format!("{k}={v}").into_bytes())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_from_the_flags_and_the_environment() {
        use std::ffi::OsStr;
        let hp = |on, off, env: Option<&str>| huge_pages(on, off, env.map(OsStr::new));
        assert_eq!(hp(false, false, None), Ok(false));
        assert_eq!(hp(false, false, Some("")), Ok(false));
        assert_eq!(hp(false, false, Some("0")), Ok(false));
        assert_eq!(hp(false, false, Some("1")), Ok(true));
        assert_eq!(hp(true, false, None), Ok(true));
        // A flag wins over the variable...
        assert_eq!(hp(true, false, Some("0")), Ok(true));
        assert_eq!(hp(false, true, Some("1")), Ok(false));
        // ...but a malformed variable is reported, flag or not.
        for (on, off) in [(false, false), (true, false), (false, true)] {
            assert_eq!(
                hp(on, off, Some("yes")),
                Err(ConfigError::HugePagesEnv("yes".into()))
            );
        }
    }

    #[test]
    fn users() {
        assert_eq!(parse_user("1000:1000"), Ok((1000, 1000)));
        assert_eq!(parse_user("0"), Ok((0, 0)));
        assert_eq!(parse_user("5:7"), Ok((5, 7)));
        assert!(parse_user("root").is_err());
        assert!(parse_user("1:").is_err());
        assert!(parse_user("-1").is_err());
    }

    #[test]
    fn env_overrides_and_rejects() {
        let env = workload_env(1000, &["HOME=/x".into(), "A=b=c".into(), "EMPTY=".into()]).unwrap();
        let env: Vec<String> = env
            .into_iter()
            .map(|e| String::from_utf8(e).unwrap())
            .collect();
        assert!(env.contains(&"HOME=/x".to_string()));
        assert!(env.contains(&"A=b=c".to_string()));
        assert!(env.contains(&"EMPTY=".to_string()));
        assert_eq!(env.iter().filter(|e| e.starts_with("HOME=")).count(), 1);
        assert_eq!(
            workload_env(0, &["NOEQ".into()]),
            Err(ConfigError::Env("NOEQ".into()))
        );
        assert_eq!(
            workload_env(0, &["=v".into()]),
            Err(ConfigError::Env("=v".into()))
        );
    }

    #[test]
    fn etc_holds_the_user_and_nothing_secret() {
        let files = etc_files(Path::new("/"), 1000, 1000);
        let get = |name: &str| {
            files.iter().find_map(|f| match f {
                SpecFile::File { path, data } if path == name.as_bytes() => {
                    Some(String::from_utf8_lossy(data).into_owned())
                }
                _ => None,
            })
        };
        assert!(get("/etc/passwd")
            .unwrap()
            .contains("agent:x:1000:1000:agent:/home/agent:/bin/sh"));
        assert!(get("/etc/group").unwrap().contains("agent:x:1000:"));
        assert!(get("/etc/hosts").unwrap().contains("localhost"));
        for f in &files {
            let p = match f {
                SpecFile::File { path, .. } | SpecFile::Symlink { path, .. } => path,
            };
            let p = String::from_utf8_lossy(p);
            assert!(
                !p.contains("shadow") && !p.contains("ssh") && !p.contains("private"),
                "{p}"
            );
        }
    }

    #[test]
    fn alternatives_links_come_in_name_order_with_their_targets() {
        let root = std::env::temp_dir().join(format!("amvm-etc-test-{}", std::process::id()));
        let alt = root.join("etc/alternatives");
        std::fs::create_dir_all(&alt).unwrap();
        for (name, target) in [
            ("nc", "/bin/nc.openbsd"),
            ("awk", "/usr/bin/mawk"),
            ("pager", "/bin/less"),
        ] {
            std::os::unix::fs::symlink(target, alt.join(name)).unwrap();
        }
        std::fs::write(alt.join("README"), b"not a link").unwrap();
        let links: Vec<(String, String)> = etc_files(&root, 1000, 1000)
            .into_iter()
            .filter_map(|f| match f {
                SpecFile::Symlink { path, target } => Some((
                    String::from_utf8(path).unwrap(),
                    String::from_utf8(target).unwrap(),
                )),
                SpecFile::File { .. } => None,
            })
            .collect();
        std::fs::remove_dir_all(&root).unwrap();
        let want = [
            ("/etc/alternatives/awk", "/usr/bin/mawk"),
            ("/etc/alternatives/nc", "/bin/nc.openbsd"),
            ("/etc/alternatives/pager", "/bin/less"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        assert_eq!(links, want);
    }

    #[test]
    fn system_roots_are_checked() {
        assert_eq!(system_root("host"), Ok(PathBuf::from("/")));
        let e = system_root("/nonexistent-root").unwrap_err();
        assert!(
            e.to_string().starts_with("--system /nonexistent-root: "),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("amvm-sysroot-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("usr/bin")).unwrap();
        let e = system_root(dir.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("no usable /bin/sh"), "{e}");
        std::os::unix::fs::symlink("/usr/bin/dash", dir.join("usr/bin/sh")).unwrap();
        std::fs::write(dir.join("usr/bin/dash"), b"#!").unwrap();
        let e = system_root(dir.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("not an executable"), "{e}");
        std::fs::set_permissions(
            dir.join("usr/bin/dash"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::create_dir(dir.join("bin")).unwrap();
        let e = system_root(dir.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("merged-/usr"), "{e}");
        std::fs::remove_dir(dir.join("bin")).unwrap();
        std::os::unix::fs::symlink("usr/bin", dir.join("bin")).unwrap();
        assert_eq!(
            system_root(dir.to_str().unwrap()),
            Ok(dir.canonicalize().unwrap())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bounds() {
        assert!(check_mem(63).is_err());
        assert_eq!(check_mem(512), Ok(512));
        assert!(check_cpus(0).is_err());
        assert!(check_cpus(33).is_err());
        assert_eq!(check_cpus(2), Ok(2));
    }
}

/// A sandbox's own egress gateway (`--egress-allow`): `amvm gateway`'s flags, paths absolute.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GatewaySpec {
    pub allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// The audit log: `--egress-log`, else `gateway.jsonl` in the sandbox's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
}

impl GatewaySpec {
    /// `amvm gateway`'s arguments for this spec, listening on `listen`, auditing to `log`.
    pub fn args(&self, listen: &Path, log: &Path) -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> =
            vec!["gateway".into(), "--listen".into(), listen.into()];
        for r in &self.allow {
            a.extend(["--allow".into(), r.into()]);
        }
        for c in &self.credentials {
            a.extend(["--credential".into(), c.into()]);
        }
        if let Some(ca) = &self.ca {
            a.extend(["--ca".into(), ca.into()]);
        }
        a.extend(["--log".into(), log.into()]);
        a
    }
}

/// `--egress-allow`, `--egress-credential`, `--egress-ca` (and `--egress-log`): checked as the
/// gateway will check them (each rule, each credential's file read, the CA parsed), files made
/// absolute; `None` without a rule.
pub fn gateway(
    allow: &[String],
    credentials: &[String],
    ca: Option<&Path>,
    log: Option<&Path>,
) -> Result<Option<GatewaySpec>, ConfigError> {
    use amvm_egress::gateway::{Gateway, GatewayError, Options};
    if allow.is_empty() {
        return Ok(None);
    }
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_owned());
    // A credential's file, absolute: the gateway starts in another directory.
    let credentials: Vec<String> = credentials
        .iter()
        .map(|c| match c.rsplit_once(":@") {
            Some((head, file)) if !file.is_empty() => {
                format!("{head}:@{}", abs(Path::new(file)).display())
            }
            _ => c.clone(),
        })
        .collect();
    let spec = GatewaySpec {
        allow: allow.to_vec(),
        credentials,
        ca: ca.map(abs),
        log: log.map(abs),
    };
    let named = |e: GatewayError| {
        ConfigError::Gateway(match e {
            GatewayError::Allow(a, why) => format!("--egress-allow {a}: {why}"),
            GatewayError::Credential(c, why) => format!(
                "--egress-credential {c}: {}",
                why.replace("--allow", "--egress-allow")
            ),
            GatewayError::Ca(p, why) => format!("--egress-ca {}: {why}", p.display()),
            e => e.to_string(),
        })
    };
    // The log is opened (appended to) by the gateway itself: its directory must be there.
    if let Some(log) = &spec.log {
        if !log.parent().is_some_and(Path::is_dir) {
            return Err(ConfigError::Gateway(format!(
                "--egress-log {}: its directory does not exist",
                log.display()
            )));
        }
    }
    // Everything but the log (opened by the gateway itself, in append mode).
    Gateway::new(&Options {
        listen: PathBuf::new(),
        allow: spec.allow.clone(),
        credentials: spec.credentials.clone(),
        ca: spec.ca.clone(),
        log: None,
        max_streams: 64,
        max_request_bytes: 32 << 20,
        idle_timeout: Duration::from_secs(300),
    })
    .map_err(named)?;
    Ok(Some(spec))
}
