//! An overlayfs upper directory, as a tar of changes in OCI layer form: what [`super::apply`]
//! applies. In the upper directory overlayfs marks a deletion with a whiteout (a character
//! device 0/0) and a directory that hides the lower one with an opaque xattr
//! (`trusted.overlay.opaque` for a mount by root, `user.overlay.opaque` with `userxattr`); in
//! the layer they become `.wh.NAME` and `.wh..wh..opq` entries.
//!
//! The upper directory was written by the guest, so it is walked like [`super::apply`] walks:
//! from one descriptor, `O_NOFOLLOW`, never leaving it. Names come out sorted (the same tree
//! gives the same archive); a directory's entry comes before its opaque marker and both before
//! its children; files with more than one link inside the tree become hard links; files with
//! holes become GNU sparse entries. FIFOs, sockets and other devices have no place in a layer
//! and are left out, each reported.

use super::apply::{list_dir, owned, stat_at};
use super::tar::TarWriter;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{0}: {1}")]
    Io(String, io::Error),
    #[error(
        "{0}: overlayfs {1} (a redirect or metacopy upper layer) cannot be written as a layer"
    )]
    Unsupported(String, &'static str),
}

/// What went into the layer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LayerReport {
    pub entries: u64,
    pub whiteouts: u64,
    pub data_bytes: u64,
    /// Paths left out (FIFOs, sockets, devices), with why.
    pub skipped: Vec<String>,
}

/// Write `upper` as a layer to `out`.
pub fn write_layer<W: Write>(upper: &Path, out: W) -> Result<(W, LayerReport), LayerError> {
    let shown = |p: &[u8]| String::from_utf8_lossy(p).into_owned();
    let io_err = |p: &[u8]| {
        let p = if p.is_empty() {
            ".".to_string()
        } else {
            shown(p)
        };
        move |e: io::Error| LayerError::Io(p, e)
    };
    let c = CString::new(upper.as_os_str().as_bytes()).map_err(|_| {
        LayerError::Io(
            upper.display().to_string(),
            io::ErrorKind::InvalidInput.into(),
        )
    })?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: open(2) with a NUL-terminated path; checked.
    let root = owned(unsafe { libc::open(c.as_ptr(), flags) })
        .map_err(|e| LayerError::Io(upper.display().to_string(), e))?;
    let mut tar = TarWriter::new(out);
    let mut report = LayerReport::default();
    let mut links: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    // Depth first, names sorted: (directory descriptor, its path in the layer).
    // Directories still to walk are kept by path, not by descriptor (a directory with
    // thousands of subdirectories must not hold thousands of descriptors open); each is opened
    // again from the root, one component at a time, without following symlinks.
    let mut stack: Vec<Vec<u8>> = vec![Vec::new()];
    while let Some(prefix) = stack.pop() {
        let dir = open_below(&root, &prefix).map_err(io_err(&prefix))?;
        let mut names = list_dir(dir.as_raw_fd()).map_err(io_err(&prefix))?;
        names.sort();
        let mut subdirs = Vec::new();
        for name in names {
            let mut path = prefix.clone();
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(name.as_bytes());
            // amvm apply refuses such a path; leave it (and what is below it) out here, so the
            // rest of the layer still applies.
            if path.len() + 16 >= 4096 {
                report.skipped.push(format!(
                    "{}...: a path longer than PATH_MAX, left out",
                    shown(&path[..64])
                ));
                continue;
            }
            let st = stat_at(dir.as_raw_fd(), &name).map_err(io_err(&path))?;
            let mode = st.st_mode & 0o7777;
            let mtime = st.st_mtime;
            match st.st_mode & libc::S_IFMT {
                libc::S_IFCHR if st.st_rdev == 0 => {
                    let mut wh = prefix.clone();
                    if !wh.is_empty() {
                        wh.push(b'/');
                    }
                    wh.extend_from_slice(b".wh.");
                    wh.extend_from_slice(name.as_bytes());
                    tar.put(b'0', &wh, b"", 0o644, mtime, 0, &mut io::empty())
                        .map_err(io_err(&path))?;
                    report.whiteouts += 1;
                    report.entries += 1;
                }
                libc::S_IFDIR => {
                    for (key, what) in [
                        (c"trusted.overlay.redirect", "redirect_dir"),
                        (c"user.overlay.redirect", "redirect_dir"),
                        (c"trusted.overlay.metacopy", "metacopy"),
                        (c"user.overlay.metacopy", "metacopy"),
                    ] {
                        if xattr(dir.as_raw_fd(), &name, key).is_some() {
                            return Err(LayerError::Unsupported(shown(&path), what));
                        }
                    }
                    let mut d = path.clone();
                    d.push(b'/');
                    tar.put(b'5', &d, b"", mode, mtime, 0, &mut io::empty())
                        .map_err(io_err(&path))?;
                    report.entries += 1;
                    let opaque = [c"trusted.overlay.opaque", c"user.overlay.opaque"]
                        .iter()
                        .any(|k| xattr(dir.as_raw_fd(), &name, k).as_deref() == Some(b"y"));
                    if opaque {
                        d.extend_from_slice(b".wh..wh..opq");
                        tar.put(b'0', &d, b"", 0o644, mtime, 0, &mut io::empty())
                            .map_err(io_err(&path))?;
                        report.entries += 1;
                    }
                    subdirs.push(path);
                }
                libc::S_IFLNK => {
                    let target = read_link(dir.as_raw_fd(), &name).map_err(io_err(&path))?;
                    tar.put(b'2', &path, &target, 0o777, mtime, 0, &mut io::empty())
                        .map_err(io_err(&path))?;
                    report.entries += 1;
                }
                libc::S_IFREG => {
                    let key = (st.st_dev as u64, st.st_ino as u64);
                    if st.st_nlink > 1 {
                        if let Some(first) = links.get(&key) {
                            tar.put(b'1', &path, first, mode, mtime, 0, &mut io::empty())
                                .map_err(io_err(&path))?;
                            report.entries += 1;
                            continue;
                        }
                        links.insert(key, path.clone());
                    }
                    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
                    // SAFETY: openat(2) relative to a directory we hold; checked.
                    let fd = owned(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) })
                        .map_err(io_err(&path))?;
                    let mut f = File::from(fd);
                    let size = st.st_size as u64;
                    let chunks = data_chunks(&mut f, size).map_err(io_err(&path))?;
                    if chunks.len() == 1 && chunks[0] == (0, size) || size == 0 {
                        tar.put(b'0', &path, b"", mode, mtime, size, &mut f)
                            .map_err(io_err(&path))?;
                    } else {
                        let mut data = ChunkReader {
                            file: f,
                            chunks: chunks.clone(),
                            at: 0,
                            left: 0,
                        };
                        tar.put_sparse(&path, mode, mtime, size, &chunks, &mut data)
                            .map_err(io_err(&path))?;
                    }
                    report.data_bytes += chunks.iter().map(|c| c.1).sum::<u64>();
                    report.entries += 1;
                }
                _ => {
                    let what = match st.st_mode & libc::S_IFMT {
                        libc::S_IFIFO => "a FIFO",
                        libc::S_IFSOCK => "a socket",
                        _ => "a device node",
                    };
                    report
                        .skipped
                        .push(format!("{}: {what}, left out", shown(&path)));
                }
            }
        }
        // Pushed in reverse so the first name is walked first.
        stack.extend(subdirs.into_iter().rev());
    }
    let out = tar.finish().map_err(io_err(b"the archive"))?;
    Ok((out, report))
}

/// Directory `rel` below `root` (empty: `root` itself), reached without following symlinks.
fn open_below(root: &OwnedFd, rel: &[u8]) -> io::Result<OwnedFd> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: fcntl(2) F_DUPFD_CLOEXEC of a descriptor we hold; checked.
    let mut cur = owned(unsafe { libc::fcntl(root.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    for c in rel.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
        let name = CString::new(c).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: openat(2) relative to a directory we hold; checked.
        cur = owned(unsafe { libc::openat(cur.as_raw_fd(), name.as_ptr(), flags) })?;
    }
    Ok(cur)
}

/// The file's data as (offset, length) runs, holes left out (SEEK_DATA / SEEK_HOLE); the
/// whole file as one run where the filesystem cannot tell.
fn data_chunks(f: &mut File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut chunks = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        // SAFETY: lseek(2) on a file we hold.
        let data = unsafe { libc::lseek(f.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // only a hole up to the end
                Some(libc::EINVAL) if chunks.is_empty() => return Ok(vec![(0, size)]),
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let (start, end) = (data as u64, (hole as u64).min(size));
        if end > start {
            chunks.push((start, end - start));
        }
        pos = end.max(start + 1);
    }
    f.seek(SeekFrom::Start(0))?;
    // A file with holes only still needs one (empty) run for a sparse entry's map.
    if chunks.is_empty() {
        chunks.push((size, 0));
    }
    Ok(chunks)
}

/// Reads a file's data runs one after another.
struct ChunkReader {
    file: File,
    chunks: Vec<(u64, u64)>,
    at: usize,
    left: u64,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.left == 0 {
            let Some(&(off, len)) = self.chunks.get(self.at) else {
                return Ok(0);
            };
            self.at += 1;
            self.file.seek(SeekFrom::Start(off))?;
            self.left = len;
        }
        let n = (buf.len() as u64).min(self.left) as usize;
        let got = self.file.read(&mut buf[..n])?;
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= got as u64;
        Ok(got)
    }
}

fn read_link(dir: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: readlinkat(2) into a buffer of the length given.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The value of xattr `key` on directory `name` in `dir` (never through a symlink), if set and
/// at most 256 bytes.
fn xattr(dir: RawFd, name: &CStr, key: &CStr) -> Option<Vec<u8>> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat(2) relative to a directory we hold; checked.
    let fd = owned(unsafe { libc::openat(dir, name.as_ptr(), flags) }).ok()?;
    let mut buf = [0u8; 256];
    // SAFETY: fgetxattr(2) on a descriptor we hold, into a buffer of the length given.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            key.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

#[cfg(test)]
mod tests {
    use super::super::apply::{apply, Options};
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn tree(root: &Path) -> Vec<String> {
        super::super::tree(root, false)
    }

    fn whiteout(p: &Path) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: mknod(2) of a 0/0 character device (an overlayfs whiteout; unprivileged
        // since Linux 5.8) at a NUL-terminated path.
        let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) };
        assert_eq!(
            r,
            0,
            "mknod whiteout {}: {}",
            p.display(),
            io::Error::last_os_error()
        );
    }

    fn set_opaque(p: &Path) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: setxattr(2) with NUL-terminated strings and a 1-byte value.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"user.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        assert_eq!(
            r,
            0,
            "setxattr {}: {}",
            p.display(),
            io::Error::last_os_error()
        );
    }

    /// An upper directory as overlayfs leaves it (whiteouts, an opaque directory, new and
    /// changed files, a symlink, a hard link, a sparse file), turned into a layer and applied
    /// to a copy of the lower directory, gives exactly the merged view.
    #[test]
    fn an_upper_directory_applied_to_the_lower_gives_the_merged_view() {
        let base = std::env::temp_dir().join(format!("amvm-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (lower, upper, merged) = (base.join("lower"), base.join("upper"), base.join("merged"));
        for d in [&lower, &upper, &merged] {
            std::fs::create_dir_all(d).unwrap();
        }
        // lower: a, gone, dir/{x,y}, opq/{old1,old2}
        // the merged view the guest saw: a changed, gone deleted, dir/x deleted, dir/z new,
        //   opq replaced by a new directory holding only fresh, new/{file,link,hard}, sparse
        for (root, files) in [
            (
                &lower,
                &["a", "gone", "dir/x", "dir/y", "opq/old1", "opq/old2"][..],
            ),
            (&merged, &["dir/y"][..]),
        ] {
            for f in files {
                let p = root.join(f);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(&p, format!("lower {f}")).unwrap();
            }
        }
        let put = |rel: &str, data: &[u8]| {
            for root in [&upper, &merged] {
                let p = root.join(rel);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(&p, data).unwrap();
            }
        };
        put("a", b"changed");
        put("dir/z", b"new in dir");
        put("opq/fresh", b"fresh");
        put("new/file", b"a new file");
        whiteout(&upper.join("gone"));
        whiteout(&upper.join("dir/x"));
        set_opaque(&upper.join("opq"));
        for root in [&upper, &merged] {
            std::os::unix::fs::symlink("file", root.join("new/link")).unwrap();
            std::fs::hard_link(root.join("new/file"), root.join("new/hard")).unwrap();
            let f = File::create(root.join("sparse")).unwrap();
            f.set_len(64 << 20).unwrap();
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"middle", 32 << 20).unwrap();
        }
        let (bytes, report) = write_layer(&upper, Vec::new()).unwrap();
        assert_eq!(report.whiteouts, 2);
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        assert!(
            bytes.len() < 1 << 20,
            "the 64 MiB sparse file went in sparse: {} bytes",
            bytes.len()
        );
        // Deterministic: the same tree, the same archive.
        assert_eq!(write_layer(&upper, Vec::new()).unwrap().0, bytes);
        let target = base.join("target");
        std::fs::create_dir_all(&target).unwrap();
        for f in ["a", "gone", "dir/x", "dir/y", "opq/old1", "opq/old2"] {
            let p = target.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::copy(lower.join(f), &p).unwrap();
        }
        let archive = base.join("changes.tar");
        std::fs::write(&archive, &bytes).unwrap();
        let mut lines = Vec::new();
        let r = apply(&archive, &target, Options::default(), &mut |l| {
            lines.push(l)
        })
        .unwrap();
        assert_eq!(r.refused, 0, "{lines:?}");
        assert_eq!(tree(&target), tree(&merged));
        for f in ["a", "dir/y", "dir/z", "opq/fresh", "new/file"] {
            assert_eq!(
                std::fs::read(target.join(f)).unwrap(),
                std::fs::read(merged.join(f)).unwrap(),
                "{f}"
            );
        }
        assert_eq!(
            std::fs::metadata(target.join("new/hard")).unwrap().ino(),
            std::fs::metadata(target.join("new/file")).unwrap().ino()
        );
        let sparse = std::fs::metadata(target.join("sparse")).unwrap();
        assert_eq!(sparse.len(), 64 << 20);
        assert!(sparse.blocks() * 512 < 1 << 20);
        let _ = std::fs::remove_dir_all(&base);
    }

    /// More subdirectories in one directory than the process may hold descriptors open and a chain deeper than PATH_MAX: the first all go in, the second is left out and
    /// reported, and the layer still applies.
    #[test]
    fn a_wide_and_a_too_deep_upper_directory() {
        // Run again in a process of its own whose descriptor limit is 256 (the limit is the
        // process's; the other tests run beside this one).
        const LOW: &str = "AMVM_TEST_LOW_NOFILE";
        if std::env::var_os(LOW).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "changes::layer::tests::a_wide_and_a_too_deep_upper_directory",
                ])
                .args(["--test-threads=1", "--nocapture"])
                .env(LOW, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}{out:?}"
            );
            return;
        }
        let lim = libc::rlimit {
            rlim_cur: 256,
            rlim_max: 256,
        };
        // SAFETY: setrlimit(2) from a local; this process is this test's alone.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
        let base = std::env::temp_dir().join(format!("amvm-layer-wide-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let upper = base.join("upper");
        // More subdirectories than this process may have descriptors open.
        let wide = 300;
        for i in 0..wide {
            std::fs::create_dir_all(upper.join(format!("wide/d{i}"))).unwrap();
        }
        std::fs::write(upper.join(format!("wide/d{}/f", wide - 1)), b"last").unwrap();
        // 20 levels of 250-byte names: over 5000 bytes, built relative to each level.
        std::fs::create_dir_all(upper.join("deep")).unwrap();
        let c = CString::new(upper.join("deep").as_os_str().as_bytes()).unwrap();
        // SAFETY: open(2) of a NUL-terminated path; checked.
        let mut fd =
            owned(unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) }).unwrap();
        let name = CString::new(vec![b'n'; 250]).unwrap();
        for _ in 0..20 {
            // SAFETY: mkdirat(2) relative to a directory we hold.
            let r = unsafe { libc::mkdirat(fd.as_raw_fd(), name.as_ptr(), 0o755) };
            assert_eq!(r, 0);
            let flags = libc::O_RDONLY | libc::O_DIRECTORY;
            // SAFETY: openat(2) relative to a directory we hold; checked by owned().
            fd = owned(unsafe { libc::openat(fd.as_raw_fd(), name.as_ptr(), flags) }).unwrap();
        }
        let (bytes, report) = write_layer(&upper, Vec::new()).unwrap();
        assert_eq!(report.skipped.len(), 1, "{:?}", report.skipped);
        assert!(report.skipped[0].ends_with("a path longer than PATH_MAX, left out"));
        let target = base.join("target");
        std::fs::create_dir_all(&target).unwrap();
        let archive = base.join("changes.tar");
        std::fs::write(&archive, &bytes).unwrap();
        let r = apply(&archive, &target, Options::default(), &mut |_| {}).unwrap();
        assert_eq!(r.refused, 0);
        assert_eq!(
            std::fs::read_dir(target.join("wide")).unwrap().count(),
            wide
        );
        let last = target.join(format!("wide/d{}/f", wide - 1));
        assert_eq!(std::fs::read(last).unwrap(), b"last");
        let _ = std::fs::remove_dir_all(&base);
    }
}
