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
