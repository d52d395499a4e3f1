//! Taking a snapshot, in the VMM (its main thread, on its supervisor's request: vmmctl.rs).
//!
//! With the vCPUs parked (paused first if they were not), the vsock worker held and every
//! share's rings stopped, nothing writes guest memory; then each vCPU's state (read by its own
//! parked thread), the VM's, the transports', the shares' backends' and guest RAM (its data
//! only: holes stay holes) go to the two files the request brought. Then the guest goes on as
//! it was: the rings start where they stood, the worker goes on, and vCPUs that were running
//! run again. Whatever fails, the guest is let go the same way and the reason is the answer.

use super::{format, DevicesState, MachineState, Meta};
use crate::vstate::memory;
use crate::vstate::pause::Pauser;
use crate::vstate::vm::Vm;
use amvm_devices::virtio::fs::VhostUserFs;
use amvm_devices::virtio::MmioTransport;
use amvm_devices::vsock::device::WorkerHold;
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use vm_memory::GuestMemoryMmap;

/// How long the vsock worker and the parked vCPUs have to answer (microseconds, normally).
const LIMIT: Duration = Duration::from_secs(5);

/// What a snapshot reads, as the VMM holds it.
pub struct Machine<'a> {
    pub vm: &'a Vm,
    pub mem: &'a GuestMemoryMmap,
    pub pauser: &'a Pauser,
    /// Slot order: the vsock device's, then each share's.
    pub transports: &'a [Arc<Mutex<MmioTransport>>],
    pub shares: &'a [(String, Arc<Mutex<VhostUserFs>>)],
    pub vsock: &'a WorkerHold,
    /// Each read-only disk's worker and image, in slot order.
    pub disks: &'a [(WorkerHold, super::DiskState)],
    /// A restored guest's `/proc/self/pagemap` (its RAM is a private mapping).
    pub pagemap: Option<&'a File>,
    pub mem_mib: u64,
    pub cpus: u8,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Machine<'_> {
    /// Write the snapshot to the request's two files (state, memory); the answer is a line of
    /// JSON saying what was written.
    pub fn snapshot(&self, fds: Vec<OwnedFd>) -> Result<String, String> {
        let [state, memory]: [OwnedFd; 2] = fds
            .try_into()
            .map_err(|f: Vec<OwnedFd>| format!("a snapshot takes two files; {} came", f.len()))?;
        let (state, memory) = (File::from(state), File::from(memory));
        let was_paused = self.pauser.is_paused();
        if !was_paused {
            self.pauser
                .pause(crate::builder::PAUSE_LIMIT)
                .map_err(|e| e.to_string())?;
        }
        let mut stopped_rings = Vec::new();
        let taken = self.take(&state, &memory, &mut stopped_rings);
        // The guest goes on as it was, whatever happened.
        let mut after = Vec::new();
        for (i, bases) in stopped_rings {
            if let Err(e) = lock(&self.shares[i].1).restart_rings(&bases) {
                after.push(format!("restarting share {}: {e}", self.shares[i].0));
            }
        }
        self.vsock.release();
        for (d, _) in self.disks {
            d.release();
        }
        if !was_paused {
            self.pauser.resume();
        }
        match (taken, after.is_empty()) {
            (Ok(summary), true) => Ok(summary),
            (Ok(_), false) => Err(after.join("; ")),
            (Err(e), _) => Err(e),
        }
    }

    fn take(
        &self,
        state: &File,
        memory: &File,
        stopped_rings: &mut Vec<(usize, Vec<u32>)>,
    ) -> Result<String, String> {
        self.vsock.hold(LIMIT).map_err(|e| e.to_string())?;
        for (d, image) in self.disks {
            d.hold(LIMIT)
                .map_err(|e| format!("disk {}: {e}", image.image.display()))?;
        }
        let mut shares = Vec::with_capacity(self.shares.len());
        for (i, (tag, fs)) in self.shares.iter().enumerate() {
            let saved = lock(fs)
                .save_backend_state()
                .map_err(|e| format!("share {tag}: {e}"))?;
            stopped_rings.push((i, saved.ring_bases.clone()));
            shares.push((tag.clone(), saved));
        }
        let vcpus = self.pauser.save_states(LIMIT).map_err(|e| e.to_string())?;
        let vm = self.vm.save_state().map_err(|e| e.to_string())?;
        let transports = self
            .transports
            .iter()
            .map(|t| lock(t).save_state())
            .collect();
        let len = memory::backing(self.mem)
            .ok_or("guest memory is not file-backed")?
            .1;
        let copied = memory::write_snapshot(self.mem, memory, self.pagemap)
            .map_err(|e| format!("writing guest memory: {e}"))?;
        let machine = MachineState {
            meta: Meta {
                amvm: env!("CARGO_PKG_VERSION").into(),
                mem_mib: self.mem_mib,
                cpus: self.cpus,
                created: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            },
            vm,
            vcpus,
            devices: DevicesState {
                transports,
                shares,
                disks: self.disks.iter().map(|(_, d)| d.clone()).collect(),
            },
        };
        let bytes = format::encode(&machine).map_err(|e| e.to_string())?;
        let mut out = state;
        out.write_all(&bytes)
            .and_then(|()| out.sync_all())
            .and_then(|()| memory.sync_all())
            .map_err(|e| format!("writing the state: {e}"))?;
        Ok(format!(
            "{{\"state_bytes\": {}, \"memory_bytes\": {len}, \"memory_written\": {copied}}}",
            bytes.len()
        ))
    }
}
