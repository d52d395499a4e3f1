//! Layers into snapshots: a chain's root made from the chain below it by hard links, its
//! layer (decompressed and checked against its diff id) applied on top.

use super::{bad, io_err, Digest, Store, StoreError};
use crate::changes::apply::{self, Options};
use sha2::{Digest as _, Sha256};
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The OCI chain ids of a stack of layers: the first is its diff id; each next one is
/// sha256 of the previous chain id, a space and its own diff id.
pub fn chain_ids(diff_ids: &[Digest]) -> Vec<Digest> {
    let mut out: Vec<Digest> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => Digest::of(format!("{prev} {d}").as_bytes()),
        };
        out.push(next);
    }
    out
}

/// Compression, by the stream's first bytes (what a media type claims is not trusted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

pub(crate) fn sniff(path: &Path) -> Result<Compression, StoreError> {
    let mut head = [0u8; 4];
    let mut f = File::open(path).map_err(io_err(path.display()))?;
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path.display())(e)),
        }
    }
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
        _ => Compression::None,
    })
}

/// `src` decompressed into a new file `dest` (0600); returns the sha256 of what was written.
pub(crate) fn decompress(src: &Path, dest: &Path) -> Result<Digest, StoreError> {
    let kind = sniff(src)?;
    let f = File::open(src).map_err(io_err(src.display()))?;
    let r = BufReader::with_capacity(256 * 1024, f);
    let mut reader: Box<dyn Read> = match kind {
        Compression::None => Box::new(r),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(r)
                .map_err(|e| bad(src.display().to_string(), e.to_string()))?,
        ),
    };
    let mut out = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(dest)
        .map_err(io_err(dest.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(bad(
                    src.display().to_string(),
                    format!("cannot decompress ({kind:?}): {e}"),
                ))
            }
        };
        h.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io_err(dest.display()))?;
    }
    Ok(Digest::from_hasher(h))
}

/// Unpack `layers` (stored blobs; `diff_ids` their uncompressed digests): every chain not yet
/// in `snapshots/` is made. Returns the top chain id and the root's size in bytes.
pub(super) fn unpack(
    store: &Store,
    layers: &[Digest],
    diff_ids: &[Digest],
    say: &mut dyn FnMut(String),
) -> Result<(Digest, u64), StoreError> {
    let chains = chain_ids(diff_ids);
    for (i, chain) in chains.iter().enumerate() {
        let snap = store.snapshot(chain);
        if snap.is_dir() {
            continue;
        }
        let tmp = store.tmp("snapshot");
        let tar = store.tmp("layer.tar");
        let made = make_chain(
            store,
            &tmp,
            &tar,
            i.checked_sub(1).map(|p| store.snapshot(&chains[p])),
            &layers[i],
            &diff_ids[i],
            say,
        );
        let _ = std::fs::remove_file(&tar);
        let size = match made {
            Ok(size) => size,
            Err(e) => {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
        };
        let size_file = PathBuf::from(format!("{}.size", snap.display()));
        std::fs::write(&size_file, size.to_string()).map_err(io_err(size_file.display()))?;
        store.note_added(size_file);
        if let Err(e) = std::fs::rename(&tmp, &snap) {
            // Another import made the same chain meanwhile: keep theirs.
            let _ = remove_tree(&tmp);
            if !snap.is_dir() {
                return Err(io_err(snap.display())(e));
            }
        } else {
            store.note_added(snap);
        }
    }
    let top = chains.last().expect("at least one layer").clone();
    let size_file = format!("{}.size", store.snapshot(&top).display());
    let size = std::fs::read_to_string(&size_file)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    Ok((top, size))
}

/// The mount points a root needs for the guest (`/proc`, `/sys`, `/dev`, `/tmp`,
/// `/workspace`), made when a layer has not.
const MOUNT_POINTS: [&str; 5] = ["proc", "sys", "dev", "tmp", "workspace"];

fn make_chain(
    store: &Store,
    tmp: &Path,
    tar: &Path,
    below: Option<PathBuf>,
    layer: &Digest,
    diff_id: &Digest,
    say: &mut dyn FnMut(String),
) -> Result<u64, StoreError> {
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(tmp)
        .map_err(io_err(tmp.display()))?;
    if let Some(below) = below {
        clone_tree(&below, tmp)?;
    }
    let got = decompress(&store.blob(layer), tar)?;
    if &got != diff_id {
        return Err(StoreError::DigestMismatch {
            what: format!("layer {layer} uncompressed"),
            want: diff_id.to_string(),
            got: got.to_string(),
        });
    }
    let mut skipped = 0u64;
    let opts = Options {
        check_only: false,
        skip_refused: true,
        any_symlink: true,
    };
    let report = apply::apply(tar, tmp, opts, &mut |line| {
        if line.contains(": refused: ") {
            skipped += 1;
        }
        tracing::debug!("layer {layer}: {line}");
        say(format!("layer {}: {line}", layer.short()));
    })
    .map_err(|e| StoreError::Layer {
        digest: layer.to_string(),
        why: e.to_string(),
    })?;
    tracing::debug!(
        "layer {layer}: {} entries applied, {} skipped",
        report.applied,
        skipped
    );
    for m in MOUNT_POINTS {
        let p = tmp.join(m);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::DirBuilder::new()
                .mode(0o755)
                .create(&p)
                .and_then(|()| {
                    let mode = if m == "tmp" { 0o1777 } else { 0o755 };
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
                })
                .map_err(io_err(p.display()))?;
        }
    }
    fix_dirs(tmp)
}

/// Every directory below `root` given `u+rwx` (so the store can build on it and remove it);
/// returns the size of the files and symlinks (each inode once).
fn fix_dirs(root: &Path) -> Result<u64, StoreError> {
    let mut size = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let md = std::fs::symlink_metadata(&dir).map_err(io_err(dir.display()))?;
        if md.mode() & 0o700 != 0o700 {
            let mode = (md.mode() & 0o7777) | 0o700;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(io_err(dir.display()))?;
        }
        for e in std::fs::read_dir(&dir).map_err(io_err(dir.display()))? {
            let e = e.map_err(io_err(dir.display()))?;
            let md = e.metadata().map_err(io_err(e.path().display()))?;
            if md.is_dir() {
                stack.push(e.path());
            } else if seen.insert(md.ino()) {
                size += md.len();
            }
        }
    }
    Ok(size)
}

/// `dst` (an empty directory) made a copy of `src` by hard links: directories made anew with
/// their modes, everything else linked (`linkat` without following a symlink).
fn clone_tree(src: &Path, dst: &Path) -> Result<(), StoreError> {
    let mut stack = vec![(src.to_path_buf(), dst.to_path_buf())];
    let mut modes = Vec::new();
    while let Some((s, d)) = stack.pop() {
        for e in std::fs::read_dir(&s).map_err(io_err(s.display()))? {
            let e = e.map_err(io_err(s.display()))?;
            let ft = e.file_type().map_err(io_err(e.path().display()))?;
            let to = d.join(e.file_name());
            if ft.is_dir() {
                let mode = e.metadata().map_err(io_err(e.path().display()))?.mode() & 0o7777;
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&to)
                    .map_err(io_err(to.display()))?;
                modes.push((to.clone(), mode | 0o700));
                stack.push((e.path(), to));
            } else {
                std::fs::hard_link(e.path(), &to).map_err(io_err(to.display()))?;
            }
        }
    }
    for (p, mode) in modes {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
            .map_err(io_err(p.display()))?;
    }
    Ok(())
}

/// Remove a file or a whole tree (directories made writable first); returns the bytes of the
/// files whose last link went.
pub(super) fn remove_tree(path: &Path) -> Result<u64, StoreError> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_err(path.display())(e)),
    };
    if !md.is_dir() {
        let freed = if md.nlink() <= 1 { md.len() } else { 0 };
        std::fs::remove_file(path).map_err(io_err(path.display()))?;
        return Ok(freed);
    }
    let mut freed = 0;
    if md.mode() & 0o700 != 0o700 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(path.display()))?;
    }
    for e in std::fs::read_dir(path).map_err(io_err(path.display()))? {
        let e = e.map_err(io_err(path.display()))?;
        freed += remove_tree(&e.path())?;
    }
    std::fs::remove_dir(path).map_err(io_err(path.display()))?;
    Ok(freed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let a = Digest::of(b"a");
        let b = Digest::of(b"b");
        let c = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(c[0], a);
        assert_eq!(c[1], Digest::of(format!("{a} {b}").as_bytes()));
        assert!(chain_ids(&[]).is_empty());
    }
}
