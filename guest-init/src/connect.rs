//! `amvm-connect`: the same binary as guest-init, run under another name (a symlink in the
//! initramfs). A small, exact client for the workload — `amvm-connect unix:PATH` or
//! `amvm-connect HOST:PORT` — that copies stdin to the socket, half-closes it at stdin's EOF,
//! and copies the socket to stdout until the peer closes. Busybox's `nc` cannot reach a unix
//! socket; this reaches the egress relay's one (`$AMVM_EGRESS_SOCK`).

use crate::egress::Client;
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;

/// Entry point; returns the process's exit status.
pub fn main(args: &[String]) -> i32 {
    let [target] = args else {
        eprintln!("usage: amvm-connect unix:PATH | HOST:PORT");
        return 2;
    };
    let stream = match target.strip_prefix("unix:") {
        Some(path) => UnixStream::connect(path).map(Client::Unix),
        None => TcpStream::connect(target.as_str()).map(Client::Tcp),
    };
    let mut stream = match stream {
        Ok(s) => s,
        Err(e) => {
            eprintln!("amvm-connect: {target}: {e}");
            return 1;
        }
    };
    let mut up = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("amvm-connect: {e}");
            return 1;
        }
    };
    std::thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        if let Err(e) = io::copy(&mut stdin, &mut up) {
            eprintln!("amvm-connect: sending: {e}");
        }
        up.shutdown(Shutdown::Write);
    });
    let mut stdout = io::stdout().lock();
    match io::copy(&mut stream, &mut stdout).and_then(|_| stdout.flush()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("amvm-connect: receiving: {e}");
            1
        }
    }
}
