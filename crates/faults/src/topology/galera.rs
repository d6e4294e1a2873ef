//! The `galera` topology: not built yet.

use crate::scenarios::Env;

/// Settings of the `galera` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct GaleraArgs {}

/// Runs the `galera` scenario.
pub async fn run(_env: &Env, _args: &GaleraArgs) -> anyhow::Result<()> {
    anyhow::bail!("the galera topology is not built yet")
}
