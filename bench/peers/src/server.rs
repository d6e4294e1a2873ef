//! What a running system looks like to the load generator, and how it is served.

use crate::orders::Orders;
use axum::{Router, http::request::Parts, routing::get};
use sqlx::{PgPool, postgres::PgPoolOptions};
use std::time::Duration;

/// PostgreSQL connections per system.
pub const POOL_SIZE: u32 = 64;

/// A system serving `POST /orders` on its own loopback port.
pub struct Server {
    /// The name in the report.
    pub name: &'static str,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// Its order table, to count what the handler really did.
    pub orders: Orders,
    /// Whether a client must first `POST /login` and send the session cookie back
    /// (axum-idempotent keeps responses in the caller's session).
    pub login: bool,
}

/// Whether every pool pings a connection before handing it out (sqlx's default, `true`).
static PING_ON_ACQUIRE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`PING_ON_ACQUIRE`] for the pools made after it (`--no-ping-on-acquire`).
pub fn set_ping_on_acquire(ping: bool) {
    PING_ON_ACQUIRE.store(ping, std::sync::atomic::Ordering::Relaxed);
}

/// A pool of [`POOL_SIZE`] connections. Connections idle for 30 s close, so the
/// systems not being measured do not hold PostgreSQL connections.
pub async fn pool(database_url: &str) -> sqlx::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .test_before_acquire(PING_ON_ACQUIRE.load(std::sync::atomic::Ordering::Relaxed))
        .idle_timeout(Duration::from_secs(30))
        .connect(database_url)
        .await
}

/// Serves `router`, plus `GET /health` (to open connections before a race), on a fresh
/// loopback port in the background; returns its base URL.
pub async fn serve(router: Router) -> std::io::Result<String> {
    let router = router.route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(url)
}

/// Prefix of every user the load generator sends (`x-user`), so a run can find its old keys.
pub const USER_PREFIX: &str = "peers-";

/// The caller, from the `x-user` header: the idempotency scope of our layer and of
/// `idempotent`.
pub fn user(parts: &Parts) -> Option<String> {
    parts
        .headers
        .get("x-user")?
        .to_str()
        .ok()
        .map(str::to_owned)
}
