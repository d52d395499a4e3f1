//! The guest's file systems. The initramfs holds guest-init alone; everything else is built
//! here, in two steps:
//!
//! * [`early`], before the control channel: /dev (devtmpfs, then the console as our stdio),
//!   /dev/pts, /proc, /sys, /tmp.
//! * [`root`], from the run spec: the virtio-fs shares read-only (the system's `/usr`, the
//!   workspace), the merged-/usr links (`/bin` → `usr/bin`, ...), a sealed `/etc` built from the
//!   spec's files, and tmpfs `/run` and `/home` with size caps.

use crate::sys::{mount, remount_readonly};
use guest_init::protocol::{Mount, RunSpec, SpecFile, DISK_TAG_PREFIX};
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Where guest-init appears under other names (`amvm-connect`), last in the workload's PATH.
pub const TOOLS_DIR: &str = "/amvm/bin";

const NODEV_NOSUID: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

fn ctx(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Mount the kernel file systems the workload and guest-init need; make the console our stdio.
pub fn early() -> io::Result<()> {
    for (fstype, target, flags, data) in [
        ("devtmpfs", "/dev", libc::MS_NOSUID, None),
        // Pseudo-terminals (`script`, Python's pty, node-pty): /dev/ptmx opens the devpts
        // instance mounted beside it, at /dev/pts.
        (
            "devpts",
            "/dev/pts",
            NODEV_NOSUID | libc::MS_NOEXEC,
            Some("mode=0620,ptmxmode=0666"),
        ),
        ("proc", "/proc", NODEV_NOSUID | libc::MS_NOEXEC, None),
        ("sysfs", "/sys", NODEV_NOSUID | libc::MS_NOEXEC, None),
        ("tmpfs", "/tmp", NODEV_NOSUID, Some("mode=1777,size=50%")),
    ] {
        fs::create_dir_all(target)?;
        mount(fstype, target, fstype, flags, data)
            .map_err(ctx(format!("mount {fstype} on {target}")))?;
    }
    console_stdio();
    Ok(())
}

/// The initramfs has no /dev/console, so the kernel started us without stdio: open it now.
fn console_stdio() {
    if let Ok(c) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors; `c` stays open for the call.
            unsafe { libc::dup2(c.as_raw_fd(), fd) };
        }
    }
}

/// Build the root the workload sees, as the spec describes it.
pub fn root(spec: &RunSpec) -> io::Result<()> {
    for Mount {
        tag,
        path,
        writable,
    } in &spec.mounts
    {
        let (tag, path) = (
            String::from_utf8_lossy(tag).into_owned(),
            String::from_utf8_lossy(path).into_owned(),
        );
        fs::create_dir_all(&path)?;
        if let Some(id) = tag.strip_prefix(std::str::from_utf8(DISK_TAG_PREFIX).unwrap_or("")) {
            // A read-only disk: read-only here whatever the spec says (the host refuses
            // writes too).
            let dev = disk_by_serial(id)?;
            mount(&dev, &path, "erofs", libc::MS_RDONLY | NODEV_NOSUID, None).map_err(ctx(
                format!("mount the EROFS disk {id:?} ({dev}) on {path}"),
            ))?;
            continue;
        }
        mount(
            &tag,
            &path,
            "virtiofs",
            if *writable {
                NODEV_NOSUID
            } else {
                libc::MS_RDONLY | NODEV_NOSUID
            },
            None,
        )
        .map_err(ctx(format!("mount virtio-fs {tag:?} on {path}")))?;
    }
    if !spec.root.is_empty() {
        container_root(Path::new(OsStr::from_bytes(&spec.root)))?;
    }
    // Merged /usr: the classic paths are links into it.
    for (link, target) in [
        ("/bin", "usr/bin"),
        ("/sbin", "usr/sbin"),
        ("/lib", "usr/lib"),
        ("/lib64", "usr/lib64"),
        ("/lib32", "usr/lib32"),
        ("/libx32", "usr/libx32"),
    ] {
        if Path::new("/").join(target).exists() {
            std::os::unix::fs::symlink(target, link).map_err(ctx(format!("link {link}")))?;
        }
    }
    etc(&spec.files)?;
    for (target, mode, size) in [("/run", "0755", "64m"), ("/home", "0755", "50%")] {
        fs::create_dir_all(target)?;
        let data = format!("mode={mode},size={size}");
        mount("tmpfs", target, "tmpfs", NODEV_NOSUID, Some(&data))
            .map_err(ctx(format!("mount tmpfs on {target}")))?;
    }
    fs::create_dir_all("/root")?;
    fs::set_permissions("/root", fs::Permissions::from_mode(0o700))?;
    fs::create_dir_all("/var")?;
    std::os::unix::fs::symlink("/tmp", "/var/tmp")?;
    fs::create_dir_all(TOOLS_DIR)?;
    std::os::unix::fs::symlink("/init", Path::new(TOOLS_DIR).join("amvm-connect"))?;
    // The workload's own tmpfs mounts (`--tmpfs`), last, so one on /tmp replaces the default.
    for t in &spec.tmpfs {
        let path = String::from_utf8_lossy(&t.path).into_owned();
        let (flags, data) = tmpfs_options(&String::from_utf8_lossy(&t.options));
        fs::create_dir_all(&path).map_err(ctx(format!("making the mount point {path}")))?;
        mount("tmpfs", &path, "tmpfs", flags, Some(&data))
            .map_err(ctx(format!("mount tmpfs on {path} ({data})")))?;
    }
    if !spec.root.is_empty() {
        root_files(Path::new(OsStr::from_bytes(&spec.root)), &spec.files)?;
    }
    if !spec.hostname.is_empty() {
        // SAFETY: sethostname(2) reads `len` bytes of a buffer that outlives the call.
        let rc = unsafe { libc::sethostname(spec.hostname.as_ptr().cast(), spec.hostname.len()) };
        if rc != 0 {
            return Err(ctx("sethostname".into())(io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// The device node of the virtio-blk disk whose serial is `id` (`/sys/block/vdX/serial`).
fn disk_by_serial(id: &str) -> io::Result<String> {
    let entries = fs::read_dir("/sys/block").map_err(ctx("/sys/block".into()))?;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("vd") {
            continue;
        }
        let serial = fs::read(e.path().join("serial")).unwrap_or_default();
        if serial.trim_ascii_end() == id.as_bytes() {
            return Ok(format!("/dev/{name}"));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no virtio-blk disk with the serial {id:?} in /sys/block"),
    ))
}

/// A container's root (its share mounted at `root` already): the kernel's file systems inside
/// it, as a container runtime makes them. Its own `/etc` and the rest are the image's.
pub(crate) fn container_root(root: &Path) -> io::Result<()> {
    let at = |p: &str| root.join(p);
    let need = |p: &Path| -> io::Result<()> {
        if p.is_dir() {
            return Ok(());
        }
        fs::create_dir(p).map_err(ctx(format!(
            "the root file system has no {} to mount on",
            p.display()
        )))
    };
    for (fstype, target, flags) in [
        ("proc", "proc", NODEV_NOSUID | libc::MS_NOEXEC),
        (
            "sysfs",
            "sys",
            NODEV_NOSUID | libc::MS_NOEXEC | libc::MS_RDONLY,
        ),
    ] {
        let p = at(target);
        need(&p)?;
        mount(fstype, &p.to_string_lossy(), fstype, flags, None)
            .map_err(ctx(format!("mount {fstype} on {}", p.display())))?;
    }
    // The guest's /dev (devtmpfs, with /dev/pts), and a /dev/shm of its own.
    let dev = at("dev");
    need(&dev)?;
    crate::sys::bind("/dev", &dev.to_string_lossy(), true)
        .map_err(ctx(format!("bind /dev on {}", dev.display())))?;
    let shm = dev.join("shm");
    fs::create_dir_all(&shm)?;
    mount(
        "tmpfs",
        &shm.to_string_lossy(),
        "tmpfs",
        NODEV_NOSUID,
        Some("mode=1777,size=64m"),
    )
    .map_err(ctx(format!("mount tmpfs on {}", shm.display())))
}

/// The spec's files under a container's root (an engine's `/etc/hosts`, `/etc/resolv.conf`,
/// `/etc/hostname`): each written to a tmpfs of its own and bind-mounted, read-only, over the
/// file the root has there (which must exist: amvm makes it on the host when it can).
fn root_files(root: &Path, files: &[SpecFile]) -> io::Result<()> {
    let store = Path::new("/run/amvm/files");
    let mut n = 0;
    for f in files {
        let SpecFile::File { path, data } = f else {
            continue;
        };
        let target = Path::new(OsStr::from_bytes(path));
        if !target.starts_with(root) {
            continue;
        }
        if n == 0 {
            fs::create_dir_all(store)?;
        }
        n += 1;
        let src = store.join(n.to_string());
        fs::write(&src, data)?;
        fs::set_permissions(&src, fs::Permissions::from_mode(0o644))?;
        if !target.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no file to mount on in the root", target.display()),
            ));
        }
        let t = target.to_string_lossy();
        crate::sys::bind(&src.to_string_lossy(), &t, false)
            .map_err(ctx(format!("bind a file on {t}")))?;
        remount_readonly(&t, NODEV_NOSUID | libc::MS_BIND).map_err(ctx(format!("seal {t}")))?;
    }
    Ok(())
}

/// `--tmpfs` options (checked by amvm): mount flags, and the rest as tmpfs's own data. nosuid
/// and nodev always; `noexec` and `ro` when asked.
fn tmpfs_options(options: &str) -> (libc::c_ulong, String) {
    let mut flags = NODEV_NOSUID;
    let mut data = Vec::new();
    for o in options.split(',').filter(|o| !o.is_empty()) {
        match o {
            "noexec" => flags |= libc::MS_NOEXEC,
            "ro" => flags |= libc::MS_RDONLY,
            "rw" | "exec" | "nosuid" | "nodev" => {}
            kv => data.push(kv),
        }
    }
    (flags, data.join(","))
}

/// A tmpfs `/etc` holding exactly the spec's files, then remounted read-only.
fn etc(files: &[SpecFile]) -> io::Result<()> {
    fs::create_dir_all("/etc")?;
    mount(
        "tmpfs",
        "/etc",
        "tmpfs",
        NODEV_NOSUID,
        Some("mode=0755,size=16m"),
    )
    .map_err(ctx("mount tmpfs on /etc".into()))?;
    for f in files {
        let path = match f {
            SpecFile::File { path, .. } | SpecFile::Symlink { path, .. } => {
                Path::new(OsStr::from_bytes(path))
            }
        };
        if !path.starts_with("/etc/") {
            continue;
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        match f {
            SpecFile::File { data, .. } => fs::write(path, data)?,
            SpecFile::Symlink { target, .. } => {
                std::os::unix::fs::symlink(OsStr::from_bytes(target), path)?
            }
        }
    }
    remount_readonly("/etc", NODEV_NOSUID).map_err(ctx("seal /etc".into()))
}
