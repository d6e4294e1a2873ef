//! The three nodes of the `galera` topology as `.ci/topology/galera.sh` runs them: their URLs,
//! their `mariadbd` processes, their replication counters, and what each node holds.

use crate::{
    checks::invariants,
    command,
    db::{Db, Snapshot},
    scenarios::START_BALANCE_CENTS,
};
use anyhow::{bail, ensure, Context, Result};
use sqlx::{mysql::MySqlPoolOptions, MySqlPool};
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

/// The nodes, numbered as the script numbers them (node N answers SQL on port 3310 + N).
pub const NODES: [u8; 3] = [1, 2, 3];

/// The scenario's database, made afresh on the cluster for every run.
pub const DATABASE: &str = "galera_proof";

/// The URL of `database` on node `node`, as user `idem`.
pub fn url(node: u8, database: &str) -> String {
    format!(
        "mysql://idem:idem@127.0.0.1:{}/{database}",
        3310 + u16::from(node)
    )
}

async fn pool(node: u8, database: &str) -> Result<MySqlPool> {
    MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url(node, database))
        .await
        .with_context(|| {
            format!("connecting to node {node} (is `.ci/topology/galera.sh up` done?)")
        })
}

/// Node `node`'s `wsrep_%` status variables.
pub async fn status(node: u8) -> Result<BTreeMap<String, String>> {
    let pool = pool(node, "idem").await?;
    let rows: Vec<(String, String)> = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'wsrep%'")
        .fetch_all(&pool)
        .await?;
    pool.close().await;
    Ok(rows.into_iter().collect())
}

/// Fails unless every node is up, `Synced`, in one cluster of three.
pub async fn ensure_synced() -> Result<()> {
    for node in NODES {
        let status = status(node).await?;
        let state = status.get("wsrep_local_state_comment").map(String::as_str);
        let size = status.get("wsrep_cluster_size").map(String::as_str);
        ensure!(
            state == Some("Synced") && size == Some("3"),
            "node {node} is {state:?} in a cluster of {size:?}, not Synced in a cluster of 3"
        );
    }
    Ok(())
}

/// Drops and creates [`DATABASE`] (through node 1; DDL replicates to every node).
pub async fn fresh_database() -> Result<()> {
    let pool = pool(1, "idem").await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {DATABASE}"))
        .execute(&pool)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(())
}

/// Certification failures and brute-force aborts a node counted since it started: the
/// conflicts between transactions of different nodes that Galera resolved by rolling one back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Conflicts {
    /// `wsrep_local_cert_failures`: local transactions that failed certification on commit.
    pub cert_failures: u64,
    /// `wsrep_local_bf_aborts`: local transactions aborted by a replicated one.
    pub bf_aborts: u64,
}

impl Conflicts {
    /// Node `node`'s counters.
    pub async fn of(node: u8) -> Result<Self> {
        let status = status(node).await?;
        let count =
            |name: &str| -> u64 { status.get(name).and_then(|v| v.parse().ok()).unwrap_or(0) };
        Ok(Conflicts {
            cert_failures: count("wsrep_local_cert_failures"),
            bf_aborts: count("wsrep_local_bf_aborts"),
        })
    }

    /// Every node's counters.
    pub async fn all() -> Result<BTreeMap<u8, Self>> {
        let mut all = BTreeMap::new();
        for node in NODES {
            all.insert(node, Conflicts::of(node).await?);
        }
        Ok(all)
    }

    /// What was counted between `before` and `after` on a node that did not restart.
    pub fn since(self, before: Self) -> Self {
        Conflicts {
            cert_failures: self.cert_failures.saturating_sub(before.cert_failures),
            bf_aborts: self.bf_aborts.saturating_sub(before.bf_aborts),
        }
    }

    /// Both counts added up.
    pub fn plus(self, other: Self) -> Self {
        Conflicts {
            cert_failures: self.cert_failures + other.cert_failures,
            bf_aborts: self.bf_aborts + other.bf_aborts,
        }
    }
}

/// The pid of node `node`'s `mariadbd`, from the pid file the script gives it.
pub fn pid(node: u8) -> Result<u32> {
    let file = format!("/run/idem-galera/n{node}.pid");
    let pid: u32 = std::fs::read_to_string(&file)
        .with_context(|| format!("reading {file}"))?
        .trim()
        .parse()
        .with_context(|| format!("{file} holds no pid"))?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    ensure!(
        comm.trim() == "mariadbd",
        "pid {pid} of {file} is not a running mariadbd ({:?})",
        comm.trim()
    );
    Ok(pid)
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// SIGKILLs node `node`'s `mariadbd` and waits until it is gone; returns its pid.
pub async fn kill9(node: u8) -> Result<u32> {
    let pid = pid(node)?;
    command::run(
        &["kill".to_owned(), "-KILL".to_owned()],
        &[&pid.to_string()],
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !gone(pid) {
        if Instant::now() > deadline {
            bail!("node {node}'s mariadbd (pid {pid}) is still alive 60 s after SIGKILL");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(pid)
}

/// What one node holds of the scenario's database.
#[derive(Debug, Clone)]
pub struct Holdings {
    /// The node.
    pub node: u8,
    /// Its tables.
    pub snapshot: Snapshot,
    /// Every row the checks read, one line each, sorted: equal on every node of a consistent
    /// cluster.
    pub rows: Vec<String>,
}

impl Holdings {
    /// Reads node `node`'s tables of [`DATABASE`].
    pub async fn read(node: u8) -> Result<Self> {
        let db = Db::connect(&url(node, DATABASE)).await?;
        let snapshot = db.snapshot().await;
        db.close().await;
        let snapshot = snapshot.with_context(|| format!("reading node {node}"))?;
        Ok(Holdings {
            node,
            rows: rows(&snapshot),
            snapshot,
        })
    }

    /// `keys K, orders O, charges C, purchases P, refunds R`.
    pub fn counts(&self) -> String {
        let s = &self.snapshot;
        format!(
            "keys {}, orders {}, charges {}, purchases {}, refunds {}",
            s.keys.len(),
            s.orders.len(),
            s.charges.len(),
            s.purchases.len(),
            s.refunds.len()
        )
    }
}

fn rows(s: &Snapshot) -> Vec<String> {
    let mut rows: Vec<String> = s
        .keys
        .iter()
        .map(|k| {
            format!(
                "key {} {} {} {} {:?} {:?} {:?}",
                k.scope, k.operation, k.key, k.state, k.status, k.placed, k.recovery_point
            )
        })
        .chain(s.users.iter().map(|u| format!("user {u:?}")))
        .chain(s.orders.iter().map(|o| format!("order {o:?}")))
        .chain(s.purchases.iter().map(|p| format!("purchase {p:?}")))
        .chain(s.charges.iter().map(|c| format!("charge {c:?}")))
        .chain(s.refunds.iter().map(|r| format!("refund {r:?}")))
        .collect();
    rows.sort();
    rows
}

/// Reads every node until all hold the same rows and each passes the invariants on its own
/// (at most `limit`: a node applies what the others committed a moment later); returns what
/// each holds.
pub async fn agreeing(limit: Duration) -> Result<Vec<Holdings>> {
    let deadline = Instant::now() + limit;
    loop {
        let mut nodes = Vec::new();
        for node in NODES {
            nodes.push(Holdings::read(node).await?);
        }
        let differ: Vec<u8> = nodes
            .iter()
            .filter(|h| h.rows != nodes[0].rows)
            .map(|h| h.node)
            .collect();
        let offenders: Vec<String> = nodes
            .iter()
            .flat_map(|h| {
                let (_, bad) = invariants(&h.snapshot, START_BALANCE_CENTS);
                bad.into_iter()
                    .map(move |b| format!("node {}: {b}", h.node))
            })
            .collect();
        if differ.is_empty() && offenders.is_empty() {
            return Ok(nodes);
        }
        if Instant::now() > deadline {
            let counts: Vec<String> = nodes
                .iter()
                .map(|h| format!("node {}: {}", h.node, h.counts()))
                .collect();
            bail!(
                "the nodes disagree after {:.0}s: nodes {differ:?} differ from node 1 ({}); {} offenders: {}",
                limit.as_secs_f64(),
                counts.join("; "),
                offenders.len(),
                offenders.iter().take(10).cloned().collect::<Vec<_>>().join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
