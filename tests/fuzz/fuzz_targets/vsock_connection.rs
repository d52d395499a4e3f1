//! One vsock stream's state machine (`devices/src/vsock/connection.rs`) driven by arbitrary
//! guest packets (any op, flags, credit fields, payload) interleaved with host events on a
//! scripted stream (partial writes and reads, EAGAIN, EINTR, EOF, errors) and `next_for_guest`
//! calls with any payload limit. Checked after every step:
//!
//! * every packet to the guest is well formed, and the first is RESPONSE; nothing follows RST;
//! * RW packets never exceed the guest's credit (its last `buf_alloc`/`fwd_cnt` minus what we
//!   sent), the payload limit or 64 KiB, and never follow SHUTDOWN(SEND) or the guest's
//!   SHUTDOWN(RCV);
//! * the host stream got a prefix of the guest's RW bytes, in order; `fwd_cnt` is exactly the
//!   bytes it accepted; nothing is written after `shutdown(SHUT_WR)`;
//! * unless the connection was reset, no guest byte is lost (written + buffered = sent), and the
//!   TX buffer never exceeds the credit we granted;
//! * the guest got exactly the bytes the host produced;
//! * whenever a control packet is due, `next_for_guest` returns one.
//!
//! Input: `our_buf: class u8`, the REQUEST's `buf_alloc: u32` and `fwd_cnt: u32`, then steps
//! `kind: u8 % 6`: 0-1 a guest packet (`amvm_fuzz::guest_packet`), 2 script + flush
//! (`amvm_fuzz::script`, then `flush_to_host`), 3 script only, 4-5 `next_for_guest` up to
//! `u8 % 8 + 1` times with a payload limit (`class: u8`).
#![no_main]

use amvm_devices::vsock::connection::{Connection, State};
use amvm_devices::vsock::defs::*;
use amvm_devices::vsock::device::CONN_BUF_ALLOC;
use amvm_devices::vsock::packet::{Header, TxPacket};
use amvm_fuzz::*;
use libfuzzer_sys::fuzz_target;

fn max_payload(inp: &mut Input) -> usize {
    match inp.u8() % 5 {
        0 | 1 => MAX_PKT_PAYLOAD,
        2 => usize::from(inp.u8()),
        3 => usize::from(inp.u16()),
        _ => inp.u32() as usize,
    }
}

fn check(conn: &Connection<FakeStream>, model: &mut StreamModel) {
    let s = conn.stream();
    model.check_stream(s, conn.byte_counts());
    assert!(
        conn.buffered() <= model.our_buf_alloc as usize,
        "TX buffer {} over the credit we granted ({})",
        conn.buffered(),
        model.our_buf_alloc
    );
    if conn.reset_reason().is_none() {
        assert_eq!(
            s.written.len() + conn.buffered(),
            model.guest_rw.len(),
            "guest bytes lost without a reset"
        );
    }
    assert_eq!(
        conn.wants_host_write(),
        conn.buffered() > 0 && matches!(conn.state(), State::Accepted | State::Established)
    );
    if conn.wants_host_read() {
        assert!(conn.peer_credit() > 0 && conn.state() == State::Established);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let our_buf = match inp.u8() % 4 {
        0 | 1 => CONN_BUF_ALLOC,
        2 => u32::from(inp.u16()),
        _ => inp.u32(),
    };
    let req = Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 50000,
        dst_port: 1024,
        len: 0,
        type_: TYPE_STREAM,
        op: OP_REQUEST,
        flags: 0,
        buf_alloc: inp.u32(),
        fwd_cnt: inp.u32(),
    };
    let mut conn = Connection::accept(FakeStream::default(), &req, our_buf);
    let mut model = StreamModel::new(&req, our_buf);
    while !inp.is_empty() {
        match inp.u8() % 6 {
            0 | 1 => {
                let (hdr, data) = guest_packet(&mut inp, &req);
                let closed = conn.state() == State::Closed;
                trace!("guest: {hdr:?} + {} bytes", data.len());
                conn.recv_from_guest(&TxPacket {
                    hdr,
                    data: data.clone(),
                });
                if !closed {
                    model.guest_sent(&hdr, &data);
                }
                if hdr.op == OP_RST {
                    assert_eq!(conn.state(), State::Closed, "a guest RST ends the stream");
                }
            }
            2 => {
                script(conn.stream_mut(), &mut inp);
                conn.flush_to_host();
            }
            3 => script(conn.stream_mut(), &mut inp),
            _ => {
                let times = inp.u8() % 8 + 1;
                let max = max_payload(&mut inp);
                for _ in 0..times {
                    let due = conn.has_control_for_guest();
                    let out = conn.next_for_guest(max);
                    if due {
                        assert!(out.is_some(), "a control packet was due but none came");
                    }
                    trace!("host: {:?}", out.as_ref().map(|p| (p.0, p.1.len())));
                    let Some(p) = out else { break };
                    assert_eq!(p.0.fwd_cnt, conn.stream().written.len() as u32);
                    model.host_sent(&p, max, true);
                    if p.0.op == OP_RST {
                        assert_eq!(conn.state(), State::Closed);
                    }
                }
            }
        }
        trace!(
            "  state {:?}, buffered {}, written {}",
            conn.state(),
            conn.buffered(),
            conn.stream().written.len()
        );
        check(&conn, &mut model);
        if conn.state() == State::Closed {
            assert!(conn.next_for_guest(MAX_PKT_PAYLOAD).is_none());
            assert!(!conn.has_control_for_guest());
        }
    }
});
