//! A sandbox's state kept while it does not run: `amvm pause` / `amvm resume` (issue 37). Real
//! guests: a process's memory and the guest's files survive, a paused guest runs nothing,
//! and every call that needs it running says it is paused instead of hanging.

use amvm_tests::world::World;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Prints 0, 1, 2, ... every 50 ms: the count lives only in the process's memory.
const COUNTER: &str =
    "import time\ni = 0\nwhile True:\n    print(i, flush=True)\n    i += 1\n    time.sleep(0.05)\n";

/// The numbers a counter printed so far.
type Seen = Arc<Mutex<Vec<u64>>>;

fn seen_len(seen: &Seen) -> usize {
    seen.lock().unwrap().len()
}

fn wait_for_lines(seen: &Seen, n: usize, what: &str) {
    let until = Instant::now() + Duration::from_secs(120);
    while seen_len(seen) < n {
        assert!(Instant::now() < until, "{what}: {} lines", seen_len(seen));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The count neither stands still nor restarts over `pauses`: every number once, in order.
fn counted_on(seen: &Seen) {
    let seen = seen.lock().unwrap();
    let expected: Vec<u64> = (0..seen.len() as u64).collect();
    assert_eq!(*seen, expected, "the counter restarted or skipped");
}

/// The counter's output has not grown for `quiet` (after `settle` for lines in flight).
fn stands_still(seen: &Seen, settle: Duration, quiet: Duration) -> usize {
    std::thread::sleep(settle);
    let before = seen_len(seen);
    std::thread::sleep(quiet);
    let after = seen_len(seen);
    assert_eq!(
        before, after,
        "the guest ran while paused: {before} then {after} lines"
    );
    after
}

fn api(sock: &Path, what: &str) -> (bool, String, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/amvm_api.py");
    let o = Command::new("python3")
        .arg(script)
        .arg(sock)
        .arg(what)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn a_paused_sandbox_keeps_its_processes_and_files_runs_nothing_and_says_it_is_paused() {
    let w = World::new("snapshots", "pause");
    let id = w.create(&["--name", "pz", "--mem", "256", "--cpus", "2"]);
    let o = w.exec("pz", &["sh", "-c", "echo kept > /tmp/f"]);
    assert_eq!(o.code, 0, "{}", o.stderr);

    let mut counter = w
        .cmd(&["exec", "pz", "--", "python3", "-u", "-c", COUNTER])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen: Seen = Arc::default();
    let out = counter.stdout.take().unwrap();
    let s = seen.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            s.lock().unwrap().push(line.trim().parse().unwrap());
        }
    });
    wait_for_lines(&seen, 5, "the counter before the pause");

    // Paused: said so by pause, inspect and ls; the counter stands still.
    let o = w.amvm(&["pause", "pz"]);
    assert_eq!(
        (o.code, o.stdout_str().trim()),
        (0, id.as_str()),
        "{}",
        o.stderr
    );
    assert_eq!(w.inspect("pz")["state"], "paused");
    let ls = w.amvm(&["ls"]);
    assert!(
        ls.stdout_str()
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("paused")),
        "ls: {}",
        ls.stdout_str()
    );
    let at_pause = stands_still(&seen, Duration::from_millis(500), Duration::from_secs(2));

    // What needs a running guest says it is paused, at once, and changes nothing.
    for (what, args) in [
        ("exec", vec!["exec", "pz", "--", "true"]),
        ("cp", vec!["cp", "pz:/tmp/f", "-"]),
    ] {
        let o = w.amvm(&args);
        assert_eq!(o.code, 125, "{what} on a paused sandbox: {o:?}");
        assert!(
            o.stderr
                .contains("sandbox pz is paused: `amvm resume pz` first"),
            "{what}: {}",
            o.stderr
        );
    }
    // Pausing again changes nothing; the guest still stands still.
    let o = w.amvm(&["pause", "pz"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    stands_still(&seen, Duration::ZERO, Duration::from_millis(500));

    // Resumed: the same process counts on from where it stood; the file is there.
    let o = w.amvm(&["resume", "pz"]);
    assert_eq!(
        (o.code, o.stdout_str().trim()),
        (0, id.as_str()),
        "{}",
        o.stderr
    );
    assert_eq!(w.inspect("pz")["state"], "running");
    wait_for_lines(&seen, at_pause + 5, "the counter after resume");
    counted_on(&seen);
    let o = w.exec("pz", &["cat", "/tmp/f"]);
    assert_eq!(
        (o.code, o.stdout_str()),
        (0, "kept\n".into()),
        "{}",
        o.stderr
    );
    let o = w.amvm(&["resume", "pz"]);
    assert_eq!(o.code, 0, "resuming a running sandbox: {}", o.stderr);

    // The same through the API, from Python: an exec there is refused with 409.
    let sock = w.sandbox_dir(&id).join("api.sock");
    let (ok, body, err) = api(&sock, "pause");
    assert!(ok, "API pause: {err}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["state"], "paused");
    let at_pause = stands_still(&seen, Duration::from_millis(500), Duration::from_secs(1));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/amvm_api.py");
    let o = Command::new("python3")
        .arg(&script)
        .arg(&sock)
        .args(["exec", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("409") && err.contains("is paused"),
        "an API exec on a paused sandbox: {err}"
    );
    let (ok, body, err) = api(&sock, "resume");
    assert!(ok, "API resume: {err}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["state"], "running");
    wait_for_lines(&seen, at_pause + 5, "the counter after the API's resume");
    counted_on(&seen);

    // A paused sandbox stops as any other: its processes get their SIGTERM.
    let o = w.amvm(&["pause", "pz"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = w.amvm(&["stop", "-t", "5", "pz"]);
    assert_eq!(o.code, 0, "stopping a paused sandbox: {}", o.stderr);
    assert_eq!(w.inspect("pz")["state"], "stopped");
    let status = counter.wait().unwrap();
    assert!(!status.success(), "the counter ended with the sandbox");
    reader.join().unwrap();
    let o = w.amvm(&["pause", "pz"]);
    assert_eq!(o.code, 125, "pausing a stopped sandbox: {o:?}");
    assert!(
        o.stderr.contains("is not running (stopped)"),
        "{}",
        o.stderr
    );
}

/// The KVM state a snapshot carries, saved from a VM whose vCPUs are set up for boot, written
/// in the state file format, read back, put into a new VM, and saved again: the same state
/// (but for the counters that run on by themselves: the TSC, the clock, the PIT's load times).
#[test]
fn a_vm_and_its_vcpus_kvm_state_round_trips_through_the_state_file() {
    use amvm::snapshot::{format, DevicesState, MachineState, Meta};
    use amvm::vstate::{kvm::Kvm, memory, vcpu::BootEntry, vm::Vm};
    amvm_tests::require_kvm();
    let kvm = Kvm::open().expect("opening /dev/kvm");
    let cpus = 2u8;
    let machine = |mib| {
        let (mem, _) = memory::create(mib, false).unwrap();
        let vm = Vm::new(&kvm, &mem).unwrap();
        (mem, vm)
    };
    let (_mem, vm) = machine(64);
    let vcpus: Vec<_> = (0..cpus)
        .map(|id| {
            let v = vm.create_vcpu(id).unwrap();
            let boot = (id == 0).then_some(BootEntry {
                entry: 0x100_0000,
                start_info: 0x6000,
            });
            v.configure(&kvm, cpus, boot).unwrap();
            v
        })
        .collect();
    let state = MachineState {
        meta: Meta {
            amvm: "test".into(),
            mem_mib: 64,
            cpus,
            created: 0,
        },
        vm: vm.save_state().unwrap(),
        vcpus: vcpus.iter().map(|v| v.save_state(&kvm).unwrap()).collect(),
        devices: DevicesState {
            transports: Vec::new(),
            shares: Vec::new(),
            disks: Vec::new(),
        },
    };
    assert_eq!(state.vcpus[0].regs.rip, 0x100_0000, "the boot vCPU's entry");
    assert!(
        state.vcpus[0].msrs.len() > 10,
        "MSRs saved: {:?}",
        state.vcpus[0]
            .msrs
            .iter()
            .map(|m| m.index)
            .collect::<Vec<_>>()
    );
    let bytes = format::encode(&state).unwrap();
    let back: MachineState = format::decode(&bytes).unwrap();

    let (_mem2, vm2) = machine(64);
    vm2.restore_state(&back.vm).unwrap();
    let vcpus2: Vec<_> = back
        .vcpus
        .iter()
        .map(|s| {
            let v = vm2.create_vcpu(s.id).unwrap();
            v.restore_state(&kvm, cpus, s).unwrap();
            v
        })
        .collect();
    let again = MachineState {
        meta: back.meta.clone(),
        vm: vm2.save_state().unwrap(),
        vcpus: vcpus2.iter().map(|v| v.save_state(&kvm).unwrap()).collect(),
        devices: DevicesState {
            transports: Vec::new(),
            shares: Vec::new(),
            disks: Vec::new(),
        },
    };
    // Each vCPU's state, field by field, as its bytes; the TSC and a deadline made of it run on.
    let json = |v: &amvm::vstate::vcpu::VcpuState| {
        let mut j = serde_json::to_value(v).unwrap();
        let msrs: Vec<_> = v
            .msrs
            .iter()
            .filter(|m| m.index != 0x10 && m.index != 0x6e0)
            .map(|m| (m.index, m.data))
            .collect();
        j["msrs"] = serde_json::json!(msrs);
        j
    };
    for (a, b) in state.vcpus.iter().zip(&again.vcpus) {
        let (ja, jb) = (json(a), json(b));
        for field in ja.as_object().unwrap().keys() {
            assert_eq!(ja[field], jb[field], "vCPU {}: {field} changed", a.id);
        }
    }
    let bytes_of = |c| serde_json::to_value(c).unwrap();
    for (a, b) in [
        (&state.vm.pic_master, &again.vm.pic_master),
        (&state.vm.pic_slave, &again.vm.pic_slave),
        (&state.vm.ioapic, &again.vm.ioapic),
    ] {
        assert_eq!(bytes_of(a), bytes_of(b), "an interrupt controller changed");
    }
    assert!(
        again.vm.clock.clock >= state.vm.clock.clock,
        "the KVM clock went back: {} then {}",
        state.vm.clock.clock,
        again.vm.clock.clock
    );
    for (a, b) in state.vm.pit.channels.iter().zip(&again.vm.pit.channels) {
        assert_eq!(
            (a.mode, a.count),
            (b.mode, b.count),
            "a PIT channel changed"
        );
    }
    // The state refuses another amvm before anything is restored.
    assert!(back
        .check()
        .unwrap_err()
        .to_string()
        .contains("written by amvm test"));
}

/// virtiofsd's part of a snapshot: its state (the inodes the guest holds) saved over
/// vhost-user's device-state protocol and loaded into a new virtiofsd serving the same
/// directory; a damaged state is refused by the new one, not taken.
#[test]
fn virtiofsd_saves_its_state_and_a_new_one_loads_it() {
    use amvm::fs::{virtiofsd_path, Virtiofsd};
    use amvm_devices::virtio::fs::VhostUserFs;
    let cache = amvm::config::cache_dir().expect("a cache directory");
    let bin = virtiofsd_path(&cache);
    let dir = std::env::temp_dir().join(format!("amvm-fs-state-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("sub/file"), "kept").unwrap();
    let policy = amvm::seccomp::Policy::new(false).unwrap();
    let serve = || {
        let (d, stream) = Virtiofsd::spawn(&bin, &dir, false, false, &[], &policy, None)
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let fs = VhostUserFs::new("workspace", stream).expect("the vhost-user handshake");
        (d, fs)
    };
    let (_a, mut a) = serve();
    let state = a.save_backend_state().expect("virtiofsd saves its state");
    assert!(
        state.ring_bases.is_empty(),
        "no rings before the guest's driver started"
    );
    assert!(!state.blob.is_empty(), "an empty state");

    let (_b, mut b) = serve();
    b.load_backend_state(&state.blob)
        .expect("a new virtiofsd loads it");

    let (_c, mut c) = serve();
    let half = &state.blob[..state.blob.len() / 2];
    let e = c.load_backend_state(half).unwrap_err();
    assert!(e.to_string().contains("CHECK_DEVICE_STATE"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `amvm snapshot`: the whole sandbox written to a new private directory (the state file
/// decodes and holds every vCPU, transport and share; guest memory is sparse), and the sandbox
/// goes on as it was, its exec streams and shares working; a paused one stays paused; `--stop`
/// ends it; an existing directory or a stopped sandbox is refused with nothing left behind.
#[test]
fn a_snapshot_writes_the_whole_sandbox_to_a_new_private_directory_and_it_goes_on() {
    use amvm::snapshot::{format, MachineState};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let w = World::new("snapshots", "write");
    let ws = w.xdg.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("in-workspace"), "from the host\n").unwrap();
    let id = w.create(&[
        "--name",
        "sn",
        "--mem",
        "256",
        "--cpus",
        "2",
        "--workspace",
        ws.to_str().unwrap(),
    ]);
    let o = w.exec("sn", &["sh", "-c", "echo kept > /tmp/f"]);
    assert_eq!(o.code, 0, "{}", o.stderr);

    let dir = w.xdg.join("snap1");
    let d = dir.to_str().unwrap();
    let o = w.amvm(&["snapshot", "sn", d]);
    assert_eq!((o.code, o.stdout_str().trim()), (0, d), "{}", o.stderr);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    for f in ["state", "memory", "sandbox.json"] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
    let mem = std::fs::metadata(dir.join("memory")).unwrap();
    assert_eq!(mem.len(), 256 << 20);
    assert!(
        mem.blocks() * 512 < mem.len(),
        "the memory file is not sparse: {} of {} bytes",
        mem.blocks() * 512,
        mem.len()
    );
    let state: MachineState =
        format::decode(&std::fs::read(dir.join("state")).unwrap()).expect("the state file decodes");
    state.check().expect("this amvm restores it");
    assert_eq!((state.meta.cpus, state.vcpus.len()), (2, 2));
    assert_eq!(
        state.devices.transports.len(),
        3,
        "vsock, the system and the workspace shares"
    );
    assert!(state.devices.transports.iter().all(|t| t.activated));
    let tags: Vec<&str> = state.devices.shares.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(tags, ["system", "workspace"]);
    assert!(
        state.devices.shares.iter().all(|s| !s.1.blob.is_empty()),
        "virtiofsd's state"
    );
    let described: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("sandbox.json")).unwrap()).unwrap();
    assert_eq!(described["sandbox"]["id"], id.as_str());
    assert_eq!(described["kernel_sha256"].as_str().map(str::len), Some(64));

    // It went on: execs (vsock), the guest's files, both shares (their virtiofsd's rings were
    // stopped for the snapshot and started again).
    let o = w.exec(
        "sn",
        &[
            "sh",
            "-c",
            "cat /tmp/f /workspace/in-workspace; ls /usr/bin | grep -cx sh",
        ],
    );
    assert_eq!(
        (o.code, o.stdout_str()),
        (0, "kept\nfrom the host\n1\n".into()),
        "{}",
        o.stderr
    );
    assert_eq!(w.inspect("sn")["state"], "running");

    // The same through the API, from Python (its files passed with the request).
    let sock = w.sandbox_dir(&id).join("api.sock");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("standin/amvm_api.py");
    let o = Command::new("python3")
        .arg(&script)
        .arg(&sock)
        .args(["snapshot", w.xdg.join("snap-api").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["memory_bytes"], 256u64 << 20);
    assert_eq!(v["sandbox"]["state"], "running");
    format::decode::<MachineState>(&std::fs::read(w.xdg.join("snap-api/state")).unwrap())
        .expect("the API's snapshot decodes");

    // A paused sandbox stays paused.
    assert_eq!(w.amvm(&["pause", "sn"]).code, 0);
    let o = w.amvm(&["snapshot", "sn", w.xdg.join("snap2").to_str().unwrap()]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(w.inspect("sn")["state"], "paused");
    assert_eq!(w.amvm(&["resume", "sn"]).code, 0);
    let o = w.exec("sn", &["cat", "/tmp/f"]);
    assert_eq!(
        (o.code, o.stdout_str()),
        (0, "kept\n".into()),
        "{}",
        o.stderr
    );

    // Into a directory that exists: refused, the snapshot there untouched.
    let before = std::fs::read(dir.join("state")).unwrap();
    let o = w.amvm(&["snapshot", "sn", d]);
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr
            .contains("exists: a snapshot goes into a new directory"),
        "{}",
        o.stderr
    );
    assert_eq!(std::fs::read(dir.join("state")).unwrap(), before);

    // --stop ends it.
    let o = w.amvm(&[
        "snapshot",
        "--stop",
        "sn",
        w.xdg.join("snap3").to_str().unwrap(),
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let info = w.inspect("sn");
    assert_eq!(info["state"], "stopped");
    assert_eq!(info["ended"], "stopped by amvm snapshot --stop");
    let o = w.amvm(&["snapshot", "sn", w.xdg.join("snap4").to_str().unwrap()]);
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr.contains("is not running (stopped)"),
        "{}",
        o.stderr
    );
    assert!(
        !w.xdg.join("snap4").exists(),
        "a refused snapshot left its directory"
    );
}

/// Counts in its memory and writes each number to /tmp/count (a restored copy's output goes
/// nowhere: its stream was the old host's).
const FILE_COUNTER: &str = "import os, time\ni = 0\nwhile True:\n    with open('/tmp/count.new', 'w') as f:\n        f.write(str(i))\n    os.rename('/tmp/count.new', '/tmp/count')\n    i += 1\n    time.sleep(0.05)\n";

fn count_in(w: &World, sandbox: &str) -> u64 {
    let o = w.exec(sandbox, &["cat", "/tmp/count"]);
    assert_eq!(o.code, 0, "{sandbox}: {}", o.stderr);
    o.stdout_str().trim().parse().unwrap()
}

/// `n` bytes of xorshift noise from `seed`: file contents no cache could have guessed.
fn noise(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// `sha256sum`'s answer for a host file, as the guest's `sha256sum < FILE` prints it.
fn host_sha256(path: &Path) -> String {
    let o = Command::new("sha256sum")
        .stdin(std::fs::File::open(path).unwrap())
        .output()
        .unwrap();
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

/// One line of `cmd`'s output in `sandbox`.
fn line_of(w: &World, sandbox: &str, cmd: &str) -> String {
    let o = w.exec(sandbox, &["sh", "-c", cmd]);
    assert_eq!(o.code, 0, "{sandbox}: {cmd}: {}", o.stderr);
    o.stdout_str().trim().to_string()
}

#[test]
fn a_restored_snapshot_goes_on_with_its_processes_files_and_workspace_and_each_copy_is_its_own() {
    let w = World::new("snapshots", "restore");
    let ws = w.xdg.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("data"), "opened before the snapshot\n").unwrap();
    // Larger than one FUSE read: a restored sandbox's reads go through its relay's shadow.
    std::fs::write(ws.join("big"), noise(3 << 20, 0x2545_f491_4f6c_dd1d)).unwrap();
    let big_sum = host_sha256(&ws.join("big"));
    w.create(&[
        "--name",
        "orig",
        "--mem",
        "256",
        "--workspace",
        ws.to_str().unwrap(),
    ]);
    assert_eq!(w.exec("orig", &["sh", "-c", "echo kept > /tmp/f"]).code, 0);
    // A process with its count in memory, and one holding a workspace file open.
    let mut counter = w
        .cmd(&["exec", "orig", "--", "python3", "-c", FILE_COUNTER])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let holder_script = "exec 3</workspace/data; echo open > /tmp/held; \
        while [ ! -e /tmp/go ]; do sleep 0.1; done; cat <&3 > /tmp/read-after";
    let mut holder = w
        .cmd(&["exec", "orig", "--", "sh", "-c", holder_script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(180);
    loop {
        let o = w.exec("orig", &["sh", "-c", "cat /tmp/held && cat /tmp/count"]);
        if o.code == 0
            && o.stdout_str()
                .lines()
                .nth(1)
                .and_then(|c| c.parse::<u64>().ok())
                >= Some(5)
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "the counter and holder did not start: {}",
            o.stderr
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = count_in(&w, "orig");

    let dir = w.xdg.join("snap");
    let d = dir.to_str().unwrap();
    let o = w.amvm(&["snapshot", "orig", d, "--stop"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    // The original is gone, and its execs with it.
    let _ = counter.wait();
    let _ = holder.wait();
    assert_eq!(w.inspect("orig")["state"], "stopped");

    // A new sandbox continues it: the same files, the counter counting on from where it was
    // (not from 0), the held file still readable, the workspace served, execs working.
    let o = w.amvm(&["create", "--from", d, "--name", "r1"]);
    assert_eq!(o.code, 0, "create --from: {}", o.stderr);
    let r1 = o.stdout_str().trim().to_string();
    assert_eq!(w.inspect("r1")["id"], r1.as_str());
    assert_eq!(w.inspect("r1")["state"], "running");
    assert_eq!(line_of(&w, "r1", "cat /tmp/f"), "kept");
    let first = count_in(&w, "r1");
    std::thread::sleep(Duration::from_secs(1));
    let second = count_in(&w, "r1");
    assert!(
        first >= before && second > first,
        "the counter did not go on: {before} before the snapshot, then {first}, {second}"
    );
    assert_eq!(
        line_of(
            &w,
            "r1",
            "touch /tmp/go; for i in $(seq 100); do [ -s /tmp/read-after ] && break; sleep 0.1; done; cat /tmp/read-after"
        ),
        "opened before the snapshot"
    );
    assert_eq!(
        line_of(&w, "r1", "cat /workspace/data"),
        "opened before the snapshot"
    );
    // Its clock is the host's, not the snapshot's.
    let guest_now: i64 = line_of(&w, "r1", "date +%s").parse().unwrap();
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest_now - host_now).abs() < 60,
        "guest {guest_now}, host {host_now}"
    );

    // The same snapshot again, while the first copy runs: a sandbox of its own, with its own
    // randomness (the RNG reseeded from the host at restore).
    let o = w.amvm(&["create", "--from", d, "--name", "r2"]);
    assert_eq!(o.code, 0, "create --from again: {}", o.stderr);
    assert_eq!(line_of(&w, "r2", "cat /tmp/f"), "kept");
    let draw = "cat /proc/sys/kernel/random/uuid; head -c 16 /dev/urandom | od -An -tx1";
    let (a, b) = (line_of(&w, "r1", draw), line_of(&w, "r2", draw));
    assert_ne!(a, b, "two copies of one snapshot drew the same randomness");
    assert_eq!(w.exec("r2", &["sh", "-c", "echo own > /tmp/f"]).code, 0);
    assert_eq!(
        line_of(&w, "r1", "cat /tmp/f"),
        "kept",
        "r2's write reached r1"
    );
    assert_eq!(line_of(&w, "r2", "sha256sum < /workspace/big"), big_sum);

    // A snapshot of a restored sandbox, whose RAM is a copy-on-write mapping of the first
    // snapshot's file: what it wrote since its restore goes into the new snapshot with the
    // rest, and it goes on after it.
    let blob = "head -c 8M /dev/urandom > /tmp/blob && sha256sum < /tmp/blob";
    let blob_sum = line_of(&w, "r1", blob);
    let dir2 = w.xdg.join("snap2");
    let o = w.amvm(&["snapshot", "r1", dir2.to_str().unwrap()]);
    assert_eq!(o.code, 0, "a snapshot of a restored sandbox: {}", o.stderr);
    let o = w.amvm(&["create", "--from", dir2.to_str().unwrap(), "--name", "r3"]);
    assert_eq!(o.code, 0, "create --from the second snapshot: {}", o.stderr);
    for s in ["r1", "r3"] {
        assert_eq!(line_of(&w, s, "cat /tmp/f"), "kept", "{s}");
        assert_eq!(line_of(&w, s, "sha256sum < /tmp/blob"), blob_sum, "{s}");
        assert_eq!(line_of(&w, s, "sha256sum < /workspace/big"), big_sum, "{s}");
    }
    let (a, b) = (count_in(&w, "r3"), count_in(&w, "r1"));
    std::thread::sleep(Duration::from_secs(1));
    assert!(count_in(&w, "r3") > a && count_in(&w, "r1") > b);

    // A damaged snapshot is refused with the reason, and nothing is made.
    let ids = || -> Vec<String> {
        let all: serde_json::Value =
            serde_json::from_slice(&w.amvm(&["ls", "--json"]).stdout).unwrap();
        let mut v: Vec<String> = all
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    let ls_before = ids();
    let copy = |name: &str| {
        let to = w.xdg.join(name);
        let st = Command::new("cp")
            .args(["-a", "--sparse=always", d, to.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(st.success());
        to
    };
    let bad = copy("bad-state");
    let mut state = std::fs::read(bad.join("state")).unwrap();
    let last = state.len() - 2;
    state[last] ^= 0x20;
    std::fs::write(bad.join("state"), &state).unwrap();
    let o = w.amvm(&["create", "--from", bad.to_str().unwrap()]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("checksum"), "{}", o.stderr);
    let short = copy("short-memory");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(short.join("memory"))
        .unwrap();
    f.set_len(1 << 20).unwrap();
    let o = w.amvm(&["create", "--from", short.to_str().unwrap()]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("truncated"), "{}", o.stderr);
    let o = w.amvm(&["create", "--from", d, "--cpus", "2"]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("only --name"), "{}", o.stderr);
    let o = w.amvm(&["create", "--from", w.xdg.join("nowhere").to_str().unwrap()]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("nowhere"), "{}", o.stderr);
    assert_eq!(ids(), ls_before, "a refused restore made something");

    for s in ["r1", "r2", "r3"] {
        let o = w.amvm(&["stop", s]);
        assert_eq!(o.code, 0, "stop {s}: {}", o.stderr);
    }
}

#[test]
fn forks_of_a_running_sandbox_are_each_their_own_and_the_original_goes_on() {
    let w = World::new("snapshots", "fork");
    w.create(&["--name", "parent", "--mem", "256"]);
    assert_eq!(
        w.exec("parent", &["sh", "-c", "echo from the parent > /tmp/f"])
            .code,
        0
    );
    let o = w.amvm(&["fork", "-n", "3", "parent"]);
    assert_eq!(o.code, 0, "fork: {}", o.stderr);
    let forks: Vec<String> = o.stdout_str().lines().map(str::to_string).collect();
    assert_eq!(forks.len(), 3, "{}", o.stdout_str());
    let mut draws = std::collections::BTreeSet::new();
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(w.inspect(f)["state"], "running");
        assert_eq!(line_of(&w, f, "cat /tmp/f"), "from the parent");
        assert_eq!(
            w.exec(f, &["sh", "-c", &format!("echo fork {i} > /tmp/f")])
                .code,
            0
        );
        draws.insert(line_of(&w, f, "cat /proc/sys/kernel/random/uuid"));
    }
    draws.insert(line_of(&w, "parent", "cat /proc/sys/kernel/random/uuid"));
    assert_eq!(draws.len(), 4, "forks drew the same UUIDs: {draws:?}");
    // Each kept its own write; the parent its own; no snapshot is left behind.
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(line_of(&w, f, "cat /tmp/f"), format!("fork {i}"));
    }
    assert_eq!(line_of(&w, "parent", "cat /tmp/f"), "from the parent");
    let parent_dir = w.sandbox_dir(w.inspect("parent")["id"].as_str().unwrap());
    let left: Vec<_> = std::fs::read_dir(&parent_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("fork-"))
        .collect();
    assert!(left.is_empty(), "a fork's snapshot was left: {left:?}");
    // A fork of a stopped sandbox is refused and makes nothing.
    assert_eq!(w.amvm(&["stop", "parent"]).code, 0);
    let o = w.amvm(&["fork", "parent"]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("not running"), "{}", o.stderr);
    let all: serde_json::Value = serde_json::from_slice(&w.amvm(&["ls", "--json"]).stdout).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 4);
}

/// A read-only EROFS disk (`-v IMAGE:GUEST`) goes into a snapshot as its image's identity: the
/// restored guest reads on from the same image (files it never read before included, so the
/// disk itself serves them, not the page cache it came back with); an image changed since is
/// refused with 125 before anything runs.
#[test]
fn a_sandbox_s_erofs_disk_comes_back_with_its_restore_and_a_changed_image_is_refused() {
    let w = World::new("snapshots", "disk");
    let tree = w.xdg.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("before"), "read before the snapshot\n").unwrap();
    std::fs::write(tree.join("after"), noise(2 << 20, 0x9e37_79b9_7f4a_7c15)).unwrap();
    let big_sum = host_sha256(&tree.join("after"));
    let image = w.xdg.join("tree.erofs");
    let out = Command::new("mkfs.erofs")
        .arg(&image)
        .arg(&tree)
        .output()
        .expect("mkfs.erofs (erofs-utils; images/setup installs it)");
    assert!(out.status.success(), "mkfs.erofs: {out:?}");
    let volume = format!("{}:/data", image.display());
    w.create(&["--name", "orig", "--mem", "256", "-v", &volume]);
    assert_eq!(
        line_of(&w, "orig", "cat /data/before"),
        "read before the snapshot"
    );
    let dir = w.xdg.join("snap");
    let d = dir.to_str().unwrap();
    let o = w.amvm(&["snapshot", "orig", d, "--stop"]);
    assert_eq!(o.code, 0, "{}", o.stderr);

    let o = w.amvm(&["create", "--from", d, "--name", "r1"]);
    assert_eq!(o.code, 0, "create --from: {}", o.stderr);
    assert_eq!(
        line_of(&w, "r1", "cat /data/before"),
        "read before the snapshot"
    );
    assert_eq!(line_of(&w, "r1", "sha256sum < /data/after"), big_sum);
    assert_eq!(w.amvm(&["rm", "-f", "r1"]).code, 0);

    // The image rebuilt (a new modification time): the snapshot's guest would read blocks of
    // another file system under its cached ones.
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&image)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let o = w.amvm(&["create", "--from", d, "--name", "r2"]);
    assert_eq!(o.code, 125, "{o:?}");
    assert!(
        o.stderr.contains("changed since the snapshot"),
        "{}",
        o.stderr
    );
    let all: serde_json::Value = serde_json::from_slice(&w.amvm(&["ls", "--json"]).stdout).unwrap();
    assert!(
        all.as_array().unwrap().iter().all(|s| s["name"] != "r2"),
        "a refused restore left a sandbox: {all}"
    );
}

#[test]
fn an_overlay_workspace_s_changes_go_into_the_snapshot_and_each_copy_keeps_its_own() {
    let w = World::new("snapshots", "overlay");
    let ws = w.xdg.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("base"), "base\n").unwrap();
    std::fs::write(ws.join("gone"), "to be deleted\n").unwrap();
    let overlay = format!("{}:overlay", ws.display());
    let egress = amvm_tests::egress_server::EgressServer::start(
        "snapshots-overlay",
        amvm_tests::egress_server::Pace::Fast,
    );
    w.create(&[
        "--name",
        "ov",
        "--mem",
        "256",
        "--workspace",
        &overlay,
        "--egress",
        egress.path_str(),
    ]);
    // Changes before the snapshot: a new file, an edit, a delete (a whiteout in the upper
    // layer) and a read-only directory.
    let changes = "echo parent > /workspace/p && echo edited > /workspace/base && \
        rm /workspace/gone && mkdir -p /workspace/ro/d && echo in > /workspace/ro/d/f && \
        chmod 555 /workspace/ro/d";
    let o = w.exec("ov", &["sh", "-c", changes]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let dir = w.xdg.join("snap");
    let d = dir.to_str().unwrap();
    let o = w.amvm(&["snapshot", "ov", d]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    // Paused for the copy of its changes, running again after.
    assert_eq!(w.inspect("ov")["state"], "running");
    assert_eq!(
        w.exec("ov", &["sh", "-c", "echo later > /workspace/after"])
            .code,
        0
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("upper/p")).unwrap(),
        "parent\n"
    );

    // A restore has the changes as they were at the snapshot, not the original's later ones.
    let o = w.amvm(&["create", "--from", d, "--name", "r1"]);
    assert_eq!(o.code, 0, "create --from: {}", o.stderr);
    assert!(!o.stderr.contains("warning"), "{}", o.stderr);
    let seen = "cat /workspace/p /workspace/base /workspace/ro/d/f; \
        test -e /workspace/gone || echo gone; test -e /workspace/after || echo no-after";
    assert_eq!(
        line_of(&w, "r1", seen),
        "parent\nedited\nin\ngone\nno-after"
    );
    assert_eq!(
        w.exec("r1", &["sh", "-c", "echo r1 > /workspace/r1-own"])
            .code,
        0
    );
    // Its egress works: a new stream through the restored vsock device, every byte there.
    let down =
        "echo DOWN 100000 | busybox nc ${AMVM_EGRESS_ADDR%:*} ${AMVM_EGRESS_ADDR#*:} | wc -c";
    assert_eq!(line_of(&w, "r1", down), "100000");
    let diff = |s: &str| {
        let o = w.amvm(&["diff", s]);
        assert_eq!(o.code, 0, "diff {s}: {}", o.stderr);
        o.stdout_str().to_string()
    };
    let r1 = diff("r1");
    for name in ["p", "base", "gone", "r1-own"] {
        assert!(
            r1.contains(&format!("/{name}")) || r1.contains(&format!(" {name}")),
            "r1's diff lacks {name}:\n{r1}"
        );
    }
    assert!(
        !r1.contains("after"),
        "r1's diff has the original's later change:\n{r1}"
    );
    assert!(
        !diff("ov").contains("r1-own"),
        "r1's change reached the original"
    );

    // Forks of an overlay sandbox: each keeps its own changes, not its siblings'.
    let o = w.amvm(&["fork", "-n", "2", "r1"]);
    assert_eq!(o.code, 0, "fork: {}", o.stderr);
    let forks: Vec<String> = o.stdout_str().lines().map(str::to_string).collect();
    assert_eq!(forks.len(), 2, "{}", o.stdout_str());
    for (i, f) in forks.iter().enumerate() {
        let o = w.exec(f, &["sh", "-c", &format!("echo {i} > /workspace/mine-{i}")]);
        assert_eq!(o.code, 0, "{}", o.stderr);
    }
    for (i, f) in forks.iter().enumerate() {
        let d = diff(f);
        assert!(d.contains(&format!("mine-{i}")), "fork {i}:\n{d}");
        assert!(
            d.contains("r1-own"),
            "fork {i} lost its parent's change:\n{d}"
        );
        assert!(
            !d.contains(&format!("mine-{}", 1 - i)),
            "fork {i} has its sibling's:\n{d}"
        );
    }
    assert!(
        !diff("r1").contains("mine-"),
        "a fork's change reached its parent"
    );

    // The original's host-side processes killed outright: the snapshot does not need them.
    let info = w.inspect("ov");
    for pid in [&info["pid"], &info["vmm_pid"]] {
        let pid = pid.as_u64().unwrap() as i32;
        // SAFETY: kill(2) of a process of this test's own sandbox.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    // The workspace changed on the host since the snapshot: the restore says so.
    std::fs::write(ws.join("host-edit"), "new\n").unwrap();
    let o = w.amvm(&["create", "--from", d, "--name", "r2"]);
    assert_eq!(o.code, 0, "create --from: {}", o.stderr);
    assert!(
        o.stderr.contains("changed on the host since the snapshot"),
        "{}",
        o.stderr
    );
    assert_eq!(line_of(&w, "r2", "cat /workspace/p"), "parent");
    assert_ne!(w.inspect("ov")["state"], "running");
    // A snapshot of an overlay sandbox without its upper layer is refused, making nothing.
    remove_upper(&dir);
    let o = w.amvm(&["create", "--from", d]);
    assert_eq!(o.code, 125, "{}", o.stderr);
    assert!(o.stderr.contains("upper layer is missing"), "{}", o.stderr);
    for s in ["r1", "r2", &forks[0], &forks[1]] {
        let o = w.amvm(&["stop", s]);
        assert_eq!(o.code, 0, "stop {s}: {}", o.stderr);
    }
}

/// Take the upper layer out of a snapshot (its read-only directories made writable first).
fn remove_upper(dir: &Path) {
    let st = Command::new("chmod")
        .args(["-R", "u+rwx"])
        .arg(dir.join("upper"))
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::remove_dir_all(dir.join("upper")).unwrap();
}

#[test]
fn a_sandbox_s_own_gateway_starts_with_it_comes_back_with_its_restore_and_ends_with_it() {
    let w = World::new("snapshots", "gateway");
    // A TLS upstream on loopback that wants a key the sandbox never sees.
    let up = w.xdg.join("up");
    std::fs::create_dir_all(&up).unwrap();
    std::fs::write(up.join("key"), "sk-restored-gw-1\n").unwrap();
    // Its /v1/messages streams at once (no holding back).
    std::fs::write(up.join("go"), "").unwrap();
    let upstream = amvm_tests::TlsUpstream::start(&up, &[("UPSTREAM_KEY", "sk-restored-gw-1")]);
    let port = &upstream.port;
    let allow = format!("api=localhost:{port}");
    let cred = format!("api=header:x-api-key:@{}", up.join("key").display());
    let ca = up.join("ca.pem");
    let log = w.xdg.join("audit.log");
    w.create(&[
        "--name",
        "gw",
        "--mem",
        "256",
        "--egress-allow",
        &allow,
        "--egress-credential",
        &cred,
        "--egress-ca",
        ca.to_str().unwrap(),
        "--egress-log",
        log.to_str().unwrap(),
    ]);
    let gateways = || {
        let state = w.xdg.join("amvm");
        amvm_tests::leftovers::processes_with(&format!("{}/", state.display()))
            .into_iter()
            .filter(|p| p.contains(" gateway --listen "))
            .collect::<Vec<_>>()
    };
    assert_eq!(gateways().len(), 1, "{:?}", gateways());
    // The key the upstream wants is added on the host: /v1/messages answers 200, not 401.
    let call = |sb: &str, word: &str| {
        line_of(
            &w,
            sb,
            &format!(
                "curl -sS -d {word} http://$AMVM_EGRESS_ADDR/api/echo; \
                 curl -sS -o /dev/null -w ' %{{http_code}}' http://$AMVM_EGRESS_ADDR/api/v1/messages"
            ),
        )
    };
    assert_eq!(call("gw", "before"), "before 200");
    let snap = w.xdg.join("snap");
    let o = w.amvm(&["snapshot", "--stop", "gw", snap.to_str().unwrap()]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(w.amvm(&["rm", "gw"]).code, 0);
    let until = Instant::now() + Duration::from_secs(30);
    while !gateways().is_empty() {
        assert!(Instant::now() < until, "left: {:?}", gateways());
        std::thread::sleep(Duration::from_millis(100));
    }
    // The restore starts a gateway of its own with the snapshot's rules.
    let o = w.amvm(&["create", "--from", snap.to_str().unwrap(), "--name", "back"]);
    assert_eq!(o.code, 0, "create --from: {}", o.stderr);
    assert_eq!(gateways().len(), 1, "{:?}", gateways());
    assert_eq!(call("back", "after"), "after 200");
    assert_eq!(w.amvm(&["rm", "-f", "back"]).code, 0);
    let until = Instant::now() + Duration::from_secs(30);
    while !gateways().is_empty() {
        assert!(Instant::now() < until, "left: {:?}", gateways());
        std::thread::sleep(Duration::from_millis(100));
    }
    // Audited by each sandbox's name; the key in no line.
    let audit = std::fs::read_to_string(&log).unwrap();
    for name in ["gw", "back"] {
        let mine = audit
            .lines()
            .filter(|l| l.contains(&format!("\"sandbox\":\"{name}\"")))
            .filter(|l| l.contains("\"status\":200"))
            .count();
        assert_eq!(mine, 2, "{name}:\n{audit}");
    }
    assert!(!audit.contains("sk-restored-gw-1"), "{audit}");
}
