//! Opening /dev/kvm and making sure it can really run our guest.
//!
//! Refused with a clear message: no device (no KVM on this host), no permission (the `kvm`
//! group), an API or capability we need missing, and a /dev/kvm without hardware
//! virtualization — notably PVM, a software-only KVM for nested use that cannot run a stock
//! guest kernel (no `vmx`/`svm` CPU flag; its module is `kvm_pvm`).

use crate::arch::x86_64::cpuid;
use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Cap;
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Where the KVM device is, unless `AMVM_KVM_DEVICE` says otherwise.
pub const DEFAULT_KVM_DEVICE: &str = "/dev/kvm";

#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error("{0} does not exist: this host has no KVM (enable virtualization in the firmware or the cloud instance, and load kvm_intel or kvm_amd)")]
    NoDevice(PathBuf),
    #[error("no permission to open {0}: add your user to the `kvm` group (sudo usermod -aG kvm $USER, then log in again)")]
    NoPermission(PathBuf),
    #[error("cannot open {0}: {1}")]
    Open(PathBuf, std::io::Error),
    #[error("KVM API version {0}, need 12")]
    ApiVersion(i32),
    #[error("KVM lacks a capability amvm needs: {0:?}")]
    MissingCap(Cap),
    #[error("{0} is PVM, a software-only KVM without hardware virtualization (no vmx/svm CPU flag): it cannot run amvm's guest. Run amvm through tests/kvm-host/run, which provides an emulated KVM host")]
    Pvm(PathBuf),
    #[error("{0} has no hardware virtualization behind it (no vmx/svm flag in /proc/cpuinfo): amvm needs VT-x or AMD-V. Run amvm through tests/kvm-host/run, which provides an emulated KVM host")]
    NoHardwareVirt(PathBuf),
    #[error("KVM_GET_SUPPORTED_CPUID: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
    #[error("KVM_GET_MSR_INDEX_LIST: {0}")]
    MsrIndexList(kvm_ioctls::Error),
    #[error("KVM_CREATE_VM: {0}")]
    CreateVm(kvm_ioctls::Error),
}

/// An open, checked KVM handle and what it supports.
#[derive(Debug)]
pub struct Kvm {
    pub(super) fd: kvm_ioctls::Kvm,
    supported_cpuid: CpuId,
    msr_index_list: Vec<u32>,
}

impl Kvm {
    /// Open the KVM device (`AMVM_KVM_DEVICE` or /dev/kvm) and check it can run our guest.
    pub fn open() -> Result<Self, KvmError> {
        Self::open_path(&device_path())
    }

    pub fn open_path(path: &Path) -> Result<Self, KvmError> {
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| KvmError::NoDevice(path.to_owned()))?;
        let fd = kvm_ioctls::Kvm::new_with_path(&cpath).map_err(|e| match e.errno() {
            libc::ENOENT | libc::ENXIO | libc::ENODEV => KvmError::NoDevice(path.to_owned()),
            libc::EACCES | libc::EPERM => KvmError::NoPermission(path.to_owned()),
            n => KvmError::Open(path.to_owned(), std::io::Error::from_raw_os_error(n)),
        })?;
        check_hardware_virtualization(path)?;
        let api = fd.get_api_version();
        if api != kvm_bindings::KVM_API_VERSION as i32 {
            return Err(KvmError::ApiVersion(api));
        }
        for cap in [
            Cap::Irqchip,
            Cap::UserMemory,
            Cap::Ioeventfd,
            Cap::Irqfd,
            Cap::Pit2,
            Cap::ExtCpuid,
            Cap::SetTssAddr,
        ] {
            if !fd.check_extension(cap) {
                return Err(KvmError::MissingCap(cap));
            }
        }
        let mut supported_cpuid = fd
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(KvmError::SupportedCpuid)?;
        // KVM emulates the LAPIC's TSC-deadline timer but says so by this capability, not in
        // the supported CPUID (Documentation/virt/kvm/api.rst, KVM_GET_SUPPORTED_CPUID).
        if fd.check_extension(Cap::TscDeadlineTimer) {
            cpuid::offer_tsc_deadline(supported_cpuid.as_mut_slice());
        }
        let msr_index_list = fd
            .get_msr_index_list()
            .map_err(KvmError::MsrIndexList)?
            .as_slice()
            .to_vec();
        Ok(Kvm {
            fd,
            supported_cpuid,
            msr_index_list,
        })
    }

    /// The CPUID entries KVM can offer a guest on this host (never more).
    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }

    /// Whether KVM lets a guest's MSR `index` be saved and restored (and so set at boot).
    pub fn msr_supported(&self, index: u32) -> bool {
        self.msr_index_list.contains(&index)
    }
}

/// The KVM device amvm opens: `AMVM_KVM_DEVICE`, else /dev/kvm.
pub fn device_path() -> PathBuf {
    std::env::var_os("AMVM_KVM_DEVICE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_KVM_DEVICE))
}

/// What this host's KVM runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Virtualization {
    /// VT-x (`vmx`) or AMD-V (`svm`).
    Hardware(&'static str),
    /// PVM's module is loaded: a software-only KVM.
    Pvm,
    /// Neither flag.
    None,
}

/// PVM's module, else the CPU flag /proc/cpuinfo shows.
pub fn virtualization() -> Virtualization {
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Virtualization::Pvm;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo_hw_virt(&cpuinfo).map_or(Virtualization::None, Virtualization::Hardware)
}

/// A KVM we can use needs VT-x or AMD-V under it. PVM exposes /dev/kvm without either.
fn check_hardware_virtualization(path: &Path) -> Result<(), KvmError> {
    match virtualization() {
        Virtualization::Hardware(_) => Ok(()),
        Virtualization::Pvm => Err(KvmError::Pvm(path.to_owned())),
        Virtualization::None => Err(KvmError::NoHardwareVirt(path.to_owned())),
    }
}

fn cpuinfo_hw_virt(cpuinfo: &str) -> Option<&'static str> {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(str::split_whitespace)
        .find_map(|f| match f {
            "vmx" => Some("vmx"),
            "svm" => Some("svm"),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hw_virt_flag_detection() {
        assert_eq!(
            cpuinfo_hw_virt("processor\t: 0\nflags\t\t: fpu vme svm lm\n"),
            Some("svm")
        );
        assert_eq!(cpuinfo_hw_virt("flags\t\t: fpu vmx\n"), Some("vmx"));
        assert_eq!(cpuinfo_hw_virt("flags\t\t: fpu vme svm_lock lm\n"), None);
        assert_eq!(
            cpuinfo_hw_virt("model name\t: vmx svm\nflags\t\t: fpu\n"),
            None
        );
    }

    #[test]
    fn missing_device_is_named_with_the_fix() {
        let e = Kvm::open_path(Path::new("/nonexistent/kvm")).unwrap_err();
        assert!(matches!(e, KvmError::NoDevice(_)), "{e}");
        assert!(e.to_string().contains("/nonexistent/kvm"));
    }
}
