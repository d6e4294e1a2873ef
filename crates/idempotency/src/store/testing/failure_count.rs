//! Scenarios of the failure counter ([`Store::count_failure`], [`Store::failure_count`]), run
//! in the `protocol` suite: every store has them, its own or the provided ones.

use super::{store_name, unique, Profile};
use crate::{
    store::{LeaseToken, PendingRow},
    Effects, Fingerprint, IdempotencyKey, Store,
};
use std::{sync::Arc, time::Duration};

/// How many copies of one message fail at the same time.
const COPIES: u32 = 24;

/// A counter row of a message that fails, for the test's counter `counter`.
fn counter_row(counter: &IdempotencyKey) -> PendingRow<'_> {
    PendingRow {
        key: counter,
        fingerprint: Fingerprint::of_bytes(b"the message"),
        token: LeaseToken::new(),
        effects: Effects::Local,
        journaled: false,
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(3600),
    }
}

/// Counting: a counter starts at 0, counts 1, 2 …, and two counters do not share a count.
pub async fn failures_are_counted_one_by_one<S: Store>(store: S, _profile: Profile) {
    let name = store_name::<S>();
    let id = unique("counted");
    let counter = IdempotencyKey::new("queue", "order.paid#failures", &id).unwrap();
    let other = IdempotencyKey::new("queue", "order.sent#failures", &id).unwrap();
    assert_eq!(
        store.failure_count(&counter, 10).await.unwrap(),
        0,
        "{name}"
    );
    for expected in 1..=3 {
        let error = format!(r#"{{"error":"boom {expected}"}}"#);
        let count = store
            .count_failure(&counter_row(&counter), error.as_bytes(), 10)
            .await
            .unwrap();
        assert_eq!(
            count, expected,
            "{name}: the count after {expected} failures"
        );
        assert_eq!(store.failure_count(&counter, 10).await.unwrap(), expected);
    }
    assert_eq!(store.failure_count(&other, 10).await.unwrap(), 0, "{name}");
    assert_eq!(
        store
            .count_failure(&counter_row(&other), b"{}", 10)
            .await
            .unwrap(),
        1,
        "{name}: another message type counts on its own"
    );
}

/// Copies of one message failing at the same time each count: `COPIES` concurrent counts get
/// the counts 1 to `COPIES`, each once, and leave `COPIES`.
pub async fn concurrent_failures_each_count<S: Store>(store: S, _profile: Profile) {
    let name = store_name::<S>();
    let counter = IdempotencyKey::new("queue", "order.paid#failures", unique("raced")).unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(COPIES as usize));
    let copies: Vec<_> = (0..COPIES)
        .map(|_| {
            let (store, counter, barrier) = (store.clone(), counter.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .count_failure(&counter_row(&counter), br#"{"error":"boom"}"#, 2 * COPIES)
                    .await
            })
        })
        .collect();
    let mut counts = Vec::new();
    for copy in copies {
        counts.push(copy.await.expect("a copy").expect("a count"));
    }
    counts.sort_unstable();
    assert_eq!(
        counts,
        (1..=COPIES).collect::<Vec<_>>(),
        "{name}: every concurrent failure counts once"
    );
    assert_eq!(
        store.failure_count(&counter, 2 * COPIES).await.unwrap(),
        COPIES,
        "{name}"
    );
}
