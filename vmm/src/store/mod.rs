//! The OCI image store: container images imported from `docker save` / `podman save` archives
//! and OCI image layouts, run with `amvm run|create --image REF`.
//!
//! Layout, under `$AMVM_CACHE/oci` (default `~/.cache/amvm/oci`, mode 0700):
//!
//! * `blobs/sha256/HEX`: manifests, configs and layers as they came, each stored once, under
//!   the digest it was checked against (written to `tmp/` first, hashed while written, and
//!   renamed into place only when its digest and size are right: a half-written or tampered
//!   blob is never under a digest's name).
//! * `snapshots/HEX`: the unpacked root of a chain of layers, named by its OCI chain id (the
//!   first layer's diff id; then sha256 of the previous chain id, a space, the next diff id).
//!   A chain is made from the chain below it by hard links (directories are made anew, files
//!   and symlinks linked), then its layer applied on top by the changes code
//!   (`changes::apply`): whiteouts and opaque directories as OCI says, every path walked with
//!   `O_NOFOLLOW` so nothing outside the snapshot is touched, files written anew and renamed
//!   over (a linked file of the chain below is replaced, never written through). So two images
//!   that share a base layer share its files on disk. `snapshots/HEX.size` holds the root's
//!   size in bytes. Snapshots are made in `tmp/` and renamed into place whole.
//!   `snapshots/HEX.erofs` is the same root as an EROFS image, made by `mkfs.erofs` the first
//!   time the image runs ([`Store::erofs_image`]): the guest mounts it from a read-only disk.
//! * `refs/HEX.json`: one image name (HEX is sha256 of the normalised name), its image id (the
//!   config's digest), its manifest, layers, diff ids, top chain, size and when it was stored.
//!
//! Import and pull take the store's lock shared (they only add, each piece by an atomic
//! rename, so two of them at once at worst do the same work twice); `rm` and `prune` take it
//! exclusive.
//!
//! What the host keeps of a layer: regular files, directories, symlinks (any target) and hard
//! links within the layer. Device nodes and FIFOs are skipped (each named); setuid and setgid
//! bits are dropped and owners are the store's owner, as `amvm apply` does; directories get
//! `u+rwx` (so the store can build on them and remove them); the guest sees the root
//! read-only either way.

pub mod import;
pub mod pull;
mod unpack;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use unpack::chain_ids;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no image store: set AMVM_CACHE or HOME")]
    NoDir,
    #[error("{0}: {1}")]
    Io(String, io::Error),
    #[error("{0:?} is not an image reference: {1}")]
    BadRef(String, String),
    #[error("no image {0} in the store (amvm image list shows what is there; amvm image import FILE adds one)")]
    NotFound(String),
    #[error("{0:?} names {1} images; give a whole name")]
    Ambiguous(String, usize),
    #[error("{what}: {why}")]
    Bad { what: String, why: String },
    #[error("{what}: its digest is {got}, not {want}; nothing of it was kept")]
    DigestMismatch {
        what: String,
        want: String,
        got: String,
    },
    #[error("{what}: {got} bytes, not {want}; nothing of it was kept")]
    SizeMismatch { what: String, want: u64, got: u64 },
    #[error("image {name} is for {platform}; amvm runs linux/amd64 images")]
    Platform { name: String, platform: String },
    #[error("cannot reach the registry {registry}: {why}")]
    Unreachable { registry: String, why: String },
    #[error("layer {digest}: {why}")]
    Layer { digest: String, why: String },
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> StoreError {
    let what = what.to_string();
    move |e| StoreError::Io(what, e)
}

pub(crate) fn bad(what: impl Into<String>, why: impl Into<String>) -> StoreError {
    StoreError::Bad {
        what: what.into(),
        why: why.into(),
    }
}

/// A content digest, `sha256:` and 64 lower-case hex digits (the only algorithm accepted: the
/// one every registry and engine writes).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    pub fn parse(s: &str) -> Result<Digest, String> {
        let Some(hex) = s.strip_prefix("sha256:") else {
            return Err(format!("{s:?} is not a sha256 digest"));
        };
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(format!(
                "{s:?} is not a sha256 digest (64 lower-case hex digits)"
            ));
        }
        Ok(Digest(s.to_string()))
    }
    pub fn of(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }
    pub(crate) fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("sha256:{}", hex(&h.finalize())))
    }
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The first 12 hex digits, as engines show an image id.
    pub fn short(&self) -> &str {
        &self.hex()[..12]
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Digest {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Digest::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An image name as engines normalise it: `python:3.12` is `docker.io/library/python:3.12`,
/// `localhost/x` is `localhost/x:latest`.
pub fn normalise(name: &str) -> Result<String, StoreError> {
    let r: oci_spec::distribution::Reference =
        name.parse()
            .map_err(|e: oci_spec::distribution::ParseError| {
                StoreError::BadRef(name.to_string(), e.to_string())
            })?;
    Ok(r.whole())
}

/// What engines would normalise `name` to, by their rules alone (Docker Hub's `library/` and
/// `docker.io/`, `:latest` without a tag or digest), unchecked: a stored name equal to one of
/// these was checked when it was stored.
fn likely_names(name: &str) -> Vec<String> {
    let (path, suffix) = match name.find('@') {
        Some(at) => (&name[..at], name[at..].to_string()),
        None => {
            let last = name.rsplit('/').next().unwrap_or(name);
            if last.contains(':') {
                let cut = name.len() - last.len() + last.find(':').unwrap_or(0);
                (&name[..cut], name[cut..].to_string())
            } else {
                (name, ":latest".to_string())
            }
        }
    };
    let first = path.split('/').next().unwrap_or(path);
    let has_registry =
        path.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost");
    let full = if has_registry {
        path.to_string()
    } else if path.contains('/') {
        format!("docker.io/{path}")
    } else {
        format!("docker.io/library/{path}")
    };
    vec![format!("{full}{suffix}")]
}

/// One stored image name: `refs/HEX.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    /// The normalised name (`docker.io/library/python:3.12-slim`).
    pub name: String,
    /// The image id: its config's digest.
    pub id: Digest,
    /// The manifest's digest, when the image came with one (an OCI layout, a registry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Digest>,
    /// The layers' blobs, in order.
    pub layers: Vec<Digest>,
    /// Their uncompressed digests (the config's `rootfs.diff_ids`).
    pub diff_ids: Vec<Digest>,
    /// The top chain id: `snapshots/HEX` is the image's root.
    pub chain: Digest,
    /// The unpacked root's size in bytes.
    pub size: u64,
    /// When the image was made (its config's `created`), if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    /// When it was stored here (RFC 3339, UTC).
    pub stored: String,
    /// Where it came from (`import FILE`, `pull REF`).
    pub source: String,
}

/// What running an image takes from its config (Docker's meaning of each).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunDefaults {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
}

/// An image found for a run: its root and its config's defaults.
#[derive(Debug, Clone)]
pub struct Found {
    pub record: Record,
    pub root: PathBuf,
    pub defaults: RunDefaults,
}

/// The store, opened (its directories made when missing).
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    /// What this store value added that no name refers to yet (blobs, snapshots): an import
    /// that fails removes it ([`Store::undo`]), so a refused image leaves nothing behind.
    added: std::sync::Mutex<Vec<PathBuf>>,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Store {
    /// `$AMVM_CACHE/oci`, default `~/.cache/amvm/oci`.
    pub fn default_dir() -> Result<PathBuf, StoreError> {
        Ok(crate::config::cache_dir()
            .ok_or(StoreError::NoDir)?
            .join("oci"))
    }

    /// The store at `dir`. Nothing is made until something is added ([`Store::lock`] makes its
    /// directories): reading a store that is not there (or on a read-only file system) finds
    /// no images.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Ok(Store {
            dir: dir.to_path_buf(),
            added: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn prepare(&self) -> Result<(), StoreError> {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true).mode(0o700);
        for sub in ["blobs/sha256", "snapshots", "refs", "tmp"] {
            let p = self.dir.join(sub);
            b.create(&p).map_err(io_err(p.display()))?;
        }
        Ok(())
    }

    pub(crate) fn note_added(&self, p: PathBuf) {
        self.added.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }

    /// Remove what [`Store::note_added`] noted since the last names were written (a failed
    /// import's blobs and snapshots). A concurrent import that found one of them there may
    /// then fail on it, saying so; run again, it succeeds.
    pub fn undo(&self) {
        let added = std::mem::take(&mut *self.added.lock().unwrap_or_else(|e| e.into_inner()));
        for p in added.into_iter().rev() {
            let _ = unpack::remove_tree(&p);
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The store's lock: shared to add, exclusive to remove. Every change takes it first, so
    /// this is where the store's directories are made.
    pub fn lock(&self, exclusive: bool) -> Result<File, StoreError> {
        self.prepare()?;
        let p = self.dir.join("lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&p)
            .map_err(io_err(p.display()))?;
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        // SAFETY: flock(2) on a descriptor we hold; checked.
        if unsafe { libc::flock(f.as_raw_fd(), op) } != 0 {
            return Err(io_err(p.display())(io::Error::last_os_error()));
        }
        Ok(f)
    }

    /// A fresh name in `tmp/` (this process's id in it, so `prune` can tell a live one).
    pub(crate) fn tmp(&self, what: &str) -> PathBuf {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join("tmp")
            .join(format!("{}.{n}.{what}", std::process::id()))
    }

    pub fn blob(&self, d: &Digest) -> PathBuf {
        self.dir.join("blobs/sha256").join(d.hex())
    }

    pub(crate) fn snapshot(&self, chain: &Digest) -> PathBuf {
        self.dir.join("snapshots").join(chain.hex())
    }

    /// The EROFS image of chain `chain`'s root (`snapshots/HEX.erofs`), which a run mounts from
    /// a read-only disk instead of sharing the root over virtio-fs (its metadata then stays in
    /// the guest's page cache). Made from the root with `mkfs.erofs` on first use, in `tmp/`
    /// and renamed into place whole, under the store's shared lock (two runs at once at worst
    /// both make it). `None` when `mkfs.erofs` is not installed (erofs-utils): the root is
    /// shared as before.
    pub fn erofs_image(&self, chain: &Digest) -> Result<Option<PathBuf>, StoreError> {
        let image = self
            .dir
            .join("snapshots")
            .join(format!("{}.erofs", chain.hex()));
        if image.is_file() {
            return Ok(Some(image));
        }
        let root = self.snapshot(chain);
        let _lock = self.lock(false)?;
        if image.is_file() {
            return Ok(Some(image));
        }
        let tmp =
            self.dir
                .join("tmp")
                .join(format!("{}.erofs-{}", std::process::id(), chain.hex()));
        // `-x-1`: no extended attributes (the store keeps none it means; and listing them
        // fails on file systems without them, such as a virtio-fs mount).
        let out = match std::process::Command::new("mkfs.erofs")
            .args(["--quiet", "-x-1"])
            .arg(&tmp)
            .arg(&root)
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::info!(
                    "mkfs.erofs is not installed (erofs-utils): the image's root is shared over \
                     virtio-fs instead of mounted from an EROFS disk"
                );
                return Ok(None);
            }
            Err(e) => return Err(StoreError::Io("mkfs.erofs".into(), e)),
        };
        if !out.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(bad(
                format!("the EROFS image of {}", root.display()),
                format!(
                    "mkfs.erofs failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        std::fs::rename(&tmp, &image).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            StoreError::Io(image.display().to_string(), e)
        })?;
        Ok(Some(image))
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.dir
            .join("refs")
            .join(format!("{}.json", Digest::of(name.as_bytes()).hex()))
    }

    /// Store what `src` yields as a blob: hashed while written to `tmp/`, checked against
    /// `want` (digest and size) when given, then renamed to its digest's name. A blob already
    /// there is kept (the new copy dropped). Returns the digest and size.
    pub fn put_blob(
        &self,
        what: &str,
        src: &mut dyn Read,
        want: Option<(&Digest, u64)>,
    ) -> Result<(Digest, u64), StoreError> {
        let mut w = BlobWriter::new(self, what, want)?;
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let got = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(what)(e)),
            };
            w.write(&buf[..got])?;
        }
        w.finish()
    }

    /// A stored blob's bytes (a manifest's or a config's: at most `limit`).
    pub fn read_blob(&self, d: &Digest, limit: u64) -> Result<Vec<u8>, StoreError> {
        let p = self.blob(d);
        let mut v = Vec::new();
        File::open(&p)
            .and_then(|f| f.take(limit + 1).read_to_end(&mut v))
            .map_err(io_err(p.display()))?;
        if v.len() as u64 > limit {
            return Err(bad(d.to_string(), format!("larger than {limit} bytes")));
        }
        Ok(v)
    }

    /// Record `names` for an image whose config and layers are stored: unpack its layers
    /// (the chains not there yet), then write one ref per name.
    pub fn add(
        &self,
        names: &[String],
        config: &Digest,
        manifest: Option<&Digest>,
        layers: &[Digest],
        source: &str,
        say: &mut dyn FnMut(String),
    ) -> Result<Vec<Record>, StoreError> {
        let raw = self.read_blob(config, MAX_CONFIG)?;
        let cfg = parse_config(config, &raw)?;
        let diff_ids = cfg
            .rootfs()
            .diff_ids()
            .iter()
            .map(|d| Digest::parse(d).map_err(|why| bad(format!("image config {config}"), why)))
            .collect::<Result<Vec<_>, _>>()?;
        if diff_ids.len() != layers.len() {
            return Err(bad(
                format!("image config {config}"),
                format!("{} diff ids for {} layers", diff_ids.len(), layers.len()),
            ));
        }
        if layers.is_empty() {
            return Err(bad(format!("image {config}"), "no layers"));
        }
        let (chain, size) = unpack::unpack(self, layers, &diff_ids, say)?;
        let stored = crate::oci::rfc3339_now();
        let mut out = Vec::new();
        for name in names {
            let rec = Record {
                name: name.clone(),
                id: config.clone(),
                manifest: manifest.cloned(),
                layers: layers.to_vec(),
                diff_ids: diff_ids.clone(),
                chain: chain.clone(),
                size,
                created: cfg.created().clone(),
                stored: stored.clone(),
                source: source.to_string(),
            };
            let p = self.ref_path(name);
            let tmp = self.tmp("ref");
            let data = serde_json::to_vec_pretty(&rec).expect("a record serialises");
            std::fs::write(&tmp, data)
                .and_then(|()| std::fs::rename(&tmp, &p))
                .map_err(|e| {
                    let _ = std::fs::remove_file(&tmp);
                    io_err(p.display())(e)
                })?;
            out.push(rec);
        }
        // Named now: kept.
        self.added.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(out)
    }

    /// Every stored name, sorted.
    pub fn list(&self) -> Result<Vec<Record>, StoreError> {
        let dir = self.dir.join("refs");
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(io_err(dir.display())(e)),
        };
        for e in entries {
            let p = e.map_err(io_err(dir.display()))?.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let data = std::fs::read(&p).map_err(io_err(p.display()))?;
            let rec: Record = serde_json::from_slice(&data)
                .map_err(|e| bad(p.display().to_string(), e.to_string()))?;
            out.push(rec);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The image `what` names: a name (normalised as engines do), or an id or its prefix
    /// (at least 12 hex digits, `sha256:` optional).
    pub fn find(&self, what: &str) -> Result<Record, StoreError> {
        let all = self.list()?;
        let id = what.strip_prefix("sha256:").unwrap_or(what);
        if id.len() >= 12 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
            let hits: Vec<_> = all.iter().filter(|r| r.id.hex().starts_with(id)).collect();
            let mut ids: Vec<_> = hits.iter().map(|r| &r.id).collect();
            ids.dedup();
            match ids.len() {
                0 => {}
                1 => return Ok(hits[0].clone()),
                n => return Err(StoreError::Ambiguous(what.to_string(), n)),
            }
        }
        // The names `what` may normalise to, tried first: the reference grammar's regex takes
        // 40 ms to build here (most of a second in an emulated host), which a run of an
        // image that is there should not pay.
        for name in likely_names(what) {
            if let Some(r) = all.iter().find(|r| r.name == name) {
                return Ok(r.clone());
            }
        }
        let name = normalise(what)?;
        all.into_iter()
            .find(|r| r.name == name)
            .ok_or(StoreError::NotFound(name))
    }

    /// The image for a run: its root (checked to be there) and its config's defaults.
    pub fn for_run(&self, what: &str) -> Result<Found, StoreError> {
        let record = self.find(what)?;
        let root = self.snapshot(&record.chain);
        if !root.is_dir() {
            return Err(bad(
                format!("image {}", record.name),
                format!(
                    "its root {} is missing (amvm image rm it and import it again)",
                    root.display()
                ),
            ));
        }
        let raw = self.read_blob(&record.id, MAX_CONFIG)?;
        let cfg = parse_config(&record.id, &raw)?;
        let mut d = RunDefaults::default();
        if let Some(c) = cfg.config() {
            d.entrypoint = c.entrypoint().clone().unwrap_or_default();
            d.cmd = c.cmd().clone().unwrap_or_default();
            d.env = c.env().clone().unwrap_or_default();
            d.workdir = c.working_dir().clone().filter(|w| !w.is_empty());
            d.user = c.user().clone().filter(|u| !u.is_empty());
        }
        Ok(Found {
            record,
            root,
            defaults: d,
        })
    }

    /// Remove the name `what`, then what no other name needs ([`Store::prune`]).
    pub fn remove(&self, what: &str) -> Result<(Record, u64), StoreError> {
        let _lock = self.lock(true)?;
        let rec = self.find(what)?;
        let p = self.ref_path(&rec.name);
        std::fs::remove_file(&p).map_err(io_err(p.display()))?;
        let freed = self.prune_locked()?;
        Ok((rec, freed))
    }

    /// Remove the blobs and snapshots no stored name needs, and what dead processes left in
    /// `tmp/`. Returns the bytes freed (blobs; snapshots count their files' sizes).
    pub fn prune(&self) -> Result<u64, StoreError> {
        let _lock = self.lock(true)?;
        self.prune_locked()
    }

    fn prune_locked(&self) -> Result<u64, StoreError> {
        let mut blobs = std::collections::HashSet::new();
        let mut chains = std::collections::HashSet::new();
        for r in self.list()? {
            blobs.insert(r.id.hex().to_string());
            if let Some(m) = &r.manifest {
                blobs.insert(m.hex().to_string());
            }
            for l in &r.layers {
                blobs.insert(l.hex().to_string());
            }
            for c in chain_ids(&r.diff_ids) {
                chains.insert(c.hex().to_string());
            }
        }
        let mut freed = 0u64;
        let dir = self.dir.join("blobs/sha256");
        for e in std::fs::read_dir(&dir).map_err(io_err(dir.display()))? {
            let e = e.map_err(io_err(dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !blobs.contains(&name) {
                freed += e.metadata().map_or(0, |m| m.len());
                std::fs::remove_file(e.path()).map_err(io_err(e.path().display()))?;
            }
        }
        let dir = self.dir.join("snapshots");
        for e in std::fs::read_dir(&dir).map_err(io_err(dir.display()))? {
            let e = e.map_err(io_err(dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let hex = name
                .strip_suffix(".size")
                .or_else(|| name.strip_suffix(".erofs"))
                .unwrap_or(&name);
            if chains.contains(hex) {
                continue;
            }
            if name.ends_with(".size") {
                let _ = std::fs::remove_file(e.path());
            } else if name.ends_with(".erofs") {
                freed += e.metadata().map_or(0, |m| m.len());
                std::fs::remove_file(e.path()).map_err(io_err(e.path().display()))?;
            } else {
                freed += unpack::remove_tree(&e.path())?;
            }
        }
        let dir = self.dir.join("tmp");
        for e in std::fs::read_dir(&dir).map_err(io_err(dir.display()))? {
            let e = e.map_err(io_err(dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let pid: Option<i32> = name.split('.').next().and_then(|p| p.parse().ok());
            // SAFETY: kill(2) with signal 0 only asks whether the process exists.
            let alive = pid.is_some_and(|p| unsafe { libc::kill(p, 0) } == 0);
            if !alive {
                freed += unpack::remove_tree(&e.path())?;
            }
        }
        Ok(freed)
    }
}

/// One blob being written: to a file in `tmp/`, hashed and counted as it goes, renamed to its
/// digest's name by [`BlobWriter::finish`] only when digest and size are right. Dropped
/// unfinished (an error, an interrupted pull), its file is removed.
pub(crate) struct BlobWriter<'a> {
    store: &'a Store,
    what: String,
    want: Option<(Digest, u64)>,
    tmp: PathBuf,
    file: File,
    hash: Sha256,
    n: u64,
}

impl<'a> BlobWriter<'a> {
    pub(crate) fn new(
        store: &'a Store,
        what: &str,
        want: Option<(&Digest, u64)>,
    ) -> Result<Self, StoreError> {
        let tmp = store.tmp("blob");
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err(tmp.display()))?;
        Ok(BlobWriter {
            store,
            what: what.to_string(),
            want: want.map(|(d, n)| (d.clone(), n)),
            tmp,
            file,
            hash: Sha256::new(),
            n: 0,
        })
    }

    pub(crate) fn written(&self) -> u64 {
        self.n
    }

    pub(crate) fn write(&mut self, buf: &[u8]) -> Result<(), StoreError> {
        self.n += buf.len() as u64;
        if let Some((_, size)) = &self.want {
            if self.n > *size {
                return Err(StoreError::SizeMismatch {
                    what: self.what.clone(),
                    want: *size,
                    got: self.n,
                });
            }
        }
        self.hash.update(buf);
        self.file.write_all(buf).map_err(io_err(self.tmp.display()))
    }

    pub(crate) fn finish(mut self) -> Result<(Digest, u64), StoreError> {
        let d = Digest::from_hasher(std::mem::take(&mut self.hash));
        if let Some((want_d, size)) = &self.want {
            if self.n != *size {
                return Err(StoreError::SizeMismatch {
                    what: self.what.clone(),
                    want: *size,
                    got: self.n,
                });
            }
            if &d != want_d {
                return Err(StoreError::DigestMismatch {
                    what: self.what.clone(),
                    want: want_d.to_string(),
                    got: d.to_string(),
                });
            }
        }
        self.file.sync_all().map_err(io_err(self.tmp.display()))?;
        let dest = self.store.blob(&d);
        if !dest.exists() {
            std::fs::rename(&self.tmp, &dest).map_err(io_err(dest.display()))?;
            self.store.note_added(dest);
        }
        Ok((d, self.n))
    }
}

impl Drop for BlobWriter<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// An index's linux/amd64 entry; none is [`StoreError::Platform`] naming `name` and the
/// platforms the index has.
pub(crate) fn linux_amd64<'i>(
    index: &'i oci_spec::image::ImageIndex,
    name: &str,
) -> Result<&'i oci_spec::image::Descriptor, StoreError> {
    let platforms = || {
        index
            .manifests()
            .iter()
            .filter_map(|m| m.platform().as_ref())
    };
    let is_it = |p: &oci_spec::image::Platform| {
        p.os().to_string() == "linux" && p.architecture().to_string() == "amd64"
    };
    if let Some(m) = index
        .manifests()
        .iter()
        .find(|m| m.platform().as_ref().is_some_and(is_it))
    {
        return Ok(m);
    }
    let have: Vec<String> = platforms()
        .map(|p| format!("{}/{}", p.os(), p.architecture()))
        .collect();
    Err(StoreError::Platform {
        name: name.to_string(),
        platform: if have.is_empty() {
            "no platform".into()
        } else {
            have.join(", ")
        },
    })
}

/// The largest manifest, index or config read (registries cap manifests at 4 MiB).
pub const MAX_CONFIG: u64 = 4 << 20;

fn parse_config(d: &Digest, raw: &[u8]) -> Result<oci_spec::image::ImageConfiguration, StoreError> {
    let cfg: oci_spec::image::ImageConfiguration =
        serde_json::from_slice(raw).map_err(|e| bad(format!("image config {d}"), e.to_string()))?;
    let os = cfg.os().to_string();
    let arch = cfg.architecture().to_string();
    if os != "linux" || arch != "amd64" {
        return Err(StoreError::Platform {
            name: d.to_string(),
            platform: format!("{os}/{arch}"),
        });
    }
    Ok(cfg)
}

/// The image's user as `uid:gid`, Docker's way: `UID`, `UID:GID`, `NAME`, `NAME:GROUP` (names
/// looked up in the root's own /etc/passwd and /etc/group, read without following a symlink
/// out of it); a user without a group takes its passwd entry's group, else 0. Also returns
/// the user's home directory from passwd, if it has one.
pub fn resolve_user(root: &Path, user: &str) -> Result<(u32, u32, Option<String>), StoreError> {
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read_in_root(root, "etc/passwd").unwrap_or_default();
    let entries: Vec<Vec<&str>> = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .filter(|f| f.len() >= 7)
        .collect();
    let entry = match u.parse::<u32>() {
        Ok(uid) => entries.iter().find(|f| f[2].parse() == Ok(uid)),
        Err(_) => entries.iter().find(|f| f[0] == u),
    };
    let uid = match (u.parse::<u32>(), entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(f)) => f[2]
            .parse()
            .map_err(|_| bad("the image's /etc/passwd", format!("a bad uid for {u}")))?,
        (Err(_), None) => {
            return Err(bad(
                format!("the image's user {user:?}"),
                format!("no user {u} in its /etc/passwd"),
            ))
        }
    };
    let gid = match g {
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                let group = read_in_root(root, "etc/group").unwrap_or_default();
                group
                    .lines()
                    .map(|l| l.split(':').collect::<Vec<_>>())
                    .find(|f| f.len() >= 3 && f[0] == g)
                    .and_then(|f| f[2].parse().ok())
                    .ok_or_else(|| {
                        bad(
                            format!("the image's user {user:?}"),
                            format!("no group {g} in its /etc/group"),
                        )
                    })?
            }
        },
        None => entry.and_then(|f| f[3].parse().ok()).unwrap_or(0),
    };
    let home = entry.map(|f| f[5].to_string()).filter(|h| !h.is_empty());
    Ok((uid, gid, home))
}

/// A small file of the root (at most 1 MiB), each component opened without following a
/// symlink; `None` when it is not there as a regular file.
fn read_in_root(root: &Path, rel: &str) -> Option<String> {
    let mut cur = File::open(root).ok()?;
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let c = std::ffi::CString::new(*part).ok()?;
        let flags = libc::O_RDONLY
            | libc::O_NOFOLLOW
            | libc::O_CLOEXEC
            | if last { 0 } else { libc::O_DIRECTORY };
        // SAFETY: openat(2) relative to a directory we hold, NUL-terminated name; checked.
        let fd = unsafe { libc::openat(cur.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just returned to us and nothing else owns it.
        cur = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    }
    if !cur.metadata().ok()?.is_file() {
        return None;
    }
    let mut s = String::new();
    cur.take(1 << 20).read_to_string(&mut s).ok()?;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_and_names() {
        assert!(Digest::parse("sha256:abc").is_err());
        assert!(Digest::parse(&format!("sha512:{}", "a".repeat(64))).is_err());
        assert!(Digest::parse(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(Digest::parse(&format!("sha256:../{}", "a".repeat(61))).is_err());
        let d = Digest::of(b"");
        assert_eq!(
            d.as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(d.short(), "e3b0c44298fc");
        assert_eq!(
            normalise("python:3.12-slim").unwrap(),
            "docker.io/library/python:3.12-slim"
        );
        assert_eq!(
            normalise("localhost/amvm-busybox").unwrap(),
            "localhost/amvm-busybox:latest"
        );
        assert_eq!(
            normalise("127.0.0.1:5000/a/b:v1").unwrap(),
            "127.0.0.1:5000/a/b:v1"
        );
        for n in [
            "python:3.12-slim",
            "python",
            "user/app",
            "localhost/amvm-busybox",
            "127.0.0.1:5000/a/b:v1",
            "127.0.0.1:5000/a/b",
            "quay.io/x/y@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        ] {
            assert_eq!(likely_names(n), vec![normalise(n).unwrap()], "{n}");
        }
        assert!(normalise("UPPER").is_err());
        assert!(normalise("").is_err());
    }

    /// A chain's EROFS image is made once from its root (then found, not made again), and
    /// prune removes it with the root once no image needs the chain.
    #[test]
    fn a_root_s_erofs_image_is_made_once_and_pruned_with_it() {
        let dir = std::env::temp_dir().join(format!("amvm-store-erofs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(&dir).unwrap();
        store.prepare().unwrap();
        let chain = Digest::of(b"a chain");
        let root = store.snapshot(&chain);
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/issue"), "hi\n").unwrap();
        let Some(image) = store.erofs_image(&chain).unwrap() else {
            panic!("mkfs.erofs is not installed (erofs-utils; images/setup installs it)");
        };
        assert_eq!(image, dir.join(format!("snapshots/{}.erofs", chain.hex())));
        assert!(crate::config::is_erofs(&image).unwrap());
        let made = std::fs::metadata(&image).unwrap().modified().unwrap();
        assert_eq!(store.erofs_image(&chain).unwrap(), Some(image.clone()));
        assert_eq!(std::fs::metadata(&image).unwrap().modified().unwrap(), made);
        assert_eq!(std::fs::read_dir(dir.join("tmp")).unwrap().count(), 0);
        // No image refers to the chain: prune takes the root and its EROFS image.
        assert!(store.prune().unwrap() > 0);
        assert!(!image.exists() && !root.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn users_resolve_in_the_image_s_own_files() {
        let dir = std::env::temp_dir().join(format!("amvm-store-user-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("etc")).unwrap();
        std::fs::write(
            dir.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1002::/home/app:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(dir.join("etc/group"), "root:x:0:\nstaff:x:50:\n").unwrap();
        let r = |u: &str| resolve_user(&dir, u);
        assert_eq!(r("app").unwrap(), (1001, 1002, Some("/home/app".into())));
        assert_eq!(
            r("app:staff").unwrap(),
            (1001, 50, Some("/home/app".into()))
        );
        assert_eq!(r("1001").unwrap(), (1001, 1002, Some("/home/app".into())));
        assert_eq!(r("4242").unwrap(), (4242, 0, None));
        assert_eq!(r("7:8").unwrap(), (7, 8, None));
        assert!(r("nobody")
            .unwrap_err()
            .to_string()
            .contains("no user nobody"));
        assert!(r("app:nogroup").is_err());
        // A symlinked /etc/passwd leading out of the root is not read.
        std::fs::remove_file(dir.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("etc/passwd")).unwrap();
        assert!(r("root").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
