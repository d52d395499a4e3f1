//! `amvm apply CHANGES DIR`: apply a tar of changes in OCI layer form to DIR, where the tar may
//! have been made from what a hostile guest wrote. The rule (docs/threat-model.md):
//!
//! * Nothing outside DIR is touched. Every path is resolved from a descriptor of DIR one
//!   component at a time with `O_NOFOLLOW`: a symlink (or a non-directory, or another mount)
//!   where a directory is expected refuses that entry; files are created with `O_EXCL` and
//!   `O_NOFOLLOW` and renamed into place, so an existing symlink is replaced, never written
//!   through.
//! * Refused, each with a line: absolute paths, `..` components, names over 255 bytes or paths
//!   over PATH_MAX, device nodes, FIFOs and unknown types, symlinks whose target is absolute or
//!   leaves DIR (`..` is allowed only as leading components, and no further up than the link's
//!   own directory), hard links whose target is outside DIR or not a regular file in it, and
//!   PAX-format sparse files.
//! * Neutralised, each with a line: setuid and setgid bits (dropped). Silently: owners (files
//!   belong to whoever applies), a file's sticky bit. A GNU sparse file is written sparse.
//! * Whiteouts (`.wh.NAME`) remove NAME; an opaque marker (`.wh..wh..opq`) removes what the
//!   directory held before this apply.
//!
//! The archive is read twice: first to check it whole (framing and every entry's own rules),
//! then to apply it. A malformed archive, or refusals found in the first pass (unless
//! `skip_refused`), change nothing.

use super::tar::{Entry, Kind, Reader, TarError};
use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, Read, Seek};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Longest path (PATH_MAX, with its NUL) and name (NAME_MAX) Linux accepts.
const PATH_MAX: usize = 4096;
const NAME_MAX: usize = 255;
const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("{0}: {1}")]
    Open(PathBuf, io::Error),
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("{path}: {source}; nothing was applied")]
    Archive {
        path: PathBuf,
        #[source]
        source: TarError,
    },
    #[error("{path}: {source} (after {applied} entries were applied)")]
    ArchiveLate {
        path: PathBuf,
        applied: u64,
        #[source]
        source: TarError,
    },
    #[error(
        "{0} entries refused (listed above); nothing was applied (--skip-refused applies the rest)"
    )]
    Refused(u64),
}

/// How to apply.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Only check the archive; change nothing.
    pub check_only: bool,
    /// Apply what may be applied even when some entries are refused.
    pub skip_refused: bool,
    /// An image's layer (the image store): a symlink may point anywhere, absolute targets
    /// included, since neither amvm nor virtiofsd ever follows one on the host (paths are
    /// walked with `O_NOFOLLOW`) and the guest resolves it inside its own root.
    pub any_symlink: bool,
}

/// What an apply did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub applied: u64,
    pub refused: u64,
    pub neutralised: u64,
}

/// An entry's path as components, checked: relative, no `..`, within NAME_MAX and PATH_MAX.
/// Empty for DIR itself.
fn components(path: &[u8]) -> Result<Vec<&[u8]>, String> {
    if path.starts_with(b"/") {
        return Err("an absolute path".into());
    }
    if path.len() >= PATH_MAX {
        return Err(format!(
            "a path of {} bytes (PATH_MAX is {PATH_MAX})",
            path.len()
        ));
    }
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("a `..` component".into()),
            c if c.len() > NAME_MAX => {
                return Err(format!(
                    "a name of {} bytes (NAME_MAX is {NAME_MAX})",
                    c.len()
                ))
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

/// A symlink target that stays in DIR for a link whose directory is `depth` levels below DIR:
/// relative, `..` only before every other component and at most `depth` of them.
fn symlink_target_ok(target: &[u8], depth: usize) -> Result<(), String> {
    let shown = || String::from_utf8_lossy(target).into_owned();
    if target.is_empty() {
        return Err("a symlink with an empty target".into());
    }
    if target.starts_with(b"/") {
        return Err(format!("a symlink to an absolute path ({})", shown()));
    }
    if target.len() >= PATH_MAX {
        return Err(format!("a symlink target of {} bytes", target.len()));
    }
    let mut ups = 0;
    let mut descended = false;
    for c in target.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." if descended => {
                return Err(format!(
                    "a symlink with `..` after a name ({}): amvm cannot tell where it leads",
                    shown()
                ))
            }
            b".." => ups += 1,
            _ => descended = true,
        }
    }
    if ups > depth {
        return Err(format!(
            "a symlink that points out of the directory ({})",
            shown()
        ));
    }
    Ok(())
}

/// What one entry asks for, after its own checks (before any filesystem is looked at).
#[derive(Debug)]
enum Action<'a> {
    /// The entry for DIR itself: nothing to do (DIR's own mode is left alone).
    Root,
    File {
        comps: Vec<&'a [u8]>,
        mode: u32,
        dropped_setid: bool,
    },
    Dir {
        comps: Vec<&'a [u8]>,
        mode: u32,
        dropped_setid: bool,
    },
    Symlink {
        comps: Vec<&'a [u8]>,
        target: &'a [u8],
    },
    HardLink {
        comps: Vec<&'a [u8]>,
        target: Vec<&'a [u8]>,
    },
    Whiteout {
        parent: Vec<&'a [u8]>,
        name: &'a [u8],
    },
    Opaque {
        dir: Vec<&'a [u8]>,
    },
}

fn plan(e: &Entry, any_symlink: bool) -> Result<Action<'_>, String> {
    let comps = components(&e.path)?;
    let Some((&last, parent)) = comps.split_last() else {
        return match e.kind {
            Kind::Directory => Ok(Action::Root),
            _ => Err("an entry for the directory itself that is not a directory".into()),
        };
    };
    if last == OPAQUE {
        return Ok(Action::Opaque {
            dir: parent.to_vec(),
        });
    }
    if let Some(name) = last.strip_prefix(WHITEOUT) {
        if name.is_empty() || name == b"." || name == b".." {
            return Err("a whiteout with no name".into());
        }
        return Ok(Action::Whiteout {
            parent: parent.to_vec(),
            name,
        });
    }
    let dropped_setid = e.mode & 0o6000 != 0;
    match e.kind {
        Kind::File if e.pax_sparse => Err("a PAX-format sparse file (not supported)".into()),
        Kind::File => Ok(Action::File {
            comps,
            mode: e.mode & 0o777,
            dropped_setid,
        }),
        Kind::Directory => Ok(Action::Dir {
            comps,
            mode: e.mode & 0o1777,
            dropped_setid,
        }),
        Kind::Symlink => {
            if any_symlink {
                if e.link.is_empty() || e.link.len() >= PATH_MAX {
                    return Err(format!("a symlink target of {} bytes", e.link.len()));
                }
            } else {
                symlink_target_ok(&e.link, comps.len() - 1)?;
            }
            Ok(Action::Symlink {
                comps,
                target: &e.link,
            })
        }
        Kind::HardLink => {
            let target = components(&e.link).map_err(|why| format!("a hard link to {why}"))?;
            if target.is_empty() {
                return Err("a hard link to the directory itself".into());
            }
            Ok(Action::HardLink { comps, target })
        }
        Kind::CharDevice | Kind::BlockDevice => Err("a device node".into()),
        Kind::Fifo => Err("a FIFO".into()),
        Kind::Other(t) => Err(format!("an entry of unknown type {:?}", t as char)),
    }
}

/// An entry's own checks, as the first pass makes them (before any filesystem is looked at):
/// `Err` says why it is refused.
pub fn check_entry(e: &Entry) -> Result<(), String> {
    plan(e, false).map(|_| ())
}

fn shown(path: &[u8]) -> String {
    String::from_utf8_lossy(path).escape_debug().to_string()
}

/// Apply `archive` to `dir`; each refused or neutralised entry is reported through `say`, one
/// line each.
pub fn apply(
    archive: &Path,
    dir: &Path,
    opts: Options,
    say: &mut dyn FnMut(String),
) -> Result<Report, ApplyError> {
    let mut file = File::open(archive).map_err(|e| ApplyError::Open(archive.to_owned(), e))?;
    let root = open_dir(dir)?;
    // Pass 1: the whole archive, checked.
    let mut report = Report::default();
    let bad = |source| ApplyError::Archive {
        path: archive.to_owned(),
        source,
    };
    {
        let mut r = Reader::new(io::BufReader::new(&mut file));
        while let Some(e) = r.next_entry().map_err(bad)? {
            io::copy(&mut r.data(&e), &mut io::sink()).map_err(|e| bad(e.into()))?;
            if let Err(why) = plan(&e, opts.any_symlink) {
                report.refused += 1;
                say(format!("{}: refused: {why}", shown(&e.path)));
            }
        }
    }
    if opts.check_only {
        return Ok(report);
    }
    if report.refused > 0 && !opts.skip_refused {
        return Err(ApplyError::Refused(report.refused));
    }
    // Pass 2: apply.
    file.rewind()
        .map_err(|e| ApplyError::Open(archive.to_owned(), e))?;
    let mut r = Reader::new(io::BufReader::with_capacity(256 * 1024, &mut file));
    let mut a = Applier::new(root)?;
    report.refused = 0;
    loop {
        let late = |source, applied| ApplyError::ArchiveLate {
            path: archive.to_owned(),
            applied,
            source,
        };
        let Some(e) = r.next_entry().map_err(|s| late(s, report.applied))? else {
            break;
        };
        let result = match plan(&e, opts.any_symlink) {
            Ok(action) => a.run(action, &e, &mut r.data(&e), say),
            Err(_) => {
                // Said in the first pass.
                report.refused += 1;
                continue;
            }
        };
        match result {
            Ok(neutralised) => {
                report.applied += 1;
                report.neutralised += neutralised;
            }
            Err(why) => {
                report.refused += 1;
                say(format!("{}: refused: {why}", shown(&e.path)));
            }
        }
    }
    for (comps, mode) in std::mem::take(&mut a.dir_modes) {
        let comps: Vec<&[u8]> = comps.iter().map(Vec::as_slice).collect();
        if let Err(why) = a.set_dir_mode(&comps, mode) {
            say(format!(
                "{}: mode not set: {why}",
                shown(&comps.join(&b'/'))
            ));
        }
    }
    Ok(report)
}

fn open_dir(dir: &Path) -> Result<OwnedFd, ApplyError> {
    let c = cstring(dir.as_os_str().as_bytes()).map_err(|e| ApplyError::Open(dir.to_owned(), e))?;
    // SAFETY: open(2) with a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOTDIR) => ApplyError::NotADirectory(dir.to_owned()),
            _ => ApplyError::Open(dir.to_owned(), e),
        });
    }
    // SAFETY: `fd` was just returned to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(super) fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    check(fd)?;
    // SAFETY: `fd` was just returned to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(super) fn stat_at(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: libc::stat is plain data; all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat(2) with a NUL-terminated name into a local, not following symlinks.
    check(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn stat_fd(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: as stat_at.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) of a descriptor we hold into a local.
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// Applies actions below one directory descriptor.
struct Applier {
    root: OwnedFd,
    dev: libc::dev_t,
    /// The last parent directory walked to, by its components (entries come grouped).
    cached: Option<(Vec<Vec<u8>>, OwnedFd)>,
    /// Hashes of the paths this apply created (an opaque marker keeps those).
    created: HashSet<u64>,
    hasher: RandomState,
    /// Directory modes, set at the end (a read-only directory must first receive its files).
    dir_modes: Vec<(Vec<Vec<u8>>, u32)>,
    tmp_counter: u64,
}

impl Applier {
    fn new(root: OwnedFd) -> Result<Self, ApplyError> {
        let dev = stat_fd(root.as_raw_fd())
            .map_err(|e| ApplyError::Open(PathBuf::from("the directory"), e))?
            .st_dev;
        Ok(Applier {
            root,
            dev,
            cached: None,
            created: HashSet::new(),
            hasher: RandomState::new(),
            dir_modes: Vec::new(),
            tmp_counter: 0,
        })
    }

    fn hash(&self, comps: &[&[u8]]) -> u64 {
        self.hasher.hash_one(comps)
    }

    /// A descriptor of directory `comps` below DIR (created when missing and `create`),
    /// reached without following any symlink or leaving DIR's filesystem.
    ///
    /// The descriptor is the caller's own (a duplicate of the one cached), so dropping the
    /// cache while using it is safe.
    fn walk(&mut self, comps: &[&[u8]], create: bool) -> Result<Option<OwnedFd>, String> {
        let dup = |fd: RawFd| {
            // SAFETY: fcntl(2) F_DUPFD_CLOEXEC of a descriptor we hold; checked.
            owned(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) }).map_err(|e| e.to_string())
        };
        if let Some((c, fd)) = &self.cached {
            if c.len() == comps.len() && c.iter().zip(comps).all(|(a, b)| a.as_slice() == *b) {
                return dup(fd.as_raw_fd()).map(Some);
            }
        }
        let mut cur: Option<OwnedFd> = None;
        for (i, &c) in comps.iter().enumerate() {
            let at = cur
                .as_ref()
                .map_or(self.root.as_raw_fd(), AsRawFd::as_raw_fd);
            let name = cstring(c).map_err(|e| e.to_string())?;
            let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
            // SAFETY: openat(2) relative to a directory we hold, NUL-terminated name; checked.
            let mut fd = owned(unsafe { libc::openat(at, name.as_ptr(), flags) });
            if create
                && fd
                    .as_ref()
                    .is_err_and(|e| e.raw_os_error() == Some(libc::ENOENT))
            {
                // SAFETY: mkdirat(2) relative to a directory we hold; checked below.
                let r = unsafe { libc::mkdirat(at, name.as_ptr(), 0o755) };
                if r == 0 {
                    let h = self.hash(&comps[..=i]);
                    self.created.insert(h);
                }
                // SAFETY: as the openat above.
                fd = owned(unsafe { libc::openat(at, name.as_ptr(), flags) });
            }
            let here = || shown(&comps[..=i].join(&b'/'));
            let fd = match fd {
                Ok(fd) => fd,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !create => return Ok(None),
                Err(e) => {
                    return Err(match e.raw_os_error() {
                        Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
                            format!("{} is a symlink or not a directory", here())
                        }
                        _ => format!("{}: {e}", here()),
                    })
                }
            };
            let st = stat_fd(fd.as_raw_fd()).map_err(|e| e.to_string())?;
            if st.st_dev != self.dev {
                return Err(format!("{} is another filesystem (a mount point)", here()));
            }
            cur = Some(fd);
        }
        let Some(fd) = cur else {
            return dup(self.root.as_raw_fd()).map(Some);
        };
        let mine = dup(fd.as_raw_fd())?;
        self.cached = Some((comps.iter().map(|c| c.to_vec()).collect(), fd));
        Ok(Some(mine))
    }

    fn tmp_name(&mut self) -> CString {
        self.tmp_counter += 1;
        let name = format!(".amvm-apply.{}.{}", std::process::id(), self.tmp_counter);
        CString::new(name).expect("no NUL in a formatted name")
    }

    /// Replace `name` in `dir` by the entry at `tmp`, whatever is there now (a directory is
    /// removed first). On failure `tmp` is removed.
    fn put(&mut self, dir: RawFd, tmp: &CStr, name: &CStr) -> Result<(), String> {
        // SAFETY: renameat(2) within a directory we hold, NUL-terminated names; checked.
        let mut r = check(unsafe { libc::renameat(dir, tmp.as_ptr(), dir, name.as_ptr()) });
        if let Err(e) = &r {
            if matches!(
                e.raw_os_error(),
                Some(libc::EISDIR) | Some(libc::ENOTEMPTY) | Some(libc::EEXIST)
            ) {
                self.cached = None;
                r = remove_tree(dir, name).and_then(|()| {
                    // SAFETY: as above.
                    check(unsafe { libc::renameat(dir, tmp.as_ptr(), dir, name.as_ptr()) })
                });
            }
        }
        r.map_err(|e| {
            // SAFETY: unlinkat(2) of our own temporary name in a directory we hold.
            unsafe { libc::unlinkat(dir, tmp.as_ptr(), 0) };
            e.to_string()
        })
    }

    /// Do `action`; returns how many neutralisations it made.
    fn run(
        &mut self,
        action: Action<'_>,
        e: &Entry,
        data: &mut dyn Read,
        say: &mut dyn FnMut(String),
    ) -> Result<u64, String> {
        let err = |e: io::Error| e.to_string();
        let mut neutralised = 0;
        let mut note_setid = |dropped: bool, say: &mut dyn FnMut(String)| {
            if dropped {
                neutralised += 1;
                say(format!(
                    "{}: setuid and setgid bits dropped",
                    shown(&e.path)
                ));
            }
        };
        match action {
            Action::Root => {}
            Action::File {
                comps,
                mode,
                dropped_setid,
            } => {
                let (last, parent) = comps.split_last().expect("a named entry");
                let dir = self.walk(parent, true)?.expect("created");
                let dir = dir.as_raw_fd();
                let name = cstring(last).map_err(err)?;
                let flags = libc::O_WRONLY
                    | libc::O_CREAT
                    | libc::O_EXCL
                    | libc::O_NOFOLLOW
                    | libc::O_CLOEXEC;
                // Straight to its name when nothing is there; else a temporary, renamed over.
                // SAFETY: openat(2) relative to a directory we hold; checked.
                let direct = owned(unsafe { libc::openat(dir, name.as_ptr(), flags, 0o600) });
                let (fd, tmp) = match direct {
                    Ok(fd) => (fd, None),
                    Err(ref x) if x.raw_os_error() == Some(libc::EEXIST) => {
                        let tmp = self.tmp_name();
                        // SAFETY: as above.
                        let fd = owned(unsafe { libc::openat(dir, tmp.as_ptr(), flags, 0o600) })
                            .map_err(err)?;
                        (fd, Some(tmp))
                    }
                    Err(x) => return Err(x.to_string()),
                };
                let mut f = File::from(fd);
                let written = write_data(&mut f, e, data).and_then(|()| {
                    use std::os::unix::fs::PermissionsExt;
                    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
                    set_mtime(&f, e.mtime)
                });
                let at = tmp.as_deref().unwrap_or(&name);
                if let Err(x) = written {
                    // SAFETY: unlinkat(2) of the file just made, in a directory we hold.
                    unsafe { libc::unlinkat(dir, at.as_ptr(), 0) };
                    return Err(x.to_string());
                }
                if let Some(tmp) = tmp {
                    self.put(dir, &tmp, &name)?;
                }
                let h = self.hash(&comps);
                self.created.insert(h);
                note_setid(dropped_setid, say);
            }
            Action::Dir {
                comps,
                mode,
                dropped_setid,
            } => {
                let (last, parent) = comps.split_last().expect("a named entry");
                let dir = self.walk(parent, true)?.expect("created");
                let dir = dir.as_raw_fd();
                let name = cstring(last).map_err(err)?;
                // SAFETY: mkdirat(2) relative to a directory we hold; checked.
                let r = check(unsafe { libc::mkdirat(dir, name.as_ptr(), 0o700) });
                if let Err(x) = r {
                    if x.raw_os_error() != Some(libc::EEXIST) {
                        return Err(x.to_string());
                    }
                    let st = stat_at(dir, &name).map_err(err)?;
                    if !is_dir(&st) {
                        self.cached = None;
                        remove_tree(dir, &name).map_err(err)?;
                        // SAFETY: as above.
                        check(unsafe { libc::mkdirat(dir, name.as_ptr(), 0o700) }).map_err(err)?;
                    }
                }
                let h = self.hash(&comps);
                self.created.insert(h);
                self.dir_modes
                    .push((comps.iter().map(|c| c.to_vec()).collect(), mode));
                note_setid(dropped_setid, say);
            }
            Action::Symlink { comps, target } => {
                let (last, parent) = comps.split_last().expect("a named entry");
                let dir = self.walk(parent, true)?.expect("created");
                let dir = dir.as_raw_fd();
                let name = cstring(last).map_err(err)?;
                let target = cstring(target).map_err(err)?;
                let tmp = self.tmp_name();
                // SAFETY: symlinkat(2) of a NUL-terminated target at our temporary name; checked.
                check(unsafe { libc::symlinkat(target.as_ptr(), dir, tmp.as_ptr()) })
                    .map_err(err)?;
                self.put(dir, &tmp, &name)?;
                let h = self.hash(&comps);
                self.created.insert(h);
            }
            Action::HardLink { comps, target } => {
                let (tlast, tparent) = target.split_last().expect("checked non-empty");
                let Some(tdir) = self.walk(tparent, false)? else {
                    return Err("a hard link to a file that is not in the directory".into());
                };
                let tname = cstring(tlast).map_err(err)?;
                match stat_at(tdir.as_raw_fd(), &tname) {
                    Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => {}
                    Ok(_) => {
                        return Err("a hard link to something that is not a regular file".into())
                    }
                    Err(_) => {
                        return Err("a hard link to a file that is not in the directory".into())
                    }
                }
                let (last, parent) = comps.split_last().expect("a named entry");
                let dir = self.walk(parent, true)?.expect("created");
                let dir = dir.as_raw_fd();
                let name = cstring(last).map_err(err)?;
                let tmp = self.tmp_name();
                // SAFETY: linkat(2) between directories we hold, not following a final symlink.
                check(unsafe {
                    libc::linkat(tdir.as_raw_fd(), tname.as_ptr(), dir, tmp.as_ptr(), 0)
                })
                .map_err(err)?;
                self.put(dir, &tmp, &name)?;
                let h = self.hash(&comps);
                self.created.insert(h);
            }
            Action::Whiteout { parent, name } => {
                let Some(dir) = self.walk(&parent, false)? else {
                    return Ok(0); // nothing there to remove
                };
                let name = cstring(name).map_err(err)?;
                self.cached = None;
                match remove_tree(dir.as_raw_fd(), &name) {
                    Ok(()) => {}
                    Err(x) if x.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(x) => return Err(x.to_string()),
                }
            }
            Action::Opaque { dir } => {
                let Some(fd) = self.walk(&dir, false)? else {
                    return Ok(0);
                };
                self.cached = None;
                for child in list_dir(fd.as_raw_fd()).map_err(err)? {
                    let mut path = dir.clone();
                    path.push(child.as_bytes());
                    if !self.created.contains(&self.hash(&path)) {
                        remove_tree(fd.as_raw_fd(), &child).map_err(err)?;
                    }
                }
            }
        }
        Ok(neutralised)
    }

    fn set_dir_mode(&mut self, comps: &[&[u8]], mode: u32) -> Result<(), String> {
        let (last, parent) = comps.split_last().expect("a named entry");
        let Some(dir) = self.walk(parent, false)? else {
            return Err("it is gone".into());
        };
        let name = cstring(last).map_err(|e| e.to_string())?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: openat(2) relative to a directory we hold; checked.
        let fd = owned(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) })
            .map_err(|e| e.to_string())?;
        // SAFETY: fchmod(2) of the directory just opened (never a symlink: O_NOFOLLOW).
        check(unsafe { libc::fchmod(fd.as_raw_fd(), mode) }).map_err(|e| e.to_string())
    }
}

/// A file's data: a sparse file's chunks at their offsets, then its full size.
fn write_data(f: &mut File, e: &Entry, data: &mut dyn Read) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    if e.sparse.is_empty() {
        io::copy(data, f)?;
    } else {
        let mut buf = vec![0u8; 64 * 1024];
        for &(off, len) in &e.sparse {
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                data.read_exact(&mut buf[..n])?;
                f.write_all_at(&buf[..n], off + done)?;
                done += n as u64;
            }
        }
        f.set_len(e.size)?;
    }
    f.flush()
}

fn set_mtime(f: &File, mtime: i64) -> io::Result<()> {
    let t = libc::timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        t,
    ];
    // SAFETY: futimens(2) of a file we hold with two timespecs on our stack.
    check(unsafe { libc::futimens(f.as_raw_fd(), times.as_ptr()) })
}

/// The names in directory `dir` (a descriptor of any kind), without `.` and `..`.
pub(super) fn list_dir(dir: RawFd) -> io::Result<Vec<CString>> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: openat(2) of "." relative to a directory we hold; checked. The new descriptor
    // is handed to fdopendir, which owns it from then on (closedir closes it).
    let fd = unsafe { libc::openat(dir, c".".as_ptr(), flags) };
    check(fd)?;
    // SAFETY: fdopendir(3) on the descriptor just opened; checked.
    let d = unsafe { libc::fdopendir(fd) };
    if d.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so the descriptor is still ours to close.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    let mut names = Vec::new();
    loop {
        // SAFETY: readdir(3) on the stream we opened.
        let ent = unsafe { libc::readdir(d) };
        if ent.is_null() {
            break;
        }
        // SAFETY: a non-null entry from readdir is valid until the next call on the stream.
        let raw = unsafe { (*ent).d_name.as_ptr() };
        // SAFETY: d_name is a NUL-terminated string inside that entry; copied out at once.
        let name = unsafe { CStr::from_ptr(raw) }.to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    // SAFETY: closedir(3) of the stream we opened (and its descriptor).
    unsafe { libc::closedir(d) };
    Ok(names)
}

/// Remove `name` in `dir`: a file or symlink itself, a directory with all it holds (symlinks
/// inside are removed, never followed).
fn remove_tree(dir: RawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: unlinkat(2) relative to a directory we hold.
    if unsafe { libc::unlinkat(dir, name.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EISDIR) {
        return Err(e);
    }
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat(2) relative to a directory we hold; checked.
    let sub = owned(unsafe { libc::openat(dir, name.as_ptr(), flags) })?;
    for child in list_dir(sub.as_raw_fd())? {
        remove_tree(sub.as_raw_fd(), &child)?;
    }
    // SAFETY: unlinkat(2) of the now empty directory.
    check(unsafe { libc::unlinkat(dir, name.as_ptr(), libc::AT_REMOVEDIR) })
}

#[cfg(test)]
mod tests {
    use super::super::tar::Writer;
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::sync::atomic::{AtomicU32, Ordering};

    static NEXT: AtomicU32 = AtomicU32::new(0);

    /// A scratch tree: `dir` (what is applied to), `outside/` beside it with a sentinel file,
    /// and where the archive goes.
    struct Bed {
        base: PathBuf,
        dir: PathBuf,
        outside: PathBuf,
        archive: PathBuf,
    }

    impl Bed {
        fn new() -> Bed {
            let base = std::env::temp_dir().join(format!(
                "amvm-apply-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&base);
            let dir = base.join("dir");
            let outside = base.join("outside");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::create_dir_all(&outside).unwrap();
            std::fs::write(outside.join("sentinel"), b"untouched").unwrap();
            let archive = base.join("changes.tar");
            Bed {
                base,
                dir,
                outside,
                archive,
            }
        }

        fn apply(&self, w: Writer, opts: Options) -> (Result<Report, ApplyError>, Vec<String>) {
            std::fs::write(&self.archive, w.finish()).unwrap();
            let mut lines = Vec::new();
            let r = apply(&self.archive, &self.dir, opts, &mut |l| lines.push(l));
            (r, lines)
        }

        /// Every path below `root` with what it is (file contents, link target, dir), sorted.
        fn tree(root: &Path) -> Vec<String> {
            super::super::tree(root, true)
        }

        fn outside_untouched(&self) {
            assert_eq!(Bed::tree(&self.outside), ["sentinel: 644 untouched"]);
        }
    }

    impl Drop for Bed {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }

    const SKIP: Options = Options {
        check_only: false,
        skip_refused: true,
        any_symlink: false,
    };

    #[test]
    fn a_layer_applies_files_dirs_links_and_whiteouts() {
        let bed = Bed::new();
        std::fs::write(bed.dir.join("keep"), b"old").unwrap();
        std::fs::write(bed.dir.join("gone"), b"old").unwrap();
        std::fs::create_dir_all(bed.dir.join("tree/deep")).unwrap();
        std::fs::write(bed.dir.join("tree/deep/x"), b"old").unwrap();
        std::fs::create_dir_all(bed.dir.join("opq")).unwrap();
        std::fs::write(bed.dir.join("opq/lower"), b"old").unwrap();
        std::fs::write(bed.dir.join("replaced"), b"a file").unwrap();
        let mut w = Writer::default();
        w.entry(b'5', b"./", b"", 0o755, b"");
        w.entry(b'0', b"./keep", b"", 0o640, b"new");
        w.entry(b'0', b"./.wh.gone", b"", 0o644, b"");
        w.entry(b'0', b"./.wh.tree", b"", 0o644, b"");
        w.entry(b'5', b"./opq/", b"", 0o750, b"");
        w.entry(b'0', b"./opq/.wh..wh..opq", b"", 0o644, b"");
        w.entry(b'0', b"./opq/upper", b"", 0o644, b"up");
        w.entry(b'5', b"./new/sub/", b"", 0o555, b"");
        w.entry(b'0', b"./new/sub/f", b"", 0o755, b"made");
        w.entry(b'2', b"./new/link", b"sub/f", 0o777, b"");
        w.entry(b'2', b"./new/sub/up", b"../../keep", 0o777, b"");
        w.entry(b'1', b"./new/hard", b"keep", 0o644, b"");
        w.entry(b'5', b"./replaced/", b"", 0o755, b"");
        let (r, lines) = bed.apply(w, Options::default());
        assert_eq!(lines, Vec::<String>::new());
        assert_eq!(
            r.unwrap(),
            Report {
                applied: 13,
                refused: 0,
                neutralised: 0
            }
        );
        assert_eq!(
            Bed::tree(&bed.dir),
            [
                "keep: 640 new",
                "new: dir 755",
                "new/hard: 640 new",
                "new/link: -> sub/f",
                "new/sub: dir 555",
                "new/sub/f: 755 made",
                "new/sub/up: -> ../../keep",
                "opq: dir 750",
                "opq/upper: 644 up",
                "replaced: dir 755",
            ]
        );
        assert_eq!(
            std::fs::metadata(bed.dir.join("new/hard")).unwrap().ino(),
            std::fs::metadata(bed.dir.join("keep")).unwrap().ino()
        );
        bed.outside_untouched();
    }

    #[test]
    fn an_image_layer_keeps_any_symlink_and_never_follows_one() {
        let bed = Bed::new();
        let target = format!("{}/sentinel", bed.outside.display());
        let mut w = Writer::default();
        w.entry(b'2', b"usr/bin/awk", b"/etc/alternatives/awk", 0o777, b"");
        w.entry(b'2', b"up", b"../../..", 0o777, b"");
        w.entry(b'2', b"out", target.as_bytes(), 0o777, b"");
        // Written through none of them: each replaced, or refused as a symlinked directory.
        w.entry(b'0', b"out", b"", 0o644, b"pwned");
        w.entry(b'0', b"up/x", b"", 0o644, b"pwned");
        let refused = Bed::new();
        let (r, _) = refused.apply(w.clone(), Options::default());
        assert!(matches!(r, Err(ApplyError::Refused(3))), "{r:?}");
        let opts = Options {
            any_symlink: true,
            ..SKIP
        };
        let (r, lines) = bed.apply(w, opts);
        assert_eq!(r.unwrap().refused, 1, "{lines:?}");
        assert!(
            lines[0].starts_with("up/x: refused: up is a symlink"),
            "{lines:?}"
        );
        assert_eq!(
            Bed::tree(&bed.dir),
            [
                "out: 644 pwned",
                "up: -> ../../..",
                "usr: dir 755",
                "usr/bin: dir 755",
                "usr/bin/awk: -> /etc/alternatives/awk",
            ]
        );
        bed.outside_untouched();
    }

    #[test]
    fn dot_dot_is_refused_and_by_default_nothing_is_applied() {
        let bed = Bed::new();
        let mut w = Writer::default();
        w.entry(b'0', b"fine", b"", 0o644, b"ok");
        w.entry(b'0', b"../outside/sentinel", b"", 0o644, b"pwned");
        w.entry(b'0', b"a/../../outside/new", b"", 0o644, b"pwned");
        let (r, lines) = bed.apply(w, Options::default());
        assert!(matches!(r, Err(ApplyError::Refused(2))), "{r:?}");
        assert_eq!(
            lines,
            [
                "../outside/sentinel: refused: a `..` component",
                "a/../../outside/new: refused: a `..` component"
            ]
        );
        assert!(Bed::tree(&bed.dir).is_empty(), "nothing applied");
        bed.outside_untouched();
        // --check says the same and changes nothing; --skip-refused applies the rest.
        let mut lines = Vec::new();
        let opts = Options {
            check_only: true,
            skip_refused: false,
            any_symlink: false,
        };
        let r = apply(&bed.archive, &bed.dir, opts, &mut |l| lines.push(l)).unwrap();
        assert_eq!((r.refused, lines.len()), (2, 2));
        assert!(Bed::tree(&bed.dir).is_empty());
        let r = apply(&bed.archive, &bed.dir, SKIP, &mut |_| {}).unwrap();
        assert_eq!((r.applied, r.refused), (1, 2));
        assert_eq!(Bed::tree(&bed.dir), ["fine: 644 ok"]);
        bed.outside_untouched();
    }

    #[test]
    fn absolute_paths_are_refused() {
        let bed = Bed::new();
        let target = format!("{}/sentinel", bed.outside.display());
        let mut w = Writer::default();
        w.entry(b'0', target.as_bytes(), b"", 0o644, b"pwned");
        w.entry(b'5', b"/", b"", 0o777, b"");
        let (r, lines) = bed.apply(w, SKIP);
        assert_eq!(r.unwrap().refused, 2);
        assert!(
            lines
                .iter()
                .all(|l| l.ends_with("refused: an absolute path")),
            "{lines:?}"
        );
        assert!(Bed::tree(&bed.dir).is_empty());
        bed.outside_untouched();
    }

    #[test]
    fn symlinks_that_point_out_are_refused_those_inside_kept() {
        let bed = Bed::new();
        let abs = format!("{}/sentinel", bed.outside.display());
        let mut w = Writer::default();
        w.entry(b'2', b"abs", abs.as_bytes(), 0o777, b"");
        w.entry(b'2', b"up", b"../outside/sentinel", 0o777, b"");
        w.entry(b'2', b"sub/up2", b"../../outside", 0o777, b"");
        w.entry(b'2', b"sneaky", b"sub/../../outside", 0o777, b"");
        w.entry(b'2', b"empty", b"", 0o777, b"");
        w.entry(b'2', b"sub/fine", b"../sub/x", 0o777, b"");
        w.entry(b'2', b"dot", b".", 0o777, b"");
        let (r, lines) = bed.apply(w, SKIP);
        let r = r.unwrap();
        assert_eq!((r.applied, r.refused), (2, 5), "{lines:#?}");
        assert!(lines[0].starts_with("abs: refused: a symlink to an absolute path"));
        assert!(lines[1].starts_with("up: refused: a symlink that points out"));
        assert!(lines[2].starts_with("sub/up2: refused: a symlink that points out"));
        assert!(lines[3].starts_with("sneaky: refused: a symlink with `..` after a name"));
        assert!(lines[4].starts_with("empty: refused: a symlink with an empty target"));
        assert_eq!(
            Bed::tree(&bed.dir),
            ["dot: -> .", "sub: dir 755", "sub/fine: -> ../sub/x"]
        );
        bed.outside_untouched();
    }

    #[test]
    fn a_file_under_a_symlink_is_refused_never_written_through() {
        let bed = Bed::new();
        // DIR already has a symlink out (the user's own), and the archive makes one inside.
        std::os::unix::fs::symlink(&bed.outside, bed.dir.join("out")).unwrap();
        std::fs::create_dir(bed.dir.join("real")).unwrap();
        let mut w = Writer::default();
        w.entry(b'0', b"out/sentinel", b"", 0o644, b"pwned");
        w.entry(b'0', b"out/new", b"", 0o644, b"pwned");
        w.entry(b'2', b"alias", b"real", 0o777, b"");
        w.entry(b'0', b"alias/f", b"", 0o644, b"through");
        w.entry(b'0', b".wh.out/sentinel", b"", 0o644, b""); // a whiteout's parent, too
        let (r, lines) = bed.apply(w, SKIP);
        let r = r.unwrap();
        assert_eq!((r.applied, r.refused), (2, 3), "{lines:#?}");
        assert_eq!(
            lines[0],
            "out/sentinel: refused: out is a symlink or not a directory"
        );
        assert_eq!(
            lines[2],
            "alias/f: refused: alias is a symlink or not a directory"
        );
        assert!(Bed::tree(&bed.dir.join("real")).is_empty());
        bed.outside_untouched();
    }

    #[test]
    fn an_existing_symlink_is_replaced_not_followed() {
        let bed = Bed::new();
        std::os::unix::fs::symlink(bed.outside.join("sentinel"), bed.dir.join("f")).unwrap();
        std::os::unix::fs::symlink(&bed.outside, bed.dir.join("d")).unwrap();
        let mut w = Writer::default();
        w.entry(b'0', b"f", b"", 0o644, b"mine");
        w.entry(b'5', b"d/", b"", 0o700, b"");
        w.entry(b'0', b".wh.gone-anyway", b"", 0o644, b"");
        let (r, lines) = bed.apply(w, Options::default());
        assert_eq!(r.unwrap().refused, 0, "{lines:?}");
        assert_eq!(Bed::tree(&bed.dir), ["d: dir 700", "f: 644 mine"]);
        bed.outside_untouched();
        // A whiteout of a symlink to a directory removes the link, not what it points to.
        std::os::unix::fs::symlink(&bed.outside, bed.dir.join("d2")).unwrap();
        let mut w = Writer::default();
        w.entry(b'0', b".wh.d2", b"", 0o644, b"");
        let (r, _) = bed.apply(w, Options::default());
        assert_eq!(r.unwrap().applied, 1);
        assert!(!bed.dir.join("d2").exists());
        bed.outside_untouched();
    }

    #[test]
    fn device_nodes_fifos_and_unknown_types_are_refused() {
        let bed = Bed::new();
        let mut w = Writer::default();
        w.entry(b'3', b"null", b"", 0o666, b"");
        w.entry(b'4', b"sda", b"", 0o660, b"");
        w.entry(b'6', b"fifo", b"", 0o644, b"");
        w.entry(b'V', b"volume", b"", 0o644, b"");
        let (r, lines) = bed.apply(w, SKIP);
        assert_eq!(r.unwrap().refused, 4);
        assert_eq!(
            lines,
            [
                "null: refused: a device node",
                "sda: refused: a device node",
                "fifo: refused: a FIFO",
                "volume: refused: an entry of unknown type 'V'"
            ]
        );
        assert!(Bed::tree(&bed.dir).is_empty());
    }

    #[test]
    fn setuid_and_setgid_bits_are_dropped() {
        let bed = Bed::new();
        let mut w = Writer::default();
        w.entry(b'0', b"su", b"", 0o4755, b"x");
        w.entry(b'0', b"sg", b"", 0o2755, b"x");
        w.entry(b'5', b"gdir/", b"", 0o2775, b"");
        w.entry(b'5', b"sticky/", b"", 0o1777, b"");
        let (r, lines) = bed.apply(w, Options::default());
        assert_eq!(
            r.unwrap(),
            Report {
                applied: 4,
                refused: 0,
                neutralised: 3
            }
        );
        assert_eq!(lines.len(), 3);
        assert!(lines[0].ends_with("su: setuid and setgid bits dropped"));
        assert_eq!(
            Bed::tree(&bed.dir),
            [
                "gdir: dir 775",
                "sg: 755 x",
                "sticky: dir 1777",
                "su: 755 x"
            ]
        );
    }

    #[test]
    fn hard_links_out_of_the_tree_are_refused() {
        let bed = Bed::new();
        std::os::unix::fs::symlink(&bed.outside, bed.dir.join("out")).unwrap();
        std::fs::create_dir(bed.dir.join("sub")).unwrap();
        let abs = format!("{}/sentinel", bed.outside.display());
        let mut w = Writer::default();
        w.entry(b'1', b"h1", b"../outside/sentinel", 0o644, b"");
        w.entry(b'1', b"h2", abs.as_bytes(), 0o644, b"");
        w.entry(b'1', b"h3", b"out/sentinel", 0o644, b"");
        w.entry(b'1', b"h4", b"missing", 0o644, b"");
        w.entry(b'1', b"h5", b"sub", 0o644, b"");
        w.entry(b'1', b"h6", b"out", 0o644, b"");
        let (r, lines) = bed.apply(w, SKIP);
        assert_eq!(r.unwrap().refused, 6, "{lines:#?}");
        assert_eq!(lines[0], "h1: refused: a hard link to a `..` component");
        assert_eq!(lines[1], "h2: refused: a hard link to an absolute path");
        assert_eq!(lines[2], "h3: refused: out is a symlink or not a directory");
        assert_eq!(
            lines[3],
            "h4: refused: a hard link to a file that is not in the directory"
        );
        assert_eq!(
            lines[4],
            "h5: refused: a hard link to something that is not a regular file"
        );
        assert_eq!(
            lines[5],
            "h6: refused: a hard link to something that is not a regular file"
        );
        let sentinel = std::fs::metadata(bed.outside.join("sentinel")).unwrap();
        assert_eq!(sentinel.nlink(), 1, "no new link to the file outside");
        bed.outside_untouched();
    }

    #[test]
    fn names_longer_than_name_max_or_paths_than_path_max_are_refused() {
        let bed = Bed::new();
        let long_name = vec![b'n'; 256];
        let mut long_path = Vec::new();
        while long_path.len() < PATH_MAX {
            long_path.extend_from_slice(&[b'd'; 200]);
            long_path.push(b'/');
        }
        let mut w = Writer::default();
        w.entry(b'0', &long_name, b"", 0o644, b"x");
        w.entry(b'0', &long_path, b"", 0o644, b"x");
        w.entry(b'0', &[b'k'; 255], b"", 0o644, b"fits");
        let (r, lines) = bed.apply(w, SKIP);
        let r = r.unwrap();
        assert_eq!((r.applied, r.refused), (1, 2), "{lines:?}");
        assert!(lines[0].ends_with("refused: a name of 256 bytes (NAME_MAX is 255)"));
        assert!(lines[1].contains("(PATH_MAX is 4096)"), "{}", lines[1]);
    }

    #[test]
    fn a_10_gib_sparse_file_is_written_sparse() {
        let bed = Bed::new();
        let size = 10u64 << 30;
        let mut w = Writer::default();
        w.sparse(b"big", 0o644, size, &[(0, b"head"), (size - 4, b"tail")]);
        let (r, lines) = bed.apply(w, Options::default());
        assert_eq!(r.unwrap().applied, 1, "{lines:?}");
        let m = std::fs::metadata(bed.dir.join("big")).unwrap();
        assert_eq!(m.len(), size);
        assert!(
            m.blocks() * 512 < 1 << 20,
            "{} blocks: not sparse",
            m.blocks()
        );
        use std::os::unix::fs::FileExt;
        let f = File::open(bed.dir.join("big")).unwrap();
        let mut b = [0u8; 4];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"head");
        f.read_exact_at(&mut b, size - 4).unwrap();
        assert_eq!(&b, b"tail");
        f.read_exact_at(&mut b, 5 << 30).unwrap();
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn a_malformed_archive_changes_nothing() {
        let bed = Bed::new();
        let mut w = Writer::default();
        w.entry(b'0', b"first", b"", 0o644, b"x");
        w.entry(b'0', b"second", b"", 0o644, &[1u8; 4000]);
        let mut bytes = w.finish();
        bytes.truncate(1536); // inside the second file's data
        std::fs::write(&bed.archive, &bytes).unwrap();
        let e = apply(&bed.archive, &bed.dir, SKIP, &mut |_| {}).unwrap_err();
        assert!(matches!(e, ApplyError::Archive { .. }), "{e}");
        assert!(
            e.to_string().ends_with("truncated); nothing was applied"),
            "{e}"
        );
        assert!(Bed::tree(&bed.dir).is_empty());
        // And a missing DIR or archive is one clear error.
        let e = apply(&bed.archive, &bed.base.join("nope"), SKIP, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("nope: No such file"), "{e}");
        std::fs::set_permissions(&bed.archive, std::fs::Permissions::from_mode(0o644)).unwrap();
    }

    /// `dirs` directories of 1000 empty files each, applied; returns the files found after.
    fn tiny_files(dirs: u32) -> usize {
        let bed = Bed::new();
        {
            use std::io::Write;
            let mut f = io::BufWriter::new(File::create(&bed.archive).unwrap());
            for d in 0..dirs {
                let mut w = Writer::default();
                w.entry(b'5', format!("d{d}/").as_bytes(), b"", 0o755, b"");
                for i in 0..1000 {
                    w.entry(b'0', format!("d{d}/f{i}").as_bytes(), b"", 0o644, b"");
                }
                f.write_all(&w.out).unwrap();
            }
            f.write_all(&[0u8; 1024]).unwrap();
        }
        let r = apply(&bed.archive, &bed.dir, Options::default(), &mut |_| {}).unwrap();
        assert_eq!((r.applied, r.refused), (u64::from(dirs) * 1001, 0));
        (0..dirs)
            .map(|d| {
                std::fs::read_dir(bed.dir.join(format!("d{d}")))
                    .unwrap()
                    .count()
            })
            .sum()
    }

    #[test]
    fn twenty_thousand_tiny_files_apply() {
        assert_eq!(tiny_files(20), 20_000);
    }

    /// A million empty files in a thousand directories: one pass each way, memory of one hash
    /// per path (for opaque markers). About 5 minutes of system time on our 2-core machine.
    #[test]
    #[ignore = "long tier: tests/run --long"]
    fn a_million_tiny_files_apply() {
        assert_eq!(tiny_files(1000), 1_000_000);
    }
}
