//! The `pg_failover` topology: not built yet.

use crate::scenarios::Env;

/// Settings of the `pg_failover` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct PgFailoverArgs {}

/// Runs the `pg_failover` scenario.
pub async fn run(_env: &Env, _args: &PgFailoverArgs) -> anyhow::Result<()> {
    anyhow::bail!("the pg_failover topology is not built yet")
}
