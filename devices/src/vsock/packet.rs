//! vsock packets in and out of descriptor chains.
//!
//! A packet is the 44-byte little-endian `virtio_vsock_hdr` followed by `hdr.len` payload bytes.
//! Drivers lay it out in any shape: Linux since 6.2 may put header and payload in one
//! descriptor, large TX payloads span several descriptors (non-linear skbs), and a hostile
//! driver may do anything. So both directions walk the chain byte-wise:
//!
//! * [`read_tx`] gathers the header, then exactly `hdr.len` payload bytes, from the chain's
//!   device-readable descriptors. Every address and length is checked against guest memory by
//!   vm-memory; a write-only descriptor, a payload over [`MAX_PKT_PAYLOAD`], or a chain shorter
//!   than the header says is an error for this packet, never a panic.
//! * [`write_rx`] scatters a header and payload over the chain's device-writable descriptors and
//!   returns the byte count for the used ring.

use super::defs::{HDR_LEN, MAX_PKT_PAYLOAD};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestMemoryBackend};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("descriptor chain holds {got} bytes, the packet needs {need}")]
    Truncated { got: usize, need: usize },
    #[error("payload of {0} bytes exceeds the {MAX_PKT_PAYLOAD}-byte maximum")]
    PayloadTooLarge(u32),
    #[error("device-writable descriptor in a TX chain")]
    WritableInTx,
    #[error("device-readable descriptor in an RX chain")]
    ReadOnlyInRx,
    #[error("descriptor at {addr:#x}+{len} is outside guest memory")]
    BadAddress { addr: u64, len: u32 },
    #[error("RX chain has room for {room} bytes, the packet needs {need}")]
    RxTooSmall { room: usize, need: usize },
}

/// `struct virtio_vsock_hdr`, decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Header {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"));
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// A packet the guest sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxPacket {
    pub hdr: Header,
    pub data: Vec<u8>,
}

/// Read one guest->host packet from a TX chain.
pub fn read_tx<M: GuestMemoryBackend>(
    mem: &M,
    chain: impl IntoIterator<Item = Descriptor>,
) -> Result<TxPacket, PacketError> {
    let mut hdr_buf = [0u8; HDR_LEN];
    let mut hdr_got = 0usize;
    let mut hdr: Option<Header> = None;
    let mut data = Vec::new();
    let mut seen = 0usize;
    for desc in chain {
        if desc.is_write_only() {
            return Err(PacketError::WritableInTx);
        }
        let (addr, len) = (desc.addr(), desc.len());
        // The whole descriptor must lie in guest memory, even the part we will not read.
        if len > 0 && !mem.check_range(addr, len as usize) {
            return Err(PacketError::BadAddress { addr: addr.0, len });
        }
        seen = seen.saturating_add(len as usize);
        let mut off = 0usize;
        while off < len as usize {
            let at = addr
                .checked_add(off as u64)
                .ok_or(PacketError::BadAddress { addr: addr.0, len })?;
            let left = len as usize - off;
            if hdr.is_none() {
                let n = left.min(HDR_LEN - hdr_got);
                mem.read_slice(&mut hdr_buf[hdr_got..hdr_got + n], at)
                    .map_err(|_| PacketError::BadAddress { addr: addr.0, len })?;
                hdr_got += n;
                off += n;
                if hdr_got == HDR_LEN {
                    let h = Header::from_bytes(&hdr_buf);
                    if h.len as usize > MAX_PKT_PAYLOAD {
                        return Err(PacketError::PayloadTooLarge(h.len));
                    }
                    data.reserve_exact(h.len as usize);
                    hdr = Some(h);
                }
            } else {
                let want = hdr.map(|h| h.len as usize).unwrap_or(0);
                let n = left.min(want - data.len());
                if n == 0 {
                    // Trailing bytes beyond hdr.len: drivers may offer bigger buffers; ignore them.
                    break;
                }
                let start = data.len();
                data.resize(start + n, 0);
                mem.read_slice(&mut data[start..], at)
                    .map_err(|_| PacketError::BadAddress { addr: addr.0, len })?;
                off += n;
            }
        }
        if let Some(h) = hdr {
            if data.len() == h.len as usize {
                return Ok(TxPacket { hdr: h, data });
            }
        }
    }
    let need = HDR_LEN + hdr.map(|h| h.len as usize).unwrap_or(0);
    Err(PacketError::Truncated { got: seen, need })
}

/// Write one host->guest packet into an RX chain; returns the bytes written (for the used ring).
/// `hdr.len` is set from `data`. Nothing is written unless the whole packet fits.
pub fn write_rx<M: GuestMemoryBackend>(
    mem: &M,
    chain: impl IntoIterator<Item = Descriptor>,
    hdr: &Header,
    data: &[u8],
) -> Result<u32, PacketError> {
    assert!(
        data.len() <= MAX_PKT_PAYLOAD,
        "caller bug: payload over the maximum"
    );
    let mut hdr = *hdr;
    hdr.len = data.len() as u32;
    let hdr_bytes = hdr.to_bytes();
    let need = HDR_LEN + data.len();
    // Validate the whole chain first, so a packet is delivered whole or not at all.
    let mut descs = Vec::new();
    let mut room = 0usize;
    for desc in chain {
        if !desc.is_write_only() {
            return Err(PacketError::ReadOnlyInRx);
        }
        let (addr, len) = (desc.addr(), desc.len());
        if len > 0 && !mem.check_range(addr, len as usize) {
            return Err(PacketError::BadAddress { addr: addr.0, len });
        }
        room = room.saturating_add(len as usize);
        descs.push(desc);
        if room >= need {
            break;
        }
    }
    if room < need {
        return Err(PacketError::RxTooSmall { room, need });
    }
    // Scatter header then payload over the descriptors, slice by slice.
    let mut parts: [&[u8]; 2] = [&hdr_bytes, data];
    let mut written = 0usize;
    for desc in descs {
        let mut room = desc.len() as usize;
        let mut at = desc.addr();
        for part in parts.iter_mut() {
            if room == 0 {
                break;
            }
            let n = part.len().min(room);
            if n == 0 {
                continue;
            }
            mem.write_slice(&part[..n], at)
                .map_err(|_| PacketError::BadAddress {
                    addr: desc.addr().0,
                    len: desc.len(),
                })?;
            *part = &part[n..];
            at = at.unchecked_add(n as u64);
            room -= n;
            written += n;
        }
        if written == need {
            break;
        }
    }
    Ok(written as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    const WRITE: u16 = 2; // VRING_DESC_F_WRITE

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn hdr(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1234,
            dst_port: 80,
            len,
            type_: 1,
            op: 5,
            flags: 0,
            buf_alloc: 262144,
            fwd_cnt: 17,
        }
    }

    /// Lay `bytes` out in guest memory split at `cuts`, return the descriptors.
    fn lay_out(m: &GuestMemoryMmap, bytes: &[u8], cuts: &[usize], flags: u16) -> Vec<Descriptor> {
        let mut descs = Vec::new();
        let mut addr = 0x1000u64;
        let mut start = 0;
        let mut points: Vec<usize> = cuts
            .iter()
            .copied()
            .filter(|&c| c > 0 && c < bytes.len())
            .collect();
        points.sort_unstable();
        points.dedup();
        points.push(bytes.len());
        for end in points {
            m.write_slice(&bytes[start..end], GuestAddress(addr))
                .unwrap();
            descs.push(Descriptor::new(addr, (end - start) as u32, flags, 0));
            addr += (end - start) as u64 + 64; // gaps between buffers
            start = end;
        }
        descs
    }

    #[test]
    fn header_round_trips() {
        let h = hdr(99);
        assert_eq!(Header::from_bytes(&h.to_bytes()), h);
    }

    #[test]
    fn tx_packets_of_any_shape_parse_identically() {
        let m = mem();
        for len in [0usize, 1, 43, 44, 45, 4096, 32768, 32769, 65536] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut wire = hdr(len as u32).to_bytes().to_vec();
            wire.extend_from_slice(&data);
            let shapes: Vec<Vec<usize>> = vec![
                vec![],                // header and payload in one descriptor
                vec![HDR_LEN],         // header alone, payload alone
                vec![10, HDR_LEN + 1], // header split, payload split
                vec![HDR_LEN, HDR_LEN + 4096, HDR_LEN + 8192, HDR_LEN + 32768], // many pages
                (1..wire.len().min(300)).collect(), // one byte per descriptor at the start
            ];
            for cuts in shapes {
                let descs = lay_out(&m, &wire, &cuts, 0);
                let p =
                    read_tx(&m, descs).unwrap_or_else(|e| panic!("len {len} cuts {cuts:?}: {e}"));
                assert_eq!(p.hdr, hdr(len as u32));
                assert_eq!(p.data, data, "len {len}");
            }
        }
    }

    #[test]
    fn tx_rejects_hostile_chains() {
        let m = mem();
        let wire = hdr(100).to_bytes();
        // Header promises 100 bytes, chain has none.
        let d = lay_out(&m, &wire, &[], 0);
        assert_eq!(
            read_tx(&m, d),
            Err(PacketError::Truncated { got: 44, need: 144 })
        );
        // Shorter than a header.
        let d = lay_out(&m, &wire[..20], &[], 0);
        assert!(matches!(read_tx(&m, d), Err(PacketError::Truncated { .. })));
        // Empty chain.
        assert!(matches!(
            read_tx(&m, Vec::new()),
            Err(PacketError::Truncated { .. })
        ));
        // Oversized payload claim.
        let d = lay_out(&m, &hdr(MAX_PKT_PAYLOAD as u32 + 1).to_bytes(), &[], 0);
        assert_eq!(
            read_tx(&m, d),
            Err(PacketError::PayloadTooLarge(MAX_PKT_PAYLOAD as u32 + 1))
        );
        // Writable descriptor in a TX chain.
        let d = lay_out(&m, &wire, &[], WRITE);
        assert_eq!(read_tx(&m, d), Err(PacketError::WritableInTx));
        // Addresses outside guest memory, and wrapping around the address space.
        for (addr, len) in [
            (1u64 << 20, 44u32),
            ((1 << 20) - 10, 44),
            (u64::MAX - 3, 44),
            (0, u32::MAX),
        ] {
            let r = read_tx(&m, vec![Descriptor::new(addr, len, 0, 0)]);
            assert!(
                matches!(r, Err(PacketError::BadAddress { .. })),
                "{addr:#x}+{len}: {r:?}"
            );
        }
    }

    #[test]
    fn tx_ignores_bytes_beyond_the_header_length() {
        let m = mem();
        let mut wire = hdr(3).to_bytes().to_vec();
        wire.extend_from_slice(b"abcXYZ");
        let p = read_tx(&m, lay_out(&m, &wire, &[HDR_LEN + 1], 0)).unwrap();
        assert_eq!(p.data, b"abc");
    }

    #[test]
    fn rx_scatters_over_any_shape_and_is_all_or_nothing() {
        let m = mem();
        for len in [0usize, 1, 4096, 65536] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
            for cuts in [vec![], vec![HDR_LEN], vec![7, 100, 5000]] {
                let room = vec![0u8; HDR_LEN + len + 100];
                let descs = lay_out(&m, &room, &cuts, WRITE);
                let n = write_rx(&m, descs.clone(), &hdr(0), &data).unwrap();
                assert_eq!(n as usize, HDR_LEN + len);
                // Read it back through the TX parser, as a guest would see it.
                let back: Vec<Descriptor> = descs
                    .iter()
                    .map(|d| Descriptor::new(d.addr().0, d.len(), 0, 0))
                    .collect();
                let p = read_tx(&m, back).unwrap();
                assert_eq!((p.hdr.len as usize, p.data), (len, data.clone()));
            }
        }
        let small = lay_out(&m, &[0u8; 50], &[], WRITE);
        assert_eq!(
            write_rx(&m, small, &hdr(0), &[1; 10]),
            Err(PacketError::RxTooSmall { room: 50, need: 54 })
        );
        let ro = lay_out(&m, &[0u8; 100], &[], 0);
        assert_eq!(
            write_rx(&m, ro, &hdr(0), &[1; 10]),
            Err(PacketError::ReadOnlyInRx)
        );
        let bad = vec![Descriptor::new((1 << 20) - 8, 64, WRITE, 0)];
        assert!(matches!(
            write_rx(&m, bad, &hdr(0), &[1; 10]),
            Err(PacketError::BadAddress { .. })
        ));
    }
}
