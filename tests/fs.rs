//! virtio-fs: the workspace and the system root reach the guest read-only — by the guest's
//! mount flag and, because a guest kernel is not trusted, refused by the host side (virtiofsd
//! `--readonly`) when guest root remounts them read-write. Reads are exact; nothing of the
//! backends outlives a run, however it ends.

use amvm_tests::egress_server::hex;
use amvm_tests::{amvm, run_vm, spawn_vm, RUN_TIMEOUT_SECS};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A fresh workspace directory under the temp dir, removed on drop.
struct Workspace(PathBuf);

impl Workspace {
    fn new(name: &str) -> Workspace {
        let dir = std::env::temp_dir().join(format!("amvm-ws-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Workspace(dir)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
    /// Every entry under the workspace: path -> (kind, mode, content hash).
    fn snapshot(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        let mut stack = vec![self.0.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                let m = std::fs::symlink_metadata(&p).unwrap();
                use std::os::unix::fs::PermissionsExt;
                let what = if m.is_dir() {
                    stack.push(p.clone());
                    format!("dir {:o}", m.permissions().mode())
                } else if m.is_symlink() {
                    format!("link {:?}", std::fs::read_link(&p).unwrap())
                } else {
                    format!(
                        "file {:o} {}",
                        m.permissions().mode(),
                        hex(&Sha256::digest(std::fs::read(&p).unwrap()))
                    )
                };
                out.insert(p, what);
            }
        }
        out
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    // xorshift64*: plenty random for a content check, and fast.
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(n);
    out
}

#[test]
fn a_50_mb_file_reads_exactly() {
    let ws = Workspace::new("big");
    let data = random_bytes(50_000_000, 7);
    std::fs::write(ws.0.join("big.bin"), &data).unwrap();
    let want = hex(&Sha256::digest(&data));
    let o = run_vm(
        &["--workspace", ws.path()],
        &["sh", "-c", "sha256sum big.bin; stat -c %s big.bin"],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), format!("{want}  big.bin\n50000000\n"));
}

#[test]
fn ten_thousand_small_files_list_and_read_correctly() {
    let ws = Workspace::new("many");
    let dir = ws.0.join("many");
    std::fs::create_dir(&dir).unwrap();
    let mut all = Vec::new();
    for i in 0..10_000 {
        let body = format!("file {i}\n");
        std::fs::write(dir.join(format!("f{i:05}")), &body).unwrap();
        all.extend_from_slice(body.as_bytes());
    }
    let want = hex(&Sha256::digest(&all));
    // Under the emulated KVM host each file costs a few FUSE round trips of milliseconds:
    // a longer hang guard.
    let o = run_vm(
        &["--workspace", ws.path(), "--timeout", "1500"],
        &["sh", "-c", "cd many && ls | wc -l && cat f* | sha256sum"],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), format!("10000\n{want}  -\n"));
}

/// Writes of every kind, one per line: `op rc` (0 = it worked).
const WRITES: &str = "for op in 'echo x > /workspace/new' 'echo x >> /workspace/a.txt' \
    'rm /workspace/a.txt' 'mkdir /workspace/d' 'chmod 777 /workspace/a.txt' \
    'ln -s a.txt /workspace/l' 'mv /workspace/a.txt /workspace/b.txt' 'touch /workspace/a.txt' \
    'truncate -s 0 /workspace/a.txt' 'echo x > /usr/amvm-test' 'mkdir /usr/lib/amvm-test'; do \
    if eval \"$op\" 2>/tmp/err; then echo \"WROTE: $op\"; else echo \"refused: $(cat /tmp/err)\"; fi; done";

fn check_all_refused(out: &str) {
    assert!(!out.contains("WROTE"), "a write went through:\n{out}");
    assert_eq!(out.matches("refused: ").count(), 11, "{out}");
    for line in out.lines().filter(|l| l.starts_with("refused")) {
        assert!(line.contains("Read-only file system"), "not EROFS: {line}");
    }
}

#[test]
fn writes_fail_with_erofs_by_the_mount_flag_and_the_host_tree_is_unchanged() {
    let ws = Workspace::new("ro");
    std::fs::write(ws.0.join("a.txt"), b"original\n").unwrap();
    let before = ws.snapshot();
    let script = format!(
        "grep -E ' /(workspace|usr) ' /proc/mounts | cut -d' ' -f2,4 | cut -d, -f1; {WRITES}"
    );
    let o = run_vm(&["--workspace", ws.path()], &["sh", "-c", &script]);
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(
        out.contains("/usr ro\n") && out.contains("/workspace ro\n"),
        "{out}"
    );
    check_all_refused(&out);
    assert_eq!(ws.snapshot(), before);
}

#[test]
fn guest_root_remounting_read_write_is_still_refused_by_the_host() {
    let ws = Workspace::new("root");
    std::fs::write(ws.0.join("a.txt"), b"original\n").unwrap();
    let before = ws.snapshot();
    let script = format!(
        "id -u; mount -o remount,rw /workspace && mount -o remount,rw /usr && \
         grep -E ' /(workspace|usr) ' /proc/mounts | cut -d' ' -f2,4 | cut -d, -f1; {WRITES}"
    );
    let o = run_vm(
        &["--workspace", ws.path(), "--user", "0:0"],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(out.starts_with("0\n"), "{out}");
    assert!(
        out.contains("/usr rw\n") && out.contains("/workspace rw\n"),
        "the guest kernel thinks both are writable now: {out}"
    );
    check_all_refused(&out);
    assert_eq!(ws.snapshot(), before);
}

/// `mkfs.erofs IMAGE DIR` (erofs-utils, which images/setup installs).
fn mkfs_erofs(image: &std::path::Path, dir: &std::path::Path) {
    let out = std::process::Command::new("mkfs.erofs")
        .arg(image)
        .arg(dir)
        .output()
        .expect("mkfs.erofs (erofs-utils; images/setup installs it)");
    assert!(out.status.success(), "mkfs.erofs: {out:?}");
}

#[test]
fn an_erofs_image_volume_reads_exactly_and_stays_unwritten_whatever_guest_root_does() {
    let ws = Workspace::new("erofs");
    let tree = ws.0.join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    let data = random_bytes(5_000_000, 11);
    std::fs::write(tree.join("big.bin"), &data).unwrap();
    for i in 0..300 {
        std::fs::write(tree.join(format!("a/f{i:03}")), format!("file {i}\n")).unwrap();
    }
    std::fs::write(tree.join("a/b/deep.txt"), b"deep\n").unwrap();
    std::os::unix::fs::symlink("a/b/deep.txt", tree.join("link")).unwrap();
    let image = ws.0.join("tree.erofs");
    mkfs_erofs(&image, &tree);
    let before = hex(&Sha256::digest(std::fs::read(&image).unwrap()));
    let want_big = hex(&Sha256::digest(&data));
    // As guest root: read everything, then try every way to write — the mount is read-only,
    // a read-write remount fails (EROFS has none), and the disk itself refuses raw writes
    // even after `blockdev --setrw` (the device said read-only; the host refuses writes too).
    let script = "cd /data && sha256sum big.bin && cat a/f* | sha256sum && cat link && \
        find . | sort | sha256sum && grep ' /data ' /proc/mounts | cut -d' ' -f1,3,4 | cut -d, -f1; \
        echo x > /data/new 2>/dev/null && echo WROTE-FILE; \
        mount -o remount,rw /data 2>/dev/null && echo REMOUNTED; \
        blockdev --setrw /dev/vda 2>/dev/null; \
        dd if=/dev/zero of=/dev/vda bs=4096 count=16 conv=fsync 2>/dev/null && echo WROTE-DISK; \
        echo done";
    let o = run_vm(
        &["-v", &format!("{}:/data", image.display()), "--user", "0:0"],
        &["sh", "-c", script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let small: Vec<u8> = (0..300)
        .flat_map(|i| format!("file {i}\n").into_bytes())
        .collect();
    let mut listing = vec![".".to_string()];
    let mut stack = vec![tree.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            listing.push(format!("./{}", p.strip_prefix(&tree).unwrap().display()));
        }
    }
    // `sort` in the guest's C locale: byte order.
    listing.sort();
    let listing = hex(&Sha256::digest(format!("{}\n", listing.join("\n"))));
    assert_eq!(
        o.stdout_str(),
        format!(
            "{want_big}  big.bin\n{}  -\ndeep\n{listing}  -\n/dev/vda erofs ro\ndone\n",
            hex(&Sha256::digest(&small))
        )
    );
    assert_eq!(hex(&Sha256::digest(std::fs::read(&image).unwrap())), before);
}

#[test]
fn python_and_node_run_on_the_default_system_root() {
    let o = run_vm(
        &[],
        &[
            "sh",
            "-c",
            "python3 -c 'print(2+3)' && node -e 'console.log(6*7)'",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), "5\n42\n");
}

#[test]
fn a_system_dir_replaces_the_hosts_usr() {
    // A minimal unpacked root: the host's static busybox as /usr/bin/sh and a few applets, a
    // marker file, and the merged-/usr link /bin -> usr/bin.
    let root = Workspace::new("sysroot");
    let bin = root.0.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(root.0.join("usr/share")).unwrap();
    std::fs::copy("/usr/bin/busybox", bin.join("busybox")).unwrap();
    for applet in ["cat", "ls", "sh"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    std::os::unix::fs::symlink("usr/bin", root.0.join("bin")).unwrap();
    std::fs::write(root.0.join("usr/share/marker"), "from the system dir\n").unwrap();
    let o = run_vm(
        &["--system", root.path()],
        &[
            "sh",
            "-c",
            "cat /usr/share/marker; ls -1 /usr/bin; test -e /usr/bin/python3 || echo no-python",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(
        o.stdout_str(),
        "from the system dir\nbusybox\ncat\nls\nsh\nno-python\n"
    );
}

#[test]
fn etc_is_synthesized_and_secrets_stay_on_the_host() {
    let o = run_vm(
        &[],
        &[
            "sh",
            "-c",
            "whoami; getent hosts localhost | head -1; ls /etc/shadow /root/.ssh 2>&1; \
             test -s /etc/ssl/certs/ca-certificates.crt && echo certs; echo x > /etc/passwd; \
             ls /home; cd && pwd && touch ok && echo home-writable",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(out.starts_with("agent\n"), "{out}");
    assert!(out.contains("localhost"), "{out}");
    assert!(out.contains("certs\n"), "{out}");
    assert!(out.contains("/home/agent\nhome-writable\n"), "{out}");
    assert!(
        o.stderr.contains("/etc/passwd: Read-only file system"),
        "{o:?}"
    );
    assert!(
        out.contains("'/etc/shadow': No such file")
            && out.contains("'/root/.ssh': Permission denied"),
        "{out}"
    );
}

fn nothing_left(ws: &Workspace, pid: u32) {
    amvm_tests::leftovers::nothing_left(ws.path(), pid);
}

fn run_and_check(ws: &Workspace, opts: &[&str], cmd: &[&str], want: i32) {
    let mut args = vec!["--workspace", ws.path()];
    args.extend_from_slice(opts);
    let child = spawn_vm(&args, cmd);
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(want), "{out:?}");
    nothing_left(ws, pid);
}

#[test]
fn no_backend_survives_success_failure_or_a_killed_workload() {
    let ws = Workspace::new("left");
    run_and_check(&ws, &[], &["true"], 0);
    run_and_check(&ws, &[], &["sh", "-c", "exit 3"], 3);
    run_and_check(&ws, &[], &["sh", "-c", "kill -9 $$"], 137);
}

#[test]
fn no_backend_survives_a_timeout_sigterm_or_sigkill_of_amvm() {
    let ws = Workspace::new("left-sig");
    run_and_check(&ws, &["--timeout", "3"], &["sleep", "100"], 124);

    for (sig, want) in [(libc::SIGTERM, Some(143)), (libc::SIGKILL, None)] {
        let mut child = spawn_vm(
            &["--workspace", ws.path()],
            &["sh", "-c", "echo ready; exec sleep 1000"],
        );
        let pid = child.id();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line, "ready\n");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), want, "{status:?}");
        if sig == libc::SIGKILL {
            // A run is a sandbox: one killed outright leaves its state directory, which the
            // next amvm ls removes (it lists no dead run).
            let left = amvm_tests::leftovers::sandboxes_naming(ws.path());
            assert_eq!(left.len(), 1, "{left:?}");
            let ls = amvm(["ls", "--json"], &[]);
            assert_eq!(ls.code, 0, "{ls:?}");
            assert!(!ls.stdout_str().contains(ws.path()), "{}", ls.stdout_str());
            let left = amvm_tests::leftovers::sandboxes_naming(ws.path());
            assert!(left.is_empty(), "amvm ls left {left:?}");
            run_and_check(&ws, &[], &["true"], 0);
        }
        nothing_left(&ws, pid);
    }
}

#[test]
fn a_virtiofsd_of_another_version_is_refused_before_anything_starts() {
    let ws = Workspace::new("old-backend");
    let fake = ws.0.join("virtiofsd");
    std::fs::write(&fake, "#!/bin/sh\necho 'virtiofsd 1.7.0'\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    amvm_tests::require_kvm();
    let o = amvm(
        ["run", "--workspace", ws.path(), "--", "true"],
        &[("AMVM_VIRTIOFSD", fake.to_str().unwrap())],
    );
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr
            .contains("is \"virtiofsd 1.7.0\", not the virtiofsd 1.14.0"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_backend_that_fails_to_start_is_reported_with_its_stderr() {
    let ws = Workspace::new("bad-backend");
    let fake = ws.0.join("fake-virtiofsd");
    std::fs::write(
        &fake,
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'virtiofsd 1.14.0'; exit 0; }\n\
         echo 'fake virtiofsd: cannot serve this' >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    amvm_tests::require_kvm();
    let o = amvm(
        [
            "run",
            "--timeout",
            RUN_TIMEOUT_SECS,
            "--workspace",
            ws.path(),
            "--",
            "true",
        ],
        &[("AMVM_VIRTIOFSD", fake.to_str().unwrap())],
    );
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr.contains("virtiofsd for /usr failed"),
        "{}",
        o.stderr
    );
    assert!(
        o.stderr.contains("fake virtiofsd: cannot serve this"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_working_directory_the_user_cannot_enter_is_named() {
    for (dir, why) in [
        ("/root", "Permission denied"),
        ("/nonexistent", "no such directory"),
    ] {
        let o = run_vm(&["-w", dir], &["true"]);
        assert_eq!(o.code, 125, "{o:?}");
        assert!(
            o.stderr.contains(&format!(
                "amvm: cannot enter the working directory {dir}: {why}"
            )),
            "{o:?}"
        );
    }
}
