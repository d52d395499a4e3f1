//! The docs cannot drift from the code: every command README.md and docs/ show runs as shown
//! (`tests/docs/commands.py`), the CI workflow parses and runs README.md's test command, and
//! the troubleshooting table quotes messages amvm really prints.

use amvm_tests::{amvm_bin, require_kvm};
use std::path::{Path, PathBuf};
use std::process::Command;
use yaml_rust2::{Yaml, YamlLoader};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository root")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The `sh` blocks of README.md and docs/*.md, run where /dev/kvm is real (this test runs
/// inside tests/kvm-host/run). `sh host` blocks are run by tests/run on the machine itself.
#[test]
fn every_doc_command_runs_as_documented() {
    require_kvm();
    let out = Command::new("python3")
        .arg(root().join("tests/docs/commands.py"))
        .args(["--where", "kvm"])
        .env("AMVM_BIN", amvm_bin())
        .output()
        .expect("python3 tests/docs/commands.py");
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    assert!(
        out.status.success(),
        "doc commands failed:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains(" passed, 0 failed"),
        "no summary line: {report}"
    );
}

/// README.md's test command: the one `sh` block that is exactly `tests/run` (it is marked
/// no-run, being this suite), and `.ci/run` executes exactly it.
#[test]
fn ci_runs_the_readme_test_command() {
    let readme = read("README.md");
    assert!(
        readme.contains("```sh no-run: this is the test suite itself\ntests/run\n```"),
        "README.md no longer shows `tests/run` as the test command"
    );
    let ci = read(".ci/run");
    assert!(
        ci.lines().any(|l| l.trim() == "exec tests/run"),
        ".ci/run does not run README.md's test command:\n{ci}"
    );
}

fn key<'a>(y: &'a Yaml, k: &str) -> &'a Yaml {
    &y[k]
}

/// `.github/workflows/amvm.yml` is a workflow GitHub would run as written: it parses, has
/// triggers, a job on a hosted Linux runner whose steps each either `uses` a pinned action or
/// `run`s a script, a step that makes /dev/kvm usable (the udev rule of docs/hosts.md), and a
/// step that runs README.md's test command through `.ci/run`, as CI here does.
#[test]
fn the_workflow_parses_and_runs_the_readme_test_command() {
    let text = read(".github/workflows/amvm.yml");
    let docs = YamlLoader::load_from_str(&text).expect("amvm.yml is not valid YAML");
    assert_eq!(docs.len(), 1, "one YAML document");
    let wf = &docs[0];
    assert!(key(wf, "name").as_str().is_some(), "workflow name");
    let on = key(wf, "on");
    assert!(
        !on.is_badvalue() && !on.is_null(),
        "no `on:` triggers (note: `on` must stay a string key)"
    );
    assert!(!key(on, "push").is_badvalue() || !key(on, "pull_request").is_badvalue());
    let jobs = key(wf, "jobs").as_hash().expect("jobs: a mapping");
    assert!(!jobs.is_empty(), "at least one job");
    let mut runs_suite = false;
    let mut sets_up_kvm = false;
    for (name, job) in jobs {
        let name = name.as_str().expect("job names are strings");
        let runner = key(job, "runs-on").as_str().unwrap_or_default();
        assert!(
            runner.starts_with("ubuntu-"),
            "job {name}: runs-on {runner:?} is not a hosted Linux runner"
        );
        let timeout = key(job, "timeout-minutes").as_i64().unwrap_or(360);
        assert!(timeout <= 90, "job {name}: timeout-minutes {timeout} > 90");
        let steps = key(job, "steps").as_vec().expect("steps: a list");
        assert!(!steps.is_empty(), "job {name} has no steps");
        for (i, step) in steps.iter().enumerate() {
            let uses = key(step, "uses").as_str();
            let run = key(step, "run").as_str();
            match (uses, run) {
                (Some(u), None) => assert!(
                    u.split_once('@')
                        .is_some_and(|(a, v)| a.contains('/') && !v.is_empty()),
                    "job {name} step {i}: `uses: {u}` is not owner/action@version"
                ),
                (None, Some(script)) => {
                    if script.contains("udev/rules.d") && script.contains("KERNEL==\"kvm\"") {
                        sets_up_kvm = true;
                        // As on a Debian host, and as the suite checks: the kvm group may open
                        // it (tests/hardening.rs), others may not (tests/doctor.rs).
                        assert!(
                            script.contains("GROUP=\"kvm\"") && script.contains("MODE=\"0660\""),
                            "job {name} step {i}: /dev/kvm must be the kvm group's, mode 0660"
                        );
                    }
                    // Started as CI starts it here: .ci/run (which runs README.md's test
                    // command), with CI=true.
                    if script.lines().any(|l| l.trim().starts_with("bash .ci/run")) {
                        runs_suite = true;
                        assert!(
                            script.contains("--device /dev/kvm"),
                            "the suite's step must pass /dev/kvm into its container"
                        );
                        assert!(
                            script.contains("-e CI=true"),
                            "the suite's step must set CI=true, as CI here does"
                        );
                    }
                }
                _ => panic!("job {name} step {i}: exactly one of `uses` and `run`"),
            }
        }
    }
    assert!(sets_up_kvm, "no step installs the /dev/kvm udev rule");
    assert!(
        runs_suite,
        "no step runs `bash .ci/run` (README.md's test command, as CI runs it)"
    );
}

/// docs/hosts.md's troubleshooting table quotes, in its first column, the messages amvm prints:
/// each one must appear verbatim in the source of amvm's crates.
#[test]
fn troubleshooting_messages_are_what_amvm_prints() {
    let hosts = read("docs/hosts.md");
    let table = hosts
        .split("## Troubleshooting")
        .nth(1)
        .expect("docs/hosts.md has a Troubleshooting section");
    let mut sources = String::new();
    for dir in ["vmm/src", "devices/src", "egress/src", "guest-init/src"] {
        collect_rs(&root().join(dir), &mut sources);
    }
    let mut checked = 0;
    for row in table.lines().filter(|l| l.starts_with("| `")) {
        let cell = row.split('|').nth(1).unwrap().trim();
        let msg = cell
            .strip_prefix('`')
            .and_then(|c| c.strip_suffix('`'))
            .unwrap_or_else(|| panic!("first cell is not one `message`: {row}"));
        assert!(
            sources.contains(msg),
            "docs/hosts.md quotes {msg:?}, which amvm's source does not contain"
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} messages in the table");
}

fn collect_rs(dir: &Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// docs/engines.md's configuration snippets parse: the daemon.json entry as JSON (with the runtime
/// path images/setup installs), the RuntimeClass as YAML with its handler.
#[test]
fn engines_config_snippets_parse() {
    let text = read("docs/engines.md");
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut cur: Option<(String, String)> = None;
    for line in text.lines() {
        match (&mut cur, line.strip_prefix("```")) {
            (None, Some(info)) => cur = Some((info.trim().to_string(), String::new())),
            (Some(_), Some("")) => blocks.push(cur.take().unwrap()),
            (Some((_, body)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    let json: Vec<&String> = blocks
        .iter()
        .filter(|b| b.0 == "json")
        .map(|b| &b.1)
        .collect();
    assert_eq!(json.len(), 1, "one daemon.json block");
    let v: serde_json::Value = serde_json::from_str(json[0]).expect("daemon.json parses");
    assert_eq!(v["runtimes"]["amvm"]["path"], "/usr/local/bin/amvm-runc");
    let yaml: Vec<&String> = blocks
        .iter()
        .filter(|b| b.0 == "yaml")
        .map(|b| &b.1)
        .collect();
    assert_eq!(yaml.len(), 1, "one RuntimeClass block");
    let docs = YamlLoader::load_from_str(yaml[0]).expect("the RuntimeClass parses");
    assert_eq!(key(&docs[0], "kind").as_str(), Some("RuntimeClass"));
    assert_eq!(key(&docs[0], "handler").as_str(), Some("amvm"));
    let setup = read("images/setup");
    assert!(
        setup.contains("ln -sfn amvm /usr/local/bin/amvm-runc"),
        "images/setup installs the path docs/engines.md names"
    );
}
