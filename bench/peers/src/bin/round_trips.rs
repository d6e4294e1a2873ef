//! What each step of a first request costs on PostgreSQL, one at a time (no concurrency): the
//! single-transaction mode's steps against the baseline's INSERT, and the reserving statement
//! against a plain INSERT of the same row (the price of bounding its lock wait).
//!
//! ```sh
//! cargo run --release --manifest-path bench/peers/Cargo.toml --ignore-rust-version \
//!     --bin round_trips -- [DATABASE_URL] [ITERATIONS]
//! ```

use idempotency::{
    Attempt, Fingerprint, Idempotency, IdempotencyKey, PgStore, Store, protocol::Begun,
};
use std::time::{Duration, Instant};

/// The same row as the reservation inserts, without `lock_timeout`.
const PLAIN_INSERT: &str = "INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until, expires_at)
    VALUES ($1, $2, $3, 'pending', 'local', $4, $5,
            now() + INTERVAL '10 seconds', now() + INTERVAL '1 day')
    ON CONFLICT (scope, operation, idem_key) DO NOTHING
    RETURNING true";

const ORDER: &str = "INSERT INTO round_trip_orders (body) VALUES ($1) RETURNING id";

/// Time spent per step, summed.
#[derive(Default)]
struct Steps {
    begin_reserved: Duration,
    order_in_tx: Duration,
    finish: Duration,
    baseline_insert: Duration,
    begin_alone: Duration,
    plain_reserve: Duration,
}

fn fresh_attempt() -> anyhow::Result<Attempt> {
    let key = IdempotencyKey::new(
        format!("round-trips-{}", uuid::Uuid::new_v4()),
        "order",
        "k",
    )?;
    Ok(Attempt::new(key, Fingerprint::of_bytes(b"body")))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "postgres://idem:idem@127.0.0.1:5432/idem".to_owned());
    let iterations: u32 = args.next().map(|n| n.parse()).transpose()?.unwrap_or(1000);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    let store = PgStore::new(pool.clone());
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS round_trip_orders (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&pool)
        .await?;
    let engine = Idempotency::new(store).with_single_transaction(Duration::from_secs(5));
    let mut steps = Steps::default();
    for _ in 0..iterations {
        let attempt = fresh_attempt()?;
        let started = Instant::now();
        let Begun::Acquired(lease, mut tx) = engine.begin_reserved(&attempt).await? else {
            anyhow::bail!("a fresh key was answered as a replay");
        };
        steps.begin_reserved += started.elapsed();
        let started = Instant::now();
        sqlx::query(ORDER).bind("x").fetch_one(&mut *tx).await?;
        steps.order_in_tx += started.elapsed();
        let started = Instant::now();
        lease.finish(tx, b"{}").await?;
        steps.finish += started.elapsed();
        let started = Instant::now();
        sqlx::query(ORDER).bind("x").fetch_one(&pool).await?;
        steps.baseline_insert += started.elapsed();

        let attempt = fresh_attempt()?;
        let started = Instant::now();
        let mut tx = engine.store().begin().await?;
        steps.begin_alone += started.elapsed();
        let started = Instant::now();
        sqlx::query(PLAIN_INSERT)
            .bind(attempt.key().scope())
            .bind(attempt.key().operation())
            .bind(attempt.key().key())
            .bind(attempt.fingerprint().as_bytes().as_slice())
            .bind(uuid::Uuid::new_v4())
            .fetch_one(&mut *tx)
            .await?;
        steps.plain_reserve += started.elapsed();
        tx.rollback().await?;
    }
    sqlx::query("DELETE FROM idempotency_keys WHERE scope LIKE 'round-trips-%'")
        .execute(&pool)
        .await?;
    let mean = |total: Duration| total.as_secs_f64() * 1e6 / f64::from(iterations);
    println!("mean of {iterations}, in µs:");
    let rows = [
        (
            "single transaction: BEGIN + the key's INSERT",
            steps.begin_reserved,
        ),
        (
            "single transaction: the handler's INSERT",
            steps.order_in_tx,
        ),
        ("single transaction: completion + COMMIT", steps.finish),
        (
            "baseline: INSERT in autocommit, with its commit",
            steps.baseline_insert,
        ),
        ("BEGIN alone (the store's, as above)", steps.begin_alone),
        (
            "a plain INSERT of the key row, in a transaction",
            steps.plain_reserve,
        ),
    ];
    for (step, total) in rows {
        println!("  {step:<50} {:7.1}", mean(total));
    }
    Ok(())
}
