//! `shop`: the demo service (default), its retry storm (`shop storm`) and its benchmark
//! (`shop bench`).

use clap::{Parser, Subcommand};
use shop::{
    app,
    bench::{self, BenchArgs},
    providers::Faults,
    scale::{self, ScaleArgs},
    state::Config,
    storm::{self, StormArgs},
    worker::{self, WorkerArgs},
};
use std::{io::Write, time::Duration};

/// The demo shop: purchases, orders, points and e-mails, protected against duplicate requests.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hammer the shop with duplicated requests and check every ledger.
    Storm(StormArgs),
    /// Measure the middleware's cost against the same handler without it.
    Bench(BenchArgs),
    /// The benchmark on PostgreSQL with millions of keys in the table, and during a purge.
    Scale(ScaleArgs),
    /// Consume the purchase events (points and receipts) from RabbitMQ, exactly once each.
    Worker(WorkerArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// `sqlite://FILE` (created if missing), `postgres://USER:PASS@HOST/DB` or
    /// `mysql://USER:PASS@HOST/DB` (MariaDB).
    #[arg(long, env = "SHOP_DATABASE_URL", default_value = "sqlite://shop.db")]
    database_url: String,
    /// Where the simulated payment and mail providers keep their state (the same kinds of URL;
    /// default: the shop's database). Outside services keep theirs outside the shop's database:
    /// `faults --topology pg-failover` puts them on another server than the one that fails over.
    #[arg(long, env = "SHOP_PROVIDER_DATABASE_URL")]
    provider_database_url: Option<String>,
    /// Probability that a payment provider call fails (half of the failures after charging).
    #[arg(long, default_value_t = 0.0, value_parser = rate)]
    payment_fail_rate: f64,
    /// Latency of each payment provider call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    payment_latency_ms: u64,
    /// Probability that a mail provider call fails (half of the failures after sending).
    #[arg(long, default_value_t = 0.0, value_parser = rate)]
    mail_fail_rate: f64,
    /// How long a request may go without a sign of life, in milliseconds, before a retry may
    /// take its idempotency key over (purchases, orders) or the recovery job may resolve it
    /// (e-mails). A live request's lease is extended every third of it (see `--no-heartbeat`).
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// Do not extend held leases while requests work: a request that works longer than
    /// `--lease-ms` loses its key to a retry, as a frozen process would (`faults slow-worker`).
    #[arg(long)]
    no_heartbeat: bool,
    /// Answer replays of purchases this process completed from memory, keeping at most this
    /// many results (`Idempotency::with_replay_cache`; default: off). Do not use it where an
    /// operator may delete keys by hand.
    #[arg(long)]
    replay_cache: Option<usize>,
    /// Pause between passes of the maintenance worker, in milliseconds: it carries purchases
    /// whose client or process went away to their end, releases abandoned keys and purges expired
    /// ones.
    #[arg(long, default_value_t = 1_000)]
    worker_interval_ms: u64,
    /// Hand the allocator's free pages back to the kernel every this many milliseconds (glibc
    /// keeps them otherwise; see `shop::heap`); 0 never does.
    #[arg(long, default_value_t = 2_000)]
    heap_trim_ms: u64,
    /// Run no maintenance worker (another process runs it, or `idem recover` does).
    #[arg(long)]
    no_worker: bool,
    /// How long, in milliseconds, a duplicate of a keyed request still in flight waits for it and
    /// then answers with its stored response instead of a 409 (0: 409 at once).
    #[arg(long, default_value_t = 0)]
    wait_for_in_flight_ms: u64,
    /// Keyed orders (`POST /orders`, local work) reserve their key inside the business
    /// transaction (`Idempotency::with_single_transaction`), a duplicate waiting for the holder's
    /// commit at most this many milliseconds (0: off). PostgreSQL and MariaDB.
    #[arg(long, default_value_t = 0)]
    single_transaction_ms: u64,
    /// Write each paid purchase's event into the outbox and relay it to this RabbitMQ broker
    /// (`amqp://USER:PASS@HOST:PORT/VHOST`), for `shop worker`; on a cluster, the
    /// comma-separated URLs of its nodes, tried in turn on each reconnection.
    #[arg(long, env = "SHOP_AMQP_URL")]
    amqp_url: Option<String>,
    /// Declare the purchase events' queues as quorum queues (a RabbitMQ cluster; `shop worker`
    /// must say the same).
    #[arg(long, env = "SHOP_AMQP_QUORUM_QUEUES")]
    amqp_quorum_queues: bool,
    /// Also consume the purchase events in this process (what `shop worker` does), so that one
    /// command runs the shop and its worker; needs `--amqp-url`.
    #[arg(long, requires = "amqp_url")]
    consume: bool,
    /// Share of outbox rows published twice on purpose (fault proof).
    #[arg(long, default_value_t = 0.0, value_parser = rate, hide = true)]
    outbox_duplicate_share: f64,
    /// Also mount `POST /unprotected/purchases` (the purchase handler without the idempotency middleware).
    #[arg(long, hide = true)]
    bench_routes: bool,
    /// Serve `POST /purchases` without the idempotency middleware (a deliberately broken shop, to
    /// show that the storm catches double charges).
    #[arg(long, hide = true)]
    unguarded_purchases: bool,
}

fn rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a probability between 0 and 1"))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx::query=error,shop=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Storm(args)) => storm::run(args).await,
        Some(Command::Bench(args)) => bench::run(args).await,
        Some(Command::Scale(args)) => scale::run(args).await,
        Some(Command::Worker(args)) => worker::run(args).await,
        None => serve(cli.serve).await,
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::new(&args.database_url);
    config.provider_database_url = args.provider_database_url.clone();
    config.payment = Faults {
        fail_rate: args.payment_fail_rate,
        latency: Duration::from_millis(args.payment_latency_ms),
    };
    config.mail = Faults {
        fail_rate: args.mail_fail_rate,
        latency: Duration::ZERO,
    };
    config.bench_routes = args.bench_routes;
    config.unguarded_purchases = args.unguarded_purchases;
    config.lease = Duration::from_millis(args.lease_ms);
    config.heartbeat = !args.no_heartbeat;
    config.replay_cache = args.replay_cache;
    config.worker_interval =
        (!args.no_worker).then(|| Duration::from_millis(args.worker_interval_ms.max(10)));
    config.wait_for_in_flight =
        (args.wait_for_in_flight_ms > 0).then(|| Duration::from_millis(args.wait_for_in_flight_ms));
    config.single_transaction =
        (args.single_transaction_ms > 0).then(|| Duration::from_millis(args.single_transaction_ms));
    config.amqp_url = args.amqp_url.clone();
    config.amqp_quorum_queues = args.amqp_quorum_queues;
    config.outbox_duplicate_share = args.outbox_duplicate_share;
    let running = app::start(&config, &args.listen).await?;
    let _trimming = (args.heap_trim_ms > 0)
        .then(|| shop::heap::trim_periodically(Duration::from_millis(args.heap_trim_ms)));
    if let (true, Some(amqp_url)) = (args.consume, args.amqp_url.clone()) {
        let consuming = WorkerArgs {
            database_url: args.database_url.clone(),
            provider_database_url: args.provider_database_url.clone(),
            amqp_url,
            amqp_quorum_queues: args.amqp_quorum_queues,
            prefetch: 32,
            concurrency: 8,
            mail_fail_rate: args.mail_fail_rate,
            lease_ms: args.lease_ms,
        };
        tokio::spawn(async move {
            if let Err(error) = worker::run(consuming).await {
                tracing::error!(
                    error = format!("{error:#}"),
                    "the in-process worker stopped"
                );
            }
        });
    }
    let url = running.url();
    let database = args
        .database_url
        .rsplit('@')
        .next()
        .unwrap_or(&args.database_url);
    let mut out = std::io::stdout().lock();
    writeln!(out, "shop listening on {url} (database {database})")?;
    writeln!(
        out,
        "try: curl -i -X POST {url}/purchases -H 'X-User-Id: alice' -H \"Idempotency-Key: $(uuidgen)\" -H 'Content-Type: application/json' -d '{{\"sku\": \"tea\", \"quantity\": 2}}'"
    )?;
    out.flush()?;
    drop(out);
    shutdown_signal().await;
    let mut running = running;
    running.stop_worker().await;
    drop(running);
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
