//! `faults`: the fault proof of the demo shop on a real PostgreSQL. Each scenario starts real
//! `shop` processes, injects a fault, and checks from the database that nothing was charged twice
//! and no key was lost. Prints its counts and ends with `N passed, M failed`.
//!
//! ```text
//! cargo build --release -p shop -p idempotency-cli -p faults
//! TEST_POSTGRES_URL=postgres://idem:idem@127.0.0.1/idem target/release/faults \
//!     --shop-bin target/release/shop --idem-bin target/release/idem
//! ```

mod checks;
mod client;
mod scenarios;
mod shop_process;

use clap::{Parser, ValueEnum};
use std::{path::PathBuf, time::Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Kill9,
    LostAck,
    DbRestart,
    SlowWorker,
    Hostile,
    CrossTenant,
}

/// Fault proof: kill -9, lost COMMIT acknowledgements, database restarts, slow workers, hostile
/// input and cross-tenant keys, against real `shop` processes on PostgreSQL (TEST_POSTGRES_URL).
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
    /// SIGKILLs in the kill9 scenario.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Trials of the lost-ack, slow-worker and cross-tenant scenarios.
    #[arg(long, default_value_t = 10)]
    trials: usize,
    /// The shop's lease, in milliseconds.
    #[arg(long, default_value_t = 1500)]
    lease_ms: u64,
    /// Command controlling PostgreSQL, split on spaces; `stop` / `start` are appended
    /// (default: `pg_ctlcluster --skip-systemctl-redirect $PG_VERSION main`).
    #[arg(long, env = "FAULTS_POSTGRES_CTL")]
    postgres_ctl: Option<String>,
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
        postgres_ctl: ctl.split_whitespace().map(str::to_owned).collect(),
        lease_ms: args.lease_ms,
    };
    let all = [
        Scenario::Kill9,
        Scenario::LostAck,
        Scenario::DbRestart,
        Scenario::SlowWorker,
        Scenario::Hostile,
        Scenario::CrossTenant,
    ];
    let chosen: Vec<Scenario> = if args.only.is_empty() {
        all.to_vec()
    } else {
        args.only.clone()
    };
    let (mut passed, mut failed) = (0, 0);
    for scenario in chosen {
        let started = Instant::now();
        let result = match scenario {
            Scenario::Kill9 => scenarios::kill9(&env, args.kills).await,
            Scenario::LostAck => scenarios::lost_ack(&env, args.trials).await,
            Scenario::DbRestart => scenarios::db_restart(&env).await,
            Scenario::SlowWorker => scenarios::slow_worker(&env, args.trials.min(5)).await,
            Scenario::Hostile => scenarios::hostile(&env).await,
            Scenario::CrossTenant => scenarios::cross_tenant(&env, args.trials).await,
        };
        let took = started.elapsed().as_secs_f64();
        match result {
            Ok(()) => {
                passed += 1;
                println!("faults: {scenario:?}: ok ({took:.1}s)");
            }
            Err(e) => {
                failed += 1;
                println!("faults: {scenario:?}: FAILED ({took:.1}s): {e:#}");
            }
        }
    }
    println!("faults: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
