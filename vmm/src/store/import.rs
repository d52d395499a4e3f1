//! `amvm image import FILE|DIR`: `docker save` / `podman save` archives (docker-archive and
//! oci-archive, plain or gzip/zstd-compressed) and OCI image layouts (directories).
//!
//! An archive is first unpacked into the store's `tmp/` by the changes code (so an entry that
//! would reach outside it is refused and nothing is imported), then read as a directory:
//!
//! * an OCI image layout (`index.json`, `blobs/sha256/...`): every manifest it lists, an
//!   index resolved to its linux/amd64 manifest; each blob checked against its descriptor's
//!   digest and size as it is copied into the store. Names from the `io.containerd.image.name`
//!   annotation, else `org.opencontainers.image.ref.name` when it is a whole name.
//! * a `docker save` directory (`manifest.json`): each entry's config and layers (paths in
//!   the archive) stored under their digests; the layers are checked against the config's
//!   diff ids when unpacked. Names from `RepoTags`.
//!
//! `--name` names an image that has no name (or replaces the archive's).

use super::unpack::{decompress, sniff, Compression};
use super::{bad, io_err, normalise, Digest, Record, Store, StoreError, MAX_CONFIG};
use crate::changes::apply::{self, Options};
use oci_spec::image::{Descriptor, ImageIndex, ImageManifest, MediaType};
use std::fs::File;
use std::path::{Path, PathBuf};

const ANNOTATION_NAME: &str = "io.containerd.image.name";
const ANNOTATION_REF: &str = "org.opencontainers.image.ref.name";

/// Import `path`; each image's records (one per name).
pub fn import(
    store: &Store,
    path: &Path,
    name: Option<&str>,
    say: &mut dyn FnMut(String),
) -> Result<Vec<Record>, StoreError> {
    let name = name.map(normalise).transpose()?;
    let _lock = store.lock(false)?;
    let result = import_locked(store, path, name.as_deref(), say);
    if result.is_err() {
        store.undo();
    }
    result
}

fn import_locked(
    store: &Store,
    path: &Path,
    name: Option<&str>,
    say: &mut dyn FnMut(String),
) -> Result<Vec<Record>, StoreError> {
    let md = std::fs::metadata(path).map_err(io_err(path.display()))?;
    let source = format!(
        "import {}",
        std::path::absolute(path)
            .unwrap_or_else(|_| path.to_path_buf())
            .display()
    );
    if md.is_dir() {
        return import_dir(store, path, name, &source, say);
    }
    let staging = store.tmp("archive");
    let tar = store.tmp("archive.tar");
    let result = (|| {
        let archive = match sniff(path)? {
            Compression::None => path.to_path_buf(),
            _ => {
                decompress(path, &tar)?;
                tar.clone()
            }
        };
        std::fs::create_dir(&staging).map_err(io_err(staging.display()))?;
        let mut refused = Vec::new();
        apply::apply(&archive, &staging, Options::default(), &mut |l| {
            refused.push(l)
        })
        .map_err(|e| {
            bad(
                path.display().to_string(),
                format!("not an image archive: {e}{}", first_line(&refused)),
            )
        })?;
        import_dir(store, &staging, name, &source, say)
    })();
    let _ = std::fs::remove_file(&tar);
    let _ = super::unpack::remove_tree(&staging);
    result
}

fn first_line(lines: &[String]) -> String {
    lines.first().map_or(String::new(), |l| format!(" ({l})"))
}

fn import_dir(
    store: &Store,
    dir: &Path,
    name: Option<&str>,
    source: &str,
    say: &mut dyn FnMut(String),
) -> Result<Vec<Record>, StoreError> {
    if dir.join("index.json").is_file() {
        oci_layout(store, dir, name, source, say)
    } else if dir.join("manifest.json").is_file() {
        docker_dir(store, dir, name, source, say)
    } else {
        Err(bad(
            dir.display().to_string(),
            "neither an OCI image layout (index.json) nor a docker save archive (manifest.json)",
        ))
    }
}

/// A layout's blob for a descriptor, checked and stored.
fn put(store: &Store, dir: &Path, d: &Descriptor) -> Result<Digest, StoreError> {
    let digest =
        Digest::parse(d.digest().as_ref()).map_err(|why| bad(dir.display().to_string(), why))?;
    let p = dir.join("blobs/sha256").join(digest.hex());
    let mut f = File::open(&p).map_err(io_err(p.display()))?;
    let (got, _) = store.put_blob(&format!("blob {digest}"), &mut f, Some((&digest, d.size())))?;
    Ok(got)
}

fn is_index(m: &MediaType) -> bool {
    matches!(m, MediaType::ImageIndex)
        || m.to_string() == "application/vnd.docker.distribution.manifest.list.v2+json"
}

fn oci_layout(
    store: &Store,
    dir: &Path,
    name: Option<&str>,
    source: &str,
    say: &mut dyn FnMut(String),
) -> Result<Vec<Record>, StoreError> {
    let p = dir.join("index.json");
    let raw = read_small(&p)?;
    let index: ImageIndex =
        serde_json::from_slice(&raw).map_err(|e| bad(p.display().to_string(), e.to_string()))?;
    // (descriptor of a manifest, its names)
    let mut found: Vec<(Descriptor, Vec<String>)> = Vec::new();
    for d in index.manifests() {
        let names = names_of(d);
        let m = if is_index(d.media_type()) {
            resolve_index(store, dir, d)?
        } else {
            d.clone()
        };
        found.push((m, names));
    }
    if found.is_empty() {
        return Err(bad(p.display().to_string(), "lists no image"));
    }
    if name.is_some() && found.len() > 1 {
        return Err(bad(
            dir.display().to_string(),
            format!("holds {} images; --name names one", found.len()),
        ));
    }
    let mut out = Vec::new();
    for (m, mut names) in found {
        if let Some(n) = name {
            names = vec![n.to_string()];
        }
        if names.is_empty() {
            return Err(bad(
                dir.display().to_string(),
                format!("image {} has no name; give one with --name", m.digest()),
            ));
        }
        let md = put(store, dir, &m)?;
        let raw = store.read_blob(&md, MAX_CONFIG)?;
        let manifest: ImageManifest = serde_json::from_slice(&raw)
            .map_err(|e| bad(format!("manifest {md}"), e.to_string()))?;
        let config = put(store, dir, manifest.config())?;
        let layers = manifest
            .layers()
            .iter()
            .map(|l| put(store, dir, l))
            .collect::<Result<Vec<_>, _>>()?;
        out.extend(store.add(&names, &config, Some(&md), &layers, source, say)?);
    }
    Ok(out)
}

/// An index's linux/amd64 manifest (an index within an index followed once more).
fn resolve_index(store: &Store, dir: &Path, d: &Descriptor) -> Result<Descriptor, StoreError> {
    let mut d = d.clone();
    for _ in 0..2 {
        let digest = put(store, dir, &d)?;
        let raw = store.read_blob(&digest, MAX_CONFIG)?;
        let index: ImageIndex = serde_json::from_slice(&raw)
            .map_err(|e| bad(format!("index {digest}"), e.to_string()))?;
        let pick = super::linux_amd64(&index, &format!("index {digest}"))?;
        if !is_index(pick.media_type()) {
            return Ok(pick.clone());
        }
        d = pick.clone();
    }
    Err(bad(
        format!("index {}", d.digest()),
        "indexes nested too deep",
    ))
}

/// The names a layout gives a manifest: a whole name in its annotations.
fn names_of(d: &Descriptor) -> Vec<String> {
    let Some(a) = d.annotations() else {
        return Vec::new();
    };
    for key in [ANNOTATION_NAME, ANNOTATION_REF] {
        if let Some(v) = a.get(key) {
            // A bare tag (`latest`, as `skopeo copy oci:DIR:TAG` writes) is not a name.
            if v.contains('/') || v.contains(':') {
                if let Ok(n) = normalise(v) {
                    return vec![n];
                }
            }
        }
    }
    Vec::new()
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

fn docker_dir(
    store: &Store,
    dir: &Path,
    name: Option<&str>,
    source: &str,
    say: &mut dyn FnMut(String),
) -> Result<Vec<Record>, StoreError> {
    let p = dir.join("manifest.json");
    let raw = read_small(&p)?;
    let entries: Vec<DockerEntry> =
        serde_json::from_slice(&raw).map_err(|e| bad(p.display().to_string(), e.to_string()))?;
    if entries.is_empty() {
        return Err(bad(p.display().to_string(), "lists no image"));
    }
    if name.is_some() && entries.len() > 1 {
        return Err(bad(
            dir.display().to_string(),
            format!("holds {} images; --name names one", entries.len()),
        ));
    }
    let mut out = Vec::new();
    for e in entries {
        let names = match name {
            Some(n) => vec![n.to_string()],
            None => e
                .repo_tags
                .unwrap_or_default()
                .iter()
                .map(|t| normalise(t))
                .collect::<Result<Vec<_>, _>>()?,
        };
        if names.is_empty() {
            return Err(bad(
                dir.display().to_string(),
                format!("image {} has no name; give one with --name", e.config),
            ));
        }
        let put_file = |rel: &str| -> Result<Digest, StoreError> {
            let p = inside(dir, rel)?;
            let mut f = File::open(&p).map_err(io_err(p.display()))?;
            Ok(store.put_blob(rel, &mut f, None)?.0)
        };
        let config = put_file(&e.config)?;
        let layers = e
            .layers
            .iter()
            .map(|l| put_file(l))
            .collect::<Result<Vec<_>, _>>()?;
        out.extend(store.add(&names, &config, None, &layers, source, say)?);
    }
    Ok(out)
}

/// A path the archive names, kept inside it: relative, no `..`.
fn inside(dir: &Path, rel: &str) -> Result<PathBuf, StoreError> {
    let p = Path::new(rel);
    if p.is_absolute()
        || p.components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(bad(
            dir.join("manifest.json").display().to_string(),
            format!("names {rel:?}, not a path inside the archive"),
        ));
    }
    Ok(dir.join(p))
}

fn read_small(p: &Path) -> Result<Vec<u8>, StoreError> {
    use std::io::Read;
    let mut v = Vec::new();
    File::open(p)
        .and_then(|f| f.take(MAX_CONFIG + 1).read_to_end(&mut v))
        .map_err(io_err(p.display()))?;
    if v.len() as u64 > MAX_CONFIG {
        return Err(bad(
            p.display().to_string(),
            format!("larger than {MAX_CONFIG} bytes"),
        ));
    }
    Ok(v)
}
