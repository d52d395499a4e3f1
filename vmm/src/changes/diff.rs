//! `amvm changes FILE [--base DIR]`: a changes archive as a unified diff against DIR, in the
//! form `git diff --no-index` prints (binary files marked, not shown), so a person can read what
//! a sandbox changed before `amvm apply`ing it.
//!
//! Base files are read from DIR the way apply walks it (no symlink followed on the way); a
//! path that cannot be read that way counts as absent. Nothing is written anywhere.

use super::tar::{Kind, Reader, TarError};
use std::io::{self, Read, Write};
use std::path::Path;

/// Largest file (base or changed) shown as text; larger ones are described, not diffed.
const MAX_TEXT: u64 = 4 << 20;
/// Lines of context around each change.
const CONTEXT: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error("{0}: {1}")]
    Open(std::path::PathBuf, io::Error),
    #[error("{0}: {1}")]
    Archive(std::path::PathBuf, TarError),
    #[error("writing the diff: {0}")]
    Out(io::Error),
}

/// Print `archive` as a diff against `base` (or against nothing) to `out`.
pub fn print(archive: &Path, base: Option<&Path>, out: &mut dyn Write) -> Result<(), DiffError> {
    let f = std::fs::File::open(archive).map_err(|e| DiffError::Open(archive.to_owned(), e))?;
    let mut r = Reader::new(io::BufReader::new(f));
    let bad = |e| DiffError::Archive(archive.to_owned(), e);
    while let Some(e) = r.next_entry().map_err(bad)? {
        let path = String::from_utf8_lossy(&e.path)
            .trim_start_matches("./")
            .to_string();
        let name = path.rsplit('/').next().unwrap_or("");
        let old = |p: &str| base.and_then(|b| read_base(b, p));
        let w =
            |out: &mut dyn Write, s: String| out.write_all(s.as_bytes()).map_err(DiffError::Out);
        if name == ".wh..wh..opq" {
            let dir = path.trim_end_matches(".wh..wh..opq").trim_end_matches('/');
            w(
                out,
                format!("# {dir}/: replaced (what it held before is gone)\n"),
            )?;
            continue;
        }
        if let Some(gone) = name.strip_prefix(".wh.") {
            let dir = &path[..path.len() - name.len()];
            let p = format!("{dir}{gone}");
            match old(&p) {
                Some(Base::File(data, mode)) => w(out, file_diff(&p, Some((&data, mode)), None))?,
                Some(Base::Dir) => w(out, format!("# {p}/: deleted with all it held\n"))?,
                Some(Base::Link(t)) => w(out, file_diff(&p, Some((t.as_bytes(), 0o120000)), None))?,
                None => w(out, format!("# {p}: deleted\n"))?,
            }
            continue;
        }
        match e.kind {
            Kind::File => {
                let mut data = Vec::new();
                let mut reader = r.data(&e);
                let shown_size = e.size;
                (&mut reader)
                    .take(MAX_TEXT + 1)
                    .read_to_end(&mut data)
                    .map_err(|x| bad(x.into()))?;
                io::copy(&mut reader, &mut io::sink()).map_err(|x| bad(x.into()))?;
                if shown_size > MAX_TEXT {
                    w(
                        out,
                        format!("# {path}: {shown_size} bytes, too large to show\n"),
                    )?;
                    continue;
                }
                let before = match old(&path) {
                    Some(Base::File(d, m)) => Some((d, m)),
                    _ => None,
                };
                let text = file_diff(
                    &path,
                    before.as_ref().map(|(d, m)| (d.as_slice(), *m)),
                    Some((&data, 0o100000 | e.mode)),
                );
                w(out, text)?;
            }
            Kind::Symlink => {
                let before = match old(&path) {
                    Some(Base::Link(t)) => Some(t),
                    _ => None,
                };
                let target = String::from_utf8_lossy(&e.link).into_owned();
                if before.as_deref() != Some(target.as_str()) {
                    let b = before.map(|t| t.into_bytes());
                    w(
                        out,
                        file_diff(
                            &path,
                            b.as_deref().map(|t| (t, 0o120000)),
                            Some((target.as_bytes(), 0o120000)),
                        ),
                    )?;
                }
            }
            Kind::HardLink => w(
                out,
                format!(
                    "# {path}: a hard link to {}\n",
                    String::from_utf8_lossy(&e.link)
                ),
            )?,
            Kind::Directory => {}
            _ => w(out, format!("# {path}: an entry amvm apply refuses\n"))?,
        }
    }
    Ok(())
}

enum Base {
    File(Vec<u8>, u32),
    Dir,
    Link(String),
}

/// What `rel` is in `base`, reached without following symlinks on the way.
fn read_base(base: &Path, rel: &str) -> Option<Base> {
    let mut p = base.to_path_buf();
    let parts: Vec<&str> = rel
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if parts.contains(&"..") {
        return None;
    }
    for (i, c) in parts.iter().enumerate() {
        p.push(c);
        let m = std::fs::symlink_metadata(&p).ok()?;
        if i + 1 < parts.len() && !m.is_dir() {
            return None;
        }
        if i + 1 == parts.len() {
            use std::os::unix::fs::PermissionsExt;
            if m.file_type().is_symlink() {
                return Some(Base::Link(
                    std::fs::read_link(&p).ok()?.to_string_lossy().into_owned(),
                ));
            }
            if m.is_dir() {
                return Some(Base::Dir);
            }
            if m.is_file() && m.len() <= MAX_TEXT {
                return Some(Base::File(
                    std::fs::read(&p).ok()?,
                    0o100000 | (m.permissions().mode() & 0o777),
                ));
            }
            return None;
        }
    }
    None
}

fn is_binary(d: &[u8]) -> bool {
    d[..d.len().min(8000)].contains(&0)
}

/// One file's diff: `old`/`new` as (contents, git mode), `None` for absent.
fn file_diff(path: &str, old: Option<(&[u8], u32)>, new: Option<(&[u8], u32)>) -> String {
    let mut s = format!("diff --git a/{path} b/{path}\n");
    match (old, new) {
        (None, Some((_, m))) => s.push_str(&format!("new file mode {m:o}\n")),
        (Some((_, m)), None) => s.push_str(&format!("deleted file mode {m:o}\n")),
        (Some((_, a)), Some((_, b))) if a != b => {
            s.push_str(&format!("old mode {a:o}\nnew mode {b:o}\n"))
        }
        _ => {}
    }
    let (a, b) = (old.map_or(&[][..], |o| o.0), new.map_or(&[][..], |n| n.0));
    if a == b {
        return if old.is_some() && new.is_some() && old.map(|o| o.1) == new.map(|n| n.1) {
            String::new()
        } else {
            s
        };
    }
    let (from, to) = (
        if old.is_some() {
            format!("a/{path}")
        } else {
            "/dev/null".into()
        },
        if new.is_some() {
            format!("b/{path}")
        } else {
            "/dev/null".into()
        },
    );
    if is_binary(a) || is_binary(b) {
        s.push_str(&format!("Binary files {from} and {to} differ\n"));
        return s;
    }
    s.push_str(&format!("--- {from}\n+++ {to}\n"));
    let (a, b) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    let al: Vec<&str> = a.split_inclusive('\n').collect();
    let bl: Vec<&str> = b.split_inclusive('\n').collect();
    s.push_str(&unified(&al, &bl));
    s
}

/// The edit script of `a` into `b` (Myers' greedy algorithm): equal, delete, insert, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq(usize, usize),
    Del(usize),
    Ins(usize),
}

fn edit_script(a: &[&str], b: &[&str]) -> Vec<Op> {
    let (n, m) = (a.len() as isize, b.len() as isize);
    let max = (n + m) as usize;
    let off = max as isize + 1;
    let mut v = vec![0isize; 2 * max + 3];
    let mut trace: Vec<Vec<isize>> = Vec::new();
    'outer: for d in 0..=max as isize {
        trace.push(v.clone());
        let mut k = -d;
        while k <= d {
            let idx = (k + off) as usize;
            let mut x = if k == -d || (k != d && v[idx - 1] < v[idx + 1]) {
                v[idx + 1]
            } else {
                v[idx - 1] + 1
            };
            let mut y = x - k;
            while x < n && y < m && a[x as usize] == b[y as usize] {
                x += 1;
                y += 1;
            }
            v[idx] = x;
            if x >= n && y >= m {
                trace.push(v.clone());
                break 'outer;
            }
            k += 2;
        }
    }
    // Walk the trace back from (n, m).
    let mut ops = Vec::new();
    let (mut x, mut y) = (n, m);
    for d in (1..trace.len() as isize - 1).rev() {
        let v = &trace[d as usize];
        let k = x - y;
        let idx = (k + off) as usize;
        let prev_k = if k == -d || (k != d && v[idx - 1] < v[idx + 1]) {
            k + 1
        } else {
            k - 1
        };
        let prev_x = v[(prev_k + off) as usize];
        let prev_y = prev_x - prev_k;
        while x > prev_x && y > prev_y {
            x -= 1;
            y -= 1;
            ops.push(Op::Eq(x as usize, y as usize));
        }
        if x == prev_x {
            y -= 1;
            ops.push(Op::Ins(y as usize));
        } else {
            x -= 1;
            ops.push(Op::Del(x as usize));
        }
    }
    while x > 0 && y > 0 {
        x -= 1;
        y -= 1;
        ops.push(Op::Eq(x as usize, y as usize));
    }
    ops.reverse();
    ops
}

/// Hunks with [`CONTEXT`] lines around each change, as `diff -u` prints them.
fn unified(a: &[&str], b: &[&str]) -> String {
    let ops = edit_script(a, b);
    let changed: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| !matches!(o, Op::Eq(..)))
        .map(|(i, _)| i)
        .collect();
    let mut out = String::new();
    let mut i = 0;
    while i < changed.len() {
        let start = changed[i].saturating_sub(CONTEXT);
        let mut end = changed[i];
        while i < changed.len() && changed[i] <= end + 2 * CONTEXT {
            end = changed[i];
            i += 1;
        }
        let end = (end + CONTEXT + 1).min(ops.len());
        let hunk = &ops[start..end];
        // Line numbers where the hunk starts in a and b (1-based; 0 for an empty side).
        let (mut a0, mut b0) = (0usize, 0usize);
        for o in &ops[..start] {
            match o {
                Op::Eq(..) => {
                    a0 += 1;
                    b0 += 1;
                }
                Op::Del(_) => a0 += 1,
                Op::Ins(_) => b0 += 1,
            }
        }
        let alen = hunk.iter().filter(|o| !matches!(o, Op::Ins(_))).count();
        let blen = hunk.iter().filter(|o| !matches!(o, Op::Del(_))).count();
        let at = |start: usize, len: usize| if len == 0 { start } else { start + 1 };
        out.push_str(&format!(
            "@@ -{},{alen} +{},{blen} @@\n",
            at(a0, alen),
            at(b0, blen)
        ));
        for o in hunk {
            let (sign, line) = match *o {
                Op::Eq(x, _) => (' ', a[x]),
                Op::Del(x) => ('-', a[x]),
                Op::Ins(y) => ('+', b[y]),
            };
            out.push(sign);
            out.push_str(line);
            if !line.ends_with('\n') {
                out.push_str("\n\\ No newline at end of file\n");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<&str> {
        s.split_inclusive('\n').collect()
    }

    /// Applying the script to `a` gives `b`, for every pair of small inputs.
    #[test]
    fn the_edit_script_turns_a_into_b() {
        let words = ["x\n", "y\n", "z\n"];
        let mut cases: Vec<Vec<&str>> = vec![vec![]];
        for len in 1..=4 {
            for i in 0..3usize.pow(len) {
                let mut v = Vec::new();
                let mut n = i;
                for _ in 0..len {
                    v.push(words[n % 3]);
                    n /= 3;
                }
                cases.push(v);
            }
        }
        for a in &cases {
            for b in &cases {
                let ops = edit_script(a, b);
                let mut got = Vec::new();
                for o in &ops {
                    match *o {
                        Op::Eq(x, y) => {
                            assert_eq!(a[x], b[y]);
                            got.push(b[y]);
                        }
                        Op::Ins(y) => got.push(b[y]),
                        Op::Del(_) => {}
                    }
                }
                assert_eq!(&got, b, "{a:?} -> {b:?}: {ops:?}");
                let dels = ops.iter().filter(|o| matches!(o, Op::Del(_))).count();
                assert_eq!(
                    a.len() - dels,
                    ops.iter().filter(|o| matches!(o, Op::Eq(..))).count()
                );
            }
        }
    }

    #[test]
    fn hunks_look_like_diff_u() {
        let a = "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n";
        let b = "1\n2\n3\n4\nfive\n6\n7\n8\n9\n10\n";
        assert_eq!(
            unified(&lines(a), &lines(b)),
            "@@ -2,7 +2,7 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n"
        );
        assert_eq!(unified(&[], &lines("new\n")), "@@ -0,0 +1,1 @@\n+new\n");
        assert_eq!(
            unified(&lines("a\nb"), &lines("a\nc")),
            "@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n"
        );
    }

    #[test]
    fn a_file_diff_has_git_headers_and_marks_binaries() {
        let d = file_diff(
            "src/a.rs",
            Some((b"old\n", 0o100644)),
            Some((b"new\n", 0o100755)),
        );
        assert_eq!(
            d,
            "diff --git a/src/a.rs b/src/a.rs\nold mode 100644\nnew mode 100755\n--- a/src/a.rs\n+++ b/src/a.rs\n@@ -1,1 +1,1 @@\n-old\n+new\n"
        );
        let d = file_diff("img", None, Some((b"\x89PNG\0\0", 0o100644)));
        assert!(
            d.ends_with("Binary files /dev/null and b/img differ\n"),
            "{d}"
        );
        let d = file_diff("gone", Some((b"x\n", 0o100644)), None);
        assert!(
            d.contains("deleted file mode 100644\n--- a/gone\n+++ /dev/null\n"),
            "{d}"
        );
        assert_eq!(
            file_diff("same", Some((b"x", 0o100644)), Some((b"x", 0o100644))),
            ""
        );
    }
}
