//! The retry storm: many users, each logical operation sent several times (concurrent
//! duplicates, retries after a client-side timeout, double clicks, a changed payload under a
//! reused key), then every ledger is checked.
//!
//! A share of the logical purchases (`--give-up-share`) is sent by clients that **give up**: each
//! copy is sent once and never retried after an error, a timeout, a 409 or a 503. Their keys are
//! carried to their end by the shop (the request goes on without its client) or by its
//! maintenance worker; after the traffic the storm waits (bounded) until no key is pending, then
//! learns how each given-up purchase ended from the database.
//!
//! Invariants checked per user:
//! * every logical purchase and every order payment was charged **at most once**, and exactly
//!   once if it succeeded: all answers of one operation name the same charge, distinct
//!   operations distinct charges, and the provider holds exactly those charges (less refunds);
//!   a purchase may also end settled as failed (a definitive 502 `payment-failed` for every copy,
//!   nothing charged for good);
//! * `balance = start balance − charges kept`, and the charges kept equal the paid orders;
//! * one point grant per order, with the points of the first grant;
//! * no e-mail sent twice: duplicates of one key got one message id, and the provider sent at
//!   most one message per key (exactly one for every key answered 201).
//!
//! And over the whole run, read from the databases (when the storm knows them): **no key is left
//! pending**, and **every provider charge belongs to exactly one paid order of its user, or was
//! refunded**, under a provider key derived from one of the run's purchase keys (or naming one
//! of the user's orders, for order payments).

use crate::{
    app,
    client::{Answer, Call, Client},
    db::{self, sql, ProviderDb, ShopDb},
    providers::Faults,
    purchase::{PURCHASE, START_BALANCE_CENTS},
    state::Config,
};
use anyhow::{bail, Context};
use futures_util::future::join_all;
use idempotency::{durable::provider_key, IdempotencyKey};
use idempotency_http::StoredResponse;
use indicatif::{ProgressBar, ProgressStyle};
use rand::Rng;
use reqwest::StatusCode;
use serde_json::{json, Value};
use std::{
    collections::{BTreeMap, HashMap, HashSet},
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
    /// Where the simulated providers of those services keep their state (default: their
    /// database); also where the storm audits the charges.
    #[arg(long)]
    pub provider_database_url: Option<String>,
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
    /// Share of the logical purchases whose client gives up: it sends each copy once and never
    /// retries after an error or a timeout (nor after a 409 or a 503).
    #[arg(long, default_value_t = 0.25, value_parser = share)]
    pub give_up_share: f64,
    /// Lease of the services the storm starts, in milliseconds: how long a request may hold its
    /// key before a retry or the worker may take it over.
    #[arg(long, default_value_t = 5_000)]
    pub lease_ms: u64,
    /// Pause between the maintenance worker's passes in the services the storm starts, in
    /// milliseconds.
    #[arg(long, default_value_t = 200)]
    pub worker_interval_ms: u64,
    /// How long to wait after the traffic for the workers to settle every key, in seconds.
    #[arg(long, default_value_t = 60)]
    pub settle_timeout_secs: u64,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn share(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a share between 0 and 1"))
    }
}

/// How long a well-behaved client keeps retrying one request before the storm calls it a
/// violation.
const RETRY_LIMIT: Duration = Duration::from_secs(60);

/// Counters of what the services answered.
#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    executed: AtomicU64,
    replayed: AtomicU64,
    conflict: AtomicU64,
    unprocessable: AtomicU64,
    refused: AtomicU64,
    payment_failed: AtomicU64,
    server_errors: AtomicU64,
    timeouts: AtomicU64,
    other: AtomicU64,
}

impl Counts {
    fn count(&self, answer: &Result<Answer, reqwest::Error>) {
        match answer {
            Err(_) => self.tally(None, false, false),
            Ok(a) => self.tally(Some(a.status), a.replayed, a.is_problem("payment-failed")),
        }
    }

    /// Counts an attempt of which only the middleware's record is known (not the last).
    fn count_attempt(&self, attempt: &idempotency_client::AttemptRecord) {
        self.tally(attempt.result.status(), attempt.replayed, false);
    }

    /// One answer (`None`: a timeout or transport error) under its counter.
    fn tally(&self, status: Option<StatusCode>, replayed: bool, payment_failed: bool) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let counter = match status {
            None => &self.timeouts,
            Some(_) if replayed => &self.replayed,
            Some(s) if s.is_success() => &self.executed,
            Some(StatusCode::CONFLICT) => &self.conflict,
            Some(StatusCode::UNPROCESSABLE_ENTITY) => &self.unprocessable,
            Some(StatusCode::PAYMENT_REQUIRED) => &self.refused,
            Some(_) if payment_failed => &self.payment_failed,
            Some(s) if s.is_server_error() => &self.server_errors,
            Some(_) => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether `a` is the definitive answer of a purchase settled as failed.
fn payment_failed(a: &Answer) -> bool {
    a.status == StatusCode::BAD_GATEWAY && a.is_problem("payment-failed")
}

/// A logical purchase whose client gave up: what it saw, to compare with how its key ended.
#[derive(Debug)]
struct GivenUp {
    what: String,
    key: String,
    /// A purchase more expensive than any balance (expected to end in a stored 402).
    refused: bool,
    /// Every answer that came back (timeouts and transport errors are absent).
    answers: Vec<Answer>,
}

/// How the given-up purchases ended, once settled.
#[derive(Debug, Default)]
struct GiveUps {
    operations: u64,
    /// Some copy received a definitive answer (201, 402 or the 502 payment-failed).
    answered: u64,
    /// No copy received a definitive answer, yet the key ended completed with a 201.
    completed_later: u64,
    /// Keys settled as failed (the 502 payment-failed stored).
    settled_failed: u64,
    /// Keys completed with a 402.
    refused: u64,
    /// Keys absent: never reserved (the client gave up before), or released before anything was
    /// recorded (nothing charged).
    released: u64,
    /// Keys parked for review.
    parked: u64,
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
    /// Purchases settled as failed (every copy answered the definitive 502).
    purchases_failed: i64,
    /// Every purchase key the user sent.
    purchase_keys: Vec<String>,
    /// The purchases whose client gave up.
    given_up: Vec<GivenUp>,
}

/// The whole run's state.
struct Storm {
    client: Client,
    counts: Counts,
    violations: Mutex<Vec<String>>,
    duplicates: usize,
    target: AtomicU64,
    give_up_share: f64,
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

    /// Sends until a definitive answer through `idempotency-client`, as a well-behaved client
    /// does: the same key on every attempt; timeouts, 409 in progress, 503 pending and
    /// 502/503/504 retried; never a 400 or 422. The definitive 502 of a purchase settled as
    /// failed comes back replayed on its retry and stops there; an e-mail of unknown outcome ends
    /// in 409 `needs-review`. `None` after [`RETRY_LIMIT`].
    async fn until_definitive(&self, call: &Call<'_>) -> Option<Answer> {
        let (answer, outcome) = self
            .client
            .send_until_definitive(self.next_target(), call, RETRY_LIMIT)
            .await;
        let attempts = outcome.attempts.len();
        for (n, attempt) in outcome.attempts.iter().enumerate() {
            match (&answer, n + 1 == attempts) {
                (Some(last), true) => self.counts.count(&Ok(last.clone())),
                _ => self.counts.count_attempt(attempt),
            }
        }
        answer
    }

    /// Sends `copies` copies of `call` at once, each until definitive.
    async fn racing(&self, call: &Call<'_>, copies: usize) -> Vec<Answer> {
        let answers = join_all((0..copies).map(|_| self.until_definitive(call))).await;
        let n = answers.len();
        let answers: Vec<Answer> = answers.into_iter().flatten().collect();
        if answers.len() != n {
            self.violation(format!(
                "{} {}: no definitive answer within {} s",
                call.method,
                call.path,
                RETRY_LIMIT.as_secs()
            ));
        }
        answers
    }

    /// Whether the client of the next logical purchase gives up after its first try.
    fn gives_up(&self) -> bool {
        self.give_up_share > 0.0 && rand::thread_rng().gen_bool(self.give_up_share)
    }

    /// Sends `copies` copies of `call` at once, each once: the answers that came back.
    async fn racing_once(&self, call: &Call<'_>, copies: usize) -> Vec<Answer> {
        join_all((0..copies).map(|_| self.send(call)))
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Checks what the copies of a given-up purchase received, and keeps it for the audit.
    fn given_up(
        &self,
        what: String,
        key: String,
        refused: bool,
        answers: Vec<Answer>,
        expected: &mut Expected,
    ) {
        let created: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .collect();
        let ids: HashSet<(&Value, &Value)> = created
            .iter()
            .map(|a| (&a.body["purchase_id"], &a.body["charge_id"]))
            .collect();
        if ids.len() > 1 {
            self.violation(format!(
                "{what} (gave up): copies answered different purchases {ids:?}"
            ));
        }
        let executed = created.iter().filter(|a| !a.replayed).count();
        if executed > 1 {
            self.violation(format!(
                "{what} (gave up): {executed} copies executed (not replayed)"
            ));
        }
        if !created.is_empty() && answers.iter().any(payment_failed) {
            self.violation(format!(
                "{what} (gave up): copies answered both 201 and the definitive 502"
            ));
        }
        expected.given_up.push(GivenUp {
            what,
            key,
            refused,
            answers,
        });
    }

    async fn run_user(&self, user: &str, operations: u64, bar: &ProgressBar) -> Expected {
        let mut expected = Expected::default();
        for op in 0..operations {
            match op % 6 {
                0 => self.concurrent_purchase(user, op, &mut expected).await,
                1 => self.timeout_retry_purchase(user, op, &mut expected).await,
                2 => self.order_pay_grant(user, op, &mut expected).await,
                3 => self.email(user, op, &mut expected).await,
                4 => self.refused_purchase(user, op, &mut expected).await,
                _ => self.double_click_purchase(user, op, &mut expected).await,
            }
            bar.inc(1);
        }
        expected
    }

    /// All answers to one logical purchase must be one purchase with one charge, or all the
    /// definitive 502 of a purchase settled as failed (nothing charged for good).
    fn one_purchase(&self, what: &str, answers: &[Answer], expected: &mut Expected) {
        if !answers.is_empty() && answers.iter().all(payment_failed) {
            let decided = answers.iter().filter(|a| !a.replayed).count();
            if decided > 1 {
                self.violation(format!(
                    "{what}: the failure was decided {decided} times, not stored once"
                ));
            }
            expected.purchases_failed += 1;
            return;
        }
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
        expected.purchase_keys.push(key.clone());
        let body = json!({"sku": "tea", "quantity": 1 + op % 3});
        let call = Call::post("/purchases", user, &body).key(&key);
        if self.gives_up() {
            let answers = self.racing_once(&call, self.duplicates).await;
            let what = format!("{user} purchase {op} (concurrent)");
            self.given_up(what, key, false, answers, expected);
            return;
        }
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
        expected.purchase_keys.push(key.clone());
        let body = json!({"sku": "coffee", "quantity": 2});
        let first = Call::post("/purchases", user, &body)
            .key(&key)
            .timeout(Duration::from_millis(2));
        let first_answer = self.send(&first).await;
        if self.gives_up() {
            // The client gave up with its timeout; the shop goes on without it.
            let what = format!("{user} purchase {op} (timeout, gave up)");
            let answers = first_answer.into_iter().collect();
            self.given_up(what, key, false, answers, expected);
            return;
        }
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
        expected.purchase_keys.push(key.clone());
        let body = json!({"sku": "mug", "quantity": 1});
        let call = Call::post("/purchases", user, &body).key(&key);
        if self.gives_up() {
            let (a, b) = tokio::join!(self.send(&call), async {
                tokio::time::sleep(Duration::from_millis(3)).await;
                self.send(&call).await
            });
            let answers = [a, b].into_iter().flatten().collect();
            let what = format!("{user} purchase {op} (double click)");
            self.given_up(what, key, false, answers, expected);
            return;
        }
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
    async fn refused_purchase(&self, user: &str, op: u64, expected: &mut Expected) {
        let key = uuid::Uuid::new_v4().to_string();
        expected.purchase_keys.push(key.clone());
        let body = json!({"sku": "mug", "quantity": 100});
        let call = Call::post("/purchases", user, &body).key(&key);
        if self.gives_up() {
            let answers = self.racing_once(&call, self.duplicates).await;
            if let Some(a) = answers.iter().find(|a| {
                a.status != StatusCode::PAYMENT_REQUIRED && a.status != StatusCode::CONFLICT
            }) {
                self.violation(format!(
                    "{user} refused purchase {op} (gave up): answered {}",
                    a.status
                ));
            }
            let what = format!("{user} refused purchase {op}");
            self.given_up(what, key, true, answers, expected);
            return;
        }
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
                "{user} order {order_id}: {first_payments} calls paid it (charges {charges:?}, answers {:?})",
                paid.iter().map(|a| (a.status.as_u16(), a.problem_type())).collect::<Vec<_>>()
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

    /// Learns from the settled key table how each given-up purchase of `user` ended, adds the
    /// charges of those that completed to what the user expects, and checks that the key agrees
    /// with what the client had seen.
    fn learn(&self, user: &str, expected: &mut Expected, tables: &Tables, tally: &mut GiveUps) {
        let charged: HashSet<&str> = tables
            .charges
            .iter()
            .map(|c| c.provider_key.as_str())
            .collect();
        for g in std::mem::take(&mut expected.given_up) {
            tally.operations += 1;
            let what = &g.what;
            let definitive = g.answers.iter().any(|a| {
                a.status == StatusCode::CREATED
                    || a.status == StatusCode::PAYMENT_REQUIRED
                    || payment_failed(a)
            });
            if definitive {
                tally.answered += 1;
            }
            let created = g.answers.iter().find(|a| a.status == StatusCode::CREATED);
            let row = tables.keys.get(&(user.to_owned(), g.key.clone()));
            let status = row.and_then(|(_, stored)| stored.as_ref().map(|s| s.status));
            match row.map(|(state, _)| state.as_str()) {
                Some("completed") if status == Some(201) && !g.refused => {
                    let stored = row.and_then(|(_, s)| s.as_ref()).expect("a stored response");
                    let body: Value = serde_json::from_slice(&stored.body).unwrap_or(Value::Null);
                    if created.is_some_and(|a| a.body["charge_id"] != body["charge_id"]) {
                        self.violation(format!(
                            "{what} (gave up): answered charge {}, the key stored {}",
                            created.map_or(&Value::Null, |a| &a.body["charge_id"]),
                            body["charge_id"]
                        ));
                    }
                    if created.is_none() {
                        tally.completed_later += 1;
                    }
                    expected
                        .charges
                        .push(body["charge_id"].as_str().unwrap_or_default().to_owned());
                    expected.charged_cents += body["amount_cents"].as_i64().unwrap_or_default();
                }
                Some("completed") if status == Some(502) && created.is_none() => {
                    tally.settled_failed += 1;
                    expected.purchases_failed += 1;
                }
                Some("completed") if status == Some(402) && g.refused && created.is_none() => {
                    tally.refused += 1;
                }
                Some("needs_review") if created.is_none() => tally.parked += 1,
                None if created.is_none() => {
                    tally.released += 1;
                    if purchase_charge_key(user, &g.key).is_some_and(|pk| charged.contains(pk.as_str())) {
                        self.violation(format!("{what} (gave up): its key was released, yet it was charged"));
                    }
                }
                state => self.violation(format!(
                    "{what} (gave up): the client saw {:?}, the key is {state:?} with a stored {status:?}",
                    g.answers.iter().map(|a| a.status.as_u16()).collect::<Vec<_>>()
                )),
            }
        }
    }

    /// Over the whole run: every provider charge belongs to exactly one paid order of its user
    /// (same amount), or was refunded; and was made under a provider key derived from one of the
    /// user's purchase keys, or naming one of the user's orders (an order payment).
    fn check_charges(&self, tables: &Tables, expectations: &BTreeMap<String, Expected>) {
        let mut known: HashMap<String, &str> = HashMap::new();
        for (user, expected) in expectations {
            for key in &expected.purchase_keys {
                if let Some(pk) = purchase_charge_key(user, key) {
                    known.insert(pk, user.as_str());
                }
            }
        }
        let mut paid: HashMap<&str, Vec<&OrderRow>> = HashMap::new();
        for order in &tables.orders {
            known.insert(format!("shop:order-pay:{}", order.0), order.1.as_str());
            if let (Some(charge), "paid") = (order.4.as_deref(), order.3.as_str()) {
                paid.entry(charge).or_default().push(order);
            }
        }
        for ChargeRow {
            provider_key,
            charge_id,
            account,
            amount,
        } in &tables.charges
        {
            let owners = paid.get(charge_id.as_str()).map_or(0, |orders| {
                orders
                    .iter()
                    .filter(|o| &o.1 == account && o.2 == *amount)
                    .count()
            });
            let refunded = tables.refunds.contains_key(charge_id);
            if !((owners == 1 && !refunded) || (owners == 0 && refunded)) {
                self.violation(format!(
                    "{account}: charge {charge_id} ({amount} cents) belongs to {owners} paid orders of its user, refunded: {refunded}"
                ));
            }
            if known.get(provider_key).is_none_or(|user| user != account) {
                self.violation(format!(
                    "{account}: charge {charge_id} was made under provider key {provider_key}, derived from none of the user's purchases or orders"
                ));
            }
        }
    }

    /// Compares one user's ledger with what the client saw (and, for given-up purchases, what
    /// the key table says); refunded charges are not kept.
    async fn check_ledger(&self, user: &str, expected: &Expected, tables: Option<&Tables>) {
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
        let refunds = tables.map(|t| &t.refunds);
        let refunded = |charge: &str| refunds.and_then(|r| r.get(charge)).copied();
        let refunded_cents: i64 = charged.iter().filter_map(|c| refunded(c)).sum();
        let charged: Vec<&str> = charged
            .into_iter()
            .filter(|c| refunded(c).is_none())
            .collect();
        let mut ledger_charges: Vec<&str> = charged.clone();
        ledger_charges.sort_unstable();
        let mut expected_charges: Vec<&str> = expected.charges.iter().map(String::as_str).collect();
        expected_charges.sort_unstable();
        if ledger_charges != expected_charges {
            self.violation(format!(
                "{user}: the provider keeps {} charges, the client saw {} logical payments succeed",
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
                "charged_total_cents (less refunds)",
                int("charged_total_cents") - refunded_cents,
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

/// The provider key of the charge of purchase `key` of `user`, as the shop derives it.
fn purchase_charge_key(user: &str, key: &str) -> Option<String> {
    IdempotencyKey::new(user, PURCHASE, key)
        .ok()
        .map(|k| provider_key(&k, "charge"))
}

/// `(id, user_id, amount_cents, status, charge_id)` of `shop_orders`.
type OrderRow = (i64, String, i64, String, Option<String>);

/// A row of `payment_provider_charges`.
#[derive(Debug, sqlx::FromRow)]
struct ChargeRow {
    provider_key: String,
    charge_id: String,
    account: String,
    #[sqlx(rename = "amount_cents")]
    amount: i64,
}

/// The run's rows, read from the databases once every key settled.
#[derive(Debug, Default)]
struct Tables {
    /// Purchase keys: `(user, key)` → `(state, stored response)`.
    keys: HashMap<(String, String), (String, Option<StoredResponse>)>,
    orders: Vec<OrderRow>,
    charges: Vec<ChargeRow>,
    /// Refunded charge id → amount.
    refunds: HashMap<String, i64>,
}

/// Read access to the databases of the run (the storm's users only).
struct Audit {
    shop: ShopDb,
    providers: ProviderDb,
    /// `LIKE` pattern of the run's users.
    users: String,
}

impl Audit {
    /// Keys of the run's users still pending (every operation).
    async fn pending(&self) -> anyhow::Result<i64> {
        let mut conn = self.shop.read().await?;
        Ok(conn
            .conn()
            .scalar(
                sql("SELECT count(*) FROM idempotency_keys WHERE state =
                     'pending' AND scope LIKE $1")
                .bind(&self.users),
            )
            .await?)
    }

    /// Polls until no key of the run is pending, at most `limit`: returns how many were pending
    /// at first, how many are left, and how long it took.
    async fn settle(&self, limit: Duration) -> anyhow::Result<(i64, i64, Duration)> {
        let started = Instant::now();
        let first = self.pending().await?;
        let mut left = first;
        while left > 0 && started.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(200)).await;
            left = self.pending().await?;
        }
        Ok((first, left, started.elapsed()))
    }

    async fn load(&self) -> anyhow::Result<Tables> {
        let mut conn = self.shop.read().await?;
        let (keys, orders) = {
            let mut c = conn.conn();
            let keys: Vec<(String, String, String, Option<Vec<u8>>)> = c
                .fetch_all(
                    sql("SELECT scope, idem_key, state, result FROM idempotency_keys
                         WHERE operation = $1 AND scope LIKE $2")
                    // MariaDB keeps the key columns as VARBINARY (and `state` as ascii_bin).
                    .on_mysql(
                        "SELECT CONVERT(scope USING utf8mb4), CONVERT(idem_key USING utf8mb4),
                         CONVERT(state USING utf8mb4), result FROM idempotency_keys
                         WHERE operation = $1 AND scope LIKE $2",
                    )
                    .bind(PURCHASE)
                    .bind(&self.users),
                )
                .await?;
            let orders: Vec<OrderRow> = c
                .fetch_all(
                    sql(
                        "SELECT id, user_id, amount_cents, status, charge_id FROM shop_orders
                         WHERE user_id LIKE $1",
                    )
                    .bind(&self.users),
                )
                .await?;
            (keys, orders)
        };
        drop(conn);
        let mut conn = self.providers.conn().await?;
        let (charges, refunds) = {
            let mut c = conn.conn();
            let charges = sql("SELECT provider_key, charge_id, account, amount_cents
                 FROM payment_provider_charges WHERE account LIKE $1");
            let charges: Vec<ChargeRow> = c.fetch_all(charges.bind(&self.users)).await?;
            let refunds: Vec<(String, i64)> = c
                .fetch_all(
                    sql(
                        "SELECT r.charge_id, r.amount_cents FROM payment_provider_refunds r
                         JOIN payment_provider_charges c ON c.charge_id = r.charge_id
                         WHERE c.account LIKE $1",
                    )
                    .bind(&self.users),
                )
                .await?;
            (charges, refunds)
        };
        Ok(Tables {
            keys: keys
                .into_iter()
                .map(|(user, key, state, result)| {
                    let stored = result.and_then(|bytes| serde_json::from_slice(&bytes).ok());
                    ((user, key), (state, stored))
                })
                .collect(),
            orders,
            charges,
            refunds: refunds.into_iter().collect(),
        })
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
        .args(
            args.provider_database_url
                .iter()
                .flat_map(|url| ["--provider-database-url", url.as_str()]),
        )
        .arg("--payment-fail-rate")
        .arg(args.payment_fail_rate.to_string())
        .arg("--payment-latency-ms")
        .arg(args.payment_latency_ms.to_string())
        .arg("--mail-fail-rate")
        .arg(args.mail_fail_rate.to_string())
        .arg("--lease-ms")
        .arg(args.lease_ms.to_string())
        .arg("--worker-interval-ms")
        .arg(args.worker_interval_ms.to_string())
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
    // The databases, to wait for the workers and audit the run (unknown when the storm targets
    // services it did not start, unless --database-url names theirs).
    let mut databases = None;
    let urls = if !args.urls.is_empty() {
        if args.database_url.is_some() {
            databases = Some(
                db::connect_with(&database_url, args.provider_database_url.as_deref(), 2).await?,
            );
        }
        args.urls.clone()
    } else if args.processes > 0 {
        let mut urls = Vec::new();
        for _ in 0..args.processes {
            let (child, url) = spawn_child(&args, &database_url).await?;
            _children.0.push(child);
            urls.push(url);
        }
        databases =
            Some(db::connect_with(&database_url, args.provider_database_url.as_deref(), 2).await?);
        urls
    } else {
        let mut config = Config::new(&database_url);
        config.provider_database_url = args.provider_database_url.clone();
        config.payment = Faults {
            fail_rate: args.payment_fail_rate,
            latency: Duration::from_millis(args.payment_latency_ms),
        };
        config.mail = Faults {
            fail_rate: args.mail_fail_rate,
            latency: Duration::ZERO,
        };
        config.lease = Duration::from_millis(args.lease_ms);
        config.worker_interval = Some(Duration::from_millis(args.worker_interval_ms.max(10)));
        let running = app::start(&config, "127.0.0.1:0").await?;
        let url = running.url();
        databases = Some((running.app.db().clone(), running.app.providers().clone()));
        _in_process = Some(running);
        vec![url]
    };
    let give_up_share = if databases.is_some() {
        args.give_up_share
    } else {
        if args.give_up_share > 0.0 {
            println!("storm: no database to audit given-up purchases with (pass --database-url): every client retries");
        }
        0.0
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
        "storm: {} users × {} operations × {} duplicates against {} ({} process{}, {where_}); {:.0}% of the purchases' clients give up after one try",
        args.users,
        args.operations,
        args.duplicates,
        urls.join(", "),
        urls.len(),
        if urls.len() == 1 { "" } else { "es" },
        give_up_share * 100.0
    );

    let storm = Arc::new(Storm {
        client: Client::new(urls),
        counts: Counts::default(),
        violations: Mutex::new(Vec::new()),
        duplicates: args.duplicates as usize,
        target: AtomicU64::new(0),
        give_up_share,
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

    // Wait for the workers to settle what the clients left, then learn how the given-up
    // purchases ended and audit every charge.
    let audit = databases.map(|(shop, providers)| Audit {
        shop,
        providers,
        users: format!("storm-{}-%", &run_id[..8]),
    });
    let mut tally = GiveUps::default();
    let mut settled = None;
    let tables = match &audit {
        Some(audit) => {
            let limit = Duration::from_secs(args.settle_timeout_secs);
            let (first, left, took) = audit.settle(limit).await?;
            if left > 0 {
                storm.violation(format!(
                    "{left} keys still pending {:.0} s after the traffic",
                    took.as_secs_f64()
                ));
            }
            settled = Some((first, left, took));
            let tables = audit.load().await?;
            for (user, expected) in expectations.iter_mut() {
                storm.learn(user, expected, &tables, &mut tally);
            }
            storm.check_charges(&tables, &expectations);
            Some(tables)
        }
        None => None,
    };
    for (user, expected) in &expectations {
        storm.check_ledger(user, expected, tables.as_ref()).await;
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
        "answers: executed {}  replayed {}  409 {}  422 {}  402 {}  502 payment-failed {}  other 5xx {}  client timeouts {}  other {}",
        get(&c.executed),
        get(&c.replayed),
        get(&c.conflict),
        get(&c.unprocessable),
        get(&c.refused),
        get(&c.payment_failed),
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
    if let Some((first, left, took)) = settled {
        println!(
            "given up: {} purchases sent once ({} got a definitive answer); once settled: {} completed later, {} settled failed, {} refused, {} left no key (never reserved, or released with nothing done), {} parked",
            tally.operations,
            tally.answered,
            tally.completed_later,
            tally.settled_failed,
            tally.refused,
            tally.released,
            tally.parked
        );
        println!(
            "settled: {first} keys pending when the traffic stopped, {left} left after {:.1} s",
            took.as_secs_f64()
        );
    }
    let failed: i64 = expectations.values().map(|e| e.purchases_failed).sum();
    let refunds = tables.as_ref().map_or(0, |t| t.refunds.len());
    println!(
        "checked {} ledgers: {total_charges} payments, {failed} purchases settled as failed, {refunds} refunds, {parked} e-mails parked for review",
        expectations.len()
    );
    let violations = storm.violations.lock().expect("violations");
    if violations.is_empty() {
        println!(
            "invariants: OK (every payment charged exactly once, balances consistent, one grant per order, no e-mail sent twice{})",
            if tables.is_some() {
                "; no key left pending, every charge belongs to exactly one paid order of its user or was refunded"
            } else {
                ""
            }
        );
        Ok(())
    } else {
        for v in violations.iter().take(50) {
            println!("VIOLATION: {v}");
        }
        bail!("{} invariant violations", violations.len())
    }
}
