//! The storage contract, the rows it keeps, and one implementation per database.
//!
//! The [`protocol`](crate::protocol) decides; a [`Store`] only runs the statements. Every method
//! that changes a row is *conditional*: it names the lease token it expects, so a stale worker, a
//! recovery job and a retry can never both act on one key.

pub(crate) mod failures;
pub(crate) mod history;
pub(crate) mod maintenance;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod migration;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub(crate) mod postgres;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod row;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub(crate) mod sqlite;

pub use crate::error::is_unavailable_error;
pub use maintenance::Maintenance;
pub(crate) use maintenance::Resolution;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) use maintenance::{KeyFilter, KeyStats, StateCount};
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use chrono::{DateTime, Utc};
use std::{fmt, future::Future, str::FromStr, time::Duration};
use uuid::Uuid;

/// The life of a key: `pending` → `completed`, or back to nothing (released), or `needs_review`
/// (parked for a human) → `completed` / `failed`.
///
/// ```
/// use idempotency::store::KeyState;
/// assert_eq!("needs_review".parse::<KeyState>().unwrap(), KeyState::NeedsReview);
/// assert_eq!(KeyState::Completed.as_str(), "completed");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyState {
    /// Reserved; the work is running (or its worker died and the lease will expire).
    Pending,
    /// The work committed together with its result; replays return that result.
    Completed,
    /// Parked: an external effect may or may not have happened; never released automatically.
    NeedsReview,
    /// Resolved by an operator as not done; the key may be reserved again.
    Failed,
}

impl KeyState {
    /// All states, in life order.
    pub const ALL: [KeyState; 4] = [
        KeyState::Pending,
        KeyState::Completed,
        KeyState::NeedsReview,
        KeyState::Failed,
    ];

    /// The name stored in the `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Pending => "pending",
            KeyState::Completed => "completed",
            KeyState::NeedsReview => "needs_review",
            KeyState::Failed => "failed",
        }
    }
}

impl fmt::Display for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KeyState {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KeyState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown state {s:?}")))
    }
}

/// What the protected work touches, which decides what may happen to a key whose worker vanished.
///
/// ```
/// use idempotency::Effects;
/// assert_eq!(Effects::default(), Effects::Local);
/// assert_eq!("external".parse::<Effects>().unwrap(), Effects::External);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Effects {
    /// Only our database: the work commits with the key's completion or not at all, so an expired
    /// lease means nothing happened and the key can be taken over.
    #[default]
    Local,
    /// An outside service (payment, mail) is called: an expired lease may hide an effect that did
    /// happen, so only the recovery job (asking the provider) or a human may decide.
    External,
}

impl Effects {
    /// The name stored in the `effects` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Effects::Local => "local",
            Effects::External => "external",
        }
    }
}

impl fmt::Display for Effects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Effects {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "local" => Ok(Effects::Local),
            "external" => Ok(Effects::External),
            other => Err(StoreError::Corrupt(format!("unknown effects {other:?}"))),
        }
    }
}

/// A fresh random token naming one holder of a key. Completion, release and takeover all check
/// it (fencing), so a worker whose lease was taken over cannot complete.
///
/// ```
/// use idempotency::store::LeaseToken;
/// assert_ne!(LeaseToken::new(), LeaseToken::new());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub Uuid);

impl LeaseToken {
    /// A new random (v4) token.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        Self(Uuid::new_v4())
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One row of the key table, as a store read it. Durations are computed by the database's clock.
///
/// ```
/// # use idempotency::{*, key::*, store::*};
/// # fn show(record: &KeyRecord) {
/// if record.state == KeyState::Pending && record.lease_expired() {
///     println!("{} was abandoned by its worker", record.key);
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The key the row belongs to.
    pub key: IdempotencyKey,
    /// Where the row is in its life.
    pub state: KeyState,
    /// Whether the work calls outside services.
    pub effects: Effects,
    /// Fingerprint of the request that reserved it.
    pub fingerprint: Fingerprint,
    /// Token of the current holder.
    pub lease_token: LeaseToken,
    /// Time left on the lease, by the database clock; zero once it has ended.
    pub lease_remaining: Duration,
    /// Whether the row is past its retention (`expires_at <= now()`).
    pub expired: bool,
    /// The stored result, for completed rows.
    pub result: Option<Vec<u8>>,
    /// Why the row was parked or resolved.
    pub reason: Option<String>,
    /// How often the recovery job asked a resolver and got "unknown".
    pub recovery_attempts: u32,
    /// When the row was first reserved.
    pub created_at: DateTime<Utc>,
    /// When the row last changed.
    pub updated_at: DateTime<Utc>,
    /// When the lease ends (ended).
    pub lease_until: DateTime<Utc>,
    /// When the row may be purged.
    pub expires_at: DateTime<Utc>,
    /// The last recovery point a durable operation reached (see [`Steps`](crate::durable::Steps)).
    pub recovery_point: Option<String>,
    /// The stored request of a durable operation (canonical JSON), kept while it is unsettled so
    /// that it can be resumed without the client; cleared at completion.
    pub request: Option<Vec<u8>>,
    /// The journal of a durable operation's steps (JSON): the output of each step done, and the
    /// outside steps started.
    pub progress: Option<Vec<u8>>,
}

impl KeyRecord {
    /// A record of `key` in `state`, as a store starts one from its row: the lease, retention,
    /// timestamps and durable fields are empty (zero, the epoch, `None`); the store sets the
    /// ones its row holds (the fields are public), by the database's clock. New fields added
    /// later get such an empty default here, so a store keeps compiling.
    ///
    /// ```
    /// use idempotency::{store::{KeyRecord, KeyState, LeaseToken}, Effects, Fingerprint, IdempotencyKey};
    /// let key = IdempotencyKey::new("user-1", "purchase", "k1")?;
    /// let mut record = KeyRecord::new(key, KeyState::Completed, Effects::Local, Fingerprint::of_bytes(b"r"), LeaseToken::new());
    /// record.result = Some(b"{}".to_vec());
    /// assert!(record.lease_expired());
    /// # Ok::<(), idempotency::key::InvalidKey>(())
    /// ```
    pub fn new(
        key: IdempotencyKey,
        state: KeyState,
        effects: Effects,
        fingerprint: Fingerprint,
        lease_token: LeaseToken,
    ) -> Self {
        Self {
            key,
            state,
            effects,
            fingerprint,
            lease_token,
            lease_remaining: Duration::ZERO,
            expired: false,
            result: None,
            reason: None,
            recovery_attempts: 0,
            created_at: DateTime::<Utc>::UNIX_EPOCH,
            updated_at: DateTime::<Utc>::UNIX_EPOCH,
            lease_until: DateTime::<Utc>::UNIX_EPOCH,
            expires_at: DateTime::<Utc>::UNIX_EPOCH,
            recovery_point: None,
            request: None,
            progress: None,
        }
    }

    /// Whether the lease has ended by the database clock.
    pub fn lease_expired(&self) -> bool {
        self.lease_remaining.is_zero()
    }

    /// Whether the row belongs to a durable operation that can be resumed from its stored
    /// request: pending, external, with a request stored by its first step.
    pub fn is_resumable(&self) -> bool {
        self.state == KeyState::Pending
            && self.effects == Effects::External
            && self.request.is_some()
    }
}

/// What a durable step writes with its business rows: the key's new recovery point and journal,
/// and (with the first write) the request. See [`Journal::save_progress`].
///
/// ```
/// use idempotency::store::Progress;
/// let progress = Progress { recovery_point: "debited", journal: br#"{"done":{}}"#, request: None };
/// assert_eq!(progress.recovery_point, "debited");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// The name of the point reached.
    pub recovery_point: &'a str,
    /// The whole journal, as JSON.
    pub journal: &'a [u8],
    /// The canonical request, written only where none is stored yet.
    pub request: Option<&'a [u8]>,
}

/// What to write when reserving a key (or taking it over).
///
/// ```
/// # use idempotency::{*, key::*, store::*};
/// # use std::time::Duration;
/// let key = IdempotencyKey::new("user-1", "purchase", "k1")?;
/// let row = PendingRow {
///     key: &key,
///     fingerprint: Fingerprint::of_bytes(b"request"),
///     token: LeaseToken::new(),
///     effects: Effects::Local,
///     journaled: false,
///     lease: Duration::from_secs(60),
///     retention: Duration::from_secs(86_400),
/// };
/// assert_eq!(row.lease_millis(), 60_000);
/// # Ok::<(), InvalidKey>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct PendingRow<'a> {
    /// The key to reserve.
    pub key: &'a IdempotencyKey,
    /// Fingerprint of the request.
    pub fingerprint: Fingerprint,
    /// The token the new holder will present.
    pub token: LeaseToken,
    /// Whether the work calls outside services.
    pub effects: Effects,
    /// Whether the work commits a flushed recovery point before any outside call
    /// ([`Attempt::with_journaled`](crate::Attempt::with_journaled)).
    pub journaled: bool,
    /// How long the holder may work before others may consider it dead.
    pub lease: Duration,
    /// How long the row is kept once written (reset at completion).
    pub retention: Duration,
}

impl PendingRow<'_> {
    /// Whether the key records a history ([`Maintenance::history`]): external or journaled
    /// work. A plain local key records nothing, so its reservation costs what it did.
    pub fn records_history(&self) -> bool {
        self.effects == Effects::External || self.journaled
    }

    /// The lease length in whole milliseconds, as bound into SQL.
    pub fn lease_millis(&self) -> i64 {
        millis(self.lease)
    }

    /// The retention in whole milliseconds, as bound into SQL.
    pub fn retention_millis(&self) -> i64 {
        millis(self.retention)
    }

    /// Whether this reservation must reach the disk on its own, before the work starts.
    ///
    /// Only for external work that is not journaled: it may have its outside effect before any
    /// commit of its own, so a reservation lost in a crash would leave that effect without a key.
    /// Every other reservation may commit without waiting for its flush
    /// (`synchronous_commit = off` on PostgreSQL, `synchronous = NORMAL` on SQLite), because the
    /// first flushed commit after it flushes it too (logs are written in order), and nothing
    /// outside the database happens before that commit:
    /// * [`Effects::Local`] work: its completion commits with the work, flushed; a crash before
    ///   it loses only a reservation whose work cannot have committed either (a retry runs it,
    ///   once);
    /// * a journaled durable operation: every outside call comes after a flushed recovery
    ///   point.
    ///
    /// Proved by crashing the database mid-storm (`faults --only db-crash`).
    ///
    /// ```
    /// # use idempotency::{*, key::*, store::*};
    /// # use std::time::Duration;
    /// let key = IdempotencyKey::new("user-1", "charge", "k1")?;
    /// let mut row = PendingRow {
    ///     key: &key,
    ///     fingerprint: Fingerprint::of_bytes(b"request"),
    ///     token: LeaseToken::new(),
    ///     effects: Effects::External,
    ///     journaled: false,
    ///     lease: Duration::from_secs(60),
    ///     retention: Duration::from_secs(86_400),
    /// };
    /// assert!(row.must_flush_reservation());
    /// row.journaled = true;
    /// assert!(!row.must_flush_reservation());
    /// # Ok::<(), InvalidKey>(())
    /// ```
    pub fn must_flush_reservation(&self) -> bool {
        self.effects == Effects::External && !self.journaled
    }
}

/// A duration as whole milliseconds for SQL, saturating.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The answer of [`Store::insert_pending`].
// `Conflict` is large, but the value is moved once and matched at once: boxing buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Insertion {
    /// The row was inserted and committed: the caller holds the key.
    Inserted,
    /// A row already exists; here it is.
    Conflict(KeyRecord),
    /// The insert conflicted but the row was gone when read (released in between): try again.
    Vanished,
}

/// The answer of [`ReserveInTransaction::reserve_in`] (the single-transaction mode,
/// [`Idempotency::with_single_transaction`](crate::Idempotency::with_single_transaction)).
///
/// ```
/// use idempotency::store::ReservedIn;
/// // Only `Inserted` lets the work run in the transaction; the others roll it back.
/// assert_ne!(ReservedIn::Busy, ReservedIn::Inserted);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReservedIn {
    /// The pending row is written in the transaction, not committed: the caller holds the key
    /// for as long as the transaction lives, and nobody else sees the row.
    Inserted,
    /// The key has a committed row (perhaps after waiting for the transaction that wrote it):
    /// roll back and answer it the article's way ([`Store::insert_pending`]).
    Exists,
    /// Another transaction held the key for longer than the wait.
    Busy,
}

/// The statements the protocol needs, one per step of the article.
///
/// Implementations must make [`insert_pending`](Store::insert_pending) a single INSERT against the
/// unique `(scope, operation, key)` constraint, committed on its own, whatever the isolation level
/// of the server; and every update conditional on the lease token. A key that records a history
/// ([`PendingRow::records_history`]: external or durable work) writes its events with the change
/// they record: a reservation's `reserved` event, a claim's `claimed` event (where the key is
/// external or its history has begun), and the events of [`release_recorded`](Store::release_recorded),
/// [`park_recorded`](Store::park_recorded) and [`append_event`](Store::append_event), each in the
/// same statement or in one short transaction that commits only if the change acted. A plain
/// local key's statements stay single autocommit statements, with no event. See
/// `PgStore`, `SqliteStore` and `MySqlStore`,
/// and the guide `docs/implementing-a-store.md` in the repository (the rules every method
/// follows, and the conformance suite that proves a new store: `idempotency::store::testing`, feature
/// `testing`).
///
/// Features beyond the article's protocol are capabilities of their own, which a store
/// implements only if it offers them: [`Journal`] (durable steps and recovery),
/// [`ReserveInTransaction`] (the single-transaction mode), [`CompletionSignal`] (waiting for a
/// duplicate's original) and [`Maintenance`] (the operator's side).
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{Store, SqliteStore};
/// let store = SqliteStore::connect("sqlite://keys.db?mode=rwc").await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
pub trait Store: Clone + Send + Sync + 'static {
    /// The sqlx database the business transaction runs on.
    type Database: sqlx::Database;

    /// Creates or upgrades the key table (idempotent; safe from several processes at once).
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// INSERTs a pending row under the unique constraint and commits it; on conflict, reads the
    /// existing row. Must not fail with a serialization error under any server isolation level.
    fn insert_pending(
        &self,
        row: &PendingRow<'_>,
    ) -> impl Future<Output = Result<Insertion, StoreError>> + Send;

    /// Reads one row.
    fn find(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>> + Send;

    /// The replay path: the stored result of the row, only where it is `completed`, unexpired
    /// (by the database clock) and carries `fingerprint`; `None` for anything else, which
    /// [`insert_pending`](Store::insert_pending) then decides. One indexed read, never a write.
    fn find_replay(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;

    /// Re-reserves a row that may be reused, if it still carries `stale`: a `failed` row, a
    /// `completed` row past its retention, or a `pending` *local* row whose lease ended. Writes
    /// `row` (new token, fingerprint, lease) and returns whether it did.
    fn take_over(
        &self,
        row: &PendingRow<'_>,
        stale: LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Opens the business transaction.
    fn begin(
        &self,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self::Database>, StoreError>> + Send;

    /// Inside the business transaction: marks the key completed with `result`, only where it is
    /// pending with `token`. `false` means the lease was lost and the transaction must roll back.
    fn complete(
        &self,
        tx: &mut sqlx::Transaction<'static, Self::Database>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes the row only where it is still pending with `token`; a completed key is never
    /// released. Returns whether a row was deleted.
    fn release(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Parks the row as `needs_review` with `reason`, only where it is pending with `token`.
    fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease of a key still pending with `token` to `lease` from now, by the
    /// database's clock: a live holder's heartbeat. `false` means the lease is no longer ours
    /// (taken over, settled, released or parked).
    fn extend_lease(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Claims a pending key whose lease has ended, keeping everything it holds (progress,
    /// request, `recovery_attempts`): replaces the lease token `stale` by `fresh` and sets
    /// `lease_until = now() + lease`, only where the row is still `pending`, still carries
    /// `stale` and its lease has ended. `true` means the caller now holds the key with `fresh`:
    /// the previous holder can no longer write (its token is gone). The recovery job and a
    /// client retry of a durable operation both claim this way, so exactly one of them drives.
    fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Inside `tx` (a step's or a completion's transaction, or one of its own): appends an event
    /// of `kind` with `detail` to the history of `key`, with this store's worker name as actor,
    /// so it commits or rolls back with the change it records. Called only for keys that record
    /// a history (external or durable work; plain local keys record nothing). The default
    /// records nothing: a store without a history table keeps working.
    fn append_event(
        &self,
        tx: &mut sqlx::Transaction<'static, Self::Database>,
        key: &IdempotencyKey,
        kind: history::EventKind,
        detail: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (tx, key, kind, detail);
        std::future::ready(Ok(()))
    }

    /// [`release`](Self::release), with a `released` event in the key's history written in the
    /// same statement or transaction. Called instead of `release` for keys that record a history;
    /// the default releases without one.
    fn release_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.release(key, token)
    }

    /// [`park`](Self::park), with a `parked` event (detail: `reason`) in the key's history written
    /// in the same statement or transaction. Called instead of `park` for keys that record a
    /// history; the default parks without one.
    fn park_recorded(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.park(key, token, reason)
    }

    /// Counts one more failure in the **failure counter** `counter`, a `completed` row of its
    /// own that holds the count in `recovery_attempts` and the last failure's `result` as its
    /// stored result (the [`Inbox`](crate::queue::Inbox) keeps one per failing message, keyed
    /// `"{message type}#failures"`), and returns the count: 1 for a new row or for one past its
    /// retention, else one more than the row held. The row then expires `counter.retention` from
    /// now (by the database clock), and is purged with the keys. Concurrent calls each count:
    /// `n` copies failing at once leave `n` more, never fewer.
    ///
    /// The stores of this crate do it in one statement (an upsert that returns the count). The
    /// provided implementation, for a store without an upsert, completes one record row per
    /// failure instead (`"{counter's operation}-{n}"`, the first free `n` of `1..=limit`) and
    /// stops counting at `limit`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency::{store::{LeaseToken, PendingRow}, Effects, Fingerprint, IdempotencyKey, Store};
    /// use std::time::Duration;
    /// let counter = IdempotencyKey::new("orders", "order.paid#failures", "m-1")?;
    /// let row = PendingRow {
    ///     key: &counter,
    ///     fingerprint: Fingerprint::of_bytes(b"payload"),
    ///     token: LeaseToken::new(),
    ///     effects: Effects::Local,
    ///     journaled: false,
    ///     lease: Duration::from_secs(10),
    ///     retention: Duration::from_secs(86_400),
    /// };
    /// let failures = store.count_failure(&row, br#"{"error":"timeout"}"#, 5).await?;
    /// assert_eq!(store.failure_count(&counter, 5).await?, failures);
    /// # Ok(()) }
    /// ```
    fn count_failure(
        &self,
        counter: &PendingRow<'_>,
        result: &[u8],
        limit: u32,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send {
        failures::count_by_records(self, counter, result, limit)
    }

    /// The count of the failure counter `counter` ([`count_failure`](Store::count_failure)): 0
    /// when it has no row or its row is past its retention. The provided implementation counts
    /// the record rows of its `count_failure`, up to `limit`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency::{IdempotencyKey, Store};
    /// let counter = IdempotencyKey::new("orders", "order.paid#failures", "never-failed")?;
    /// assert_eq!(store.failure_count(&counter, 5).await?, 0);
    /// # Ok(()) }
    /// ```
    fn failure_count(
        &self,
        counter: &IdempotencyKey,
        limit: u32,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send {
        failures::count_records(self, counter, limit)
    }
}

/// Capability of durable operations ([`Steps`](crate::durable::Steps)) and of the recovery job
/// ([`Recovery`](crate::maintenance::Recovery)): a journal of the steps done, written in each step's
/// transaction, and a count of the outside outcomes found unknown.
///
/// A store without it runs every protocol of [`Idempotency`](crate::Idempotency) but
/// [`perform`](crate::Idempotency::perform), [`Steps`](crate::durable::Steps) and [`Recovery`](crate::maintenance::Recovery).
/// The conformance suite's `journal` scenarios prove an implementation
/// (`idempotency::store::testing`, feature `testing`).
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore, key: idempotency::IdempotencyKey, token: idempotency::store::LeaseToken) -> Result<(), idempotency::StoreError> {
/// use idempotency::store::Journal;
/// use std::time::Duration;
/// // The provider did not say whether the charge happened: look again in a second.
/// store.note_unknown(&key, token, Duration::from_secs(1)).await?;
/// # Ok(()) }
/// ```
pub trait Journal: Store {
    /// Inside a durable step's transaction: writes `progress` (recovery point, journal, and the
    /// request where none is stored yet), only where the key is pending with `token`. `false`
    /// means the lease was lost: the step's transaction must roll back (fencing).
    fn save_progress(
        &self,
        tx: &mut sqlx::Transaction<'static, Self::Database>,
        key: &IdempotencyKey,
        token: LeaseToken,
        progress: &Progress<'_>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Notes that an outside outcome is unknown: `recovery_attempts += 1` and
    /// `lease_until = now() + retry_after` (when the recovery job, or a retry, may look again),
    /// only where the key is `pending` with `token`. The key stays pending with `token`. Returns
    /// whether it did.
    fn note_unknown(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        retry_after: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// Capability of the single-transaction mode
/// ([`Idempotency::with_single_transaction`](crate::Idempotency::with_single_transaction)): the
/// database queues a duplicate INSERT on the unique index until the transaction that wrote the
/// first one ends (PostgreSQL, InnoDB), so the key row can be written inside the business
/// transaction. SQLite, whose single writer queues whole transactions, does not offer it.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(store: idempotency::PgStore, row: idempotency::store::PendingRow<'_>) -> Result<(), idempotency::StoreError> {
/// use idempotency::{Store, store::{ReserveInTransaction, ReservedIn}};
/// use std::time::Duration;
/// let mut tx = store.begin().await?;
/// if store.reserve_in(&mut tx, &row, Duration::from_secs(5)).await? == ReservedIn::Inserted {
///     // The work runs in `tx`, and the key is completed in it.
/// }
/// # Ok(()) }
/// ```
pub trait ReserveInTransaction: Store {
    /// The single-transaction mode's reservation: INSERTs the `row` inside `tx`, the business
    /// transaction, without committing it, such that [`Store::complete`] with the row's token in
    /// the same `tx` completes it (nobody else sees it before `tx` commits, so the state it is
    /// written in is the store's choice: PostgreSQL writes it `completed` without a result, which
    /// the completion fills in place). A duplicate's INSERT then waits on the
    /// unique index until `tx` ends, for at most `wait` (then [`ReservedIn::Busy`]); after a
    /// commit it finds the row ([`ReservedIn::Exists`]), after a rollback it inserts its own.
    /// Only for [`Effects::Local`] work that is not journaled.
    fn reserve_in(
        &self,
        tx: &mut sqlx::Transaction<'static, Self::Database>,
        row: &PendingRow<'_>,
        wait: Duration,
    ) -> impl Future<Output = Result<ReservedIn, StoreError>> + Send;
}

/// Capability of waiting for a duplicate's original ([`Consumer`](crate::queue::Inbox)'s in-progress
/// wait, the HTTP layer's wait for a request in flight): how a waiter learns that a pending key
/// stopped being pending.
///
/// Both methods are provided: `impl CompletionSignal for MyStore {}` waits by polling
/// [`Store::find`] and notifies nobody (waiters poll). A database with notifications overrides
/// both (PostgreSQL: `LISTEN`/`NOTIFY`).
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # fn demo() {
/// use idempotency::{SqliteStore, store::CompletionSignal};
/// fn waits<S: CompletionSignal>() {}
/// waits::<SqliteStore>();
/// # }
/// ```
pub trait CompletionSignal: Store {
    /// Waits, at most `timeout`, for a pending key to stop being pending: for a duplicate that
    /// arrived while the original request still runs, so that it can answer with the original's
    /// stored result instead of a 409.
    ///
    /// Returns [`Awaited::Completed`] with the stored result once the key is completed with
    /// `fingerprint`; [`Awaited::Settled`] once anything else happened that a new reservation
    /// must decide (the key was released, parked, completed for another request, or its lease
    /// ended so that a retry may take it over or resume it); [`Awaited::TimedOut`] if it is still
    /// pending when `timeout` runs out. It only reads.
    ///
    /// The provided implementation polls [`find`](Store::find): after 1 ms, then each pause
    /// doubling up to 25 ms, and never past the lease's end or
    /// the timeout. The PostgreSQL store overrides it with `LISTEN`, woken by the `NOTIFY` of
    /// [`notify_settled`](CompletionSignal::notify_settled), keeping a slower poll as a safety net.
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(key: idempotency::IdempotencyKey, fingerprint: idempotency::Fingerprint) -> Result<(), idempotency::StoreError> {
    /// use idempotency::{SqliteStore, store::{Awaited, CompletionSignal}};
    /// use std::time::Duration;
    /// let store = SqliteStore::connect("sqlite://keys.db?mode=rwc").await?;
    /// match store.wait_for_completion(&key, &fingerprint, Duration::from_secs(2)).await? {
    ///     Awaited::Completed(result) => println!("replay {} bytes", result.len()),
    ///     Awaited::Settled => println!("reserve again"),
    ///     Awaited::TimedOut => println!("still running: 409"),
    ///     _ => println!("a later kind of end: treat it as still running"),
    /// }
    /// # Ok(()) }
    /// ```
    fn wait_for_completion(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        timeout: Duration,
    ) -> impl Future<Output = Result<Awaited, StoreError>> + Send {
        poll_for_completion(self, key, fingerprint, timeout)
    }

    /// Tells [`wait_for_completion`](CompletionSignal::wait_for_completion)ers in other processes that
    /// `key` has just stopped being pending: called after the commit that completed it, or after
    /// it was released or parked. Where the database has no notification, this does nothing (the
    /// provided implementation) and waiters poll; PostgreSQL sends a `NOTIFY`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo(store: idempotency::PgStore, key: idempotency::IdempotencyKey) -> Result<(), idempotency::StoreError> {
    /// use idempotency::store::CompletionSignal;
    /// store.notify_settled(&key).await?;
    /// # Ok(()) }
    /// ```
    fn notify_settled(
        &self,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = key;
        async { Ok(()) }
    }
}

/// The first pause of the polling [`CompletionSignal::wait_for_completion`].
pub(crate) const POLL_FIRST: Duration = Duration::from_millis(1);

/// The longest pause of the polling [`CompletionSignal::wait_for_completion`].
pub(crate) const POLL_MAX: Duration = Duration::from_millis(25);

/// What [`CompletionSignal::wait_for_completion`] saw.
///
/// ```
/// use idempotency::store::Awaited;
/// assert_ne!(Awaited::Completed(b"{}".to_vec()), Awaited::TimedOut);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Awaited {
    /// The key completed with the awaited fingerprint: its stored result, to replay.
    Completed(Vec<u8>),
    /// The key is no longer pending as it was (released, parked, failed, completed for another
    /// request, expired, or its lease ended so that it may be taken over or resumed): reserve
    /// again to learn what to do.
    Settled,
    /// Still pending when the time ran out.
    TimedOut,
}

/// What a read of the awaited key says: `Some` once the wait is over, `None` while the key is
/// pending with a live lease (or pending where no retry could take it over).
pub(crate) fn awaited(record: Option<KeyRecord>, fingerprint: &Fingerprint) -> Option<Awaited> {
    let Some(record) = record else {
        return Some(Awaited::Settled);
    };
    match record.state {
        KeyState::Completed if !record.expired && record.fingerprint == *fingerprint => {
            Some(Awaited::Completed(record.result.unwrap_or_default()))
        }
        KeyState::Pending if record.lease_expired() => {
            // A reservation would take it over (local) or resume it (a durable operation of this
            // request); any other pending key stays in progress whatever a retry does.
            let takeable = record.effects == Effects::Local
                || (record.is_resumable() && record.fingerprint == *fingerprint);
            takeable.then_some(Awaited::Settled)
        }
        KeyState::Pending => None,
        _ => Some(Awaited::Settled),
    }
}

/// How long to sleep before looking again: `pause`, but never past the lease's end (then the
/// key may be taken over) nor past `deadline`.
pub(crate) fn next_look(
    pause: Duration,
    record_lease: Option<Duration>,
    deadline: tokio::time::Instant,
) -> Duration {
    let mut sleep = pause;
    if let Some(lease) = record_lease.filter(|lease| !lease.is_zero()) {
        sleep = sleep.min(lease + Duration::from_millis(1));
    }
    sleep.min(deadline.saturating_duration_since(tokio::time::Instant::now()))
}

/// The provided [`CompletionSignal::wait_for_completion`]: bounded polling of [`Store::find`].
pub(crate) async fn poll_for_completion<S: Store>(
    store: &S,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    timeout: Duration,
) -> Result<Awaited, StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = POLL_FIRST;
    loop {
        let record = store.find(key).await?;
        let lease = record.as_ref().map(|record| record.lease_remaining);
        if let Some(done) = awaited(record, fingerprint) {
            return Ok(done);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Awaited::TimedOut);
        }
        tokio::time::sleep(next_look(pause, lease, deadline)).await;
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// After an insert lost to an existing row: read that row, or report it gone.
#[allow(dead_code)]
pub(crate) async fn read_conflict<S: Store>(
    store: &S,
    key: &IdempotencyKey,
) -> Result<Insertion, StoreError> {
    Ok(match store.find(key).await? {
        Some(existing) => Insertion::Conflict(existing),
        None => Insertion::Vanished,
    })
}

/// Runs `work` in a task of its own, to the end even when its caller is cancelled, so that
/// cancelling the caller midway cannot leave a pooled connection in a state nobody restores.
/// For `BEGIN`: sqlx 0.8 may acknowledge a `BEGIN` after its caller was dropped, which leaves an
/// open transaction nobody owns (on SQLite it holds the write lock for good); in the task, a
/// transaction its caller no longer waits for is dropped, which rolls it back. For SQLite's
/// relaxed reservation: the connection's `synchronous` level is always put back.
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) async fn uncancellable<T, F>(work: F) -> Result<T, StoreError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, StoreError>> + Send + 'static,
{
    tokio::spawn(work)
        .await
        .map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?
}
