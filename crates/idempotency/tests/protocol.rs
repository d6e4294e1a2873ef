//! The protocol's behaviour that needs this repository's harness (a store's pool starved), on
//! every backend (see `test_support::backend_tests!`). The rest of the protocol's scenarios are
//! the published conformance suite (`idempotency::store::testing::protocol`), run by `conformance.rs`.

mod common;

use common::{attempt, purchase, unique, Harness};
use idempotency::{protocol::Reservation, Error, Idempotency, Outcome};
use serde_json::json;
use std::time::Duration;

/// A heartbeat racing a takeover. The holder reserves (on a store of its own with a 2-connection
/// pool), then its pool is starved for 0.5 to 2 leases: its beats wait, as a frozen process's
/// would. Meanwhile a retry on another store polls the key from just past the lease on, and takes
/// it over once the lease has ended. Depending on which comes first, the holder's late beat
/// extends the lease (the retry gets `InProgress`, then the holder's stored result) or finds the
/// token gone (the holder's completion fails with `LeaseLost`; the retry executes). Exactly one
/// completes and one effect survives, 200 times; both orders must occur.
async fn a_heartbeat_racing_a_takeover_never_lets_both_complete<S: Harness>(store: S) {
    const TRIALS: u32 = 200;
    let lease = Duration::from_millis(60);
    let holder_store = store.reopen(2).await;
    let holder = Idempotency::new(holder_store.clone()).with_lease(lease);
    let retrier = Idempotency::new(store.reopen(4).await).with_lease(lease);
    let (mut kept, mut taken_over) = (0, 0);
    for trial_no in 0..TRIALS {
        let trial = format!("{}-{trial_no}", unique("beat-race"));
        let a = attempt("racer", &trial, json!({"trial": trial}));
        let Reservation::Acquired(held) = holder.reserve(&a).await.unwrap() else {
            panic!("{}: a fresh key", S::NAME)
        };
        let starved = holder_store.starve().await;
        let retry = tokio::spawn({
            let (retrier, a, trial) = (retrier.clone(), a.clone(), trial.clone());
            async move {
                tokio::time::sleep(lease + Duration::from_millis(2)).await;
                loop {
                    match purchase(&retrier, &a, &trial, 2).await {
                        Ok(outcome) => return outcome,
                        Err(Error::InProgress { .. }) => {
                            tokio::time::sleep(Duration::from_millis(3)).await
                        }
                        Err(other) => panic!("{}: {other:?}", S::NAME),
                    }
                }
            }
        });
        // Frozen for 0.5 to 2 leases, across the end of the lease.
        tokio::time::sleep(lease * (10 + trial_no % 31) / 20).await;
        drop(starved);
        // The holder works on for another lease: only its heartbeat keeps the key now.
        tokio::time::sleep(lease).await;
        let mut tx = holder_store.begin().await.unwrap();
        S::insert_effect(&mut tx, &trial).await.unwrap();
        let finished = held.finish(tx, b"{\"by\":\"holder\"}").await;
        let retried = retry.await.unwrap();
        match (&finished, &retried) {
            (Ok(()), Outcome::Replayed(_)) => kept += 1,
            (Err(Error::LeaseLost), Outcome::Executed(_)) => taken_over += 1,
            other => panic!(
                "{}: trial {trial_no}: exactly one completes: {other:?}",
                S::NAME
            ),
        }
        assert_eq!(
            store.count_effects(&trial).await,
            1,
            "{}: trial {trial_no}",
            S::NAME
        );
    }
    println!(
        "{}: {TRIALS} races of a late heartbeat and a takeover: {kept} holders kept their key, {taken_over} were taken over",
        S::NAME
    );
    assert!(
        kept > 0 && taken_over > 0,
        "{}: both orders must occur: kept {kept}, taken over {taken_over}",
        S::NAME
    );
}

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    a_heartbeat_racing_a_takeover_never_lets_both_complete,
}
