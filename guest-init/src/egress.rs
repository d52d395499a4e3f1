//! The egress relay: the workload's only way out of the guest. guest-init listens on
//! 127.0.0.1:[`EGRESS_TCP_PORT`] and on the unix socket [`EGRESS_SOCK`], exports both to the
//! workload (`AMVM_EGRESS_ADDR`, `AMVM_EGRESS_SOCK`), and splices every accepted connection to
//! a vsock stream to the host's [`EGRESS_PORT`] — both directions, with half-close passed
//! through (EOF one way becomes `shutdown(SHUT_WR)` the same way). Without `--egress` nothing
//! listens.

use crate::channel::vsock_connect;
use guest_init::protocol::EGRESS_PORT;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};

/// The TCP port on the guest's loopback.
pub const EGRESS_TCP_PORT: u16 = 4700;
/// The unix socket in the guest.
pub const EGRESS_SOCK: &str = "/run/amvm/egress.sock";

/// Start listening (on `lo`, which main brings up first); returns the variables the workload gets.
pub fn start() -> io::Result<Vec<(String, String)>> {
    let tcp = TcpListener::bind(("127.0.0.1", EGRESS_TCP_PORT))?;
    std::fs::create_dir_all("/run/amvm")?;
    let unix = UnixListener::bind(EGRESS_SOCK)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(EGRESS_SOCK, std::fs::Permissions::from_mode(0o666))?;
    std::thread::Builder::new()
        .name("egress-tcp".into())
        .spawn(move || {
            for client in tcp.incoming().flatten() {
                let _ = client.set_nodelay(true);
                spawn_relay(Client::Tcp(client));
            }
        })?;
    std::thread::Builder::new()
        .name("egress-unix".into())
        .spawn(move || {
            for client in unix.incoming().flatten() {
                spawn_relay(Client::Unix(client));
            }
        })?;
    Ok(vec![
        (
            "AMVM_EGRESS_ADDR".into(),
            format!("127.0.0.1:{EGRESS_TCP_PORT}"),
        ),
        ("AMVM_EGRESS_SOCK".into(), EGRESS_SOCK.into()),
    ])
}

/// A workload-side stream socket: an accepted relay connection, or amvm-connect's own.
pub(crate) enum Client {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Client {
    pub(crate) fn try_clone(&self) -> io::Result<Client> {
        Ok(match self {
            Client::Tcp(s) => Client::Tcp(s.try_clone()?),
            Client::Unix(s) => Client::Unix(s.try_clone()?),
        })
    }
    pub(crate) fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Client::Tcp(s) => s.shutdown(how),
            Client::Unix(s) => s.shutdown(how),
        };
    }
}

impl Read for Client {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Client::Tcp(s) => s.read(buf),
            Client::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Client {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Client::Tcp(s) => s.write(buf),
            Client::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn spawn_relay(client: Client) {
    let _ = std::thread::Builder::new()
        .name("egress".into())
        .spawn(move || {
            // The vsock stream, held as a UnixStream: both are connected stream sockets, and
            // read/write/shutdown/dup are the same system calls for either family.
            let host = match vsock_connect(2, EGRESS_PORT) {
                Ok(fd) => UnixStream::from(fd),
                Err(_) => {
                    client.shutdown(Shutdown::Both);
                    return;
                }
            };
            let (Ok(client_r), Ok(host_w)) = (client.try_clone(), host.try_clone()) else {
                return;
            };
            let up = std::thread::spawn(move || {
                pump(client_r, host_w, |h: &UnixStream| {
                    h.shutdown(Shutdown::Write)
                })
            });
            pump(host, client, |c: &Client| {
                c.shutdown(Shutdown::Write);
                Ok(())
            });
            let _ = up.join();
        });
}

/// Copy `from` to `to` until EOF, then half-close `to`. On an error both ends are shut down,
/// so the other direction ends too and the workload sees the failure.
fn pump<R: Read, W: Write>(mut from: R, mut to: W, half_close: impl Fn(&W) -> io::Result<()>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => {
                let _ = half_close(&to);
                return;
            }
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
