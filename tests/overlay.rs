//! `--workspace DIR:overlay` and `--changes FILE` (issue 24): the workload edits /workspace as an
//! agent would; DIR is byte-identical afterwards; the changes, applied to a copy of DIR with
//! `amvm apply`, reproduce exactly what the guest saw; a guest that crashes loses nothing it had
//! written.
//!
//! The changes file (and so the overlay's scratch directory beside it) goes to /dev/shm: the
//! emulated KVM host's /tmp is itself an overlayfs, which cannot hold an upper layer.

use amvm_tests::{amvm_bin, run_vm};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Prints one line per path under the directory it is given: `path type mode sha256|target`,
/// sorted; the same script runs in the guest and on the host.
const MANIFEST: &str = r#"
import hashlib, os, stat, sys
root = sys.argv[1]
out = []
for d, dirs, files in os.walk(root):
    for n in dirs + files:
        p = os.path.join(d, n)
        st = os.lstat(p)
        rel = os.path.relpath(p, root)
        mode = oct(stat.S_IMODE(st.st_mode))
        if stat.S_ISLNK(st.st_mode):
            out.append(f"{rel} link {os.readlink(p)}")
        elif stat.S_ISDIR(st.st_mode):
            out.append(f"{rel} dir {mode}")
        else:
            out.append(f"{rel} file {mode} {hashlib.sha256(open(p, 'rb').read()).hexdigest()}")
print("\n".join(sorted(out)))
"#;

fn manifest(dir: &Path) -> String {
    let out = Command::new("python3")
        .args(["-c", MANIFEST])
        .arg(dir)
        .output()
        .expect("python3");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

struct Bed {
    base: PathBuf,
    dir: PathBuf,
    changes: PathBuf,
}

impl Bed {
    /// DIR: a small project owned by uid 1000 (the workload's user), as a user's checkout is.
    fn new(name: &str) -> Bed {
        Bed::owned_by(name, 1000)
    }

    /// DIR owned by `uid` (0: root's, as a CI checkout is); for another user the bed's
    /// directory is theirs too (the changes file and the scratch directory go there).
    fn owned_by(name: &str, uid: u32) -> Bed {
        let base =
            PathBuf::from("/dev/shm").join(format!("amvm-overlay-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dir = base.join("repo");
        for d in ["src", "old/deep", "docs"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("README"), "the project\n").unwrap();
        std::fs::write(dir.join("src/main.rs"), "fn main() { broken }\n").unwrap();
        std::fs::write(dir.join("src/stale.rs"), "// to be deleted\n").unwrap();
        std::fs::write(dir.join("old/deep/x"), "old tree\n").unwrap();
        std::fs::write(dir.join("docs/guide.md"), "guide\n").unwrap();
        std::fs::write(dir.join("build.sh"), "#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("docs/guide.md", dir.join("GUIDE")).unwrap();
        let owner = format!("{uid}:{uid}");
        let chown = |p: &Path| {
            assert!(Command::new("chown")
                .args(["-R", "-h", &owner])
                .arg(p)
                .status()
                .unwrap()
                .success());
        };
        chown(&dir);
        if uid != 0 && uid != 1000 {
            chown(&base);
        }
        let changes = base.join("changes.tar");
        Bed { base, dir, changes }
    }

    fn run(&self, opts: &[&str], script: &str) -> amvm_tests::Outcome {
        let ws = format!("{}:overlay", self.dir.display());
        let mut all = vec![
            "--workspace",
            ws.as_str(),
            "--changes",
            self.changes.to_str().unwrap(),
        ];
        all.extend_from_slice(opts);
        run_vm(&all, &["sh", "-c", script])
    }
}

impl Bed {
    /// A copy of DIR (`cp -a`) and `amvm apply CHANGES COPY`'s outcome.
    fn apply_to_copy(&self) -> (PathBuf, std::process::Output) {
        let copy = self.base.join("copy");
        let cp = Command::new("cp")
            .arg("-a")
            .arg(&self.dir)
            .arg(&copy)
            .status()
            .unwrap();
        assert!(cp.success());
        let applied = Command::new(amvm_bin())
            .arg("apply")
            .arg(&self.changes)
            .arg(&copy)
            .output()
            .unwrap();
        (copy, applied)
    }
}

impl Bed {
    /// What is in the bed's directory (the overlay's scratch directory must not be).
    fn left(&self) -> Vec<String> {
        let mut left: Vec<_> = std::fs::read_dir(&self.base)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        left
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

#[test]
fn an_agent_edits_the_workspace_and_its_changes_reproduce_what_it_saw() {
    let bed = Bed::new("agent");
    let before = manifest(&bed.dir);
    let script = "set -e; cd /workspace
         echo 'fn main() { fixed() }' > src/main.rs
         rm src/stale.rs
         rm -r old
         mkdir -p src/util && printf 'pub fn fixed() {}\\n' > src/util/mod.rs
         mv docs manual
         ln -sf manual/guide.md GUIDE
         chmod +x build.sh
         head -c 100000 /dev/urandom > data.bin
         : > empty
         python3 -c \"$M\" /workspace";
    let o = bed.run(&["-e", &format!("M={MANIFEST}")], script);
    assert_eq!(o.code, 0, "{o:?}");
    let seen = o.stdout_str();
    assert!(seen.contains("src/util/mod.rs file 0o644"), "{seen}");
    assert!(seen.contains("build.sh file 0o755"), "{seen}");
    assert!(
        !seen.contains("stale.rs") && !seen.contains("old"),
        "{seen}"
    );
    // DIR itself is exactly as it was.
    assert_eq!(manifest(&bed.dir), before, "DIR was written");
    // The changes, applied to a copy of DIR, give the guest's view.
    let (copy, applied) = bed.apply_to_copy();
    assert!(applied.status.success(), "{applied:?}");
    assert_eq!(
        manifest(&copy),
        seen,
        "the applied changes differ from the guest's view"
    );
    // Nothing of the overlay is left beside the changes.
    assert_eq!(bed.left(), ["changes.tar", "copy", "repo"]);
}

#[test]
fn a_guest_that_crashes_loses_nothing_it_had_written() {
    let bed = Bed::new("crash");
    let o = bed.run(
        &["--user", "0:0"],
        "echo 'written before the crash' > /workspace/saved; rm /workspace/README; sync; \
         echo c > /proc/sysrq-trigger; sleep 100",
    );
    assert_eq!(o.code, 125, "{o:?}");
    assert!(o.stderr.contains("its kernel panicked"), "{o:?}");
    let (copy, applied) = bed.apply_to_copy();
    assert!(applied.status.success(), "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(copy.join("saved")).unwrap(),
        "written before the crash\n"
    );
    assert!(!copy.join("README").exists());
    assert!(bed.dir.join("README").exists(), "DIR was written");
}

#[test]
fn a_symlink_out_made_in_the_guest_is_refused_when_applied() {
    let bed = Bed::new("hostile");
    let o = bed.run(
        &[],
        "cd /workspace && ln -s /etc/shadow shadow && echo fine > fine",
    );
    assert_eq!(o.code, 0, "{o:?}");
    let (copy, applied) = bed.apply_to_copy();
    assert_eq!(applied.status.code(), Some(125), "{applied:?}");
    let err = String::from_utf8_lossy(&applied.stderr);
    assert!(
        err.contains("shadow: refused: a symlink to an absolute path (/etc/shadow)"),
        "{err}"
    );
    assert!(!copy.join("fine").exists(), "nothing applied");
}

/// `--overlay-size`: what fits is written, what does not gets ENOSPC, and the workload goes on
/// to its own exit status; the changes hold exactly what it kept, and the capped layer (a tmpfs
/// in the supervisor's namespace) leaves nothing behind.
#[test]
fn a_full_overlay_size_gives_the_workload_enospc_and_the_run_goes_on() {
    let bed = Bed::new("size");
    let before = manifest(&bed.dir);
    let o = bed.run(
        &["--overlay-size", "4m"],
        "cd /workspace
         head -c 3000000 /dev/zero > fits && echo fits
         rm fits
         if head -c 8000000 /dev/zero > big 2>/tmp/err; then echo wrote; else echo refused; fi
         grep -o 'No space left on device' /tmp/err
         rm big
         echo kept > after.txt && echo README gone && rm README
         exit 7",
    );
    assert_eq!(o.code, 7, "{o:?}");
    assert_eq!(
        o.stdout_str(),
        "fits\nrefused\nNo space left on device\nREADME gone\n",
        "{o:?}"
    );
    assert_eq!(manifest(&bed.dir), before, "DIR was written");
    let (copy, applied) = bed.apply_to_copy();
    assert!(applied.status.success(), "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(copy.join("after.txt")).unwrap(),
        "kept\n"
    );
    assert!(!copy.join("README").exists() && !copy.join("big").exists());
    assert_eq!(bed.left(), ["changes.tar", "copy", "repo"]);
}

/// `-v HOST:GUEST` is read-only (EROFS in the guest, nothing on the host changes); `:rw` writes
/// the host directory itself.
#[test]
fn volumes_are_read_only_unless_rw() {
    let base = PathBuf::from("/dev/shm").join(format!("amvm-volumes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (ro, rw) = (base.join("ro"), base.join("rw"));
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::create_dir_all(&rw).unwrap();
    std::fs::write(ro.join("input"), "from the host\n").unwrap();
    Command::new("chown")
        .args(["-R", "1000:1000"])
        .arg(&base)
        .status()
        .unwrap();
    let (ro_arg, rw_arg) = (
        format!("{}:/data", ro.display()),
        format!("{}:/out:rw", rw.display()),
    );
    let o = run_vm(
        &["-v", &ro_arg, "-v", &rw_arg],
        &[
            "sh",
            "-c",
            "cat /data/input; touch /data/x 2>&1 | sed 's/.*: //'; \
             echo 'from the guest' > /out/result; mkdir /out/sub; echo done",
        ],
    );
    let _cleanup = Cleanup(base.clone());
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(
        o.stdout_str(),
        "from the host\nRead-only file system\ndone\n",
        "{o:?}"
    );
    assert_eq!(
        std::fs::read_dir(&ro).unwrap().count(),
        1,
        "the ro volume was written"
    );
    assert_eq!(
        std::fs::read_to_string(rw.join("result")).unwrap(),
        "from the guest\n"
    );
    assert!(rw.join("sub").is_dir());
}

/// `--tmpfs` as the seed platform sets /tmp, and a small one whose size cap gives the workload
/// ENOSPC (the run goes on); noexec holds.
#[test]
fn tmpfs_mounts_keep_their_size_cap_and_options() {
    let o = run_vm(
        &[
            "--tmpfs",
            "/tmp:rw,noexec,nosuid,size=64m,mode=1777",
            "--tmpfs",
            "/scratch:size=1m",
        ],
        &[
            "sh",
            "-c",
            "grep -E ' /(tmp|scratch) ' /proc/mounts | cut -d' ' -f2,4; \
             dd if=/dev/zero of=/scratch/fill bs=64k count=64 2>&1 | grep -o 'No space left on device'; \
             echo \"scratch holds $(du -k /scratch/fill | cut -f1) KiB\"; \
             cp /bin/true /tmp/t && /tmp/t; echo \"exec in /tmp: $?\"",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(
        out.contains("/tmp rw,nosuid,nodev,noexec,relatime,size=65536k"),
        "{out}"
    );
    assert!(
        out.contains("/scratch rw,nosuid,nodev,relatime,size=1024k"),
        "{out}"
    );
    assert!(out.contains("No space left on device"), "{out}");
    assert!(
        out.contains("scratch holds 10") || out.contains("scratch holds 9"),
        "{out}"
    );
    assert!(out.contains("exec in /tmp: 126"), "{out}");
}

struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Issue 36: the workspace's owner appears in the guest as the workload's user (virtiofsd's id
/// translation), read-only or under an overlay, and what the workload writes is, on the host,
/// the user's who ran amvm. Here root runs amvm on a root-owned checkout, as on a CI machine,
/// where the workload (uid 1000) could write nothing before.
#[test]
fn a_root_owned_checkout_works_for_the_workload_as_root() {
    let bed = Bed::owned_by("root-owned", 0);
    std::fs::write(bed.dir.join("secret"), "root's own\n").unwrap();
    std::fs::set_permissions(
        bed.dir.join("secret"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    // Read-only: the owner's files are the workload's (even mode 0600 ones), and still not
    // writable.
    let ro = run_vm(
        &["--workspace", bed.dir.to_str().unwrap()],
        &[
            "sh",
            "-c",
            "id -u; stat -c '%u:%g' /workspace /workspace/README; cat /workspace/secret; \
             echo x > /workspace/new 2>/dev/null && echo wrote || echo refused",
        ],
    );
    assert_eq!(ro.code, 0, "{ro:?}");
    assert_eq!(
        ro.stdout_str(),
        "1000\n1000:1000\n1000:1000\nroot's own\nrefused\n"
    );
    // Overlay: the agent edits as it would in its own checkout.
    let before = manifest(&bed.dir);
    let o = bed.run(
        &[],
        "set -e; cd /workspace; stat -c '%u:%g' . src/main.rs
         echo 'fn main() { fixed() }' > src/main.rs
         mkdir -p new/dir && echo hi > new/dir/f && rm src/stale.rs && echo done",
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), "1000:1000\n1000:1000\ndone\n");
    assert_eq!(manifest(&bed.dir), before, "DIR was written");
    let (copy, applied) = bed.apply_to_copy();
    assert!(applied.status.success(), "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(copy.join("src/main.rs")).unwrap(),
        "fn main() { fixed() }\n"
    );
    assert_eq!(
        std::fs::read_to_string(copy.join("new/dir/f")).unwrap(),
        "hi\n"
    );
    assert!(!copy.join("src/stale.rs").exists());
    assert_eq!(bed.left(), ["changes.tar", "copy", "repo"]);
}

/// The same for a user who is not the workload's uid (4321, a kvm group member), on their own
/// checkout: they see their files as the workload's, its writes land in the upper layer as
/// theirs (checked on the host while a sandbox runs), and `amvm apply` as them reproduces them.
#[test]
fn a_users_own_checkout_works_for_the_workload_as_that_user() {
    use std::os::unix::fs::MetadataExt;
    amvm_tests::require_kvm();
    let bed = Bed::owned_by("user-owned", 4321);
    let kvm = std::fs::metadata("/dev/kvm").expect("/dev/kvm").gid();
    let as_user = |args: &[&str]| {
        let out = Command::new("setpriv")
            .args([
                "--reuid=4321",
                "--regid=4321",
                &format!("--groups={kvm}"),
                "--inh-caps=-all",
            ])
            .arg(amvm_bin())
            .args(args)
            .env("HOME", &bed.base)
            .env_remove("AMVM_CACHE")
            .env_remove("XDG_RUNTIME_DIR")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        amvm_tests::Outcome::from(out)
    };
    let ws = format!("{}:overlay", bed.dir.display());
    let name = format!("owned-{}", std::process::id());
    let c = as_user(&["create", "--name", &name, "--workspace", &ws]);
    assert_eq!(c.code, 0, "{c:?}");
    let o = as_user(&[
        "exec",
        &name,
        "--",
        "sh",
        "-c",
        "set -e; cd /workspace; id -u; stat -c '%u:%g' . README; echo hi > made; mkdir d; echo ok",
    ]);
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str(), "1000\n1000:1000\n1000:1000\nok\n");
    let info = as_user(&["inspect", &name]);
    assert_eq!(info.code, 0, "{info:?}");
    let info: serde_json::Value = serde_json::from_str(&info.stdout_str()).unwrap();
    let scratch = PathBuf::from(info["config"]["overlay_scratch"].as_str().unwrap());
    for made in ["made", "d"] {
        let m = std::fs::symlink_metadata(scratch.join("upper").join(made)).unwrap();
        assert_eq!(
            (m.uid(), m.gid()),
            (4321, 4321),
            "{made} in the upper layer"
        );
    }
    let d = as_user(&["diff", &name]);
    assert_eq!(d.code, 0, "{d:?}");
    let rm = as_user(&["rm", "-f", &name]);
    assert_eq!(rm.code, 0, "{rm:?}");
    assert!(!scratch.exists(), "the scratch directory is left");
}
