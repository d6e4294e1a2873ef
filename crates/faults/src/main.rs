//! `faults`: the fault proof of the demo shop on a real PostgreSQL, a real MariaDB and SQLite
//! (`--backend`; `lost-ack`, `db-restart` and `db-crash` need a database server and run on
//! PostgreSQL and MariaDB; `consumer-kill9` runs its shop on PostgreSQL and needs RabbitMQ at
//! `TEST_AMQP_URL`; `disk-full` runs on SQLite and needs root to mount a tmpfs). Each scenario
//! starts real `shop` processes, injects a fault, lets the shop's worker settle what the clients
//! left, and checks from the databases that nothing was charged twice, no key was lost or left
//! pending, every charge belongs to a paid order or was refunded, and (SQLite) `PRAGMA
//! integrity_check` answers `ok`; `abandon` also reads, with `idem keys history`, the history of
//! the purchases killed mid-charge and finished by the restarted shop. Prints its counts and
//! ends with `N passed, M failed`.
//!
//! ```text
//! cargo build --release -p shop -p idempotency-cli -p faults
//! TEST_POSTGRES_URL=postgres://idem:idem@127.0.0.1/idem target/release/faults \
//!     --shop-bin target/release/shop --idem-bin target/release/idem --backend postgres
//! target/release/faults --backend sqlite
//! TEST_MYSQL_URL=mysql://idem:idem@127.0.0.1/idem target/release/faults --backend mysql
//! ```

mod checks;
mod client;
mod command;
mod consumer_kill9;
mod db;
mod disk_full;
mod history;
mod scenarios;
mod shop_process;
mod topology;

use clap::{Parser, ValueEnum};
use scenarios::{ShopDatabase, Shutdown};
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Kill9,
    LostAck,
    DbRestart,
    DbCrash,
    SlowWorker,
    Hostile,
    CrossTenant,
    Abandon,
    ConsumerKill9,
    DiskFull,
}

impl Scenario {
    /// Whether the scenario runs on `backend`: a lost COMMIT acknowledgement and a database
    /// restart or crash need a database server; the queue consumer's scenario runs its shop on
    /// PostgreSQL; a full disk is made under the SQLite files.
    fn runs_on(self, backend: ShopDatabase) -> bool {
        match self {
            Scenario::LostAck | Scenario::DbRestart | Scenario::DbCrash => backend.is_server(),
            Scenario::ConsumerKill9 => backend == ShopDatabase::Postgres,
            // A full disk under the shop's own files: a tmpfs this process mounts.
            Scenario::DiskFull => backend == ShopDatabase::Sqlite,
            _ => true,
        }
    }
}

/// Fault proof: kill -9, lost COMMIT acknowledgements, database restarts, slow workers, hostile
/// input, cross-tenant keys and abandoned purchases, against real `shop` processes on PostgreSQL
/// (TEST_POSTGRES_URL), MariaDB (TEST_MYSQL_URL) and SQLite.
#[derive(Debug, Parser)]
struct Args {
    /// The `shop` binary.
    #[arg(long, default_value = "target/release/shop")]
    shop_bin: PathBuf,
    /// The `idem` binary.
    #[arg(long, default_value = "target/release/idem")]
    idem_bin: PathBuf,
    /// Scenarios to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// Backends to run them on (default: postgres, mysql and sqlite). A scenario that needs a
    /// database server is not run on SQLite.
    #[arg(long, value_enum, value_delimiter = ',')]
    backend: Vec<ShopDatabase>,
    /// SIGKILLs in the kill9 scenario.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Trials of the lost-ack, slow-worker and cross-tenant scenarios.
    #[arg(long, default_value_t = 10)]
    trials: usize,
    /// The shop's lease, in milliseconds.
    #[arg(long, default_value_t = 1500)]
    lease_ms: u64,
    /// Pause between the shop's maintenance worker passes, in milliseconds.
    #[arg(long, default_value_t = 200)]
    worker_interval_ms: u64,
    /// SIGKILLs per run of the abandon scenario.
    #[arg(long, default_value_t = 10)]
    abandon_kills: usize,
    /// How long the shop's worker may take to settle every key once the traffic stopped, in
    /// seconds.
    #[arg(long, default_value_t = 90)]
    settle_limit_secs: u64,
    /// An extra argument for the shops of the abandon scenario (repeatable), e.g.
    /// `--abandon-shop-arg=--no-worker` to see the scenario fail without the worker.
    #[arg(long, allow_hyphen_values = true, hide = true)]
    abandon_shop_arg: Vec<String>,
    /// Purchase events of the consumer-kill9 scenario (each variant).
    #[arg(long, default_value_t = 1000)]
    consumer_messages: usize,
    /// SIGKILLs of `shop worker` in the consumer-kill9 scenario (each variant).
    #[arg(long, default_value_t = 12)]
    consumer_kills: usize,
    /// Command controlling RabbitMQ, split on spaces; `stop_app` / `start_app` are appended.
    #[arg(
        long,
        env = "FAULTS_RABBITMQ_CTL",
        default_value = "env RABBITMQ_NODENAME=rabbit@localhost ERL_EPMD_ADDRESS=127.0.0.1 rabbitmqctl -q"
    )]
    rabbitmq_ctl: String,
    /// Command controlling PostgreSQL, split on spaces; `stop` / `start` / `stop -m immediate`
    /// (the crash) are appended (default: `pg_ctlcluster --skip-systemctl-redirect $PG_VERSION
    /// main`).
    #[arg(long, env = "FAULTS_POSTGRES_CTL")]
    postgres_ctl: Option<String>,
    /// Command controlling MariaDB, split on spaces; `stop` / `start` / `crash` (SIGKILL) are
    /// appended (CI starts MariaDB without systemd, through this script).
    #[arg(
        long,
        env = "FAULTS_MYSQL_CTL",
        default_value = "bash .ci/mariadb-ctl.sh"
    )]
    mysql_ctl: String,
    /// Production topologies to run instead of the scenarios (their engines are started by
    /// `.ci/topology/NAME.sh up`).
    #[arg(long, value_enum, value_delimiter = ',')]
    topology: Vec<topology::Topology>,
    #[command(flatten)]
    topology_args: topology::TopologyArgs,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let version = std::env::var("PG_VERSION").unwrap_or_else(|_| "15".into());
    let ctl = args
        .postgres_ctl
        .clone()
        .unwrap_or_else(|| format!("pg_ctlcluster --skip-systemctl-redirect {version} main"));
    let env = scenarios::Env {
        shop_bin: args.shop_bin.clone(),
        idem_bin: args.idem_bin.clone(),
        postgres_ctl: command::words(&ctl),
        mysql_ctl: command::words(&args.mysql_ctl),
        lease_ms: args.lease_ms,
        worker_interval_ms: args.worker_interval_ms,
        settle_limit: Duration::from_secs(args.settle_limit_secs),
        abandon_shop_args: args.abandon_shop_arg.clone(),
    };
    if !args.topology.is_empty() {
        run_topologies(&env, &args).await;
    }
    let all = [
        Scenario::Kill9,
        Scenario::LostAck,
        Scenario::DbRestart,
        Scenario::DbCrash,
        Scenario::SlowWorker,
        Scenario::Hostile,
        Scenario::CrossTenant,
        Scenario::Abandon,
        Scenario::ConsumerKill9,
        Scenario::DiskFull,
    ];
    let rabbitmq_ctl = command::words(&args.rabbitmq_ctl);
    let chosen: Vec<Scenario> = if args.only.is_empty() {
        all.to_vec()
    } else {
        args.only.clone()
    };
    let backends: Vec<ShopDatabase> = if args.backend.is_empty() {
        vec![
            ShopDatabase::Postgres,
            ShopDatabase::Mysql,
            ShopDatabase::Sqlite,
        ]
    } else {
        args.backend.clone()
    };
    let (mut passed, mut failed) = (0, 0);
    for scenario in chosen {
        for &backend in &backends {
            if !scenario.runs_on(backend) {
                println!("faults: {scenario:?} on {backend}: not applicable");
                continue;
            }
            let started = Instant::now();
            let result = run(&args, &env, &rabbitmq_ctl, scenario, backend).await;
            let took = started.elapsed().as_secs_f64();
            match result {
                Ok(()) => {
                    passed += 1;
                    println!("faults: {scenario:?} on {backend}: ok ({took:.1}s)");
                }
                Err(e) => {
                    failed += 1;
                    println!("faults: {scenario:?} on {backend}: FAILED ({took:.1}s): {e:#}");
                }
            }
        }
    }
    println!("faults: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// Runs the chosen topologies, prints `N passed, M failed`, and exits.
async fn run_topologies(env: &scenarios::Env, args: &Args) -> ! {
    let (mut passed, mut failed) = (0, 0);
    for &chosen in &args.topology {
        let started = Instant::now();
        let result = topology::run(env, &args.topology_args, chosen).await;
        let took = started.elapsed().as_secs_f64();
        match result {
            Ok(()) => {
                passed += 1;
                println!("faults: topology {chosen:?}: ok ({took:.1}s)");
            }
            Err(e) => {
                failed += 1;
                println!("faults: topology {chosen:?}: FAILED ({took:.1}s): {e:#}");
            }
        }
    }
    println!("faults: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

/// Runs one scenario on one backend.
async fn run(
    args: &Args,
    env: &scenarios::Env,
    rabbitmq_ctl: &[String],
    scenario: Scenario,
    backend: ShopDatabase,
) -> anyhow::Result<()> {
    match scenario {
        Scenario::Kill9 => scenarios::kill9(env, backend, args.kills).await,
        Scenario::LostAck => scenarios::lost_ack(env, backend, args.trials).await,
        Scenario::DbRestart => scenarios::db_restart(env, backend, Shutdown::Clean).await,
        Scenario::DbCrash => scenarios::db_restart(env, backend, Shutdown::Crash).await,
        Scenario::SlowWorker => scenarios::slow_worker(env, backend, args.trials.min(5)).await,
        Scenario::Hostile => scenarios::hostile(env, backend).await,
        Scenario::CrossTenant => scenarios::cross_tenant(env, backend, args.trials).await,
        Scenario::Abandon => scenarios::abandon(env, backend, args.abandon_kills).await,
        Scenario::DiskFull => disk_full::disk_full(env).await,
        Scenario::ConsumerKill9 => {
            for broker_restart in [false, true] {
                let plan = consumer_kill9::Plan {
                    messages: args.consumer_messages,
                    kills: args.consumer_kills,
                    broker_restart,
                };
                consumer_kill9::consumer_kill9(env, plan, rabbitmq_ctl).await?;
            }
            Ok(())
        }
    }
}
