//! Build guest-init as a static binary and hand its path to the amvm crate, which embeds it
//! (`include_bytes!`) and generates the guest's initramfs from it at run time.
//!
//! guest-init needs `-C target-feature=+crt-static` (no musl toolchain here). Setting that for
//! the whole workspace would also apply to proc-macros, which cannot be static; so we run a
//! nested `cargo build --target x86_64-unknown-linux-gnu` with target-only RUSTFLAGS, in a
//! separate target directory (so it never waits on the outer build's lock).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const TRIPLE: &str = "x86_64-unknown-linux-gnu";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest
        .parent()
        .expect("vmm/ sits in the workspace")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("set by cargo"));
    // OUT_DIR is <target>/<profile>/build/<pkg>/out: share one nested build per profile.
    let target_dir = out_dir
        .ancestors()
        .nth(3)
        .expect("OUT_DIR depth")
        .join("guest-init-build");

    let guest_init = workspace.join("guest-init");
    for p in ["src", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", guest_init.join(p).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("Cargo.lock").display()
    );

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&workspace)
        .args([
            "build",
            "--release",
            "-p",
            "guest-init",
            "--bin",
            "guest-init",
            "--target",
            TRIPLE,
        ])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's wrappers and flags (clippy, coverage, host RUSTFLAGS) are not for this.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    cmd.env(
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
        "-C target-feature=+crt-static -C strip=symbols",
    );
    let status = cmd
        .status()
        .expect("running the nested cargo build of guest-init");
    assert!(status.success(), "building guest-init failed");

    let built = target_dir.join(TRIPLE).join("release").join("guest-init");
    let dest = out_dir.join("guest-init");
    copy_if_changed(&built, &dest);
    println!("cargo:rustc-env=AMVM_GUEST_INIT_PATH={}", dest.display());
}

fn copy_if_changed(from: &Path, to: &Path) {
    let new = std::fs::read(from).unwrap_or_else(|e| panic!("reading {}: {e}", from.display()));
    if std::fs::read(to).ok().as_deref() != Some(&new[..]) {
        std::fs::write(to, &new).unwrap_or_else(|e| panic!("writing {}: {e}", to.display()));
    }
}
