//! The opt-in replay cache (`Idempotency::with_replay_cache`), on every backend: it answers a
//! replay of a result this process completed from memory, and only the same key with the same
//! fingerprint before the row expires; everything else is decided by the database as without
//! it.

mod common;

use common::{attempt, purchase, unique, Harness};
use idempotency::{protocol::Reservation, Error, Idempotency, Outcome};
use serde_json::json;
use std::time::Duration;

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    a_cached_replay_is_answered_from_memory,
    another_request_under_a_cached_key_is_refused_by_the_database,
    a_cached_result_is_never_replayed_past_its_expiry,
    the_cache_is_scoped_and_bounded,
}

async fn a_cached_replay_is_answered_from_memory<S: Harness>(store: S) {
    let cached = Idempotency::new(store.clone()).with_replay_cache(100);
    let trial = unique("cached");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));
    let executed = purchase(&cached, &a, &trial, 1).await.unwrap();
    assert_eq!(executed, Outcome::Executed(json!({"trial": trial, "n": 1})));
    // The row goes behind the engine's back (what the documentation says not to do): only
    // memory can still answer, and it does, in `run`, `reserve` and `replay` alike.
    store.delete_by_hand(a.key()).await;
    assert_eq!(
        purchase(&cached, &a, &trial, 2).await.unwrap(),
        Outcome::Replayed(json!({"trial": trial, "n": 1}))
    );
    assert!(matches!(
        cached.reserve(&a).await.unwrap(),
        Reservation::Completed(_)
    ));
    assert!(cached.replay(&a).await.unwrap().is_some());
    assert_eq!(store.count_effects(&trial).await, 1);
    // An engine without the cache asks the database, which has no row any more.
    let uncached = Idempotency::new(store.clone());
    assert!(!purchase(&uncached, &a, &trial, 3)
        .await
        .unwrap()
        .is_replayed());
    assert_eq!(store.count_effects(&trial).await, 2);
}

async fn another_request_under_a_cached_key_is_refused_by_the_database<S: Harness>(store: S) {
    let cached = Idempotency::new(store.clone()).with_replay_cache(100);
    let trial = unique("reused");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));
    purchase(&cached, &a, &trial, 1).await.unwrap();
    let b = attempt("user-1", &trial, json!({"sku": "coffee"}));
    let refused = purchase(&cached, &b, &trial, 2).await.unwrap_err();
    assert!(matches!(refused, Error::KeyReused), "{refused:?}");
    assert_eq!(store.count_effects(&trial).await, 1);
}

async fn a_cached_result_is_never_replayed_past_its_expiry<S: Harness>(store: S) {
    let cached = Idempotency::new(store.clone())
        .with_replay_cache(100)
        .with_retention(Duration::from_millis(300));
    let trial = unique("expiring");
    let a = attempt("user-1", &trial, json!({"sku": "tea"}));
    purchase(&cached, &a, &trial, 1).await.unwrap();
    assert!(purchase(&cached, &a, &trial, 2)
        .await
        .unwrap()
        .is_replayed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Past retention the database treats the key as new: so must the cache.
    assert_eq!(
        purchase(&cached, &a, &trial, 3).await.unwrap(),
        Outcome::Executed(json!({"trial": trial, "n": 3}))
    );
    assert_eq!(store.count_effects(&trial).await, 2);
}

async fn the_cache_is_scoped_and_bounded<S: Harness>(store: S) {
    let cached = Idempotency::new(store.clone()).with_replay_cache(2);
    let trial = unique("scoped");
    let alice = attempt("alice", &trial, json!({"sku": "tea"}));
    let bob = attempt("bob", &trial, json!({"sku": "tea"}));
    purchase(&cached, &alice, &trial, 1).await.unwrap();
    // The same client key and payload from another user is another key.
    assert!(!purchase(&cached, &bob, &trial, 2)
        .await
        .unwrap()
        .is_replayed());
    // Two more completions push alice's result out of a cache of two: her replay then comes
    // from the database (still a replay, with her own result).
    for n in 0..2 {
        let other = attempt("carol", &format!("{trial}-{n}"), json!({"n": n}));
        purchase(&cached, &other, &trial, 10 + n).await.unwrap();
    }
    store.delete_by_hand(alice.key()).await;
    assert!(!purchase(&cached, &alice, &trial, 4)
        .await
        .unwrap()
        .is_replayed());
}
