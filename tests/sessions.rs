//! Long-lived sandboxes: `amvm create`, then many `amvm exec`s in the same VM, `ls`, `inspect`,
//! `stop`, `rm`, `wait`. Each test keeps its sandboxes in a state directory of its own
//! (`XDG_RUNTIME_DIR`), and checks that what it removed left nothing behind.

use amvm_tests::{amvm_bin, leftovers, require_kvm, Outcome};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A test's own sandbox world: its state directory, removed (with anything still running in
/// it killed by `rm -f`) at the end.
struct World {
    xdg: PathBuf,
}

impl World {
    fn new(name: &str) -> World {
        require_kvm();
        let xdg = std::env::temp_dir().join(format!("amvm-sessions-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&xdg);
        std::fs::create_dir_all(&xdg).unwrap();
        World { xdg }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(amvm_bin());
        c.args(args)
            .env("XDG_RUNTIME_DIR", &self.xdg)
            .stdin(Stdio::null());
        c
    }

    fn amvm(&self, args: &[&str]) -> Outcome {
        Outcome::from(self.cmd(args).output().expect("spawning amvm"))
    }

    /// `amvm exec` with `input` on its stdin (`-i`).
    fn exec_with_stdin(&self, sandbox: &str, input: &[u8], command: &[&str]) -> Outcome {
        let mut args = vec!["exec", "-i", sandbox, "--"];
        args.extend_from_slice(command);
        let mut child = self
            .cmd(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap();
        Outcome::from(out)
    }

    /// Create a sandbox (with a hang guard); its id.
    fn create(&self, opts: &[&str]) -> String {
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

    fn exec(&self, sandbox: &str, command: &[&str]) -> Outcome {
        let mut args = vec!["exec", sandbox, "--"];
        args.extend_from_slice(command);
        self.amvm(&args)
    }

    fn inspect(&self, sandbox: &str) -> serde_json::Value {
        let out = self.amvm(&["inspect", sandbox]);
        assert_eq!(out.code, 0, "inspect: {}", out.stderr);
        serde_json::from_slice(&out.stdout).expect("inspect prints JSON")
    }

    /// The sandbox's supervisor and VMM, which must be running now.
    fn procs(&self, sandbox: &str) -> Procs {
        let info = self.inspect(sandbox);
        ["pid", "vmm_pid"]
            .iter()
            .map(|k| {
                let pid = info[k].as_u64().unwrap() as u32;
                let start = start_time(pid)
                    .unwrap_or_else(|| panic!("{sandbox}'s {k} {pid} is not running"));
                (pid, start)
            })
            .collect()
    }

    /// `amvm ls --json` lists no sandbox.
    fn none_listed(&self) {
        let ls = self.amvm(&["ls", "--json"]);
        assert_eq!(
            (ls.code, ls.stdout_str().trim()),
            (0, "[]"),
            "{}",
            ls.stderr
        );
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
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

/// Within a few seconds, no process mentions `needle` (a sandbox's workspace: its virtiofsd;
/// its state directory: its supervisor and VMM).
fn no_process_with(needle: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let found = leftovers::processes_with(needle);
        if found.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "left behind: {found:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// When process `pid` started (/proc/PID/stat's 22nd field); `None` once it is gone (or a
/// zombie).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    if fields.next()? == "Z" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// A running sandbox's processes (its supervisor and its VMM) as (pid, start time).
type Procs = Vec<(u32, u64)>;

/// Within a few seconds, none of `procs` is left (a pid reused by another process does not
/// count).
fn all_gone(procs: &Procs) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Procs = procs
            .iter()
            .copied()
            .filter(|&(pid, start)| start_time(pid) == Some(start))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn one_line(out: &Outcome) -> &str {
    let err = out.stderr.trim_end();
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    err
}

#[test]
fn state_persists_between_execs_and_each_exec_has_its_own_streams_and_status() {
    let w = World::new("persist");
    let id = w.create(&["--name", "persist", "--mem", "256", "-e", "GREETING=hi"]);
    // A file written by one exec is read by the next; the sandbox's -e reaches every exec.
    let out = w.exec(
        "persist",
        &["sh", "-c", "echo $GREETING > /tmp/state; echo written"],
    );
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "written\n"),
        "{}",
        out.stderr
    );
    let out = w.exec(&id, &["cat", "/tmp/state"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "hi\n"),
        "{}",
        out.stderr
    );
    // An argument that is not UTF-8 (a Linux file name need not be) arrives byte for byte.
    let odd = std::ffi::OsStr::from_bytes(b"\xff\xfe-odd\x80");
    let out = Outcome::from(
        w.cmd(&[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "printf %s \"$1\" > /tmp/odd; cat /tmp/odd",
            "sh",
        ])
        .arg(odd)
        .output()
        .unwrap(),
    );
    assert_eq!(
        (out.code, out.stdout.as_slice()),
        (0, odd.as_bytes()),
        "{}",
        out.stderr
    );
    // stdout and stderr apart, the status exact, the user the sandbox's (1000) unless asked.
    let out = w.exec(&id, &["sh", "-c", "id -u; echo oops >&2; exit 42"]);
    assert_eq!(out.code, 42);
    assert_eq!(
        (out.stdout_str().as_str(), out.stderr.as_str()),
        ("1000\n", "oops\n")
    );
    let out = w.amvm(&[
        "exec",
        "--user",
        "0:0",
        "-e",
        "X=y",
        "-w",
        "/tmp",
        &id,
        "--",
        "sh",
        "-c",
        "id -u; echo $X; pwd",
    ]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "0\ny\n/tmp\n"),
        "{}",
        out.stderr
    );
    let out = w.exec(&id, &["sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.code, 128 + 15);
    let out = w.exec(&id, &["no-such-command"]);
    assert_eq!(out.code, 127, "{}", out.stderr);
    // stdin, byte-exact: 3 MiB of a pattern through `cat`, back out.
    let input: Vec<u8> = (0..3 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let out = w.exec_with_stdin(&id, &input, &["cat"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout == input,
        "stdin came back as {} bytes, not the {} sent",
        out.stdout.len(),
        input.len()
    );
    let info = w.inspect("persist");
    assert_eq!(info["state"], "running");
    assert_eq!(info["id"], id.as_str());
    assert_eq!(info["name"], "persist");
    assert_eq!(info["execs"], 8);
    assert!(info["vmm_pid"].as_u64().unwrap() > 0);
}

#[test]
fn eight_concurrent_execs_are_byte_exact_with_their_own_status() {
    let w = World::new("eight");
    let id = w.create(&["--mem", "256"]);
    let threads: Vec<_> = (1..=8u8)
        .map(|i| {
            let (id, xdg) = (id.clone(), w.xdg.clone());
            std::thread::spawn(move || {
                // Each writes its own 1 MiB (its line repeated) and exits with its own status.
                let script = format!("yes exec-{i}-output-line | head -c 1048576; exit {i}");
                let out = Command::new(amvm_bin())
                    .args(["exec", &id, "--", "sh", "-c", &script])
                    .env("XDG_RUNTIME_DIR", &xdg)
                    .stdin(Stdio::null())
                    .output()
                    .unwrap();
                (i, Outcome::from(out))
            })
        })
        .collect();
    for t in threads {
        let (i, out) = t.join().unwrap();
        let line = format!("exec-{i}-output-line\n");
        let want: Vec<u8> = line.bytes().cycle().take(1 << 20).collect();
        assert_eq!(out.code, i32::from(i), "exec {i}: {}", out.stderr);
        assert!(
            out.stdout == want,
            "exec {i}: {} bytes, not its own 1 MiB",
            out.stdout.len()
        );
        assert_eq!(out.stderr, "", "exec {i}");
    }
    assert_eq!(w.inspect(&id)["execs"], 8);
}

#[test]
fn stop_and_rm_leave_nothing_behind_and_names_are_free_again() {
    let w = World::new("stop");
    let ws = w.xdg.join("workspace");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("seen"), "from the host\n").unwrap();
    let ws_s = ws.to_str().unwrap();
    let id = w.create(&["--name", "stopme", "--workspace", ws_s, "--label", "team=a"]);
    let procs = w.procs(&id);
    let dir = w.sandbox_dir(&id);
    // A second create with the name in use is refused and makes nothing.
    let before = std::fs::read_dir(w.xdg.join("amvm")).unwrap().count();
    let out = w.amvm(&["create", "--name", "stopme"]);
    assert_eq!(out.code, 125);
    assert!(
        one_line(&out).contains("the name stopme is in use"),
        "{}",
        out.stderr
    );
    assert_eq!(
        std::fs::read_dir(w.xdg.join("amvm")).unwrap().count(),
        before
    );
    let out = w.exec("stopme", &["cat", "seen"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "from the host\n"),
        "{}",
        out.stderr
    );
    let ls = w.amvm(&["ls"]);
    assert!(
        ls.stdout_str()
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("stopme") && l.contains("running")),
        "{}",
        ls.stdout_str()
    );
    assert_eq!(w.inspect(&id)["labels"]["team"], "a");
    // A long-running exec is ended by the stop (SIGTERM: 143), not left hanging.
    let mut sleeper = w
        .cmd(&["exec", "stopme", "--", "sleep", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let out = w.amvm(&["stop", "--time", "5", "stopme"]);
    assert_eq!(
        (out.code, out.stdout_str().trim()),
        (0, id.as_str()),
        "{}",
        out.stderr
    );
    let slept = sleeper.wait().unwrap();
    assert!(
        matches!(slept.code(), Some(143) | Some(125)),
        "the sleeping exec ended with {slept:?}"
    );
    assert_eq!(w.inspect(&id)["state"], "stopped");
    let out = w.exec("stopme", &["true"]);
    assert_eq!(out.code, 125);
    assert!(
        one_line(&out).contains("is not running (stopped)"),
        "{}",
        out.stderr
    );
    // Waiting on a stopped sandbox answers at once.
    let out = w.amvm(&["wait", &id]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    no_process_with(ws_s);
    all_gone(&procs);
    let out = w.amvm(&["rm", "stopme"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!dir.exists(), "{} left behind", dir.display());
    let out = w.amvm(&["rm", "stopme"]);
    assert_eq!(out.code, 125);
    assert!(
        one_line(&out).contains("no sandbox stopme"),
        "{}",
        out.stderr
    );
    // The name is free again.
    let id2 = w.create(&["--name", "stopme", "--mem", "128"]);
    let procs2 = w.procs(&id2);
    assert_ne!(id, id2);
    // rm of a running sandbox needs -f.
    let out = w.amvm(&["rm", "stopme"]);
    assert_eq!(out.code, 125);
    assert!(one_line(&out).contains("is running"), "{}", out.stderr);
    let out = w.amvm(&["rm", "-f", "stopme"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!w.sandbox_dir(&id2).exists());
    all_gone(&procs2);
}

#[test]
fn a_vmm_killed_outright_shows_in_ls_and_rm_cleans_up() {
    let w = World::new("killed");
    let ws = w.xdg.join("ws-killed");
    std::fs::create_dir_all(&ws).unwrap();
    let ws_s = ws.to_str().unwrap();
    let id = w.create(&["--workspace", ws_s]);
    let procs = w.procs(&id);
    let dir = w.sandbox_dir(&id);
    let vmm = w.inspect(&id)["vmm_pid"].as_u64().unwrap() as i32;
    // SAFETY: kill(2) of the VMM this test started.
    assert_eq!(unsafe { libc::kill(vmm, libc::SIGKILL) }, 0);
    let until = Instant::now() + Duration::from_secs(30);
    let info = loop {
        let info = w.inspect(&id);
        if info["state"] != "running" {
            break info;
        }
        assert!(Instant::now() < until, "still running: {info}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(info["state"], "exited", "{info}");
    assert!(
        info["ended"]
            .as_str()
            .unwrap()
            .contains("killed by signal 9"),
        "{info}"
    );
    let out = w.exec(&id, &["true"]);
    assert_eq!(out.code, 125);
    one_line(&out);
    no_process_with(ws_s);
    let out = w.amvm(&["rm", &id]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!dir.exists());
    all_gone(&procs);
}

#[test]
fn an_idle_sandbox_stops_by_itself_but_not_while_an_exec_runs() {
    let w = World::new("idle");
    let id = w.create(&["--mem", "128", "--idle-timeout", "3"]);
    let procs = w.procs(&id);
    // An exec that outlasts the idle timeout keeps the sandbox up and ends on its own.
    let out = w.exec(&id, &["sh", "-c", "sleep 6; echo slept"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "slept\n"),
        "{}",
        out.stderr
    );
    let out = w.amvm(&["wait", &id]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["state"], "stopped", "{info}");
    assert!(
        info["ended"].as_str().unwrap().contains("--idle-timeout"),
        "{info}"
    );
    all_gone(&procs);
}

#[test]
fn an_exec_that_hits_the_pids_or_memory_limit_leaves_the_sandbox_serving() {
    let w = World::new("limits");
    let id = w.create(&["--mem", "256", "--pids", "40"]);
    // The fork bomb stops at the sandbox's pids.max; its children die with it (its cgroup).
    let out = w.exec(&id, &["python3", "-c", amvm_tests::FORK_UNTIL_REFUSED]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "forks 39 then errno 11\n"),
        "{}",
        out.stderr
    );
    let out = w.exec(
        &id,
        &[
            "sh",
            "-c",
            "echo alive; cat /sys/fs/cgroup/workload/pids.current",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout_str().starts_with("alive\n"),
        "{}",
        out.stdout_str()
    );
    // Out of memory: that exec is killed (137, said so), the next one runs.
    let out = w.exec(
        &id,
        &[
            "python3",
            "-c",
            "l = []\nfor i in range(16):\n    l.append(b'x' * (64 << 20))\nprint('all allocated')",
        ],
    );
    assert_eq!(out.code, 137, "{}", out.stderr);
    assert!(
        out.stderr.contains("amvm: killed: out of memory"),
        "{}",
        out.stderr
    );
    let out = w.exec(&id, &["echo", "still here"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "still here\n"),
        "{}",
        out.stderr
    );
    assert_eq!(w.inspect(&id)["state"], "running");
}

/// Every file under `dir` with its content (symlinks as `-> target`), sorted.
fn tree(dir: &Path) -> Vec<(String, String)> {
    let mut all = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                all.push((rel + "/", String::new()));
                todo.push(p);
            } else if t.is_symlink() {
                all.push((
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                ));
            } else {
                all.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    all.sort();
    all
}

/// A workspace for an overlay: `base/repo` holding `files`, owned by the workload's user (uid
/// 1000) as a user's checkout is; `base` is in /dev/shm, because the host side of an overlay
/// must not be on an overlayfs (the test bed's /tmp is one).
fn workspace(name: &str, files: &[(&str, &str)]) -> (PathBuf, PathBuf) {
    let base =
        PathBuf::from("/dev/shm").join(format!("amvm-sessions-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let ws = base.join("repo");
    std::fs::create_dir_all(&ws).unwrap();
    for (path, text) in files {
        let p = ws.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let chown = Command::new("chown")
        .args(["-R", "1000:1000"])
        .arg(&ws)
        .status()
        .unwrap();
    assert!(chown.success());
    (base, ws)
}

/// `cp -a DIR DEST`: DEST.
fn copy_of(dir: &Path, dest: &Path) -> PathBuf {
    let cp = Command::new("cp")
        .arg("-a")
        .arg(dir)
        .arg(dest)
        .status()
        .unwrap();
    assert!(cp.success());
    dest.to_path_buf()
}

#[test]
fn an_overlay_workspace_keeps_writes_in_the_sandbox_until_diff_and_commit() {
    let w = World::new("overlay");
    let (base, ws) = workspace(
        "ws",
        &[
            ("README", "old\n"),
            ("gone.txt", "delete me\n"),
            ("src/a.rs", "fn a() {}\n"),
        ],
    );
    let before = tree(&ws);
    let id = w.create(&["--workspace", &format!("{}:overlay", ws.display())]);

    let out = w.exec(
        &id,
        &[
            "sh",
            "-c",
            "cd /workspace && echo new > README && rm gone.txt && mkdir -p new/dir \
             && echo hi > new/dir/f && ln -s ../README new/link",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    // The next exec sees the first one's writes; the host's DIR does not.
    let out = w.exec(&id, &["sh", "-c", "cat /workspace/README; ls /workspace"]);
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "new\nREADME\nnew\nsrc\n"),
        "{}",
        out.stderr
    );
    assert_eq!(tree(&ws), before, "the workspace itself is untouched");

    let diff = w.amvm(&["diff", &id]);
    assert_eq!(diff.code, 0, "{}", diff.stderr);
    let text = diff.stdout_str();
    for want in [
        "-old\n",
        "+new\n",
        "gone.txt",
        "-delete me\n",
        "new/dir/f",
        "+hi\n",
    ] {
        assert!(text.contains(want), "diff lacks {want:?}:\n{text}");
    }
    assert!(
        !text.contains("src/a.rs"),
        "an untouched file is not in the diff:\n{text}"
    );
    assert_eq!(tree(&ws), before, "diff changes nothing");

    // commit applies them to a copy of DIR, which then holds what the guest saw.
    let copy = copy_of(&ws, &base.join("copy"));
    let out = w.amvm(&["commit", &id, copy.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        tree(&copy),
        vec![
            ("README".to_string(), "new\n".to_string()),
            ("new/".into(), String::new()),
            ("new/dir/".into(), String::new()),
            ("new/dir/f".into(), "hi\n".into()),
            ("new/link".into(), "-> ../README".into()),
            ("src/".into(), String::new()),
            ("src/a.rs".into(), "fn a() {}\n".into()),
        ]
    );
    assert_eq!(tree(&ws), before);

    // A sandbox without one says so; rm takes the overlay's host side with it.
    let plain = w.create(&[]);
    let out = w.amvm(&["diff", &plain]);
    assert_eq!(out.code, 125);
    assert!(
        one_line(&out).contains("has no writable workspace"),
        "{}",
        out.stderr
    );
    let scratch = PathBuf::from(
        w.inspect(&id)["config"]["overlay_scratch"]
            .as_str()
            .unwrap(),
    );
    assert!(scratch.join("upper").is_dir(), "{}", scratch.display());
    for s in [&id, &plain] {
        let out = w.amvm(&["rm", "-f", s]);
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    assert!(!scratch.exists(), "{} left behind", scratch.display());
    no_process_with(ws.to_str().unwrap());
    let _ = std::fs::remove_dir_all(&base);
}

/// `create --overlay-size`: the cap holds across execs (ENOSPC, and the sandbox serves on), diff
/// reads the capped layer inside the supervisor's namespace while it runs, and says plainly
/// that the changes are gone once it has stopped.
#[test]
fn an_overlay_size_caps_a_sandboxs_workspace_and_diff_reads_it_while_it_runs() {
    let w = World::new("overlay-size");
    let (base, ws) = workspace("cap", &[("README", "old\n")]);
    let before = tree(&ws);
    let id = w.create(&[
        "--workspace",
        &format!("{}:overlay", ws.display()),
        "--overlay-size",
        "4m",
    ]);
    let out = w.exec(
        &id,
        &["sh", "-c", "head -c 8000000 /dev/zero > /workspace/big"],
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("No space left on device"), "{out:?}");
    let out = w.exec(
        &id,
        &[
            "sh",
            "-c",
            "rm /workspace/big && echo new > /workspace/README",
        ],
    );
    assert_eq!(out.code, 0, "the sandbox serves on: {out:?}");
    let diff = w.amvm(&["diff", &id]);
    assert_eq!(diff.code, 0, "{}", diff.stderr);
    let text = diff.stdout_str();
    assert!(text.contains("-old\n") && text.contains("+new\n"), "{text}");
    assert!(!text.contains("big"), "{text}");
    assert_eq!(tree(&ws), before, "the workspace itself is untouched");

    let scratch = PathBuf::from(
        w.inspect(&id)["config"]["overlay_scratch"]
            .as_str()
            .unwrap(),
    );
    // From here the layer is a tmpfs in the supervisor's namespace only: an empty directory.
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    let out = w.amvm(&["stop", "--time", "1", &id]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = w.amvm(&["diff", &id]);
    assert_eq!(out.code, 125, "{out:?}");
    assert!(
        one_line(&out).contains("has ended, and with it its workspace changes"),
        "{}",
        out.stderr
    );
    let out = w.amvm(&["rm", &id]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!scratch.exists(), "{} left behind", scratch.display());
    no_process_with(ws.to_str().unwrap());
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn bad_input_gets_one_line_and_changes_nothing() {
    let w = World::new("bad");
    for (args, why) in [
        (
            &["create", "--name", "../x"][..],
            "--name ../x: use letters",
        ),
        (
            &["create", "--label", "novalue"][..],
            "--label novalue: say KEY=VAL",
        ),
        (
            &["create", "--changes", "/tmp/changes.tar"][..],
            "--changes (a sandbox's changes come from amvm diff ID and amvm commit ID DIR) is not supported by amvm create yet",
        ),
        (&["diff", "nosuch"][..], "no sandbox nosuch"),
        (&["commit", "nosuch", "/tmp"][..], "no sandbox nosuch"),
        (
            &["create", "--kernel", "/nonexistent/vmlinux"][..],
            "/nonexistent/vmlinux",
        ),
        (
            &["create", "--workspace", "/nonexistent"][..],
            "--workspace /nonexistent",
        ),
        (&["exec", "nosuch", "--", "true"][..], "no sandbox nosuch"),
        (&["inspect", "0123456789ab"][..], "no sandbox 0123456789ab"),
        (&["stop", "nosuch"][..], "no sandbox nosuch"),
        // A usage error points at the help of the subcommand it was in.
        (&["create", "--mem"][..], "(see amvm create --help)"),
        (&["exec", "--bogus", "x"][..], "(see amvm exec --help)"),
    ] {
        let out = w.amvm(args);
        assert_eq!(out.code, 125, "{args:?}: {}", out.stderr);
        assert!(one_line(&out).contains(why), "{args:?}: {}", out.stderr);
    }
    w.none_listed();
}

#[test]
fn the_api_works_from_python_http_client() {
    let w = World::new("python");
    let id = w.create(&["--mem", "256"]);
    let sock = w.sandbox_dir(&id).join("api.sock");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/amvm_api.py");
    let info = Command::new("python3")
        .arg(&script)
        .arg(&sock)
        .arg("info")
        .output()
        .unwrap();
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(
        (v["id"].as_str(), v["state"].as_str()),
        (Some(id.as_str()), Some("running"))
    );
    // An exec with stdin, its stdout, stderr and status apart, through Python's own HTTP.
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(&sock)
        .args([
            "exec",
            "--stdin",
            "sh",
            "-c",
            "tr a-z A-Z; echo to-stderr >&2; exit 9",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello from python\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(9),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"HELLO FROM PYTHON\n");
    assert_eq!(out.stderr, b"to-stderr\n");
    // The API refuses what it does not know, with a JSON error.
    let bad = Command::new("curl")
        .args(["-sS", "--unix-socket"])
        .arg(&sock)
        .args([
            "-X",
            "POST",
            "-d",
            "{\"argv\": []}",
            "-H",
            "Upgrade: amvm-exec/1",
            "http://amvm/v1/exec",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(
        v["error"].as_str().unwrap().contains("argv is empty"),
        "{v}"
    );

    // Archives, Docker's put_archive and get_archive: a tree with modes, a symlink and a file
    // larger than any JSON body (4 MiB) goes in through Python and comes back byte-exact.
    use std::os::unix::fs::PermissionsExt;
    let src = w.xdg.join("arch");
    std::fs::create_dir_all(src.join("tree/sub")).unwrap();
    std::fs::write(src.join("tree/run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(
        src.join("tree/run.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let big: Vec<u8> = (0..5_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(src.join("tree/sub/big.bin"), &big).unwrap();
    std::os::unix::fs::symlink("sub/big.bin", src.join("tree/link")).unwrap();
    let tar_in = w.xdg.join("in.tar");
    let packed = Command::new("tar")
        .arg("-cf")
        .arg(&tar_in)
        .arg("-C")
        .arg(&src)
        .arg("tree")
        .status()
        .unwrap();
    assert!(packed.success());
    let api = |args: &[&str], stdin: Stdio| {
        let out = Command::new("python3")
            .arg(&script)
            .arg(&sock)
            .args(args)
            .stdin(stdin)
            .output()
            .unwrap();
        (
            out.status.code(),
            out.stdout,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = api(
        &["put-archive", "/tmp"],
        Stdio::from(std::fs::File::open(&tar_in).unwrap()),
    );
    assert_eq!(code, Some(0), "{err}");
    let out = w.exec(
        &id,
        &[
            "sh",
            "-c",
            "stat -c '%a %s' /tmp/tree/run.sh /tmp/tree/sub/big.bin; readlink /tmp/tree/link",
        ],
    );
    assert_eq!(
        (out.code, out.stdout_str().as_str()),
        (0, "755 19\n644 5000000\nsub/big.bin\n"),
        "{}",
        out.stderr
    );
    let (code, tar_out, err) = api(&["get-archive", "/tmp/tree"], Stdio::null());
    assert_eq!(code, Some(0), "{err}");
    let back = w.xdg.join("back");
    std::fs::create_dir_all(&back).unwrap();
    let mut untar = Command::new("tar")
        .arg("-xf")
        .arg("-")
        .arg("-C")
        .arg(&back)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    untar.stdin.take().unwrap().write_all(&tar_out).unwrap();
    assert!(untar.wait().unwrap().success());
    assert_eq!(listing(&back.join("tree")), listing(&src.join("tree")));
    // What is not there is a 404 with the reason; a relative path a 400.
    for (args, want) in [
        (
            ["get-archive", "/nonexistent"],
            "404: /nonexistent: no such file or directory",
        ),
        (
            ["put-archive", "/nonexistent"],
            "404: /nonexistent: no such directory",
        ),
        (
            ["get-archive", "tmp"],
            "400: path \"tmp\": a path in the sandbox must be absolute",
        ),
    ] {
        let (code, _, err) = api(&args, Stdio::from(std::fs::File::open(&tar_in).unwrap()));
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `find`-style listing of a tree: path, type, mode, and a symlink's target or a file's bytes.
fn listing(root: &Path) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = std::fs::symlink_metadata(&p).unwrap();
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        let mode = md.permissions().mode() & 0o7777;
        if md.file_type().is_symlink() {
            out.push(format!(
                "{rel} link -> {}",
                std::fs::read_link(&p).unwrap().display()
            ));
        } else if md.is_dir() {
            out.push(format!("{rel} dir {mode:o}"));
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        } else {
            let data = std::fs::read(&p).unwrap();
            out.push(format!(
                "{rel} file {mode:o} {} {:x}",
                data.len(),
                data.iter()
                    .fold(0u64, |h, &b| h.wrapping_mul(1_099_511_628_211)
                        ^ u64::from(b))
            ));
        }
    }
    out.sort();
    out
}

#[test]
fn cp_copies_trees_in_and_out_byte_exact_with_modes_and_symlinks() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new("cp");
    let id = w.create(&["--mem", "256"]);
    let src = w.xdg.join("tree");
    std::fs::create_dir_all(src.join("sub/empty")).unwrap();
    std::fs::write(src.join("run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(src.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(src.join("sub/secret"), "only mine\n").unwrap();
    std::fs::set_permissions(
        src.join("sub/secret"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let big: Vec<u8> = (0..(1u32 << 20) + 7)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    std::fs::write(src.join("sub/big.bin"), &big).unwrap();
    std::os::unix::fs::symlink("../run.sh", src.join("sub/link")).unwrap();
    std::fs::set_permissions(src.join("sub"), std::fs::Permissions::from_mode(0o750)).unwrap();
    // In: as /tmp/tree (new), and into an existing directory (/tmp, as /tmp/tree's sibling).
    let out = w.amvm(&["cp", src.to_str().unwrap(), &format!("{id}:/tmp/copy")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = w.exec(&id, &["sh", "-c", "cd /tmp/copy && ./run.sh && stat -c '%n %a' run.sh sub sub/secret && readlink sub/link && sha256sum sub/big.bin"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let sha = {
        use sha2::Digest;
        amvm_tests::egress_server::hex(&sha2::Sha256::digest(&big))
    };
    assert_eq!(
        out.stdout_str(),
        format!("ran\nrun.sh 755\nsub 750\nsub/secret 600\n../run.sh\n{sha}  sub/big.bin\n")
    );
    // Out: the copy back, into an existing directory and as a new path, equals the original.
    let back = w.xdg.join("back");
    std::fs::create_dir(&back).unwrap();
    let out = w.amvm(&["cp", &format!("{id}:/tmp/copy"), back.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(listing(&back.join("copy")), listing(&src));
    let again = w.xdg.join("again");
    let out = w.amvm(&[
        "cp",
        &format!("{id}:/tmp/copy/sub"),
        again.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(listing(&again), listing(&src.join("sub")));
    // `-`: a tar on stdout.
    let out = w.amvm(&["cp", &format!("{id}:/tmp/copy/run.sh"), "-"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .windows(10)
            .any(|w| w == b"echo ran\n\0" || w.starts_with(b"echo ran")),
        "a tar holding run.sh"
    );
    // A guest that hands back a symlink out of the destination gets nothing written.
    let out = w.exec(
        &id,
        &[
            "sh",
            "-c",
            "mkdir /tmp/evil && ln -s /etc/passwd /tmp/evil/pw",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let evil = w.xdg.join("evil");
    let out = w.amvm(&["cp", &format!("{id}:/tmp/evil"), evil.to_str().unwrap()]);
    assert_eq!(out.code, 125);
    assert!(out.stderr.contains("absolute"), "{}", out.stderr);
    assert!(!evil.exists());
    // Bad paths: one line, exit 125, nothing changed.
    for (args, why) in [
        (
            vec![
                "cp".to_string(),
                src.display().to_string(),
                format!("{id}:/nonexistent/dir/x"),
            ],
            "no such directory",
        ),
        (
            vec![
                "cp".into(),
                format!("{id}:/tmp/nothing-here"),
                w.xdg.join("n").display().to_string(),
            ],
            "nothing-here",
        ),
        (
            vec!["cp".into(), format!("{id}:relative"), "/tmp".into()],
            "one side must be",
        ),
        (
            vec![
                "cp".into(),
                w.xdg.join("missing").display().to_string(),
                format!("{id}:/tmp"),
            ],
            "missing",
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = w.amvm(&args);
        assert_eq!(out.code, 125, "{args:?}: {}", out.stderr);
        assert!(one_line(&out).contains(why), "{args:?}: {}", out.stderr);
    }
    assert!(!w.xdg.join("n").exists());
}

#[test]
fn twenty_sandboxes_up_at_once_then_all_stopped_leave_nothing_behind() {
    let w = World::new("twenty");
    let ids: Vec<String> = (0..20)
        .map(|i| w.create(&["--mem", "128", "--name", &format!("s{i}")]))
        .collect();
    let ls = w.amvm(&["ls", "--json"]);
    let all: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    let running = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "running")
        .count();
    assert_eq!(running, 20, "{all}");
    // Each is its own VM: a file written in one is in no other.
    for (i, id) in ids.iter().enumerate() {
        let out = w.exec(id, &["sh", "-c", &format!("echo {i} > /tmp/me; ls /tmp")]);
        if out.code != 0 {
            // How the sandbox stands (a guest that ended says how in `ended`).
            let info = w.amvm(&["inspect", id]);
            panic!("{i}: {out:?}\n{}", info.stdout_str());
        }
        assert_eq!(out.stdout_str(), "me\n", "{i}: {}", out.stderr);
    }
    let procs: Procs = ids.iter().flat_map(|id| w.procs(id)).collect();
    assert_eq!(procs.len(), 40);
    for (i, id) in ids.iter().enumerate() {
        let out = w.exec(id, &["cat", "/tmp/me"]);
        assert_eq!(out.stdout_str(), format!("{i}\n"));
    }
    let stops: Vec<_> = ids
        .iter()
        .map(|id| {
            let (id, xdg) = (id.clone(), w.xdg.clone());
            std::thread::spawn(move || {
                Command::new(amvm_bin())
                    .args(["stop", "--time", "2", &id])
                    .env("XDG_RUNTIME_DIR", &xdg)
                    .output()
                    .unwrap()
            })
        })
        .collect();
    for s in stops {
        let out = s.join().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut args = vec!["rm"];
    args.extend(ids.iter().map(String::as_str));
    let out = w.amvm(&args);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for id in &ids {
        let dir = w.sandbox_dir(id);
        assert!(!dir.exists(), "{} left", dir.display());
    }
    all_gone(&procs);
    no_process_with(&w.xdg.display().to_string());
    let names = std::fs::read_dir(w.xdg.join("amvm/names")).unwrap().count();
    assert_eq!(names, 0, "names left behind");
}

#[test]
fn exec_t_gives_a_real_terminal_its_size_and_its_resizes() {
    let w = World::new("tty");
    let id = w.create(&["--mem", "256"]);
    let helper = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/pty_run.py");
    let script =
        "tty; stty size; echo $TERM; echo READY; read line; stty size; echo got:$line; exit 5";
    let out = Command::new("python3")
        .arg(&helper)
        .args([
            "--after", "READY", "--resize", "30", "100", "--type", "hello\r", "40", "120", "--",
        ])
        .arg(amvm_bin())
        .args(["exec", "-it", &id, "--", "sh", "-c", script])
        .env("XDG_RUNTIME_DIR", &w.xdg)
        .env("TERM", "xterm-256color")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{text}{err}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("/dev/pts/"), "a terminal: {text:?}");
    assert_eq!(
        lines[1..4],
        ["40 120", "xterm-256color", "READY"],
        "{text:?}"
    );
    // The typed line (echoed by the guest's terminal), the new size, what `read` got.
    assert!(text.ends_with("hello\n30 100\ngot:hello\n"), "{text:?}");
    // Without -t, no terminal.
    let out = w.exec(&id, &["sh", "-c", "tty; true"]);
    assert_eq!(out.stdout_str(), "not a tty\n");
}

/// `amvm run -t` is a sandbox made for one exec: a real terminal of the caller's size, what is
/// typed, the exit status, an overlay workspace's `--changes` written, and no sandbox left
/// behind. With `--timeout` it is 124, as any run.
#[test]
fn run_t_gives_a_terminal_writes_its_changes_and_leaves_no_sandbox() {
    let w = World::new("run-tty");
    let (base, ws) = workspace("run-tty", &[("README", "old\n")]);
    let changes = base.join("changes.tar");
    let helper = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/pty_run.py");
    let script = "tty; stty size; echo READY; read line; echo $line > /workspace/typed; \
                  echo got:$line; exit 6";
    let out = Command::new("python3")
        .arg(&helper)
        .args(["--after", "READY", "--type", "hello\r", "33", "91", "--"])
        .arg(amvm_bin())
        .args(["run", "-it", "--mem", "256", "--workspace"])
        .arg(format!("{}:overlay", ws.display()))
        .arg("--changes")
        .arg(&changes)
        .args(["--", "sh", "-c", script])
        .env("XDG_RUNTIME_DIR", &w.xdg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{text}{err}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("/dev/pts/"), "a terminal: {text:?}");
    assert_eq!(lines[1..3], ["33 91", "READY"], "{text:?}");
    assert!(text.ends_with("hello\ngot:hello\n"), "{text:?}");
    // The changes: the typed line in a new file, applied to a copy of the workspace.
    let copy = copy_of(&ws, &base.join("copy"));
    let applied = w.amvm(&["apply", changes.to_str().unwrap(), copy.to_str().unwrap()]);
    assert_eq!(applied.code, 0, "{}", applied.stderr);
    assert_eq!(
        std::fs::read_to_string(copy.join("typed")).unwrap(),
        "hello\n"
    );
    assert!(
        !ws.join("typed").exists(),
        "the workspace itself is untouched"
    );
    w.none_listed();
    no_process_with(ws.to_str().unwrap());

    // --timeout: 124 and the run's own line, whether it runs out while the VM boots or while
    // the command runs; nothing left either.
    for t in ["2", "20"] {
        let out = w.amvm(&[
            "run",
            "-t",
            "--mem",
            "256",
            "--timeout",
            t,
            "--",
            "sleep",
            "600",
        ]);
        assert_eq!(out.code, 124, "{out:?}");
        assert_eq!(
            out.stderr,
            format!("amvm: timed out after {t} s\n"),
            "{out:?}"
        );
    }
    w.none_listed();
    // The VMM writes to the run's stderr: --console's kernel log is there.
    let out = w.amvm(&["run", "-t", "--mem", "256", "--console", "--", "true"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("Linux version"), "{out:?}");
    w.none_listed();
    let out = w.amvm(&["run", "-t", "--changes", "/tmp/x.tar", "--", "true"]);
    assert_eq!(out.code, 125);
    assert!(
        one_line(&out).contains("--changes needs a writable workspace"),
        "{}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&base);
}

/// `amvm run` is a sandbox made for its command: listed (as a run's) while it runs, its VMM the
/// supervisor's child, and gone when the run ends with the command's status.
#[test]
fn a_run_is_a_sandbox_listed_while_it_runs_and_gone_after() {
    let w = World::new("run-listed");
    let mut child = w
        .cmd(&["run", "-i", "--mem", "256", "--", "sh", "-c"])
        .arg("echo ready; read x; echo got $x; exit 9")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    let ls = w.amvm(&["ls", "--json"]);
    let all: Vec<serde_json::Value> = serde_json::from_slice(&ls.stdout).expect("ls --json");
    assert_eq!(all.len(), 1, "{all:?}");
    let s = &all[0];
    assert_eq!(
        (s["state"].as_str(), s["run"].as_bool()),
        (Some("running"), Some(true)),
        "{s}"
    );
    let (sup, vmm) = (
        s["pid"].as_u64().unwrap() as u32,
        s["vmm_pid"].as_u64().unwrap() as u32,
    );
    let procs: Procs = [sup, vmm]
        .iter()
        .map(|&p| (p, start_time(p).unwrap()))
        .collect();
    assert_eq!(leftovers::vmm_of(child.id()), vmm, "{s}");
    let parent = std::fs::read_to_string(format!("/proc/{vmm}/stat")).unwrap();
    let ppid = parent
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    assert_eq!(ppid, sup.to_string(), "the VMM's parent is the supervisor");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!((status.code(), rest.as_str()), (Some(9), "got go\n"));
    w.none_listed();
    all_gone(&procs);
}

/// `amvm serve`: one socket for all of a user's sandboxes, driven from Python's http.client:
/// create (by name), list, an exec and an archive passed through to the sandbox by name, rm
/// refused while running unless forced, and the server gone on SIGTERM with its socket.
#[test]
fn amvm_serve_creates_lists_passes_through_and_removes_from_python() {
    let w = World::new("serve");
    let sock = w.xdg.join("serve.sock");
    let mut server = w
        .cmd(&["serve", "--socket", sock.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !sock.exists() {
        if let Ok(Some(st)) = server.try_wait() {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(server.stderr.as_mut().unwrap(), &mut err);
            panic!("amvm serve ended ({st}): {err}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "amvm serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Only its user can reach it.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/amvm_api.py");
    let api = |args: &[&str]| {
        let out = Command::new("python3")
            .arg(&script)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let s = sock.to_str().unwrap();
    let (code, out, err) = api(&[
        s, "create", "--name", "srv", "--", "--mem", "256", "--label", "k=v",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let made: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (
            made["name"].as_str(),
            made["state"].as_str(),
            made["labels"]["k"].as_str()
        ),
        (Some("srv"), Some("running"), Some("v")),
        "{made}"
    );
    let id = made["id"].as_str().unwrap().to_string();
    // The CLI sees the same sandbox.
    assert_eq!(w.inspect("srv")["id"].as_str(), Some(id.as_str()));
    let (code, out, err) = api(&[s, "ls"]);
    assert_eq!(code, Some(0), "{err}");
    let all: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(all.as_array().map(Vec::len), Some(1), "{all}");
    assert_eq!(all[0]["id"].as_str(), Some(id.as_str()));
    // An exec and an archive through the server, by name.
    let (code, out, err) = api(&[
        "--sandbox",
        "srv",
        s,
        "exec",
        "sh",
        "-c",
        "echo hi > /tmp/f; cat /tmp/f; echo e >&2; exit 3",
    ]);
    assert_eq!((code, out.as_str(), err.as_str()), (Some(3), "hi\n", "e\n"));
    let (code, out, err) = api(&["--sandbox", "srv", s, "info"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&id), "{out}");
    let tar = Command::new("python3")
        .arg(&script)
        .args(["--sandbox", &id, s, "get-archive", "/tmp/f"])
        .output()
        .unwrap();
    assert!(
        tar.status.success(),
        "{}",
        String::from_utf8_lossy(&tar.stderr)
    );
    let listed = Command::new("tar")
        .args(["-tvf", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(&tar.stdout)?;
            c.wait_with_output()
        })
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.trim_end().ends_with(" f") && listed.contains(" 3 "),
        "{listed}"
    );
    // What the server cannot do is said with its reason.
    let (code, _, err) = api(&[s, "create", "--", "--mem", "lots"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("400: create: invalid value 'lots' for '--mem"),
        "{err}"
    );
    let (code, _, err) = api(&["--sandbox", "nope", s, "info"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("404: no sandbox nope"), "{err}");
    let procs = w.procs(&id);
    let (code, _, err) = api(&[s, "rm", "srv"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("409: sandbox") && err.contains("is running"),
        "{err}"
    );
    let (code, out, err) = api(&[s, "rm", "--force", "srv"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&id), "{out}");
    all_gone(&procs);
    let (_, out, _) = api(&[s, "ls"]);
    assert_eq!(out.trim(), "[]");
    // SIGTERM ends the server and takes its socket.
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let status = server.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!sock.exists(), "the socket is left");
}
