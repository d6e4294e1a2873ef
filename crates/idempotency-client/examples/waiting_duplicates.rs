//! Double clicks on a 50 ms purchase, measured against the real `shop` binary.
//!
//! Per trial, `--copies` (16) copies of one purchase (one user, one key) are sent at once, and
//! each copy's status, replay mark and latency recorded. Three setups, on SQLite and (with
//! `--postgres-url` or `$TEST_POSTGRES_URL`) PostgreSQL:
//!
//! * **wait**: the shop with `--wait-for-in-flight-ms 2000`, copies sent with plain reqwest, so
//!   every status is seen as the server sent it. Expected: one executed 201, 15 replayed 201s, no
//!   409; the waiting copies' latency close to the original's.
//! * **no wait, raw**: the shop without waiting, plain reqwest: the 409s a browser or a naive
//!   client would get.
//! * **no wait, client**: the same shop, copies sent through `idempotency-client`, which waits
//!   out each 409 by its `Retry-After-Ms` hint.
//! * **wait, two processes** (PostgreSQL): two shops on the database, the copies alternating
//!   between them, so that half the waiting copies are woken by the other process's `NOTIFY`.
//!
//! The figures are printed, never asserted.
//!
//! ```sh
//! cargo build --release -p shop
//! cargo run --release -p idempotency-client --example waiting_duplicates -- --trials 100
//! ```
//!
//! Options: `--trials N` (100), `--copies N` (16), `--latency-ms N` (50, the payment provider's
//! latency), `--wait-ms N` (2000), `--shop PATH` (`target/release/shop`), `--postgres-url URL`,
//! `--no-sqlite`, `--no-compare` (only the *wait* setup).

use idempotency_client::{IdempotencyMiddleware, Outcome, RequestKey, RetryPolicy};
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

struct Args {
    trials: usize,
    copies: usize,
    latency_ms: u64,
    wait_ms: u64,
    shop: String,
    postgres_url: Option<String>,
    sqlite: bool,
    compare: bool,
}

fn args() -> Args {
    let mut args = Args {
        trials: 100,
        copies: 16,
        latency_ms: 50,
        wait_ms: 2000,
        shop: format!("{}/../../target/release/shop", env!("CARGO_MANIFEST_DIR")),
        postgres_url: std::env::var("TEST_POSTGRES_URL").ok(),
        sqlite: true,
        compare: true,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || {
            given
                .next()
                .unwrap_or_else(|| panic!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--trials" => args.trials = value().parse().expect("--trials N"),
            "--copies" => args.copies = value().parse().expect("--copies N"),
            "--latency-ms" => args.latency_ms = value().parse().expect("--latency-ms N"),
            "--wait-ms" => args.wait_ms = value().parse().expect("--wait-ms N"),
            "--shop" => args.shop = value(),
            "--postgres-url" => args.postgres_url = Some(value()),
            "--no-sqlite" => args.sqlite = false,
            "--no-compare" => args.compare = false,
            other => panic!("unknown option {other}"),
        }
    }
    args
}

/// A shop process, killed on drop.
struct Shop {
    child: Child,
    url: String,
}

impl Drop for Shop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_shop(args: &Args, database_url: &str, wait_ms: u64) -> Shop {
    let mut child = Command::new(&args.shop)
        .args(["--listen", "127.0.0.1:0", "--database-url", database_url])
        .args(["--payment-latency-ms", &args.latency_ms.to_string()])
        .args(["--wait-for-in-flight-ms", &wait_ms.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({e}); build it with `cargo build --release -p shop` or pass --shop",
                args.shop
            )
        });
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("the shop prints where it listens")
            .expect("stdout");
        if let Some((_, rest)) = line.split_once("listening on ") {
            break rest.split_whitespace().next().unwrap_or("").to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Shop { child, url }
}

/// One copy's answer.
#[derive(Debug, Clone, Copy)]
struct Answer {
    status: u16,
    replayed: bool,
    latency: Duration,
    attempts: u32,
}

const BODY: &str = r#"{"sku": "tea", "quantity": 1}"#;

async fn raw_copies(
    http: &reqwest::Client,
    urls: &[String],
    user: &str,
    key: &str,
    n: usize,
) -> Vec<Answer> {
    let copies = (0..n).map(|i| async move {
        let url = &urls[i % urls.len()];
        let started = Instant::now();
        let response = http
            .post(format!("{url}/purchases"))
            .header("x-user-id", user)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(BODY)
            .send()
            .await
            .expect("the shop answers");
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let _ = response.bytes().await;
        Answer {
            status,
            replayed,
            latency: started.elapsed(),
            attempts: 1,
        }
    });
    futures_util::future::join_all(copies).await
}

async fn client_copies(
    client: &idempotency_client::reqwest_middleware::ClientWithMiddleware,
    urls: &[String],
    user: &str,
    key: &str,
    n: usize,
) -> Vec<Answer> {
    let copies = (0..n).map(|i| async move {
        let url = &urls[i % urls.len()];
        let started = Instant::now();
        let response = client
            .post(format!("{url}/purchases"))
            .header("x-user-id", user)
            .header("content-type", "application/json")
            .body(BODY)
            .with_extension(RequestKey::Use(key.to_owned()))
            .send()
            .await
            .expect("the shop answers");
        let outcome = Outcome::of(&response).cloned().unwrap_or_default();
        let status = response.status().as_u16();
        let _ = response.bytes().await;
        Answer {
            status,
            replayed: outcome.replayed,
            latency: started.elapsed(),
            attempts: outcome.attempt_count(),
        }
    });
    futures_util::future::join_all(copies).await
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs the trials of one setup and prints its figures.
async fn measure(args: &Args, label: &str, urls: &[String], through_client: bool) {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .expect("HTTP client");
    let client = idempotency_client::reqwest_middleware::ClientBuilder::new(http.clone())
        .with(
            IdempotencyMiddleware::new().with_policy(RetryPolicy::default().with_max_attempts(20)),
        )
        .build();
    // Warm-up: pools, caches, the layer's estimate of the purchase's duration.
    for i in 0..5 {
        for url in urls {
            let key = format!("warm-up-{i}-{}", uuid::Uuid::new_v4());
            raw_copies(&http, std::slice::from_ref(url), "warm-up", &key, 1).await;
        }
    }
    let mut originals = Vec::new();
    let mut duplicates = Vec::new();
    let mut ratios = Vec::new();
    let mut statuses = std::collections::BTreeMap::<(u16, bool), usize>::new();
    let mut executed_per_trial = std::collections::BTreeMap::<usize, usize>::new();
    let mut attempts = 0u64;
    let started = Instant::now();
    for trial in 0..args.trials {
        let user = format!("clicker-{trial}");
        let key = uuid::Uuid::new_v4().to_string();
        let copies = if through_client {
            client_copies(&client, urls, &user, &key, args.copies).await
        } else {
            raw_copies(&http, urls, &user, &key, args.copies).await
        };
        let executed: Vec<&Answer> = copies
            .iter()
            .filter(|c| c.status == 201 && !c.replayed)
            .collect();
        *executed_per_trial.entry(executed.len()).or_default() += 1;
        let original = executed.first().map(|c| c.latency);
        for copy in &copies {
            *statuses.entry((copy.status, copy.replayed)).or_default() += 1;
            attempts += u64::from(copy.attempts);
        }
        if let Some(original) = original {
            originals.push(original);
            for copy in copies.iter().filter(|c| c.status == 201 && c.replayed) {
                duplicates.push(copy.latency);
                ratios.push(copy.latency.as_secs_f64() / original.as_secs_f64());
            }
        }
        // Let the purchase's background work (detached tasks) settle between trials.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    originals.sort();
    duplicates.sort();
    ratios.sort_by(f64::total_cmp);
    let answers: Vec<String> = statuses
        .iter()
        .map(|((status, replayed), n)| {
            format!("{n} × {status}{}", if *replayed { " replayed" } else { "" })
        })
        .collect();
    println!(
        "  {label}: {} trials × {} copies in {:.1} s",
        args.trials,
        args.copies,
        started.elapsed().as_secs_f64()
    );
    println!("    answers: {}", answers.join(", "));
    println!(
        "    executions per trial: {}; requests sent: {attempts}",
        executed_per_trial
            .iter()
            .map(|(n, trials)| format!("{n} in {trials} trials"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !originals.is_empty() {
        println!(
            "    original (executed) latency ms: p50 {:.1}  p99 {:.1}  max {:.1}",
            ms(percentile(&originals, 50.0)),
            ms(percentile(&originals, 99.0)),
            ms(*originals.last().unwrap())
        );
    }
    if !duplicates.is_empty() {
        let p99 = percentile(&duplicates, 99.0);
        println!(
            "    duplicates answered 201 (replayed) latency ms: p50 {:.1}  p99 {:.1}  max {:.1}",
            ms(percentile(&duplicates, 50.0)),
            ms(p99),
            ms(*duplicates.last().unwrap())
        );
        let p99_ratio =
            ratios[((0.99 * ratios.len() as f64).ceil() as usize).clamp(1, ratios.len()) - 1];
        println!(
            "    duplicate p99 / original p50 = {:.2}×, duplicate p99 / original p99 = {:.2}×, p99 of (duplicate / its trial's original) = {:.2}× (target < 2×)",
            p99.as_secs_f64() / percentile(&originals, 50.0).as_secs_f64(),
            p99.as_secs_f64() / percentile(&originals, 99.0).as_secs_f64(),
            p99_ratio
        );
    }
}

async fn backend(args: &Args, name: &str, database_url: &str, two_processes: bool) {
    println!("== {name} ==");
    let shop = start_shop(args, database_url, args.wait_ms);
    let urls = [shop.url.clone()];
    measure(
        args,
        &format!(
            "wait (--wait-for-in-flight-ms {}), plain reqwest",
            args.wait_ms
        ),
        &urls,
        false,
    )
    .await;
    if two_processes {
        let other = start_shop(args, database_url, args.wait_ms);
        let both = [shop.url.clone(), other.url.clone()];
        measure(
            args,
            "wait, two shop processes (copies alternate), plain reqwest",
            &both,
            false,
        )
        .await;
    }
    drop(shop);
    if args.compare {
        let shop = start_shop(args, database_url, 0);
        let urls = [shop.url.clone()];
        measure(args, "no wait, plain reqwest", &urls, false).await;
        measure(args, "no wait, idempotency-client", &urls, true).await;
    }
}

#[tokio::main]
async fn main() {
    let args = args();
    println!(
        "waiting_duplicates: {} trials × {} concurrent copies of one purchase (payment latency {} ms), shop {}",
        args.trials, args.copies, args.latency_ms, args.shop
    );
    if args.sqlite {
        let dir = std::env::temp_dir().join(format!("double-click-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temporary folder");
        let url = format!("sqlite://{}", dir.join("shop.db").display());
        backend(&args, "SQLite", &url, false).await;
        let _ = std::fs::remove_dir_all(&dir);
    }
    if let Some(server) = &args.postgres_url {
        // A fresh database on the same server, so earlier runs do not count.
        std::env::set_var("TEST_POSTGRES_URL", server);
        let url = test_support::fresh_postgres_url()
            .await
            .expect("a PostgreSQL database");
        backend(&args, "PostgreSQL", &url, true).await;
    }
}
