//! The `pgbouncer` topology: not built yet.

use crate::scenarios::Env;

/// Settings of the `pgbouncer` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct PgbouncerArgs {}

/// Runs the `pgbouncer` scenario.
pub async fn run(_env: &Env, _args: &PgbouncerArgs) -> anyhow::Result<()> {
    anyhow::bail!("the pgbouncer topology is not built yet")
}
