//! The article's protocol on any [`Store`]: replays, reused keys, releases after failures,
//! panics and cancellations, lease takeover and fencing, external work left pending, the
//! heartbeat, the replay read, and racing duplicates executing once; and the failure counter
//! (its scenarios live in `failure_count`).

pub use super::failure_count::{concurrent_failures_each_count, failures_are_counted_one_by_one};

use super::{
    attempt, count_effects, insert_effect, poll_then_drop, purchase, race, store_name, unique,
    wait_until, BusinessTable, Profile,
};
use crate::{
    protocol::Reservation, store::KeyState, Attempt, Disposition, Effects, Error, Fingerprint,
    Idempotency, IdempotencyKey, Outcome, Store,
};
use serde_json::json;
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

pub async fn replay_returns_the_stored_result<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("replay");
    let a = attempt("user-1", &trial, json!({"sku": "tea", "quantity": 1}));
    let first = purchase(&idem, &a, &trial, 1).await.unwrap();
    assert_eq!(first, Outcome::Executed(json!({"trial": trial, "n": 1})));
    // A retry whose work would return something else gets the stored result, and runs nothing.
    let again = purchase(&idem, &a, &trial, 2).await.unwrap();
    assert_eq!(again, Outcome::Replayed(json!({"trial": trial, "n": 1})));
    // Same request with keys in another order and other whitespace is the same request.
    let reordered = Attempt::new(
        a.key().clone(),
        Fingerprint::of_json_bytes(b"{ \"quantity\": 1, \"sku\": \"tea\" }").unwrap(),
    );
    assert!(purchase(&idem, &reordered, &trial, 3)
        .await
        .unwrap()
        .is_replayed());
    assert_eq!(count_effects(&store, &trial).await, 1);
}

pub async fn another_payload_under_the_same_key_is_rejected<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("reused");
    purchase(
        &idem,
        &attempt("user-1", &trial, json!({"q": 1})),
        &trial,
        1,
    )
    .await
    .unwrap();
    let err = purchase(
        &idem,
        &attempt("user-1", &trial, json!({"q": 2})),
        &trial,
        2,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::KeyReused), "{err:?}");
    assert_eq!(count_effects(&store, &trial).await, 1);
}

pub async fn scopes_and_operations_are_independent<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("scoped");
    let body = json!({"sku": "tea"});
    let alice = attempt("alice", &trial, body.clone());
    let bob = attempt("bob", &trial, body.clone());
    let refund = Attempt::new(
        IdempotencyKey::new("alice", "refund", &trial).unwrap(),
        Fingerprint::of_json(&body).unwrap(),
    );
    assert!(!purchase(&idem, &alice, &trial, 1)
        .await
        .unwrap()
        .is_replayed());
    let for_bob = purchase(&idem, &bob, &trial, 2).await.unwrap();
    assert_eq!(
        for_bob,
        Outcome::Executed(json!({"trial": trial, "n": 2})),
        "bob must not see alice's result"
    );
    assert!(!purchase(&idem, &refund, &trial, 3)
        .await
        .unwrap()
        .is_replayed());
    assert_eq!(count_effects(&store, &trial).await, 3);
}

pub async fn a_failing_operation_releases_the_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("fails");
    let a = attempt("user-1", &trial, json!({}));
    let err = idem
        .run(&a, async |tx| {
            insert_effect(tx, &trial).await.unwrap();
            Err::<serde_json::Value, _>("card declined by a flaky network")
        })
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::Operation("card declined by a flaky network")
    ));
    assert_eq!(
        count_effects(&store, &trial).await,
        0,
        "the failed work was rolled back"
    );
    assert!(
        store.find(a.key()).await.unwrap().is_none(),
        "the key was released"
    );
    let retry = purchase(&idem, &a, &trial, 2).await.unwrap();
    assert_eq!(retry, Outcome::Executed(json!({"trial": trial, "n": 2})));
    assert_eq!(count_effects(&store, &trial).await, 1);
}

pub async fn a_panicking_operation_releases_the_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("panics");
    let a = attempt("user-1", &trial, json!({}));
    let (idem2, a2, t) = (idem.clone(), a.clone(), trial.clone());
    let joined = tokio::spawn(async move {
        idem2
            .run(&a2, async move |tx| {
                insert_effect(tx, &t).await?;
                if t.starts_with("panics") {
                    panic!("bug in the handler");
                }
                Ok::<_, sqlx::Error>(json!(null))
            })
            .await
    })
    .await;
    assert!(joined.unwrap_err().is_panic());
    assert!(
        store.find(a.key()).await.unwrap().is_none(),
        "the key was released"
    );
    assert_eq!(count_effects(&store, &trial).await, 0);
    assert!(!purchase(&idem, &a, &trial, 2).await.unwrap().is_replayed());
}

pub async fn a_cancelled_operation_releases_the_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("cancelled");
    let a = attempt("user-1", &trial, json!({}));
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (idem2, a2, t) = (idem.clone(), a.clone(), trial.clone());
    let task = tokio::spawn(async move {
        idem2
            .run(&a2, async move |tx| {
                insert_effect(tx, &t).await?;
                started_tx.send(()).unwrap();
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, sqlx::Error>(json!(null))
            })
            .await
    });
    started.await.unwrap();
    assert_eq!(
        store.find(a.key()).await.unwrap().map(|r| r.state),
        Some(KeyState::Pending)
    );
    task.abort(); // the client went away: the future is dropped mid-work
    assert!(task.await.unwrap_err().is_cancelled());
    let released = wait_until(Duration::from_secs(10), || async {
        store.find(a.key()).await.unwrap().is_none()
    })
    .await;
    assert!(
        released,
        "a dropped future must release its key well before the lease ends"
    );
    assert_eq!(count_effects(&store, &trial).await, 0);
    assert!(!purchase(&idem, &a, &trial, 2).await.unwrap().is_replayed());
}

pub async fn a_completed_key_is_never_released<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("kept");
    let a = attempt("user-1", &trial, json!({}));
    purchase(&idem, &a, &trial, 1).await.unwrap();
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Completed);
    // Even with the right token (as after a lost COMMIT acknowledgement), release is a no-op.
    assert!(!store.release(a.key(), row.lease_token).await.unwrap());
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Completed);
    assert!(purchase(&idem, &a, &trial, 2).await.unwrap().is_replayed());
}

pub async fn an_expired_lease_is_taken_over_and_the_stale_holder_is_fenced<S>(
    store: S,
    _profile: Profile,
) where
    S: Store,
    S::Database: BusinessTable,
{
    let lease = Duration::from_millis(300);
    // A stalled holder: its lease is not kept alive (a frozen process stops beating).
    let idem = Idempotency::new(store.clone())
        .with_lease(lease)
        .with_heartbeat(false);
    let trial = unique("takeover");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));

    // The slow worker reserves, then stalls past its lease.
    let Reservation::Acquired(stale) = idem.reserve(&a).await.unwrap() else {
        panic!("first reservation must acquire")
    };
    match purchase(&idem, &a, &trial, 2).await {
        Err(Error::InProgress { retry_after }) => assert!(retry_after <= Duration::from_secs(1)),
        other => panic!("a live lease must answer InProgress, got {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(100)).await;

    // A retry takes the expired lease over and runs.
    let retry = purchase(&idem, &a, &trial, 2).await.unwrap();
    assert_eq!(retry, Outcome::Executed(json!({"trial": trial, "n": 2})));

    // The stale worker wakes up, writes its business row and tries to complete: refused, and
    // its write is rolled back.
    let mut tx = store.begin().await.unwrap();
    insert_effect(&mut tx, &trial).await.unwrap();
    let err = stale.finish(tx, b"{\"n\":1}").await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost), "{err:?}");
    assert_eq!(
        count_effects(&store, &trial).await,
        1,
        "only the retry's write survives"
    );
    assert_eq!(
        purchase(&idem, &a, &trial, 3).await.unwrap(),
        Outcome::Replayed(json!({"trial": trial, "n": 2}))
    );
}

/// A worker stalls inside its open business transaction past its lease, while a retry arrives.
/// Exactly one effect survives. Where the stalled transaction does not block the takeover
/// (PostgreSQL, MySQL), the retry runs and the stale worker's completion is refused (fencing) and
/// rolled back; on SQLite the stalled writer holds the database, so the retry waits and replays.
pub async fn a_worker_stalled_inside_its_transaction_is_fenced<S>(store: S, profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let lease = Duration::from_millis(300);
    // A stalled holder: its lease is not kept alive (a frozen process stops beating).
    let idem = Idempotency::new(store.clone())
        .with_lease(lease)
        .with_heartbeat(false);
    let trial = unique("stalled");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));
    let (wrote_tx, wrote) = tokio::sync::oneshot::channel();
    let (idem2, a2, t) = (idem.clone(), a.clone(), trial.clone());
    let stale = tokio::spawn(async move {
        idem2
            .run(&a2, async move |tx| {
                insert_effect(tx, &t).await?;
                wrote_tx.send(()).unwrap();
                tokio::time::sleep(Duration::from_millis(900)).await; // past the lease
                Ok::<_, sqlx::Error>(json!({"by": "stale"}))
            })
            .await
    });
    wrote.await.unwrap();
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let retry = idem
        .run(&a, async |tx| {
            insert_effect(tx, &trial).await?;
            Ok::<_, sqlx::Error>(json!({"by": "retry"}))
        })
        .await
        .unwrap();
    let stale = stale.await.unwrap();
    if profile.single_writer {
        assert_eq!(stale.unwrap(), Outcome::Executed(json!({"by": "stale"})));
        assert_eq!(retry, Outcome::Replayed(json!({"by": "stale"})));
    } else {
        assert_eq!(retry, Outcome::Executed(json!({"by": "retry"})));
        assert!(matches!(stale, Err(Error::LeaseLost)), "{stale:?}");
    }
    assert_eq!(
        count_effects(&store, &trial).await,
        1,
        "{}: exactly one effect",
        store_name::<S>()
    );
}

pub async fn an_external_operation_is_not_taken_over<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let lease = Duration::from_millis(200);
    // A stalled holder: its lease is not kept alive (a frozen process stops beating).
    let idem = Idempotency::new(store.clone())
        .with_lease(lease)
        .with_heartbeat(false);
    let trial = unique("external");
    let a = attempt("user-1", &trial, json!({})).with_effects(Effects::External);
    let Reservation::Acquired(lease_held) = idem.reserve(&a).await.unwrap() else {
        panic!("acquire")
    };
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let err = purchase(&idem, &a, &trial, 2).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err:?}");
    assert_eq!(count_effects(&store, &trial).await, 0);
    std::mem::forget(lease_held); // the worker "died": no release
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Pending);
    assert!(row.lease_expired());
}

/// External work that is abandoned (cancelled or panicking) may have had its outside effect: its
/// key is not released but left pending for the recovery job.
pub async fn abandoned_external_work_stays_pending<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("abandoned-external");
    let a =
        attempt("user-1", &trial, json!({"to": "a@example.com"})).with_effects(Effects::External);
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (idem2, a2) = (idem.clone(), a.clone());
    let task = tokio::spawn(async move {
        idem2
            .run(&a2, async move |_tx| {
                started_tx.send(()).unwrap(); // the mail is on its way
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<_, sqlx::Error>(json!(null))
            })
            .await
    });
    started.await.unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let row = store.find(a.key()).await.unwrap().expect("not released");
    assert_eq!(row.state, KeyState::Pending);

    let b =
        attempt("user-1", &unique("panicking-external"), json!({})).with_effects(Effects::External);
    let (idem3, b2) = (idem.clone(), b.clone());
    let joined = tokio::spawn(async move {
        idem3
            .run(&b2, async |_tx| panic!("bug after calling the provider"))
            .await as Result<Outcome<()>, Error<sqlx::Error>>
    })
    .await;
    assert!(joined.unwrap_err().is_panic());
    let row = store.find(b.key()).await.unwrap().expect("not released");
    assert_eq!(row.state, KeyState::Pending);
}

pub async fn an_expired_key_runs_anew<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone()).with_retention(Duration::from_millis(200));
    let trial = unique("expired");
    let a = attempt("user-1", &trial, json!({"v": 1}));
    purchase(&idem, &a, &trial, 1).await.unwrap();
    assert!(purchase(&idem, &a, &trial, 2).await.unwrap().is_replayed());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(store.find(a.key()).await.unwrap().unwrap().expired);
    // Past retention the key is as good as new, even for another payload.
    let b = attempt("user-1", &trial, json!({"v": 2}));
    assert_eq!(
        purchase(&idem, &b, &trial, 3).await.unwrap(),
        Outcome::Executed(json!({"trial": trial, "n": 3}))
    );
    assert_eq!(count_effects(&store, &trial).await, 2);
}

#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Refusal {
    InsufficientFunds,
}

pub async fn a_definitive_refusal_is_stored_and_replayed<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("refused");
    let a = attempt("user-1", &trial, json!({"amount": 10_000_000}));
    let calls = Arc::new(AtomicUsize::new(0));
    for expected_replay in [false, true] {
        let outcome = idem
            .run(&a, async |_tx| {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<Result<u64, Refusal>, sqlx::Error>(Err(Refusal::InsufficientFunds))
            })
            .await
            .unwrap();
        assert_eq!(outcome.is_replayed(), expected_replay);
        assert_eq!(outcome.into_inner(), Err(Refusal::InsufficientFunds));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

pub async fn an_unknown_external_outcome_parks_the_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("parked");
    let a =
        attempt("user-1", &trial, json!({"to": "a@example.com"})).with_effects(Effects::External);
    let err = idem
        .run_with(
            &a,
            |e: &&str| Disposition::Park(format!("mail provider: {e}")),
            async |_tx| Err::<(), _>("timed out after sending"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Operation(_)));
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::NeedsReview);
    assert_eq!(
        row.reason.as_deref(),
        Some("mail provider: timed out after sending")
    );
    let again = purchase(&idem, &a, &trial, 2).await.unwrap_err();
    assert!(matches!(again, Error::NeedsReview), "{again:?}");
    assert_eq!(count_effects(&store, &trial).await, 0);
}

/// `run`'s default after an error: external work may have had its outside effect, so its key is
/// never released; it stays pending (retries get `InProgress`) for the recovery job.
pub async fn a_failed_external_run_keeps_its_key_pending<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("external-error");
    let a =
        attempt("user-1", &trial, json!({"to": "a@example.com"})).with_effects(Effects::External);
    let err = idem
        .run(&a, async |_tx| Err::<(), _>("provider timed out"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Operation(_)), "{err:?}");
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Pending);
    let again = purchase(&idem, &a, &trial, 2).await.unwrap_err();
    assert!(matches!(again, Error::InProgress { .. }), "{again:?}");
    assert_eq!(count_effects(&store, &trial).await, 0);
}

/// `run_with` answering `Store` for an error: the core cannot store the error, so the key is
/// parked (never released, never completed without a result).
pub async fn store_for_an_error_parks_the_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("store-error");
    let a = attempt("user-1", &trial, json!({"q": 1}));
    let err = idem
        .run_with(
            &a,
            |_: &&str| Disposition::Store,
            async |_tx| Err::<(), _>("refused"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Operation(_)), "{err:?}");
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::NeedsReview);
    assert!(
        row.reason
            .as_deref()
            .unwrap_or("")
            .contains("Disposition::Store"),
        "{:?}",
        row.reason
    );
}

/// `run_with` answering `Release`, even for external work: the caller's word that nothing went
/// out; a retry runs again.
pub async fn release_for_an_error_lets_a_retry_run<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("release-error");
    let a = attempt("user-1", &trial, json!({"q": 1})).with_effects(Effects::External);
    idem.run_with(
        &a,
        |_: &&str| Disposition::Release,
        async |_tx| Err::<(), _>("refused before the call"),
    )
    .await
    .unwrap_err();
    assert!(store.find(a.key()).await.unwrap().is_none());
    let retried = purchase(&idem, &a, &trial, 2).await.unwrap();
    assert!(!retried.is_replayed());
    assert_eq!(count_effects(&store, &trial).await, 1);
}

/// The heartbeat: work lasting five leases completes once. Retries sent meanwhile, each past
/// the lease, get `InProgress` instead of taking the key over, and then the stored result.
pub async fn work_lasting_five_leases_completes_once<S>(store: S, profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let lease = Duration::from_millis(200);
    let idem = Idempotency::new(store.clone()).with_lease(lease);
    let trial = unique("long-work");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let worker = tokio::spawn({
        let (idem, a, trial) = (idem.clone(), a.clone(), trial.clone());
        async move {
            idem.run(&a, async |tx| {
                started_tx.send(()).unwrap();
                tokio::time::sleep(lease * 5).await;
                insert_effect(tx, &trial).await?;
                Ok::<_, sqlx::Error>(json!({"by": "worker"}))
            })
            .await
        }
    });
    started.await.unwrap();
    if !profile.single_writer {
        // (On SQLite the worker's transaction holds the one writer: a retry waits for it.)
        for _ in 0..3 {
            tokio::time::sleep(lease + Duration::from_millis(50)).await;
            let retry = purchase(&idem, &a, &trial, 2).await;
            assert!(
                matches!(retry, Err(Error::InProgress { .. })),
                "{}: a live holder keeps its key past its lease: {retry:?}",
                store_name::<S>()
            );
        }
    }
    let done = worker.await.unwrap().unwrap();
    assert_eq!(done, Outcome::Executed(json!({"by": "worker"})));
    assert_eq!(
        purchase(&idem, &a, &trial, 3).await.unwrap(),
        Outcome::Replayed(json!({"by": "worker"}))
    );
    assert_eq!(count_effects(&store, &trial).await, 1);
}

pub async fn migrate_is_idempotent_and_concurrent<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
}

/// The replay read answers only a completed, unexpired row with the same fingerprint; everything
/// else is left to the reserving INSERT.
pub async fn the_replay_read_answers_only_completed_matching_rows<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone()).with_retention(Duration::from_millis(300));
    let trial = unique("replay-read");
    let a = attempt("user-1", &trial, json!({"v": 1}));
    let other = attempt("user-1", &trial, json!({"v": 2}));
    assert_eq!(
        store.find_replay(a.key(), a.fingerprint()).await.unwrap(),
        None
    );
    // Pending: nothing to replay yet.
    let Reservation::Acquired(lease) = idem.reserve(&a).await.unwrap() else {
        panic!("a new key must be acquired");
    };
    assert_eq!(
        store.find_replay(a.key(), a.fingerprint()).await.unwrap(),
        None
    );
    let tx = store.begin().await.unwrap();
    lease.finish(tx, b"stored").await.unwrap();
    assert_eq!(
        store.find_replay(a.key(), a.fingerprint()).await.unwrap(),
        Some(b"stored".to_vec())
    );
    // Another request under the key, or another scope, reads nothing.
    assert_eq!(
        store
            .find_replay(other.key(), other.fingerprint())
            .await
            .unwrap(),
        None
    );
    let elsewhere = attempt("user-2", &trial, json!({"v": 1}));
    assert_eq!(
        store
            .find_replay(elsewhere.key(), elsewhere.fingerprint())
            .await
            .unwrap(),
        None
    );
    // Past retention (by the database clock) the row is not replayed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        store.find_replay(a.key(), a.fingerprint()).await.unwrap(),
        None
    );
}

/// With the replay read turned off the INSERT alone answers replays and reused keys.
pub async fn without_the_replay_read_the_insert_decides<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone()).with_replay_first(false);
    let trial = unique("insert-decides");
    let a = attempt("user-1", &trial, json!({"v": 1}));
    assert!(!purchase(&idem, &a, &trial, 1).await.unwrap().is_replayed());
    assert_eq!(
        purchase(&idem, &a, &trial, 2).await.unwrap(),
        Outcome::Replayed(json!({"trial": trial, "n": 1}))
    );
    let b = attempt("user-1", &trial, json!({"v": 2}));
    let err = purchase(&idem, &b, &trial, 3).await.unwrap_err();
    assert!(matches!(err, Error::KeyReused), "{err:?}");
    assert_eq!(count_effects(&store, &trial).await, 1);
}

/// By default the engine reads first only while replays dominate, and the answers are the
/// same either way: 30 first requests leave it inserting first; 30 replays turn it to reading
/// first (each replay answered with the stored result); first requests turn it back.
pub async fn the_default_replay_read_follows_the_recent_replays<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("adaptive-read");
    let firsts: Vec<_> = (0..30)
        .map(|i| attempt("user-1", &format!("{trial}-{i}"), json!({"i": i})))
        .collect();
    for (n, first) in firsts.iter().enumerate() {
        assert!(!purchase(&idem, first, &trial, n as u64)
            .await
            .unwrap()
            .is_replayed());
    }
    assert!(!idem.replays_first(), "first requests: insert first");
    let mut turned_at = None;
    for (n, first) in firsts.iter().enumerate() {
        assert_eq!(
            purchase(&idem, first, &trial, 1000).await.unwrap(),
            Outcome::Replayed(json!({"trial": trial, "n": n}))
        );
        if turned_at.is_none() && idem.replays_first() {
            turned_at = Some(n);
        }
    }
    assert!(turned_at.is_some(), "30 replays in a row: read first");
    for i in 30..60 {
        let fresh = attempt("user-1", &format!("{trial}-{i}"), json!({"i": i}));
        assert!(!purchase(&idem, &fresh, &trial, i)
            .await
            .unwrap()
            .is_replayed());
    }
    assert!(!idem.replays_first(), "first requests again: insert first");
    assert_eq!(count_effects(&store, &trial).await, 60);
}

/// A caller dropped while its reservation is in flight (a client hung up) leaves no key pending:
/// the INSERT finishes in its own task and a key it reserved is released, also when the caller
/// goes between the answer and its receipt, and also for external work. 400 reservations are
/// cut at every point of their round trip: half by timeouts from 0 to 2 ms, half after 0 to 39
/// polls (yielding to the runtime between polls), which cuts some whatever the machine's speed.
pub async fn a_cancelled_reservation_leaves_no_pending_key<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("cut-reserve");
    let (mut cut, mut acquired) = (0, 0);
    let mut keys = Vec::new();
    for i in 0..400u64 {
        let a = attempt("user-1", &format!("{trial}-{i}"), json!({"i": i})).with_effects(
            if i % 2 == 0 {
                Effects::Local
            } else {
                Effects::External
            },
        );
        let reserved = if (i / 2) % 2 == 0 {
            tokio::time::timeout(Duration::from_micros(i * 5), idem.reserve(&a))
                .await
                .ok()
        } else {
            poll_then_drop(idem.reserve(&a), (i / 4) % 40).await
        };
        match reserved {
            None => cut += 1,
            Some(Ok(Reservation::Acquired(lease))) => {
                acquired += 1;
                assert!(lease.release().await.unwrap());
            }
            Some(Ok(_)) => panic!("a new key cannot be completed"),
            Some(Err(error)) => panic!("a new key must be acquired, got {error:?}"),
        }
        keys.push(a.into_key());
    }
    assert!(cut > 0, "no reservation was cut; the test proves nothing");
    let mut left = keys.len();
    for _ in 0..100 {
        left = 0;
        for key in &keys {
            if store.find(key).await.unwrap().is_some() {
                left += 1;
            }
        }
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{}: {cut} reservations cut, {acquired} acquired, {left} keys left",
        store_name::<S>()
    );
    assert_eq!(left, 0, "keys left pending by cancelled reservations");
}

/// The request, owned by the caller; the work only borrows it.
struct Order {
    trial: String,
    quantity: u64,
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

/// The work is an async closure that borrows the caller's request and counter (no clone, no
/// `move`), and `run`'s future is still `Send`: it is spawned on the multi-threaded runtime.
pub async fn work_borrowing_the_request_is_send_and_runs_once<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    let idem = Idempotency::new(store.clone());
    let trial = unique("borrowed");
    let a = attempt("user-1", &trial, json!({"sku": "tea", "quantity": 2}));
    let task = tokio::spawn(async move {
        let order = Order {
            trial: trial.clone(),
            quantity: 2,
        };
        let calls = AtomicUsize::new(0);
        let mut outcomes = Vec::new();
        for _ in 0..2 {
            let run = idem.run(&a, async |tx| {
                calls.fetch_add(1, Ordering::SeqCst);
                insert_effect(tx, &order.trial).await?;
                tokio::task::yield_now().await; // `tx` and the borrows are held across awaits
                insert_effect(&mut *tx, &format!("{}-again", order.trial)).await?;
                Ok::<_, sqlx::Error>(json!({"trial": &order.trial, "quantity": order.quantity}))
            });
            outcomes.push(assert_send(run).await.unwrap());
        }
        (trial, outcomes, calls.into_inner())
    });
    let (trial, outcomes, calls) = task.await.unwrap();
    let stored = json!({"trial": trial, "quantity": 2});
    assert_eq!(
        outcomes,
        [Outcome::Executed(stored.clone()), Outcome::Replayed(stored)]
    );
    assert_eq!(calls, 1, "the replay did not run the work");
    assert_eq!(count_effects(&store, &trial).await, 1);
}

/// ≥ 200 trials of ≥ 8 tasks racing one new key: the effect happens exactly once per trial.
pub async fn concurrent_duplicates_execute_exactly_once<S>(store: S, _profile: Profile)
where
    S: Store,
    S::Database: BusinessTable,
{
    race(store, 200, 8).await;
}
