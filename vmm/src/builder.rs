//! The boot recipe: one function that reads top to bottom — KVM, memory, devices, kernel,
//! initramfs, command line, vCPUs, start — then waits for the guest and turns its end into an
//! exit status. Comments mark where order matters.

use crate::arch::x86_64::layout;
use crate::boot::{self, initramfs};
use crate::config::RunConfig;
use crate::fs::Virtiofsd;
use crate::output::{ConsoleSink, Report};
use crate::seccomp::{Policy, SeccompError, ThreadKind};
use crate::signals::{self, Signals};
use crate::vstate::kvm::{Kvm, KvmError};
use crate::vstate::memory::{self, MemoryError};
use crate::vstate::pause::Pauser;
use crate::vstate::vcpu::{BootEntry, VcpuError, VcpuStop};
use crate::vstate::vm::{Vm, VmError};
use amvm_devices::bus::{Bus, BusDevice, BusError};
use amvm_devices::legacy::{self, EventFdTrigger, ResetLine, Uart};
use amvm_devices::virtio::block::BlockDevice;
use amvm_devices::virtio::fs::VhostUserFs;
use amvm_devices::virtio::{MmioError, MmioTransport, VIRTIO_MMIO_QUEUE_NOTIFY};
use amvm_devices::vsock::device::VsockDevice;
use amvm_egress::Egress;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Fs(#[from] crate::fs::FsError),
    #[error(transparent)]
    Egress(#[from] amvm_egress::EgressError),
    #[error("virtio-mmio: {0}")]
    Mmio(#[from] MmioError),
    #[error("vsock device: {0}")]
    Vsock(io::Error),
    #[error("the disk image {}: {}", .0.display(), .1)]
    Disk(std::path::PathBuf, io::Error),
    #[error("starting the control channel: {0}")]
    Control(io::Error),
    #[error("event fd: {0}")]
    EventFd(io::Error),
    #[error("starting a vCPU thread: {0}")]
    Thread(io::Error),
    #[error("timed out after {0} s")]
    Timeout(u64),
    #[error(transparent)]
    Seccomp(#[from] SeccompError),
    #[error(transparent)]
    Jail(#[from] crate::jail::JailError),
    #[error(transparent)]
    Overlay(#[from] crate::overlay::OverlayError),
    #[error("setting up signal forwarding: {0}")]
    Signals(io::Error),
    #[error(transparent)]
    Pause(#[from] crate::vstate::pause::PauseError),
    #[error("interrupted by {}: {why}", signals::name(*.sig))]
    Interrupted { sig: i32, why: &'static str },
    #[error("restoring the snapshot: {0}")]
    Restore(String),
    #[error("the guest failed: {error}{}", console_note(.console))]
    GuestFailed { error: String, console: String },
    #[error("the guest stopped ({how}) without reporting an exit status{}{}", .protocol.as_ref().map(|p| format!(" (channel: {p})")).unwrap_or_default(), console_note(.console))]
    NoStatus {
        how: String,
        protocol: Option<String>,
        console: String,
    },
}

/// The console's last 20 non-empty lines for an error report; when the kernel panicked, its
/// panic line is always among them (the call trace after it can be longer than 20 lines).
fn console_note(console: &str) -> String {
    let lines: Vec<&str> = console.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return " (no console output; run with --console to see the guest's kernel log)".into();
    }
    let mut shown: Vec<&str> = lines[lines.len().saturating_sub(20)..].to_vec();
    if let Some(panic) = lines.iter().find(|l| l.contains(crate::output::PANIC_MARK)) {
        if !shown.contains(panic) {
            shown.splice(0..2.min(shown.len()), [*panic, "..."]);
        }
    }
    format!("; the guest console's last lines:\n{}", shown.join("\n"))
}

impl RunError {
    /// The exit status amvm ends with: 124 for a timeout, 128+N when signal N ended the run
    /// before the workload did, 125 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Timeout(_) => crate::exit::TIMEOUT,
            RunError::Interrupted { sig, .. } => (128 + sig).clamp(0, 255) as u8,
            _ => crate::exit::AMVM_FAILURE,
        }
    }
}

/// How long the vCPUs have to leave KVM_RUN when paused (they take microseconds; a vCPU that
/// does not is stuck in the host kernel, and the pause is refused).
pub(crate) const PAUSE_LIMIT: Duration = Duration::from_secs(5);

/// How long the workload has to exit after amvm forwards it a signal, before amvm tears the VM
/// down itself (a second signal does that at once).
const SIGNAL_GRACE: Duration = Duration::from_secs(10);

/// Boot the VM described by `cfg`, run its workload, return the workload's exit status.
///
/// On return the vCPU threads may still be inside KVM_RUN: the caller exits the process.
/// `ctl`: a session's channel from its supervisor (vmmctl.rs: pause, resume).
pub fn run(cfg: &RunConfig, t: &Timeline, ctl: Option<OwnedFd>) -> Result<u8, RunError> {
    let deadline = cfg.timeout.map(|t| (Instant::now() + t, t.as_secs()));
    // While this is the only thread: no privilege gain by exec, an empty network namespace and
    // a private mount namespace (jail.rs). Everything amvm starts inherits them.
    crate::jail::no_new_privs()?;
    crate::jail::enter_namespaces()?;
    t.mark("namespaces entered");
    // An overlay workspace is mounted in that namespace, where only amvm and virtiofsd see it.
    let overlay = match &cfg.overlay {
        Some(ov) => {
            let scratch = ov.scratch.as_deref().ok_or(RunError::Overlay(
                crate::overlay::OverlayError::Scratch(
                    ov.lower.clone(),
                    io::Error::other("no scratch directory was made"),
                ),
            ))?;
            crate::overlay::mount(ov, scratch)?;
            t.mark("overlay mounted");
            Some(crate::overlay::merged(scratch))
        }
        None => None,
    };
    // Before any thread starts (they inherit the mask): SIGINT/SIGTERM/SIGHUP wait in a
    // signalfd for the loop below, which forwards them to the workload.
    let signals = Signals::block().map_err(RunError::Signals)?;
    // Every thread started from here on filters itself (seccomp.rs); the guest runs only once
    // all of them, this one last, have.
    let policy = Policy::new(cfg.seccomp)?;
    t.mark("seccomp filters compiled");

    // Host-side inputs first (cheap, and the user's to fix), then KVM.
    // The guest connects only once amvm is in its empty root (jail.rs), where the socket
    // amvm checks here is bound in at EGRESS_IN_ROOT.
    let egress = match &cfg.egress {
        Some(sock) => {
            let mut e = Egress::new(sock, cfg.egress_log.as_deref())?;
            e.connect_through(Path::new(crate::jail::EGRESS_IN_ROOT));
            Some(e)
        }
        None => None,
    };
    // Read-only disks: each image opened read-only, now, while the host's tree is in reach.
    let images = cfg
        .disks
        .iter()
        .map(|d| {
            let f =
                std::fs::File::open(&d.image).map_err(|e| RunError::Disk(d.image.clone(), e))?;
            let state = crate::snapshot::DiskState::of(&d.id, &d.image, &f)
                .map_err(|e| RunError::Disk(d.image.clone(), e))?;
            Ok((state, f))
        })
        .collect::<Result<Vec<_>, RunError>>()?;
    // Shared with the vCPU threads (a parked one saves its state for a snapshot with it).
    let kvm = Arc::new(Kvm::open()?);
    t.mark("egress checked, KVM open");
    // Guest RAM while amvm still has the capabilities to make its huge-page tmpfs (memory.rs).
    // A restore maps the snapshot's memory file copy-on-write instead, once the snapshot is
    // known to fit this machine: nothing is copied, and the shares relay (below).
    let mem_bytes = cfg.mem_mib << 20;
    let restore = cfg.restore.as_deref();
    let mem = match restore {
        Some(r) => {
            check_restore(cfg, &r.state)?;
            check_disks(&r.state.devices.disks, &images)?;
            let mem = memory::restore_private(cfg.mem_mib, &r.memory)?;
            t.mark("guest memory mapped from the snapshot (copy-on-write)");
            mem
        }
        None => {
            let (mem, backing) = memory::create(cfg.mem_mib, cfg.huge_pages)?;
            t.mark(match backing {
                memory::Backing::HugeTmpfs => "guest memory created (huge-page tmpfs)",
                memory::Backing::Memfd => "guest memory created (memfd)",
            });
            mem
        }
    };
    // A snapshot of a restored guest finds the pages it wrote here (memory::write_snapshot);
    // opened now, while /proc is still in reach.
    let pagemap = match restore {
        Some(_) => Some(
            std::fs::File::open("/proc/self/pagemap")
                .map_err(|e| RunError::Restore(format!("/proc/self/pagemap: {e}")))?,
        ),
        None => None,
    };
    // The shares' backends: every virtiofsd is started now, and each is handshaken once guest
    // memory and the kernel are loaded (their start-up overlaps that work), so a share that
    // cannot be served still fails the run before the guest exists. They are killed when
    // `backends` drops, on every way out of this function (and with amvm's main thread in any
    // case).
    if !cfg.shares.is_empty() {
        let stamps = crate::config::cache_dir().map(|c| c.join("virtiofsd-checked"));
        crate::fs::check_version(&cfg.virtiofsd, stamps.as_deref())?;
    }
    let mut backends = Vec::with_capacity(cfg.shares.len());
    let mut fs_streams = Vec::with_capacity(cfg.shares.len());
    for (tag, dir, writable) in &cfg.shares {
        let stable = tag == crate::config::TAG_SYSTEM;
        // The workspace's owner appears in the guest as the workload's user, and what the
        // workload makes there is the host user's who runs amvm (fs::translate_ids): a
        // root-owned checkout works for the unprivileged workload, as root and as any user.
        let ids = if tag == crate::config::TAG_WORKSPACE {
            workspace_ids(dir, cfg.spec.uid, cfg.spec.gid)
        } else {
            Vec::new()
        };
        // An overlay workspace is served from its merged directory (whose writes go to the
        // upper layer); an rw volume is the host directory itself.
        let (dir, writable) = match &overlay {
            Some(merged) if tag == crate::config::TAG_WORKSPACE => (merged, true),
            _ => (dir, *writable),
        };
        // A sandbox's directory (its session socket's) holds the vhost-user socket for the
        // moment it is bound, so nothing is left outside it whenever this process dies.
        let socket_dir = cfg.session.as_deref().and_then(Path::parent);
        let (backend, stream) = Virtiofsd::spawn(
            &cfg.virtiofsd,
            dir,
            stable,
            writable,
            &ids,
            &policy,
            socket_dir,
        )?;
        backends.push(backend);
        fs_streams.push((tag, stream));
    }
    t.mark("virtiofsd started");

    // The irqchip is created with the VM, before any vCPU (KVM requires that order).
    let vm = Vm::new(&kvm, &mem)?;
    if let Some(r) = restore {
        vm.restore_state(&r.state.vm)?;
    }
    t.mark("VM created");

    // Devices. COM1: kernel console; i8042: the exit path; virtio-vsock: the control channel;
    // virtio-fs: the shares.
    let exit_evt = EventFdTrigger::new().map_err(RunError::EventFd)?;
    let report = Arc::new(Mutex::new(Report::default()));
    let console = ConsoleSink::new(cfg.console);
    let mut pio = Bus::new();
    let mut mmio = Bus::new();
    attach_uart(
        &vm,
        &mut pio,
        legacy::COM1_BASE,
        legacy::COM1_IRQ,
        console.clone(),
    )?;
    // The i8042 reset (the guest's `reboot=k`) has its own event, so the end of a run can tell
    // a guest that reset itself from one that crashed (a triple fault and nothing else).
    let reset_evt = EventFdTrigger::new().map_err(RunError::EventFd)?;
    let reset = ResetLine::new(reset_evt.try_clone().map_err(RunError::EventFd)?);
    pio.insert(
        legacy::I8042_BASE,
        legacy::I8042_PORTS,
        Arc::new(Mutex::new(reset)),
    )?;
    let (ports, control) = match &cfg.session {
        // A session: the control and exec streams go to its supervisor, which speaks the
        // protocol (sandbox/); this process only moves their bytes.
        Some(_) => crate::control::session(egress),
        None => crate::control::start(
            &policy,
            report.clone(),
            egress,
            &cfg.spec.encode(),
            cfg.spec.stdin,
        )
        .map_err(RunError::Control)?,
    };
    let p = policy.clone();
    policy.expect_thread();
    let mut vsock = VsockDevice::with_thread_hook(
        GUEST_CID,
        ports,
        Box::new(move || p.enter(ThreadKind::EventLoop)),
    )
    .map_err(|e| {
        policy.forget_thread();
        RunError::Vsock(e)
    })?;
    let vsock_hold = vsock.hold();
    if restore.is_some() {
        // The guest's streams were the old host's: it is told they are gone (TRANSPORT_RESET)
        // once the restored transport activates the device.
        vsock.set_restored();
    }
    // Every transport (slot order: vsock, then the shares) and share, for a snapshot.
    let mut transports = Vec::with_capacity(1 + cfg.shares.len());
    let mut shares: Vec<(String, Arc<Mutex<VhostUserFs>>)> = Vec::with_capacity(cfg.shares.len());
    let (entry, transport) = attach_virtio(&vm, &mem, &mut mmio, 0, Arc::new(Mutex::new(vsock)))?;
    let mut virtio_entries = vec![entry];
    transports.push(transport);
    t.mark("legacy devices and vsock attached");

    // Guest memory contents: kernel, then the initramfs above it, then the boot tables (a
    // restored guest has them all already).
    let boot = match restore {
        Some(_) => None,
        None => {
            let kernel = boot::load_kernel(&mem, &cfg.kernel)?;
            t.mark("kernel loaded");
            let initrd = build_initramfs();
            let initrd_addr = boot::load_initramfs(&mem, mem_bytes, &kernel, &initrd)?;
            let initrd_len = initrd.len();
            // The guest has its copy: the VMM's own memory should not hold two more for the
            // whole run.
            drop(initrd);
            release_guest_init_pages();
            t.mark("kernel and initramfs loaded");
            Some((kernel.entry, initrd_addr, initrd_len))
        }
    };

    // The shares' vhost-user handshakes, now that their virtiofsd had the time to start.
    for (i, ((tag, stream), backend)) in fs_streams.into_iter().zip(&mut backends).enumerate() {
        let mut dev = VhostUserFs::new(tag, stream).map_err(|e| backend.failure(e.to_string()))?;
        if let Some(r) = restore {
            // Its new virtiofsd takes the old one's state (the inodes and files the guest
            // holds) before the restored transport hands it the guest's queues.
            let (_, saved) = &r.state.devices.shares[i];
            dev.load_backend_state(&saved.blob)
                .map_err(|e| RunError::Restore(format!("share {tag}: {e}")))?;
            // It must not map guest RAM (a private mapping): the device relays through a
            // shadow region of its own, on a thread filtered as the vsock worker is.
            let shadow = memory::shared(amvm_devices::virtio::fs::SHADOW_LEN)?;
            let p = policy.clone();
            policy.expect_thread();
            dev.relay_through(shadow, Box::new(move || p.enter(ThreadKind::EventLoop)))
                .map_err(|e| {
                    policy.forget_thread();
                    RunError::Restore(format!("share {tag}: its relay: {e}"))
                })?;
        }
        let slot = 1 + i as u64;
        let dev = Arc::new(Mutex::new(dev));
        let (entry, transport) = attach_virtio(&vm, &mem, &mut mmio, slot, dev.clone())?;
        virtio_entries.push(entry);
        transports.push(transport);
        shares.push((tag.to_string(), dev));
    }
    t.mark("virtio-fs handshakes done");
    // The disks after the shares, each its own worker thread, filtered as it starts.
    let mut disks = Vec::with_capacity(images.len());
    for (i, (disk, file)) in images.into_iter().enumerate() {
        let p = policy.clone();
        policy.expect_thread();
        let dev = BlockDevice::new(file, &disk.id, Box::new(move || p.enter(ThreadKind::Block)))
            .map_err(|e| {
                policy.forget_thread();
                RunError::Disk(disk.image.clone(), e)
            })?;
        disks.push((dev.hold(), disk));
        let slot = (1 + cfg.shares.len() + i) as u64;
        let (entry, transport) =
            attach_virtio(&vm, &mem, &mut mmio, slot, Arc::new(Mutex::new(dev)))?;
        virtio_entries.push(entry);
        transports.push(transport);
    }
    if !disks.is_empty() {
        t.mark("disks attached");
    }
    // Nothing needs the host's tree any more: the kernel is loaded, /dev/kvm is open, and each
    // virtiofsd answered its handshake, so it is in a mount namespace of its own. amvm moves
    // into an empty root (jail.rs), then drops its capabilities (as root, virtiofsd's sandbox
    // took what it needed from ours at exec: with no_new_privs an exec cannot gain any). The
    // threads started above dropped their own as they filtered themselves (seccomp.rs).
    let mut sockets = Vec::with_capacity(2);
    if let Some(e) = &cfg.egress {
        sockets.push((e.as_path(), crate::jail::EGRESS_IN_ROOT));
    }
    if let Some(g) = &cfg.session {
        sockets.push((g.as_path(), crate::jail::GUEST_IN_ROOT));
    }
    crate::jail::enter_empty_root(&sockets)?;
    crate::jail::drop_capabilities()?;
    t.mark("in the empty root, capabilities dropped");
    if let Some((_, initrd_addr, initrd_len)) = boot {
        let cmdline = boot::cmdline(cfg.console, &virtio_entries)?;
        boot::configure_pvh(
            &mem,
            mem_bytes,
            &cmdline,
            (initrd_addr, initrd_len),
            cfg.cpus,
        )?;
    }

    // vCPUs: all configured before any runs; vCPU 0 boots, the others wait for the guest's SIPI
    // (or each continues where the snapshot has it).
    let mut vcpus = Vec::with_capacity(cfg.cpus.into());
    for id in 0..cfg.cpus {
        let vcpu = vm.create_vcpu(id)?;
        match (restore, boot) {
            (Some(r), _) => vcpu.restore_state(&kvm, cfg.cpus, &r.state.vcpus[usize::from(id)])?,
            (None, Some((entry, _, _))) => {
                let boot = (id == 0).then_some(BootEntry {
                    entry,
                    start_info: layout::PVH_INFO_START,
                });
                vcpu.configure(&kvm, cfg.cpus, boot)?;
            }
            (None, None) => unreachable!("a boot without a kernel"),
        }
        vcpus.push(vcpu);
    }
    // The devices after the vCPUs: a restored transport may interrupt the guest at once (the
    // vsock device's TRANSPORT_RESET event), and an interrupt delivered before a vCPU's LAPIC
    // is restored would be wiped by it.
    if let Some(r) = restore {
        for (i, (transport, state)) in transports
            .iter()
            .zip(&r.state.devices.transports)
            .enumerate()
        {
            transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .restore_state(state)
                .map_err(|e| RunError::Restore(format!("device {i}: {e}")))?;
        }
        t.mark("devices restored");
    }
    let (pio, mmio) = (Arc::new(pio), Arc::new(mmio));
    // `amvm pause`: the vCPUs are kicked out of KVM_RUN by a signal whose handler is set now,
    // before the filters (they refuse rt_sigaction).
    let pauser = Arc::new(Pauser::default());
    crate::vstate::pause::install_kick_handler()?;
    let stops: Arc<Mutex<Vec<Result<VcpuStop, VcpuError>>>> = Arc::default();
    for (id, vcpu) in vcpus.into_iter().enumerate() {
        let (pio, mmio, stops) = (pio.clone(), mmio.clone(), stops.clone());
        let kvm = kvm.clone();
        let pauser = pauser.clone();
        let done = exit_evt.try_clone().map_err(RunError::EventFd)?;
        let p = policy.clone();
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .stack_size(amvm_devices::THREAD_STACK_SIZE)
            .spawn(move || {
                p.enter_vcpu();
                let r = vcpu.run(&kvm, &pio, &mmio, &pauser);
                stops.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                let _ = done.0.write(1);
            })
            .map_err(RunError::Thread)?;
    }
    // vCPU threads keep using guest memory and the VM until the process exits (this thread
    // returns without dropping them: `ManuallyDrop`); a snapshot reads both meanwhile.
    let (vm, mem) = (
        std::mem::ManuallyDrop::new(vm),
        std::mem::ManuallyDrop::new(mem),
    );
    let machine = crate::snapshot::take::Machine {
        vm: &vm,
        mem: &mem,
        pauser: &pauser,
        transports: &transports,
        shares: &shares,
        vsock: &vsock_hold,
        disks: &disks,
        pagemap: pagemap.as_ref(),
        mem_mib: cfg.mem_mib,
        cpus: cfg.cpus,
    };
    // Last: this thread's filter, once every other thread has its own; then the vCPUs run.
    policy.seal()?;
    t.mark("vCPUs released (every thread filtered)");

    // Wait for the guest to stop; forward signals meanwhile.
    // As a File: read(2)/write(2), which the main thread's filter allows (a UnixStream's
    // recv/send are recvfrom/sendto).
    let mut ctl = ctl.map(std::fs::File::from);
    let epoll =
        Waiter::new(&[&exit_evt, &reset_evt], &signals, ctl.as_ref()).map_err(RunError::EventFd)?;
    let mut forwarded: Option<(i32, Instant)> = None;
    loop {
        let grace_end = forwarded.map(|f| f.1);
        let until = [deadline.map(|d| d.0), grace_end]
            .into_iter()
            .flatten()
            .min();
        match epoll.wait(until).map_err(RunError::EventFd)? {
            Wake::Stopped => break,
            Wake::Control => {
                let Some(c) = ctl.as_mut() else { continue };
                let served = crate::vmmctl::serve_one(c, |req, fds| match req {
                    crate::vmmctl::Request::Pause => {
                        pauser.pause(PAUSE_LIMIT).map_err(|e| e.to_string())?;
                        tracing::debug!("vCPUs paused");
                        Ok(String::new())
                    }
                    crate::vmmctl::Request::Resume => {
                        pauser.resume();
                        tracing::debug!("vCPUs resumed");
                        Ok(String::new())
                    }
                    crate::vmmctl::Request::Snapshot => machine.snapshot(fds),
                });
                if !matches!(served, Ok(true)) {
                    // The supervisor is gone (its death kills this process too): stop
                    // watching the channel.
                    if let Some(c) = ctl.take() {
                        epoll.forget(&c).map_err(RunError::EventFd)?;
                    }
                }
            }
            Wake::Signal => {
                while let Some(sig) = signals.next().map_err(RunError::Signals)? {
                    if let Some((first, _)) = forwarded {
                        tracing::debug!("second signal {sig}: tearing down");
                        return Err(RunError::Interrupted {
                            sig: first,
                            why: "a second signal arrived before the workload exited",
                        });
                    }
                    tracing::debug!("forwarding signal {sig} to the workload");
                    control.signal(sig);
                    forwarded = Some((sig, Instant::now() + SIGNAL_GRACE));
                }
            }
            Wake::Time => {
                if let Some((d, secs)) = deadline {
                    if Instant::now() >= d {
                        return Err(RunError::Timeout(secs));
                    }
                }
                if let Some((sig, end)) = forwarded {
                    if Instant::now() >= end {
                        return Err(RunError::Interrupted {
                            sig,
                            why: "the workload did not exit within 10 s of it",
                        });
                    }
                }
            }
        }
    }

    t.mark("the guest stopped");
    let stops = stops.lock().unwrap_or_else(|p| p.into_inner());
    let failure = stops
        .iter()
        .find_map(|r| r.as_ref().err().map(ToString::to_string));
    let report = report.lock().unwrap_or_else(|p| p.into_inner());
    let reset = reset_evt.0.read().is_ok();
    if cfg.session.is_some()
        && failure.is_none()
        && reset
        && !console.tail().contains(crate::output::PANIC_MARK)
    {
        // A session ends with guest-init's reboot once its supervisor said stop (or left);
        // a kernel panic resets too (panic=-1), and is reported below as a run's is.
        return Ok(0);
    }
    match (report.exit, failure) {
        (Some(code), _) => Ok(code),
        (None, _) if forwarded.is_some() => Err(RunError::Interrupted {
            sig: forwarded.map(|f| f.0).unwrap_or_default(),
            why: "the guest stopped before reporting the workload's status",
        }),
        (None, Some(error)) => Err(RunError::GuestFailed {
            error,
            console: console.tail(),
        }),
        (None, None) => {
            let console = console.tail();
            let stop = stops.iter().find_map(|r| r.as_ref().ok());
            Err(RunError::NoStatus {
                how: how_it_stopped(reset, stop, &console),
                protocol: report.protocol_error.as_ref().map(ToString::to_string),
                console,
            })
        }
    }
}

/// Whether a snapshot's machine is this run's: its state was decoded and checked against
/// this amvm by the caller; here its size, vCPUs and shares against the run's.
fn check_restore(cfg: &RunConfig, state: &crate::snapshot::MachineState) -> Result<(), RunError> {
    let bad = |s: String| Err(RunError::Restore(s));
    state
        .check()
        .map_err(|e| RunError::Restore(e.to_string()))?;
    if state.meta.mem_mib != cfg.mem_mib {
        return bad(format!(
            "it has {} MiB of guest RAM, this VM {} MiB",
            state.meta.mem_mib, cfg.mem_mib
        ));
    }
    if state.meta.cpus != cfg.cpus {
        return bad(format!(
            "it has {} vCPUs, this VM {}",
            state.meta.cpus, cfg.cpus
        ));
    }
    let saved: Vec<&str> = state
        .devices
        .shares
        .iter()
        .map(|(t, _)| t.as_str())
        .collect();
    let here: Vec<&str> = cfg.shares.iter().map(|(t, _, _)| t.as_str()).collect();
    if saved != here {
        return bad(format!(
            "its shares are [{}], this VM's [{}]",
            saved.join(", "),
            here.join(", ")
        ));
    }
    if cfg.session.is_none() {
        return bad("only a sandbox (a session) can be restored".into());
    }
    Ok(())
}

/// A restore's disks must be the snapshot's, unchanged: the guest's page cache holds their
/// blocks as they were.
fn check_disks(
    saved: &[crate::snapshot::DiskState],
    here: &[(crate::snapshot::DiskState, std::fs::File)],
) -> Result<(), RunError> {
    let bad = |s: String| Err(RunError::Restore(s));
    if saved.len() != here.len() {
        return bad(format!(
            "it has {} read-only disks, this VM {}",
            saved.len(),
            here.len()
        ));
    }
    for (was, (now, _)) in saved.iter().zip(here) {
        if was.id != now.id || was.image != now.image {
            return bad(format!(
                "its disk {} is the image {}, this VM's {}",
                was.id,
                was.image.display(),
                now.image.display()
            ));
        }
        if was.len != now.len || (was.mtime, was.mtime_nsec) != (now.mtime, now.mtime_nsec) {
            return bad(format!(
                "the disk image {} changed since the snapshot ({} bytes then, {} now; \
                 modified since): restore it with the image it was taken with",
                now.image.display(),
                was.len,
                now.len
            ));
        }
    }
    Ok(())
}

/// `RUST_LOG=amvm::timeline=debug`: when each step of a run finished, from `main`'s start.
pub struct Timeline(Instant);

impl Timeline {
    pub fn start() -> Timeline {
        Timeline(Instant::now())
    }

    pub fn mark(&self, what: &str) {
        tracing::debug!(target: "amvm::timeline", "{:8.1} ms  {what}", self.0.elapsed().as_secs_f64() * 1e3);
    }
}

/// How a guest that reported no exit status ended, from what the VMM saw: a kernel panic on
/// the console (it prints that even when `quiet`, then resets: `panic=-1`), the i8042 reset
/// (`reboot=k`; the kernel's triple-fault fallback may follow it, which is not a crash), or a
/// vCPU stop with nothing before it.
fn how_it_stopped(reset: bool, stop: Option<&VcpuStop>, console: &str) -> String {
    if console.contains(crate::output::PANIC_MARK) {
        return "its kernel panicked".into();
    }
    match (reset, stop) {
        (true, _) => "it reset itself".into(),
        (false, Some(VcpuStop::Shutdown { rip: Some(rip) })) => {
            format!("triple fault at RIP {rip:#x}: the guest kernel crashed")
        }
        (false, Some(VcpuStop::Shutdown { rip: None })) => {
            "triple fault: the guest kernel crashed".into()
        }
        (false, Some(VcpuStop::Halt)) => "halted".into(),
        (false, Some(VcpuStop::SystemEvent(kind))) => format!("system event {kind}"),
        (false, None) => "stopped".into(),
    }
}

/// The guest's vsock CID (2 is the host; 3 is the first guest CID).
const GUEST_CID: u64 = 3;

/// Put a virtio device in MMIO slot `slot`: its register window on the bus, its queue
/// notifications as ioeventfds, its interrupt as an irqfd. Returns its command-line entry.
fn attach_virtio(
    vm: &Vm,
    mem: &vm_memory::GuestMemoryMmap,
    mmio: &mut Bus,
    slot: u64,
    device: Arc<Mutex<dyn amvm_devices::virtio::VirtioDevice>>,
) -> Result<(String, Arc<Mutex<MmioTransport>>), RunError> {
    let base = layout::VIRTIO_MMIO_START + slot * MmioTransport::mmio_len();
    let irq = layout::VIRTIO_IRQ_START + slot as u32;
    let line = EventFdTrigger::new().map_err(RunError::EventFd)?;
    vm.register_irqfd(&line.0, irq)?;
    let transport = MmioTransport::new(mem.clone(), device, Arc::new(line))?;
    for (index, evt) in transport.queue_evts().iter().enumerate() {
        vm.register_mmio_ioevent(evt, base + VIRTIO_MMIO_QUEUE_NOTIFY, index as u32)?;
    }
    let transport = Arc::new(Mutex::new(transport));
    mmio.insert(base, MmioTransport::mmio_len(), transport.clone())?;
    Ok((MmioTransport::cmdline_entry(base, irq), transport))
}

fn attach_uart<W: io::Write + Send + 'static>(
    vm: &Vm,
    bus: &mut Bus,
    base: u64,
    irq: u32,
    out: W,
) -> Result<(), RunError> {
    let interrupt = EventFdTrigger::new().map_err(RunError::EventFd)?;
    vm.register_irqfd(&interrupt.0, irq)?;
    let uart: Arc<Mutex<dyn BusDevice>> = Arc::new(Mutex::new(Uart::new(interrupt, out)));
    bus.insert(base, legacy::UART_PORTS, uart)?;
    Ok(())
}

/// guest-init as /init, alone: everything else the guest sees comes over virtio-fs or is
/// made by guest-init (which also opens the console itself, once devtmpfs is up).
fn build_initramfs() -> Vec<u8> {
    let mut a = initramfs::Archive::new();
    a.file("init", 0o755, crate::GUEST_INIT);
    a.finish()
}

/// guest-init is embedded in amvm's read-only data (`GUEST_INIT`, about 1.5 MiB); once it is in
/// guest memory its pages in amvm are dead weight for the rest of the run. Give them back: they
/// are file-backed and read-only, so a later read (none is expected) pages them in again.
fn release_guest_init_pages() {
    let page = 4096usize;
    let start = crate::GUEST_INIT.as_ptr() as usize;
    let end = start + crate::GUEST_INIT.len();
    let (from, to) = (start.div_ceil(page) * page, end / page * page);
    if to > from {
        // SAFETY: [from, to) is whole pages inside the immutable, file-backed GUEST_INIT; no
        // reference into it is written through, and MADV_DONTNEED on such a private file
        // mapping only drops the resident copies.
        unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) };
    }
}

/// What ended a wait.
enum Wake {
    /// A vCPU stopped or the guest reset: the run is over.
    Stopped,
    /// The signalfd is readable.
    Signal,
    /// The supervisor's channel (vmmctl.rs) is readable.
    Control,
    /// The deadline passed.
    Time,
}

/// epoll over the exit event and the signalfd.
struct Waiter {
    epoll: Epoll,
}

impl Waiter {
    const EXIT: u64 = 0;
    const SIGNAL: u64 = 1;
    const CONTROL: u64 = 2;

    /// Wakes with [`Wake::Stopped`] when any of `exits` fires.
    fn new(
        exits: &[&EventFdTrigger],
        signals: &Signals,
        control: Option<&std::fs::File>,
    ) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        let epoll = Epoll::new()?;
        let exits = exits.iter().map(|e| (e.0.as_raw_fd(), Self::EXIT));
        let control = control.map(|c| (c.as_raw_fd(), Self::CONTROL));
        for (fd, token) in exits
            .chain([(signals.as_raw_fd(), Self::SIGNAL)])
            .chain(control)
        {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )?;
        }
        Ok(Waiter { epoll })
    }

    /// Stop watching `fd`.
    fn forget(&self, fd: &impl std::os::fd::AsRawFd) -> io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Delete,
            fd.as_raw_fd(),
            EpollEvent::default(),
        )
    }

    fn wait(&self, until: Option<Instant>) -> io::Result<Wake> {
        let mut events = [EpollEvent::default(); 4];
        loop {
            let timeout_ms = match until {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(Wake::Time);
                    }
                    left.as_millis().min(i32::MAX as u128).max(1) as i32
                }
            };
            match self.epoll.wait(timeout_ms, &mut events) {
                Ok(0) => continue,
                Ok(n) => {
                    // The run ending wins over a signal that raced with it.
                    if events[..n].iter().any(|e| e.data() == Self::EXIT) {
                        return Ok(Wake::Stopped);
                    }
                    if events[..n].iter().any(|e| e.data() == Self::SIGNAL) {
                        return Ok(Wake::Signal);
                    }
                    return Ok(Wake::Control);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// virtiofsd's id translation for the workspace DIR (its owner, as the workload's user), for
/// a workload of `uid:gid`. A DIR that cannot be read here is left as it is (virtiofsd says
/// why it cannot serve it).
fn workspace_ids(dir: &Path, uid: u32, gid: u32) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(dir) else {
        return Vec::new();
    };
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    let runner_uid = unsafe { libc::geteuid() };
    // SAFETY: as geteuid.
    let runner_gid = unsafe { libc::getegid() };
    let mut ids = crate::fs::translate_ids(
        "--translate-uid",
        crate::fs::Ids {
            owner: meta.uid(),
            runner: runner_uid,
            workload: uid,
        },
    );
    ids.extend(crate::fs::translate_ids(
        "--translate-gid",
        crate::fs::Ids {
            owner: meta.gid(),
            runner: runner_gid,
            workload: gid,
        },
    ));
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_that_reset_is_told_apart_from_one_that_crashed() {
        let fault = VcpuStop::Shutdown {
            rip: Some(0xffff_ffff_8100_0000),
        };
        assert_eq!(how_it_stopped(true, Some(&fault), ""), "it reset itself");
        assert_eq!(
            how_it_stopped(false, Some(&fault), "boot\n"),
            "triple fault at RIP 0xffffffff81000000: the guest kernel crashed"
        );
        assert_eq!(
            how_it_stopped(
                true,
                Some(&fault),
                "Kernel panic - not syncing: Attempted to kill init!"
            ),
            "its kernel panicked"
        );
        assert_eq!(how_it_stopped(false, None, ""), "stopped");
    }

    #[test]
    fn the_report_shows_the_panic_line_before_a_long_trace() {
        let mut console = String::from("boot\nKernel panic - not syncing: sysrq triggered crash\n");
        for i in 0..30 {
            console.push_str(&format!(" frame_{i}\n"));
        }
        let note = console_note(&console);
        let lines: Vec<&str> = note.lines().collect();
        assert_eq!(lines[0], "; the guest console's last lines:");
        assert_eq!(
            lines[1],
            "Kernel panic - not syncing: sysrq triggered crash"
        );
        assert_eq!(lines[2], "...");
        assert_eq!(lines.len(), 21, "{note}");
        assert_eq!(lines[20], " frame_29");
        // A short console is shown whole, the panic line once.
        let note = console_note("a\nKernel panic - not syncing: x\nb\n");
        assert_eq!(note.matches("Kernel panic").count(), 1, "{note}");
    }
}
