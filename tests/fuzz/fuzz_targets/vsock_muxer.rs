//! The vsock muxer (`devices/src/vsock/muxer.rs`): which guest packet goes where, which
//! connection speaks next, and when connections are reaped, driven by arbitrary guest packets
//! (spoofed CIDs, foreign types, any ports and ops), scripted host streams and `next_for_guest`
//! calls. Checked after every step:
//!
//! * every packet to the guest comes from the host CID and goes to the guest's CID;
//! * a connection exists only for a REQUEST from the guest's CID to a published port whose
//!   endpoint connected, and disappears only by being reaped after it closed, with exactly one
//!   `Backend::closed` call that carries its stream and byte counts;
//! * per connection, the same credit and byte-accounting rules as `vsock_connection`;
//! * whenever a control packet is due, `next_for_guest` returns one.
//!
//! Input: `our_buf: class u8`, then steps `kind: u8 % 8`: 0-2 a guest packet (`src_cid`,
//! `dst_cid`, `type` classes (`u8`, raw values for the last), `amvm_fuzz::guest_port`,
//! `amvm_fuzz::host_port`, then `amvm_fuzz::guest_packet`), 3 script a connection's stream
//! (`index: u8`, `amvm_fuzz::script`) and flush it, 4-5 `next_for_guest` up to `u8 % 8 + 1`
//! times with a limit `u16`, 6 `reap`, 7 a REQUEST to 1024 from `amvm_fuzz::guest_port`.
#![no_main]

use amvm_devices::vsock::connection::State;
use amvm_devices::vsock::defs::*;
use amvm_devices::vsock::device::CONN_BUF_ALLOC;
use amvm_devices::vsock::muxer::{ConnKey, Muxer};
use amvm_devices::vsock::packet::{Header, TxPacket};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

const GUEST_CID: u64 = 3;

struct Rig {
    m: Muxer<Ports>,
    our_buf: u32,
    /// Per live connection: its stream's id and the guest-side model.
    models: BTreeMap<ConnKey, (u64, StreamModel)>,
    closed_seen: usize,
}

impl Rig {
    fn keys(&self) -> Vec<ConnKey> {
        self.m.connections().map(|(k, _)| *k).collect()
    }

    fn guest(&mut self, hdr: Header, data: Vec<u8>) {
        trace!("guest: {hdr:?} + {} bytes", data.len());
        let before = self.keys();
        let key = (hdr.src_port, hdr.dst_port);
        let routed = hdr.src_cid == GUEST_CID
            && hdr.dst_cid == HOST_CID
            && hdr.type_ == TYPE_STREAM
            && before.contains(&key);
        let was_closed = routed
            && self
                .m
                .connections()
                .any(|(k, c)| *k == key && c.state() == State::Closed);
        self.m.recv_from_guest(&TxPacket {
            hdr,
            data: data.clone(),
        });
        let after = self.keys();
        if routed {
            if !was_closed {
                self.models
                    .get_mut(&key)
                    .expect("model")
                    .1
                    .guest_sent(&hdr, &data);
            }
            assert_eq!(before, after);
            return;
        }
        let new: Vec<_> = after.iter().filter(|k| !before.contains(k)).collect();
        assert!(
            before.iter().all(|k| after.contains(k)),
            "recv dropped a connection"
        );
        match new.as_slice() {
            [] => {}
            [k] => {
                assert_eq!(**k, key);
                assert!(
                    hdr.src_cid == GUEST_CID
                        && hdr.dst_cid == HOST_CID
                        && hdr.type_ == TYPE_STREAM
                        && hdr.op == OP_REQUEST
                        && (hdr.dst_port == 1024 || hdr.dst_port == 1026),
                    "connection made from {hdr:?}"
                );
                let id = self.m.backend_mut().connects;
                self.models
                    .insert(key, (id, StreamModel::new(&hdr, self.our_buf)));
            }
            _ => panic!("one packet made several connections"),
        }
    }

    /// Match reaped connections with `closed` calls.
    fn reaped(&mut self, before: &[ConnKey]) {
        let after = self.keys();
        let gone: Vec<ConnKey> = before
            .iter()
            .filter(|k| !after.contains(k))
            .copied()
            .collect();
        assert!(
            after.iter().all(|k| before.contains(k)),
            "a connection appeared"
        );
        let closed = &self.m.backend_mut().closed;
        let fresh = &closed[self.closed_seen..];
        assert_eq!(
            fresh.len(),
            gone.len(),
            "closed calls vs reaped connections"
        );
        for key in &gone {
            let (id, mut model) = self
                .models
                .remove(key)
                .expect("model for a reaped connection");
            let (port, s, counts, _) = fresh
                .iter()
                .find(|c| c.1.id == id)
                .expect("a closed call for the reaped connection");
            assert_eq!(*port, key.1);
            model.check_stream(s, *counts);
        }
        self.closed_seen += gone.len();
    }

    fn check(&mut self) {
        for (key, conn) in self.m.connections() {
            let (id, model) = self
                .models
                .get_mut(key)
                .expect("model for every connection");
            assert_eq!(conn.stream().id, *id);
            model.check_stream(conn.stream(), conn.byte_counts());
            assert!(conn.buffered() <= self.our_buf as usize);
        }
        assert_eq!(self.models.len(), self.m.connections().count());
    }
}

fn cid(inp: &mut Input, usual: u64) -> u64 {
    match inp.u8() % 8 {
        0 => inp.u64(),
        1 => usual + 1,
        _ => usual,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let our_buf = match inp.u8() % 4 {
        0 | 1 => CONN_BUF_ALLOC,
        2 => u32::from(inp.u16()),
        _ => inp.u32(),
    };
    let mut rig = Rig {
        m: Muxer::new(Ports::default(), GUEST_CID, our_buf),
        our_buf,
        models: BTreeMap::new(),
        closed_seen: 0,
    };
    while !inp.is_empty() {
        match inp.u8() % 8 {
            0..=2 => {
                let base = Header {
                    src_cid: cid(&mut inp, GUEST_CID),
                    dst_cid: cid(&mut inp, HOST_CID),
                    type_: match inp.u8() % 8 {
                        0 => inp.u16(),
                        _ => TYPE_STREAM,
                    },
                    src_port: guest_port(&mut inp),
                    dst_port: host_port(&mut inp),
                    ..Header::default()
                };
                let (hdr, data) = guest_packet(&mut inp, &base);
                rig.guest(hdr, data);
            }
            3 => {
                let keys = rig.keys();
                let i = usize::from(inp.u8());
                if keys.is_empty() {
                    continue;
                }
                let key = keys[i % keys.len()];
                let conn = rig.m.connection_mut(&key).expect("live");
                script(conn.stream_mut(), &mut inp);
                conn.flush_to_host();
            }
            4 | 5 => {
                let times = inp.u8() % 8 + 1;
                let max = match inp.u16() {
                    0 => MAX_PKT_PAYLOAD,
                    n => usize::from(n),
                };
                for _ in 0..times {
                    let before = rig.keys();
                    let due = rig.m.has_control_for_guest();
                    let out = rig.m.next_for_guest(max);
                    if due {
                        assert!(out.is_some(), "a control packet was due but none came");
                    }
                    rig.reaped(&before);
                    trace!("host: {:?}", out.as_ref().map(|p| (p.0, p.1.len())));
                    let Some(p) = out else { break };
                    let h = &p.0;
                    assert_eq!((h.src_cid, h.dst_cid), (HOST_CID, GUEST_CID), "{h:?}");
                    assert_eq!(h.len as usize, p.1.len());
                    let key = (h.dst_port, h.src_port);
                    match rig.models.get_mut(&key) {
                        Some((_, model)) => model.host_sent(&p, max, false),
                        None => assert_eq!(h.op, OP_RST, "{h:?} for no connection"),
                    }
                }
            }
            6 => {
                let before = rig.keys();
                rig.m.reap();
                rig.reaped(&before);
            }
            _ => {
                let hdr = Header {
                    src_cid: GUEST_CID,
                    dst_cid: HOST_CID,
                    src_port: guest_port(&mut inp),
                    dst_port: 1024,
                    type_: TYPE_STREAM,
                    op: OP_REQUEST,
                    buf_alloc: inp.u32(),
                    fwd_cnt: inp.u32(),
                    ..Header::default()
                };
                rig.guest(hdr, Vec::new());
            }
        }
        rig.check();
    }
});
