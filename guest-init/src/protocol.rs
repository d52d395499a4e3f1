//! The guest-init <-> VMM protocol.
//!
//! One vsock stream carries it: guest-init connects to [`CONTROL_PORT`] on the host (CID 2) as
//! soon as the kernel hands it control. Both directions use the same little-endian frames:
//! `kind: u8`, `len: u32`, then `len` payload bytes.
//!
//! * VMM -> guest: one [`FrameKind::Spec`] first (the encoded [`RunSpec`], at most
//!   [`MAX_SPEC_LEN`] bytes), then any number of [`FrameKind::Signal`] (one byte: a signal
//!   number amvm received and forwards to the workload).
//! * guest -> VMM: [`FrameKind::Stdout`] and [`FrameKind::Stderr`] (workload output, in order,
//!   at most [`MAX_FRAME_PAYLOAD`] bytes each) and one [`FrameKind::Exit`] (one byte: the exit
//!   status amvm returns).
//!
//! With `-i`, the workload's stdin is a second stream, raw bytes on [`STDIN_PORT`] (guest-init
//! connects to it only when the spec asks): stdin flows under vsock's own credit, and a
//! workload that does not read its stdin never holds up a signal.
//!
//! Run spec layout: magic [`SPEC_MAGIC`], `uid: u32`, `gid: u32`, `flags: u32` (bit 0: egress
//! relay, bit 1: stdin stream), `pids_max: u32`, `cwd: bytes`, `root: bytes`, `hostname: bytes`,
//! `argv: list`, `env: list`, `mounts: list`, `files: list`, `tmpfs: list`, where `bytes` is `len: u32` followed by `len` bytes and `list` is
//! `count: u32` followed by `count` `bytes`. Environment entries are `KEY=VALUE`; a mount is
//! `TAG NUL PATH` (a virtio-fs tag and where it goes, read-only) or `TAG NUL PATH NUL w`
//! (mounted writable); a file is `f PATH NUL DATA`
//! or a symlink `l PATH NUL TARGET` (what guest-init writes into `/etc` before sealing it); a
//! tmpfs is `PATH NUL OPTIONS`.
//!
//! A non-empty `root` (`amvm run --rootfs`, the OCI runtime) is a container's root file system:
//! the first mount is at `root`, guest-init mounts proc, sysfs and the guest's /dev inside it,
//! the files whose paths lie under it are bind-mounted over what the root has there, and every
//! process is chrooted into it (`cwd` is then inside it). A non-empty `hostname` is set.
//!
//! ## Sessions (`amvm create`)
//!
//! A spec with the session flag (bit 2) has no argv: guest-init sets the guest up, sends one
//! [`FrameKind::Ready`] and then runs what the host asks, many at once, until told to stop.
//! VMM -> guest on the control stream: [`FrameKind::Exec`] (an encoded [`ExecSpec`]),
//! [`FrameKind::ExecSignal`] (`id: u64`, `signal: u8`), [`FrameKind::ExecResize`] (`id: u64`,
//! `rows: u16`, `cols: u16`: a terminal exec's window) and [`FrameKind::Shutdown`]
//! (`grace_seconds: u32`). For each exec guest-init connects a stream of its own to
//! [`EXEC_PORT`], sends [`FrameKind::Attach`] (`id: u64`) first, then the process's Stdout,
//! Stderr and one Exit frame, and reads raw stdin bytes from the same stream (the host
//! half-closes it at the end of stdin), so each exec's output and input flow under vsock's own
//! credit: a slow reader slows its process, never another.
//!
//! A session continued from a snapshot (`amvm create --from`): the restored guest finds its
//! vsock streams reset (VIRTIO_VSOCK_EVENT_TRANSPORT_RESET), connects its control stream again
//! and gets [`FrameKind::Restored`] instead of a spec (`unix_nanos: u64`, the host's wall clock,
//! then [`RESTORED_ENTROPY`] bytes of the host's randomness): guest-init sets the clock, mixes
//! the bytes into the kernel's RNG and reseeds it, and sends [`FrameKind::Ready`] again.
//!
//! Exec spec layout: magic [`EXEC_MAGIC`], `id: u64`, `uid: u32`, `gid: u32`, `flags: u32`
//! (bit 0: stdin, bit 1: a terminal, bit 2: a capability set), `rows: u16`, `cols: u16` (the
//! terminal's first window size), `caps: u64` (with bit 2: the capabilities a uid-0 process
//! keeps, bit N for capability N), `cwd: bytes`, `argv: list`, `env: list`; with bit 3, then
//! `groups` (`u32` count, a `u32` each: supplementary groups) and `rlimits` (`u32` count, then
//! `resource: u32`, `soft: u64`, `hard: u64` each). A terminal exec's output is all Stdout (its
//! stdout and stderr are the terminal).
//!
//! The API's exec streams (`amvm exec` <-> the sandbox's supervisor) use the same frames: the
//! supervisor sends Stdout, Stderr and Exit ([`Direction::ToHost`]); the client sends
//! [`FrameKind::Stdin`], one [`FrameKind::StdinEnd`], [`FrameKind::Signal`] and
//! [`FrameKind::Resize`] (`rows: u16`, `cols: u16`)
//! ([`Direction::ToSandbox`]).
//!
//! The VMM treats every byte from the guest as hostile: a [`FrameParser`] for
//! [`Direction::ToHost`] rejects unknown or host-bound-only kinds and oversized frames instead of
//! trusting them.

/// The vsock port (on the host, CID 2) where guest-init opens the control channel.
pub const CONTROL_PORT: u32 = 1024;
/// The vsock port each egress stream connects to.
pub const EGRESS_PORT: u32 = 1025;
/// The vsock port of the workload's stdin (published only with `-i`).
pub const STDIN_PORT: u32 = 1026;

/// The vsock port each exec stream of a session connects to.
pub const EXEC_PORT: u32 = 1027;

/// First bytes of an encoded run spec (the trailing digit is the version).
pub const SPEC_MAGIC: &[u8; 8] = b"AMVMSPC8";
/// First bytes of an encoded exec spec.
pub const EXEC_MAGIC: &[u8; 8] = b"AMVMEXE2";
/// Largest payload an output frame may carry.
pub const MAX_FRAME_PAYLOAD: usize = 64 * 1024;
/// Largest encoded run spec (argv and environment together; Linux allows about 2 MiB).
pub const MAX_SPEC_LEN: usize = 4 << 20;

/// The host randomness a [`FrameKind::Restored`] frame carries.
pub const RESTORED_ENTROPY: usize = 64;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 5;
/// Upper bound on the number of argv/env entries a spec may hold.
const MAX_LIST_ITEMS: usize = 64 * 1024;

/// Errors of this module.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("run spec is truncated")]
    Truncated,
    #[error("run spec has a bad magic (guest-init and amvm are from different builds?)")]
    BadMagic,
    #[error("run spec list has {0} entries, more than allowed")]
    TooManyItems(usize),
    #[error("run spec has {0} trailing bytes")]
    TrailingBytes(usize),
    #[error("run spec has an empty argv")]
    EmptyArgv,
    #[error("run spec has a malformed mount or file entry")]
    BadEntry,
    #[error("frame of unknown kind {0:#04x}")]
    UnknownFrameKind(u8),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_PAYLOAD}-byte limit")]
    FrameTooLarge(usize),
    #[error("{0:?} frame with a {1}-byte payload (want 1)")]
    BadByteFrame(FrameKind, usize),
    #[error("{0:?} frame in the wrong direction")]
    WrongDirection(FrameKind),
    #[error("run spec of {0} bytes exceeds the {MAX_SPEC_LEN}-byte limit")]
    SpecTooLarge(usize),
    #[error("{0:?} frame with a {1}-byte payload (want {2})")]
    BadFixedFrame(FrameKind, usize, usize),
}

/// What the workload is and how to run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSpec {
    pub argv: Vec<Vec<u8>>,
    /// `KEY=VALUE` entries, the workload's whole environment.
    pub env: Vec<Vec<u8>>,
    pub cwd: Vec<u8>,
    /// A container's root file system (where the first mount goes), every process chrooted
    /// into it; empty: the guest's own root (module docs).
    pub root: Vec<u8>,
    /// The guest's hostname; empty: the kernel's.
    pub hostname: Vec<u8>,
    pub uid: u32,
    pub gid: u32,
    /// Run the egress relay (the host has an egress socket).
    pub egress: bool,
    /// The workload's stdin is the [`STDIN_PORT`] stream (`-i`); otherwise /dev/null.
    pub stdin: bool,
    /// The workload cgroup's `pids.max`: tasks (processes and threads) it may have at once.
    pub pids_max: u32,
    /// virtio-fs shares to mount read-only, in order.
    pub mounts: Vec<Mount>,
    /// Files and symlinks for the guest's `/etc`.
    pub files: Vec<SpecFile>,
    /// tmpfs mounts (`--tmpfs`), made last, in order.
    pub tmpfs: Vec<Tmpfs>,
    /// A session (`amvm create`): no argv; guest-init runs [`ExecSpec`]s until told to stop.
    pub session: bool,
}

/// One process a session runs ([`FrameKind::Exec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    /// The host's name for it, echoed in [`FrameKind::Attach`] and [`FrameKind::ExecSignal`].
    pub id: u64,
    pub argv: Vec<Vec<u8>>,
    pub env: Vec<Vec<u8>>,
    pub cwd: Vec<u8>,
    pub uid: u32,
    pub gid: u32,
    /// Its stdin is the exec stream's host-to-guest bytes; otherwise /dev/null.
    pub stdin: bool,
    /// A pseudo-terminal of this many rows and columns for its stdin, stdout and stderr.
    pub tty: Option<(u16, u16)>,
    /// The capabilities a uid-0 process keeps (bit N: capability N); `None`: all of them. A
    /// process of another uid has none either way.
    pub caps: Option<u64>,
    /// Supplementary groups (none when empty), at most [`MAX_GROUPS`].
    pub groups: Vec<u32>,
    /// Resource limits to set: (RLIMIT_* number below [`RLIM_NLIMITS`], soft, hard).
    pub rlimits: Vec<(u32, u64, u64)>,
    /// A directory of the guest to run the process chrooted into, with the kernel's file
    /// systems mounted inside it (a pod's container root on a share); empty: the session's
    /// root. Absolute when set.
    pub root: Vec<u8>,
}

/// include/uapi/linux/limits.h: NGROUPS_MAX.
pub const MAX_GROUPS: usize = 65536;
/// include/uapi/asm-generic/resource.h: RLIM_NLIMITS, the number of resources.
pub const RLIM_NLIMITS: u32 = 16;

/// include/uapi/asm-generic/resource.h: the resources' names, by number (x86_64).
const RLIMIT_NAMES: [&str; RLIM_NLIMITS as usize] = [
    "CPU",
    "FSIZE",
    "DATA",
    "STACK",
    "CORE",
    "RSS",
    "NPROC",
    "NOFILE",
    "MEMLOCK",
    "AS",
    "LOCKS",
    "SIGPENDING",
    "MSGQUEUE",
    "NICE",
    "RTPRIO",
    "RTTIME",
];

/// The number of a resource limit named `RLIMIT_NOFILE` (OCI's form) or `nofile`.
pub fn rlimit_number(name: &str) -> Option<u32> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("RLIMIT_").unwrap_or(&upper);
    RLIMIT_NAMES
        .iter()
        .position(|n| *n == bare)
        .map(|n| n as u32)
}

impl ExecSpec {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(EXEC_MAGIC);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        let extra = !self.groups.is_empty() || !self.rlimits.is_empty();
        let flags = u32::from(self.stdin)
            | u32::from(self.tty.is_some()) << 1
            | u32::from(self.caps.is_some()) << 2
            | u32::from(extra) << 3
            | u32::from(!self.root.is_empty()) << 4;
        out.extend_from_slice(&flags.to_le_bytes());
        let (rows, cols) = self.tty.unwrap_or((0, 0));
        out.extend_from_slice(&rows.to_le_bytes());
        out.extend_from_slice(&cols.to_le_bytes());
        out.extend_from_slice(&self.caps.unwrap_or(0).to_le_bytes());
        put_bytes(&mut out, &self.cwd);
        for list in [&self.argv, &self.env] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for item in list {
                put_bytes(&mut out, item);
            }
        }
        // Flag 8: the groups and the limits follow.
        if extra {
            out.extend_from_slice(&(self.groups.len() as u32).to_le_bytes());
            for g in &self.groups {
                out.extend_from_slice(&g.to_le_bytes());
            }
            out.extend_from_slice(&(self.rlimits.len() as u32).to_le_bytes());
            for (resource, soft, hard) in &self.rlimits {
                out.extend_from_slice(&resource.to_le_bytes());
                out.extend_from_slice(&soft.to_le_bytes());
                out.extend_from_slice(&hard.to_le_bytes());
            }
        }
        // Flag 16: the root follows, last.
        if !self.root.is_empty() {
            put_bytes(&mut out, &self.root);
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        if r.take(EXEC_MAGIC.len())? != EXEC_MAGIC {
            return Err(ProtocolError::BadMagic);
        }
        let id = r.u64()?;
        let uid = r.u32()?;
        let gid = r.u32()?;
        let flags = r.u32()?;
        let size = r.take(4)?;
        let (rows, cols) = (
            u16::from_le_bytes([size[0], size[1]]),
            u16::from_le_bytes([size[2], size[3]]),
        );
        let caps = r.u64()?;
        let cwd = r.bytes()?.to_vec();
        let argv = r.list()?;
        let env = r.list()?;
        let (mut groups, mut rlimits) = (Vec::new(), Vec::new());
        if flags & 8 != 0 {
            let n = r.u32()? as usize;
            if n > MAX_GROUPS {
                return Err(ProtocolError::TooManyItems(n));
            }
            groups = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
            let n = r.u32()? as usize;
            if n > RLIM_NLIMITS as usize {
                return Err(ProtocolError::TooManyItems(n));
            }
            for _ in 0..n {
                let (resource, soft, hard) = (r.u32()?, r.u64()?, r.u64()?);
                if resource >= RLIM_NLIMITS || soft > hard {
                    return Err(ProtocolError::BadEntry);
                }
                rlimits.push((resource, soft, hard));
            }
        }
        let mut root = Vec::new();
        if flags & 16 != 0 {
            root = r.bytes()?.to_vec();
            if !root.starts_with(b"/") || root.contains(&0) {
                return Err(ProtocolError::BadEntry);
            }
        }
        if !r.buf.is_empty() {
            return Err(ProtocolError::TrailingBytes(r.buf.len()));
        }
        if argv.is_empty() {
            return Err(ProtocolError::EmptyArgv);
        }
        Ok(ExecSpec {
            groups,
            rlimits,
            root,
            tty: (flags & 2 != 0).then_some((rows, cols)),
            caps: (flags & 4 != 0).then_some(caps),
            id,
            argv,
            env,
            cwd,
            uid,
            gid,
            stdin: flags & 1 != 0,
        })
    }
}

/// A tmpfs the workload asked for: where, and its options (`size=`, `mode=`, `nr_inodes=`,
/// `uid=`, `gid=` for the filesystem; `noexec`, `ro` as mount flags; nodev and nosuid always).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tmpfs {
    pub path: Vec<u8>,
    pub options: Vec<u8>,
}

impl Tmpfs {
    fn encode(&self) -> Vec<u8> {
        [&self.path[..], &[0], &self.options[..]].concat()
    }
    fn decode(b: &[u8]) -> Result<Self, ProtocolError> {
        let (path, options) = split_nul(b)?;
        Ok(Tmpfs {
            path: path.to_vec(),
            options: options.to_vec(),
        })
    }
}

/// A [`Mount`] whose tag starts with this is a read-only disk, not a virtio-fs share: the rest
/// of the tag is the virtio-blk serial of the disk (an EROFS image) guest-init mounts there.
pub const DISK_TAG_PREFIX: &[u8] = b"disk:";

/// A virtio-fs share: its tag, its absolute mount point, and whether the guest mounts it
/// writable (an overlay workspace, whose writes land in a layer on the host; the host decides
/// what a share may write, never this flag alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub tag: Vec<u8>,
    pub path: Vec<u8>,
    pub writable: bool,
}

/// One entry guest-init writes before the workload starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecFile {
    File { path: Vec<u8>, data: Vec<u8> },
    Symlink { path: Vec<u8>, target: Vec<u8> },
}

fn split_nul(b: &[u8]) -> Result<(&[u8], &[u8]), ProtocolError> {
    let i = b
        .iter()
        .position(|&c| c == 0)
        .ok_or(ProtocolError::BadEntry)?;
    Ok((&b[..i], &b[i + 1..]))
}

impl Mount {
    fn encode(&self) -> Vec<u8> {
        let flags: &[u8] = if self.writable { b"\0w" } else { b"" };
        [&self.tag[..], &[0], &self.path[..], flags].concat()
    }
    fn decode(b: &[u8]) -> Result<Self, ProtocolError> {
        let (tag, rest) = split_nul(b)?;
        let (path, writable) = match split_nul(rest) {
            Ok((path, b"w")) => (path, true),
            Ok(_) => return Err(ProtocolError::BadEntry),
            Err(_) => (rest, false),
        };
        Ok(Mount {
            tag: tag.to_vec(),
            path: path.to_vec(),
            writable,
        })
    }
}

impl SpecFile {
    fn encode(&self) -> Vec<u8> {
        match self {
            SpecFile::File { path, data } => [&b"f"[..], path, &[0], data].concat(),
            SpecFile::Symlink { path, target } => [&b"l"[..], path, &[0], target].concat(),
        }
    }
    fn decode(b: &[u8]) -> Result<Self, ProtocolError> {
        let (kind, rest) = b.split_first().ok_or(ProtocolError::BadEntry)?;
        let (path, tail) = split_nul(rest)?;
        let (path, tail) = (path.to_vec(), tail.to_vec());
        match kind {
            b'f' => Ok(SpecFile::File { path, data: tail }),
            b'l' => Ok(SpecFile::Symlink { path, target: tail }),
            _ => Err(ProtocolError::BadEntry),
        }
    }
}

const FLAG_EGRESS: u32 = 1;
const FLAG_STDIN: u32 = 2;
const FLAG_SESSION: u32 = 4;

impl RunSpec {
    /// Serialize to the layout in the module docs.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(SPEC_MAGIC);
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        let flags = if self.egress { FLAG_EGRESS } else { 0 }
            | if self.stdin { FLAG_STDIN } else { 0 }
            | if self.session { FLAG_SESSION } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.pids_max.to_le_bytes());
        put_bytes(&mut out, &self.cwd);
        put_bytes(&mut out, &self.root);
        put_bytes(&mut out, &self.hostname);
        let mounts: Vec<Vec<u8>> = self.mounts.iter().map(Mount::encode).collect();
        let files: Vec<Vec<u8>> = self.files.iter().map(SpecFile::encode).collect();
        let tmpfs: Vec<Vec<u8>> = self.tmpfs.iter().map(Tmpfs::encode).collect();
        for list in [&self.argv, &self.env, &mounts, &files, &tmpfs] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for item in list {
                put_bytes(&mut out, item);
            }
        }
        out
    }

    /// Parse and validate an encoded spec.
    pub fn decode(buf: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        if r.take(SPEC_MAGIC.len())? != SPEC_MAGIC {
            return Err(ProtocolError::BadMagic);
        }
        let uid = r.u32()?;
        let gid = r.u32()?;
        let flags = r.u32()?;
        let pids_max = r.u32()?;
        let cwd = r.bytes()?.to_vec();
        let root = r.bytes()?.to_vec();
        let hostname = r.bytes()?.to_vec();
        if (!root.is_empty() && !root.starts_with(b"/")) || hostname.len() > 64 {
            return Err(ProtocolError::BadEntry);
        }
        let argv = r.list()?;
        let env = r.list()?;
        let mounts = r
            .list()?
            .iter()
            .map(|m| Mount::decode(m))
            .collect::<Result<_, _>>()?;
        let files = r
            .list()?
            .iter()
            .map(|f| SpecFile::decode(f))
            .collect::<Result<_, _>>()?;
        let tmpfs = r
            .list()?
            .iter()
            .map(|t| Tmpfs::decode(t))
            .collect::<Result<_, _>>()?;
        if !r.buf.is_empty() {
            return Err(ProtocolError::TrailingBytes(r.buf.len()));
        }
        let session = flags & FLAG_SESSION != 0;
        if argv.is_empty() && !session {
            return Err(ProtocolError::EmptyArgv);
        }
        Ok(RunSpec {
            argv,
            env,
            cwd,
            root,
            hostname,
            uid,
            gid,
            egress: flags & FLAG_EGRESS != 0,
            stdin: flags & FLAG_STDIN != 0,
            pids_max,
            mounts,
            files,
            tmpfs,
            session,
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.buf.len() < n {
            return Err(ProtocolError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, ProtocolError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, ProtocolError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self) -> Result<&'a [u8], ProtocolError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn list(&mut self) -> Result<Vec<Vec<u8>>, ProtocolError> {
        let n = self.u32()? as usize;
        if n > MAX_LIST_ITEMS {
            return Err(ProtocolError::TooManyItems(n));
        }
        (0..n).map(|_| self.bytes().map(<[u8]>::to_vec)).collect()
    }
}

/// Frame kinds; each belongs to one [`Direction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Stdout = 1,
    Stderr = 2,
    Exit = 3,
    Ready = 4,
    Attach = 5,
    Spec = 16,
    Signal = 17,
    Exec = 18,
    ExecSignal = 19,
    Shutdown = 20,
    ExecResize = 21,
    Restored = 22,
    Stdin = 32,
    StdinEnd = 33,
    Resize = 34,
}

/// Which way frames flow; a parser accepts only its direction's kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// guest -> VMM: Stdout, Stderr, Exit.
    ToHost,
    /// VMM -> guest: Spec, Signal, Exec, ExecSignal, ExecResize, Shutdown.
    ToGuest,
    /// An API client -> a sandbox's supervisor: Stdin, StdinEnd, Signal, Resize.
    ToSandbox,
}

impl FrameKind {
    fn directions(self) -> &'static [Direction] {
        use Direction::*;
        match self {
            FrameKind::Stdout
            | FrameKind::Stderr
            | FrameKind::Exit
            | FrameKind::Ready
            | FrameKind::Attach => &[ToHost],
            FrameKind::Spec
            | FrameKind::Exec
            | FrameKind::ExecSignal
            | FrameKind::ExecResize
            | FrameKind::Restored
            | FrameKind::Shutdown => &[ToGuest],
            FrameKind::Signal => &[ToGuest, ToSandbox],
            FrameKind::Stdin | FrameKind::StdinEnd | FrameKind::Resize => &[ToSandbox],
        }
    }

    /// Check a header's length against what this kind may carry.
    fn check_len(self, len: usize) -> Result<(), ProtocolError> {
        match self {
            FrameKind::Stdout | FrameKind::Stderr | FrameKind::Stdin if len > MAX_FRAME_PAYLOAD => {
                Err(ProtocolError::FrameTooLarge(len))
            }
            FrameKind::Spec | FrameKind::Exec if len > MAX_SPEC_LEN => {
                Err(ProtocolError::SpecTooLarge(len))
            }
            FrameKind::Exit | FrameKind::Signal if len != 1 => {
                Err(ProtocolError::BadByteFrame(self, len))
            }
            FrameKind::Ready | FrameKind::StdinEnd if len != 0 => {
                Err(ProtocolError::BadFixedFrame(self, len, 0))
            }
            FrameKind::Attach if len != 8 => Err(ProtocolError::BadFixedFrame(self, len, 8)),
            FrameKind::ExecSignal if len != 9 => Err(ProtocolError::BadFixedFrame(self, len, 9)),
            FrameKind::Shutdown | FrameKind::Resize if len != 4 => {
                Err(ProtocolError::BadFixedFrame(self, len, 4))
            }
            FrameKind::ExecResize if len != 12 => Err(ProtocolError::BadFixedFrame(self, len, 12)),
            FrameKind::Restored if len != 8 + RESTORED_ENTROPY => Err(
                ProtocolError::BadFixedFrame(self, len, 8 + RESTORED_ENTROPY),
            ),
            _ => Ok(()),
        }
    }
}

impl TryFrom<u8> for FrameKind {
    type Error = ProtocolError;
    fn try_from(b: u8) -> Result<Self, ProtocolError> {
        match b {
            1 => Ok(FrameKind::Stdout),
            2 => Ok(FrameKind::Stderr),
            3 => Ok(FrameKind::Exit),
            4 => Ok(FrameKind::Ready),
            5 => Ok(FrameKind::Attach),
            16 => Ok(FrameKind::Spec),
            17 => Ok(FrameKind::Signal),
            18 => Ok(FrameKind::Exec),
            19 => Ok(FrameKind::ExecSignal),
            20 => Ok(FrameKind::Shutdown),
            21 => Ok(FrameKind::ExecResize),
            22 => Ok(FrameKind::Restored),
            32 => Ok(FrameKind::Stdin),
            33 => Ok(FrameKind::StdinEnd),
            34 => Ok(FrameKind::Resize),
            other => Err(ProtocolError::UnknownFrameKind(other)),
        }
    }
}

/// Append one frame (header and payload) to `out`. Panics only on a caller bug: a payload its
/// kind may not carry (use [`encode_chunks`] for arbitrary output data).
pub fn encode_frame(kind: FrameKind, payload: &[u8], out: &mut Vec<u8>) {
    assert!(
        kind.check_len(payload.len()).is_ok(),
        "{kind:?} frame payload of {} bytes",
        payload.len()
    );
    out.push(kind as u8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Append `data` as as many frames of `kind` as it needs.
pub fn encode_chunks(kind: FrameKind, data: &[u8], out: &mut Vec<u8>) {
    for chunk in data.chunks(MAX_FRAME_PAYLOAD) {
        encode_frame(kind, chunk, out);
    }
}

/// The first 8 bytes of `p` (which `check_len` made sure are there), little-endian.
fn le_u64(p: &[u8]) -> u64 {
    u64::from_le_bytes(p[..8].try_into().expect("checked length"))
}

/// An [`FrameKind::ExecSignal`] payload.
pub fn exec_signal_payload(id: u64, signal: u8) -> [u8; 9] {
    let mut p = [0u8; 9];
    p[..8].copy_from_slice(&id.to_le_bytes());
    p[8] = signal;
    p
}

/// A [`FrameKind::Restored`] payload.
pub fn restored_payload(unix_nanos: u64, entropy: &[u8; RESTORED_ENTROPY]) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + RESTORED_ENTROPY);
    p.extend_from_slice(&unix_nanos.to_le_bytes());
    p.extend_from_slice(entropy);
    p
}

/// An [`FrameKind::ExecResize`] payload.
pub fn exec_resize_payload(id: u64, rows: u16, cols: u16) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[..8].copy_from_slice(&id.to_le_bytes());
    p[8..10].copy_from_slice(&rows.to_le_bytes());
    p[10..].copy_from_slice(&cols.to_le_bytes());
    p
}

/// A [`FrameKind::Resize`] payload.
pub fn resize_payload(rows: u16, cols: u16) -> [u8; 4] {
    let mut p = [0u8; 4];
    p[..2].copy_from_slice(&rows.to_le_bytes());
    p[2..].copy_from_slice(&cols.to_le_bytes());
    p
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(u8),
    Ready,
    Attach(u64),
    Spec(Vec<u8>),
    Signal(u8),
    Exec(Vec<u8>),
    ExecSignal {
        id: u64,
        signal: u8,
    },
    Shutdown {
        grace_seconds: u32,
    },
    ExecResize {
        id: u64,
        rows: u16,
        cols: u16,
    },
    /// The host's wall clock (ns since the epoch) and randomness for a restored guest.
    Restored {
        unix_nanos: u64,
        entropy: Vec<u8>,
    },
    Resize {
        rows: u16,
        cols: u16,
    },
    Stdin(Vec<u8>),
    StdinEnd,
}

/// Incremental frame decoder: bytes go in as they arrive (in any pieces), whole frames come out.
/// After an error it stays failed: the stream is desynchronized.
#[derive(Debug)]
pub struct FrameParser {
    direction: Direction,
    header: Vec<u8>,
    payload: Vec<u8>,
    want: Option<(FrameKind, usize)>,
    failed: Option<ProtocolError>,
}

impl FrameParser {
    pub fn new(direction: Direction) -> Self {
        FrameParser {
            direction,
            header: Vec::with_capacity(FRAME_HEADER_LEN),
            payload: Vec::new(),
            want: None,
            failed: None,
        }
    }

    /// Feed `data`; call `on_frame` for each frame completed by it.
    pub fn feed(
        &mut self,
        mut data: &[u8],
        mut on_frame: impl FnMut(Frame),
    ) -> Result<(), ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        while !data.is_empty() {
            match self.want {
                None => {
                    let n = (FRAME_HEADER_LEN - self.header.len()).min(data.len());
                    self.header.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.header.len() == FRAME_HEADER_LEN {
                        let h = std::mem::take(&mut self.header);
                        let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
                        let parsed = FrameKind::try_from(h[0]).and_then(|k| {
                            if !k.directions().contains(&self.direction) {
                                return Err(ProtocolError::WrongDirection(k));
                            }
                            k.check_len(len).map(|()| k)
                        });
                        match parsed {
                            Ok(kind) => self.want = Some((kind, len)),
                            Err(e) => {
                                self.failed = Some(e.clone());
                                return Err(e);
                            }
                        }
                    }
                }
                Some((_, len)) => {
                    // Grow with the bytes that actually arrive, never by the header's claim.
                    let n = (len - self.payload.len()).min(data.len());
                    self.payload.extend_from_slice(&data[..n]);
                    data = &data[n..];
                }
            }
            if let Some((kind, len)) = self.want {
                if self.payload.len() == len {
                    self.want = None;
                    let p = std::mem::take(&mut self.payload);
                    on_frame(match kind {
                        FrameKind::Stdout => Frame::Stdout(p),
                        FrameKind::Stderr => Frame::Stderr(p),
                        FrameKind::Exit => Frame::Exit(p[0]),
                        FrameKind::Ready => Frame::Ready,
                        FrameKind::Attach => Frame::Attach(le_u64(&p)),
                        FrameKind::Spec => Frame::Spec(p),
                        FrameKind::Signal => Frame::Signal(p[0]),
                        FrameKind::Exec => Frame::Exec(p),
                        FrameKind::ExecSignal => Frame::ExecSignal {
                            id: le_u64(&p),
                            signal: p[8],
                        },
                        FrameKind::Shutdown => Frame::Shutdown {
                            grace_seconds: u32::from_le_bytes([p[0], p[1], p[2], p[3]]),
                        },
                        FrameKind::ExecResize => Frame::ExecResize {
                            id: le_u64(&p),
                            rows: u16::from_le_bytes([p[8], p[9]]),
                            cols: u16::from_le_bytes([p[10], p[11]]),
                        },
                        FrameKind::Restored => Frame::Restored {
                            unix_nanos: le_u64(&p),
                            entropy: p[8..].to_vec(),
                        },
                        FrameKind::Resize => Frame::Resize {
                            rows: u16::from_le_bytes([p[0], p[1]]),
                            cols: u16::from_le_bytes([p[2], p[3]]),
                        },
                        FrameKind::Stdin => Frame::Stdin(p),
                        FrameKind::StdinEnd => Frame::StdinEnd,
                    });
                }
            }
        }
        Ok(())
    }

    /// True when no partial frame is pending.
    pub fn is_idle(&self) -> bool {
        self.want.is_none() && self.header.is_empty() && self.failed.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RunSpec {
        RunSpec {
            argv: vec![b"sh".to_vec(), b"-c".to_vec(), b"echo 'a\nb'".to_vec()],
            env: vec![b"PATH=/bin".to_vec(), b"X=\xff\x00".to_vec()],
            cwd: b"/".to_vec(),
            root: b"/rootfs".to_vec(),
            hostname: b"box".to_vec(),
            uid: 1000,
            gid: 1001,
            egress: true,
            stdin: false,
            pids_max: 4096,
            mounts: vec![
                Mount {
                    tag: b"usr".to_vec(),
                    path: b"/usr".to_vec(),
                    writable: false,
                },
                Mount {
                    tag: b"workspace".to_vec(),
                    path: b"/workspace".to_vec(),
                    writable: true,
                },
            ],
            files: vec![
                SpecFile::File {
                    path: b"/etc/hosts".to_vec(),
                    data: b"127.0.0.1 localhost\n\0x".to_vec(),
                },
                SpecFile::Symlink {
                    path: b"/etc/alternatives/awk".to_vec(),
                    target: b"/usr/bin/mawk".to_vec(),
                },
            ],
            tmpfs: vec![Tmpfs {
                path: b"/scratch".to_vec(),
                options: b"size=1m,noexec".to_vec(),
            }],
            session: false,
        }
    }

    #[test]
    fn spec_round_trips() {
        assert_eq!(RunSpec::decode(&spec().encode()).unwrap(), spec());
    }

    #[test]
    fn spec_rejects_every_truncation_and_garbage() {
        let enc = spec().encode();
        for n in 0..enc.len() {
            assert!(RunSpec::decode(&enc[..n]).is_err(), "prefix {n} accepted");
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert_eq!(
            RunSpec::decode(&extra),
            Err(ProtocolError::TrailingBytes(1))
        );
        let mut bad = enc;
        bad[0] = b'X';
        assert_eq!(RunSpec::decode(&bad), Err(ProtocolError::BadMagic));
    }

    #[test]
    fn spec_rejects_empty_argv_and_huge_lists() {
        let mut s = spec();
        s.argv.clear();
        assert_eq!(RunSpec::decode(&s.encode()), Err(ProtocolError::EmptyArgv));
        let mut raw = SPEC_MAGIC.to_vec();
        raw.extend_from_slice(&[0; 16]); // uid, gid, flags, pids_max
        raw.extend_from_slice(&[0; 12]); // cwd, root, hostname: empty
        raw.extend_from_slice(&u32::MAX.to_le_bytes()); // argv count
        assert!(matches!(
            RunSpec::decode(&raw),
            Err(ProtocolError::TooManyItems(_))
        ));
        for bad in [&b""[..], b"x/etc/a\0b", b"f/etc/no-nul"] {
            assert_eq!(SpecFile::decode(bad), Err(ProtocolError::BadEntry));
        }
        let relative_root = RunSpec {
            root: b"rootfs".to_vec(),
            ..spec()
        };
        assert_eq!(
            RunSpec::decode(&relative_root.encode()),
            Err(ProtocolError::BadEntry)
        );
        assert_eq!(Mount::decode(b"no-nul"), Err(ProtocolError::BadEntry));
        assert_eq!(Mount::decode(b"t\0/p\0x"), Err(ProtocolError::BadEntry));
        assert!(Mount::decode(b"t\0/p\0w").unwrap().writable);
        assert!(!Mount::decode(b"t\0/p").unwrap().writable);
    }

    #[test]
    fn frames_survive_any_split() {
        let mut stream = Vec::new();
        encode_chunks(FrameKind::Stdout, b"hello\n", &mut stream);
        encode_chunks(
            FrameKind::Stderr,
            &vec![7u8; MAX_FRAME_PAYLOAD + 3],
            &mut stream,
        );
        encode_frame(FrameKind::Stdout, b"", &mut stream);
        encode_frame(FrameKind::Exit, &[7], &mut stream);
        for step in [1, 2, 5, 4096, stream.len()] {
            let mut p = FrameParser::new(Direction::ToHost);
            let mut got = Vec::new();
            for piece in stream.chunks(step) {
                p.feed(piece, |f| got.push(f)).unwrap();
            }
            assert!(p.is_idle());
            let mut err = Vec::new();
            for f in &got[1..3] {
                if let Frame::Stderr(b) = f {
                    err.extend_from_slice(b);
                }
            }
            assert_eq!(got[0], Frame::Stdout(b"hello\n".to_vec()));
            assert_eq!(err, vec![7u8; MAX_FRAME_PAYLOAD + 3]);
            assert_eq!(got[3], Frame::Stdout(Vec::new()));
            assert_eq!(got[4], Frame::Exit(7));
            assert_eq!(got.len(), 5);
        }
    }

    #[test]
    fn hostile_frames_are_rejected_and_stay_rejected() {
        let mut p = FrameParser::new(Direction::ToHost);
        assert_eq!(
            p.feed(&[9, 0, 0, 0, 0], |_| {}),
            Err(ProtocolError::UnknownFrameKind(9))
        );
        assert!(p
            .feed(&[1, 0, 0, 0, 0], |_| panic!("frame after error"))
            .is_err());

        let mut p = FrameParser::new(Direction::ToHost);
        let huge = ((MAX_FRAME_PAYLOAD + 1) as u32).to_le_bytes();
        let r = p.feed(&[1, huge[0], huge[1], huge[2], huge[3]], |_| {});
        assert_eq!(r, Err(ProtocolError::FrameTooLarge(MAX_FRAME_PAYLOAD + 1)));

        let mut p = FrameParser::new(Direction::ToHost);
        assert_eq!(
            p.feed(&[3, 2, 0, 0, 0], |_| {}),
            Err(ProtocolError::BadByteFrame(FrameKind::Exit, 2))
        );

        // A guest may not send host-bound kinds, however well formed.
        for kind in [FrameKind::Spec, FrameKind::Signal] {
            let mut wire = Vec::new();
            encode_frame(kind, &[15], &mut wire);
            let mut p = FrameParser::new(Direction::ToHost);
            assert_eq!(
                p.feed(&wire, |_| panic!("accepted")),
                Err(ProtocolError::WrongDirection(kind))
            );
        }
        let mut p = FrameParser::new(Direction::ToGuest);
        assert_eq!(
            p.feed(&[1, 0, 0, 0, 0], |_| {}),
            Err(ProtocolError::WrongDirection(FrameKind::Stdout))
        );
    }

    #[test]
    fn a_spec_and_signals_reach_the_guest() {
        let mut wire = Vec::new();
        let s = RunSpec {
            stdin: true,
            ..spec()
        };
        encode_frame(FrameKind::Spec, &s.encode(), &mut wire);
        encode_frame(FrameKind::Signal, &[15], &mut wire);
        let mut p = FrameParser::new(Direction::ToGuest);
        let mut got = Vec::new();
        for b in &wire {
            p.feed(std::slice::from_ref(b), |f| got.push(f)).unwrap();
        }
        let Frame::Spec(raw) = &got[0] else {
            panic!("{got:?}")
        };
        assert_eq!(RunSpec::decode(raw).unwrap(), s);
        assert_eq!(got[1], Frame::Signal(15));
        let too_big = ((MAX_SPEC_LEN + 1) as u32).to_le_bytes();
        let mut p = FrameParser::new(Direction::ToGuest);
        assert_eq!(
            p.feed(
                &[16, too_big[0], too_big[1], too_big[2], too_big[3]],
                |_| {}
            ),
            Err(ProtocolError::SpecTooLarge(MAX_SPEC_LEN + 1))
        );
    }

    fn exec_spec() -> ExecSpec {
        ExecSpec {
            id: u64::MAX - 3,
            argv: vec![b"sh".to_vec(), b"-c".to_vec(), b"cat".to_vec()],
            env: vec![b"A=\xff".to_vec()],
            cwd: b"/workspace".to_vec(),
            uid: 1000,
            gid: 1000,
            stdin: true,
            tty: Some((50, 132)),
            caps: Some(1 << 21 | 1),
            groups: vec![10, 4242],
            rlimits: vec![(7, 321, 654), (6, u64::MAX, u64::MAX)],
            root: b"/run/amvm/pod/c1/rootfs".to_vec(),
        }
    }

    #[test]
    fn resource_limits_are_known_by_name() {
        assert_eq!(rlimit_number("RLIMIT_NOFILE"), Some(7));
        assert_eq!(rlimit_number("nofile"), Some(7));
        assert_eq!(rlimit_number("RLIMIT_CPU"), Some(0));
        assert_eq!(rlimit_number("RLIMIT_RTTIME"), Some(15));
        assert_eq!(rlimit_number("RLIMIT_NOPE"), None);
        assert_eq!(rlimit_number(""), None);
    }

    #[test]
    fn a_session_spec_may_have_no_argv_and_an_exec_spec_round_trips() {
        let s = RunSpec {
            argv: vec![],
            session: true,
            ..spec()
        };
        assert_eq!(RunSpec::decode(&s.encode()).unwrap(), s);
        let e = exec_spec();
        let enc = e.encode();
        assert_eq!(ExecSpec::decode(&enc).unwrap(), e);
        for n in 0..enc.len() {
            assert!(ExecSpec::decode(&enc[..n]).is_err(), "prefix {n} accepted");
        }
        // Without groups and limits, nothing of them is sent.
        let plain = ExecSpec {
            groups: vec![],
            rlimits: vec![],
            ..exec_spec()
        };
        assert_eq!(plain.encode().len() + 4 + 8 + 4 + 2 * 20, enc.len());
        assert_eq!(ExecSpec::decode(&plain.encode()).unwrap(), plain);
        // A limit of no resource, or soft above hard, is refused.
        for bad in [(16, 1, 1), (7, 2, 1)] {
            let e = ExecSpec {
                rlimits: vec![bad],
                ..exec_spec()
            };
            assert_eq!(ExecSpec::decode(&e.encode()), Err(ProtocolError::BadEntry));
        }
        // Without a root, nothing of it is sent; a relative one is refused.
        let rootless = ExecSpec {
            root: vec![],
            ..exec_spec()
        };
        assert_eq!(rootless.encode().len() + 4 + e.root.len(), enc.len());
        assert_eq!(ExecSpec::decode(&rootless.encode()).unwrap(), rootless);
        let relative = ExecSpec {
            root: b"pod/c1".to_vec(),
            ..exec_spec()
        };
        assert_eq!(
            ExecSpec::decode(&relative.encode()),
            Err(ProtocolError::BadEntry)
        );
        let empty = ExecSpec {
            argv: vec![],
            ..exec_spec()
        };
        assert_eq!(
            ExecSpec::decode(&empty.encode()),
            Err(ProtocolError::EmptyArgv)
        );
        // A run spec is not an exec spec.
        assert_eq!(
            ExecSpec::decode(&spec().encode()),
            Err(ProtocolError::BadMagic)
        );
    }

    #[test]
    fn session_frames_parse_in_their_directions_only() {
        let mut to_guest = Vec::new();
        encode_frame(FrameKind::Exec, &exec_spec().encode(), &mut to_guest);
        encode_frame(
            FrameKind::ExecSignal,
            &exec_signal_payload(7, 2),
            &mut to_guest,
        );
        encode_frame(FrameKind::Shutdown, &9u32.to_le_bytes(), &mut to_guest);
        encode_frame(
            FrameKind::ExecResize,
            &exec_resize_payload(3, 40, 100),
            &mut to_guest,
        );
        let mut p = FrameParser::new(Direction::ToGuest);
        let mut got = Vec::new();
        for b in &to_guest {
            p.feed(std::slice::from_ref(b), |f| got.push(f)).unwrap();
        }
        assert_eq!(got[0], Frame::Exec(exec_spec().encode()));
        assert_eq!(got[1], Frame::ExecSignal { id: 7, signal: 2 });
        assert_eq!(got[2], Frame::Shutdown { grace_seconds: 9 });
        assert_eq!(
            got[3],
            Frame::ExecResize {
                id: 3,
                rows: 40,
                cols: 100
            }
        );
        let mut restored = Vec::new();
        encode_frame(
            FrameKind::Restored,
            &restored_payload(5, &[7; RESTORED_ENTROPY]),
            &mut restored,
        );
        let mut got = Vec::new();
        FrameParser::new(Direction::ToGuest)
            .feed(&restored, |f| got.push(f))
            .unwrap();
        assert_eq!(
            got,
            vec![Frame::Restored {
                unix_nanos: 5,
                entropy: vec![7; RESTORED_ENTROPY]
            }]
        );
        // A short one is refused; the host never gets one.
        let mut bad = vec![FrameKind::Restored as u8];
        bad.extend_from_slice(&8u32.to_le_bytes());
        bad.extend_from_slice(&[0; 8]);
        assert!(FrameParser::new(Direction::ToGuest)
            .feed(&bad, |_| {})
            .is_err());
        assert!(FrameParser::new(Direction::ToHost)
            .feed(&restored, |_| {})
            .is_err());

        let mut to_host = Vec::new();
        encode_frame(FrameKind::Ready, &[], &mut to_host);
        encode_frame(FrameKind::Attach, &42u64.to_le_bytes(), &mut to_host);
        let mut got = Vec::new();
        FrameParser::new(Direction::ToHost)
            .feed(&to_host, |f| got.push(f))
            .unwrap();
        assert_eq!(got, vec![Frame::Ready, Frame::Attach(42)]);

        let mut to_sandbox = Vec::new();
        encode_frame(FrameKind::Stdin, b"abc", &mut to_sandbox);
        encode_frame(FrameKind::Signal, &[2], &mut to_sandbox);
        encode_frame(FrameKind::StdinEnd, &[], &mut to_sandbox);
        encode_frame(FrameKind::Resize, &resize_payload(24, 80), &mut to_sandbox);
        let mut got = Vec::new();
        FrameParser::new(Direction::ToSandbox)
            .feed(&to_sandbox, |f| got.push(f))
            .unwrap();
        assert_eq!(
            got,
            vec![
                Frame::Stdin(b"abc".to_vec()),
                Frame::Signal(2),
                Frame::StdinEnd,
                Frame::Resize { rows: 24, cols: 80 }
            ]
        );

        // Wrong sizes and wrong directions: a guest cannot send Exec, a client cannot send
        // Exec or Attach.
        for (dir, wire) in [
            (Direction::ToHost, [5u8, 7, 0, 0, 0]),
            (Direction::ToHost, [4, 1, 0, 0, 0]),
            (Direction::ToGuest, [19, 8, 0, 0, 0]),
            (Direction::ToGuest, [20, 0, 0, 0, 0]),
            (Direction::ToHost, [18, 0, 0, 0, 0]),
            (Direction::ToSandbox, [18, 0, 0, 0, 0]),
            (Direction::ToSandbox, [5, 8, 0, 0, 0]),
            (Direction::ToGuest, [32, 0, 0, 0, 0]),
            (Direction::ToSandbox, [34, 3, 0, 0, 0]),
            (Direction::ToGuest, [21, 4, 0, 0, 0]),
            (Direction::ToSandbox, [21, 12, 0, 0, 0]),
        ] {
            let r = FrameParser::new(dir).feed(&wire, |f| panic!("accepted {f:?}"));
            assert!(r.is_err(), "{dir:?} {wire:?}");
        }
    }
}
