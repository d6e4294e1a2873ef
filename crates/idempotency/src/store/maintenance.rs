//! The statements of the operator side: recovery of abandoned keys, retention purge, listing,

use super::history::{KeyEvent, OperatorNote};
use super::{KeyRecord, KeyState, LeaseToken, Store};
use crate::{error::StoreError, IdempotencyKey};
use chrono::{DateTime, Utc};
use std::{future::Future, time::Duration};

/// Where a page of [`Maintenance::list`] ended: the `(created_at, scope, operation, key)` of its
/// last row. A filter [`with_after`](KeyFilter::with_after) a cursor lists the rows that follow
/// it in the list's order (keyset paging), so rows inserted meanwhile never shift a page.
///
/// ```
/// use idempotency::{maintenance::{KeyCursor, KeyFilter}, IdempotencyKey};
/// let last = IdempotencyKey::new("user-1", "purchase", "k-9")?;
/// let cursor = KeyCursor::new(chrono::DateTime::UNIX_EPOCH, last);
/// let next_page = KeyFilter::default().with_limit(50).with_after(cursor.clone());
/// assert_eq!(next_page.after(), Some(&cursor));
/// assert_eq!(cursor.key().key(), "k-9");
/// # Ok::<(), idempotency::key::InvalidKey>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCursor {
    created_at: DateTime<Utc>,
    key: IdempotencyKey,
}

impl KeyCursor {
    /// The position of the row of `key` created at `created_at` (as the store returned it).
    pub fn new(created_at: DateTime<Utc>, key: IdempotencyKey) -> Self {
        Self { created_at, key }
    }

    /// The position of `record`: pass the last row of a page to get the next one.
    pub fn of(record: &KeyRecord) -> Self {
        Self::new(record.created_at, record.key.clone())
    }

    /// When the row was created (the first part of the list's order).
    pub fn created_at(&self) -> DateTime<Utc> {
        self.created_at
    }

    /// The row's key (the rest of the list's order: scope, operation, key).
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

/// Which rows [`Maintenance::list`] returns. All conditions are combined with AND; `None` means
/// "any".
///
/// ```
/// use idempotency::{maintenance::KeyFilter, store::KeyState};
/// use std::time::Duration;
/// let filter = KeyFilter::default()
///     .with_state(KeyState::NeedsReview)
///     .with_older_than(Duration::from_secs(300));
/// assert_eq!(filter.limit(), 100);
/// assert_eq!(filter.state(), Some(KeyState::NeedsReview));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFilter {
    /// Only rows in this state.
    pub(crate) state: Option<KeyState>,
    /// Only rows of this scope.
    pub(crate) scope: Option<String>,
    /// Only rows of this operation.
    pub(crate) operation: Option<String>,
    /// Only rows created at least this long ago (`created_at <= now() - older_than`).
    pub(crate) older_than: Option<Duration>,
    /// At most this many rows (oldest `created_at` first).
    pub(crate) limit: u32,
    /// Only rows after this one in the list's order.
    pub(crate) after: Option<KeyCursor>,
}

impl KeyFilter {
    /// Only rows in this state.
    pub fn state(&self) -> Option<KeyState> {
        self.state
    }

    /// Only rows of this scope.
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// Only rows of this operation.
    pub fn operation(&self) -> Option<&str> {
        self.operation.as_deref()
    }

    /// Only rows created at least this long ago (`created_at <= now() - older_than`).
    pub fn older_than(&self) -> Option<Duration> {
        self.older_than
    }

    /// At most this many rows, oldest `created_at` first (default 100).
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Only rows after this position in the list's order (keyset paging).
    pub fn after(&self) -> Option<&KeyCursor> {
        self.after.as_ref()
    }

    /// Keeps only rows after `cursor` in the list's order `(created_at, scope, operation, key)`:
    /// the next page after a page whose last row was `cursor`.
    pub fn with_after(mut self, cursor: KeyCursor) -> Self {
        self.after = Some(cursor);
        self
    }

    /// Keeps only rows in `state`.
    pub fn with_state(mut self, state: KeyState) -> Self {
        self.state = Some(state);
        self
    }

    /// Keeps only rows of `scope`.
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Keeps only rows of `operation`.
    pub fn with_operation(mut self, operation: impl Into<String>) -> Self {
        self.operation = Some(operation.into());
        self
    }

    /// Keeps only rows created at least `age` ago.
    pub fn with_older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Returns at most `limit` rows.
    pub fn with_limit(mut self, limit: u32) -> Self {
        self.limit = limit;
        self
    }
}

impl Default for KeyFilter {
    fn default() -> Self {
        Self {
            state: None,
            scope: None,
            operation: None,
            older_than: None,
            limit: 100,
            after: None,
        }
    }
}

/// An operator's decision about a parked (`needs_review`) key.
///
/// ```
/// use idempotency::maintenance::Resolution;
/// let done = Resolution::Completed(br#"{"order":7}"#.to_vec());
/// assert_eq!(done.state().as_str(), "completed");
/// assert_eq!(Resolution::Failed.state().as_str(), "failed");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The effect did happen: replays will return these result bytes (the same encoding the
    /// protocol stores: the JSON of the operation's result).
    Completed(Vec<u8>),
    /// The effect did not happen: the key may be reserved again and the work run anew.
    Failed,
}

impl Resolution {
    /// The state the row moves to.
    pub fn state(&self) -> KeyState {
        match self {
            Resolution::Completed(_) => KeyState::Completed,
            Resolution::Failed => KeyState::Failed,
        }
    }
}

/// How many rows one operation has in one state.
///
/// ```
/// use idempotency::{maintenance::StateCount, store::KeyState};
/// let count = StateCount::new("purchase", KeyState::Pending, 3);
/// assert_eq!(count.count, 3);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCount {
    /// The operation.
    pub operation: String,
    /// The state.
    pub state: KeyState,
    /// How many rows.
    pub count: u64,
}

/// A snapshot of the key table, for `idem stats` and monitoring.
///
/// ```
/// use idempotency::maintenance::KeyStats;
/// let stats = KeyStats::default();
/// assert_eq!(stats.total(), 0);
/// assert!(stats.oldest_pending_age.is_none());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyStats {
    /// Row counts by operation and state, ordered by operation then state name.
    pub counts: Vec<StateCount>,
    /// Age (by the database clock) of the oldest pending row, `None` when nothing is pending.
    pub oldest_pending_age: Option<Duration>,
    /// Pending rows whose lease has ended (what the recovery job would look at).
    pub expired_leases: u64,
    /// Rows a purge would delete now.
    pub purgeable: u64,
}

impl StateCount {
    /// `count` rows of `operation` in `state`.
    pub fn new(operation: impl Into<String>, state: KeyState, count: u64) -> Self {
        Self {
            operation: operation.into(),
            state,
            count,
        }
    }
}

impl KeyStats {
    /// All rows.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.count).sum()
    }

    /// Rows in `state`, over all operations.
    pub fn in_state(&self, state: KeyState) -> u64 {
        self.counts
            .iter()
            .filter(|c| c.state == state)
            .map(|c| c.count)
            .sum()
    }
}

/// The statements recovery, retention purge and the `idem` CLI need, on top of [`Store`].
///
/// Contract for implementers (PostgreSQL, SQLite and MySQL alike):
/// * every time comparison and every written time uses the database clock;
/// * every changing method is **one** conditional statement, committed on its own (autocommit),
///   whose condition is re-checked by the database at write time, and it reports through its
///   return value whether it acted; losing a race is `Ok(false)` / `Ok(0)`, never an error.
///   Where the change writes an event into the key's history ([`resolve`](Self::resolve),
///   [`hand_back`](Self::hand_back), [`complete_recovered`](Self::complete_recovered), and
///   [`Store::claim_for_recovery`] of an external or durable key), the row and its event are
///   written together: in the same statement (a data-modifying CTE on PostgreSQL) or in one short
///   transaction of their own that commits only if the conditional change acted, never one
///   without the other;
/// * a purge never deletes `pending` or `needs_review` rows, and deletes at most `batch` rows per
///   call, skipping rows another session holds locked where the database allows it; the
///   histories of the rows it deletes go with them (same statement or transaction), and the
///   last batch of a purge (fewer than `batch` rows) also deletes the histories without a key
///   row whose newest event is older than 7 days.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(store: idempotency::PgStore) -> Result<(), idempotency::StoreError> {
/// use idempotency::{Store, store::{LeaseToken, Maintenance}};
/// use std::time::Duration;
/// for stale in store.expired_leases(10).await? {
///     let mine = LeaseToken::new();
///     if store.claim_for_recovery(&stale.key, stale.lease_token, mine, Duration::from_secs(60)).await? {
///         store.park(&stale.key, mine, "checked by hand").await?;
///     }
/// }
/// # Ok(()) }
/// ```
///
/// The statements of the operator side: recovery of abandoned keys, retention purge, listing,
/// resolution of parked keys and statistics.
///
/// [`Maintenance`] extends [`Store`] and follows its rules: every method that changes a row is a
/// single conditional statement (on the lease token, or on the state), so two recovery workers, a
/// recovery worker and a late original worker, or two operators never both act on one key. Every
/// time comparison uses the database's clock (`now()`), never the caller's.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{SqliteStore, Store, store::Maintenance};
/// let store = SqliteStore::connect("sqlite://keys.db?mode=rwc").await?;
/// store.migrate().await?;
/// for record in store.expired_leases(100).await? {
///     println!("{} was abandoned {} times", record.key, record.recovery_attempts);
/// }
/// # Ok(()) }
/// ```
pub trait Maintenance: Store {
    /// Pending rows whose lease has ended (`state = 'pending' AND lease_until <= now()`), local and
    /// external alike, the longest-expired first, at most `limit`. Reads only.
    fn expired_leases(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<KeyRecord>, StoreError>> + Send;

    /// Marks the key `completed` with `result`, outside any business transaction (the effect
    /// happened elsewhere, e.g. at a payment provider), only where it is `pending` with `token`.
    /// Sets `expires_at = now() + retention` and `reason`. Returns whether it did.
    fn complete_recovered(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        reason: &str,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes at most `batch` rows with `state IN ('completed', 'failed') AND expires_at <=
    /// now()`, in no promised order, in one statement or short transaction (skipping rows locked
    /// by other sessions where the database can), with their histories, and returns how many
    /// rows it deleted. Never touches `pending` or `needs_review` rows. A batch of fewer than
    /// `batch` rows also deletes orphaned histories (no key row, newest event older than 7
    /// days). Call it until it returns 0 to purge everything.
    fn purge_batch(&self, batch: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// How many rows a purge would delete now (same condition as [`purge_batch`](Self::purge_batch)).
    fn count_purgeable(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Rows matching `filter`, oldest `created_at` first (then by scope, operation and key), at
    /// most `filter.limit`; with [`KeyFilter::after`], only the rows after that position in this
    /// order (`(created_at, scope, operation, key) > cursor`).
    fn list(
        &self,
        filter: &KeyFilter,
    ) -> impl Future<Output = Result<Vec<KeyRecord>, StoreError>> + Send;

    /// Resolves a parked key: moves it from `needs_review` to `completed` (with the result bytes)
    /// or `failed` (result cleared), records the note's reason on the row, sets `expires_at =
    /// now() + retention`, only where it is still `needs_review` and, when `note.seen` is set,
    /// only where its `updated_at` still equals `seen` at millisecond precision. Appends a
    /// `resolved` event (actor: the operator; detail: the resolution, reason and evidence) with
    /// the change. Returns whether it did. Callers validate the note (see
    /// [`crate::maintenance::resolve`]).
    fn resolve(
        &self,
        key: &IdempotencyKey,
        resolution: &Resolution,
        note: &OperatorNote,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Hands a parked key back to the resumer, so it asks the provider again: only where it is
    /// `needs_review` (and, when `note.seen` is set, its `updated_at` still equals `seen` at
    /// millisecond precision), moves it to `pending` with its lease ended (`lease_until =
    /// now()`), `recovery_attempts = 0` and the note's reason, and appends a `handed_back` event
    /// (actor: the operator; detail: reason and evidence) with the change. The lease token is
    /// kept: the recovery job claims the key from it. Returns whether it did. Callers validate
    /// the note (see [`crate::maintenance::hand_back`]).
    fn hand_back(
        &self,
        key: &IdempotencyKey,
        note: &OperatorNote,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The history of `key`, oldest first: its newest `limit` events (a released key keeps its
    /// history, and a later reservation continues it). Reads only.
    fn history(
        &self,
        key: &IdempotencyKey,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<KeyEvent>, StoreError>> + Send;

    /// Row counts by operation and state, the age of the oldest pending row, the number of
    /// expired leases and of purgeable rows, all by the database clock.
    fn stats(&self) -> impl Future<Output = Result<KeyStats, StoreError>> + Send;
}
