//! The `rabbitmq_cluster` topology: not built yet.

use crate::scenarios::Env;

/// Settings of the `rabbitmq_cluster` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct RabbitmqClusterArgs {}

/// Runs the `rabbitmq_cluster` scenario.
pub async fn run(_env: &Env, _args: &RabbitmqClusterArgs) -> anyhow::Result<()> {
    anyhow::bail!("the rabbitmq_cluster topology is not built yet")
}
