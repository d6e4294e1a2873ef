//! The retry storm: many users, each logical operation sent several times (concurrent
//! duplicates, retries after a client-side timeout, double clicks, a changed payload under a
//! reused key), then every ledger is checked.
//!
//! Invariants checked per user:
//! * every logical purchase and every order payment was charged **exactly once**: all answers of
//!   one operation name the same charge, distinct operations distinct charges, and the provider
//!   holds exactly those charges;
//! * `balance = start balance − charges`, and the charges equal the paid orders;
//! * one point grant per order, with the points of the first grant;
//! * no e-mail sent twice: duplicates of one key got one message id, and the provider sent at
//!   most one message per key (exactly one for every key answered 201).

use crate::{
    app::{self, Config, START_BALANCE_CENTS},
    client::{Answer, Call, Client},
    providers::Faults,
};
use anyhow::{bail, Context};
use futures_util::future::join_all;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::{
    collections::{BTreeMap, HashSet},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// Options of the storm.
#[derive(Debug, Clone, clap::Args)]
pub struct StormArgs {
    /// Target running services instead of starting one (repeat for several processes).
    #[arg(long = "url")]
    pub urls: Vec<String>,
    /// Database for the services the storm starts (default: a temporary SQLite file).
    #[arg(long)]
    pub database_url: Option<String>,
    /// Start this many real `shop` child processes on free ports, sharing the database
    /// (0: serve in this process).
    #[arg(long, default_value_t = 0)]
    pub processes: usize,
    /// Simulated users.
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub users: u64,
    /// Logical operations per user.
    #[arg(long, default_value_t = 18, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub operations: u64,
    /// Copies of each request sent concurrently (double clicks, racing retries).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=32))]
    pub duplicates: u64,
    /// Payment provider failure rate for the services the storm starts.
    #[arg(long, default_value_t = 0.1)]
    pub payment_fail_rate: f64,
    /// Payment provider latency (ms) for the services the storm starts.
    #[arg(long, default_value_t = 5)]
    pub payment_latency_ms: u64,
    /// Mail provider failure rate for the services the storm starts.
    #[arg(long, default_value_t = 0.05)]
    pub mail_fail_rate: f64,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Counters of what the services answered.
#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    executed: AtomicU64,
    replayed: AtomicU64,
    conflict: AtomicU64,
    unprocessable: AtomicU64,
    refused: AtomicU64,
    server_errors: AtomicU64,
    timeouts: AtomicU64,
    other: AtomicU64,
}

impl Counts {
    fn count(&self, answer: &Result<Answer, reqwest::Error>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let counter = match answer {
            Err(_) => &self.timeouts,
            Ok(a) if a.replayed => &self.replayed,
            Ok(a) if a.status.is_success() => &self.executed,
            Ok(a) if a.status == StatusCode::CONFLICT => &self.conflict,
            Ok(a) if a.status == StatusCode::UNPROCESSABLE_ENTITY => &self.unprocessable,
            Ok(a) if a.status == StatusCode::PAYMENT_REQUIRED => &self.refused,
            Ok(a) if a.status.is_server_error() => &self.server_errors,
            Ok(_) => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the client learned about one user, to compare with the ledger.
#[derive(Debug, Default)]
struct Expected {
    /// Charge ids of the logical purchases and payments that succeeded.
    charges: Vec<String>,
    charged_cents: i64,
    points: i64,
    grants: i64,
    emails_ok: i64,
    emails_parked: i64,
}

/// The whole run's state.
struct Storm {
    client: Client,
    counts: Counts,
    violations: Mutex<Vec<String>>,
    duplicates: usize,
    target: AtomicU64,
}

impl Storm {
    fn violation(&self, message: String) {
        self.violations.lock().expect("violations").push(message);
    }

    fn next_target(&self) -> usize {
        self.target.fetch_add(1, Ordering::Relaxed) as usize
    }

    async fn send(&self, call: &Call<'_>) -> Result<Answer, reqwest::Error> {
        let answer = self.client.send(self.next_target(), call).await;
        self.counts.count(&answer);
        answer
    }

    /// Sends until a definitive answer: retries on timeouts, 409 in progress and 5xx, with the
    /// same key, as a well-behaved client does. `None` after too many attempts.
    async fn until_definitive(&self, call: &Call<'_>) -> Option<Answer> {
        let mut call = call.clone();
        for attempt in 0..200 {
            match self.send(&call).await {
                Ok(a) if a.status == StatusCode::CONFLICT && a.is_problem("in-progress") => {
                    tokio::time::sleep(Duration::from_millis(5 + attempt)).await
                }
                Ok(a) if a.status.is_server_error() && !a.is_problem("mail-outcome-unknown") => {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Ok(a) => return Some(a),
                Err(_) => {}
            }
            call.timeout = None;
        }
        None
    }

    /// Sends `copies` copies of `call` at once, each until definitive.
    async fn racing(&self, call: &Call<'_>, copies: usize) -> Vec<Answer> {
        let answers = join_all((0..copies).map(|_| self.until_definitive(call))).await;
        let n = answers.len();
        let answers: Vec<Answer> = answers.into_iter().flatten().collect();
        if answers.len() != n {
            self.violation(format!(
                "{} {}: no definitive answer after 200 attempts",
                call.method, call.path
            ));
        }
        answers
    }

    async fn run_user(&self, user: &str, operations: u64, bar: &ProgressBar) -> Expected {
        let mut expected = Expected::default();
        for op in 0..operations {
            match op % 6 {
                0 => self.concurrent_purchase(user, op, &mut expected).await,
                1 => self.timeout_retry_purchase(user, op, &mut expected).await,
                2 => self.order_pay_grant(user, op, &mut expected).await,
                3 => self.email(user, op, &mut expected).await,
                4 => self.refused_purchase(user, op).await,
                _ => self.double_click_purchase(user, op, &mut expected).await,
            }
            bar.inc(1);
        }
        expected
    }

    /// All answers to one logical purchase must be one purchase with one charge.
    fn one_purchase(&self, what: &str, answers: &[Answer], expected: &mut Expected) {
        let created: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .collect();
        if created.len() != answers.len() || created.is_empty() {
            let statuses: Vec<u16> = answers.iter().map(|a| a.status.as_u16()).collect();
            self.violation(format!(
                "{what}: expected 201 for every copy, got {statuses:?}"
            ));
            return;
        }
        let ids: HashSet<(&Value, &Value)> = created
            .iter()
            .map(|a| (&a.body["purchase_id"], &a.body["charge_id"]))
            .collect();
        if ids.len() != 1 {
            self.violation(format!(
                "{what}: copies answered different purchases {ids:?}"
            ));
        }
        let executed = created.iter().filter(|a| !a.replayed).count();
        if executed > 1 {
            self.violation(format!("{what}: {executed} copies executed (not replayed)"));
        }
        let body = &created[0].body;
        expected
            .charges
            .push(body["charge_id"].as_str().unwrap_or_default().to_owned());
        expected.charged_cents += body["amount_cents"].as_i64().unwrap_or_default();
    }

    async fn concurrent_purchase(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "tea", "quantity": 1 + op % 3});
        let call = Call::post("/purchases", user, &body).key(&key);
        let answers = self.racing(&call, self.duplicates).await;
        self.one_purchase(
            &format!("{user} purchase {op} (concurrent)"),
            &answers,
            expected,
        );
    }

    /// The first try gives up after 2 ms (the server goes on), then the client retries; the
    /// same key with another payload is refused with 422.
    async fn timeout_retry_purchase(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "coffee", "quantity": 2});
        let first = Call::post("/purchases", user, &body)
            .key(&key)
            .timeout(Duration::from_millis(2));
        let _ = self.send(&first).await;
        let retry = Call::post("/purchases", user, &body).key(&key);
        let answers = self.racing(&retry, 2).await;
        self.one_purchase(
            &format!("{user} purchase {op} (timeout, retry)"),
            &answers,
            expected,
        );
        let changed = json!({"sku": "coffee", "quantity": 3});
        let reused = Call::post("/purchases", user, &changed).key(&key);
        match self.until_definitive(&reused).await {
            Some(a)
                if a.status == StatusCode::UNPROCESSABLE_ENTITY && a.is_problem("key-reused") => {}
            other => self.violation(format!(
                "{user} purchase {op}: changed payload under a reused key answered {:?}, not 422",
                other.map(|a| a.status)
            )),
        }
    }

    /// Two clicks 3 ms apart.
    async fn double_click_purchase(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "mug", "quantity": 1});
        let call = Call::post("/purchases", user, &body).key(&key);
        let (a, b) = tokio::join!(self.until_definitive(&call), async {
            tokio::time::sleep(Duration::from_millis(3)).await;
            self.until_definitive(&call).await
        });
        let answers: Vec<Answer> = [a, b].into_iter().flatten().collect();
        self.one_purchase(
            &format!("{user} purchase {op} (double click)"),
            &answers,
            expected,
        );
    }

    /// More than any balance: a definitive 402, stored and replayed to every copy.
    async fn refused_purchase(&self, user: &str, op: u64) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "mug", "quantity": 100});
        let call = Call::post("/purchases", user, &body).key(&key);
        let answers = self.racing(&call, self.duplicates).await;
        if answers
            .iter()
            .any(|a| a.status != StatusCode::PAYMENT_REQUIRED)
        {
            let statuses: Vec<u16> = answers.iter().map(|a| a.status.as_u16()).collect();
            self.violation(format!(
                "{user} refused purchase {op}: expected 402 for every copy, got {statuses:?}"
            ));
        }
        let executed = answers.iter().filter(|a| !a.replayed).count();
        if executed > 1 {
            self.violation(format!(
                "{user} refused purchase {op}: the refusal was decided {executed} times, not stored once"
            ));
        }
    }

    /// Creates an order (keyed, duplicated), pays it from racing calls (guarded transition),
    /// then grants points from racing calls (unique constraint).
    async fn order_pay_grant(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "tea", "quantity": 2});
        let create = Call::post("/orders", user, &body).key(&key);
        let created = self.racing(&create, 2).await;
        let ids: HashSet<&Value> = created.iter().map(|a| &a.body["order_id"]).collect();
        if ids.len() != 1 || created.iter().any(|a| a.status != StatusCode::CREATED) {
            self.violation(format!("{user} order {op}: duplicates created {ids:?}"));
            return;
        }
        let Some(order_id) = created[0].body["order_id"].as_i64() else {
            return;
        };
        let empty = json!({});
        let pay = Call::post(format!("/orders/{order_id}/pay"), user, &empty);
        let paid = self.racing(&pay, self.duplicates).await;
        let first_payments = paid
            .iter()
            .filter(|a| a.body["already_paid"] == json!(false))
            .count();
        let charges: HashSet<&Value> = paid.iter().map(|a| &a.body["charge_id"]).collect();
        if first_payments != 1
            || charges.len() != 1
            || paid.iter().any(|a| a.status != StatusCode::OK)
        {
            self.violation(format!(
                "{user} order {order_id}: {first_payments} calls paid it (charges {charges:?})"
            ));
        } else {
            expected.charges.push(
                paid[0].body["charge_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
            expected.charged_cents += paid[0].body["amount_cents"].as_i64().unwrap_or_default();
        }
        let points = 10 + op as i64;
        let grant_body = json!({"order_id": order_id, "points": points});
        let grant = Call::post("/points/grants", user, &grant_body);
        let grants = self.racing(&grant, self.duplicates).await;
        let fresh = grants
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .count();
        let ids: HashSet<&Value> = grants.iter().map(|a| &a.body["grant_id"]).collect();
        let duplicates_flagged = grants
            .iter()
            .filter(|a| a.status == StatusCode::OK && a.body["duplicate"] == json!(true))
            .count();
        if fresh != 1 || ids.len() != 1 || duplicates_flagged != grants.len() - 1 {
            self.violation(format!(
                "{user} order {order_id}: {fresh} grants created, grant ids {ids:?}"
            ));
        } else {
            expected.points += points;
            expected.grants += 1;
        }
    }

    async fn email(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"to": format!("{user}@example.com"), "subject": format!("receipt {op}"), "body": "thanks"});
        let call = Call::post("/emails", user, &body).key(&key);
        let answers = self.racing(&call, self.duplicates).await;
        let sent: HashSet<&Value> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .map(|a| &a.body["message_id"])
            .collect();
        let unknown = answers
            .iter()
            .any(|a| a.is_problem("mail-outcome-unknown") || a.is_problem("needs-review"));
        match (sent.len(), unknown) {
            (1, false) => expected.emails_ok += 1,
            (0, true) => expected.emails_parked += 1,
            _ => {
                let statuses: Vec<u16> = answers.iter().map(|a| a.status.as_u16()).collect();
                self.violation(format!(
                    "{user} email {op}: {} messages answered, statuses {statuses:?}",
                    sent.len()
                ));
            }
        }
    }

    /// Compares one user's ledger with what the client saw.
    async fn check_ledger(&self, user: &str, expected: &Expected) {
        let call = Call::get(format!("/users/{user}/ledger"), user);
        let ledger = match self.client.send(0, &call).await {
            Ok(a) if a.status == StatusCode::OK => a.body,
            other => {
                self.violation(format!("{user}: ledger unreadable: {other:?}"));
                return;
            }
        };
        let int = |name: &str| ledger[name].as_i64().unwrap_or(i64::MIN);
        let charged: Vec<&str> = ledger["charges"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["charge_id"].as_str()).collect())
            .unwrap_or_default();
        let mut ledger_charges: Vec<&str> = charged.clone();
        ledger_charges.sort_unstable();
        let mut expected_charges: Vec<&str> = expected.charges.iter().map(String::as_str).collect();
        expected_charges.sort_unstable();
        if ledger_charges != expected_charges {
            self.violation(format!(
                "{user}: the provider holds {} charges, the client saw {} logical payments succeed",
                ledger_charges.len(),
                expected_charges.len()
            ));
        }
        let paid_charges: HashSet<&str> = ledger["orders"]
            .as_array()
            .map(|o| {
                o.iter()
                    .filter(|o| o["status"] == "paid")
                    .filter_map(|o| o["charge_id"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        if paid_charges != charged.iter().copied().collect::<HashSet<_>>() {
            self.violation(format!("{user}: provider charges and paid orders differ"));
        }
        let checks = [
            (
                "charged_total_cents",
                int("charged_total_cents"),
                expected.charged_cents,
            ),
            (
                "paid_orders_total_cents",
                int("paid_orders_total_cents"),
                expected.charged_cents,
            ),
            (
                "balance_cents",
                int("balance_cents"),
                START_BALANCE_CENTS - expected.charged_cents,
            ),
            ("points_total", int("points_total"), expected.points),
            ("point_grants", int("point_grants"), expected.grants),
            (
                "emails_recorded",
                int("emails_recorded"),
                expected.emails_ok,
            ),
        ];
        for (name, got, want) in checks {
            if got != want {
                self.violation(format!("{user}: {name} is {got}, expected {want}"));
            }
        }
        let sent = int("emails_sent");
        if sent < expected.emails_ok || sent > expected.emails_ok + expected.emails_parked {
            self.violation(format!(
                "{user}: the mail provider sent {sent} messages for {} answered and {} parked keys",
                expected.emails_ok, expected.emails_parked
            ));
        }
    }
}

/// Child `shop` processes, killed on drop.
struct Children(Vec<tokio::process::Child>);

async fn spawn_child(
    args: &StormArgs,
    database_url: &str,
) -> anyhow::Result<(tokio::process::Child, String)> {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let exe = std::env::current_exe().context("locating the shop binary")?;
    let mut child = tokio::process::Command::new(exe)
        .args(["--listen", "127.0.0.1:0", "--database-url", database_url])
        .arg("--payment-fail-rate")
        .arg(args.payment_fail_rate.to_string())
        .arg("--payment-latency-ms")
        .arg(args.payment_latency_ms.to_string())
        .arg("--mail-fail-rate")
        .arg(args.mail_fail_rate.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting a shop process")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(url) = listening_url(&line) {
                return Ok(url);
            }
        }
        bail!("the shop process exited before listening")
    })
    .await
    .context("the shop process did not start within 60 s")??;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, url))
}

/// The URL in the service's start-up line `shop listening on http://ADDR`.
pub fn listening_url(line: &str) -> Option<String> {
    line.split_once("listening on ")
        .map(|(_, rest)| rest.split_whitespace().next().unwrap_or("").to_owned())
        .filter(|url| url.starts_with("http://"))
}

/// Runs the storm and prints its report; fails when an invariant was violated.
pub async fn run(args: StormArgs) -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let database_url = args
        .database_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", scratch.path().join("storm.db").display()));
    let mut _children = Children(Vec::new());
    let mut _in_process = None;
    let urls = if !args.urls.is_empty() {
        args.urls.clone()
    } else if args.processes > 0 {
        let mut urls = Vec::new();
        for _ in 0..args.processes {
            let (child, url) = spawn_child(&args, &database_url).await?;
            _children.0.push(child);
            urls.push(url);
        }
        urls
    } else {
        let mut config = Config::new(&database_url);
        config.payment = Faults {
            fail_rate: args.payment_fail_rate,
            latency: Duration::from_millis(args.payment_latency_ms),
        };
        config.mail = Faults {
            fail_rate: args.mail_fail_rate,
            latency: Duration::ZERO,
        };
        let running = app::start(&config, "127.0.0.1:0").await?;
        let url = running.url();
        _in_process = Some(running);
        vec![url]
    };
    let where_ = if args.urls.is_empty() {
        database_url
            .split('@')
            .next_back()
            .unwrap_or(&database_url)
            .to_owned()
    } else {
        "external services".to_owned()
    };
    println!(
        "storm: {} users × {} operations × {} duplicates against {} ({} process{}, {where_})",
        args.users,
        args.operations,
        args.duplicates,
        urls.join(", "),
        urls.len(),
        if urls.len() == 1 { "" } else { "es" }
    );

    let storm = Arc::new(Storm {
        client: Client::new(urls),
        counts: Counts::default(),
        violations: Mutex::new(Vec::new()),
        duplicates: args.duplicates as usize,
        target: AtomicU64::new(0),
    });
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.users * args.operations)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} operations ({per_sec})",
        )
        .expect("progress template"),
    );
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let tasks: Vec<_> = (0..args.users)
        .map(|i| {
            let storm = storm.clone();
            let bar = bar.clone();
            let user = format!("storm-{}-{i}", &run_id[..8]);
            let operations = args.operations;
            tokio::spawn(async move {
                let expected = storm.run_user(&user, operations, &bar).await;
                (user, expected)
            })
        })
        .collect();
    let mut expectations = BTreeMap::new();
    for task in tasks {
        let (user, expected) = task.await?;
        expectations.insert(user, expected);
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let latency = storm.client.take_latency();
    for (user, expected) in &expectations {
        storm.check_ledger(user, expected).await;
    }

    let c = &storm.counts;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let total_charges: usize = expectations.values().map(|e| e.charges.len()).sum();
    let parked: i64 = expectations.values().map(|e| e.emails_parked).sum();
    println!(
        "operations {}  requests {}  in {:.1} s  ({:.0} requests/s)",
        args.users * args.operations,
        get(&c.requests),
        elapsed.as_secs_f64(),
        get(&c.requests) as f64 / elapsed.as_secs_f64()
    );
    println!(
        "answers: executed {}  replayed {}  409 {}  422 {}  402 {}  5xx {}  client timeouts {}  other {}",
        get(&c.executed),
        get(&c.replayed),
        get(&c.conflict),
        get(&c.unprocessable),
        get(&c.refused),
        get(&c.server_errors),
        get(&c.timeouts),
        get(&c.other)
    );
    println!(
        "latency: p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
        latency.value_at_quantile(0.50) as f64 / 1000.0,
        latency.value_at_quantile(0.99) as f64 / 1000.0,
        latency.max() as f64 / 1000.0
    );
    println!(
        "checked {} ledgers: {total_charges} payments, {parked} e-mails parked for review",
        expectations.len()
    );
    let violations = storm.violations.lock().expect("violations");
    if violations.is_empty() {
        println!("invariants: OK (every payment charged exactly once, balances consistent, one grant per order, no e-mail sent twice)");
        Ok(())
    } else {
        for v in violations.iter().take(50) {
            println!("VIOLATION: {v}");
        }
        bail!("{} invariant violations", violations.len())
    }
}
