//! A bounded reader of tar archives (POSIX ustar, pax and GNU), for changes that may have been
//! written by anyone: every header's checksum is checked, sizes are octal or base-256 and must
//! fit, the metadata records that name a path (GNU long names, pax records) are read into
//! memory only up to [`MAX_META`] bytes, and a GNU sparse file's map is bounded. Nothing here
//! touches the filesystem; [`super::apply`] decides what an entry may do.

use std::io::{self, Read, Write};

/// Largest GNU long-name or pax record block read into memory (PATH_MAX is 4096).
pub const MAX_META: u64 = 64 * 1024;
/// Most chunks a sparse file's map may have.
const MAX_SPARSE_CHUNKS: usize = 64 * 1024;
const BLOCK: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("reading the archive: {0}")]
    Io(io::Error),
    #[error("the archive ends inside an entry (truncated)")]
    Truncated,
    #[error("not a tar archive")]
    NotTar,
    #[error("header at byte {0}: bad checksum (not a tar archive, or corrupt)")]
    Checksum(u64),
    #[error("header at byte {0}: bad {1} field")]
    Field(u64, &'static str),
    #[error("header at byte {at}: a {what} of {len} bytes (at most {MAX_META})")]
    MetaTooLarge {
        at: u64,
        what: &'static str,
        len: u64,
    },
    #[error("header at byte {0}: a sparse map of more than {MAX_SPARSE_CHUNKS} chunks, or one that is not in order")]
    SparseMap(u64),
}

impl From<io::Error> for TarError {
    /// An early end of the data (from [`DataReader`] too) is a truncated archive.
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => TarError::Truncated,
            _ => TarError::Io(e),
        }
    }
}

/// What kind of entry a header describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    HardLink,
    Symlink,
    CharDevice,
    BlockDevice,
    Directory,
    Fifo,
    /// A type amvm does not know (the byte as found).
    Other(u8),
}

/// One entry: its metadata, then [`Reader::data`] for a file's contents.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where the header starts in the archive (for messages).
    pub at: u64,
    pub kind: Kind,
    pub path: Vec<u8>,
    pub link: Vec<u8>,
    pub mode: u32,
    pub mtime: i64,
    /// The file's size (a sparse file's real size).
    pub size: u64,
    /// Bytes of data that follow the header in the archive.
    stored: u64,
    /// A GNU sparse file's chunks (offset, length), in order; empty for a plain file.
    pub sparse: Vec<(u64, u64)>,
    /// pax records amvm does not apply but must not ignore (PAX sparse files).
    pub pax_sparse: bool,
}

/// Reads entries one after another from `R`.
pub struct Reader<R> {
    inner: R,
    pos: u64,
    /// Data (and padding) of the current entry not yet read.
    pending: u64,
    done: bool,
}

impl<R: Read> Reader<R> {
    pub fn new(inner: R) -> Self {
        Reader {
            inner,
            pos: 0,
            pending: 0,
            done: false,
        }
    }

    /// The next entry, `None` at the archive's end (two zero blocks, or the end of input after
    /// at least one).
    pub fn next_entry(&mut self) -> Result<Option<Entry>, TarError> {
        self.skip_pending()?;
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        let mut pax_path: Option<Vec<u8>> = None;
        let mut pax_link: Option<Vec<u8>> = None;
        let mut pax_size: Option<u64> = None;
        let mut pax_sparse = false;
        loop {
            if self.done {
                return Ok(None);
            }
            let at = self.pos;
            let mut h = [0u8; BLOCK];
            if !self.read_block(&mut h)? {
                // The end of input where a header would start: a missing end-of-archive
                // marker, which tar itself accepts.
                self.done = true;
                return Ok(None);
            }
            if h.iter().all(|&b| b == 0) {
                self.done = true;
                return Ok(None);
            }
            check_sum(&h, at).map_err(|e| if at == 0 { TarError::NotTar } else { e })?;
            let size = number(&h[124..136]).ok_or(TarError::Field(at, "size"))?;
            let kind = h[156];
            match kind {
                b'L' | b'K' | b'x' | b'g' => {
                    let what = match kind {
                        b'L' => "GNU long name",
                        b'K' => "GNU long link name",
                        _ => "pax header",
                    };
                    if size > MAX_META {
                        return Err(TarError::MetaTooLarge {
                            at,
                            what,
                            len: size,
                        });
                    }
                    let data = self.read_data(size)?;
                    match kind {
                        b'L' => long_name = Some(c_string(&data).to_vec()),
                        b'K' => long_link = Some(c_string(&data).to_vec()),
                        b'x' => {
                            for (k, v) in pax_records(&data).ok_or(TarError::Field(at, "pax"))? {
                                match k {
                                    b"path" => pax_path = Some(v.to_vec()),
                                    b"linkpath" => pax_link = Some(v.to_vec()),
                                    b"size" => {
                                        pax_size = Some(
                                            std::str::from_utf8(v)
                                                .ok()
                                                .and_then(|s| s.parse().ok())
                                                .ok_or(TarError::Field(at, "pax size"))?,
                                        )
                                    }
                                    k if k.starts_with(b"GNU.sparse.") => pax_sparse = true,
                                    _ => {}
                                }
                            }
                        }
                        _ => {} // global pax records: nothing amvm applies
                    }
                    continue;
                }
                _ => {}
            }
            let ustar = &h[257..263] == b"ustar\0" || &h[257..265] == b"ustar  \0";
            let mut path = c_string(&h[0..100]).to_vec();
            if ustar && &h[257..263] == b"ustar\0" && h[345] != 0 {
                let mut p = c_string(&h[345..500]).to_vec();
                p.push(b'/');
                p.extend_from_slice(&path);
                path = p;
            }
            let mode = number(&h[100..108]).ok_or(TarError::Field(at, "mode"))?;
            let mtime = number(&h[136..148]).ok_or(TarError::Field(at, "mtime"))?;
            let mut entry = Entry {
                at,
                kind: match kind {
                    b'0' | b'\0' | b'7' | b'S' => Kind::File,
                    b'1' => Kind::HardLink,
                    b'2' => Kind::Symlink,
                    b'3' => Kind::CharDevice,
                    b'4' => Kind::BlockDevice,
                    b'5' => Kind::Directory,
                    b'6' => Kind::Fifo,
                    k => Kind::Other(k),
                },
                path: pax_path.or(long_name).unwrap_or(path),
                link: pax_link
                    .or(long_link)
                    .unwrap_or_else(|| c_string(&h[157..257]).to_vec()),
                mode: (mode & 0o7777) as u32,
                mtime: i64::try_from(mtime).unwrap_or(0),
                size: pax_size.unwrap_or(size),
                stored: pax_size.unwrap_or(size),
                sparse: Vec::new(),
                pax_sparse,
            };
            // Old tars mark directories by a trailing slash on a regular file.
            if entry.kind == Kind::File && kind == b'\0' && entry.path.ends_with(b"/") {
                entry.kind = Kind::Directory;
            }
            if kind == b'S' {
                entry.size = number(&h[483..495]).ok_or(TarError::Field(at, "sparse size"))?;
                entry.sparse = self.sparse_map(&h, at)?;
            }
            // Links, directories and devices carry no data whatever their size field says.
            if matches!(entry.kind, Kind::File | Kind::Other(_)) {
                self.pending = padded(entry.stored);
            } else {
                entry.stored = 0;
            }
            return Ok(Some(entry));
        }
    }

    /// The current entry's data: exactly its stored bytes (a sparse file's chunks, one after
    /// another). Call at most once per entry, before [`Reader::next_entry`].
    pub fn data(&mut self, entry: &Entry) -> DataReader<'_, R> {
        let left = entry.stored.min(self.pending);
        DataReader { reader: self, left }
    }

    fn sparse_map(&mut self, h: &[u8; BLOCK], at: u64) -> Result<Vec<(u64, u64)>, TarError> {
        let mut chunks = Vec::new();
        let add = |field: &[u8], chunks: &mut Vec<(u64, u64)>| -> Result<(), TarError> {
            for c in field.chunks_exact(24) {
                if c.iter().all(|&b| b == 0) {
                    continue;
                }
                let off = number(&c[..12]).ok_or(TarError::Field(at, "sparse offset"))?;
                let len = number(&c[12..]).ok_or(TarError::Field(at, "sparse length"))?;
                off.checked_add(len).ok_or(TarError::SparseMap(at))?;
                if chunks.len() >= MAX_SPARSE_CHUNKS
                    || chunks
                        .last()
                        .is_some_and(|&(o, l): &(u64, u64)| o + l > off)
                {
                    return Err(TarError::SparseMap(at));
                }
                chunks.push((off, len));
            }
            Ok(())
        };
        add(&h[386..482], &mut chunks)?;
        let mut extended = h[482] != 0;
        while extended {
            let mut ext = [0u8; BLOCK];
            if !self.read_block(&mut ext)? {
                return Err(TarError::Truncated);
            }
            add(&ext[..504], &mut chunks)?;
            extended = ext[504] != 0;
        }
        Ok(chunks)
    }

    fn skip_pending(&mut self) -> Result<(), TarError> {
        let mut sink = [0u8; 8192];
        while self.pending > 0 {
            let n = self.pending.min(sink.len() as u64) as usize;
            self.fill(&mut sink[..n])?;
            self.pending -= n as u64;
        }
        Ok(())
    }

    fn read_data(&mut self, size: u64) -> Result<Vec<u8>, TarError> {
        let mut data = vec![0u8; padded(size) as usize];
        self.fill(&mut data)?;
        data.truncate(size as usize);
        Ok(data)
    }

    /// A whole block, or `false` at a clean end of input before its first byte.
    fn read_block(&mut self, b: &mut [u8; BLOCK]) -> Result<bool, TarError> {
        let mut got = 0;
        while got < BLOCK {
            match self.inner.read(&mut b[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) if self.pos == 0 => return Err(TarError::NotTar),
                Ok(0) => return Err(TarError::Truncated),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.pos += BLOCK as u64;
        Ok(true)
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<(), TarError> {
        self.inner.read_exact(buf)?;
        self.pos += buf.len() as u64;
        Ok(())
    }
}

/// Reads one entry's data (not its padding, which the next header read skips).
pub struct DataReader<'a, R> {
    reader: &'a mut Reader<R>,
    left: u64,
}

impl<R: Read> Read for DataReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.left.min(buf.len() as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.reader.fill(&mut buf[..n]).map_err(|e| match e {
            TarError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::UnexpectedEof, other.to_string()),
        })?;
        self.left -= n as u64;
        self.reader.pending -= n as u64;
        Ok(n)
    }
}

fn padded(n: u64) -> u64 {
    n.div_ceil(BLOCK as u64).saturating_mul(BLOCK as u64)
}

fn c_string(b: &[u8]) -> &[u8] {
    &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
}

/// An octal field (spaces and NULs around it), or GNU's base-256 (high bit set).
fn number(f: &[u8]) -> Option<u64> {
    if f.first().is_some_and(|&b| b & 0x80 != 0) {
        if f[0] & 0x40 != 0 {
            return None; // negative
        }
        let mut v: u64 = u64::from(f[0] & 0x3f);
        for &b in &f[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(v);
    }
    let s = f
        .iter()
        .copied()
        .skip_while(|&b| b == b' ')
        .take_while(|&b| b != 0 && b != b' ');
    // An empty field is 0 (some writers leave unused ones blank).
    let mut v: u64 = 0;
    for b in s {
        if !(b'0'..=b'7').contains(&b) {
            return None;
        }
        v = v.checked_mul(8)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

fn check_sum(h: &[u8; BLOCK], at: u64) -> Result<(), TarError> {
    let want = number(&h[148..156]).ok_or(TarError::Checksum(at))?;
    // The checksum field counts as spaces; old writers summed signed bytes.
    let (unsigned, signed) = h.iter().enumerate().fold((0u64, 0i64), |(u, s), (i, &b)| {
        let (bu, bs) = if (148..156).contains(&i) {
            (32, 32)
        } else {
            (u64::from(b), i64::from(b as i8))
        };
        (u + bu, s + bs)
    });
    if want == unsigned || i64::try_from(want).is_ok_and(|w| w == signed) {
        Ok(())
    } else {
        Err(TarError::Checksum(at))
    }
}

/// pax records: `LEN KEY=VALUE\n`, where LEN counts the whole record.
fn pax_records(mut data: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let sp = data.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&data[..sp]).ok()?.parse().ok()?;
        if len <= sp + 1 || len > data.len() || data[len - 1] != b'\n' {
            return None;
        }
        let rec = &data[sp + 1..len - 1];
        let eq = rec.iter().position(|&b| b == b'=')?;
        out.push((&rec[..eq], &rec[eq + 1..]));
        data = &data[len..];
    }
    Some(out)
}

/// `v` in `field`: octal with a NUL when it fits, else GNU base-256.
fn put_number(field: &mut [u8], v: u64) {
    let digits = format!("{v:0w$o}", w = field.len() - 1);
    if digits.len() < field.len() {
        field[..digits.len()].copy_from_slice(digits.as_bytes());
        field[digits.len()..].fill(0);
    } else {
        field.fill(0);
        let bytes = v.to_be_bytes();
        let n = bytes.len().min(field.len());
        let len = field.len();
        field[len - n..].copy_from_slice(&bytes[bytes.len() - n..]);
        field[0] |= 0x80;
    }
}

/// Writes a tar stream: ustar headers, a GNU long-name record before any entry whose path or
/// link does not fit, GNU sparse entries for files with holes.
pub struct TarWriter<W: Write> {
    out: W,
    written: u64,
}

impl<W: Write> TarWriter<W> {
    pub fn new(out: W) -> Self {
        TarWriter { out, written: 0 }
    }

    /// One entry; exactly `size` bytes of `data` follow it (an error if `data` has fewer).
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        kind: u8,
        path: &[u8],
        link: &[u8],
        mode: u32,
        mtime: i64,
        size: u64,
        data: &mut dyn Read,
    ) -> io::Result<()> {
        self.long_names(path, link)?;
        let h = header_block(kind, path, link, mode, mtime, size, None);
        self.write(&h)?;
        self.copy(data, size)?;
        self.pad()
    }

    /// A GNU sparse file of `size` bytes holding only `chunks` (offset, length, in order);
    /// `data` gives the chunks' bytes one after another.
    pub fn put_sparse(
        &mut self,
        path: &[u8],
        mode: u32,
        mtime: i64,
        size: u64,
        chunks: &[(u64, u64)],
        data: &mut dyn Read,
    ) -> io::Result<()> {
        self.long_names(path, b"")?;
        let stored: u64 = chunks.iter().map(|c| c.1).sum();
        let mut gnu = [0u8; BLOCK];
        let (first, rest) = chunks.split_at(chunks.len().min(4));
        for (i, &(off, len)) in first.iter().enumerate() {
            put_number(&mut gnu[386 + i * 24..398 + i * 24], off);
            put_number(&mut gnu[398 + i * 24..410 + i * 24], len);
        }
        gnu[482] = u8::from(!rest.is_empty());
        put_number(&mut gnu[483..495], size);
        let h = header_block(b'S', path, b"", mode, mtime, stored, Some(&gnu));
        self.write(&h)?;
        let blocks: Vec<&[(u64, u64)]> = rest.chunks(21).collect();
        for (n, block) in blocks.iter().enumerate() {
            let mut ext = [0u8; BLOCK];
            for (i, &(off, len)) in block.iter().enumerate() {
                put_number(&mut ext[i * 24..i * 24 + 12], off);
                put_number(&mut ext[i * 24 + 12..i * 24 + 24], len);
            }
            ext[504] = u8::from(n + 1 < blocks.len());
            self.write(&ext)?;
        }
        self.copy(data, stored)?;
        self.pad()
    }

    /// The end-of-archive marker; returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.write(&[0u8; 2 * BLOCK])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn long_names(&mut self, path: &[u8], link: &[u8]) -> io::Result<()> {
        for (kind, name) in [(b'L', path), (b'K', link)] {
            if name.len() > 99 {
                let mut n = name.to_vec();
                n.push(0);
                let h = header_block(kind, b"././@LongLink", b"", 0, 0, n.len() as u64, None);
                self.write(&h)?;
                self.write(&n)?;
                self.pad()?;
            }
        }
        Ok(())
    }

    fn write(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn copy(&mut self, data: &mut dyn Read, size: u64) -> io::Result<()> {
        let n = io::copy(&mut data.take(size), &mut self.out)?;
        self.written += n;
        if n != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{n} bytes of data where {size} were announced (did the file shrink?)"),
            ));
        }
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let rem = (self.written % BLOCK as u64) as usize;
        if rem != 0 {
            self.write(&[0u8; BLOCK][..BLOCK - rem])?;
        }
        Ok(())
    }
}

/// One 512-byte header; `path` and `link` are cut at 99 bytes (a long-name record before it
/// carries the whole of a longer one). `gnu`: a GNU header (its sparse fields from that block).
fn header_block(
    kind: u8,
    path: &[u8],
    link: &[u8],
    mode: u32,
    mtime: i64,
    size: u64,
    gnu: Option<&[u8; BLOCK]>,
) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    let path = &path[..path.len().min(99)];
    let link = &link[..link.len().min(99)];
    h[..path.len()].copy_from_slice(path);
    put_number(&mut h[100..108], u64::from(mode & 0o7777));
    put_number(&mut h[108..116], 0);
    put_number(&mut h[116..124], 0);
    put_number(&mut h[124..136], size);
    put_number(&mut h[136..148], u64::try_from(mtime).unwrap_or(0));
    h[156] = kind;
    h[157..157 + link.len()].copy_from_slice(link);
    match gnu {
        None => {
            h[257..263].copy_from_slice(b"ustar\0");
            h[263..265].copy_from_slice(b"00");
        }
        Some(g) => {
            h[257..265].copy_from_slice(b"ustar  \0");
            h[386..495].copy_from_slice(&g[386..495]);
        }
    }
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    h
}

/// Builds archives in memory, for tests and fuzzing.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    pub out: Vec<u8>,
}

impl Writer {
    /// One entry with raw header values; `data` follows it.
    pub fn entry(&mut self, kind: u8, path: &[u8], link: &[u8], mode: u32, data: &[u8]) {
        let mut t = TarWriter::new(&mut self.out);
        t.put(kind, path, link, mode, 0, data.len() as u64, &mut &data[..])
            .expect("writing to memory");
    }

    /// A GNU sparse file of `size` bytes whose only data are `chunks` (offset, bytes).
    pub fn sparse(&mut self, path: &[u8], mode: u32, size: u64, chunks: &[(u64, &[u8])]) {
        let map: Vec<(u64, u64)> = chunks.iter().map(|c| (c.0, c.1.len() as u64)).collect();
        let data: Vec<u8> = chunks.iter().flat_map(|c| c.1.iter().copied()).collect();
        let mut t = TarWriter::new(&mut self.out);
        t.put_sparse(path, mode, 0, size, &map, &mut &data[..])
            .expect("writing to memory");
    }

    /// A header alone, its size field saying `size` (for malformed archives).
    pub fn header(&mut self, kind: u8, path: &[u8], size: u64) {
        let h = header_block(kind, path, b"", 0, 0, size, None);
        self.out.extend_from_slice(&h);
    }

    /// The end-of-archive marker; returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.resize(self.out.len() + 2 * BLOCK, 0);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(bytes: &[u8]) -> Result<Vec<(Entry, Vec<u8>)>, TarError> {
        let mut r = Reader::new(bytes);
        let mut out = Vec::new();
        while let Some(e) = r.next_entry()? {
            let mut d = Vec::new();
            r.data(&e).read_to_end(&mut d)?;
            out.push((e, d));
        }
        Ok(out)
    }

    #[test]
    fn reads_what_gnu_tar_and_the_writer_write() {
        let mut w = Writer::default();
        w.entry(b'5', b"dir/", b"", 0o755, b"");
        w.entry(b'0', b"dir/a", b"", 0o644, b"hello");
        let long = [b'x'; 300];
        w.entry(b'0', &long, b"", 0o600, &[7u8; 1000]);
        w.entry(b'2', b"l", &long, 0o777, b"");
        w.sparse(
            b"s",
            0o644,
            10 << 30,
            &[(4096, b"abc"), ((10 << 30) - 1, b"z")],
        );
        let got = all(&w.finish()).unwrap();
        assert_eq!(got.len(), 5);
        assert_eq!(got[0].0.kind, Kind::Directory);
        assert_eq!(
            (got[1].0.path.as_slice(), got[1].1.as_slice()),
            (&b"dir/a"[..], &b"hello"[..])
        );
        assert_eq!(
            (got[2].0.path.len(), got[2].1.len(), got[2].0.mode),
            (300, 1000, 0o600)
        );
        assert_eq!(got[3].0.link.len(), 300);
        assert_eq!(got[4].0.size, 10 << 30);
        assert_eq!(got[4].0.sparse, vec![(4096, 3), ((10 << 30) - 1, 1)]);
        assert_eq!(got[4].1, b"abcz");
    }

    #[test]
    fn a_sparse_map_longer_than_the_header_continues_in_extension_blocks() {
        let pieces: Vec<(u64, Vec<u8>)> = (0..50u64).map(|i| (i << 20, vec![i as u8; 3])).collect();
        let chunks: Vec<(u64, &[u8])> = pieces.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        let mut w = Writer::default();
        let map: Vec<(u64, u64)> = chunks.iter().map(|c| (c.0, 3)).collect();
        let data: Vec<u8> = pieces.iter().flat_map(|p| p.1.clone()).collect();
        TarWriter::new(&mut w.out)
            .put_sparse(b"many", 0o600, 0, 64 << 20, &map, &mut &data[..])
            .unwrap();
        w.entry(b'0', b"after", b"", 0o644, b"next");
        let got = all(&w.finish()).unwrap();
        assert_eq!(got[0].0.sparse, map);
        assert_eq!(got[0].1, data);
        assert_eq!(got[0].0.size, 64 << 20);
        assert_eq!(
            (got[1].0.path.as_slice(), got[1].1.as_slice()),
            (&b"after"[..], &b"next"[..])
        );
    }

    #[test]
    fn hostile_archives_are_errors_not_allocations() {
        // A long-name record claiming 1 GiB.
        let mut w = Writer::default();
        w.header(b'L', b"././@LongLink", 1 << 30);
        let e = all(&w.finish()).unwrap_err();
        assert!(matches!(e, TarError::MetaTooLarge { .. }), "{e}");
        // A corrupted checksum.
        let mut w = Writer::default();
        w.entry(b'0', b"a", b"", 0o644, b"x");
        let mut bytes = w.finish();
        bytes[0] = b'b';
        assert!(matches!(all(&bytes).unwrap_err(), TarError::NotTar));
        let mut two = Writer::default();
        two.entry(b'0', b"a", b"", 0o644, b"x");
        two.entry(b'0', b"b", b"", 0o644, b"x");
        let mut bytes = two.finish();
        bytes[1024] = b'c';
        assert!(matches!(all(&bytes).unwrap_err(), TarError::Checksum(1024)));
        assert!(matches!(all(b"hostname\n").unwrap_err(), TarError::NotTar));
        // Data cut short.
        let mut w = Writer::default();
        w.entry(b'0', b"a", b"", 0o644, &[1u8; 2000]);
        let bytes = w.out[..1024].to_vec();
        assert!(matches!(all(&bytes).unwrap_err(), TarError::Truncated));
        // Garbage.
        assert!(all(&[0x41u8; 1024]).is_err());
        // Empty input is an empty archive.
        assert!(all(b"").unwrap().is_empty());
    }

    #[test]
    fn numbers_octal_and_base256() {
        assert_eq!(number(b"0000644\0"), Some(0o644));
        assert_eq!(number(b"  755 \0"), Some(0o755));
        assert_eq!(number(b"\0\0\0"), Some(0));
        assert_eq!(number(b"0009"), None);
        assert_eq!(
            number(&[0x80, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0]),
            Some(2 << 32)
        );
        assert_eq!(number(&[0xc0, 0, 0, 1]), None);
        assert_eq!(
            number(&[0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1]),
            None
        );
    }
}
