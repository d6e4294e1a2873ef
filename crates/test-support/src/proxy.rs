//! A TCP proxy in front of PostgreSQL or MariaDB that injects faults a real network produces:
//!
//! * [`FaultProxy::cut_next_commit`]: the next `COMMIT` is forwarded to the server, its reply is
//!   swallowed, and the connection is cut: the client sees an I/O error although the commit
//!   happened (a lost COMMIT acknowledgement);
//! * [`FaultProxy::set_down`]: every connection is cut and new ones are refused, as while the
//!   database restarts.
//!
//! It understands just enough of the wire protocol to find a text-protocol `COMMIT`, which is how
//! sqlx commits: a simple-query message (`Q`) of PostgreSQL's v3 protocol, or a `COM_QUERY`
//! packet of the MySQL protocol ([`Protocol`]). Use `sslmode=disable` (PostgreSQL) or
//! `ssl-mode=disabled` (MariaDB) through it.
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

/// MySQL protocol: the `COM_QUERY` command byte (a text statement follows).
const COM_QUERY: u8 = 0x03;

/// Which wire protocol the proxy reads to find `COMMIT`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// PostgreSQL's frontend/backend protocol v3.
    Postgres,
    /// The MySQL client/server protocol (MariaDB), uncompressed.
    Mysql,
}

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
    /// Listens on a free loopback port and forwards to `upstream`, a PostgreSQL server.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        Self::start_for(upstream, Protocol::Postgres).await
    }

    /// Listens on a free loopback port and forwards to `upstream`, a server speaking `protocol`.
    pub async fn start_for(upstream: SocketAddr, protocol: Protocol) -> FaultProxy {
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
                        let relayed = relay(client, upstream, protocol, shared.clone(), down_rx.clone());
                        tokio::spawn(relayed);
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

/// Reads the next client message: its bytes, and whether it is a text `COMMIT`.
struct Reader {
    protocol: Protocol,
    /// PostgreSQL: still in the startup phase (messages without a type byte).
    startup: bool,
}

impl Reader {
    async fn next(
        &mut self,
        from: &mut (impl AsyncReadExt + Unpin),
    ) -> std::io::Result<(Vec<u8>, bool)> {
        match self.protocol {
            Protocol::Postgres if self.startup => {
                let mut len = [0u8; 4];
                from.read_exact(&mut len).await?;
                let len = u32::from_be_bytes(len) as usize;
                let mut body = vec![0u8; len.saturating_sub(4)];
                from.read_exact(&mut body).await?;
                let code = body
                    .get(..4)
                    .map(|c| u32::from_be_bytes(c.try_into().unwrap()));
                self.startup = matches!(code, Some(SSL_REQUEST | GSSENC_REQUEST));
                Ok(([(len as u32).to_be_bytes().to_vec(), body].concat(), false))
            }
            Protocol::Postgres => {
                let mut head = [0u8; 5];
                from.read_exact(&mut head).await?;
                let len = u32::from_be_bytes(head[1..].try_into().unwrap()) as usize;
                let mut body = vec![0u8; len.saturating_sub(4)];
                from.read_exact(&mut body).await?;
                let is_commit =
                    head[0] == b'Q' && is_commit_text(body.strip_suffix(&[0]).unwrap_or(&body));
                Ok(([head.to_vec(), body].concat(), is_commit))
            }
            Protocol::Mysql => {
                // A packet: 3-byte little-endian payload length, sequence id, payload. The
                // client's handshake packets never start with COM_QUERY and "COMMIT".
                let mut head = [0u8; 4];
                from.read_exact(&mut head).await?;
                let len = u32::from_le_bytes([head[0], head[1], head[2], 0]) as usize;
                let mut payload = vec![0u8; len];
                from.read_exact(&mut payload).await?;
                let is_commit = head[3] == 0
                    && payload.first() == Some(&COM_QUERY)
                    && is_commit_text(&payload[1..]);
                Ok(([head.to_vec(), payload].concat(), is_commit))
            }
        }
    }
}

fn is_commit_text(text: &[u8]) -> bool {
    std::str::from_utf8(text).is_ok_and(|q| q.trim().eq_ignore_ascii_case("COMMIT"))
}

async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    protocol: Protocol,
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
        let mut reader = Reader {
            protocol,
            startup: true,
        };
        loop {
            let (message, is_commit) = reader.next(&mut client_read).await?;
            if is_commit && take_one(&faults.cut_commits) {
                swallow.store(true, Ordering::SeqCst);
                server_write.write_all(&message).await?;
                server_write.flush().await?;
                faults.commits_cut.fetch_add(1, Ordering::SeqCst);
                // Give the server time to commit, then cut both sides.
                tokio::time::sleep(Duration::from_millis(300)).await;
                return Ok::<(), std::io::Error>(());
            }
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
