//! The queue's inbox: exactly-once **effects** on at-least-once **delivery**, for any broker.

use crate::{
    disposition::Disposition,
    error::{BoxError, Error, StoreError},
    error::{PerformError, StepError},
    key::{InvalidKey, MAX_PART_LEN},
    operation::Operation,
    protocol::{Attempt, Idempotency},
    store::{
        self, failures::RECORD_SUFFIX_MAX, Awaited, CompletionSignal, Effects, Journal, KeyState,
        LeaseToken, PendingRow,
    },
    Fingerprint, IdempotencyKey,
};
use futures_util::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use std::{
    any::Any,
    collections::HashMap,
    fmt,
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};
use tokio::sync::Notify;

/// What a message's failure counter adds to the message type to make its operation.
const FAILURE_COUNTER_SUFFIX: &str = "#failures";

/// The longest message type an inbox accepts, so that its failure counter's operation fits in
/// [`MAX_PART_LEN`], and so do the record rows of a store that counts with the provided
/// [`Store::count_failure`](crate::Store::count_failure).
pub const MAX_MESSAGE_TYPE_LEN: usize =
    MAX_PART_LEN - FAILURE_COUNTER_SUFFIX.len() - RECORD_SUFFIX_MAX;

/// The longest error text kept in a failure counter or a [`DeliveryAction`].
const MAX_REASON_CHARS: usize = 1000;

/// The constructors of a queue message's [`Attempt`]: its idempotency key and fingerprint.
///
/// * `scope`: who handles it, e.g. the queue or the consumer group (two groups that both apply
///   a message each get their own key);
/// * `message_type`: what it asks for (`"order.paid"`), the key's operation;
/// * `id`: the message id the producer chose once and reuses on every resend (1..=255 printable
///   ASCII characters);
/// * the payload's fingerprint: canonical JSON for JSON payloads (key order and whitespace do not
///   matter), the bytes as they are otherwise. The same id with another payload is dead-lettered.
///
/// ```
/// use idempotency::Attempt;
/// let a = Attempt::message_json_bytes("billing", "invoice.send", "m-1", br#"{"a": 1, "b": 2}"#)?;
/// let b = Attempt::message_json("billing", "invoice.send", "m-1", &serde_json::json!({"b": 2, "a": 1}))?;
/// assert_eq!(a.fingerprint(), b.fingerprint());
/// assert_eq!(a.key().to_string(), "billing/invoice.send/m-1");
/// # Ok::<(), idempotency::queue::InvalidMessage>(())
/// ```
impl Attempt {
    /// The attempt of a message whose payload is a serialisable value, fingerprinted as
    /// canonical JSON.
    ///
    /// ```
    /// use idempotency::Attempt;
    /// let paid = Attempt::message_json("shipping", "order.paid", "m-1", &serde_json::json!({"order": 7}))?;
    /// assert_eq!(paid.key().operation(), "order.paid");
    /// # Ok::<(), idempotency::queue::InvalidMessage>(())
    /// ```
    pub fn message_json<T: Serialize>(
        scope: &str,
        message_type: &str,
        id: &str,
        payload: &T,
    ) -> Result<Self, InvalidMessage> {
        let fingerprint = Fingerprint::of_json(payload).map_err(InvalidMessage::Json)?;
        Self::message_with_fingerprint(scope, message_type, id, fingerprint)
    }

    /// The attempt of a message whose payload is a JSON document as delivered, fingerprinted as
    /// canonical JSON; fails if the bytes are not JSON.
    ///
    /// ```
    /// use idempotency::{Attempt, queue::InvalidMessage};
    /// assert!(Attempt::message_json_bytes("q", "t", "m-1", br#"{"a": 1}"#).is_ok());
    /// let error = Attempt::message_json_bytes("q", "t", "m-1", b"not json").unwrap_err();
    /// assert!(matches!(error, InvalidMessage::Json(_)));
    /// ```
    pub fn message_json_bytes(
        scope: &str,
        message_type: &str,
        id: &str,
        payload: &[u8],
    ) -> Result<Self, InvalidMessage> {
        let fingerprint = Fingerprint::of_json_bytes(payload).map_err(InvalidMessage::Json)?;
        Self::message_with_fingerprint(scope, message_type, id, fingerprint)
    }

    /// The attempt of a message whose payload is opaque bytes (protobuf, Avro …), fingerprinted
    /// as they are.
    ///
    /// ```
    /// use idempotency::{Attempt, Fingerprint};
    /// let raw = Attempt::message_bytes("q", "t", "m-1", b"\x08\x01")?;
    /// assert_eq!(*raw.fingerprint(), Fingerprint::of_bytes(b"\x08\x01"));
    /// # Ok::<(), idempotency::queue::InvalidMessage>(())
    /// ```
    pub fn message_bytes(
        scope: &str,
        message_type: &str,
        id: &str,
        payload: &[u8],
    ) -> Result<Self, InvalidMessage> {
        Self::message_with_fingerprint(scope, message_type, id, Fingerprint::of_bytes(payload))
    }

    /// The attempt of a message with a fingerprint computed by the caller (for example over a
    /// payload and selected headers, with [`Fingerprint::builder`]). The message type may be at
    /// most [`MAX_MESSAGE_TYPE_LEN`] bytes long.
    ///
    /// ```
    /// use idempotency::{Attempt, Fingerprint, queue::{InvalidMessage, MAX_MESSAGE_TYPE_LEN}};
    /// let fingerprint = Fingerprint::of_bytes(b"body");
    /// assert!(Attempt::message_with_fingerprint("q", "t", "m-1", fingerprint).is_ok());
    /// let long = "t".repeat(MAX_MESSAGE_TYPE_LEN + 1);
    /// let error = Attempt::message_with_fingerprint("q", &long, "m-1", fingerprint).unwrap_err();
    /// assert!(matches!(error, InvalidMessage::TypeTooLong { .. }));
    /// ```
    pub fn message_with_fingerprint(
        scope: &str,
        message_type: &str,
        id: &str,
        fingerprint: Fingerprint,
    ) -> Result<Self, InvalidMessage> {
        if message_type.len() > MAX_MESSAGE_TYPE_LEN {
            return Err(InvalidMessage::TypeTooLong {
                len: message_type.len(),
            });
        }
        Ok(Self::new(
            IdempotencyKey::new(scope, message_type, id)?,
            fingerprint,
        ))
    }
}

/// Why a message's [`Attempt`] could not be made. A transport dead-letters such a delivery: no redelivery
/// can fix it.
///
/// ```
/// use idempotency::{Attempt, queue::InvalidMessage};
/// let error = Attempt::message_json_bytes("q", "t", "m-1", b"not json").unwrap_err();
/// assert!(matches!(error, InvalidMessage::Json(_)));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// The scope, type or id is empty, too long or holds forbidden characters.
    #[error(transparent)]
    Key(#[from] InvalidKey),
    /// The message type is longer than [`MAX_MESSAGE_TYPE_LEN`] bytes.
    #[error("the message type is {len} bytes long; an inbox accepts at most {max}", max = MAX_MESSAGE_TYPE_LEN)]
    TypeTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The payload was declared JSON and is not.
    #[error("the payload is not JSON: {0}")]
    Json(#[source] serde_json::Error),
}

/// What the transport should do with a delivery, as [`Inbox::handle`] decided it.
///
/// ```
/// use idempotency::queue::DeliveryAction;
/// use std::time::Duration;
/// let action = DeliveryAction::RetryLater { delay: Duration::from_millis(200) };
/// assert!(!action.is_ack());
/// assert_eq!(action.delay(), Some(Duration::from_millis(200)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeliveryAction {
    /// Acknowledge: the effect is committed, by this delivery or (`replayed`) an earlier one.
    Ack {
        /// Whether an earlier delivery had already applied the message.
        replayed: bool,
    },
    /// Another delivery of the same message is being processed right now: deliver this one again
    /// after `delay` (it will then be acked as a replay, or run if the other one failed).
    RetryLater {
        /// How long to wait before the redelivery.
        delay: Duration,
    },
    /// The work failed and nothing was applied (the key was released): deliver the message again
    /// after `delay`.
    Retry {
        /// How long to wait before the redelivery (backoff grows with the recorded failures).
        delay: Duration,
        /// What failed.
        reason: String,
    },
    /// Never deliver this message again to this inbox: route it to the dead-letter queue.
    DeadLetter(DeadLetter),
}

impl DeliveryAction {
    /// Whether the delivery should be acknowledged.
    pub fn is_ack(&self) -> bool {
        matches!(self, DeliveryAction::Ack { .. })
    }

    /// How long to wait before a redelivery, for `RetryLater` and `Retry`.
    pub fn delay(&self) -> Option<Duration> {
        match self {
            DeliveryAction::RetryLater { delay } | DeliveryAction::Retry { delay, .. } => {
                Some(*delay)
            }
            _ => None,
        }
    }
}

impl fmt::Display for DeliveryAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeliveryAction::Ack { replayed: false } => f.write_str("ack (executed)"),
            DeliveryAction::Ack { replayed: true } => f.write_str("ack (replayed)"),
            DeliveryAction::RetryLater { delay } => {
                write!(f, "retry after {delay:?} (in progress)")
            }
            DeliveryAction::Retry { delay, reason } => write!(f, "retry after {delay:?}: {reason}"),
            DeliveryAction::DeadLetter(why) => write!(f, "dead-letter: {why}"),
        }
    }
}

/// Why a message is dead-lettered. [`code`](Self::code) is a stable name for a header or a
/// metric; `Display` is the reason for a human.
///
/// ```
/// use idempotency::queue::DeadLetter;
/// let poison = DeadLetter::Poison { failures: 5, last_error: "timeout".into() };
/// assert_eq!(poison.code(), "poison");
/// assert_eq!(poison.to_string(), "the work failed 5 times; last: timeout");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetter {
    /// The id was used before with another payload: a producer's bug, not a redelivery. The
    /// payload was not applied.
    PayloadMismatch,
    /// The work failed [`max_failures`](Inbox::with_max_failures) times (a poison message).
    Poison {
        /// Failures recorded for the message.
        failures: u32,
        /// The last one.
        last_error: String,
    },
    /// The work failed in a way no redelivery can fix ([`FailureKind::Definitive`]).
    Definitive(String),
    /// The message's key is parked as *needs review*: an outside effect may or may not have
    /// happened, and an operator must settle it (`idem keys resolve`) before a redelivery can be
    /// acked or run.
    NeedsReview(Option<String>),
    /// The message cannot be checked at all (malformed key or payload, a request that cannot be
    /// stored).
    Invalid(String),
}

impl DeadLetter {
    /// A stable name: `payload-mismatch`, `poison`, `definitive`, `needs-review` or `invalid`.
    pub fn code(&self) -> &'static str {
        match self {
            DeadLetter::PayloadMismatch => "payload-mismatch",
            DeadLetter::Poison { .. } => "poison",
            DeadLetter::Definitive(_) => "definitive",
            DeadLetter::NeedsReview(_) => "needs-review",
            DeadLetter::Invalid(_) => "invalid",
        }
    }
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeadLetter::PayloadMismatch => {
                f.write_str("the message id was already used with another payload")
            }
            DeadLetter::Poison {
                failures,
                last_error,
            } => write!(f, "the work failed {failures} times; last: {last_error}"),
            DeadLetter::Definitive(error) => write!(f, "the work failed for good: {error}"),
            DeadLetter::NeedsReview(Some(reason)) => {
                write!(f, "the message's key needs review: {reason}")
            }
            DeadLetter::NeedsReview(None) => f.write_str("the message's key needs review"),
            DeadLetter::Invalid(error) => write!(f, "invalid message: {error}"),
        }
    }
}

/// How a failed work's error should be treated; see [`Inbox::handle_with`].
///
/// ```
/// use idempotency::queue::FailureKind;
/// let classify = |e: &std::io::Error| match e.kind() {
///     std::io::ErrorKind::InvalidData => FailureKind::Definitive,
///     std::io::ErrorKind::ConnectionRefused => FailureKind::Unavailable,
///     _ => FailureKind::Transient,
/// };
/// assert_eq!(classify(&std::io::ErrorKind::InvalidData.into()), FailureKind::Definitive);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// May succeed on a redelivery: [`DeliveryAction::Retry`] with backoff, counted toward
    /// [`max_failures`](Inbox::with_max_failures).
    Transient,
    /// No redelivery can succeed (a business rule refuses the message): dead-lettered at once.
    Definitive,
    /// Something the message does not depend on is down (a database, a service): retried and
    /// **not** counted, so an outage does not dead-letter healthy messages.
    Unavailable,
}

/// An idempotent inbox: runs a message's work at most once per `(scope, message type, id)` and
/// says what to do with each delivery of it. It consumes nothing itself: the transport (a
/// broker's consumer loop, a job runner) hands it one message at a time. Cheap to clone; share
/// one per queue.
///
/// A broker redelivers a message when a consumer dies before acknowledging it, when a publisher
/// retries, or when a job is re-queued. An [`Inbox`] runs the message's work under the
/// idempotency key `(scope, message type, message id)` with [`Idempotency::run`]: the work and the
/// key's completion commit in one transaction, so the effect happens once however many copies
/// arrive, and the answer is a [`DeliveryAction`] the transport turns into an ack, a requeue or a
/// dead-letter. Acknowledge only once `handle` returned: the business transaction has then
/// committed (or rolled back), so a crash before the ack costs a redelivery, which is acked as
/// a replay.
///
/// | what happened | [`DeliveryAction`] | the key |
/// |---|---|---|
/// | the work ran and committed | `Ack { replayed: false }` | completed |
/// | an earlier copy completed (same payload) | `Ack { replayed: true }` | completed |
/// | another copy is running now, and completes within [`with_in_progress_wait`](Inbox::with_in_progress_wait) | `Ack { replayed: true }` | completed |
/// | another copy is running now, and still is after the wait | `RetryLater { delay }` | pending (theirs) |
/// | the same id with another payload | `DeadLetter(PayloadMismatch)` | untouched; never applied |
/// | the work failed ([`FailureKind::Transient`], a panic) | `Retry { delay, .. }`, with backoff | released; the failure is counted |
/// | … for the [`max_failures`](Inbox::with_max_failures)-th time (poison) | `DeadLetter(Poison)` | released; counted |
/// | the work failed for good ([`FailureKind::Definitive`]) | `DeadLetter(Definitive)` | released |
/// | a dependency is down ([`FailureKind::Unavailable`], the store unreachable) | `Retry { delay, .. }` | released; not counted |
/// | the key is parked as *needs review* | `DeadLetter(NeedsReview)` | needs review |
///
/// # Counting failures
///
/// Brokers do not agree on a delivery count (a RabbitMQ classic queue only says *redelivered*,
/// Kafka says nothing), so the inbox counts failed attempts itself, in the key table. A failed
/// message's own key is released (a redelivery must be able to run it again), so its row cannot
/// hold the count: each failing message has a **failure counter**, a completed row of its own
/// whose key is the message's with the operation `"{message type}#failures"`, holding the count
/// and, as its stored result, the last error. A failure is counted in one statement
/// ([`Store::count_failure`](crate::Store::count_failure): an upsert that returns the new count,
/// on PostgreSQL, MySQL/MariaDB and SQLite), so copies failing at the same time count twice,
/// never once. The counter expires one retention (default 24 h) after its last failure and is
/// purged with the keys; a failure after that starts again at 1. A message re-driven from a
/// dead-letter queue after `max_failures` gets one more attempt per delivery. Deliveries that
/// found the key in progress are not failures and are not counted; a process that dies inside
/// the work is not counted either (use the broker's own limit, such as RabbitMQ's quorum-queue
/// `x-delivery-limit`, as a backstop for messages that crash the process).
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency::{Attempt, queue::{DeadLetter, DeliveryAction, Inbox}};
/// use idempotency::{SqliteStore, Store, Idempotency};
///
/// let store = SqliteStore::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// sqlx::query("CREATE TABLE shipments (order_id TEXT NOT NULL)").execute(store.pool()).await?;
/// let inbox = Inbox::new(Idempotency::new(store.clone())).with_max_failures(5);
///
/// // The broker delivers the same message twice (a consumer died before its ack).
/// let body = br#"{"order": "o-1", "items": 2}"#;
/// for _ in 0..2 {
///     let message = Attempt::message_json_bytes("shipping", "order.paid", "msg-0001", body)?;
///     let action = inbox
///         .handle(&message, async |tx| {
///             sqlx::query("INSERT INTO shipments (order_id) VALUES ('o-1')").execute(&mut **tx).await?;
///             Ok::<_, sqlx::Error>(())
///         })
///         .await;
///     assert!(action.is_ack()); // executed, then replayed: ack both
/// }
/// let shipped: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments").fetch_one(store.pool()).await?;
/// assert_eq!(shipped, 1);
///
/// // The same id with another body is a producer's bug: dead-letter it, never apply it.
/// let other = Attempt::message_json_bytes("shipping", "order.paid", "msg-0001", br#"{"order": "o-2"}"#)?;
/// let action = inbox.handle(&other, async |_tx| Ok::<_, sqlx::Error>(())).await;
/// assert_eq!(action, DeliveryAction::DeadLetter(DeadLetter::PayloadMismatch));
/// # Ok(()) }
/// # #[cfg(not(feature = "sqlite"))]
/// # fn main() {}
/// ```
#[derive(Debug, Clone)]
pub struct Inbox<S> {
    engine: Idempotency<S>,
    max_failures: u32,
    retry_delay: Duration,
    max_retry_delay: Duration,
    in_progress_wait: Duration,
    /// Copies waiting for a run of this inbox (or a clone) to end, woken when it does.
    waiting: Arc<Waiting>,
}

/// The copies of messages that wait for a run of the same inbox to end, by key: a run that ends
/// (committed, or rolled back and released) wakes them at once, without a round trip, where the
/// store's own wait would only see it at its next read (every 100 ms on PostgreSQL, where an
/// inbox sends no `NOTIFY`). Copies whose run is in another process wait for the store alone.
#[derive(Debug, Default)]
struct Waiting(Mutex<HashMap<IdempotencyKey, Weak<Notify>>>);

impl Waiting {
    /// The wake-up of the waiters of `key`, shared with the others waiting for it.
    fn register(&self, key: &IdempotencyKey) -> Arc<Notify> {
        let mut waiting = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(notify) = waiting.get(key).and_then(Weak::upgrade) {
            return notify;
        }
        // Entries whose waiters are gone (their run was elsewhere) go when new ones come.
        waiting.retain(|_, notify| notify.strong_count() > 0);
        let notify = Arc::new(Notify::new());
        waiting.insert(key.clone(), Arc::downgrade(&notify));
        notify
    }

    /// A run of `key` ended here: wake its waiters.
    fn ended(&self, key: &IdempotencyKey) {
        let mut waiting = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.is_empty() {
            return;
        }
        if let Some(notify) = waiting.remove(key).and_then(|notify| notify.upgrade()) {
            notify.notify_waiters();
        }
    }
}

impl<S: CompletionSignal> Inbox<S> {
    /// An inbox on `engine` (its lease, retention and step policy apply), dead-lettering a
    /// message after 5 failures, retrying after 1 s, then 2 s, 4 s … up to 60 s, and waiting up
    /// to 1 s for a copy of the message in progress elsewhere.
    pub fn new(engine: Idempotency<S>) -> Self {
        Self {
            engine,
            max_failures: 5,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            in_progress_wait: Duration::from_secs(1),
            waiting: Arc::default(),
        }
    }

    /// After how many failed attempts a message is dead-lettered as poison (default 5; at least
    /// 1, which dead-letters on the first failure).
    pub fn with_max_failures(mut self, max_failures: u32) -> Self {
        self.max_failures = max_failures.max(1);
        self
    }

    /// The delay of the first [`DeliveryAction::Retry`] (default 1 s); it doubles with every recorded
    /// failure, up to [`with_max_retry_delay`](Self::with_max_retry_delay).
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The longest [`DeliveryAction::Retry`] delay (default 60 s).
    pub fn with_max_retry_delay(mut self, delay: Duration) -> Self {
        self.max_retry_delay = delay;
        self
    }

    /// How long a delivery that finds its message in progress elsewhere waits for that copy
    /// ([`CompletionSignal::wait_for_completion`]) before it answers [`DeliveryAction::RetryLater`] (default
    /// 1 s): when the other copy completes meanwhile, the delivery is acked as a replay at once,
    /// without a trip back through the broker. `Duration::ZERO` answers `RetryLater` at once
    /// (for a transport that can delay a message without holding it).
    pub fn with_in_progress_wait(mut self, wait: Duration) -> Self {
        self.in_progress_wait = wait;
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Idempotency<S> {
        &self.engine
    }

    /// The poison threshold.
    pub fn max_failures(&self) -> u32 {
        self.max_failures
    }

    /// Runs `work` for `message` in the business transaction, at most once per message key, and
    /// decides what to do with the delivery. Every error of the work is
    /// [`FailureKind::Transient`]; see [`handle_with`](Self::handle_with) to classify them.
    ///
    /// `message` is the message's [`Attempt`] (made with [`Attempt::message_json`] and its
    /// siblings). The work is the same async closure as [`Idempotency::run`]'s,
    /// `async |tx| { … }`, with the same error bound. It runs as local work whatever the
    /// attempt's [`Effects`]: a failed work's key is released, so a redelivery can run it again.
    ///
    /// The work's result is stored with the key, as with [`Idempotency::run`]. A business refusal
    /// that should be acknowledged (the order no longer exists) is a *result*: return
    /// `Ok(refusal)`, not an error.
    pub async fn handle<R, E, F>(&self, message: &Attempt, work: F) -> DeliveryAction
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        self.handle_with(message, |_| FailureKind::Transient, work)
            .await
    }

    /// Like [`handle`](Self::handle), with `classify` deciding what a failed work's error means:
    /// retry and count it, dead-letter now, or retry without counting.
    pub async fn handle_with<R, E, F, C>(
        &self,
        message: &Attempt,
        classify: C,
        work: F,
    ) -> DeliveryAction
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
        C: FnOnce(&E) -> FailureKind + Send,
    {
        let (key, fingerprint) = (message.key(), *message.fingerprint());
        let attempt = Attempt::new(key.clone(), fingerprint);
        // A failed work's key is always released (nothing was committed); the failure is counted
        // afterwards, by `failed`. A panic is caught here so that it counts as a failure instead
        // of taking the inbox down; `run_with` has released the key before re-raising it.
        let ran = AssertUnwindSafe(
            self.engine
                .run_with(&attempt, |_| Disposition::Release, work),
        )
        .catch_unwind()
        .await;
        if !matches!(ran, Ok(Err(Error::InProgress { .. }))) {
            self.waiting.ended(key);
        }
        match ran {
            Ok(Ok(outcome)) => DeliveryAction::Ack {
                replayed: outcome.is_replayed(),
            },
            Ok(Err(Error::Operation(error))) => {
                let kind = classify(&error);
                let error: BoxError = error.into();
                self.failed(key, fingerprint, kind, &error.to_string())
                    .await
            }
            Ok(Err(Error::Serialization(error))) => self.unserialisable(key, &error).await,
            Ok(Err(refused)) => self.refused(key, fingerprint, refused).await,
            Err(panic) => {
                let reason = format!("the work panicked: {}", panic_message(&*panic));
                self.failed(key, fingerprint, FailureKind::Transient, &reason)
                    .await
            }
        }
    }

    /// Runs the durable operation `operation` for the message `id` in `scope`, whose payload is
    /// `request` ([`Idempotency::perform`]: its steps may call outside services), and decides what
    /// to do with the delivery. The message type is the operation's name.
    ///
    /// An operation whose outside outcome is unknown stays pending and is carried on by the
    /// [`MaintenanceWorker`](crate::worker::MaintenanceWorker) (with the operation registered in
    /// its [`Operations`](crate::durable::Operations)) or by the next delivery: the delivery is
    /// [`RetryLater`](DeliveryAction::RetryLater), and is acked once the operation has settled. A
    /// settled failure ([`Steps::fail`](crate::durable::Steps::fail)) is stored and acked like a success:
    /// it was compensated and will not change.
    pub async fn perform<O: Operation<S>>(
        &self,
        scope: &str,
        id: &str,
        operation: &O,
        request: &O::Request,
    ) -> DeliveryAction
    where
        S: Journal,
    {
        // Fingerprinted here first, so that a serialisation error from `perform` can only be a
        // stored response this version cannot read (see `unserialisable`).
        let message = match Attempt::message_json(scope, operation.name(), id, request) {
            Ok(message) => message,
            Err(error) => {
                return DeliveryAction::DeadLetter(DeadLetter::Invalid(error.to_string()))
            }
        };
        let (key, fingerprint) = (message.key(), *message.fingerprint());
        let performed = AssertUnwindSafe(self.engine.perform(operation, scope, id, request))
            .catch_unwind()
            .await;
        if !matches!(
            performed,
            Ok(Err(PerformError::Reserve(Error::InProgress { .. })))
        ) {
            self.waiting.ended(key);
        }
        let error = match performed {
            Ok(Ok(outcome)) => {
                return DeliveryAction::Ack {
                    replayed: outcome.is_replayed(),
                }
            }
            Ok(Err(error)) => error,
            Err(panic) => {
                let reason = format!("the operation panicked: {}", panic_message(&*panic));
                return self
                    .failed(key, fingerprint, FailureKind::Transient, &reason)
                    .await;
            }
        };
        match error {
            PerformError::Reserve(Error::Serialization(error)) => {
                self.unserialisable(key, &error).await
            }
            PerformError::Reserve(refused) => self.refused(key, fingerprint, refused).await,
            PerformError::Released(error) => {
                let kind = match &error {
                    StepError::Store(e) if e.is_unavailable() => FailureKind::Unavailable,
                    StepError::RequestTooLarge { .. }
                    | StepError::Serialization(_)
                    | StepError::Declined { .. } => FailureKind::Definitive,
                    _ => FailureKind::Transient,
                };
                self.failed(key, fingerprint, kind, &error.to_string())
                    .await
            }
            PerformError::Pending { retry_after, .. } => {
                DeliveryAction::RetryLater { delay: retry_after }
            }
            PerformError::Parked { reason } => {
                DeliveryAction::DeadLetter(DeadLetter::NeedsReview(Some(reason)))
            }
            // Another holder carries it on, or the key is resumed once its lease ends.
            _ => DeliveryAction::RetryLater {
                delay: self.retry_delay,
            },
        }
    }

    /// How many failures are recorded for `message` (its failure counter, unless past its
    /// retention), up to [`max_failures`](Self::max_failures).
    pub async fn recorded_failures(&self, message: &Attempt) -> Result<u32, StoreError> {
        let counter = failure_counter(message.key())?;
        let failures = self
            .engine
            .store()
            .failure_count(&counter, self.max_failures)
            .await?;
        Ok(failures.min(self.max_failures))
    }

    /// The work failed (its transaction rolled back, the key released): count it when it is
    /// transient, and decide.
    async fn failed(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        kind: FailureKind,
        error: &str,
    ) -> DeliveryAction {
        let reason = bounded(error);
        match kind {
            FailureKind::Definitive => DeliveryAction::DeadLetter(DeadLetter::Definitive(reason)),
            FailureKind::Unavailable => DeliveryAction::Retry {
                delay: self.retry_delay,
                reason,
            },
            FailureKind::Transient => match self.record_failure(key, fingerprint, &reason).await {
                Ok(failures) if failures >= self.max_failures => {
                    tracing::warn!(%key, failures, error = %reason, "poison message: dead-lettered");
                    DeliveryAction::DeadLetter(DeadLetter::Poison {
                        failures,
                        last_error: reason,
                    })
                }
                Ok(failures) => DeliveryAction::Retry {
                    delay: backoff(self.retry_delay, self.max_retry_delay, failures),
                    reason,
                },
                Err(error) => {
                    tracing::warn!(%key, %error, "could not record a message's failure; it is retried uncounted");
                    DeliveryAction::Retry {
                        delay: self.retry_delay,
                        reason,
                    }
                }
            },
        }
    }

    /// Counts one more failure of the message `key` in its failure counter, in one statement
    /// ([`Store::count_failure`](crate::Store::count_failure)), and returns the count, at most
    /// `max_failures`.
    async fn record_failure(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        reason: &str,
    ) -> Result<u32, StoreError> {
        let result = serde_json::to_vec(&serde_json::json!({ "error": reason }))
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let counter = failure_counter(key)?;
        let row = PendingRow {
            key: &counter,
            fingerprint,
            token: LeaseToken::new(),
            effects: Effects::Local,
            journaled: false,
            lease: self.engine.lease(),
            retention: self.engine.retention(),
        };
        let failures = self
            .engine
            .store()
            .count_failure(&row, &result, self.max_failures)
            .await?;
        Ok(failures.min(self.max_failures))
    }

    /// The reservation refused, or the store failed (or the work failed: then it is transient).
    async fn refused<E: Into<BoxError>>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        error: Error<E>,
    ) -> DeliveryAction {
        match error {
            Error::KeyReused => DeliveryAction::DeadLetter(DeadLetter::PayloadMismatch),
            Error::InProgress { retry_after } => {
                self.in_progress(key, fingerprint, retry_after).await
            }
            Error::LeaseLost => DeliveryAction::RetryLater {
                delay: self.retry_delay,
            },
            Error::NeedsReview => {
                let reason = match self.engine.store().find(key).await {
                    Ok(record) => record.and_then(|record| record.reason),
                    Err(_) => None,
                };
                DeliveryAction::DeadLetter(DeadLetter::NeedsReview(reason))
            }
            Error::InvalidKey(error) => {
                DeliveryAction::DeadLetter(DeadLetter::Invalid(error.to_string()))
            }
            Error::Store(error) => {
                // The store being down is not the message's fault: retried, not counted. A store
                // error about this key (a row this version cannot read) is counted, so that it
                // ends in the dead-letter queue instead of looping.
                if error.is_unavailable() {
                    DeliveryAction::Retry {
                        delay: self.retry_delay,
                        reason: bounded(&error.to_string()),
                    }
                } else {
                    let reason = error.to_string();
                    self.failed(key, fingerprint, FailureKind::Transient, &reason)
                        .await
                }
            }
            Error::Serialization(error) => self.unserialisable(key, &error).await,
            Error::Operation(error) => {
                let reason = error.into().to_string();
                self.failed(key, fingerprint, FailureKind::Transient, &reason)
                    .await
            }
        }
    }

    /// Another copy holds the key: wait a little for it to complete (then this delivery is a
    /// replay), else retry later.
    async fn in_progress(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        retry_after: Duration,
    ) -> DeliveryAction {
        if self.in_progress_wait.is_zero() {
            return DeliveryAction::RetryLater { delay: retry_after };
        }
        let store = self.engine.store();
        let deadline = tokio::time::Instant::now() + self.in_progress_wait;
        let wake = self.waiting.register(key);
        let awaited = loop {
            // Enabled before the store's first read: a run here that ends from now on wakes it.
            let woken = wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            tokio::select! {
                awaited = store.wait_for_completion(key, &fingerprint, left) => break awaited,
                () = &mut woken => {}
            }
            // The run here ended (committed, or released): read the row at once.
            match store.find(key).await {
                Ok(record) => {
                    if let Some(done) = store::awaited(record, &fingerprint) {
                        break Ok(done);
                    }
                }
                Err(error) => break Err(error),
            }
        };
        match awaited {
            Ok(Awaited::Completed(_)) => DeliveryAction::Ack { replayed: true },
            // Released, parked, or its lease ended: a new delivery decides, at once.
            Ok(Awaited::Settled) => DeliveryAction::RetryLater {
                delay: Duration::ZERO,
            },
            Ok(Awaited::TimedOut) | Err(_) => DeliveryAction::RetryLater { delay: retry_after },
        }
    }

    /// A (de)serialisation error: either a completed key whose stored result this version cannot
    /// read (the effect happened: ack), or a result that could not be serialised (nothing was
    /// committed, and every redelivery would fail the same way: dead-letter). The row tells which.
    async fn unserialisable(
        &self,
        key: &IdempotencyKey,
        error: &serde_json::Error,
    ) -> DeliveryAction {
        match self.engine.store().find(key).await {
            Ok(Some(record)) if record.state == KeyState::Completed => {
                tracing::warn!(%key, %error, "stored result unreadable; the message was applied before: ack");
                DeliveryAction::Ack { replayed: true }
            }
            Ok(_) => DeliveryAction::DeadLetter(DeadLetter::Definitive(format!(
                "the work's result cannot be stored: {error}"
            ))),
            Err(store) => DeliveryAction::Retry {
                delay: self.retry_delay,
                reason: bounded(&store.to_string()),
            },
        }
    }
}

/// The delay after the `failures`-th failure: `first × 2^(failures − 1)`, at most `max`.
fn backoff(first: Duration, max: Duration, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    first.saturating_mul(factor).min(max)
}

/// The key of the failure counter of the message `key`.
fn failure_counter(key: &IdempotencyKey) -> Result<IdempotencyKey, StoreError> {
    IdempotencyKey::new(
        key.scope(),
        format!("{}{FAILURE_COUNTER_SUFFIX}", key.operation()),
        key.key(),
    )
    .map_err(|e| StoreError::Corrupt(format!("failure counter key: {e}")))
}

/// `text`, cut to [`MAX_REASON_CHARS`] characters.
fn bounded(text: &str) -> String {
    match text.char_indices().nth(MAX_REASON_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// The message of a panic payload.
fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let (first, max) = (Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = [1, 2, 3, 4, 40].map(|n| backoff(first, max, n)).to_vec();
        let ms = |ms| Duration::from_millis(ms);
        assert_eq!(delays, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
    }

    #[test]
    fn failure_counters_fit_the_key() {
        let key = IdempotencyKey::new("q", "t".repeat(MAX_MESSAGE_TYPE_LEN), "m").unwrap();
        let counter = failure_counter(&key).unwrap();
        assert_eq!(counter.operation().len() + RECORD_SUFFIX_MAX, MAX_PART_LEN);
        let long = "t".repeat(MAX_MESSAGE_TYPE_LEN + 1);
        assert!(matches!(
            Attempt::message_bytes("q", &long, "m", b""),
            Err(InvalidMessage::TypeTooLong { .. })
        ));
    }

    #[test]
    fn reasons_are_bounded() {
        assert_eq!(bounded("short"), "short");
        let long = "é".repeat(MAX_REASON_CHARS + 5);
        assert_eq!(bounded(&long).chars().count(), MAX_REASON_CHARS + 1);
    }
}
