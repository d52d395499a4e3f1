//! Descriptor-chain walking with virtio-queue over guest memory the guest controls entirely:
//! the RX and TX queues' sizes and ring addresses (any that pass `Queue::is_valid`, as the
//! transport requires, overlapping each other included), their avail indexes, ring entries and
//! descriptors, and guest writes between device passes (a driver racing the device). Each pass
//! is a copy of the vsock worker's loops in `devices/src/vsock/device.rs` (`process_tx`,
//! `fill_rx`) driving a real `Muxer`, so chains are walked exactly as the device walks them.
//!
//! Checked: nothing panics; a TX pass takes at most a bounded number of chains even when the
//! rings overlap and the device's own used-ring writes change what it reads; each chain is at
//! most the queue size, or one indirect table, long; an RX chain the device accepted never
//! fails for lack of room or for a read-only descriptor (only for addresses outside RAM).
//!
//! Input: guest memory writes (`amvm_fuzz::scribble`), per queue (RX, TX) a size class `u8`
//! (+ `u16`), three ring addresses (`amvm_fuzz::addr`, aligned down), `event_idx: bool`; then
//! steps `kind: u8 % 10`: 0 scribble, 1 set an avail idx (`queue: bool`, `delta: u8`),
//! 2 write a descriptor (`queue`, `index: u16`, `amvm_fuzz::descriptor`), 3 write an avail
//! entry (`queue`, `pos: u16`, `head: u16`), 4-5 a TX pass, 6-7 an RX pass, 8 script a
//! connection's stream, 9 notification suppression calls.
#![no_main]

use amvm_devices::vsock::defs::*;
use amvm_devices::vsock::device::CONN_BUF_ALLOC;
use amvm_devices::vsock::muxer::Muxer;
use amvm_devices::vsock::packet::{read_tx, write_rx, PacketError};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use std::num::Wrapping;
use std::sync::atomic::Ordering;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Far more chains than a queue can hold: a TX pass that takes this many does not end.
const MAX_POPS_PER_PASS: usize = 1 << 17;

/// Every descriptor of a chain, checking the length bound.
fn walk(q_size: u16, chain: impl Iterator<Item = Descriptor>) -> Vec<Descriptor> {
    let descs: Vec<Descriptor> = chain.collect();
    assert!(
        descs.len() <= usize::from(q_size) + usize::from(u16::MAX),
        "a chain of {} descriptors in a queue of {q_size}",
        descs.len()
    );
    descs
}

/// `Worker::process_tx`.
fn process_tx(mem: &GuestMemoryMmap, tx: &mut Queue, muxer: &mut Muxer<Ports>) {
    let mut pops = 0usize;
    while let Some(chain) = tx.pop_descriptor_chain(mem) {
        pops += 1;
        assert!(pops <= MAX_POPS_PER_PASS, "a TX pass that does not end");
        let head = chain.head_index();
        // The device hands the chain itself to read_tx; walk a copy for the length check.
        walk(tx.size(), chain.clone());
        let pkt = read_tx(mem, chain);
        trace!("TX chain {head}: {pkt:?}");
        if let Ok(pkt) = pkt {
            muxer.recv_from_guest(&pkt);
        }
        let _ = tx.add_used(mem, head, 0);
    }
}

/// `Worker::fill_rx` (its `loop`/`let else` shape kept, to stay comparable line by line).
#[allow(clippy::while_let_loop)]
fn fill_rx(mem: &GuestMemoryMmap, rx: &mut Queue, muxer: &mut Muxer<Ports>) {
    let mut pops = 0usize;
    loop {
        let Some(chain) = rx.pop_descriptor_chain(mem) else {
            break;
        };
        pops += 1;
        assert!(pops <= MAX_POPS_PER_PASS, "an RX pass that does not end");
        let head = chain.head_index();
        let descs = walk(rx.size(), chain);
        let room: usize = descs
            .iter()
            .filter(|d| d.is_write_only())
            .map(|d| d.len() as usize)
            .sum();
        if room < HDR_LEN || descs.iter().any(|d| !d.is_write_only()) {
            let _ = rx.add_used(mem, head, 0);
            continue;
        }
        let Some((hdr, data)) = muxer.next_for_guest(room - HDR_LEN) else {
            rx.go_to_previous_position();
            break;
        };
        trace!("RX chain {head}: {hdr:?} + {} bytes", data.len());
        let len = match write_rx(mem, descs, &hdr, &data) {
            Ok(n) => n,
            Err(e) => {
                assert!(
                    matches!(e, PacketError::BadAddress { .. }),
                    "an accepted RX chain failed: {e}"
                );
                0
            }
        };
        let _ = rx.add_used(mem, head, len);
    }
}

fn pick<'q>(rx: &'q mut Queue, tx: &'q mut Queue, inp: &mut Input) -> &'q mut Queue {
    if inp.bool() {
        tx
    } else {
        rx
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mem = guest_mem();
    scribble(&mem, &mut inp);
    let Some(mut rx) = driver_queue(&mem, &mut inp, QUEUE_SIZE) else {
        trace!("RX queue invalid");
        return;
    };
    let Some(mut tx) = driver_queue(&mem, &mut inp, QUEUE_SIZE) else {
        trace!("TX queue invalid");
        return;
    };
    let mut muxer = Muxer::new(Ports::default(), 3, CONN_BUF_ALLOC);
    while !inp.is_empty() {
        match inp.u8() % 10 {
            0 => scribble(&mem, &mut inp),
            1 => {
                let q = pick(&mut rx, &mut tx, &mut inp);
                let idx = (Wrapping(q.next_avail()) + Wrapping(u16::from(inp.u8()))).0;
                let _ = mem.write_obj(idx.to_le(), GuestAddress(q.avail_ring() + 2));
            }
            2 => {
                let q = pick(&mut rx, &mut tx, &mut inp);
                let i = u64::from(inp.u16() % q.size());
                let d = descriptor(&mut inp);
                let _ = mem.write_obj(
                    RawDescriptor::from(d),
                    GuestAddress(q.desc_table() + i * 16),
                );
            }
            3 => {
                let q = pick(&mut rx, &mut tx, &mut inp);
                let pos = u64::from(inp.u16() % q.size());
                let head = inp.u16();
                let _ = mem.write_obj(head.to_le(), GuestAddress(q.avail_ring() + 4 + 2 * pos));
            }
            4 | 5 => process_tx(&mem, &mut tx, &mut muxer),
            6 | 7 => fill_rx(&mem, &mut rx, &mut muxer),
            8 => {
                let keys: Vec<_> = muxer.connections().map(|(k, _)| *k).collect();
                let i = usize::from(inp.u8());
                if let Some(key) = keys.get(i % keys.len().max(1)) {
                    let conn = muxer.connection_mut(key).expect("live");
                    script(conn.stream_mut(), &mut inp);
                    conn.flush_to_host();
                }
            }
            _ => {
                let q = pick(&mut rx, &mut tx, &mut inp);
                let _ = match inp.u8() % 4 {
                    0 => q.enable_notification(&mem).map(drop),
                    1 => q.disable_notification(&mem),
                    2 => q.needs_notification(&mem).map(drop),
                    _ => q.avail_idx(&mem, Ordering::Acquire).map(drop),
                };
            }
        }
        muxer.reap();
    }
});
