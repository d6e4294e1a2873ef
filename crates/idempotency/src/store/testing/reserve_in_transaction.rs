//! The single-transaction mode ([`Idempotency::with_single_transaction`]) on a
//! [`ReserveInTransaction`] store: the key row is written inside the business transaction,
//! duplicates wait on the unique index and then replay, a rollback leaves no key, the wait is
//! bounded, and work with an outside effect never uses it.

use super::{attempt, count_effects, insert_effect, store_name, unique, BusinessTable, Profile};
use crate::{
    protocol::Begun,
    store::{KeyState, ReserveInTransaction},
    Disposition, Effects, Error, Idempotency, Outcome,
};
use serde_json::json;
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

/// How long a duplicate waits for the holder.
const WAIT: Duration = Duration::from_secs(5);
/// Trials of the race.
const TRIALS: usize = 200;
/// Racers per trial.
const RACERS: usize = 8;

fn engine<S: ReserveInTransaction>(store: &S) -> Idempotency<S> {
    Idempotency::new(store.clone()).with_single_transaction(WAIT)
}

/// Racers on one new key, `TRIALS` times: one runs, every other one waits for its commit and
/// replays it (none is told 409: the holder is far quicker than the wait). In every other
/// trial the first execution fails, which rolls its key back with its writes: one waiter then
/// runs instead, once.
pub async fn racers_wait_for_the_holder_then_replay<S>(store: S, _profile: Profile)
where
    S: ReserveInTransaction,
    S::Database: BusinessTable,
{
    let (mut replayed, mut failed) = (0, 0);
    for trial in 0..TRIALS {
        let idem = engine(&store).with_replay_first(trial % 4 < 2);
        let trial_id = format!("{}-{trial}", unique("single"));
        let fail_first = Arc::new(AtomicBool::new(trial % 2 == 1));
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let racers: Vec<_> = (0..RACERS)
            .map(|_| {
                let (idem, barrier, trial_id) = (idem.clone(), barrier.clone(), trial_id.clone());
                let fail_first = fail_first.clone();
                tokio::spawn(async move {
                    let a = attempt("racer", &trial_id, json!({"trial": trial_id}));
                    barrier.wait().await;
                    idem.run(&a, async |tx| {
                        insert_effect(tx, &trial_id).await?;
                        tokio::time::sleep(Duration::from_millis(3)).await;
                        if fail_first.swap(false, Ordering::SeqCst) {
                            return Err(sqlx::Error::RowNotFound);
                        }
                        Ok(json!({"trial": trial_id}))
                    })
                    .await
                })
            })
            .collect();
        let mut executed = 0;
        for racer in racers {
            match racer.await.unwrap() {
                Ok(Outcome::Executed(_)) => executed += 1,
                Ok(Outcome::Replayed(value)) => {
                    assert_eq!(value, json!({"trial": trial_id}));
                    replayed += 1;
                }
                Err(Error::Operation(_)) => failed += 1,
                Err(other) => panic!("{}: trial {trial}: unexpected {other:?}", store_name::<S>()),
            }
        }
        assert_eq!(
            executed,
            1,
            "{}: trial {trial}: one execution",
            store_name::<S>()
        );
        assert_eq!(
            count_effects(&store, &trial_id).await,
            1,
            "{}: trial {trial}",
            store_name::<S>()
        );
    }
    assert_eq!(failed, TRIALS / 2, "every failing first execution was seen");
    assert_eq!(replayed, TRIALS * (RACERS - 1) - TRIALS / 2);
    eprintln!(
        "{}: {TRIALS} trials x {RACERS} racers: {replayed} replayed after waiting, {failed} rolled back",
        store_name::<S>()
    );
}

/// Nobody sees the key before the holder commits; a rollback leaves no key at all, and the next
/// attempt holds it at once.
pub async fn the_key_is_invisible_until_commit_and_gone_after_rollback<S>(
    store: S,
    _profile: Profile,
) where
    S: ReserveInTransaction,
    S::Database: BusinessTable,
{
    let idem = engine(&store);
    let a = attempt("u", &unique("k"), json!({"n": 1}));
    let Begun::Acquired(lease, tx) = idem.begin_reserved(&a).await.unwrap() else {
        panic!("a new key")
    };
    assert!(lease.is_in_transaction());
    assert!(store.find(a.key()).await.unwrap().is_none(), "uncommitted");
    tx.rollback().await.unwrap();
    drop(lease);
    assert!(store.find(a.key()).await.unwrap().is_none(), "rolled back");
    let Begun::Acquired(lease, tx) = idem.begin_reserved(&a).await.unwrap() else {
        panic!("free again")
    };
    lease.finish(tx, b"\"done\"").await.unwrap();
    let row = store.find(a.key()).await.unwrap().expect("committed");
    assert_eq!(row.state, KeyState::Completed);
}

/// A duplicate waits at most the configured wait (MariaDB: rounded up to whole seconds) for a
/// holder that does not finish, then is told 409; once the holder commits, the next one replays.
pub async fn a_duplicate_waits_at_most_the_wait<S>(store: S, _profile: Profile)
where
    S: ReserveInTransaction,
    S::Database: BusinessTable,
{
    let short = Duration::from_millis(300);
    let idem = Idempotency::new(store.clone()).with_single_transaction(short);
    let a = attempt("u", &unique("k"), json!({"n": 1}));
    let Begun::Acquired(lease, tx) = idem.begin_reserved(&a).await.unwrap() else {
        panic!("a new key")
    };
    let started = Instant::now();
    let waited = idem.begin_reserved(&a).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(waited, Err(Error::InProgress { .. })),
        "{waited:?}"
    );
    assert!(
        elapsed >= short,
        "{}: answered after {elapsed:?}",
        store_name::<S>()
    );
    assert!(
        elapsed < Duration::from_secs(3),
        "{}: answered after {elapsed:?}",
        store_name::<S>()
    );
    lease.finish(tx, b"\"stored\"").await.unwrap();
    match idem.begin_reserved(&a).await.unwrap() {
        Begun::Completed(bytes) => assert_eq!(bytes, b"\"stored\""),
        Begun::Acquired(..) => panic!("completed before"),
    }
}

/// A refusal parked by `run_with` needs a committed row: the key is reserved again for it
/// after the rollback, and ends `needs_review` without the work's writes.
pub async fn a_park_commits_a_row_of_its_own<S>(store: S, _profile: Profile)
where
    S: ReserveInTransaction,
    S::Database: BusinessTable,
{
    let idem = engine(&store);
    let trial = unique("park");
    let a = attempt("u", &trial, json!({"n": 1}));
    let ran = idem
        .run_with(
            &a,
            |_: &sqlx::Error| Disposition::Park("refused".into()),
            async |tx| {
                insert_effect(tx, &trial).await?;
                Err::<serde_json::Value, _>(sqlx::Error::RowNotFound)
            },
        )
        .await;
    assert!(matches!(ran, Err(Error::Operation(_))), "{ran:?}");
    let row = store.find(a.key()).await.unwrap().expect("parked");
    assert_eq!(row.state, KeyState::NeedsReview);
    assert_eq!(count_effects(&store, &trial).await, 0);
}

/// Work with an outside effect never reserves inside its transaction: its reservation is
/// committed (visible) before the work starts.
pub async fn external_work_reserves_on_its_own_commit<S>(store: S, _profile: Profile)
where
    S: ReserveInTransaction,
    S::Database: BusinessTable,
{
    let idem = engine(&store);
    let a = attempt("u", &unique("k"), json!({"n": 1})).with_effects(Effects::External);
    assert_eq!(idem.single_transaction_wait(&a), None);
    let Begun::Acquired(lease, tx) = idem.begin_reserved(&a).await.unwrap() else {
        panic!("a new key")
    };
    assert!(!lease.is_in_transaction());
    let row = store
        .find(a.key())
        .await
        .unwrap()
        .expect("committed before the work");
    assert_eq!(row.state, KeyState::Pending);
    lease.finish(tx, b"1").await.unwrap();
    let journaled = attempt("u", &unique("k"), json!({"n": 1})).with_journaled(true);
    assert_eq!(idem.single_transaction_wait(&journaled), None);
}
