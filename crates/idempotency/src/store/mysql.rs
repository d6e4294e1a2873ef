//! MySQL / MariaDB store (feature `mysql`), on InnoDB.
//!
//! The reservation does not rely on the isolation level: it is a plain `INSERT` under the primary
//! key `(scope, operation, idem_key)` in autocommit, so it is committed on its own, and the
//! primary key alone decides who holds the key. A duplicate answers with error 1062, which is
//! taken as "conflict, read the row" (never `INSERT IGNORE`, which would also swallow other
//! errors). Racing inserts of one new key can deadlock inside InnoDB (1213: two waiters on the
//! same duplicate both want the insert lock after its first inserter released it) or time out
//! waiting for a lock (1205): both are taken as a lost race, the row is read again, and the insert
//! is retried a bounded number of times if the row is gone. A read-first fast path answers
//! duplicates and replays without taking any lock.
//!
//! Keys are stored as `VARBINARY`, compared byte for byte; times are `DATETIME(6)` in UTC, always
//! from the server's `UTC_TIMESTAMP(6)`, never from the application's clock.

use super::{millis, Insertion, KeyRecord, LeaseToken, PendingRow, Store};
use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use chrono::{DateTime, Utc};
use sqlx::{
    mysql::{MySqlDatabaseError, MySqlRow},
    pool::PoolConnection,
    Connection, MySql, MySqlPool, Row, Transaction,
};
use std::time::Duration;
use uuid::Uuid;

/// The key table's migrations, applied in order by [`Store::migrate`].
pub const MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "create idempotency_keys",
    include_str!("../../migrations/mysql/0001_idempotency_keys.sql"),
)];

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
         k.created_at, k.updated_at, k.lease_until, k.expires_at"
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
        updated_at = UTC_TIMESTAMP(6)
    WHERE scope = ? AND operation = ? AND idem_key = ? AND lease_token = ?
      AND (state = 'failed'
           OR (state = 'completed' AND expires_at <= UTC_TIMESTAMP(6))
           OR (state = 'pending' AND effects = 'local' AND lease_until <= UTC_TIMESTAMP(6)))";

const COMPLETE: &str = "UPDATE idempotency_keys SET
        state = 'completed', result = ?, updated_at = UTC_TIMESTAMP(6),
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
/// use idempotency::{store::{mysql::MySqlStore, Store}, Idempotency};
/// let store = MySqlStore::connect("mysql://shop:secret@127.0.0.1/shop").await?;
/// store.migrate().await?;
/// sqlx::query("CREATE TABLE IF NOT EXISTS orders (id BIGINT AUTO_INCREMENT PRIMARY KEY)")
///     .execute(store.pool())
///     .await?;
/// let idem = Idempotency::new(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
}

impl MySqlStore {
    /// A store on an existing pool (the application's own). Any session isolation level works:
    /// the reservation does not depend on it.
    pub fn new(pool: MySqlPool) -> Self {
        Self { pool }
    }

    /// Connects a new pool.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Ok(Self::new(MySqlPool::connect(url).await?))
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
    let key = IdempotencyKey::new(
        text(row, "scope")?,
        text(row, "operation")?,
        text(row, "idem_key")?,
    )
    .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let token: Vec<u8> = row.try_get("lease_token")?;
    Ok(KeyRecord {
        key,
        state: text(row, "state")?.parse()?,
        effects: text(row, "effects")?.parse()?,
        fingerprint: Fingerprint::try_from(fingerprint.as_slice())
            .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))?,
        lease_token: LeaseToken(
            Uuid::from_slice(&token).map_err(|e| StoreError::Corrupt(e.to_string()))?,
        ),
        lease_remaining: Duration::from_millis(
            row.try_get::<i64, _>("lease_remaining_ms")?.max(0) as u64
        ),
        expired: row.try_get::<i64, _>("expired")? != 0,
        result: row.try_get("result")?,
        reason: optional_text(row, "reason")?,
        recovery_attempts: row.try_get::<i32, _>("recovery_attempts")?.max(0) as u32,
        created_at: row.try_get::<DateTime<Utc>, _>("created_at")?,
        updated_at: row.try_get("updated_at")?,
        lease_until: row.try_get("lease_until")?,
        expires_at: row.try_get("expires_at")?,
    })
}

/// Applies the migrations not yet recorded, on one connection holding the migration lock.
async fn apply_migrations(conn: &mut PoolConnection<MySql>) -> Result<(), StoreError> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
            version BIGINT NOT NULL PRIMARY KEY,
            description VARCHAR(255) NOT NULL,
            applied_at DATETIME(6) NOT NULL
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    )
    .execute(&mut **conn)
    .await?;
    for &(version, description, sql) in MIGRATIONS {
        let applied: Option<i64> = sqlx::query_scalar(
            "SELECT version FROM idempotency_schema_migrations WHERE version = ?",
        )
        .bind(version)
        .fetch_optional(&mut **conn)
        .await?;
        if applied.is_some() {
            continue;
        }
        // DDL commits implicitly and cannot be rolled back: every statement is idempotent, so a
        // migration interrupted before its bookkeeping row is simply applied again.
        for statement in super::statements(sql) {
            sqlx::query(&statement)
                .execute(&mut **conn)
                .await
                .map_err(|e| StoreError::Migration(format!("{version} {description}: {e}")))?;
        }
        sqlx::query(
            "INSERT INTO idempotency_schema_migrations (version, description, applied_at)
             VALUES (?, ?, UTC_TIMESTAMP(6))",
        )
        .bind(version)
        .bind(description)
        .execute(&mut **conn)
        .await?;
    }
    Ok(())
}

impl MySqlStore {
    async fn try_insert(&self, row: &PendingRow<'_>) -> Result<(), sqlx::Error> {
        sqlx::query(INSERT)
            .bind(row.key.scope().as_bytes())
            .bind(row.key.operation().as_bytes())
            .bind(row.key.key().as_bytes())
            .bind(row.effects.as_str())
            .bind(row.fingerprint.as_bytes().as_slice())
            .bind(row.token.0.as_bytes().as_slice())
            .bind(micros(row.lease))
            .bind(micros(row.retention))
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
            return Err(StoreError::Migration(format!(
                "could not take the migration lock within {MIGRATION_LOCK_TIMEOUT_SECS} s"
            )));
        }
        let applied = apply_migrations(&mut conn).await;
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
            match self.try_insert(row).await {
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

    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        let done = sqlx::query(TAKE_OVER)
            .bind(row.effects.as_str())
            .bind(row.fingerprint.as_bytes().as_slice())
            .bind(row.token.0.as_bytes().as_slice())
            .bind(micros(row.lease))
            .bind(micros(row.retention))
            .bind(row.key.scope().as_bytes())
            .bind(row.key.operation().as_bytes())
            .bind(row.key.key().as_bytes())
            .bind(stale.0.as_bytes().as_slice())
            .execute(&self.pool)
            .await;
        match done {
            Ok(done) => Ok(done.rows_affected() == 1),
            // Rolled back by InnoDB; someone else is changing the row: the caller reads it again.
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn begin(&self) -> Result<Transaction<'static, MySql>, StoreError> {
        Ok(self.pool.begin().await?)
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
}
