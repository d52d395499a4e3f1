//! What docs/usage.md and docs/api.md promise about sandboxes and had no test of its own (issue
//! 36): signals sent to `amvm exec` reach the command, an `amvm exec` killed outright kills its
//! command, the API's 405 and 413 answers, an egress given at `create` reached from an exec, a
//! sandbox whose supervisor died is listed `dead` and removed by `amvm rm`, an exponential fork
//! bomb under `--pids` leaves the sandbox answering, and a read-only workspace, volume and
//! system root stay read-only on the host even after the guest's root remounts them writable;
//! an API client that goes away kills its exec, `amvm serve`'s sandboxes outlive it, a killed
//! overlay run keeps its changes for `diff` and `commit`, and `amvm apply`'s exit statuses.
//! Each test has a runtime directory of its own (XDG_RUNTIME_DIR), so its `amvm ls` sees only
//! its own sandboxes.

use amvm_tests::egress_server::{EgressServer, Pace};
use amvm_tests::{amvm_bin, require_kvm, Outcome};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A runtime directory of its own, and its sandboxes removed at the end.
struct World {
    xdg: PathBuf,
}

impl World {
    fn new(name: &str) -> World {
        require_kvm();
        let xdg = std::env::temp_dir().join(format!("amvm-promises-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&xdg).unwrap();
        World { xdg }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(amvm_bin());
        c.args(args).env("XDG_RUNTIME_DIR", &self.xdg);
        c
    }

    fn amvm(&self, args: &[&str]) -> Outcome {
        Outcome::from(self.cmd(args).stdin(Stdio::null()).output().unwrap())
    }

    fn create(&self, opts: &[&str]) -> String {
        let mut args = vec!["create", "--mem", "256", "--timeout", "900"];
        args.extend_from_slice(opts);
        let o = self.amvm(&args);
        assert_eq!(o.code, 0, "create {opts:?}: {o:?}");
        o.stdout_str().trim().to_string()
    }

    fn exec(&self, id: &str, script: &str) -> Outcome {
        self.amvm(&["exec", id, "--", "sh", "-c", script])
    }

    /// `amvm exec ID -- sh -c SCRIPT` started, once it printed its first line (`ready`).
    fn exec_ready(&self, id: &str, script: &str) -> (Child, BufReader<std::process::ChildStdout>) {
        let mut child = self
            .cmd(&["exec", id, "--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n", "the exec did not start");
        (child, out)
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.xdg.join("amvm").join(id)
    }

    /// Within a minute, the process whose pid an exec wrote to /tmp/victim is gone.
    fn victim_gone(&self, id: &str, what: &str) {
        let t0 = Instant::now();
        loop {
            let o = self.exec(
                id,
                "kill -0 $(cat /tmp/victim) 2>/dev/null && echo alive || echo gone",
            );
            assert_eq!(o.code, 0, "{o:?}");
            if o.stdout_str() == "gone\n" {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{what}");
            std::thread::sleep(Duration::from_millis(500));
        }
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

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with plain integers, to our own child or a process we started.
    let r = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(r, 0, "kill {pid} {sig}");
}

/// docs/usage.md: "Ctrl-C, SIGTERM and SIGHUP sent to `amvm exec` reach the command's process
/// group; an `amvm exec` killed outright kills its command."
#[test]
fn signals_to_amvm_exec_reach_the_command_and_a_killed_exec_kills_it() {
    let w = World::new("signals");
    let id = w.create(&[]);
    for (sig, name) in [
        (libc::SIGINT, "INT"),
        (libc::SIGTERM, "TERM"),
        (libc::SIGHUP, "HUP"),
    ] {
        let script = format!(
            "trap 'echo caught {name}; exit 7' {name}; echo ready; while :; do sleep 0.2; done"
        );
        let (child, mut out) = w.exec_ready(&id, &script);
        kill(child.id(), sig);
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        let o = child.wait_with_output().unwrap();
        assert_eq!(rest, format!("caught {name}\n"), "SIG{name}");
        assert_eq!(o.status.code(), Some(7), "SIG{name}: {o:?}");
    }
    // SIGKILL: amvm exec cannot forward it; its command dies with the exec's stream.
    let (child, _out) = w.exec_ready(&id, "echo $$ > /tmp/victim; echo ready; exec sleep 1000");
    let mut child = child;
    kill(child.id(), libc::SIGKILL);
    let _ = child.wait();
    w.victim_gone(&id, "the command of an exec killed outright still runs");
}

/// One HTTP request on the sandbox's API socket; the status line's code and the body.
fn http(sock: &std::path::Path, request: &[u8]) -> (u16, String) {
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    // The server may answer and close before it read a body it refuses: a write error then
    // is part of the answer.
    let _ = s.write_all(request);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    let code = reply
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {reply:?}"));
    (code, reply)
}

/// docs/api.md: "405 (wrong method) ... 413 (too large)".
#[test]
fn the_api_answers_405_for_a_wrong_method_and_413_for_too_large() {
    let w = World::new("http");
    let id = w.create(&[]);
    let sock = w.sandbox_dir(&id).join("api.sock");
    let (code, reply) = http(
        &sock,
        b"DELETE /v1/archive?path=/tmp HTTP/1.1\r\nHost: amvm\r\nContent-Length: 0\r\n\r\n",
    );
    assert_eq!(code, 405, "{reply}");
    assert!(reply.contains("wrong method"), "{reply}");
    // A body over the API's 4 MiB cap is refused before it is read.
    let (code, reply) = http(
        &sock,
        b"POST /v1/exec HTTP/1.1\r\nHost: amvm\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n\r\n{",
    );
    assert_eq!(code, 413, "{reply}");
    // A head over 16 KiB.
    let mut big = b"GET /v1/sandbox HTTP/1.1\r\nHost: amvm\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 20 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    let (code, reply) = http(&sock, &big);
    assert_eq!(code, 413, "{reply}");
    // And it still serves.
    let (code, reply) = http(&sock, b"GET /v1/sandbox HTTP/1.1\r\nHost: amvm\r\n\r\n");
    assert_eq!(code, 200, "{reply}");
}

/// docs/usage.md: `create --egress SOCKET` gives every exec the egress.
#[test]
fn an_egress_given_at_create_is_reached_from_an_exec() {
    let w = World::new("egress");
    let egress = EgressServer::start("promises-create", Pace::Fast);
    let id = w.create(&["--egress", egress.path_str()]);
    let o = w.exec(
        &id,
        "printf 'DOWN 100000\\n' | busybox nc $(echo $AMVM_EGRESS_ADDR | tr : ' ') | wc -c",
    );
    assert_eq!((o.code, o.stdout_str().trim()), (0, "100000"), "{o:?}");
}

/// docs/usage.md: a sandbox whose supervisor is gone is `dead` in `amvm ls`, and `amvm rm`
/// removes it (its VMM went with its supervisor).
#[test]
fn a_sandbox_whose_supervisor_died_is_listed_dead_and_removed() {
    let w = World::new("dead");
    let id = w.create(&["--name", "goner"]);
    let info = w.amvm(&["inspect", &id]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let (sup, vmm) = (
        info["pid"].as_u64().unwrap() as u32,
        info["vmm_pid"].as_u64().unwrap() as u32,
    );
    kill(sup, libc::SIGKILL);
    let t0 = Instant::now();
    let state = loop {
        let ls = w.amvm(&["ls", "--json"]);
        let all: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
        let state = all[0]["state"].as_str().unwrap_or_default().to_string();
        if state == "dead" || t0.elapsed() > Duration::from_secs(30) {
            break state;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(state, "dead");
    let ls = w.amvm(&["ls"]);
    assert!(
        ls.stdout_str().contains("goner") && ls.stdout_str().contains("dead"),
        "{ls:?}"
    );
    let e = w.exec(&id, "true");
    assert_eq!(e.code, 125, "{e:?}");
    assert!(e.stderr.contains("not running (dead)"), "{e:?}");
    let rm = w.amvm(&["rm", "goner"]);
    assert_eq!(rm.code, 0, "{rm:?}");
    assert!(!w.sandbox_dir(&id).exists());
    assert!(
        !std::path::Path::new(&format!("/proc/{vmm}")).exists()
            || std::fs::read_to_string(format!("/proc/{vmm}/stat"))
                .is_ok_and(|s| s.contains(") Z")),
        "the VMM outlived its supervisor"
    );
}

/// docs/usage.md: `--pids` stops a fork bomb (EAGAIN in the guest), and the sandbox answers
/// the next exec.
#[test]
fn an_exponential_fork_bomb_under_pids_leaves_the_sandbox_answering() {
    let w = World::new("bomb");
    let id = w.create(&["--pids", "64"]);
    // Each process starts two more, for ever; the exec's end kills what is left.
    let o = w.exec(
        &id,
        "b() { b & b & wait; }; b 2>/dev/null & sleep 10; echo bombed",
    );
    assert_eq!((o.code, o.stdout_str().as_str()), (0, "bombed\n"), "{o:?}");
    let o = w.exec(&id, "cat /sys/fs/cgroup/workload/pids.current; echo fine");
    assert_eq!(o.code, 0, "{o:?}");
    assert!(o.stdout_str().ends_with("fine\n"), "{o:?}");
}

/// docs/threat-model.md: a read-only share is refused by virtiofsd too, so the guest's root,
/// which may remount it read-write, still writes nothing on the host: the workspace, a volume
/// and a system root of the user's.
#[test]
fn read_only_shares_stay_read_only_on_the_host_after_a_guest_remount() {
    let w = World::new("ro");
    let base = std::env::temp_dir().join(format!("amvm-promises-ro-{}", std::process::id()));
    let (ws, vol) = (base.join("ws"), base.join("vol"));
    for d in [&ws, &vol] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("f"), "host\n").unwrap();
    }
    let volume = format!("{}:/data", vol.display());
    let id = w.create(&[
        "--user",
        "0:0",
        "--workspace",
        ws.to_str().unwrap(),
        "-v",
        &volume,
    ]);
    for dir in ["/workspace", "/data"] {
        let o = w.exec(
            &id,
            &format!(
                "mount -o remount,rw {dir} && echo remounted; \
                 echo guest > {dir}/f 2>/dev/null && echo wrote || echo refused; \
                 touch {dir}/new 2>/dev/null && echo made || echo refused"
            ),
        );
        assert_eq!(
            o.stdout_str(),
            "remounted\nrefused\nrefused\n",
            "{dir}: {o:?}"
        );
    }
    for d in [&ws, &vol] {
        assert_eq!(std::fs::read_to_string(d.join("f")).unwrap(), "host\n");
        assert!(!d.join("new").exists());
    }
    // A system root of the user's (`--system DIR`): a copy of a small root.
    let root = base.join("root");
    for d in ["usr/bin", "etc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("usr/bin/busybox")).expect("busybox-static");
    for link in ["sh", "mount", "echo", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("usr/bin").join(link)).unwrap();
    }
    std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
    std::fs::write(root.join("etc/marker"), "host\n").unwrap();
    let o = w.amvm(&[
        "run",
        "--mem",
        "256",
        "--user",
        "0:0",
        "--system",
        root.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "mount -o remount,rw /usr && echo remounted; \
         echo guest > /usr/bin/new 2>/dev/null && echo wrote || echo refused",
    ]);
    assert_eq!(o.stdout_str(), "remounted\nrefused\n", "{o:?}");
    assert!(!root.join("usr/bin/new").exists());
    let _ = std::fs::remove_dir_all(&base);
}

/// docs/api.md: an exec's command lives as long as its API connection; a client that goes
/// away kills it.
#[test]
fn an_api_client_that_disconnects_kills_its_exec() {
    let w = World::new("disconnect");
    let id = w.create(&[]);
    let sock = w.sandbox_dir(&id).join("api.sock");
    let body = br#"{"argv": ["sh", "-c", "echo $$ > /tmp/victim; echo ready; exec sleep 1000"]}"#;
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let head = format!(
        "POST /v1/exec HTTP/1.1\r\nHost: amvm\r\nUpgrade: amvm-exec/1\r\nConnection: Upgrade\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    // Read until the command said it runs (its stdout frame carries "ready").
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut got = Vec::new();
    while !got.windows(6).any(|w| w == b"ready\n") {
        let mut b = [0u8; 4096];
        let n = s.read(&mut b).unwrap();
        assert!(n > 0, "the exec ended: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&b[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    drop(s);
    w.victim_gone(&id, "the command of a client that went away still runs");
}

/// docs/api.md: sandboxes made through `amvm serve` are `amvm ls`'s and outlive it.
#[test]
fn sandboxes_made_through_amvm_serve_outlive_it() {
    let w = World::new("serve");
    let sock = w.xdg.join("serve.sock");
    let mut server = w
        .cmd(&["serve", "--socket", sock.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Until it accepts, not merely until the file exists: bind(2) makes the file before
    // listen(2) lets a connection in (a connect between the two was refused in CI, 2026-12-07).
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "amvm serve accepted nothing on its socket"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let body = br#"{"name": "outlives", "args": ["--mem", "256"]}"#;
    let mut req = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: amvm\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    let (code, reply) = http(&sock, &req);
    assert_eq!(code, 201, "{reply}");
    kill(server.id(), libc::SIGTERM);
    let st = server.wait().unwrap();
    assert!(st.success(), "amvm serve on SIGTERM: {st:?}");
    assert!(!sock.exists(), "amvm serve left its socket");
    let o = w.exec("outlives", "echo still here");
    assert_eq!(
        (o.code, o.stdout_str().as_str()),
        (0, "still here\n"),
        "{o:?}"
    );
    let rm = w.amvm(&["rm", "-f", "outlives"]);
    assert_eq!(rm.code, 0, "{rm:?}");
}

/// docs/usage.md: a run killed outright with an overlay workspace keeps its sandbox (dead) and
/// its changes, for `amvm diff` and `amvm commit`, until `amvm rm`; `amvm ls` does not sweep it.
#[test]
fn a_killed_overlay_runs_changes_are_kept_for_diff_and_commit() {
    let w = World::new("killed-overlay");
    let base = PathBuf::from("/dev/shm").join(format!("amvm-promises-ko-{}", std::process::id()));
    let repo = base.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join("main.txt"), "broken\n").unwrap();
    let ws = format!("{}:overlay", repo.display());
    let mut run = w
        .cmd(&[
            "run",
            "--mem",
            "256",
            "--workspace",
            &ws,
            "--",
            "sh",
            "-c",
            "echo fixed > main.txt && echo new > added.txt && sync && echo ready && exec sleep 1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n", "the run did not start");
    kill(run.id(), libc::SIGKILL);
    let _ = run.wait();
    // amvm ls keeps it (dead): its changes are the user's.
    let t0 = Instant::now();
    let id = loop {
        let ls = w.amvm(&["ls", "--json"]);
        let all: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
        if all[0]["state"] == "dead" {
            break all[0]["id"].as_str().unwrap().to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no dead run listed: {ls:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let d = w.amvm(&["diff", &id]);
    assert_eq!(d.code, 0, "{d:?}");
    assert!(d.stdout_str().contains("+fixed"), "{d:?}");
    let dest = base.join("dest");
    let cp = Command::new("cp")
        .arg("-a")
        .arg(&repo)
        .arg(&dest)
        .status()
        .unwrap();
    assert!(cp.success());
    let c = w.amvm(&["commit", &id, dest.to_str().unwrap()]);
    assert_eq!(c.code, 0, "{c:?}");
    assert_eq!(
        std::fs::read_to_string(dest.join("main.txt")).unwrap(),
        "fixed\n"
    );
    assert_eq!(
        std::fs::read_to_string(dest.join("added.txt")).unwrap(),
        "new\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("main.txt")).unwrap(),
        "broken\n"
    );
    let rm = w.amvm(&["rm", &id]);
    assert_eq!(rm.code, 0, "{rm:?}");
    let _ = std::fs::remove_dir_all(&base);
}

/// docs/usage.md: `amvm apply` exits 125 and writes nothing when an entry is refused, `--check`
/// exits 1 (and writes nothing), `--skip-refused` applies the rest and exits 1; 0 for a clean
/// archive. (No VM: the CLI on its own.)
#[test]
fn apply_exit_codes_for_check_and_skip_refused() {
    let base = std::env::temp_dir().join(format!("amvm-promises-apply-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let make = |name: &str, entries: &[(&str, char, &str)]| {
        let tar = base.join(name);
        let script = "import io, sys, tarfile\n\
            with tarfile.open(sys.argv[1], 'w', format=tarfile.GNU_FORMAT) as t:\n\
            \x20   for spec in sys.argv[2:]:\n\
            \x20       name, kind, link = spec.split('|')\n\
            \x20       i = tarfile.TarInfo(name); i.type = kind.encode(); i.linkname = link\n\
            \x20       data = b'' if kind != '0' else b'content'\n\
            \x20       i.size = len(data)\n\
            \x20       t.addfile(i, io.BytesIO(data))\n";
        let specs: Vec<String> = entries
            .iter()
            .map(|(n, k, l)| format!("{n}|{k}|{l}"))
            .collect();
        let ok = Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&tar)
            .args(&specs)
            .status()
            .unwrap();
        assert!(ok.success());
        tar
    };
    let clean = make("clean.tar", &[("a", '0', ""), ("b", '0', "")]);
    let evil = make(
        "evil.tar",
        &[
            ("ok", '0', ""),
            ("../escape", '0', ""),
            ("pw", '2', "/etc/passwd"),
        ],
    );
    let apply = |args: &[&str], dir: &str| {
        let d = base.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        let mut all: Vec<String> = vec!["apply".into()];
        all.extend(args.iter().map(|s| s.to_string()));
        all.push(d.to_str().unwrap().into());
        let o = amvm_tests::amvm(&all, &[]);
        (o, d)
    };
    let (o, d) = apply(&[clean.to_str().unwrap()], "t-clean");
    assert_eq!(o.code, 0, "{o:?}");
    assert!(d.join("a").exists() && d.join("b").exists());
    let (o, d) = apply(&["--check", clean.to_str().unwrap()], "t-check-clean");
    assert_eq!(o.code, 0, "{o:?}");
    assert!(!d.join("a").exists(), "--check wrote");
    let (o, d) = apply(&[evil.to_str().unwrap()], "t-evil");
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        !d.join("ok").exists(),
        "a refused archive was partly applied"
    );
    let (o, d) = apply(&["--check", evil.to_str().unwrap()], "t-check-evil");
    assert_eq!(o.code, 1, "{o:?}");
    assert!(o.stderr.contains("../escape"), "{o:?}");
    assert!(!d.join("ok").exists(), "--check wrote");
    let (o, d) = apply(&["--skip-refused", evil.to_str().unwrap()], "t-skip");
    assert_eq!(o.code, 1, "{o:?}");
    assert!(d.join("ok").exists() && !d.join("pw").exists() && !base.join("escape").exists());
    let _ = std::fs::remove_dir_all(&base);
}
