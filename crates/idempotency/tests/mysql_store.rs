//! `MySqlStore`'s MySQL-specific behaviour (collation, time zones, InnoDB deadlocks, the
//! migration lock); the protocol's behaviour runs on MySQL with the other backends in
//! `protocol.rs`. Skipped without `TEST_MYSQL_URL` (see `.ci/databases.sh`).
#![cfg(feature = "mysql")]

use idempotency::{
    store::{Insertion, LeaseToken, PendingRow},
    Effects, Fingerprint, IdempotencyKey, MySqlStore, Store,
};
use std::time::Duration;

/// The store's reservation INSERT, run here inside a transaction that is held open.
const INSERT: &str = "INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token,
         lease_until, created_at, updated_at, expires_at)
    VALUES (?, ?, ?, 'pending', ?, ?, ?,
            UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
            UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)";

/// The store's `GET_LOCK` name for migrations of the current database.
const MIGRATION_LOCK: &str = "CONCAT('idempotency_migrate_', MD5(COALESCE(DATABASE(), '')))";

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

async fn store_with(time_zone: Option<&'static str>) -> Option<MySqlStore> {
    let url = test_support::fresh_mysql_url().await?;
    let mut options = sqlx::mysql::MySqlPoolOptions::new().max_connections(4);
    if let Some(zone) = time_zone {
        options = options.after_connect(move |conn, _| {
            Box::pin(async move {
                sqlx::query(&format!("SET time_zone = '{zone}'"))
                    .execute(&mut *conn)
                    .await
                    .map(drop)
            })
        });
    }
    let store = MySqlStore::new(options.connect(&url).await.expect("connect"));
    store.migrate().await.expect("migrate");
    Some(store)
}

fn pending(key: &IdempotencyKey) -> PendingRow<'_> {
    PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(key.to_string().as_bytes()),
        token: LeaseToken::new(),
        effects: Effects::Local,
        journaled: false,
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
    }
}

#[tokio::test]
async fn keys_are_case_sensitive_and_byte_exact() {
    let Some(store) = store_with(None).await else {
        return;
    };
    // Case, trailing and leading spaces, accents: all distinct keys (a PAD SPACE or
    // case-insensitive collation would make some of them collide).
    let keys = [
        ("user", "purchase", "k"),
        ("User", "purchase", "k"),
        ("user ", "purchase", "k"),
        ("usér", "purchase", "k"),
        ("user", "Purchase", "k"),
        ("user", "purchase ", "k"),
        ("user", "purchase", "K"),
        ("user", "purchase", "k "),
        ("user", "purchase", " k"),
        ("ユーザー", "購入", "k"),
        ("ﾕｰｻﾞｰ", "購入", "k"),
    ];
    for (scope, operation, key) in keys {
        let key = IdempotencyKey::new(scope, operation, key).unwrap();
        let row = pending(&key);
        assert_eq!(
            store.insert_pending(&row).await.unwrap(),
            Insertion::Inserted,
            "{key:?} collided with another key"
        );
    }
    for (scope, operation, key) in keys {
        let key = IdempotencyKey::new(scope, operation, key).unwrap();
        let found = store.find(&key).await.unwrap().expect("row");
        assert_eq!(found.key, key, "read back byte for byte");
        assert_eq!(found.fingerprint, pending(&key).fingerprint);
        assert!(matches!(
            store.insert_pending(&pending(&key)).await.unwrap(),
            Insertion::Conflict(existing) if existing.key == key
        ));
    }
}

#[tokio::test]
async fn longest_keys_fit_the_primary_key() {
    let Some(store) = store_with(None).await else {
        return;
    };
    let scope = "é".repeat(127) + "a"; // 255 bytes of UTF-8
    let key = IdempotencyKey::new(scope, "o".repeat(255), "~".repeat(255)).unwrap();
    assert_eq!(
        store.insert_pending(&pending(&key)).await.unwrap(),
        Insertion::Inserted
    );
    assert_eq!(store.find(&key).await.unwrap().unwrap().key, key);
}

#[tokio::test]
async fn times_are_utc_from_the_server_whatever_the_session_time_zone() {
    let Some(store) = store_with(Some("+09:00")).await else {
        return;
    };
    let key = IdempotencyKey::new("user", "purchase", "tz").unwrap();
    assert_eq!(
        store.insert_pending(&pending(&key)).await.unwrap(),
        Insertion::Inserted
    );
    let row = store.find(&key).await.unwrap().unwrap();
    let server_utc: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT UTC_TIMESTAMP(6)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(
        (server_utc - row.created_at).num_seconds().abs() < 5,
        "{row:?}"
    );
    assert_eq!(
        row.lease_until - row.created_at,
        chrono::Duration::seconds(60)
    );
    assert!(row.lease_remaining > Duration::from_secs(55) && !row.lease_expired());
    assert!(!row.expired);
}

/// A store whose every connection runs at `level`.
async fn store_at(level: &'static str) -> Option<MySqlStore> {
    let url = test_support::fresh_mysql_url().await?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(16)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                sqlx::query(&format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}"))
                    .execute(&mut *conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&url)
        .await
        .expect("connect");
    let store = MySqlStore::new(pool);
    store.migrate().await.expect("migrate");
    Some(store)
}

/// 8 tasks insert one new key at once, 100 times, at every session level: exactly one
/// `Inserted` per key, and no deadlock or serialization error ever reaches the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_inserts_have_one_winner_at_every_level() {
    for level in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"] {
        let Some(store) = store_at(level).await else {
            return;
        };
        for trial in 0..100 {
            let key = IdempotencyKey::new("race", level, format!("k{trial}")).unwrap();
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.insert_pending(&pending(&key)).await
                    })
                })
                .collect();
            let mut inserted = 0;
            for task in tasks {
                match task.await.unwrap() {
                    Ok(Insertion::Inserted) => inserted += 1,
                    Ok(Insertion::Conflict(row)) => assert_eq!(row.key, key),
                    other => panic!("{level}: {other:?}"),
                }
            }
            assert_eq!(inserted, 1, "{level}: trial {trial}");
        }
    }
}

/// Reserve-and-release churn on one key: a DELETE releasing the key while others wait to
/// insert it is where InnoDB deadlocks the waiters (1213). Every call must still answer
/// cleanly, and at no moment may two tasks hold the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reserve_release_churn_never_surfaces_a_deadlock() {
    let Some(store) = store_at("REPEATABLE READ").await else {
        return;
    };
    let key = IdempotencyKey::new("churn", "purchase", "k").unwrap();
    let holders = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, key, holders) = (store.clone(), key.clone(), holders.clone());
            tokio::spawn(async move {
                let mut held = 0;
                for _ in 0..60 {
                    let row = pending(&key);
                    match store.insert_pending(&row).await {
                        Ok(Insertion::Inserted) => {
                            let before = holders.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            assert_eq!(before, 0, "two holders at once");
                            held += 1;
                            tokio::task::yield_now().await;
                            holders.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                            assert!(store.release(&key, row.token).await.unwrap());
                        }
                        Ok(_) => {}
                        Err(e) => panic!("insert_pending surfaced {e}"),
                    }
                }
                held
            })
        })
        .collect();
    let mut held = 0;
    for task in tasks {
        held += task.await.unwrap();
    }
    assert!(held > 0);
}

async fn innodb_deadlocks(store: &MySqlStore) -> Option<i64> {
    let row: Option<(String, String)> =
        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            .fetch_optional(store.pool())
            .await
            .ok()?;
    row?.1.parse().ok()
}

/// The classic InnoDB deadlock: an uncommitted insert of the key, three reservations waiting
/// on it, then a rollback — the waiters all hold shared locks and all want the insert lock,
/// and InnoDB kills all but one (1213). The victims must read the winner's row, not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlocked_reservation_reads_the_winner() {
    let Some(store) = store_at("REPEATABLE READ").await else {
        return;
    };
    let before = innodb_deadlocks(&store).await;
    for trial in 0..5 {
        let key = IdempotencyKey::new("deadlock", "purchase", format!("k{trial}")).unwrap();
        let blocker = pending(&key);
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query(INSERT)
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(blocker.effects.as_str())
            .bind(blocker.fingerprint.as_bytes().as_slice())
            .bind(blocker.token.0.as_bytes().as_slice())
            .bind(micros(blocker.lease))
            .bind(micros(blocker.retention))
            .execute(&mut *tx)
            .await
            .unwrap();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (store, key) = (store.clone(), key.clone());
                tokio::spawn(async move { store.insert_pending(&pending(&key)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await; // all three wait on the lock
        tx.rollback().await.unwrap();
        let mut inserted = 0;
        for waiter in waiters {
            match waiter.await.unwrap() {
                Ok(Insertion::Inserted) => inserted += 1,
                Ok(Insertion::Conflict(row)) => assert_eq!(row.key, key),
                other => panic!("trial {trial}: {other:?}"),
            }
        }
        assert_eq!(inserted, 1, "trial {trial}");
    }
    if let (Some(before), Some(after)) = (before, innodb_deadlocks(&store).await) {
        assert!(
            after > before,
            "the scenario must really deadlock inside InnoDB"
        );
    }
}

#[tokio::test]
async fn a_migration_applied_without_its_bookkeeping_row_is_taken_as_applied() {
    let Some(store) = store_with(None).await else {
        return;
    };
    store.migrate().await.unwrap();
    // A crash between migration 2's ALTER and its bookkeeping row.
    sqlx::query("DELETE FROM idempotency_schema_migrations WHERE version = 2")
        .execute(store.pool())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_schema_migrations ORDER BY version")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
}

#[tokio::test]
async fn migrate_records_each_version_once() {
    let Some(store) = store_with(None).await else {
        return;
    };
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_schema_migrations")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
    // The lock is released: another connection can take it at once.
    let free: Option<i64> = sqlx::query_scalar(&format!("SELECT IS_FREE_LOCK({MIGRATION_LOCK})"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(free, Some(1));
}
