//! The isolation matrix: for every database and isolation level, `workers` concurrent requests
//! race one fresh key, `trials` times, with three ways of guarding the work:
//!
//! * **(a) check-then-insert**: `SELECT` the key, and if absent `INSERT` it and run the work, in
//!   one transaction at the level under test, with no unique constraint (only a plain index);
//! * **(b) `SELECT … FOR UPDATE`-then-insert**: the same with a locking read, the lock as the only
//!   guard. SQLite has no `FOR UPDATE`; its nearest equivalent is a *deferred* transaction that
//!   reads, then writes (it takes the write lock only at the first write). For SQLite, (a) is the
//!   application's pre-check: a `SELECT` on its own, then `INSERT` and work in a `BEGIN IMMEDIATE`
//!   transaction (SQLite has one isolation level, so a check inside a deferred transaction would
//!   be (b) again);
//! * **(c) reserve-first**: [`Idempotency::run`] with the crate's real stores, every connection of
//!   the pool (the reservation's and the business transaction's) at the level under test.
//!
//! A worker *runs the work* when it passes its guard: it increments an in-memory counter (an
//! effect outside the database, like a mail, which a rollback does not undo), waits a little, and
//! writes one row in the business transaction. Per trial the matrix then knows how many workers
//! ran the work and how many rows were committed; per worker, which error it got.
//!
//! Shared by `examples/isolation_matrix.rs` (prints the table) and `tests/isolation_matrix.rs`
//! (asserts it).
#![allow(dead_code)]

use futures_util::future::BoxFuture;
use idempotency::{
    Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, MySqlStore, PgStore, SqliteStore,
    Store, StoreError,
};
use sqlx::{Connection, Executor};
use std::{
    fmt::{self, Write as _},
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tokio::sync::Barrier;

/// How hard to race.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Fresh keys per cell.
    pub trials: usize,
    /// Concurrent workers per key, released together by a barrier.
    pub workers: usize,
    /// The race window of (a) and (b): the pause between the check and the insert.
    pub window: Duration,
    /// How long the work takes once entered.
    pub work: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            trials: 200,
            workers: 8,
            window: Duration::from_millis(3),
            work: Duration::from_millis(2),
        }
    }
}

impl Config {
    /// The default, with `ISOLATION_MATRIX_TRIALS` / `ISOLATION_MATRIX_WORKERS` if set.
    pub fn from_env() -> Self {
        let get = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let default = Self::default();
        Self {
            trials: get("ISOLATION_MATRIX_TRIALS", default.trials),
            workers: get("ISOLATION_MATRIX_WORKERS", default.workers),
            ..default
        }
    }
}

/// A database of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// PostgreSQL.
    Postgres,
    /// MariaDB or MySQL, InnoDB.
    MariaDb,
    /// SQLite in WAL mode.
    Sqlite,
}

impl Engine {
    /// Every backend, in table order.
    pub const ALL: [Engine; 3] = [Engine::Postgres, Engine::MariaDb, Engine::Sqlite];

    /// The levels the matrix runs on this backend.
    pub fn levels(self) -> &'static [Level] {
        match self {
            Engine::Postgres => &[
                Level::ReadCommitted,
                Level::RepeatableRead,
                Level::Serializable,
            ],
            Engine::MariaDb => &[Level::ReadCommitted, Level::RepeatableRead],
            Engine::Sqlite => &[Level::SqliteSerializable],
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Engine::Postgres => "PostgreSQL",
            Engine::MariaDb => "MariaDB/InnoDB",
            Engine::Sqlite => "SQLite (WAL)",
        })
    }
}

/// An isolation level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// READ COMMITTED.
    ReadCommitted,
    /// REPEATABLE READ (snapshot isolation on PostgreSQL; consistent reads plus next-key locks on
    /// InnoDB).
    RepeatableRead,
    /// SERIALIZABLE (SSI on PostgreSQL).
    Serializable,
    /// SQLite's only level: serializable, one writer at a time.
    SqliteSerializable,
}

impl Level {
    fn sql(self) -> &'static str {
        match self {
            Level::ReadCommitted => "READ COMMITTED",
            Level::RepeatableRead => "REPEATABLE READ",
            Level::Serializable | Level::SqliteSerializable => "SERIALIZABLE",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::SqliteSerializable => "(serializable)",
            other => other.sql(),
        })
    }
}

/// How the work is guarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approach {
    /// (a) check-then-insert, no unique constraint.
    CheckThenInsert,
    /// (b) `SELECT … FOR UPDATE` (SQLite: deferred transaction) then insert.
    ForUpdate,
    /// (c) this crate: reserve-first under the primary key, then the work.
    ReserveFirst,
}

impl Approach {
    /// Every approach, in table order.
    pub const ALL: [Approach; 3] = [
        Approach::CheckThenInsert,
        Approach::ForUpdate,
        Approach::ReserveFirst,
    ];

    fn label(self, backend: Engine) -> &'static str {
        match (self, backend) {
            (Approach::CheckThenInsert, Engine::Sqlite) => "(a) pre-check, then insert",
            (Approach::CheckThenInsert, _) => "(a) check-then-insert",
            (Approach::ForUpdate, Engine::Sqlite) => "(b) deferred tx read+write",
            (Approach::ForUpdate, _) => "(b) SELECT FOR UPDATE",
            (Approach::ReserveFirst, _) => "(c) reserve-first",
        }
    }
}

/// What one cell measured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Trials (fresh keys) raced.
    pub trials: usize,
    /// Trials in which more than one worker ran the work (rolled back or not).
    pub ran_twice: usize,
    /// Trials in which more than one worker's work was committed.
    pub committed_twice: usize,
    /// Trials in which no worker's work was committed.
    pub never_committed: usize,
    /// Workers that failed with a deadlock (PostgreSQL 40P01, InnoDB 1213), or were refused by
    /// SQLite's deadlock avoidance (`SQLITE_BUSY` without waiting).
    pub deadlocks: usize,
    /// Workers that failed with a serialization failure (PostgreSQL 40001, SQLite
    /// `SQLITE_BUSY_SNAPSHOT`).
    pub serialization_failures: usize,
    /// Workers that failed otherwise.
    pub other_errors: usize,
    /// The first "other" error seen, for the reader.
    pub first_other_error: Option<String>,
    /// Trials with exactly one run, one commit and no error at all.
    pub clean: usize,
    /// Most workers that ran the work for one key.
    pub max_runs: usize,
}

impl Counts {
    /// Whether the cell shows any misbehaviour.
    pub fn failed_somewhere(&self) -> bool {
        self.clean < self.trials
    }
}

/// One row of the matrix.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The database.
    pub backend: Engine,
    /// The level every connection of the cell ran at.
    pub level: Level,
    /// The level as the server reported it inside a transaction.
    pub level_shown: String,
    /// The guard.
    pub approach: Approach,
    /// The measurements.
    pub counts: Counts,
    /// Wall time of the cell.
    pub elapsed: Duration,
}

/// A backend's rows and its version.
#[derive(Debug, Clone)]
pub struct EngineReport {
    /// The database.
    pub backend: Engine,
    /// `SELECT version()` (SQLite: `sqlite_version()`).
    pub version: String,
    /// Its cells, level by level, approach by approach.
    pub cells: Vec<Cell>,
}

impl EngineReport {
    /// The cell of `level` and `approach`.
    pub fn cell(&self, level: Level, approach: Approach) -> &Cell {
        self.cells
            .iter()
            .find(|c| c.level == level && c.approach == approach)
            .expect("cell was measured")
    }
}

/// Why a worker failed.
#[derive(Debug)]
pub enum Failure {
    /// Deadlock detected by the database.
    Deadlock,
    /// Serialization failure.
    Serialization,
    /// Anything else.
    Other(String),
}

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        classify(&error)
    }
}

/// Sorts a database error into the matrix's columns.
pub fn classify(error: &sqlx::Error) -> Failure {
    if let sqlx::Error::Database(db) = error {
        if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            // InnoDB reports 1213 with SQLSTATE 40001: it is a deadlock, not SSI.
            return match mysql.number() {
                1213 => Failure::Deadlock,
                _ => Failure::Other(error.to_string()),
            };
        }
        match db.code().as_deref() {
            Some("40001") => return Failure::Serialization,
            Some("40P01") => return Failure::Deadlock,
            // SQLITE_BUSY_SNAPSHOT: the read snapshot is stale, the write cannot be serialized.
            Some("517") => return Failure::Serialization,
            // SQLITE_BUSY: in this matrix only ever returned at once (SQLite does not call the
            // busy handler when a transaction that already reads asks for the write lock another
            // connection holds, as waiting could deadlock): its deadlock avoidance.
            Some("5") => return Failure::Deadlock,
            _ => {}
        }
    }
    Failure::Other(error.to_string())
}

fn classify_protocol(error: Error<sqlx::Error>) -> Option<Failure> {
    match error {
        // The answers a duplicate is supposed to get.
        Error::InProgress { .. } => None,
        Error::Operation(e) | Error::Store(StoreError::Database(e)) => Some(classify(&e)),
        other => Some(Failure::Other(other.to_string())),
    }
}

/// One fresh key raced by all workers.
pub struct Trial {
    /// The key.
    pub key: String,
    /// Releases the workers together.
    pub barrier: Barrier,
    runs: AtomicUsize,
}

impl Trial {
    /// The work begins: its effect outside the database happens now, whatever becomes of the
    /// transaction.
    pub fn enter_work(&self) {
        self.runs.fetch_add(1, Ordering::SeqCst);
    }
}

/// Races `config.trials` fresh keys with `worker`, counting runs, commits (`committed(key)`) and
/// errors.
async fn race_cell<W, C, CF>(config: Config, prefix: &str, worker: W, committed: C) -> Counts
where
    W: Fn(Arc<Trial>) -> BoxFuture<'static, Result<(), Failure>>,
    C: Fn(String) -> CF,
    CF: Future<Output = i64>,
{
    let mut counts = Counts::default();
    for n in 0..config.trials {
        let trial = Arc::new(Trial {
            key: format!("{prefix}-{n}-{}", uuid::Uuid::new_v4().simple()),
            barrier: Barrier::new(config.workers),
            runs: AtomicUsize::new(0),
        });
        let handles: Vec<_> = (0..config.workers)
            .map(|_| tokio::spawn(worker(trial.clone())))
            .collect();
        let mut errors = 0;
        for handle in handles {
            let Err(failure) = handle.await.expect("worker panicked") else {
                continue;
            };
            errors += 1;
            match failure {
                Failure::Deadlock => counts.deadlocks += 1,
                Failure::Serialization => counts.serialization_failures += 1,
                Failure::Other(message) => {
                    counts.other_errors += 1;
                    counts.first_other_error.get_or_insert(message);
                }
            }
        }
        let runs = trial.runs.load(Ordering::SeqCst);
        let commits = committed(trial.key.clone()).await;
        counts.trials += 1;
        counts.max_runs = counts.max_runs.max(runs);
        counts.ran_twice += usize::from(runs > 1);
        counts.committed_twice += usize::from(commits > 1);
        counts.never_committed += usize::from(commits == 0);
        counts.clean += usize::from(runs == 1 && commits == 1 && errors == 0);
    }
    counts
}

/// Writes the business row of a trial inside the business transaction.
type EffectFn<DB> = for<'t> fn(
    &'t mut sqlx::Transaction<'_, DB>,
    &'t str,
) -> BoxFuture<'t, Result<(), sqlx::Error>>;

/// The work of (c): enter, wait, write the business row in the business transaction.
fn reserve_first<S: Store>(
    idem: Idempotency<S>,
    trial: Arc<Trial>,
    work: Duration,
    insert: EffectFn<S::Database>,
) -> BoxFuture<'static, Result<(), Failure>> {
    Box::pin(async move {
        let attempt = Attempt::new(
            IdempotencyKey::new("matrix", "purchase", &trial.key).expect("valid key"),
            Fingerprint::of_bytes(trial.key.as_bytes()),
        );
        trial.barrier.wait().await;
        let t = trial.clone();
        let outcome = idem
            .run(&attempt, async move |tx| {
                t.enter_work();
                tokio::time::sleep(work).await;
                insert(tx, &t.key).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await;
        match outcome {
            Ok(_) => Ok(()),
            Err(e) => classify_protocol(e).map_or(Ok(()), Err),
        }
    })
}

// --- PostgreSQL --------------------------------------------------------------------------------

/// A pool whose every connection runs its transactions at `level`.
async fn pg_pool(url: &str, level: Level, size: u32) -> sqlx::PgPool {
    let set: &'static str = match level {
        Level::ReadCommitted => {
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
        }
        Level::RepeatableRead => {
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ"
        }
        _ => "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
    };
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .after_connect(move |conn, _| Box::pin(async move { conn.execute(set).await.map(drop) }))
        .connect(url)
        .await
        .expect("connect to postgres")
}

async fn pg_worker(
    pool: sqlx::PgPool,
    trial: Arc<Trial>,
    lock: bool,
    config: Config,
) -> Result<(), Failure> {
    let tx = pool.begin().await;
    trial.barrier.wait().await;
    let mut tx = tx?;
    let check = if lock {
        "SELECT k FROM naive_keys WHERE k = $1 FOR UPDATE"
    } else {
        "SELECT k FROM naive_keys WHERE k = $1"
    };
    let found: Option<String> = sqlx::query_scalar(check)
        .bind(&trial.key)
        .fetch_optional(&mut *tx)
        .await?;
    if found.is_some() {
        return Ok(()); // "already done": the duplicate is answered without running the work
    }
    tokio::time::sleep(config.window).await;
    sqlx::query("INSERT INTO naive_keys (k) VALUES ($1)")
        .bind(&trial.key)
        .execute(&mut *tx)
        .await?;
    trial.enter_work();
    tokio::time::sleep(config.work).await;
    sqlx::query("INSERT INTO matrix_effects (k) VALUES ($1)")
        .bind(&trial.key)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

fn pg_effect<'t>(
    tx: &'t mut sqlx::Transaction<'_, sqlx::Postgres>,
    key: &'t str,
) -> BoxFuture<'t, Result<(), sqlx::Error>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO matrix_effects (k) VALUES ($1)")
            .bind(key)
            .execute(&mut **tx)
            .await
            .map(drop)
    })
}

async fn postgres(config: Config) -> Option<EngineReport> {
    let mut report = None::<EngineReport>;
    for &level in Engine::Postgres.levels() {
        let url = test_support::fresh_postgres_url().await?;
        let pool = pg_pool(&url, level, config.workers as u32 + 4).await;
        for ddl in [
            "CREATE TABLE naive_keys (id BIGSERIAL PRIMARY KEY, k TEXT NOT NULL)",
            "CREATE INDEX naive_keys_k ON naive_keys (k)",
            "CREATE TABLE matrix_effects (id BIGSERIAL PRIMARY KEY, k TEXT NOT NULL)",
            "CREATE INDEX matrix_effects_k ON matrix_effects (k)",
        ] {
            sqlx::query(ddl)
                .execute(&pool)
                .await
                .expect("matrix tables");
        }
        let store = PgStore::new(pool.clone());
        store.migrate().await.expect("migrate");
        let report = report.get_or_insert_with(|| EngineReport {
            backend: Engine::Postgres,
            version: String::new(),
            cells: Vec::new(),
        });
        if report.version.is_empty() {
            report.version = sqlx::query_scalar("SELECT version()")
                .fetch_one(&pool)
                .await
                .expect("version");
        }
        let mut tx = pool.begin().await.expect("begin");
        let level_shown: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&mut *tx)
            .await
            .expect("level");
        tx.rollback().await.expect("rollback");
        let committed = |key: String| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM matrix_effects WHERE k = $1")
                    .bind(key)
                    .fetch_one(&pool)
                    .await
                    .expect("count")
            }
        };
        for approach in Approach::ALL {
            let started = Instant::now();
            let counts = match approach {
                Approach::ReserveFirst => {
                    let idem = Idempotency::new(store.clone());
                    race_cell(
                        config,
                        "c",
                        |trial| reserve_first(idem.clone(), trial, config.work, pg_effect),
                        committed,
                    )
                    .await
                }
                naive => {
                    let lock = naive == Approach::ForUpdate;
                    race_cell(
                        config,
                        if lock { "b" } else { "a" },
                        |trial| Box::pin(pg_worker(pool.clone(), trial, lock, config)),
                        committed,
                    )
                    .await
                }
            };
            report.cells.push(Cell {
                backend: Engine::Postgres,
                level,
                level_shown: level_shown.clone(),
                approach,
                counts,
                elapsed: started.elapsed(),
            });
        }
        pool.close().await;
    }
    report
}

// --- MariaDB / MySQL ---------------------------------------------------------------------------

async fn mysql_pool(url: &str, level: Level, size: u32) -> sqlx::MySqlPool {
    let set: &'static str = match level {
        Level::ReadCommitted => "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
        Level::RepeatableRead => "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        _ => "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
    };
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(size)
        .after_connect(move |conn, _| Box::pin(async move { conn.execute(set).await.map(drop) }))
        .connect(url)
        .await
        .expect("connect to mysql")
}

async fn mysql_worker(
    pool: sqlx::MySqlPool,
    trial: Arc<Trial>,
    lock: bool,
    config: Config,
) -> Result<(), Failure> {
    let tx = pool.begin().await;
    trial.barrier.wait().await;
    let mut tx = tx?;
    let check = if lock {
        "SELECT id FROM naive_keys WHERE k = ? FOR UPDATE"
    } else {
        "SELECT id FROM naive_keys WHERE k = ?"
    };
    let found: Option<i64> = sqlx::query_scalar(check)
        .bind(&trial.key)
        .fetch_optional(&mut *tx)
        .await?;
    if found.is_some() {
        return Ok(());
    }
    tokio::time::sleep(config.window).await;
    sqlx::query("INSERT INTO naive_keys (k) VALUES (?)")
        .bind(&trial.key)
        .execute(&mut *tx)
        .await?;
    trial.enter_work();
    tokio::time::sleep(config.work).await;
    sqlx::query("INSERT INTO matrix_effects (k) VALUES (?)")
        .bind(&trial.key)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

fn mysql_effect<'t>(
    tx: &'t mut sqlx::Transaction<'_, sqlx::MySql>,
    key: &'t str,
) -> BoxFuture<'t, Result<(), sqlx::Error>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO matrix_effects (k) VALUES (?)")
            .bind(key)
            .execute(&mut **tx)
            .await
            .map(drop)
    })
}

async fn mariadb(config: Config) -> Option<EngineReport> {
    let mut report = None::<EngineReport>;
    for &level in Engine::MariaDb.levels() {
        let url = test_support::fresh_mysql_url().await?;
        let pool = mysql_pool(&url, level, config.workers as u32 + 4).await;
        for ddl in [
            "CREATE TABLE naive_keys (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                k VARCHAR(255) NOT NULL, KEY naive_keys_k (k)) ENGINE = InnoDB",
            "CREATE TABLE matrix_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                k VARCHAR(255) NOT NULL, KEY matrix_effects_k (k)) ENGINE = InnoDB",
        ] {
            sqlx::query(ddl)
                .execute(&pool)
                .await
                .expect("matrix tables");
        }
        let store = MySqlStore::new(pool.clone());
        store.migrate().await.expect("migrate");
        let report = report.get_or_insert_with(|| EngineReport {
            backend: Engine::MariaDb,
            version: String::new(),
            cells: Vec::new(),
        });
        if report.version.is_empty() {
            report.version = sqlx::query_scalar("SELECT version()")
                .fetch_one(&pool)
                .await
                .expect("version");
        }
        let mut conn = pool.acquire().await.expect("connection");
        // MariaDB < 11.1 knows only tx_isolation, MySQL 8 only transaction_isolation.
        let level_shown: String = match sqlx::query_scalar("SELECT @@SESSION.transaction_isolation")
            .fetch_one(&mut *conn)
            .await
        {
            Ok(level) => level,
            Err(_) => sqlx::query_scalar("SELECT @@SESSION.tx_isolation")
                .fetch_one(&mut *conn)
                .await
                .expect("level"),
        };
        drop(conn);
        let committed = |key: String| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM matrix_effects WHERE k = ?")
                    .bind(key)
                    .fetch_one(&pool)
                    .await
                    .expect("count")
            }
        };
        for approach in Approach::ALL {
            let started = Instant::now();
            let counts = match approach {
                Approach::ReserveFirst => {
                    let idem = Idempotency::new(store.clone());
                    race_cell(
                        config,
                        "c",
                        |trial| reserve_first(idem.clone(), trial, config.work, mysql_effect),
                        committed,
                    )
                    .await
                }
                naive => {
                    let lock = naive == Approach::ForUpdate;
                    race_cell(
                        config,
                        if lock { "b" } else { "a" },
                        |trial| Box::pin(mysql_worker(pool.clone(), trial, lock, config)),
                        committed,
                    )
                    .await
                }
            };
            report.cells.push(Cell {
                backend: Engine::MariaDb,
                level,
                level_shown: level_shown.clone(),
                approach,
                counts,
                elapsed: started.elapsed(),
            });
        }
        pool.close().await;
    }
    report
}

// --- SQLite ------------------------------------------------------------------------------------

async fn sqlite_worker(
    pool: sqlx::SqlitePool,
    trial: Arc<Trial>,
    deferred: bool,
    config: Config,
) -> Result<(), Failure> {
    let conn = pool.acquire().await;
    trial.barrier.wait().await;
    let mut conn = conn?;
    let check = "SELECT k FROM naive_keys WHERE k = ?1";
    if deferred {
        // (b) BEGIN DEFERRED: the read takes a snapshot, the write lock comes with the INSERT.
        let mut tx = conn.begin().await?;
        let found: Option<String> = sqlx::query_scalar(check)
            .bind(&trial.key)
            .fetch_optional(&mut *tx)
            .await?;
        if found.is_some() {
            return Ok(());
        }
        tokio::time::sleep(config.window).await;
        sqlx::query("INSERT INTO naive_keys (k) VALUES (?1)")
            .bind(&trial.key)
            .execute(&mut *tx)
            .await?;
        trial.enter_work();
        tokio::time::sleep(config.work).await;
        sqlx::query("INSERT INTO matrix_effects (k) VALUES (?1)")
            .bind(&trial.key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    } else {
        // (a) the application's pre-check, then the write transaction SqliteStore would use.
        let found: Option<String> = sqlx::query_scalar(check)
            .bind(&trial.key)
            .fetch_optional(&mut *conn)
            .await?;
        if found.is_some() {
            return Ok(());
        }
        tokio::time::sleep(config.window).await;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query("INSERT INTO naive_keys (k) VALUES (?1)")
            .bind(&trial.key)
            .execute(&mut *tx)
            .await?;
        trial.enter_work();
        tokio::time::sleep(config.work).await;
        sqlx::query("INSERT INTO matrix_effects (k) VALUES (?1)")
            .bind(&trial.key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

fn sqlite_effect<'t>(
    tx: &'t mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: &'t str,
) -> BoxFuture<'t, Result<(), sqlx::Error>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO matrix_effects (k) VALUES (?1)")
            .bind(key)
            .execute(&mut **tx)
            .await
            .map(drop)
    })
}

async fn sqlite(config: Config) -> Option<EngineReport> {
    let level = Level::SqliteSerializable;
    let file = test_support::fresh_sqlite();
    let store = SqliteStore::connect(&file.url).await.expect("open sqlite");
    store.migrate().await.expect("migrate");
    let pool = store.pool().clone();
    for ddl in [
        "CREATE TABLE naive_keys (id INTEGER PRIMARY KEY, k TEXT NOT NULL)",
        "CREATE INDEX naive_keys_k ON naive_keys (k)",
        "CREATE TABLE matrix_effects (id INTEGER PRIMARY KEY, k TEXT NOT NULL)",
        "CREATE INDEX matrix_effects_k ON matrix_effects (k)",
    ] {
        sqlx::query(ddl)
            .execute(&pool)
            .await
            .expect("matrix tables");
    }
    let version: String = sqlx::query_scalar("SELECT sqlite_version()")
        .fetch_one(&pool)
        .await
        .expect("version");
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&pool)
        .await
        .expect("journal mode");
    let committed = |key: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM matrix_effects WHERE k = ?1")
                .bind(key)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let mut cells = Vec::new();
    for approach in Approach::ALL {
        let started = Instant::now();
        let counts = match approach {
            Approach::ReserveFirst => {
                let idem = Idempotency::new(store.clone());
                race_cell(
                    config,
                    "c",
                    |trial| reserve_first(idem.clone(), trial, config.work, sqlite_effect),
                    committed,
                )
                .await
            }
            naive => {
                let deferred = naive == Approach::ForUpdate;
                race_cell(
                    config,
                    if deferred { "b" } else { "a" },
                    |trial| Box::pin(sqlite_worker(pool.clone(), trial, deferred, config)),
                    committed,
                )
                .await
            }
        };
        cells.push(Cell {
            backend: Engine::Sqlite,
            level,
            level_shown: format!("serializable, journal_mode={journal}"),
            approach,
            counts,
            elapsed: started.elapsed(),
        });
    }
    pool.close().await;
    drop(file);
    Some(EngineReport {
        backend: Engine::Sqlite,
        version,
        cells,
    })
}

/// Runs every cell of `backend`; `None` when its server is not configured (never under CI).
pub async fn run_backend(backend: Engine, config: Config) -> Option<EngineReport> {
    match backend {
        Engine::Postgres => postgres(config).await,
        Engine::MariaDb => mariadb(config).await,
        Engine::Sqlite => sqlite(config).await,
    }
}

/// The table, as Markdown.
pub fn render(config: &Config, reports: &[EngineReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} trials x {} workers per cell (race window {:?} between check and insert, work {:?})\n",
        config.trials, config.workers, config.window, config.work
    );
    for report in reports {
        let _ = writeln!(out, "* {}: {}", report.backend, report.version);
    }
    let _ = writeln!(
        out,
        "\n| database | level | approach | ran twice+ | committed twice+ | deadlocks | serialization failures | other errors | clean single executions | max runs/key | time |"
    );
    let _ = writeln!(out, "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|");
    for report in reports {
        for cell in &report.cells {
            let c = &cell.counts;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {:.1} s |",
                cell.backend,
                cell.level,
                cell.approach.label(cell.backend),
                c.ran_twice,
                c.committed_twice,
                c.deadlocks,
                c.serialization_failures,
                c.other_errors,
                c.clean,
                c.trials,
                c.max_runs,
                cell.elapsed.as_secs_f64(),
            );
        }
    }
    let others: Vec<_> = reports
        .iter()
        .flat_map(|r| &r.cells)
        .filter_map(|cell| {
            cell.counts.first_other_error.as_ref().map(|e| {
                format!(
                    "* {} {} {}: {e}",
                    cell.backend,
                    cell.level,
                    cell.approach.label(cell.backend)
                )
            })
        })
        .collect();
    if !others.is_empty() {
        let _ = writeln!(out, "\nFirst \"other\" error per cell:\n");
        for line in others {
            let _ = writeln!(out, "{line}");
        }
    }
    let shown: Vec<_> = reports
        .iter()
        .flat_map(|r| &r.cells)
        .filter(|c| c.approach == Approach::CheckThenInsert)
        .map(|c| format!("{} {} = {}", c.backend, c.level, c.level_shown))
        .collect();
    let _ = writeln!(
        out,
        "\nLevel in effect, as the server reported it (PostgreSQL: SHOW transaction_isolation in a transaction; MariaDB: the session variable): {}",
        shown.join("; ")
    );
    out
}
