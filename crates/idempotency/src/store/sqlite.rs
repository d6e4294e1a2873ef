//! SQLite store (feature `sqlite`), the embedded default.

use super::history::{self, EventKind, KeyEvent, NewEvent, OperatorNote};
use super::migration::{self, Bookkeeping, Migration};
use super::row::{uuid, KeyRow};
use super::{millis, Insertion, KeyRecord, LeaseToken, PendingRow, Store};
use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use chrono::{DateTime, Utc};
use sqlx::{
    sqlite::{
        SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow,
        SqliteSynchronous, SqliteTransactionManager,
    },
    Row, Sqlite, SqlitePool, Transaction, TransactionManager,
};
use std::{str::FromStr, sync::Arc, time::Duration};

/// The key table's migrations, applied in order by [`Store::migrate`].
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idempotency_keys",
        sql: include_str!("../../migrations/sqlite/0001_idempotency_keys.sql"),
    },
    Migration {
        version: 2,
        description: "durable steps: recovery point, request, progress",
        sql: include_str!("../../migrations/sqlite/0002_durable_steps.sql"),
    },
    Migration {
        version: 3,
        description: "key history: idempotency_key_events",
        sql: include_str!("../../migrations/sqlite/0003_key_events.sql"),
    },
    Migration {
        version: 4,
        description: "index the expiry of settled keys only",
        sql: include_str!("../../migrations/sqlite/0004_settled_expiry_index.sql"),
    },
];

/// SQLite's clock in milliseconds since the Unix epoch.
macro_rules! now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

/// Where applied migrations are recorded.
const BOOKKEEPING: Bookkeeping = Bookkeeping {
    create_table: "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
        version INTEGER PRIMARY KEY,
        description TEXT NOT NULL,
        applied_at INTEGER NOT NULL)",
    find_version: "SELECT version FROM idempotency_schema_migrations WHERE version = ?1",
    record_version: concat!(
        "INSERT INTO idempotency_schema_migrations (version, description, applied_at) VALUES (?1, ?2, ",
        now_ms!(),
        ")"
    ),
    already_applied: migration::never_applied,
    recorded_meanwhile: migration::never_applied,
    rolled_back: migration::never_applied,
};

macro_rules! columns {
    () => {
        concat!(
            "scope, operation, idem_key, state, effects, fingerprint, lease_token, \
             MAX(0, lease_until - ",
            now_ms!(),
            ") AS lease_remaining_ms, \
             (expires_at <= ",
            now_ms!(),
            ") AS expired, result, reason, recovery_attempts, \
             created_at, updated_at, lease_until, expires_at, recovery_point, request, progress"
        )
    };
}

const FIND: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3"
);

/// Keys in a SQLite file, sharing the application's pool.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{SqliteStore, Store};
/// let store = SqliteStore::connect("sqlite://shop.db").await?; // created if missing
/// store.migrate().await?;
/// sqlx::query("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY)").execute(store.pool()).await?;
/// # Ok(()) }
/// ```
///
/// SQLite store (feature `sqlite`), the embedded default.
///
/// SQLite has one writer at a time. Left to itself, a second writer polls the lock on SQLite's
/// busy-handler schedule (sleeps of 1, 2, 5 … 100 ms), so a request can stall for hundreds of
/// milliseconds behind a short transaction. The store therefore queues its writers in process:
/// every write (a reservation, a completion, a release, a business transaction from
/// [`Store::begin`]) runs on a pool of **one writer connection**, whose waiters are served in
/// order the moment the connection returns, without sleeping. Reads (replays, duplicates, the
/// operator's listings) use the application's pool and never wait for the writer in WAL mode.
/// Business transactions still begin with `BEGIN IMMEDIATE`, so another process writing the same
/// file (the `idem` CLI) makes them wait on the busy timeout rather than fail on a lock upgrade.
///
/// A reservation first reads the row (replays and duplicates are then cheap reads), and only for
/// an absent key INSERTs under the primary key, which decides alone who holds the key.
///
/// Durability: [`SqliteStore::connect`] opens the file in WAL mode with `synchronous = FULL`, so
/// every commit (a completion, a recovery point, a release) syncs the log before it returns and
/// survives a power loss. A reservation that need not be flushed on its own
/// ([`PendingRow::must_flush_reservation`]: local work, journaled durable operations) commits
/// with `synchronous = NORMAL` on the writer connection, which is then set back: the next synced
/// commit in the same write-ahead log syncs it too, as PostgreSQL's `synchronous_commit = off`
/// does for the same reservations. Heartbeats commit at `NORMAL` too (a power cut ends their
/// holder as well). A pool opened at `NORMAL` or `OFF` (the application's choice,
/// through [`SqliteStore::new`]) is left as it is: its commits survive a crash of the process but
/// not of the machine's power.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: SqlitePool,
    /// Who this store is in the keys' histories ([`with_worker_name`](Self::with_worker_name)).
    actor: Arc<str>,
}

impl SqliteStore {
    /// A store on an existing pool. Open it in WAL mode with a busy timeout (as
    /// [`connect`](Self::connect) does) for concurrent use. Writes go to a second pool of one
    /// connection with the same options (see [`writer`](Self::writer)), opened on first use.
    /// Call it inside a Tokio runtime.
    pub fn new(pool: SqlitePool) -> Self {
        let options = (*pool.connect_options()).clone();
        let writer = Self::pool_options()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(options);
        Self {
            pool,
            writer,
            actor: history::default_actor(),
        }
    }

    /// Names this process in the keys' histories (the actor of the events it writes: reserved,
    /// steps, calls, claims, completions); default `host:pid`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// let store = idempotency::SqliteStore::connect("sqlite://shop.db").await?.with_worker_name("web-1");
    /// # Ok(()) }
    /// ```
    pub fn with_worker_name(mut self, name: &str) -> Self {
        self.actor = history::worker_actor(name);
        self
    }

    /// Opens (creating if missing) a database file in WAL mode with `synchronous = FULL` and a
    /// 30 s busy timeout.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(30));
        let pool = Self::pool_options()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(Self::new(pool))
    }

    /// Pool options that never hand out a connection whose transaction state is broken: SQLite
    /// rolls a transaction back by itself on some errors (`SQLITE_FULL` on a full disk, I/O
    /// errors), sqlx's later `ROLLBACK` then fails, and sqlx goes on believing the connection is
    /// inside a transaction (its next `begin` opens a mere savepoint). Such a connection is
    /// closed when it is released instead of being reused. [`connect`](Self::connect) and the
    /// store's writer use these options; use them for your own SQLite pools too.
    ///
    /// ```
    /// # async fn demo() -> Result<(), sqlx::Error> {
    /// let pool = idempotency::SqliteStore::pool_options()
    ///     .max_connections(4)
    ///     .connect("sqlite::memory:")
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn pool_options() -> SqlitePoolOptions {
        SqlitePoolOptions::new().after_release(|conn, _| {
            Box::pin(async move {
                if SqliteTransactionManager::get_transaction_depth(conn) == 0 {
                    return Ok(true);
                }
                // A dropped transaction's ROLLBACK may still be queued: let it run, then look.
                sqlx::Connection::ping(&mut *conn).await?;
                Ok(SqliteTransactionManager::get_transaction_depth(conn) == 0)
            })
        })
    }

    /// The pool, for the application's own reads.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The single writer connection's pool. Begin the application's own write transactions
    /// here (or with [`Store::begin`]) so that they queue with the store's writes instead of
    /// polling SQLite's lock.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// use idempotency::SqliteStore;
    /// let store = SqliteStore::connect("sqlite://shop.db").await?;
    /// let mut tx = store.writer().begin_with("BEGIN IMMEDIATE").await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS notes (body TEXT)").execute(&mut *tx).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub fn writer(&self) -> &SqlitePool {
        &self.writer
    }
}

fn time(row: &SqliteRow, column: &str) -> Result<DateTime<Utc>, StoreError> {
    let ms: i64 = row.try_get(column)?;
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| StoreError::Corrupt(format!("{column} {ms} is out of range")))
}

fn record(row: &SqliteRow) -> Result<KeyRecord, StoreError> {
    KeyRow {
        scope: row.try_get("scope")?,
        operation: row.try_get("operation")?,
        idem_key: row.try_get("idem_key")?,
        state: row.try_get("state")?,
        effects: row.try_get("effects")?,
        fingerprint: row.try_get("fingerprint")?,
        lease_token: uuid(&row.try_get::<Vec<u8>, _>("lease_token")?)?,
        lease_remaining_ms: row.try_get("lease_remaining_ms")?,
        expired: row.try_get("expired")?,
        result: row.try_get("result")?,
        reason: row.try_get("reason")?,
        recovery_attempts: row.try_get("recovery_attempts")?,
        created_at: time(row, "created_at")?,
        updated_at: time(row, "updated_at")?,
        lease_until: time(row, "lease_until")?,
        expires_at: time(row, "expires_at")?,
        recovery_point: row.try_get("recovery_point")?,
        request: row.try_get("request")?,
        progress: row.try_get("progress")?,
    }
    .into_record()
}

/// An autocommit statement for the writer connection, its arguments owned (it runs in a task).
type WriterStatement = sqlx::query::Query<'static, Sqlite, SqliteArguments<'static>>;

/// Runs `statement` (autocommit) on a connection of `writer`, in a task that always runs to the
/// end; returns the rows it changed.
///
/// `relaxed`: where the connection syncs every commit (`FULL`, `EXTRA`), this one commit runs at
/// `synchronous = NORMAL`, and the connection's level is put back before it is released (a
/// connection whose level cannot be put back is closed, not pooled). For writes whose loss in a
/// power cut harms nothing: a reservation that need not be flushed on its own
/// ([`PendingRow::must_flush_reservation`]: the next synced commit in the same write-ahead log
/// syncs it too, in order), and a heartbeat (a power cut ends its holder with the machine).
async fn execute_on_writer(
    writer: &SqlitePool,
    statement: WriterStatement,
    relaxed: bool,
) -> Result<u64, StoreError> {
    let writer = writer.clone();
    super::uncancellable(async move {
        let mut conn = writer.acquire().await?;
        let restore = if relaxed {
            let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(&mut *conn)
                .await?;
            match level {
                2 => Some("PRAGMA synchronous = FULL"),
                3 => Some("PRAGMA synchronous = EXTRA"),
                _ => None,
            }
        } else {
            None
        };
        if restore.is_some() {
            sqlx::query("PRAGMA synchronous = NORMAL")
                .execute(&mut *conn)
                .await?;
        }
        let done = statement.execute(&mut *conn).await;
        if let Some(restore) = restore {
            if let Err(error) = sqlx::query(restore).execute(&mut *conn).await {
                conn.close_on_drop();
                return Err(StoreError::Database(error));
            }
        }
        Ok(done?.rows_affected())
    })
    .await
}

impl Store for SqliteStore {
    type Database = Sqlite;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        migration::apply_pending::<Sqlite>(&mut tx, &BOOKKEEPING, MIGRATIONS).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert_pending(&self, row: &PendingRow<'_>) -> Result<Insertion, StoreError> {
        // Fast path for duplicates and replays: a read, which never waits for the writer.
        if let Some(existing) = self.find(row.key).await? {
            return Ok(Insertion::Conflict(existing));
        }
        let statement = sqlx::query(concat!(
            "INSERT INTO idempotency_keys
                (scope, operation, idem_key, state, effects, fingerprint, lease_token,
                 lease_until, created_at, updated_at, expires_at)
             VALUES (?1, ?2, ?3, 'pending', ?4, ?5, ?6, ",
            now_ms!(),
            " + ?7, ",
            now_ms!(),
            ", ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + ?8)
             ON CONFLICT (scope, operation, idem_key) DO NOTHING"
        ))
        .bind(row.key.scope().to_owned())
        .bind(row.key.operation().to_owned())
        .bind(row.key.key().to_owned())
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().to_vec())
        .bind(row.token.0.as_bytes().to_vec())
        .bind(row.lease_millis())
        .bind(row.retention_millis());
        let inserted = if row.records_history() {
            self.recorded(row.key, EventKind::Reserved, None, true, statement)
                .await?
                == 1
        } else {
            let relaxed = !row.must_flush_reservation();
            execute_on_writer(&self.writer, statement, relaxed).await? == 1
        };
        if inserted {
            return Ok(Insertion::Inserted);
        }
        super::read_conflict(self, row.key).await
    }

    async fn find(&self, key: &IdempotencyKey) -> Result<Option<KeyRecord>, StoreError> {
        sqlx::query(FIND)
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(record)
            .transpose()
    }

    async fn find_replay(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let result: Option<Option<Vec<u8>>> = sqlx::query_scalar(concat!(
            "SELECT result FROM idempotency_keys
              WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
                AND state = 'completed' AND fingerprint = ?4 AND expires_at > ",
            now_ms!()
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(fingerprint.as_bytes().as_slice())
        .fetch_optional(&self.pool)
        .await?;
        Ok(result.map(Option::unwrap_or_default))
    }

    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        let statement = sqlx::query(concat!(
            "UPDATE idempotency_keys SET
                state = 'pending', effects = ?4, fingerprint = ?5, lease_token = ?6,
                lease_until = ",
            now_ms!(),
            " + ?7,
                expires_at = ",
            now_ms!(),
            " + ?8,
                result = NULL, reason = NULL, recovery_attempts = 0,
                recovery_point = NULL, request = NULL, progress = NULL,
                created_at = CASE WHEN state = 'pending' THEN created_at ELSE ",
            now_ms!(),
            " END,
                updated_at = ",
            now_ms!(),
            "
             WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3 AND lease_token = ?9
               AND (state = 'failed'
                    OR (state = 'completed' AND expires_at <= ",
            now_ms!(),
            ")
                    OR (state = 'pending' AND effects = 'local' AND lease_until <= ",
            now_ms!(),
            "))"
        ))
        .bind(row.key.scope())
        .bind(row.key.operation())
        .bind(row.key.key())
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.token.0.as_bytes().as_slice())
        .bind(row.lease_millis())
        .bind(row.retention_millis())
        .bind(stale.0.as_bytes().as_slice());
        if row.records_history() {
            return Ok(self
                .recorded(row.key, EventKind::Reserved, None, true, statement)
                .await?
                == 1);
        }
        let done = statement.execute(&self.writer).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        let pool = self.writer.clone();
        super::uncancellable(async move {
            let mut conn = pool.acquire().await?;
            // A connection must never carry a transaction into the pool, but if one does (a
            // transaction leaked by a caller), `BEGIN IMMEDIATE` would fail with "non-zero
            // transaction depth": roll the orphan back.
            while <Sqlite as sqlx::Database>::TransactionManager::get_transaction_depth(&conn) > 0 {
                tracing::warn!(
                    "rolling back a transaction left open on a pooled SQLite connection"
                );
                <Sqlite as sqlx::Database>::TransactionManager::rollback(&mut conn).await?;
            }
            Ok(Transaction::begin(conn, Some("BEGIN IMMEDIATE".into())).await?)
        })
        .await
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE idempotency_keys SET
                state = 'completed', result = ?5, request = NULL, updated_at = ",
            now_ms!(),
            ",
                expires_at = ",
            now_ms!(),
            " + ?6
             WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0.as_bytes().as_slice())
        .bind(result)
        .bind(millis(retention))
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &IdempotencyKey, token: LeaseToken) -> Result<bool, StoreError> {
        let done = release_statement(key, token).execute(&self.writer).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let done = park_statement(key, token, reason)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let statement = release_statement(key, token);
        let done = self.recorded(key, EventKind::Released, None, true, statement);
        Ok(done.await? == 1)
    }

    async fn park_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let statement = park_statement(key, token, reason);
        let detail = Some(history::bounded(reason, history::DETAIL_MAX_BYTES));
        let done = self.recorded(key, EventKind::Parked, detail, true, statement);
        Ok(done.await? == 1)
    }

    async fn append_event(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        kind: EventKind,
        detail: Option<&str>,
    ) -> Result<(), StoreError> {
        let detail = detail.map(|d| history::bounded(d, history::DETAIL_MAX_BYTES));
        append(tx, key, kind, detail, &self.actor, true).await?;
        Ok(())
    }

    async fn extend_lease(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let statement = sqlx::query(concat!(
            "UPDATE idempotency_keys SET lease_until = ",
            now_ms!(),
            " + ?5 WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4"
        ))
        .bind(key.scope().to_owned())
        .bind(key.operation().to_owned())
        .bind(key.key().to_owned())
        .bind(token.0.as_bytes().to_vec())
        .bind(millis(lease));
        // A heartbeat need not survive a power cut: its holder does not either.
        Ok(execute_on_writer(&self.writer, statement, true).await? == 1)
    }

    async fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let statement = sqlx::query(concat!(
            "UPDATE idempotency_keys SET lease_token = ?5, lease_until = ",
            now_ms!(),
            " + ?6, updated_at = ",
            now_ms!(),
            " WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4 AND lease_until <= ",
            now_ms!()
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(stale.0.as_bytes().as_slice())
        .bind(fresh.0.as_bytes().as_slice())
        .bind(millis(lease));
        // Recorded where the key records a history (external, or a history already begun).
        let claimed = self.recorded(key, EventKind::Claimed, None, false, statement);
        Ok(claimed.await? == 1)
    }

    async fn count_failure(
        &self,
        counter: &PendingRow<'_>,
        result: &[u8],
        _limit: u32,
    ) -> Result<u32, StoreError> {
        self.upsert_failure(counter, result).await
    }

    async fn failure_count(
        &self,
        counter: &IdempotencyKey,
        _limit: u32,
    ) -> Result<u32, StoreError> {
        self.read_failure_count(counter).await
    }
}

impl super::Journal for SqliteStore {
    async fn note_unknown(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE idempotency_keys SET recovery_attempts = recovery_attempts + 1, lease_until = ",
            now_ms!(),
            " + ?5, updated_at = ",
            now_ms!(),
            " WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0.as_bytes().as_slice())
        .bind(millis(retry_after))
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn save_progress(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        token: LeaseToken,
        progress: &super::Progress<'_>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE idempotency_keys SET
                recovery_point = ?5, progress = ?6, request = COALESCE(request, ?7),
                updated_at = ",
            now_ms!(),
            " WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0.as_bytes().as_slice())
        .bind(progress.recovery_point)
        .bind(progress.journal)
        .bind(progress.request)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Waits by polling: SQLite has no notifications.
impl super::CompletionSignal for SqliteStore {}

// --- Maintenance: recovery, purge, listing, resolution, statistics ------------------------------

const EXPIRED_LEASES: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys WHERE state = 'pending' AND lease_until <= ",
    now_ms!(),
    " ORDER BY lease_until, scope, operation, idem_key LIMIT ?1"
);

const LIST: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys
      WHERE (?1 IS NULL OR state = ?1)
        AND (?2 IS NULL OR scope = ?2)
        AND (?3 IS NULL OR operation = ?3)
        AND (?4 IS NULL OR created_at <= ",
    now_ms!(),
    " - ?4)
        AND (?6 IS NULL OR (created_at, scope, operation, idem_key) > (?6, ?7, ?8, ?9))
      ORDER BY created_at, scope, operation, idem_key LIMIT ?5"
);

/// The purge condition, by SQLite's clock.
macro_rules! purgeable {
    () => {
        concat!(
            "state IN ('completed', 'failed') AND expires_at <= ",
            now_ms!()
        )
    };
}

impl SqliteStore {
    /// Runs a conditional update on the writer and, only if it changed the row, appends `event`
    /// to the key's history, both in one `BEGIN IMMEDIATE` transaction: the history never
    /// disagrees with the row.
    async fn logged_change<'q>(
        &self,
        key: &IdempotencyKey,
        event: &NewEvent<'_>,
        update: sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>,
    ) -> Result<bool, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        if update.execute(&mut *tx).await?.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        let actor = event.actor.unwrap_or(&self.actor);
        append(
            &mut tx,
            key,
            event.kind,
            event.detail.as_deref(),
            actor,
            true,
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Appends an event of `kind` (actor: this store) to the key's history, then runs `change`,
    /// in one `BEGIN IMMEDIATE` transaction that commits only if `change` changed a row: the
    /// history never disagrees with the row. `always`: record it whatever the key; otherwise
    /// only where the key is external or its history has begun. Returns the rows changed.
    async fn recorded<'q>(
        &self,
        key: &IdempotencyKey,
        kind: EventKind,
        detail: Option<&str>,
        always: bool,
        change: sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>,
    ) -> Result<u64, StoreError> {
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        append(&mut tx, key, kind, detail, &self.actor, always).await?;
        let changed = change.execute(&mut *tx).await?.rows_affected();
        if changed == 0 {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
        Ok(changed)
    }
}

/// Deletes the row of `key` where it is pending with `token`.
fn release_statement<'q>(
    key: &'q IdempotencyKey,
    token: LeaseToken,
) -> sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>> {
    sqlx::query(
        "DELETE FROM idempotency_keys
         WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
           AND state = 'pending' AND lease_token = ?4",
    )
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(token.0.as_bytes().to_vec())
}

/// Parks the row of `key` where it is pending with `token`.
fn park_statement<'q>(
    key: &'q IdempotencyKey,
    token: LeaseToken,
    reason: &'q str,
) -> sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>> {
    sqlx::query(concat!(
        "UPDATE idempotency_keys SET state = 'needs_review', reason = ?5, updated_at = ",
        now_ms!(),
        " WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
           AND state = 'pending' AND lease_token = ?4"
    ))
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(token.0.as_bytes().to_vec())
    .bind(reason)
}

/// Appends an event to the history of `key` inside `tx`, at SQLite's clock: `always`, or only
/// where the key is external or its history has begun.
async fn append(
    tx: &mut Transaction<'_, Sqlite>,
    key: &IdempotencyKey,
    kind: EventKind,
    detail: Option<&str>,
    actor: &str,
    always: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(concat!(
        "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
         SELECT ?1, ?2, ?3, ",
        now_ms!(),
        ", ?4, ?5, ?6
         WHERE ?7
            OR EXISTS (SELECT 1 FROM idempotency_keys
                        WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
                          AND effects = 'external')
            OR EXISTS (SELECT 1 FROM idempotency_key_events
                        WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3)"
    ))
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(kind.as_str())
    .bind(detail)
    .bind(actor)
    .bind(always)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl super::Maintenance for SqliteStore {
    async fn expired_leases(&self, limit: u32) -> Result<Vec<KeyRecord>, StoreError> {
        sqlx::query(EXPIRED_LEASES)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(record)
            .collect()
    }

    async fn complete_recovered(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        reason: &str,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let statement = sqlx::query(concat!(
            "UPDATE idempotency_keys SET state = 'completed', result = ?5, reason = ?6, updated_at = ",
            now_ms!(),
            ", expires_at = ",
            now_ms!(),
            " + ?7 WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'pending' AND lease_token = ?4"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0.as_bytes().as_slice())
        .bind(result)
        .bind(reason)
        .bind(millis(retention))
        ;
        let detail = Some(history::bounded(reason, history::DETAIL_MAX_BYTES));
        let done = self.recorded(key, EventKind::Completed, detail, false, statement);
        Ok(done.await? == 1)
    }

    async fn purge_batch(&self, batch: u32) -> Result<u64, StoreError> {
        // One short transaction (SQLite has one writer at a time): the batch bounds how long it
        // holds the write lock. The time is read once, so both statements choose the same rows:
        // the keys' histories go with them. The table is WITHOUT ROWID, so rows are named by
        // primary key.
        const CHOSEN: &str = "(scope, operation, idem_key) IN (
            SELECT scope, operation, idem_key FROM idempotency_keys
             WHERE state IN ('completed', 'failed') AND expires_at <= ?2
             ORDER BY expires_at, scope, operation, idem_key LIMIT ?1)";
        let mut tx = self.writer.begin_with("BEGIN IMMEDIATE").await?;
        let now: i64 = sqlx::query_scalar(concat!("SELECT ", now_ms!()))
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query(&format!(
            "DELETE FROM idempotency_key_events WHERE {CHOSEN}"
        ))
        .bind(i64::from(batch))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let deleted = sqlx::query(&format!("DELETE FROM idempotency_keys WHERE {CHOSEN}"))
            .bind(i64::from(batch))
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if deleted < u64::from(batch) {
            // The last batch of this purge: sweep the orphaned histories too.
            sqlx::query(concat!(
                "DELETE FROM idempotency_key_events WHERE id IN (",
                history::orphaned_events!("?2 - ?3", "?1"),
                ")"
            ))
            .bind(i64::from(batch))
            .bind(now)
            .bind(millis(history::ORPHAN_RETENTION))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(deleted)
    }

    async fn count_purgeable(&self) -> Result<u64, StoreError> {
        let count: i64 = sqlx::query_scalar(concat!(
            "SELECT count(*) FROM idempotency_keys WHERE ",
            purgeable!()
        ))
        .fetch_one(&self.pool)
        .await?;
        Ok(count.max(0) as u64)
    }

    async fn list(&self, filter: &super::KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        let after = filter.after.as_ref();
        sqlx::query(LIST)
            .bind(filter.state.map(|s| s.as_str()))
            .bind(filter.scope.as_deref())
            .bind(filter.operation.as_deref())
            .bind(filter.older_than.map(millis))
            .bind(i64::from(filter.limit))
            .bind(after.map(|c| c.created_at().timestamp_millis()))
            .bind(after.map(|c| c.key().scope()))
            .bind(after.map(|c| c.key().operation()))
            .bind(after.map(|c| c.key().key()))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(record)
            .collect()
    }

    async fn resolve(
        &self,
        key: &IdempotencyKey,
        resolution: &super::Resolution,
        note: &OperatorNote,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let result = match resolution {
            super::Resolution::Completed(bytes) => Some(bytes.as_slice()),
            super::Resolution::Failed => None,
        };
        let state = resolution.state().as_str();
        let update = sqlx::query(concat!(
            "UPDATE idempotency_keys SET state = ?4, result = ?5, reason = ?6, updated_at = ",
            now_ms!(),
            ", expires_at = ",
            now_ms!(),
            " + ?7 WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'needs_review' AND (?8 IS NULL OR updated_at = ?8)"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(state)
        .bind(result)
        .bind(note.reason.as_str())
        .bind(millis(retention))
        .bind(note.seen_millis());
        let event = NewEvent {
            kind: EventKind::Resolved,
            detail: Some(history::resolved_detail(state, note)),
            actor: Some(note.actor()),
        };
        self.logged_change(key, &event, update).await
    }

    async fn hand_back(
        &self,
        key: &IdempotencyKey,
        note: &OperatorNote,
    ) -> Result<bool, StoreError> {
        let update = sqlx::query(concat!(
            "UPDATE idempotency_keys SET state = 'pending', lease_until = ",
            now_ms!(),
            ", recovery_attempts = 0, reason = ?4, updated_at = ",
            now_ms!(),
            " WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
               AND state = 'needs_review' AND (?5 IS NULL OR updated_at = ?5)"
        ))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(note.reason.as_str())
        .bind(note.seen_millis());
        let event = NewEvent {
            kind: EventKind::HandedBack,
            detail: Some(history::handed_back_detail(note)),
            actor: Some(note.actor()),
        };
        self.logged_change(key, &event, update).await
    }

    async fn history(&self, key: &IdempotencyKey, limit: u32) -> Result<Vec<KeyEvent>, StoreError> {
        sqlx::query(
            "SELECT at, kind, detail, actor FROM (
                SELECT id, at, kind, detail, actor FROM idempotency_key_events
                 WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3
                 ORDER BY id DESC LIMIT ?4)
             ORDER BY id",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            history::event(
                time(row, "at")?,
                row.try_get("kind")?,
                row.try_get("detail")?,
                row.try_get("actor")?,
            )
        })
        .collect()
    }

    async fn stats(&self) -> Result<super::KeyStats, StoreError> {
        let rows = sqlx::query(
            "SELECT operation, state, count(*) AS n FROM idempotency_keys
             GROUP BY operation, state ORDER BY operation, state",
        )
        .fetch_all(&self.pool)
        .await?;
        let counts = rows
            .iter()
            .map(|row| {
                Ok(super::StateCount {
                    operation: row.try_get("operation")?,
                    state: row.try_get::<String, _>("state")?.parse()?,
                    count: row.try_get::<i64, _>("n")?.max(0) as u64,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let summary = sqlx::query(concat!(
            "SELECT
                (SELECT ",
            now_ms!(),
            " - min(created_at) FROM idempotency_keys WHERE state = 'pending') AS oldest_pending_ms,
                (SELECT count(*) FROM idempotency_keys
                  WHERE state = 'pending' AND lease_until <= ",
            now_ms!(),
            ") AS expired_leases,
                (SELECT count(*) FROM idempotency_keys WHERE ",
            purgeable!(),
            ") AS purgeable"
        ))
        .fetch_one(&self.pool)
        .await?;
        Ok(super::KeyStats {
            counts,
            oldest_pending_age: summary
                .try_get::<Option<i64>, _>("oldest_pending_ms")?
                .map(|ms| Duration::from_millis(ms.max(0) as u64)),
            expired_leases: summary.try_get::<i64, _>("expired_leases")?.max(0) as u64,
            purgeable: summary.try_get::<i64, _>("purgeable")?.max(0) as u64,
        })
    }
}

// --- Failure counters: one upsert per failure ----------------------------------------------------

/// [`Store::count_failure`]: inserts the counter at 1, or adds 1 to it (back to 1 when it was
/// past its retention), and returns the count. It runs on the one writer connection, so
/// concurrent counts follow each other and each adds its own 1.
const COUNT_FAILURE: &str = concat!(
    "INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
         created_at, updated_at, expires_at, result, recovery_attempts)
     VALUES (?1, ?2, ?3, 'completed', 'local', ?4, ?5, ",
    now_ms!(),
    ", ",
    now_ms!(),
    ", ",
    now_ms!(),
    ", ",
    now_ms!(),
    " + ?6, ?7, 1)
     ON CONFLICT (scope, operation, idem_key) DO UPDATE SET
        recovery_attempts = CASE WHEN expires_at <= ",
    now_ms!(),
    " THEN 1 ELSE recovery_attempts + 1 END,
        state = 'completed', fingerprint = excluded.fingerprint, result = excluded.result,
        updated_at = excluded.updated_at, expires_at = excluded.expires_at
     RETURNING recovery_attempts"
);

impl SqliteStore {
    /// [`Store::count_failure`] in one statement ([`COUNT_FAILURE`]), on the writer, in a task
    /// that runs to the end.
    async fn upsert_failure(
        &self,
        counter: &PendingRow<'_>,
        result: &[u8],
    ) -> Result<u32, StoreError> {
        let count = sqlx::query_scalar::<_, i64>(COUNT_FAILURE)
            .bind(counter.key.scope().to_owned())
            .bind(counter.key.operation().to_owned())
            .bind(counter.key.key().to_owned())
            .bind(counter.fingerprint.as_bytes().to_vec())
            .bind(counter.token.0.as_bytes().to_vec())
            .bind(counter.retention_millis())
            .bind(result.to_vec());
        let writer = self.writer.clone();
        let count = super::uncancellable(async move {
            let mut conn = writer.acquire().await?;
            Ok(count.fetch_one(&mut *conn).await?)
        })
        .await?;
        Ok(u32::try_from(count.max(0)).unwrap_or(u32::MAX))
    }

    /// [`Store::failure_count`]: the counter's count, 0 when it is missing or expired.
    async fn read_failure_count(&self, counter: &IdempotencyKey) -> Result<u32, StoreError> {
        let count: Option<i64> = sqlx::query_scalar(concat!(
            "SELECT recovery_attempts FROM idempotency_keys
              WHERE scope = ?1 AND operation = ?2 AND idem_key = ?3 AND expires_at > ",
            now_ms!()
        ))
        .bind(counter.scope())
        .bind(counter.operation())
        .bind(counter.key())
        .fetch_optional(&self.pool)
        .await?;
        Ok(u32::try_from(count.unwrap_or(0).max(0)).unwrap_or(u32::MAX))
    }
}
