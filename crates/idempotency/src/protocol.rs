//! The protocol of the article, top to bottom: **reserve** (own commit) → **run** the work in the
//! business transaction → **complete** the key in that same transaction → commit; on failure
//! **release** the key only if it is still pending with our lease.
//!
//! An application calls [`Idempotency::run`]. An integration (an HTTP layer, a queue adapter)
//! may take the steps one at a time: [`Idempotency::reserve`] answers a [`Reservation`],
//! [`Idempotency::begin_reserved`] a [`Begun`], and a request is fingerprinted with a
//! [`FingerprintBuilder`] (bodies in [`canonical_json`]).
//!
//! ```
//! use idempotency::protocol::{canonical_json, FingerprintBuilder};
//! let body = canonical_json(&serde_json::json!({"b": 1, "a": 2}))?;
//! let fingerprint = idempotency::Fingerprint::builder().part("body", &body).finish();
//! let _: FingerprintBuilder = idempotency::Fingerprint::builder();
//! assert_eq!(fingerprint.to_hex().len(), 64);
//! # Ok::<(), serde_json::Error>(())
//! ```

pub use crate::fingerprint::{canonical_json, FingerprintBuilder};

use crate::{
    disposition::Disposition,
    error::{BoxError, Error, StoreError},
    heartbeat::Heartbeat,
    lease::Lease,
    maintenance::signals,
    recent_replays::RecentReplays,
    replay_cache::ReplayCache,
    steps::StepPolicy,
    store::{
        history::EventKind, Effects, Insertion, KeyRecord, KeyState, LeaseToken, PendingRow,
        ReserveInTransaction, ReservedIn, Store,
    },
    Fingerprint, IdempotencyKey, Outcome,
};
use futures_util::{future::BoxFuture, FutureExt};
use serde::{de::DeserializeOwned, Serialize};
use std::{panic::AssertUnwindSafe, sync::Arc, time::Duration};
use tracing::Instrument;

/// How many times a reservation is retried when the row it conflicted with vanished meanwhile.
const RESERVE_ATTEMPTS: u32 = 8;

/// One attempt at a logical operation: its key, the fingerprint of this request, and what it
/// touches.
///
/// ```
/// use idempotency::{Attempt, Effects, Fingerprint, IdempotencyKey};
/// let key = IdempotencyKey::new("user-1", "send-mail", "k-1")?;
/// let attempt = Attempt::new(key, Fingerprint::of_bytes(b"hello")).with_effects(Effects::External);
/// assert_eq!(attempt.effects(), Effects::External);
/// # Ok::<(), idempotency::key::InvalidKey>(())
/// ```
#[derive(Debug, Clone)]
pub struct Attempt {
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    effects: Effects,
    journaled: bool,
}

impl Attempt {
    /// A local attempt.
    pub fn new(key: IdempotencyKey, fingerprint: Fingerprint) -> Self {
        Self {
            key,
            fingerprint,
            effects: Effects::Local,
            journaled: false,
        }
    }

    /// The key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The key, taking the attempt apart.
    pub fn into_key(self) -> IdempotencyKey {
        self.key
    }

    /// What this request asked for.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// What the work touches (default [`Effects::Local`]).
    pub fn effects(&self) -> Effects {
        self.effects
    }

    /// Whether the work is a durable operation ([`Steps`](crate::durable::Steps)) that commits a recovery point before
    /// any outside call (default `false`). Its reservation then need not be flushed to disk on
    /// its own: the first step's commit flushes it too (see [`Attempt::with_journaled`]).
    pub fn journaled(&self) -> bool {
        self.journaled
    }

    /// Sets what the work touches.
    pub fn with_effects(mut self, effects: Effects) -> Self {
        self.effects = effects;
        self
    }

    /// Declares the work a durable operation run through [`Steps`](crate::durable::Steps) ([`Idempotency::perform`]
    /// and [`Idempotency::perform_reserved`] do): every outside call comes after a committed,
    /// flushed recovery point (a local step, or the mark [`Steps::call`](crate::durable::Steps::call) writes first). A crash
    /// before that commit loses at most a reservation whose work had no effect, so the
    /// reservation is not flushed on its own (PostgreSQL: `synchronous_commit = off` for its
    /// statement; log records are flushed in order, so the first step's commit makes it durable).
    ///
    /// Only declare this for work that makes no outside call before its first step.
    ///
    /// ```
    /// use idempotency::{Attempt, Effects, Fingerprint, IdempotencyKey};
    /// let key = IdempotencyKey::new("user-1", "purchase", "k-1")?;
    /// let attempt = Attempt::new(key, Fingerprint::of_bytes(b"{}"))
    ///     .with_effects(Effects::External)
    ///     .with_journaled(true);
    /// assert!(attempt.journaled());
    /// # Ok::<(), idempotency::key::InvalidKey>(())
    /// ```
    pub fn with_journaled(mut self, journaled: bool) -> Self {
        self.journaled = journaled;
        self
    }
}

/// The reason a key is parked with when `run_with`'s decision for an error is
/// [`Disposition::Store`]: the core has no encoding for the error.
const STORE_FOR_AN_ERROR: &str = "the work failed and its error was marked Disposition::Store, \
which the core cannot store (return a definitive failure as Ok to store it)";

/// How a run starts: with a stored result, or with the key held and the business transaction.
enum Started<S: Store, R> {
    Replayed(R),
    Acquired(Lease<S>, sqlx::Transaction<'static, S::Database>),
}

/// The answer of [`Idempotency::begin_reserved`]: the key held and the business transaction
/// begun, or the stored result.
///
/// ```no_run
/// # async fn demo(idem: idempotency::Idempotency<idempotency::PgStore>, attempt: idempotency::Attempt) -> Result<(), idempotency::Error> {
/// use idempotency::protocol::Begun;
/// match idem.begin_reserved(&attempt).await? {
///     Begun::Acquired(lease, mut tx) => {
///         sqlx::query("INSERT INTO orders (sku) VALUES ('tea')").execute(&mut *tx).await.map_err(idempotency::StoreError::from)?;
///         lease.finish(tx, br#"{"order":1}"#).await?;
///     }
///     Begun::Completed(stored) => println!("replay {} bytes", stored.len()),
/// }
/// # Ok(()) }
/// ```
pub enum Begun<S: Store> {
    /// We hold the key: run the work in the transaction, then [`Lease::finish`] both.
    Acquired(Lease<S>, sqlx::Transaction<'static, S::Database>),
    /// The operation was completed before; these are its stored result bytes.
    Completed(Vec<u8>),
}

impl<S: Store> std::fmt::Debug for Begun<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Begun::Acquired(lease, _) => f
                .debug_tuple("Acquired")
                .field(lease.key())
                .finish_non_exhaustive(),
            Begun::Completed(stored) => f.debug_tuple("Completed").field(&stored.len()).finish(),
        }
    }
}

/// The answer of [`Idempotency::reserve`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Reservation<S: Store> {
    /// We hold the key; run the work and [`Lease::finish`] it.
    Acquired(Lease<S>),
    /// The operation was completed before; these are its stored result bytes.
    Completed(Vec<u8>),
}

/// A reservation on its way from the reserving task to its caller. Dropped before the caller
/// took it (the caller was cancelled), it releases an acquired key: no work ran under it, so
/// this holds for external work too, which a dropped [`Lease`] would leave pending.
struct Unclaimed<S: Store>(Option<Result<Reservation<S>, Error>>);

impl<S: Store> Drop for Unclaimed<S> {
    fn drop(&mut self) {
        if let Some(Ok(Reservation::Acquired(mut lease))) = self.0.take() {
            lease.release_in_background();
        }
    }
}

/// The engine: a store plus the lease and retention policy.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency::{SqliteStore, Store, Attempt, Fingerprint, IdempotencyKey, Idempotency, Outcome};
///
/// let store = SqliteStore::connect("sqlite://shop.db?mode=rwc").await?;
/// store.migrate().await?;
/// let idem = Idempotency::new(store);
///
/// let request = serde_json::json!({"sku": "tea", "quantity": 2});
/// let attempt = Attempt::new(
///     IdempotencyKey::new("user-42", "purchase", "c0ffee")?,
///     Fingerprint::of_json(&request)?,
/// );
/// let outcome = idem
///     .run(&attempt, async |tx| {
///         // The closure borrows `request`: no clone, no `move`.
///         sqlx::query("INSERT INTO orders (sku) VALUES (?)")
///             .bind(request["sku"].as_str())
///             .execute(&mut **tx)
///             .await?;
///         Ok::<_, sqlx::Error>(serde_json::json!({"order": 1}))
///     })
///     .await?;
/// match outcome {
///     Outcome::Executed(order) => println!("charged: {order}"),
///     Outcome::Replayed(order) => println!("already charged: {order}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    store: S,
    lease: Duration,
    retention: Duration,
    max_retry_after: Duration,
    /// `Some`: forced by [`with_replay_first`](Self::with_replay_first); `None`: adaptive.
    replay_first: Option<bool>,
    recent_replays: Arc<RecentReplays>,
    step_policy: StepPolicy,
    heartbeat: bool,
    /// Results this process completed, for replays without a round trip (opt-in).
    replay_cache: Option<Arc<ReplayCache>>,
    /// `Some`: local work reserves inside its business transaction, and a duplicate waits for
    /// it (opt-in).
    single_transaction: Option<SingleTransaction<S>>,
}

/// The single-transaction mode as an engine holds it: how long a duplicate waits, and the
/// store's [`ReserveInTransaction`] captured where the mode was turned on, so that the engine
/// (and the code generic over it) needs only [`Store`].
struct SingleTransaction<S> {
    wait: Duration,
    reserve: Arc<dyn ReservesInTransaction<S>>,
}

impl<S> Clone for SingleTransaction<S> {
    fn clone(&self) -> Self {
        Self {
            wait: self.wait,
            reserve: self.reserve.clone(),
        }
    }
}

impl<S> std::fmt::Debug for SingleTransaction<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingleTransaction")
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

/// [`ReserveInTransaction::reserve_in`], callable where only `S: Store` is known.
trait ReservesInTransaction<S>: Send + Sync {
    fn reserve_in<'a>(
        &self,
        store: &'a S,
        tx: &'a mut sqlx::Transaction<'static, S::Database>,
        row: &'a PendingRow<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<ReservedIn, StoreError>>
    where
        S: Store;
}

/// The capability of a store that has it.
struct Captured;

impl<S: ReserveInTransaction> ReservesInTransaction<S> for Captured {
    fn reserve_in<'a>(
        &self,
        store: &'a S,
        tx: &'a mut sqlx::Transaction<'static, S::Database>,
        row: &'a PendingRow<'a>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<ReservedIn, StoreError>>
    where
        S: Store,
    {
        Box::pin(store.reserve_in(tx, row, wait))
    }
}

impl<S: Store> Idempotency<S> {
    /// An engine with a 10 s lease kept alive by a heartbeat while work runs
    /// ([`with_heartbeat`](Self::with_heartbeat)), 24 h retention, and an adaptive replay read
    /// (see [`with_replay_first`](Self::with_replay_first)).
    ///
    /// Why 10 s: with the heartbeat a live holder keeps its key however long it works, so the
    /// lease no longer has to outlast the slowest work. It only bounds how long a *crashed*
    /// holder blocks its key (a retry takes local work over, the recovery job looks at external
    /// work, one lease after the last beat), and it must stay well above a beat's round trip
    /// and a pause of the process (a beat every 3.3 s).
    pub fn new(store: S) -> Self {
        Self {
            store,
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(24 * 60 * 60),
            max_retry_after: Duration::from_secs(1),
            replay_first: None,
            recent_replays: Arc::default(),
            step_policy: StepPolicy::default(),
            heartbeat: true,
            replay_cache: None,
            single_transaction: None,
        }
    }

    /// How durable operations treat outside calls whose outcome is unknown or not done
    /// (default [`StepPolicy::default`]).
    pub fn with_step_policy(mut self, policy: StepPolicy) -> Self {
        self.step_policy = policy;
        self
    }

    /// The step policy.
    pub fn step_policy(&self) -> StepPolicy {
        self.step_policy
    }

    /// Forces whether [`reserve`](Self::reserve) first tries a plain read for a stored result
    /// ([`Store::find_replay`]) before the reserving INSERT.
    ///
    /// The read answers a replay with one indexed lookup, but costs a first request one more
    /// round trip; without it, the reserving INSERT answers a replay too (its conflict returns
    /// the stored row), a little more dearly. By default the engine decides per request: it
    /// reads first while more than half of its recent reservations (about the last 16 to 50, in
    /// this process) were replays, and inserts first otherwise. Force `false` where duplicates
    /// are rare, `true` where replays dominate. Either way the INSERT alone decides every case
    /// the read does not answer, so the choice never changes an answer.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// # use idempotency::{SqliteStore, Idempotency};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// let writes_mostly = Idempotency::new(store).with_replay_first(false);
    /// # Ok(()) }
    /// ```
    pub fn with_replay_first(mut self, replay_first: bool) -> Self {
        self.replay_first = Some(replay_first);
        self
    }

    /// Answers replays of results **this process** completed from memory, without a database
    /// round trip: a bounded cache of at most `capacity` results (the oldest evicted first),
    /// off by default.
    ///
    /// Safe because a completed result never changes until its key expires: an entry answers
    /// only the same scope, operation and key **with the same request fingerprint**, and only
    /// until a deadline no later than the row's `expires_at` (the completion's start plus the
    /// retention). Anything else (a miss, another request under the key, an expired entry)
    /// goes to the database, which answers as without the cache. Memory: about the size of
    /// the stored responses plus 200 bytes per entry.
    ///
    /// Do not use it where keys are changed behind the engine's back before they expire: an
    /// operator deleting or rewriting rows by hand, a restore from a backup, or a retention
    /// shortened in the database. The cache would go on replaying what it holds until its
    /// deadline.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// # use idempotency::{SqliteStore, Idempotency};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// let idem = Idempotency::new(store).with_replay_cache(10_000);
    /// # Ok(()) }
    /// ```
    pub fn with_replay_cache(mut self, capacity: usize) -> Self {
        self.replay_cache = Some(Arc::new(ReplayCache::new(capacity)));
        self
    }

    /// **Single-transaction mode** for local work (off by default): the key row is inserted
    /// *inside* the business transaction instead of in a reservation committed on its own, and
    /// completed and committed with the work. A duplicate's INSERT waits on the unique index
    /// until that transaction ends, for at most `wait` (set for that one statement:
    /// PostgreSQL's `lock_timeout`; InnoDB's `innodb_lock_wait_timeout`, in whole seconds,
    /// rounded up), and then replays the stored result instead of getting
    /// [`Error::InProgress`]; after `wait` it does get [`Error::InProgress`]. One round trip and
    /// one commit fewer per first request.
    ///
    /// How it differs from the article's protocol, which it follows in every other case:
    /// * nobody sees the reservation before the work commits: no pending row exists for the
    ///   recovery job, the operator's list or other processes; a crash or a rollback leaves no
    ///   key at all (the work rolled back with it), so a retry runs the work once;
    /// * a duplicate holds a connection while it waits, and the holder's transaction stays open
    ///   for the whole work (as the business transaction already does);
    /// * a 422 for another request under the same key comes once the holder commits;
    /// * a response stored **without** the work's writes (a stored 4xx) or a park needs a
    ///   committed row of its own: the transaction rolls back and the key is reserved again
    ///   the article's way for it.
    ///
    /// It applies only to [`Effects::Local`] work that is not journaled: work with an outside
    /// effect always reserves on its own commit first, since a reservation nobody sees could
    /// not be found by the recovery job after a crash. It needs a store whose database queues
    /// duplicate INSERTs on the unique index ([`ReserveInTransaction`]: PostgreSQL, MySQL and
    /// MariaDB); SQLite, which does not offer it, reserves the article's way.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// use idempotency::{Idempotency, PgStore};
    /// use std::time::Duration;
    /// let store = PgStore::connect("postgres://shop@127.0.0.1/shop").await?;
    /// let idem = Idempotency::new(store).with_single_transaction(Duration::from_secs(5));
    /// # Ok(()) }
    /// ```
    pub fn with_single_transaction(mut self, wait: Duration) -> Self
    where
        S: ReserveInTransaction,
    {
        self.single_transaction = Some(SingleTransaction {
            wait,
            reserve: Arc::new(Captured),
        });
        self
    }

    /// How long a duplicate waits for `attempt`'s holder in the single-transaction mode, if
    /// that mode applies to it ([`with_single_transaction`](Self::with_single_transaction)):
    /// turned on, local work, not journaled.
    ///
    /// ```
    /// # #[cfg(feature = "postgres")]
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency::{Attempt, Effects, Fingerprint, IdempotencyKey, Idempotency, PgStore};
    /// use std::time::Duration;
    /// let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://shop@127.0.0.1/shop")?;
    /// let idem = Idempotency::new(PgStore::new(pool)).with_single_transaction(Duration::from_secs(5));
    /// let attempt = Attempt::new(IdempotencyKey::new("u", "op", "k")?, Fingerprint::of_bytes(b""));
    /// assert_eq!(idem.single_transaction_wait(&attempt), Some(Duration::from_secs(5)));
    /// // Work with an outside effect reserves on its own commit.
    /// let external = attempt.with_effects(Effects::External);
    /// assert_eq!(idem.single_transaction_wait(&external), None);
    /// # Ok(()) }
    /// ```
    pub fn single_transaction_wait(&self, attempt: &Attempt) -> Option<Duration> {
        let applies = attempt.effects == Effects::Local && !attempt.journaled;
        let mode = self.single_transaction.as_ref()?;
        applies.then_some(mode.wait)
    }

    /// The result of a completed key cached by [`with_replay_cache`](Self::with_replay_cache),
    /// for the attempt's fingerprint.
    fn cached_replay(&self, attempt: &Attempt) -> Option<Vec<u8>> {
        let cache = self.replay_cache.as_ref()?;
        cache.get(&attempt.key, &attempt.fingerprint)
    }

    /// How long a holder may go without a sign of life before its key may be taken over
    /// (local) or recovered (default 10 s). While a lease is held its heartbeat extends it
    /// every third of its length ([`with_heartbeat`](Self::with_heartbeat)), so work may run
    /// longer than the lease; the lease bounds how long a *dead* holder blocks its key: one
    /// lease after its last beat.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Whether a held lease is extended while its work runs (default `true`): every third of
    /// the lease, an `UPDATE … WHERE lease_token = ours` by the database's clock
    /// ([`Store::extend_lease`]), in a task of its own. A beat that finds the token gone stops
    /// and flags the lease ([`Lease::is_lost`]); the completion then fails with
    /// [`Error::LeaseLost`] without writing. Off, a holder that works longer than its lease has
    /// its key taken over (fenced: its completion fails), so the lease must outlast the
    /// longest work.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo() -> Result<(), idempotency::StoreError> {
    /// # use idempotency::{SqliteStore, Idempotency};
    /// # use std::time::Duration;
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// // A 10 s lease, kept alive every 3.3 s while the work runs.
    /// let idem = Idempotency::new(store).with_lease(Duration::from_secs(10));
    /// # Ok(()) }
    /// ```
    pub fn with_heartbeat(mut self, heartbeat: bool) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// The beating half of a lease on `key` held with `token` (`None` when off).
    fn heartbeat_for(&self, key: &IdempotencyKey, token: LeaseToken) -> Option<Heartbeat> {
        self.heartbeat
            .then(|| Heartbeat::start(&self.store, key, token, self.lease))
            .flatten()
    }

    /// How long keys and results are kept after completion.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The longest `retry_after` hint given with [`Error::InProgress`] (default 1 s).
    pub fn with_max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The lease length.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Step 1: reserve the key, committed on its own, or learn why not.
    ///
    /// * new (or expired, or failed) key → [`Reservation::Acquired`];
    /// * other fingerprint → [`Error::KeyReused`];
    /// * completed → [`Reservation::Completed`] with the stored bytes;
    /// * pending with a live lease → [`Error::InProgress`];
    /// * pending with an ended lease: taken over when [`Effects::Local`], else
    ///   [`Error::InProgress`] (the recovery job decides);
    /// * needs review → [`Error::NeedsReview`].
    ///
    /// When [`replays_first`](Self::replays_first), a completed key with the same fingerprint is
    /// answered by a plain read, before any INSERT is tried.
    ///
    /// Cancellation-safe: the INSERT runs in a task of its own. If the caller is dropped while it
    /// is in flight (a client hung up), the task finishes it and releases a key it reserved, so
    /// no key is left pending without a holder until its lease ends.
    pub async fn reserve(&self, attempt: &Attempt) -> Result<Reservation<S>, Error> {
        let span = signals::phase_span!(signals::SPAN_RESERVE, attempt.key);
        let reserved = self.reserve_once(attempt).instrument(span.clone()).await;
        noted_reservation(&span, &attempt.key, &reserved);
        reserved
    }

    /// [`reserve`](Self::reserve), without its span and counts.
    async fn reserve_once(&self, attempt: &Attempt) -> Result<Reservation<S>, Error> {
        if let Some(result) = self.replay_before_insert(attempt).await? {
            return Ok(Reservation::Completed(result));
        }
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel();
        let (engine, attempt) = (self.clone(), attempt.clone());
        tokio::spawn(
            async move {
                let answer = engine.insert_or_read(&attempt).await;
                // If the caller is gone, the answer is dropped here (or in the channel, if the
                // caller goes between this send and its receipt), and `Unclaimed` releases the key.
                let _ = answer_tx.send(Unclaimed(Some(answer)));
            }
            .in_current_span(),
        );
        match answer_rx.await {
            Ok(mut unclaimed) => {
                let answer = unclaimed.0.take().expect("claimed once");
                self.recent_replays
                    .observe(matches!(answer, Ok(Reservation::Completed(_))));
                answer
            }
            Err(_) => Err(Error::Store(StoreError::Database(
                sqlx::Error::WorkerCrashed,
            ))),
        }
    }

    /// Reserves the key and begins the business transaction: [`reserve`](Self::reserve) (its
    /// own commit) then [`Store::begin`]; or, in the
    /// [single-transaction mode](Self::with_single_transaction), the pending row inserted
    /// inside the transaction. A duplicate of a holder in that mode waits for it and then
    /// replays. The other answers are those of [`reserve`](Self::reserve).
    ///
    /// Cancellation-safe: a transaction dropped before it was handed over rolls back, and a
    /// reservation committed on its own is released as in [`reserve`](Self::reserve).
    pub async fn begin_reserved(&self, attempt: &Attempt) -> Result<Begun<S>, Error> {
        if let Some(wait) = self.single_transaction_wait(attempt) {
            if let Some(begun) = self.reserve_in_transaction(attempt, wait).await? {
                return Ok(begun);
            }
        }
        let mut lease = match self.reserve(attempt).await? {
            Reservation::Completed(bytes) => return Ok(Begun::Completed(bytes)),
            Reservation::Acquired(lease) => lease,
        };
        match self.store.begin().await {
            Ok(tx) => Ok(Begun::Acquired(lease, tx)),
            Err(e) => {
                lease.release_quietly().await;
                Err(e.into())
            }
        }
    }

    /// The single-transaction reservation. `None` when the key has a committed row: the caller
    /// answers it the article's way.
    async fn reserve_in_transaction(
        &self,
        attempt: &Attempt,
        wait: Duration,
    ) -> Result<Option<Begun<S>>, Error> {
        let span = signals::phase_span!(signals::SPAN_RESERVE, attempt.key);
        let reserved = self
            .reserve_in_transaction_once(attempt, wait)
            .instrument(span.clone())
            .await;
        match &reserved {
            Ok(Some(Begun::Acquired(..))) => signals::record(&span, signals::ACQUIRED),
            Ok(Some(Begun::Completed(_))) => {
                signals::record(&span, signals::REPLAYED);
                signals::outcome(attempt.key.operation(), signals::REPLAYED);
            }
            // Reserved again the article's way, under a span of its own.
            Ok(None) => {}
            Err(error) => noted_refusal(&span, &attempt.key, error),
        }
        reserved
    }

    /// [`reserve_in_transaction`](Self::reserve_in_transaction), without its span and counts.
    async fn reserve_in_transaction_once(
        &self,
        attempt: &Attempt,
        wait: Duration,
    ) -> Result<Option<Begun<S>>, Error> {
        let Some(mode) = &self.single_transaction else {
            return Ok(None);
        };
        if let Some(result) = self.replay_before_insert(attempt).await? {
            return Ok(Some(Begun::Completed(result)));
        }
        let mut tx = self.store.begin().await?;
        let row = self.pending_row(attempt);
        let reserved = mode
            .reserve
            .reserve_in(&self.store, &mut tx, &row, wait)
            .await;
        let reserved = match reserved {
            // The key's history begins in the same transaction as its row.
            Ok(ReservedIn::Inserted) if row.records_history() => self
                .store
                .append_event(&mut tx, row.key, EventKind::Reserved, None)
                .await
                .map(|()| ReservedIn::Inserted),
            other => other,
        };
        if let Ok(ReservedIn::Inserted) = reserved {
            self.recent_replays.observe(false);
            let lease = self.lease_for(&row, true);
            return Ok(Some(Begun::Acquired(lease, tx)));
        }
        let _ = tx.rollback().await;
        match reserved? {
            ReservedIn::Busy => Err(Error::InProgress {
                retry_after: self.max_retry_after,
            }),
            _ => Ok(None),
        }
    }

    /// A committed reservation for settling `lease`'s key without the work's transaction (a
    /// refusal stored without the work's writes, a park): `lease` itself unless it is
    /// [in the transaction](Lease::is_in_transaction); then, once that transaction rolled back,
    /// the key reserved again the article's way (a duplicate that got there first answers
    /// instead: [`Reservation::Completed`] or an error).
    ///
    /// ```no_run
    /// # async fn demo(idem: idempotency::Idempotency<idempotency::PgStore>, attempt: idempotency::Attempt, lease: idempotency::Lease<idempotency::PgStore>) -> Result<(), idempotency::Error> {
    /// use idempotency::protocol::Reservation;
    /// if let Reservation::Acquired(lease) = idem.reserve_committed(&attempt, lease).await? {
    ///     lease.park("refused by the fraud check").await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn reserve_committed(
        &self,
        attempt: &Attempt,
        mut lease: Lease<S>,
    ) -> Result<Reservation<S>, Error> {
        if !lease.in_transaction {
            return Ok(Reservation::Acquired(lease));
        }
        lease.disarm();
        self.reserve(attempt).await
    }

    /// The replay read alone ([`Store::find_replay`]): the stored result of a completed,
    /// unexpired key with the attempt's fingerprint, or `None` (then [`reserve`](Self::reserve)
    /// decides). It writes nothing, so it may be cancelled at any point.
    pub async fn replay(&self, attempt: &Attempt) -> Result<Option<Vec<u8>>, Error> {
        match self.cached_replay(attempt) {
            Some(result) => Ok(Some(result)),
            None => self.stored_replay(attempt).await,
        }
    }

    /// What a reservation answers before it tries any INSERT: a cached replay, or, when
    /// [`replays_first`](Self::replays_first), the store's replay read.
    async fn replay_before_insert(&self, attempt: &Attempt) -> Result<Option<Vec<u8>>, Error> {
        // A cache hit does not vote on `replays_first`: that heuristic decides whether a
        // database read comes first, and cached replays never reach the database.
        if let Some(result) = self.cached_replay(attempt) {
            return Ok(Some(result));
        }
        if self.replays_first() {
            return self.stored_replay(attempt).await;
        }
        Ok(None)
    }

    /// The store's replay read; a hit counts toward [`replays_first`](Self::replays_first).
    async fn stored_replay(&self, attempt: &Attempt) -> Result<Option<Vec<u8>>, Error> {
        let result = self
            .store
            .find_replay(&attempt.key, &attempt.fingerprint)
            .await?;
        if result.is_some() {
            // A miss is left to the reservation that follows, so it counts once.
            self.recent_replays.observe(true);
        }
        Ok(result)
    }

    /// Whether [`reserve`](Self::reserve) reads for a replay first now: as forced by
    /// [`with_replay_first`](Self::with_replay_first), or else whether most recent reservations
    /// were replays.
    pub fn replays_first(&self) -> bool {
        self.replay_first
            .unwrap_or_else(|| self.recent_replays.mostly_replays())
    }

    /// The reserving INSERT and, on conflict, the decision on the existing row.
    async fn insert_or_read(&self, attempt: &Attempt) -> Result<Reservation<S>, Error> {
        for _ in 0..RESERVE_ATTEMPTS {
            let row = self.pending_row(attempt);
            let existing = match self.store.insert_pending(&row).await? {
                Insertion::Inserted => {
                    return Ok(Reservation::Acquired(self.lease_for(&row, false)))
                }
                Insertion::Vanished => continue,
                Insertion::Conflict(existing) => existing,
            };
            if existing.is_resumable()
                && existing.lease_expired()
                && existing.fingerprint == attempt.fingerprint
            {
                match self.claim_to_resume(&row, &existing).await? {
                    Some(resumed) => return Ok(resumed),
                    None => continue,
                }
            }
            let reusable = match existing.state {
                KeyState::Failed => true,
                KeyState::Completed => existing.expired,
                KeyState::Pending => existing.effects == Effects::Local && existing.lease_expired(),
                KeyState::NeedsReview => false,
            };
            if reusable {
                if self.store.take_over(&row, existing.lease_token).await? {
                    tracing::debug!(key = %attempt.key, state = %existing.state, "idempotency key taken over");
                    return Ok(Reservation::Acquired(self.lease_for(&row, false)));
                }
                continue;
            }
            return self.answer_existing(attempt, existing);
        }
        Err(StoreError::Contention(RESERVE_ATTEMPTS).into())
    }

    /// A durable operation whose holder went away: claims it (fenced) with its journal, to carry
    /// it on from its recovery point. `None` when another claimer was first (reserve again).
    async fn claim_to_resume(
        &self,
        row: &PendingRow<'_>,
        existing: &KeyRecord,
    ) -> Result<Option<Reservation<S>>, Error> {
        let key = row.key;
        if !self
            .store
            .claim_for_recovery(key, existing.lease_token, row.token, self.lease)
            .await?
        {
            return Ok(None);
        }
        let mut lease = self.lease_for(row, false);
        lease.effects = Effects::External;
        // The journal as of the claim: the row read before it may miss a step the old holder
        // committed in between (steps do not change the token).
        match self.claimed_row(key, row.token).await {
            Ok(Some(claimed)) => {
                tracing::debug!(key = %key, recovery_point = ?claimed.recovery_point, "durable operation resumed by a retry");
                lease.resumed = Some(Box::new(claimed));
                Ok(Some(Reservation::Acquired(lease)))
            }
            // Taken from us meanwhile: our lease is nobody's to release.
            Ok(None) => {
                lease.disarm();
                Err(Error::LeaseLost)
            }
            Err(error) => {
                // We hold a durable key we cannot read: leave it pending.
                lease.disarm();
                Err(error.into())
            }
        }
    }

    /// The answer for a key held by someone else, or settled: 422 for another request, the
    /// stored result, needs review, or in progress with a retry hint.
    fn answer_existing(
        &self,
        attempt: &Attempt,
        existing: KeyRecord,
    ) -> Result<Reservation<S>, Error> {
        if existing.fingerprint != attempt.fingerprint {
            return Err(Error::KeyReused);
        }
        match existing.state {
            KeyState::Completed => Ok(Reservation::Completed(existing.result.unwrap_or_default())),
            KeyState::NeedsReview => Err(Error::NeedsReview),
            _ => Err(Error::InProgress {
                retry_after: existing
                    .lease_remaining
                    .min(self.max_retry_after)
                    .max(Duration::from_millis(1)),
            }),
        }
    }

    /// The row of `key` as it is now, if `token` still holds it: what a claimer of a durable
    /// operation resumes from. Read after the claim, it holds every step the old holder
    /// committed, and no later one can commit (the token changed).
    pub(crate) async fn claimed_row(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self
            .store
            .find(key)
            .await?
            .filter(|row| row.lease_token == token && row.state == KeyState::Pending))
    }

    /// The row that reserves `attempt`'s key for a new holder (a fresh token).
    fn pending_row<'a>(&self, attempt: &'a Attempt) -> PendingRow<'a> {
        PendingRow {
            key: &attempt.key,
            fingerprint: attempt.fingerprint,
            token: LeaseToken::new(),
            effects: attempt.effects,
            journaled: attempt.journaled,
            lease: self.lease,
            retention: self.retention,
        }
    }

    /// A lease on the key `row` reserved; `in_transaction` for a row written inside the
    /// business transaction, which nobody sees before it commits (no heartbeat: nothing to
    /// extend, nobody to take it over).
    fn lease_for(&self, row: &PendingRow<'_>, in_transaction: bool) -> Lease<S> {
        Lease {
            store: self.store.clone(),
            key: row.key.clone(),
            token: row.token,
            effects: row.effects,
            retention: self.retention,
            armed: true,
            resumed: None,
            heartbeat: (!in_transaction)
                .then(|| self.heartbeat_for(row.key, row.token))
                .flatten(),
            replay_cache: self.cache_for(row.fingerprint),
            in_transaction,
            records_history: row.records_history(),
        }
    }

    /// The replay cache and the fingerprint a lease's completion is remembered under.
    fn cache_for(&self, fingerprint: Fingerprint) -> Option<(Arc<ReplayCache>, Fingerprint)> {
        self.replay_cache
            .as_ref()
            .map(|cache| (cache.clone(), fingerprint))
    }

    /// A lease for a key the recovery job claimed with `token`.
    pub(crate) fn claimed_lease(&self, record: &KeyRecord, token: LeaseToken) -> Lease<S> {
        Lease {
            store: self.store.clone(),
            key: record.key.clone(),
            token,
            effects: record.effects,
            retention: self.retention,
            armed: true,
            // Only a key with recorded progress is resumed; one with nothing recorded made no
            // outside call and may be released.
            resumed: record.request.is_some().then(|| Box::new(record.clone())),
            heartbeat: self.heartbeat_for(&record.key, token),
            replay_cache: self.cache_for(record.fingerprint),
            in_transaction: false,
            // Claimed by the recovery job: external work, or a durable operation.
            records_history: true,
        }
    }

    /// Runs `work` at most once per key: reserve, run in the business transaction, complete in
    /// the same transaction, commit. On error, panic or cancellation the writes roll back, and
    /// the key is released for [`Effects::Local`] work and left pending for the recovery job for
    /// [`Effects::External`] work, whose outside effect may have happened (see [`Lease`]).
    /// [`run_with`](Self::run_with) decides per error instead.
    ///
    /// To store a *definitive* business refusal (so a replay refuses the same way), make it part
    /// of the result: return `Ok(Err(refusal))` with `R = Result<T, Refusal>`.
    ///
    /// The work is an async closure, `async |tx| { … }`, given the business transaction. It may
    /// borrow the caller's data (the request, a reference to its state): the transaction is
    /// only lent to it for the call. sqlx's executors are implemented for the connection, not
    /// the transaction, so a query runs on `&mut **tx`; a helper taking
    /// `&mut sqlx::Transaction<'_, DB>` gets `tx` itself.
    ///
    /// The closure must accept a transaction of any lifetime (`for<'c>`), not only the
    /// `Transaction<'static, _>` it is given: with `'static` in the bound, rustc (up to at least
    /// 1.95) cannot prove the future `Send` where it must be (`tokio::spawn`, axum), and reports
    /// "implementation of `AsyncFnOnce` is not general enough". A helper the work calls with
    /// `tx` therefore takes `&mut Transaction<'_, DB>`, not `&mut Transaction<'static, DB>`.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency::{SqliteStore, Store, Attempt, Fingerprint, Idempotency, IdempotencyKey};
    ///
    /// struct Order { sku: String, quantity: i64 }
    ///
    /// # let dir = tempfile::tempdir()?;
    /// # let url = format!("sqlite://{}", dir.path().join("shop.db").display());
    /// let store = SqliteStore::connect(&url).await?;
    /// store.migrate().await?;
    /// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT, quantity INTEGER)")
    ///     .execute(store.pool())
    ///     .await?;
    /// let idem = Idempotency::new(store);
    ///
    /// let order = Order { sku: "tea".into(), quantity: 2 };
    /// let attempt = Attempt::new(
    ///     IdempotencyKey::new("user-42", "purchase", "k-1")?,
    ///     Fingerprint::of_bytes(b"tea x2"),
    /// );
    /// for replay in [false, true] {
    ///     let outcome = idem
    ///         .run(&attempt, async |tx| {
    ///             let id: i64 = sqlx::query_scalar(
    ///                 "INSERT INTO orders (sku, quantity) VALUES (?, ?) RETURNING id",
    ///             )
    ///             .bind(&order.sku) // borrowed from the caller
    ///             .bind(order.quantity)
    ///             .fetch_one(&mut **tx)
    ///             .await?;
    ///             Ok::<_, sqlx::Error>(id)
    ///         })
    ///         .await?;
    ///     assert_eq!(outcome.is_replayed(), replay);
    ///     assert_eq!(outcome.into_inner(), 1);
    /// }
    /// # Ok(()) }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    ///
    /// # `Send`
    ///
    /// The future of `run` is `Send` (it can be given to `tokio::spawn`, or be an axum
    /// handler's) whenever the closure's future is: the compiler sees through `run`'s future to
    /// the closure's. Stable Rust cannot yet *name* that future in a bound
    /// (`AsyncFnOnce::CallOnceFuture` is unstable; "return type notation" is not stable), so the
    /// bound is not written here: a non-`Send` value held across an `.await` in the work shows
    /// up as an error where the future must be `Send` (at `tokio::spawn`), not at `run`. The
    /// usual workaround, `F: for<'t> FnOnce(&'t mut Tx) -> Fut` with `Fut: Send + 't` through a
    /// helper trait, would forbid exactly what this signature is for: a closure that borrows the
    /// caller's data (the compiler then requires those borrows to be `'static`).
    ///
    /// # The work, everywhere
    ///
    /// Every place that runs work inside a business transaction takes this same closure and
    /// this same error bound: `run`, [`run_with`](Self::run_with), the durable steps
    /// ([`Steps::local`](crate::durable::Steps::local), [`Steps::finish`](crate::durable::Steps::finish),
    /// [`Steps::fail`](crate::durable::Steps::fail)) and the queue's [`Inbox::handle`](crate::queue::Inbox::handle)
    /// and [`Inbox::handle_with`](crate::queue::Inbox::handle_with) (and `idempotency_amqp`'s
    /// `Incoming::handle`, which call them). Work written for one fits the others.
    ///
    /// The error is any `E: Into<BoxError> + Send`: every `std::error::Error + Send + Sync` type
    /// (`sqlx::Error`, your own `thiserror` enum), `anyhow::Error`, `String` and `&str`. `run`
    /// hands it back untouched, as [`Error::Operation`]; the steps and the inbox, which must keep
    /// or report an error of any work, turn it into a [`BoxError`] ([`StepError::Local`](crate::durable::StepError::Local))
    /// or its text (the failure counter's last error, [`DeliveryAction::Retry`](crate::queue::DeliveryAction::Retry)).
    /// This is the widest bound all of them can live with: `Display` alone could not be boxed
    /// as an error source, and `std::error::Error + 'static` alone would refuse `anyhow::Error`
    /// and plain strings. Unlike sqlx's `Connection::transaction`, no `E: From<sqlx::Error>` is
    /// asked for: the engine's own failures (the store, a lost lease) come back as the other
    /// variants of [`Error`], never inside `E`.
    pub async fn run<R, E, F>(&self, attempt: &Attempt, work: F) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        self.settled_by(attempt, |_| None, work).await
    }

    /// Like [`run`](Self::run), but `on_error` gives the [`Disposition`] of a failed work's key:
    /// [`Release`](Disposition::Release) it (nothing went out), or [`Park`](Disposition::Park)
    /// it as `needs_review` (an outside effect may have happened). The core stores only `Ok`
    /// values, so [`Store`](Disposition::Store) for an error parks the key too. The work is the same
    /// async closure as [`run`](Self::run)'s, with the same error bound (see there, and for `Send`).
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency::{SqliteStore, Store, Attempt, Disposition, Effects, Error, Fingerprint, Idempotency, IdempotencyKey};
    ///
    /// struct Mail { to: String }
    ///
    /// # let dir = tempfile::tempdir()?;
    /// # let url = format!("sqlite://{}", dir.path().join("mail.db").display());
    /// let store = SqliteStore::connect(&url).await?;
    /// store.migrate().await?;
    /// let idem = Idempotency::new(store);
    ///
    /// let mail = Mail { to: "ada@example.com".into() };
    /// let attempt = Attempt::new(
    ///     IdempotencyKey::new("user-42", "send-mail", "k-1")?,
    ///     Fingerprint::of_bytes(mail.to.as_bytes()),
    /// )
    /// .with_effects(Effects::External);
    /// let sent = idem
    ///     .run_with(
    ///         &attempt,
    ///         |e: &String| Disposition::Park(format!("mail provider: {e}")),
    ///         async |_tx| Err::<(), _>(format!("timed out sending to {}", mail.to)),
    ///     )
    ///     .await;
    /// assert!(matches!(sent, Err(Error::Operation(_))));
    /// // The key is parked: a retry is refused until someone looks at it.
    /// assert!(idem.run(&attempt, async |_tx| Ok::<_, String>(())).await.is_err());
    /// # Ok(()) }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    pub async fn run_with<R, E, F, C>(
        &self,
        attempt: &Attempt,
        on_error: C,
        work: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
        C: FnOnce(&E) -> Disposition + Send,
    {
        self.settled_by(attempt, |e| Some(on_error(e)), work).await
    }

    /// [`run`](Self::run) and [`run_with`](Self::run_with): `on_error` answers `None` for the
    /// default by the attempt's effects.
    async fn settled_by<R, E, F, C>(
        &self,
        attempt: &Attempt,
        on_error: C,
        work: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
        C: FnOnce(&E) -> Option<Disposition> + Send,
    {
        let (lease, mut tx) = match self.start(attempt).await? {
            Started::Replayed(stored) => return Ok(Outcome::Replayed(stored)),
            Started::Acquired(lease, tx) => (lease, tx),
        };
        let span = signals::phase_span!(signals::SPAN_WORK, attempt.key);
        let ran = AssertUnwindSafe(work(&mut tx))
            .catch_unwind()
            .instrument(span.clone())
            .await;
        signals::record(
            &span,
            match &ran {
                Ok(Ok(_)) => signals::EXECUTED,
                _ => signals::ERROR,
            },
        );
        drop(span);
        self.settle(attempt, lease, tx, ran, on_error).await
    }

    /// Steps 1 and 2 of a run: reserve (committed before any work), then begin the business
    /// transaction.
    async fn start<R: DeserializeOwned, E>(
        &self,
        attempt: &Attempt,
    ) -> Result<Started<S, R>, Error<E>> {
        // 1. Reserve, committed before any work (or, in the single-transaction mode, inside
        // the business transaction); 2. the business transaction the work runs in.
        match self.begin_reserved(attempt).await.map_err(Error::widen)? {
            Begun::Completed(bytes) => {
                let _replay = signals::phase_span!(signals::SPAN_REPLAY, attempt.key).entered();
                let stored = serde_json::from_slice(&bytes).map_err(Error::Serialization)?;
                Ok(Started::Replayed(stored))
            }
            Begun::Acquired(lease, tx) => Ok(Started::Acquired(lease, tx)),
        }
    }

    /// Parks the key of failed work (its transaction rolled back) for a human, logging a
    /// failure; in the single-transaction mode, under a reservation committed for it.
    async fn park(&self, attempt: &Attempt, lease: Lease<S>, reason: &str) {
        let parked = match self.reserve_committed(attempt, lease).await {
            Ok(Reservation::Acquired(lease)) => lease.park(reason).await.map_err(Error::from),
            // A duplicate holds or settled the key meanwhile: nothing of ours to park.
            Ok(_) => Ok(false),
            Err(error) => Err(error),
        };
        if let Err(error) = parked {
            tracing::error!(%error, key = %attempt.key, "could not park idempotency key");
        }
    }

    /// Step 3 of a run, once the work `ran` in `tx`: complete the key in the same transaction
    /// and commit both; or roll back and release, park or abandon the key.
    async fn settle<R, E, C>(
        &self,
        attempt: &Attempt,
        mut lease: Lease<S>,
        tx: sqlx::Transaction<'static, S::Database>,
        ran: std::thread::Result<Result<R, E>>,
        on_error: C,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize,
        C: FnOnce(&E) -> Option<Disposition>,
    {
        let value = match ran {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => {
                let _ = tx.rollback().await;
                let reason = match on_error(&e) {
                    Some(Disposition::Park(reason)) => Some(reason),
                    Some(Disposition::Store) => Some(STORE_FOR_AN_ERROR.to_owned()),
                    Some(Disposition::Release) => {
                        lease.release_quietly().await;
                        None
                    }
                    // The default by effects: local work is released (nothing went out);
                    // external work stays pending, since its outside effect may have happened,
                    // and the recovery job settles it after its lease.
                    None => {
                        lease.abandon().await;
                        None
                    }
                };
                if let Some(reason) = reason {
                    self.park(attempt, lease, &reason).await;
                }
                return Err(Error::Operation(e));
            }
            Err(panic) => {
                let _ = tx.rollback().await;
                lease.abandon().await;
                std::panic::resume_unwind(panic);
            }
        };
        let bytes = match serde_json::to_vec(&value) {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = tx.rollback().await;
                lease.release_quietly().await;
                return Err(Error::Serialization(e));
            }
        };

        // 3. Complete the key in the same transaction, and commit both.
        lease.finish(tx, &bytes).await.map_err(Error::widen)?;
        Ok(Outcome::Executed(value))
    }
}

/// Records a reservation's answer on its span and counts a refusal or a replay (an acquired key
/// is counted when it is settled).
fn noted_reservation<S: Store>(
    span: &tracing::Span,
    key: &IdempotencyKey,
    reserved: &Result<Reservation<S>, Error>,
) {
    match reserved {
        Ok(Reservation::Acquired(_)) => signals::record(span, signals::ACQUIRED),
        Ok(Reservation::Completed(_)) => {
            signals::record(span, signals::REPLAYED);
            signals::outcome(key.operation(), signals::REPLAYED);
        }
        Err(error) => noted_refusal(span, key, error),
    }
}

/// Records and counts a reservation refused.
fn noted_refusal(span: &tracing::Span, key: &IdempotencyKey, error: &Error) {
    let outcome = match error {
        Error::InProgress { .. } => signals::CONFLICT,
        Error::KeyReused => signals::MISMATCH,
        Error::NeedsReview => signals::NEEDS_REVIEW_OUTCOME,
        Error::LeaseLost => signals::LEASE_LOST,
        _ => {
            signals::record(span, signals::ERROR);
            return;
        }
    };
    signals::record(span, outcome);
    signals::outcome(key.operation(), outcome);
}
