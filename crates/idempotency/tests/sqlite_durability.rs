//! SQLite's durability: `SqliteStore::connect` syncs every commit (`synchronous = FULL`); a
//! reservation that may be relaxed (`PendingRow::must_flush_reservation`) commits at `NORMAL` on
//! the writer connection, and the level is always put back, even when the reserving caller is
//! cancelled midway, so the business transactions after it are synced. Heartbeats likewise. A
//! pool the application opened at `NORMAL` is left alone.

use idempotency::{
    store::{LeaseToken, PendingRow},
    Effects, Fingerprint, IdempotencyKey, SqliteStore, Store,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use std::{str::FromStr, time::Duration};

/// `PRAGMA synchronous` as a business transaction of the store sees it.
async fn level_in_business_tx(store: &SqliteStore) -> i64 {
    let mut tx = store.begin().await.unwrap();
    let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    level
}

fn row(key: &IdempotencyKey, effects: Effects, journaled: bool) -> PendingRow<'_> {
    PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(b"request"),
        token: LeaseToken::new(),
        effects,
        journaled,
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relaxed_reservations_leave_the_writer_synced() {
    let file = test_support::fresh_sqlite();
    let store = SqliteStore::connect(&file.url).await.unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        level_in_business_tx(&store).await,
        2,
        "connect syncs (FULL)"
    );

    let kinds = [
        (Effects::Local, false),
        (Effects::External, true),
        (Effects::External, false),
    ];
    let (mut cancelled, mut inserted) = (0, 0);
    for i in 0..300u64 {
        let key = IdempotencyKey::new("user-1", "op", format!("k{i}")).unwrap();
        let (effects, journaled) = kinds[i as usize % kinds.len()];
        // Cancel many reservations at varied moments: poll the reservation `i % 40` times, 30 µs
        // apart (a statement takes about that long on SQLite's worker thread), then drop it.
        let pending = row(&key, effects, journaled);
        let reservation = store.insert_pending(&pending);
        let pause = Duration::from_micros(30);
        let outcome = test_support::poll_then_drop(reservation, i % 40, pause).await;
        match outcome {
            None => cancelled += 1,
            Some(result) => {
                result.unwrap();
                inserted += 1;
                // A heartbeat commits at NORMAL too, and puts the level back.
                let beat = store.extend_lease(&key, pending.token, Duration::from_secs(60));
                assert!(beat.await.unwrap(), "iteration {i}: the holder's beat");
            }
        }
        assert_eq!(
            level_in_business_tx(&store).await,
            2,
            "iteration {i}: a business transaction after a reservation must be synced"
        );
    }
    println!("{cancelled} reservations cancelled, {inserted} completed");
    assert!(cancelled > 15, "cancellation exercised ({cancelled})");
    assert!(inserted > 30, "reservations completed ({inserted})");
}

#[tokio::test]
async fn a_pool_opened_at_normal_is_left_at_normal() {
    let file = test_support::fresh_sqlite();
    let options = SqliteConnectOptions::from_str(&file.url)
        .unwrap()
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    let pool = SqliteStore::pool_options()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();
    for i in 0..3 {
        let key = IdempotencyKey::new("user-1", "op", format!("k{i}")).unwrap();
        store
            .insert_pending(&row(&key, Effects::Local, false))
            .await
            .unwrap();
        assert_eq!(level_in_business_tx(&store).await, 1, "NORMAL, as opened");
    }
}
