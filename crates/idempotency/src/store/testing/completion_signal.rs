//! Waiting for a pending key on a [`CompletionSignal`] store: the waiter gets the stored result
//! once the holder completes, `Settled` once the key is released or completed for another
//! request, and `TimedOut` while a live holder works.

use super::{attempt, store_name, unique, BusinessTable, Profile};
use crate::{
    protocol::Reservation,
    store::{Awaited, CompletionSignal},
    Attempt, Idempotency, Lease,
};
use serde_json::json;
use std::time::{Duration, Instant};

/// Reserves a new key; its lease and attempt.
async fn hold<S: CompletionSignal>(idem: &Idempotency<S>, prefix: &str) -> (Lease<S>, Attempt) {
    let a = attempt("waiter", &unique(prefix), json!({"n": 1}));
    match idem.reserve(&a).await.expect("reserve") {
        Reservation::Acquired(lease) => (lease, a),
        _ => panic!("{}: a new key must be acquired", store_name::<S>()),
    }
}

/// Waits for `a`'s key in a task of its own, at most `timeout`.
fn wait<S: CompletionSignal>(
    store: &S,
    a: &Attempt,
    timeout: Duration,
) -> tokio::task::JoinHandle<Awaited> {
    let (store, a) = (store.clone(), a.clone());
    tokio::spawn(async move {
        store
            .wait_for_completion(a.key(), a.fingerprint(), timeout)
            .await
            .expect("wait_for_completion")
    })
}

/// A waiter gets the stored result once the holder completes and signals it.
pub async fn a_waiter_gets_the_completed_result<S>(store: S, _profile: Profile)
where
    S: CompletionSignal,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let (lease, a) = hold(&idem, "completed").await;
    let waiter = wait(&store, &a, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let tx = store.begin().await.unwrap();
    lease.finish(tx, b"stored").await.unwrap();
    store.notify_settled(a.key()).await.unwrap();
    assert_eq!(
        waiter.await.unwrap(),
        Awaited::Completed(b"stored".to_vec())
    );
}

/// A waiter for a live holder is told `TimedOut` after its timeout, not before.
pub async fn a_waiter_times_out_while_the_holder_works<S>(store: S, _profile: Profile)
where
    S: CompletionSignal,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let (lease, a) = hold(&idem, "times-out").await;
    let started = Instant::now();
    let timeout = Duration::from_millis(300);
    let awaited = store
        .wait_for_completion(a.key(), a.fingerprint(), timeout)
        .await
        .unwrap();
    assert_eq!(awaited, Awaited::TimedOut);
    assert!(started.elapsed() >= timeout, "{:?}", started.elapsed());
    assert!(lease.release().await.unwrap());
}

/// A released key settles the wait (the waiter reserves again to learn what to do).
pub async fn a_release_settles_the_wait<S>(store: S, _profile: Profile)
where
    S: CompletionSignal,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let (lease, a) = hold(&idem, "released").await;
    let waiter = wait(&store, &a, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(lease.release().await.unwrap());
    store.notify_settled(a.key()).await.unwrap();
    assert_eq!(waiter.await.unwrap(), Awaited::Settled);
}

/// A key completed for another request settles a waiter of this one without a result.
pub async fn another_requests_completion_settles_the_wait<S>(store: S, _profile: Profile)
where
    S: CompletionSignal,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let (lease, a) = hold(&idem, "other").await;
    let other = Attempt::new(
        a.key().clone(),
        crate::Fingerprint::of_json(&json!({"n": 2})).unwrap(),
    );
    let waiter = wait(&store, &other, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let tx = store.begin().await.unwrap();
    lease.finish(tx, b"stored").await.unwrap();
    store.notify_settled(a.key()).await.unwrap();
    assert_eq!(waiter.await.unwrap(), Awaited::Settled);
}
