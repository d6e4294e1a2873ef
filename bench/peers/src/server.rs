//! What a running system looks like to the load generator, and how it is served.

use crate::orders::Orders;
use axum::{Router, http::request::Parts, routing::get};
use sqlx::{PgPool, postgres::PgPoolOptions};
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

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

/// How every system's pool is set up (`--pool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolSettings {
    /// sqlx's defaults, as a user who passes their own pool has: only the size is set.
    Default,
    /// The same without sqlx's ping per checkout (`test_before_acquire(false)`).
    Tuned,
}

impl PoolSettings {
    /// What the report's header says.
    pub fn describe(self) -> &'static str {
        match self {
            PoolSettings::Default => {
                "`default` (sqlx's defaults: 64 connections, ping per checkout; idle timeout 30 s)"
            }
            PoolSettings::Tuned => {
                "`tuned` (64 connections, no ping per checkout: `test_before_acquire(false)`; idle timeout 30 s)"
            }
        }
    }
}

/// Whether the pools are [`PoolSettings::Tuned`].
static TUNED: AtomicBool = AtomicBool::new(false);

/// Sets the settings of the pools made after it.
pub fn set_pool_settings(settings: PoolSettings) {
    TUNED.store(settings == PoolSettings::Tuned, Ordering::Relaxed);
}

/// A pool of [`POOL_SIZE`] connections, with sqlx's defaults or tuned ([`set_pool_settings`]).
/// Connections idle for 30 s close, so the systems not being measured do not hold PostgreSQL
/// connections (six systems of 64 would pass `max_connections`).
pub async fn pool(database_url: &str) -> sqlx::Result<PgPool> {
    let options = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .idle_timeout(Duration::from_secs(30));
    let options = if TUNED.load(Ordering::Relaxed) {
        options.test_before_acquire(false)
    } else {
        options
    };
    options.connect(database_url).await
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
