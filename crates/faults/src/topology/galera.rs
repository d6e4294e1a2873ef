//! The `galera` topology: a three-node MariaDB Galera cluster (`.ci/topology/galera.sh`), one
//! `shop` process bound to each node. Every key is raced by `--galera-racers` clients split
//! across the shops, so two nodes accept the same key at once and Galera's certification decides
//! on commit; mid-race one node's `mariadbd` is SIGKILLed and rejoins (IST) while the traffic
//! goes on. Then, from the databases: one execution per key (one order, one charge), every racer
//! answered the same purchase, no 500 and no 503 without `Retry-After`, no key pending (the
//! worker settles, `idem recover --once` finds nothing), and every node, read on its own, holds
//! the same rows.

mod cluster;

use crate::{
    client::{purchase_until_settled, OpReport, Settled},
    command,
    scenarios::{as_strs, merge, print_verdict, recover, settle_and_check, Env},
    shop_process::ShopProcess,
};
use anyhow::{bail, ensure, Context, Result};
use cluster::Conflicts;
use serde_json::json;
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// Settings of the `galera` topology.
#[derive(Debug, Clone, clap::Args)]
pub struct GaleraArgs {
    /// Keys raced on the Galera cluster.
    #[arg(long, default_value_t = 40)]
    pub galera_trials: usize,
    /// Concurrent clients per key, split across the shops (one shop per node).
    #[arg(long, default_value_t = 16)]
    pub galera_racers: usize,
    /// Keys raced at once.
    #[arg(long, default_value_t = 4)]
    pub galera_parallel: usize,
    /// The node whose `mariadbd` is SIGKILLed and rejoined mid-race (2 or 3).
    #[arg(long, default_value_t = 2)]
    pub galera_kill_node: u8,
    /// The cluster's control script, split on spaces (`start N` is appended).
    #[arg(long, default_value = "bash .ci/topology/galera.sh")]
    pub galera_ctl: String,
}

/// Users the keys are spread over.
const USERS: usize = 8;

/// How long one racer keeps retrying its purchase.
const RACER_LIMIT: Duration = Duration::from_secs(180);

/// What the node kill and rejoin took.
#[derive(Debug, Clone, Copy)]
struct Fault {
    pid: u32,
    /// Keys done when the node was killed.
    at_trial: usize,
    /// From SIGKILL until the rejoined node was Synced.
    down: Duration,
    /// The rejoin (`start N`): recovery, IST, Synced.
    rejoin: Duration,
    /// The killed node's counters just before the kill (they restart from 0 with it).
    conflicts_before_kill: Conflicts,
}

/// Runs the `galera` scenario.
pub async fn run(env: &Env, args: &GaleraArgs) -> Result<()> {
    ensure!(
        matches!(args.galera_kill_node, 2 | 3),
        "--galera-kill-node must be 2 or 3"
    );
    ensure!(
        args.galera_trials >= 4,
        "--galera-trials must be at least 4"
    );
    cluster::ensure_synced().await?;
    cluster::fresh_database().await?;
    let conflicts_at_start = Conflicts::all().await?;
    let shops = start_shops(env).await?;
    let started = Instant::now();
    let done = Arc::new(AtomicUsize::new(0));
    let fault = tokio::spawn(inject(
        command::words(&args.galera_ctl),
        args.galera_kill_node,
        done.clone(),
        args.galera_trials / 4,
    ));
    let urls: Vec<String> = shops.iter().map(ShopProcess::url).collect();
    let races = race_all(&urls, args, done).await;
    let fault = fault.await.context("the fault task")?;
    let (races, fault) = (races?, fault?);
    let traffic = started.elapsed();
    for shop in &shops {
        ensure!(
            !shop.panicked(),
            "a shop panicked; log {}",
            shop.log().display()
        );
    }
    let conflicts = conflicts_since(&conflicts_at_start, args.galera_kill_node, &fault).await?;
    let verdict = verdict(env, args, &races).await;
    drop(shops);
    let verdict = verdict?;
    report(args, &races, &fault, traffic, conflicts, &verdict);
    verdict.ensure_clean(args)
}

/// One shop per node, started at once (their migrations race too).
async fn start_shops(env: &Env) -> Result<Vec<ShopProcess>> {
    let mut shop_args = env.shop_args();
    shop_args.extend(["--payment-latency-ms".into(), "15".into()]);
    let starts = cluster::NODES.map(|node| {
        let (bin, url, args) = (
            env.shop_bin.clone(),
            cluster::url(node, cluster::DATABASE),
            shop_args.clone(),
        );
        tokio::spawn(async move {
            ShopProcess::start(&bin, &url, &as_strs(&args))
                .await
                .with_context(|| format!("the shop on node {node}"))
        })
    });
    let mut shops = Vec::new();
    for start in starts {
        shops.push(start.await??);
    }
    Ok(shops)
}

/// Once `kill_after` keys are done: SIGKILL node `node`'s `mariadbd`, leave it down a moment
/// (its shop answers 503 meanwhile), then rejoin it through the script while the race goes on.
async fn inject(
    ctl: Vec<String>,
    node: u8,
    done: Arc<AtomicUsize>,
    kill_after: usize,
) -> Result<Fault> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while done.load(Ordering::SeqCst) < kill_after {
        ensure!(
            Instant::now() < deadline,
            "{kill_after} keys were not done within 300 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let at_trial = done.load(Ordering::SeqCst);
    let conflicts_before_kill = Conflicts::of(node).await?;
    let killed = Instant::now();
    let pid = cluster::kill9(node).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rejoining = Instant::now();
    command::run(&ctl, &["start", &node.to_string()])
        .await
        .with_context(|| format!("rejoining node {node}"))?;
    Ok(Fault {
        pid,
        at_trial,
        down: killed.elapsed(),
        rejoin: rejoining.elapsed(),
        conflicts_before_kill,
    })
}

/// One key raced by every racer: the merged report, and how many racers ended with the 201.
struct Race {
    op: OpReport,
    created: usize,
}

/// Races every key, `--galera-parallel` at a time; counts the keys done in `done`.
async fn race_all(urls: &[String], args: &GaleraArgs, done: Arc<AtomicUsize>) -> Result<Vec<Race>> {
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..args.galera_parallel.max(1))
        .map(|_| {
            let (urls, next, done) = (urls.to_vec(), next.clone(), done.clone());
            let (trials, racers) = (args.galera_trials, args.galera_racers);
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut races = Vec::new();
                loop {
                    let trial = next.fetch_add(1, Ordering::SeqCst);
                    if trial >= trials {
                        return races;
                    }
                    races.push(race(&http, &urls, trial, racers).await);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let mut races = Vec::new();
    for worker in workers {
        races.extend(worker.await?);
    }
    Ok(races)
}

/// One key: `racers` clients at once, racer `i` on shop `i mod shops`.
async fn race(http: &reqwest::Client, urls: &[String], trial: usize, racers: usize) -> Race {
    let key = uuid::Uuid::new_v4().to_string();
    let user = format!("galera-{}", trial % USERS);
    let body = json!({"sku": "tea", "quantity": 1 + trial % 3});
    let mut set = tokio::task::JoinSet::new();
    for racer in 0..racers {
        let (http, url) = (http.clone(), urls[racer % urls.len()].clone());
        let (user, key, body) = (user.clone(), key.clone(), body.clone());
        set.spawn(async move {
            purchase_until_settled(&http, &url, &user, &key, &body, RACER_LIMIT).await
        });
    }
    let mut merged: Option<OpReport> = None;
    let mut created = 0;
    while let Some(joined) = set.join_next().await {
        let op = match joined {
            Ok(op) => op,
            Err(e) => gave_up(&user, &key, format!("racer task: {e}")),
        };
        created += usize::from(op.settled == Settled::Created);
        merged = Some(match merged {
            None => op,
            Some(m) => merge(m, op),
        });
    }
    let op = merged.unwrap_or_else(|| gave_up(&user, &key, "no racer".into()));
    Race { op, created }
}

fn gave_up(user: &str, key: &str, why: String) -> OpReport {
    OpReport::gave_up(user, key, serde_json::Value::Null, &why)
}

/// The conflicts every node counted during the run (the killed node's before its kill, and
/// since its restart).
async fn conflicts_since(
    start: &BTreeMap<u8, Conflicts>,
    killed: u8,
    fault: &Fault,
) -> Result<Conflicts> {
    let end = Conflicts::all().await?;
    let mut total = Conflicts::default();
    for node in cluster::NODES {
        let (before, after) = (start[&node], end[&node]);
        total = total.plus(if node == killed {
            fault.conflicts_before_kill.since(before).plus(after)
        } else {
            after.since(before)
        });
    }
    Ok(total)
}

/// What the databases and the clients say once the race is over.
struct Verdict {
    tally: crate::checks::Tally,
    recovered: String,
    nodes: Vec<cluster::Holdings>,
    answers: BTreeMap<u16, usize>,
    /// Racers that did not end with the 201.
    unsettled_racers: usize,
    /// Keys whose racers received more than one purchase, or none.
    split_keys: usize,
    /// Keys a client saw created whose 201 purchase no node holds.
    acked_then_lost: usize,
    unhinted_503: usize,
    bare_5xx: usize,
}

/// Lets the worker settle, checks node 1's tables against every client, runs `idem recover
/// --once`, and reads every node until they agree.
async fn verdict(env: &Env, args: &GaleraArgs, races: &[Race]) -> Result<Verdict> {
    let url = cluster::url(1, cluster::DATABASE);
    let ops: Vec<OpReport> = races.iter().map(|r| r.op.clone()).collect();
    let tally = settle_and_check(env, &url, &ops).await?;
    let recovered = recover(env, &url).await?;
    let nodes = cluster::agreeing(Duration::from_secs(60)).await?;
    let mut answers = BTreeMap::new();
    for op in &ops {
        for (status, n) in &op.statuses {
            *answers.entry(*status).or_default() += n;
        }
    }
    let acked_then_lost = nodes.iter().map(|h| lost_on(h, &ops)).max().unwrap_or(0);
    Ok(Verdict {
        tally,
        recovered,
        nodes,
        answers,
        unsettled_racers: races.iter().map(|r| args.galera_racers - r.created).sum(),
        split_keys: ops.iter().filter(|o| o.purchase_ids.len() != 1).count(),
        acked_then_lost,
        unhinted_503: ops.iter().map(|o| o.unhinted_503).sum(),
        bare_5xx: ops.iter().map(|o| o.bare_5xx).sum(),
    })
}

/// Keys a client saw created (201) that node `h` does not hold as completed with that purchase.
fn lost_on(h: &cluster::Holdings, ops: &[OpReport]) -> usize {
    let s = &h.snapshot;
    let purchase_of: BTreeMap<i64, i64> = s.purchases.iter().map(|p| (p.2, p.0)).collect();
    let held: BTreeMap<(&str, &str), String> = s
        .keys
        .iter()
        .filter(|k| k.state == "completed" && k.status == Some(201))
        .filter_map(|k| match k.placed {
            Some(crate::db::Placed::Order(order)) => purchase_of
                .get(&order)
                .map(|p| ((k.scope.as_str(), k.key.as_str()), p.to_string())),
            _ => None,
        })
        .collect();
    ops.iter()
        .filter(|o| o.settled == Settled::Created)
        .filter(|o| held.get(&(o.user.as_str(), o.key.as_str())) != o.purchase_ids.iter().next())
        .count()
}

impl Verdict {
    /// Fails on any violated check.
    fn ensure_clean(&self, args: &GaleraArgs) -> Result<()> {
        let t = &self.tally;
        let trials = args.galera_trials;
        let server_errors: usize = self
            .answers
            .iter()
            .filter(|(s, _)| **s >= 500 && **s != 503)
            .map(|(_, n)| n)
            .sum();
        let mut bad = Vec::new();
        if t.duplicated > 0 {
            bad.push(format!("{} violations (double charges …)", t.duplicated));
        }
        if t.executed_once != trials || t.charges != trials || t.paid != trials {
            bad.push(format!(
                "{trials} keys, but {} executed once, {} charges, {} orders paid",
                t.executed_once, t.charges, t.paid
            ));
        }
        if t.pending > 0 || t.needs_review > 0 {
            bad.push(format!(
                "{} keys pending, {} needs_review",
                t.pending, t.needs_review
            ));
        }
        if self.unsettled_racers > 0 || self.split_keys > 0 {
            bad.push(format!(
                "{} racers without the 201, {} keys whose racers got other than one purchase",
                self.unsettled_racers, self.split_keys
            ));
        }
        if self.acked_then_lost > 0 {
            bad.push(format!(
                "{} keys acknowledged with 201 then lost on a node",
                self.acked_then_lost
            ));
        }
        if server_errors > 0 || self.bare_5xx > 0 || self.unhinted_503 > 0 {
            bad.push(format!("{server_errors} 5xx other than 503, {} 5xx without problem JSON, {} 503 without Retry-After", self.bare_5xx, self.unhinted_503));
        }
        if self.answers.get(&503).copied().unwrap_or(0) == 0 {
            bad.push(
                "no request saw the node's outage (no 503): the fault was not exercised".into(),
            );
        }
        if !bad.is_empty() {
            bail!("{}", bad.join("; "));
        }
        Ok(())
    }
}

fn answers(by_status: &BTreeMap<u16, usize>) -> String {
    by_status
        .iter()
        .map(|(status, n)| match status {
            0 => format!("transport error {n}"),
            s => format!("{s} {n}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn report(
    args: &GaleraArgs,
    races: &[Race],
    fault: &Fault,
    traffic: Duration,
    conflicts: Conflicts,
    v: &Verdict,
) {
    let requests: usize = v.answers.values().sum();
    let replays: usize = races.iter().map(|r| r.op.replays).sum();
    println!(
        "faults: galera: {} keys x {} racers over {} shops (one per node), {requests} requests in {:.1}s; kills 1: node {}'s mariadbd (pid {}) SIGKILLed after {} keys, rejoined (IST) in {:.1}s, {:.1}s from the kill to Synced",
        args.galera_trials,
        args.galera_racers,
        cluster::NODES.len(),
        traffic.as_secs_f64(),
        args.galera_kill_node,
        fault.pid,
        fault.at_trial,
        fault.rejoin.as_secs_f64(),
        fault.down.as_secs_f64(),
    );
    println!(
        "faults: galera: answers {}; replays {replays}; 5xx without problem JSON {}, 503 without Retry-After {}; certification failures {}, brute-force aborts {} (summed over the nodes)",
        answers(&v.answers),
        v.bare_5xx,
        v.unhinted_503,
        conflicts.cert_failures,
        conflicts.bf_aborts,
    );
    println!(
        "faults: galera: duplicates {}, acknowledged-then-lost {}, racers without the 201 {}, pending {}, needs_review {}; idem recover: {}",
        v.tally.duplicated,
        v.acked_then_lost,
        v.unsettled_racers,
        v.tally.pending,
        v.tally.needs_review,
        v.recovered
    );
    let nodes: Vec<String> = v
        .nodes
        .iter()
        .map(|h| format!("node {}: {}", h.node, h.counts()))
        .collect();
    println!(
        "faults: galera: every node holds the same rows: {}",
        nodes.join("; ")
    );
    print_verdict("galera", &v.tally);
}
