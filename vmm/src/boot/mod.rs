//! Filling guest memory for a PVH boot: the ELF kernel, the initramfs, the command line, the
//! boot GDT, the MP table and the `hvm_start_info` that points the kernel at all of them.

pub mod initramfs;

use crate::arch::x86_64::{layout, mptable, regs};
use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::KernelLoader;
use std::fs::File;
use std::path::{Path, PathBuf};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const E820_RAM: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("kernel {0}: {1} (run images/setup: as root it installs one for every user in /usr/local/lib/amvm; or pass --kernel)")]
    KernelOpen(PathBuf, std::io::Error),
    #[error("kernel {0} is not a loadable x86_64 ELF vmlinux: {1}")]
    KernelLoad(PathBuf, linux_loader::loader::Error),
    #[error("kernel {0} has no PVH entry point (build it with CONFIG_PVH=y)")]
    NoPvhEntry(PathBuf),
    #[error("initramfs of {size} bytes does not fit in guest memory above the kernel (end {kernel_end:#x}, RAM below 4 GiB ends {ram_end:#x}): give the guest more --mem")]
    InitrdTooLarge {
        size: usize,
        kernel_end: u64,
        ram_end: u64,
    },
    #[error("kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    #[error("kernel command line of {0} bytes is longer than the guest allows ({max})", max = layout::CMDLINE_MAX_SIZE)]
    CmdlineTooLong(usize),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error("writing {what} into guest memory: {source}")]
    GuestWrite {
        what: &'static str,
        source: vm_memory::GuestMemoryError,
    },
    #[error("PVH boot parameters: {0}")]
    Pvh(linux_loader::configurator::Error),
}

/// Where the loaded kernel starts executing, and where its image ends.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    pub entry: u64,
    pub end: u64,
}

/// Load an ELF vmlinux at its physical addresses and find its PVH entry.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let mut file = File::open(path).map_err(|e| BootError::KernelOpen(path.to_owned(), e))?;
    let loaded = Elf::load(
        mem,
        None,
        &mut file,
        Some(GuestAddress(layout::HIMEM_START)),
    )
    .map_err(|e| BootError::KernelLoad(path.to_owned(), e))?;
    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => Ok(LoadedKernel {
            entry: entry.0,
            end: loaded.kernel_end,
        }),
        _ => Err(BootError::NoPvhEntry(path.to_owned())),
    }
}

/// Copy the initramfs to the top of RAM below the MMIO gap; return its guest address.
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    kernel: &LoadedKernel,
    initramfs: &[u8],
) -> Result<u64, BootError> {
    let ram_end = layout::low_ram_end(mem_bytes);
    let too_large = || BootError::InitrdTooLarge {
        size: initramfs.len(),
        kernel_end: kernel.end,
        ram_end,
    };
    let addr = ram_end
        .checked_sub(initramfs.len() as u64)
        .ok_or_else(too_large)?
        & !0xfff;
    if addr < kernel.end {
        return Err(too_large());
    }
    mem.write_slice(initramfs, GuestAddress(addr))
        .map_err(|source| BootError::GuestWrite {
            what: "initramfs",
            source,
        })?;
    Ok(addr)
}

/// The kernel command line, naming each virtio-mmio device (`virtio_devices`). Quiet unless the
/// console is shown; `reboot=k` makes the guest's reboot(2) an i8042 reset (our exit path);
/// `panic=-1` turns a panic into that reset too; `no_timer_check` skips the IO-APIC timer probe,
/// which under a loaded (emulated) host intermittently hung the boot right after "Switch to
/// symmetric I/O mode" (KVM's in-kernel PIT and IOAPIC are known-good, nothing to probe).
pub fn cmdline(verbose_console: bool, virtio_devices: &[String]) -> Result<Cmdline, BootError> {
    let mut c = Cmdline::new(layout::CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    let base = "console=ttyS0 reboot=k panic=-1 8250.nr_uarts=1 random.trust_cpu=on no_timer_check rdinit=/init";
    c.insert_str(base).map_err(BootError::Cmdline)?;
    c.insert_str(if verbose_console {
        "loglevel=7"
    } else {
        "quiet"
    })
    .map_err(BootError::Cmdline)?;
    for dev in virtio_devices {
        c.insert_str(dev).map_err(BootError::Cmdline)?;
    }
    Ok(c)
}

/// Write the command line, GDT/IDT, MP table and PVH start info. `initramfs` is (address, size).
pub fn configure_pvh(
    mem: &GuestMemoryMmap,
    mem_bytes: u64,
    cmdline: &Cmdline,
    initramfs: (u64, usize),
    cpus: u8,
) -> Result<(), BootError> {
    let cstr = cmdline.as_cstring().map_err(BootError::Cmdline)?;
    let bytes = cstr.as_bytes_with_nul();
    if bytes.len() > layout::CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong(bytes.len()));
    }
    let write = |what: &'static str, data: &[u8], addr: u64| {
        mem.write_slice(data, GuestAddress(addr))
            .map_err(|source| BootError::GuestWrite { what, source })
    };
    write("command line", bytes, layout::CMDLINE_START)?;

    let gdt: Vec<u8> = regs::gdt().iter().flat_map(|e| e.to_le_bytes()).collect();
    write("GDT", &gdt, layout::GDT_START)?;
    write("IDT", &[0u8; 8], layout::IDT_START)?;
    write("MP table", &mptable::build(cpus)?, layout::EBDA_START)?;

    let mut memmap = vec![hvm_memmap_table_entry {
        addr: 0,
        size: layout::EBDA_START,
        type_: E820_RAM,
        reserved: 0,
    }];
    for (start, len) in layout::ram_ranges(mem_bytes) {
        // The first range starts at 0; below HIMEM_START only the part before the EBDA is RAM.
        let (start, len) = if start == 0 {
            (layout::HIMEM_START, len - layout::HIMEM_START)
        } else {
            (start, len)
        };
        memmap.push(hvm_memmap_table_entry {
            addr: start,
            size: len,
            type_: E820_RAM,
            reserved: 0,
        });
    }
    let modules = [hvm_modlist_entry {
        paddr: initramfs.0,
        size: initramfs.1 as u64,
        cmdline_paddr: 0,
        reserved: 0,
    }];
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        flags: 0,
        nr_modules: modules.len() as u32,
        modlist_paddr: layout::MODLIST_START,
        cmdline_paddr: layout::CMDLINE_START,
        rsdp_paddr: 0,
        memmap_paddr: layout::MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        reserved: 0,
    };
    let mut params = BootParams::new(&start_info, GuestAddress(layout::PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(layout::MEMMAP_START));
    params.set_modules(&modules, GuestAddress(layout::MODLIST_START));
    PvhBootConfigurator::write_bootparams(&params, mem).map_err(BootError::Pvh)
}
