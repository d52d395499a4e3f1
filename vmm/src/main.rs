//! `amvm`: parse the command line and run the subcommand (a run: `sandbox::run`).
//! amvm's own failures exit 125 with one line on stderr; a timeout exits 124; a signal that
//! ends the run before the workload does exits 128+N.

use amvm::cli::{Cli, Command, ImageCommand};
use amvm::exit;
use clap::{CommandFactory, Parser};
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    // One malloc arena for all threads: glibc shrinks a thread's own arena with a one-time
    // open("/proc/sys/vm/overcommit_memory"), which no thread's seccomp filter allows (nor
    // should it); the main arena shrinks with brk(2). amvm has a handful of threads, so one
    // arena costs nothing measurable.
    // SAFETY: mallopt(3) with integer arguments, before any allocation by another thread.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    // Before anything opens a descriptor: drop whatever the caller leaked to us.
    if let Err(e) = amvm::jail::close_inherited_fds() {
        eprintln!("amvm: {e}");
        return ExitCode::from(exit::AMVM_FAILURE);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // The OCI runtime: as `amvm-runc` (the name engines are pointed at) or `amvm oci ...`.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let as_runc = argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "amvm-runc");
    if as_runc || argv.get(1).is_some_and(|a| a == "oci") {
        let rest = argv.iter().skip(if as_runc { 1 } else { 2 }).cloned();
        let args = std::iter::once(std::ffi::OsString::from("amvm-runc")).chain(rest);
        return match amvm::oci::OciCli::try_parse_from(args) {
            Ok(cli) => ExitCode::from(amvm::oci::main(cli)),
            Err(e) => usage_error(e, Some("oci")),
        };
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // The subcommand the user named (the first word that is not a flag), for the hint.
            let sub = argv
                .iter()
                .skip(1)
                .filter_map(|a| a.to_str())
                .find(|a| !a.starts_with('-'))
                .filter(|a| Cli::command().find_subcommand(a).is_some());
            return usage_error(e, sub);
        }
    };
    match cli.command {
        Command::Run(args) => sandbox_result(amvm::sandbox::run::run(*args).map(|code| {
            let _ = std::io::stdout().flush();
            ExitCode::from(code)
        })),
        Command::Image(cmd) => image(cmd),
        Command::Apply(args) => apply(args),
        Command::Changes(args) => {
            let mut out = std::io::stdout().lock();
            match amvm::changes::diff::print(&args.changes, args.base.as_deref(), &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("amvm: changes: {e}");
                    ExitCode::from(exit::AMVM_FAILURE)
                }
            }
        }
        Command::Create(args) => {
            sandbox_result(amvm::sandbox::supervisor::create(*args).map(|id| {
                println!("{id}");
                ExitCode::SUCCESS
            }))
        }
        Command::Serve { socket } => {
            sandbox_result(amvm::sandbox::serve::serve(socket).map(|()| ExitCode::SUCCESS))
        }
        Command::Gateway(args) => gateway(args),
        Command::Exec(args) => sandbox_result(amvm::sandbox::commands::exec(args).map(|code| {
            let _ = std::io::stdout().flush();
            ExitCode::from(code)
        })),
        Command::Cp { src, dest } => {
            let r = amvm::sandbox::copy::cli(&src, &dest);
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Diff { sandbox } => {
            let r = amvm::sandbox::commands::diff(&sandbox, &mut std::io::stdout().lock());
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Commit { sandbox, dir } => {
            let r = amvm::sandbox::commands::commit(&sandbox, &dir);
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Oci { .. } => unreachable!("dispatched before parsing"),
        Command::Ls { json } => {
            let r = amvm::sandbox::commands::ls(json, &mut std::io::stdout().lock());
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Inspect { sandbox } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox)
                .and_then(|sb| sb.info())
                .and_then(|i| {
                    amvm::sandbox::commands::print_info(&i, &mut std::io::stdout().lock())
                });
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Stop { time, sandbox } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox).and_then(|sb| sb.stop(time));
            sandbox_result(r.map(|i| {
                println!("{}", i.id);
                ExitCode::SUCCESS
            }))
        }
        Command::Pause { sandbox } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox).and_then(|sb| sb.pause());
            sandbox_result(r.map(|i| {
                println!("{}", i.id);
                ExitCode::SUCCESS
            }))
        }
        Command::Resume { sandbox } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox).and_then(|sb| sb.resume());
            sandbox_result(r.map(|i| {
                println!("{}", i.id);
                ExitCode::SUCCESS
            }))
        }
        Command::Snapshot { stop, sandbox, dir } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox)
                .and_then(|sb| sb.snapshot(&dir, stop));
            sandbox_result(r.map(|_| {
                println!("{}", dir.display());
                ExitCode::SUCCESS
            }))
        }
        Command::Fork { n, sandbox } => {
            let r = amvm::sandbox::commands::fork(&sandbox, n);
            sandbox_result(r.map(|ids| {
                for id in ids {
                    println!("{id}");
                }
                ExitCode::SUCCESS
            }))
        }
        Command::Wait { sandbox } => {
            let r = amvm::sandbox::client::Sandbox::open(&sandbox)
                .and_then(|sb| sb.wait())
                .and_then(|i| {
                    amvm::sandbox::commands::print_info(&i, &mut std::io::stdout().lock())
                });
            sandbox_result(r.map(|()| ExitCode::SUCCESS))
        }
        Command::Rm { force, sandboxes } => {
            if amvm::sandbox::commands::rm(force, &sandboxes) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(exit::AMVM_FAILURE)
            }
        }
        Command::Doctor => {
            let ok = amvm::doctor::run(&mut std::io::stdout().lock());
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// `amvm image list|path|rm|import|prune`: the built images in `$AMVM_CACHE/images` and the
/// OCI images in the store (`$AMVM_CACHE/oci`).
fn image(cmd: ImageCommand) -> ExitCode {
    use amvm::image;
    use amvm::store::{self, Store};
    let store = || -> anyhow::Result<Store> { Ok(Store::open(&Store::default_dir()?)?) };
    // A bare word that names a built image is that; anything else is an OCI image's name.
    let built = |name: &str| -> Option<image::Image> {
        let dir = image::images_dir().ok()?;
        image::is_name(name)
            .then(|| image::find(&dir, name).ok())
            .flatten()
    };
    // An imported image; for a name that is in neither place, the error that fits it: a bare
    // word is said as a built image's name (it may be a recipe not yet built).
    let stored = |name: &str| -> anyhow::Result<store::Found> {
        match store()?.for_run(name) {
            Ok(f) => Ok(f),
            Err(store::StoreError::NotFound(_)) if image::is_name(name) => {
                Err(match image::find(&image::images_dir()?, name) {
                    Ok(_) => store::StoreError::NotFound(name.to_string()).into(),
                    Err(e) => e.into(),
                })
            }
            Err(store::StoreError::BadRef(..)) if image::check_name(name).is_err() => {
                Err(match image::check_name(name) {
                    Ok(()) => store::StoreError::NotFound(name.to_string()).into(),
                    Err(e) => e.into(),
                })
            }
            Err(e) => Err(e.into()),
        }
    };
    let run = || -> anyhow::Result<()> {
        match cmd {
            ImageCommand::List => {
                let dir = image::images_dir()?;
                // (name, id, size, when, what)
                let mut rows: Vec<[String; 5]> = image::list(&dir)?
                    .into_iter()
                    .map(|i| {
                        [
                            i.name,
                            "-".into(),
                            i.size_bytes.map_or("?".into(), image::human_size),
                            i.built.unwrap_or_else(|| "?".into()),
                            i.versions.unwrap_or_default(),
                        ]
                    })
                    .collect();
                for r in store()?.list()? {
                    rows.push([
                        r.name,
                        r.id.short().to_string(),
                        image::human_size(r.size),
                        r.stored.chars().take(19).collect::<String>() + "Z",
                        r.source,
                    ]);
                }
                if rows.is_empty() {
                    eprintln!(
                        "amvm: no images (build one with images/harness/build, or amvm image \
                         import an archive)"
                    );
                    return Ok(());
                }
                let width = rows.iter().map(|r| r[0].len()).max().unwrap_or(4).max(4);
                let mut out = std::io::stdout().lock();
                let _ = writeln!(
                    out,
                    "{:width$}  {:12}  {:>8}  {:20}  CONTENTS",
                    "NAME", "ID", "SIZE", "WHEN"
                );
                for [name, id, size, when, what] in rows {
                    let _ = writeln!(out, "{name:width$}  {id:12}  {size:>8}  {when:20}  {what}");
                }
            }
            ImageCommand::Path { name } => match built(&name) {
                Some(i) => println!("{}", i.rootfs.display()),
                None => println!("{}", stored(&name)?.root.display()),
            },
            ImageCommand::Rm { name } => match built(&name) {
                Some(_) => {
                    image::remove(&image::images_dir()?, &name)?;
                    eprintln!("amvm: removed image {name}");
                }
                None => {
                    stored(&name)?;
                    let (r, freed) = store()?.remove(&name)?;
                    eprintln!(
                        "amvm: removed image {} ({}; {} freed)",
                        r.name,
                        r.id.short(),
                        image::human_size(freed)
                    );
                }
            },
            ImageCommand::Import { path, name } => {
                let s = store()?;
                let mut say = |line: String| eprintln!("amvm: {line}");
                let records = store::import::import(&s, &path, name.as_deref(), &mut say)?;
                for r in records {
                    println!("{}", r.name);
                    eprintln!(
                        "amvm: imported {} ({}, {} layers, {})",
                        r.name,
                        r.id.short(),
                        r.layers.len(),
                        image::human_size(r.size)
                    );
                }
            }
            ImageCommand::Pull {
                plain_http,
                ca,
                reference,
            } => {
                let s = store()?;
                let mut say = |line: String| eprintln!("amvm: {line}");
                let opts = store::pull::PullOptions { plain_http, ca };
                let r = store::pull::pull(&s, &reference, &opts, &mut say)?;
                println!("{}", r.name);
                eprintln!(
                    "amvm: pulled {} ({}, {} layers, {})",
                    r.name,
                    r.id.short(),
                    r.layers.len(),
                    image::human_size(r.size)
                );
            }
            ImageCommand::Prune => {
                let freed = store()?.prune()?;
                eprintln!(
                    "amvm: pruned the image store: {} freed",
                    image::human_size(freed)
                );
            }
        }
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("amvm: {e:#}");
            ExitCode::from(exit::AMVM_FAILURE)
        }
    }
}

/// `amvm apply CHANGES DIR`.
fn apply(args: amvm::cli::ApplyArgs) -> ExitCode {
    use amvm::changes::apply::{apply, Options};
    let opts = Options {
        check_only: args.check,
        skip_refused: args.skip_refused,
        any_symlink: false,
    };
    let mut say = |line: String| eprintln!("amvm: apply: {line}");
    match apply(&args.changes, &args.dir, opts, &mut say) {
        Ok(r) if args.check => {
            eprintln!(
                "amvm: apply: {}: checked, {} entries would be refused",
                args.changes.display(),
                r.refused
            );
            ExitCode::from(u8::from(r.refused > 0))
        }
        Ok(r) => {
            eprintln!(
                "amvm: apply: applied {} entries to {} ({} refused, {} neutralised)",
                r.applied,
                args.dir.display(),
                r.refused,
                r.neutralised
            );
            match (r.refused, r.applied) {
                (0, _) => ExitCode::SUCCESS,
                (_, 1..) => ExitCode::from(1),
                _ => ExitCode::from(exit::AMVM_FAILURE),
            }
        }
        Err(e) => {
            eprintln!("amvm: apply: {e}");
            ExitCode::from(exit::AMVM_FAILURE)
        }
    }
}

/// A sandbox command's end: its own status, or one line and 125.
/// `amvm gateway`: serve until SIGINT, SIGTERM or SIGHUP, then remove the socket.
fn gateway(args: amvm::cli::GatewayArgs) -> ExitCode {
    use amvm_egress::gateway::{bind, ConfigFile, Gateway, Options};
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("amvm: gateway: {e}");
        ExitCode::from(exit::AMVM_FAILURE)
    };
    let file = match args.config.as_deref().map(ConfigFile::read).transpose() {
        Ok(f) => f.unwrap_or_default(),
        Err(e) => return fail(&e),
    };
    let Some(listen) = args.listen.or(file.listen.clone()) else {
        return fail(&"no socket to listen on: give --listen SOCK (or listen in --config)");
    };
    let opts = Options {
        listen,
        allow: file.allow.iter().cloned().chain(args.allow).collect(),
        credentials: file
            .credential_args()
            .into_iter()
            .chain(args.credential)
            .collect(),
        ca: args.ca.or(file.ca),
        log: args.log.or(file.log),
        max_streams: args.max_streams.or(file.max_streams).unwrap_or(64),
        max_request_bytes: args
            .max_request_bytes
            .or(file.max_request_bytes)
            .unwrap_or(32 << 20),
        idle_timeout: std::time::Duration::from_secs(
            args.idle_timeout
                .or(file.idle_timeout)
                .unwrap_or(300)
                .max(1),
        ),
    };
    if opts.allow.is_empty() {
        return fail(&"no --allow rule: nothing could go through");
    }
    let gw = match Gateway::new(&opts) {
        // A stream comes from a VMM: its sandbox is the one of this user's with that VMM.
        Ok(g) => g.with_namer(Box::new(|pid| {
            let pid = u32::try_from(pid).ok()?;
            let info = amvm::sandbox::list()
                .ok()?
                .into_iter()
                .find(|i| i.vmm_pid == pid)?;
            Some(info.name.unwrap_or(info.id))
        })),
        Err(e) => return fail(&e),
    };
    // Blocked before any thread starts (they inherit the mask); a thread waits for them.
    let signals = match amvm::signals::Signals::block() {
        Ok(s) => s,
        Err(e) => return fail(&format!("blocking signals: {e}")),
    };
    let listener = match bind(&opts.listen) {
        Ok(l) => l,
        Err(e) => return fail(&e),
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _ = signals.wait();
        let _ = tx.send(());
    });
    let stop = async move {
        // The runtime's own blocking pool waits for the signal thread's word.
        let _ = tokio::task::spawn_blocking(move || rx.recv()).await;
    };
    eprintln!(
        "amvm: gateway on {} for {}",
        opts.listen.display(),
        opts.allow.join(", ")
    );
    let r = gw.serve(listener, stop);
    let _ = std::fs::remove_file(&opts.listen);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn sandbox_result(r: Result<ExitCode, amvm::sandbox::SandboxError>) -> ExitCode {
    r.unwrap_or_else(|e| {
        eprintln!("amvm: {e}");
        ExitCode::from(exit::AMVM_FAILURE)
    })
}

/// clap's own help/version go to stdout with 0; any usage error is one line and 125, pointing
/// at the help of `sub`command when the user named one.
fn usage_error(e: clap::Error, sub: Option<&str>) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            eprintln!("amvm: missing subcommand (try `amvm run -- COMMAND`, or amvm --help)");
            ExitCode::from(exit::AMVM_FAILURE)
        }
        _ => {
            // clap's message is several lines; keep the first (and what it introduces with ':').
            let msg = e.render().to_string();
            let mut lines = msg.lines().map(str::trim).filter(|l| !l.is_empty());
            let mut first = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            if first.ends_with(':') {
                first = format!("{first} {}", lines.next().unwrap_or_default());
            }
            match sub {
                Some(sub) => eprintln!("amvm: {first} (see amvm {sub} --help)"),
                None => eprintln!("amvm: {first} (see amvm --help)"),
            }
            ExitCode::from(exit::AMVM_FAILURE)
        }
    }
}
