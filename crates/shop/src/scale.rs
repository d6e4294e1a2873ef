//! The benchmark at scale (PostgreSQL): the same scenarios as [`bench`](crate::bench) on a
//! near-empty key table, then with millions of completed keys in it, then while a retention
//! purge deletes a million expired ones. Everything runs in a scratch database created for the
//! run and dropped after it. Ratios are printed, never asserted.

use crate::{
    bench::{self, BenchArgs, Scenario, Worker},
    client::Client,
    cpu::Server,
};
use anyhow::Context;
use idempotency::{maintenance::Purge, PgStore};
use sqlx::{postgres::PgConnectOptions, ConnectOptions, Connection, PgConnection};
use std::{
    str::FromStr,
    sync::Arc,
    time::{Duration, Instant},
};

/// Options of the benchmark at scale.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// The scenarios, their seconds, rounds and concurrencies (`--no-sqlite` is implied).
    #[command(flatten)]
    pub bench: BenchArgs,
    /// Completed, unexpired keys written into the table before the second pass.
    #[arg(long, default_value_t = 10_000_000)]
    pub keys: u64,
    /// Expired keys the purge deletes while first requests are measured.
    #[arg(long, default_value_t = 1_000_000)]
    pub expired: u64,
}

/// Rows per INSERT when filling the table.
const FILL_CHUNK: u64 = 500_000;

/// A database created for one run, dropped by [`Scratch::drop_database`].
struct Scratch {
    admin: PgConnectOptions,
    name: String,
    url: String,
}

impl Scratch {
    async fn create(server_url: &str) -> anyhow::Result<Self> {
        let admin = PgConnectOptions::from_str(server_url)?;
        let name = format!(
            "shop_scale_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut conn = admin.connect().await?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .context("CREATE DATABASE (the user needs CREATEDB)")?;
        conn.close().await?;
        let url = admin.clone().database(&name).to_url_lossy().to_string();
        Ok(Self { admin, name, url })
    }

    async fn drop_database(self) -> anyhow::Result<()> {
        let mut conn = self.admin.connect().await?;
        sqlx::raw_sql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut conn)
        .await?;
        Ok(())
    }
}

/// Writes `count` completed keys of other users (random key text, a 200-byte result) that
/// expire `expires_in_secs` from now (negative: already expired), then `VACUUM ANALYZE`.
async fn fill(url: &str, count: u64, expires_in_secs: i64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut conn = PgConnection::connect(url).await?;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let result = vec![b'x'; 200];
    let mut from = 1u64;
    while from <= count {
        let to = (from + FILL_CHUNK - 1).min(count);
        sqlx::query(
            "INSERT INTO idempotency_keys
                (scope, operation, idem_key, state, effects, fingerprint, lease_token,
                 lease_until, result, expires_at)
             SELECT 'fill-' || (g % 100000), 'POST /purchases', md5($1 || g::text), 'completed',
                    'local', decode(md5(g::text), 'hex'), gen_random_uuid(), now(), $2,
                    now() + $3 * INTERVAL '1 second'
             FROM generate_series($4::BIGINT, $5::BIGINT) AS g",
        )
        .bind(&tag)
        .bind(&result)
        .bind(expires_in_secs)
        .bind(from as i64)
        .bind(to as i64)
        .execute(&mut conn)
        .await
        .context("filling the key table")?;
        from = to + 1;
    }
    sqlx::raw_sql("VACUUM ANALYZE idempotency_keys")
        .execute(&mut conn)
        .await?;
    Ok(started.elapsed())
}

/// The key table's rows and its size with indexes.
async fn table_size(url: &str) -> anyhow::Result<String> {
    let mut conn = PgConnection::connect(url).await?;
    let (rows, bytes): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM idempotency_keys),
                pg_total_relation_size('idempotency_keys')",
    )
    .fetch_one(&mut conn)
    .await?;
    Ok(format!(
        "{rows} rows, {:.0} MB with indexes",
        bytes as f64 / 1e6
    ))
}

/// p99 of first requests (ms), measured in one-second slices while `busy` says so.
async fn first_request_p99(
    client: &Client,
    workers: &Arc<[Worker]>,
    mut busy: impl FnMut(usize) -> bool,
) -> anyhow::Result<(f64, u64)> {
    client.take_latency();
    let mut requests = 0;
    let mut slice = 0;
    while busy(slice) {
        let second = Duration::from_secs(1);
        let tally = bench::measure(
            client,
            workers,
            Scenario::Protected,
            second,
            Server::Postgres,
        )
        .await?;
        requests += tally.requests;
        slice += 1;
    }
    let h = client.take_latency();
    Ok((h.value_at_quantile(0.99) as f64 / 1000.0, requests))
}

/// The first requests' p99 with no purge, then while [`Purge`] deletes `expired` keys.
async fn purge_pass(
    args: &ScaleArgs,
    url: &str,
    client: &Client,
    workers: &Arc<[Worker]>,
) -> anyhow::Result<()> {
    let filled = fill(url, args.expired, -3600).await?;
    println!(
        "scale: {} expired keys written in {:.0} s; table {}",
        args.expired,
        filled.as_secs_f64(),
        table_size(url).await?
    );
    let seconds = args.bench.seconds.ceil().max(1.0) as usize;
    let (quiet_p99, quiet_n) = first_request_p99(client, workers, |s| s < seconds).await?;
    let purge = Purge::new(PgStore::connect(url).await?);
    let purgeable = purge.count().await?;
    let purging = tokio::spawn({
        let purge = purge.clone();
        async move { purge.run(|_| {}).await }
    });
    let (busy_p99, busy_n) = first_request_p99(client, workers, |_| !purging.is_finished()).await?;
    let report = purging.await??;
    // The shop's own maintenance worker purges too: both share the expired rows.
    println!(
        "scale: c={}: first request p99 without a purge {quiet_p99:.2} ms ({quiet_n} requests); during the purge {busy_p99:.2} ms ({busy_n} requests) = {:.2}x (target <= 2); {purgeable} expired keys: this purge deleted {} in {} batches, {:.1} s (the shop's maintenance worker the rest), {} left",
        workers.len(),
        busy_p99 / quiet_p99,
        report.deleted,
        report.batches,
        report.elapsed.as_secs_f64(),
        purge.count().await?
    );
    Ok(())
}

/// Runs the benchmark at scale and prints the tables and ratios.
pub async fn run(args: ScaleArgs) -> anyhow::Result<()> {
    let server = args
        .bench
        .postgres_url
        .clone()
        .or_else(|| std::env::var("TEST_POSTGRES_URL").ok())
        .filter(|u| !u.is_empty())
        .context("pass --postgres-url or set TEST_POSTGRES_URL")?;
    let scratch = Scratch::create(&server).await?;
    let outcome = measure_at_scale(&args, &scratch.url).await;
    scratch.drop_database().await?;
    outcome
}

async fn measure_at_scale(args: &ScaleArgs, url: &str) -> anyhow::Result<()> {
    let (_running, client) = bench::start_shop(url, &args.bench).await?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut pools = Vec::new();
    let mut empty = Vec::new();
    bench::print_header(&format!(
        "PostgreSQL, key table: {}",
        table_size(url).await?
    ));
    for &concurrency in &args.bench.concurrency {
        let workers =
            bench::prepare(&client, &format!("{run}-c{concurrency}"), concurrency).await?;
        empty.push(
            bench::measure_concurrency(&client, &workers, &args.bench, "empty", Server::Postgres)
                .await?,
        );
        pools.push(workers);
    }
    let filled = fill(url, args.keys, 86_400).await?;
    let size = table_size(url).await?;
    println!(
        "\nscale: {} completed keys written in {:.0} s (with VACUUM ANALYZE)",
        args.keys,
        filled.as_secs_f64()
    );
    bench::print_header(&format!("PostgreSQL, key table: {size}"));
    for (workers, before) in pools.iter().zip(&empty) {
        let label = format!("{} keys", args.keys);
        let after =
            bench::measure_concurrency(&client, workers, &args.bench, &label, Server::Postgres)
                .await?;
        println!(
            "scale: c={}: with {} keys / empty: first request ratio {:.2} / {:.2} = {:.2}x, replay ratio {:.2} / {:.2} = {:.2}x (target >= 0.9 each)",
            workers.len(),
            args.keys,
            after.first_request,
            before.first_request,
            after.first_request / before.first_request,
            after.replay,
            before.replay,
            after.replay / before.replay
        );
    }
    let top = pools.last().context("no concurrency")?;
    purge_pass(args, url, &client, top).await
}
