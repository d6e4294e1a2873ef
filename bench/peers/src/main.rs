//! Side-by-side benchmark of the same handler unprotected, behind our `IdempotencyLayer`, behind
//! `axum-idempotent` and behind `idempotent`, in one process (see README.md).

mod load;
mod orders;
mod probe;
mod report;
mod server;
mod systems;

use clap::Parser;
use load::Target;
use probe::Probe;
use report::{Kind, Measured, Report};
use server::PoolSettings;
use std::{sync::Arc, time::Duration};
use systems::System;
use tokio::runtime::{Builder, Handle};

#[derive(Debug, Parser)]
#[command(about = "Throughput, replays and racers: our idempotency layer against its peers")]
struct Args {
    /// PostgreSQL (orders, our keys, axum-idempotent's sessions).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://idem:idem@127.0.0.1:5432/idem"
    )]
    database_url: String,
    /// Redis or Valkey (the `idempotent` store).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Measured seconds per cell (after a 0.5 s warm-up).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Rounds; each measures the baseline and every system, in a rotated order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Racer trials per system.
    #[arg(long, default_value_t = 200)]
    trials: usize,
    /// Racers per trial.
    #[arg(long, default_value_t = 16)]
    racers: usize,
    /// Concurrent clients of the many-clients cells.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Systems compared with the (always measured) baseline.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ours,ours-single-tx,ours-cached,axum-idempotent,idempotent"
    )]
    systems: Vec<System>,
    /// Every system's pool: `default` is sqlx's defaults (64 connections); `tuned` also skips
    /// sqlx's ping per checkout.
    #[arg(long, value_enum, default_value_t = PoolSettings::Default)]
    pool: PoolSettings,
}

/// The servers run on the main runtime; the load generator on its own (threads named
/// [`probe::LOAD_THREAD`]), so the servers' CPU is that of the other threads.
fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    server::set_pool_settings(args.pool);
    let load = Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(probe::LOAD_THREAD)
        .enable_all()
        .build()?;
    let servers = Builder::new_multi_thread().enable_all().build()?;
    servers.block_on(run(args, load.handle().clone()))
}

async fn run(args: Args, load: Handle) -> anyhow::Result<()> {
    let database_url = args.database_url.clone();
    let probe = Arc::new(
        load.spawn(async move { Probe::connect(&database_url).await })
            .await??,
    );
    if probe::load_threads() == 0 {
        anyhow::bail!(
            "no thread is named {:?}: the servers' CPU would include the load's",
            probe::LOAD_THREAD
        );
    }
    let config = systems::Config {
        database_url: args.database_url.clone(),
        redis_url: args.redis_url.clone(),
    };
    let baseline = Arc::new(Target::new(
        systems::start(System::Baseline, &config).await?,
    ));
    let mut peers = Vec::new();
    for system in dedup(&args.systems) {
        match systems::start(system, &config).await {
            Ok(server) => peers.push(Arc::new(Target::new(server))),
            Err(error) => eprintln!("skipping {system:?}: it did not start: {error:#}"),
        }
    }
    let measured = Duration::from_secs_f64(args.seconds);
    let fresh_kinds = [
        Kind::Fresh { clients: 1 },
        Kind::Fresh {
            clients: args.clients,
        },
    ];
    let replay_kind = Kind::Replay {
        clients: args.clients,
    };

    let mut results = Vec::new();
    for round in 0..args.rounds {
        let mut order = peers.clone();
        order.rotate_left(round % peers.len().max(1));
        for kind in fresh_kinds {
            for target in std::iter::once(&baseline).chain(&order) {
                results.push(measure(&load, &probe, round, target, kind, measured).await?);
            }
        }
        for target in &order {
            results.push(measure(&load, &probe, round, target, replay_kind, measured).await?);
        }
    }

    let mut races = Vec::new();
    for target in std::iter::once(&baseline).chain(&peers) {
        let name = target.server.name;
        let (target, racers, trials) = (target.clone(), args.racers, args.trials);
        let race = load
            .spawn(async move { load::race(&target, racers, trials).await })
            .await??;
        eprintln!(
            "racers {:>15}: doubled {} / {}, max {}",
            name, race.doubled, race.trials, race.max_executions
        );
        races.push((name, race));
    }

    let report = Report {
        pool: args.pool,
        statements: probe.counts_statements(),
        rounds: args.rounds,
        systems: peers.iter().map(|target| target.server.name).collect(),
        kinds: vec![fresh_kinds[0], fresh_kinds[1], replay_kind],
        measured: results,
        racers: args.racers,
        races,
    };
    println!("{}", report.markdown());
    Ok(())
}

/// Measures one cell on the load runtime and prints it as progress.
async fn measure(
    load: &Handle,
    probe: &Arc<Probe>,
    round: usize,
    target: &Arc<Target>,
    kind: Kind,
    measured: Duration,
) -> anyhow::Result<Measured> {
    let name = target.server.name;
    let (target, probe) = (target.clone(), probe.clone());
    let work = async move {
        anyhow::Ok(match kind {
            Kind::Fresh { clients } => {
                (load::fresh(&target, clients, measured, &probe).await?, None)
            }
            Kind::Replay { clients } => {
                let replay = load::replay(&target, clients, measured, &probe).await?;
                (replay.cell, Some(replay.new_rows))
            }
        })
    };
    let (cell, new_rows) = load.spawn(work).await??;
    let measured = Measured {
        round,
        system: name,
        kind,
        cell,
        new_rows,
    };
    eprintln!("{}", measured.line());
    Ok(measured)
}

/// The systems in their first order, without repeats or the baseline.
fn dedup(systems: &[System]) -> Vec<System> {
    let mut unique = Vec::new();
    for system in systems {
        if *system != System::Baseline && !unique.contains(system) {
            unique.push(*system);
        }
    }
    unique
}
