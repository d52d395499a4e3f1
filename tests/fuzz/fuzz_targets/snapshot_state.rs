//! The snapshot state file's decoder (`vmm/src/snapshot/format.rs`) and what it decodes into
//! (`MachineState`: the VM's and every vCPU's KVM state, kvm-bindings' serde), over files
//! anyone may have damaged. Checked besides "no panic":
//!
//! * mode 0, the rest of the input as a whole file: accepted only with the header, version,
//!   length and checksum it must have;
//! * mode 1, the rest of the input as a body behind a correct header and checksum (what a
//!   corruption the checksum missed, or a hand-edited file, would be): the JSON parser and the
//!   state's types, then `check()`; an accepted state encodes again and decodes to the same
//!   bytes.
#![no_main]

use amvm::snapshot::format::{decode, encode, FORMAT_VERSION, MAGIC};
use amvm::snapshot::MachineState;
use amvm_fuzz::trace;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fn check(bytes: &[u8]) {
    match decode::<MachineState>(bytes) {
        Ok(state) => {
            trace!("accepted: {state:?}");
            assert!(bytes.starts_with(MAGIC));
            let again = encode(&state).expect("a decoded state encodes");
            let back: MachineState = decode(&again).expect("its own encoding decodes");
            assert_eq!(encode(&back).unwrap(), again, "encode/decode is not stable");
            let _ = state.check();
        }
        Err(e) => trace!("refused: {e}"),
    }
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&mode, rest)) = bytes.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        check(rest);
    } else {
        let mut file = Vec::with_capacity(52 + rest.len());
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        file.extend_from_slice(&(rest.len() as u64).to_le_bytes());
        file.extend_from_slice(&Sha256::digest(rest));
        file.extend_from_slice(rest);
        check(&file);
    }
});
