//! A full disk is "not now", not "never". On a real SQLite file whose size is capped (`PRAGMA
//! max_page_count`: SQLite answers `SQLITE_FULL`, as on a full disk), a new key's reservation
//! fails with an unavailable store error (the HTTP layer answers 503), a completed key still
//! replays, nothing is left half-written, and once there is room again the same key reserves and
//! completes. The shop's files on a tmpfs that really fills up: `faults --only disk-full`.

use idempotency::{
    protocol::Reservation, store::is_unavailable_error, Attempt, Error, Fingerprint, Idempotency,
    IdempotencyKey, SqliteStore, Store,
};
use sqlx::{sqlite::SqliteTransactionManager, TransactionManager};

fn attempt(key: &str) -> Attempt {
    Attempt::new(
        IdempotencyKey::new("user-1", "purchase", key).expect("a valid key"),
        Fingerprint::of_bytes(key.as_bytes()),
    )
}

async fn pages(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("PRAGMA page_count")
        .fetch_one(store.writer())
        .await
        .expect("page_count")
}

#[tokio::test]
async fn a_full_database_is_unavailable_then_recovers() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let url = format!("sqlite://{}", dir.path().join("full.db").display());
    let store = SqliteStore::connect(&url).await.expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE filler (body TEXT)")
        .execute(store.writer())
        .await
        .expect("a business table");
    let idem = Idempotency::new(store.clone()).with_heartbeat(false);
    let done = attempt("done");
    let Reservation::Acquired(lease) = idem.reserve(&done).await.expect("reserve") else {
        panic!("a fresh key")
    };
    let tx = store.begin().await.expect("begin");
    lease.finish(tx, b"stored").await.expect("complete");

    // No room for one more page (the writer pool is one connection, so the cap holds for every
    // write the store makes), then fill the free pages with a big key's rows.
    let full = pages(&store).await;
    sqlx::query(&format!("PRAGMA max_page_count = {full}"))
        .execute(store.writer())
        .await
        .expect("cap the file");
    let mut refused = None;
    for n in 0..200 {
        let big = format!("{n}-{}", "k".repeat(200));
        match idem.reserve(&attempt(&big)).await {
            Ok(Reservation::Acquired(lease)) => lease.leave_pending(),
            Ok(_) => panic!("a fresh key"),
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
    }
    let refused = refused.expect("the capped file must fill up");
    let Error::Store(store_error) = &refused else {
        panic!("a full database is a store error, got {refused:?}")
    };
    assert!(
        store_error.is_unavailable(),
        "SQLITE_FULL must be unavailable (503, retry later): {store_error:?}"
    );
    if let idempotency::StoreError::Database(db) = store_error {
        assert!(is_unavailable_error(db));
    }
    // A business transaction that hits the full disk: SQLite rolls it back by itself, so the
    // explicit ROLLBACK fails too. The writer connection must not come back believing it is
    // still inside a transaction (its next `begin` would open a mere savepoint).
    let mut tx = store.begin().await.expect("begin");
    let mut hit_full = false;
    for _ in 0..200 {
        let insert = sqlx::query("INSERT INTO filler (body) VALUES (?1)")
            .bind("x".repeat(4000))
            .execute(&mut *tx)
            .await;
        if let Err(error) = insert {
            assert!(is_unavailable_error(&error), "{error:?}");
            hit_full = true;
            break;
        }
    }
    assert!(hit_full, "the capped file must fill up");
    let _ = tx.rollback().await;
    let mut conn = store.writer().acquire().await.expect("the writer");
    assert_eq!(
        <SqliteTransactionManager as TransactionManager>::get_transaction_depth(&conn),
        0,
        "the writer came back inside a transaction sqlx believes is open"
    );
    sqlx::query("SELECT 1")
        .execute(&mut *conn)
        .await
        .expect("usable");
    drop(conn);

    // Reads go on: the completed key replays.
    match idem.reserve(&done).await.expect("a replay needs no room") {
        Reservation::Completed(bytes) => assert_eq!(bytes, b"stored"),
        _ => panic!("the completed key must replay"),
    }

    // Room again: the refused key reserves and completes.
    sqlx::query("PRAGMA max_page_count = 1073741823")
        .execute(store.writer())
        .await
        .expect("lift the cap");
    let again = attempt("after");
    let Reservation::Acquired(lease) = idem.reserve(&again).await.expect("room again") else {
        panic!("a fresh key")
    };
    let tx = store.begin().await.expect("begin");
    lease.finish(tx, b"later").await.expect("complete");
    let check: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_all(store.pool())
        .await
        .expect("integrity_check");
    assert_eq!(check, ["ok"]);
}
