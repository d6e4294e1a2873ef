//! Side-by-side benchmark of the same handler unprotected, behind our `IdempotencyLayer`, behind
//! `axum-idempotent` and behind `idempotent`, in one process (see README.md).

mod load;
mod orders;
mod report;
mod server;
mod systems;

use clap::Parser;
use load::Target;
use report::{Kind, Measured, Report};
use std::{sync::Arc, time::Duration};
use systems::System;

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
    /// Every pool hands out connections without sqlx's ping per checkout (one round trip less
    /// per acquisition, for every system alike).
    #[arg(long)]
    no_ping_on_acquire: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    server::set_ping_on_acquire(!args.no_ping_on_acquire);
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
                results.push(measure(round, target, kind, measured).await?);
            }
        }
        for target in &order {
            results.push(measure(round, target, replay_kind, measured).await?);
        }
    }

    let mut races = Vec::new();
    for target in std::iter::once(&baseline).chain(&peers) {
        let race = load::race(target, args.racers, args.trials).await?;
        eprintln!(
            "racers {:>15}: doubled {} / {}, max {}",
            target.server.name, race.doubled, race.trials, race.max_executions
        );
        races.push((target.server.name, race));
    }

    let report = Report {
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

/// Measures one cell and prints it as progress.
async fn measure(
    round: usize,
    target: &Arc<Target>,
    kind: Kind,
    measured: Duration,
) -> anyhow::Result<Measured> {
    let (cell, new_rows) = match kind {
        Kind::Fresh { clients } => (load::fresh(target, clients, measured).await?, None),
        Kind::Replay { clients } => {
            let replay = load::replay(target, clients, measured).await?;
            (replay.cell, Some(replay.new_rows))
        }
    };
    let measured = Measured {
        round,
        system: target.server.name,
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
