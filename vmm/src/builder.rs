//! The boot recipe: one function that reads top to bottom — KVM, memory, devices, kernel,
//! initramfs, command line, vCPUs, start — then waits for the guest and turns its end into an
//! exit status. Comments mark where order matters.

use crate::arch::x86_64::layout;
use crate::boot::{self, initramfs};
use crate::config::RunConfig;
use crate::output::{ChannelSink, ConsoleSink, Report};
use crate::vstate::kvm::{Kvm, KvmError};
use crate::vstate::memory::{self, MemoryError};
use crate::vstate::vcpu::{BootEntry, VcpuError, VcpuStop};
use crate::vstate::vm::{Vm, VmError};
use amvm_devices::bus::{BusError, PioBus, PioDevice};
use amvm_devices::legacy::{self, EventFdTrigger, ResetLine, Uart};
use guest_init::protocol::SPEC_PATH;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
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
    #[error(
        "{0}: {1} (install Debian's busybox-static, or point AMVM_BUSYBOX at a static busybox)"
    )]
    Busybox(PathBuf, String),
    #[error("event fd: {0}")]
    EventFd(io::Error),
    #[error("starting a vCPU thread: {0}")]
    Thread(io::Error),
    #[error("timed out after {0} s")]
    Timeout(u64),
    #[error("the guest failed: {error}{}", console_note(.console))]
    GuestFailed { error: String, console: String },
    #[error("the guest stopped without reporting an exit status{}{}", .protocol.as_ref().map(|p| format!(" (channel: {p})")).unwrap_or_default(), console_note(.console))]
    NoStatus {
        protocol: Option<String>,
        console: String,
    },
}

fn console_note(console: &str) -> String {
    let lines: Vec<&str> = console.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        " (no console output; run with --console to see the guest's kernel log)".into()
    } else {
        let last = &lines[lines.len().saturating_sub(20)..];
        format!("; the guest console's last lines:\n{}", last.join("\n"))
    }
}

/// Boot the VM described by `cfg`, run its workload, return the workload's exit status.
///
/// On return the vCPU threads may still be inside KVM_RUN: the caller exits the process.
pub fn run(cfg: &RunConfig) -> Result<u8, RunError> {
    let deadline = cfg.timeout.map(|t| (Instant::now() + t, t.as_secs()));

    // KVM first: without a usable /dev/kvm nothing else is worth doing.
    let kvm = Kvm::open()?;
    let busybox = read_static_busybox(&cfg.busybox)?;

    let mem_bytes = cfg.mem_mib << 20;
    let mem = memory::create(cfg.mem_mib)?;
    // The irqchip is created with the VM, before any vCPU (KVM requires that order).
    let vm = Vm::new(&kvm, &mem)?;

    // Devices. COM1: kernel console; COM2: guest-init's channel; i8042: the exit path.
    let exit_evt = EventFdTrigger::new().map_err(RunError::EventFd)?;
    let report = Arc::new(Mutex::new(Report::default()));
    let console = ConsoleSink::new(cfg.console);
    let mut bus = PioBus::new();
    attach_uart(
        &vm,
        &mut bus,
        legacy::COM1_BASE,
        legacy::COM1_IRQ,
        console.clone(),
    )?;
    let channel = ChannelSink::new(io::stdout(), io::stderr(), report.clone());
    attach_uart(&vm, &mut bus, legacy::COM2_BASE, legacy::COM2_IRQ, channel)?;
    let reset = ResetLine::new(exit_evt.try_clone().map_err(RunError::EventFd)?);
    bus.insert(
        legacy::I8042_BASE,
        legacy::I8042_PORTS,
        Arc::new(Mutex::new(reset)),
    )?;

    // Guest memory contents: kernel, then the initramfs above it, then the boot tables.
    let kernel = boot::load_kernel(&mem, &cfg.kernel)?;
    let initrd = build_initramfs(cfg, &busybox);
    let initrd_addr = boot::load_initramfs(&mem, mem_bytes, &kernel, &initrd)?;
    let cmdline = boot::cmdline(cfg.console)?;
    boot::configure_pvh(
        &mem,
        mem_bytes,
        &cmdline,
        (initrd_addr, initrd.len()),
        cfg.cpus,
    )?;

    // vCPUs: all configured before any runs; vCPU 0 boots, the others wait for the guest's SIPI.
    let mut vcpus = Vec::with_capacity(cfg.cpus.into());
    for id in 0..cfg.cpus {
        let vcpu = vm.create_vcpu(id)?;
        let boot = (id == 0).then_some(BootEntry {
            entry: kernel.entry,
            start_info: layout::PVH_INFO_START,
        });
        vcpu.configure(&kvm, cfg.cpus, boot)?;
        vcpus.push(vcpu);
    }
    let bus = Arc::new(bus);
    let stops: Arc<Mutex<Vec<Result<VcpuStop, VcpuError>>>> = Arc::default();
    for (id, vcpu) in vcpus.into_iter().enumerate() {
        let (bus, stops) = (bus.clone(), stops.clone());
        let done = exit_evt.try_clone().map_err(RunError::EventFd)?;
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                let r = vcpu.run(&bus);
                stops.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                let _ = done.0.write(1);
            })
            .map_err(RunError::Thread)?;
    }
    // vCPU threads keep using guest memory and the VM until the process exits.
    std::mem::forget((vm, mem));

    if !wait_for(&exit_evt, deadline.map(|d| d.0)).map_err(RunError::EventFd)? {
        return Err(RunError::Timeout(deadline.map(|d| d.1).unwrap_or_default()));
    }

    let failure = stops
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find_map(|r| r.as_ref().err().map(ToString::to_string));
    let report = report.lock().unwrap_or_else(|p| p.into_inner());
    match (report.exit, failure) {
        (Some(code), _) => Ok(code),
        (None, Some(error)) => Err(RunError::GuestFailed {
            error,
            console: console.tail(),
        }),
        (None, None) => Err(RunError::NoStatus {
            protocol: report.protocol_error.as_ref().map(ToString::to_string),
            console: console.tail(),
        }),
    }
}

fn attach_uart<W: io::Write + Send + 'static>(
    vm: &Vm,
    bus: &mut PioBus,
    base: u16,
    irq: u32,
    out: W,
) -> Result<(), RunError> {
    let interrupt = EventFdTrigger::new().map_err(RunError::EventFd)?;
    vm.register_irqfd(&interrupt.0, irq)?;
    let uart: Arc<Mutex<dyn PioDevice>> = Arc::new(Mutex::new(Uart::new(interrupt, out)));
    bus.insert(base, legacy::UART_PORTS, uart)?;
    Ok(())
}

fn read_static_busybox(path: &Path) -> Result<Vec<u8>, RunError> {
    let bytes =
        std::fs::read(path).map_err(|e| RunError::Busybox(path.to_owned(), e.to_string()))?;
    if !initramfs::is_static_elf(&bytes) {
        return Err(RunError::Busybox(
            path.to_owned(),
            "not a static x86_64 executable".into(),
        ));
    }
    Ok(bytes)
}

/// guest-init as /init, its run spec, a console node, and busybox with `sh`.
fn build_initramfs(cfg: &RunConfig, busybox: &[u8]) -> Vec<u8> {
    let mut a = initramfs::Archive::new();
    a.dir("dev", 0o755)
        .char_dev("dev/console", 0o600, 5, 1)
        .dir("bin", 0o755)
        .file("bin/busybox", 0o755, busybox)
        .symlink("bin/sh", "busybox")
        .dir("amvm", 0o700)
        .file(SPEC_PATH.trim_start_matches('/'), 0o600, &cfg.spec.encode())
        .file("init", 0o755, crate::GUEST_INIT);
    a.finish()
}

/// Wait until `evt` fires (true) or `deadline` passes (false).
fn wait_for(evt: &EventFdTrigger, deadline: Option<Instant>) -> io::Result<bool> {
    let epoll = Epoll::new()?;
    use std::os::fd::AsRawFd;
    epoll.ctl(
        ControlOperation::Add,
        evt.0.as_raw_fd(),
        EpollEvent::new(EventSet::IN, 0),
    )?;
    let mut events = [EpollEvent::default(); 1];
    loop {
        let timeout_ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                left.as_millis().min(i32::MAX as u128).max(1) as i32
            }
        };
        match epoll.wait(timeout_ms, &mut events) {
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}
