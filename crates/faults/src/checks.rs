//! Invariants read straight from the database after a scenario.

use crate::client::{OpReport, Settled};
use anyhow::{ensure, Result};
use sqlx::PgPool;
use std::collections::BTreeMap;

/// What the database says of a run.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Logical operations checked.
    pub operations: usize,
    /// Operations completed, with exactly one charge.
    pub executed_once: usize,
    /// Operations parked as needs_review.
    pub needs_review: usize,
    /// Operations released (absent key, no charge): the client may retry.
    pub failed_retryable: usize,
    /// Keys still pending (must be 0).
    pub pending: usize,
    /// Operations with more than one charge, or a purchase without its key (must be 0).
    pub duplicated: usize,
}

/// Checks every operation: its key's state, its charges, the client's view, and each user's
/// balance against its charges.
pub async fn check(pool: &PgPool, ops: &[OpReport], start_balance: i64) -> Result<Verdict> {
    let mut verdict = Verdict {
        operations: ops.len(),
        ..Verdict::default()
    };
    for op in ops {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT state FROM idempotency_keys WHERE scope = $1 AND idem_key = $2",
        )
        .bind(&op.user)
        .bind(&op.key)
        .fetch_optional(pool)
        .await?;
        let charges: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM payment_provider_charges WHERE account = $1 AND provider_key LIKE '%/' || $2",
        )
        .bind(&op.user)
        .bind(&op.key)
        .fetch_one(pool)
        .await?;
        ensure!(
            op.purchase_ids.len() <= 1,
            "{}/{}: the client received different purchases {:?}",
            op.user,
            op.key,
            op.purchase_ids
        );
        match state.as_deref() {
            Some("completed") => {
                if charges == 1 {
                    verdict.executed_once += 1;
                } else {
                    verdict.duplicated += 1;
                    eprintln!(
                        "VIOLATION {}/{}: completed with {charges} charges",
                        op.user, op.key
                    );
                }
            }
            Some("needs_review") => verdict.needs_review += 1,
            Some("pending") => {
                verdict.pending += 1;
                eprintln!("VIOLATION {}/{}: still pending", op.user, op.key);
            }
            Some(other) => eprintln!("{}/{}: state {other}", op.user, op.key),
            None => {
                // Released: nothing may have been charged for good.
                if charges == 0 {
                    verdict.failed_retryable += 1;
                } else {
                    verdict.duplicated += 1;
                    eprintln!(
                        "VIOLATION {}/{}: released but charged {charges}",
                        op.user, op.key
                    );
                }
            }
        }
        if op.settled == Settled::Created {
            ensure!(
                state.as_deref() == Some("completed"),
                "{}/{}: the client got 201 but the key is {state:?}",
                op.user,
                op.key
            );
        }
    }
    // Money: every user's balance is the start balance less what was charged for completed
    // purchases; the purchases table has exactly one row per completed key.
    let mut users: BTreeMap<&str, usize> = BTreeMap::new();
    for op in ops {
        *users.entry(op.user.as_str()).or_default() += 0;
    }
    for user in users.keys() {
        let balance: Option<i64> =
            sqlx::query_scalar("SELECT balance_cents FROM shop_users WHERE id = $1")
                .bind(user)
                .fetch_optional(pool)
                .await?;
        let debited: i64 = sqlx::query_scalar(
            "SELECT COALESCE(sum(amount_cents), 0)::BIGINT FROM shop_orders WHERE user_id = $1",
        )
        .bind(user)
        .fetch_one(pool)
        .await?;
        let purchases: i64 =
            sqlx::query_scalar("SELECT count(*) FROM shop_purchases WHERE user_id = $1")
                .bind(user)
                .fetch_one(pool)
                .await?;
        let completed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND state = 'completed'
               AND operation LIKE '%purchase%'",
        )
        .bind(user)
        .fetch_one(pool)
        .await?;
        if let Some(balance) = balance {
            ensure!(
                balance + debited == start_balance,
                "{user}: balance {balance} + orders {debited} != start {start_balance}"
            );
        }
        ensure!(
            purchases == completed,
            "{user}: {purchases} purchase rows for {completed} completed keys"
        );
    }
    verdict.duplicated += sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM (SELECT provider_key FROM payment_provider_charges
           GROUP BY provider_key HAVING count(*) > 1) d",
    )
    .fetch_one(pool)
    .await? as usize;
    ensure!(
        verdict.pending == 0,
        "{} keys still pending",
        verdict.pending
    );
    ensure!(
        verdict.duplicated == 0,
        "{} operations ran twice",
        verdict.duplicated
    );
    Ok(verdict)
}
