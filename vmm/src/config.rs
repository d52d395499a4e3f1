//! What one `amvm run` needs, validated: the machine (kernel, memory, vCPUs), what the guest
//! runs (the [`RunSpec`] guest-init receives) and how the run is supervised.

use crate::arch::x86_64::mptable;
use guest_init::protocol::RunSpec;
use std::path::PathBuf;
use std::time::Duration;

pub const MIN_MEM_MIB: u64 = 64;
pub const MAX_MEM_MIB: u64 = 256 * 1024;
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Where the host's static busybox is, until the system root arrives over virtio-fs.
pub const DEFAULT_BUSYBOX: &str = "/bin/busybox";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--mem {0}: must be between {MIN_MEM_MIB} and {MAX_MEM_MIB} MiB")]
    Mem(u64),
    #[error("--cpus {0}: must be between 1 and {max}", max = mptable::MAX_CPUS)]
    Cpus(u8),
    #[error("--user {0:?}: expected UID or UID:GID (numbers)")]
    User(String),
    #[error("-e {0:?}: expected KEY=VALUE with a non-empty KEY")]
    Env(String),
    #[error("-w {0:?}: the working directory must be an absolute path")]
    Workdir(String),
    #[error("--timeout 0: the limit must be at least 1 second")]
    Timeout,
    #[error("{0} is not supported yet by this version of amvm")]
    NotYetSupported(&'static str),
    #[error("the command and its environment take {0} bytes, more than the {max} allowed", max = guest_init::protocol::MAX_SPEC_LEN)]
    SpecTooLarge(usize),
    #[error("no default kernel: set AMVM_KERNEL, AMVM_CACHE or HOME, or pass --kernel")]
    NoDefaultKernel,
}

/// A validated run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub kernel: PathBuf,
    pub mem_mib: u64,
    pub cpus: u8,
    /// Show the guest's kernel console on stderr.
    pub console: bool,
    pub timeout: Option<Duration>,
    pub spec: RunSpec,
    /// A static busybox for the initramfs (this version's guest userland).
    pub busybox: PathBuf,
    /// The host unix socket egress streams go to (`--egress`), and their log.
    pub egress: Option<PathBuf>,
    pub egress_log: Option<PathBuf>,
}

/// The kernel `images/build-kernel` builds: `$AMVM_KERNEL`, else the `vmlinux` link in the
/// cache (`$AMVM_CACHE`, default `~/.cache/amvm`).
pub fn default_kernel() -> Result<PathBuf, ConfigError> {
    if let Some(k) = std::env::var_os("AMVM_KERNEL") {
        return Ok(PathBuf::from(k));
    }
    let cache = match std::env::var_os("AMVM_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").ok_or(ConfigError::NoDefaultKernel)?)
            .join(".cache/amvm"),
    };
    Ok(cache.join("kernel/vmlinux"))
}

pub fn check_mem(mib: u64) -> Result<u64, ConfigError> {
    if (MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mib) {
        Ok(mib)
    } else {
        Err(ConfigError::Mem(mib))
    }
}

pub fn check_cpus(n: u8) -> Result<u8, ConfigError> {
    if (1..=mptable::MAX_CPUS).contains(&n) {
        Ok(n)
    } else {
        Err(ConfigError::Cpus(n))
    }
}

/// `UID` or `UID:GID` (GID defaults to UID).
pub fn parse_user(s: &str) -> Result<(u32, u32), ConfigError> {
    let bad = || ConfigError::User(s.to_string());
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?),
        None => {
            let u = s.parse().map_err(|_| bad())?;
            (u, u)
        }
    };
    Ok((u, g))
}

/// The workload's environment: a fixed base, then `-e` entries (later ones win).
pub fn workload_env(uid: u32, extra: &[String]) -> Result<Vec<Vec<u8>>, ConfigError> {
    let home = if uid == 0 { "/root" } else { "/home/agent" };
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), home.into()),
        ("TERM".into(), "dumb".into()),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    for kv in extra {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                env.retain(|(ek, _)| ek != k);
                env.push((k.into(), v.into()));
            }
            _ => return Err(ConfigError::Env(kv.clone())),
        }
    }
    Ok(env
        .into_iter()
        .map(|(k, v)| format!("{k}={v}").into_bytes())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users() {
        assert_eq!(parse_user("1000:1000"), Ok((1000, 1000)));
        assert_eq!(parse_user("0"), Ok((0, 0)));
        assert_eq!(parse_user("5:7"), Ok((5, 7)));
        assert!(parse_user("root").is_err());
        assert!(parse_user("1:").is_err());
        assert!(parse_user("-1").is_err());
    }

    #[test]
    fn env_overrides_and_rejects() {
        let env = workload_env(1000, &["HOME=/x".into(), "A=b=c".into(), "EMPTY=".into()]).unwrap();
        let env: Vec<String> = env
            .into_iter()
            .map(|e| String::from_utf8(e).unwrap())
            .collect();
        assert!(env.contains(&"HOME=/x".to_string()));
        assert!(env.contains(&"A=b=c".to_string()));
        assert!(env.contains(&"EMPTY=".to_string()));
        assert_eq!(env.iter().filter(|e| e.starts_with("HOME=")).count(), 1);
        assert_eq!(
            workload_env(0, &["NOEQ".into()]),
            Err(ConfigError::Env("NOEQ".into()))
        );
        assert_eq!(
            workload_env(0, &["=v".into()]),
            Err(ConfigError::Env("=v".into()))
        );
    }

    #[test]
    fn bounds() {
        assert!(check_mem(63).is_err());
        assert_eq!(check_mem(512), Ok(512));
        assert!(check_cpus(0).is_err());
        assert!(check_cpus(33).is_err());
        assert_eq!(check_cpus(2), Ok(2));
    }
}
