//! The fault scenarios. Each runs on a fresh database of the backend it is given (a PostgreSQL
//! or MariaDB database, or a SQLite file in a temporary folder; `lost-ack`, `db-restart` and
//! `db-crash` need a database server and run on PostgreSQL and MariaDB), prints its counts, and
//! fails on any duplicated charge, lost key, unsettled key, unclear answer or (SQLite) a failed
//! `PRAGMA integrity_check`.

use crate::{
    checks::{check, wait_settled, Tally},
    client::{purchase_until_settled, OpReport, Settled},
    command,
    db::Db,
    history,
    shop_process::ShopProcess,
};
use anyhow::{bail, ensure, Context, Result};
use rand::Rng;
use serde_json::{json, Value};
use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use test_support::proxy::{FaultProxy, Protocol};
use tokio::sync::Mutex;

/// Every user starts with this balance (the shop's `START_BALANCE_CENTS`).
pub const START_BALANCE_CENTS: i64 = 100_000;

/// What the scenarios need from outside.
#[derive(Debug, Clone)]
pub struct Env {
    /// The `shop` binary.
    pub shop_bin: PathBuf,
    /// The `idem` binary.
    pub idem_bin: PathBuf,
    /// Command controlling the PostgreSQL server; `stop` and `start` are appended.
    pub postgres_ctl: Vec<String>,
    /// Command controlling the MariaDB server; `stop` and `start` are appended.
    pub mysql_ctl: Vec<String>,
    /// Lease given to the shop, in milliseconds.
    pub lease_ms: u64,
    /// Pause between the shop's maintenance worker passes, in milliseconds.
    pub worker_interval_ms: u64,
    /// How long the shop's worker may take to settle every key once the traffic stopped.
    pub settle_limit: Duration,
    /// Extra arguments for the shops of the `abandon` scenario (e.g. `--no-worker`, to see it
    /// fail).
    pub abandon_shop_args: Vec<String>,
}

impl Env {
    /// `--lease-ms L --worker-interval-ms W`.
    pub fn shop_args(&self) -> Vec<String> {
        vec![
            "--lease-ms".into(),
            self.lease_ms.to_string(),
            "--worker-interval-ms".into(),
            self.worker_interval_ms.to_string(),
        ]
    }
}

pub(crate) fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Where a scenario keeps the shop's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShopDatabase {
    /// A fresh PostgreSQL database on the server of `TEST_POSTGRES_URL`.
    Postgres,
    /// A SQLite file in a temporary folder (the shop's embedded default).
    Sqlite,
    /// A fresh MariaDB database on the server of `TEST_MYSQL_URL`.
    Mysql,
}

impl ShopDatabase {
    /// Whether the backend is a database server (which can restart, and whose COMMIT reply
    /// can be lost on the network).
    pub fn is_server(self) -> bool {
        self != ShopDatabase::Sqlite
    }

    /// A fresh database on this backend's server.
    async fn fresh_server_database(self) -> Result<String> {
        let harness = match self {
            ShopDatabase::Postgres => test_support::TestDatabase::Postgres,
            ShopDatabase::Mysql => test_support::TestDatabase::MySql,
            ShopDatabase::Sqlite => bail!("SQLite has no server"),
        };
        let database = harness.fresh_database().await.with_context(|| {
            format!(
                "TEST_{}_URL must name the {self} server",
                harness.name().to_uppercase()
            )
        })?;
        Ok(database.url)
    }

    /// The wire protocol of this backend's server, for the fault proxy.
    fn protocol(self) -> Protocol {
        match self {
            ShopDatabase::Mysql => Protocol::Mysql,
            _ => Protocol::Postgres,
        }
    }

    /// The command controlling this backend's server.
    fn ctl(self, env: &Env) -> &[String] {
        match self {
            ShopDatabase::Mysql => &env.mysql_ctl,
            _ => &env.postgres_ctl,
        }
    }
}

impl std::fmt::Display for ShopDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShopDatabase::Postgres => "postgres",
            ShopDatabase::Sqlite => "sqlite",
            ShopDatabase::Mysql => "mysql",
        })
    }
}

/// A fresh database for one scenario run. A SQLite file lives in a temporary folder, deleted
/// when this is dropped unless [`FreshDatabase::keep`] was called.
pub struct FreshDatabase {
    /// The shop's `--database-url`.
    pub url: String,
    scratch: Option<tempfile::TempDir>,
}

impl FreshDatabase {
    async fn new(backend: ShopDatabase) -> Result<Self> {
        Ok(match backend {
            ShopDatabase::Postgres | ShopDatabase::Mysql => FreshDatabase {
                url: backend.fresh_server_database().await?,
                scratch: None,
            },
            ShopDatabase::Sqlite => {
                let scratch = tempfile::tempdir()?;
                FreshDatabase {
                    url: format!("sqlite://{}", scratch.path().join("shop.db").display()),
                    scratch: Some(scratch),
                }
            }
        })
    }

    /// Keeps a SQLite folder for inspection and says where it is.
    fn keep(&mut self) -> String {
        match self.scratch.take() {
            Some(scratch) => format!("databases kept in {}", scratch.keep().display()),
            None => format!("database {}", self.url),
        }
    }
}

fn purchase_body(rng: &mut impl Rng) -> Value {
    json!({"sku": "tea", "quantity": rng.gen_range(1..=3)})
}

/// One logical purchase sent as a double click (two concurrent copies), each copy retrying until
/// it settles.
async fn double_click(http: &reqwest::Client, url: &str, user: &str, body: &Value) -> OpReport {
    let key = uuid::Uuid::new_v4().to_string();
    let (a, b) = tokio::join!(
        purchase_until_settled(http, url, user, &key, body, Duration::from_secs(120)),
        purchase_until_settled(http, url, user, &key, body, Duration::from_secs(120)),
    );
    merge(a, b)
}

pub(crate) fn merge(mut a: OpReport, b: OpReport) -> OpReport {
    a.purchase_ids.extend(b.purchase_ids);
    for (status, n) in b.statuses {
        *a.statuses.entry(status).or_default() += n;
    }
    a.replays += b.replays;
    a.bare_5xx += b.bare_5xx;
    a.unhinted_503 += b.unhinted_503;
    if a.settled != Settled::Created {
        a.settled = b.settled;
    }
    a
}

/// Workers that keep starting new logical purchases until `stop` is set.
pub(crate) fn purchase_workers(
    url: String,
    workers: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<OpReport>>> {
    purchase_workers_among(url, workers, 6, stop)
}

/// [`purchase_workers`] buying for `users` users (`user-0` …).
pub(crate) fn purchase_workers_among(
    url: String,
    workers: usize,
    users: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<OpReport>>> {
    (0..workers)
        .map(|w| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut done = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let user = format!("user-{}", (w * 7 + n) % users.max(1));
                    let body = purchase_body(&mut rand::thread_rng());
                    done.push(double_click(&http, &url, &user, &body).await);
                    n += 1;
                }
                done
            })
        })
        .collect()
}

pub(crate) async fn collect(
    handles: Vec<tokio::task::JoinHandle<Vec<OpReport>>>,
) -> Result<Vec<OpReport>> {
    let mut ops = Vec::new();
    for handle in handles {
        ops.extend(handle.await?);
    }
    Ok(ops)
}

/// Runs `idem recover --once` and returns its output. The CLI has no durable operations
/// registered: it leaves durable purchase keys to the shop's worker, so after the worker settled
/// everything it must find nothing to do.
pub(crate) async fn recover(env: &Env, database_url: &str) -> Result<String> {
    let out = tokio::process::Command::new(&env.idem_bin)
        .args(["recover", "--once", "--database-url", database_url])
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "idem recover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout)
        .trim()
        .replace('\n', " | ");
    ensure!(
        printed.contains("released 0, completed 0, failed 0, parked 0"),
        "idem recover found work after the shop's worker settled everything: {printed}"
    );
    Ok(printed)
}

/// Waits (bounded) until the shop's worker has settled every key, then checks the database and
/// the clients' operations.
pub(crate) async fn settle_and_check(
    env: &Env,
    database_url: &str,
    ops: &[OpReport],
) -> Result<Tally> {
    let db = Db::connect(database_url).await?;
    let (took, _) = wait_settled(&db, START_BALANCE_CENTS, env.settle_limit).await?;
    if took > Duration::from_secs(1) {
        println!(
            "faults: the shop's worker settled the last keys in {:.1}s",
            took.as_secs_f64()
        );
    }
    let tally = check(&db, ops, START_BALANCE_CENTS).await;
    let integrity = db.integrity_check().await;
    db.close().await;
    if integrity? {
        println!("faults: PRAGMA integrity_check of both SQLite files (shop, providers): ok");
    }
    tally
}

/// What the clients saw during an outage (a database restart, a full disk).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outage {
    requests: usize,
    replays: usize,
    /// Requests that got no answer at all.
    transport: usize,
    /// 503 answers.
    unavailable: usize,
    /// 5xx answers without a problem JSON body.
    bare: usize,
}

impl Outage {
    pub(crate) fn of(ops: &[OpReport]) -> Self {
        let count = |status: u16| -> usize {
            ops.iter()
                .map(|o| o.statuses.get(&status).copied().unwrap_or(0))
                .sum()
        };
        Outage {
            requests: ops.iter().map(OpReport::requests).sum(),
            replays: ops.iter().map(|o| o.replays).sum(),
            transport: count(0),
            unavailable: count(503),
            bare: ops.iter().map(|o| o.bare_5xx).sum(),
        }
    }

    /// Fails unless some request saw the outage (`what`), and every 5xx was problem JSON.
    pub(crate) fn ensure_seen_and_explained(&self, what: &str) -> Result<()> {
        ensure!(
            self.unavailable > 0,
            "no request saw {what}: the fault was not exercised"
        );
        ensure!(self.bare == 0, "every 5xx must be application/problem+json");
        Ok(())
    }
}

impl std::fmt::Display for Outage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests, {} answered 503, {} transport errors, {} 5xx without problem JSON, {} replays",
            self.requests, self.unavailable, self.transport, self.bare, self.replays
        )
    }
}

pub(crate) fn print_verdict(name: &str, v: &Tally) {
    println!(
        "faults: {name}: tally: operations {}, executed once {}, settled failed {}, refused {}, needs_review {}, failed-retryable {}, pending {}, charges {}, refunded {}, duplicated {}",
        v.operations,
        v.executed_once,
        v.settled_failed,
        v.refused,
        v.needs_review,
        v.failed_retryable,
        v.pending,
        v.charges,
        v.refunded,
        v.duplicated
    );
}

/// SIGKILL the shop at random moments while clients keep retrying; then restart it, let its
/// worker settle what the clients left, and check.
pub async fn kill9(env: &Env, backend: ShopDatabase, kills: usize) -> Result<()> {
    let mut fresh = FreshDatabase::new(backend).await?;
    let db = fresh.url.clone();
    let mut args = env.shop_args();
    args.extend(["--payment-latency-ms".into(), "15".into()]);
    let shop = ShopProcess::start(&env.shop_bin, &db, &as_strs(&args)).await?;
    let url = shop.url();
    let shop = Arc::new(Mutex::new(shop));
    let stop = Arc::new(AtomicBool::new(false));
    let workers = purchase_workers(url, 8, stop.clone());
    let started = Instant::now();
    for _ in 0..kills {
        let pause = rand::thread_rng().gen_range(150..450);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        shop.lock().await.restart().await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let ops = collect(workers).await?;
    let mut shop = Arc::try_unwrap(shop)
        .ok()
        .context("shop still shared")?
        .into_inner();
    let starts = shop.starts;
    ensure!(
        !shop.panicked(),
        "the shop panicked; log {}",
        shop.log().display()
    );
    // Once more, then leave it alone: its worker resumes whatever is still pending.
    shop.restart().await?;
    let tally = match settle_and_check(env, &db, &ops).await {
        Ok(tally) => tally,
        Err(e) => {
            let kept = fresh.keep();
            return Err(e.context(format!("{kept}; shop log {}", shop.log().display())));
        }
    };
    ensure!(
        !shop.panicked(),
        "the shop panicked; log {}",
        shop.log().display()
    );
    shop.kill9().await?;
    let recovered = recover(env, &db).await?;
    let seen = Outage::of(&ops);
    println!(
        "faults: kill9 ({backend}): {kills} kills ({starts} starts) in {:.1}s, {} operations, {} requests, {} replays, {} transport errors; then idem recover: {recovered}",
        started.elapsed().as_secs_f64(),
        ops.len(),
        seen.requests,
        seen.replays,
        seen.transport
    );
    print_verdict(&format!("kill9 ({backend})"), &tally);
    ensure!(tally.executed_once > 0, "nothing executed");
    Ok(())
}

/// A proxy cuts the connection right after forwarding the business COMMIT, before its reply
/// (PostgreSQL's protocol or MariaDB's).
pub async fn lost_ack(env: &Env, backend: ShopDatabase, trials: usize) -> Result<()> {
    let db = backend.fresh_server_database().await?;
    let (server, proxied_at) = server_address(&db)?;
    let upstream = tokio::net::lookup_host(server)
        .await?
        .next()
        .context("resolve the database host")?;
    let proxy = FaultProxy::start_for(upstream, backend.protocol()).await;
    let proxied = proxied_at(proxy.addr().port());
    let shop = ShopProcess::start(&env.shop_bin, &proxied, &as_strs(&env.shop_args())).await?;
    let http = reqwest::Client::new();
    let mut ops = Vec::new();
    let mut replayed_after_cut = 0;
    for trial in 0..trials {
        let user = format!("ack-user-{}", trial % 3);
        let key = uuid::Uuid::new_v4().to_string();
        let cuts_before = proxy.commits_cut();
        proxy.cut_next_commit();
        let body = json!({"sku": "tea", "quantity": 1});
        let op = purchase_until_settled(
            &http,
            &shop.url(),
            &user,
            &key,
            &body,
            Duration::from_secs(60),
        )
        .await;
        ensure!(
            proxy.commits_cut() == cuts_before + 1,
            "trial {trial}: no COMMIT was cut"
        );
        ensure!(
            op.settled == Settled::Created,
            "trial {trial}: {:?}",
            op.settled
        );
        let first_failed = op.statuses.keys().any(|s| *s == 0 || *s >= 500);
        ensure!(
            first_failed,
            "trial {trial}: the cut COMMIT did not fail the first answer: {:?}",
            op.statuses
        );
        if op.replays > 0 {
            replayed_after_cut += 1;
        }
        ops.push(op);
    }
    ensure!(!shop.panicked(), "the shop panicked");
    let tally = settle_and_check(env, &db, &ops).await?;
    let seen = Outage::of(&ops);
    // The purchase is durable: the COMMIT whose reply is lost (its order step, or its last
    // step) did commit, and whoever holds the key next (the retry, or the shop's worker) goes on
    // from that recovery point, so the retry's 201 is either the stored answer (a replay) or the
    // end of a purchase it carried on itself: never a second order or charge.
    println!(
        "faults: lost-ack: {trials} COMMIT replies cut, {} requests, {} replays; retries answered from the store {replayed_after_cut}, retries that carried the purchase on from its recovery point {}",
        seen.requests,
        seen.replays,
        trials - replayed_after_cut
    );
    print_verdict("lost-ack", &tally);
    ensure!(
        tally.executed_once == trials && tally.paid == trials,
        "every trial must be one order and one charge ({} executed once, {} orders paid, {trials} trials)",
        tally.executed_once,
        tally.paid
    );
    Ok(())
}

/// The `host:port` of a server URL (`scheme://user:pass@host:port/db?…`), and the same URL
/// pointed at a local port instead, without TLS (for the fault proxy).
fn server_address(db: &str) -> Result<(String, impl Fn(u16) -> String + '_)> {
    let (scheme, rest) = db.split_once("://").context("a URL")?;
    let (userinfo, rest) = rest.rsplit_once('@').context("a URL with a user")?;
    let (server, path) = rest.split_once('/').context("a URL with a database")?;
    let database = path.split('?').next().unwrap_or(path);
    let default_port = if scheme == "mysql" { 3306 } else { 5432 };
    let server = if server.contains(':') {
        server.to_owned()
    } else {
        format!("{server}:{default_port}")
    };
    let no_tls = if scheme == "mysql" {
        "ssl-mode=disabled"
    } else {
        "sslmode=disable"
    };
    let proxied =
        move |port: u16| format!("{scheme}://{userinfo}@127.0.0.1:{port}/{database}?{no_tls}");
    Ok((server, proxied))
}

/// How the database server goes down in [`db_restart`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// A clean stop (`stop`): the server writes and flushes its log first.
    Clean,
    /// A crash: PostgreSQL `stop -m immediate` (every server process quits at once, without
    /// writing its WAL buffers, so commits made with `synchronous_commit = off` that were still
    /// in them are lost; crash recovery on start), MariaDB SIGKILL (`crash` of the control
    /// script). The process crashes, the machine does not: what reached the kernel survives.
    Crash,
}

impl Shutdown {
    /// The words appended to the backend's control command to go down this way.
    fn action(self, backend: ShopDatabase) -> &'static [&'static str] {
        match (self, backend) {
            (Shutdown::Clean, _) => &["stop"],
            (Shutdown::Crash, ShopDatabase::Mysql) => &["crash"],
            (Shutdown::Crash, _) => &["stop", "-m", "immediate"],
        }
    }

    fn scenario(self) -> &'static str {
        match self {
            Shutdown::Clean => "db-restart",
            Shutdown::Crash => "db-crash",
        }
    }
}

/// The database server (PostgreSQL or MariaDB) stops (cleanly or by a crash) mid-storm and
/// starts again: answers are 503 problem JSON meanwhile, the shop recovers by itself, and the
/// invariants hold. The crash is the proof of the reservation's relaxed durability on
/// PostgreSQL (`synchronous_commit = off` for local work and durable operations): a reservation
/// lost in the crash leaves nothing behind, because the work it guarded had not committed.
pub async fn db_restart(env: &Env, backend: ShopDatabase, shutdown: Shutdown) -> Result<()> {
    let db = backend.fresh_server_database().await?;
    let mut shop = ShopProcess::start(&env.shop_bin, &db, &as_strs(&env.shop_args())).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let workers = purchase_workers(shop.url(), 6, stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let down = Instant::now();
    command::run(backend.ctl(env), shutdown.action(backend)).await?;
    tokio::time::sleep(Duration::from_secs(5)).await; // longer than the shop's 3 s acquire timeout
    command::run(backend.ctl(env), &["start"]).await?;
    let restart_took = down.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let ops = collect(workers).await?;
    shop.wait_healthy(Duration::from_secs(10)).await?;
    ensure!(shop.starts == 1, "the shop had to be restarted");
    ensure!(!shop.panicked(), "the shop panicked");
    let tally = settle_and_check(env, &db, &ops).await?;
    let recovered = recover(env, &db).await?;
    let outage = Outage::of(&ops);
    let name = shutdown.scenario();
    println!(
        "faults: {name}: database down for {:.1}s, {} operations, {outage}; then idem recover: {recovered}",
        restart_took.as_secs_f64(),
        ops.len()
    );
    print_verdict(name, &tally);
    outage.ensure_seen_and_explained(match shutdown {
        Shutdown::Clean => "the restart",
        Shutdown::Crash => "the crash",
    })
}

/// A handler stalls past its lease while a retry takes the key over: the stale worker's commit
/// is refused and rolled back; one charge in total.
pub async fn slow_worker(env: &Env, backend: ShopDatabase, trials: usize) -> Result<()> {
    let fresh = FreshDatabase::new(backend).await?;
    let db = fresh.url.clone();
    let shop = ShopProcess::start(
        &env.shop_bin,
        &db,
        &[
            "--lease-ms",
            "800",
            // A stalled worker: its lease is not kept alive (a frozen process stops beating).
            "--no-heartbeat",
            "--payment-latency-ms",
            "1500",
            // The retry takes the key over here, not the maintenance worker (whose pass could
            // claim the key first once its lease ended).
            "--no-worker",
        ],
    )
    .await?;
    let http = reqwest::Client::new();
    let mut ops = Vec::new();
    let mut fenced = 0;
    for trial in 0..trials {
        let user = format!("slow-user-{trial}");
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "tea", "quantity": 1});
        let base = shop.url();
        let first = send_once(&http, &base, &user, &key, &body);
        let retry = async {
            tokio::time::sleep(Duration::from_millis(1100)).await; // past the 800 ms lease
            send_once(&http, &base, &user, &key, &body).await
        };
        let ((first_status, first_json), (retry_status, _)) = tokio::join!(first, retry);
        // The stale worker's next write is refused: 409 (the layer's lease-lost, or the shop's
        // in-progress: "another worker carries this purchase on").
        let kind = first_json["type"].as_str().unwrap_or_default();
        if first_status == 409 && (kind.ends_with("/lease-lost") || kind.ends_with("/in-progress"))
        {
            fenced += 1;
        } else {
            println!("faults: slow-worker ({backend}): trial {trial}: the stale worker answered {first_status} {first_json}");
        }
        ensure!(
            retry_status == 201,
            "trial {trial}: the takeover must execute, got {retry_status}"
        );
        // Both copies settle on the same purchase.
        let op = purchase_until_settled(
            &http,
            &shop.url(),
            &user,
            &key,
            &body,
            Duration::from_secs(30),
        )
        .await;
        ensure!(
            op.replays == 1,
            "trial {trial}: a later retry must be a replay"
        );
        ops.push(op);
    }
    let tally = settle_and_check(env, &db, &ops).await?;
    println!("faults: slow-worker ({backend}): {trials} stalls past the lease, {fenced} stale workers refused with 409 (lease-lost or in-progress), {trials} takeovers executed");
    print_verdict(&format!("slow-worker ({backend})"), &tally);
    ensure!(
        fenced == trials,
        "every stale worker must be fenced ({fenced}/{trials})"
    );
    Ok(())
}

async fn send_once(
    http: &reqwest::Client,
    url: &str,
    user: &str,
    key: &str,
    body: &Value,
) -> (u16, Value) {
    match http
        .post(format!("{url}/purchases"))
        .header("X-User-Id", user)
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
    {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// Hostile input: clear 4xx problem JSON, no panic, nothing stored.
pub async fn hostile(env: &Env, backend: ShopDatabase) -> Result<()> {
    let fresh = FreshDatabase::new(backend).await?;
    let db = fresh.url.clone();
    let shop = ShopProcess::start(&env.shop_bin, &db, &[]).await?;
    let pool = Db::connect(&db).await?;
    let http = reqwest::Client::new();
    let url = format!("{}/purchases", shop.url());
    let good = br#"{"sku":"tea","quantity":1}"#.to_vec();
    let huge = {
        let mut body = br#"{"sku":"tea","quantity":1,"pad":""#.to_vec();
        body.extend(std::iter::repeat_n(b'x', 10 * 1024 * 1024));
        body.extend(br#""}"#);
        body
    };
    type Case = (&'static str, Vec<(&'static str, Vec<u8>)>, Vec<u8>);
    let cases: Vec<Case> = vec![
        (
            "invalid UTF-8 in the key",
            vec![("idempotency-key", b"k\xff\xfe".to_vec())],
            good.clone(),
        ),
        (
            "invalid UTF-8 in the user",
            vec![
                ("x-user-id", b"u\xff".to_vec()),
                ("idempotency-key", b"k-utf8".to_vec()),
            ],
            good.clone(),
        ),
        (
            "10,000-character key",
            vec![("idempotency-key", vec![b'k'; 10_000])],
            good.clone(),
        ),
        (
            "key with a tab",
            vec![("idempotency-key", b"a\tb".to_vec())],
            good.clone(),
        ),
        (
            "malformed structured-field key",
            vec![("idempotency-key", b"\"unterminated".to_vec())],
            good.clone(),
        ),
        ("missing key", vec![], good.clone()),
        (
            "not JSON on a JSON route",
            vec![("idempotency-key", b"k-notjson".to_vec())],
            b"sku=tea&quantity=1".to_vec(),
        ),
        (
            "JSON of the wrong shape",
            vec![("idempotency-key", b"k-shape".to_vec())],
            br#"{"sku": 5}"#.to_vec(),
        ),
        (
            "unknown SKU",
            vec![("idempotency-key", b"k-sku".to_vec())],
            br#"{"sku":"'; DROP TABLE shop_orders; --","quantity":1}"#.to_vec(),
        ),
    ];
    let mut answered = Vec::new();
    {
        // The server answers 413 before the client has sent 10 MB and closes the connection, so
        // send it over a raw socket and read the answer while the body is still being written.
        let before = pool.stored().await?;
        let (status, content_type, detail) =
            raw_post(&shop.url(), "mallory", "k-huge", huge).await?;
        ensure!(
            status == 413,
            "10 MB body: expected 413, got {status} {detail}"
        );
        ensure!(
            content_type.starts_with("application/problem+json"),
            "10 MB body: {content_type}"
        );
        ensure!(
            pool.stored().await? == before,
            "10 MB body: something was stored"
        );
        answered.push(format!("10 MB body → {status}"));
    }
    for (name, headers, body) in cases {
        let before = pool.stored().await?;
        let mut request = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        if !headers.iter().any(|(h, _)| *h == "x-user-id") {
            request = request.header("x-user-id", "mallory");
        }
        for (header, value) in headers {
            request = request.header(header, reqwest::header::HeaderValue::from_bytes(&value)?);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("{name}: no answer"))?;
        let status = response.status().as_u16();
        let problem = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
        let detail: Value = response.json().await.unwrap_or(Value::Null);
        ensure!(
            (400..500).contains(&status),
            "{name}: expected a 4xx, got {status} {detail}"
        );
        ensure!(problem, "{name}: {status} without application/problem+json");
        ensure!(
            detail["title"].is_string() && detail["type"].is_string(),
            "{name}: problem without type/title: {detail}"
        );
        ensure!(
            pool.stored().await? == before,
            "{name}: something was stored"
        );
        answered.push(format!("{name} → {status}"));
    }
    // A key made of SQL metacharacters is a valid key: it is stored as data, replayed, and the
    // tables are intact.
    let nasty = r#"'; DROP TABLE idempotency_keys; -- " OR 1=1 /* \ %_"#;
    let body = json!({"sku": "tea", "quantity": 1});
    let first = purchase_until_settled(
        &http,
        &shop.url(),
        "mallory",
        nasty,
        &body,
        Duration::from_secs(10),
    )
    .await;
    let again = purchase_until_settled(
        &http,
        &shop.url(),
        "mallory",
        nasty,
        &body,
        Duration::from_secs(10),
    )
    .await;
    ensure!(
        first.settled == Settled::Created && again.replays == 1,
        "SQL-metacharacter key: {first:?} / {again:?}"
    );
    let kept: Vec<String> = pool
        .snapshot()
        .await?
        .keys
        .into_iter()
        .filter(|k| k.scope == "mallory")
        .map(|k| k.key)
        .collect();
    ensure!(kept == [nasty], "the key was not stored verbatim: {kept:?}");
    shop_alive(&shop).await?;
    println!(
        "faults: hostile ({backend}): {} hostile requests answered 4xx problem JSON with nothing stored: {}",
        answered.len(),
        answered.join("; ")
    );
    println!("faults: hostile ({backend}): a key of SQL metacharacters was stored verbatim, executed once and replayed; no panic");
    Ok(())
}

/// POSTs `/purchases` over a raw HTTP/1.1 connection, writing the body in the background, and
/// returns the status, content type and body of the answer.
async fn raw_post(
    base: &str,
    user: &str,
    key: &str,
    body: Vec<u8>,
) -> Result<(u16, String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = base.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(authority).await?;
    let (mut read, mut write) = stream.into_split();
    let head = format!(
        "POST /purchases HTTP/1.1\r\nHost: {authority}\r\nX-User-Id: {user}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let writer = tokio::spawn(async move {
        let _ = write.write_all(head.as_bytes()).await;
        let _ = write.write_all(&body).await;
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let n = match tokio::time::timeout_at(deadline, read.read(&mut buf)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => 0,
        };
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
            let length = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if length.is_some_and(|len| answer.len() >= end + 4 + len) {
                break;
            }
        }
    }
    writer.abort();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line in the answer")?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_owned()))
}

async fn shop_alive(shop: &ShopProcess) -> Result<()> {
    let health = reqwest::get(format!("{}/healthz", shop.url())).await?;
    ensure!(
        health.status().is_success(),
        "the shop is not healthy after hostile input"
    );
    if shop.panicked() {
        bail!("the shop panicked; log {}", shop.log().display());
    }
    Ok(())
}

/// User B sending user A's key and payload never receives A's stored response.
pub async fn cross_tenant(env: &Env, backend: ShopDatabase, trials: usize) -> Result<()> {
    let fresh = FreshDatabase::new(backend).await?;
    let db = fresh.url.clone();
    let shop = ShopProcess::start(&env.shop_bin, &db, &[]).await?;
    let http = reqwest::Client::new();
    let mut ops = Vec::new();
    for trial in 0..trials {
        let key = uuid::Uuid::new_v4().to_string();
        let body = json!({"sku": "tea", "quantity": 1 + trial % 3});
        // Both at once, then each again.
        let base = shop.url();
        let (alice, bob) = tokio::join!(
            purchase_until_settled(&http, &base, "alice", &key, &body, Duration::from_secs(30)),
            purchase_until_settled(&http, &base, "bob", &key, &body, Duration::from_secs(30)),
        );
        ensure!(
            alice.replays == 0 && bob.replays == 0,
            "trial {trial}: a first request was a replay"
        );
        ensure!(
            alice.purchase_ids != bob.purchase_ids,
            "trial {trial}: bob received alice's purchase"
        );
        let alice_again = purchase_until_settled(
            &http,
            &shop.url(),
            "alice",
            &key,
            &body,
            Duration::from_secs(30),
        )
        .await;
        let bob_again = purchase_until_settled(
            &http,
            &shop.url(),
            "bob",
            &key,
            &body,
            Duration::from_secs(30),
        )
        .await;
        ensure!(
            alice_again.purchase_ids == alice.purchase_ids,
            "trial {trial}: alice's replay changed"
        );
        ensure!(
            bob_again.purchase_ids == bob.purchase_ids,
            "trial {trial}: bob's replay changed"
        );
        ops.push(merge(alice, alice_again));
        ops.push(merge(bob, bob_again));
    }
    let tally = settle_and_check(env, &db, &ops).await?;
    println!("faults: cross-tenant ({backend}): {trials} keys sent by two users at once: {} separate executions, 0 responses crossed", 2 * trials);
    print_verdict(&format!("cross-tenant ({backend})"), &tally);
    Ok(())
}

/// The faults of an `abandon` run besides the kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Payment latency only.
    Latency,
    /// Payment latency and a provider failing half of its charges (half of the failures after
    /// charging, the answer lost).
    ProviderFaults,
}

/// What one `abandon` run saw.
#[derive(Debug, Default)]
struct AbandonRun {
    kills: usize,
    latency_ms: u64,
    sent: usize,
    refused_connections: usize,
    answers: BTreeMap<u16, usize>,
    settle: Duration,
    by_worker: usize,
    /// The histories of the keys the restarted shop's worker finished (latency variant).
    resumed: Option<history::Resumed>,
    tally: Tally,
}

/// Purchases sent once each (a fresh key, never retried) while the shop is SIGKILLed at random
/// moments and restarted; then the shop is restarted once more and left alone: within
/// `settle_limit` its own worker must leave no key pending and no charge without a paid or
/// refunded order. Two runs on `backend`: with payment latency, and with provider faults (fail
/// rate 0.5). After the run with latency only, the purchases killed mid-charge and finished by
/// the restarted shop's worker must read back through `idem keys history` as reserved, step
/// committed, call started, claimed by another process, call answered, completed
/// ([`history::check_resumed`]).
pub async fn abandon(env: &Env, backend: ShopDatabase, kills: usize) -> Result<()> {
    let mut failed = Vec::new();
    for variant in [Variant::Latency, Variant::ProviderFaults] {
        let name = format!("{backend:?}/{variant:?}").to_lowercase();
        let started = Instant::now();
        match abandon_run(env, backend, variant, kills).await {
            Ok(run) => {
                let v = &run.tally;
                println!(
                    "faults: abandon {name}: ok ({:.1}s): {} kills, payment latency {} ms; {} purchases sent once ({} more refused a connection while the shop was down), answers {}; settled {:.1}s after the last restart; keys {}: 201 {}, failed-settled {}, 402 {}, needs_review {}, settled by the worker {}; {} sent without a key left (released); charges {}, paid {}, refunded {}{}",
                    started.elapsed().as_secs_f64(),
                    run.kills,
                    run.latency_ms,
                    run.sent,
                    run.refused_connections,
                    answers(&run.answers),
                    run.settle.as_secs_f64(),
                    v.keys,
                    v.executed_once,
                    v.settled_failed,
                    v.refused,
                    v.needs_review,
                    run.by_worker,
                    v.failed_retryable,
                    v.charges,
                    v.paid,
                    v.refunded,
                    run.resumed
                        .as_ref()
                        .map(|r| format!("; {}", resumed_line(r)))
                        .unwrap_or_default(),
                );
            }
            Err(e) => {
                println!(
                    "faults: abandon {name}: FAILED ({:.1}s): {e:#}",
                    started.elapsed().as_secs_f64()
                );
                failed.push(name);
            }
        }
    }
    ensure!(failed.is_empty(), "failed runs: {}", failed.join(", "));
    Ok(())
}

/// The `idem keys history` line of a run: how many keys were resumed, and one history.
fn resumed_line(resumed: &history::Resumed) -> String {
    let (key, _, events) = resumed.example.clone().unwrap_or_default();
    format!(
        "idem keys history of {} keys finished by the worker: {} claimed by a restarted shop, {} of them killed mid-charge, each reserved > step_committed > call_started > claimed (another process) > call_answered > completed; e.g. {key}: {events}",
        resumed.read, resumed.resumed, resumed.mid_call,
    )
}

pub(crate) fn answers(by_status: &BTreeMap<u16, usize>) -> String {
    by_status
        .iter()
        .map(|(status, n)| match status {
            0 => format!("transport error {n}"),
            s => format!("{s} {n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One purchase, sent once: the client accepts whatever comes back (or nothing).
enum Sent {
    /// The connection was refused (the shop is down): the purchase never reached it.
    Refused,
    /// Sent; what came back (status 0: no answer).
    Sent(OpReport),
}

async fn purchase_once(http: &reqwest::Client, url: &str, user: &str, body: &Value) -> Sent {
    let key = uuid::Uuid::new_v4().to_string();
    let mut report = OpReport {
        user: user.to_owned(),
        key,
        body: body.clone(),
        settled: Settled::GaveUp("sent once".into()),
        purchase_ids: Default::default(),
        statuses: Default::default(),
        replays: 0,
        bare_5xx: 0,
        unhinted_503: 0,
    };
    let sent = http
        .post(format!("{url}/purchases"))
        .header("X-User-Id", user)
        .header("Idempotency-Key", &report.key)
        .json(body)
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(e) if e.is_connect() => return Sent::Refused,
        Err(_) => {
            report.statuses.insert(0, 1);
            return Sent::Sent(report);
        }
    };
    let status = response.status().as_u16();
    let json: Value = match response.bytes().await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        Err(_) => {
            report.statuses.insert(0, 1);
            return Sent::Sent(report);
        }
    };
    report.statuses.insert(status, 1);
    let kind = json["type"].as_str().unwrap_or_default();
    match status {
        201 => {
            report.settled = Settled::Created;
            if let Some(id) = json.get("purchase_id") {
                report.purchase_ids.insert(id.to_string());
            }
        }
        502 if kind.ends_with("/payment-failed") => report.settled = Settled::Failed,
        _ => {}
    }
    Sent::Sent(report)
}

async fn abandon_run(
    env: &Env,
    backend: ShopDatabase,
    variant: Variant,
    kills: usize,
) -> Result<AbandonRun> {
    let mut fresh = FreshDatabase::new(backend).await?;
    let url = fresh.url.clone();
    let latency_ms = rand::thread_rng().gen_range(50..=150);
    let mut args = vec![
        "--lease-ms".to_owned(),
        "1000".into(),
        "--worker-interval-ms".into(),
        env.worker_interval_ms.to_string(),
        "--payment-latency-ms".into(),
        latency_ms.to_string(),
    ];
    if variant == Variant::ProviderFaults {
        args.extend(["--payment-fail-rate".into(), "0.5".into()]);
    }
    args.extend(env.abandon_shop_args.iter().cloned());
    let shop = ShopProcess::start(&env.shop_bin, &url, &as_strs(&args)).await?;
    let db = Db::connect(&url).await?;
    let base = shop.url();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..5)
        .map(|c| {
            let (base, stop) = (base.clone(), stop.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let (mut ops, mut refused, mut n) = (Vec::new(), 0, 0);
                while !stop.load(Ordering::SeqCst) {
                    let user = format!("abandon-{}", (c * 5 + n) % 12);
                    let body = purchase_body(&mut rand::thread_rng());
                    match purchase_once(&http, &base, &user, &body).await {
                        Sent::Sent(op) => ops.push(op),
                        Sent::Refused => {
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    n += 1;
                }
                (ops, refused)
            })
        })
        .collect();
    let shop = Arc::new(Mutex::new(shop));
    for _ in 0..kills {
        let pause = rand::thread_rng().gen_range(150..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        shop.lock().await.restart().await?;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let (mut ops, mut refused_connections) = (Vec::new(), 0);
    for client in clients {
        let (sent, refused) = client.await?;
        ops.extend(sent);
        refused_connections += refused;
    }
    let mut shop = Arc::try_unwrap(shop)
        .ok()
        .context("shop still shared")?
        .into_inner();
    // Once more (mid-resume, if the worker was at it), then leave it alone.
    shop.restart().await?;
    let settled = wait_settled(&db, START_BALANCE_CENTS, env.settle_limit).await;
    let outcome = async {
        let (settle, _) = settled?;
        let tally = check(&db, &ops, START_BALANCE_CENTS).await?;
        db.integrity_check().await?;
        ensure!(
            !shop.panicked(),
            "the shop panicked; log {}",
            shop.log().display()
        );
        ensure!(tally.executed_once > 0, "nothing was bought");
        // Settled by the worker: the client's only answer was none, or a non-final one (503
        // pending, 409 …), yet the key ended completed.
        let completed: HashSet<(String, String)> = db
            .snapshot()
            .await?
            .keys
            .into_iter()
            .filter(|k| k.state == "completed")
            .map(|k| (k.scope, k.key))
            .collect();
        let by_worker: Vec<&OpReport> = ops
            .iter()
            .filter(|op| {
                matches!(op.settled, Settled::GaveUp(_))
                    && !op.statuses.contains_key(&402)
                    && completed.contains(&(op.user.clone(), op.key.clone()))
            })
            .collect();
        // With latency only, every resumed charge is answered: the histories of the keys
        // killed mid-charge read back in order through `idem keys history`.
        let resumed = match variant {
            Variant::Latency => {
                Some(history::check_resumed(&env.idem_bin, &url, &by_worker).await?)
            }
            Variant::ProviderFaults => None,
        };
        Ok((settle, tally, by_worker.len(), resumed))
    }
    .await;
    shop.kill9().await?;
    db.close().await;
    let (settle, tally, by_worker, resumed) = match outcome {
        Ok(done) => done,
        Err(e) => {
            let kept = fresh.keep();
            return Err(e.context(format!("{kept}; shop log {}", shop.log().display())));
        }
    };
    let mut answers = BTreeMap::new();
    for op in &ops {
        for (status, n) in &op.statuses {
            *answers.entry(*status).or_default() += n;
        }
    }
    Ok(AbandonRun {
        kills,
        latency_ms,
        sent: ops.len(),
        refused_connections,
        answers,
        settle,
        by_worker,
        resumed,
        tally,
    })
}
