//! The agent harness image (images/harness): Claude Code, Codex and Gemini CLI start inside amvm
//! on it, and a one-word prompt to each sends its API request through the egress to a stand-in
//! API on the host (tests/standin/egress.py), which logs it. The image must be built
//! (`images/harness/build`; tests/run does it first, cached): without it these tests fail.

use amvm_tests::{amvm, run_vm};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A prompt's whole run (boot, the CLI's start, its request, its error report), with room for
/// the emulated KVM host: a hang guard, not a speed assertion.
const PROMPT_TIMEOUT: &str = "900";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository")
        .to_owned()
}

/// The image's root filesystem, or a failure saying how to build it.
fn harness_image() -> PathBuf {
    let out = amvm(["image", "path", "harness"], &[]);
    assert_eq!(
        out.code,
        0,
        "the harness image is not built ({}): run images/harness/build (tests/run does)",
        out.stderr.trim()
    );
    PathBuf::from(out.stdout_str().trim())
}

/// The versions the recipe pins (images/harness/package.json).
fn pinned(package: &str) -> String {
    let text = std::fs::read_to_string(repo().join("images/harness/package.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["dependencies"][package]
        .as_str()
        .unwrap_or_else(|| panic!("{package} is not pinned in images/harness/package.json"))
        .to_string()
}

#[test]
fn the_three_harnesses_start_on_the_image() {
    let rootfs = harness_image();
    let out = run_vm(
        &["--system", "harness", "--timeout", PROMPT_TIMEOUT],
        &[
            "sh",
            "-c",
            "for c in claude codex gemini; do printf '%s: ' $c; $c --version || echo \"exit $?\"; done; \
             printf 'node: '; node --version; printf 'os: '; . /usr/lib/os-release; echo $VERSION_CODENAME",
        ],
    );
    let text = out.stdout_str();
    assert_eq!(out.code, 0, "stdout:\n{text}\nstderr:\n{}", out.stderr);
    let line = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name} line in:\n{text}"))
            .to_string()
    };
    assert_eq!(
        line("claude"),
        format!("{} (Claude Code)", pinned("@anthropic-ai/claude-code"))
    );
    assert_eq!(
        line("codex"),
        format!("codex-cli {}", pinned("@openai/codex"))
    );
    assert_eq!(line("gemini"), pinned("@google/gemini-cli"));
    // The image's own userland, not the host's: Debian trixie's Node 20 (the host is bookworm).
    assert_eq!(line("os"), "trixie");
    let meta = std::fs::read_to_string(rootfs.parent().unwrap().join("image.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(Some(line("node").as_str()), meta["node"].as_str());
}

/// tests/standin/egress.py on a fresh socket, logging to a file; killed on drop.
struct Standin {
    child: Child,
    dir: PathBuf,
}

impl Standin {
    fn start(name: &str) -> Standin {
        let dir = std::env::temp_dir().join(format!("amvm-harness-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new("python3")
            .arg(repo().join("tests/standin/egress.py"))
            .arg(dir.join("egress.sock"))
            .arg("--log")
            .arg(dir.join("requests.jsonl"))
            .stdin(Stdio::null())
            .spawn()
            .expect("starting tests/standin/egress.py");
        let until = Instant::now() + Duration::from_secs(60);
        while !dir.join("egress.sock").exists() {
            assert!(Instant::now() < until, "the stand-in egress did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Standin { child, dir }
    }

    fn socket(&self) -> String {
        self.dir.join("egress.sock").to_str().unwrap().to_string()
    }

    /// Every request it logged.
    fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join("requests.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON log line"))
            .collect()
    }
}

impl Drop for Standin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Run `script` on the harness image with the stand-in as the egress; return amvm's outcome
/// and what the stand-in logged.
fn prompt(name: &str, script: &str) -> (amvm_tests::Outcome, Vec<serde_json::Value>) {
    harness_image();
    let standin = Standin::start(name);
    let sock = standin.socket();
    let out = run_vm(
        &[
            "--system",
            "harness",
            "--egress",
            &sock,
            "--timeout",
            PROMPT_TIMEOUT,
        ],
        &["sh", "-c", script],
    );
    (out, standin.requests())
}

/// The requests to `path_prefix` with `method`, each carrying the auth header `auth`.
fn api_calls<'a>(
    log: &'a [serde_json::Value],
    method: &str,
    path_prefix: &str,
) -> Vec<&'a serde_json::Value> {
    log.iter()
        .filter(|r| {
            r["method"] == method
                && r["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(path_prefix))
        })
        .collect()
}

fn show(out: &amvm_tests::Outcome, log: &[serde_json::Value]) -> String {
    let lines: Vec<String> = log.iter().map(|r| r.to_string()).collect();
    format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}\nstand-in log:\n{}",
        out.code,
        out.stdout_str(),
        out.stderr,
        lines.join("\n")
    )
}

/// The stand-in's error text: the reply made it back through the egress into the CLI.
const STANDIN_ERROR: &str = "stand-in egress: no real API here";

#[test]
fn claude_code_prompt_reaches_the_egress() {
    let (out, log) = prompt(
        "claude",
        "export ANTHROPIC_BASE_URL=http://$AMVM_EGRESS_ADDR ANTHROPIC_API_KEY=sk-ant-standin \
         CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1; claude -p hi 2>&1; echo \"claude exit $?\"",
    );
    let text = out.stdout_str();
    let why = show(&out, &log);
    assert_eq!(out.code, 0, "{why}");
    assert!(text.contains(STANDIN_ERROR), "{why}");
    assert!(text.contains("claude exit 1"), "{why}");
    // One request (the stand-in's 401 says x-should-retry: false), the Messages API, keyed.
    let calls = api_calls(&log, "POST", "/v1/messages");
    assert_eq!(calls.len(), 1, "{why}");
    assert_eq!(log.len(), 1, "nothing but the API call: {why}");
    let call = calls[0];
    assert_eq!(call["auth"], serde_json::json!(["x-api-key"]), "{why}");
    let ua = call["headers"]["user-agent"].as_str().unwrap_or_default();
    let version = pinned("@anthropic-ai/claude-code");
    assert!(ua.starts_with(&format!("claude-cli/{version}")), "{why}");
    assert!(call["headers"]["anthropic-version"].is_string(), "{why}");
    assert!(call["body_bytes"].as_u64().unwrap_or(0) > 1000, "{why}");
}

#[test]
fn codex_prompt_reaches_the_egress() {
    // codex 0.171 reads no base-URL variable: a provider of its own, on the command line.
    let (out, log) = prompt(
        "codex",
        "export OPENAI_API_KEY=sk-standin; codex exec --skip-git-repo-check --disable plugins \
         -c model_provider=standin -c model_providers.standin.name=standin \
         -c model_providers.standin.base_url=http://$AMVM_EGRESS_ADDR/v1 \
         -c model_providers.standin.env_key=OPENAI_API_KEY \
         -c model_providers.standin.wire_api=responses \
         -c model_providers.standin.stream_max_retries=0 hi </dev/null 2>&1; echo \"codex exit $?\"",
    );
    let text = out.stdout_str();
    let why = show(&out, &log);
    assert_eq!(out.code, 0, "{why}");
    assert!(text.contains(STANDIN_ERROR), "{why}");
    assert!(text.contains("codex exit 1"), "{why}");
    let calls = api_calls(&log, "POST", "/v1/responses");
    assert!(!calls.is_empty(), "{why}");
    for call in &calls {
        assert_eq!(call["auth"], serde_json::json!(["authorization"]), "{why}");
        let ua = call["headers"]["user-agent"].as_str().unwrap_or_default();
        let version = pinned("@openai/codex");
        assert!(ua.starts_with(&format!("codex_exec/{version}")), "{why}");
        assert!(call["body_bytes"].as_u64().unwrap_or(0) > 1000, "{why}");
    }
}

#[test]
fn gemini_cli_prompt_reaches_the_egress() {
    // The API-key auth type must be chosen in its settings: with only the base-URL variable,
    // 0.61.0 picks a "gateway" type its own check then rejects (exit 41, nothing sent).
    let (out, log) = prompt(
        "gemini",
        "mkdir -p $HOME/.gemini && printf '%s' \
         '{\"security\":{\"auth\":{\"selectedType\":\"gemini-api-key\"}},\
         \"privacy\":{\"usageStatisticsEnabled\":false},\
         \"general\":{\"enableAutoUpdate\":false,\"enableAutoUpdateNotification\":false}}' \
         >$HOME/.gemini/settings.json; \
         export GEMINI_API_KEY=standin GOOGLE_GEMINI_BASE_URL=http://$AMVM_EGRESS_ADDR \
         GEMINI_CLI_TRUST_WORKSPACE=true; gemini -p hi </dev/null 2>&1; echo \"gemini exit $?\"",
    );
    let text = out.stdout_str();
    let why = show(&out, &log);
    assert_eq!(out.code, 0, "{why}");
    assert!(text.contains(STANDIN_ERROR), "{why}");
    assert!(text.contains("gemini exit 1"), "{why}");
    let calls = api_calls(&log, "POST", "/v1beta/models/");
    assert!(!calls.is_empty(), "{why}");
    assert_eq!(calls.len(), log.len(), "nothing but API calls: {why}");
    let version = pinned("@google/gemini-cli");
    for call in &calls {
        let path = call["path"].as_str().unwrap_or_default();
        assert!(
            path.contains(":generateContent") || path.contains(":streamGenerateContent"),
            "{why}"
        );
        assert_eq!(call["auth"], serde_json::json!(["x-goog-api-key"]), "{why}");
        let ua = call["headers"]["user-agent"].as_str().unwrap_or_default();
        assert!(ua.contains("GeminiCLI") && ua.contains(&version), "{why}");
    }
}

/// The three keys, each only in a host file: the guest gets placeholders.
const KEYS: [(&str, &str); 3] = [
    ("anthropic", "sk-ant-host-only-7f3e"),
    ("openai", "sk-oai-host-only-91c2"),
    ("gemini", "gem-host-only-5d0a"),
];

#[test]
fn the_three_clis_answer_through_the_gateway_with_their_keys_only_on_the_host() {
    harness_image();
    let dir = std::env::temp_dir().join(format!("amvm-harness-gw-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A stand-in of the three model APIs over real TLS, its certificate from a CA made here.
    for (name, key) in KEYS {
        std::fs::write(dir.join(format!("{name}.key")), format!("{key}\n")).unwrap();
    }
    let upstream = amvm_tests::TlsUpstream::start(
        &dir,
        &[
            ("UPSTREAM_KEY", KEYS[0].1),
            ("UPSTREAM_OPENAI_KEY", KEYS[1].1),
            ("UPSTREAM_GEMINI_KEY", KEYS[2].1),
            ("UPSTREAM_MODEL", "1"),
        ],
    );
    let port = &upstream.port;
    // The run's own gateway (--egress-allow): one rule per API, each with its credential.
    let path = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let mut opts: Vec<String> = Vec::new();
    for (name, _) in KEYS {
        opts.extend(["--egress-allow".into(), format!("{name}=localhost:{port}")]);
    }
    opts.extend([
        "--egress-credential".into(),
        format!("anthropic=header:x-api-key:@{}", path("anthropic.key")),
        "--egress-credential".into(),
        format!("openai=bearer:@{}", path("openai.key")),
        "--egress-credential".into(),
        format!("gemini=header:x-goog-api-key:@{}", path("gemini.key")),
        "--egress-ca".into(),
        path("ca.pem"),
        "--egress-log".into(),
        path("audit.log"),
        "--system".into(),
        "harness".into(),
        "--timeout".into(),
        PROMPT_TIMEOUT.into(),
    ]);
    let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
    let out = run_vm(
        &opts,
        &[
            "sh",
            "-c",
            "export ANTHROPIC_BASE_URL=http://$AMVM_EGRESS_ADDR/anthropic \
             ANTHROPIC_API_KEY=sk-ant-placeholder CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1; \
             claude -p hi 2>&1; echo \"claude exit $?\"; \
             OPENAI_API_KEY=sk-placeholder codex exec --skip-git-repo-check --disable plugins \
             -c model_provider=gw -c model_providers.gw.name=gw \
             -c model_providers.gw.base_url=http://$AMVM_EGRESS_ADDR/openai/v1 \
             -c model_providers.gw.env_key=OPENAI_API_KEY -c model_providers.gw.wire_api=responses \
             -c model_providers.gw.stream_max_retries=0 hi </dev/null 2>&1; \
             echo \"codex exit $?\"; \
             mkdir -p $HOME/.gemini && printf '%s' \
             '{\"security\":{\"auth\":{\"selectedType\":\"gemini-api-key\"}},\
             \"privacy\":{\"usageStatisticsEnabled\":false},\
             \"general\":{\"enableAutoUpdate\":false,\"enableAutoUpdateNotification\":false}}' \
             >$HOME/.gemini/settings.json; \
             mkdir -p $HOME/project && cd $HOME/project; \
             GEMINI_API_KEY=placeholder GOOGLE_GEMINI_BASE_URL=http://$AMVM_EGRESS_ADDR/gemini \
             GEMINI_CLI_TRUST_WORKSPACE=true gemini -m gemini-2.5-flash -p hi </dev/null 2>&1; \
             echo \"gemini exit $?\"; \
             echo \"keys in the guest: $(env | grep -c host-only || true)\"",
        ],
    );
    let records = std::fs::read_to_string(dir.join("records")).unwrap_or_default();
    let audit = std::fs::read_to_string(dir.join("audit.log")).unwrap_or_default();
    let why = format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}\nupstream saw:\n{records}\naudit:\n{audit}",
        out.code,
        out.stdout_str(),
        out.stderr
    );
    let text = out.stdout_str();
    assert_eq!(out.code, 0, "{why}");
    for cli in ["claude", "codex", "gemini"] {
        assert!(text.contains(&format!("{cli} exit 0")), "{why}");
    }
    assert!(
        text.matches("hello from the stand-in model").count() >= 3,
        "{why}"
    );
    assert!(text.contains("keys in the guest: 0"), "{why}");
    // Each API got its own key from the host (not the guest's placeholder), and no other.
    let records: Vec<serde_json::Value> = records
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (api, prefix, header, value) in [
        (
            "anthropic",
            "/v1/messages",
            "x-api-key",
            KEYS[0].1.to_string(),
        ),
        (
            "openai",
            "/v1/responses",
            "authorization",
            format!("Bearer {}", KEYS[1].1),
        ),
        (
            "gemini",
            "/v1beta/models/",
            "x-goog-api-key",
            KEYS[2].1.to_string(),
        ),
    ] {
        let calls: Vec<&serde_json::Value> = records
            .iter()
            .filter(|r| r["path"].as_str().is_some_and(|p| p.starts_with(prefix)))
            .collect();
        assert!(!calls.is_empty(), "no {api} call: {why}");
        for c in calls {
            let headers = c["headers"].as_array().unwrap();
            let got: Vec<&serde_json::Value> = headers
                .iter()
                .filter(|h| h[0] == header)
                .map(|h| &h[1])
                .collect();
            assert_eq!(got, [&serde_json::json!(value)], "{api}: {why}");
            let all = c["headers"].to_string();
            let others = KEYS.iter().filter(|(_, k)| all.contains(k)).count();
            assert_eq!(others, 1, "{api} saw another API's key: {why}");
        }
    }
    // Audited, by sandbox, without a key.
    for path in [
        "\"path\":\"/v1/messages",
        "\"path\":\"/v1/responses\"",
        "\"path\":\"/v1beta/models/gemini-2.5-flash:streamGenerateContent",
    ] {
        assert!(
            audit
                .lines()
                .any(|l| l.contains(path) && l.contains("\"status\":200")),
            "{path}: {why}"
        );
    }
    assert!(!audit.contains("\"sandbox\":null"), "{why}");
    for (_, key) in KEYS {
        assert!(!audit.contains(key) && !text.contains(key), "{why}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
