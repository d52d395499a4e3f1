//! vsock packets in and out of guest descriptor chains: `read_tx` and `write_rx` over arbitrary
//! guest memory and arbitrary chains, both as plain descriptor lists and as real chains walked
//! by virtio-queue from a descriptor table the guest wrote (loops, indirect tables, heads out of
//! range). Each result is checked against a byte-by-byte reference implementation, and
//! `write_rx` must change guest memory exactly as the reference does (nothing at all on error).
//!
//! Input: `mode: u8`, guest memory writes (`amvm_fuzz::scribble`), then per mode:
//! 0 TX / 1 RX over `count: u8 % 17` descriptors; 2 TX / 3 RX over a chain from
//! `amvm_fuzz::one_chain_queue`. RX modes then read a 44-byte header and `len: u16` (class
//! `u8`: payload length; the payload is generated).
#![no_main]

use amvm_devices::vsock::defs::{HDR_LEN, MAX_PKT_PAYLOAD};
use amvm_devices::vsock::packet::{read_tx, write_rx, Header};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::GuestMemoryMmap;

fn check_tx(
    mem: &GuestMemoryMmap,
    chain: impl IntoIterator<Item = Descriptor>,
    descs: &[Descriptor],
) {
    let got = read_tx(mem, chain).map(|p| (p.hdr, p.data));
    let want = reference_read_tx(mem, descs);
    trace!("read_tx over {descs:?}: {got:?}");
    assert_eq!(got, want, "descriptors {descs:?}");
    if let Ok((h, data)) = got {
        assert_eq!(h.len as usize, data.len());
        assert!(data.len() <= MAX_PKT_PAYLOAD);
    }
}

fn check_rx(
    mem: &GuestMemoryMmap,
    chain: impl IntoIterator<Item = Descriptor>,
    descs: &[Descriptor],
    inp: &mut Input,
) {
    let raw: [u8; HDR_LEN] = {
        let mut b = [0u8; HDR_LEN];
        let got = inp.bytes(HDR_LEN);
        b[..got.len()].copy_from_slice(got);
        b
    };
    let hdr = Header::from_bytes(&raw);
    let n = match inp.u8() % 4 {
        0 => usize::from(inp.u8()),
        1 => MAX_PKT_PAYLOAD - usize::from(inp.u8()),
        _ => usize::from(inp.u16()),
    };
    let data: Vec<u8> = (0..n).map(|i| (i as u8) ^ 0xa5).collect();
    let before = snapshot(mem);
    let got = write_rx(mem, chain, &hdr, &data);
    let after = snapshot(mem);
    let (want, want_mem) = reference_write_rx(&before, descs, &hdr, &data);
    trace!("write_rx of {n} bytes over {descs:?}: {got:?}");
    assert_eq!(got, want, "descriptors {descs:?}");
    assert!(
        after == want_mem,
        "write_rx changed guest memory other than the reference (result {got:?})"
    );
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mem = guest_mem();
    let mode = inp.u8() % 4;
    scribble(&mem, &mut inp);
    match mode {
        0 | 1 => {
            let count = inp.u8() % 17;
            let descs: Vec<Descriptor> = (0..count).map(|_| descriptor(&mut inp)).collect();
            if mode == 0 {
                check_tx(&mem, descs.clone(), &descs);
            } else {
                check_rx(&mem, descs.clone(), &descs, &mut inp);
            }
        }
        _ => {
            let mut q = one_chain_queue(&mem, &mut inp);
            let chain = q
                .pop_descriptor_chain(&mem)
                .expect("one chain is available");
            let descs: Vec<Descriptor> = chain.clone().collect();
            // A chain is at most the queue size, or one indirect table, long.
            assert!(descs.len() <= usize::from(q.size()) + usize::from(u16::MAX));
            if mode == 2 {
                check_tx(&mem, chain, &descs);
            } else {
                check_rx(&mem, chain, &descs, &mut inp);
            }
        }
    }
});
