//! The phases of the `pgbouncer` topology, each on a fresh database reached through PgBouncer.

use super::{sessions, Bouncer, Breakage, PgbouncerArgs, PhaseDb};
use crate::{
    checks::Tally,
    client::{purchase_until_settled, OpReport, Settled},
    db::Db,
    scenarios::{
        answers, as_strs, collect, merge, purchase_workers, recover, settle_and_check, Env,
    },
    shop_process::ShopProcess,
};
use anyhow::{ensure, Context, Result};
use rand::Rng;
use serde_json::{json, Value};
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// Answers by status over all operations (`0`: no answer).
fn by_status(ops: &[OpReport]) -> BTreeMap<u16, usize> {
    let mut all = BTreeMap::new();
    for op in ops {
        for (status, n) in &op.statuses {
            *all.entry(*status).or_default() += n;
        }
    }
    all
}

/// Operations the client saw created (201) whose key the database does not hold completed with
/// that answer: acknowledged, then lost.
async fn acknowledged_then_lost(db: &PhaseDb, ops: &[OpReport]) -> Result<usize> {
    let db = Db::connect(&db.direct).await?;
    let snapshot = db.snapshot().await;
    db.close().await;
    let completed: std::collections::HashSet<(String, String)> = snapshot?
        .keys
        .into_iter()
        .filter(|k| k.state == "completed" && k.status == Some(201))
        .map(|k| (k.scope, k.key))
        .collect();
    Ok(ops
        .iter()
        .filter(|op| op.settled == Settled::Created)
        .filter(|op| !completed.contains(&(op.user.clone(), op.key.clone())))
        .count())
}

/// Prints one phase's counts.
fn print_counts(phase: &str, ops: &[OpReport], tally: &Tally, lost: usize) {
    println!(
        "faults: pgbouncer {phase}: {} operations; answers {}; executed once {}, settled failed {}, refused {}; duplicates {}; acknowledged-then-lost {lost}; pending {}, needs_review {}",
        ops.len(),
        answers(&by_status(ops)),
        tally.executed_once,
        tally.settled_failed,
        tally.refused,
        tally.duplicated,
        tally.pending,
        tally.needs_review
    );
}

/// The retry storm, two shop processes, through PgBouncer (`shop storm --processes 2`: it
/// checks every ledger, that no key is left pending and that every charge belongs to exactly
/// one paid order or was refunded).
pub(super) async fn storm(env: &Env, bouncer: &Bouncer, args: &PgbouncerArgs) -> Result<()> {
    let db = bouncer.fresh("storm").await?;
    let started = Instant::now();
    let out = tokio::process::Command::new(&env.shop_bin)
        .args(["storm", "--quiet", "--processes", "2", "--database-url"])
        .arg(&db.pooled)
        .args(["--users", &args.pgbouncer_storm_users.to_string()])
        .args(["--operations", &args.pgbouncer_storm_operations.to_string()])
        .output()
        .await
        .context("running shop storm")?;
    let printed = String::from_utf8_lossy(&out.stdout);
    for line in printed.lines().filter(|l| !l.trim().is_empty()) {
        println!("faults: pgbouncer storm: {line}");
    }
    ensure!(
        out.status.success(),
        "shop storm through PgBouncer failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let seen = sessions::check(bouncer, &db).await?;
    println!(
        "faults: pgbouncer storm: ok ({:.1}s); sessions: {seen}",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Durable purchases (double clicks, each copy retrying) sent to one shop that is SIGKILLed
/// `kills` times and started again; a second shop on the same database is never killed and its
/// worker resumes what the killed one left. Then the first shop is killed for good, the second
/// settles everything, and `idem recover` (through PgBouncer too) must find nothing to do.
pub(super) async fn durable_kills(env: &Env, bouncer: &Bouncer, kills: usize) -> Result<()> {
    let db = bouncer.fresh("durable").await?;
    let mut shop_args = env.shop_args();
    shop_args.extend(["--payment-latency-ms".into(), "15".into()]);
    let resumer = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let mut shop = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let workers = purchase_workers(shop.url(), 6, stop.clone());
    let started = Instant::now();
    for _ in 0..kills {
        let pause = rand::thread_rng().gen_range(150..450);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        shop.restart().await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let ops = collect(workers).await?;
    let starts = shop.starts;
    shop.kill9().await?;
    ensure!(
        !shop.panicked() && !resumer.panicked(),
        "a shop panicked; logs {} and {}",
        shop.log().display(),
        resumer.log().display()
    );
    let tally = settle_and_check(env, &db.direct, &ops)
        .await
        .with_context(|| {
            format!(
                "shop logs {} and {}",
                shop.log().display(),
                resumer.log().display()
            )
        })?;
    let recovered = recover(env, &db.pooled).await?;
    drop(resumer);
    let lost = acknowledged_then_lost(&db, &ops).await?;
    println!(
        "faults: pgbouncer durable: {kills} SIGKILLs ({starts} starts) in {:.1}s; idem recover through PgBouncer: {recovered}",
        started.elapsed().as_secs_f64()
    );
    print_counts("durable", &ops, &tally, lost);
    ensure!(tally.executed_once > 0, "nothing executed");
    ensure!(lost == 0, "{lost} purchases answered 201 were lost");
    println!(
        "faults: pgbouncer durable: sessions: {}",
        sessions::check(bouncer, &db).await?
    );
    Ok(())
}

/// Two shops waiting for requests in flight (`--wait-for-in-flight-ms`); each logical purchase
/// is sent to both at once (a double click landing on two processes, so that the wait cannot
/// be settled in memory: behind PgBouncer the store polls, `LISTEN` cannot work). No client may
/// see a 409, and some copies must have been answered by a replay after waiting.
pub(super) async fn in_flight(env: &Env, bouncer: &Bouncer, keys: usize) -> Result<()> {
    let db = bouncer.fresh("inflight").await?;
    let mut shop_args = env.shop_args();
    shop_args.extend(["--payment-latency-ms".into(), "150".into()]);
    if bouncer.breakage != Some(Breakage::NoWait) {
        shop_args.extend(["--wait-for-in-flight-ms".into(), "10000".into()]);
    }
    let a = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let b = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let started = Instant::now();
    let ops = across(a.url(), b.url(), keys, "/purchases").await?;
    let tally = settle_and_check(env, &db.direct, &ops).await?;
    let lost = acknowledged_then_lost(&db, &ops).await?;
    drop((a, b));
    let statuses = by_status(&ops);
    let conflicts = statuses.get(&409).copied().unwrap_or(0);
    let replays: usize = ops.iter().map(|o| o.replays).sum();
    println!(
        "faults: pgbouncer in-flight: {keys} double clicks across two shops in {:.1}s: {replays} copies answered by a replay, {conflicts} answered 409",
        started.elapsed().as_secs_f64()
    );
    print_counts("in-flight", &ops, &tally, lost);
    ensure!(
        conflicts == 0,
        "{conflicts} copies answered 409 in progress: the wait did not hold them"
    );
    ensure!(
        replays > 0,
        "no copy was answered by a replay: the copies never overlapped"
    );
    ensure!(lost == 0, "{lost} purchases answered 201 were lost");
    println!(
        "faults: pgbouncer in-flight: sessions: {}",
        sessions::check(bouncer, &db).await?
    );
    Ok(())
}

/// Sends each of `keys` logical requests to `path` of both shops at once, four keys at a time;
/// purchases retry through `idempotency-client`, orders through [`order_until_settled`].
async fn across(a: String, b: String, keys: usize, path: &'static str) -> Result<Vec<OpReport>> {
    let lanes: Vec<_> = (0..4)
        .map(|lane| {
            let (a, b) = (a.clone(), b.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut ops = Vec::new();
                for n in (lane..keys).step_by(4) {
                    let user = format!("pgb-user-{}", n % 6);
                    let key = uuid::Uuid::new_v4().to_string();
                    let body = json!({"sku": "tea", "quantity": 1 + n % 3});
                    let limit = Duration::from_secs(60);
                    let (x, y) = if path == "/purchases" {
                        tokio::join!(
                            purchase_until_settled(&http, &a, &user, &key, &body, limit),
                            purchase_until_settled(&http, &b, &user, &key, &body, limit),
                        )
                    } else {
                        tokio::join!(
                            order_until_settled(&http, &a, &user, &key, &body, limit),
                            order_until_settled(&http, &b, &user, &key, &body, limit),
                        )
                    };
                    ops.push(merge(x, y));
                }
                ops
            })
        })
        .collect();
    collect(lanes).await
}

/// POSTs `/orders` with `key` until it is answered 201 (or its replay), retrying transport
/// errors, 409 and 5xx every 50 ms until `limit`. The order id goes in `purchase_ids`.
async fn order_until_settled(
    http: &reqwest::Client,
    base: &str,
    user: &str,
    key: &str,
    body: &Value,
    limit: Duration,
) -> OpReport {
    let mut report = OpReport::gave_up(user, key, body.clone(), "deadline");
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let sent = http
            .post(format!("{base}/orders"))
            .header("X-User-Id", user)
            .header("Idempotency-Key", key)
            .json(body)
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let status = sent.as_ref().map_or(0, |r| r.status().as_u16());
        *report.statuses.entry(status).or_default() += 1;
        if let Ok(response) = sent {
            if !response.status().is_success() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let replayed = response.headers().contains_key("idempotent-replayed");
            let answer: Value = response.json().await.unwrap_or(Value::Null);
            report.replays += usize::from(replayed);
            report.purchase_ids.insert(answer["order_id"].to_string());
            report.settled = Settled::Created;
            return report;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    report
}

/// Keyed orders (local work) in the single-transaction mode: the key is reserved inside the
/// business transaction, under a `lock_timeout` set for that statement only
/// (`set_config(…, true)`), a duplicate waiting on the key's index for the holder's commit.
/// Each order is sent to both shops at once: both copies must name the same order, none may be
/// answered 409, one order row per key, no key left pending; and no `lock_timeout` may be left
/// on any server connection.
pub(super) async fn single_transaction(env: &Env, bouncer: &Bouncer, keys: usize) -> Result<()> {
    let db = bouncer.fresh("single").await?;
    let mut shop_args = env.shop_args();
    shop_args.extend(["--single-transaction-ms".into(), "5000".into()]);
    let a = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let b = ShopProcess::start(&env.shop_bin, &db.pooled, &as_strs(&shop_args)).await?;
    let started = Instant::now();
    let ops = across(a.url(), b.url(), keys, "/orders").await?;
    drop((a, b));
    let statuses = by_status(&ops);
    let conflicts = statuses.get(&409).copied().unwrap_or(0);
    let replays: usize = ops.iter().map(|o| o.replays).sum();
    let split = ops.iter().filter(|o| o.purchase_ids.len() != 1).count();
    let mut direct = <sqlx::PgConnection as sqlx::Connection>::connect(&db.direct).await?;
    let (orders, unsettled): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM shop_orders),
                (SELECT count(*) FROM idempotency_keys WHERE state <> 'completed')",
    )
    .fetch_one(&mut direct)
    .await?;
    println!(
        "faults: pgbouncer single-transaction: {keys} orders double-clicked across two shops in {:.1}s; answers {}; {replays} replays; {orders} order rows; copies naming different orders {split}; keys not completed {unsettled}",
        started.elapsed().as_secs_f64(),
        answers(&statuses),
    );
    ensure!(
        split == 0,
        "{split} keys: the two copies did not name one order"
    );
    ensure!(orders == keys as i64, "{orders} order rows for {keys} keys");
    ensure!(unsettled == 0, "{unsettled} keys not completed");
    ensure!(
        conflicts == 0,
        "{conflicts} copies answered 409: a duplicate did not wait for the holder"
    );
    println!(
        "faults: pgbouncer single-transaction: sessions: {}",
        sessions::check(bouncer, &db).await?
    );
    Ok(())
}
