//! virtio-blk, read-only: an image file (in practice an EROFS file system) the guest reads and
//! can never write.
//!
//! Read-only twice over: the device offers `VIRTIO_BLK_F_RO` (the guest's block layer refuses
//! writes itself) and this side refuses every request but reads and the device id, whatever
//! the guest's kernel does; the image is open `O_RDONLY` in any case. One queue, served by a
//! worker thread of its own: a chain is a 16-byte header the device reads, the data, and a
//! status byte the device writes last. Everything in a chain is checked (header size, which
//! descriptors are writable, the range against the image, the request's size); a chain that
//! fails is answered `VIRTIO_BLK_S_IOERR` when it has a status byte to say so, and used with
//! nothing written when it has not: an error for that request, never for the device.

use super::hold::WorkerHold;
use super::VIRTIO_RING_F_EVENT_IDX;
use super::{ActivateError, InterruptStatus, VirtioDevice, VIRTIO_F_VERSION_1};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// `virtio_ids.h`.
pub const VIRTIO_ID_BLOCK: u32 = 2;
/// Feature bits (`virtio_blk.h`): the largest segment, the most segments, read-only.
const VIRTIO_BLK_F_SIZE_MAX: u32 = 1;
const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
const VIRTIO_BLK_F_RO: u32 = 5;
/// Request types.
const VIRTIO_BLK_T_IN: u32 = 0;
const VIRTIO_BLK_T_OUT: u32 = 1;
const VIRTIO_BLK_T_FLUSH: u32 = 4;
const VIRTIO_BLK_T_GET_ID: u32 = 8;
/// Status values.
const VIRTIO_BLK_S_OK: u8 = 0;
const VIRTIO_BLK_S_IOERR: u8 = 1;
const VIRTIO_BLK_S_UNSUPP: u8 = 2;
/// The request header: `le32 type, le32 reserved, le64 sector`.
const HEADER_LEN: u32 = 16;
/// Sectors are 512 bytes whatever the image's block size.
pub const SECTOR: u64 = 512;
/// `VIRTIO_BLK_ID_BYTES`: the serial the guest shows as `/sys/block/vdX/serial`.
pub const ID_BYTES: usize = 20;
/// The queue's size.
pub const QUEUE_SIZE: u16 = 256;
/// What the config space tells the driver: segments of at most 1 MiB, at most 128 of them
/// (Linux then never sends a larger request than this device reads at once).
const SIZE_MAX: u32 = 1 << 20;
const SEG_MAX: u32 = 128;
/// A read's data, at most (a chain that claims more is refused): what the driver was told.
pub const MAX_REQUEST: u64 = 4 << 20;

const TOKEN_KICK: u64 = 0;
const TOKEN_KILL: u64 = 1;
const TOKEN_HOLD: u64 = 2;

/// A read-only virtio-blk device over an image file.
pub struct BlockDevice {
    /// The image's length, as sectors (a trailing part of a sector is out of reach).
    sectors: u64,
    id: [u8; ID_BYTES],
    acked_features: u64,
    queue_sizes: [u16; 1],
    kill: EventFd,
    /// The worker exists from the start (so it is filtered before the guest runs) and waits
    /// here for the device's activation.
    activate: Option<std::sync::mpsc::SyncSender<Activation>>,
    worker: Option<JoinHandle<()>>,
    hold: WorkerHold,
}

impl std::fmt::Debug for BlockDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockDevice")
            .field("sectors", &self.sectors)
            .field("id", &String::from_utf8_lossy(&self.id))
            .finish_non_exhaustive()
    }
}

struct Activation {
    mem: GuestMemoryMmap,
    queue: Queue,
    kick: EventFd,
    interrupt: Arc<InterruptStatus>,
}

impl BlockDevice {
    /// A device reading `image` (opened read-only by the caller), whose guest serial is `id`
    /// (at most [`ID_BYTES`] bytes; longer is cut). The worker thread starts now and runs
    /// `on_start` first (the VMM's seccomp filter for it).
    pub fn new(image: File, id: &str, on_start: Box<dyn FnOnce() + Send>) -> io::Result<Self> {
        let len = image.metadata()?.len();
        let sectors = len / SECTOR;
        let mut serial = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&id.as_bytes()[..n]);
        let kill = EventFd::new(libc::EFD_NONBLOCK)?;
        let worker_kill = kill.try_clone()?;
        let hold = WorkerHold::new()?;
        let worker_hold = hold.clone();
        let epoll = Epoll::new()?;
        let (activate, activation) = std::sync::mpsc::sync_channel::<Activation>(1);
        let worker = std::thread::Builder::new()
            .name("virtio-blk".into())
            .stack_size(crate::THREAD_STACK_SIZE)
            .spawn(move || {
                on_start();
                let Ok(a) = activation.recv() else { return };
                let requests = Requests {
                    mem: a.mem,
                    queue: a.queue,
                    image,
                    sectors,
                    id: serial,
                    interrupt: a.interrupt,
                    buf: Vec::new(),
                };
                if let Err(e) = run(requests, &a.kick, &worker_kill, &worker_hold, &epoll) {
                    tracing::error!("virtio-blk worker stopped: {e}");
                }
            })?;
        Ok(BlockDevice {
            sectors,
            id: serial,
            acked_features: 0,
            queue_sizes: [QUEUE_SIZE],
            kill,
            activate: Some(activate),
            worker: Some(worker),
            hold,
        })
    }

    /// What holds the worker for a snapshot.
    pub fn hold(&self) -> WorkerHold {
        self.hold.clone()
    }

    /// The image's size in sectors, as the guest sees it.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }
}

impl Drop for BlockDevice {
    fn drop(&mut self) {
        let _ = self.kill.write(1);
        self.activate.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// `struct virtio_blk_config` up to `seg_max`: `le64 capacity, le32 size_max, le32 seg_max`.
fn config_space(sectors: u64) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[..8].copy_from_slice(&sectors.to_le_bytes());
    c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
    c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
    c
}

impl VirtioDevice for BlockDevice {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }
    fn device_features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_BLK_F_RO)
            | (1 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
    }
    fn ack_features(&mut self, acked: u64) {
        self.acked_features = acked;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&config_space(self.sectors), offset, data);
    }
    /// Nothing in the config space is writable (`writeback` needs `CONFIG_WCE`, not offered).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
        interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError> {
        let got = queues.len().min(queue_evts.len());
        let (Ok([queue]), Ok([kick])) = (
            <[Queue; 1]>::try_from(queues),
            <[EventFd; 1]>::try_from(queue_evts),
        ) else {
            return Err(ActivateError::QueueCount { expected: 1, got });
        };
        if !queue.ready() {
            return Err(ActivateError::QueueNotReady { index: 0 });
        }
        let activate = self
            .activate
            .take()
            .ok_or(ActivateError::AlreadyActivated)?;
        // A restored driver may have queued requests whose kick the old device took: look once.
        let _ = kick.write(1);
        activate
            .send(Activation {
                mem,
                queue,
                kick,
                interrupt,
            })
            .map_err(|_| {
                ActivateError::Backend(io::Error::other("the virtio-blk worker has stopped"))
            })?;
        self.hold.set_active();
        Ok(())
    }
}

fn run(
    mut requests: Requests,
    kick: &EventFd,
    kill: &EventFd,
    hold: &WorkerHold,
    epoll: &Epoll,
) -> io::Result<()> {
    for (fd, token) in [
        (kick.as_raw_fd(), TOKEN_KICK),
        (kill.as_raw_fd(), TOKEN_KILL),
        (hold.wake_fd(), TOKEN_HOLD),
    ] {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )?;
    }
    let mut events = [EpollEvent::default(); 4];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_KILL => return Ok(()),
                // Requests are served whole within a pass: held between two, nothing is
                // half done.
                TOKEN_HOLD => hold.wait_if_held(),
                _ => {
                    let _ = kick.read();
                }
            }
        }
        requests.pass();
    }
}

/// The request side: the guest's queue and the image. Public for the fuzz target
/// (`tests/fuzz/fuzz_targets/block.rs`), which drives [`Requests::pass`] by hand.
pub struct Requests {
    pub mem: GuestMemoryMmap,
    pub queue: Queue,
    pub image: File,
    pub sectors: u64,
    pub id: [u8; ID_BYTES],
    pub interrupt: Arc<InterruptStatus>,
    buf: Vec<u8>,
}

/// One chain, taken apart: the header, the data segments (address, length), where the status
/// byte goes.
struct Parsed {
    kind: u32,
    sector: u64,
    data: Vec<(GuestAddress, u32, bool)>,
    status: Option<GuestAddress>,
}

impl Requests {
    pub fn new(
        mem: GuestMemoryMmap,
        queue: Queue,
        image: File,
        id: [u8; ID_BYTES],
        interrupt: Arc<InterruptStatus>,
    ) -> io::Result<Self> {
        let sectors = image.metadata()?.len() / SECTOR;
        Ok(Requests {
            mem,
            queue,
            image,
            sectors,
            id,
            interrupt,
            buf: Vec::new(),
        })
    }

    /// Serve every request the driver queued; interrupt if it asked for one.
    pub fn pass(&mut self) {
        let Requests {
            mem,
            queue,
            image,
            sectors,
            id,
            interrupt,
            buf,
        } = self;
        let mem = &*mem;
        let mut disk = Disk {
            mem,
            image,
            sectors: *sectors,
            id,
            buf,
        };
        let used = super::serve_available(queue, mem, "virtio-blk", |chain| {
            disk.serve(parse(mem, chain))
        });
        if used {
            interrupt.signal_used_if_due(queue, mem, "virtio-blk");
        }
    }
}

/// What serving a request reads: guest memory and the image.
struct Disk<'a> {
    mem: &'a GuestMemoryMmap,
    image: &'a File,
    sectors: u64,
    id: &'a [u8; ID_BYTES],
    buf: &'a mut Vec<u8>,
}

impl Disk<'_> {
    /// One request; returns what the used ring says the device wrote.
    fn serve(&mut self, parsed: Result<Parsed, (String, Option<GuestAddress>)>) -> u32 {
        let p = match parsed {
            Ok(p) => p,
            Err((why, status)) => {
                tracing::warn!("virtio-blk: refused a request: {why}");
                return self.finish(status, 0, VIRTIO_BLK_S_IOERR);
            }
        };
        let (status, written) = match p.kind {
            VIRTIO_BLK_T_IN => match self.read(&p) {
                Ok(n) => (VIRTIO_BLK_S_OK, n),
                Err(why) => {
                    tracing::warn!("virtio-blk: read at sector {}: {why}", p.sector);
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            },
            VIRTIO_BLK_T_GET_ID => match self.get_id(&p) {
                Ok(n) => (VIRTIO_BLK_S_OK, n),
                Err(why) => {
                    tracing::warn!("virtio-blk: device id: {why}");
                    (VIRTIO_BLK_S_IOERR, 0)
                }
            },
            // A read-only device: the guest's kernel knows (VIRTIO_BLK_F_RO), and a guest that
            // writes anyway is refused here whatever it sends.
            VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_FLUSH => (VIRTIO_BLK_S_IOERR, 0),
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        self.finish(p.status, written, status)
    }

    /// Write the status byte (if the chain has one); the used length counts it.
    fn finish(&self, status_at: Option<GuestAddress>, written: u32, status: u8) -> u32 {
        let Some(at) = status_at else {
            return 0;
        };
        match self.mem.write_obj(status, at) {
            Ok(()) => written.saturating_add(1),
            Err(e) => {
                tracing::warn!("virtio-blk: status byte: {e}");
                written
            }
        }
    }

    /// `VIRTIO_BLK_T_IN`: the sectors from `p.sector` into the writable segments.
    fn read(&mut self, p: &Parsed) -> Result<u32, String> {
        if p.data.iter().any(|&(_, _, write)| !write) {
            return Err("a read with a data buffer the device may not write".into());
        }
        let total: u64 = p.data.iter().map(|&(_, len, _)| u64::from(len)).sum();
        if total > MAX_REQUEST {
            return Err(format!(
                "{total} bytes, more than the {MAX_REQUEST} a request may read"
            ));
        }
        if !total.is_multiple_of(SECTOR) {
            return Err(format!("{total} bytes, not whole sectors"));
        }
        let within = p
            .sector
            .checked_add(total / SECTOR)
            .is_some_and(|end| end <= self.sectors);
        if !within {
            return Err(format!(
                "{} sectors from sector {}: past the image's {}",
                total / SECTOR,
                p.sector,
                self.sectors
            ));
        }
        let mut offset = p.sector * SECTOR;
        for &(addr, len, _) in &p.data {
            self.buf.resize(len as usize, 0);
            self.image
                .read_exact_at(self.buf, offset)
                .map_err(|e| format!("the image: {e}"))?;
            self.mem
                .write_slice(self.buf, addr)
                .map_err(|e| format!("guest memory: {e}"))?;
            offset += u64::from(len);
        }
        // At most MAX_REQUEST.
        Ok(total as u32)
    }

    /// `VIRTIO_BLK_T_GET_ID`: the serial, as much of it as the buffer holds.
    fn get_id(&self, p: &Parsed) -> Result<u32, String> {
        let Some(&(addr, len, true)) = p.data.first() else {
            return Err("no writable buffer for the id".into());
        };
        let n = (len as usize).min(ID_BYTES);
        self.mem
            .write_slice(&self.id[..n], addr)
            .map_err(|e| format!("guest memory: {e}"))?;
        Ok(n as u32)
    }
}

/// Take a chain apart. On failure: why, and the status byte's address if the chain has a
/// usable one (so the driver still hears of the error).
fn parse(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> Result<Parsed, (String, Option<GuestAddress>)> {
    let descs: Vec<_> = chain.collect();
    // The status byte: the last byte of the last descriptor, which the device writes.
    let status = descs
        .last()
        .filter(|d| d.is_write_only() && d.len() >= 1)
        .and_then(|d| d.addr().checked_add(u64::from(d.len()) - 1))
        .filter(|&at| mem.address_in_range(at));
    let fail = |why: String| Err((why, status));
    let Some(first) = descs.first() else {
        return fail("an empty chain".into());
    };
    if descs.len() < 2 {
        return fail("a chain of one descriptor: no header and status apart".into());
    }
    if status.is_none() {
        return fail("the last descriptor is not a writable status byte in guest memory".into());
    }
    if first.is_write_only() || first.len() < HEADER_LEN {
        return fail(format!(
            "the header: {} bytes{}",
            first.len(),
            if first.is_write_only() {
                ", device-writable"
            } else {
                ""
            }
        ));
    }
    let mut header = [0u8; HEADER_LEN as usize];
    if let Err(e) = mem.read_slice(&mut header, first.addr()) {
        return fail(format!("the header: {e}"));
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let mut data = Vec::with_capacity(descs.len());
    // The header's descriptor may carry data after the header (any layout is allowed); the
    // last one's bytes before the status byte are data too.
    if first.len() > HEADER_LEN {
        let Some(at) = first.addr().checked_add(u64::from(HEADER_LEN)) else {
            return fail("the header's descriptor wraps around".into());
        };
        data.push((at, first.len() - HEADER_LEN, false));
    }
    let last = descs.len() - 1;
    for (i, d) in descs.iter().enumerate().skip(1) {
        let len = if i == last { d.len() - 1 } else { d.len() };
        if len > 0 {
            data.push((d.addr(), len, d.is_write_only()));
        }
    }
    Ok(Parsed {
        kind,
        sector,
        data,
        status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_utils::{test_mem, CountingInterrupt};
    use std::io::Write;
    use virtio_queue::desc::split::Descriptor;

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    /// An image of `sectors` sectors, sector k filled with the byte k.
    fn image(sectors: u64) -> File {
        let mut f = tempfile();
        for k in 0..sectors {
            f.write_all(&[k as u8; SECTOR as usize]).unwrap();
        }
        f
    }

    fn tempfile() -> File {
        let path = std::env::temp_dir().join(format!(
            "amvm-blk-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    fn requests(sectors: u64) -> (Requests, Arc<CountingInterrupt>) {
        let mut q = Queue::new(16).unwrap();
        q.try_set_desc_table_address(GuestAddress(DESC)).unwrap();
        q.try_set_avail_ring_address(GuestAddress(AVAIL)).unwrap();
        q.try_set_used_ring_address(GuestAddress(USED)).unwrap();
        q.set_ready(true);
        let line = Arc::new(CountingInterrupt::default());
        let mut id = [0u8; ID_BYTES];
        id[..6].copy_from_slice(b"amvm-0");
        let r = Requests::new(
            test_mem(),
            q,
            image(sectors),
            id,
            Arc::new(InterruptStatus::new(line.clone())),
        )
        .unwrap();
        (r, line)
    }

    /// The driver offers a chain at descriptors `first..`: (address, length, flags).
    fn offer(r: &Requests, first: u16, chain: &[(u64, u32, u16)]) {
        for (k, &(addr, len, flags)) in chain.iter().enumerate() {
            let i = first + k as u16;
            let next = if k + 1 < chain.len() { F_NEXT } else { 0 };
            let d = Descriptor::new(addr, len, flags | next, i + 1);
            r.mem
                .write_obj(d, GuestAddress(DESC + 16 * u64::from(i)))
                .unwrap();
        }
        let idx: u16 = r.mem.read_obj(GuestAddress(AVAIL + 2)).unwrap();
        r.mem
            .write_obj(first, GuestAddress(AVAIL + 4 + 2 * u64::from(idx % 16)))
            .unwrap();
        r.mem
            .write_obj(idx.wrapping_add(1), GuestAddress(AVAIL + 2))
            .unwrap();
    }

    fn header(r: &Requests, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        r.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn used(r: &Requests) -> Vec<(u32, u32)> {
        let idx: u16 = r.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = USED + 4 + 8 * u64::from(i % 16);
                (
                    r.mem.read_obj(GuestAddress(at)).unwrap(),
                    r.mem.read_obj(GuestAddress(at + 4)).unwrap(),
                )
            })
            .collect()
    }

    fn byte(r: &Requests, at: u64) -> u8 {
        r.mem.read_obj(GuestAddress(at)).unwrap()
    }

    #[test]
    fn reads_land_in_every_segment_and_say_ok() {
        let (mut r, line) = requests(8);
        r.mem.write_obj(0xffu8, GuestAddress(0x9000)).unwrap();
        header(&r, 0x8000, VIRTIO_BLK_T_IN, 2);
        // Sectors 2 and 3: one in low RAM, one in the other region; then the status.
        offer(
            &r,
            0,
            &[
                (0x8000, 16, 0),
                (0xa000, 512, F_WRITE),
                (0x20_0000, 512, F_WRITE),
                (0x9000, 1, F_WRITE),
            ],
        );
        r.pass();
        assert_eq!(used(&r), [(0, 1025)]);
        assert_eq!(byte(&r, 0x9000), VIRTIO_BLK_S_OK);
        assert_eq!((byte(&r, 0xa000), byte(&r, 0xa1ff)), (2, 2));
        assert_eq!((byte(&r, 0x20_0000), byte(&r, 0x20_01ff)), (3, 3));
        assert_eq!(line.count(), 1);
    }

    #[test]
    fn the_serial_is_the_id_cut_to_the_buffer() {
        let (mut r, _) = requests(1);
        header(&r, 0x8000, VIRTIO_BLK_T_GET_ID, 0);
        offer(
            &r,
            0,
            &[(0x8000, 16, 0), (0xa000, 20, F_WRITE), (0x9000, 1, F_WRITE)],
        );
        header(&r, 0x8100, VIRTIO_BLK_T_GET_ID, 0);
        offer(
            &r,
            3,
            &[(0x8100, 16, 0), (0xb000, 4, F_WRITE), (0x9001, 1, F_WRITE)],
        );
        r.pass();
        assert_eq!(used(&r), [(0, 21), (3, 5)]);
        let mut id = [0u8; 20];
        r.mem.read_slice(&mut id, GuestAddress(0xa000)).unwrap();
        assert_eq!(&id[..7], b"amvm-0\0");
        let mut short = [0u8; 5];
        r.mem.read_slice(&mut short, GuestAddress(0xb000)).unwrap();
        assert_eq!(&short, b"amvm\0");
    }

    #[test]
    fn writes_flushes_and_unknown_requests_are_refused_and_change_nothing() {
        let (mut r, _) = requests(4);
        let before = {
            let mut b = vec![0u8; 4 * SECTOR as usize];
            r.image.read_exact_at(&mut b, 0).unwrap();
            b
        };
        r.mem
            .write_slice(&[0xaa; 512], GuestAddress(0xa000))
            .unwrap();
        header(&r, 0x8000, VIRTIO_BLK_T_OUT, 0);
        offer(
            &r,
            0,
            &[(0x8000, 16, 0), (0xa000, 512, 0), (0x9000, 1, F_WRITE)],
        );
        header(&r, 0x8100, VIRTIO_BLK_T_FLUSH, 0);
        offer(&r, 3, &[(0x8100, 16, 0), (0x9001, 1, F_WRITE)]);
        header(&r, 0x8200, 99, 0);
        offer(&r, 5, &[(0x8200, 16, 0), (0x9002, 1, F_WRITE)]);
        r.pass();
        assert_eq!(used(&r), [(0, 1), (3, 1), (5, 1)]);
        assert_eq!(byte(&r, 0x9000), VIRTIO_BLK_S_IOERR);
        assert_eq!(byte(&r, 0x9001), VIRTIO_BLK_S_IOERR);
        assert_eq!(byte(&r, 0x9002), VIRTIO_BLK_S_UNSUPP);
        let mut after = vec![0u8; 4 * SECTOR as usize];
        r.image.read_exact_at(&mut after, 0).unwrap();
        assert_eq!(before, after);
    }

    #[test]
    fn malformed_chains_are_errors_for_their_request_only() {
        let (mut r, _) = requests(4);
        r.mem
            .write_slice(&[0x5a; 4096], GuestAddress(0xa000))
            .unwrap();
        // Past the end of the image (and a sector count that overflows).
        header(&r, 0x8000, VIRTIO_BLK_T_IN, 3);
        offer(
            &r,
            0,
            &[
                (0x8000, 16, 0),
                (0xa000, 1024, F_WRITE),
                (0x9000, 1, F_WRITE),
            ],
        );
        header(&r, 0x8100, VIRTIO_BLK_T_IN, u64::MAX);
        offer(
            &r,
            3,
            &[
                (0x8100, 16, 0),
                (0xa000, 512, F_WRITE),
                (0x9001, 1, F_WRITE),
            ],
        );
        // Not whole sectors; a data buffer the device may not write.
        header(&r, 0x8200, VIRTIO_BLK_T_IN, 0);
        offer(
            &r,
            6,
            &[
                (0x8200, 16, 0),
                (0xa000, 100, F_WRITE),
                (0x9002, 1, F_WRITE),
            ],
        );
        header(&r, 0x8300, VIRTIO_BLK_T_IN, 0);
        offer(
            &r,
            9,
            &[(0x8300, 16, 0), (0xa000, 512, 0), (0x9003, 1, F_WRITE)],
        );
        r.pass();
        assert_eq!(used(&r), [(0, 1), (3, 1), (6, 1), (9, 1)]);
        for at in 0x9000..0x9004 {
            assert_eq!(byte(&r, at), VIRTIO_BLK_S_IOERR);
        }
        // None of them wrote guest memory.
        let mut data = vec![0u8; 1024];
        r.mem.read_slice(&mut data, GuestAddress(0xa000)).unwrap();
        assert!(data.iter().all(|&b| b == 0x5a));
        // No status byte (the last descriptor read-only): used with nothing written. A short
        // header; a data buffer outside guest RAM; a writable header: each answered IOERR.
        offer(&r, 0, &[(0x8000, 16, 0), (0xa000, 512, 0)]);
        header(&r, 0x8000, VIRTIO_BLK_T_IN, 0);
        offer(&r, 2, &[(0x8000, 8, 0), (0x9000, 1, F_WRITE)]);
        offer(
            &r,
            4,
            &[
                (0x8000, 16, 0),
                (0x50_0000, 512, F_WRITE),
                (0x9001, 1, F_WRITE),
            ],
        );
        offer(&r, 7, &[(0x8000, 16, F_WRITE), (0x9002, 1, F_WRITE)]);
        offer(&r, 9, &[(0x8000, 16, 0)]);
        r.pass();
        assert_eq!(&used(&r)[4..], [(0, 0), (2, 1), (4, 1), (7, 1), (9, 0)]);
        for at in 0x9000..0x9003 {
            assert_eq!(byte(&r, at), VIRTIO_BLK_S_IOERR);
        }
    }

    #[test]
    fn a_request_larger_than_the_limit_is_refused() {
        let (mut r, _) = requests(16);
        header(&r, 0x8000, VIRTIO_BLK_T_IN, 0);
        // Five descriptors of 1 MiB claimed (the memory need not hold them: refused first).
        let big = 1u32 << 20;
        offer(
            &r,
            0,
            &[
                (0x8000, 16, 0),
                (0x20_0000, big, F_WRITE),
                (0x20_0000, big, F_WRITE),
                (0x20_0000, big, F_WRITE),
                (0x20_0000, big, F_WRITE),
                (0x20_0000, big, F_WRITE),
                (0x9000, 1, F_WRITE),
            ],
        );
        r.pass();
        assert_eq!(used(&r), [(0, 1)]);
        assert_eq!(byte(&r, 0x9000), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn the_device_is_read_only_and_reports_its_size() {
        let dev = BlockDevice::new(image(9), "amvm-1", Box::new(|| {})).unwrap();
        assert_eq!(dev.device_type(), VIRTIO_ID_BLOCK);
        assert_ne!(dev.device_features() & (1 << VIRTIO_BLK_F_RO), 0);
        let mut cap = [0u8; 8];
        dev.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 9);
        let mut seg = [0u8; 4];
        dev.read_config(12, &mut seg);
        assert_eq!(u32::from_le_bytes(seg), SEG_MAX);
        let mut past = [7u8; 4];
        dev.read_config(64, &mut past);
        assert_eq!(past, [7; 4]);
    }
}
