//! A test's own sandbox world: a state directory of its own (`XDG_RUNTIME_DIR`), whose
//! sandboxes are removed (anything still running killed by `rm -f`) when it drops.

use crate::{amvm_bin, require_kvm, Outcome};
use std::path::PathBuf;
use std::process::{Command, Stdio};

pub struct World {
    pub xdg: PathBuf,
}

impl World {
    /// `suite` and `name` make the directory's name (with this process's pid).
    pub fn new(suite: &str, name: &str) -> World {
        require_kvm();
        let xdg = std::env::temp_dir().join(format!("amvm-{suite}-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&xdg);
        std::fs::create_dir_all(&xdg).unwrap();
        World { xdg }
    }

    /// `amvm ARGS` in this world, stdin closed.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(amvm_bin());
        c.args(args)
            .env("XDG_RUNTIME_DIR", &self.xdg)
            .stdin(Stdio::null());
        c
    }

    pub fn amvm(&self, args: &[&str]) -> Outcome {
        Outcome::from(self.cmd(args).output().expect("spawning amvm"))
    }

    /// Create a sandbox (with a hang guard); its id.
    pub fn create(&self, opts: &[&str]) -> String {
        let mut args = vec!["create", "--timeout", "900"];
        args.extend_from_slice(opts);
        let out = self.amvm(&args);
        assert_eq!(out.code, 0, "create {opts:?}: {}", out.stderr);
        let id = out.stdout_str().trim().to_string();
        assert!(
            id.len() == 12 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "an id: {id:?}"
        );
        id
    }

    pub fn exec(&self, sandbox: &str, command: &[&str]) -> Outcome {
        let mut args = vec!["exec", sandbox, "--"];
        args.extend_from_slice(command);
        self.amvm(&args)
    }

    pub fn inspect(&self, sandbox: &str) -> serde_json::Value {
        let out = self.amvm(&["inspect", sandbox]);
        assert_eq!(out.code, 0, "inspect: {}", out.stderr);
        serde_json::from_slice(&out.stdout).expect("inspect prints JSON")
    }

    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.xdg.join("amvm").join(id)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let ls = self.amvm(&["ls", "--json"]);
        if let Ok(serde_json::Value::Array(all)) = serde_json::from_slice(&ls.stdout) {
            for s in all {
                if let Some(id) = s["id"].as_str() {
                    let _ = self.amvm(&["rm", "-f", id]);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.xdg);
    }
}
