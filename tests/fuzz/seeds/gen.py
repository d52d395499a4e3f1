#!/usr/bin/env python3
"""Write the seed corpus: a few small, meaningful inputs per fuzz target.

Each target documents its input format at the top of tests/fuzz/fuzz_targets/<target>.rs (the
fields are read by amvm_fuzz::Input: little-endian integers, zeros past the end). This script
encodes valid packets, chains, driver sequences and frame streams in that format, so the
fuzzer starts from inputs that reach deep states. Run it from anywhere; it rewrites
tests/fuzz/seeds/<target>/*.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def u8(v):
    return struct.pack("<B", v & 0xFF)


def u16(v):
    return struct.pack("<H", v & 0xFFFF)


def u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


# --- amvm_fuzz helpers -------------------------------------------------------------------

def addr_page0(page):  # class 7: region 0, page-aligned
    return u8(7) + u8(page)


def addr_page1(page):  # class 8: region 1, page-aligned
    return u8(8) + u8(page)


def addr_r0(off):  # class 0: region 0 + u16
    return u8(0) + u16(off)


def len_u8(n):  # class 1
    return u8(1) + u8(n)


def len_u16(n):  # class 2
    return u8(2) + u16(n)


F_NONE, F_NEXT, F_WRITE, F_WRITE_NEXT = 0, 1, 2, 3  # flag classes


def desc(addr, length, flag_class, nxt=0):
    return addr + length + u8(flag_class) + u16(nxt)


def scribble(writes):
    """writes: [(addr_bytes, data)]"""
    out = u8(len(writes))
    for a, data in writes:
        out += a + u8(len(data)) + data
    return out


def vsock_hdr(src_cid=3, dst_cid=2, src_port=50000, dst_port=1024, length=0, type_=1, op=5,
              flags=0, buf_alloc=65536, fwd_cnt=0):
    return (u64(src_cid) + u64(dst_cid) + u32(src_port) + u32(dst_port) + u32(length) +
            u16(type_) + u16(op) + u32(flags) + u32(buf_alloc) + u32(fwd_cnt))


OP_REQUEST, OP_RESPONSE, OP_RST, OP_SHUTDOWN, OP_RW = 1, 2, 3, 4, 5


def guest_packet(op_index, data=b"", flag_class=0, buf_alloc=None, fwd=0):
    """amvm_fuzz::guest_packet; op_index into [RW,RW,RW,CU,CR,SHUTDOWN,RST,REQUEST,RESPONSE];
    flag classes 0: none, 1: SEND, 2: RCV|SEND; buf_alloc None: 256 KiB."""
    buf = u8(0) if buf_alloc is None else u8(2) + u32(buf_alloc)
    n = len(data)
    length = u8(0) if n == 0 else u8(1) + u8(n) if n < 256 else u8(3) + u16(n)
    return u8(op_index) + u8(flag_class) + buf + u32(fwd) + length + data


RW, CREDIT_UPDATE, CREDIT_REQUEST, SHUTDOWN, RST, REQUEST = 0, 3, 4, 5, 6, 7


def step_bytes(n):  # IoStep::Bytes(n)
    return u8(0) + u16(n)


STEP_WOULDBLOCK, STEP_EINTR, STEP_ZERO = u8(4), u8(5), u8(6)


def script(which, steps):  # which: 0 read, 1 write, 2 shutdown
    return u8(which) + u8(len(steps)) + b"".join(steps)


# --- targets -----------------------------------------------------------------------------

def vsock_packet():
    ping = vsock_hdr(length=4) + b"ping"
    seeds = {}
    # TX, one descriptor holding header and payload.
    seeds["tx_one_desc"] = (u8(0) + scribble([(addr_page0(1), ping)]) + u8(1) +
                            desc(addr_page0(1), len_u8(48), F_NONE))
    # TX, header split and payload in its own descriptor.
    seeds["tx_split"] = (u8(0) + scribble([(addr_page0(1), ping)]) + u8(3) +
                         desc(addr_r0(0x1000), len_u8(10), F_NONE) +
                         desc(addr_r0(0x100A), len_u8(34), F_NONE) +
                         desc(addr_r0(0x102C), len_u8(4), F_NONE))
    # RX into a header descriptor and a data descriptor.
    seeds["rx_two_desc"] = (u8(1) + scribble([]) + u8(2) +
                            desc(addr_page0(2), len_u8(44), F_WRITE) +
                            desc(addr_page0(3), len_u16(4096), F_WRITE) +
                            vsock_hdr(src_cid=2, dst_cid=3, src_port=1024, dst_port=50000) +
                            u8(0) + u8(16))
    # TX through a real chain: table entries 0 -> 1.
    seeds["tx_chain"] = (u8(2) + scribble([(addr_page0(1), ping)]) + u8(2) + u8(2) +
                         u8(0) + desc(addr_r0(0x1000), len_u8(20), F_NEXT, 1) +
                         u8(1) + desc(addr_r0(0x1014), len_u8(28), F_NONE) +
                         u8(0) + u8(0))
    # RX through a chain of two writable descriptors.
    seeds["rx_chain"] = (u8(3) + scribble([]) + u8(2) + u8(2) +
                         u8(0) + desc(addr_page0(2), len_u8(44), F_WRITE_NEXT, 1) +
                         u8(1) + desc(addr_page0(3), len_u16(1024), F_WRITE) +
                         u8(0) + u8(0) +
                         vsock_hdr(src_cid=2, dst_cid=3, op=OP_RW) + u8(0) + u8(200))
    # A chain that loops on itself.
    seeds["tx_loop"] = (u8(2) + scribble([(addr_page0(1), vsock_hdr(length=1000))]) + u8(2) +
                        u8(1) + u8(0) + desc(addr_page0(1), len_u8(44), F_NEXT, 0) +
                        u8(0) + u8(0))
    return seeds


def vsock_connection():
    seeds = {}
    head = u8(0) + u32(262144) + u32(0)
    nfg = lambda times: u8(4) + u8(times - 1) + u8(0)  # next_for_guest, max MAX_PKT_PAYLOAD
    seeds["exchange_and_close"] = (
        head + nfg(1) +
        u8(0) + guest_packet(RW, b"ping") +
        u8(2) + script(1, [step_bytes(2)]) +
        u8(2) + script(1, [STEP_EINTR, step_bytes(100)]) +
        u8(3) + script(0, [step_bytes(100), STEP_ZERO]) +
        nfg(3) +
        u8(0) + guest_packet(SHUTDOWN, flag_class=2) +
        nfg(2))
    seeds["credit_request"] = (
        head + nfg(1) +
        u8(0) + guest_packet(RW, b"x" * 300) +
        u8(3) + script(1, [STEP_WOULDBLOCK]) +
        u8(0) + guest_packet(CREDIT_REQUEST) +
        u8(2) + script(1, [step_bytes(65535)]) +
        nfg(2))
    seeds["guest_rst"] = head + nfg(1) + u8(0) + guest_packet(RST) + nfg(1)
    # A guest with a tiny buffer: the host must respect its credit.
    seeds["small_guest_buffer"] = (
        u8(0) + u32(16) + u32(0) + nfg(1) +
        u8(3) + script(0, [step_bytes(1000), step_bytes(1000)]) + nfg(4) +
        u8(0) + guest_packet(CREDIT_UPDATE, buf_alloc=16, fwd=16) + nfg(2))
    return seeds


def vsock_muxer():
    seeds = {}
    head = u8(0)
    req = lambda port_class, buf: u8(7) + u8(port_class) + u32(buf) + u32(0)
    nfg = lambda times: u8(4) + u8(times - 1) + u16(0)

    def pkt(gport_class, hport_class, body):
        return u8(0) + u8(2) + u8(2) + u8(1) + u8(gport_class) + u8(hport_class) + body

    seeds["two_streams"] = (
        head + req(0, 65536) + req(1, 65536) + nfg(2) +
        pkt(0, 0, guest_packet(RW, b"hello")) +
        u8(3) + u8(0) + script(1, [step_bytes(5)]) +
        u8(3) + u8(1) + script(0, [step_bytes(64), STEP_ZERO]) +
        nfg(4) +
        pkt(1, 0, guest_packet(SHUTDOWN, flag_class=2)) +
        nfg(3) + u8(6))
    seeds["unpublished_and_refused"] = (
        head + pkt(0, 4, guest_packet(REQUEST)) + pkt(1, 2, guest_packet(REQUEST)) +
        pkt(2, 0, guest_packet(RW, b"no connection")) + nfg(4))
    # Spoofed source CID and a foreign type.
    seeds["spoofed"] = (
        head + u8(0) + u8(1) + u8(2) + u8(1) + u8(0) + u8(0) + guest_packet(REQUEST) +
        u8(0) + u8(2) + u8(2) + u8(0) + u16(2) + u8(0) + u8(0) + guest_packet(REQUEST) +
        nfg(2))
    return seeds


def virtio_mmio():
    seeds = {}
    dev = (u8(3) + u8(0) + u8(8) + u8(0) + u8(8) + u8(0) + u8(6) + u64(1 << 3) + u8(1) +
           u8(8) + u8(1) + u8(1))

    def queue(sel, num_log, pages):
        out = u8(sel) + u8(0) + u8(num_log)
        for p in pages:
            out += addr_page0(p)
        return out + u8(0)

    init = (u8(7) + u8(0) + u8(1) + u8(3) + queue(0, 4, (1, 2, 3)) +
            queue(1, 4, (4, 5, 6)) + queue(2, 4, (7, 8, 9)))
    read_reg = lambda idx: u8(0) + u8(0) + u8(idx) + u8(4)
    seeds["init_sequence"] = (dev + init + read_reg(0) + read_reg(1) + read_reg(18) +
                              u8(0) + u8(3) + u16(0) + u8(8) +  # config read
                              u8(9) + u8(1) +  # notify queue 0
                              u8(8) + u8(0) + u8(8) + u8(2) + u32(1) +  # irq + ack
                              u8(4) + u8(0))  # reset
    # The Linux driver's steps one by one, with feature reads.
    seeds["step_by_step"] = (dev + u8(4) + u8(0) + u8(4) + u8(1) + u8(4) + u8(2) +
                             u8(2) + u8(0) + u8(5) + u8(4) + u64(1) +  # DEVICE_FEATURES_SEL=1
                             read_reg(4) + u8(6) + u8(0) + u8(1) + u8(4) + u8(3) +
                             u8(5) + queue(0, 3, (1, 2, 3)) + u8(4) + u8(4) +
                             read_reg(14) + read_reg(16))
    # Odd sizes and offsets.
    seeds["odd_accesses"] = (dev + u8(0) + u8(0) + u8(18) + u8(2) + u8(2) + u8(4) + u16(0x71) +
                             u8(1) + u64(0xFF) + u8(1) + u8(5) + u64(0xFFFFFFFFFFFFFFF0) + u8(8) +
                             u8(2) + u8(3) + u16(0xEFC) + u8(8) + u64(0x1122334455667788))
    return seeds


def desc_chain():
    seeds = {}
    request = vsock_hdr(op=OP_REQUEST)
    rw = vsock_hdr(op=OP_RW, length=5) + b"hello"
    mem = scribble([(addr_page0(1), request), (addr_page0(4), rw)])
    # RX queue in region 1 pages 0-2, TX in pages 3-5; 16 entries each.
    queues = (u8(0) + u8(4) + addr_page1(0) + addr_page1(1) + addr_page1(2) + u8(0) +
              u8(0) + u8(4) + addr_page1(3) + addr_page1(4) + addr_page1(5) + u8(0))

    def put_desc(q, index, d):
        return u8(2) + u8(q) + u16(index) + d

    def put_avail(q, pos, head):
        return u8(3) + u8(q) + u16(pos) + u16(head)

    def bump(q, delta):
        return u8(1) + u8(q) + u8(delta)

    TX_PASS, RX_PASS = u8(4), u8(6)
    connect = (put_desc(1, 0, desc(addr_page0(1), len_u8(44), F_NONE)) +
               put_avail(1, 0, 0) + bump(1, 1) + TX_PASS +
               put_desc(0, 0, desc(addr_page0(2), len_u16(4096), F_WRITE)) +
               put_avail(0, 0, 0) + bump(0, 1) + RX_PASS)
    seeds["connect"] = mem + queues + connect
    seeds["connect_and_send"] = (
        mem + queues + connect +
        put_desc(1, 1, desc(addr_page0(4), len_u8(49), F_NONE)) + put_avail(1, 1, 1) +
        bump(1, 1) + TX_PASS +
        u8(8) + u8(0) + script(0, [step_bytes(300)]) +
        put_desc(0, 1, desc(addr_page0(3), len_u8(44), F_WRITE_NEXT, 2)) +
        put_desc(0, 2, desc(addr_page0(5), len_u16(8192), F_WRITE)) +
        put_avail(0, 1, 1) + bump(0, 1) + RX_PASS)
    # A descriptor that chains to itself, and an avail idx far ahead.
    seeds["loop_and_bad_idx"] = (
        mem + queues + put_desc(1, 0, desc(addr_page0(1), len_u8(44), F_NEXT, 0)) +
        put_avail(1, 0, 0) + bump(1, 1) + TX_PASS + bump(1, 200) + TX_PASS)
    return seeds


def spec(argv=(b"sh", b"-c", b"echo hi"), env=(b"PATH=/usr/bin",), cwd=b"/",
         mounts=(b"system\0/usr",), files=(b"f/etc/hosts\x00127.0.0.1 localhost\n",
                                             b"l/etc/mtab\x00/proc/mounts"),
         tmpfs=(b"/scratch\x00size=1m,noexec",), root=b"", hostname=b"box", flags=3):
    """A run spec (guest-init/src/protocol.rs, RunSpec, SPEC_MAGIC's layout)."""
    def lst(items):
        return u32(len(items)) + b"".join(u32(len(i)) + i for i in items)

    def byt(b):
        return u32(len(b)) + b

    return (b"AMVMSPC8" + u32(1000) + u32(1000) + u32(flags) + u32(4096) + byt(cwd) + byt(root) +
            byt(hostname) + lst(argv) + lst(env) + lst(mounts) + lst(files) + lst(tmpfs))


def exec_spec(groups=(10, 4242), rlimits=((7, 321, 654),)):
    """An exec spec (guest-init/src/protocol.rs, ExecSpec): stdin, a 24x80 terminal, capabilities,
    and (flag 8) supplementary groups and resource limits."""
    def lst(items):
        return u32(len(items)) + b"".join(u32(len(i)) + i for i in items)

    extra = u32(len(groups)) + b"".join(u32(g) for g in groups)
    extra += u32(len(rlimits)) + b"".join(u32(r) + u64(s) + u64(h) for r, s, h in rlimits)
    return (b"AMVMEXE2" + u64(7) + u32(1000) + u32(1000) + u32(1 | 2 | 4 | 8) + u16(24) + u16(80) +
            u64(1 << 21) + u32(1) + b"/" + lst([b"sh", b"-c", b"ulimit -n"]) + lst([b"A=1"]) + extra)


def frame(kind, payload):
    return u8(kind) + u32(len(payload)) + payload


def control_frames():
    seeds = {}
    out = frame(1, b"hello\n") + frame(2, b"oops\n") + frame(1, b"") + frame(3, b"\x07")
    seeds["to_host"] = u8(0) + u8(0) + out
    seeds["to_host_cut"] = u8(0) + u8(3) + u16(1) + u16(4) + u16(6) + out
    seeds["to_host_garbage"] = u8(0) + u8(0) + frame(1, b"ok") + frame(0xEE, b"bad") + out
    seeds["to_guest"] = u8(1) + u8(1) + u16(7) + frame(16, spec()) + frame(17, b"\x0f")
    seeds["spec"] = u8(2) + u8(0) + spec()
    # A session's spec (flag 4): no command; and a container's, with a root.
    seeds["session_spec"] = u8(2) + u8(0) + spec(argv=(), flags=4)
    seeds["rootfs_spec"] = u8(2) + u8(0) + spec(root=b"/rootfs", mounts=(b"rootfs\0/rootfs\0w",))
    # A session: the Exec frame with its spec, a resize and a signal for it, then Shutdown.
    seeds["session_to_guest"] = (u8(1) + u8(0) + frame(18, exec_spec()) + frame(21, u64(7) + u16(30) + u16(100))
                                 + frame(19, u64(7) + u8(2)) + frame(20, u32(10)))
    seeds["exec_spec"] = u8(4) + u8(0) + exec_spec()
    return seeds


def changes_tar():
    import io
    import tarfile

    def archive(fmt, entries):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
            for name, kind, link, data in entries:
                i = tarfile.TarInfo(name)
                i.type, i.linkname, i.size, i.mode = kind, link, len(data), 0o644
                t.addfile(i, io.BytesIO(data))
        return buf.getvalue()

    layer = [("./", tarfile.DIRTYPE, "", b""), ("./src/", tarfile.DIRTYPE, "", b""),
             ("./src/main.rs", tarfile.REGTYPE, "", b"fn main() {}\n"),
             ("./.wh.old", tarfile.REGTYPE, "", b""), ("./src/.wh..wh..opq", tarfile.REGTYPE, "", b""),
             ("./link", tarfile.SYMTYPE, "src/main.rs", b""), ("./hard", tarfile.LNKTYPE, "src/main.rs", b""),
             ("./" + "n" * 150, tarfile.REGTYPE, "", b"long"), ("./up", tarfile.SYMTYPE, "../out", b""),
             ("../escape", tarfile.REGTYPE, "", b"x"), ("./dev", tarfile.CHRTYPE, "", b"")]
    seeds = {}
    seeds["gnu"] = u8(0) + archive(tarfile.GNU_FORMAT, layer)
    seeds["pax"] = u8(0) + archive(tarfile.PAX_FORMAT, layer)
    seeds["ustar"] = u8(0) + archive(tarfile.USTAR_FORMAT, layer[:7])
    # mode 1: two entries, a file and a long-named symlink
    seeds["round_trip"] = (u8(1) + u8(2) + u8(0) + u16(3) + u16(0) + u16(0o644) + u16(5) + b"abc" + b"hello"
                           + u8(2) + u16(120) + u16(4) + u16(0o777) + u16(0) + b"l" * 120 + b"dest")
    return seeds


def snapshot_state():
    """A small machine state (kvm-bindings' structs as byte arrays; short ones are zero-filled),
    as a whole file (mode 0) and as a body behind a made header (mode 1)."""
    import hashlib, json
    zeros = lambda n: [0] * n
    vcpu = {"id": 0, "cpuid": [zeros(40)], "mp_state": zeros(4), "regs": zeros(144),
            "sregs": zeros(312), "xsave": zeros(64), "xcrs": zeros(392), "debugregs": zeros(128),
            "lapic": zeros(64), "msrs": [zeros(16)], "events": zeros(64)}
    transport = {"device_type": 19, "status": 15, "device_features_sel": 0, "driver_features_sel": 0,
                 "driver_features": 1 << 32, "acked_beyond_64": False, "queue_sel": 0,
                 "activated": True, "interrupt_status": 0, "config_generation": 0,
                 "queues": [{"size": 128, "ready": True, "desc_table": 0x1000, "avail_ring": 0x2000,
                             "used_ring": 0x3000}]}
    fs = dict(transport, device_type=26)
    body = json.dumps({"meta": {"amvm": "0.1.0", "mem_mib": 256, "cpus": 1, "created": 0},
                       "vm": {"pit": zeros(112), "clock": zeros(48), "pic_master": zeros(64),
                              "pic_slave": zeros(64), "ioapic": zeros(64)},
                       "vcpus": [vcpu],
                       "devices": {"transports": [transport, fs],
                                   "shares": [["system", {"ring_bases": [0, 3], "blob": [1, 2, 3]}]]}},
                      separators=(",", ":")).encode()
    head = b"AMVMSNAP" + u32(1) + u64(len(body)) + hashlib.sha256(body).digest()
    return {"file": u8(0) + head + body, "body": u8(1) + body,
            "other_version": u8(0) + b"AMVMSNAP" + u32(2) + head[12:] + body}


def fs_relay():
    """tests/fuzz/fuzz_targets/fs_relay.rs: steps are `which: bool`, then `kind`, then fields."""
    mem = scribble([(addr_page0(1), b"FUSE request header and body" + bytes(16))])
    queues = (u8(0) + u8(4) + addr_page1(0) + addr_page1(1) + addr_page1(2) + u8(0) +
              u8(0) + u8(4) + addr_page1(3) + addr_page1(4) + addr_page1(5) + u8(1))

    def put_desc(q, index, d):
        return u8(q) + u8(2) + u16(index) + d

    def put_avail(q, pos, head):
        return u8(q) + u8(3) + u16(pos) + u16(head)

    def bump(q, delta):
        return u8(q) + u8(1) + u8(delta)

    def backend_uses(q, length, jump=0):
        # The head the relay offered last, `length` bytes written.
        return u8(q) + u8(6) + u8(1) + u8(0) + u32(length) + u8(jump)

    PASS = u8(0) + u8(4)
    request = (put_desc(1, 0, desc(addr_page0(1), len_u8(44), F_NEXT, 1)) +
               put_desc(1, 1, desc(addr_page0(2), len_u16(4096), F_WRITE)) +
               put_avail(1, 0, 0) + bump(1, 1) + PASS)
    return {
        "request_and_reply": mem + queues + request + backend_uses(1, 100) + PASS,
        "reply_too_long": mem + queues + request + backend_uses(1, 1 << 30) + PASS,
        "used_index_jumps": mem + queues + request + backend_uses(1, 16, 250) + PASS,
        "write_then_read": mem + queues + (
            put_desc(1, 0, desc(addr_page0(2), len_u8(8), F_WRITE_NEXT, 1)) +
            put_desc(1, 1, desc(addr_page0(1), len_u8(8), F_NONE)) +
            put_avail(1, 0, 0) + bump(1, 1) + PASS),
    }


def block():
    """tests/fuzz/fuzz_targets/block.rs: steps are `kind`, then fields."""
    mem = scribble([])
    # One queue of 16 entries in region 1 pages 0-2, event_idx off.
    queue = u8(0) + u8(4) + addr_page1(0) + addr_page1(1) + addr_page1(2) + u8(0)

    def put_desc(index, d):
        return u8(2) + u16(index) + d

    def put_avail(pos, head):
        return u8(3) + u16(pos) + u16(head)

    def header(page, kind, sector):
        return u8(4) + addr_page0(page) + u8(kind) + u8(1) + u8(sector)

    PASS = u8(5)
    bump = u8(1) + u8(1)
    def read_two_sectors(sector):
        # Sectors `sector` and the next into page 3 (1024 bytes), status in page 4.
        return (header(1, 0, sector) +
                put_desc(0, desc(addr_page0(1), len_u8(16), F_NEXT, 1)) +
                put_desc(1, desc(addr_page0(3), len_u16(1024), F_WRITE_NEXT, 2)) +
                put_desc(2, desc(addr_page0(4), len_u8(1), F_WRITE)) +
                put_avail(0, 0) + bump + PASS)

    read = read_two_sectors(2)
    get_id = (header(2, 8, 0) +
              put_desc(3, desc(addr_page0(2), len_u8(16), F_NEXT, 4)) +
              put_desc(4, desc(addr_page0(5), len_u8(20), F_WRITE_NEXT, 5)) +
              put_desc(5, desc(addr_page0(4), len_u8(1), F_WRITE)) +
              put_avail(1, 3) + bump + PASS)
    write = (header(1, 1, 0) +
             put_desc(0, desc(addr_page0(1), len_u8(16), F_NEXT, 1)) +
             put_desc(1, desc(addr_page0(3), len_u16(512), F_NEXT, 2)) +
             put_desc(2, desc(addr_page0(4), len_u8(1), F_WRITE)) +
             put_avail(0, 0) + bump + PASS)
    past_end = read_two_sectors(63)
    return {
        "read": mem + queue + read,
        "read_then_id": mem + queue + read + get_id,
        "write_refused": mem + queue + write,
        "past_the_end": mem + queue + past_end,
    }


def main():
    for target, fn in [("snapshot_state", snapshot_state), ("vsock_packet", vsock_packet), ("vsock_connection", vsock_connection),
                       ("vsock_muxer", vsock_muxer), ("virtio_mmio", virtio_mmio),
                       ("desc_chain", desc_chain), ("control_frames", control_frames),
                       ("changes_tar", changes_tar), ("fs_relay", fs_relay),
                       ("block", block)]:
        d = os.path.join(HERE, target)
        os.makedirs(d, exist_ok=True)
        for old in os.listdir(d):
            os.remove(os.path.join(d, old))
        for name, data in fn().items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
