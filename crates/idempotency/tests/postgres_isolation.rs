//! PostgreSQL with REPEATABLE READ / SERIALIZABLE as the server default: a losing
//! `INSERT … ON CONFLICT DO NOTHING` may fail with 40001 there; the reservation must still answer
//! cleanly (no serialization error reaches the caller) and the work must still run exactly once.

mod common;

use common::Harness;
use idempotency::{PgStore, Store};

async fn store_with_default_isolation(level: &str) -> Option<PgStore> {
    let store = <PgStore as Harness>::open().await?;
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    sqlx::query(&format!(
        "ALTER DATABASE {database} SET default_transaction_isolation TO '{level}'"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let options = (*store.pool().connect_options()).clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(24)
        .connect_with(options)
        .await
        .unwrap();
    let shown: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(shown, level);
    let store = PgStore::new(pool);
    store.migrate().await.unwrap();
    Some(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_under_serializable_default() {
    if let Some(store) = store_with_default_isolation("serializable").await {
        idempotency::store::testing::prepare(&store).await;
        idempotency::store::testing::race(store, 200, 8).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_under_repeatable_read_default() {
    if let Some(store) = store_with_default_isolation("repeatable read").await {
        idempotency::store::testing::prepare(&store).await;
        idempotency::store::testing::race(store, 200, 8).await;
    }
}

/// Concurrent failure counts on one counter under SERIALIZABLE: an upsert that meets a row
/// changed after its snapshot fails with 40001 and is tried again; every failure still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failure_counts_under_serializable_default() {
    if let Some(store) = store_with_default_isolation("serializable").await {
        let profile = idempotency::store::testing::Profile::default();
        idempotency::store::testing::protocol::concurrent_failures_each_count(store, profile).await;
    }
}

/// The key columns compare byte by byte (migration 2), whatever the database's locale.
#[tokio::test]
async fn key_columns_collate_as_bytes() {
    let Some(store) = <PgStore as Harness>::open().await else {
        return;
    };
    let collations: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT column_name::TEXT, collation_name::TEXT FROM information_schema.columns
          WHERE table_name = 'idempotency_keys'
            AND column_name IN ('scope', 'operation', 'idem_key')
          ORDER BY column_name",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(collations.len(), 3, "{collations:?}");
    for (column, collation) in collations {
        assert_eq!(collation.as_deref(), Some("C"), "{column}");
    }
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_schema_migrations ORDER BY version")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(applied, [1, 2, 3, 4, 5]);
    // Only settled keys are indexed by expiry: a reservation writes two index entries.
    let expiry_indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes
          WHERE tablename = 'idempotency_keys' AND indexdef LIKE '%(expires_at)%'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(expiry_indexes.len(), 1, "{expiry_indexes:?}");
    assert!(
        expiry_indexes[0]
            .contains("WHERE (state = ANY (ARRAY['completed'::text, 'failed'::text]))"),
        "{expiry_indexes:?}"
    );
}

/// The single-transaction mode writes its key row once into the table's indexes: the row is
/// inserted `completed` without a result, so the completion in the same transaction changes no
/// indexed column and PostgreSQL makes it a HOT update (no index entry written). The table is
/// new, so the row's page has room for the new version.
#[tokio::test]
async fn a_single_transaction_completion_is_a_hot_update() {
    use idempotency::{
        store::{Effects, KeyState, LeaseToken, PendingRow, ReserveInTransaction, ReservedIn},
        Fingerprint, IdempotencyKey,
    };
    use std::time::Duration;
    let Some(store) = <PgStore as Harness>::open().await else {
        return;
    };
    let key = IdempotencyKey::new("user-1", "orders", common::unique("hot")).unwrap();
    let row = PendingRow {
        key: &key,
        fingerprint: Fingerprint::of_bytes(b"request"),
        token: LeaseToken::new(),
        effects: Effects::Local,
        journaled: false,
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3_600),
    };
    let mut tx = store.begin().await.unwrap();
    let reserved = store
        .reserve_in(&mut tx, &row, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(reserved, ReservedIn::Inserted);
    let completed = store
        .complete(&mut tx, &key, row.token, br#"{"order":1}"#, row.retention)
        .await
        .unwrap();
    assert!(completed);
    // A second completion by the same holder finds nothing left to complete.
    let again = store
        .complete(&mut tx, &key, row.token, br#"{"order":2}"#, row.retention)
        .await
        .unwrap();
    assert!(!again);
    let (updated, hot): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated('idempotency_keys'::regclass),
                pg_stat_get_xact_tuples_hot_updated('idempotency_keys'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!((updated, hot), (1, 1), "(updated, of them HOT)");
    tx.commit().await.unwrap();
    let record = store.find(&key).await.unwrap().expect("the committed row");
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.result.as_deref(), Some(&br#"{"order":1}"#[..]));
    // Another holder's token completes nothing, committed or not.
    let mut tx = store.begin().await.unwrap();
    let stranger = store
        .complete(&mut tx, &key, LeaseToken::new(), b"{}", row.retention)
        .await
        .unwrap();
    assert!(!stranger);
    tx.rollback().await.unwrap();
}
