//! A directory tree copied as exactly as this process may: an overlay workspace's upper layer
//! into a snapshot (`amvm snapshot`, while the sandbox is paused) and from there into a
//! restored sandbox's new scratch directory, before its overlay is mounted.
//!
//! Kept: each file's data (sparse: holes stay holes), mode, owner (where this process may set
//! it: as root, or when it is its own already), access and modification times, hard links,
//! symlinks (copied, never followed), and — in a manifest beside the copy, because the
//! snapshot's file system may not hold them as they are (an overlayfs takes a character
//! device 0/0 for a whiteout of its own and refuses `trusted.overlay.*`) — device nodes, FIFOs,
//! sockets and every extended attribute (overlayfs's own included: a whiteout stays a
//! whiteout, an opaque directory opaque). Nothing is followed out of the tree: every entry is
//! looked at with lstat, files are opened with `O_NOFOLLOW`, and a manifest's records apply
//! only to the paths the copy itself walks (one naming anything else is refused).

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{path}: {what}: {source}")]
pub struct TreeError {
    path: PathBuf,
    what: String,
    #[source]
    source: io::Error,
}

/// What a copy copied.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    /// Entries below the top directory.
    pub entries: u64,
    /// File data bytes (holes not counted).
    pub bytes: u64,
}

/// Copy the tree at directory `from` to the new directory `to`, its special files and extended
/// attributes into the file `manifest` (JSON).
pub fn save(from: &Path, to: &Path, manifest: &Path) -> Result<Copied, TreeError> {
    let mut c = Copier::new(Side::Save(Vec::new()));
    c.top(from, to)?;
    let Side::Save(records) = c.side else {
        unreachable!("made as Save")
    };
    let json = serde_json::to_vec(&records).expect("serializable");
    std::fs::write(manifest, json).map_err(err(manifest, "write"))?;
    Ok(c.copied)
}

/// Copy the tree `from` that [`save`] made, with its `manifest`, to `to` (made when absent;
/// an existing empty directory is filled), which takes `from`'s own mode, owner and times
/// last.
pub fn load(from: &Path, manifest: &Path, to: &Path) -> Result<Copied, TreeError> {
    let bytes = std::fs::read(manifest).map_err(err(manifest, "read"))?;
    let damaged = |why: String| TreeError {
        path: manifest.to_owned(),
        what: "the manifest".into(),
        source: io::Error::new(io::ErrorKind::InvalidData, why),
    };
    let records: Vec<Record> =
        serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
    let total = records.len();
    let mut xattrs = HashMap::new();
    let mut specials: HashMap<Vec<u8>, Vec<Record>> = HashMap::new();
    for r in records {
        let parts: Vec<&[u8]> = r.path.split(|&b| b == b'/').collect();
        if parts
            .iter()
            .any(|p| p.is_empty() || *p == b"." || *p == b"..")
            && !r.path.is_empty()
        {
            return Err(damaged(format!(
                "a record for {:?}",
                String::from_utf8_lossy(&r.path)
            )));
        }
        match &r.special {
            Some(sp) => {
                let kind = sp.mode & libc::S_IFMT;
                if r.path.is_empty()
                    || ![libc::S_IFCHR, libc::S_IFBLK, libc::S_IFIFO, libc::S_IFSOCK]
                        .contains(&kind)
                {
                    return Err(damaged(format!(
                        "a special file {:?} of mode {:o}",
                        String::from_utf8_lossy(&r.path),
                        sp.mode
                    )));
                }
                let parent = r.path[..r.path.len() - parts.last().map_or(0, |p| p.len())]
                    .strip_suffix(b"/")
                    .unwrap_or(b"")
                    .to_vec();
                specials.entry(parent).or_default().push(r);
            }
            None => {
                xattrs.insert(r.path, r.xattrs);
            }
        }
    }
    let mut c = Copier::new(Side::Load { xattrs, specials });
    c.top(from, to)?;
    if c.applied != total {
        return Err(damaged(format!(
            "{} of its {total} records name nothing in {}",
            total - c.applied,
            from.display()
        )));
    }
    Ok(c.copied)
}

/// Extended attributes: (name, value) pairs.
type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// What the manifest says of one entry: a special file (made again from this), or a file's
/// extended attributes.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    /// Relative to the top, `/`-separated; empty for the top itself.
    path: Vec<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    special: Option<Special>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    xattrs: Xattrs,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Special {
    mode: u32,
    rdev: u64,
    uid: u32,
    gid: u32,
}

/// Remove the tree at `path` whatever its directories' modes (a copied upper layer may hold
/// read-only ones), quietly: what cannot be removed stays.
pub fn remove(path: &Path) {
    make_removable(path);
    let _ = std::fs::remove_dir_all(path);
}

/// Give every directory of the tree at `path` (not following symlinks) mode 0700, so that
/// its owner can remove what is in it.
pub fn make_removable(path: &Path) {
    let mut stack = vec![path.to_owned()];
    while let Some(d) = stack.pop() {
        if !std::fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
}

fn err<'a>(path: &'a Path, what: &'a str) -> impl Fn(io::Error) -> TreeError + 'a {
    move |source| TreeError {
        path: path.to_owned(),
        what: what.into(),
        source,
    }
}

/// Which way a copy goes.
enum Side {
    /// Into a snapshot: special files and extended attributes are recorded, not made.
    Save(Vec<Record>),
    /// Out of one: the manifest's extended attributes by path, and its special files by their
    /// directory's path.
    Load {
        xattrs: HashMap<Vec<u8>, Xattrs>,
        specials: HashMap<Vec<u8>, Vec<Record>>,
    },
}

struct Copier {
    side: Side,
    /// (device, inode) of a file with several links → where its first link was copied to.
    links: HashMap<(u64, u64), PathBuf>,
    copied: Copied,
    /// Manifest records applied (Load).
    applied: usize,
}

fn join(rel: &[u8], name: &[u8]) -> Vec<u8> {
    if rel.is_empty() {
        return name.to_vec();
    }
    [rel, b"/", name].concat()
}

impl Copier {
    fn new(side: Side) -> Self {
        Copier {
            side,
            links: HashMap::new(),
            copied: Copied::default(),
            applied: 0,
        }
    }

    fn top(&mut self, from: &Path, to: &Path) -> Result<(), TreeError> {
        let meta = std::fs::symlink_metadata(from).map_err(err(from, "lstat"))?;
        if !meta.is_dir() {
            return Err(TreeError {
                path: from.to_owned(),
                what: "the top of a tree".into(),
                source: io::Error::from_raw_os_error(libc::ENOTDIR),
            });
        }
        self.entry(from, to, b"", &meta)
    }

    fn entry(
        &mut self,
        from: &Path,
        to: &Path,
        rel: &[u8],
        meta: &Metadata,
    ) -> Result<(), TreeError> {
        let ft = meta.file_type();
        let top = rel.is_empty();
        if !top {
            self.copied.entries += 1;
        }
        let special = !(ft.is_dir() || ft.is_file() || ft.is_symlink());
        if let Side::Save(records) = &mut self.side {
            let xattrs = list_xattrs(from)?;
            if special {
                records.push(Record {
                    path: rel.to_vec(),
                    special: Some(Special {
                        mode: meta.mode(),
                        rdev: meta.rdev(),
                        uid: meta.uid(),
                        gid: meta.gid(),
                    }),
                    xattrs,
                });
                return Ok(());
            }
            if !xattrs.is_empty() {
                records.push(Record {
                    path: rel.to_vec(),
                    special: None,
                    xattrs,
                });
            }
        }
        if !ft.is_dir() && meta.nlink() > 1 {
            let key = (meta.dev(), meta.ino());
            if let Some(first) = self.links.get(&key) {
                return std::fs::hard_link(first, to).map_err(err(to, "link"));
            }
            self.links.insert(key, to.to_owned());
        }
        if ft.is_dir() {
            // 0700 while it is filled: a read-only directory gets its mode after its entries.
            match std::fs::DirBuilder::new().create(to) {
                Err(e) if top && e.kind() == io::ErrorKind::AlreadyExists => {}
                r => r.map_err(err(to, "mkdir"))?,
            }
            std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o700))
                .map_err(err(to, "chmod"))?;
            let mut names: Vec<_> = std::fs::read_dir(from)
                .map_err(err(from, "read the directory"))?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<_, _>>()
                .map_err(err(from, "read the directory"))?;
            names.sort();
            for name in names {
                let (f, t) = (from.join(&name), to.join(&name));
                let m = std::fs::symlink_metadata(&f).map_err(err(&f, "lstat"))?;
                self.entry(&f, &t, &join(rel, name.as_bytes()), &m)?;
            }
            if let Side::Load { specials, .. } = &mut self.side {
                for r in specials.remove(rel).unwrap_or_default() {
                    let name = r.path.rsplit(|&b| b == b'/').next().unwrap_or(&r.path);
                    let t = to.join(std::ffi::OsStr::from_bytes(name));
                    let sp = r.special.as_ref().expect("filed as special");
                    let c = cpath(&t)?;
                    // SAFETY: mknod(2) with a NUL-terminated path that outlives the call.
                    let res = unsafe { libc::mknod(c.as_ptr(), sp.mode, sp.rdev) };
                    check(res).map_err(err(&t, "mknod"))?;
                    set_xattrs(&t, &r.xattrs)?;
                    owner(&t, sp.uid, sp.gid)?;
                    self.copied.entries += 1;
                    self.applied += 1;
                }
            }
        } else if ft.is_file() {
            let src = File::options()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(from)
                .map_err(err(from, "open"))?;
            let dst = File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(to)
                .map_err(err(to, "create"))?;
            self.copied.bytes += crate::vstate::memory::copy_sparse(&src, &dst, meta.len())
                .map_err(err(from, "copy"))?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(from).map_err(err(from, "readlink"))?;
            std::os::unix::fs::symlink(target, to).map_err(err(to, "symlink"))?;
        } else {
            return Err(TreeError {
                path: from.to_owned(),
                what: "a special file in a saved tree (its manifest holds those)".into(),
                source: io::ErrorKind::InvalidData.into(),
            });
        }
        if let Side::Load { xattrs, .. } = &mut self.side {
            if let Some(x) = xattrs.remove(rel) {
                set_xattrs(to, &x)?;
                self.applied += 1;
            }
        }
        owner(to, meta.uid(), meta.gid())?;
        if !ft.is_symlink() {
            // After chown, which clears setuid and setgid bits.
            std::fs::set_permissions(to, std::fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(err(to, "chmod"))?;
        }
        set_times(to, meta)
    }
}

/// lchown, where this process may: not root, the copy is its user's, which is all it may make.
fn owner(to: &Path, uid: u32, gid: u32) -> Result<(), TreeError> {
    match std::os::unix::fs::lchown(to, Some(uid), Some(gid)) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Ok(()),
        r => r.map_err(err(to, "chown")),
    }
}

/// What a tree looked like: its entries counted and a SHA-256 over each one's path, type and
/// mode, size, modification time and inode number (lstat's, in name order; a directory that
/// cannot be read counts as such). A host-side edit, add, remove or rename of a workspace
/// changes it; a writer that keeps a file's size and mtime and inode is not seen (git, editors
/// and `cp` are).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    pub entries: u64,
    pub sha256: String,
}

/// The fingerprint of the tree at directory `dir`.
pub fn fingerprint(dir: &Path) -> Result<Fingerprint, TreeError> {
    use sha2::{Digest, Sha256};
    fn walk(dir: &Path, rel: &[u8], h: &mut Sha256, n: &mut u64) {
        let names = std::fs::read_dir(dir).and_then(|r| {
            r.map(|e| e.map(|e| e.file_name()))
                .collect::<Result<Vec<_>, _>>()
        });
        let Ok(mut names) = names else {
            h.update(b"\0unreadable\0");
            return;
        };
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let mut r = rel.to_vec();
            r.push(b'/');
            r.extend_from_slice(name.as_bytes());
            *n += 1;
            h.update(&r);
            let Ok(m) = std::fs::symlink_metadata(&path) else {
                h.update(b"\0gone\0");
                continue;
            };
            for v in [
                m.mode() as u64,
                m.size(),
                m.mtime() as u64,
                m.mtime_nsec() as u64,
                m.ino(),
            ] {
                h.update(v.to_le_bytes());
            }
            if m.is_dir() {
                walk(&path, &r, h, n);
            }
        }
    }
    let meta = std::fs::symlink_metadata(dir).map_err(err(dir, "lstat"))?;
    if !meta.is_dir() {
        return Err(TreeError {
            path: dir.to_owned(),
            what: "a workspace".into(),
            source: io::Error::from_raw_os_error(libc::ENOTDIR),
        });
    }
    let (mut h, mut n) = (Sha256::new(), 0);
    walk(dir, b"", &mut h, &mut n);
    Ok(Fingerprint {
        entries: n,
        sha256: crate::sandbox::client::hex(&h.finalize()),
    })
}

fn cpath(p: &Path) -> Result<CString, TreeError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| TreeError {
        path: p.to_owned(),
        what: "a path".into(),
        source: io::ErrorKind::InvalidInput.into(),
    })
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A length-returning xattr call, retried with a buffer as large as the kernel says it needs.
fn sized(mut call: impl FnMut(&mut [u8]) -> isize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let n = call(&mut buf);
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || buf.len() >= 1 << 20 {
            return Err(e);
        }
        let need = call(&mut []);
        let need = if need > 0 {
            need as usize
        } else {
            buf.len() * 2
        };
        buf.resize(need.max(buf.len() * 2).min(1 << 20), 0);
    }
}

/// Every extended attribute of `path` (not following a symlink): names and values.
fn list_xattrs(path: &Path) -> Result<Xattrs, TreeError> {
    let f = cpath(path)?;
    let list = sized(|b| {
        // SAFETY: llistxattr(2) writes at most `b.len()` bytes into `b` (none when empty).
        unsafe { libc::llistxattr(f.as_ptr(), b.as_mut_ptr().cast(), b.len()) }
    });
    let list = match list {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(Vec::new()),
        r => r.map_err(err(path, "list its extended attributes"))?,
    };
    let mut out = Vec::new();
    for name in list.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let c = CString::new(name).expect("split at NUL");
        let value = sized(|b| {
            // SAFETY: lgetxattr(2) writes at most `b.len()` bytes into `b`.
            unsafe { libc::lgetxattr(f.as_ptr(), c.as_ptr(), b.as_mut_ptr().cast(), b.len()) }
        })
        .map_err(err(
            path,
            &format!("read the attribute {}", String::from_utf8_lossy(name)),
        ))?;
        out.push((name.to_vec(), value));
    }
    Ok(out)
}

fn set_xattrs(path: &Path, xattrs: &Xattrs) -> Result<(), TreeError> {
    let t = cpath(path)?;
    for (name, value) in xattrs {
        let shown = String::from_utf8_lossy(name).into_owned();
        let name = CString::new(name.as_slice()).map_err(|_| TreeError {
            path: path.to_owned(),
            what: format!("an attribute name {shown:?}"),
            source: io::ErrorKind::InvalidData.into(),
        })?;
        // SAFETY: lsetxattr(2) reads `value.len()` bytes of `value`; the strings are NUL-terminated.
        let r = unsafe {
            libc::lsetxattr(
                t.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        check(r).map_err(err(path, &format!("set the attribute {shown}")))?;
    }
    Ok(())
}

fn set_times(to: &Path, meta: &Metadata) -> Result<(), TreeError> {
    let c = cpath(to)?;
    let ts = |s: i64, ns: i64| libc::timespec {
        tv_sec: s as libc::time_t,
        tv_nsec: ns as _,
    };
    let times = [
        ts(meta.atime(), meta.atime_nsec()),
        ts(meta.mtime(), meta.mtime_nsec()),
    ];
    // SAFETY: utimensat(2) with a NUL-terminated path and two timespecs on this frame.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(r).map_err(err(to, "set its times"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, FileTypeExt};

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("amvm-tree-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_tree_saved_and_loaded_keeps_its_links_holes_modes_times_specials_and_attributes() {
        let base = tmp("copy");
        let a = base.join("a");
        std::fs::create_dir_all(a.join("sub/deep")).unwrap();
        std::fs::write(a.join("sub/deep/f"), b"data").unwrap();
        std::fs::hard_link(a.join("sub/deep/f"), a.join("hard")).unwrap();
        symlink("/etc/passwd", a.join("out")).unwrap();
        let sparse = File::create(a.join("sparse")).unwrap();
        sparse.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&sparse, b"end", (8 << 20) - 3).unwrap();
        let fifo = cpath(&a.join("fifo")).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        check(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }).unwrap();
        let wh = cpath(&a.join("gone")).unwrap();
        // SAFETY: mknod(2) of overlayfs's whiteout (a character device 0/0: Linux 5.8 allows
        // it without CAP_MKNOD) with a NUL-terminated path.
        check(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR | 0o600, 0) }).unwrap();
        let xattr_set = {
            let p = cpath(&a.join("sub")).unwrap();
            // SAFETY: lsetxattr(2) with NUL-terminated strings and a 1-byte value.
            let r = unsafe {
                libc::lsetxattr(
                    p.as_ptr(),
                    c"user.overlay.opaque".as_ptr(),
                    b"y".as_ptr().cast(),
                    1,
                    0,
                )
            };
            r == 0
        };
        std::fs::set_permissions(a.join("sub/deep"), std::fs::Permissions::from_mode(0o555))
            .unwrap();
        std::fs::set_permissions(a.join("sub/deep/f"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        // Into a "snapshot": specials and attributes go into the manifest, not the tree.
        let (saved, manifest) = (base.join("saved"), base.join("saved.json"));
        let copied = save(&a, &saved, &manifest).unwrap();
        assert_eq!(copied.entries, 8);
        assert!(!saved.join("fifo").exists() && !saved.join("gone").exists());
        assert_eq!(std::fs::read(saved.join("hard")).unwrap(), b"data");
        // And out of it, whole again.
        let b = base.join("b");
        let copied = load(&saved, &manifest, &b).unwrap();
        assert_eq!(copied.entries, 8);
        assert_eq!(std::fs::read(b.join("hard")).unwrap(), b"data");
        let (f, h) = (
            std::fs::metadata(b.join("sub/deep/f")).unwrap(),
            std::fs::metadata(b.join("hard")).unwrap(),
        );
        assert_eq!(f.ino(), h.ino(), "a hard link stays one");
        assert_eq!(f.mode() & 0o7777, 0o640);
        let d = std::fs::metadata(b.join("sub/deep")).unwrap();
        assert_eq!(d.mode() & 0o7777, 0o555);
        assert_eq!(
            d.mtime(),
            std::fs::metadata(a.join("sub/deep")).unwrap().mtime()
        );
        assert_eq!(
            std::fs::read_link(b.join("out")).unwrap(),
            Path::new("/etc/passwd")
        );
        let s = std::fs::metadata(b.join("sparse")).unwrap();
        assert_eq!(s.len(), 8 << 20);
        assert!(s.blocks() * 512 < 1 << 20, "the hole stayed a hole");
        assert!(copied.bytes < 1 << 20);
        assert!(std::fs::symlink_metadata(b.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        let w = std::fs::symlink_metadata(b.join("gone")).unwrap();
        assert!(
            w.file_type().is_char_device() && w.rdev() == 0,
            "a whiteout stays one"
        );
        if xattr_set {
            let p = cpath(&b.join("sub")).unwrap();
            let mut v = [0u8; 4];
            // SAFETY: lgetxattr(2) writes at most 4 bytes into `v`.
            let n = unsafe {
                libc::lgetxattr(
                    p.as_ptr(),
                    c"user.overlay.opaque".as_ptr(),
                    v.as_mut_ptr().cast(),
                    4,
                )
            };
            assert_eq!(n, 1);
            assert_eq!(v[0], b'y');
        }
        // Into an existing empty directory too; a file where the top should be is refused.
        let c = base.join("c");
        std::fs::create_dir(&c).unwrap();
        load(&saved, &manifest, &c).unwrap();
        assert_eq!(std::fs::read(c.join("sub/deep/f")).unwrap(), b"data");
        let e = save(&a.join("hard"), &base.join("d"), &base.join("d.json")).unwrap_err();
        assert!(e.to_string().contains("the top of a tree"), "{e}");
        // A manifest naming what is not in the tree, or reaching out of it, is refused.
        for bad in [
            r#"[{"path":[110,111,110,101],"xattrs":[[[117,46,120],[49]]]}]"#,
            r#"[{"path":[46,46,47,120],"special":{"mode":8576,"rdev":0,"uid":0,"gid":0}}]"#,
            r#"[{"path":[120],"special":{"mode":33188,"rdev":0,"uid":0,"gid":0}}]"#,
        ] {
            std::fs::write(base.join("bad.json"), bad).unwrap();
            let to = base.join("e");
            remove(&to);
            let e = load(&saved, &base.join("bad.json"), &to).unwrap_err();
            assert!(e.to_string().contains("manifest"), "{e}");
        }
        // The same tree twice is the same fingerprint; a touch, an add or a remove changes it.
        let f0 = fingerprint(&c).unwrap();
        assert_eq!(f0, fingerprint(&c).unwrap());
        assert_eq!(f0.entries, 8);
        std::fs::write(c.join("new"), b"x").unwrap();
        let f1 = fingerprint(&c).unwrap();
        assert_eq!(f1.entries, 9);
        std::fs::remove_file(c.join("new")).unwrap();
        assert_eq!(fingerprint(&c).unwrap(), f0);
        let t = File::options().write(true).open(c.join("hard")).unwrap();
        t.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(7))
            .unwrap();
        assert_ne!(fingerprint(&c).unwrap(), f0);
        remove(&base);
        assert!(!base.exists());
    }
}
