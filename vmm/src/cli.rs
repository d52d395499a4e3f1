//! The command line, as ../docs/usage.md and the design's user contract state it.

use crate::config::{self, ConfigError, RunConfig};
use guest_init::protocol::{Mount, RunSpec, DISK_TAG_PREFIX};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// The settings as a TOML file (the same names: listen, allow, [[credential]] rule, header
    /// or bearer, and file, ca, log, max_streams, max_request_bytes, idle_timeout); flags add to its
    /// rules and win over its other settings.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The unix socket to serve (made 0600): what sandboxes are given as `--egress`.
    #[arg(long, value_name = "SOCK")]
    pub listen: Option<PathBuf>,
    /// An upstream that may be reached: `HOST` (port 443), `HOST:PORT`, or `NAME=HOST[:PORT]`,
    /// whose name also routes `http://$AMVM_EGRESS_ADDR/NAME/...` there. Repeatable.
    #[arg(long, value_name = "RULE")]
    pub allow: Vec<String>,
    /// `RULE=header:NAME:@FILE`: add header NAME, its value FILE's first line, to every
    /// request forwarded by RULE (a rule's NAME, or its HOST: all rules of that host);
    /// `RULE=bearer:@FILE` adds `Authorization: Bearer <line>`. Repeatable.
    #[arg(long, value_name = "SPEC")]
    pub credential: Vec<String>,
    /// PEM certificates to trust besides the webpki roots (a private CA).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// Append the audit log (one JSON line per request or tunnel) to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Requests and tunnels open at once; more get 503 (default 64).
    #[arg(long, value_name = "N")]
    pub max_streams: Option<usize>,
    /// A request body larger than this many bytes gets 413 (default 32 MiB).
    #[arg(long, value_name = "BYTES")]
    pub max_request_bytes: Option<u64>,
    /// Close a tunnel, or give up on an upload or an upstream, after this many seconds without a byte
    /// (default 300).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout: Option<u64>,
}

/// The workload's default task limit: room for builds and test runners with many threads,
/// while a fork bomb stops long before it exhausts a small guest.
pub const DEFAULT_PIDS: u32 = 4096;

#[derive(Debug, clap::Parser)]
#[command(
    name = "amvm",
    version,
    about = "Run a command in a fresh microVM",
    disable_help_subcommand = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Run COMMAND in a fresh microVM; exit with its status.
    Run(Box<RunArgs>),
    /// Boot a sandbox that stays up (until `amvm stop` or its --timeout) and print its id.
    Create(Box<CreateArgs>),
    /// Serve the API for all of this user's sandboxes on one socket (create, list, inspect,
    /// remove; exec, stop, wait and archives passed to each sandbox's own): docs/api.md.
    /// Runs until SIGINT or SIGTERM.
    Serve {
        /// The socket (default: api.sock beside the sandboxes' state directories).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// Be an egress for sandboxes (`--egress SOCK`): HTTP to allowed upstreams over TLS, with
    /// credentials added on the host, and CONNECT tunnels to allowed hosts; every request
    /// audited. Runs until SIGINT or SIGTERM: docs/usage.md.
    Gateway(GatewayArgs),
    /// Run COMMAND in a running sandbox; exit with its status.
    Exec(ExecArgs),
    /// Copy a file or tree into or out of a sandbox: `cp HOSTPATH SANDBOX:/PATH` or `cp
    /// SANDBOX:/PATH HOSTPATH` (`-` for a tar on stdin or stdout). Into DEST when it is an
    /// existing directory, else as DEST.
    Cp {
        #[arg(value_name = "SRC")]
        src: String,
        #[arg(value_name = "DEST")]
        dest: String,
    },
    /// Show what a sandbox's guest changed in its writable workspace (`--workspace
    /// DIR:overlay`) so far, as a unified diff against DIR. Changes nothing.
    Diff {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Apply what a sandbox's guest changed in its writable workspace to DIR, as `amvm apply`
    /// does (refusing whatever could reach outside DIR; a refusal applies nothing).
    Commit {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// amvm as an OCI runtime, runc's command line (create, start, state, kill, delete, exec,
    /// ps, features): what Docker, podman and containerd run, each container in a microVM.
    /// Also reached as `amvm-runc` (a link to amvm), the path engines are given.
    /// docs/engines.md.
    Oci {
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "ARGS"
        )]
        args: Vec<OsString>,
    },
    /// List this user's sandboxes.
    Ls {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print a sandbox's configuration and state as JSON.
    Inspect {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Stop a sandbox: its processes get SIGTERM, then SIGKILL after --time seconds.
    Stop {
        /// Seconds between SIGTERM and SIGKILL.
        #[arg(short = 't', long = "time", value_name = "SECS", default_value_t = 10)]
        time: u32,
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Pause a sandbox: its vCPUs stop where they are; its processes, memory and streams are
    /// kept until `amvm resume` (execs and cp wait for that).
    Pause {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Let a paused sandbox run again.
    Resume {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Write a sandbox's whole state (vCPUs, devices, its shares' server state, guest memory)
    /// to DIR, a new directory; the sandbox goes on as it was (running or paused).
    Snapshot {
        /// End the sandbox once the snapshot is written.
        #[arg(long)]
        stop: bool,
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// Start N new sandboxes from a running (or paused) sandbox's current state, each its own
    /// from then on (a snapshot restored N times; the original goes on). Prints their ids.
    Fork {
        /// How many.
        #[arg(short = 'n', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
        n: u32,
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// Remove stopped sandboxes (with -f, running ones too: killed at once).
    Rm {
        /// Kill a running sandbox first.
        #[arg(short = 'f', long)]
        force: bool,
        #[arg(required = true, value_name = "SANDBOX")]
        sandboxes: Vec<String>,
    },
    /// Wait until a sandbox stops; print its state.
    Wait {
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
    },
    /// List, import or remove images: built system images (`--system NAME`; recipes build
    /// them, images/harness/build) and OCI images (`--image REF`).
    #[command(subcommand)]
    Image(ImageCommand),
    /// Check that this host can run a sandbox (KVM, its kind and access, the kernel,
    /// virtiofsd, namespaces, cgroup v2), booting one small VM; print what to fix. Exit 0 only
    /// when that VM ran, 1 when a check failed.
    Doctor,
    /// Apply CHANGES (a tar in OCI layer form: whiteouts delete, opaque markers empty a
    /// directory) to DIR, refusing whatever could reach outside DIR (docs/threat-model.md).
    /// Exit 0 when every entry was applied, 1 when some were refused (each named on stderr)
    /// and the rest applied, 125 when nothing was applied.
    Apply(ApplyArgs),
    /// Show CHANGES as a unified diff against DIR (`git diff --no-index` style; binary files
    /// marked, not shown). Changes nothing.
    Changes(ChangesArgs),
}

#[derive(Debug, clap::Args)]
pub struct ChangesArgs {
    /// The directory the changes were made over (without it, every file shows as new).
    #[arg(long, value_name = "DIR")]
    pub base: Option<PathBuf>,
    /// The changes: a tar file (`amvm run --changes`).
    #[arg(value_name = "CHANGES")]
    pub changes: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// Only check CHANGES (and list what would be refused); change nothing.
    #[arg(long)]
    pub check: bool,
    /// Apply the entries that may be applied even when others are refused (by default a
    /// refused entry stops the apply before anything changes).
    #[arg(long)]
    pub skip_refused: bool,
    /// The changes: a tar file.
    #[arg(value_name = "CHANGES")]
    pub changes: PathBuf,
    /// The directory to apply them to.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
pub enum ImageCommand {
    /// List the images: built ones (`--system NAME`) and imported ones (`--image REF`):
    /// name, id, size, when, what is in them or where they came from.
    List,
    /// Print the root filesystem directory of image NAME (a built image's name, or an
    /// imported image's name or id).
    Path {
        /// The image's name.
        name: String,
    },
    /// Remove image NAME; for an imported image, also its layers and blobs no other image
    /// needs.
    Rm {
        /// The image's name.
        name: String,
    },
    /// Add the images of FILE or DIR to the store (`--image REF` runs them): a `docker save`
    /// or `podman save` archive (docker-archive or oci-archive, plain, gzip or zstd), or an
    /// OCI image layout directory. Prints each image's name.
    Import {
        /// Name the image REF (for an archive of one image that has none, or to rename it).
        #[arg(long, value_name = "REF")]
        name: Option<String>,
        #[arg(value_name = "FILE|DIR")]
        path: PathBuf,
    },
    /// Pull image REF from its registry (the OCI distribution API) into the store: an index
    /// resolved to linux/amd64, every blob checked against its digest. Credentials from
    /// `$REGISTRY_AUTH_FILE`, podman's auth.json or ~/.docker/config.json. Prints its name.
    Pull {
        /// Plain HTTP instead of HTTPS (a registry on loopback falls back to it by itself).
        #[arg(long)]
        plain_http: bool,
        /// PEM certificates to trust besides the system's (a private registry's CA).
        #[arg(long, value_name = "FILE")]
        ca: Option<PathBuf>,
        #[arg(value_name = "REF")]
        reference: String,
    },
    /// Remove from the store what no image needs (and what interrupted imports and pulls
    /// left).
    Prune,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    /// Forward stdin to the workload.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Give the workload a pseudo-terminal (the caller's terminal in raw mode meanwhile with
    /// -i, its window size passed on and kept up to date): `amvm run -it -- claude`. The run
    /// is then a sandbox made for it (amvm create, exec -t, rm).
    #[arg(short = 't', long)]
    pub tty: bool,
    /// The command and its arguments (with --image: the image's Entrypoint runs it, as
    /// Docker's arguments replace Cmd; without one, the image's Entrypoint and Cmd).
    #[arg(
        required_unless_present = "image",
        trailing_var_arg = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

impl RunArgs {
    /// Validate everything that can be checked without touching the host.
    pub fn into_config(self) -> Result<RunConfig, ConfigError> {
        self.vm.into_config(self.command, self.interactive, None)
    }
}

/// `amvm create`: a sandbox that stays up and runs `amvm exec`s.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    /// A name for the sandbox, usable wherever its id is (unique among this user's sandboxes).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// A label, shown by `amvm inspect` and `amvm ls --json`. Repeatable.
    #[arg(long = "label", value_name = "KEY=VAL")]
    pub labels: Vec<String>,
    /// Stop the sandbox once no exec has run for SECS seconds.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout: Option<u64>,
    /// Continue the sandbox `amvm snapshot` wrote to DIR (its settings come from there; with
    /// it only --name, --label, --idle-timeout and --egress may be given).
    #[arg(long, value_name = "DIR")]
    pub from: Option<PathBuf>,
}

/// `amvm exec`.
#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// Forward stdin to the command.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Give the command a pseudo-terminal (the caller's terminal in raw mode meanwhile, its
    /// window size passed on and kept up to date). With -i for interactive programs.
    #[arg(short = 't', long)]
    pub tty: bool,
    /// Set an environment variable (on top of the sandbox's own). Repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VAL")]
    pub env: Vec<String>,
    /// Working directory inside the guest (default: the sandbox's).
    #[arg(short = 'w', long = "workdir", value_name = "DIR")]
    pub workdir: Option<String>,
    /// UID[:GID] the command runs as (default: the sandbox's).
    #[arg(long, value_name = "UID[:GID]")]
    pub user: Option<String>,
    /// Run the command chrooted into DIR, a directory of the guest (a root file system on a
    /// share: `-v HOST:GUEST`), with /proc, /sys and /dev mounted inside it on first use.
    #[arg(long, value_name = "DIR")]
    pub root: Option<String>,
    /// The sandbox's id or name.
    #[arg(value_name = "SANDBOX")]
    pub sandbox: String,
    /// `env` is the whole environment (the OCI runtime's processes).
    #[arg(skip)]
    pub clear_env: bool,
    /// The capabilities a uid-0 command keeps (the OCI runtime's processes).
    #[arg(skip)]
    pub capabilities: Option<u64>,
    /// Supplementary groups (the OCI runtime's processes).
    #[arg(skip)]
    pub groups: Vec<u32>,
    /// Resource limits (the OCI runtime's processes).
    #[arg(skip)]
    pub rlimits: Vec<crate::sandbox::api::Rlimit>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// The VM and the workload's defaults, shared by `run` and `create`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("egress_any").args(["egress", "egress_allow"]).multiple(true)))]
pub struct VmArgs {
    /// Share DIR at /workspace (the default working directory): read-only, or with
    /// `DIR:overlay` writable, the writes going to a layer on the host while DIR itself is
    /// never written.
    #[arg(long, value_name = "DIR[:overlay]")]
    pub workspace: Option<PathBuf>,
    /// Share host directory HOST at GUEST, read-only unless `:rw` (which lets the guest write
    /// HOST itself). HOST may also be an EROFS image file (`mkfs.erofs IMAGE DIR`): a read-only
    /// disk the guest mounts at GUEST, whose metadata the guest caches like a local file
    /// system's. Repeatable.
    #[arg(short = 'v', long = "volume", value_name = "HOST:GUEST[:ro|rw]")]
    pub volumes: Vec<String>,
    /// Mount a tmpfs at PATH, docker's syntax: `/tmp:rw,noexec,nosuid,size=64m,mode=1777`.
    /// Its size caps what the workload may write there (ENOSPC past it). Repeatable.
    #[arg(long, value_name = "PATH[:OPTIONS]")]
    pub tmpfs: Vec<String>,
    /// With `--workspace DIR:overlay`: at exit, write what the workload changed in
    /// /workspace to FILE, a tar in OCI layer form (`amvm apply FILE DIR` applies it).
    #[arg(long, value_name = "FILE")]
    pub changes: Option<PathBuf>,
    /// With `--workspace DIR:overlay`: cap what the workload may write to /workspace at SIZE
    /// (`64m`, `1g`; ENOSPC past it). The upper layer then lives in memory, in a tmpfs of
    /// that size held by amvm's supervising process, instead of in a scratch directory on disk.
    #[arg(long, value_name = "SIZE")]
    pub overlay_size: Option<String>,
    /// Host unix socket the workload may reach through the egress relay.
    #[arg(long, value_name = "SOCKET")]
    pub egress: Option<PathBuf>,
    /// Append one JSON line per egress stream to FILE (needs --egress); with --egress-allow,
    /// the gateway's audit log (one line per request or tunnel).
    #[arg(long, value_name = "FILE", requires = "egress_any")]
    pub egress_log: Option<PathBuf>,
    /// Instead of --egress: an egress gateway of the sandbox's own (`amvm gateway`, started
    /// with it and ending with it) that lets through RULE: `HOST`, `HOST:PORT` or
    /// `NAME=HOST[:PORT]`, as `amvm gateway --allow`. Repeatable.
    #[arg(long, value_name = "RULE", conflicts_with = "egress")]
    pub egress_allow: Vec<String>,
    /// With --egress-allow: a credential the gateway adds on the host, as `amvm gateway
    /// --credential` (`RULE=header:NAME:@FILE` or `RULE=bearer:@FILE`). Repeatable.
    #[arg(long, value_name = "SPEC", requires = "egress_allow")]
    pub egress_credential: Vec<String>,
    /// With --egress-allow: PEM certificates the gateway trusts besides the webpki roots.
    #[arg(long, value_name = "FILE", requires = "egress_allow")]
    pub egress_ca: Option<PathBuf>,
    /// Read-only system root: `host` projects the host's /usr; NAME is a built image (amvm
    /// image list); DIR (with a `/`) is an unpacked rootfs.
    #[arg(long, value_name = "host|NAME|DIR", default_value = "host")]
    pub system: String,
    /// Run image REF (`amvm image import` stored it) as the root: its files read-only, its
    /// config's Entrypoint, Cmd, Env, WorkingDir and User as Docker uses them (flags win).
    #[arg(long, value_name = "REF", conflicts_with_all = ["system", "rootfs"])]
    pub image: Option<String>,
    /// With --image: pull it first when it is not in the store (`missing`, the default), every
    /// time (`always`), or never (an image not there is an error).
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = Pull::Missing, requires = "image")]
    pub pull: Pull,
    /// The image's Entrypoint and Cmd, once `--image` is resolved.
    #[arg(skip)]
    pub image_command: Option<(Vec<String>, Vec<String>)>,
    /// A whole root file system (a container's: its own /etc, /bin, ...) as the workload's /,
    /// instead of --system's: read-only unless `:rw` (which lets the guest write DIR itself).
    /// Its mount points (/proc, /sys, /dev, volumes) must exist unless it is writable.
    #[arg(long, value_name = "DIR[:rw]", conflicts_with = "system")]
    pub rootfs: Option<String>,
    /// Guest kernel (default: the one images/build-kernel builds and caches).
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,
    /// Guest memory in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    pub mem: u64,
    /// Number of vCPUs.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub cpus: u8,
    /// Most tasks (processes and threads) the workload may have at once (its cgroup's
    /// pids.max): a fork bomb stops there.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PIDS,
          value_parser = clap::value_parser!(u32).range(1..=4_194_304))]
    pub pids: u32,
    /// Wall-clock limit for the whole run, in seconds (exit 124 when it expires).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Set an environment variable for the workload.
    #[arg(short = 'e', long = "env", value_name = "KEY=VAL")]
    pub env: Vec<String>,
    /// Working directory inside the guest.
    #[arg(short = 'w', long = "workdir", value_name = "DIR")]
    pub workdir: Option<String>,
    /// UID[:GID] the workload runs as (default 1000:1000, or an --image's own User).
    #[arg(long, value_name = "UID[:GID]")]
    pub user: Option<String>,
    /// Show the guest's kernel log on stderr.
    #[arg(long)]
    pub console: bool,
    /// Back guest RAM with transparent huge pages (an unlinked file in a private
    /// `huge=within_size` tmpfs) instead of a memfd: fewer nested-paging faults, so
    /// memory-heavy workloads run faster (1.6x in the emulated test bed). Also
    /// `AMVM_HUGE_PAGES=1`. Not yet the default (docs/performance.md says why).
    #[arg(long, conflicts_with = "no_huge_pages")]
    pub huge_pages: bool,
    /// Guest RAM on a memfd even where `AMVM_HUGE_PAGES=1` asks for huge pages.
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Run amvm's own threads without their seccomp filters: for debugging amvm only, never
    /// for untrusted code (docs/threat-model.md).
    #[arg(long)]
    pub no_seccomp: bool,
    /// A restore's flags (`create --from`): its guest set its `/etc` up long ago and is never
    /// sent a run spec, so none of the host's files for it ([`config::etc_files`]) are read.
    #[arg(skip)]
    pub restoring: bool,
    /// An `--image`'s root as an EROFS image (the store's, [`VmArgs::resolve_image`]): mounted
    /// from a read-only disk instead of shared, when the root is read-only.
    #[arg(skip)]
    pub rootfs_image: Option<PathBuf>,
}

/// `--pull`: when `--image` pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Pull {
    Missing,
    Always,
    Never,
}

/// The workload's user when neither `--user` nor an image says: unprivileged.
pub const DEFAULT_USER: &str = "1000:1000";

impl VmArgs {
    /// `--image REF`: find it in the store and turn it into the flags it stands for: its root
    /// as `--rootfs` (read-only), and its config's User, Env and WorkingDir where no flag
    /// says otherwise (a tmpfs on /tmp too, as a container has a writable /tmp). Done once;
    /// again it changes nothing.
    pub fn resolve_image(mut self) -> Result<Self, ConfigError> {
        let Some(image) = self.image.clone() else {
            return Ok(self);
        };
        if self.image_command.is_some() {
            return Ok(self);
        }
        let bad = |why: String| ConfigError::Image(image.clone(), why);
        let store = crate::store::Store::default_dir()
            .and_then(|d| crate::store::Store::open(&d))
            .map_err(|e| bad(e.to_string()))?;
        let missing = matches!(
            store.find(&image),
            Err(crate::store::StoreError::NotFound(_))
        );
        if self.pull == Pull::Always || (missing && self.pull == Pull::Missing) {
            if missing {
                eprintln!("amvm: {image} is not in the store: pulling it");
            }
            let mut say = |line: String| tracing::info!("{line}");
            crate::store::pull::pull(&store, &image, &Default::default(), &mut say)
                .map_err(|e| bad(e.to_string()))?;
        }
        let found = store.for_run(&image).map_err(|e| bad(e.to_string()))?;
        let d = found.defaults;
        let (uid, gid, home) = match (&self.user, &d.user) {
            (Some(u), _) => {
                let (uid, gid) = config::parse_user(u)?;
                let home = crate::store::resolve_user(&found.root, &uid.to_string())
                    .ok()
                    .and_then(|(_, _, h)| h);
                (uid, gid, home)
            }
            (None, Some(u)) => {
                crate::store::resolve_user(&found.root, u).map_err(|e| bad(e.to_string()))?
            }
            (None, None) => {
                let (uid, gid) = config::parse_user(DEFAULT_USER)?;
                (uid, gid, None)
            }
        };
        self.user = Some(format!("{uid}:{gid}"));
        let mut env = vec![format!("HOME={}", home.as_deref().unwrap_or("/"))];
        env.extend(d.env.iter().cloned());
        env.append(&mut self.env);
        self.env = env;
        if self.workdir.is_none() {
            self.workdir = d.workdir.clone();
        }
        if !self.tmpfs.iter().any(|t| {
            t.split(':')
                .next()
                .is_some_and(|p| p.trim_end_matches('/') == "/tmp")
        }) {
            self.tmpfs.push("/tmp:rw,mode=1777".into());
        }
        self.rootfs = Some(format!("{}:ro", found.root.display()));
        // A root that cannot be made an EROFS image is shared instead: slower metadata, the
        // same run.
        self.rootfs_image = store.erofs_image(&found.record.chain).unwrap_or_else(|e| {
            eprintln!("amvm: warning: {e}; its root is shared over virtio-fs instead");
            None
        });
        self.image = Some(found.record.name);
        self.image_command = Some((d.entrypoint, d.cmd));
        Ok(self)
    }

    /// Validate everything that can be checked without touching the host. `session`: the
    /// supervisor socket of a sandbox (`amvm create`; then `command` is empty).
    pub fn into_config(
        self,
        command: Vec<OsString>,
        interactive: bool,
        session: Option<PathBuf>,
    ) -> Result<RunConfig, ConfigError> {
        let this = self.resolve_image()?;
        let command = this.run_argv(command, session.is_none())?;
        this.into_config_resolved(command, interactive, session)
    }

    /// A run's command with `--image` resolved: the image's Entrypoint, then the command
    /// given or else the image's Cmd (Docker's rule). `needed`: an empty result is an error.
    pub fn run_argv(
        &self,
        command: Vec<OsString>,
        needed: bool,
    ) -> Result<Vec<OsString>, ConfigError> {
        let Some((entrypoint, cmd)) = &self.image_command else {
            return Ok(command);
        };
        let rest = if command.is_empty() {
            cmd.iter().map(OsString::from).collect()
        } else {
            command
        };
        let argv: Vec<OsString> = entrypoint.iter().map(OsString::from).chain(rest).collect();
        if argv.is_empty() && needed {
            return Err(ConfigError::Image(
                self.image.clone().unwrap_or_default(),
                "it has no Entrypoint or Cmd: give a command after --".into(),
            ));
        }
        Ok(argv)
    }

    /// [`VmArgs::into_config`] once [`VmArgs::resolve_image`] was done and the command is
    /// the whole command.
    pub(crate) fn into_config_resolved(
        self,
        command: Vec<OsString>,
        interactive: bool,
        session: Option<PathBuf>,
    ) -> Result<RunConfig, ConfigError> {
        let rootfs = self.rootfs.as_deref().map(config::rootfs).transpose()?;
        let root = match &rootfs {
            Some((dir, _)) => dir.clone(),
            None => config::system_root(&self.system)?,
        };
        let in_root = |p: &str| config::guest_path(rootfs.is_some(), p);
        let (workspace, overlay) = match self.workspace.as_deref() {
            Some(w) => {
                let (dir, overlay) = config::workspace_arg(w)?;
                (Some(config::workspace(&dir)?), overlay)
            }
            None => (None, false),
        };
        if self.changes.is_some() && !overlay {
            return Err(ConfigError::ChangesWithoutOverlay);
        }
        if self.overlay_size.is_some() && !overlay {
            return Err(ConfigError::SizeWithoutOverlay);
        }
        let size = self
            .overlay_size
            .as_deref()
            .map(config::overlay_size)
            .transpose()?;
        let overlay = match (&workspace, overlay) {
            (Some(lower), true) => Some(config::overlay(lower, self.changes.as_deref(), size)?),
            _ => None,
        };
        let (uid, gid) = config::parse_user(self.user.as_deref().unwrap_or(DEFAULT_USER))?;
        let cwd = match self.workdir {
            Some(w) if w.starts_with('/') => w,
            Some(w) => return Err(ConfigError::Workdir(w)),
            None if workspace.is_some() => config::WORKSPACE_PATH.to_string(),
            None => "/".to_string(),
        };
        let mut disks = Vec::new();
        let (mut shares, mut mounts) = match &rootfs {
            // A read-only image root made into an EROFS image: a disk, no share.
            Some((_, false)) if self.rootfs_image.is_some() => {
                let id = config::DISK_ROOT_ID.to_string();
                let tag = format!("{}{id}", String::from_utf8_lossy(DISK_TAG_PREFIX));
                disks.push(config::Disk {
                    id,
                    image: self.rootfs_image.clone().unwrap_or_default(),
                });
                (
                    Vec::new(),
                    vec![Mount {
                        tag: tag.into_bytes(),
                        path: config::ROOTFS_PATH.into(),
                        writable: false,
                    }],
                )
            }
            Some((dir, writable)) => (
                vec![(config::TAG_ROOT.to_string(), dir.clone(), *writable)],
                vec![Mount {
                    tag: config::TAG_ROOT.into(),
                    path: config::ROOTFS_PATH.into(),
                    writable: *writable,
                }],
            ),
            None => (
                vec![(config::TAG_SYSTEM.to_string(), root.join("usr"), false)],
                vec![Mount {
                    tag: config::TAG_SYSTEM.into(),
                    path: b"/usr".to_vec(),
                    writable: false,
                }],
            ),
        };
        let mut taken = vec![if rootfs.is_some() { "/" } else { "/usr" }.to_string()];
        if let Some(ws) = workspace {
            // With an overlay, the share is the overlay's merged directory, made at run time.
            shares.push((config::TAG_WORKSPACE.to_string(), ws, overlay.is_some()));
            mounts.push(Mount {
                tag: config::TAG_WORKSPACE.into(),
                path: in_root(config::WORKSPACE_PATH).into_bytes(),
                writable: overlay.is_some(),
            });
            taken.push(config::WORKSPACE_PATH.into());
        }
        for (i, v) in self.volumes.iter().enumerate() {
            let (source, guest, writable) = config::volume(v)?;
            if taken.contains(&guest) {
                return Err(ConfigError::Volume(
                    v.clone(),
                    format!("{guest} is mounted already"),
                ));
            }
            taken.push(guest.clone());
            let tag = match source {
                config::VolumeSource::Dir(dir) => {
                    let tag = format!("vol{i}");
                    shares.push((tag.clone(), dir, writable));
                    tag
                }
                config::VolumeSource::Image(image) => {
                    let id = config::disk_id(disks.len());
                    disks.push(config::Disk {
                        id: id.clone(),
                        image,
                    });
                    format!("{}{id}", String::from_utf8_lossy(DISK_TAG_PREFIX))
                }
            };
            mounts.push(Mount {
                tag: tag.into_bytes(),
                path: in_root(&guest).into_bytes(),
                writable,
            });
        }
        let mut tmpfs = self
            .tmpfs
            .iter()
            .map(|t| config::tmpfs(t))
            .collect::<Result<Vec<_>, _>>()?;
        for t in &mut tmpfs {
            t.path = in_root(&String::from_utf8_lossy(&t.path)).into_bytes();
        }
        let gateway = config::gateway(
            &self.egress_allow,
            &self.egress_credential,
            self.egress_ca.as_deref(),
            self.egress_log.as_deref(),
        )?;
        let cache = config::cache_dir().unwrap_or_default();
        let timeout = match self.timeout {
            Some(0) => return Err(ConfigError::Timeout),
            t => t.map(Duration::from_secs),
        };
        let spec = RunSpec {
            argv: command.into_iter().map(OsStringExt::into_vec).collect(),
            env: config::workload_env(uid, &self.env)?,
            cwd: cwd.into_bytes(),
            root: if rootfs.is_some() {
                config::ROOTFS_PATH.into()
            } else {
                Vec::new()
            },
            hostname: Vec::new(),
            uid,
            gid,
            egress: self.egress.is_some() || gateway.is_some(),
            stdin: interactive,
            pids_max: self.pids,
            mounts,
            // A container's root has an /etc of its own.
            files: if rootfs.is_some() || self.restoring {
                Vec::new()
            } else {
                config::etc_files(&root, uid, gid)
            },
            tmpfs,
            session: session.is_some(),
        };
        let len = spec.encode().len();
        if len > guest_init::protocol::MAX_SPEC_LEN {
            return Err(ConfigError::SpecTooLarge(len));
        }
        Ok(RunConfig {
            kernel: match self.kernel {
                Some(k) => k,
                None => config::default_kernel()?,
            },
            mem_mib: config::check_mem(self.mem)?,
            cpus: config::check_cpus(self.cpus)?,
            console: self.console,
            huge_pages: config::huge_pages(
                self.huge_pages,
                self.no_huge_pages,
                std::env::var_os("AMVM_HUGE_PAGES").as_deref(),
            )?,
            seccomp: !self.no_seccomp,
            timeout,
            spec,
            // A gateway's socket is known once the sandbox's directory is (supervisor.rs).
            egress_log: if gateway.is_some() {
                None
            } else {
                self.egress_log
            },
            egress: self.egress,
            gateway,
            overlay,
            session,
            shares,
            disks,
            virtiofsd: crate::fs::virtiofsd_path(&cache),
            restore: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<RunConfig, String> {
        let cli = Cli::try_parse_from(args).map_err(|e| e.kind().to_string())?;
        let Command::Run(run) = cli.command else {
            return Err("not run".into());
        };
        run.into_config().map_err(|e| e.to_string())
    }

    #[test]
    fn command_after_double_dash_keeps_its_flags() {
        let c = parse(&["amvm", "run", "--cpus", "2", "--", "sh", "-c", "exit 7"]).unwrap();
        assert_eq!(
            c.spec.argv,
            vec![b"sh".to_vec(), b"-c".to_vec(), b"exit 7".to_vec()]
        );
        assert_eq!(
            (c.cpus, c.mem_mib, c.spec.uid, c.spec.gid),
            (2, 512, 1000, 1000)
        );
        let c = parse(&["amvm", "run", "ls", "-l"]).unwrap();
        assert_eq!(c.spec.argv, vec![b"ls".to_vec(), b"-l".to_vec()]);
    }

    #[test]
    fn a_restore_reads_no_etc_files_for_its_guest() {
        let vm = |restoring| {
            let cli = Cli::try_parse_from(["amvm", "create"]).unwrap();
            let Command::Create(mut create) = cli.command else {
                panic!("not create");
            };
            create.vm.restoring = restoring;
            create
                .vm
                .into_config(Vec::new(), false, Some("/".into()))
                .unwrap()
        };
        // A boot's guest gets its /etc (passwd, group, hosts, ... from the host's system root);
        // a restored one has it already.
        assert!(vm(false).spec.files.len() >= 5);
        assert!(vm(true).spec.files.is_empty());
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(parse(&["amvm", "run", "--bogus", "--", "true"]).is_err());
        assert!(parse(&["amvm", "run", "--egress-log", "/l", "--", "true"]).is_err());
        let c = parse(&["amvm", "run", "--egress", "/e.sock", "--", "true"]).unwrap();
        assert!(c.spec.egress && c.egress.is_some());
        assert!(parse(&["amvm", "run"]).is_err());
        assert!(parse(&["amvm", "run", "--cpus", "0", "--", "true"])
            .unwrap_err()
            .contains("--cpus 0"));
        assert!(parse(&["amvm", "run", "--timeout", "0", "--", "true"]).is_err());
        assert!(parse(&["amvm", "run", "-w", "rel", "--", "true"]).is_err());
        let both = [
            "amvm",
            "run",
            "--huge-pages",
            "--no-huge-pages",
            "--",
            "true",
        ];
        assert_eq!(
            parse(&both).unwrap_err(),
            "an argument cannot be used with one or more of the other specified arguments"
        );
        let huge = "x".repeat(guest_init::protocol::MAX_SPEC_LEN);
        let e = parse(&["amvm", "run", "--", "echo", &huge]).unwrap_err();
        assert!(e.contains("more than the"), "{e}");
        assert!(
            parse(&["amvm", "run", "-i", "--", "cat"])
                .unwrap()
                .spec
                .stdin
        );
        let e = parse(&["amvm", "run", "--workspace", "/nonexistent", "--", "true"]).unwrap_err();
        assert!(e.starts_with("--workspace /nonexistent: "), "{e}");
        let e = parse(&["amvm", "run", "--workspace", "/etc/hostname", "--", "true"]).unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
        let e = parse(&["amvm", "run", "--changes", "/tmp/c.tar", "--", "true"]).unwrap_err();
        assert!(e.starts_with("--changes needs a writable workspace"), "{e}");
        let e = parse(&[
            "amvm",
            "run",
            "--workspace",
            "/tmp",
            "--changes",
            "/c",
            "--",
            "true",
        ]);
        assert!(e.unwrap_err().starts_with("--changes needs"));
        let e = parse(&[
            "amvm",
            "run",
            "--workspace",
            "/tmp:overlay",
            "--changes",
            "/nonexistent/c",
            "--",
            "true",
        ]);
        assert!(e
            .unwrap_err()
            .starts_with("--changes /nonexistent/c: its directory"));
        let c = parse(&["amvm", "run", "--workspace", "/tmp:overlay", "--", "true"]).unwrap();
        assert!(c.overlay.is_some() && c.spec.mounts[1].writable);
        assert_eq!(c.overlay.unwrap().size, None);
        let e = parse(&["amvm", "run", "--overlay-size", "8m", "--", "true"]).unwrap_err();
        assert!(
            e.starts_with("--overlay-size needs a writable workspace"),
            "{e}"
        );
        let e = parse(&[
            "amvm",
            "run",
            "--workspace",
            "/tmp",
            "--overlay-size",
            "8m",
            "--",
            "true",
        ]);
        assert!(e.unwrap_err().starts_with("--overlay-size needs"));
        let ov = |size: &str| {
            parse(&[
                "amvm",
                "run",
                "--workspace",
                "/tmp:overlay",
                "--overlay-size",
                size,
                "--",
                "true",
            ])
            .map(|c| c.overlay.unwrap().size.unwrap())
        };
        assert_eq!(ov("8m"), Ok(8 << 20));
        assert_eq!(ov("1G"), Ok(1 << 30));
        assert_eq!(ov("64MiB"), Ok(64 << 20));
        assert_eq!(ov("2048k"), Ok(2 << 20));
        assert_eq!(ov("1048576"), Ok(1 << 20));
        for (bad, why) in [
            ("", "say a size"),
            ("m", "say a size"),
            ("1.5m", "the suffix"),
            ("8x", "the suffix"),
            ("8mm", "the suffix"),
            ("1k", "at least 1m"),
            ("99999999999999999999", "too large"),
            ("99999999999g", "too large"),
        ] {
            let e = ov(bad).unwrap_err();
            assert!(
                e.starts_with(&format!("--overlay-size {bad:?}: {why}")),
                "{bad}: {e}"
            );
        }
        let c = parse(&["amvm", "run", "--workspace", "/tmp", "--", "true"]).unwrap();
        assert!(c.overlay.is_none() && !c.spec.mounts[1].writable);
        assert_eq!(c.spec.cwd, b"/workspace");
        assert_eq!(c.shares.len(), 2);
        // Volumes and tmpfs mounts.
        let c = parse(&[
            "amvm",
            "run",
            "-v",
            "/tmp:/data",
            "-v",
            "/etc:/cfg:rw",
            "--tmpfs",
            "/scratch:size=1m,noexec",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(
            c.shares[1],
            ("vol0".to_string(), PathBuf::from("/tmp"), false)
        );
        assert_eq!(
            c.shares[2],
            ("vol1".to_string(), PathBuf::from("/etc"), true)
        );
        assert!(c.spec.mounts[2].writable && !c.spec.mounts[1].writable);
        assert_eq!(c.spec.tmpfs[0].path, b"/scratch");
        // An EROFS image is a disk, not a share: the guest finds it by its serial.
        let image = std::env::temp_dir().join(format!("amvm-cli-erofs-{}", std::process::id()));
        let mut bytes = vec![0u8; 4096];
        bytes[1024..1028].copy_from_slice(&config::EROFS_MAGIC.to_le_bytes());
        std::fs::write(&image, bytes).unwrap();
        let v = format!("{}:/img", image.display());
        let c = parse(&["amvm", "run", "-v", "/tmp:/data", "-v", &v, "--", "true"]).unwrap();
        std::fs::remove_file(&image).unwrap();
        assert_eq!(c.shares.len(), 2);
        assert_eq!(
            c.disks,
            [config::Disk {
                id: "amvm-disk0".into(),
                image: image.clone()
            }]
        );
        assert_eq!(c.spec.mounts[2].tag, b"disk:amvm-disk0");
        assert_eq!(c.spec.mounts[2].path, b"/img");
        assert!(!c.spec.mounts[2].writable);
        for (bad, why) in [
            (&["-v", "/tmp"][..], "say HOST:GUEST"),
            (&["-v", "/tmp:/d:rx"][..], "mode \"rx\""),
            (&["-v", "/nonexistent:/d"][..], "/nonexistent: No such file"),
            (&["-v", "/tmp:relative"][..], "must be absolute"),
            (&["-v", "/tmp:/usr/x"][..], "cannot mount over /usr/x"),
            (&["-v", "/tmp:/a/../b"][..], "`..` component"),
            (
                &["-v", "/tmp:/d", "-v", "/etc:/d"][..],
                "/d is mounted already",
            ),
            (
                &["--tmpfs", "/s:size=1m,suid"][..],
                "always mounts a tmpfs nosuid,nodev",
            ),
            (&["--tmpfs", "/s:bogus"][..], "unknown option"),
            (&["--tmpfs", "/s:size=1m;rm"][..], "bad value for size"),
            (&["--tmpfs", "/"][..], "cannot mount over /"),
        ] {
            let mut args = vec!["amvm", "run"];
            args.extend_from_slice(bad);
            args.extend_from_slice(&["--", "true"]);
            let e = parse(&args).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
