//! The `pgbouncer` topology: the shop on PostgreSQL behind PgBouncer in transaction pooling mode
//! (`.ci/topology/pgbouncer.sh up`: 127.0.0.1:6432 in front of the server of
//! `TEST_POSTGRES_URL`). Each phase runs on a fresh database (`topo_pgb_…`, created on the server
//! directly) that the shops, the storm and `idem` reach only through PgBouncer:
//!
//! 1. the retry storm with two shop processes (`shop storm --processes 2`);
//! 2. durable purchases while one shop is SIGKILLed again and again, a second shop's worker
//!    resuming what the killed one left;
//! 3. double clicks sent to two shops waiting for requests in flight (no 409 may reach a client);
//! 4. keyed orders in the single-transaction mode, double clicks across the two shops.
//!
//! After each phase the databases are read directly: no purchase charged twice, no key pending,
//! no answer the client got lost; and every server connection PgBouncer holds for the phase's
//! database is visited (all at once, one transaction each) to check that no session setting
//! leaked out of a transaction (`lock_timeout`, `statement_timeout` are the server's defaults),
//! and that no prepared statement or `LISTEN` was left there.

mod phases;
mod sessions;

use crate::scenarios::Env;
use anyhow::{Context, Result};
use sqlx::{Connection, Executor};
use std::time::Instant;

/// Settings of the `pgbouncer` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct PgbouncerArgs {
    /// PgBouncer's address (transaction pooling), as `.ci/topology/pgbouncer.sh up` starts it.
    #[arg(long, default_value = "127.0.0.1:6432")]
    pub pgbouncer_addr: String,
    /// Users of the storm phase (each sends `--pgbouncer-storm-operations` logical operations).
    #[arg(long, default_value_t = 12)]
    pub pgbouncer_storm_users: u64,
    /// Logical operations per user in the storm phase.
    #[arg(long, default_value_t = 10)]
    pub pgbouncer_storm_operations: u64,
    /// SIGKILLs of a shop in the durable-purchase phase.
    #[arg(long, default_value_t = 10)]
    pub pgbouncer_kills: usize,
    /// Double clicks (keys) of the in-flight and single-transaction phases, each.
    #[arg(long, default_value_t = 40)]
    pub pgbouncer_double_clicks: usize,
    /// Shows that the checks catch their faults: `leak` sets `lock_timeout` for the session on
    /// a server connection before the session check; `no-wait` runs the in-flight phase without
    /// the wait.
    #[arg(long, hide = true)]
    pub pgbouncer_break: Option<Breakage>,
}

/// A fault put in on purpose, to see a check fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Breakage {
    /// A session `SET lock_timeout` through PgBouncer, as a leaking library would do.
    Leak,
    /// Shops without the wait for requests in flight.
    NoWait,
}

/// PgBouncer and the PostgreSQL server behind it.
pub(super) struct Bouncer {
    /// `postgres://USER:PASS@HOST:PORT/DB` of the server itself (`TEST_POSTGRES_URL`).
    server: String,
    /// PgBouncer's `HOST:PORT`.
    addr: String,
    breakage: Option<Breakage>,
}

/// A phase's fresh database, reached directly or through PgBouncer.
pub(super) struct PhaseDb {
    /// The database's name.
    pub name: String,
    /// Through the server itself (for the checks).
    pub direct: String,
    /// Through PgBouncer (for the shops, the storm and `idem`).
    pub pooled: String,
}

/// `url` with its `HOST:PORT` and database replaced.
fn with_address(url: &str, addr: Option<&str>, database: &str) -> Result<String> {
    let (scheme, rest) = url.split_once("://").context("a URL with a scheme")?;
    let (credentials, location) = rest.rsplit_once('@').context("a URL with a user")?;
    let host = location.split(['/', '?']).next().unwrap_or(location);
    Ok(format!(
        "{scheme}://{credentials}@{}/{database}",
        addr.unwrap_or(host)
    ))
}

impl Bouncer {
    fn new(args: &PgbouncerArgs) -> Self {
        Bouncer {
            server: std::env::var("TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://idem:idem@127.0.0.1:5432/idem".into()),
            addr: args.pgbouncer_addr.clone(),
            breakage: args.pgbouncer_break,
        }
    }

    /// Creates `topo_pgb_PHASE_…` on the server.
    pub(super) async fn fresh(&self, phase: &str) -> Result<PhaseDb> {
        let name = format!(
            "topo_pgb_{phase}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut admin = sqlx::PgConnection::connect(&self.server)
            .await
            .with_context(|| format!("connecting to {} (TEST_POSTGRES_URL)", self.server))?;
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        admin.close().await?;
        Ok(PhaseDb {
            direct: with_address(&self.server, None, &name)?,
            pooled: with_address(&self.server, Some(&self.addr), &name)?,
            name,
        })
    }

    /// `psql` arguments for PgBouncer's admin console (database `pgbouncer`).
    pub(super) fn admin_url(&self) -> Result<String> {
        with_address(&self.server, Some(&self.addr), "pgbouncer")
    }
}

/// Runs the `pgbouncer` scenario.
pub async fn run(env: &Env, args: &PgbouncerArgs) -> Result<()> {
    let bouncer = Bouncer::new(args);
    sessions::ensure_transaction_pooling(&bouncer).await?;
    let started = Instant::now();
    phases::storm(env, &bouncer, args).await.context("storm")?;
    phases::durable_kills(env, &bouncer, args.pgbouncer_kills)
        .await
        .context("durable purchases with kills")?;
    phases::in_flight(env, &bouncer, args.pgbouncer_double_clicks)
        .await
        .context("waiting for requests in flight")?;
    phases::single_transaction(env, &bouncer, args.pgbouncer_double_clicks)
        .await
        .context("single-transaction mode")?;
    println!(
        "faults: pgbouncer: 4 phases through PgBouncer (transaction pooling) in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::with_address;

    #[test]
    fn addresses_are_replaced() {
        let url = "postgres://idem:idem@127.0.0.1:5432/idem";
        assert_eq!(
            with_address(url, Some("127.0.0.1:6432"), "x").unwrap(),
            "postgres://idem:idem@127.0.0.1:6432/x"
        );
        assert_eq!(
            with_address(url, None, "y").unwrap(),
            "postgres://idem:idem@127.0.0.1:5432/y"
        );
    }
}
