//! `amvm cp`: files and trees into and out of a sandbox, as tar streams over an exec of the
//! guest's own `tar` (as the sandbox's user, so it reaches what that user may: /tmp, $HOME, a
//! writable workspace).
//!
//! In: the host's `tar` packs HOSTPATH (read with the caller's permissions), the stream goes
//! to the exec's stdin, the guest's `tar` unpacks it. Out: the guest's `tar` packs GUESTPATH
//! and the host unpacks it with `amvm apply`'s reader (changes/apply.rs), because what the guest
//! sends is hostile: nothing lands outside the destination, symlinks that leave it and device
//! nodes are refused, setuid bits dropped; a refused entry stops the copy before anything
//! changes. Docker's rules for where things land: into DEST when it is an existing directory,
//! else as DEST itself (whose parent must exist).

use super::api::ExecRequest;
use super::client::{Event, Sandbox};
use super::SandboxError;
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Unpack stdin (a tar) at $1; as $1/$2's basename when $1 is not an existing directory.
const UNPACK: &str = r#"dst=$1 name=$2
if [ -d "$dst" ]; then exec tar -x -f - -C "$dst"; fi
if [ -z "$name" ]; then echo "$dst: no such directory" >&2; exit 1; fi
parent=$(dirname -- "$dst")
if [ ! -d "$parent" ]; then echo "$parent: no such directory" >&2; exit 1; fi
tmp=$(mktemp -d "$parent/.amvm-cp.XXXXXX") || exit 1
tar -x -f - -C "$tmp" && mv -T -- "$tmp/$name" "$dst"; rc=$?
rm -rf -- "$tmp"; exit $rc"#;

/// Pack $1 (its basename, from its directory) to stdout; status 44 when $1 is not there. Also
/// the API's `GET /v1/archive`.
pub(crate) const PACK: &str = r#"[ -e "$1" ] || [ -L "$1" ] || { echo "$1: no such file or directory" >&2; exit 44; }
cd -- "$(dirname -- "$1")" && exec tar -c -f - -- "$(basename -- "$1")""#;

fn cp_err(what: impl std::fmt::Display) -> SandboxError {
    SandboxError::Copy(what.to_string())
}

fn guest_path(p: &str) -> Result<&str, SandboxError> {
    check_guest_path(p).map_err(|e| cp_err(format!("{p}: {e}")))?;
    Ok(p)
}

/// An exec of `sh -c SCRIPT` with `args` as $1..., from /, as the sandbox's user: how `cp` and
/// the API's archives run the guest's `tar`.
pub(crate) fn script_exec(script: &str, args: &[&str], stdin: bool) -> ExecRequest {
    let mut argv: Vec<super::api::Arg> =
        vec!["sh".into(), "-c".into(), script.into(), "amvm-cp".into()];
    argv.extend(args.iter().map(|&a| a.into()));
    ExecRequest {
        argv,
        env: vec![],
        workdir: Some("/".into()),
        user: None,
        stdin,
        tty: None,
        clear_env: false,
        capabilities: None,
        groups: vec![],
        rlimits: vec![],
        root: None,
    }
}

/// A path in the sandbox, as `cp` and the API's archives take it: absolute, without `..`.
pub(crate) fn check_guest_path(p: &str) -> Result<(), &'static str> {
    if !p.starts_with('/') {
        return Err("a path in the sandbox must be absolute");
    }
    if p.split('/').any(|c| c == "..") {
        return Err("a `..` component");
    }
    Ok(())
}

impl Sandbox {
    fn cp_exec(
        &self,
        script: &str,
        args: &[&str],
        stdin: bool,
    ) -> Result<super::client::ExecStream, SandboxError> {
        self.exec(&script_exec(script, args, stdin))
    }

    /// Copy host file or tree `src` to `dest` in the sandbox (`src` `None`: a tar from
    /// `tar_in` is unpacked into the directory `dest`).
    pub fn copy_in(
        &self,
        src: Option<&Path>,
        tar_in: Option<Box<dyn Read + Send>>,
        dest: &str,
    ) -> Result<(), SandboxError> {
        let dest = guest_path(dest)?;
        let (mut reader, name, mut child): (
            Box<dyn Read + Send>,
            String,
            Option<std::process::Child>,
        ) = match src {
            Some(src) => {
                std::fs::symlink_metadata(src)
                    .map_err(|e| cp_err(format!("{}: {e}", src.display())))?;
                let abs = std::path::absolute(src)
                    .map_err(|e| cp_err(format!("{}: {e}", src.display())))?;
                let name = abs.file_name().ok_or_else(|| {
                    cp_err(format!("{}: name a file or directory", src.display()))
                })?;
                let name_s = name
                    .to_str()
                    .ok_or_else(|| cp_err(format!("{}: the name is not UTF-8", src.display())))?
                    .to_string();
                let parent = abs.parent().unwrap_or(Path::new("/"));
                let mut tar = std::process::Command::new("tar")
                    .arg("-c")
                    .arg("-f")
                    .arg("-")
                    .arg("-C")
                    .arg(parent)
                    .arg("--")
                    .arg(name)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .map_err(|e| cp_err(format!("running the host's tar: {e}")))?;
                let out = tar.stdout.take().expect("piped");
                (Box::new(out), name_s, Some(tar))
            }
            None => (
                tar_in.expect("a tar stream without a source"),
                String::new(),
                None,
            ),
        };
        let mut stream = self.cp_exec(UNPACK, &[dest, &name], true)?;
        let tx = stream.sender();
        let feeder = std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match reader.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                if tx.stdin(&buf[..n]).is_err() {
                    return Ok(());
                }
            }
            tx.stdin_end()
        });
        let mut errs = Vec::new();
        let status = loop {
            match stream.next_event()? {
                Some(Event::Stderr(b)) => errs.extend_from_slice(&b),
                Some(Event::Stdout(_)) => {}
                Some(Event::Exit(c)) => break c,
                None => unreachable!("next_event() errs at a stream without Exit"),
            }
        };
        let fed = feeder.join().unwrap_or(Ok(()));
        // The guest's side failing is the cause (the host's tar then fails too, writing into a
        // stream nobody reads): say why it failed.
        if status != 0 {
            if let Some(mut tar) = child.take() {
                let _ = tar.kill();
                let _ = tar.wait();
            }
            return Err(cp_err(format!(
                "{}:{dest}: {}",
                self.shown(),
                first_line(&errs)
            )));
        }
        if let Some(mut tar) = child.take() {
            let mut e = String::new();
            if let Some(mut se) = tar.stderr.take() {
                let _ = se.read_to_string(&mut e);
            }
            let st = tar
                .wait()
                .map_err(|e| cp_err(format!("the host's tar: {e}")))?;
            if !st.success() {
                return Err(cp_err(format!(
                    "the host's tar failed: {}",
                    first_line(e.as_bytes())
                )));
            }
        }
        if let Err(e) = fed {
            return Err(cp_err(format!("reading the tar stream: {e}")));
        }
        Ok(())
    }

    /// Copy `src` in the sandbox to host path `dest` (`dest` `None`: the tar to `tar_out`).
    pub fn copy_out(
        &self,
        src: &str,
        dest: Option<&Path>,
        tar_out: Option<&mut dyn Write>,
    ) -> Result<(), SandboxError> {
        let src = guest_path(src)?;
        let name = src
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or_default();
        if name.is_empty() {
            return Err(cp_err(format!("{src}: name a file or directory, not /")));
        }
        // Where the tar goes first: beside the destination (the same file system), or stdout.
        let (into, rename_to) = match dest {
            Some(d) if d.is_dir() => (d.to_path_buf(), None),
            Some(d) => {
                let abs =
                    std::path::absolute(d).map_err(|e| cp_err(format!("{}: {e}", d.display())))?;
                let parent = abs.parent().unwrap_or(Path::new("/")).to_path_buf();
                if !parent.is_dir() {
                    return Err(cp_err(format!("{}: no such directory", parent.display())));
                }
                if std::fs::symlink_metadata(&abs).is_ok() {
                    return Err(cp_err(format!(
                        "{}: exists and is not a directory",
                        abs.display()
                    )));
                }
                (parent, Some(abs))
            }
            None => (PathBuf::new(), None),
        };
        let mut stream = self.cp_exec(PACK, &[src], false)?;
        let mut tmp_tar = None;
        let mut sink: Box<dyn Write> = match (dest, tar_out) {
            (None, Some(w)) => Box::new(w),
            _ => {
                let path = into.join(format!(".amvm-cp-{}.tar", std::process::id()));
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(|e| cp_err(format!("{}: {e}", path.display())))?;
                tmp_tar = Some(path);
                Box::new(std::io::BufWriter::new(f))
            }
        };
        let cleanup = |p: &Option<PathBuf>| {
            if let Some(p) = p {
                let _ = std::fs::remove_file(p);
            }
        };
        let mut errs = Vec::new();
        let mut write_err = None;
        let status = loop {
            match stream.next_event() {
                Ok(Some(Event::Stdout(b))) => {
                    if write_err.is_none() {
                        if let Err(e) = sink.write_all(&b) {
                            write_err = Some(e);
                        }
                    }
                }
                Ok(Some(Event::Stderr(b))) => errs.extend_from_slice(&b),
                Ok(Some(Event::Exit(c))) => break c,
                Ok(None) => unreachable!("next_event() errs at a stream without Exit"),
                Err(e) => {
                    drop(sink);
                    cleanup(&tmp_tar);
                    return Err(e);
                }
            }
        };
        let flushed = sink.flush();
        drop(sink);
        if status != 0 {
            cleanup(&tmp_tar);
            return Err(cp_err(format!(
                "{}:{src}: {}",
                self.shown(),
                first_line(&errs)
            )));
        }
        if let Some(e) = write_err.or(flushed.err()) {
            cleanup(&tmp_tar);
            return Err(cp_err(format!("writing the copy: {e}")));
        }
        let Some(tar) = tmp_tar else {
            return Ok(());
        };
        let result = unpack(&tar, &into, name, rename_to.as_deref());
        cleanup(&Some(tar));
        result
    }
}

/// Unpack the guest's `tar` into `into` (then, for a new destination, rename `name` there to
/// `rename_to`), refusing whatever could reach outside.
fn unpack(
    tar: &Path,
    into: &Path,
    name: &str,
    rename_to: Option<&Path>,
) -> Result<(), SandboxError> {
    use crate::changes::apply::{apply, Options};
    let mut said = Vec::new();
    let mut say = |line: String| said.push(line);
    let opts = Options {
        check_only: false,
        skip_refused: false,
        any_symlink: false,
    };
    match rename_to {
        None => apply(tar, into, opts, &mut say).map(|_| ()).map_err(|e| {
            cp_err(format!(
                "{}{e}",
                said.iter().map(|l| format!("{l}; ")).collect::<String>()
            ))
        }),
        Some(dest) => {
            let stage = into.join(format!(".amvm-cp-{}", std::process::id()));
            std::fs::create_dir(&stage).map_err(|e| cp_err(format!("{}: {e}", stage.display())))?;
            let r = apply(tar, &stage, opts, &mut say)
                .map_err(|e| {
                    cp_err(format!(
                        "{}{e}",
                        said.iter().map(|l| format!("{l}; ")).collect::<String>()
                    ))
                })
                .and_then(|_| {
                    std::fs::rename(stage.join(OsStr::from_bytes(name.as_bytes())), dest)
                        .map_err(|e| cp_err(format!("{}: {e}", dest.display())))
                });
            let _ = std::fs::remove_dir_all(&stage);
            r
        }
    }
}

fn first_line(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let l = s
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("failed")
        .trim();
    l.trim_start_matches("tar: ").to_string()
}

/// `amvm cp SRC DEST`: exactly one of them `SANDBOX:PATH`; `-` for a tar on stdin or stdout.
pub fn cli(src: &str, dest: &str) -> Result<(), SandboxError> {
    let split = |s: &str| -> Option<(String, String)> {
        let (a, b) = s.split_once(':')?;
        (!a.is_empty() && !a.contains('/') && b.starts_with('/'))
            .then(|| (a.to_string(), b.to_string()))
    };
    match (split(src), split(dest)) {
        (Some(_), Some(_)) => Err(cp_err(
            "copy between a sandbox and the host: one side is a host path",
        )),
        (None, None) => Err(cp_err(format!(
            "one side must be SANDBOX:/PATH (an absolute path in the sandbox): {src} {dest}"
        ))),
        (None, Some((sb, path))) => {
            let sb = Sandbox::open(&sb)?;
            if src == "-" {
                sb.copy_in(None, Some(Box::new(std::io::stdin())), &path)
            } else {
                sb.copy_in(Some(Path::new(src)), None, &path)
            }
        }
        (Some((sb, path)), None) => {
            let sb = Sandbox::open(&sb)?;
            if dest == "-" {
                let mut out = std::io::stdout().lock();
                sb.copy_out(&path, None, Some(&mut out))
            } else {
                sb.copy_out(&path, Some(Path::new(dest)), None)
            }
        }
    }
}
