//! The benchmark: in one run and on one database, the protected `POST /purchases` against the
//! same handler without the idempotency middleware (`POST /unprotected/purchases`), and a replay against a plain
//! indexed read (`GET /orders/{id}`), at each concurrency, on SQLite, MariaDB and PostgreSQL. The
//! four scenarios are interleaved in rounds so drifts (cache warm-up, autovacuum, the other
//! tenants of the machine) hit them alike; the ratios are printed, never asserted.
//!
//! Beside throughput and latency, each scenario reports the CPU seconds per 1,000 requests of the
//! database server's processes and of the shop ([`cpu`](crate::cpu)): the load generator runs on
//! its own runtime, whose threads are left out of the shop's figure.

use crate::{
    app,
    client::{Call, Client},
    cpu::{self, Sample, Server, Spent},
    state::Config,
};
use anyhow::{bail, Context};
use futures_util::future::join_all;
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::{
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, OnceLock,
    },
    time::{Duration, Instant},
};
use tokio::runtime::{Builder, Runtime};

/// Options of the benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// PostgreSQL database to measure on (default: `$TEST_POSTGRES_URL`; skipped when neither).
    #[arg(long)]
    pub postgres_url: Option<String>,
    /// MariaDB database to measure on (default: `$TEST_MYSQL_URL`; skipped when neither).
    #[arg(long)]
    pub mysql_url: Option<String>,
    /// Skip SQLite.
    #[arg(long)]
    pub no_sqlite: bool,
    /// Skip MariaDB.
    #[arg(long)]
    pub no_mysql: bool,
    /// Skip PostgreSQL.
    #[arg(long)]
    pub no_postgres: bool,
    /// Measured seconds per scenario and concurrency (split over the rounds).
    #[arg(long, default_value_t = 4.0)]
    pub seconds: f64,
    /// Rounds the scenarios are interleaved in.
    #[arg(long, default_value_t = 4)]
    pub rounds: u32,
    /// Concurrent clients (repeatable).
    #[arg(long = "concurrency", default_values_t = vec![1, 32])]
    pub concurrency: Vec<usize>,
    /// Answer replays of results the shop completed from memory, at most this many
    /// (`Idempotency::with_replay_cache`); default: off, every replay reads the database.
    #[arg(long)]
    pub replay_cache: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    Protected,
    Unprotected,
    Replay,
    Read,
}

impl Scenario {
    const ALL: [Scenario; 4] = [
        Scenario::Protected,
        Scenario::Unprotected,
        Scenario::Replay,
        Scenario::Read,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Protected => "POST /purchases (middleware, first request)",
            Scenario::Unprotected => "POST /unprotected/purchases (no middleware)",
            Scenario::Replay => "POST /purchases (middleware, replay)",
            Scenario::Read => "GET /orders/{id} (plain indexed read)",
        }
    }
}

/// Per-worker fixtures: its own user, and keys/orders to replay and read.
pub(crate) struct Worker {
    user: String,
    replay_keys: Vec<String>,
    order_ids: Vec<i64>,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    pub(crate) requests: u64,
    seconds: f64,
    spent: Spent,
}

/// The load generator's runtime: its threads are named [`cpu::LOAD_THREAD`], so the shop's CPU
/// (the main runtime's) leaves them out. It lives as long as the process.
static LOAD: OnceLock<Runtime> = OnceLock::new();

/// Runs `work` on the load generator's runtime: its requests, and the connections they open.
async fn on_load<T: Send + 'static>(
    work: impl Future<Output = anyhow::Result<T>> + Send + 'static,
) -> anyhow::Result<T> {
    let runtime = LOAD.get_or_init(|| {
        Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(cpu::LOAD_THREAD)
            .enable_all()
            .build()
            .expect("the load generator's runtime")
    });
    runtime
        .spawn(work)
        .await
        .context("the load generator failed")?
}

/// Makes each worker's fixtures (on the load generator's runtime).
pub(crate) async fn prepare(
    client: &Client,
    run: &str,
    workers: usize,
) -> anyhow::Result<Arc<[Worker]>> {
    let (client, run) = (client.clone(), run.to_owned());
    Ok(
        on_load(async move { prepare_here(&client, &run, workers).await })
            .await?
            .into(),
    )
}

async fn prepare_here(client: &Client, run: &str, workers: usize) -> anyhow::Result<Vec<Worker>> {
    let body = json!({"sku": "pencil", "quantity": 1});
    let mut out = Vec::new();
    for w in 0..workers {
        let user = format!("bench-{run}-{w}");
        let mut worker = Worker {
            user,
            replay_keys: Vec::new(),
            order_ids: Vec::new(),
        };
        for _ in 0..8 {
            let key = uuid::Uuid::new_v4().to_string();
            let a = client
                .send(0, &Call::post("/purchases", &worker.user, &body).key(&key))
                .await?;
            if a.status != StatusCode::CREATED {
                bail!("bench fixture purchase failed: {} {}", a.status, a.body);
            }
            worker
                .order_ids
                .push(a.body["order_id"].as_i64().unwrap_or_default());
            worker.replay_keys.push(key);
        }
        out.push(worker);
    }
    Ok(out)
}

/// Runs one scenario for `duration` with one task per worker on the load generator's runtime;
/// returns completed requests and the CPU `server` and the shop spent meanwhile.
pub(crate) async fn measure(
    client: &Client,
    workers: &Arc<[Worker]>,
    scenario: Scenario,
    duration: Duration,
    server: Server,
) -> anyhow::Result<Tally> {
    let (client, workers) = (client.clone(), workers.clone());
    on_load(async move {
        let start = Sample::take(server);
        let mut tally = measure_here(&client, &workers, scenario, duration).await?;
        tally.spent = start.until(&Sample::take(server));
        Ok(tally)
    })
    .await
}

async fn measure_here(
    client: &Client,
    workers: &[Worker],
    scenario: Scenario,
    duration: Duration,
) -> anyhow::Result<Tally> {
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let body: Value = json!({"sku": "pencil", "quantity": 1});
    let started = Instant::now();
    let timer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(duration).await;
            stop.store(true, Ordering::Relaxed);
        })
    };
    let counts = join_all(workers.iter().enumerate().map(|(w, worker)| {
        let stop = stop.clone();
        let failures = failures.clone();
        let body = &body;
        async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let i = n as usize;
                let (answer, want) = match scenario {
                    Scenario::Protected => {
                        let key = uuid::Uuid::new_v4().to_string();
                        let call = Call::post("/purchases", &worker.user, body).key(&key);
                        (client.send(w, &call).await, StatusCode::CREATED)
                    }
                    Scenario::Unprotected => {
                        let call = Call::post("/unprotected/purchases", &worker.user, body);
                        (client.send(w, &call).await, StatusCode::CREATED)
                    }
                    Scenario::Replay => {
                        let key = &worker.replay_keys[i % worker.replay_keys.len()];
                        let call = Call::post("/purchases", &worker.user, body).key(key);
                        (client.send(w, &call).await, StatusCode::CREATED)
                    }
                    Scenario::Read => {
                        let id = worker.order_ids[i % worker.order_ids.len()];
                        let call = Call::get(format!("/orders/{id}"), &worker.user);
                        (client.send(w, &call).await, StatusCode::OK)
                    }
                };
                match answer {
                    Ok(a) if a.status == want => {}
                    Ok(a) => {
                        tracing::warn!(status = %a.status, body = %a.body, "bench request failed");
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "bench request failed");
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
                n += 1;
            }
            n
        }
    }))
    .await;
    let seconds = started.elapsed().as_secs_f64();
    timer.abort();
    let failed = failures.load(Ordering::Relaxed);
    if failed > 0 {
        bail!("{failed} requests of {} failed", scenario.name());
    }
    Ok(Tally {
        requests: counts.iter().sum(),
        seconds,
        spent: Spent::default(),
    })
}

/// The ratios of one concurrency: first request / unprotected, replay / plain read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ratios {
    pub(crate) first_request: f64,
    pub(crate) replay: f64,
}

/// The four scenarios at one concurrency, interleaved in rounds; prints their table rows and
/// returns the ratios.
pub(crate) async fn measure_concurrency(
    client: &Client,
    workers: &Arc<[Worker]>,
    args: &BenchArgs,
    label: &str,
    server: Server,
) -> anyhow::Result<Ratios> {
    let concurrency = workers.len();
    // Warm-up, not counted.
    for scenario in Scenario::ALL {
        measure(
            client,
            workers,
            scenario,
            Duration::from_millis(300),
            server,
        )
        .await?;
    }
    client.take_latency();
    let mut tallies = [Tally::default(); 4];
    let mut histograms: Vec<Option<hdrhistogram::Histogram<u64>>> = vec![None; 4];
    let slice = Duration::from_secs_f64(args.seconds / f64::from(args.rounds.max(1)));
    for _ in 0..args.rounds.max(1) {
        for (i, scenario) in Scenario::ALL.into_iter().enumerate() {
            let t = measure(client, workers, scenario, slice, server).await?;
            tallies[i].requests += t.requests;
            tallies[i].seconds += t.seconds;
            tallies[i].spent += t.spent;
            let h = client.take_latency();
            match &mut histograms[i] {
                Some(acc) => acc.add(&h).context("merging histograms")?,
                slot => *slot = Some(h),
            }
        }
    }
    let rate = |i: usize| tallies[i].requests as f64 / tallies[i].seconds;
    let per_1000 = |i: usize| {
        let thousands = tallies[i].requests.max(1) as f64 / 1000.0;
        let spent = tallies[i].spent;
        (
            spent.database.map(|s| s / thousands),
            spent.shop / thousands,
        )
    };
    for (i, scenario) in Scenario::ALL.into_iter().enumerate() {
        let h = histograms[i].as_ref().expect("measured");
        let (database, shop) = per_1000(i);
        println!(
            "{:<46} {:>5} {:>10.0} {:>9.2} {:>9.2} {:>10} {:>10.3}",
            scenario.name(),
            concurrency,
            rate(i),
            h.value_at_quantile(0.5) as f64 / 1000.0,
            h.value_at_quantile(0.99) as f64 / 1000.0,
            database.map_or_else(|| "-".to_owned(), |s| format!("{s:.3}")),
            shop
        );
    }
    let ratios = Ratios {
        first_request: rate(0) / rate(1),
        replay: rate(2) / rate(3),
    };
    println!(
        "{label} c={concurrency}: first request / unprotected = {:.2}x (target >= 0.6), replay / plain read = {:.2}x (target >= 0.9)",
        ratios.first_request, ratios.replay
    );
    let ((database, shop), (database_floor, shop_floor)) = (per_1000(0), per_1000(1));
    let database = match (database, database_floor) {
        (Some(d), Some(f)) => format!("database {d:.3} / {f:.3} = {:.2}x", d / f),
        _ if server == Server::InProcess => "database: in the shop".to_owned(),
        _ => "database: n/a (no server process visible)".to_owned(),
    };
    println!(
        "{label} c={concurrency}: CPU s per 1,000 first requests vs unprotected: {database}, shop {shop:.3} / {shop_floor:.3} = {:.2}x",
        shop / shop_floor
    );
    Ok(ratios)
}

/// Prints the table header.
pub(crate) fn print_header(label: &str) {
    println!("\n== {label} ==");
    println!(
        "{:<46} {:>5} {:>10} {:>9} {:>9} {:>10} {:>10}",
        "scenario", "conc", "req/s", "p50 ms", "p99 ms", "db CPU", "shop CPU"
    );
}

/// Starts the shop on `url` with the bench routes.
pub(crate) async fn start_shop(
    url: &str,
    args: &BenchArgs,
) -> anyhow::Result<(app::Running, Client)> {
    let mut config = Config::new(url);
    config.bench_routes = true;
    config.max_connections = 40;
    config.replay_cache = args.replay_cache;
    let running = app::start(&config, "127.0.0.1:0").await?;
    let client = Client::new(vec![running.url()]);
    Ok((running, client))
}

async fn bench_backend(
    label: &str,
    url: &str,
    args: &BenchArgs,
    server: Server,
) -> anyhow::Result<()> {
    let (_running, client) = start_shop(url, args).await?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    print_header(label);
    for &concurrency in &args.concurrency {
        let workers = prepare(&client, &format!("{run}-c{concurrency}"), concurrency).await?;
        measure_concurrency(&client, &workers, args, label, server).await?;
    }
    Ok(())
}

/// `given`, else the environment variable `var`, unless empty.
fn url_or_env(given: &Option<String>, var: &str) -> Option<String> {
    given
        .clone()
        .or_else(|| std::env::var(var).ok())
        .filter(|u| !u.is_empty())
}

/// Runs the benchmark and prints the tables and ratios.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    println!(
        "bench: {} s per scenario and concurrency, in {} interleaved rounds; concurrency {:?}",
        args.seconds, args.rounds, args.concurrency
    );
    println!(
        "CPU: utime + stime from /proc, in s per 1,000 requests, of the database server's processes \
         (postgres; mariadbd or mysqld; none for SQLite, which runs in the shop) and of the shop's \
         threads but the load generator's"
    );
    on_load(async { Ok(()) }).await?;
    if cpu::load_threads() == 0 {
        println!(
            "no thread is named {:?}: the shop's CPU includes the load generator's",
            cpu::LOAD_THREAD
        );
    }
    if !args.no_sqlite {
        let dir = tempfile::tempdir()?;
        let url = format!("sqlite://{}", dir.path().join("bench.db").display());
        bench_backend("SQLite (file, WAL)", &url, &args, Server::InProcess).await?;
    }
    if !args.no_mysql {
        match url_or_env(&args.mysql_url, "TEST_MYSQL_URL") {
            Some(url) => bench_backend("MariaDB", &url, &args, Server::MariaDb).await?,
            None => println!("\nMariaDB skipped: pass --mysql-url or set TEST_MYSQL_URL"),
        }
    }
    if !args.no_postgres {
        match url_or_env(&args.postgres_url, "TEST_POSTGRES_URL") {
            Some(url) => bench_backend("PostgreSQL", &url, &args, Server::Postgres).await?,
            None => println!("\nPostgreSQL skipped: pass --postgres-url or set TEST_POSTGRES_URL"),
        }
    }
    Ok(())
}
