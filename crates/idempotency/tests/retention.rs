//! Retention purge on PostgreSQL, SQLite and MySQL/MariaDB: only expired completed/failed rows, in batches,
//! from several instances at once, and without disturbing concurrent writers.

mod common;

use common::{attempt, purchase, unique, Harness};
use idempotency::{
    maintenance::Purge,
    store::{KeyState, Maintenance},
    Idempotency, MySqlStore, Outcome, PgStore, SqliteStore,
};
use serde_json::json;
use std::{
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

// Every store implements `Maintenance`, so the shared per-backend macro serves.
test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    purge_removes_only_expired_keys_in_batches,
    concurrent_purges_delete_each_row_once,
    large_purge_runs_beside_a_busy_writer,
    purge_takes_histories_with_their_keys_and_old_orphans,
}

/// Rows written straight with SQL, in bulk, with times relative to the database clock.
trait Bulk: Harness + Maintenance {
    /// Inserts `n` rows `scope/bulk/k<i>` in `state`, expiring `expires_in_ms` from now (negative:
    /// in the past), with leases that ended an hour ago.
    fn bulk(
        &self,
        scope: &str,
        state: KeyState,
        n: i64,
        expires_in_ms: i64,
    ) -> impl Future<Output = ()> + Send;

    /// Appends a `reserved` event to the history of `scope/bulk/key`, `days_ago` days ago.
    fn old_event(&self, scope: &str, key: &str, days_ago: i64) -> impl Future<Output = ()> + Send;
}

impl Bulk for PgStore {
    async fn old_event(&self, scope: &str, key: &str, days_ago: i64) {
        sqlx::query(
            "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind)
             VALUES ($1, 'bulk', $2, now() - $3 * INTERVAL '1 day', 'reserved')",
        )
        .bind(scope)
        .bind(key)
        .bind(days_ago)
        .execute(self.pool())
        .await
        .expect("insert an event");
    }

    async fn bulk(&self, scope: &str, state: KeyState, n: i64, expires_in_ms: i64) {
        sqlx::query(
            "INSERT INTO idempotency_keys
                (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
                 result, created_at, updated_at, expires_at)
             SELECT $1, 'bulk', 'k' || i, $2, 'local', sha256(i::TEXT::BYTEA), gen_random_uuid(),
                    now() - INTERVAL '1 hour', '{}'::BYTEA, now() - INTERVAL '2 hours',
                    now() - INTERVAL '2 hours', now() + $3 * INTERVAL '1 millisecond'
             FROM generate_series(1, $4) AS i",
        )
        .bind(scope)
        .bind(state.as_str())
        .bind(expires_in_ms)
        .bind(n)
        .execute(self.pool())
        .await
        .expect("bulk insert");
    }
}

impl Bulk for SqliteStore {
    async fn old_event(&self, scope: &str, key: &str, days_ago: i64) {
        sqlx::query(
            "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind)
             VALUES (?1, 'bulk', ?2,
                     CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?3 * 86400000, 'reserved')",
        )
        .bind(scope)
        .bind(key)
        .bind(days_ago)
        .execute(self.pool())
        .await
        .expect("insert an event");
    }

    async fn bulk(&self, scope: &str, state: KeyState, n: i64, expires_in_ms: i64) {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?4),
                  clock(ms) AS (SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER))
             INSERT INTO idempotency_keys
                (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
                 result, created_at, updated_at, expires_at)
             SELECT ?1, 'bulk', 'k' || i, ?2, 'local', zeroblob(32), randomblob(16),
                    ms - 3600000, X'7B7D', ms - 7200000, ms - 7200000, ms + ?3
             FROM n, clock",
        )
        .bind(scope)
        .bind(state.as_str())
        .bind(expires_in_ms)
        .bind(n)
        .execute(self.pool())
        .await
        .expect("bulk insert");
    }
}

impl Bulk for MySqlStore {
    async fn old_event(&self, scope: &str, key: &str, days_ago: i64) {
        sqlx::query(
            "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind)
             VALUES (?, 'bulk', ?, UTC_TIMESTAMP(3) - INTERVAL ? DAY, 'reserved')",
        )
        .bind(scope)
        .bind(key)
        .bind(days_ago)
        .execute(self.pool())
        .await
        .expect("insert an event");
    }

    async fn bulk(&self, scope: &str, state: KeyState, n: i64, expires_in_ms: i64) {
        // Numbers 0..n from a cross join of digits: no recursion limits on MySQL or MariaDB.
        sqlx::query(
            "INSERT INTO idempotency_keys
                (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
                 result, created_at, updated_at, expires_at)
             SELECT ?, 'bulk', CONCAT('k', i), ?, 'local', UNHEX(SHA2(i, 256)),
                    UNHEX(REPLACE(UUID(), '-', '')),
                    UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, '{}', UTC_TIMESTAMP(6) - INTERVAL 2 HOUR,
                    UTC_TIMESTAMP(6) - INTERVAL 2 HOUR,
                    UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND
             FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * g.d AS i
                   FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                         UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                         UNION ALL SELECT 8 UNION ALL SELECT 9) a,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                         UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                         UNION ALL SELECT 8 UNION ALL SELECT 9) b,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                         UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                         UNION ALL SELECT 8 UNION ALL SELECT 9) c,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                         UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                         UNION ALL SELECT 8 UNION ALL SELECT 9) e,
                        (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                         UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                         UNION ALL SELECT 8 UNION ALL SELECT 9) f,
                        (SELECT 0 AS d UNION ALL SELECT 1) g) numbers
             WHERE i < ?",
        )
        .bind(scope)
        .bind(state.as_str())
        .bind(expires_in_ms)
        .bind(n)
        .execute(self.pool())
        .await
        .expect("bulk insert");
    }
}

const PAST: i64 = -60_000;

/// The purge deletes a purged key's history with it, and the history of a key without a row
/// once its newest event is older than seven days; it keeps younger orphaned histories (a
/// released key, which a later reservation continues) and the histories of kept keys.
async fn purge_takes_histories_with_their_keys_and_old_orphans<S: Bulk>(store: S) {
    let trial = unique("history");
    let scope = |name: &str| format!("{trial}-{name}");
    store
        .bulk(&scope("done"), KeyState::Completed, 3, PAST)
        .await;
    store
        .bulk(&scope("live"), KeyState::Completed, 3, FUTURE)
        .await;
    store.old_event(&scope("done"), "k1", 0).await;
    store.old_event(&scope("live"), "k1", 8).await;
    store.old_event(&scope("orphan-old"), "k1", 8).await;
    store.old_event(&scope("orphan-old"), "k1", 9).await;
    store.old_event(&scope("orphan-new"), "k1", 8).await;
    store.old_event(&scope("orphan-new"), "k1", 0).await;
    let events = |name: &str| {
        let (store, key) = (store.clone(), key_of(&scope(name)));
        async move { store.history(&key, 100).await.unwrap().len() }
    };
    assert_eq!(events("done").await, 1, "{}", S::NAME);
    assert_eq!(events("orphan-old").await, 2, "{}", S::NAME);
    let report = Purge::new(store.clone())
        .with_batch(100)
        .run(|_| {})
        .await
        .unwrap();
    assert!(report.deleted >= 3, "{}: {report:?}", S::NAME);
    assert_eq!(
        events("done").await,
        0,
        "{}: the purged key's history",
        S::NAME
    );
    assert_eq!(events("orphan-old").await, 0, "{}: an old orphan", S::NAME);
    assert_eq!(events("orphan-new").await, 2, "{}: a young orphan", S::NAME);
    assert_eq!(events("live").await, 1, "{}: a kept key's history", S::NAME);
}

/// The key `scope/bulk/k1`.
fn key_of(scope: &str) -> idempotency::IdempotencyKey {
    idempotency::IdempotencyKey::new(scope, "bulk", "k1").unwrap()
}
const FUTURE: i64 = 3_600_000;

async fn purge_removes_only_expired_keys_in_batches<S: Bulk>(store: S) {
    store.bulk("old-done", KeyState::Completed, 23, PAST).await;
    store.bulk("old-failed", KeyState::Failed, 11, PAST).await;
    store
        .bulk("fresh-done", KeyState::Completed, 5, FUTURE)
        .await;
    store
        .bulk("fresh-failed", KeyState::Failed, 4, FUTURE)
        .await;
    // Past their expiry, but never purged: work in flight and keys awaiting a human.
    store.bulk("old-pending", KeyState::Pending, 6, PAST).await;
    store
        .bulk("old-parked", KeyState::NeedsReview, 7, PAST)
        .await;

    let purge = Purge::new(store.clone()).with_batch(10);
    assert_eq!(purge.count().await.unwrap(), 34, "{}: dry run", S::NAME);
    assert_eq!(store.stats().await.unwrap().purgeable, 34);
    // A dry run deletes nothing.
    assert_eq!(store.stats().await.unwrap().total(), 56);

    // One batch deletes exactly the batch size.
    assert_eq!(store.purge_batch(10).await.unwrap(), 10);
    let mut seen = Vec::new();
    let report = purge.run(|total| seen.push(total)).await.unwrap();
    assert_eq!(report.deleted, 24, "{}", S::NAME);
    assert_eq!(report.batches, 3, "24 rows in batches of 10");
    assert_eq!(seen, vec![10, 20, 24], "progress after each batch");
    assert_eq!(purge.count().await.unwrap(), 0);
    assert_eq!(purge.run(|_| {}).await.unwrap().deleted, 0);

    let stats = store.stats().await.unwrap();
    assert_eq!(stats.total(), 22, "{}: {stats:?}", S::NAME);
    assert_eq!(stats.in_state(KeyState::Completed), 5);
    assert_eq!(stats.in_state(KeyState::Failed), 4);
    assert_eq!(stats.in_state(KeyState::Pending), 6);
    assert_eq!(stats.in_state(KeyState::NeedsReview), 7);
}

async fn concurrent_purges_delete_each_row_once<S: Bulk>(store: S) {
    const ROWS: i64 = 5_000;
    const PURGES: usize = 4;
    for trial in 0..3 {
        store
            .bulk(&format!("t{trial}"), KeyState::Completed, ROWS, PAST)
            .await;
        let barrier = Arc::new(tokio::sync::Barrier::new(PURGES));
        let purges: Vec<_> = (0..PURGES)
            .map(|_| {
                let purge = Purge::new(store.clone()).with_batch(250);
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    purge.run(|_| {}).await.unwrap()
                })
            })
            .collect();
        let mut deleted = 0;
        let mut busy = 0;
        for purge in purges {
            let report = purge.await.unwrap();
            deleted += report.deleted;
            busy += usize::from(report.deleted > 0);
        }
        assert_eq!(deleted, ROWS as u64, "{}: trial {trial}", S::NAME);
        assert_eq!(store.stats().await.unwrap().total(), 0);
        eprintln!(
            "{}: trial {trial}: {PURGES} purges deleted {deleted} rows together ({busy} did some)",
            S::NAME
        );
    }
}

async fn large_purge_runs_beside_a_busy_writer<S: Bulk>(store: S) {
    const ROWS: i64 = 100_000;
    let started = Instant::now();
    store.bulk("expired", KeyState::Completed, ROWS, PAST).await;
    store.bulk("kept", KeyState::Completed, 1_000, FUTURE).await;
    let inserted = started.elapsed();

    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, done) = (store.clone(), done.clone());
        tokio::spawn(async move {
            let idem = Idempotency::new(store.clone());
            let trial = unique("writer");
            let (mut successes, mut errors, mut slowest) = (0u64, Vec::new(), Duration::ZERO);
            while !done.load(Ordering::SeqCst) || successes == 0 {
                let a = attempt("writer", &format!("{trial}-{successes}"), json!({}));
                let t = Instant::now();
                match purchase(&idem, &a, &trial, successes).await {
                    Ok(Outcome::Executed(_)) => successes += 1,
                    other => errors.push(format!("{other:?}")),
                }
                slowest = slowest.max(t.elapsed());
            }
            (successes, errors, slowest)
        })
    };

    let purge_started = Instant::now();
    let report = Purge::new(store.clone())
        .with_batch(1_000)
        .run(|_| {})
        .await
        .unwrap();
    let purged_in = purge_started.elapsed();
    done.store(true, Ordering::SeqCst);
    let (successes, errors, slowest) = writer.await.unwrap();

    assert_eq!(report.deleted, ROWS as u64, "{}", S::NAME);
    assert_eq!(report.batches, (ROWS / 1_000) as u64);
    assert!(errors.is_empty(), "{}: writer errors: {errors:?}", S::NAME);
    assert!(successes > 0);
    assert_eq!(store.count_effects(&unique("none")).await, 0);
    let stats = store.stats().await.unwrap();
    assert_eq!(
        stats.total(),
        1_000 + successes,
        "{}: kept rows and the writer's keys remain",
        S::NAME
    );
    eprintln!(
        "{}: bulk insert {ROWS} rows in {inserted:?}; purge {} rows in {} batches in {purged_in:?}; \
         concurrent writer: {successes} successes, {} errors, slowest call {slowest:?}",
        S::NAME,
        report.deleted,
        report.batches,
        errors.len()
    );
}

/// SQLite indexes the expiry of settled keys only (a reservation writes one index entry less),
/// and the purge's and the count's condition, copied here from the store, searches that index.
#[tokio::test]
async fn sqlite_indexes_the_expiry_of_settled_keys_only() {
    let store = <SqliteStore as Harness>::open().await.expect("sqlite");
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM idempotency_schema_migrations ORDER BY version")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(applied, [1, 2, 3, 4]);
    let expiry_indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, sql FROM sqlite_master
          WHERE type = 'index' AND tbl_name = 'idempotency_keys' AND sql LIKE '%(expires_at)%'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(expiry_indexes.len(), 1, "{expiry_indexes:?}");
    let (name, sql) = &expiry_indexes[0];
    assert_eq!(name, "idempotency_keys_settled_expiry");
    assert!(
        sql.contains("WHERE state IN ('completed', 'failed')"),
        "{sql}"
    );
    const SETTLED_AND_EXPIRED: &str =
        "state IN ('completed', 'failed') AND expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    let statements = [
        format!("SELECT count(*) FROM idempotency_keys WHERE {SETTLED_AND_EXPIRED}"),
        format!(
            "DELETE FROM idempotency_keys WHERE (scope, operation, idem_key) IN (
                SELECT scope, operation, idem_key FROM idempotency_keys
                 WHERE {SETTLED_AND_EXPIRED}
                 ORDER BY expires_at, scope, operation, idem_key LIMIT 1000)"
        ),
    ];
    for statement in statements {
        let plan: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(&format!("EXPLAIN QUERY PLAN {statement}"))
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert!(
            plan.iter().any(|(_, _, _, detail)| {
                detail.contains("USING INDEX idempotency_keys_settled_expiry")
                    || detail.contains("USING COVERING INDEX idempotency_keys_settled_expiry")
            }),
            "{statement}: {plan:?}"
        );
    }
}
