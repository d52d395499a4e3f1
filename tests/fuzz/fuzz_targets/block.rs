//! The read-only virtio-blk device's request side (`devices/src/virtio/block.rs`) against a
//! hostile driver: its queue (size and ring addresses any that pass `Queue::is_valid`), avail
//! index and entries, descriptors (headers of any type and sector, data anywhere, chains that
//! loop or go through indirect tables), guest memory scribbled between passes.
//!
//! Checked: nothing panics, every pass ends, the used index never runs ahead of what the
//! driver made available, and the image is never written (its bytes are the same after).
//!
//! Input: guest memory writes (`amvm_fuzz::scribble`), the queue (`amvm_fuzz::driver_queue`);
//! then steps `kind: u8 % 6`: 0 scribble, 1 set the avail idx (`delta: u8`), 2 write a
//! descriptor (`index: u16`, `amvm_fuzz::descriptor`), 3 write an avail entry (`pos: u16`,
//! `head: u16`), 4 write a request header (`amvm_fuzz::addr`, `type: u8 % 10`, `sector: u8` or
//! a raw `u64`), 5 a pass.
#![no_main]

use amvm_devices::virtio::block::{Requests, ID_BYTES, SECTOR};
use amvm_devices::virtio::{Interrupt, InterruptStatus};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

#[derive(Debug)]
struct NoLine;
impl Interrupt for NoLine {
    fn trigger(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// 64 sectors, sector k all k; one file for the whole run (unlinked at once).
const SECTORS: u64 = 64;
fn image() -> &'static std::fs::File {
    static IMAGE: OnceLock<std::fs::File> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("amvm-fuzz-blk-{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("the image");
        let _ = std::fs::remove_file(&path);
        for k in 0..SECTORS {
            f.write_all(&[k as u8; SECTOR as usize]).expect("the image");
        }
        f
    })
}

fn image_intact(f: &std::fs::File) -> bool {
    let mut buf = vec![0u8; (SECTORS * SECTOR) as usize];
    f.read_exact_at(&mut buf, 0).expect("the image");
    buf.chunks(SECTOR as usize)
        .enumerate()
        .all(|(k, s)| s.iter().all(|&b| b == k as u8))
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mem = guest_mem();
    scribble(&mem, &mut inp);
    let Some(queue) = driver_queue(&mem, &mut inp, 256) else {
        trace!("queue invalid");
        return;
    };
    let (size, table, avail) = (queue.size(), queue.desc_table(), queue.avail_ring());
    let file = image().try_clone().expect("the image");
    let interrupt = Arc::new(InterruptStatus::new(Arc::new(NoLine)));
    let mut id = [0u8; ID_BYTES];
    id[..9].copy_from_slice(b"amvm-fuzz");
    let mut requests = Requests::new(mem.clone(), queue, file, id, interrupt).expect("requests");
    let mut passes = 0u32;
    while !inp.is_empty() {
        match inp.u8() % 6 {
            0 => scribble(&mem, &mut inp),
            kind @ 1..=3 => driver_write(&mem, &mut inp, kind, (size, table, avail)),
            4 => {
                let at = addr(&mut inp);
                let kind = u32::from(inp.u8() % 10);
                let sector = if inp.bool() {
                    u64::from(inp.u8())
                } else {
                    inp.u64()
                };
                let mut h = [0u8; 16];
                h[..4].copy_from_slice(&kind.to_le_bytes());
                h[8..].copy_from_slice(&sector.to_le_bytes());
                let _ = mem.write_slice(&h, GuestAddress(at));
            }
            _ => {
                // The device's own count (the guest may scribble the used ring's index).
                let before = requests.queue.next_used();
                requests.pass();
                passes += 1;
                let after = requests.queue.next_used();
                assert!(
                    after.wrapping_sub(before) <= size,
                    "pass {passes}: used {before} -> {after} on a ring of {size}"
                );
            }
        }
    }
    assert!(image_intact(image()), "the image was written");
});
