//! Recovery of abandoned keys and operator resolution of parked ones.

use crate::{
    error::{PerformError, StoreError},
    maintenance::signals,
    operation::{Operations, Resumed},
    protocol::Idempotency,
    steps::Settlement,
    store::{
        history::OperatorNote, Effects, Journal, KeyRecord, KeyState, LeaseToken, Maintenance,
        Resolution,
    },
    IdempotencyKey,
};
use chrono::{DateTime, Utc};
use futures_util::{stream::FuturesUnordered, FutureExt, StreamExt};
use std::{fmt, future::Future, panic::AssertUnwindSafe, time::Duration};

/// What the provider says about an external operation whose worker vanished.
///
/// ```
/// use idempotency::durable::ProviderAnswer;
/// let answer = ProviderAnswer::Completed(br#"{"charge":"ch_1"}"#.to_vec());
/// assert!(matches!(answer, ProviderAnswer::Completed(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProviderAnswer {
    /// The effect happened; store these result bytes (the JSON replays will return).
    Completed(Vec<u8>),
    /// The effect did not happen: release the key so a retry runs the work again.
    Failed,
    /// The provider cannot tell (yet): ask again on a later pass, up to the attempt limit.
    Unknown,
}

/// Asks the outside service what became of an external operation ("did charge `k` happen?").
///
/// Called at most once per claim of a key; a resolver that fails (network error, timeout) should
/// answer [`ProviderAnswer::Unknown`].
///
/// ```
/// use idempotency::{durable::{ProviderAnswer, Resolver}};
/// use idempotency::store::KeyRecord;
/// struct AlwaysFailed;
/// impl Resolver for AlwaysFailed {
///     async fn resolve(&self, _record: &KeyRecord) -> ProviderAnswer {
///         ProviderAnswer::Failed
///     }
/// }
/// ```
pub trait Resolver: Send + Sync + 'static {
    /// The provider's answer about `record` (its key, fingerprint, attempts so far …).
    fn resolve(&self, record: &KeyRecord) -> impl Future<Output = ProviderAnswer> + Send;
}

/// The absence of a resolver: external keys are parked for a human.
///
/// ```
/// use idempotency::{durable::NoResolver, maintenance::Recovery};
/// # #[cfg(feature = "sqlite")]
/// # fn demo(store: idempotency::SqliteStore) {
/// let recovery: Recovery<_, NoResolver> = Recovery::new(store);
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NoResolver;

impl Resolver for NoResolver {
    async fn resolve(&self, _record: &KeyRecord) -> ProviderAnswer {
        ProviderAnswer::Unknown
    }
}

/// What one recovery pass did, key by key.
///
/// ```
/// use idempotency::maintenance::RecoveryReport;
/// let mut report = RecoveryReport::default();
/// report.released = 2;
/// report.parked = 1;
/// assert_eq!(report.acted(), 3);
/// assert_eq!(
///     report.to_string(),
///     "released 2, completed 0, failed 0, parked 1, unknown 0, skipped 0, unregistered 0"
/// );
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// Local keys released (and external ones whose provider answered "failed" are counted in
    /// `failed`, not here).
    pub released: u64,
    /// External keys the resolver reported completed; their result is stored.
    pub completed: u64,
    /// External keys the resolver reported failed; they were released.
    pub failed: u64,
    /// External keys parked as `needs_review` (no resolver, or unknown too often).
    pub parked: u64,
    /// External keys still unknown; a later pass asks again.
    pub unknown: u64,
    /// Keys another worker (or a retry) changed first; nothing was done to them.
    pub skipped: u64,
    /// Pending durable keys whose operation this worker does not have in its registry
    /// ([`Recovery::with_operations`]): left untouched, each logged at `warn`. Anything but 0
    /// means a worker is missing an operation (or names it differently from the route), and
    /// those keys stay pending until a worker that has it runs.
    pub unregistered: u64,
}

impl RecoveryReport {
    /// Keys whose state this pass changed (released, completed, failed or parked).
    pub fn acted(&self) -> u64 {
        self.released + self.completed + self.failed + self.parked
    }

    /// Adds another pass's counts.
    pub fn add(&mut self, other: &RecoveryReport) {
        self.released += other.released;
        self.completed += other.completed;
        self.failed += other.failed;
        self.parked += other.parked;
        self.unknown += other.unknown;
        self.skipped += other.skipped;
        self.unregistered += other.unregistered;
    }
}

impl fmt::Display for RecoveryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "released {}, completed {}, failed {}, parked {}, unknown {}, skipped {}, unregistered {}",
            self.released,
            self.completed,
            self.failed,
            self.parked,
            self.unknown,
            self.skipped,
            self.unregistered
        )
    }
}

/// The recovery job: configuration plus [`run_once`](Self::run_once) and [`run`](Self::run).
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), idempotency::StoreError> {
/// use idempotency::maintenance::Recovery;
/// use std::time::Duration;
/// let recovery = Recovery::new(store).with_max_attempts(3).with_batch(500);
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let job = tokio::spawn(async move {
///     recovery.run(Duration::from_secs(30), async { let _ = stopped.await; }).await
/// });
/// // … on shutdown:
/// let _ = stop.send(());
/// let total = job.await.unwrap()?;
/// # Ok(()) }
/// ```
///
/// Recovery of abandoned keys and operator resolution of parked ones.
///
/// A key stays `pending` when its worker died between reserving it and finishing (a crash, a
/// killed pod). Once its lease has ended, the recovery job decides, in the order the article
/// describes:
///
/// * **local** operations (only our database) are released: their business transaction commits
///   together with the key's completion, so a pending key means nothing was committed;
/// * **external** operations (a payment, a mail) are asked about: a [`Resolver`] queries the
///   provider with the same key and answers *completed* (the result is stored), *failed* (the key
///   is released so a retry runs again) or *unknown*. With no resolver, or still unknown after
///   [`Recovery::with_max_attempts`] passes, the key is parked as `needs_review` and never released
///   automatically; an operator settles it with [`resolve`] (`idem keys resolve`).
///
/// Every decision is fenced: the job first *claims* the key (a conditional UPDATE from the stale
/// lease token to its own), and writes the decision conditional on its own token. Two recovery
/// workers, or a recovery worker and the late original worker, never both act.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{durable::{ProviderAnswer, Resolver}, maintenance::Recovery};
/// use idempotency::{SqliteStore, Store};
/// use idempotency::store::KeyRecord;
///
/// struct Payments;
/// impl Resolver for Payments {
///     async fn resolve(&self, record: &KeyRecord) -> ProviderAnswer {
///         // Ask the payment provider about `record.key.key()` here.
///         ProviderAnswer::Unknown
///     }
/// }
///
/// let store = SqliteStore::connect("sqlite://shop.db?mode=rwc").await?;
/// let report = Recovery::new(store).with_resolver(Payments).run_once().await?;
/// println!("released {}, parked {}", report.released, report.parked);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Recovery<S: Maintenance + Journal, R = NoResolver> {
    store: S,
    resolver: Option<R>,
    operations: Option<(Idempotency<S>, Operations<S>)>,
    max_attempts: u32,
    batch: u32,
    claim_lease: Duration,
    resolver_timeout: Duration,
    retry_after: Duration,
    retention: Duration,
    concurrency: usize,
}

impl<S: Maintenance + Journal> Recovery<S, NoResolver> {
    /// A job without resolver (external keys are parked), 5 attempts, batches of 100 keys, a
    /// 60 s claim, a 30 s resolver timeout, asking again on the next pass, results kept 24 h.
    pub fn new(store: S) -> Self {
        Self {
            store,
            resolver: None,
            operations: None,
            max_attempts: 5,
            batch: 100,
            claim_lease: Duration::from_secs(60),
            resolver_timeout: Duration::from_secs(30),
            retry_after: Duration::ZERO,
            retention: Duration::from_secs(24 * 60 * 60),
            concurrency: 8,
        }
    }

    /// Asks `resolver` about external keys.
    pub fn with_resolver<R: Resolver>(self, resolver: R) -> Recovery<S, R> {
        Recovery {
            store: self.store,
            resolver: Some(resolver),
            operations: self.operations,
            max_attempts: self.max_attempts,
            batch: self.batch,
            claim_lease: self.claim_lease,
            resolver_timeout: self.resolver_timeout,
            retry_after: self.retry_after,
            retention: self.retention,
            concurrency: self.concurrency,
        }
    }
}

impl<S: Maintenance + Journal, R: Resolver> Recovery<S, R> {
    /// How many "unknown" answers a key may get before it is parked (at least 1).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// How many abandoned keys one pass looks at (at least 1).
    pub fn with_batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a claim protects the key while the resolver is asked; keep it above the
    /// [resolver timeout](Self::with_resolver_timeout), so no other worker claims the key while
    /// its provider is still being asked.
    pub fn with_claim_lease(mut self, lease: Duration) -> Self {
        self.claim_lease = lease;
        self
    }

    /// How long the resolver may take; a resolver that takes longer (or panics) counts as
    /// [`ProviderAnswer::Unknown`].
    pub fn with_resolver_timeout(mut self, timeout: Duration) -> Self {
        self.resolver_timeout = timeout;
        self
    }

    /// After an "unknown", how long until a pass may ask again (default: the next pass).
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = delay;
        self
    }

    /// How long a result the resolver reports is kept.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Resumes durable operations: a pending key of an operation registered in `operations`
    /// is claimed and continued from its recovery point by the operation's own function, with
    /// `engine`'s retention and [step policy](crate::steps::StepPolicy) (a key with nothing
    /// recorded made no outside call and is released). Keys of other operations are decided as
    /// before (resolver, or parked); a key with a stored request whose operation is not registered
    /// here is left alone for a worker that has it (counted as skipped).
    pub fn with_operations(mut self, engine: Idempotency<S>, operations: Operations<S>) -> Self {
        self.operations = Some((engine, operations));
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// One pass: looks at up to `batch` pending keys whose lease ended and decides each.
    ///
    /// Up to [`with_concurrency`](Self::with_concurrency) keys are decided at once (each key is
    /// claimed on its own, so they never interfere); a store failure ends the pass after the keys
    /// under way are decided.
    pub async fn run_once(&self) -> Result<RecoveryReport, StoreError> {
        let records = self.store.expired_leases(self.batch).await?;
        let mut waiting = records.iter();
        let mut running = FuturesUnordered::new();
        let mut total = RecoveryReport::default();
        let mut failure = None;
        loop {
            while running.len() < self.concurrency {
                match waiting.next() {
                    Some(record) if failure.is_none() => running.push(self.decide(record)),
                    _ => break,
                }
            }
            match running.next().await {
                Some(Ok(report)) => total.add(&report),
                Some(Err(error)) => failure = Some(error),
                None => break,
            }
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(total),
        }
    }

    async fn decide(&self, record: &KeyRecord) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        self.recover(record, &mut report).await?;
        Ok(report)
    }

    /// How many keys one pass decides at once (default 8, at least 1): a resumed operation or a
    /// resolver waits on an outside service, and one slow provider should not hold up the rest.
    pub fn with_concurrency(mut self, keys: usize) -> Self {
        self.concurrency = keys.max(1);
        self
    }

    async fn recover(
        &self,
        record: &KeyRecord,
        report: &mut RecoveryReport,
    ) -> Result<(), StoreError> {
        let key = &record.key;
        let registered = self
            .operations
            .as_ref()
            .is_some_and(|(_, operations)| operations.contains(key.operation()));
        if record.is_resumable() && !registered {
            tracing::warn!(
                %key,
                operation = key.operation(),
                "pending durable key of an operation this worker does not have; left pending for a worker that registers it"
            );
            report.unregistered += 1;
            return Ok(());
        }
        let token = LeaseToken::new();
        // A durable operation is driven under the engine's own lease, as the request was: a
        // resumer that dies mid-run holds the key no longer than the request would have.
        let claim = match (&self.operations, registered) {
            (Some((engine, _)), true) => engine.lease(),
            _ => self.claim_lease,
        };
        if !self
            .store
            .claim_for_recovery(key, record.lease_token, token, claim)
            .await?
        {
            report.skipped += 1;
            signals::count(signals::RECOVERED_TOTAL, key.operation(), signals::SKIPPED);
            return Ok(());
        }
        // From here on we hold the key with `token`; every write below is conditional on it.
        if let (Some((engine, operations)), true) = (&self.operations, registered) {
            if record.effects == Effects::External {
                return Self::resume(engine, operations, key, token, report).await;
            }
        }
        let (recovered, done) = match record.effects {
            Effects::Local => {
                let done = self.store.release(key, token).await?;
                (Recovered::Released, done)
            }
            Effects::External => self.settle_external(record, token).await?,
        };
        report.note(recovered, done);
        recovered.count(key, done);
        tracing::debug!(%key, effects = %record.effects, ?recovered, done, "idempotency key recovered");
        Ok(())
    }

    /// A claimed key of a registered durable operation: continued from its recovery point by
    /// the operation's own function.
    async fn resume(
        engine: &Idempotency<S>,
        operations: &Operations<S>,
        key: &IdempotencyKey,
        token: LeaseToken,
        report: &mut RecoveryReport,
    ) -> Result<(), StoreError> {
        // Resume from the row as of the claim (see `Idempotency::claimed_row`).
        let Some(claimed) = engine.claimed_row(key, token).await? else {
            report.note(Recovered::Unknown, false);
            Recovered::Unknown.count(key, false);
            return Ok(());
        };
        let lease = engine.claimed_lease(&claimed, token);
        let (recovered, done) = match operations.resume(engine, lease, &claimed).await {
            Ok(Resumed::Settled(Settlement::Completed)) => (Recovered::Completed, true),
            Ok(Resumed::Settled(_)) => (Recovered::Failed, true),
            Ok(Resumed::Released) => (Recovered::Released, true),
            Ok(Resumed::Stopped(PerformError::Parked { .. })) => (Recovered::Parked, true),
            Ok(Resumed::Stopped(PerformError::LeaseLost)) => (Recovered::Unknown, false),
            Ok(Resumed::Stopped(error)) => {
                tracing::info!(%key, %error, "durable operation still pending");
                (Recovered::Unknown, true)
            }
            Err(_unused) => unreachable!("the operation is registered"),
        };
        report.note(recovered, done);
        recovered.count(key, done);
        tracing::debug!(%key, ?recovered, done, "durable operation resumed");
        Ok(())
    }

    /// A claimed external operation that is not resumed here: the resolver's answer decides
    /// (parked without a resolver, or once "unknown" came back `max_attempts` times).
    async fn settle_external(
        &self,
        record: &KeyRecord,
        token: LeaseToken,
    ) -> Result<(Recovered, bool), StoreError> {
        let key = &record.key;
        let Some(resolver) = &self.resolver else {
            let done = self
                .store
                .park_recorded(
                    key,
                    token,
                    "abandoned external operation; no resolver configured",
                )
                .await?;
            return Ok((Recovered::Parked, done));
        };
        Ok(match self.ask(resolver, record).await {
            ProviderAnswer::Completed(result) => {
                let done = self
                    .store
                    .complete_recovered(
                        key,
                        token,
                        &result,
                        "recovered: the provider reported it completed",
                        self.retention,
                    )
                    .await?;
                (Recovered::Completed, done)
            }
            ProviderAnswer::Failed => {
                let done = self.store.release_recorded(key, token).await?;
                (Recovered::Failed, done)
            }
            ProviderAnswer::Unknown => {
                let attempts = record.recovery_attempts.saturating_add(1);
                if attempts >= self.max_attempts {
                    let reason = format!(
                        "abandoned external operation; the provider's answer was unknown {attempts} times"
                    );
                    let done = self.store.park_recorded(key, token, &reason).await?;
                    (Recovered::Parked, done)
                } else {
                    let done = self
                        .store
                        .note_unknown(key, token, self.retry_after)
                        .await?;
                    (Recovered::Unknown, done)
                }
            }
        })
    }

    /// Asks the resolver, bounded by the resolver timeout; a panic or a timeout is "unknown".
    async fn ask(&self, resolver: &R, record: &KeyRecord) -> ProviderAnswer {
        let asked = AssertUnwindSafe(resolver.resolve(record)).catch_unwind();
        match tokio::time::timeout(self.resolver_timeout, asked).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_panic)) => {
                tracing::error!(key = %record.key, "the recovery resolver panicked; taken as unknown");
                ProviderAnswer::Unknown
            }
            Err(_elapsed) => {
                tracing::warn!(key = %record.key, timeout = ?self.resolver_timeout, "the recovery resolver timed out; taken as unknown");
                ProviderAnswer::Unknown
            }
        }
    }

    /// Runs passes every `interval` until `shutdown` completes, and returns the summed report.
    /// A pass that fails (database down) is logged and retried at the next interval; a pass in
    /// progress is finished before returning.
    pub async fn run(
        &self,
        interval: Duration,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RecoveryReport, StoreError> {
        self.run_with(interval, shutdown, |_| {}).await
    }

    /// Like [`run`](Self::run), calling `on_pass` with each pass's outcome.
    pub async fn run_with(
        &self,
        interval: Duration,
        shutdown: impl Future<Output = ()> + Send,
        mut on_pass: impl FnMut(&Result<RecoveryReport, StoreError>) + Send,
    ) -> Result<RecoveryReport, StoreError> {
        let mut total = RecoveryReport::default();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let pass = self.run_once().await;
            match &pass {
                Ok(report) => total.add(report),
                Err(error) => tracing::warn!(%error, "recovery pass failed; retrying later"),
            }
            on_pass(&pass);
            tokio::select! {
                _ = &mut shutdown => return Ok(total),
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// What recovery did with one key (the [`RecoveryReport`] counter it adds to).
#[derive(Debug, Clone, Copy)]
enum Recovered {
    Released,
    Completed,
    Failed,
    Parked,
    Unknown,
}

impl Recovered {
    /// Counts what recovery did with `key` ([`signals::RECOVERED_TOTAL`]).
    fn count(self, key: &IdempotencyKey, done: bool) {
        let outcome = match (done, self) {
            (false, _) => signals::SKIPPED,
            (true, Recovered::Released) => signals::RELEASED,
            (true, Recovered::Completed) => signals::SETTLED_COMPLETED,
            (true, Recovered::Failed) => signals::SETTLED_FAILED,
            (true, Recovered::Parked) => signals::PARKED,
            (true, Recovered::Unknown) => signals::UNKNOWN,
        };
        signals::count(signals::RECOVERED_TOTAL, key.operation(), outcome);
    }
}

impl RecoveryReport {
    /// Counts a fenced write: under what it did when it acted, as skipped when another party
    /// changed the key between our claim and our write (possible only after the claim ran out).
    fn note(&mut self, recovered: Recovered, done: bool) {
        let counter = match (done, recovered) {
            (false, _) => &mut self.skipped,
            (true, Recovered::Released) => &mut self.released,
            (true, Recovered::Completed) => &mut self.completed,
            (true, Recovered::Failed) => &mut self.failed,
            (true, Recovered::Parked) => &mut self.parked,
            (true, Recovered::Unknown) => &mut self.unknown,
        };
        *counter += 1;
    }
}

/// Why [`resolve`] or [`hand_back`] refused.
///
/// ```
/// use idempotency::maintenance::ResolveError;
/// assert!(ResolveError::EmptyReason.to_string().contains("reason"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// An operator action must say why (it is kept on the row and in the history).
    #[error("a reason is required to resolve a key")]
    EmptyReason,
    /// An operator action must say who takes it (it is recorded in the history).
    #[error("an operator name is required to resolve a key")]
    EmptyOperator,
    /// A field of the note is longer than allowed.
    #[error("the {field} is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// Which field: `operator`, `reason` or `evidence`.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    /// No row for that key.
    #[error("no idempotency key {0}")]
    NotFound(IdempotencyKey),
    /// The key is not parked; only `needs_review` keys can be resolved or handed back.
    #[error("key {key} is {state}, not needs_review; only parked keys can be resolved")]
    NotParked {
        /// The key.
        key: IdempotencyKey,
        /// Its current state.
        state: KeyState,
    },
    /// The row changed since the operator looked at it (its `updated_at` is no longer the
    /// note's `seen`): nothing was written; look again.
    #[error("key {key} changed since it was seen (updated at {updated_at}); look again")]
    Stale {
        /// The key.
        key: IdempotencyKey,
        /// The row's current `updated_at`.
        updated_at: DateTime<Utc>,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The longest operator name an action accepts, in bytes.
const OPERATOR_MAX_BYTES: usize = 200;
/// The longest reason an action accepts, in bytes.
const REASON_MAX_BYTES: usize = 1000;
/// The longest evidence an action accepts, in bytes.
const EVIDENCE_MAX_BYTES: usize = 700;

/// The note with its fields trimmed, or why it is refused: operator and reason must not be
/// empty; operator, reason and evidence are bounded (together they fit an event's detail).
fn validated(note: &OperatorNote) -> Result<OperatorNote, ResolveError> {
    let operator = note.operator.trim();
    let reason = note.reason.trim();
    let evidence = note
        .evidence
        .as_deref()
        .map(str::trim)
        .filter(|e| !e.is_empty());
    if operator.is_empty() {
        return Err(ResolveError::EmptyOperator);
    }
    if reason.is_empty() {
        return Err(ResolveError::EmptyReason);
    }
    let fields = [
        ("operator", operator.len(), OPERATOR_MAX_BYTES),
        ("reason", reason.len(), REASON_MAX_BYTES),
        ("evidence", evidence.map_or(0, str::len), EVIDENCE_MAX_BYTES),
    ];
    if let Some(&(field, len, max)) = fields.iter().find(|(_, len, max)| len > max) {
        return Err(ResolveError::TooLong { field, len, max });
    }
    let mut clean = OperatorNote::new(operator, reason);
    clean.evidence = evidence.map(str::to_owned);
    clean.seen = note.seen;
    Ok(clean)
}

/// Why an operator action that did not act was refused, from the row as it is now.
async fn refusal<S: Maintenance>(store: &S, key: &IdempotencyKey) -> ResolveError {
    match refusal_reason(store, key).await {
        Ok(never) => match never {},
        Err(error) => error,
    }
}

/// [`refusal`]'s reading of the row.
async fn refusal_reason<S: Maintenance>(
    store: &S,
    key: &IdempotencyKey,
) -> Result<std::convert::Infallible, ResolveError> {
    let row = store
        .find(key)
        .await?
        .ok_or_else(|| ResolveError::NotFound(key.clone()))?;
    if row.state != KeyState::NeedsReview {
        return Err(ResolveError::NotParked {
            key: key.clone(),
            state: row.state,
        });
    }
    // Still parked, yet not acted on: its `updated_at` is no longer the note's `seen` (or
    // another action settled and re-parked it meanwhile).
    Err(ResolveError::Stale {
        key: key.clone(),
        updated_at: row.updated_at,
    })
}

/// Settles a parked key as an operator: `needs_review` → `completed` (with result bytes) or
/// `failed`, keeping the note's reason on the row and the result for `retention`, and recording
/// a `resolved` event (the operator, the resolution, reason and evidence) in the key's history.
/// With [`OperatorNote::with_seen`], refuses ([`ResolveError::Stale`]) if the row changed since.
/// Returns the updated row.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency::{IdempotencyKey, maintenance::{resolve, OperatorNote, Resolution}};
/// use std::time::Duration;
/// let key = IdempotencyKey::new("user-1", "charge", "k-9")?;
/// let note = OperatorNote::new("alice", "provider shows no charge");
/// let row = resolve(&store, &key, &Resolution::Failed, &note, Duration::from_secs(86_400)).await?;
/// assert_eq!(row.reason.as_deref(), Some("provider shows no charge"));
/// # Ok(()) }
/// ```
pub async fn resolve<S: Maintenance>(
    store: &S,
    key: &IdempotencyKey,
    resolution: &Resolution,
    note: &OperatorNote,
    retention: Duration,
) -> Result<KeyRecord, ResolveError> {
    let note = validated(note)?;
    if !store.resolve(key, resolution, &note, retention).await? {
        return Err(refusal(store, key).await);
    }
    store
        .find(key)
        .await?
        .ok_or_else(|| ResolveError::NotFound(key.clone()))
}

/// Hands a parked key back to the resumer as an operator, so it asks the provider again:
/// `needs_review` → `pending` with its lease ended and its attempts reset, keeping the note's
/// reason on the row and recording a `handed_back` event in the key's history. The next pass of
/// the recovery job (or the durable resumer) claims it. With [`OperatorNote::with_seen`],
/// refuses ([`ResolveError::Stale`]) if the row changed since. Returns the updated row.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency::{IdempotencyKey, maintenance::{hand_back, OperatorNote}, store::KeyState};
/// let key = IdempotencyKey::new("user-1", "charge", "k-9")?;
/// let note = OperatorNote::new("alice", "provider was down; ask again")
///     .with_evidence("status page incident 812");
/// let row = hand_back(&store, &key, &note).await?;
/// assert_eq!(row.state, KeyState::Pending);
/// # Ok(()) }
/// ```
pub async fn hand_back<S: Maintenance>(
    store: &S,
    key: &IdempotencyKey,
    note: &OperatorNote,
) -> Result<KeyRecord, ResolveError> {
    let note = validated(note)?;
    if !store.hand_back(key, &note).await? {
        return Err(refusal(store, key).await);
    }
    store
        .find(key)
        .await?
        .ok_or_else(|| ResolveError::NotFound(key.clone()))
}
