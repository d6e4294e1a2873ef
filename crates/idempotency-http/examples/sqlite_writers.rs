//! SQLite's single writer under the layer (issue 16, item 2): first requests against the same
//! handler without the layer, and how long concurrent new keys wait for the writer.
//!
//! ```text
//! cargo run --release -p idempotency-http --features sqlite --example sqlite_writers -- \
//!     [SECONDS] [ROUNDS] [TRIALS]
//! ```
//!
//! The handler inserts one row and works 5 ms (a sleep) inside its transaction, then answers
//! 201. Unprotected, it runs its own write transaction on the store's writer connection;
//! protected, it writes through [`IdempotentTx`], so the key's completion commits with its row.
//! Both read and write one WAL-mode file in a temporary folder.
//!
//! It prints, from one run:
//! * fresh keys, one client: requests per second with and without the layer, per round (the
//!   order alternates) and the ratio of the sums;
//! * TRIALS (default 100) trials of 4 concurrent requests, each with a new key: every
//!   request's latency and its wait (the latency less the 5 ms of work), as p50, p99 and the
//!   maximum, and how many waited more than 50 ms.

use axum::{http::StatusCode, routing::post, Router};
use idempotency::{Idempotency, SqliteStore, Store};
use idempotency_http::{IdempotencyLayer, IdempotentTx};
use sqlx::Sqlite;
use std::time::{Duration, Instant};

/// The business work inside the transaction.
const WORK: Duration = Duration::from_millis(5);
/// Concurrent new keys per trial.
const RACERS: usize = 4;
/// The longest acceptable wait of a first request.
const WAIT_BOUND: Duration = Duration::from_millis(50);

async fn protected(mut tx: IdempotentTx<Sqlite>, body: String) -> StatusCode {
    sqlx::query("INSERT INTO orders (body) VALUES (?1)")
        .bind(body)
        .execute(&mut **tx)
        .await
        .expect("insert");
    tokio::time::sleep(WORK).await;
    StatusCode::CREATED
}

async fn unprotected(
    axum::extract::State(store): axum::extract::State<SqliteStore>,
    body: String,
) -> StatusCode {
    let mut tx = store
        .writer()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("begin");
    sqlx::query("INSERT INTO orders (body) VALUES (?1)")
        .bind(body)
        .execute(&mut *tx)
        .await
        .expect("insert");
    tokio::time::sleep(WORK).await;
    tx.commit().await.expect("commit");
    StatusCode::CREATED
}

/// Sends one first request (a new key when `protect`), returning its latency.
async fn send(client: &reqwest::Client, base: &str, protect: bool, n: u64) -> Duration {
    let started = Instant::now();
    let path = if protect { "protected" } else { "plain" };
    let response = client
        .post(format!("{base}/{path}"))
        .header("x-user", "bench")
        .header("idempotency-key", format!("k-{}-{n}", uuid::Uuid::new_v4()))
        .header("content-type", "text/plain")
        .body(format!("order {n}"))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::CREATED, "{path}");
    started.elapsed()
}

/// Requests per second of one client sending first requests for `seconds`.
async fn throughput(client: &reqwest::Client, base: &str, protect: bool, seconds: f64) -> f64 {
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        send(client, base, protect, sent).await;
        sent += 1;
    }
    sent as f64 / started.elapsed().as_secs_f64()
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: SECONDS ROUNDS TRIALS"))
        .collect();
    let seconds = args.first().copied().unwrap_or(3.0);
    let rounds = args.get(1).copied().unwrap_or(3.0) as usize;
    let trials = args.get(2).copied().unwrap_or(100.0) as usize;

    let dir = tempfile::tempdir()?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("bench.db").display()
    );
    let store = SqliteStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, body TEXT NOT NULL)")
        .execute(store.writer())
        .await?;
    let layer = IdempotencyLayer::new(Idempotency::new(store.clone())).with_scope_from(|parts| {
        parts
            .headers
            .get("x-user")?
            .to_str()
            .ok()
            .map(str::to_owned)
    });
    let app = Router::new()
        .route("/protected", post(protected))
        .route_layer(layer)
        .route("/plain", post(unprotected))
        .with_state(store.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();

    // Fresh keys, one client, alternating which goes first.
    let (mut plain_sum, mut protected_sum) = (0.0, 0.0);
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        let mut rates = [0.0; 2];
        for protect in order {
            rates[usize::from(protect)] = throughput(&client, &base, protect, seconds).await;
        }
        plain_sum += rates[0];
        protected_sum += rates[1];
        println!(
            "sqlite: round {}: fresh key, 1 client: unprotected {:.0} req/s, with the layer {:.0} req/s ({:.2}x)",
            round + 1,
            rates[0],
            rates[1],
            rates[1] / rates[0]
        );
    }
    println!(
        "sqlite: fresh key, 1 client, {rounds} rounds of {seconds} s: {:.2}x the unprotected handler",
        protected_sum / plain_sum
    );

    // Concurrent new keys: each request's latency and its wait beyond its own work.
    let mut latencies = Vec::with_capacity(trials * RACERS);
    for trial in 0..trials {
        let racers = (0..RACERS).map(|i| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(
                async move { send(&client, &base, true, (trial * RACERS + i) as u64).await },
            )
        });
        for racer in racers.collect::<Vec<_>>() {
            latencies.push(racer.await?);
        }
    }
    latencies.sort();
    let waits: Vec<Duration> = latencies.iter().map(|l| l.saturating_sub(WORK)).collect();
    let over = waits.iter().filter(|w| **w > WAIT_BOUND).count();
    println!(
        "sqlite: {trials} trials of {RACERS} concurrent new keys ({} requests), work {} ms: latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; wait p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; waits over {} ms: {over}",
        latencies.len(),
        WORK.as_millis(),
        millis(quantile(&latencies, 0.5)),
        millis(quantile(&latencies, 0.99)),
        millis(latencies[latencies.len() - 1]),
        millis(quantile(&waits, 0.5)),
        millis(quantile(&waits, 0.99)),
        millis(waits[waits.len() - 1]),
        WAIT_BOUND.as_millis(),
    );
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(store.pool())
        .await?;
    println!("sqlite: rows written {rows}");
    Ok(())
}
