//! The single-transaction mode (`Idempotency::with_single_transaction`) on PostgreSQL and
//! MariaDB, where it needs this repository's harness: a SIGKILLed holder leaves no key, and the
//! wait is set for the reserving statement only. The mode's other scenarios are the published
//! conformance suite (`idempotency::store::testing::reserve_in_transaction`), run by `conformance.rs`.

mod common;

use common::{attempt, unique, Harness};
use idempotency::{
    protocol::{Begun, Reservation},
    store::ReserveInTransaction,
    Idempotency, MySqlStore, Outcome, PgStore, SqliteStore, Store,
};
use serde_json::json;
use std::time::{Duration, Instant};
use test_support::TestDatabase;

const WAIT: Duration = Duration::from_secs(5);

/// How the SIGKILL test's child finds its database and key.
const URL_VAR: &str = "SINGLE_TX_CHILD_URL";
const KEY_VAR: &str = "SINGLE_TX_CHILD_KEY";

/// What the child prints once its work has written in the transaction.
const WORKING: &str = "the work has written";

/// The SIGKILL test, with a runtime of its own size.
mod killed {
    use super::a_killed_holder_leaves_no_key;

    test_support::backend_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        except Sqlite = "SQLite reserves on its own commit";
        a_killed_holder_leaves_no_key,
    }
}

fn engine<S: ReserveInTransaction>(store: &S) -> Idempotency<S> {
    Idempotency::new(store.clone()).with_single_transaction(WAIT)
}

/// SQLite is not offered the mode: it does not implement `ReserveInTransaction` (its
/// reservations commit on their own), so `with_single_transaction` does not compile for it. The
/// engine then reserves the article's way.
#[tokio::test]
async fn sqlite_reserves_on_its_own_commit() {
    struct Probe<S>(std::marker::PhantomData<S>);
    trait Offered {
        const OFFERED: bool = false;
    }
    impl<S> Offered for Probe<S> {}
    impl<S: idempotency::store::ReserveInTransaction> Probe<S> {
        #[allow(dead_code)]
        const OFFERED: bool = true;
    }
    const {
        assert!(!Probe::<SqliteStore>::OFFERED);
        assert!(Probe::<PgStore>::OFFERED);
        assert!(Probe::<MySqlStore>::OFFERED);
    }
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let a = attempt("u", "k", json!({}));
    match Idempotency::new(store.clone())
        .begin_reserved(&a)
        .await
        .unwrap()
    {
        Begun::Acquired(lease, _tx) => assert!(!lease.is_in_transaction()),
        Begun::Completed(_) => panic!("a new key"),
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

async fn work_until_killed<S: Harness + ReserveInTransaction>(store: S, key: &str) {
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

async fn kill_holders<S: Harness + ReserveInTransaction>(store: S, url: &str) {
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
