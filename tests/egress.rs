//! Egress: the workload's streams reach the host's `--egress` socket complete and in order, both
//! ways, at every size around the boundaries where peers lost bytes (vsock-notes.md), with fast,
//! slow and pausing readers, in parallel, half-closed, and when the endpoint dies.
//! Both ends hash what they saw; the test compares the hashes.

use amvm_tests::egress_server::{hex, pattern, pattern_sha, EgressServer, Pace};
use amvm_tests::run_vm;
use sha2::{Digest, Sha256};

/// Around every buffer and credit boundary of the path: a page, the guest driver's 32 KiB, one
/// 64 KiB packet (and guest-init's relay buffer), our CREDIT_UPDATE threshold (half of the 256 KiB
/// window), the window itself and twice it, and 1 MiB.
const SIZES: &[usize] = &[
    1,
    4095,
    4096,
    4097,
    32767,
    32768,
    32769,
    65535,
    65536,
    65537,
    131071,
    131072,
    131073,
    262143,
    262144,
    262145,
    524287,
    524288,
    524289,
    1 << 20,
];

/// The guest's client for the relay's TCP address (from the environment): the host's busybox,
/// which the guest sees in /usr.
const NC: &str = "busybox nc ${AMVM_EGRESS_ADDR%:*} ${AMVM_EGRESS_ADDR#*:}";
/// The guest's client for the relay's unix socket (busybox `nc` cannot do unix sockets).
const UNIX: &str = "amvm-connect unix:$AMVM_EGRESS_SOCK";

fn lines_with(out: &str, prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = out
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// Guest uploads `n` random bytes per size; returns the guest's "UP n sha" lines and checks the
/// server saw the same bytes and the guest got the server's hash back.
fn upload(server: &EgressServer, sizes: &[usize], client: &str, extra_opts: &[&str]) {
    let list: Vec<String> = sizes.iter().map(ToString::to_string).collect();
    let script = format!(
        "for n in {}; do head -c $n /dev/urandom > /tmp/f; h=$(sha256sum < /tmp/f | cut -d' ' -f1); \
         echo \"UP $n $h\"; r=$( (echo UP $n; cat /tmp/f) | {client}); echo \"REPLY $n $r\"; done",
        list.join(" ")
    );
    let mut opts = vec!["--egress", server.path_str()];
    opts.extend_from_slice(extra_opts);
    let o = run_vm(&opts, &["sh", "-c", &script]);
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    let guest = lines_with(&out, "UP ");
    assert_eq!(guest.len(), sizes.len(), "{out}");
    let mut host = server.records();
    host.sort();
    assert_eq!(
        guest, host,
        "what the guest sent differs from what the host received"
    );
    for line in &guest {
        let mut w = line.split(' ').skip(1);
        let (n, h) = (w.next().unwrap(), w.next().unwrap());
        assert!(
            out.contains(&format!("REPLY {n} {h}")),
            "reply for {n} missing or wrong:\n{out}"
        );
    }
}

#[test]
fn uploads_of_every_boundary_size_arrive_byte_exact() {
    let server = EgressServer::start("up", Pace::Fast);
    upload(&server, SIZES, NC, &[]);
}

#[test]
fn uploads_through_the_guest_unix_socket_arrive_byte_exact() {
    let server = EgressServer::start("up-unix", Pace::Fast);
    upload(&server, SIZES, UNIX, &[]);
}

#[test]
fn uploads_survive_a_slow_pausing_reader() {
    let server = EgressServer::start("slow", Pace::Slow);
    upload(&server, &[262145, 1 << 20], NC, &[]);
    let server = EgressServer::start("slow-unix", Pace::Slow);
    upload(&server, &[65537], UNIX, &[]);
}

#[test]
fn a_64_mib_upload_arrives_byte_exact() {
    let server = EgressServer::start("big", Pace::Fast);
    upload(&server, &[64 << 20], NC, &[]);
}

/// The guest asks for `DOWN n` per size and hashes what arrives; both ends' hashes must be the
/// pattern's.
fn download(server: &EgressServer, sizes: &[usize], client: &str, extra_opts: &[&str]) {
    let list: Vec<String> = sizes.iter().map(ToString::to_string).collect();
    let script = format!(
        "for n in {}; do h=$(echo DOWN $n | {client} | sha256sum | cut -d' ' -f1); echo \"DOWN $n $h\"; done",
        list.join(" ")
    );
    let mut opts = vec!["--egress", server.path_str()];
    opts.extend_from_slice(extra_opts);
    let o = run_vm(&opts, &["sh", "-c", &script]);
    assert_eq!(o.code, 0, "{o:?}");
    let guest = lines_with(&o.stdout_str(), "DOWN ");
    let mut want: Vec<String> = sizes
        .iter()
        .map(|&n| format!("DOWN {n} {}", pattern_sha(n)))
        .collect();
    want.sort();
    assert_eq!(guest, want);
    let mut host = server.records();
    host.sort();
    assert_eq!(host, want, "the server's own record of what it sent");
}

#[test]
fn downloads_of_every_boundary_size_arrive_byte_exact() {
    let server = EgressServer::start("down", Pace::Fast);
    let mut sizes = SIZES.to_vec();
    sizes.push(64 << 20);
    download(&server, &sizes, NC, &[]);
}

#[test]
fn downloads_through_the_guest_unix_socket_arrive_byte_exact() {
    let server = EgressServer::start("down-unix", Pace::Fast);
    download(&server, SIZES, UNIX, &[]);
}

const GIB: usize = 1 << 30;
/// The 1 GiB streams' hang guard. Not a speed limit: in the emulated KVM host, beside each other
/// on one emulated CPU, the upload has taken about 20 minutes (seventh session) and once ran
/// past 1500 s, the guard before.
const GIB_TIMEOUT: &str = "3000";

// The two 1 GiB streams are the long tier (`tests/run --long`, each in an emulated host of its
// own): in the emulated host they took 20-40 minutes, most of the default suite's time. What
// they prove at every size below — each buffer and credit boundary, 64 MiB each way, a slow
// reader, parallel streams, half-close — the default suite proves with the tests above and
// below; these add the sustained GiB (16384 packets of 64 KiB, 4096 windows of our 256 KiB credit).
#[test]
#[ignore = "long tier: tests/run --long"]
fn a_1_gib_download_arrives_byte_exact() {
    let server = EgressServer::start("gib-down", Pace::Fast);
    download(&server, &[GIB], NC, &["--timeout", GIB_TIMEOUT]);
}

#[test]
#[ignore = "long tier: tests/run --long"]
fn a_1_gib_upload_arrives_byte_exact() {
    // 64 MiB of random bytes sent 16 times; the guest hashes the whole GiB on its way out (a
    // fifo to sha256sum beside the relay client), the server hashes what it received.
    let server = EgressServer::start("gib-up", Pace::Fast);
    let script = format!(
        "head -c 67108864 /dev/urandom > /tmp/f; mkfifo /tmp/p; \
         sha256sum < /tmp/p | cut -d' ' -f1 > /tmp/h & \
         r=$( (echo UP {GIB}; for i in $(seq 16); do cat /tmp/f; done | tee /tmp/p) | {NC}); \
         wait; echo \"UP {GIB} $(cat /tmp/h)\"; echo \"REPLY $r\""
    );
    let o = run_vm(
        &["--egress", server.path_str(), "--timeout", GIB_TIMEOUT],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    let sent = lines_with(&out, "UP ");
    assert_eq!(sent.len(), 1, "{out}");
    assert_eq!(server.records(), sent, "what the host received");
    let h = sent[0].rsplit(' ').next().unwrap();
    assert_eq!(lines_with(&out, "REPLY "), vec![format!("REPLY {h}")]);
}

#[test]
fn eight_parallel_streams_each_way() {
    // Four pairs through the TCP address, four through the unix socket, all at once.
    let server = EgressServer::start("par", Pace::Fast);
    let script = format!(
        "for i in 1 2 3 4 5 6 7 8; do if [ $i -le 4 ]; then c=\"{NC}\"; else c=\"{UNIX}\"; fi; \
           ( head -c 262145 /dev/urandom > /tmp/f$i; \
           echo \"UP 262145 $(sha256sum < /tmp/f$i | cut -d' ' -f1)\" > /tmp/l$i; \
           (echo UP 262145; cat /tmp/f$i) | eval $c > /dev/null; \
           echo \"DOWN 1048577 $(echo DOWN 1048577 | eval $c | sha256sum | cut -d' ' -f1)\" >> /tmp/l$i ) & \
         done; wait; cat /tmp/l*"
    );
    let o = run_vm(
        &["--egress", server.path_str(), "--cpus", "2"],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    let down = format!("DOWN 1048577 {}", pattern_sha(1048577));
    assert_eq!(lines_with(&out, "DOWN "), vec![down; 8], "{out}");
    let mut host: Vec<String> = server
        .records()
        .into_iter()
        .filter(|r| r.starts_with("UP "))
        .collect();
    host.sort();
    assert_eq!(lines_with(&out, "UP "), host);
}

#[test]
fn a_half_closed_upload_still_reads_the_whole_reply() {
    // HTTP/1.0 style: the guest writes, shuts down its write side (nc does at stdin EOF), and
    // the server answers only after seeing that EOF.
    let server = EgressServer::start("half", Pace::Fast);
    let script = format!(
        "head -c 300000 /dev/urandom > /tmp/f; echo \"UPEOF 300000 $(sha256sum < /tmp/f | cut -d' ' -f1)\"; \
         r=$( (echo UPEOF; cat /tmp/f) | {NC}); echo \"REPLY $r\""
    );
    let o = run_vm(
        &["--egress", server.path_str(), "--timeout", "120"],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    let host = server.records();
    assert_eq!(host.len(), 1);
    // The server counted 6 header bytes ("UPEOF\n") that were not part of the file: strip them.
    let sent = lines_with(&out, "UPEOF ");
    assert_eq!(sent.len(), 1, "{out}");
    let guest_hash = sent[0].rsplit(' ').next().unwrap();
    let reply = lines_with(&out, "REPLY ");
    assert_eq!(
        reply,
        vec![format!("REPLY {}", host[0].rsplit(' ').next().unwrap())]
    );
    assert!(host[0].starts_with("UPEOF 300000 "), "{host:?}");
    assert_eq!(host[0].rsplit(' ').next().unwrap(), guest_hash);
}

#[test]
fn an_endpoint_that_dies_mid_stream_resets_that_stream_only() {
    let server = EgressServer::start("die", Pace::Fast);
    let log = server.dir.join("egress.jsonl");
    let script = format!(
        "(echo DIE; head -c 2000000 /dev/zero) | {NC} > /tmp/r; echo \"died: $(wc -c < /tmp/r) bytes back\"; \
         h=$(echo DOWN 4097 | {NC} | sha256sum | cut -d' ' -f1); echo \"DOWN 4097 $h\""
    );
    // amvm keeps running, and nothing of the run is left on the host afterwards.
    let o = amvm_tests::run_vm_leaving_nothing(
        &[
            "--egress",
            server.path_str(),
            "--egress-log",
            log.to_str().unwrap(),
        ],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(out.contains("died: 0 bytes back"), "{out}");
    assert!(
        out.contains(&format!(
            "DOWN 4097 {}",
            hex(&Sha256::digest(pattern(4097)))
        )),
        "the next stream works: {out}"
    );
    let log = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "one JSON line per stream: {log}");
    assert!(
        lines.iter().any(|l| l.contains("\"bytes_in\":4097")),
        "{log}"
    );
}

#[test]
fn every_http_request_of_a_keep_alive_stream_is_logged() {
    let server = EgressServer::start("http", Pace::Fast);
    let log = server.dir.join("egress.jsonl");
    let script = format!(
        "printf 'POST /v1/messages HTTP/1.1\\r\\nHost: api\\r\\nContent-Length: 5\\r\\n\\r\\nhello\
         GET /v1/models HTTP/1.1\\r\\nHost: api\\r\\n\\r\\n' | {UNIX}; echo"
    );
    let o = run_vm(
        &[
            "--egress",
            server.path_str(),
            "--egress-log",
            log.to_str().unwrap(),
        ],
        &["sh", "-c", &script],
    );
    assert_eq!(o.code, 0, "{o:?}");
    assert_eq!(o.stdout_str().matches("200 OK").count(), 2, "{o:?}");
    assert_eq!(server.records(), vec!["HTTP 2".to_string()]);
    let log = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3, "two request lines and the stream's: {log}");
    assert!(
        lines[0].contains("\"http_request\":\"POST /v1/messages HTTP/1.1\"")
            && lines[1].contains("\"http_request\":\"GET /v1/models HTTP/1.1\"")
            && lines[2].contains("\"http_requests\":2"),
        "{log}"
    );
}

#[test]
fn no_egress_flag_means_nothing_listens() {
    let o = run_vm(
        &[],
        &[
            "sh",
            "-c",
            "echo \"addr=[$AMVM_EGRESS_ADDR]\"; busybox nc 127.0.0.1 4700 < /dev/null; echo nc=$?",
        ],
    );
    assert_eq!(o.code, 0, "{o:?}");
    let out = o.stdout_str();
    assert!(out.contains("addr=[]"), "{out}");
    assert!(
        !out.contains("nc=0"),
        "something accepted a connection: {out}"
    );
}
