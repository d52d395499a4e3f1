//! Built system images: unpacked root filesystems that `--system NAME` selects by name.
//!
//! An image is a directory `IMAGES/NAME/` holding `rootfs/` (what `--system DIR` takes) and
//! `image.json` (what its recipe recorded: versions, size, when). `IMAGES` is
//! `$AMVM_CACHE/images` (default `~/.cache/amvm/images`). Recipes live in the source tree
//! (`images/harness/build` builds `harness`); amvm itself only finds, lists and removes images.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("no image directory: set AMVM_CACHE or HOME")]
    NoDir,
    #[error("{0:?} is not an image name (letters, digits, '.', '_', '-'; not starting with '.')")]
    BadName(String),
    #[error("no image named {name} in {dir} ({built}); build it with images/{name}/build, or give a directory as ./{name}")]
    NotFound {
        name: String,
        dir: PathBuf,
        built: String,
    },
    #[error("image {0}: {1}")]
    Io(String, String),
}

/// One built image, as `image.json` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub name: String,
    pub rootfs: PathBuf,
    /// `image.json`'s `built` (an RFC 3339 time), if it has one.
    pub built: Option<String>,
    /// `image.json`'s `size_bytes`, if it has one.
    pub size_bytes: Option<u64>,
    /// `image.json`'s `versions` line (what is in it), if it has one.
    pub versions: Option<String>,
}

/// Where images live: `$AMVM_CACHE/images`, default `~/.cache/amvm/images`.
pub fn images_dir() -> Result<PathBuf, ImageError> {
    Ok(crate::config::cache_dir()
        .ok_or(ImageError::NoDir)?
        .join("images"))
}

/// A name is one path component of a safe alphabet: it can never leave the images directory.
pub fn check_name(name: &str) -> Result<(), ImageError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ImageError::BadName(name.to_string()))
    }
}

/// Whether `--system VALUE` names an image rather than a directory: a bare word, no `/`.
pub fn is_name(value: &str) -> bool {
    !value.contains('/') && !value.starts_with('.') && value != "host"
}

/// The built image `name` in `dir`. An image is built once `image.json` is in place: the
/// recipes write it last, into a directory renamed into place, so a half-built one never counts.
pub fn find(dir: &Path, name: &str) -> Result<Image, ImageError> {
    check_name(name)?;
    let base = dir.join(name);
    match std::fs::read_to_string(base.join("image.json")) {
        Ok(meta) => Ok(parse(name, &base, &meta)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ImageError::NotFound {
            name: name.to_string(),
            dir: dir.to_owned(),
            built: match list(dir) {
                Ok(l) if !l.is_empty() => {
                    let names: Vec<_> = l.iter().map(|i| i.name.as_str()).collect();
                    format!("built: {}", names.join(", "))
                }
                _ => "none built".to_string(),
            },
        }),
        Err(e) => Err(ImageError::Io(name.to_string(), e.to_string())),
    }
}

/// Every built image in `dir`, by name. A missing directory is an empty list.
pub fn list(dir: &Path) -> Result<Vec<Image>, ImageError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ImageError::Io(dir.display().to_string(), e.to_string())),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if check_name(&name).is_err() {
            continue; // the recipes' temporary and removal directories start with '.'
        }
        if let Ok(meta) = std::fs::read_to_string(entry.path().join("image.json")) {
            out.push(parse(&name, &entry.path(), &meta));
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Remove the image `name`: first renamed aside (so it stops being listed or found at once, and
/// an interrupted removal leaves no half image behind a valid name), then deleted.
pub fn remove(dir: &Path, name: &str) -> Result<(), ImageError> {
    let image = find(dir, name)?;
    let base = image.rootfs.parent().unwrap_or(dir).to_owned();
    let aside = dir.join(format!(".rm-{name}-{}", std::process::id()));
    let io = |e: std::io::Error| ImageError::Io(name.to_string(), e.to_string());
    std::fs::rename(&base, &aside).map_err(io)?;
    // remove_dir_all does not follow symbolic links: a rootfs full of absolute links is safe.
    std::fs::remove_dir_all(&aside).map_err(io)
}

fn parse(name: &str, base: &Path, meta: &str) -> Image {
    Image {
        name: name.to_string(),
        rootfs: base.join("rootfs"),
        built: json_field(meta, "built"),
        size_bytes: json_field(meta, "size_bytes").and_then(|s| s.parse().ok()),
        versions: json_field(meta, "versions"),
    }
}

/// A top-level string or number field of the flat JSON object the recipes write. Not a JSON
/// parser: image.json is amvm's own file (a recipe's), and a field it cannot read is just absent.
fn json_field(text: &str, key: &str) -> Option<String> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    if let Some(s) = rest.strip_prefix('"') {
        let end = s.find('"')?;
        Some(s[..end].to_string())
    } else {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        (end > 0).then(|| rest[..end].to_string())
    }
}

/// `1.5 GiB`, `230 MiB`, `12 KiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 || v >= 10.0 {
        format!("{v:.0} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(dir: &Path, name: &str, meta: &str) {
        std::fs::create_dir_all(dir.join(name).join("rootfs/usr/bin")).unwrap();
        std::fs::write(dir.join(name).join("image.json"), meta).unwrap();
    }

    #[test]
    fn names_cannot_leave_the_directory() {
        for bad in ["", ".", "..", ".hidden", "a/b", "a b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["harness", "harness-2", "deb_13.1"] {
            check_name(good).unwrap();
        }
        assert!(is_name("harness"));
        assert!(!is_name("host") && !is_name("./harness") && !is_name("/srv/root"));
    }

    #[test]
    fn images_are_found_listed_and_removed() {
        let tmp = std::env::temp_dir().join(format!("amvm-image-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        assert_eq!(list(&tmp).unwrap(), vec![]);
        let e = find(&tmp, "harness").unwrap_err().to_string();
        assert!(
            e.contains("no image named harness") && e.contains("none built"),
            "{e}"
        );

        make(
            &tmp,
            "harness",
            "{\n  \"name\": \"harness\",\n  \"built\": \"2026-12-01T12:00:00Z\",\n  \"size_bytes\": 734003200,\n  \"versions\": \"node 20.19.2\"\n}\n",
        );
        make(&tmp, "b", "{}");
        // Half-built (no image.json) and hidden directories are not images.
        std::fs::create_dir_all(tmp.join("half/rootfs")).unwrap();
        std::fs::create_dir_all(tmp.join(".harness.tmp-1/rootfs")).unwrap();

        let all = list(&tmp).unwrap();
        let names: Vec<_> = all.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["b", "harness"]);
        let h = find(&tmp, "harness").unwrap();
        assert_eq!(h.rootfs, tmp.join("harness/rootfs"));
        assert_eq!(h.built.as_deref(), Some("2026-12-01T12:00:00Z"));
        assert_eq!(h.size_bytes, Some(734_003_200));
        assert_eq!(h.versions.as_deref(), Some("node 20.19.2"));
        assert_eq!(find(&tmp, "b").unwrap().size_bytes, None);
        let e = find(&tmp, "half").unwrap_err().to_string();
        assert!(e.contains("built: b, harness"), "{e}");

        remove(&tmp, "harness").unwrap();
        assert!(!tmp.join("harness").exists());
        assert!(find(&tmp, "harness").is_err());
        assert!(remove(&tmp, "harness").is_err());
        assert!(remove(&tmp, "../x").is_err());
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(734_003_200), "700 MiB");
        assert_eq!(human_size(3 << 30), "3.0 GiB");
    }
}
