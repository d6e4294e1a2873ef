//! A TCP proxy in front of PostgreSQL that injects faults a real network produces:
//!
//! * [`FaultProxy::cut_next_commit`]: the next `COMMIT` is forwarded to the server, its reply is
//!   swallowed, and the connection is cut: the client sees an I/O error although the commit
//!   happened (a lost COMMIT acknowledgement);
//! * [`FaultProxy::set_down`]: every connection is cut and new ones are refused, as while the
//!   database restarts.
//!
//! It understands just enough of the PostgreSQL wire protocol (v3) to find simple-query `COMMIT`
//! messages, which is how sqlx commits. Use `sslmode=disable` through it.
//!
//! ```no_run
//! # async fn demo() {
//! let proxy = test_support::proxy::FaultProxy::start("127.0.0.1:5432".parse().unwrap()).await;
//! let url = format!("postgres://idem:idem@{}/idem?sslmode=disable", proxy.addr());
//! proxy.cut_next_commit();
//! # }
//! ```

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

/// SSLRequest and GSSENCRequest codes: startup-phase messages after which another startup follows.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

#[derive(Debug, Default)]
struct Faults {
    cut_commits: AtomicUsize,
    commits_cut: AtomicUsize,
    connections: AtomicUsize,
}

/// A running proxy; it stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: Arc<Faults>,
    down: watch::Sender<bool>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let faults = Arc::new(Faults::default());
        let (down, down_rx) = watch::channel(false);
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = faults.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        if *down_rx.borrow() {
                            drop(client);
                            continue;
                        }
                        shared.connections.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(relay(client, upstream, shared.clone(), down_rx.clone()));
                    }
                }
            }
        });
        FaultProxy {
            addr,
            faults,
            down,
            _stop: stop,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Arms one lost acknowledgement: the next `COMMIT` (on any connection) reaches the server,
    /// but its reply never reaches the client, whose connection is then cut.
    pub fn cut_next_commit(&self) {
        self.faults.cut_commits.fetch_add(1, Ordering::SeqCst);
    }

    /// How many COMMIT replies were swallowed so far.
    pub fn commits_cut(&self) -> usize {
        self.faults.commits_cut.load(Ordering::SeqCst)
    }

    /// How many connections were accepted so far.
    pub fn connections(&self) -> usize {
        self.faults.connections.load(Ordering::SeqCst)
    }

    /// `true`: cut every open connection and refuse new ones; `false`: accept again.
    pub fn set_down(&self, down: bool) {
        let _ = self.down.send(down);
    }
}

async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    faults: Arc<Faults>,
    mut down: watch::Receiver<bool>,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let swallow = AtomicBool::new(false);

    // Client → server, message by message, watching for COMMIT.
    let upward = async {
        let mut startup = true;
        loop {
            let message = if startup {
                let mut len = [0u8; 4];
                client_read.read_exact(&mut len).await?;
                let len = u32::from_be_bytes(len) as usize;
                let mut body = vec![0u8; len.saturating_sub(4)];
                client_read.read_exact(&mut body).await?;
                let code = body
                    .get(..4)
                    .map(|c| u32::from_be_bytes(c.try_into().unwrap()));
                startup = matches!(code, Some(SSL_REQUEST | GSSENC_REQUEST));
                [(len as u32).to_be_bytes().to_vec(), body].concat()
            } else {
                let mut head = [0u8; 5];
                client_read.read_exact(&mut head).await?;
                let len = u32::from_be_bytes(head[1..].try_into().unwrap()) as usize;
                let mut body = vec![0u8; len.saturating_sub(4)];
                client_read.read_exact(&mut body).await?;
                let is_commit = head[0] == b'Q'
                    && std::str::from_utf8(body.strip_suffix(&[0]).unwrap_or(&body))
                        .is_ok_and(|q| q.trim().eq_ignore_ascii_case("COMMIT"));
                if is_commit && take_one(&faults.cut_commits) {
                    swallow.store(true, Ordering::SeqCst);
                    server_write.write_all(&head).await?;
                    server_write.write_all(&body).await?;
                    server_write.flush().await?;
                    faults.commits_cut.fetch_add(1, Ordering::SeqCst);
                    // Give the server time to commit, then cut both sides.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return Ok::<(), std::io::Error>(());
                }
                [head.to_vec(), body].concat()
            };
            server_write.write_all(&message).await?;
        }
    };

    // Server → client, byte for byte, unless the reply is being swallowed.
    let downward = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
            if !swallow.load(Ordering::SeqCst) {
                client_write.write_all(&buf[..n]).await?;
            }
        }
    };

    let went_down = async {
        while !*down.borrow() {
            if down.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };

    tokio::select! {
        _ = upward => {}
        _ = downward => {}
        _ = went_down => {}
    }
}

fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}
