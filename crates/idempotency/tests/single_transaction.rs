//! The single-transaction mode (`Idempotency::with_single_transaction`) on PostgreSQL and
//! MariaDB: the key row is written inside the business transaction, duplicates wait on the
//! unique index and then replay, a rollback (or a SIGKILLed holder) leaves no key, the wait is
//! bounded, and work with an outside effect never uses it.

mod common;

use common::{attempt, unique, Harness};
use idempotency::{
    Begun, Disposition, Effects, Error, Idempotency, KeyState, MySqlStore, Outcome, PgStore,
    Reservation, SqliteStore, Store,
};
use serde_json::json;
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use test_support::TestDatabase;

const WAIT: Duration = Duration::from_secs(5);
const TRIALS: usize = 200;
const RACERS: usize = 8;
/// How the SIGKILL test's child finds its database and key.
const URL_VAR: &str = "SINGLE_TX_CHILD_URL";
const KEY_VAR: &str = "SINGLE_TX_CHILD_KEY";
/// What the child prints once its work has written in the transaction.
const WORKING: &str = "the work has written";

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    except Sqlite = "SQLite reserves on its own commit (its one writer connection queues writers already)";
    via crate::on_store;
    racers_wait_for_the_holder_then_replay,
    the_key_is_invisible_until_commit_and_gone_after_rollback,
    a_duplicate_waits_at_most_the_wait,
    a_park_commits_a_row_of_its_own,
    external_work_reserves_on_its_own_commit,
}

/// The SIGKILL test, with a runtime of its own size.
mod killed {
    use super::a_killed_holder_leaves_no_key;

    test_support::backend_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        except Sqlite = "SQLite reserves on its own commit";
        a_killed_holder_leaves_no_key,
    }
}

fn engine<S: Store>(store: &S) -> Idempotency<S> {
    Idempotency::new(store.clone()).with_single_transaction(WAIT)
}

/// SQLite is not offered the mode: its reservations commit on their own.
#[tokio::test]
async fn sqlite_reserves_on_its_own_commit() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    let a = attempt("u", "k", json!({}));
    assert!(!store.reserves_in_transaction());
    assert_eq!(engine(&store).single_transaction_wait(&a), None);
}

/// Racers on one new key, `TRIALS` times: one runs, every other one waits for its commit and
/// replays it (none is told 409: the holder is far quicker than the wait). In every other
/// trial the first execution fails, which rolls its key back with its writes: one waiter then
/// runs instead, once.
async fn racers_wait_for_the_holder_then_replay<S: Harness>(store: S) {
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
                        S::insert_effect(tx, &trial_id).await?;
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
                Err(other) => panic!("{}: trial {trial}: unexpected {other:?}", S::NAME),
            }
        }
        assert_eq!(executed, 1, "{}: trial {trial}: one execution", S::NAME);
        assert_eq!(
            store.count_effects(&trial_id).await,
            1,
            "{}: trial {trial}",
            S::NAME
        );
    }
    assert_eq!(failed, TRIALS / 2, "every failing first execution was seen");
    assert_eq!(replayed, TRIALS * (RACERS - 1) - TRIALS / 2);
    eprintln!(
        "{}: {TRIALS} trials x {RACERS} racers: {replayed} replayed after waiting, {failed} rolled back",
        S::NAME
    );
}

/// Nobody sees the key before the holder commits; a rollback leaves no key at all, and the next
/// attempt holds it at once.
async fn the_key_is_invisible_until_commit_and_gone_after_rollback<S: Harness>(store: S) {
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
async fn a_duplicate_waits_at_most_the_wait<S: Harness>(store: S) {
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
    assert!(elapsed >= short, "{}: answered after {elapsed:?}", S::NAME);
    assert!(
        elapsed < Duration::from_secs(3),
        "{}: answered after {elapsed:?}",
        S::NAME
    );
    lease.finish(tx, b"\"stored\"").await.unwrap();
    match idem.begin_reserved(&a).await.unwrap() {
        Begun::Completed(bytes) => assert_eq!(bytes, b"\"stored\""),
        Begun::Acquired(..) => panic!("completed before"),
    }
}

/// The wait is set for the reserving statement only: the work runs with the session's own
/// lock timeout.
#[tokio::test]
async fn the_work_keeps_the_sessions_lock_timeout_on_postgres() {
    let Some(store) = PgStore::open().await else {
        return;
    };
    let a = attempt("u", &unique("k"), json!({"n": 1}));
    let Begun::Acquired(_lease, mut tx) = engine(&store).begin_reserved(&a).await.unwrap() else {
        panic!("a new key")
    };
    let setting: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(setting, "0");
}

/// The same on MariaDB: `SET STATEMENT … FOR` leaves the session's `innodb_lock_wait_timeout`.
#[tokio::test]
async fn the_work_keeps_the_sessions_lock_timeout_on_mariadb() {
    let Some(store) = MySqlStore::open().await else {
        return;
    };
    let a = attempt("u", &unique("k"), json!({"n": 1}));
    let Begun::Acquired(_lease, mut tx) = engine(&store).begin_reserved(&a).await.unwrap() else {
        panic!("a new key")
    };
    let session: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let global: u64 = sqlx::query_scalar("SELECT @@GLOBAL.innodb_lock_wait_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(session, global);
    assert_ne!(session, WAIT.as_secs());
}

/// A refusal parked by `run_with` needs a committed row: the key is reserved again for it
/// after the rollback, and ends `needs_review` without the work's writes.
async fn a_park_commits_a_row_of_its_own<S: Harness>(store: S) {
    let idem = engine(&store);
    let trial = unique("park");
    let a = attempt("u", &trial, json!({"n": 1}));
    let ran = idem
        .run_with(
            &a,
            |_: &sqlx::Error| Disposition::Park("refused".into()),
            async |tx| {
                S::insert_effect(tx, &trial).await?;
                Err::<serde_json::Value, _>(sqlx::Error::RowNotFound)
            },
        )
        .await;
    assert!(matches!(ran, Err(Error::Operation(_))), "{ran:?}");
    let row = store.find(a.key()).await.unwrap().expect("parked");
    assert_eq!(row.state, KeyState::NeedsReview);
    assert_eq!(store.count_effects(&trial).await, 0);
}

/// Work with an outside effect never reserves inside its transaction: its reservation is
/// committed (visible) before the work starts.
async fn external_work_reserves_on_its_own_commit<S: Harness>(store: S) {
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

/// The child process of `a_killed_holder_leaves_no_key`, not a test of its own: it reserves the
/// key it is given in the single-transaction mode, writes its effect in the transaction, says
/// so, and works until it is killed.
#[tokio::test]
#[ignore = "the child process of the SIGKILL test, which runs it"]
async fn the_child_works_in_its_transaction_until_killed() {
    let url = std::env::var(URL_VAR).expect("run by the SIGKILL test");
    let key = std::env::var(KEY_VAR).expect("run by the SIGKILL test");
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&url).await.expect("connect");
        work_until_killed(PgStore::new(pool), &key).await;
    } else {
        let pool = sqlx::MySqlPool::connect(&url).await.expect("connect");
        work_until_killed(MySqlStore::new(pool), &key).await;
    }
}

async fn work_until_killed<S: Harness>(store: S, key: &str) {
    let Begun::Acquired(_lease, mut tx) = engine(&store)
        .begin_reserved(&attempt("killed", key, json!({"key": key})))
        .await
        .expect("reserve")
    else {
        panic!("the key must be fresh")
    };
    S::insert_effect(&mut tx, key).await.expect("write");
    println!("{WORKING}");
    std::future::pending::<()>().await;
}

/// A holder SIGKILLed mid-work, with a duplicate waiting on its key: the database rolls the
/// holder's transaction back, key row and writes together, and the waiting duplicate runs the
/// work at once (not after a lease), once. No pending key is left for anyone to recover.
async fn a_killed_holder_leaves_no_key(backend: TestDatabase) {
    let db = backend
        .fresh_database()
        .await
        .expect("an available backend");
    match backend {
        TestDatabase::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
            sqlx::query("CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, trial TEXT NOT NULL)")
                .execute(&pool)
                .await
                .expect("effects table");
            kill_holders(PgStore::new(pool), &db.url).await
        }
        TestDatabase::MySql => {
            let pool = sqlx::MySqlPool::connect(&db.url).await.expect("connect");
            sqlx::query(
                "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, trial VARCHAR(255) NOT NULL) ENGINE = InnoDB",
            )
            .execute(&pool)
            .await
            .expect("effects table");
            kill_holders(MySqlStore::new(pool), &db.url).await
        }
        TestDatabase::Sqlite => unreachable!("excepted"),
    }
}

async fn kill_holders<S: Harness>(store: S, url: &str) {
    store.migrate().await.expect("migrate");
    for trial in 0..10 {
        let key = unique("kill");
        let mut child = test_support::spawn_child_test(
            "the_child_works_in_its_transaction_until_killed",
            &[(URL_VAR, url), (KEY_VAR, &key)],
            WORKING,
        )
        .await;
        let idem = engine(&store);
        let a = attempt("killed", &key, json!({"key": key}));
        let duplicate = tokio::spawn({
            let (idem, key) = (idem.clone(), key.clone());
            async move {
                idem.run(&a, async |tx| {
                    S::insert_effect(tx, &key).await?;
                    Ok::<_, sqlx::Error>(json!({"ran": "after the kill"}))
                })
                .await
            }
        });
        // The duplicate is waiting on the holder's key.
        tokio::time::sleep(Duration::from_millis(50 + 20 * trial)).await;
        assert!(
            !duplicate.is_finished(),
            "trial {trial}: it waits for the holder"
        );
        child.kill().expect("SIGKILL");
        let killed = Instant::now();
        child.wait().expect("reap the holder");
        let ran = duplicate.await.unwrap();
        assert!(
            matches!(ran, Ok(Outcome::Executed(_))),
            "trial {trial}: {ran:?}"
        );
        assert!(
            killed.elapsed() < Duration::from_secs(2),
            "trial {trial}: the duplicate waited {:?} after the kill",
            killed.elapsed()
        );
        assert_eq!(store.count_effects(&key).await, 1, "trial {trial}: once");
        let reserved = idem
            .reserve(&attempt("killed", &key, json!({"key": key})))
            .await
            .unwrap();
        assert!(
            matches!(reserved, Reservation::Completed(_)),
            "trial {trial}"
        );
    }
}
