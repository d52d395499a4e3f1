//! `amvm gateway` against real servers on loopback: a TLS upstream (Python's http.server and
//! ssl, its certificate signed by a CA this test makes with openssl), a TCP echo server for
//! tunnels, and a tripwire listener that must never be reached. Clients speak HTTP/1.1 on the
//! gateway's unix socket, as a guest's streams arrive there.

use amvm_egress::gateway::{bind, Gateway, Options};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &str = "sk-test-0123456789abcdef";

struct Bed {
    dir: PathBuf,
    upstream: Child,
    port: u16,
    echo_port: u16,
    trip_port: u16,
    tripped: Arc<AtomicUsize>,
}

impl Drop for Bed {
    fn drop(&mut self) {
        let _ = self.upstream.kill();
        let _ = self.upstream.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sh(dir: &Path, cmd: &str) {
    let o = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn bed(name: &str) -> Bed {
    let dir = std::env::temp_dir().join(format!("amvm-gateway-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A CA of the test's own, and a certificate for localhost that it signed.
    let standin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/standin");
    sh(&dir, &format!("{} .", standin.join("test-ca").display()));
    std::fs::write(dir.join("key"), format!("{SECRET}\n")).unwrap();
    let upstream = Command::new("python3")
        .arg(standin.join("tls_upstream.py"))
        .args(["up.pem", "up.key", "port", "records", "go"])
        .env("UPSTREAM_KEY", SECRET)
        .current_dir(&dir)
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    let port = loop {
        if let Ok(p) = std::fs::read_to_string(dir.join("port")) {
            break p.trim().parse().unwrap();
        }
        assert!(Instant::now() < until, "the TLS upstream did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Tunnels' far end: echoes what it gets.
    let echo = TcpListener::bind("127.0.0.1:0").unwrap();
    let echo_port = echo.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in echo.incoming().flatten() {
            std::thread::spawn(move || {
                let mut w = c.try_clone().unwrap();
                let _ = std::io::copy(&mut &c, &mut w);
            });
        }
    });
    // A port no rule allows: any connection to it is a leak.
    let trip = TcpListener::bind("127.0.0.1:0").unwrap();
    let trip_port = trip.local_addr().unwrap().port();
    let tripped = Arc::new(AtomicUsize::new(0));
    let t = tripped.clone();
    std::thread::spawn(move || {
        for _ in trip.incoming() {
            t.fetch_add(1, Ordering::SeqCst);
        }
    });
    Bed {
        dir,
        upstream,
        port,
        echo_port,
        trip_port,
        tripped,
    }
}

/// A gateway serving `sock` until the returned sender is dropped.
fn gateway(bed: &Bed, ca: bool, max_streams: usize) -> (PathBuf, tokio::sync::oneshot::Sender<()>) {
    gateway_idle(bed, ca, max_streams, 30)
}

fn gateway_idle(
    bed: &Bed,
    ca: bool,
    max_streams: usize,
    idle: u64,
) -> (PathBuf, tokio::sync::oneshot::Sender<()>) {
    let sock = bed.dir.join(format!("gw-{max_streams}-{ca}-{idle}.sock"));
    let opts = Options {
        listen: sock.clone(),
        allow: vec![
            format!("up=localhost:{}", bed.port),
            format!("localhost:{}", bed.echo_port),
        ],
        credentials: vec![format!(
            "localhost=header:x-api-key:@{}",
            bed.dir.join("key").display()
        )],
        ca: ca.then(|| bed.dir.join("ca.pem")),
        log: Some(bed.dir.join("audit.log")),
        max_streams,
        max_request_bytes: 1 << 20,
        idle_timeout: Duration::from_secs(idle),
    };
    let gw = Gateway::new(&opts).unwrap();
    let listener = bind(&sock).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        gw.serve(listener, async move {
            let _ = rx.await;
        })
        .unwrap()
    });
    (sock, tx)
}

/// One request; the response's status line, headers and body as sent (chunked framing kept).
fn exchange(sock: &Path, request: &[u8]) -> (u16, String, Vec<u8>) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    split(&all)
}

fn split(all: &[u8]) -> (u16, String, Vec<u8>) {
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(all)));
    let head = String::from_utf8_lossy(&all[..end]).to_string();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, all[end + 4..].to_vec())
}

/// The data of a chunked body, and whether it ended with its last chunk.
fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(nl) = b.windows(2).position(|w| w == b"\r\n") else {
            return (out, false);
        };
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return (out, true);
        }
        if b.len() < nl + 2 + n + 2 {
            out.extend_from_slice(&b[(nl + 2).min(b.len())..]);
            return (out, false);
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
}

fn audit(bed: &Bed) -> Vec<serde_json::Value> {
    std::fs::read_to_string(bed.dir.join("audit.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_gateway_forwards_with_the_credential_streams_tunnels_refuses_and_audits() {
    let bed = bed("main");
    let (sock, _stop) = gateway(&bed, true, 64);

    // A named upstream over TLS, the credential added on the host, the events streamed: the
    // first arrives while the upstream still holds the rest (it sends them once told to).
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"model":"m","messages":[]}"#;
    write!(
        s,
        "POST /up/v1/messages HTTP/1.1\r\nHost: 127.0.0.1:4700\r\nx-api-key: guest-made-up\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = Vec::new();
    loop {
        let mut line = String::new();
        assert!(r.read_line(&mut line).unwrap() > 0, "ended early: {seen:?}");
        seen.push(line.clone());
        if line.contains("event: first") {
            break;
        }
    }
    std::fs::write(bed.dir.join("go"), b"").unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    let head = seen.concat();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let rest = String::from_utf8_lossy(&rest);
    assert_eq!(rest.matches("event: more").count(), 4, "{rest}");
    assert!(
        rest.ends_with("0\r\n\r\n"),
        "the stream did not end whole: {rest:?}"
    );
    // The upstream got the host's credential, not the guest's, and no hop-by-hop header.
    let records = std::fs::read_to_string(bed.dir.join("records")).unwrap();
    let req: serde_json::Value = serde_json::from_str(records.lines().next().unwrap()).unwrap();
    assert_eq!(req["path"], "/v1/messages");
    let headers = req["headers"].as_array().unwrap();
    let keys: Vec<&serde_json::Value> = headers
        .iter()
        .filter(|h| h[0] == "x-api-key")
        .map(|h| &h[1])
        .collect();
    assert_eq!(keys, [SECRET], "{headers:?}");
    assert!(headers
        .iter()
        .any(|h| h[0] == "host" && h[1] == format!("localhost:{}", bed.port)));
    assert!(!headers.iter().any(|h| h[0] == "connection"), "{headers:?}");

    // Not allowed: a host of no rule, an allowed host on another port; 403 naming why, the
    // stream closed, nothing connected to.
    let (status, _, body) = exchange(
        &sock,
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n",
    );
    assert_eq!(status, 403);
    assert!(String::from_utf8_lossy(&body).contains("example.com: not allowed"));
    let trip = format!(
        "GET / HTTP/1.1\r\nHost: localhost:{}\r\n\r\n",
        bed.trip_port
    );
    let (status, head, _) = exchange(&sock, trip.as_bytes());
    assert_eq!(status, 403);
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    let connect = format!(
        "CONNECT localhost:{0} HTTP/1.1\r\nHost: localhost:{0}\r\n\r\n",
        bed.trip_port
    );
    let (status, _, body) = exchange(&sock, connect.as_bytes());
    assert_eq!(status, 403);
    assert!(
        String::from_utf8_lossy(&body).contains("not allowed"),
        "{body:?}"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        bed.tripped.load(Ordering::SeqCst),
        0,
        "a refused request reached a socket"
    );

    // CONNECT to an allowed host and port: a tunnel, bytes both ways untouched.
    let mut t = UnixStream::connect(&sock).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        t,
        "CONNECT localhost:{0} HTTP/1.1\r\nHost: localhost:{0}\r\n\r\n",
        bed.echo_port
    )
    .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        t.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut w = t.try_clone().unwrap();
    let p2 = payload.clone();
    let writer = std::thread::spawn(move || {
        w.write_all(&p2).unwrap();
        w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut back = Vec::new();
    t.read_to_end(&mut back).unwrap();
    writer.join().unwrap();
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "the tunnel changed bytes");

    // 1,000 requests over 20 concurrent streams: every answer is its own request's body.
    let threads: Vec<_> = (0..20)
        .map(|t| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
                let mut r = BufReader::new(s.try_clone().unwrap());
                for i in 0..50 {
                    let body = format!("stream {t} request {i} {}", "x".repeat(i * 37));
                    write!(
                        s,
                        "POST /up/echo HTTP/1.1\r\nHost: gw\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .unwrap();
                    let mut len = None;
                    loop {
                        let mut line = String::new();
                        r.read_line(&mut line).unwrap();
                        if line == "\r\n" {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = Some(v.trim().parse::<usize>().unwrap());
                        }
                    }
                    let mut got = vec![0u8; len.expect("a length")];
                    r.read_exact(&mut got).unwrap();
                    assert_eq!(String::from_utf8(got).unwrap(), body);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    // Upstream connections are kept and reused: far fewer TLS handshakes than requests.
    let conns = std::fs::read_to_string(bed.dir.join("records.connections"))
        .unwrap()
        .lines()
        .count();
    assert!(
        conns <= 100,
        "{conns} upstream connections for 1,000 requests"
    );

    // The upstream dies mid-stream: the guest's response ends without its last chunk.
    let (status, _, body) = exchange(
        &sock,
        b"GET /up/die HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 200);
    let (data, whole) = dechunk(&body);
    assert_eq!(data, b"partial");
    assert!(!whole, "a cut upstream looked like a whole answer");

    // The audit log: one line per request and tunnel, the credential in none of them.
    std::thread::sleep(Duration::from_millis(300));
    let lines = audit(&bed);
    let echoes = lines
        .iter()
        .filter(|l| l["path"] == "/echo" && l["status"] == 200 && l.get("error").is_none())
        .count();
    assert_eq!(echoes, 1000);
    let sse = lines
        .iter()
        .find(|l| l["path"] == "/v1/messages")
        .expect("the SSE request's line");
    assert_eq!(sse["status"], 200);
    assert_eq!(sse["host"], "localhost");
    assert!(sse["down_bytes"].as_u64().unwrap() > 50, "{sse}");
    assert_eq!(sse["up_bytes"].as_u64().unwrap(), body_len());
    let tunnel = lines
        .iter()
        .find(|l| l["kind"] == "connect" && l["status"] == 200)
        .unwrap();
    assert_eq!(tunnel["up_bytes"].as_u64().unwrap(), 200_000);
    assert_eq!(tunnel["down_bytes"].as_u64().unwrap(), 200_000);
    assert_eq!(lines.iter().filter(|l| l["status"] == 403).count(), 3);
    let died = lines.iter().find(|l| l["path"] == "/die").unwrap();
    assert!(died["error"].as_str().is_some(), "{died}");
    let log = std::fs::read_to_string(bed.dir.join("audit.log")).unwrap();
    assert!(!log.contains(SECRET), "the credential is in the audit log");
}

fn body_len() -> u64 {
    r#"{"model":"m","messages":[]}"#.len() as u64
}

#[test]
fn an_upstream_the_gateway_cannot_verify_is_a_502_saying_why() {
    let bed = bed("tls");
    // Without --ca the test CA is unknown: the webpki roots do not have it.
    let (sock, _stop) = gateway(&bed, false, 64);
    let (status, _, body) = exchange(
        &sock,
        b"GET /up/echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    );
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 502, "{body}");
    assert!(
        body.contains("TLS") && body.contains("certificate"),
        "{body}"
    );
    assert!(!body.contains(SECRET));
    assert!(
        std::fs::read_to_string(bed.dir.join("records"))
            .unwrap_or_default()
            .is_empty(),
        "a request went to an upstream that was not verified"
    );
}

#[test]
fn streams_beyond_the_limit_get_503_and_bad_options_are_refused() {
    let bed = bed("limits");
    let (sock, _stop) = gateway(&bed, true, 1);
    // One tunnel holds the only stream.
    let mut t = UnixStream::connect(&sock).unwrap();
    write!(
        t,
        "CONNECT localhost:{0} HTTP/1.1\r\nHost: localhost:{0}\r\n\r\n",
        bed.echo_port
    )
    .unwrap();
    let mut b = [0u8; 12];
    t.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"HTTP/1.1 200");
    let (status, _, _) = exchange(
        &sock,
        b"GET /up/echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 503);
    // An upstream that stops sending mid-answer is cut after --idle-timeout: the guest's answer
    // ends without its last chunk (the upstream would stall for two minutes; the read below
    // would time out after one).
    let (idle_sock, _stop_idle) = gateway_idle(&bed, true, 4, 2);
    let (status, _, body) = exchange(
        &idle_sock,
        b"GET /up/stall HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 200);
    let (data, whole) = dechunk(&body);
    assert_eq!(data, b"first");
    assert!(!whole, "a stalled upstream looked like a whole answer");
    std::thread::sleep(Duration::from_millis(300));
    let stalled = audit(&bed)
        .into_iter()
        .find(|l| l["path"] == "/stall")
        .expect("the stalled request's line");
    assert!(
        stalled["error"]
            .as_str()
            .unwrap()
            .contains("--idle-timeout"),
        "{stalled}"
    );
    // An upload that keeps moving is not idle, however long it takes (3.2 s, the timeout
    // 2 s); one that stops is ended after the timeout, its stream freed.
    let mut u = UnixStream::connect(&idle_sock).unwrap();
    u.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    u.write_all(
        b"POST /up/echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Length: 8\r\n\r\n",
    )
    .unwrap();
    for b in b"slowpost" {
        std::thread::sleep(Duration::from_millis(400));
        u.write_all(&[*b]).unwrap();
    }
    let mut all = Vec::new();
    let _ = u.read_to_end(&mut all);
    let (status, _, body) = split(&all);
    assert_eq!((status, body.as_slice()), (200, &b"slowpost"[..]));
    let mut u = UnixStream::connect(&idle_sock).unwrap();
    u.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    u.write_all(
        b"POST /up/echo HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Length: 8\r\n\r\nstop",
    )
    .unwrap();
    let mut all = Vec::new();
    let _ = u.read_to_end(&mut all);
    let (status, _, _) = split(&all);
    assert_eq!(status, 502);
    std::thread::sleep(Duration::from_millis(300));
    let stopped = audit(&bed)
        .into_iter()
        .find(|l| l["path"] == "/echo" && l["status"] == 502)
        .expect("the stopped upload's line");
    assert!(
        stopped["error"]
            .as_str()
            .unwrap()
            .contains("nothing moved for 2 s"),
        "{stopped}"
    );
    // Bad options: a rule with a scheme, a credential for a host no rule allows, a CA that
    // is not PEM.
    let base = Options {
        listen: bed.dir.join("x.sock"),
        allow: vec!["localhost:1".into()],
        credentials: vec![],
        ca: None,
        log: None,
        max_streams: 4,
        max_request_bytes: 1 << 20,
        idle_timeout: Duration::from_secs(5),
    };
    let err = |o: Options| Gateway::new(&o).err().expect("accepted").to_string();
    assert!(err(Options {
        allow: vec!["https://x.com".into()],
        ..base.clone()
    })
    .contains("--allow"));
    let e = err(Options {
        credentials: vec![format!(
            "other.com=header:x-api-key:@{}",
            bed.dir.join("key").display()
        )],
        ..base.clone()
    });
    assert!(e.contains("no --allow rule") && !e.contains(SECRET), "{e}");
    let e = err(Options {
        ca: Some(bed.dir.join("key")),
        ..base
    });
    assert!(e.contains("--ca") && !e.contains(SECRET), "{e}");
}
