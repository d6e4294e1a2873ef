//! MySQL / MariaDB store (feature `mysql`), on InnoDB.

use super::history::{self, EventKind, KeyEvent, NewEvent, OperatorNote};
use super::migration::{self, Bookkeeping, Migration};
use super::row::{uuid, KeyRow};
use super::{millis, Insertion, KeyRecord, LeaseToken, PendingRow, ReservedIn, Store};
use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use sqlx::{
    mysql::{MySqlDatabaseError, MySqlRow},
    Connection, MySql, MySqlPool, Row, Transaction,
};
use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

/// The key table's migrations, applied in order by [`Store::migrate`].
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idempotency_keys",
        sql: include_str!("../../migrations/mysql/0001_idempotency_keys.sql"),
    },
    Migration {
        version: 2,
        description: "durable steps: recovery point, request, progress",
        sql: include_str!("../../migrations/mysql/0002_durable_steps.sql"),
    },
    Migration {
        version: 3,
        description: "key history: idempotency_key_events",
        sql: include_str!("../../migrations/mysql/0003_key_events.sql"),
    },
];

/// MySQL error 1060 (`ER_DUP_FIELDNAME`): a column added by a migration exists already (the
/// migration ran, its bookkeeping row did not).
const ER_DUP_FIELDNAME: u16 = 1060;

/// The `GET_LOCK` name serialising migrations of one database (lock names are server-wide and at
/// most 64 characters, hence the digest of the database name).
const MIGRATION_LOCK: &str = "CONCAT('idempotency_migrate_', MD5(COALESCE(DATABASE(), '')))";

/// How long `migrate` waits for another process's migration, in seconds.
const MIGRATION_LOCK_TIMEOUT_SECS: i64 = 60;

/// How many times a reservation insert that lost a race inside InnoDB (deadlock, lock wait
/// timeout) to a row that is gone when read again is retried before answering
/// [`Insertion::Vanished`] (the protocol then starts over).
const INSERT_ATTEMPTS: u32 = 4;

/// How many times a release or park that was chosen as a deadlock victim is retried.
const WRITE_ATTEMPTS: u32 = 4;

/// MySQL error 1062 (`ER_DUP_ENTRY`): the key exists.
const ER_DUP_ENTRY: u16 = 1062;
/// MySQL error 1205 (`ER_LOCK_WAIT_TIMEOUT`).
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// MySQL error 1213 (`ER_LOCK_DEADLOCK`).
const ER_LOCK_DEADLOCK: u16 = 1213;

macro_rules! columns {
    () => {
        "k.scope, k.operation, k.idem_key, k.state, k.effects, k.fingerprint, k.lease_token, \
         CAST(GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), k.lease_until) / 1000)) AS SIGNED) AS lease_remaining_ms, \
         CAST(k.expires_at <= UTC_TIMESTAMP(6) AS SIGNED) AS expired, k.result, k.reason, k.recovery_attempts, \
         k.created_at, k.updated_at, k.lease_until, k.expires_at, k.recovery_point, k.request, k.progress"
    };
}

const FIND: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k WHERE k.scope = ? AND k.operation = ? AND k.idem_key = ?"
);

const INSERT: &str = "INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token,
         lease_until, created_at, updated_at, expires_at)
    VALUES (?, ?, ?, 'pending', ?, ?, ?,
            UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
            UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)";

// MySQL evaluates single-table UPDATE assignments left to right, each seeing the values assigned
// before it: `created_at` must read the old `state`, so it comes first.
const TAKE_OVER: &str = "UPDATE idempotency_keys SET
        created_at = CASE WHEN state = 'pending' THEN created_at ELSE UTC_TIMESTAMP(6) END,
        state = 'pending', effects = ?, fingerprint = ?, lease_token = ?,
        lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
        expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
        result = NULL, reason = NULL, recovery_attempts = 0,
        recovery_point = NULL, request = NULL, progress = NULL,
        updated_at = UTC_TIMESTAMP(6)
    WHERE scope = ? AND operation = ? AND idem_key = ? AND lease_token = ?
      AND (state = 'failed'
           OR (state = 'completed' AND expires_at <= UTC_TIMESTAMP(6))
           OR (state = 'pending' AND effects = 'local' AND lease_until <= UTC_TIMESTAMP(6)))";

const COMPLETE: &str = "UPDATE idempotency_keys SET
        state = 'completed', result = ?, request = NULL, updated_at = UTC_TIMESTAMP(6),
        expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
    WHERE scope = ? AND operation = ? AND idem_key = ? AND state = 'pending' AND lease_token = ?";

const RELEASE: &str = "DELETE FROM idempotency_keys
    WHERE scope = ? AND operation = ? AND idem_key = ? AND state = 'pending' AND lease_token = ?";

const PARK: &str = "UPDATE idempotency_keys SET state = 'needs_review', reason = ?,
        updated_at = UTC_TIMESTAMP(6)
    WHERE scope = ? AND operation = ? AND idem_key = ? AND state = 'pending' AND lease_token = ?";

/// Keys in MySQL or MariaDB (InnoDB), sharing the application's pool so the business work and
/// the key's completion commit in one transaction.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{MySqlStore, Store, Idempotency};
/// let store = MySqlStore::connect("mysql://shop:secret@127.0.0.1/shop").await?;
/// store.migrate().await?;
/// sqlx::query("CREATE TABLE IF NOT EXISTS orders (id BIGINT AUTO_INCREMENT PRIMARY KEY)")
///     .execute(store.pool())
///     .await?;
/// let idem = Idempotency::new(store);
/// # Ok(()) }
/// ```
///
/// MySQL / MariaDB store (feature `mysql`), on InnoDB.
///
/// The reservation does not rely on the isolation level: it is a plain `INSERT` under the primary
/// key `(scope, operation, idem_key)` in autocommit, so it is committed on its own, and the
/// primary key alone decides who holds the key. A duplicate answers with error 1062, which is
/// taken as "conflict, read the row" (never `INSERT IGNORE`, which would also swallow other
/// errors). Racing inserts of one new key can deadlock inside InnoDB (1213: two waiters on the
/// same duplicate both want the insert lock after its first inserter released it) or time out
/// waiting for a lock (1205): both are taken as a lost race, the row is read again, and the insert
/// is retried a bounded number of times if the row is gone. A read-first fast path answers
/// duplicates and replays without taking any lock.
///
/// Keys are stored as `VARBINARY`, compared byte for byte; times are `DATETIME(6)` in UTC, always
/// from the server's `UTC_TIMESTAMP(6)`, never from the application's clock.
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// The server's flavour, learnt from `VERSION()` by the first single-transaction
    /// reservation.
    flavor: Arc<OnceLock<Flavor>>,
    /// Who this store is in the keys' histories ([`with_worker_name`](Self::with_worker_name)).
    actor: Arc<str>,
}

/// How one statement's lock wait is bounded: MariaDB's `SET STATEMENT … FOR`, or MySQL's
/// optimizer hint `SET_VAR` (each ignores or refuses the other's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    MariaDb,
    MySql,
}

impl Flavor {
    /// The single-transaction reservation: [`INSERT`] waiting at most `seconds` for a lock.
    fn bounded_insert(self, seconds: u64) -> String {
        match self {
            Flavor::MariaDb => {
                format!("SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR {INSERT}")
            }
            Flavor::MySql => INSERT.replacen(
                "INSERT INTO",
                &format!("INSERT /*+ SET_VAR(innodb_lock_wait_timeout = {seconds}) */ INTO"),
                1,
            ),
        }
    }
}

impl MySqlStore {
    /// A store on an existing pool (the application's own). Any session isolation level works:
    /// the reservation does not depend on it.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            flavor: Arc::default(),
            actor: history::default_actor(),
        }
    }

    /// Names this process in the keys' histories (the actor of the events it writes: reserved,
    /// steps, calls, claims, completions); default `host:pid`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// let store = idempotency::MySqlStore::connect("mysql://localhost/shop").await?.with_worker_name("web-1");
    /// # Ok(()) }
    /// ```
    pub fn with_worker_name(mut self, name: &str) -> Self {
        self.actor = history::worker_actor(name);
        self
    }

    /// The server's flavour, asked on `tx` the first time.
    async fn flavor(&self, tx: &mut Transaction<'static, MySql>) -> Result<Flavor, StoreError> {
        if let Some(flavor) = self.flavor.get() {
            return Ok(*flavor);
        }
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&mut **tx)
            .await?;
        let flavor = if version.contains("MariaDB") {
            Flavor::MariaDb
        } else {
            Flavor::MySql
        };
        Ok(*self.flavor.get_or_init(|| flavor))
    }

    /// Connects a new pool, without sqlx's ping on every checkout
    /// (`test_before_acquire(false)`). A first request checks out two connections (the
    /// reservation, then the business transaction), so the pings are two of its seven round
    /// trips on PostgreSQL (their cost: `bench/peers --pool tuned`). A connection that
    /// died with the server fails its next statement instead: the request answers 503 ("not
    /// now") and its retry runs on a fresh connection. Give your own pool the same setting.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .test_before_acquire(false)
            .connect(url)
            .await?;
        Ok(Self::new(pool))
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

/// The MySQL error number of a database error, if it is one.
pub(crate) fn error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Deadlock (1213) or lock wait timeout (1205): the statement lost a race inside InnoDB and was
/// rolled back; nothing it did remains.
pub(crate) fn lost_race(error: &sqlx::Error) -> bool {
    matches!(
        error_number(error),
        Some(ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT)
    )
}

/// Binds the placeholders of [`INSERT`]: the key, its effects, fingerprint and token, the lease
/// and the retention in microseconds.
fn bind_pending<'q>(
    query: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    row: &'q PendingRow<'_>,
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    query
        .bind(row.key.scope().as_bytes())
        .bind(row.key.operation().as_bytes())
        .bind(row.key.key().as_bytes())
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.token.0.as_bytes().as_slice())
        .bind(micros(row.lease))
        .bind(micros(row.retention))
}

/// Microseconds for `INTERVAL ? MICROSECOND`, saturating.
fn micros(duration: Duration) -> i64 {
    millis(duration).saturating_mul(1000)
}

fn text(row: &MySqlRow, column: &str) -> Result<String, StoreError> {
    // Binary columns and `_bin` collations come flagged BINARY, which sqlx only decodes as bytes.
    let bytes: Vec<u8> = row.try_get(column)?;
    String::from_utf8(bytes).map_err(|_| StoreError::Corrupt(format!("{column} is not UTF-8")))
}

fn optional_text(row: &MySqlRow, column: &str) -> Result<Option<String>, StoreError> {
    let bytes: Option<Vec<u8>> = row.try_get(column)?;
    bytes
        .map(|bytes| {
            String::from_utf8(bytes)
                .map_err(|_| StoreError::Corrupt(format!("{column} is not UTF-8")))
        })
        .transpose()
}

fn record(row: &MySqlRow) -> Result<KeyRecord, StoreError> {
    KeyRow {
        scope: text(row, "scope")?,
        operation: text(row, "operation")?,
        idem_key: text(row, "idem_key")?,
        state: text(row, "state")?,
        effects: text(row, "effects")?,
        fingerprint: row.try_get("fingerprint")?,
        lease_token: uuid(&row.try_get::<Vec<u8>, _>("lease_token")?)?,
        lease_remaining_ms: row.try_get("lease_remaining_ms")?,
        expired: row.try_get::<i64, _>("expired")? != 0,
        result: row.try_get("result")?,
        reason: optional_text(row, "reason")?,
        recovery_attempts: row.try_get::<i32, _>("recovery_attempts")?.into(),
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        lease_until: row.try_get("lease_until")?,
        expires_at: row.try_get("expires_at")?,
        recovery_point: optional_text(row, "recovery_point")?,
        request: row.try_get("request")?,
        progress: row.try_get("progress")?,
    }
    .into_record()
}

/// Where applied migrations are recorded. DDL commits implicitly and cannot be rolled back:
/// every statement is idempotent or tolerated, so a migration interrupted before its bookkeeping
/// row is simply applied again.
const BOOKKEEPING: Bookkeeping = Bookkeeping {
    create_table: "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
        version BIGINT NOT NULL PRIMARY KEY,
        description VARCHAR(255) NOT NULL,
        applied_at DATETIME(6) NOT NULL
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    find_version: "SELECT version FROM idempotency_schema_migrations WHERE version = ?",
    record_version: "INSERT INTO idempotency_schema_migrations (version, description, applied_at)
        VALUES (?, ?, UTC_TIMESTAMP(6))",
    already_applied: |error| error_number(error) == Some(ER_DUP_FIELDNAME),
    // `GET_LOCK` holds on one server: on a Galera cluster, processes migrating through
    // different nodes run at once. Their DDL is idempotent and ordered cluster-wide; the second
    // bookkeeping row of a version is a duplicate, or a certification conflict (1213) on commit.
    recorded_meanwhile: |error| error_number(error) == Some(ER_DUP_ENTRY),
    rolled_back: lost_race,
};

impl MySqlStore {
    async fn try_insert(&self, row: &PendingRow<'_>) -> Result<(), sqlx::Error> {
        bind_pending(sqlx::query(INSERT), row)
            .execute(&self.pool)
            .await
            .map(drop)
    }

    /// Runs an autocommit write again when InnoDB chose it as a deadlock victim (it was rolled
    /// back entirely, so running it again is safe).
    async fn write_retrying<'q>(
        &self,
        query: impl Fn() -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<u64, StoreError> {
        let mut attempt = 1;
        loop {
            match query().execute(&self.pool).await {
                Ok(done) => return Ok(done.rows_affected()),
                Err(e)
                    if attempt < WRITE_ATTEMPTS && error_number(&e) == Some(ER_LOCK_DEADLOCK) =>
                {
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Store for MySqlStore {
    type Database = MySql;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        let locked: Option<i64> =
            sqlx::query_scalar(&format!("SELECT GET_LOCK({MIGRATION_LOCK}, ?)"))
                .bind(MIGRATION_LOCK_TIMEOUT_SECS)
                .fetch_one(&mut *conn)
                .await?;
        if locked != Some(1) {
            return Err(StoreError::MigrationLocked {
                waited: Duration::from_secs(MIGRATION_LOCK_TIMEOUT_SECS.unsigned_abs()),
            });
        }
        let applied = migration::apply_pending::<MySql>(&mut conn, &BOOKKEEPING, MIGRATIONS).await;
        let released = sqlx::query(&format!("SELECT RELEASE_LOCK({MIGRATION_LOCK})"))
            .execute(&mut *conn)
            .await;
        if released.is_err() {
            // Never hand a connection that may still hold the lock back to the pool.
            let _ = conn.detach().close().await;
        }
        applied
    }

    async fn insert_pending(&self, row: &PendingRow<'_>) -> Result<Insertion, StoreError> {
        // Fast path for duplicates and replays: a consistent read, which takes no lock.
        if let Some(existing) = self.find(row.key).await? {
            return Ok(Insertion::Conflict(existing));
        }
        for _ in 0..INSERT_ATTEMPTS {
            let inserted = if row.records_history() {
                let insert = || bind_pending(sqlx::query(INSERT), row);
                let event = (EventKind::Reserved, None, true);
                self.recorded_once(row.key, event, insert()).await.map(drop)
            } else {
                self.try_insert(row).await
            };
            match inserted {
                Ok(()) => return Ok(Insertion::Inserted),
                Err(e) if error_number(&e) == Some(ER_DUP_ENTRY) => {
                    return super::read_conflict(self, row.key).await
                }
                // Rolled back by InnoDB: nothing was inserted. Whoever won has committed its row.
                Err(e) if lost_race(&e) => {
                    if let Some(existing) = self.find(row.key).await? {
                        return Ok(Insertion::Conflict(existing));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Insertion::Vanished)
    }

    async fn find(&self, key: &IdempotencyKey) -> Result<Option<KeyRecord>, StoreError> {
        sqlx::query(FIND)
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
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
        let result: Option<Option<Vec<u8>>> = sqlx::query_scalar(
            "SELECT result FROM idempotency_keys
              WHERE scope = ? AND operation = ? AND idem_key = ?
                AND state = 'completed' AND fingerprint = ? AND expires_at > UTC_TIMESTAMP(6)",
        )
        .bind(key.scope().as_bytes())
        .bind(key.operation().as_bytes())
        .bind(key.key().as_bytes())
        .bind(fingerprint.as_bytes().as_slice())
        .fetch_optional(&self.pool)
        .await?;
        Ok(result.map(Option::unwrap_or_default))
    }

    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        let take_over = sqlx::query(TAKE_OVER)
            .bind(row.effects.as_str())
            .bind(row.fingerprint.as_bytes().as_slice())
            .bind(row.token.0.as_bytes().as_slice())
            .bind(micros(row.lease))
            .bind(micros(row.retention))
            .bind(row.key.scope().as_bytes())
            .bind(row.key.operation().as_bytes())
            .bind(row.key.key().as_bytes())
            .bind(stale.0.as_bytes().as_slice());
        let done = if row.records_history() {
            let event = (EventKind::Reserved, None, true);
            self.recorded_once(row.key, event, take_over).await
        } else {
            take_over
                .execute(&self.pool)
                .await
                .map(|done| done.rows_affected())
        };
        match done {
            Ok(done) => Ok(done == 1),
            // Rolled back by InnoDB; someone else is changing the row: the caller reads it again.
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn begin(&self) -> Result<Transaction<'static, MySql>, StoreError> {
        let pool = self.pool.clone();
        super::uncancellable(async move { Ok(pool.begin().await?) }).await
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, MySql>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        // An UPDATE reads the latest committed row (not the transaction's snapshot), so a take-over
        // committed after this transaction began is seen and fences us out.
        let done = sqlx::query(COMPLETE)
            .bind(result)
            .bind(micros(retention))
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0.as_bytes().as_slice())
            .execute(&mut **tx)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &IdempotencyKey, token: LeaseToken) -> Result<bool, StoreError> {
        let deleted = self
            .write_retrying(|| {
                sqlx::query(RELEASE)
                    .bind(key.scope().as_bytes())
                    .bind(key.operation().as_bytes())
                    .bind(key.key().as_bytes())
                    .bind(token.0.as_bytes().as_slice())
            })
            .await?;
        Ok(deleted == 1)
    }

    async fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let parked = self
            .write_retrying(|| {
                sqlx::query(PARK)
                    .bind(reason)
                    .bind(key.scope().as_bytes())
                    .bind(key.operation().as_bytes())
                    .bind(key.key().as_bytes())
                    .bind(token.0.as_bytes().as_slice())
            })
            .await?;
        Ok(parked == 1)
    }

    async fn release_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let release = || {
            sqlx::query(RELEASE)
                .bind(key.scope().as_bytes())
                .bind(key.operation().as_bytes())
                .bind(key.key().as_bytes())
                .bind(token.0.as_bytes().as_slice())
        };
        let event = (EventKind::Released, None, true);
        Ok(self.recorded(key, event, release).await? == 1)
    }

    async fn park_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let park = || {
            sqlx::query(PARK)
                .bind(reason)
                .bind(key.scope().as_bytes())
                .bind(key.operation().as_bytes())
                .bind(key.key().as_bytes())
                .bind(token.0.as_bytes().as_slice())
        };
        let detail = Some(history::bounded(reason, history::DETAIL_MAX_BYTES));
        let event = (EventKind::Parked, detail, true);
        Ok(self.recorded(key, event, park).await? == 1)
    }

    async fn append_event(
        &self,
        tx: &mut Transaction<'static, MySql>,
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
        let extended = self
            .write_retrying(|| {
                sqlx::query(
                    "UPDATE idempotency_keys SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                     WHERE scope = ? AND operation = ? AND idem_key = ?
                       AND state = 'pending' AND lease_token = ?",
                )
                .bind(micros(lease))
                .bind(key.scope().as_bytes())
                .bind(key.operation().as_bytes())
                .bind(key.key().as_bytes())
                .bind(token.0.as_bytes().as_slice())
            })
            .await?;
        Ok(extended == 1)
    }

    async fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let event = (EventKind::Claimed, None, false);
        self.conditional_recorded(key, event, || {
            sqlx::query(
                "UPDATE idempotency_keys SET
                    lease_token = ?, lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
                    updated_at = UTC_TIMESTAMP(6)
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                   AND state = 'pending' AND lease_token = ? AND lease_until <= UTC_TIMESTAMP(6)",
            )
            .bind(fresh.0.as_bytes().as_slice())
            .bind(micros(lease))
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(stale.0.as_bytes().as_slice())
        })
        .await
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

impl super::Journal for MySqlStore {
    async fn note_unknown(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        self.conditional(|| {
            sqlx::query(
                "UPDATE idempotency_keys SET
                    recovery_attempts = recovery_attempts + 1,
                    lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
                    updated_at = UTC_TIMESTAMP(6)
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                   AND state = 'pending' AND lease_token = ?",
            )
            .bind(micros(retry_after))
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0.as_bytes().as_slice())
        })
        .await
    }

    async fn save_progress(
        &self,
        tx: &mut Transaction<'static, MySql>,
        key: &IdempotencyKey,
        token: LeaseToken,
        progress: &super::Progress<'_>,
    ) -> Result<bool, StoreError> {
        // Like `complete`, the UPDATE reads the latest committed row, so a claim committed after
        // this transaction began fences us out.
        let done = sqlx::query(
            "UPDATE idempotency_keys SET
                recovery_point = ?, progress = ?, request = COALESCE(request, ?),
                updated_at = UTC_TIMESTAMP(6)
             WHERE scope = ? AND operation = ? AND idem_key = ? AND state = 'pending' AND lease_token = ?",
        )
        .bind(progress.recovery_point)
        .bind(progress.journal)
        .bind(progress.request)
        .bind(key.scope().as_bytes())
        .bind(key.operation().as_bytes())
        .bind(key.key().as_bytes())
        .bind(token.0.as_bytes().as_slice())
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

impl super::ReserveInTransaction for MySqlStore {
    /// InnoDB queues a duplicate's INSERT on the primary key behind the uncommitted row. The wait
    /// is bounded per statement in whole seconds (`innodb_lock_wait_timeout`, at least 1), so
    /// `wait` is rounded up. Waiters left when a holder rolls back may deadlock on the freed
    /// key (1213, their transaction rolled back): they answer [`ReservedIn::Exists`] and reserve
    /// the article's way, which decides.
    async fn reserve_in(
        &self,
        tx: &mut Transaction<'static, MySql>,
        row: &PendingRow<'_>,
        wait: Duration,
    ) -> Result<ReservedIn, StoreError> {
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let sql = self.flavor(tx).await?.bounded_insert(seconds.max(1));
        let inserted = bind_pending(sqlx::query(&sql), row)
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(_) => Ok(ReservedIn::Inserted),
            Err(e) => match error_number(&e) {
                Some(ER_DUP_ENTRY | ER_LOCK_DEADLOCK) => Ok(ReservedIn::Exists),
                Some(ER_LOCK_WAIT_TIMEOUT) => Ok(ReservedIn::Busy),
                _ => Err(e.into()),
            },
        }
    }
}

/// Waits by polling: MySQL has no notifications.
impl super::CompletionSignal for MySqlStore {}

// --- Maintenance: recovery, purge, listing, resolution, statistics ------------------------------

const EXPIRED_LEASES: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k WHERE k.state = 'pending' AND k.lease_until <= UTC_TIMESTAMP(6)
      ORDER BY k.lease_until, k.scope, k.operation, k.idem_key LIMIT ?"
);

const LIST: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k
      WHERE (? IS NULL OR k.state = ?)
        AND (? IS NULL OR k.scope = ?)
        AND (? IS NULL OR k.operation = ?)
        AND (? IS NULL OR k.created_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)
        AND (? IS NULL OR (k.created_at, k.scope, k.operation, k.idem_key) > (?, ?, ?, ?))
      ORDER BY k.created_at, k.scope, k.operation, k.idem_key LIMIT ?"
);

/// The purge condition, by the server's clock.
macro_rules! purgeable {
    () => {
        "state IN ('completed', 'failed') AND expires_at <= UTC_TIMESTAMP(6)"
    };
}

impl MySqlStore {
    /// Runs a conditional autocommit statement; losing a race inside InnoDB (deadlock victim
    /// after the retries, lock wait timeout) means another session changed the row first:
    /// `Ok(false)`.
    async fn conditional<'q>(
        &self,
        query: impl Fn() -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<bool, StoreError> {
        match self.write_retrying(query).await {
            Ok(done) => Ok(done == 1),
            Err(StoreError::Database(e)) if lost_race(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// The fence of an operator action on the row it saw (two parameters, both `seen` in
/// milliseconds since the epoch): none, or the row's `updated_at` equals it at millisecond
/// precision (truncated, as the other backends compare).
macro_rules! seen_matches {
    () => {
        "(? IS NULL OR TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at) DIV 1000 = ?)"
    };
}

impl MySqlStore {
    /// One attempt of [`purge_batch`](super::Maintenance::purge_batch).
    async fn try_purge_batch(&self, batch: u32) -> Result<u64, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let chosen: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = sqlx::query_as(concat!(
            "SELECT scope, operation, idem_key FROM idempotency_keys WHERE ",
            purgeable!(),
            " ORDER BY expires_at LIMIT ? FOR UPDATE"
        ))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        if chosen.is_empty() {
            // Nothing expired: end the transaction without a COMMIT (an idle worker's pass
            // writes nothing), and sweep the orphaned histories.
            tx.rollback().await?;
            self.sweep_orphaned_events(batch).await?;
            return Ok(0);
        }
        let mut deleted = 0;
        for (scope, operation, idem_key) in &chosen {
            sqlx::query(
                "DELETE FROM idempotency_key_events
                  WHERE scope = ? AND operation = ? AND idem_key = ?",
            )
            .bind(scope)
            .bind(operation)
            .bind(idem_key)
            .execute(&mut *tx)
            .await?;
            deleted += sqlx::query(concat!(
                "DELETE FROM idempotency_keys
                  WHERE scope = ? AND operation = ? AND idem_key = ? AND ",
                purgeable!()
            ))
            .bind(scope)
            .bind(operation)
            .bind(idem_key)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        tx.commit().await?;
        if chosen.len() < batch as usize {
            // The last batch of this purge: sweep the orphaned histories too.
            self.sweep_orphaned_events(batch).await?;
        }
        Ok(deleted)
    }

    /// Deletes at most `batch` orphaned events ([`history::ORPHAN_RETENTION`]). They are found
    /// by a consistent read, which locks nothing (a locking scan would hold gap locks that
    /// concurrent appends wait for), then deleted by id, still old.
    async fn sweep_orphaned_events(&self, batch: u32) -> Result<(), sqlx::Error> {
        let retention = micros(history::ORPHAN_RETENTION);
        let ids: Vec<u64> = sqlx::query_scalar(history::orphaned_events!(
            "UTC_TIMESTAMP(3) - INTERVAL ? MICROSECOND",
            "?"
        ))
        .bind(retention)
        .bind(retention)
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        if ids.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = ids.iter().map(u64::to_string).collect();
        sqlx::query(&format!(
            "DELETE FROM idempotency_key_events
              WHERE id IN ({}) AND at <= UTC_TIMESTAMP(3) - INTERVAL ? MICROSECOND",
            list.join(", ")
        ))
        .bind(retention)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// An event for [`MySqlStore::recorded`]: its kind, detail, and whether it is recorded whatever
/// the key (else only where the key is external or its history has begun).
type Recorded<'d> = (EventKind, Option<&'d str>, bool);

impl MySqlStore {
    /// Runs a conditional update and, only if it changed the row, appends `event` to the key's
    /// history, both in one transaction: the history never disagrees with the row. Run again
    /// whole when InnoDB chose it as a deadlock victim; losing a race is `Ok(false)`.
    async fn logged_change<'q>(
        &self,
        key: &IdempotencyKey,
        event: &NewEvent<'_>,
        update: impl Fn() -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<bool, StoreError> {
        let actor = event.actor.unwrap_or(&self.actor);
        let detail = event.detail.as_deref();
        let mut attempt = 1;
        loop {
            let mut tx = self.pool.begin().await?;
            let done = match update().execute(&mut *tx).await {
                Ok(done) if done.rows_affected() != 1 => Ok(false),
                Ok(_) => append(&mut tx, key, event.kind, detail, actor, true)
                    .await
                    .map(|()| true),
                Err(e) => Err(e),
            };
            let done = match done {
                Ok(true) => tx.commit().await.map(|()| true),
                other => other,
            };
            match done {
                Ok(changed) => return Ok(changed),
                Err(e)
                    if attempt < WRITE_ATTEMPTS && error_number(&e) == Some(ER_LOCK_DEADLOCK) =>
                {
                    attempt += 1;
                }
                Err(e) if lost_race(&e) => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Runs `change` and, if it changed a row, appends `event` (actor: this store) to the key's
    /// history, in one transaction: the history never disagrees with the row. Returns the rows
    /// changed; the database's error as it is (a duplicate, a deadlock), nothing committed.
    async fn recorded_once(
        &self,
        key: &IdempotencyKey,
        (kind, detail, always): Recorded<'_>,
        change: sqlx::query::Query<'_, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<u64, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let changed = change.execute(&mut *tx).await?.rows_affected();
        if changed == 0 {
            tx.rollback().await?;
            return Ok(0);
        }
        append(&mut tx, key, kind, detail, &self.actor, always).await?;
        tx.commit().await?;
        Ok(changed)
    }

    /// [`recorded_once`](Self::recorded_once), run again whole when InnoDB chose it as a
    /// deadlock victim.
    async fn recorded<'q>(
        &self,
        key: &IdempotencyKey,
        event: Recorded<'_>,
        change: impl Fn() -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<u64, StoreError> {
        let mut attempt = 1;
        loop {
            match self.recorded_once(key, event, change()).await {
                Ok(done) => return Ok(done),
                Err(e)
                    if attempt < WRITE_ATTEMPTS && error_number(&e) == Some(ER_LOCK_DEADLOCK) =>
                {
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// [`recorded`](Self::recorded) for a conditional statement: losing a race inside InnoDB is
    /// `Ok(false)`.
    async fn conditional_recorded<'q>(
        &self,
        key: &IdempotencyKey,
        event: Recorded<'_>,
        change: impl Fn() -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<bool, StoreError> {
        match self.recorded(key, event, change).await {
            Ok(done) => Ok(done == 1),
            Err(StoreError::Database(e)) if lost_race(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Appends an event to the history of `key` inside `tx`, at the server's clock, after the change
/// it records: `always`, or only where the key (as changed) is external or its history has
/// begun.
async fn append(
    tx: &mut Transaction<'_, MySql>,
    key: &IdempotencyKey,
    kind: EventKind,
    detail: Option<&str>,
    actor: &str,
    always: bool,
) -> Result<(), sqlx::Error> {
    let statement = if always {
        "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
         VALUES (?, ?, ?, UTC_TIMESTAMP(3), ?, ?, ?)"
    } else {
        "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
         SELECT k.scope, k.operation, k.idem_key, UTC_TIMESTAMP(3), ?, ?, ?
           FROM idempotency_keys k
          WHERE k.scope = ? AND k.operation = ? AND k.idem_key = ?
            AND (k.effects = 'external'
                 OR EXISTS (SELECT 1 FROM idempotency_key_events e
                             WHERE e.scope = k.scope AND e.operation = k.operation
                               AND e.idem_key = k.idem_key))"
    };
    let query = sqlx::query(statement);
    let query = if always {
        query
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(kind.as_str())
            .bind(detail)
            .bind(actor)
    } else {
        query
            .bind(kind.as_str())
            .bind(detail)
            .bind(actor)
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
    };
    query.execute(&mut **tx).await?;
    Ok(())
}

impl super::Maintenance for MySqlStore {
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
        let detail = Some(history::bounded(reason, history::DETAIL_MAX_BYTES));
        let event = (EventKind::Completed, detail, false);
        self.conditional_recorded(key, event, || {
            sqlx::query(
                "UPDATE idempotency_keys SET
                    state = 'completed', result = ?, reason = ?, updated_at = UTC_TIMESTAMP(6),
                    expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                   AND state = 'pending' AND lease_token = ?",
            )
            .bind(result)
            .bind(reason)
            .bind(micros(retention))
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0.as_bytes().as_slice())
        })
        .await
    }

    async fn purge_batch(&self, batch: u32) -> Result<u64, StoreError> {
        // One bounded transaction walking the expires_at index: the chosen rows are locked, then
        // their histories and the rows go together. MySQL cannot LIMIT a DELETE joined to
        // another table, hence the two steps. A deadlock victim is retried whole.
        let mut attempt = 1;
        loop {
            match self.try_purge_batch(batch).await {
                Ok(deleted) => return Ok(deleted),
                Err(e)
                    if attempt < WRITE_ATTEMPTS && error_number(&e) == Some(ER_LOCK_DEADLOCK) =>
                {
                    attempt += 1;
                }
                Err(e) if lost_race(&e) => return Ok(0),
                Err(e) => return Err(e.into()),
            }
        }
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
        let state = filter.state.map(|s| s.as_str());
        let scope = filter.scope.as_deref().map(str::as_bytes);
        let operation = filter.operation.as_deref().map(str::as_bytes);
        let older_than = filter.older_than.map(micros);
        let after = filter.after.as_ref();
        let after_time = after.map(|c| c.created_at().naive_utc());
        sqlx::query(LIST)
            .bind(state)
            .bind(state)
            .bind(scope)
            .bind(scope)
            .bind(operation)
            .bind(operation)
            .bind(older_than)
            .bind(older_than)
            .bind(after_time)
            .bind(after_time)
            .bind(after.map(|c| c.key().scope().as_bytes()))
            .bind(after.map(|c| c.key().operation().as_bytes()))
            .bind(after.map(|c| c.key().key().as_bytes()))
            .bind(i64::from(filter.limit))
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
        let event = NewEvent {
            kind: EventKind::Resolved,
            detail: Some(history::resolved_detail(state, note)),
            actor: Some(note.actor()),
        };
        self.logged_change(key, &event, || {
            sqlx::query(concat!(
                "UPDATE idempotency_keys SET
                    state = ?, result = ?, reason = ?, updated_at = UTC_TIMESTAMP(6),
                    expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                   AND state = 'needs_review' AND ",
                seen_matches!()
            ))
            .bind(state)
            .bind(result)
            .bind(note.reason.as_str())
            .bind(micros(retention))
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(note.seen_millis())
            .bind(note.seen_millis())
        })
        .await
    }

    async fn hand_back(
        &self,
        key: &IdempotencyKey,
        note: &OperatorNote,
    ) -> Result<bool, StoreError> {
        let event = NewEvent {
            kind: EventKind::HandedBack,
            detail: Some(history::handed_back_detail(note)),
            actor: Some(note.actor()),
        };
        self.logged_change(key, &event, || {
            sqlx::query(concat!(
                "UPDATE idempotency_keys SET
                    state = 'pending', lease_until = UTC_TIMESTAMP(6), recovery_attempts = 0,
                    reason = ?, updated_at = UTC_TIMESTAMP(6)
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                   AND state = 'needs_review' AND ",
                seen_matches!()
            ))
            .bind(note.reason.as_str())
            .bind(key.scope().as_bytes())
            .bind(key.operation().as_bytes())
            .bind(key.key().as_bytes())
            .bind(note.seen_millis())
            .bind(note.seen_millis())
        })
        .await
    }

    async fn history(&self, key: &IdempotencyKey, limit: u32) -> Result<Vec<KeyEvent>, StoreError> {
        sqlx::query(
            "SELECT at, kind, detail, actor FROM (
                SELECT id, at, kind, detail, actor FROM idempotency_key_events
                 WHERE scope = ? AND operation = ? AND idem_key = ?
                 ORDER BY id DESC LIMIT ?) newest
             ORDER BY id",
        )
        .bind(key.scope().as_bytes())
        .bind(key.operation().as_bytes())
        .bind(key.key().as_bytes())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            history::event(
                row.try_get("at")?,
                &text(row, "kind")?,
                optional_text(row, "detail")?,
                optional_text(row, "actor")?,
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
                    operation: text(row, "operation")?,
                    state: text(row, "state")?.parse()?,
                    count: row.try_get::<i64, _>("n")?.max(0) as u64,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let summary = sqlx::query(concat!(
            "SELECT
                (SELECT CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) / 1000) AS SIGNED)
                   FROM idempotency_keys WHERE state = 'pending') AS oldest_pending_ms,
                (SELECT count(*) FROM idempotency_keys
                  WHERE state = 'pending' AND lease_until <= UTC_TIMESTAMP(6)) AS expired_leases,
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

/// How many times a failure count is tried again when InnoDB rolled it back (a deadlock among
/// concurrent upserts of one new row, or a lock wait timeout): nothing was written, so it counts
/// once when tried again.
const FAILURE_COUNT_ATTEMPTS: u32 = 64;

/// [`Store::count_failure`]: inserts the counter at 1, or adds 1 to it (back to 1 when it was
/// past its retention; the assignments run left to right, so `recovery_attempts` reads the old
/// `expires_at`). The count is also handed to `LAST_INSERT_ID(…)`, which the server returns in
/// the statement's OK packet: no second statement reads it back. `ON DUPLICATE KEY UPDATE`
/// locks the row, so concurrent upserts queue on it and each adds its own 1 to the latest count.
const COUNT_FAILURE: &str = "INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
         created_at, updated_at, expires_at, result, recovery_attempts)
    VALUES (?, ?, ?, 'completed', 'local', ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
            UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, LAST_INSERT_ID(1))
    ON DUPLICATE KEY UPDATE
        recovery_attempts = LAST_INSERT_ID(
            IF(expires_at <= UTC_TIMESTAMP(6), 1, recovery_attempts + 1)),
        state = 'completed', fingerprint = ?, result = ?, updated_at = UTC_TIMESTAMP(6),
        expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";

impl MySqlStore {
    /// [`Store::count_failure`] in one statement ([`COUNT_FAILURE`]).
    async fn upsert_failure(
        &self,
        counter: &PendingRow<'_>,
        result: &[u8],
    ) -> Result<u32, StoreError> {
        let retention = micros(counter.retention);
        for _ in 0..FAILURE_COUNT_ATTEMPTS {
            let count = sqlx::query(COUNT_FAILURE)
                .bind(counter.key.scope().as_bytes())
                .bind(counter.key.operation().as_bytes())
                .bind(counter.key.key().as_bytes())
                .bind(counter.fingerprint.as_bytes().as_slice())
                .bind(counter.token.0.as_bytes().as_slice())
                .bind(retention)
                .bind(result)
                .bind(counter.fingerprint.as_bytes().as_slice())
                .bind(result)
                .bind(retention);
            match count.execute(&self.pool).await {
                Ok(done) => return Ok(u32::try_from(done.last_insert_id()).unwrap_or(u32::MAX)),
                Err(e) if lost_race(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention(FAILURE_COUNT_ATTEMPTS))
    }

    /// [`Store::failure_count`]: the counter's count, 0 when it is missing or expired.
    async fn read_failure_count(&self, counter: &IdempotencyKey) -> Result<u32, StoreError> {
        let count: Option<i32> = sqlx::query_scalar(
            "SELECT recovery_attempts FROM idempotency_keys
              WHERE scope = ? AND operation = ? AND idem_key = ? AND expires_at > UTC_TIMESTAMP(6)",
        )
        .bind(counter.scope().as_bytes())
        .bind(counter.operation().as_bytes())
        .bind(counter.key().as_bytes())
        .fetch_optional(&self.pool)
        .await?;
        Ok(count.unwrap_or(0).max(0) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process migrating through another Galera node records a version between this one's
    /// check and its own record (`GET_LOCK` excludes only the processes of one node). A check
    /// that misses the recorded rows stands for that moment, on a real server.
    #[tokio::test]
    async fn a_version_recorded_meanwhile_by_another_process_is_taken_as_applied() {
        let Some(url) = test_support::fresh_mysql_url().await else {
            return;
        };
        let store = MySqlStore::connect(&url).await.unwrap();
        store.migrate().await.unwrap();
        let late = Bookkeeping {
            find_version: "SELECT version FROM idempotency_schema_migrations
                WHERE version = ? AND 1 = 0",
            ..BOOKKEEPING
        };
        let mut conn = store.pool().acquire().await.unwrap();
        migration::apply_pending::<MySql>(&mut conn, &late, MIGRATIONS)
            .await
            .unwrap();
        let versions: Vec<i64> = sqlx::query_scalar(
            "SELECT version FROM idempotency_schema_migrations ORDER BY version",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        assert_eq!(versions, vec![1, 2, 3]);
        // Without the tolerance, the duplicate fails the migration (what a second node saw).
        let strict = Bookkeeping {
            recorded_meanwhile: |_| false,
            ..late
        };
        let error = migration::apply_pending::<MySql>(&mut conn, &strict, MIGRATIONS)
            .await
            .unwrap_err();
        let StoreError::Database(error) = error else {
            panic!("expected the duplicate, got {error:?}");
        };
        assert_eq!(error_number(&error), Some(ER_DUP_ENTRY));
    }
}
