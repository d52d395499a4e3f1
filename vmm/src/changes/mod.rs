//! Changes made in a sandbox, as a tar in OCI image-layer form (whiteouts for deletions,
//! opaque directories): made from an overlayfs upper directory ([`layer`]) and applied to a
//! host directory safely ([`apply`]), or shown as a diff first ([`diff`]).

pub mod apply;
pub mod diff;
pub mod layer;
pub mod tar;

/// Every path below `root` with what it is (`dir MODE`, `-> TARGET`, or a file's `MODE` and its
/// contents, or with `contents` false its length), sorted by path: for comparing trees in tests.
#[cfg(test)]
fn tree(root: &std::path::Path, contents: bool) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                stack.push(p.clone());
                format!("dir {:o}", m.mode() & 0o7777)
            } else if contents {
                let data = std::fs::read(&p).unwrap();
                format!("{:o} {}", m.mode() & 0o7777, String::from_utf8_lossy(&data))
            } else {
                format!("{:o} {:?}", m.mode() & 0o7777, m.len())
            };
            out.push((rel.clone(), format!("{rel}: {what}")));
        }
    }
    out.sort();
    out.into_iter().map(|x| x.1).collect()
}
