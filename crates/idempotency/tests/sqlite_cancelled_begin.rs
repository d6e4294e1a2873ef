//! sqlx 0.8's SQLite worker can acknowledge a `BEGIN IMMEDIATE` after its caller was cancelled:
//! the pooled connection then holds the write lock in a transaction nobody owns, and every later
//! writer waits out its busy timeout ("database is locked"). Seen in CI on a loaded machine (3 of 4
//! runs fail without the fix under two busy loops); the store begins in a task of its own, so a
//! cancelled caller cannot strand a transaction.

use idempotency::{SqliteStore, Store};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn begin_survives_cancelled_begins() {
    let file = test_support::fresh_sqlite();
    let store = SqliteStore::connect(&file.url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE t (x INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let mut cancelled = 0;
    for i in 0..400u64 {
        // Cancel a begin at a random moment (often while the worker is mid-BEGIN).
        let attempt = tokio::time::timeout(Duration::from_micros(i % 60), async {
            let mut tx = store.begin().await.unwrap();
            sqlx::query("INSERT INTO t (x) VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            tx.commit().await.unwrap();
        })
        .await;
        if attempt.is_err() {
            cancelled += 1;
        }
        // Every later transaction must begin, and run on its own.
        let mut tx = store
            .begin()
            .await
            .unwrap_or_else(|e| panic!("iteration {i}: {e}"));
        sqlx::query("INSERT INTO t (x) VALUES (2)")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    }
    assert!(
        cancelled > 50,
        "the race window was exercised ({cancelled} cancelled)"
    );
}
