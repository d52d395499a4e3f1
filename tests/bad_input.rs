//! Bad input gets one clear line on stderr, exit 125, and leaves nothing behind.

use amvm_tests::{amvm, require_kvm, Outcome};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// One line, prefixed `amvm:`, exit 125, nothing on stdout.
fn assert_one_line_125(o: &Outcome, needle: &str) {
    assert_eq!(o.code, 125, "{o:?}");
    assert!(o.stdout.is_empty(), "{o:?}");
    assert_eq!(o.stderr.lines().count(), 1, "want one line: {:?}", o.stderr);
    assert!(o.stderr.starts_with("amvm: "), "{:?}", o.stderr);
    assert!(
        o.stderr.contains(needle),
        "want {needle:?} in {:?}",
        o.stderr
    );
}

/// A private TMPDIR that must still be empty after amvm exits.
fn scratch() -> tempdir::Dir {
    tempdir::Dir::new()
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            let p = std::env::temp_dir().join(format!(
                "amvm-test-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        pub fn assert_empty(&self) {
            let left: Vec<_> = std::fs::read_dir(&self.0).unwrap().collect();
            assert!(left.is_empty(), "amvm left files behind: {left:?}");
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn missing_kernel() {
    require_kvm();
    let t = scratch();
    let tmp = t.0.to_str().unwrap();
    let o = amvm(
        ["run", "--kernel", "/nonexistent/vmlinux", "--", "true"],
        &[("TMPDIR", tmp)],
    );
    assert_one_line_125(&o, "/nonexistent/vmlinux");
    t.assert_empty();
}

#[test]
fn kernel_that_is_not_an_elf() {
    require_kvm();
    let t = scratch();
    let bogus = t.0.join("not-a-kernel");
    std::fs::write(&bogus, b"MZ this is not an ELF vmlinux").unwrap();
    let o = amvm(
        ["run", "--kernel", bogus.to_str().unwrap(), "--", "true"],
        &[],
    );
    assert_one_line_125(&o, "not a loadable x86_64 ELF vmlinux");
}

#[test]
fn missing_kvm_device() {
    let o = amvm(
        ["run", "--", "true"],
        &[("AMVM_KVM_DEVICE", "/nonexistent/kvm")],
    );
    assert_one_line_125(&o, "/nonexistent/kvm does not exist");
}

#[test]
fn no_permission_on_kvm_device_names_the_kvm_group() {
    let t = scratch();
    let dev = t.0.join("kvm");
    std::fs::write(&dev, b"").unwrap();
    std::fs::set_permissions(&dev, std::fs::Permissions::from_mode(0o000)).unwrap();
    let dev = dev.to_str().unwrap().to_string();
    let is_root = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"));
    let o = if is_root {
        // Root bypasses file modes through CAP_DAC_OVERRIDE: drop it (and its read twin) so the
        // open fails as it does for a user outside the kvm group.
        let out = std::process::Command::new("setpriv")
            .args([
                "--bounding-set",
                "-dac_override,-dac_read_search",
                "--inh-caps",
                "-dac_override,-dac_read_search",
                "--",
            ])
            .arg(amvm_tests::amvm_bin())
            .args(["run", "--", "true"])
            .env("AMVM_KVM_DEVICE", &dev)
            .output()
            .expect("setpriv (util-linux) runs amvm without CAP_DAC_OVERRIDE");
        Outcome {
            code: out.status.code().unwrap(),
            stdout: out.stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into(),
        }
    } else {
        amvm(["run", "--", "true"], &[("AMVM_KVM_DEVICE", &dev)])
    };
    assert_one_line_125(&o, "`kvm` group");
    assert!(Path::new(&dev).exists());
}

#[test]
fn unknown_flag() {
    let o = amvm(["run", "--frobnicate", "--", "true"], &[]);
    assert_one_line_125(&o, "--frobnicate");
    assert_one_line_125(&o, "(see amvm run --help)");
    assert_one_line_125(&amvm(["--frobnicate"], &[]), "(see amvm --help)");
}

#[test]
fn missing_command() {
    let o = amvm(["run"], &[]);
    assert_one_line_125(&o, "COMMAND");
}

#[test]
fn impossible_sizes() {
    assert_one_line_125(&amvm(["run", "--cpus", "0", "--", "true"], &[]), "--cpus 0");
    assert_one_line_125(
        &amvm(["run", "--cpus", "33", "--", "true"], &[]),
        "--cpus 33",
    );
    assert_one_line_125(&amvm(["run", "--mem", "1", "--", "true"], &[]), "--mem 1");
    assert_one_line_125(
        &amvm(["run", "--pids", "0", "--", "true"], &[]),
        "'0' for '--pids <N>'",
    );
    assert_one_line_125(
        &amvm(["run", "--user", "root", "--", "true"], &[]),
        "--user",
    );
    assert_one_line_125(
        &amvm(["run", "--", "true"], &[("AMVM_HUGE_PAGES", "yes")]),
        "AMVM_HUGE_PAGES=\"yes\": say 1 (on) or 0 (off)",
    );
    // A flag does not hide a malformed variable.
    assert_one_line_125(
        &amvm(
            ["run", "--huge-pages", "--", "true"],
            &[("AMVM_HUGE_PAGES", "yes")],
        ),
        "AMVM_HUGE_PAGES=\"yes\": say 1 (on) or 0 (off)",
    );
}

#[test]
fn missing_egress_socket() {
    let o = amvm(
        ["run", "--egress", "/nonexistent/egress.sock", "--", "true"],
        &[],
    );
    assert_one_line_125(&o, "egress socket /nonexistent/egress.sock: no such file");
}

#[test]
fn bad_shares_are_refused_before_anything_starts() {
    let dir = std::env::temp_dir().join(format!("amvm-badroot-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("usr")).unwrap();
    let root = dir.to_str().unwrap().to_string();
    // Something that starts as an EROFS image does (its superblock's magic at byte 1024).
    let image = dir.join("image.erofs");
    let mut bytes = vec![0u8; 4096];
    bytes[1024..1028].copy_from_slice(&0xE0F5_E1E2u32.to_le_bytes());
    std::fs::write(&image, bytes).unwrap();
    let erofs = format!("{}:/data:rw", image.display());
    for (args, says) in [
        (
            vec!["run", "--workspace", "/nonexistent/ws", "--", "true"],
            "--workspace /nonexistent/ws: No such file or directory",
        ),
        (
            vec!["run", "--workspace", "/etc/passwd", "--", "true"],
            "--workspace /etc/passwd: not a directory",
        ),
        (
            vec!["run", "--system", "/nonexistent/root", "--", "true"],
            "--system /nonexistent/root: No such file or directory",
        ),
        (
            vec!["run", "--system", &root, "--", "true"],
            "has no usable /bin/sh",
        ),
        (
            vec!["run", "-v", "/etc/passwd:/data", "--", "true"],
            "/etc/passwd: not a directory, and not an EROFS image (make one with mkfs.erofs)",
        ),
        (
            vec!["run", "-v", &erofs, "--", "true"],
            ": an EROFS image is read-only; drop :rw",
        ),
    ] {
        assert_one_line_125(&amvm(&args, &[]), says);
    }
    // A bare word is an image name: one that is not built is refused, naming the images that
    // are; a name that could leave the images directory is refused as a name.
    let cache = dir.join("cache");
    std::fs::create_dir_all(cache.join("images/other/rootfs")).unwrap();
    std::fs::write(cache.join("images/other/image.json"), "{}").unwrap();
    let cache = cache.to_str().unwrap();
    assert_one_line_125(
        &amvm(
            ["run", "--system", "usr", "--", "true"],
            &[("AMVM_CACHE", cache)],
        ),
        "--system usr: no image named usr in ",
    );
    let out = amvm(["image", "path", "usr"], &[("AMVM_CACHE", cache)]);
    assert_one_line_125(&out, "(built: other); build it with images/usr/build");
    assert_one_line_125(
        &amvm(["image", "rm", "../x"], &[("AMVM_CACHE", cache)]),
        "\"../x\" is not an image name",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_gateway_with_bad_rules_says_which_and_leaves_no_socket() {
    let dir = scratch();
    let sock = dir.0.join("gw.sock");
    let s = sock.to_str().unwrap();
    let o = amvm(["gateway", "--listen", s], &[]);
    assert_one_line_125(&o, "no --allow rule");
    let o = amvm(
        [
            "gateway",
            "--listen",
            s,
            "--allow",
            "https://api.example.com",
        ],
        &[],
    );
    assert_one_line_125(&o, "--allow https://api.example.com");
    let key = dir.0.join("key");
    std::fs::write(&key, "sk-never-shown\n").unwrap();
    let cred = format!("other.example=header:x-api-key:@{}", key.display());
    let o = amvm(
        [
            "gateway",
            "--listen",
            s,
            "--allow",
            "api.example.com",
            "--credential",
            &cred,
        ],
        &[],
    );
    assert_one_line_125(&o, "no --allow rule");
    assert!(!o.stderr.contains("sk-never-shown"), "{o:?}");
    let o = amvm(
        [
            "gateway",
            "--listen",
            s,
            "--allow",
            "api.example.com",
            "--ca",
            "/nowhere.pem",
        ],
        &[],
    );
    assert_one_line_125(&o, "/nowhere.pem");
    let conf = dir.0.join("gw.toml");
    std::fs::write(
        &conf,
        "listen = \"gw.sock\"\nalow = [\"api.example.com\"]\n",
    )
    .unwrap();
    let o = amvm(["gateway", "--config", conf.to_str().unwrap()], &[]);
    assert_one_line_125(&o, "alow");
    let o = amvm(["gateway", "--allow", "api.example.com"], &[]);
    assert_one_line_125(&o, "--listen");
    assert!(!sock.exists(), "a refused gateway left its socket");
    // The same refusals for a run's own gateway, under the run's flag names, before any sandbox
    // (or gateway) is made.
    let mark = format!("AMVM_GW_REFUSED={}", std::process::id());
    let run = |flags: &[&str]| {
        let mut args = vec!["run", "-e", &mark];
        args.extend_from_slice(flags);
        args.extend(["--", "true"]);
        amvm(args, &[])
    };
    let o = run(&["--egress-allow", "https://api.example.com"]);
    assert_one_line_125(
        &o,
        "--egress-allow https://api.example.com: say a host name",
    );
    let o = run(&[
        "--egress-allow",
        "api.example.com",
        "--egress-credential",
        &cred,
    ]);
    assert_one_line_125(
        &o,
        "--egress-credential other.example=...: no --egress-allow rule",
    );
    assert!(!o.stderr.contains("sk-never-shown"), "{o:?}");
    let missing = "api=bearer:@/nowhere.key";
    let o = run(&[
        "--egress-allow",
        "api=api.example.com",
        "--egress-credential",
        missing,
    ]);
    assert_one_line_125(
        &o,
        "--egress-credential api=bearer:@/nowhere.key: /nowhere.key",
    );
    let o = run(&[
        "--egress-allow",
        "api.example.com",
        "--egress-ca",
        "/nowhere.pem",
    ]);
    assert_one_line_125(&o, "--egress-ca /nowhere.pem");
    let o = run(&[
        "--egress-allow",
        "api.example.com",
        "--egress-log",
        "/nowhere/a.log",
    ]);
    assert_one_line_125(
        &o,
        "--egress-log /nowhere/a.log: its directory does not exist",
    );
    let o = run(&["--egress-allow", "api.example.com", "--egress", s]);
    assert_one_line_125(&o, "cannot be used with");
    let o = run(&["--egress-credential", &cred]);
    assert_one_line_125(&o, "--egress-allow");
    let left = amvm_tests::leftovers::sandboxes_naming(&mark);
    assert!(left.is_empty(), "a refused run made a sandbox: {left:?}");
    assert!(amvm_tests::leftovers::processes_with(s).is_empty());
}
