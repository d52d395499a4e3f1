//! Pod benchmark through containerd's CRI (see tests/bench/cri): the same containerd, the same
//! image and pod, runtime handler `runc` (Debian's runc) against `amvm` (amvm's pod shim: one VM
//! per pod) and `amvm-runc` (the runc shim with amvm-runc: one VM per container). Prints one
//! table of medians.
//!
//!   cri-bench --amvm PATH [--runs N]

use amvm_tests::cri::{log_lines, pod_config, Containerd};
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The process whose command line holds all of `needles`.
fn process_with(needles: &[&str]) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        needles.iter().all(|n| cmd.contains(n)).then_some(pid)
    })
}

/// The fields of /proc/PID/stat after the command's closing parenthesis (state, ppid, ...: the
/// third field of stat(5) is the first here), or nothing for a process gone.
fn stat_fields(stat: &std::path::Path) -> Vec<u64> {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    let Some((_, rest)) = text.rsplit_once(')') else {
        return Vec::new();
    };
    // The state is a letter: 0 holds its place.
    rest.split_whitespace()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .collect()
}

/// `pid` and every process below it.
fn tree(pid: u32) -> Vec<u32> {
    let mut parent = std::collections::HashMap::<u32, Vec<u32>>::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(&ppid) = stat_fields(&e.path().join("stat")).get(1) {
            parent.entry(ppid as u32).or_default().push(p);
        }
    }
    let mut all = vec![pid];
    let mut i = 0;
    while i < all.len() {
        all.extend(parent.get(&all[i]).into_iter().flatten());
        i += 1;
    }
    all
}

/// The proportional set size of `pids` together, in MiB (/proc/PID/smaps_rollup).
fn pss_mib(pids: &[u32]) -> f64 {
    let kib: u64 = pids
        .iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).ok())
        .filter_map(|t| {
            t.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum();
    kib as f64 / 1024.0
}

/// The CPU time `pids` have used so far, user and system (guest time included), in seconds.
fn cpu_secs(pids: &[u32]) -> f64 {
    // SAFETY: sysconf reads a constant of the system; no memory is touched.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks: u64 = pids
        .iter()
        .map(|p| stat_fields(std::path::Path::new(&format!("/proc/{p}/stat"))))
        // stat(5): utime is field 14, stime 15 (here 11 and 12).
        .filter_map(|f| Some(f.get(11)? + f.get(12)?))
        .sum();
    ticks as f64 / hz
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let amvm = opt("--amvm").expect("--amvm PATH");
    let runs: usize = opt("--runs").map_or(3, |r| r.parse().expect("--runs N"));
    let ctd = Containerd::start("bench", std::path::Path::new(&amvm));
    ctd.import_busybox();
    let mut cri = ctd.client();
    let mut rows: Vec<(&str, Vec<f64>)> = Vec::new();
    for handler in ["runc", "amvm", "amvm-runc"] {
        let (mut start, mut exec, mut stop, mut mem, mut idle) =
            (vec![], vec![], vec![], vec![], vec![]);
        for i in 0..runs {
            let name = format!("{handler}-{i}");
            let logs = ctd.base.join("logs").join(&name);
            let config = pod_config(&name, &logs, &[]);
            let t0 = Instant::now();
            let pod = cri.run_pod(&config, handler).expect("RunPodSandbox");
            let c = cri
                .create(
                    &pod,
                    &config,
                    "c",
                    &["sh", "-c", "echo ready; exec sleep 600"],
                )
                .expect("CreateContainer");
            cri.start(&c).expect("StartContainer");
            let until = Instant::now() + Duration::from_secs(600);
            while !log_lines(&logs.join("c.log"))
                .iter()
                .any(|(_, l)| l == "ready")
            {
                assert!(
                    Instant::now() < until,
                    "no output from {name}: {}",
                    ctd.log()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            start.push(t0.elapsed().as_secs_f64());
            // The pod's shim and everything below it (the shim is their subreaper): for amvm
            // the VMs' supervisors, VMMs and virtiofsd, for runc the pod's processes.
            let shim = process_with(&["containerd-shim", &pod]).expect("the pod's shim");
            let pids = tree(shim);
            mem.push(pss_mib(&pids));
            // What the running pod costs while its container sleeps: the CPU time of the same
            // tree over a while, as thousandths of a CPU.
            let (c0, w0) = (cpu_secs(&pids), Instant::now());
            std::thread::sleep(Duration::from_secs(10));
            idle.push((cpu_secs(&pids) - c0) / w0.elapsed().as_secs_f64() * 1000.0);
            let t1 = Instant::now();
            let (code, _, _) = cri.exec_sync(&c, &["true"], 300).expect("ExecSync");
            assert_eq!(code, 0);
            exec.push(t1.elapsed().as_secs_f64());
            let t2 = Instant::now();
            cri.stop_pod(&pod).expect("StopPodSandbox");
            cri.remove_pod(&pod).expect("RemovePodSandbox");
            stop.push(t2.elapsed().as_secs_f64());
        }
        rows.push((
            handler,
            vec![
                median(start),
                median(exec),
                median(stop),
                median(mem),
                median(idle),
            ],
        ));
    }
    let what = [
        "pod start: RunPodSandbox to the first container output",
        "ExecSync `true` into the running container",
        "StopPodSandbox + RemovePodSandbox",
        "host memory of a running pod: PSS of its shim's tree, MiB",
        "idle CPU of a running pod: its shim's tree, millicores",
    ];
    println!("\nCRI pods through containerd, median of {runs} (seconds unless said)\n");
    println!(
        "| {:<58} | {:>8} | {:>8} | {:>9} | {:>9} | {:>14} |",
        "", "runc", "amvm", "amvm-runc", "amvm/runc", "amvm-runc/runc"
    );
    println!(
        "|{:-<60}|{:->10}|{:->10}|{:->11}|{:->11}|{:->16}|",
        "", "", "", "", "", ""
    );
    for (i, w) in what.iter().enumerate() {
        let (r, a, o) = (rows[0].1[i], rows[1].1[i], rows[2].1[i]);
        // A ratio to nothing (runc's idle pod can use no CPU at all) is not a number to print.
        let ratio = |x: f64| {
            if r > 0.0 {
                format!("{:.2}", x / r)
            } else {
                "-".to_string()
            }
        };
        println!(
            "| {w:<58} | {r:>8.3} | {a:>8.3} | {o:>9.3} | {:>9} | {:>14} |",
            ratio(a),
            ratio(o)
        );
    }
    let (r, a) = (rows[0].1[0], rows[1].1[0]);
    println!(
        "SUMMARY|cri: pod start, amvm vs runc|{a:.2} s|{r:.2} s (runc)|{:.1}|",
        a / r
    );
}
