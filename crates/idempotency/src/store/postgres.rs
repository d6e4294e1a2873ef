//! PostgreSQL store (feature `postgres`).

use super::history::{self, EventKind, KeyEvent, OperatorNote};
use super::migration::{self, Bookkeeping, Migration};
use super::row::KeyRow;
use super::{millis, Insertion, KeyRecord, LeaseToken, PendingRow, ReservedIn, Store};
use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use sqlx::{
    postgres::{PgArguments, PgQueryResult, PgRow},
    PgConnection, PgPool, Postgres, Row, Transaction,
};
use std::{collections::HashMap, sync::Arc, time::Duration};
use tokio::sync::{oneshot, Notify, OnceCell};

/// A statement with its arguments bound.
type PgQuery<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// The key table's migrations, applied in order by [`Store::migrate`].
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idempotency_keys",
        sql: include_str!("../../migrations/postgres/0001_idempotency_keys.sql"),
    },
    Migration {
        version: 2,
        description: "keys compare byte by byte (COLLATE \"C\")",
        sql: include_str!("../../migrations/postgres/0002_keys_collate_c.sql"),
    },
    Migration {
        version: 3,
        description: "durable steps: recovery point, request, progress",
        sql: include_str!("../../migrations/postgres/0003_durable_steps.sql"),
    },
    Migration {
        version: 4,
        description: "key history: idempotency_key_events",
        sql: include_str!("../../migrations/postgres/0004_key_events.sql"),
    },
    Migration {
        version: 5,
        description: "index the expiry of settled keys only",
        sql: include_str!("../../migrations/postgres/0005_settled_expiry_index.sql"),
    },
];

/// Lock id for `pg_advisory_xact_lock` while migrating ("idem" in ASCII).
const MIGRATION_LOCK: i64 = 0x6964_656d;

/// Where applied migrations are recorded.
const BOOKKEEPING: Bookkeeping = Bookkeeping {
    create_table: "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
        version BIGINT PRIMARY KEY,
        description TEXT NOT NULL,
        applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    find_version: "SELECT version FROM idempotency_schema_migrations WHERE version = $1",
    record_version:
        "INSERT INTO idempotency_schema_migrations (version, description) VALUES ($1, $2)",
    already_applied: migration::never_applied,
    recorded_meanwhile: migration::never_applied,
    rolled_back: migration::never_applied,
};

macro_rules! columns {
    () => {
        "k.scope, k.operation, k.idem_key, k.state, k.effects, k.fingerprint, k.lease_token, \
         GREATEST(0, CEIL(EXTRACT(EPOCH FROM (k.lease_until - now())) * 1000))::BIGINT AS lease_remaining_ms, \
         (k.expires_at <= now()) AS expired, k.result, k.reason, k.recovery_attempts, \
         k.created_at, k.updated_at, k.lease_until, k.expires_at, k.recovery_point, k.request, k.progress"
    };
}

/// The reservation statement; `$9` chooses `synchronous_commit` for its own (autocommit)
/// transaction. It returns a row when it inserted, none on a conflict: the conflicting row is
/// then read by a second statement ([`read_conflict`](super::read_conflict)). Reading it in the
/// same statement (a join on the key) made every first request's statement larger for the
/// sake of duplicates, which mostly read first anyway
/// ([`replays_first`](crate::Idempotency::replays_first)).
const RESERVE: &str = "WITH durability AS (SELECT set_config('synchronous_commit', $9, true) AS level)
    INSERT INTO idempotency_keys
        (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until, expires_at)
    SELECT $1, $2, $3, 'pending', $4, $5, $6,
           now() + $7 * INTERVAL '1 millisecond', now() + $8 * INTERVAL '1 millisecond'
      FROM durability
    ON CONFLICT (scope, operation, idem_key) DO NOTHING
    RETURNING 1 AS inserted";

/// `synchronous_commit` for a reservation: `off` unless it must be flushed on its own
/// ([`PendingRow::must_flush_reservation`], which gives the argument and its proof).
fn reservation_durability(row: &PendingRow<'_>) -> &'static str {
    if row.must_flush_reservation() {
        "on"
    } else {
        "off"
    }
}

/// The single-transaction reservation ([`ReserveInTransaction::reserve_in`](super::ReserveInTransaction::reserve_in)): the INSERT runs under
/// `lock_timeout = $9` (milliseconds), and the transaction's previous `lock_timeout` is put back
/// in the same statement, after the INSERT (each step reads the one before it, which orders
/// them), so the business work keeps the caller's setting.
///
/// The row is inserted already `completed`, without a result: nobody else sees it before the
/// transaction commits, and the transaction commits only after [`Store::complete`] wrote the
/// result into it (a racer waits on the primary key's entry and then reads the committed row, as
/// it would a pending one). Inserted that way the row never enters the pending index, and its
/// completion changes no indexed column: a HOT update, which writes no index entry.
const RESERVE_IN: &str = "WITH before AS (SELECT current_setting('lock_timeout') AS setting),
    waiting AS (SELECT set_config('lock_timeout', $9, true) AS setting FROM before),
    inserted AS (
        INSERT INTO idempotency_keys
            (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until, expires_at)
        SELECT $1, $2, $3, 'completed', $4, $5, $6,
               now() + $7 * INTERVAL '1 millisecond', now() + $8 * INTERVAL '1 millisecond'
          FROM waiting
        ON CONFLICT (scope, operation, idem_key) DO NOTHING
        RETURNING 1
    ),
    restored AS (
        SELECT set_config('lock_timeout', before.setting, true) AS setting
          FROM before, (SELECT count(*) AS rows FROM inserted) AS done
    )
    SELECT EXISTS (SELECT 1 FROM inserted) AS inserted, (SELECT setting FROM restored) AS lock_timeout";

/// Binds `$1`–`$8` of [`RESERVE`], [`RESERVE_IN`] and the take-over: the key, its effects,
/// fingerprint and token, the lease and the retention in milliseconds.
fn bind_pending<'q>(
    query: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    row: &'q PendingRow<'_>,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(row.key.scope())
        .bind(row.key.operation())
        .bind(row.key.key())
        .bind(row.effects.as_str())
        .bind(row.fingerprint.as_bytes().as_slice())
        .bind(row.token.0)
        .bind(row.lease_millis())
        .bind(row.retention_millis())
}

/// `lock_not_available` (55P03): `lock_timeout` ran out.
fn lock_timed_out(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

const FIND: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k WHERE k.scope = $1 AND k.operation = $2 AND k.idem_key = $3"
);

/// Keys in PostgreSQL, sharing the application's pool so the business work and the key's
/// completion commit in one transaction.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{PgStore, Store, Idempotency};
/// let pool = sqlx::PgPool::connect("postgres://shop@127.0.0.1/shop").await?;
/// let store = PgStore::new(pool);
/// store.migrate().await?;
/// let idem = Idempotency::new(store);
/// # Ok(()) }
/// ```
///
/// PostgreSQL store (feature `postgres`).
///
/// The reservation is one statement: `INSERT … ON CONFLICT DO NOTHING` joined with a read of the
/// existing row, so a first request and a duplicate each cost one round trip. It runs in
/// autocommit; under REPEATABLE READ or SERIALIZABLE server defaults a losing insert may fail with
/// SQLSTATE 40001 instead of returning nothing, which is taken as "conflict, read the row".
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// Whether the pool reaches PostgreSQL through a transaction pooler, detected at first use
    /// ([`PgStore::behind_transaction_pooler`]); shared by the clones of this store.
    pooler: Arc<OnceCell<bool>>,
    /// Waiters for completions, and the one listener connection that wakes them (started by the
    /// first [`CompletionSignal::wait_for_completion`](super::CompletionSignal::wait_for_completion)); shared by the clones of this store.
    completions: Arc<Completions>,
    /// Who this store is in the keys' histories ([`with_worker_name`](Self::with_worker_name)).
    actor: Arc<str>,
}

impl PgStore {
    /// A store on an existing pool (the application's own).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            pooler: Arc::default(),
            completions: Arc::default(),
            actor: history::default_actor(),
        }
    }

    /// Names this process in the keys' histories (the actor of the events it writes: reserved,
    /// steps, calls, claims, completions); default `host:pid`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// let store = idempotency::PgStore::connect("postgres://localhost/shop").await?.with_worker_name("web-1");
    /// # Ok(()) }
    /// ```
    pub fn with_worker_name(mut self, name: &str) -> Self {
        self.actor = history::worker_actor(name);
        self
    }

    /// Connects a new pool, without sqlx's ping on every checkout
    /// (`test_before_acquire(false)`). A first request checks out two connections (the
    /// reservation, then the business transaction), so the pings are two of its seven round
    /// trips on PostgreSQL (their cost: `bench/peers --pool tuned`). A connection that
    /// died with the server fails its next statement instead: the request answers 503 ("not
    /// now") and its retry runs on a fresh connection. Give your own pool the same setting.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .test_before_acquire(false)
            .connect(url)
            .await?;
        Ok(Self::new(pool))
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether the pool reaches PostgreSQL through a pooler that hands a session's server
    /// connection to other clients between transactions (PgBouncer's `pool_mode = transaction`),
    /// detected once, at the store's first use, and shared by its clones.
    ///
    /// Behind such a pooler a prepared statement lives on a server connection the client may not
    /// get back: sqlx's named statements (`sqlx_s_1`, …, with or without its statement cache)
    /// collide with those other clients left there, and even an unnamed one is prepared and
    /// executed in two round trips that, outside a transaction, may reach two different server
    /// connections. So the store then runs each statement of its own unnamed
    /// (`persistent(false)`) and inside a transaction (`BEGIN` … `COMMIT` around those that ran
    /// alone), and its waiters for requests in flight poll instead of `LISTEN`ing (a
    /// notification would reach whichever client holds that server connection). Your own
    /// statements on the same pool must do the same: `.persistent(false)`, inside a transaction.
    ///
    /// The detection opens two connections of its own and runs plain `SELECT pg_backend_pid()`
    /// statements (the simple protocol, safe behind any pooler): on a direct connection or
    /// behind a session pooler a session keeps its backend; behind a transaction pooler the
    /// backend of one session, idle between its statements, serves the other session's
    /// transaction, or the first session's next statement runs on another backend.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// use idempotency::PgStore;
    /// // PgBouncer in transaction pooling mode on port 6432.
    /// let store = PgStore::connect("postgres://shop:secret@127.0.0.1:6432/shop").await?;
    /// let pooled = store.behind_transaction_pooler().await?;
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("UPDATE accounts SET held = held + $1")
    ///     .bind(100_i64)
    ///     .persistent(!pooled)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn behind_transaction_pooler(&self) -> Result<bool, StoreError> {
        Ok(self.pooled().await?)
    }

    async fn pooled(&self) -> Result<bool, sqlx::Error> {
        self.pooler
            .get_or_try_init(|| detect_transaction_pooler(&self.pool))
            .await
            .copied()
    }

    /// Runs a statement of the store's own on the pool: alone on a direct connection; behind a
    /// transaction pooler, unnamed and inside a transaction of its own.
    async fn exec(&self, query: PgQuery<'_>) -> Result<PgQueryResult, sqlx::Error> {
        if !self.pooled().await? {
            return query.execute(&self.pool).await;
        }
        let mut tx = self.pool.begin().await?;
        let done = query.persistent(false).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done)
    }

    /// [`exec`](Self::exec) for a statement returning rows.
    async fn rows(&self, query: PgQuery<'_>) -> Result<Vec<PgRow>, sqlx::Error> {
        if !self.pooled().await? {
            return query.fetch_all(&self.pool).await;
        }
        let mut tx = self.pool.begin().await?;
        let rows = query.persistent(false).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// [`rows`](Self::rows) for a statement returning at most one row.
    async fn maybe_row(&self, query: PgQuery<'_>) -> Result<Option<PgRow>, sqlx::Error> {
        Ok(self.rows(query).await?.into_iter().next())
    }

    /// [`rows`](Self::rows) for a statement returning one row.
    async fn row(&self, query: PgQuery<'_>) -> Result<PgRow, sqlx::Error> {
        self.maybe_row(query).await?.ok_or(sqlx::Error::RowNotFound)
    }

    /// Whether a statement run inside the caller's transaction may be named (cached).
    async fn named(&self) -> Result<bool, sqlx::Error> {
        Ok(!self.pooled().await?)
    }
}

/// Whether `pool` reaches PostgreSQL through a transaction pooler ([`PgStore::behind_transaction_pooler`]):
/// two connections of its own, simple-protocol statements only. Three rounds, in case another
/// client took the idle backend in between (PgBouncer hands out the most recently used one first).
async fn detect_transaction_pooler(pool: &PgPool) -> Result<bool, sqlx::Error> {
    use sqlx::{Connection, Executor};
    let options = pool.connect_options();
    let mut first = PgConnection::connect_with(&options).await?;
    let mut second = PgConnection::connect_with(&options).await?;
    let mut pooled = false;
    for _ in 0..3 {
        let before = backend_pid(&mut first).await?;
        second.execute("BEGIN").await?;
        let other = backend_pid(&mut second).await?;
        let after = backend_pid(&mut first).await?;
        second.execute("ROLLBACK").await?;
        if other == before || after != before {
            pooled = true;
            break;
        }
    }
    let (_, _) = (first.close().await, second.close().await);
    if pooled {
        tracing::info!("PostgreSQL is reached through a transaction pooler: unnamed statements in transactions, waiters poll");
    }
    Ok(pooled)
}

/// `pg_backend_pid()`, by the simple protocol (a statement given as text, without arguments).
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    use sqlx::Executor;
    conn.fetch_one("SELECT pg_backend_pid()").await?.try_get(0)
}

/// SQLSTATE 40001 (serialization failure) or 40P01 (deadlock): the statement lost a race.
pub(crate) fn lost_race(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))
}

fn record(row: &PgRow) -> Result<KeyRecord, StoreError> {
    KeyRow {
        scope: row.try_get("scope")?,
        operation: row.try_get("operation")?,
        idem_key: row.try_get("idem_key")?,
        state: row.try_get("state")?,
        effects: row.try_get("effects")?,
        fingerprint: row.try_get("fingerprint")?,
        lease_token: row.try_get("lease_token")?,
        lease_remaining_ms: row.try_get("lease_remaining_ms")?,
        expired: row.try_get("expired")?,
        result: row.try_get("result")?,
        reason: row.try_get("reason")?,
        recovery_attempts: row.try_get::<i32, _>("recovery_attempts")?.into(),
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        lease_until: row.try_get("lease_until")?,
        expires_at: row.try_get("expires_at")?,
        recovery_point: row.try_get("recovery_point")?,
        request: row.try_get("request")?,
        progress: row.try_get("progress")?,
    }
    .into_record()
}

impl Store for PgStore {
    type Database = Postgres;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        migration::apply_pending::<Postgres>(&mut tx, &BOOKKEEPING, MIGRATIONS).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert_pending(&self, row: &PendingRow<'_>) -> Result<Insertion, StoreError> {
        let reserve = bind_pending(sqlx::query(RESERVE), row).bind(reservation_durability(row));
        let answer = if row.records_history() {
            self.reserve_recorded(row.key, reserve).await
        } else {
            self.maybe_row(reserve).await
        };
        match answer {
            Ok(Some(_)) => Ok(Insertion::Inserted),
            // A conflict: the row, as committed now.
            Ok(None) => super::read_conflict(self, row.key).await,
            Err(e) if lost_race(&e) => super::read_conflict(self, row.key).await,
            Err(e) => Err(e.into()),
        }
    }

    async fn find(&self, key: &IdempotencyKey) -> Result<Option<KeyRecord>, StoreError> {
        self.maybe_row(
            sqlx::query(FIND)
                .bind(key.scope())
                .bind(key.operation())
                .bind(key.key()),
        )
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
        let row = self
            .maybe_row(
                sqlx::query(
                    "SELECT result FROM idempotency_keys
                      WHERE scope = $1 AND operation = $2 AND idem_key = $3
                        AND state = 'completed' AND expires_at > now() AND fingerprint = $4",
                )
                .bind(key.scope())
                .bind(key.operation())
                .bind(key.key())
                .bind(fingerprint.as_bytes().as_slice()),
            )
            .await?;
        let result = row
            .map(|row| row.try_get::<Option<Vec<u8>>, _>("result"))
            .transpose()?;
        Ok(result.map(Option::unwrap_or_default))
    }

    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        let take_over = sqlx::query(
            "UPDATE idempotency_keys SET
                state = 'pending', effects = $4, fingerprint = $5, lease_token = $6,
                lease_until = now() + $7 * INTERVAL '1 millisecond',
                expires_at = now() + $8 * INTERVAL '1 millisecond',
                result = NULL, reason = NULL, recovery_attempts = 0,
                recovery_point = NULL, request = NULL, progress = NULL,
                created_at = CASE WHEN state = 'pending' THEN created_at ELSE now() END,
                updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idem_key = $3 AND lease_token = $9
               AND (state = 'failed'
                    OR (state = 'completed' AND expires_at <= now())
                    OR (state = 'pending' AND effects = 'local' AND lease_until <= now()))",
        );
        let take_over = bind_pending(take_over, row).bind(stale.0);
        let done = if row.records_history() {
            self.recorded(row.key, EventKind::Reserved, None, true, take_over)
                .await
        } else {
            self.exec(take_over).await.map(|done| done.rows_affected())
        };
        match done {
            Ok(done) => Ok(done == 1),
            // Someone else changed the row first; the caller reads it again.
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        let pool = self.pool.clone();
        super::uncancellable(async move { Ok(pool.begin().await?) }).await
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        // A pending row, or the row this very transaction reserved (inserted `completed`
        // without a result, see RESERVE_IN): that one keeps the expiry it was inserted with (the
        // transaction's start plus the retention), so no indexed column changes.
        let done = sqlx::query(
            "UPDATE idempotency_keys SET
                state = 'completed', result = $5, request = NULL, updated_at = clock_timestamp(),
                expires_at = CASE WHEN state = 'pending'
                                  THEN clock_timestamp() + $6 * INTERVAL '1 millisecond'
                                  ELSE expires_at END
             WHERE scope = $1 AND operation = $2 AND idem_key = $3 AND lease_token = $4
               AND (state = 'pending'
                    OR (state = 'completed' AND result IS NULL
                        AND xmin = pg_current_xact_id()::xid))",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0)
        .bind(result)
        .bind(millis(retention))
        .persistent(self.named().await?)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &IdempotencyKey, token: LeaseToken) -> Result<bool, StoreError> {
        let done = self.exec(release_statement(key, token)).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let done = self.exec(park_statement(key, token, reason)).await?;
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
        tx: &mut Transaction<'static, Postgres>,
        key: &IdempotencyKey,
        kind: EventKind,
        detail: Option<&str>,
    ) -> Result<(), StoreError> {
        let detail = detail.map(|d| history::bounded(d, history::DETAIL_MAX_BYTES));
        let named = self.named().await?;
        append(tx, key, kind, detail, &self.actor, true, named).await?;
        Ok(())
    }

    async fn extend_lease(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done = self.exec(sqlx::query(
            "UPDATE idempotency_keys SET lease_until = now() + $5 * INTERVAL '1 millisecond'
             WHERE scope = $1 AND operation = $2 AND idem_key = $3
               AND state = 'pending' AND lease_token = $4",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0)
        .bind(millis(lease)))
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let claim = sqlx::query(
            "UPDATE idempotency_keys SET
                lease_token = $5, lease_until = now() + $6 * INTERVAL '1 millisecond',
                updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idem_key = $3
               AND state = 'pending' AND lease_token = $4 AND lease_until <= now()",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(stale.0)
        .bind(fresh.0)
        .bind(millis(lease));
        // Recorded where the key records a history (external, or a history already begun).
        match self
            .recorded(key, EventKind::Claimed, None, false, claim)
            .await
        {
            Ok(done) => Ok(done == 1),
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
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

impl super::Journal for PgStore {
    async fn note_unknown(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        self.conditional(
            sqlx::query(
                "UPDATE idempotency_keys SET
                    recovery_attempts = recovery_attempts + 1,
                    lease_until = now() + $5 * INTERVAL '1 millisecond', updated_at = now()
                 WHERE scope = $1 AND operation = $2 AND idem_key = $3
                   AND state = 'pending' AND lease_token = $4",
            )
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(token.0)
            .bind(millis(retry_after)),
        )
        .await
    }

    async fn save_progress(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        key: &IdempotencyKey,
        token: LeaseToken,
        progress: &super::Progress<'_>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET
                recovery_point = $5, progress = $6, request = COALESCE(request, $7),
                updated_at = clock_timestamp()
             WHERE scope = $1 AND operation = $2 AND idem_key = $3
               AND state = 'pending' AND lease_token = $4",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0)
        .bind(progress.recovery_point)
        .bind(progress.journal)
        .bind(progress.request)
        .persistent(self.named().await?)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

impl super::ReserveInTransaction for PgStore {
    async fn reserve_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        row: &PendingRow<'_>,
        wait: Duration,
    ) -> Result<ReservedIn, StoreError> {
        // 0 would mean "wait forever" to PostgreSQL.
        let wait_ms = millis(wait).max(1).to_string();
        let answer = bind_pending(sqlx::query(RESERVE_IN), row)
            .bind(wait_ms)
            .persistent(self.named().await?)
            .fetch_one(&mut **tx)
            .await
            .and_then(|answer| answer.try_get::<bool, _>("inserted"));
        match answer {
            Ok(true) => Ok(ReservedIn::Inserted),
            Ok(false) => Ok(ReservedIn::Exists),
            Err(e) if lock_timed_out(&e) => Ok(ReservedIn::Busy),
            // REPEATABLE READ or SERIALIZABLE: the row committed after our snapshot.
            Err(e) if lost_race(&e) => Ok(ReservedIn::Exists),
            Err(e) => Err(e.into()),
        }
    }
}

impl super::CompletionSignal for PgStore {
    async fn wait_for_completion(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        timeout: Duration,
    ) -> Result<super::Awaited, StoreError> {
        self.completions.wait(self, key, fingerprint, timeout).await
    }

    /// `NOTIFY` on the store's channel with a short hash of the key as payload, in a
    /// transaction of its own committed without waiting for its WAL flush
    /// (`synchronous_commit = off`; a notification need not survive a crash, and waiters poll
    /// anyway).
    ///
    /// Not inside the completing transaction: PostgreSQL serialises the commits of transactions
    /// that notified (a database-wide lock held through the commit's WAL flush), which cut the
    /// commit rate of 32 concurrent writers by about three (pgbench on this machine), for every
    /// completion whether anyone waits or not.
    async fn notify_settled(&self, key: &IdempotencyKey) -> Result<(), StoreError> {
        self.exec(
            sqlx::query(
                "WITH durability AS (SELECT set_config('synchronous_commit', 'off', true) AS level)
             SELECT pg_notify($1, $2)::TEXT AS notified FROM durability",
            )
            .bind(COMPLETION_CHANNEL)
            .bind(completion_payload(key)),
        )
        .await?;
        Ok(())
    }
}

// --- Maintenance: recovery, purge, listing, resolution, statistics ------------------------------

impl PgStore {
    /// Appends an event of `kind` (actor: this store) to the key's history, then runs `change`,
    /// in one transaction that commits only if `change` changed a row: the history never
    /// disagrees with the row. `always`: record it whatever the key; otherwise only where the
    /// key is external or its history has begun. Returns the rows changed.
    async fn recorded(
        &self,
        key: &IdempotencyKey,
        kind: EventKind,
        detail: Option<&str>,
        always: bool,
        change: PgQuery<'_>,
    ) -> Result<u64, sqlx::Error> {
        let named = self.named().await?;
        let mut tx = self.pool.begin().await?;
        append(&mut tx, key, kind, detail, &self.actor, always, named).await?;
        let changed = change.persistent(named).execute(&mut *tx).await?;
        if changed.rows_affected() == 0 {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
        Ok(changed.rows_affected())
    }

    /// The reservation of a key that records a history: the reserving statement and, if it
    /// inserted the row, a `reserved` event, in one transaction.
    async fn reserve_recorded(
        &self,
        key: &IdempotencyKey,
        reserve: PgQuery<'_>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        let named = self.named().await?;
        let mut tx = self.pool.begin().await?;
        let answer = reserve.persistent(named).fetch_optional(&mut *tx).await?;
        if answer.is_some() {
            append(
                &mut tx,
                key,
                EventKind::Reserved,
                None,
                &self.actor,
                true,
                named,
            )
            .await?;
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        Ok(answer)
    }
}

/// Deletes the row of `key` where it is pending with `token`.
fn release_statement(key: &IdempotencyKey, token: LeaseToken) -> PgQuery<'_> {
    sqlx::query(
        "DELETE FROM idempotency_keys
         WHERE scope = $1 AND operation = $2 AND idem_key = $3
           AND state = 'pending' AND lease_token = $4",
    )
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(token.0)
}

/// Parks the row of `key` where it is pending with `token`.
fn park_statement<'q>(key: &'q IdempotencyKey, token: LeaseToken, reason: &'q str) -> PgQuery<'q> {
    sqlx::query(
        "UPDATE idempotency_keys SET state = 'needs_review', reason = $5, updated_at = now()
         WHERE scope = $1 AND operation = $2 AND idem_key = $3
           AND state = 'pending' AND lease_token = $4",
    )
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(token.0)
    .bind(reason)
}

/// Appends an event to the history of `key` inside `tx`, at the transaction's `now()`:
/// `always`, or only where the key is external or its history has begun.
async fn append(
    tx: &mut Transaction<'_, Postgres>,
    key: &IdempotencyKey,
    kind: EventKind,
    detail: Option<&str>,
    actor: &str,
    always: bool,
    named: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
         SELECT $1, $2, $3, now(), $4, $5, $6
          WHERE $7
             OR EXISTS (SELECT 1 FROM idempotency_keys
                         WHERE scope = $1 AND operation = $2 AND idem_key = $3
                           AND effects = 'external')
             OR EXISTS (SELECT 1 FROM idempotency_key_events
                         WHERE scope = $1 AND operation = $2 AND idem_key = $3)",
    )
    .bind(key.scope())
    .bind(key.operation())
    .bind(key.key())
    .bind(kind.as_str())
    .bind(detail)
    .bind(actor)
    .bind(always)
    .persistent(named)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The fence of an operator action on the row it saw: no `seen` (a NULL parameter), or the
/// row's `updated_at` equals it at millisecond precision (both truncated, as the other backends
/// compare).
macro_rules! seen_matches {
    ($param:literal) => {
        concat!(
            "(",
            $param,
            "::BIGINT IS NULL OR (extract(epoch FROM date_trunc('milliseconds', updated_at)) * 1000)::BIGINT = ",
            $param,
            ")"
        )
    };
}

const EXPIRED_LEASES: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k WHERE k.state = 'pending' AND k.lease_until <= now()
      ORDER BY k.lease_until, k.scope, k.operation, k.idem_key LIMIT $1"
);

const LIST: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idempotency_keys k
      WHERE ($1::TEXT IS NULL OR k.state = $1)
        AND ($2::TEXT IS NULL OR k.scope = $2)
        AND ($3::TEXT IS NULL OR k.operation = $3)
        AND ($4::BIGINT IS NULL OR k.created_at <= now() - $4 * INTERVAL '1 millisecond')
        AND ($6::TIMESTAMPTZ IS NULL
             OR (k.created_at, k.scope, k.operation, k.idem_key) > ($6, $7::TEXT, $8::TEXT, $9::TEXT))
      ORDER BY k.created_at, k.scope, k.operation, k.idem_key LIMIT $5"
);

impl PgStore {
    /// Runs a conditional statement; a serialization failure or deadlock (possible under a
    /// SERIALIZABLE server default) means another session changed the row first: `Ok(false)`.
    async fn conditional(&self, query: PgQuery<'_>) -> Result<bool, StoreError> {
        match self.exec(query).await {
            Ok(done) => Ok(done.rows_affected() == 1),
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

impl super::Maintenance for PgStore {
    async fn expired_leases(&self, limit: u32) -> Result<Vec<KeyRecord>, StoreError> {
        self.rows(sqlx::query(EXPIRED_LEASES).bind(i64::from(limit)))
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
        let complete = sqlx::query(
            "UPDATE idempotency_keys SET
                state = 'completed', result = $5, reason = $6, updated_at = now(),
                expires_at = now() + $7 * INTERVAL '1 millisecond'
             WHERE scope = $1 AND operation = $2 AND idem_key = $3
               AND state = 'pending' AND lease_token = $4",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.key())
        .bind(token.0)
        .bind(result)
        .bind(reason)
        .bind(millis(retention));
        let detail = Some(history::bounded(reason, history::DETAIL_MAX_BYTES));
        match self
            .recorded(key, EventKind::Completed, detail, false, complete)
            .await
        {
            Ok(done) => Ok(done == 1),
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn purge_batch(&self, batch: u32) -> Result<u64, StoreError> {
        // `= ANY (ARRAY(…))` runs the inner SELECT once (an InitPlan): it locks at most `batch`
        // expired rows, skipping rows other sessions hold (a concurrent purge or take-over) and
        // re-checking its condition on the latest row version; the DELETE then fetches exactly
        // those rows by ctid (a TID scan) and checks the condition again. Locked rows cannot move
        // within the statement. Not chosen: `IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)` may be
        // rescanned and delete more than `n` rows; a join on a CTE was planned as a hash join over
        // the whole table; an ORDER BY sorts every expired row when the planner picks a bitmap
        // scan (as it does before the table is analysed). Each is O(table) per batch.
        // The keys' histories go in the same statement.
        let done = self
            .row(
                sqlx::query(
                    "WITH deleted AS (
                        DELETE FROM idempotency_keys
                         WHERE ctid = ANY (ARRAY(
                             SELECT ctid FROM idempotency_keys
                             WHERE state IN ('completed', 'failed') AND expires_at <= now()
                             LIMIT $1
                             FOR UPDATE SKIP LOCKED))
                           AND state IN ('completed', 'failed') AND expires_at <= now()
                        RETURNING scope, operation, idem_key),
                     events AS (
                        DELETE FROM idempotency_key_events e USING deleted d
                         WHERE e.scope = d.scope AND e.operation = d.operation
                           AND e.idem_key = d.idem_key)
                     SELECT count(*) AS n FROM deleted",
                )
                .bind(i64::from(batch)),
            )
            .await;
        let deleted = match done {
            Ok(row) => row.try_get::<i64, _>("n")?.max(0) as u64,
            Err(e) if lost_race(&e) => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        if deleted < u64::from(batch) {
            // The last batch of this purge: sweep the orphaned histories too.
            self.exec(
                sqlx::query(concat!(
                    "DELETE FROM idempotency_key_events WHERE id = ANY (ARRAY(",
                    history::orphaned_events!("now() - INTERVAL '1 millisecond' * $2", "$1"),
                    "))"
                ))
                .bind(i64::from(batch))
                .bind(millis(history::ORPHAN_RETENTION)),
            )
            .await
            .or_else(|e| {
                if lost_race(&e) {
                    Ok(Default::default())
                } else {
                    Err(e)
                }
            })?;
        }
        Ok(deleted)
    }

    async fn count_purgeable(&self) -> Result<u64, StoreError> {
        let count: i64 = self
            .row(sqlx::query(
                "SELECT count(*) AS n FROM idempotency_keys
                 WHERE state IN ('completed', 'failed') AND expires_at <= now()",
            ))
            .await?
            .try_get("n")?;
        Ok(count.max(0) as u64)
    }

    async fn list(&self, filter: &super::KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        let after = filter.after.as_ref();
        self.rows(
            sqlx::query(LIST)
                .bind(filter.state.map(|s| s.as_str()))
                .bind(filter.scope.as_deref())
                .bind(filter.operation.as_deref())
                .bind(filter.older_than.map(millis))
                .bind(i64::from(filter.limit))
                .bind(after.map(|c| c.created_at()))
                .bind(after.map(|c| c.key().scope()))
                .bind(after.map(|c| c.key().operation()))
                .bind(after.map(|c| c.key().key())),
        )
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
        // One statement: the row and its event are written together or not at all.
        self.conditional(
            sqlx::query(concat!(
                "WITH changed AS (
                    UPDATE idempotency_keys SET
                        state = $4, result = $5, reason = $6, updated_at = now(),
                        expires_at = now() + $7 * INTERVAL '1 millisecond'
                     WHERE scope = $1 AND operation = $2 AND idem_key = $3
                       AND state = 'needs_review' AND ",
                seen_matches!("$8"),
                " RETURNING scope, operation, idem_key)
                 INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
                 SELECT scope, operation, idem_key, now(), 'resolved', $9, $10 FROM changed"
            ))
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(state)
            .bind(result)
            .bind(note.reason.as_str())
            .bind(millis(retention))
            .bind(note.seen_millis())
            .bind(history::resolved_detail(state, note))
            .bind(note.actor()),
        )
        .await
    }

    async fn hand_back(
        &self,
        key: &IdempotencyKey,
        note: &OperatorNote,
    ) -> Result<bool, StoreError> {
        self.conditional(
            sqlx::query(concat!(
                "WITH changed AS (
                    UPDATE idempotency_keys SET
                        state = 'pending', lease_until = now(), recovery_attempts = 0,
                        reason = $4, updated_at = now()
                     WHERE scope = $1 AND operation = $2 AND idem_key = $3
                       AND state = 'needs_review' AND ",
                seen_matches!("$5"),
                " RETURNING scope, operation, idem_key)
                 INSERT INTO idempotency_key_events (scope, operation, idem_key, at, kind, detail, actor)
                 SELECT scope, operation, idem_key, now(), 'handed_back', $6, $7 FROM changed"
            ))
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(note.reason.as_str())
            .bind(note.seen_millis())
            .bind(history::handed_back_detail(note))
            .bind(note.actor()),
        )
        .await
    }

    async fn history(&self, key: &IdempotencyKey, limit: u32) -> Result<Vec<KeyEvent>, StoreError> {
        self.rows(
            sqlx::query(
                "SELECT at, kind, detail, actor FROM (
                    SELECT id, at, kind, detail, actor FROM idempotency_key_events
                     WHERE scope = $1 AND operation = $2 AND idem_key = $3
                     ORDER BY id DESC LIMIT $4) newest
                 ORDER BY id",
            )
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.key())
            .bind(i64::from(limit)),
        )
        .await?
        .iter()
        .map(|row| {
            history::event(
                row.try_get("at")?,
                row.try_get("kind")?,
                row.try_get("detail")?,
                row.try_get("actor")?,
            )
        })
        .collect()
    }

    async fn stats(&self) -> Result<super::KeyStats, StoreError> {
        let rows = self
            .rows(sqlx::query(
                "SELECT operation, state, count(*) AS n FROM idempotency_keys
             GROUP BY operation, state ORDER BY operation, state",
            ))
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
        let summary = self
            .row(sqlx::query(
                "SELECT
                (SELECT CEIL(EXTRACT(EPOCH FROM (now() - min(created_at))) * 1000)::BIGINT
                   FROM idempotency_keys WHERE state = 'pending') AS oldest_pending_ms,
                (SELECT count(*) FROM idempotency_keys
                  WHERE state = 'pending' AND lease_until <= now()) AS expired_leases,
                (SELECT count(*) FROM idempotency_keys
                  WHERE state IN ('completed', 'failed') AND expires_at <= now()) AS purgeable",
            ))
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

// --- Waiting for completions: LISTEN/NOTIFY -------------------------------------------------------

/// The channel [`CompletionSignal::notify_settled`](super::CompletionSignal::notify_settled) notifies on (after the commit that completed a key, or
/// its release), and the store's waiters listen on. The payload is [`completion_payload`] of the
/// key.
pub(crate) const COMPLETION_CHANNEL: &str = "idempotency_completed";

/// How often a waiter reads the key while the listener runs, as a safety net: a completion by a
/// process that does not notify (the recovery job, an operator's resolution, a crash between the
/// commit and the notification) sends none, and one sent while the listener reconnected is lost.
pub(crate) const NOTIFIED_POLL: Duration = Duration::from_millis(100);

/// The payload notified when `key` completes: 32 hex digits of the SHA-256 of its three parts
/// (length-prefixed), short and free of the key's own characters. Two keys sharing a payload only
/// cost their waiters one extra read.
pub(crate) fn completion_payload(key: &IdempotencyKey) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for part in [key.scope(), key.operation(), key.key()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex::encode(&hash.finalize()[..16])
}

/// The waiters of one store (and its clones), by payload, and the listener task that wakes them.
#[derive(Default)]
struct Completions {
    state: std::sync::Mutex<Listening>,
}

#[derive(Default)]
struct Listening {
    /// Per payload: the waiters' wake-up, and how many wait on it.
    waiters: HashMap<String, (Arc<Notify>, usize)>,
    listener: ListenerState,
    /// Dropped with the store: stops the listener task.
    _stop: Option<oneshot::Sender<()>>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ListenerState {
    /// Not started, or stopped after a failure (the next waiter starts it again).
    #[default]
    Idle,
    /// Connecting and subscribing: waiters poll as without a listener.
    Starting,
    /// Subscribed: notifications wake the waiters.
    Listening,
}

impl std::fmt::Debug for Completions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock().map(|s| (s.listener, s.waiters.len()));
        let mut debug = f.debug_struct("Completions");
        if let Ok((listener, waited)) = state {
            debug
                .field("listener", &listener)
                .field("keys_waited_for", &waited);
        }
        debug.finish()
    }
}

/// One waiter's subscription to a payload; unsubscribes on drop.
struct Subscription<'c> {
    completions: &'c Completions,
    payload: String,
    notify: Arc<Notify>,
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut state = self.completions.lock();
        if let Some((_, count)) = state.waiters.get_mut(&self.payload) {
            *count -= 1;
            if *count == 0 {
                state.waiters.remove(&self.payload);
            }
        }
    }
}

impl Completions {
    fn lock(&self) -> std::sync::MutexGuard<'_, Listening> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn subscribe(&self, payload: String) -> Subscription<'_> {
        let mut state = self.lock();
        let entry = state
            .waiters
            .entry(payload.clone())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        let notify = entry.0.clone();
        Subscription {
            completions: self,
            payload,
            notify,
        }
    }

    /// Wakes the waiters of `payload` (all of them for `None`: notifications may have been lost).
    fn wake(&self, payload: Option<&str>) {
        let state = self.lock();
        match payload {
            Some(payload) => {
                if let Some((notify, _)) = state.waiters.get(payload) {
                    notify.notify_waiters();
                }
            }
            None => state
                .waiters
                .values()
                .for_each(|(notify, _)| notify.notify_waiters()),
        }
    }

    fn set_listener(&self, listener: ListenerState) {
        self.lock().listener = listener;
    }

    /// Starts the listener task unless it runs or is starting; returns whether it listens now.
    fn ensure_listening(self: &Arc<Self>, pool: &PgPool) -> bool {
        let mut state = self.lock();
        match state.listener {
            ListenerState::Listening => return true,
            ListenerState::Starting => return false,
            ListenerState::Idle => {}
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let (stop_tx, stop_rx) = oneshot::channel();
        state.listener = ListenerState::Starting;
        state._stop = Some(stop_tx);
        drop(state);
        runtime.spawn(listen(Arc::downgrade(self), pool.clone(), stop_rx));
        false
    }

    /// [`CompletionSignal::wait_for_completion`](super::CompletionSignal::wait_for_completion) for PostgreSQL: subscribe first, then read the key (a
    /// completion that committed before the subscription is seen by that read), then sleep until
    /// a notification for the key, the safety-net poll, the lease's end or the deadline.
    async fn wait(
        self: &Arc<Self>,
        store: &PgStore,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        timeout: Duration,
    ) -> Result<super::Awaited, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let subscription = self.subscribe(completion_payload(key));
        let mut pause = super::POLL_FIRST;
        loop {
            // Behind a transaction pooler a LISTEN would be left on a server connection other
            // clients get: poll.
            let listening = !store.pooled().await? && self.ensure_listening(&store.pool);
            let notified = subscription.notify.notified();
            tokio::pin!(notified);
            // Registered before the read: a notification from here on wakes this waiter.
            notified.as_mut().enable();
            let record = store.find(key).await?;
            let lease = record.as_ref().map(|record| record.lease_remaining);
            if let Some(done) = super::awaited(record, fingerprint) {
                return Ok(done);
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(super::Awaited::TimedOut);
            }
            // Without a listener (yet), poll as the provided implementation does.
            let poll = if listening { NOTIFIED_POLL } else { pause };
            pause = (pause * 2).min(super::POLL_MAX);
            let sleep = super::next_look(poll, lease, deadline);
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }
}

/// The listener task: one connection, `LISTEN` on [`COMPLETION_CHANNEL`], each notification
/// waking the waiters of its payload. It ends when the store is dropped (or its pool closed); on
/// a failure it marks itself idle and the next waiter starts another.
async fn listen(
    completions: std::sync::Weak<Completions>,
    pool: PgPool,
    mut stop: oneshot::Receiver<()>,
) {
    let started = async {
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
        listener.listen(COMPLETION_CHANNEL).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    let mut listener = tokio::select! {
        _ = &mut stop => return,
        started = started => match started {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "could not LISTEN for idempotency completions; waiters poll");
                if let Some(completions) = completions.upgrade() {
                    completions.set_listener(ListenerState::Idle);
                }
                return;
            }
        },
    };
    match completions.upgrade() {
        Some(completions) => {
            completions.set_listener(ListenerState::Listening);
            // Waiters that read the key before the LISTEN took effect read it again.
            completions.wake(None);
        }
        None => return,
    }
    loop {
        let received = tokio::select! {
            _ = &mut stop => return,
            received = listener.try_recv() => received,
        };
        let Some(completions) = completions.upgrade() else {
            return;
        };
        match received {
            Ok(Some(notification)) => completions.wake(Some(notification.payload())),
            // The connection was lost (the next receive reconnects and subscribes again): what
            // was notified meanwhile is lost, so every waiter reads its key again.
            Ok(None) => completions.wake(None),
            Err(error) => {
                tracing::warn!(%error, "idempotency completion listener stopped; waiters poll");
                completions.set_listener(ListenerState::Idle);
                completions.wake(None);
                return;
            }
        }
    }
}

// --- Failure counters: one upsert per failure ----------------------------------------------------

/// How many times a failure count is tried again after a serialization failure (a server whose
/// default isolation is REPEATABLE READ or SERIALIZABLE, where an upsert that meets a row changed
/// after its snapshot fails instead of waiting; nothing was written, so it counts once when
/// tried again).
const FAILURE_COUNT_ATTEMPTS: u32 = 64;

/// [`Store::count_failure`]: inserts the counter at 1, or adds 1 to it (back to 1 when it was
/// past its retention), and returns the count. `ON CONFLICT DO UPDATE` locks the row, so
/// concurrent upserts queue on it and each adds its own 1 to the latest count.
const COUNT_FAILURE: &str = "INSERT INTO idempotency_keys AS k
        (scope, operation, idem_key, state, effects, fingerprint, lease_token, lease_until,
         expires_at, result, recovery_attempts)
    VALUES ($1, $2, $3, 'completed', 'local', $4, $5, now(),
            now() + $6 * INTERVAL '1 millisecond', $7, 1)
    ON CONFLICT (scope, operation, idem_key) DO UPDATE SET
        recovery_attempts = CASE WHEN k.expires_at <= now() THEN 1
                                 ELSE k.recovery_attempts + 1 END,
        state = 'completed', fingerprint = EXCLUDED.fingerprint, result = EXCLUDED.result,
        updated_at = now(), expires_at = EXCLUDED.expires_at
    RETURNING recovery_attempts";

impl PgStore {
    /// [`Store::count_failure`] in one statement ([`COUNT_FAILURE`]).
    async fn upsert_failure(
        &self,
        counter: &PendingRow<'_>,
        result: &[u8],
    ) -> Result<u32, StoreError> {
        for _ in 0..FAILURE_COUNT_ATTEMPTS {
            let count = sqlx::query(COUNT_FAILURE)
                .bind(counter.key.scope())
                .bind(counter.key.operation())
                .bind(counter.key.key())
                .bind(counter.fingerprint.as_bytes().as_slice())
                .bind(counter.token.0)
                .bind(counter.retention_millis())
                .bind(result);
            match self.row(count).await {
                Ok(row) => return Ok(row.try_get::<i32, _>("recovery_attempts")?.max(0) as u32),
                Err(e) if lost_race(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention(FAILURE_COUNT_ATTEMPTS))
    }

    /// [`Store::failure_count`]: the counter's count, 0 when it is missing or expired.
    async fn read_failure_count(&self, counter: &IdempotencyKey) -> Result<u32, StoreError> {
        let row = self
            .maybe_row(
                sqlx::query(
                    "SELECT recovery_attempts FROM idempotency_keys
                      WHERE scope = $1 AND operation = $2 AND idem_key = $3
                        AND expires_at > now()",
                )
                .bind(counter.scope())
                .bind(counter.operation())
                .bind(counter.key()),
            )
            .await?;
        let count = row
            .map(|row| row.try_get::<i32, _>("recovery_attempts"))
            .transpose()?;
        Ok(count.unwrap_or(0).max(0) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::{completion_payload, PgStore, COMPLETION_CHANNEL};
    use crate::{store::CompletionSignal, IdempotencyKey};
    use std::time::Duration;

    #[test]
    fn payloads_are_short_and_differ_by_key() {
        let a = IdempotencyKey::new("alice", "purchase", "k-1").unwrap();
        let b = IdempotencyKey::new("alice", "purchase", "k-2").unwrap();
        assert_eq!(completion_payload(&a).len(), 32);
        assert_ne!(completion_payload(&a), completion_payload(&b));
    }

    /// `notify_settled` reaches a `LISTEN`er on the store's channel with the key's payload.
    #[tokio::test]
    async fn notify_settled_reaches_a_listener() {
        let Some(url) = test_support::fresh_postgres_url().await else {
            return;
        };
        let store = PgStore::connect(&url).await.unwrap();
        let mut listener = sqlx::postgres::PgListener::connect(&url).await.unwrap();
        listener.listen(COMPLETION_CHANNEL).await.unwrap();
        let key = IdempotencyKey::new("alice", "pay", "k-1").unwrap();
        store.notify_settled(&key).await.unwrap();
        let notification = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("a notification")
            .unwrap();
        assert_eq!(notification.payload(), completion_payload(&key));
    }
}
