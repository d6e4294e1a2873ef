//! Invariants read straight from the databases after a scenario, once no key may move any more.
//!
//! The purchase is a durable operation (order → charge → paid): a key ends `completed` with the
//! 201 (order paid with its charge, a purchase row), `completed` with a definitive 502
//! `payment-failed` (order cancelled and the debit given back; a charge, if one was made, was
//! refunded), `completed` with a 402 (balance too low, nothing written), `needs_review` (parked
//! for an operator), or absent (released before anything was recorded: no charge). The provider
//! charges with a key derived from ours ([`provider_key`]), so every charge names its key.

use crate::{
    client::{OpReport, Settled},
    db::{Db, KeyRow, Placed, Snapshot},
};
use anyhow::{bail, ensure, Result};
use idempotency::{durable::provider_key, IdempotencyKey};
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::{Duration, Instant},
};

/// The operation name of purchase keys.
pub const PURCHASE: &str = "purchase";

/// What the database says of a run: the keys, charges and orders counted by how they ended.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Logical operations the clients sent (0 when not checked against clients).
    pub operations: usize,
    /// Purchase keys in the table.
    pub keys: usize,
    /// Keys completed with the 201, exactly one charge, its order paid.
    pub executed_once: usize,
    /// Keys settled as failed (a definitive 502, order cancelled, no unrefunded charge).
    pub settled_failed: usize,
    /// Keys completed with a definitive 402 (balance too low).
    pub refused: usize,
    /// Keys parked as needs_review (allowed only without an unsettled charge).
    pub needs_review: usize,
    /// Client operations whose key is absent (released, nothing charged): the client may retry.
    pub failed_retryable: usize,
    /// Keys still pending (must be 0).
    pub pending: usize,
    /// Provider charges.
    pub charges: usize,
    /// Orders paid.
    pub paid: usize,
    /// Refunds.
    pub refunded: usize,
    /// Violations (must be 0): double charges, charges without a paid or refunded order, money
    /// that does not add up, answers that disagree with the database.
    pub duplicated: usize,
}

/// The provider key of the charge of purchase `key` of `user`, as the shop derives it.
pub fn charge_key(user: &str, key: &str) -> Option<String> {
    IdempotencyKey::new(user, PURCHASE, key)
        .ok()
        .map(|k| provider_key(&k, "charge"))
}

/// Checks a settled snapshot; returns the counts and every offender found (empty when every
/// invariant holds).
pub fn invariants(s: &Snapshot, start_balance: i64) -> (Tally, Vec<String>) {
    let mut v = Tally::default();
    let mut bad = Vec::new();
    let orders: HashMap<i64, &crate::db::OrderRow> = s.orders.iter().map(|o| (o.id, o)).collect();
    let refunded: HashSet<&str> = s.refunds.iter().map(|r| r.1.as_str()).collect();
    let charges_by_key: HashMap<&str, &crate::db::ChargeRow> = s
        .charges
        .iter()
        .map(|c| (c.provider_key.as_str(), c))
        .collect();
    let purchase_of: HashMap<i64, i64> = s.purchases.iter().map(|p| (p.2, p.0)).collect();
    let name = |k: &KeyRow| format!("{}/{}", k.scope, k.key);
    // Which key placed each order; which key each charge belongs to.
    let mut key_of_order: HashMap<i64, &KeyRow> = HashMap::new();
    let mut key_of_charge: HashMap<String, &KeyRow> = HashMap::new();
    for k in s.keys.iter().filter(|k| k.operation == PURCHASE) {
        v.keys += 1;
        if let Some(Placed::Order(order)) = k.placed {
            if let Some(other) = key_of_order.insert(order, k) {
                bad.push(format!(
                    "order {order} placed by two keys: {} and {}",
                    name(other),
                    name(k)
                ));
            }
        }
        if let Some(pk) = charge_key(&k.scope, &k.key) {
            key_of_charge.insert(pk, k);
        }
    }

    // 1. Every key is settled, and its stored answer matches its rows.
    for k in s.keys.iter().filter(|k| k.operation == PURCHASE) {
        let charge = charge_key(&k.scope, &k.key).and_then(|pk| charges_by_key.get(pk.as_str()));
        let order = match k.placed {
            Some(Placed::Order(id)) => orders.get(&id).copied(),
            _ => None,
        };
        match (k.state.as_str(), k.status) {
            ("pending", _) => {
                v.pending += 1;
                bad.push(format!(
                    "{}: still pending (recovery point {:?})",
                    name(k),
                    k.recovery_point
                ));
            }
            ("completed", Some(201)) => {
                let ok = match (order, charge) {
                    (Some(o), Some(c)) => {
                        o.status == "paid"
                            && o.user == k.scope
                            && o.charge_id.as_deref() == Some(c.charge_id.as_str())
                            && o.amount == c.amount
                            && purchase_of.contains_key(&o.id)
                            && !refunded.contains(c.charge_id.as_str())
                    }
                    _ => false,
                };
                if ok {
                    v.executed_once += 1;
                } else {
                    bad.push(format!(
                        "{}: completed with 201 but order {order:?}, charge {charge:?}, purchase row {:?}",
                        name(k),
                        order.and_then(|o| purchase_of.get(&o.id))
                    ));
                }
            }
            ("completed", Some(502)) => {
                let cancelled = order.is_some_and(|o| o.status == "cancelled");
                let unrefunded = charge.filter(|c| !refunded.contains(c.charge_id.as_str()));
                if cancelled && unrefunded.is_none() {
                    v.settled_failed += 1;
                } else {
                    bad.push(format!(
                        "{}: settled failed (502) but order {order:?}, unrefunded charge {unrefunded:?}",
                        name(k)
                    ));
                }
            }
            ("completed", Some(402)) => {
                if k.placed == Some(Placed::Refused) && charge.is_none() {
                    v.refused += 1;
                } else {
                    bad.push(format!(
                        "{}: refused (402) but placed {:?}, charge {charge:?}",
                        name(k),
                        k.placed
                    ));
                }
            }
            ("needs_review", _) => {
                v.needs_review += 1;
                eprintln!(
                    "faults: note: {} parked as needs_review: {:?}",
                    name(k),
                    k.reason
                );
            }
            (state, status) => bad.push(format!(
                "{}: unexpected state {state} with stored status {status:?}",
                name(k)
            )),
        }
    }

    // 2. Every charge belongs to exactly one paid order of its user, or was refunded; and to a
    //    key that still exists (a released key made no charge).
    let paid_by_charge: HashMap<&str, Vec<&crate::db::OrderRow>> =
        s.orders.iter().fold(HashMap::new(), |mut m, o| {
            if let (Some(c), "paid") = (o.charge_id.as_deref(), o.status.as_str()) {
                m.entry(c).or_default().push(o);
            }
            m
        });
    v.charges = s.charges.len();
    v.refunded = s.refunds.len();
    for c in &s.charges {
        let paid: Vec<_> = paid_by_charge
            .get(c.charge_id.as_str())
            .map(|os| {
                os.iter()
                    .filter(|o| o.user == c.account && o.amount == c.amount)
                    .collect()
            })
            .unwrap_or_default();
        let is_refunded = refunded.contains(c.charge_id.as_str());
        if !((paid.len() == 1 && !is_refunded) || (paid.is_empty() && is_refunded)) {
            bad.push(format!(
                "charge {} ({} cents, account {}): {} paid orders, refunded {is_refunded}",
                c.charge_id,
                c.amount,
                c.account,
                paid.len()
            ));
        }
        match key_of_charge.get(&c.provider_key) {
            Some(k) if k.scope == c.account => {}
            Some(k) => bad.push(format!(
                "charge {} of account {} made under the key of {}",
                c.charge_id,
                c.account,
                name(k)
            )),
            None => bad.push(format!(
                "charge {} (account {}, provider key {}) has no idempotency key: released after charging, or charged outside the operation",
                c.charge_id, c.account, c.provider_key
            )),
        }
    }
    let charge_ids: HashSet<&str> = s.charges.iter().map(|c| c.charge_id.as_str()).collect();
    for (refund_key, charge_id, _) in &s.refunds {
        if !charge_ids.contains(charge_id.as_str()) {
            bad.push(format!(
                "refund {refund_key} of an unknown charge {charge_id}"
            ));
        }
    }

    // 3. Every order was placed by a key and is in the state its key's settlement says.
    for o in &s.orders {
        let Some(k) = key_of_order.get(&o.id) else {
            bad.push(format!(
                "order {} ({}, {}) placed by no key",
                o.id, o.user, o.status
            ));
            continue;
        };
        let fits = match o.status.as_str() {
            "paid" => k.state == "completed" && k.status == Some(201),
            "cancelled" => k.state == "completed" && k.status == Some(502),
            "pending_payment" => k.state == "pending" || k.state == "needs_review",
            _ => false,
        };
        if o.status == "paid" {
            v.paid += 1;
        }
        if !fits {
            bad.push(format!(
                "order {} is {} but its key {} is {} ({:?})",
                o.id,
                o.status,
                name(k),
                k.state,
                k.status
            ));
        }
    }

    // 4. Money: balance + orders still holding the debit (awaiting payment, paid) = start;
    //    cancelled orders were given back. One purchase row per 201, for a paid order.
    let mut held: BTreeMap<&str, i64> = BTreeMap::new();
    let mut created: BTreeMap<&str, i64> = BTreeMap::new();
    for o in &s.orders {
        if o.status == "pending_payment" || o.status == "paid" {
            *held.entry(o.user.as_str()).or_default() += o.amount;
        }
    }
    for k in &s.keys {
        if k.operation == PURCHASE && k.state == "completed" && k.status == Some(201) {
            *created.entry(k.scope.as_str()).or_default() += 1;
        }
    }
    for (user, balance) in &s.users {
        let debited = held.get(user.as_str()).copied().unwrap_or(0);
        if balance + debited != start_balance {
            bad.push(format!(
                "{user}: balance {balance} + orders awaiting payment or paid {debited} != start {start_balance}"
            ));
        }
    }
    let mut purchases: BTreeMap<&str, i64> = BTreeMap::new();
    for (id, user, order) in &s.purchases {
        *purchases.entry(user.as_str()).or_default() += 1;
        if !orders
            .get(order)
            .is_some_and(|o| o.status == "paid" && &o.user == user)
        {
            bad.push(format!(
                "purchase {id} of {user}: order {order} is not a paid order of that user"
            ));
        }
    }
    let users: HashSet<&str> = purchases.keys().chain(created.keys()).copied().collect();
    for user in users {
        let (rows, keys) = (
            purchases.get(user).copied().unwrap_or(0),
            created.get(user).copied().unwrap_or(0),
        );
        if rows != keys {
            bad.push(format!(
                "{user}: {rows} purchase rows for {keys} keys completed with 201"
            ));
        }
    }
    v.duplicated = bad.len();
    (v, bad)
}

/// Polls until every key is settled and every charge belongs to a paid or refunded order, at most
/// `limit`; returns how long it took, or fails with the offenders.
pub async fn wait_settled(
    db: &Db,
    start_balance: i64,
    limit: Duration,
) -> Result<(Duration, Tally)> {
    let started = Instant::now();
    loop {
        let snapshot = db.snapshot().await?;
        let (tally, offenders) = invariants(&snapshot, start_balance);
        if offenders.is_empty() {
            return Ok((started.elapsed(), tally));
        }
        if started.elapsed() > limit {
            let unsettled_charges = offenders
                .iter()
                .filter(|o| o.starts_with("charge "))
                .count();
            let shown: Vec<&str> = offenders.iter().take(20).map(String::as_str).collect();
            bail!(
                "not settled after {:.0}s: {} keys pending, {unsettled_charges} charges without exactly one paid order or a refund, {} offenders in all:\n  {}",
                limit.as_secs_f64(),
                tally.pending,
                offenders.len(),
                shown.join("\n  ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks the settled database and every client operation against it: an operation answered 201
/// is a key completed with that purchase, one answered the definitive 502 a key settled failed, one
/// whose key is absent made no charge.
pub async fn check(db: &Db, ops: &[OpReport], start_balance: i64) -> Result<Tally> {
    check_snapshot(&db.snapshot().await?, ops, start_balance)
}

/// [`check`] on a snapshot already read.
pub fn check_snapshot(snapshot: &Snapshot, ops: &[OpReport], start_balance: i64) -> Result<Tally> {
    let (mut tally, mut bad) = invariants(snapshot, start_balance);
    tally.operations = ops.len();
    let keys: HashMap<(&str, &str), &KeyRow> = snapshot
        .keys
        .iter()
        .filter(|k| k.operation == PURCHASE)
        .map(|k| ((k.scope.as_str(), k.key.as_str()), k))
        .collect();
    let purchase_of: HashMap<i64, i64> = snapshot.purchases.iter().map(|p| (p.2, p.0)).collect();
    for op in ops {
        let who = format!("{}/{}", op.user, op.key);
        ensure!(
            op.purchase_ids.len() <= 1,
            "{who}: the client received different purchases {:?}",
            op.purchase_ids
        );
        let key = keys.get(&(op.user.as_str(), op.key.as_str()));
        match (&op.settled, key) {
            (Settled::Created, Some(k)) if k.state == "completed" && k.status == Some(201) => {
                let stored = match k.placed {
                    Some(Placed::Order(order)) => purchase_of.get(&order).map(i64::to_string),
                    _ => None,
                };
                if stored.as_ref() != op.purchase_ids.iter().next() {
                    bad.push(format!(
                        "{who}: the client got purchase {:?}, the database has {stored:?}",
                        op.purchase_ids
                    ));
                }
            }
            (Settled::Created, k) => bad.push(format!(
                "{who}: the client got 201 but the key is {:?}",
                k.map(|k| (&k.state, k.status))
            )),
            (Settled::Failed, Some(k)) if k.state == "completed" && k.status == Some(502) => {}
            (Settled::Failed, k) => bad.push(format!(
                "{who}: the client got the definitive 502 but the key is {:?}",
                k.map(|k| (&k.state, k.status))
            )),
            (_, None) => tally.failed_retryable += 1,
            _ => {}
        }
    }
    if !bad.is_empty() {
        for b in bad.iter().take(30) {
            eprintln!("VIOLATION {b}");
        }
        bail!("{} violations ({} keys pending)", bad.len(), tally.pending);
    }
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{ChargeRow, OrderRow};

    const START: i64 = 100_000;

    fn key(user: &str, key: &str, state: &str, status: Option<u16>, placed: Placed) -> KeyRow {
        KeyRow {
            scope: user.into(),
            operation: PURCHASE.into(),
            key: key.into(),
            state: state.into(),
            status,
            placed: Some(placed),
            recovery_point: None,
            reason: None,
        }
    }

    fn charge(user: &str, key: &str, id: &str, amount: i64) -> ChargeRow {
        ChargeRow {
            provider_key: charge_key(user, key).unwrap(),
            charge_id: id.into(),
            account: user.into(),
            amount,
        }
    }

    /// k1 paid (900), k2 settled failed without a charge, k3 refused.
    fn healthy() -> Snapshot {
        Snapshot {
            keys: vec![
                key("u", "k1", "completed", Some(201), Placed::Order(1)),
                key("u", "k2", "completed", Some(502), Placed::Order(2)),
                key("u", "k3", "completed", Some(402), Placed::Refused),
            ],
            users: vec![("u".into(), START - 900)],
            orders: vec![
                OrderRow {
                    id: 1,
                    user: "u".into(),
                    amount: 900,
                    status: "paid".into(),
                    charge_id: Some("ch1".into()),
                },
                OrderRow {
                    id: 2,
                    user: "u".into(),
                    amount: 450,
                    status: "cancelled".into(),
                    charge_id: None,
                },
            ],
            purchases: vec![(10, "u".into(), 1)],
            charges: vec![charge("u", "k1", "ch1", 900)],
            refunds: vec![],
        }
    }

    fn offenders(s: &Snapshot) -> Vec<String> {
        invariants(s, START).1
    }

    #[test]
    fn a_settled_run_passes() {
        let (tally, bad) = invariants(&healthy(), START);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            (tally.executed_once, tally.settled_failed, tally.refused),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_pending_purchase_charged_but_not_paid_is_caught() {
        let mut s = healthy();
        s.keys[0] = key("u", "k1", "pending", None, Placed::Order(1));
        s.orders[0].status = "pending_payment".into();
        s.orders[0].charge_id = None;
        s.purchases.clear();
        let bad = offenders(&s);
        assert!(bad.iter().any(|b| b.contains("still pending")), "{bad:?}");
        assert!(bad.iter().any(|b| b.starts_with("charge ch1")), "{bad:?}");
    }

    #[test]
    fn a_failed_purchase_keeping_its_charge_is_caught_unless_refunded() {
        let mut s = healthy();
        s.charges.push(charge("u", "k2", "ch2", 450));
        let bad = offenders(&s);
        assert!(bad.iter().any(|b| b.starts_with("charge ch2")), "{bad:?}");
        assert!(bad.iter().any(|b| b.contains("settled failed")), "{bad:?}");
        s.refunds.push(("r2".into(), "ch2".into(), 450));
        assert!(offenders(&s).is_empty(), "{:?}", offenders(&s));
    }

    #[test]
    fn a_charge_of_a_released_key_or_an_unknown_key_is_caught() {
        let mut s = healthy();
        s.charges.push(charge("u", "gone", "ch9", 450));
        s.refunds.push(("r9".into(), "ch9".into(), 450));
        let bad = offenders(&s);
        assert!(
            bad.iter().any(|b| b.contains("has no idempotency key")),
            "{bad:?}"
        );
    }

    #[test]
    fn a_double_charge_is_caught() {
        let mut s = healthy();
        // The same purchase charged again under another provider key.
        let mut again = charge("u", "k1", "ch1b", 900);
        again.provider_key = "shop:u/purchase/k1".into();
        s.charges.push(again);
        let bad = offenders(&s);
        assert!(bad.iter().any(|b| b.starts_with("charge ch1b")), "{bad:?}");
    }

    #[test]
    fn money_that_does_not_add_up_is_caught() {
        let mut s = healthy();
        // The cancelled order's debit was not given back.
        s.users[0].1 -= 450;
        let bad = offenders(&s);
        assert!(bad.iter().any(|b| b.contains("balance")), "{bad:?}");
        // A 201 without its purchase row.
        let mut s = healthy();
        s.purchases.clear();
        assert!(!offenders(&s).is_empty());
    }
}
