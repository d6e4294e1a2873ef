//! Production topologies (`faults --topology NAME`): the same promise on the engines users run
//! beyond one database server. Each topology's engines are started by its script in
//! `.ci/topology/` (`up` and `down`), which the scenario also uses to kill, promote or restart
//! a node; `docs/deployment.md` says, per topology, the settings it needs and what it
//! guarantees.

mod galera;
mod pg_failover;
mod pgbouncer;
mod rabbitmq_cluster;

use crate::scenarios::Env;

pub use galera::GaleraArgs;
pub use pg_failover::PgFailoverArgs;
pub use pgbouncer::PgbouncerArgs;
pub use rabbitmq_cluster::RabbitmqClusterArgs;

/// A deployment topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Topology {
    /// A PostgreSQL primary and a streaming standby; the primary is SIGKILLed mid-traffic and the
    /// standby promoted (synchronous, then asynchronous replication).
    PgFailover,
    /// PostgreSQL behind PgBouncer in transaction pooling mode.
    Pgbouncer,
    /// A three-node MariaDB Galera cluster; shops on different nodes; one node SIGKILLed and
    /// rejoined.
    Galera,
    /// Three RabbitMQ nodes with quorum queues; one node killed and restarted mid-traffic.
    RabbitmqCluster,
}

/// Every topology's own settings.
#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    #[command(flatten)]
    pub pg_failover: PgFailoverArgs,
    #[command(flatten)]
    pub pgbouncer: PgbouncerArgs,
    #[command(flatten)]
    pub galera: GaleraArgs,
    #[command(flatten)]
    pub rabbitmq_cluster: RabbitmqClusterArgs,
}

/// Runs one topology's scenario.
pub async fn run(env: &Env, args: &TopologyArgs, topology: Topology) -> anyhow::Result<()> {
    match topology {
        Topology::PgFailover => pg_failover::run(env, &args.pg_failover).await,
        Topology::Pgbouncer => pgbouncer::run(env, &args.pgbouncer).await,
        Topology::Galera => galera::run(env, &args.galera).await,
        Topology::RabbitmqCluster => rabbitmq_cluster::run(env, &args.rabbitmq_cluster).await,
    }
}
