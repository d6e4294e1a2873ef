//! Durable steps: an operation that calls outside services, written as a sequence of **local

use crate::{
    error::{BoxError, PerformError, StepError},
    fingerprint::canonical_json,
    lease::{append_on_its_own, Lease},
    maintenance::signals,
    store::{
        history::{self, EventKind},
        Journal as JournalStore, KeyRecord, Progress, Store,
    },
    IdempotencyKey,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    time::Duration,
};
use tracing::Instrument;

/// The largest request (canonical JSON) a durable operation stores with its key: 64 KiB.
pub const MAX_STORED_REQUEST: usize = 64 * 1024;

/// The longest recovery point stored, in characters: the `recovery_point` column is
/// `VARCHAR(255)` on MySQL/MariaDB, and a failure point carries the provider's reason, of any
/// length. A longer point is cut at a character boundary; it only names the point (the journal,
/// not the point, records what is done).
const MAX_RECOVERY_POINT_CHARS: usize = 255;

/// `point`, cut to [`MAX_RECOVERY_POINT_CHARS`].
fn bounded_point(point: &str) -> &str {
    match point.char_indices().nth(MAX_RECOVERY_POINT_CHARS) {
        Some((end, _)) => &point[..end],
        None => point,
    }
}

/// The key a provider gets for the outside call `step` of the operation held by `key`: the
/// SHA-256 (hex) of the key's three parts and the step name, each length-prefixed. The same
/// operation and step always give the same provider key; another step, operation, scope or key
/// never does. 64 characters, within every provider's limit.
///
/// ```
/// use idempotency::{IdempotencyKey, durable::provider_key};
/// let key = IdempotencyKey::new("user-1", "purchase", "k-1")?;
/// assert_eq!(provider_key(&key, "charge"), provider_key(&key, "charge"));
/// assert_ne!(provider_key(&key, "charge"), provider_key(&key, "refund"));
/// assert_eq!(provider_key(&key, "charge").len(), 64);
/// # Ok::<(), idempotency::key::InvalidKey>(())
/// ```
pub fn provider_key(key: &IdempotencyKey, step: &str) -> String {
    let mut digest = Sha256::new();
    for part in [key.scope(), key.operation(), key.key(), step] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part.as_bytes());
    }
    hex::encode(digest.finalize())
}

/// How an outside call failed.
///
/// ```
/// use idempotency::durable::CallError;
/// let lost = CallError::Unknown("timeout".into());
/// assert!(lost.to_string().contains("timeout"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// No answer (timeout, reset): the call may or may not have taken effect.
    #[error("the outcome of the call is unknown: {0}")]
    Unknown(String),
    /// The provider refused for good (card declined): the call did not take effect.
    #[error("the provider declined: {0}")]
    Declined(String),
}

/// What a provider says when asked about a call by its key.
///
/// ```
/// use idempotency::durable::Lookup;
/// let answer: Lookup<u32> = Lookup::Done(7);
/// assert!(matches!(answer, Lookup::Done(7)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lookup<T> {
    /// The call took effect; this is its result.
    Done(T),
    /// No call with that key took effect: it may be made again.
    NotDone,
    /// The provider cannot tell now (it did not answer).
    Unknown(String),
}

/// How persistent a durable operation is with outside calls.
///
/// ```
/// use idempotency::durable::StepPolicy;
/// use std::time::Duration;
/// let policy = StepPolicy::default();
/// assert_eq!(policy.max_unknown(), 5);
/// assert_eq!(policy.calls_per_step(), 3);
/// let patient = policy.with_max_unknown(10).with_retry_after(Duration::from_secs(5));
/// assert_eq!(patient.max_unknown(), 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPolicy {
    /// How many times an outcome may be unknown (a suspended run, a resume that still cannot tell)
    /// before the key is parked as *needs review*.
    pub(crate) max_unknown: u32,
    /// How long a key whose outcome is unknown waits before the resumer (or a retry) looks again.
    pub(crate) retry_after: Duration,
    /// How many calls one run makes for a step whose provider says *not done*, before the step
    /// fails with [`StepError::NotDone`].
    pub(crate) calls_per_step: u32,
}

impl StepPolicy {
    /// How many times an outcome may be unknown before the key is parked as *needs review* (default 5).
    pub fn max_unknown(&self) -> u32 {
        self.max_unknown
    }

    /// How long a key whose outcome is unknown waits before it is looked at again (default 1 s).
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How many calls one run makes for a step whose provider says *not done* (default 3).
    pub fn calls_per_step(&self) -> u32 {
        self.calls_per_step
    }

    /// Parks the key as *needs review* once its outcome was unknown `max_unknown` times.
    pub fn with_max_unknown(mut self, max_unknown: u32) -> Self {
        self.max_unknown = max_unknown;
        self
    }

    /// Looks again at a key whose outcome is unknown after `retry_after`.
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Makes at most `calls_per_step` calls per run for a step whose provider says *not done*.
    pub fn with_calls_per_step(mut self, calls_per_step: u32) -> Self {
        self.calls_per_step = calls_per_step;
        self
    }
}

impl Default for StepPolicy {
    fn default() -> Self {
        Self {
            max_unknown: 5,
            retry_after: Duration::from_secs(1),
            calls_per_step: 3,
        }
    }
}

/// How a durable operation was settled.
///
/// ```
/// use idempotency::durable::Settlement;
/// assert_ne!(Settlement::Completed, Settlement::Failed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// It ran to its end ([`Steps::finish`]).
    Completed,
    /// It was settled as failed, compensated, with a definitive failure response
    /// ([`Steps::fail`]).
    Failed,
}

/// Proof that a durable operation settled its key: the response stored with it, and how.
/// Only [`Steps::finish`] and [`Steps::fail`] make one.
#[derive(Debug)]
pub struct Finished<R> {
    response: R,
    settlement: Settlement,
}

impl<R> Finished<R> {
    /// The stored response.
    pub fn response(&self) -> &R {
        &self.response
    }

    /// The stored response, by value.
    pub fn into_response(self) -> R {
        self.response
    }

    /// Whether it completed or was settled as failed.
    pub fn settlement(&self) -> Settlement {
        self.settlement
    }
}

/// The journal kept in the key's `progress` column.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Journal {
    /// The output of each step done.
    #[serde(default)]
    done: BTreeMap<String, serde_json::Value>,
    /// Outside calls to providers without keys that were started and not answered.
    #[serde(default)]
    started: BTreeSet<String>,
}

/// A durable operation in progress: the key held, its journal, and the steps.
///
/// Made by [`Idempotency::perform`](crate::Idempotency::perform) and the resumer; an operation
/// receives it in [`Operation::run`](crate::operation::Operation::run).
///
/// Durable steps: an operation that calls outside services, written as a sequence of **local
/// steps** (our database) and **outside calls** (a payment provider, a mailer), each of which
/// commits a *recovery point* with the key, so that the operation can be carried to its end by
/// whoever holds the key next: the request itself, the client's retry, or the resumer.
///
/// * A [local step](Steps::local) runs in a business transaction and commits its writes **with**
///   the key's new recovery point and the step's output (the journal). The write is fenced by the
///   lease token: a worker whose key was claimed by someone else rolls its step back
///   ([`StepError::LeaseLost`]).
/// * An [outside call](Steps::call) gets a provider key derived from our key and the step's name
///   ([`provider_key`]), so calling again is safe. When the answer is lost, the provider is asked
///   with the same key ([`Lookup`]): *done* continues, *not done* calls again, *unknown* leaves the
///   key pending for the resumer ([`StepError::Pending`]). A provider **without** keys
///   ([`Steps::call_unkeyed`]) is marked as started before the call; an unknown outcome, or a
///   resumed operation that finds the mark, parks the key as *needs review*.
/// * The operation ends with [`Steps::finish`] (its last local writes and the key's completion
///   with the response, in one transaction) or [`Steps::fail`] (compensating writes and a
///   definitive failure response, stored and replayed).
///
/// Completed steps are never run again: a resumed operation re-runs the same function, and each
/// step already in the journal returns its recorded output instead of running.
///
/// The request is stored with the key (canonical JSON, at most [`MAX_STORED_REQUEST`] bytes) by the
/// first step that writes, and cleared when the key completes. A pending key without a stored
/// request has therefore made no outside call, and may be released.
pub struct Steps<S: JournalStore> {
    lease: Lease<S>,
    policy: StepPolicy,
    retention: Duration,
    journal: Journal,
    recovery_point: Option<String>,
    request: Vec<u8>,
    request_stored: bool,
    unknown_so_far: u32,
    resumed: bool,
    settled: bool,
    /// Events waiting for the next commit of the journal (answers of outside calls, which are
    /// committed with the next step).
    events: Vec<(EventKind, String)>,
}

impl<S: JournalStore> std::fmt::Debug for Steps<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("key", self.lease.key())
            .field("recovery_point", &self.recovery_point)
            .field("resumed", &self.resumed)
            .finish_non_exhaustive()
    }
}

impl<S: JournalStore> Steps<S> {
    /// Steps under `lease` for `request`; a lease that resumed a key brings its journal.
    pub(crate) fn new<Q: Serialize>(
        lease: Lease<S>,
        request: &Q,
        policy: StepPolicy,
        retention: Duration,
    ) -> Result<Self, Box<(Lease<S>, StepError)>> {
        let request = match canonical_json(request) {
            Ok(bytes) => bytes,
            Err(e) => return Err(Box::new((lease, e.into()))),
        };
        if request.len() > MAX_STORED_REQUEST {
            let size = request.len();
            return Err(Box::new((
                lease,
                StepError::RequestTooLarge {
                    size,
                    limit: MAX_STORED_REQUEST,
                },
            )));
        }
        let resumed = lease.resumed_record();
        let journal = match resumed.and_then(|record| record.progress.as_deref()) {
            Some(bytes) => match serde_json::from_slice(bytes) {
                Ok(journal) => journal,
                Err(e) => return Err(Box::new((lease, e.into()))),
            },
            None => Journal::default(),
        };
        Ok(Self {
            policy,
            retention,
            journal,
            recovery_point: resumed.and_then(|record| record.recovery_point.clone()),
            request_stored: resumed.is_some_and(|record| record.request.is_some()),
            unknown_so_far: resumed.map_or(0, |record| record.recovery_attempts),
            resumed: resumed.is_some(),
            request,
            lease,
            settled: false,
            events: Vec::new(),
        })
    }

    /// The key held.
    pub fn key(&self) -> &IdempotencyKey {
        self.lease.key()
    }

    /// The last recovery point reached (`None` before the first step).
    pub fn recovery_point(&self) -> Option<&str> {
        self.recovery_point.as_deref()
    }

    /// Whether this run took the key over from an earlier one (a retry, the resumer).
    pub fn is_resumed(&self) -> bool {
        self.resumed
    }

    /// The provider key of the outside call `step` ([`provider_key`]).
    pub fn provider_key(&self, step: &str) -> String {
        provider_key(self.lease.key(), step)
    }

    /// Whether anything was recorded: a step done, a call started, or the request stored. A key
    /// with nothing recorded made no outside call and may be released.
    pub(crate) fn has_progress(&self) -> bool {
        self.request_stored || !self.journal.done.is_empty() || !self.journal.started.is_empty()
    }

    fn store(&self) -> &S {
        self.lease.store()
    }

    fn recorded<T: DeserializeOwned>(&self, step: &str) -> Result<Option<T>, StepError> {
        match self.journal.done.get(step) {
            Some(value) => Ok(Some(serde_json::from_value(value.clone())?)),
            None => Ok(None),
        }
    }

    /// Writes the journal and `point` inside `tx`, fenced by our token.
    async fn save(
        &mut self,
        tx: &mut sqlx::Transaction<'static, S::Database>,
        point: &str,
    ) -> Result<(), StepError> {
        let journal = serde_json::to_vec(&self.journal)?;
        let progress = Progress {
            recovery_point: bounded_point(point),
            journal: &journal,
            request: (!self.request_stored).then_some(self.request.as_slice()),
        };
        let saved = self
            .store()
            .save_progress(tx, self.lease.key(), self.lease.token(), &progress)
            .await?;
        if !saved {
            return Err(StepError::LeaseLost);
        }
        if self.lease.records_history {
            for (kind, detail) in std::mem::take(&mut self.events) {
                let key = self.lease.key();
                let store = self.lease.store();
                store.append_event(tx, key, kind, Some(&detail)).await?;
            }
        }
        Ok(())
    }

    /// After a step's transaction rolled back on `error`: a lost lease is noted in the key's
    /// history (in a transaction of its own, once the step's has ended: SQLite has one writer).
    async fn after_rollback(&self, error: StepError) -> StepError {
        if matches!(error, StepError::LeaseLost) {
            self.lease
                .note_lease_lost("a step found the lease taken")
                .await;
        }
        error
    }

    /// Appends an event of `kind` to the key's history at once, in a transaction of its own
    /// (an outside call about to start, an unknown answer): nothing else commits with it.
    async fn append_now(&self, kind: EventKind, detail: &str) {
        if self.lease.records_history {
            append_on_its_own(self.store(), self.lease.key(), kind, Some(detail)).await;
        }
    }

    /// An answer of an outside call, recorded with the next commit of the journal.
    fn answered<T: Serialize>(&mut self, provider_key: &str, output: &T) {
        let answer = serde_json::to_string(output).unwrap_or_default();
        let detail = history::call_detail(provider_key, Some(&answer));
        self.events.push((EventKind::CallAnswered, detail));
    }

    /// Saves the journal in a transaction of its own (outside calls' marks and results).
    async fn save_now(&mut self, point: &str) -> Result<(), StepError> {
        let mut tx = self.store().begin().await?;
        if let Err(e) = self.save(&mut tx, point).await {
            let _ = tx.rollback().await;
            return Err(self.after_rollback(e).await);
        }
        tx.commit().await?;
        self.committed(point);
        Ok(())
    }

    fn committed(&mut self, point: &str) {
        self.request_stored = true;
        self.recovery_point = Some(bounded_point(point).to_owned());
    }

    /// A **local step**: runs `work` in a business transaction, then records the step's output as
    /// the recovery point `name` in the same transaction, and commits both. A step already in the
    /// journal is not run again: its recorded output is returned.
    ///
    /// If `work` fails, its transaction rolls back and [`StepError::Local`] is returned. If the
    /// lease was lost meanwhile, the transaction rolls back ([`StepError::LeaseLost`]).
    ///
    /// The work is the same async closure as [`Idempotency::run`](crate::Idempotency::run)'s,
    /// `async |tx| { … }`, with the same error bound; it may borrow the request and the outputs
    /// of earlier steps.
    pub async fn local<T, E, F>(&mut self, name: &str, work: F) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<T, E> + Send,
    {
        if let Some(output) = self.recorded(name)? {
            return Ok(output);
        }
        let span = tracing::debug_span!(
            signals::SPAN_STEP,
            scope = self.key().scope(),
            operation = self.key().operation(),
            step = name,
            outcome = tracing::field::Empty,
        );
        let done = self.run_local(name, work).instrument(span.clone()).await;
        if done.is_ok() {
            signals::step(self.key().operation(), signals::STEP_COMMITTED);
        }
        signals::record(&span, outcome_of(&done, signals::STEP_COMMITTED));
        done
    }

    /// [`local`](Self::local) once the step is not in the journal, without its span and counts.
    async fn run_local<T, E, F>(&mut self, name: &str, work: F) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<T, E> + Send,
    {
        let mut tx = self.store().begin().await?;
        let output = match work(&mut tx).await {
            Ok(output) => output,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(StepError::Local {
                    step: name.to_owned(),
                    source: e.into(),
                });
            }
        };
        self.journal
            .done
            .insert(name.to_owned(), serde_json::to_value(&output)?);
        self.events
            .push((EventKind::StepCommitted, name.to_owned()));
        if let Err(e) = self.save(&mut tx, name).await {
            self.journal.done.remove(name);
            let _ = tx.rollback().await;
            return Err(self.after_rollback(e).await);
        }
        tx.commit().await?;
        self.committed(name);
        Ok(output)
    }

    /// An **outside call** to a provider that honours idempotency keys: `call` is made with the
    /// step's [provider key](Self::provider_key), and its output recorded in the journal under
    /// `name`. A step already in the journal is not called again.
    ///
    /// When the answer is lost ([`CallError::Unknown`]), or when this run resumed the key from an
    /// earlier one, `lookup` asks the provider with the same key first: *done* records its output,
    /// *not done* calls (again, up to [`StepPolicy::calls_per_step`] calls, then
    /// [`StepError::NotDone`]), and *unknown* leaves the key pending ([`StepError::Pending`]), or
    /// parks it after [`StepPolicy::max_unknown`] times.
    ///
    /// The output is committed with the next step (local, [`finish`](Self::finish) or
    /// [`fail`](Self::fail)), not in a transaction of its own: a run that stops before then leaves
    /// the call unrecorded, and the next run asks the provider with the same key ([`Lookup`])
    /// instead of reading the journal. That saves a commit per call; nothing is lost, since a
    /// keyed provider answers for its key.
    pub async fn call<T, C, CF, L, LF>(
        &mut self,
        name: &str,
        call: C,
        lookup: L,
    ) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        C: Fn(String) -> CF + Send,
        CF: Future<Output = Result<T, CallError>> + Send,
        L: Fn(String) -> LF + Send,
        LF: Future<Output = Lookup<T>> + Send,
    {
        if let Some(output) = self.recorded(name)? {
            return Ok(output);
        }
        let key = self.provider_key(name);
        let span = tracing::debug_span!(
            signals::SPAN_CALL,
            scope = self.key().scope(),
            operation = self.key().operation(),
            step = name,
            provider_key = key.as_str(),
            outcome = tracing::field::Empty,
        );
        let answered = self
            .call_keyed(name, key, call, lookup)
            .instrument(span.clone())
            .await;
        signals::record(&span, self.noted_call(&answered));
        answered
    }

    /// Counts the end of an outside call, and answers its span's outcome.
    fn noted_call<T>(&self, answered: &Result<T, StepError>) -> &'static str {
        let outcome = outcome_of(answered, signals::CALL_ANSWERED);
        if matches!(outcome, signals::CALL_ANSWERED | signals::CALL_FAILED) {
            signals::step(self.key().operation(), outcome);
        }
        outcome
    }

    /// [`call`](Self::call) once the step is not in the journal, under provider key `key`,
    /// without its span and counts.
    async fn call_keyed<T, C, CF, L, LF>(
        &mut self,
        name: &str,
        key: String,
        call: C,
        lookup: L,
    ) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        C: Fn(String) -> CF + Send,
        CF: Future<Output = Result<T, CallError>> + Send,
        L: Fn(String) -> LF + Send,
        LF: Future<Output = Lookup<T>> + Send,
    {
        if !self.request_stored {
            // Nothing is recorded yet: record the request before the first outside call, so the
            // key can never be released after a call was made.
            self.save_now(&format!("{name}: calling")).await?;
        }
        let mut ask_first = self.resumed;
        let mut calls = 0;
        loop {
            if ask_first {
                match lookup(key.clone()).await {
                    Lookup::Done(output) => {
                        self.answered(&key, &output);
                        return self.note_call(name, output);
                    }
                    Lookup::NotDone => {}
                    Lookup::Unknown(reason) => {
                        signals::step(self.key().operation(), signals::CALL_UNKNOWN);
                        let detail = format!("{key} {name}: {reason}");
                        self.append_now(EventKind::CallUnknown, &detail).await;
                        return Err(self.unknown(&format!("{name}: {reason}")).await);
                    }
                }
            }
            if calls == self.policy.calls_per_step.max(1) {
                return Err(StepError::NotDone {
                    step: name.to_owned(),
                });
            }
            calls += 1;
            self.append_now(EventKind::CallStarted, &history::call_detail(&key, None))
                .await;
            match call(key.clone()).await {
                Ok(output) => {
                    self.answered(&key, &output);
                    return self.note_call(name, output);
                }
                Err(CallError::Declined(reason)) => {
                    return Err(StepError::Declined {
                        step: name.to_owned(),
                        reason,
                    })
                }
                Err(CallError::Unknown(reason)) => {
                    signals::step(self.key().operation(), signals::CALL_UNKNOWN);
                    tracing::debug!(key = %self.key(), step = name, %reason, "outside call unanswered; asking the provider");
                    let detail = format!("{key} {name}: {reason}");
                    self.append_now(EventKind::CallUnknown, &detail).await;
                    ask_first = true;
                }
            }
        }
    }

    /// Puts a keyed call's output in the journal, to be committed with the next step.
    fn note_call<T: Serialize>(&mut self, name: &str, output: T) -> Result<T, StepError> {
        self.journal
            .done
            .insert(name.to_owned(), serde_json::to_value(&output)?);
        Ok(output)
    }

    /// Puts an unkeyed call's output in the journal and commits it at once.
    async fn record_call<T: Serialize>(&mut self, name: &str, output: T) -> Result<T, StepError> {
        self.journal
            .done
            .insert(name.to_owned(), serde_json::to_value(&output)?);
        self.journal.started.remove(name);
        if let Err(e) = self.save_now(name).await {
            self.journal.done.remove(name);
            return Err(e);
        }
        Ok(output)
    }

    /// An **outside call** to a provider **without** idempotency keys (a mailer): the call is
    /// marked as started (committed) before it is made. If its answer is lost, or a later run finds
    /// the mark without an answer, nobody can tell whether it took effect: the key is parked as
    /// *needs review* ([`StepError::Parked`]) and never released or called again automatically.
    pub async fn call_unkeyed<T, C, CF>(&mut self, name: &str, call: C) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        C: FnOnce() -> CF + Send,
        CF: Future<Output = Result<T, CallError>> + Send,
    {
        if let Some(output) = self.recorded(name)? {
            return Ok(output);
        }
        let span = tracing::debug_span!(
            signals::SPAN_CALL,
            scope = self.key().scope(),
            operation = self.key().operation(),
            step = name,
            provider_key = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let answered = self
            .call_unkeyed_once(name, call)
            .instrument(span.clone())
            .await;
        signals::record(&span, self.noted_call(&answered));
        answered
    }

    /// [`call_unkeyed`](Self::call_unkeyed) once the step is not in the journal, without its
    /// span and counts.
    async fn call_unkeyed_once<T, C, CF>(&mut self, name: &str, call: C) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send,
        C: FnOnce() -> CF + Send,
        CF: Future<Output = Result<T, CallError>> + Send,
    {
        if self.journal.started.contains(name) {
            let reason = format!("{name}: started by an earlier run, and the provider has no idempotency keys: whether it took effect is unknown");
            return Err(self.park(&reason).await);
        }
        self.journal.started.insert(name.to_owned());
        self.events.push((EventKind::CallStarted, name.to_owned()));
        if let Err(e) = self.save_now(&format!("{name}: started")).await {
            self.journal.started.remove(name);
            return Err(e);
        }
        match call().await {
            Ok(output) => {
                self.answered(name, &output);
                self.record_call(name, output).await
            }
            Err(CallError::Declined(reason)) => {
                self.journal.started.remove(name);
                self.save_now(&format!("{name}: declined")).await?;
                Err(StepError::Declined {
                    step: name.to_owned(),
                    reason,
                })
            }
            Err(CallError::Unknown(reason)) => {
                signals::step(self.key().operation(), signals::CALL_UNKNOWN);
                let reason = format!("{name}: {reason}; the provider has no idempotency keys");
                Err(self.park(&reason).await)
            }
        }
    }

    /// The **last step**: runs `work` in a business transaction and completes the key with its
    /// response in the same transaction, then commits both. Replays return that response.
    pub async fn finish<R, E, F>(&mut self, work: F) -> Result<Finished<R>, StepError>
    where
        R: Serialize + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        let span = self.settle_span("finish");
        let finished = self
            .settle("completed", Settlement::Completed, work)
            .instrument(span.clone())
            .await;
        self.noted_settlement(&span, &finished, signals::SETTLED_COMPLETED);
        finished
    }

    /// The span of the last step, `finish` or `fail`.
    fn settle_span(&self, step: &'static str) -> tracing::Span {
        tracing::debug_span!(
            signals::SPAN_STEP,
            scope = self.key().scope(),
            operation = self.key().operation(),
            step,
            outcome = tracing::field::Empty,
        )
    }

    /// Counts a settlement (a step, and the key's completion) and records it on its span.
    fn noted_settlement<R>(
        &self,
        span: &tracing::Span,
        finished: &Result<Finished<R>, StepError>,
        settled: &'static str,
    ) {
        if finished.is_ok() {
            signals::step(self.key().operation(), settled);
            signals::outcome(self.key().operation(), signals::EXECUTED);
        }
        signals::record(span, outcome_of(finished, settled));
    }

    /// Settles the operation as **failed**: runs the compensating `work` (refund a debit, cancel
    /// an order) in a business transaction and completes the key with the failure response it
    /// returns, in the same transaction. The failure is definitive: replays return it.
    pub async fn fail<R, E, F>(&mut self, reason: &str, work: F) -> Result<Finished<R>, StepError>
    where
        R: Serialize + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        let point = format!("failed: {reason}");
        let span = self.settle_span("fail");
        let finished = self
            .settle(&point, Settlement::Failed, work)
            .instrument(span.clone())
            .await;
        self.noted_settlement(&span, &finished, signals::SETTLED_FAILED);
        finished
    }

    async fn settle<R, E, F>(
        &mut self,
        point: &str,
        settlement: Settlement,
        work: F,
    ) -> Result<Finished<R>, StepError>
    where
        R: Serialize + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        let mut tx = self.store().begin().await?;
        let response = match work(&mut tx).await {
            Ok(response) => response,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(StepError::Local {
                    step: point.to_owned(),
                    source: e.into(),
                });
            }
        };
        let result = serde_json::to_vec(&response)?;
        if let Err(e) = self.save(&mut tx, point).await {
            let _ = tx.rollback().await;
            return Err(self.after_rollback(e).await);
        }
        // The remaining lease covers the completion; a beat racing it would only find it settled.
        self.lease.stop_heartbeat();
        let started = std::time::Instant::now();
        let completed = self
            .store()
            .complete(
                &mut tx,
                self.lease.key(),
                self.lease.token(),
                &result,
                self.retention,
            )
            .await?;
        if !completed {
            let _ = tx.rollback().await;
            self.lease
                .note_lease_lost("the completion found the lease taken")
                .await;
            return Err(StepError::LeaseLost);
        }
        if self.lease.records_history {
            let (kind, detail) = match settlement {
                Settlement::Completed => (EventKind::Completed, None),
                _ => (EventKind::Failed, Some(point)),
            };
            let key = self.lease.key();
            self.store()
                .append_event(&mut tx, key, kind, detail)
                .await?;
        }
        // A failed COMMIT may still have committed (a lost acknowledgement): the key is left
        // pending either way, never released, and the next holder finds out from the row.
        tx.commit().await?;
        self.settled = true;
        self.lease.disarm();
        self.lease.remember(started, &result);
        Ok(Finished {
            response,
            settlement,
        })
    }

    /// Notes an unknown outcome: the key stays pending for `retry_after`, or is parked once the
    /// outcome was unknown [`StepPolicy::max_unknown`] times.
    async fn unknown(&mut self, reason: &str) -> StepError {
        // The key is about to wait for `retry_after` (or be parked): no beat may extend it.
        self.lease.stop_heartbeat();
        let attempts = self.unknown_so_far.saturating_add(1);
        if attempts >= self.policy.max_unknown.max(1) {
            let reason = format!("the outcome was unknown {attempts} times; last: {reason}");
            return self.park(&reason).await;
        }
        let retry_after = self.policy.retry_after;
        match self
            .store()
            .note_unknown(self.lease.key(), self.lease.token(), retry_after)
            .await
        {
            Ok(true) => {
                self.unknown_so_far = attempts;
                self.lease.disarm();
                signals::step(self.key().operation(), signals::LEFT_PENDING);
                signals::outcome(self.key().operation(), signals::LEFT_PENDING);
                tracing::info!(key = %self.key(), %reason, attempts, "durable operation pending; the resumer carries it on");
                StepError::Pending {
                    retry_after,
                    reason: reason.to_owned(),
                }
            }
            Ok(false) => StepError::LeaseLost,
            Err(e) => e.into(),
        }
    }

    async fn park(&mut self, reason: &str) -> StepError {
        self.lease.stop_heartbeat();
        let (key, token) = (self.lease.key(), self.lease.token());
        let parked = if self.lease.records_history {
            self.store().park_recorded(key, token, reason).await
        } else {
            self.store().park(key, token, reason).await
        };
        match parked {
            Ok(true) => {
                self.lease.disarm();
                signals::step(self.key().operation(), signals::PARKED);
                signals::outcome(self.key().operation(), signals::PARKED);
                tracing::warn!(key = %self.key(), %reason, "durable operation parked for review");
                StepError::Parked {
                    reason: reason.to_owned(),
                }
            }
            Ok(false) => StepError::LeaseLost,
            Err(e) => e.into(),
        }
    }

    /// After the operation returned an error: what happens to the key. Nothing recorded → the key
    /// is released (no step took effect); otherwise it is never released: it stays pending for
    /// the resumer (or is parked after too many unknown outcomes).
    pub(crate) async fn after_error(mut self, error: StepError) -> PerformError {
        match error {
            StepError::LeaseLost | StepError::Pending { .. } | StepError::Parked { .. } => {
                PerformError::stopped(error)
            }
            error if self.settled => PerformError::Interrupted(error),
            error if !self.has_progress() => {
                self.lease.release_now().await;
                PerformError::Released(error)
            }
            error if error.is_unavailable() => {
                // The database said "not now" (unreachable, full, a deadlock): no outside
                // outcome became less certain, so this is not counted toward parking. The key
                // stays pending with its recovery point, unextended, and whoever holds it after
                // its lease (a retry, the resumer) carries the operation on.
                self.lease.disarm();
                PerformError::Interrupted(error)
            }
            error => {
                let noted = self.unknown(&error.to_string()).await;
                match noted {
                    StepError::Pending { .. } | StepError::Parked { .. } | StepError::LeaseLost => {
                        PerformError::stopped(noted)
                    }
                    _ => PerformError::Interrupted(error),
                }
            }
        }
    }
}

/// The span outcome of a step that answered `answered`: `done` when it succeeded.
fn outcome_of<T>(answered: &Result<T, StepError>, done: &'static str) -> &'static str {
    match answered {
        Ok(_) => done,
        Err(StepError::Declined { .. } | StepError::NotDone { .. }) => signals::CALL_FAILED,
        Err(StepError::Pending { .. }) => signals::LEFT_PENDING,
        Err(StepError::Parked { .. }) => signals::PARKED,
        Err(StepError::LeaseLost) => signals::LEASE_LOST,
        Err(_) => signals::ERROR,
    }
}

/// A recorded record of a resumed key, for [`Steps::new`].
impl<S: Store> Lease<S> {
    fn resumed_record(&self) -> Option<&KeyRecord> {
        self.resumed.as_deref()
    }
}
