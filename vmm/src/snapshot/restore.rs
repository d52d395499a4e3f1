//! Opening a snapshot for `amvm create --from DIR`: everything is checked here, in the
//! caller's process, before anything is made — that DIR is a snapshot this amvm wrote, of the
//! kernel it would boot now, whole (the state file's checksum, the memory file's length).

use super::{format, MachineState};
use crate::config::Restore;
use crate::sandbox::Info;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("{0}: not a snapshot's description: {1}")]
    Description(PathBuf, String),
    #[error("{0}: {1}")]
    State(PathBuf, format::FormatError),
    #[error("{0}: {1}")]
    Mismatch(PathBuf, super::MismatchError),
    #[error("{path}: {have} bytes, where the snapshot's guest RAM is {need}: it is truncated")]
    ShortMemory { path: PathBuf, have: u64, need: u64 },
    #[error("the guest kernel {path} is not the one the snapshot ran (its SHA-256 was {was}, now {now})")]
    OtherKernel {
        path: PathBuf,
        was: String,
        now: String,
    },
    #[error("the snapshot's guest kernel {0}: {1}")]
    Kernel(PathBuf, std::io::Error),
    #[error(
        "{0}: the snapshot was not finished (amvm snapshot failed or was stopped while writing it)"
    )]
    Unfinished(PathBuf),
    #[error(
        "{0}: the snapshot's sandbox had an overlay workspace, but its upper layer is missing"
    )]
    NoUpper(PathBuf),
}

/// What `sandbox.json` says of the snapshot.
#[derive(serde::Deserialize)]
struct Description {
    amvm: String,
    kernel_sha256: Option<String>,
    sandbox: Info,
    /// Written once the snapshot succeeded (its absence: an unfinished snapshot).
    next_exec_id: Option<u64>,
    /// The workspace's host directory and what it looked like.
    workspace: Option<Workspace>,
}

#[derive(serde::Deserialize)]
struct Workspace {
    dir: PathBuf,
    fingerprint: super::tree::Fingerprint,
}

/// A snapshot, opened and checked: the sandbox it was (its settings) and what the VMM
/// continues from.
pub struct Opened {
    pub sandbox: Info,
    pub restore: Restore,
    /// What the user should hear before the restore goes on (its workspace changed).
    pub warnings: Vec<String>,
}

/// Open and check the snapshot in `dir`.
pub fn open(dir: &Path) -> Result<Opened, OpenError> {
    let path = |name: &str| dir.join(name);
    let read = |name: &str, limit: u64| -> Result<Vec<u8>, OpenError> {
        let p = path(name);
        let f = File::open(&p).map_err(|e| OpenError::Io(p.clone(), e))?;
        let mut v = Vec::new();
        f.take(limit)
            .read_to_end(&mut v)
            .map_err(|e| OpenError::Io(p.clone(), e))?;
        Ok(v)
    };
    let described = read("sandbox.json", 1 << 20)?;
    let d: Description = serde_json::from_slice(&described)
        .map_err(|e| OpenError::Description(path("sandbox.json"), e.to_string()))?;
    let here = env!("CARGO_PKG_VERSION");
    if d.amvm != here {
        return Err(OpenError::Mismatch(
            path("sandbox.json"),
            super::MismatchError::Amvm(d.amvm, here.into()),
        ));
    }
    let Some(next_exec_id) = d.next_exec_id else {
        return Err(OpenError::Unfinished(dir.to_owned()));
    };
    let upper = match d.sandbox.config.overlay_lower {
        Some(_) if path("upper").is_dir() && path("upper.json").is_file() => Some(path("upper")),
        Some(_) => return Err(OpenError::NoUpper(dir.to_owned())),
        None => None,
    };
    let bytes = read("state", format::HEADER as u64 + format::MAX_BODY + 1)?;
    let state: MachineState =
        format::decode(&bytes).map_err(|e| OpenError::State(path("state"), e))?;
    state
        .check()
        .map_err(|e| OpenError::Mismatch(path("state"), e))?;
    let memory = File::open(path("memory")).map_err(|e| OpenError::Io(path("memory"), e))?;
    let have = memory
        .metadata()
        .map_err(|e| OpenError::Io(path("memory"), e))?
        .len();
    let need = state.meta.mem_mib << 20;
    if have < need {
        return Err(OpenError::ShortMemory {
            path: path("memory"),
            have,
            need,
        });
    }
    if let (Some(k), Some(was)) = (&d.sandbox.config.kernel, &d.kernel_sha256) {
        let now = crate::sandbox::client::sha256_remembered(k)
            .map_err(|e| OpenError::Kernel(k.clone(), e))?;
        if &now != was {
            return Err(OpenError::OtherKernel {
                path: k.clone(),
                was: was.clone(),
                now,
            });
        }
    }
    let mut warnings = Vec::new();
    if let Some(w) = d.workspace {
        // A missing workspace is the create's error (its share cannot be made).
        if let Ok(now) = super::tree::fingerprint(&w.dir) {
            if now != w.fingerprint {
                warnings.push(format!(
                    "the workspace {} changed on the host since the snapshot ({} entries then, \
                     {} now): the restored guest may still hold what it read of it before",
                    w.dir.display(),
                    w.fingerprint.entries,
                    now.entries
                ));
            }
        }
    }
    Ok(Opened {
        sandbox: d.sandbox,
        restore: Restore {
            state,
            memory,
            next_exec_id,
            upper,
        },
        warnings,
    })
}
