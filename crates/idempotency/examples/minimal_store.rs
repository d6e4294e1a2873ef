//! **FOR ILLUSTRATION ONLY — NOT A STORE TO RUN IN PRODUCTION.** A minimal [`Store`]: the
//! whole contract in one file, each method one plain conditional statement, proved by the
//! published conformance suite (`tests/example_store.rs` runs `store_conformance!` on it).
//!
//! Its database lives in memory and is gone when the last clone of the store is dropped: nothing
//! survives the process, nothing is tuned (no relaxed flushes, no cancellation guards), and it
//! takes the time from this process's clock, where a store shared by several processes must use
//! the database's. Use `SqliteStore`, `PgStore` or `MySqlStore` for real work.
//!
//! Why not keep the keys in a `HashMap`? The protocol completes a key **inside the business
//! transaction** ([`Store::complete`] gets the `sqlx::Transaction`): the completion must commit,
//! or roll back, with the work's writes. A map beside the database cannot join that
//! transaction, so a store's key table lives in the database the business writes go to: here,
//! one in-memory SQLite database.
//!
//! Why several connections? The protocol reads a key while a business transaction is open (a
//! duplicate asks while the original works): on one connection that read would wait for the
//! transaction, which waits for the read. SQLite's shared cache (what `sqlite::memory:` opens)
//! lets the readers' connections ([`Store::find`], [`Store::find_replay`]) read the key table
//! beside the one writer connection, whose transaction locks only the tables it writes.
//!
//! Run it: `cargo run -p idempotency --example minimal_store --features testing`.

use idempotency::{
    maintenance::{KeyEvent, KeyFilter, KeyStats, OperatorNote, Resolution, StateCount},
    store::{
        CompletionSignal, Insertion, Journal, KeyRecord, KeyState, LeaseToken, Maintenance,
        PendingRow, Progress,
    },
    Fingerprint, IdempotencyKey, Store, StoreError,
};
use sqlx::{
    sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteRow},
    Row, Sqlite, SqlitePool, Transaction,
};
use std::{str::FromStr, time::Duration};

/// A store whose key table and business tables live in one in-memory SQLite database.
/// Illustration only: see the module's documentation.
#[derive(Debug, Clone)]
pub struct MinimalStore {
    /// The one connection every write and business transaction runs on (SQLite has one writer).
    /// It never closes, so the in-memory database lives as long as the store.
    pool: SqlitePool,
    /// Connections for the reads that must not wait for a business transaction.
    reader: SqlitePool,
}

impl MinimalStore {
    /// A new, empty in-memory database.
    pub async fn new() -> Result<Self, Box<dyn std::error::Error>> {
        // `sqlite::memory:` names a new shared-cache database: every connection opened with
        // these options (and clones of them) reaches the same one.
        let options = SqliteConnectOptions::from_str("sqlite::memory:")?;
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options.clone())
            .await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        Ok(Self { pool, reader })
    }

    /// The writer's pool, for the business tables.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// Milliseconds since the epoch, by this process's clock.
fn now() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `now()` plus `duration`.
fn after(duration: Duration) -> i64 {
    now().saturating_add(i64::try_from(duration.as_millis()).unwrap_or(i64::MAX))
}

/// The row of `key`, if the statement changed one.
const WHERE_HELD: &str =
    "scope = ? AND operation = ? AND idem_key = ? AND state = 'pending' AND lease_token = ?";

/// A statement on `key` held with `token`, its other arguments bound first; whether it
/// changed the row.
async fn on_held<'c, E>(
    executor: E,
    set: &str,
    binds: Vec<Bind>,
    key: &IdempotencyKey,
    token: LeaseToken,
) -> Result<bool, StoreError>
where
    E: sqlx::Executor<'c, Database = Sqlite>,
{
    let sql = format!("UPDATE keys SET {set} WHERE {WHERE_HELD}");
    let mut query = sqlx::query(&sql);
    for bind in binds {
        query = match bind {
            Bind::Int(value) => query.bind(value),
            Bind::Text(value) => query.bind(value),
            Bind::Bytes(value) => query.bind(value),
        };
    }
    let done = query
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.to_string())
        .execute(executor)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// A value bound into [`on_held`]'s statement.
enum Bind {
    Int(i64),
    Text(Option<String>),
    Bytes(Option<Vec<u8>>),
}

/// A row read back as a [`KeyRecord`].
fn record(row: &SqliteRow) -> Result<KeyRecord, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(what.to_owned());
    let time = |column: &str| -> Result<_, StoreError> {
        chrono::DateTime::from_timestamp_millis(row.try_get(column)?).ok_or_else(|| corrupt(column))
    };
    let (lease_until, expires_at): (i64, i64) =
        (row.try_get("lease_until")?, row.try_get("expires_at")?);
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let token: String = row.try_get("lease_token")?;
    let key = IdempotencyKey::new(
        row.try_get::<String, _>("scope")?,
        row.try_get::<String, _>("operation")?,
        row.try_get::<String, _>("idem_key")?,
    )
    .map_err(|_| corrupt("key"))?;
    let mut record = KeyRecord::new(
        key,
        row.try_get::<String, _>("state")?.parse()?,
        row.try_get::<String, _>("effects")?.parse()?,
        Fingerprint::try_from(fingerprint.as_slice()).map_err(|_| corrupt("fingerprint"))?,
        LeaseToken(token.parse().map_err(|_| corrupt("lease_token"))?),
    );
    record.lease_remaining = Duration::from_millis(u64::try_from(lease_until - now()).unwrap_or(0));
    record.expired = expires_at <= now();
    record.result = row.try_get("result")?;
    record.reason = row.try_get("reason")?;
    record.recovery_attempts = row.try_get("recovery_attempts")?;
    record.created_at = time("created_at")?;
    record.updated_at = time("updated_at")?;
    record.lease_until = time("lease_until")?;
    record.expires_at = time("expires_at")?;
    record.recovery_point = row.try_get("recovery_point")?;
    record.request = row.try_get("request")?;
    record.progress = row.try_get("progress")?;
    Ok(record)
}

impl Store for MinimalStore {
    type Database = Sqlite;

    async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS keys (
                scope TEXT NOT NULL, operation TEXT NOT NULL, idem_key TEXT NOT NULL,
                state TEXT NOT NULL, effects TEXT NOT NULL, fingerprint BLOB NOT NULL,
                lease_token TEXT NOT NULL, lease_until INTEGER NOT NULL,
                expires_at INTEGER NOT NULL, result BLOB, reason TEXT,
                recovery_attempts INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL,
                updated_at INTEGER NOT NULL, recovery_point TEXT, request BLOB, progress BLOB,
                PRIMARY KEY (scope, operation, idem_key))",
        )
        .execute(&self.pool)
        .await?;
        // The history of each key (`Maintenance::history`); no foreign key: a released key
        // keeps its history.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS key_events (
                id INTEGER PRIMARY KEY, scope TEXT NOT NULL, operation TEXT NOT NULL,
                idem_key TEXT NOT NULL, at INTEGER NOT NULL, kind TEXT NOT NULL, detail TEXT,
                actor TEXT)",
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn insert_pending(&self, row: &PendingRow<'_>) -> Result<Insertion, StoreError> {
        let at = now();
        let inserted = sqlx::query(
            "INSERT INTO keys (scope, operation, idem_key, state, effects, fingerprint,
                lease_token, lease_until, expires_at, created_at, updated_at)
             VALUES (?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT DO NOTHING",
        )
        .bind(row.key.scope())
        .bind(row.key.operation())
        .bind(row.key.key())
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.token.to_string())
        .bind(after(row.lease))
        .bind(after(row.retention))
        .bind(at)
        .bind(at)
        .execute(&self.pool)
        .await?;
        if inserted.rows_affected() == 1 {
            return Ok(Insertion::Inserted);
        }
        Ok(match self.find(row.key).await? {
            Some(existing) => Insertion::Conflict(existing),
            None => Insertion::Vanished,
        })
    }

    async fn find(&self, key: &IdempotencyKey) -> Result<Option<KeyRecord>, StoreError> {
        let row =
            sqlx::query("SELECT * FROM keys WHERE scope = ? AND operation = ? AND idem_key = ?")
                .bind(key.scope())
                .bind(key.operation())
                .bind(key.key())
                .fetch_optional(&self.reader)
                .await?;
        row.as_ref().map(record).transpose()
    }

    async fn find_replay(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let result: Option<Option<Vec<u8>>> = sqlx::query_scalar(
            "SELECT result FROM keys WHERE scope = ? AND operation = ? AND idem_key = ?
               AND state = 'completed' AND expires_at > ? AND fingerprint = ?",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(now())
        .bind(fingerprint.as_bytes().as_slice())
        .fetch_optional(&self.reader)
        .await?;
        Ok(result.map(Option::unwrap_or_default))
    }

    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        let at = now();
        let done = sqlx::query(
            "UPDATE keys SET state = 'pending', effects = ?, fingerprint = ?, lease_token = ?,
                lease_until = ?, expires_at = ?, result = NULL, reason = NULL,
                recovery_attempts = 0, updated_at = ?, recovery_point = NULL, request = NULL,
                progress = NULL
             WHERE scope = ? AND operation = ? AND idem_key = ? AND lease_token = ?
               AND (state = 'failed'
                    OR (state = 'completed' AND expires_at <= ?)
                    OR (state = 'pending' AND effects = 'local' AND lease_until <= ?))",
        )
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.token.to_string())
        .bind(after(row.lease))
        .bind(after(row.retention))
        .bind(at)
        .bind(row.key.scope())
        .bind(row.key.operation())
        .bind(row.key.key())
        .bind(stale.to_string())
        .bind(at)
        .bind(at)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        Ok(self.pool.begin().await?)
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let set = "state = 'completed', result = ?, expires_at = ?, updated_at = ?, request = NULL";
        let binds = vec![
            Bind::Bytes(Some(result.to_vec())),
            Bind::Int(after(retention)),
            Bind::Int(now()),
        ];
        on_held(&mut **tx, set, binds, key, token).await
    }

    async fn release(&self, key: &IdempotencyKey, token: LeaseToken) -> Result<bool, StoreError> {
        let sql = format!("DELETE FROM keys WHERE {WHERE_HELD}");
        let done = sqlx::query(&sql)
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(token.to_string())
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let set = "state = 'needs_review', reason = ?, updated_at = ?";
        let binds = vec![Bind::Text(Some(reason.to_owned())), Bind::Int(now())];
        on_held(&self.pool, set, binds, key, token).await
    }

    async fn extend_lease(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let binds = vec![Bind::Int(after(lease))];
        on_held(&self.pool, "lease_until = ?", binds, key, token).await
    }

    async fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE keys SET lease_token = ?, lease_until = ?, updated_at = ?
             WHERE scope = ? AND operation = ? AND idem_key = ? AND state = 'pending'
               AND lease_token = ? AND lease_until <= ?",
        )
        .bind(fresh.to_string())
        .bind(after(lease))
        .bind(now())
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(stale.to_string())
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Durable steps: two more conditional statements.
impl Journal for MinimalStore {
    async fn save_progress(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        token: LeaseToken,
        progress: &Progress<'_>,
    ) -> Result<bool, StoreError> {
        let set =
            "recovery_point = ?, progress = ?, request = COALESCE(request, ?), updated_at = ?";
        let binds = vec![
            Bind::Text(Some(progress.recovery_point.to_owned())),
            Bind::Bytes(Some(progress.journal.to_vec())),
            Bind::Bytes(progress.request.map(<[u8]>::to_vec)),
            Bind::Int(now()),
        ];
        on_held(&mut **tx, set, binds, key, token).await
    }

    async fn note_unknown(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        let set = "recovery_attempts = recovery_attempts + 1, lease_until = ?, updated_at = ?";
        let binds = vec![Bind::Int(after(retry_after)), Bind::Int(now())];
        on_held(&self.pool, set, binds, key, token).await
    }
}

/// Waiting for a duplicate's original: the provided polling of `find`.
impl CompletionSignal for MinimalStore {}

/// The rows a purge may delete.
const PURGEABLE: &str = "state IN ('completed', 'failed') AND expires_at <= ?";

/// The operator's side: recovery, purge, listing, and the actions on parked keys, each of which
/// writes its row and its history event in one transaction.
impl Maintenance for MinimalStore {
    async fn expired_leases(&self, limit: u32) -> Result<Vec<KeyRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM keys WHERE state = 'pending' AND lease_until <= ?
             ORDER BY lease_until LIMIT ?",
        )
        .bind(now())
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(record).collect()
    }

    async fn complete_recovered(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        reason: &str,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let set = "state = 'completed', result = ?, reason = ?, expires_at = ?, updated_at = ?";
        let binds = vec![
            Bind::Bytes(Some(result.to_vec())),
            Bind::Text(Some(reason.to_owned())),
            Bind::Int(after(retention)),
            Bind::Int(now()),
        ];
        on_held(&self.pool, set, binds, key, token).await
    }

    async fn purge_batch(&self, batch: u32) -> Result<u64, StoreError> {
        // The keys and their histories go together.
        let mut tx = self.pool.begin().await?;
        let at = now();
        let chosen =
            format!("SELECT scope, operation, idem_key FROM keys WHERE {PURGEABLE} LIMIT {batch}");
        sqlx::query(&format!(
            "DELETE FROM key_events WHERE (scope, operation, idem_key) IN ({chosen})"
        ))
        .bind(at)
        .execute(&mut *tx)
        .await?;
        let done = sqlx::query(&format!(
            "DELETE FROM keys WHERE (scope, operation, idem_key) IN ({chosen})"
        ))
        .bind(at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn count_purgeable(&self) -> Result<u64, StoreError> {
        let sql = format!("SELECT COUNT(*) FROM keys WHERE {PURGEABLE}");
        let count: i64 = sqlx::query_scalar(&sql)
            .bind(now())
            .fetch_one(&self.reader)
            .await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn list(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        let after = filter.after();
        let older_than = filter
            .older_than()
            .map(|age| now().saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX)));
        let rows = sqlx::query(
            "SELECT * FROM keys WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR scope = ?2)
               AND (?3 IS NULL OR operation = ?3) AND (?4 IS NULL OR created_at <= ?4)
               AND (?6 IS NULL OR (created_at, scope, operation, idem_key) > (?6, ?7, ?8, ?9))
             ORDER BY created_at, scope, operation, idem_key LIMIT ?5",
        )
        .bind(filter.state().map(KeyState::as_str))
        .bind(filter.scope())
        .bind(filter.operation())
        .bind(older_than)
        .bind(i64::from(filter.limit()))
        // Keyset paging: the rows after the last one of the page before.
        .bind(after.map(|c| c.created_at().timestamp_millis()))
        .bind(after.map(|c| c.key().scope()))
        .bind(after.map(|c| c.key().operation()))
        .bind(after.map(|c| c.key().key()))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(record).collect()
    }

    async fn resolve(
        &self,
        key: &IdempotencyKey,
        resolution: &Resolution,
        note: &OperatorNote,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let result = match resolution {
            Resolution::Completed(bytes) => Some(bytes.clone()),
            _ => None,
        };
        let state = resolution.state().as_str();
        let set = "state = ?, result = ?, reason = ?, expires_at = ?, updated_at = ?";
        let binds = vec![
            Bind::Text(Some(state.to_owned())),
            Bind::Bytes(result),
            Bind::Text(Some(note.reason.clone())),
            Bind::Int(after(retention)),
            Bind::Int(now()),
        ];
        let event = ("resolved", format!("{state}: {}", note.detail()));
        self.on_parked(set, binds, key, note, event).await
    }

    async fn hand_back(
        &self,
        key: &IdempotencyKey,
        note: &OperatorNote,
    ) -> Result<bool, StoreError> {
        let set = "state = 'pending', lease_until = ?, recovery_attempts = 0, reason = ?, \
                   updated_at = ?";
        let binds = vec![
            Bind::Int(now()),
            Bind::Text(Some(note.reason.clone())),
            Bind::Int(now()),
        ];
        let event = ("handed_back", note.detail());
        self.on_parked(set, binds, key, note, event).await
    }

    async fn history(&self, key: &IdempotencyKey, limit: u32) -> Result<Vec<KeyEvent>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM (SELECT * FROM key_events
                WHERE scope = ? AND operation = ? AND idem_key = ? ORDER BY id DESC LIMIT ?)
             ORDER BY id",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let at = chrono::DateTime::from_timestamp_millis(row.try_get("at")?)
                    .ok_or_else(|| StoreError::Corrupt("at".to_owned()))?;
                let kind = row.try_get::<String, _>("kind")?.parse()?;
                let mut event = KeyEvent::new(at, kind);
                event.detail = row.try_get("detail")?;
                event.actor = row.try_get("actor")?;
                Ok(event)
            })
            .collect()
    }

    async fn stats(&self) -> Result<KeyStats, StoreError> {
        let mut stats = KeyStats::default();
        let rows = sqlx::query(
            "SELECT operation, state, COUNT(*) AS n FROM keys
             GROUP BY operation, state ORDER BY operation, state",
        )
        .fetch_all(&self.reader)
        .await?;
        for row in &rows {
            let state = row.try_get::<String, _>("state")?.parse()?;
            let count = u64::try_from(row.try_get::<i64, _>("n")?).unwrap_or(0);
            stats.counts.push(StateCount::new(
                row.try_get::<String, _>("operation")?,
                state,
                count,
            ));
        }
        let oldest: Option<i64> =
            sqlx::query_scalar("SELECT MIN(created_at) FROM keys WHERE state = 'pending'")
                .fetch_one(&self.reader)
                .await?;
        stats.oldest_pending_age =
            oldest.map(|at| Duration::from_millis(u64::try_from(now() - at).unwrap_or(0)));
        stats.expired_leases = self.expired_leases(u32::MAX).await?.len() as u64;
        stats.purgeable = self.count_purgeable().await?;
        Ok(stats)
    }
}

impl MinimalStore {
    /// An operator's change of a parked row, fenced on the `updated_at` the operator saw, and
    /// its history event, in one transaction.
    async fn on_parked(
        &self,
        set: &str,
        binds: Vec<Bind>,
        key: &IdempotencyKey,
        note: &OperatorNote,
        (kind, detail): (&str, String),
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE keys SET {set} WHERE scope = ? AND operation = ? AND idem_key = ?
               AND state = 'needs_review' AND (? IS NULL OR updated_at = ?)"
        );
        let mut update = sqlx::query(&sql);
        for bind in binds {
            update = match bind {
                Bind::Int(value) => update.bind(value),
                Bind::Text(value) => update.bind(value),
                Bind::Bytes(value) => update.bind(value),
            };
        }
        let seen = note.seen.map(|seen| seen.timestamp_millis());
        let mut tx = self.pool.begin().await?;
        let done = update
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(seen)
            .bind(seen)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO key_events (scope, operation, idem_key, at, kind, detail, actor)
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(now())
        .bind(kind)
        .bind(detail)
        .bind(&note.operator)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }
}

/// A purchase run twice under one key: executed once, replayed once.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    use idempotency::{Attempt, Idempotency};
    let store = MinimalStore::new().await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE orders (sku TEXT NOT NULL)")
        .execute(store.pool())
        .await?;
    let idem = Idempotency::new(store.clone());
    let request = serde_json::json!({"sku": "tea"});
    let attempt = Attempt::new(
        IdempotencyKey::new("user-1", "purchase", "k-1")?,
        Fingerprint::of_json(&request)?,
    );
    for _ in 0..2 {
        let outcome = idem
            .run(&attempt, async |tx| {
                sqlx::query("INSERT INTO orders (sku) VALUES ('tea')")
                    .execute(&mut **tx)
                    .await?;
                Ok::<_, sqlx::Error>(serde_json::json!({"order": 1}))
            })
            .await?;
        println!("replayed: {}", outcome.is_replayed());
    }
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(orders, 1);
    assert_eq!(
        KeyState::Completed,
        store.find(attempt.key()).await?.unwrap().state
    );
    Ok(())
}
