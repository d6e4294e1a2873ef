//! One harness for every backend: a fresh store with a business table `effects`, and the map from
//! a backend to its store that `test_support::backend_tests!` runs each generic test through.
#![allow(dead_code)]

use futures_util::future::BoxFuture;
use idempotency::{Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, Outcome};
use idempotency::{PgStore, SqliteStore, Store};
use serde_json::json;
use sqlx::Transaction;
use std::{any::Any, time::Duration};

/// A store on a fresh database, with a business table to count effects in.
pub trait Harness:
    Store + idempotency::store::Journal + idempotency::store::CompletionSignal + Sized
{
    /// Backend name for messages.
    const NAME: &'static str;

    /// A migrated store on a fresh database, or `None` when the backend is not configured (never
    /// under CI).
    fn open() -> impl std::future::Future<Output = Option<Self>> + Send;

    /// The business write: one row in `effects` for `trial`, inside the business transaction.
    fn insert_effect<'t>(
        tx: &'t mut Transaction<'_, Self::Database>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>>;

    /// How many effects `trial` has.
    fn count_effects(&self, trial: &str) -> impl std::future::Future<Output = i64> + Send;

    /// Another store on the same database, with a pool of at most `connections`.
    fn reopen(&self, connections: u32) -> impl std::future::Future<Output = Self> + Send;

    /// Deletes a key row behind the engine's back, as an operator's hand would.
    fn delete_by_hand(&self, key: &IdempotencyKey) -> impl std::future::Future<Output = ()> + Send;

    /// Holds every connection this store writes with until the guard is dropped: meanwhile its
    /// statements (a lease's heartbeat among them) wait, as a frozen process's would. Other
    /// stores on the database ([`reopen`](Self::reopen)) go on.
    fn starve(&self) -> impl std::future::Future<Output = Box<dyn Any + Send>> + Send;
}

impl Harness for PgStore {
    const NAME: &'static str = "postgres";

    async fn open() -> Option<Self> {
        let url = test_support::fresh_postgres_url().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(24)
            .connect(&url)
            .await
            .expect("connect to fresh postgres database");
        let store = PgStore::new(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, trial TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(store)
    }

    fn insert_effect<'t>(
        tx: &'t mut Transaction<'_, sqlx::Postgres>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (trial) VALUES ($1)")
                .bind(trial)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn delete_by_hand(&self, key: &IdempotencyKey) {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE scope = $1 AND operation = $2 AND idem_key = $3",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .execute(self.pool())
        .await
        .expect("delete a key by hand");
    }
    async fn count_effects(&self, trial: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE trial = $1")
            .bind(trial)
            .fetch_one(self.pool())
            .await
            .expect("count effects")
    }
    async fn reopen(&self, connections: u32) -> Self {
        let options = self.pool().connect_options().as_ref().clone();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .connect_with(options)
            .await
            .expect("reopen postgres");
        PgStore::new(pool)
    }

    async fn starve(&self) -> Box<dyn Any + Send> {
        Box::new(hold_all(self.pool()).await)
    }
}

/// Keeps every SQLite test file alive for the whole test binary.
static SQLITE_FILES: std::sync::Mutex<Vec<test_support::SqliteFile>> =
    std::sync::Mutex::new(Vec::new());

impl Harness for SqliteStore {
    const NAME: &'static str = "sqlite";

    async fn open() -> Option<Self> {
        let file = test_support::fresh_sqlite();
        let store = SqliteStore::connect(&file.url).await.expect("open sqlite");
        SQLITE_FILES.lock().unwrap().push(file);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (id INTEGER PRIMARY KEY, trial TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("effects table");
        Some(store)
    }

    fn insert_effect<'t>(
        tx: &'t mut Transaction<'_, sqlx::Sqlite>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (trial) VALUES (?1)")
                .bind(trial)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn delete_by_hand(&self, key: &IdempotencyKey) {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .execute(self.pool())
        .await
        .expect("delete a key by hand");
    }
    async fn count_effects(&self, trial: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE trial = ?1")
            .bind(trial)
            .fetch_one(self.pool())
            .await
            .expect("count effects")
    }
    async fn reopen(&self, _connections: u32) -> Self {
        let file = self.pool().connect_options().get_filename().to_owned();
        SqliteStore::connect(&format!("sqlite://{}", file.display()))
            .await
            .expect("reopen sqlite")
    }

    async fn starve(&self) -> Box<dyn Any + Send> {
        // Every write goes through the one writer connection; holding it (outside any
        // transaction) takes no SQLite lock, so other stores on the file go on writing.
        Box::new(
            self.writer()
                .acquire()
                .await
                .expect("the writer connection"),
        )
    }
}

impl Harness for idempotency::MySqlStore {
    const NAME: &'static str = "mysql";

    async fn open() -> Option<Self> {
        let url = test_support::fresh_mysql_url().await?;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(24)
            .connect(&url)
            .await
            .expect("connect to fresh mysql database");
        let store = idempotency::MySqlStore::new(pool);
        store.migrate().await.expect("migrate");
        sqlx::query(
            "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, trial VARCHAR(255) NOT NULL) ENGINE = InnoDB",
        )
        .execute(store.pool())
        .await
        .expect("effects table");
        Some(store)
    }

    fn insert_effect<'t>(
        tx: &'t mut Transaction<'_, sqlx::MySql>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (trial) VALUES (?)")
                .bind(trial)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn delete_by_hand(&self, key: &IdempotencyKey) {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE scope = ? AND operation = ? AND idem_key = ?",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .execute(self.pool())
        .await
        .expect("delete a key by hand");
    }
    async fn count_effects(&self, trial: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE trial = ?")
            .bind(trial)
            .fetch_one(self.pool())
            .await
            .expect("count effects")
    }
    async fn reopen(&self, connections: u32) -> Self {
        let options = self.pool().connect_options().as_ref().clone();
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(connections)
            .connect_with(options)
            .await
            .expect("reopen mysql");
        idempotency::MySqlStore::new(pool)
    }

    async fn starve(&self) -> Box<dyn Any + Send> {
        Box::new(hold_all(self.pool()).await)
    }
}

/// Every connection `pool` may open, held.
async fn hold_all<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Vec<sqlx::pool::PoolConnection<DB>> {
    let mut held = Vec::new();
    for _ in 0..pool.options().get_max_connections() {
        held.push(pool.acquire().await.expect("a pooled connection"));
    }
    held
}

/// Runs the generic test `$test` (`async fn name<S: Harness>(store: S)`) on `$backend`'s store:
/// this crate's map from a backend to its store type, for the `via` of
/// `test_support::backend_tests!`, which lists the backends. Exhaustive: a backend added there
/// must be given its store here.
#[macro_export]
macro_rules! on_store {
    ($backend:expr, $test:path) => {
        match $backend {
            test_support::TestDatabase::Sqlite => {
                $crate::common::run_on_fresh::<idempotency::SqliteStore, _>($test).await
            }
            test_support::TestDatabase::Postgres => {
                $crate::common::run_on_fresh::<idempotency::PgStore, _>($test).await
            }
            test_support::TestDatabase::MySql => {
                $crate::common::run_on_fresh::<idempotency::MySqlStore, _>($test).await
            }
        }
    };
}

/// Runs `test` on a fresh `S`; nothing when the backend is skipped.
pub async fn run_on_fresh<S: Harness, Fut: std::future::Future<Output = ()>>(
    test: impl FnOnce(S) -> Fut,
) {
    if let Some(store) = S::open().await {
        test(store).await;
    }
}

pub fn attempt(scope: &str, key: &str, body: serde_json::Value) -> Attempt {
    Attempt::new(
        IdempotencyKey::new(scope, "purchase", key).unwrap(),
        Fingerprint::of_json(&body).unwrap(),
    )
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Runs a purchase that writes one effect for `trial` and returns `{"trial": …, "n": n}`.
pub async fn purchase<S: Harness>(
    idem: &Idempotency<S>,
    attempt: &Attempt,
    trial: &str,
    n: u64,
) -> Result<Outcome<serde_json::Value>, Error<sqlx::Error>> {
    idem.run(attempt, async |tx| {
        S::insert_effect(tx, trial).await?;
        Ok(json!({"trial": trial, "n": n}))
    })
    .await
}

pub async fn wait_until<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
