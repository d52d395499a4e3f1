//! The guest's initramfs, generated in memory: a `newc` cpio archive holding guest-init as
//! `/init`, its run spec, a console node, and (until the system root arrives over virtio-fs)
//! a static busybox so `sh -c` works.
//!
//! newc format (see the kernel's Documentation/driver-api/early-userspace/buffer-format.rst):
//! per entry the ASCII magic `070701`, thirteen 8-digit hex fields (ino, mode, uid, gid, nlink,
//! mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize incl. NUL, check), the
//! name with its NUL, padding to 4 bytes, the data, padding to 4 bytes; ended by `TRAILER!!!`.

const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

/// A cpio archive under construction.
#[derive(Debug, Default)]
pub struct Archive {
    buf: Vec<u8>,
    ino: u32,
}

impl Archive {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn dir(&mut self, name: &str, perm: u32) -> &mut Self {
        self.entry(name, S_IFDIR | perm, (0, 0), &[])
    }

    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> &mut Self {
        self.entry(name, S_IFREG | perm, (0, 0), data)
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.entry(name, S_IFLNK | 0o777, (0, 0), target.as_bytes())
    }

    pub fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) -> &mut Self {
        self.entry(name, S_IFCHR | perm, (major, minor), &[])
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> &mut Self {
        self.ino += 1;
        let nlink = if mode & S_IFMT == S_IFDIR { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// Close the archive and return its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.buf
    }
}

/// True if `elf` is an ELF executable with no program interpreter (so it runs without a
/// dynamic loader in an otherwise empty root).
pub fn is_static_elf(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[32..40].try_into().expect("8 bytes")) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    if phentsize < 4 {
        return false;
    }
    (0..phnum).all(|i| {
        let off = phoff.saturating_add(i.saturating_mul(phentsize));
        match elf.get(off..off + 4) {
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != PT_INTERP,
            None => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal newc reader, to check what we write.
    fn entries(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut consumed = 0usize;
        loop {
            assert_eq!(&b[..6], b"070701");
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + 8 * i..14 + 8 * i]).unwrap(), 16)
                    .unwrap()
            };
            let (mode, size, namesize) = (field(1), field(6) as usize, field(11) as usize);
            let name = String::from_utf8(b[110..110 + namesize - 1].to_vec()).unwrap();
            let mut off = 110 + namesize;
            off += (4 - (consumed + off) % 4) % 4;
            let data = b[off..off + size].to_vec();
            off += size;
            off += (4 - (consumed + off) % 4) % 4;
            consumed += off;
            b = &b[off..];
            if name == "TRAILER!!!" {
                assert!(b.is_empty());
                return out;
            }
            out.push((name, mode, data));
        }
    }

    #[test]
    fn archive_round_trips() {
        let mut a = Archive::new();
        a.dir("dev", 0o755)
            .char_dev("dev/console", 0o600, 5, 1)
            .file("init", 0o755, b"abcde");
        a.symlink("bin/sh", "busybox");
        let e = entries(&a.finish());
        assert_eq!(e.len(), 4);
        assert_eq!(e[0], ("dev".into(), S_IFDIR | 0o755, vec![]));
        assert_eq!(e[1].1, S_IFCHR | 0o600);
        assert_eq!(e[2], ("init".into(), S_IFREG | 0o755, b"abcde".to_vec()));
        assert_eq!(
            e[3],
            ("bin/sh".into(), S_IFLNK | 0o777, b"busybox".to_vec())
        );
    }

    #[test]
    fn static_elf_detection() {
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        // Test binaries link dynamically: they have an interpreter.
        assert!(!is_static_elf(&me));
        assert!(!is_static_elf(b"#!/bin/sh\n"));
        assert!(!is_static_elf(&[0x7f, b'E', b'L', b'F', 2, 1]));
        let guest_init = crate::GUEST_INIT;
        assert!(is_static_elf(guest_init), "guest-init must be static");
    }
}
