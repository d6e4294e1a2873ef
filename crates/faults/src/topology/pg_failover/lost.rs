//! The acknowledged purchases a failover lost: found by comparing every 201 a client received
//! with the promoted standby, checked against what the documentation says can be lost, and
//! re-sent with their keys.

use super::Replication;
use crate::{
    checks::{charge_key, invariants, PURCHASE},
    client::{purchase_until_settled, OpReport, Settled},
    db::{Db, Placed, Snapshot},
    scenarios::{Env, START_BALANCE_CENTS},
};
use anyhow::{bail, ensure, Result};
use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

/// How an acknowledged purchase fared on the promoted standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Its key completed with the purchase the client received.
    Kept,
    /// Its key is gone: the reservation and everything after it were lost.
    KeyLost,
    /// Its key is there, but the completion the client saw was lost and the key was completed
    /// again: by the shops' worker from an earlier recovery point, or by the other copy of a
    /// double click, still retrying (the client then received two purchases).
    CompletedAgain,
}

/// The clients' operations once the lost ones were re-sent, and the counts.
#[derive(Debug, Default)]
pub struct Lost {
    /// Every operation, a lost one replaced by its re-sending.
    pub ops: Vec<OpReport>,
    /// Acknowledged purchases whose key was lost.
    pub key_lost: usize,
    /// Acknowledged purchases whose key was completed again.
    pub completed_again: usize,
    /// Lost purchases whose acknowledged purchase id names another purchase now (the promoted
    /// standby's sequence handed it out again).
    pub ids_reused: usize,
    /// Re-sent purchases carried out again (their key was lost).
    pub carried_out_again: usize,
    /// Re-sent purchases replayed (completed again by the worker or a retry).
    pub replayed: usize,
    /// Re-sent purchases refused for the balance (their key was lost, and the balance no
    /// longer covers them).
    pub refused: usize,
    /// The provider keys of the charges of those refused purchases: kept by the provider
    /// without an order, to be refunded.
    pub unpaid_charges: HashSet<String>,
    /// Charges the re-sending added at the provider (must be 0).
    pub new_charges: usize,
}

impl Lost {
    /// Acknowledged-then-lost purchases.
    pub fn count(&self) -> usize {
        self.key_lost + self.completed_again
    }
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "key lost {}, completed again by the worker or a retry {}, acknowledged purchase id now naming another purchase {}; re-sent with their keys: carried out again {}, replayed {}, refused for the balance {} (their charge kept by the provider without an order, to refund), new provider charges {}",
            self.key_lost,
            self.completed_again,
            self.ids_reused,
            self.carried_out_again,
            self.replayed,
            self.refused,
            self.new_charges
        )
    }
}

/// Polls until no purchase key is pending (the shops' workers carried on every purchase a
/// client or the failover left), at most `limit`.
async fn wait_no_pending(db: &Db, limit: Duration) -> Result<Snapshot> {
    let started = Instant::now();
    loop {
        let snapshot = db.snapshot().await?;
        let pending = snapshot
            .keys
            .iter()
            .filter(|k| k.operation == PURCHASE && k.state == "pending")
            .count();
        if pending == 0 {
            return Ok(snapshot);
        }
        ensure!(
            started.elapsed() < limit,
            "{pending} keys still pending after {:.0}s",
            limit.as_secs_f64()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The key (user, key) of each purchase id on the promoted standby.
fn purchase_owners(snapshot: &Snapshot) -> HashMap<String, (String, String)> {
    let purchase_of: HashMap<i64, i64> = snapshot.purchases.iter().map(|p| (p.2, p.0)).collect();
    snapshot
        .keys
        .iter()
        .filter_map(|k| match k.placed {
            Some(Placed::Order(order)) => purchase_of
                .get(&order)
                .map(|id| (id.to_string(), (k.scope.clone(), k.key.clone()))),
            _ => None,
        })
        .collect()
}

/// What became of each acknowledged purchase on the promoted standby.
fn fates(snapshot: &Snapshot, ops: &[OpReport]) -> Vec<Fate> {
    let purchase_of: HashMap<i64, i64> = snapshot.purchases.iter().map(|p| (p.2, p.0)).collect();
    let keys: HashMap<(&str, &str), _> = snapshot
        .keys
        .iter()
        .filter(|k| k.operation == PURCHASE)
        .map(|k| ((k.scope.as_str(), k.key.as_str()), k))
        .collect();
    ops.iter()
        .map(|op| {
            if op.settled != Settled::Created {
                return Fate::Kept;
            }
            let Some(k) = keys.get(&(op.user.as_str(), op.key.as_str())) else {
                return Fate::KeyLost;
            };
            let stored = match k.placed {
                Some(Placed::Order(order)) => purchase_of.get(&order).map(i64::to_string),
                _ => None,
            };
            // A double click whose copies got two purchases: one copy's 201 was lost, and the
            // other copy, still retrying, carried the purchase out again.
            let same = k.state == "completed"
                && k.status == Some(201)
                && op.purchase_ids.len() == 1
                && stored.as_ref() == op.purchase_ids.iter().next();
            if same {
                Fate::Kept
            } else {
                Fate::CompletedAgain
            }
        })
        .collect()
}

/// A lost completion took its business writes with it: leave out the charges of the purchases
/// whose key was lost (the provider keeps them; the shop lost their order), and every invariant
/// must hold: no order without its key, no completed key without its order and purchase row,
/// balances that add up, every other charge paid by exactly one order.
fn check_writes_went_with_completions(
    snapshot: &Snapshot,
    ops: &[OpReport],
    fates: &[Fate],
    unpaid: &HashSet<String>,
) -> Result<()> {
    let mut lost_charges: HashSet<String> = ops
        .iter()
        .zip(fates)
        .filter(|(_, fate)| **fate == Fate::KeyLost)
        .filter_map(|(op, _)| charge_key(&op.user, &op.key))
        .collect();
    let kept_by_provider: HashSet<&str> = snapshot
        .charges
        .iter()
        .map(|c| c.provider_key.as_str())
        .collect();
    let uncharged = lost_charges
        .iter()
        .filter(|k| !kept_by_provider.contains(k.as_str()))
        .count();
    ensure!(
        uncharged == 0,
        "{uncharged} acknowledged purchases have no charge at the provider"
    );
    lost_charges.extend(unpaid.iter().cloned());
    let mut shop_side = snapshot.clone();
    shop_side
        .charges
        .retain(|c| !lost_charges.contains(&c.provider_key));
    let (_, offenders) = invariants(&shop_side, START_BALANCE_CENTS);
    if !offenders.is_empty() {
        bail!(
            "after the failover, {} inconsistencies besides the charges of lost keys:\n  {}",
            offenders.len(),
            offenders
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
    Ok(())
}

/// The provider keys of purchases refused for the balance although the provider holds their
/// charge: a purchase in flight at the failover whose charge was made and whose order was lost,
/// carried out again by its retry once the user's balance no longer covered it. Only a lost
/// order can lead there (a refused purchase never calls the provider).
fn refused_after_charging(snapshot: &Snapshot) -> HashSet<String> {
    let charged: HashSet<&str> = snapshot
        .charges
        .iter()
        .map(|c| c.provider_key.as_str())
        .collect();
    snapshot
        .keys
        .iter()
        .filter(|k| k.operation == PURCHASE && k.placed == Some(Placed::Refused))
        .filter_map(|k| charge_key(&k.scope, &k.key))
        .filter(|pk| charged.contains(pk.as_str()))
        .collect()
}

/// Re-sends lost purchase `op` with its key and counts how it ended: carried out again (its
/// key was lost; the provider answers with its first charge), replayed (the worker completed
/// it again), or refused for the balance (its key was lost, and the user's balance no longer
/// covers it: the provider keeps a charge without an order).
async fn resend(
    http: &reqwest::Client,
    shop_url: &str,
    op: &OpReport,
    counts: &mut Lost,
) -> Result<OpReport> {
    let limit = Duration::from_secs(60);
    let again = purchase_until_settled(http, shop_url, &op.user, &op.key, &op.body, limit).await;
    match &again.settled {
        Settled::Created if again.replays == 0 => counts.carried_out_again += 1,
        Settled::Created => counts.replayed += 1,
        Settled::GaveUp(_) if again.statuses.contains_key(&402) => {
            counts.refused += 1;
            counts.unpaid_charges.extend(charge_key(&op.user, &op.key));
        }
        other => bail!("{}/{}: re-sent, it ended {other:?}", op.user, op.key),
    }
    Ok(again)
}

/// Once the workers settled what the failover left: finds the acknowledged purchases the
/// standby did not have (none may be lost under synchronous replication), checks that each lost
/// completion took its business writes with it, and re-sends each lost purchase with its key
/// through `shop_url`: carried out again under the same provider key, it must add no charge.
pub async fn settle_and_account(
    env: &Env,
    mode: Replication,
    db: &Db,
    shop_url: &str,
    mut ops: Vec<OpReport>,
) -> Result<Lost> {
    let snapshot = wait_no_pending(db, env.settle_limit).await?;
    let fates = fates(&snapshot, &ops);
    let lost: Vec<usize> = (0..ops.len()).filter(|&i| fates[i] != Fate::Kept).collect();
    if mode == Replication::Sync && !lost.is_empty() {
        let shown: Vec<String> = lost
            .iter()
            .take(10)
            .map(|&i| format!("{}/{} ({:?})", ops[i].user, ops[i].key, fates[i]))
            .collect();
        bail!(
            "synchronous replication lost {} acknowledged purchases: {}",
            lost.len(),
            shown.join(", ")
        );
    }
    let mut counts = Lost::default();
    if mode == Replication::Async {
        counts.unpaid_charges = refused_after_charging(&snapshot);
        counts.refused = counts.unpaid_charges.len();
    }
    check_writes_went_with_completions(&snapshot, &ops, &fates, &counts.unpaid_charges)?;
    let owners = purchase_owners(&snapshot);
    let http = reqwest::Client::new();
    for &i in &lost {
        match fates[i] {
            Fate::KeyLost => counts.key_lost += 1,
            _ => counts.completed_again += 1,
        }
        let this = (ops[i].user.clone(), ops[i].key.clone());
        let reused = ops[i]
            .purchase_ids
            .iter()
            .any(|id| owners.get(id).is_some_and(|owner| *owner != this));
        if reused {
            counts.ids_reused += 1;
        }
        ops[i] = resend(&http, shop_url, &ops[i], &mut counts).await?;
    }
    counts.new_charges = db
        .snapshot()
        .await?
        .charges
        .len()
        .saturating_sub(snapshot.charges.len());
    ensure!(
        counts.new_charges == 0,
        "re-sending the lost purchases added {} charges at the provider",
        counts.new_charges
    );
    counts.ops = ops;
    Ok(counts)
}

/// The settled databases for the final checks, without the charges the provider keeps for
/// purchases that were lost and then refused for the balance (they await a refund; every
/// other charge must belong to exactly one paid order).
pub async fn settled_snapshot(db: &Db, limit: Duration, lost: &Lost) -> Result<Snapshot> {
    let mut snapshot = wait_no_pending(db, limit).await?;
    snapshot
        .charges
        .retain(|c| !lost.unpaid_charges.contains(&c.provider_key));
    Ok(snapshot)
}
