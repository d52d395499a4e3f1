//! `amvm apply`'s archive reader (`vmm/src/changes/tar.rs`) and its per-entry rules
//! (`vmm/src/changes/apply.rs`, `check_entry`), over archives anyone may have written.
//! Checked besides "no panic":
//!
//! * mode 0, the rest of the input as an archive: every entry's data reads to its end without
//!   reading more than the input holds; names and link names stay within the metadata cap; an
//!   accepted entry has a relative path without `..`, and an accepted symlink's target, resolved
//!   lexically from the link's directory, never climbs above DIR;
//! * mode 1, entries described by the input, written with the test writer: the reader gives back
//!   exactly the kinds, paths, link names, modes and data that were written.
//!
//! Input: `mode: u8 % 2`, then for mode 0 the archive bytes; for mode 1 `count: u8 % 8` entries
//! of `kind: u8` (index into `0125346`), `path_len: u16 % 600`, `link_len: u16 % 300`,
//! `mode: u16`, `data_len: u16 % 3000`, then those path, link and data bytes.
#![no_main]

use amvm::changes::apply::check_entry;
use amvm::changes::tar::{Kind, Reader, Writer, MAX_META};
use amvm_fuzz::{trace, Input};
use libfuzzer_sys::fuzz_target;
use std::io::Read;

/// Where a relative symlink target lands, lexically, from a directory `depth` levels below the
/// root: `None` when it climbs above it.
fn lexical_depth(target: &[u8], depth: usize) -> Option<usize> {
    let mut d = depth as i64;
    for c in target.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => d -= 1,
            _ => d += 1,
        }
        if d < 0 {
            return None;
        }
    }
    Some(d as usize)
}

fn as_archive(bytes: &[u8]) {
    let mut r = Reader::new(bytes);
    let mut total = 0usize;
    loop {
        let e = match r.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(err) => {
                trace!("error: {err}");
                break;
            }
        };
        assert!(e.path.len() as u64 <= MAX_META && e.link.len() as u64 <= MAX_META);
        let mut data = Vec::new();
        let read = r.data(&e).read_to_end(&mut data);
        total += data.len();
        assert!(total <= bytes.len(), "more data than input");
        trace!("{:?} {:?} -> {:?}: {} bytes ({read:?})", e.kind, String::from_utf8_lossy(&e.path), String::from_utf8_lossy(&e.link), data.len());
        if read.is_err() {
            break;
        }
        if check_entry(&e).is_ok() {
            assert!(!e.path.starts_with(b"/"), "accepted an absolute path");
            assert!(
                !e.path.split(|&b| b == b'/').any(|c| c == b".."),
                "accepted a .. component"
            );
            if e.kind == Kind::Symlink && !e.path.split(|&b| b == b'/').last().is_some_and(|l| l.starts_with(b".wh.")) {
                let depth = e
                    .path
                    .split(|&b| b == b'/')
                    .filter(|c| !c.is_empty() && *c != b".")
                    .count()
                    .saturating_sub(1);
                assert!(!e.link.starts_with(b"/"), "accepted an absolute symlink");
                assert!(
                    lexical_depth(&e.link, depth).is_some(),
                    "accepted a symlink out: {:?} -> {:?}",
                    String::from_utf8_lossy(&e.path),
                    String::from_utf8_lossy(&e.link)
                );
            }
        }
    }
}

fn round_trip(input: &mut Input) {
    let count = input.u8() % 8;
    let mut w = Writer::default();
    let mut want = Vec::new();
    for _ in 0..count {
        let kind = b"0125346"[usize::from(input.u8()) % 7];
        let path_len = usize::from(input.u16() % 600);
        let link_len = usize::from(input.u16() % 300);
        let mode = u32::from(input.u16()) & 0o7777;
        let data_len = usize::from(input.u16() % 3000);
        // NUL ends a name in tar; the writer is for names without one.
        let mut path: Vec<u8> = input.bytes(path_len).iter().map(|&b| b.max(1)).collect();
        if path.is_empty() {
            path.push(b'p');
        }
        // A trailing slash on an old-style entry reads as a directory; keep the kinds exact.
        if path.ends_with(b"/") {
            path.push(b'p');
        }
        let link: Vec<u8> = input.bytes(link_len).iter().map(|&b| b.max(1)).collect();
        let data = if kind == b'0' { input.bytes(data_len).to_vec() } else { Vec::new() };
        w.entry(kind, &path, &link, mode, &data);
        want.push((kind, path, link, mode, data));
    }
    let bytes = w.finish();
    let mut r = Reader::new(bytes.as_slice());
    for (kind, path, link, mode, data) in want {
        let e = r.next_entry().expect("reads").expect("an entry");
        let k = match e.kind {
            Kind::File => b'0',
            Kind::HardLink => b'1',
            Kind::Symlink => b'2',
            Kind::CharDevice => b'3',
            Kind::BlockDevice => b'4',
            Kind::Directory => b'5',
            Kind::Fifo => b'6',
            Kind::Other(k) => k,
        };
        assert_eq!(k, kind);
        assert_eq!(e.path, path);
        assert_eq!(e.link, link);
        assert_eq!(e.mode, mode);
        let mut got = Vec::new();
        r.data(&e).read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
    }
    assert!(r.next_entry().unwrap().is_none());
}

fuzz_target!(|bytes: &[u8]| {
    let mut input = Input::new(bytes);
    match input.u8() % 2 {
        0 => as_archive(&bytes[1.min(bytes.len())..]),
        _ => round_trip(&mut input),
    }
});
