//! The guest's file systems: /dev, /proc, /sys, /tmp on the in-memory root.

use crate::sys::mount;
use std::fs;
use std::io;
use std::path::Path;

/// Mount the kernel file systems the workload and guest-init need.
pub fn early() -> io::Result<()> {
    let nodev_nosuid = libc::MS_NOSUID | libc::MS_NODEV;
    for (fstype, target, flags) in [
        ("devtmpfs", "/dev", libc::MS_NOSUID),
        ("proc", "/proc", nodev_nosuid | libc::MS_NOEXEC),
        ("sysfs", "/sys", nodev_nosuid | libc::MS_NOEXEC),
        ("tmpfs", "/tmp", nodev_nosuid),
    ] {
        fs::create_dir_all(target)?;
        match mount(fstype, target, fstype, flags) {
            // The initramfs may already carry a populated /dev (a console node); devtmpfs on top is fine.
            Ok(()) => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("mount {fstype} on {target}: {e}"),
                ))
            }
        }
    }
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions("/tmp", fs::Permissions::from_mode(0o1777))?;
    Ok(())
}

/// When the initramfs carries busybox, give its applets their names in /bin.
pub fn busybox_applets() {
    let busybox = Path::new("/bin/busybox");
    if busybox.exists() {
        let _ = std::process::Command::new(busybox)
            .args(["--install", "-s", "/bin"])
            .status();
    }
}
