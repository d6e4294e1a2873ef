//! The systems under test, each started on its own port with its own pool and order table.

mod axum_idempotent;
mod baseline;
mod idempotent;
mod ours;

use crate::server::Server;

/// A system to measure. The baseline is always measured; the others are chosen with `--systems`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum System {
    /// The handler alone.
    #[value(skip)]
    Baseline,
    /// `idempotency_http::IdempotencyLayer` on `idempotency::PgStore`.
    Ours,
    /// The same, with the opt-in in-process replay cache (`Idempotency::with_replay_cache`).
    OursCached,
    /// The same, in the opt-in single-transaction mode (`Idempotency::with_single_transaction`):
    /// the key row is written inside the handler's transaction.
    OursSingleTx,
    /// The `axum-idempotent` crate, on `ruts` sessions in PostgreSQL.
    AxumIdempotent,
    /// The `idempotent` crate, its tower middleware on its Valkey/Redis store.
    Idempotent,
}

/// Where the stores live.
pub struct Config {
    pub database_url: String,
    pub redis_url: String,
}

/// Starts `system` in the background.
pub async fn start(system: System, config: &Config) -> anyhow::Result<Server> {
    match system {
        System::Baseline => baseline::start(&config.database_url).await,
        System::Ours => ours::start(&config.database_url, ours::Mode::Plain).await,
        System::OursCached => ours::start(&config.database_url, ours::Mode::Cached).await,
        System::OursSingleTx => ours::start(&config.database_url, ours::Mode::SingleTx).await,
        System::AxumIdempotent => axum_idempotent::start(&config.database_url).await,
        System::Idempotent => idempotent::start(&config.database_url, &config.redis_url).await,
    }
}
