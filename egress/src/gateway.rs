//! `amvm gateway`: an egress a sandbox's `--egress SOCKET` can point at. Two ways through, on
//! the one unix socket, each checked against the allowlist:
//!
//! * plain HTTP/1.1 to a named upstream — the request's absolute-form URI, a first path
//!   segment naming an `--allow NAME=HOST` rule (`http://$AMVM_EGRESS_ADDR/anthropic/v1/...`),
//!   or its Host header — forwarded over TLS (rustls, the upstream's certificate verified
//!   against the webpki roots and `--ca`), with the rule's credential header added from a file
//!   the guest never sees, both bodies streamed as they come (server-sent events and chunked
//!   bodies are not buffered);
//! * `CONNECT host:port` to an allowed host and port, tunnelled end to end (the TLS is the
//!   guest's own; no credential is added).
//!
//! Anything else gets 403 naming why, and the stream is closed. Every request and tunnel is one
//! JSON line in the audit log once it ends (method, host, path, status, bytes each way, time;
//! never a credential, which is also scrubbed from every error text). HTTP is hyper's, TLS is
//! rustls' (ring); nothing here parses HTTP or does cryptography by hand.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("--allow {0}: {1}")]
    Allow(String, String),
    #[error("--credential {0}: {1}")]
    Credential(String, String),
    #[error("--ca {0}: {1}")]
    Ca(PathBuf, String),
    #[error("--log {0}: {1}")]
    Log(PathBuf, io::Error),
    #[error("{0}: {1}")]
    Listen(PathBuf, io::Error),
    #[error("{0}: another gateway (or something else) is listening there")]
    InUse(PathBuf),
    #[error("the gateway's runtime: {0}")]
    Runtime(io::Error),
    #[error("--config {0}: {1}")]
    Config(PathBuf, String),
}

/// One `--allow [NAME=]HOST[:PORT]` rule (port 443 unless given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    pub name: Option<String>,
    pub host: String,
    pub port: u16,
}

impl Allow {
    pub fn parse(arg: &str) -> Result<Allow, GatewayError> {
        let bad = |why: &str| GatewayError::Allow(arg.to_string(), why.to_string());
        let (name, rest) = match arg.split_once('=') {
            Some((n, r)) => (Some(n), r),
            None => (None, arg),
        };
        if let Some(n) = name {
            if n.is_empty()
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(bad("a rule's name is letters, digits, - and _"));
            }
        }
        let host_name = "say a host name such as api.anthropic.com (no scheme, no path)";
        if rest.contains('/') {
            return Err(bad(host_name));
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("the port is 1 to 65535"))?,
            ),
            None => (rest, 443),
        };
        if port == 0 {
            return Err(bad("the port is 1 to 65535"));
        }
        let host = host.to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
            return Err(bad(host_name));
        }
        Ok(Allow {
            name: name.map(str::to_string),
            host,
            port,
        })
    }

    fn shown(&self) -> String {
        match &self.name {
            Some(n) => format!("{n}={}:{}", self.host, self.port),
            None => format!("{}:{}", self.host, self.port),
        }
    }
}

/// A `--credential RULE=header:NAME:@FILE` or `RULE=bearer:@FILE`: the header the gateway adds
/// to every request it forwards by a rule RULE names (the rule's NAME, or its HOST: every rule of
/// that host), its value read from FILE (one line) when the gateway starts. `bearer:` is
/// `Authorization: Bearer <line>` (OpenAI's and most APIs' form).
struct Credential {
    target: String,
    header: HeaderName,
    value: HeaderValue,
}

impl Credential {
    /// Whether this credential goes with requests by `rule`.
    fn applies_to(&self, rule: &Allow) -> bool {
        self.target == rule.host || rule.name.as_deref() == Some(self.target.as_str())
    }
}

fn credential(arg: &str) -> Result<Credential, GatewayError> {
    let bad = |why: String| GatewayError::Credential(arg.to_string(), why);
    let form =
        "the form is RULE=header:NAME:@FILE or RULE=bearer:@FILE (RULE: a rule's NAME or HOST)";
    let (target, spec) = arg.split_once('=').ok_or_else(|| bad(form.into()))?;
    if target.is_empty() {
        return Err(bad(form.into()));
    }
    let (header, prefix, file) = if let Some(file) = spec.strip_prefix("bearer:@") {
        (hyper::header::AUTHORIZATION, "Bearer ", file)
    } else {
        let spec = spec
            .strip_prefix("header:")
            .ok_or_else(|| bad(form.into()))?;
        let (name, file) = spec.rsplit_once(":@").ok_or_else(|| bad(form.into()))?;
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| bad(format!("{name:?} is not a header name")))?;
        (header, "", file)
    };
    // The file's first line; its content is never shown, not even in this error.
    let text = std::fs::read_to_string(file).map_err(|e| bad(format!("{file}: {e}")))?;
    let line = text.lines().next().unwrap_or("").trim();
    if line.is_empty() {
        return Err(bad(format!("{file} is empty")));
    }
    let mut value = HeaderValue::from_str(&format!("{prefix}{line}"))
        .map_err(|_| bad(format!("{file} holds bytes a header value cannot")))?;
    value.set_sensitive(true);
    Ok(Credential {
        target: target.to_ascii_lowercase(),
        header,
        value,
    })
}

/// What `amvm gateway` was given.
#[derive(Debug, Clone)]
pub struct Options {
    pub listen: PathBuf,
    pub allow: Vec<String>,
    pub credentials: Vec<String>,
    /// PEM certificates trusted besides the webpki roots (a private CA).
    pub ca: Option<PathBuf>,
    /// The audit log (JSON lines); stdout without it.
    pub log: Option<PathBuf>,
    /// Streams (requests and tunnels) open at once; more get 503.
    pub max_streams: usize,
    /// A request body larger than this gets 413.
    pub max_request_bytes: u64,
    /// A tunnel or an upstream that moves no byte for this long is closed.
    pub idle_timeout: Duration,
}

/// An upstream connection's sending half, kept for the next request to the same upstream.
type Sender = hyper::client::conn::http1::SendRequest<GwBody>;

/// A process id to the name of the sandbox it runs, if it runs one.
pub type Namer = dyn Fn(i32) -> Option<String> + Send + Sync;

/// An upstream: host and port.
type Upstream = (String, u16);

/// Idle upstream connections are kept this long, this many per upstream.
const POOL_IDLE: Duration = Duration::from_secs(30);
const POOL_PER_UPSTREAM: usize = 16;

/// `--config FILE`: the same settings as a TOML file. Every key is optional; the command
/// line's `--allow` and `--credential` add to the file's, its other flags win over the file.
///
/// ```toml
/// listen = "/run/amvm/gateway.sock"
/// allow = ["anthropic=api.anthropic.com", "registry.npmjs.org"]
/// ca = "/etc/amvm/private-ca.pem"
/// log = "/var/log/amvm/gateway.jsonl"
/// max_streams = 64
/// max_request_bytes = 33554432
/// idle_timeout = 300
///
/// [[credential]]
/// host = "api.anthropic.com"
/// header = "x-api-key"
/// file = "/etc/amvm/anthropic.key"
/// ```
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub listen: Option<PathBuf>,
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub credential: Vec<CredentialEntry>,
    pub ca: Option<PathBuf>,
    pub log: Option<PathBuf>,
    pub max_streams: Option<usize>,
    pub max_request_bytes: Option<u64>,
    pub idle_timeout: Option<u64>,
}

/// One `[[credential]]` of a config file: `rule` (or `host`) and `file`, with either
/// `header = "NAME"` or `bearer = true` (`--credential RULE=header:NAME:@FILE` /
/// `RULE=bearer:@FILE`).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialEntry {
    #[serde(alias = "host")]
    pub rule: String,
    pub header: Option<String>,
    #[serde(default)]
    pub bearer: bool,
    pub file: PathBuf,
}

impl ConfigFile {
    /// Read and check `path` (a relative path in it is relative to the file's directory).
    pub fn read(path: &Path) -> Result<ConfigFile, GatewayError> {
        let bad = |why: String| GatewayError::Config(path.to_owned(), why);
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        // One line: where, and what (toml's own text draws the line with a caret).
        let mut c: ConfigFile = toml::from_str(&text).map_err(|e| {
            let line = e
                .span()
                .map(|s| 1 + text[..s.start.min(text.len())].matches('\n').count());
            let what = e.message().trim().replace('\n', " ");
            bad(match line {
                Some(l) => format!("line {l}: {what}"),
                None => what,
            })
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        c.listen.as_mut().map(fix);
        c.ca.as_mut().map(fix);
        c.log.as_mut().map(fix);
        for e in &mut c.credential {
            fix(&mut e.file);
            if e.header.is_some() == e.bearer {
                return Err(bad(format!(
                    "[[credential]] {}: say either header = \"NAME\" or bearer = true",
                    e.rule
                )));
            }
        }
        Ok(c)
    }

    /// The file's credentials in `--credential`'s form.
    pub fn credential_args(&self) -> Vec<String> {
        self.credential
            .iter()
            .map(|e| match &e.header {
                Some(h) => format!("{}=header:{h}:@{}", e.rule, e.file.display()),
                None => format!("{}=bearer:@{}", e.rule, e.file.display()),
            })
            .collect()
    }
}

/// The gateway, checked and ready to serve.
pub struct Gateway {
    /// Which sandbox a connecting process (its pid: a VMM's) is, for the audit log.
    namer: Option<Box<Namer>>,
    /// Idle upstream connections (TLS done), by host and port: a request reuses one instead of
    /// paying a TLS handshake.
    pool: Mutex<std::collections::HashMap<Upstream, Vec<(Sender, Instant)>>>,
    allow: Vec<Allow>,
    credentials: Vec<Credential>,
    /// Every credential's value, to scrub from error texts.
    secrets: Vec<String>,
    tls: tokio_rustls::TlsConnector,
    log: Mutex<Box<dyn Write + Send>>,
    streams: Arc<tokio::sync::Semaphore>,
    max_request_bytes: u64,
    idle_timeout: Duration,
}

impl Gateway {
    pub fn new(opts: &Options) -> Result<Gateway, GatewayError> {
        let allow = opts
            .allow
            .iter()
            .map(|a| Allow::parse(a))
            .collect::<Result<Vec<_>, _>>()?;
        let credentials = opts
            .credentials
            .iter()
            .map(|c| credential(c))
            .collect::<Result<Vec<_>, _>>()?;
        for c in &credentials {
            if !allow.iter().any(|a| c.applies_to(a)) {
                return Err(GatewayError::Credential(
                    format!("{}=...", c.target),
                    "no --allow rule has that name or host".into(),
                ));
            }
        }
        // The header's value, and the key alone (a bearer value is "Bearer KEY").
        let secrets = credentials
            .iter()
            .filter_map(|c| c.value.to_str().ok())
            .flat_map(|v| [v.to_string(), v.trim_start_matches("Bearer ").to_string()])
            .collect();
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        if let Some(ca) = &opts.ca {
            use rustls::pki_types::pem::PemObject;
            let bad = |why: String| GatewayError::Ca(ca.clone(), why);
            let mut n = 0;
            for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)
                .map_err(|e| bad(e.to_string()))?
            {
                roots
                    .add(cert.map_err(|e| bad(e.to_string()))?)
                    .map_err(|e| bad(e.to_string()))?;
                n += 1;
            }
            if n == 0 {
                return Err(bad("no PEM certificate in it".into()));
            }
        }
        // ring rather than aws-lc-rs (rustls' default, which has post-quantum key exchange but
        // needs cmake and minutes of C on the build machine); TLS 1.2 and 1.3, rustls' safe
        // defaults otherwise.
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| GatewayError::Ca(PathBuf::new(), e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let log: Box<dyn Write + Send> = match &opts.log {
            Some(p) => {
                use std::os::unix::fs::OpenOptionsExt;
                Box::new(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .mode(0o600)
                        .open(p)
                        .map_err(|e| GatewayError::Log(p.clone(), e))?,
                )
            }
            None => Box::new(io::stdout()),
        };
        Ok(Gateway {
            namer: None,
            pool: Mutex::default(),
            allow,
            credentials,
            secrets,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            log: Mutex::new(log),
            streams: Arc::new(tokio::sync::Semaphore::new(opts.max_streams.max(1))),
            max_request_bytes: opts.max_request_bytes,
            idle_timeout: opts.idle_timeout,
        })
    }

    /// Name each connection's sandbox in the audit log with `namer` (its peer's pid: the VMM
    /// whose guest opened the stream).
    pub fn with_namer(mut self, namer: Box<Namer>) -> Self {
        self.namer = Some(namer);
        self
    }

    /// Serve on `listener` until `stop` resolves.
    pub fn serve(
        self,
        listener: std::os::unix::net::UnixListener,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), GatewayError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(GatewayError::Runtime)?;
        let me = Arc::new(self);
        rt.block_on(async move {
            listener
                .set_nonblocking(true)
                .map_err(GatewayError::Runtime)?;
            let listener =
                tokio::net::UnixListener::from_std(listener).map_err(GatewayError::Runtime)?;
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    conn = listener.accept() => {
                        let (conn, _) = match conn {
                            Ok(c) => c,
                            Err(e) => {
                                tracing::warn!("accepting: {e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            }
                        };
                        let peer = conn.peer_cred().ok().and_then(|c| c.pid());
                        let me = me.clone();
                        tokio::spawn(async move { me.connection(conn, peer).await });
                    }
                    _ = &mut stop => break,
                }
            }
            Ok(())
        })
    }

    async fn connection(self: Arc<Self>, conn: tokio::net::UnixStream, peer: Option<i32>) {
        let sandbox = match peer {
            Some(pid) if self.namer.is_some() => {
                let me = self.clone();
                tokio::task::spawn_blocking(move || me.namer.as_ref().and_then(|n| n(pid)))
                    .await
                    .ok()
                    .flatten()
            }
            _ => None,
        };
        let sandbox: Option<Arc<str>> = sandbox.map(Arc::from);
        let me = self.clone();
        let service = hyper::service::service_fn(move |req| {
            let (me, sandbox) = (me.clone(), sandbox.clone());
            async move { Ok::<_, std::convert::Infallible>(me.request(req, peer, sandbox).await) }
        });
        let served = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(conn), service)
            .with_upgrades()
            .await;
        if let Err(e) = served {
            tracing::debug!("a gateway connection: {e}");
        }
    }

    /// A credential's value never leaves in an error text.
    fn scrub(&self, text: String) -> String {
        self.secrets
            .iter()
            .fold(text, |t, s| t.replace(s.as_str(), "[credential]"))
    }

    fn record(&self, r: &Record) {
        let line = serde_json::to_string(r).expect("serializable");
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(log, "{line}");
        let _ = log.flush();
    }

    async fn request(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: Option<i32>,
        sandbox: Option<Arc<str>>,
    ) -> Response<GwBody> {
        let started = Instant::now();
        let mut rec = Record {
            time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            sandbox: sandbox.map(|s| s.to_string()),
            peer_pid: peer,
            kind: if req.method() == Method::CONNECT {
                "connect"
            } else {
                "http"
            },
            method: req.method().to_string(),
            host: String::new(),
            port: 0,
            path: String::new(),
            rule: None,
            status: 0,
            up_bytes: 0,
            down_bytes: 0,
            ms: 0.0,
            error: None,
        };
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            rec.status = 503;
            rec.error = Some("too many streams at once (--max-streams)".into());
            self.record(&rec);
            return refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many streams at once (--max-streams)",
            );
        };
        if req.method() == Method::CONNECT {
            return self.connect(req, rec, started, permit).await;
        }
        self.forward(req, rec, started, permit).await
    }

    /// The rule that lets `host:port` through.
    fn allowed(&self, host: &str, port: u16) -> Option<&Allow> {
        self.allow.iter().find(|a| a.host == host && a.port == port)
    }

    fn deny(&self, mut rec: Record, started: Instant, why: String) -> Response<GwBody> {
        rec.status = 403;
        rec.ms = started.elapsed().as_secs_f64() * 1e3;
        rec.error = Some(why.clone());
        self.record(&rec);
        refusal(StatusCode::FORBIDDEN, &why)
    }

    async fn connect(
        self: Arc<Self>,
        req: Request<Incoming>,
        mut rec: Record,
        started: Instant,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Response<GwBody> {
        let authority = req.uri().authority().cloned();
        let Some((host, port)) = authority
            .as_ref()
            .and_then(|a| Some((a.host().to_ascii_lowercase(), a.port_u16()?)))
        else {
            rec.status = 400;
            self.record(&rec);
            return refusal(StatusCode::BAD_REQUEST, "CONNECT takes host:port");
        };
        rec.host = host.clone();
        rec.port = port;
        let Some(rule) = self.allowed(&host, port) else {
            let why = format!(
                "CONNECT {host}:{port}: not allowed (no --allow rule names that host and port)"
            );
            return self.deny(rec, started, why);
        };
        rec.rule = Some(rule.shown());
        rec.status = 200;
        let upstream = match tokio::time::timeout(
            self.idle_timeout,
            tokio::net::TcpStream::connect((host.as_str(), port)),
        )
        .await
        {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                s
            }
            Ok(Err(e)) => return self.failed(rec, started, format!("{host}:{port}: {e}")),
            Err(_) => return self.failed(rec, started, format!("{host}:{port}: no answer")),
        };
        let me = self.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match hyper::upgrade::on(req).await {
                Ok(upgraded) => {
                    let (up, down, err) =
                        tunnel(TokioIo::new(upgraded), upstream, me.idle_timeout).await;
                    rec.up_bytes = up;
                    rec.down_bytes = down;
                    rec.error = err.map(|e| me.scrub(e));
                }
                Err(e) => rec.error = Some(me.scrub(e.to_string())),
            }
            rec.ms = started.elapsed().as_secs_f64() * 1e3;
            me.record(&rec);
        });
        Response::new(empty())
    }

    fn failed(&self, mut rec: Record, started: Instant, why: String) -> Response<GwBody> {
        let why = self.scrub(why);
        rec.status = 502;
        rec.ms = started.elapsed().as_secs_f64() * 1e3;
        rec.error = Some(why.clone());
        self.record(&rec);
        refusal(StatusCode::BAD_GATEWAY, &format!("upstream: {why}"))
    }

    /// Where a plain request goes: its absolute URI's host, a first path segment naming a
    /// rule (stripped), or its Host header; the rule and the path to send. A host given with
    /// a port (other than HTTP's 80) needs a rule of that port.
    fn route(&self, req: &Request<Incoming>) -> Result<(&Allow, String), String> {
        let path = req
            .uri()
            .path_and_query()
            .map_or("/".to_string(), |p| p.as_str().to_string());
        let by_host = |host: &str, port: Option<u16>| {
            let host = host.to_ascii_lowercase();
            let port = port.filter(|&p| p != 80);
            self.allow
                .iter()
                .find(|a| a.host == host && port.is_none_or(|p| p == a.port))
                .ok_or(match port {
                    Some(p) => format!(
                        "{host}:{p}: not allowed (no --allow rule names that host and port)"
                    ),
                    None => format!("{host}: not allowed (no --allow rule names it)"),
                })
        };
        if let Some(host) = req.uri().host() {
            // Absolute form (a client told to use a proxy): the host is the upstream's.
            return by_host(host, req.uri().port_u16()).map(|a| (a, path));
        }
        // `/NAME/rest?query`: exactly one slash before the name.
        let after = path.strip_prefix('/').unwrap_or("");
        let first = after.split(['/', '?']).next().unwrap_or("");
        if let Some(a) = self
            .allow
            .iter()
            .find(|a| !first.is_empty() && a.name.as_deref() == Some(first))
        {
            let rest = &after[first.len()..];
            let rest = if rest.starts_with('/') {
                rest.to_string()
            } else {
                format!("/{rest}")
            };
            return Ok((a, rest));
        }
        let host = req
            .headers()
            .get(hyper::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if host.is_empty() {
            return Err(format!(
                "no host, and {path:?} starts with no rule's name (--allow NAME=HOST)"
            ));
        }
        let (name, port) = match host.rsplit_once(':') {
            Some((h, p)) => match p.parse::<u16>() {
                Ok(p) => (h, Some(p)),
                Err(_) => return Err(format!("{host}: not a host and port")),
            },
            None => (host, None),
        };
        by_host(name, port).map(|a| (a, path))
    }

    async fn forward(
        self: Arc<Self>,
        req: Request<Incoming>,
        mut rec: Record,
        started: Instant,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Response<GwBody> {
        let (rule, path) = match self.route(&req) {
            Ok(r) => (r.0.clone(), r.1),
            Err(why) => {
                rec.path = req.uri().path().to_string();
                rec.host = req
                    .uri()
                    .host()
                    .or_else(|| req.headers().get(hyper::header::HOST)?.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                return self.deny(rec, started, why);
            }
        };
        rec.host = rule.host.clone();
        rec.port = rule.port;
        rec.path = path.split('?').next().unwrap_or("").to_string();
        rec.rule = Some(rule.shown());
        let declared = req
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_request_bytes) {
            rec.status = 413;
            self.record(&rec);
            return refusal(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!(
                    "a request body over {} bytes (--max-request-bytes)",
                    self.max_request_bytes
                ),
            );
        }
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let host_header = if rule.port == 443 {
            rule.host.clone()
        } else {
            format!("{}:{}", rule.host, rule.port)
        };
        parts.headers.insert(
            hyper::header::HOST,
            HeaderValue::from_str(&host_header).expect("a checked host name"),
        );
        for c in self.credentials.iter().filter(|c| c.applies_to(&rule)) {
            parts.headers.insert(c.header.clone(), c.value.clone());
        }
        parts.uri = match path.parse() {
            Ok(u) => u,
            Err(_) => {
                rec.status = 400;
                self.record(&rec);
                return refusal(StatusCode::BAD_REQUEST, "a path that is not a URI path");
            }
        };
        parts.version = hyper::Version::HTTP_11;
        let up = Arc::new(AtomicU64::new(0));
        let limit = self.max_request_bytes;
        let counted_up = up.clone();
        // When the guest last sent a byte of the body (ms after `started`): an upload that
        // moves is not idle, however long it takes.
        let moved = Arc::new(AtomicU64::new(0));
        let moved_up = moved.clone();
        let body = body
            .map_frame(move |f| {
                if let Some(d) = f.data_ref() {
                    counted_up.fetch_add(d.len() as u64, Ordering::Relaxed);
                    moved_up.store(started.elapsed().as_millis() as u64, Ordering::Relaxed);
                }
                f
            })
            .map_err(|e| e.to_string());
        let body = http_body_util::Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .map_err(|e| io::Error::other(e.to_string()))
            .boxed();
        let upstream_req = Request::from_parts(parts, body);
        // The answer's head, while either side moves: --idle-timeout after the guest's last
        // byte up with no answer ends the stream (a stalled upload, a silent upstream).
        let send = self.send(&rule, upstream_req);
        tokio::pin!(send);
        let answer = loop {
            let last = moved.load(Ordering::Relaxed);
            let deadline = started + Duration::from_millis(last) + self.idle_timeout;
            match tokio::time::timeout_at(deadline.into(), &mut send).await {
                Ok(r) => break Some(r),
                Err(_) if moved.load(Ordering::Relaxed) == last => break None,
                Err(_) => continue,
            }
        };
        let (response, sender) = match answer {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                return self.failed(rec, started, format!("{}:{}: {e}", rule.host, rule.port))
            }
            None => {
                return self.failed(
                    rec,
                    started,
                    format!(
                        "{}:{}: nothing moved for {} s (--idle-timeout)",
                        rule.host,
                        rule.port,
                        self.idle_timeout.as_secs()
                    ),
                )
            }
        };
        rec.status = response.status().as_u16();
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let body = Counted {
            inner: body,
            back: Some(((rule.host.clone(), rule.port), sender)),
            down: 0,
            up,
            rec: Some(rec),
            started,
            gateway: self.clone(),
            idle: Box::pin(tokio::time::sleep(self.idle_timeout)),
            _permit: permit,
        };
        Response::from_parts(parts, body.boxed())
    }

    /// An idle connection to `key`'s upstream that can take a request now, if one is kept.
    fn take(&self, key: &Upstream) -> Option<Sender> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let idle = pool.get_mut(key)?;
        while let Some((s, since)) = idle.pop() {
            if since.elapsed() < POOL_IDLE && s.is_ready() {
                return Some(s);
            }
        }
        None
    }

    /// Keep a connection whose last answer was read whole, for the next request.
    fn give(&self, key: Upstream, s: Sender) {
        if s.is_closed() {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        let idle = pool.entry(key).or_default();
        idle.retain(|(s, since)| since.elapsed() < POOL_IDLE && !s.is_closed());
        if idle.len() < POOL_PER_UPSTREAM {
            idle.push((s, Instant::now()));
        }
    }

    /// Send `req` to the rule's upstream: on a kept connection when one is idle (a request it
    /// could not take, never sent, goes on a new one), else on a new connection. The answer,
    /// and the connection to give back once the answer's body is read.
    async fn send(
        &self,
        rule: &Allow,
        req: Request<GwBody>,
    ) -> Result<(Response<Incoming>, Sender), String> {
        let key = (rule.host.clone(), rule.port);
        let mut req = req;
        if let Some(mut s) = self.take(&key) {
            match s.try_send_request(req).await {
                Ok(r) => return Ok((r, s)),
                Err(mut e) => match e.take_message() {
                    Some(r) => req = r,
                    None => return Err(chain(&e.into_error())),
                },
            }
        }
        let mut s = self.open(rule).await?;
        let r = s.send_request(req).await.map_err(|e| chain(&e))?;
        Ok((r, s))
    }

    /// A new connection to the rule's upstream: TCP, TLS (its certificate verified), HTTP/1.1.
    async fn open(&self, rule: &Allow) -> Result<Sender, String> {
        let tcp = tokio::net::TcpStream::connect((rule.host.as_str(), rule.port))
            .await
            .map_err(|e| e.to_string())?;
        // A request's head and body are separate writes: Nagle would hold the second for the
        // upstream's delayed ACK.
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(rule.host.clone())
            .map_err(|e| e.to_string())?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("an upstream connection: {e}");
            }
        });
        Ok(sender)
    }
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        text.push_str(&format!(": {s}"));
        src = s.source();
    }
    text
}

type GwBody = BoxBody<Bytes, io::Error>;

fn empty() -> GwBody {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed()
}

/// A refusal: the status, the reason as text, and the stream closed after it.
fn refusal(status: StatusCode, why: &str) -> Response<GwBody> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("amvm gateway: {why}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Headers that belong to one hop (RFC 9110 7.6.1), and any the Connection header names.
fn strip_hop_by_hop(h: &mut hyper::HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        h.remove(n);
    }
}

/// One line of the audit log.
#[derive(serde::Serialize)]
struct Record {
    time: f64,
    /// The sandbox whose guest opened the stream (its name, else its id), when known.
    sandbox: Option<String>,
    peer_pid: Option<i32>,
    kind: &'static str,
    method: String,
    host: String,
    port: u16,
    path: String,
    rule: Option<String>,
    status: u16,
    up_bytes: u64,
    down_bytes: u64,
    ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// An upstream's response body on its way to the guest, counted; its record is written when it
/// ends (or is dropped: the guest went away), with the stream's permit released then.
struct Counted {
    inner: Incoming,
    /// The connection it came on, given back to the pool once the body is read whole.
    back: Option<(Upstream, Sender)>,
    down: u64,
    up: Arc<AtomicU64>,
    rec: Option<Record>,
    started: Instant,
    gateway: Arc<Gateway>,
    /// Fires when the upstream has sent nothing for `--idle-timeout`: the stream ends then.
    idle: Pin<Box<tokio::time::Sleep>>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Counted {
    fn finish(&mut self, error: Option<String>) {
        if let Some(mut rec) = self.rec.take() {
            rec.down_bytes = self.down;
            rec.up_bytes = self.up.load(Ordering::Relaxed);
            rec.ms = self.started.elapsed().as_secs_f64() * 1e3;
            rec.error = error.map(|e| self.gateway.scrub(e));
            self.gateway.record(&rec);
        }
    }
}

impl Counted {
    /// Read whole: its connection back to the pool, its record written.
    fn ended(&mut self) {
        if let Some((key, s)) = self.back.take() {
            self.gateway.give(key, s);
        }
        self.finish(None);
    }
}

impl Body for Counted {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.down += d.len() as u64;
                }
                let next = tokio::time::Instant::now() + self.gateway.idle_timeout;
                self.idle.as_mut().reset(next);
                // A body of known length is not polled past its last byte: it ends here.
                if self.inner.is_end_stream() {
                    self.ended();
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => {
                let text = format!("the upstream's body: {e}");
                self.finish(Some(text.clone()));
                Poll::Ready(Some(Err(io::Error::other(self.gateway.scrub(text)))))
            }
            Poll::Ready(None) => {
                self.ended();
                Poll::Ready(None)
            }
            Poll::Pending => match std::future::Future::poll(self.idle.as_mut(), cx) {
                Poll::Ready(()) => {
                    let text = format!(
                        "the upstream sent nothing for {} s (--idle-timeout)",
                        self.gateway.idle_timeout.as_secs()
                    );
                    self.finish(Some(text.clone()));
                    Poll::Ready(Some(Err(io::Error::other(text))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            // An empty body, never polled.
            self.ended();
        } else {
            self.finish(Some("the guest closed the stream before its end".into()));
        }
    }
}

/// Both ways until both ends are done, or nothing moves for `idle`: the bytes each way, and why
/// it ended early.
async fn tunnel(
    guest: TokioIo<hyper::upgrade::Upgraded>,
    upstream: tokio::net::TcpStream,
    idle: Duration,
) -> (u64, u64, Option<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut gr, mut gw) = tokio::io::split(guest);
    let (mut ur, mut uw) = upstream.into_split();
    let up = Arc::new(AtomicU64::new(0));
    let down = Arc::new(AtomicU64::new(0));
    let last = Arc::new(Mutex::new(Instant::now()));
    let pump = |mut r: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                mut w: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                n: Arc<AtomicU64>,
                last: Arc<Mutex<Instant>>| async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let k = r.read(&mut buf).await?;
            if k == 0 {
                w.shutdown().await?;
                return Ok::<(), io::Error>(());
            }
            w.write_all(&buf[..k]).await?;
            n.fetch_add(k as u64, Ordering::Relaxed);
            *last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        }
    };
    let a = pump(
        Box::new(&mut gr),
        Box::new(&mut uw),
        up.clone(),
        last.clone(),
    );
    let b = pump(
        Box::new(&mut ur),
        Box::new(&mut gw),
        down.clone(),
        last.clone(),
    );
    let both = async { tokio::try_join!(a, b) };
    let watch = async {
        loop {
            tokio::time::sleep(idle / 4).await;
            if last.lock().unwrap_or_else(|p| p.into_inner()).elapsed() >= idle {
                return;
            }
        }
    };
    let err = tokio::select! {
        r = both => r.err().map(|e| e.to_string()),
        () = watch => Some(format!("idle for {} s (--idle-timeout)", idle.as_secs())),
    };
    (
        up.load(Ordering::Relaxed),
        down.load(Ordering::Relaxed),
        err,
    )
}

/// Bind `path` as the gateway's socket (0600): a socket left by a gateway that is gone is
/// replaced; one that answers is not.
pub fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, GatewayError> {
    use std::os::unix::fs::PermissionsExt;
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(GatewayError::InUse(path.to_owned()));
    }
    let _ = std::fs::remove_file(path);
    let l = std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| GatewayError::Listen(path.to_owned(), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| GatewayError::Listen(path.to_owned(), e))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_rules_parse_and_refuse() {
        assert_eq!(
            Allow::parse("API.Anthropic.com").unwrap(),
            Allow {
                name: None,
                host: "api.anthropic.com".into(),
                port: 443
            }
        );
        assert_eq!(
            Allow::parse("npm=registry.npmjs.org:8443").unwrap(),
            Allow {
                name: Some("npm".into()),
                host: "registry.npmjs.org".into(),
                port: 8443
            }
        );
        for bad in [
            "",
            "https://x.com",
            "x.com/path",
            "x.com:0",
            "x.com:99999",
            "=x.com",
            "a b=x.com",
            "-x.com",
        ] {
            assert!(Allow::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_credential_is_read_from_its_file_and_never_shown() {
        let dir = std::env::temp_dir().join(format!("amvm-gw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, "sk-secret-123\n").unwrap();
        let c = credential(&format!("api.x.com=header:x-api-key:@{}", f.display())).unwrap();
        assert_eq!(c.header, "x-api-key");
        assert_eq!(c.value, "sk-secret-123");
        assert!(c.value.is_sensitive());
        std::fs::write(&f, "bad\u{1}value\n").unwrap();
        let e = credential(&format!("api.x.com=header:x-api-key:@{}", f.display()))
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("bad"), "{e}");
        assert!(credential("api.x.com=x-api-key:@/nowhere").is_err());
        assert!(credential("=bearer:@/nowhere").is_err());
        std::fs::write(&f, "sk-openai-9\n").unwrap();
        let c = credential(&format!("openai=bearer:@{}", f.display())).unwrap();
        assert_eq!(c.header, "authorization");
        assert_eq!(c.value, "Bearer sk-openai-9");
        // By the rule's name: that rule only; by host: every rule of the host.
        let rule = |n: Option<&str>, h: &str| Allow {
            name: n.map(str::to_string),
            host: h.into(),
            port: 443,
        };
        assert!(c.applies_to(&rule(Some("openai"), "localhost")));
        assert!(!c.applies_to(&rule(Some("gemini"), "localhost")));
        assert!(!c.applies_to(&rule(None, "localhost")));
        let c = credential(&format!("LocalHost=bearer:@{}", f.display())).unwrap();
        assert!(c.applies_to(&rule(Some("gemini"), "localhost")));
        let e = credential("api.x.com=header:x-api-key:@/nowhere")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("/nowhere"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_config_file_reads_with_paths_beside_it_and_refuses_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("amvm-gw-conf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("gw.toml");
        std::fs::write(
            &f,
            "listen = \"gw.sock\"\nallow = [\"a=api.x.com\", \"npm.org:8443\"]\nidle_timeout = 9\n\
             [[credential]]\nhost = \"api.x.com\"\nheader = \"x-api-key\"\nfile = \"key\"\n\
             [[credential]]\nrule = \"a\"\nbearer = true\nfile = \"/k\"\n",
        )
        .unwrap();
        let c = ConfigFile::read(&f).unwrap();
        assert_eq!(c.listen.as_deref(), Some(dir.join("gw.sock").as_path()));
        assert_eq!(c.allow, ["a=api.x.com", "npm.org:8443"]);
        assert_eq!(c.idle_timeout, Some(9));
        assert_eq!(
            c.credential_args(),
            [
                format!("api.x.com=header:x-api-key:@{}", dir.join("key").display()),
                "a=bearer:@/k".to_string()
            ]
        );
        std::fs::write(
            &f,
            "[[credential]]\nrule = \"a\"\nbearer = true\nheader = \"x\"\nfile = \"k\"\n",
        )
        .unwrap();
        let e = ConfigFile::read(&f).err().unwrap().to_string();
        assert!(e.contains("either header"), "{e}");
        std::fs::write(&f, "allow = [\"a.com\"]\nallwo = [\"b.com\"]\n").unwrap();
        let e = ConfigFile::read(&f).err().unwrap().to_string();
        assert!(e.contains("allwo"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hop_by_hop_headers_go() {
        let mut h = hyper::HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }
}
