//! The provided failure count of [`Store::count_failure`] and [`Store::failure_count`], for a
//! store without an upsert: one completed **record row** per failure, keyed
//! `"{counter's operation}-{n}"`, each inserted under the key table's unique constraint, so that
//! copies failing at the same time take different numbers.

use super::{Effects, Insertion, LeaseToken, PendingRow, Store};
use crate::{error::StoreError, IdempotencyKey};

/// How many times a record is tried again when the row it met vanished meanwhile.
const RECORD_ATTEMPTS: u32 = 8;

/// The longest suffix a record adds to the counter's operation: `-` and up to 10 digits.
pub(crate) const RECORD_SUFFIX_MAX: usize = "-".len() + 10;

/// The key of the `number`-th record of `counter`.
fn record_key(counter: &IdempotencyKey, number: u32) -> Result<IdempotencyKey, StoreError> {
    IdempotencyKey::new(
        counter.scope(),
        format!("{}-{number}", counter.operation()),
        counter.key(),
    )
    .map_err(|e| StoreError::Corrupt(format!("failure record key: {e}")))
}

/// Completes the first free record `1..=limit` of `counter` with `result` and returns its
/// number, or `limit` when all are taken. Two statements and a commit per record tried.
pub(crate) async fn count_by_records<S: Store>(
    store: &S,
    counter: &PendingRow<'_>,
    result: &[u8],
    limit: u32,
) -> Result<u32, StoreError> {
    let mut number = 1;
    let mut vanished = 0;
    while number <= limit {
        let record = record_key(counter.key, number)?;
        let row = PendingRow {
            key: &record,
            token: LeaseToken::new(),
            effects: Effects::Local,
            journaled: false,
            ..*counter
        };
        match store.insert_pending(&row).await? {
            Insertion::Inserted => {
                let mut tx = store.begin().await?;
                let completed = store
                    .complete(&mut tx, &record, row.token, result, row.retention)
                    .await?;
                if completed {
                    tx.commit().await?;
                }
                return Ok(number);
            }
            Insertion::Conflict(_) => number += 1,
            Insertion::Vanished if vanished < RECORD_ATTEMPTS => vanished += 1,
            Insertion::Vanished => return Err(StoreError::Contention(RECORD_ATTEMPTS)),
        }
    }
    Ok(limit)
}

/// How many records `1..=limit` of `counter` exist, counted from 1 up to the first missing one.
pub(crate) async fn count_records<S: Store>(
    store: &S,
    counter: &IdempotencyKey,
    limit: u32,
) -> Result<u32, StoreError> {
    let mut failures = 0;
    while failures < limit {
        if store
            .find(&record_key(counter, failures + 1)?)
            .await?
            .is_none()
        {
            break;
        }
        failures += 1;
    }
    Ok(failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::MAX_PART_LEN;

    #[test]
    fn records_fit_the_key() {
        let long = "t".repeat(MAX_PART_LEN - RECORD_SUFFIX_MAX);
        let counter = IdempotencyKey::new("q", long, "m").unwrap();
        assert!(record_key(&counter, u32::MAX).is_ok());
        assert_eq!(
            record_key(&IdempotencyKey::new("q", "t#failures", "m").unwrap(), 2)
                .unwrap()
                .operation(),
            "t#failures-2"
        );
    }
}
