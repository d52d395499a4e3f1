//! Pod benchmark through containerd's CRI (see tests/bench/cri): the same containerd, the same
//! image and pod, runtime handler `runc` (Debian's runc) against `amvm`. Prints one table of
//! medians.
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
    for handler in ["runc", "amvm"] {
        let (mut start, mut exec, mut stop) = (vec![], vec![], vec![]);
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
            let t1 = Instant::now();
            let (code, _, _) = cri.exec_sync(&c, &["true"], 300).expect("ExecSync");
            assert_eq!(code, 0);
            exec.push(t1.elapsed().as_secs_f64());
            let t2 = Instant::now();
            cri.stop_pod(&pod).expect("StopPodSandbox");
            cri.remove_pod(&pod).expect("RemovePodSandbox");
            stop.push(t2.elapsed().as_secs_f64());
        }
        rows.push((handler, vec![median(start), median(exec), median(stop)]));
    }
    let what = [
        "pod start: RunPodSandbox to the first container output",
        "ExecSync `true` into the running container",
        "StopPodSandbox + RemovePodSandbox",
    ];
    println!("\nCRI pods through containerd, median of {runs} (seconds)\n");
    println!(
        "| {:<56} | {:>8} | {:>8} | {:>10} |",
        "", "runc", "amvm", "amvm/runc"
    );
    println!("|{:-<58}|{:->10}|{:->10}|{:->12}|", "", "", "", "");
    for (i, w) in what.iter().enumerate() {
        let (r, a) = (rows[0].1[i], rows[1].1[i]);
        println!("| {w:<56} | {r:>8.3} | {a:>8.3} | {:>10.2} |", a / r);
    }
    let (r, a) = (rows[0].1[0], rows[1].1[0]);
    println!(
        "SUMMARY|cri: pod start, amvm vs runc|{a:.2} s|{r:.2} s (runc)|{:.1}|",
        a / r
    );
}
