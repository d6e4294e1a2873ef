//! `idempotency-client` against the real shop binary: double clicks answered by waiting
//! (`--wait-for-in-flight-ms`), and purchases driven to completion through payment faults and
//! SIGKILLs of the shop, then checked in the database: each executed exactly once.

mod common;

use idempotency::{durable::provider_key, IdempotencyKey};
use idempotency_client::{IdempotencyMiddleware, Outcome, Probe, RequestKey, RetryPolicy};
use serde_json::{json, Value};
use shop::{db::sql, purchase::START_BALANCE_CENTS};
use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};
use test_support::TestDatabase;

/// A `shop` process on a given address (restartable on the same port), killed on drop.
struct Shop {
    child: Option<Child>,
    database_url: String,
    extra: Vec<String>,
    listen: String,
    url: String,
}

impl Shop {
    fn start(database_url: &str, extra: &[&str]) -> Shop {
        let mut shop = Shop {
            child: None,
            database_url: database_url.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            listen: "127.0.0.1:0".into(),
            url: String::new(),
        };
        shop.spawn();
        shop.listen = shop.url.trim_start_matches("http://").to_owned();
        shop
    }

    /// Starts the process on `self.listen`; waits for its address.
    fn spawn(&mut self) {
        let started = Instant::now();
        loop {
            let mut child = Command::new(env!("CARGO_BIN_EXE_shop"))
                .args([
                    "--listen",
                    &self.listen,
                    "--database-url",
                    &self.database_url,
                ])
                .args(&self.extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("start the shop binary");
            let stdout = child.stdout.take().expect("stdout");
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some((_, rest)) = line.split_once("listening on ") {
                        let url = rest.split_whitespace().next().unwrap_or("").to_owned();
                        let _ = tx.send(url);
                    }
                }
            });
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(url) => {
                    self.url = url;
                    self.child = Some(child);
                    return;
                }
                Err(_) => {
                    // The port may not be free yet after a kill: try again.
                    let _ = child.kill();
                    let _ = child.wait();
                    assert!(
                        started.elapsed() < Duration::from_secs(60),
                        "the shop did not start"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// SIGKILL, then a new process on the same port.
    fn kill_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        self.kill();
    }
}

fn purchase_body() -> Value {
    json!({"sku": "tea", "quantity": 2})
}

const TEA2_CENTS: i64 = 900;

/// What the databases say about one user's purchases (one user per operation).
#[derive(Debug, Default, PartialEq, Eq)]
struct Rows {
    /// `(status, charge_id)` of each order.
    orders: Vec<(String, Option<String>)>,
    purchases: i64,
    /// Charges on the user's account: `(provider_key, charge_id)`.
    charges: Vec<(String, String)>,
    /// Refunded charge ids among them.
    refunded: Vec<String>,
    balance: Option<i64>,
    /// The key's state and stored status.
    key_state: Option<String>,
}

async fn rows(database_url: &str, user: &str, key: &str) -> Rows {
    // The shop's own connections and statements: one code path for every backend.
    let (shop, providers) = shop::db::connect(database_url, 2).await.unwrap();
    let mut read = shop.read().await.unwrap();
    let mut c = read.conn();
    let orders = sql("SELECT status, charge_id FROM shop_orders WHERE user_id = $1 ORDER BY id");
    let orders = c.fetch_all(orders.bind(user)).await.unwrap();
    let purchases = sql("SELECT count(*) FROM shop_purchases WHERE user_id = $1");
    let purchases = c.scalar(purchases.bind(user)).await.unwrap();
    let balance = sql("SELECT balance_cents FROM shop_users WHERE id = $1");
    let balance = c.scalar_optional(balance.bind(user)).await.unwrap();
    let state = sql(
        "SELECT state FROM idempotency_keys WHERE scope = $1 AND operation = 'purchase' AND idem_key = $2",
    )
    // MariaDB keeps `state` in a binary collation, which sqlx reads as bytes.
    .on_mysql(
        "SELECT CONVERT(state USING utf8mb4) FROM idempotency_keys
         WHERE scope = $1 AND operation = 'purchase' AND idem_key = $2",
    );
    let key_state = c.scalar_optional(state.bind(user).bind(key)).await.unwrap();
    drop(read);
    let mut read = providers.conn().await.unwrap();
    let mut c = read.conn();
    let charges =
        sql("SELECT provider_key, charge_id FROM payment_provider_charges WHERE account = $1");
    let charges = c.fetch_all(charges.bind(user)).await.unwrap();
    let refunds = sql("SELECT r.charge_id FROM payment_provider_refunds r
         JOIN payment_provider_charges c ON c.charge_id = r.charge_id WHERE c.account = $1");
    let refunded = c
        .fetch_all::<(String,)>(refunds.bind(user))
        .await
        .unwrap()
        .into_iter()
        .map(|(charge_id,)| charge_id)
        .collect();
    Rows {
        orders,
        purchases,
        charges,
        refunded,
        balance,
        key_state,
    }
}

/// 16 copies of one 50 ms purchase at once, 3 times: with the shop waiting for the request in
/// flight, every copy is a 201 (one executed, 15 replays), none a 409; one charge per key.
async fn double_click_gets_no_409(backend: TestDatabase) {
    let Some((database_url, sqlite)) = common::database(backend).await else {
        return;
    };
    let shop = Shop::start(
        &database_url,
        &[
            "--payment-latency-ms",
            "50",
            "--wait-for-in-flight-ms",
            "2000",
        ],
    );
    let http = reqwest::Client::new();
    for trial in 0..3 {
        let user = format!("clicker-{trial}");
        let key = uuid::Uuid::new_v4().to_string();
        let copies = (0..16).map(|_| {
            let request = http
                .post(format!("{}/purchases", shop.url))
                .header("x-user-id", &user)
                .header("idempotency-key", &key)
                .json(&purchase_body());
            async move {
                let response = request.send().await.unwrap();
                let replayed = response.headers().contains_key("idempotent-replayed");
                let status = response.status().as_u16();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                (status, replayed, body)
            }
        });
        let answers = futures_util::future::join_all(copies).await;
        let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
        assert!(
            statuses.iter().all(|s| *s == 201),
            "{backend}: {statuses:?}"
        );
        assert_eq!(answers.iter().filter(|a| a.1).count(), 15, "{backend}");
        let charges: std::collections::HashSet<String> = answers
            .iter()
            .map(|a| a.2["charge_id"].to_string())
            .collect();
        assert_eq!(charges.len(), 1, "{backend}: one charge in every answer");
        let rows = rows(&database_url, &user, &key).await;
        assert_eq!(rows.charges.len(), 1, "{backend}: {rows:?}");
        assert_eq!(rows.purchases, 1, "{backend}: {rows:?}");
    }
    drop(shop);
    drop(sqlite);
}

/// How one operation ended, seen from the client.
#[derive(Debug)]
struct Ended {
    user: String,
    key: String,
    status: Option<u16>,
    body: Value,
    outcome: Outcome,
}

/// Purchases driven to completion with the client while the payment provider fails half of its
/// calls and the shop is SIGKILLed and restarted on the same port; then, from the database, each
/// purchase answered 201 was charged exactly once and paid, and each answered with the
/// definitive 502 `payment-failed` was charged nothing (or refunded) and given its money back.
async fn purchases_survive_faults_and_kills(backend: TestDatabase) {
    // A shorter run on SQLite.
    let (operations, kills) = match backend {
        TestDatabase::Sqlite => (24, 6),
        TestDatabase::Postgres | TestDatabase::MySql => (40, 10),
    };
    let Some((database_url, sqlite)) = common::database(backend).await else {
        return;
    };
    let shop = Arc::new(Mutex::new(Shop::start(
        &database_url,
        &[
            "--payment-fail-rate",
            "0.5",
            "--payment-latency-ms",
            "20",
            "--lease-ms",
            "1500",
            "--worker-interval-ms",
            "200",
            "--wait-for-in-flight-ms",
            "1000",
        ],
    )));
    let url = shop.lock().unwrap().url.clone();
    let client = idempotency_client::reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new().with_policy(
                RetryPolicy::default()
                    .with_max_attempts(1_000)
                    .with_deadline(Duration::from_secs(120))
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(400)),
            ),
        )
        .build();

    // The killer: SIGKILL and restart at random moments while operations run.
    let done = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (shop, done, killed) = (shop.clone(), done.clone(), killed.clone());
        std::thread::spawn(move || {
            use rand::Rng;
            while killed.load(Ordering::SeqCst) < kills && !done.load(Ordering::SeqCst) {
                let pause = rand::thread_rng().gen_range(150..500);
                std::thread::sleep(Duration::from_millis(pause));
                shop.lock().unwrap().kill_and_restart();
                killed.fetch_add(1, Ordering::SeqCst);
            }
        })
    };

    let started = Instant::now();
    let ended: Vec<Ended> = futures_util::future::join_all((0..operations).map(|i| {
        let client = client.clone();
        let url = url.clone();
        async move {
            // Spread the starts over the kills.
            tokio::time::sleep(Duration::from_millis(40 * i as u64)).await;
            let user = format!("buyer-{i}");
            let key = uuid::Uuid::new_v4().to_string();
            let probe = Probe::new();
            let sent = client
                .post(format!("{url}/purchases"))
                .header("x-user-id", &user)
                .timeout(Duration::from_secs(10))
                .json(&purchase_body())
                .with_extension(RequestKey::Use(key.clone()))
                .with_extension(probe.clone())
                .send()
                .await;
            let (status, body) = match sent {
                Ok(response) => {
                    let status = response.status().as_u16();
                    (Some(status), response.json().await.unwrap_or(Value::Null))
                }
                Err(error) => (None, Value::String(error.to_string())),
            };
            Ended {
                user,
                key,
                status,
                body,
                outcome: probe.outcome(),
            }
        }
    }))
    .await;
    done.store(true, Ordering::SeqCst);
    killer.join().unwrap();
    let kills_done = killed.load(Ordering::SeqCst);

    let mut by_status: HashMap<Option<u16>, usize> = HashMap::new();
    let mut seen: std::collections::BTreeMap<u16, usize> = Default::default();
    let (mut requests, mut transport_errors, mut replays) = (0, 0, 0);
    for op in &ended {
        *by_status.entry(op.status).or_default() += 1;
        for status in op.outcome.statuses() {
            *seen.entry(status.as_u16()).or_default() += 1;
        }
        requests += op.outcome.attempt_count();
        transport_errors += op.outcome.transport_errors();
        replays += usize::from(op.outcome.replayed);
        // No 400 or 422 was ever answered, so none could have been retried.
        for status in op.outcome.statuses() {
            assert!(
                !matches!(status.as_u16(), 400 | 401 | 403 | 404 | 422),
                "{op:?}"
            );
        }
    }
    println!(
        "{backend}: {operations} purchases, {kills_done} kills, {requests} requests, {transport_errors} transport errors, {replays} final replays, {:.1} s; final statuses {by_status:?}; every answer {seen:?}",
        started.elapsed().as_secs_f64()
    );

    // Every operation was driven to a final answer: 201 or the definitive 502.
    let (mut created, mut failed) = (0, 0);
    for op in &ended {
        let rows = rows(&database_url, &op.user, &op.key).await;
        assert_eq!(
            rows.key_state.as_deref(),
            Some("completed"),
            "{op:?}: {rows:?}"
        );
        let unrefunded: Vec<&(String, String)> = rows
            .charges
            .iter()
            .filter(|(_, id)| !rows.refunded.contains(id))
            .collect();
        let expected_key = provider_key(
            &IdempotencyKey::new(&op.user, "purchase", &op.key).unwrap(),
            "charge",
        );
        // Every charge on this account was made with this operation's provider key.
        assert!(
            rows.charges.iter().all(|(pk, _)| *pk == expected_key),
            "{op:?}: {rows:?}"
        );
        match op.status {
            Some(201) => {
                created += 1;
                assert_eq!(rows.charges.len(), 1, "{op:?}: {rows:?}");
                assert_eq!(unrefunded.len(), 1, "{op:?}: {rows:?}");
                let charge_id = &rows.charges[0].1;
                assert_eq!(op.body["charge_id"], json!(charge_id), "{op:?}");
                assert_eq!(
                    rows.orders,
                    vec![("paid".to_owned(), Some(charge_id.clone()))],
                    "{op:?}"
                );
                assert_eq!(rows.purchases, 1, "{op:?}: {rows:?}");
                assert_eq!(rows.balance, Some(START_BALANCE_CENTS - TEA2_CENTS));
            }
            Some(502) => {
                failed += 1;
                assert!(
                    op.body["type"]
                        .as_str()
                        .is_some_and(|t| t.ends_with("/payment-failed")),
                    "{op:?}"
                );
                assert!(unrefunded.is_empty(), "{op:?}: {rows:?}");
                assert!(rows.orders.iter().all(|(status, _)| status == "cancelled"));
                assert!(rows.orders.len() <= 1, "{op:?}: {rows:?}");
                assert_eq!(rows.purchases, 0, "{op:?}: {rows:?}");
                assert_eq!(rows.balance, Some(START_BALANCE_CENTS));
            }
            _ => panic!("not driven to completion: {op:?}"),
        }
    }
    println!(
        "{backend}: {created} executed once (201), {failed} settled as failed (502), 0 duplicated"
    );
    assert_eq!(created + failed, operations);
    assert!(kills_done >= 1, "the shop was killed");
    drop(shop);
    drop(sqlite);
}

test_support::backend_tests! {
    #[tokio::test]
    double_click_gets_no_409,
    purchases_survive_faults_and_kills,
}
