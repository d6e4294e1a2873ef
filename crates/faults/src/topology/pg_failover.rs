//! The `pg-failover` topology: a PostgreSQL primary and a streaming standby
//! (`.ci/topology/pg-failover.sh`: clusters `failover_a` on 5441 and `failover_b` on 5442),
//! reached by two `shop` processes through PgBouncer on 5440. Mid-traffic the standby stops
//! receiving (its WAL sender SIGSTOPped on the primary, a network stall), the primary's
//! postmaster and every process it started are SIGKILLed, the standby is promoted and PgBouncer
//! re-pointed; traffic goes on against the new primary; the shops' workers settle what is left.
//!
//! Run once with synchronous replication (`synchronous_standby_names = '*'`): every
//! acknowledged 201 must be on the new primary. Once with asynchronous replication: what the
//! stall kept from the standby is lost; each acknowledged purchase whose completion was lost is
//! counted, must have lost its business writes with it, and is re-sent with its key: it is
//! carried out again under the same provider key, and the provider, whose state lives on
//! another server (`shop --provider-database-url`), answers with its first charge.

mod lost;

use crate::{
    checks::check_snapshot,
    client::OpReport,
    command,
    db::Db,
    scenarios::{
        answers as answers_text, as_strs, collect, print_verdict, purchase_workers_among, recover,
        Env, START_BALANCE_CENTS,
    },
    shop_process::ShopProcess,
};
use anyhow::{bail, ensure, Context, Result};
use rand::Rng;
use sqlx::{Connection, Executor};
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// The shops' database, through PgBouncer on the topology's endpoint.
const SHOP_URL: &str = "postgres://idem:idem@127.0.0.1:5440/shop?sslmode=disable";

/// How the standby is kept up to date.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Replication {
    /// `synchronous_standby_names = '*'`: a commit is acknowledged once the standby has it.
    Sync,
    /// `synchronous_standby_names = ''`: the standby trails the primary.
    Async,
}

impl std::fmt::Display for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Replication::Sync => "sync",
            Replication::Async => "async",
        })
    }
}

/// Settings of the `pg-failover` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct PgFailoverArgs {
    /// Replication modes to run, in this order.
    #[arg(
        long = "pg-failover-modes",
        value_enum,
        value_delimiter = ',',
        default_values_t = [Replication::Sync, Replication::Async]
    )]
    pub modes: Vec<Replication>,
    /// Clients per shop, each sending double-clicked purchases one after another.
    #[arg(long = "pg-failover-clients", default_value_t = 4)]
    pub clients: usize,
    /// Seconds of traffic before the failover (at most; at least half of it), and after it.
    #[arg(long = "pg-failover-traffic-secs", default_value_t = 4)]
    pub traffic_secs: u64,
    /// How long the standby receives nothing before the primary is killed, in milliseconds.
    #[arg(long = "pg-failover-stall-ms", default_value_t = 1500)]
    pub stall_ms: u64,
    /// The topology's control script, split on spaces (`reset MODE`, `pause-replication`,
    /// `kill-primary`, `promote` are appended).
    #[arg(
        long = "pg-failover-ctl",
        env = "FAULTS_PG_FAILOVER_CTL",
        default_value = "bash .ci/topology/pg-failover.sh"
    )]
    pub ctl: String,
}

/// Runs the scenario once per replication mode.
pub async fn run(env: &Env, args: &PgFailoverArgs) -> Result<()> {
    let ctl = command::words(&args.ctl);
    let mut failed = Vec::new();
    for &mode in &args.modes {
        let started = Instant::now();
        match run_mode(env, args, &ctl, mode).await {
            Ok(()) => println!(
                "faults: pg-failover ({mode}): ok ({:.1}s)",
                started.elapsed().as_secs_f64()
            ),
            Err(e) => {
                println!(
                    "faults: pg-failover ({mode}): FAILED ({:.1}s): {e:#}",
                    started.elapsed().as_secs_f64()
                );
                failed.push(mode.to_string());
            }
        }
    }
    ensure!(failed.is_empty(), "failed modes: {}", failed.join(", "));
    Ok(())
}

/// A fresh database for the providers on the shared server of `TEST_POSTGRES_URL` (never the
/// one that fails over): `topo_pgf_providers_MODE`.
async fn fresh_providers_database(mode: Replication) -> Result<String> {
    let admin_url = std::env::var("TEST_POSTGRES_URL")
        .context("TEST_POSTGRES_URL must name the shared PostgreSQL server (. .ci/databases.sh)")?;
    let name = format!("topo_pgf_providers_{mode}");
    let mut admin = sqlx::PgConnection::connect(&admin_url)
        .await
        .with_context(|| format!("connecting to {admin_url}"))?;
    admin
        .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
        .await?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    admin.close().await?;
    let (base, _) = admin_url
        .split_once('?')
        .unwrap_or((admin_url.as_str(), ""));
    let (server, _) = base.rsplit_once('/').context("a URL with a database")?;
    Ok(format!("{server}/{name}"))
}

/// One run, for the checks and the report.
struct Run<'a> {
    env: &'a Env,
    mode: Replication,
    /// How long the standby received nothing before the kill, in milliseconds.
    stall_ms: u64,
    /// From the SIGKILL to PgBouncer pointing at the promoted standby.
    failover: Duration,
    /// A shop, to re-send lost purchases to.
    shop_url: String,
}

/// Traffic for a while, then the stall, the SIGKILL, the promotion and the re-pointing; returns
/// how long it took from the kill.
async fn fail_over(args: &PgFailoverArgs, ctl: &[String]) -> Result<Duration> {
    let before = args.traffic_secs * 1000;
    let wait = rand::thread_rng().gen_range(before / 2..=before.max(1));
    tokio::time::sleep(Duration::from_millis(wait)).await;
    command::run(ctl, &["pause-replication"]).await?;
    tokio::time::sleep(Duration::from_millis(args.stall_ms)).await;
    let killed = Instant::now();
    command::run(ctl, &["kill-primary"]).await?;
    command::run(ctl, &["promote"]).await?;
    Ok(killed.elapsed())
}

/// Two shops through PgBouncer, their providers on `providers`.
async fn start_shops(env: &Env, providers: &str) -> Result<Vec<ShopProcess>> {
    let mut args = env.shop_args();
    args.extend([
        "--payment-latency-ms".to_owned(),
        "20".to_owned(),
        "--provider-database-url".to_owned(),
        providers.to_owned(),
    ]);
    let mut shops = Vec::new();
    for _ in 0..2 {
        shops.push(ShopProcess::start(&env.shop_bin, SHOP_URL, &as_strs(&args)).await?);
    }
    Ok(shops)
}

/// One run: fresh primary and standby in `mode`, two shops, traffic, the failover, the checks.
async fn run_mode(
    env: &Env,
    args: &PgFailoverArgs,
    ctl: &[String],
    mode: Replication,
) -> Result<()> {
    command::run(ctl, &["reset", &mode.to_string()]).await?;
    let providers = fresh_providers_database(mode).await?;
    let mut shops = start_shops(env, &providers).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for shop in &shops {
        // Enough users that no balance runs out: a purchase lost at the failover and sent again
        // is then carried out again, not refused for a balance spent meanwhile.
        let users = 24;
        clients.extend(purchase_workers_among(
            shop.url(),
            args.clients,
            users,
            stop.clone(),
        ));
    }
    let failover = fail_over(args, ctl).await;
    if failover.is_ok() {
        tokio::time::sleep(Duration::from_secs(args.traffic_secs)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let ops = collect(clients).await?;
    let run = Run {
        env,
        mode,
        stall_ms: args.stall_ms,
        failover: failover?,
        shop_url: shops[0].url(),
    };
    let judged = async {
        for shop in &mut shops {
            shop.wait_healthy(Duration::from_secs(30)).await?;
            ensure!(shop.starts == 1, "a shop had to be restarted");
            ensure!(!shop.panicked(), "a shop panicked");
        }
        let db = Db::connect_split(SHOP_URL, &providers).await?;
        let judged = judge(&run, &db, ops).await;
        db.close().await;
        judged
    }
    .await;
    for shop in &mut shops {
        shop.kill9().await?;
    }
    judged.with_context(|| {
        let logs: Vec<String> = shops
            .iter()
            .map(|s| s.log().display().to_string())
            .collect();
        format!("shop logs {}", logs.join(", "))
    })
}

/// Answers by status, over every attempt of every operation (0: no answer).
fn by_status(ops: &[OpReport]) -> BTreeMap<u16, usize> {
    let mut by_status = BTreeMap::new();
    for op in ops {
        for (status, n) in &op.statuses {
            *by_status.entry(*status).or_default() += n;
        }
    }
    by_status
}

/// The clients' answers: no 500, every 503 with `Retry-After`, every 5xx problem JSON, and the
/// failover seen (some 503 or unanswered request).
fn check_answers(ops: &[OpReport], by_status: &BTreeMap<u16, usize>) -> Result<()> {
    let bare: usize = ops.iter().map(|o| o.bare_5xx).sum();
    let unhinted: usize = ops.iter().map(|o| o.unhinted_503).sum();
    if let Some(n) = by_status.get(&500) {
        bail!("{n} answers were 500: an error of the failover was not taken for \"not now\"");
    }
    ensure!(
        unhinted == 0,
        "{unhinted} answers were 503 without Retry-After"
    );
    ensure!(bare == 0, "{bare} 5xx answers were not problem JSON");
    let seen = by_status.get(&503).copied().unwrap_or(0) + by_status.get(&0).copied().unwrap_or(0);
    ensure!(
        seen > 0,
        "no request saw the failover: the fault was not exercised"
    );
    Ok(())
}

/// Checks the answers, settles, accounts for what was lost, checks the databases, and prints
/// the counts.
async fn judge(run: &Run<'_>, db: &Db, ops: Vec<OpReport>) -> Result<()> {
    let Run { env, mode, .. } = *run;
    let answers = by_status(&ops);
    check_answers(&ops, &answers)?;
    let lost = lost::settle_and_account(env, mode, db, &run.shop_url, ops).await?;
    let snapshot = lost::settled_snapshot(db, env.settle_limit, &lost).await?;
    let tally = check_snapshot(&snapshot, &lost.ops, START_BALANCE_CENTS)?;
    let recovered = recover(env, SHOP_URL).await?;
    println!(
        "faults: pg-failover ({mode}): {} operations; 1 kill: the primary SIGKILLed after a {} ms replication stall, the standby promoted and PgBouncer re-pointed {:.1}s after the kill; answers {}; duplicates {}; acknowledged-then-lost {} ({lost}); pending {}, stuck {}; then idem recover: {recovered}",
        lost.ops.len(),
        run.stall_ms,
        run.failover.as_secs_f64(),
        answers_text(&answers),
        tally.duplicated,
        lost.count(),
        tally.pending,
        tally.needs_review,
    );
    print_verdict(&format!("pg-failover ({mode})"), &tally);
    ensure!(
        tally.needs_review == 0,
        "{} keys parked as needs_review",
        tally.needs_review
    );
    ensure!(tally.executed_once > 0, "nothing was bought");
    Ok(())
}
