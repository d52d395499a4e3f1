//! The virtio-fs relay (`devices/src/virtio/fs_relay.rs`) between a hostile guest and a hostile
//! backend: the guest's two queues (sizes and ring addresses any that pass `Queue::is_valid`,
//! their avail indexes, entries and descriptors, guest memory scribbled between passes) on one
//! side; on the other, used entries in the shadow rings naming any id with any length, used
//! indexes that jump, and the shadow's data scribbled.
//!
//! Checked: nothing panics, every pass ends, and no ring ever has more requests in flight than
//! it has slots.
//!
//! Input: guest memory writes (`amvm_fuzz::scribble`), per queue a size class `u8` (+ `u16`),
//! three ring addresses, `event_idx: bool`; then steps `kind: u8 % 8`: 0 scribble, 1 set an
//! avail idx (`queue: bool`, `delta: u8`), 2 write a descriptor (`queue`, `index: u16`,
//! `amvm_fuzz::descriptor`), 3 write an avail entry (`queue`, `pos: u16`, `head: u16`), 4-5 a
//! relay pass, 6 the backend uses an entry (`queue`, `id`: an offered head or any `u32`,
//! `len: u32`, `jump: u8`), 7 the backend writes into the shadow's data (`off: u32`, bytes).
#![no_main]

use amvm_devices::virtio::fs_relay::{
    ring_addresses, Relay, DATA_LEN, DATA_START, RING_SIZE, SHADOW_LEN, SLOTS,
};
use amvm_devices::virtio::{Interrupt, InterruptStatus};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

#[derive(Debug)]
struct NoLine;
impl Interrupt for NoLine {
    fn trigger(&self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mem = guest_mem();
    scribble(&mem, &mut inp);
    let mut queues = Vec::new();
    for _ in 0..2 {
        let Some(q) = driver_queue(&mem, &mut inp, 1024) else {
            trace!("queue invalid");
            return;
        };
        queues.push(q);
    }
    // What the driver side needs of each queue, kept before the relay owns them.
    let rings: Vec<(u16, u64, u64)> = queues
        .iter()
        .map(|q| (q.size(), q.desc_table(), q.avail_ring()))
        .collect();
    let shadow =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), SHADOW_LEN as usize)]).expect("shadow");
    let interrupt = Arc::new(InterruptStatus::new(Arc::new(NoLine)));
    let mut relay =
        Relay::standalone(mem.clone(), shadow.clone(), queues, interrupt).expect("relay");
    while !inp.is_empty() {
        let which = usize::from(inp.bool());
        let (size, table, avail) = rings[which];
        match inp.u8() % 8 {
            0 => scribble(&mem, &mut inp),
            kind @ 1..=3 => driver_write(&mem, &mut inp, kind, (size, table, avail)),
            4 | 5 => relay.pass(),
            6 => {
                let (_, s_avail, s_used) = ring_addresses(which);
                let id = if inp.bool() {
                    // One of the heads the relay offered (most recent first).
                    let idx: u16 = shadow.read_obj(GuestAddress(s_avail + 2)).unwrap();
                    let back = u16::from(inp.u8()) + 1;
                    let at = s_avail + 4 + 2 * u64::from(idx.wrapping_sub(back) % RING_SIZE);
                    u32::from(shadow.read_obj::<u16>(GuestAddress(at)).unwrap())
                } else {
                    inp.u32()
                };
                let len = inp.u32();
                let used: u16 = shadow.read_obj(GuestAddress(s_used + 2)).unwrap();
                let at = s_used + 4 + 8 * u64::from(used % RING_SIZE);
                shadow.write_obj(id, GuestAddress(at)).unwrap();
                shadow.write_obj(len, GuestAddress(at + 4)).unwrap();
                let jump = match inp.u8() {
                    0..=239 => 1,
                    j => (u16::from(j) - 239) * 300,
                };
                shadow
                    .write_obj(used.wrapping_add(jump), GuestAddress(s_used + 2))
                    .unwrap();
            }
            _ => {
                let off = u64::from(inp.u32()) % DATA_LEN;
                let bytes = inp.bytes(64);
                let _ = shadow.write_slice(bytes, GuestAddress(DATA_START + off));
            }
        }
        for i in 0..2 {
            assert!(
                relay.in_flight(i) <= usize::from(SLOTS),
                "ring {i} over its slots"
            );
        }
    }
});
