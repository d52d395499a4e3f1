//! The virtio-mmio transport (`devices/src/virtio/mmio.rs`): guest reads and writes at any
//! offset, of any size (0..=8 bytes) and value, in any order, in front of a small recording
//! device whose queue sizes, features, config space and reset/activation behaviour come from
//! the input too. Besides "nothing panics", checked after every access:
//!
//! * the status byte only ever holds a prefix of ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK
//!   (plus FAILED / DEVICE_NEEDS_RESET), and reads back as the transport says;
//! * the device is activated only after DRIVER_OK, never twice without a reset, with one queue
//!   and one event fd per queue, every ready queue valid in guest memory; it is told only
//!   features it offered, VERSION_1 among them;
//! * register accesses that are not aligned 32-bit words read as zero; config reads return the
//!   device's bytes, zeros past its end or past the window.
//!
//! Input: the device (`nqueues: u8 % 5`, per queue a max-size class `u8` (+ `u16`),
//! `features: u64`, `version1: bool`, `config_len: u8 % 64`, `can_reset`, `fail_activate`),
//! then steps `kind: u8 % 10`: 0-1 read (`offset`, `size: u8 % 9`), 2-3 write (`offset`,
//! `size`, 8 value bytes), 4 Linux-style status bit add (`bit: u8`), 5 program a queue,
//! 6 driver features, 7 the whole init sequence, 8 device-side interrupt, 9 QueueNotify.
//! An offset is `class: u8` then a register (`u8`), a config offset (`u16`) or a raw `u64`.
#![no_main]

use amvm_devices::virtio::mmio::MMIO_LEN;
use amvm_devices::virtio::*;
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use std::io;
use std::sync::{Arc, Mutex};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, Default)]
struct Line;
impl Interrupt for Line {
    fn trigger(&self) -> io::Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct Dev {
    max_sizes: Vec<u16>,
    features: u64,
    config: Vec<u8>,
    can_reset: bool,
    fail_activate: bool,
    active: bool,
    acked: Option<u64>,
    activations: usize,
}

impl VirtioDevice for Dev {
    fn device_type(&self) -> u32 {
        19
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.max_sizes
    }
    fn device_features(&self) -> u64 {
        self.features
    }
    fn ack_features(&mut self, acked: u64) {
        assert_eq!(acked & !self.features, 0, "acked features not offered");
        assert_ne!(
            acked & (1 << VIRTIO_F_VERSION_1),
            0,
            "acked without VERSION_1"
        );
        assert!(!self.active, "features acked while active");
        self.acked = Some(acked);
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        assert!(offset + data.len() as u64 <= MMIO_LEN - VIRTIO_MMIO_CONFIG);
        assert!(
            data.iter().all(|&b| b == 0),
            "config read buffer not zeroed"
        );
        read_config_bytes(&self.config, offset, data);
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        assert!(offset + data.len() as u64 <= MMIO_LEN - VIRTIO_MMIO_CONFIG);
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
        _interrupt: Arc<InterruptStatus>,
    ) -> Result<(), ActivateError> {
        assert!(!self.active, "activated twice without a reset");
        assert!(self.acked.is_some(), "activated before FEATURES_OK");
        assert_eq!(queues.len(), self.max_sizes.len());
        assert_eq!(queue_evts.len(), queues.len());
        for (q, &max) in queues.iter().zip(&self.max_sizes) {
            assert_eq!(q.max_size(), max);
            assert!(q.size() <= max && q.size().is_power_of_two());
            if q.ready() {
                assert!(
                    q.is_valid(&mem),
                    "a ready queue that does not fit guest memory"
                );
            }
        }
        self.activations += 1;
        if self.fail_activate {
            return Err(ActivateError::Backend(io::Error::other("refused")));
        }
        self.active = true;
        Ok(())
    }
    fn reset(&mut self) -> bool {
        if self.can_reset {
            self.active = false;
            self.acked = None;
        }
        self.can_reset
    }
}

const REGS: [u64; 30] = [
    VIRTIO_MMIO_MAGIC_VALUE,
    VIRTIO_MMIO_VERSION,
    VIRTIO_MMIO_DEVICE_ID,
    VIRTIO_MMIO_VENDOR_ID,
    VIRTIO_MMIO_DEVICE_FEATURES,
    VIRTIO_MMIO_DEVICE_FEATURES_SEL,
    VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL,
    VIRTIO_MMIO_GUEST_PAGE_SIZE,
    VIRTIO_MMIO_QUEUE_SEL,
    VIRTIO_MMIO_QUEUE_NUM_MAX,
    VIRTIO_MMIO_QUEUE_NUM,
    VIRTIO_MMIO_QUEUE_ALIGN,
    VIRTIO_MMIO_QUEUE_PFN,
    VIRTIO_MMIO_QUEUE_READY,
    VIRTIO_MMIO_QUEUE_NOTIFY,
    VIRTIO_MMIO_INTERRUPT_STATUS,
    VIRTIO_MMIO_INTERRUPT_ACK,
    VIRTIO_MMIO_STATUS,
    VIRTIO_MMIO_QUEUE_DESC_LOW,
    VIRTIO_MMIO_QUEUE_DESC_HIGH,
    VIRTIO_MMIO_QUEUE_AVAIL_LOW,
    VIRTIO_MMIO_QUEUE_AVAIL_HIGH,
    VIRTIO_MMIO_QUEUE_USED_LOW,
    VIRTIO_MMIO_QUEUE_USED_HIGH,
    VIRTIO_MMIO_SHM_SEL,
    VIRTIO_MMIO_SHM_LEN_LOW,
    VIRTIO_MMIO_SHM_BASE_HIGH,
    VIRTIO_MMIO_CONFIG_GENERATION,
    VIRTIO_MMIO_CONFIG,
];

fn offset(inp: &mut Input) -> u64 {
    match inp.u8() % 6 {
        0..=2 => REGS[usize::from(inp.u8()) % REGS.len()],
        3 => VIRTIO_MMIO_CONFIG + u64::from(inp.u16()) % (MMIO_LEN - VIRTIO_MMIO_CONFIG + 16),
        4 => u64::from(inp.u16()),
        _ => inp.u64(),
    }
}

struct Rig {
    t: amvm_devices::virtio::MmioTransport,
    dev: Arc<Mutex<Dev>>,
}

impl Rig {
    fn rd(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.read(off, &mut b);
        u32::from_le_bytes(b)
    }
    fn wr(&mut self, off: u64, v: u32) {
        self.t.write(off, &v.to_le_bytes());
    }
    fn add_status(&mut self, bit: u32) {
        let s = self.rd(VIRTIO_MMIO_STATUS);
        self.wr(VIRTIO_MMIO_STATUS, s | bit);
    }
    fn program_queue(&mut self, inp: &mut Input) {
        self.wr(VIRTIO_MMIO_QUEUE_SEL, u32::from(inp.u8() % 6));
        let num = match inp.u8() % 4 {
            0..=2 => 1u32 << (inp.u8() % 10),
            _ => inp.u32(),
        };
        self.wr(VIRTIO_MMIO_QUEUE_NUM, num);
        for (low, high) in [
            (VIRTIO_MMIO_QUEUE_DESC_LOW, VIRTIO_MMIO_QUEUE_DESC_HIGH),
            (VIRTIO_MMIO_QUEUE_AVAIL_LOW, VIRTIO_MMIO_QUEUE_AVAIL_HIGH),
            (VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_QUEUE_USED_HIGH),
        ] {
            let a = addr(inp) & !0xf;
            self.wr(low, a as u32);
            self.wr(high, (a >> 32) as u32);
        }
        let ready = match inp.u8() % 4 {
            0..=2 => 1,
            _ => inp.u32(),
        };
        self.wr(VIRTIO_MMIO_QUEUE_READY, ready);
    }
    fn driver_features(&mut self, inp: &mut Input) {
        let offered = self.dev.lock().unwrap().features;
        let f = match inp.u8() % 4 {
            0 | 1 => offered,
            2 => offered & inp.u64(),
            _ => inp.u64(),
        };
        self.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        self.wr(VIRTIO_MMIO_DRIVER_FEATURES, (f >> 32) as u32);
        self.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        self.wr(VIRTIO_MMIO_DRIVER_FEATURES, f as u32);
        if inp.u8().is_multiple_of(8) {
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES_SEL, u32::from(inp.u8()));
            self.wr(VIRTIO_MMIO_DRIVER_FEATURES, inp.u32());
        }
    }

    fn check(&mut self) {
        const A: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
        const D: u32 = VIRTIO_CONFIG_S_DRIVER;
        const F: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
        const OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
        let status = self.t.status();
        let core = status & !(VIRTIO_CONFIG_S_FAILED | VIRTIO_CONFIG_S_NEEDS_RESET);
        assert!(
            [0, A, A | D, A | D | F, A | D | F | OK].contains(&core),
            "status {status:#x}"
        );
        assert_eq!(self.rd(VIRTIO_MMIO_STATUS), status);
        assert_eq!(self.rd(VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC_VALUE);
        let dev = self.dev.lock().unwrap();
        assert_eq!(self.t.is_activated(), dev.active);
        if dev.active {
            assert_eq!(core, A | D | F | OK, "active without DRIVER_OK");
        }
        if status & F != 0 {
            assert!(dev.acked.is_some(), "FEATURES_OK without ack_features");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let nqueues = inp.u8() % 5;
    let max_sizes: Vec<u16> = (0..nqueues)
        .map(|_| match inp.u8() % 4 {
            0..=2 => 1u16 << (inp.u8() % 16),
            _ => inp.u16(),
        })
        .collect();
    let mut features = inp.u64();
    if !inp.u8().is_multiple_of(8) {
        features |= 1 << VIRTIO_F_VERSION_1;
    }
    let config: Vec<u8> = (0..inp.u8() % 64).map(|i| i ^ 0x3c).collect();
    let dev = Arc::new(Mutex::new(Dev {
        max_sizes,
        features,
        config,
        can_reset: !inp.u8().is_multiple_of(8),
        fail_activate: inp.u8().is_multiple_of(8),
        active: false,
        acked: None,
        activations: 0,
    }));
    let Ok(t) = MmioTransport::new(guest_mem(), dev.clone(), Arc::new(Line)) else {
        return;
    };
    let mut r = Rig { t, dev };
    while !inp.is_empty() {
        match inp.u8() % 10 {
            0 | 1 => {
                let off = offset(&mut inp);
                let size = usize::from(inp.u8() % 9);
                let mut buf = [0xffu8; 8];
                r.t.read(off, &mut buf[..size]);
                let got = &buf[..size];
                if off >= VIRTIO_MMIO_CONFIG {
                    let mut want = vec![0u8; size];
                    if off.checked_add(size as u64).is_some_and(|e| e <= MMIO_LEN) {
                        let dev = r.dev.lock().unwrap();
                        read_config_bytes(&dev.config, off - VIRTIO_MMIO_CONFIG, &mut want);
                    }
                    assert_eq!(got, &want[..], "config read at {off:#x}+{size}");
                } else if size != 4 || off & 3 != 0 {
                    assert!(got.iter().all(|&b| b == 0), "odd register read not zero");
                }
            }
            2 | 3 => {
                let off = offset(&mut inp);
                let size = usize::from(inp.u8() % 9);
                let v = inp.u64().to_le_bytes();
                r.t.write(off, &v[..size]);
            }
            4 => {
                let bit = match inp.u8() % 8 {
                    0 => 0,
                    n @ 1..=4 => [0, 1, 2, 8, 4][usize::from(n)],
                    5 => VIRTIO_CONFIG_S_FAILED,
                    6 => VIRTIO_CONFIG_S_NEEDS_RESET,
                    _ => inp.u32(),
                };
                if bit == 0 {
                    r.wr(VIRTIO_MMIO_STATUS, 0);
                } else {
                    r.add_status(bit);
                }
            }
            5 => r.program_queue(&mut inp),
            6 => r.driver_features(&mut inp),
            7 => {
                r.wr(VIRTIO_MMIO_STATUS, 0);
                r.add_status(VIRTIO_CONFIG_S_ACKNOWLEDGE);
                r.add_status(VIRTIO_CONFIG_S_DRIVER);
                r.driver_features(&mut inp);
                r.add_status(VIRTIO_CONFIG_S_FEATURES_OK);
                for _ in 0..inp.u8() % 5 {
                    r.program_queue(&mut inp);
                }
                r.add_status(VIRTIO_CONFIG_S_DRIVER_OK);
            }
            8 => {
                let irq = r.t.interrupt_status().clone();
                let _ = match inp.u8() % 3 {
                    0 => irq.signal_used_queue(),
                    1 => irq.signal_config_change(),
                    _ => {
                        r.wr(VIRTIO_MMIO_INTERRUPT_ACK, inp.u32());
                        Ok(())
                    }
                };
            }
            _ => {
                let q = match inp.u8() % 4 {
                    0 => inp.u32(),
                    n => u32::from(n - 1),
                };
                r.wr(VIRTIO_MMIO_QUEUE_NOTIFY, q);
            }
        }
        trace!(
            "status {:#x}, activated {}",
            r.t.status(),
            r.t.is_activated()
        );
        r.check();
    }
});
