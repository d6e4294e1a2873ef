//! The PostgreSQL store behind PgBouncer in transaction pooling mode (`TEST_PGBOUNCER_ADDR`,
//! e.g. `127.0.0.1:6432`, in front of the server of `TEST_POSTGRES_URL`; unset: skipped, except
//! in CI, which starts PgBouncer before the tests).
//! Start it with `bash .ci/topology/pgbouncer.sh up`, then
//! `TEST_PGBOUNCER_ADDR=127.0.0.1:6432 cargo test -p idempotency --all-features --test pgbouncer`.
//!
//! The store must see that it is behind a transaction pooler (and not on a direct connection),
//! and then pass the whole conformance suite through it: without that detection its first
//! statement meets another client's `sqlx_s_1` on the server connection, or its prepared
//! statement is gone by the time it is executed.

use idempotency::{PgStore, Store};

/// A fresh database on the server of `TEST_POSTGRES_URL`, and its URL through PgBouncer.
async fn fresh_urls() -> Option<(String, String)> {
    let Ok(addr) = std::env::var("TEST_PGBOUNCER_ADDR") else {
        assert!(
            !test_support::in_ci(),
            "TEST_PGBOUNCER_ADDR is not set, but CI is: .ci/run starts PgBouncer for this test"
        );
        eprintln!("SKIPPED: TEST_PGBOUNCER_ADDR is not set (bash .ci/topology/pgbouncer.sh up)");
        return None;
    };
    let direct = test_support::fresh_postgres_url().await?;
    let (head, database) = direct.rsplit_once('/')?;
    let (credentials, _) = head.rsplit_once('@')?;
    Some((direct.clone(), format!("{credentials}@{addr}/{database}")))
}

async fn fresh() -> Option<PgStore> {
    let (_, pooled) = fresh_urls().await?;
    let store = PgStore::connect(&pooled)
        .await
        .expect("connect through PgBouncer");
    store.migrate().await.expect("migrate through PgBouncer");
    Some(store)
}

#[tokio::test]
async fn the_pooler_is_detected_and_a_direct_connection_is_not() {
    let Some((direct, pooled)) = fresh_urls().await else {
        return;
    };
    let through = PgStore::connect(&pooled).await.unwrap();
    assert!(through.behind_transaction_pooler().await.unwrap());
    let direct = PgStore::connect(&direct).await.unwrap();
    assert!(!direct.behind_transaction_pooler().await.unwrap());
}

idempotency::store::testing::store_conformance!(
    fresh,
    [protocol, journal, reserve_in_transaction, completion_signal]
);
