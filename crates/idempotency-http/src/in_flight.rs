//! A duplicate that arrives while the original still runs: waiting for it
//! ([`IdempotencyLayer::with_wait_for_in_flight`](crate::IdempotencyLayer::with_wait_for_in_flight)), and
//! the retry hint of the 409 answered when it is not waited for (or does not finish in time).
//!
//! # Waiting
//!
//! When the reservation answers *in progress* (the key is pending with a live lease) and the
//! layer has a wait bound, the request waits for the key to change. It is woken
//!
//! * at once when the original runs in this process behind the same layer: the layer wakes the
//!   key's waiters as soon as it has completed (or released, or parked) a key;
//! * from another process, on PostgreSQL, by the `NOTIFY` that layer sends after its commit
//!   ([`CompletionSignal::notify_settled`]), received by one `LISTEN` connection per store, with a read
//!   every 100 ms as a safety net;
//! * otherwise by polling ([`CompletionSignal::wait_for_completion`]: 1 ms, doubling to 25 ms).
//!
//! Only layers with a wait bound announce their completions (so a deployment without waiting
//! pays nothing); give every instance that shares a database the same setting, or the waiters of
//! one will poll for the completions of another. Then:
//!
//! * completed with this request's fingerprint → the stored response, with
//!   `Idempotent-Replayed: true`, as for any replay;
//! * anything else changed (released after a 5xx, parked, completed for another request, the
//!   lease ended) → the key is reserved again, which decides as for a new request (run it, 422,
//!   409 …);
//! * still pending when the bound runs out → 409 `in-progress`, as without waiting.
//!
//! The wait is cut at the bound whatever the store does (a `tokio::time::timeout` around it), so
//! a duplicate never waits longer than the bound before its answer is decided. Each wait counts
//! one `idempotency_in_flight_waits_total{operation, result}` ([`WAITS_TOTAL`]), `result` one of
//! [`WAIT_REPLAYED`], [`WAIT_SETTLED`], [`WAIT_TIMED_OUT`], [`WAIT_FAILED`].
//!
//! # The retry hint
//!
//! A 409 `in-progress` carries `Retry-After` in whole seconds, as HTTP requires (at least 1),
//! and [`Retry-After-Ms`](idempotency_wire::header::RETRY_AFTER_MS), the same hint in milliseconds. The
//! hint is the layer's estimate of how long the operation takes: the median of its last 16
//! executions in this process (from the reservation to the commit of the completion; a median,
//! so that a cold first request does not skew it), at least 10 ms, and never more than the
//! engine's own hint (the lease left, capped at 1 s by default). Before the first execution it
//! is the engine's hint. A double click on a 5 ms transfer is thus told to come back in about 5–10 ms,
//! not in a second.

use futures_util::future::BoxFuture;
use idempotency::{
    maintenance::signals,
    protocol::Reservation,
    store::{Awaited, CompletionSignal},
    Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, Store, StoreError,
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::sync::Notify;
use tracing::Instrument;

/// The counter of waits for a request in flight.
///
/// ```
/// assert_eq!(idempotency_http::in_flight::WAITS_TOTAL, "idempotency_in_flight_waits_total");
/// ```
pub const WAITS_TOTAL: &str = "idempotency_in_flight_waits_total";
/// `result`: the original completed; its stored response was replayed.
pub const WAIT_REPLAYED: &str = "replayed";
/// `result`: the key changed otherwise (released, parked …) and was reserved again.
pub const WAIT_SETTLED: &str = "settled";
/// `result`: still in progress at the bound; 409.
pub const WAIT_TIMED_OUT: &str = "timed_out";
/// `result`: the store failed while waiting; 409 as without waiting.
pub const WAIT_FAILED: &str = "failed";

/// The smallest millisecond hint given (a floor against clients hammering a key).
pub const MIN_HINT: Duration = Duration::from_millis(10);

/// Counts a wait's end, and records it as the outcome of its span
/// ([`SPAN_WAIT`](idempotency::maintenance::signals::SPAN_WAIT)).
fn count(operation: &str, result: &'static str) {
    ::metrics::counter!(WAITS_TOTAL, "operation" => operation.to_owned(), "result" => result)
        .increment(1);
    tracing::Span::current().record(signals::FIELD_OUTCOME, result);
}

/// A layer's wait for requests in flight: its bound, and the store's [`CompletionSignal`]
/// captured where the wait was turned on, so that the layer needs only [`Store`].
pub(crate) struct InFlightWait<S> {
    pub(crate) bound: Duration,
    signal: Arc<dyn Signal<S>>,
}

impl<S: CompletionSignal> InFlightWait<S> {
    /// The wait of a layer on a store that can signal completions.
    pub(crate) fn new(bound: Duration) -> Self {
        Self {
            bound,
            signal: Arc::new(Captured),
        }
    }
}

impl<S> Clone for InFlightWait<S> {
    fn clone(&self) -> Self {
        Self {
            bound: self.bound,
            signal: self.signal.clone(),
        }
    }
}

impl<S> std::fmt::Debug for InFlightWait<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.bound.fmt(f)
    }
}

/// [`CompletionSignal`], callable where only `S: Store` is known.
trait Signal<S>: Send + Sync {
    fn wait_for_completion<'a>(
        &self,
        store: &'a S,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Awaited, StoreError>>;

    fn notify_settled<'a>(
        &self,
        store: &'a S,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// The signal of a store that has one.
struct Captured;

impl<S: CompletionSignal> Signal<S> for Captured {
    fn wait_for_completion<'a>(
        &self,
        store: &'a S,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Awaited, StoreError>> {
        Box::pin(store.wait_for_completion(key, fingerprint, timeout))
    }

    fn notify_settled<'a>(
        &self,
        store: &'a S,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(store.notify_settled(key))
    }
}

/// Reserves the key; when it is in progress and `wait` is set, waits (at most its bound in all)
/// for it to change and decides again.
pub(crate) async fn reserve<S: Store>(
    engine: &Idempotency<S>,
    attempt: &Attempt,
    wait: Option<&InFlightWait<S>>,
    waiters: &Waiters,
    operation: &str,
) -> Result<Reservation<S>, Error> {
    let reserved = engine.reserve(attempt).await;
    let Some(wait) = wait.filter(|wait| !wait.bound.is_zero()) else {
        return reserved;
    };
    if !matches!(reserved, Err(Error::InProgress { .. })) {
        return reserved;
    }
    let span = tracing::debug_span!(
        signals::SPAN_WAIT,
        scope = attempt.key().scope(),
        operation = attempt.key().operation(),
        outcome = tracing::field::Empty,
    );
    wait_and_reserve(engine, attempt, wait, reserved, waiters, operation)
        .instrument(span)
        .await
}

/// The wait of [`reserve`], for a key found in progress (`reserved`), at most the bound in all.
async fn wait_and_reserve<S: Store>(
    engine: &Idempotency<S>,
    attempt: &Attempt,
    wait: &InFlightWait<S>,
    reserved: Result<Reservation<S>, Error>,
    waiters: &Waiters,
    operation: &str,
) -> Result<Reservation<S>, Error> {
    let (bound, signal) = (wait.bound, &wait.signal);
    let deadline = Instant::now() + bound;
    let mut reserved = reserved;
    let local = waiters.subscribe(attempt.key());
    loop {
        if !matches!(reserved, Err(Error::InProgress { .. })) {
            return reserved;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            count(operation, WAIT_TIMED_OUT);
            return reserved;
        }
        let store = engine.store();
        // Registered before the store's first read: a completion in this process from here on
        // wakes it, and one before is seen by that read.
        let woken = local.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let waited = tokio::time::timeout(left, async {
            tokio::select! {
                awaited = signal.wait_for_completion(store, attempt.key(), attempt.fingerprint(), left) => awaited,
                _ = woken => Ok(Awaited::Settled),
            }
        })
        .await;
        match waited {
            Ok(Ok(Awaited::Completed(bytes))) => {
                count(operation, WAIT_REPLAYED);
                tracing::debug!(
                    waited_ms = (bound - left).as_millis() as u64,
                    "the request in flight completed; replaying it"
                );
                return Ok(Reservation::Completed(bytes));
            }
            Ok(Ok(Awaited::Settled)) => {
                count(operation, WAIT_SETTLED);
                reserved = engine.reserve(attempt).await;
            }
            // (A future kind of wait's end counts as a timeout: the reservation stands.)
            Ok(Ok(_)) | Err(_) => {
                count(operation, WAIT_TIMED_OUT);
                return reserved;
            }
            Ok(Err(error)) => {
                count(operation, WAIT_FAILED);
                tracing::warn!(%error, "could not wait for the request in flight");
                return reserved;
            }
        }
    }
}

/// Tells the waiters of `key` that the layer is done with it (completed, released or parked):
/// those of this process at once, those of other processes through
/// [`CompletionSignal::notify_settled`], sent in the background.
pub(crate) fn announce<S: Store>(
    store: &S,
    wait: &InFlightWait<S>,
    waiters: &Waiters,
    key: IdempotencyKey,
) {
    waiters.wake(&key);
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let (store, signal) = (store.clone(), wait.signal.clone());
        runtime.spawn(async move {
            if let Err(error) = signal.notify_settled(&store, &key).await {
                tracing::debug!(%error, "could not notify the waiters of other processes; they poll");
            }
        });
    }
}

/// The requests of this process waiting for a key in flight, by key.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    keys: Mutex<HashMap<IdempotencyKey, (Arc<Notify>, usize)>>,
}

/// One waiter's registration; removed on drop.
struct Waiting<'w> {
    waiters: &'w Waiters,
    key: IdempotencyKey,
    notify: Arc<Notify>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut keys = self
            .waiters
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, count)) = keys.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

impl Waiters {
    fn subscribe(&self, key: &IdempotencyKey) -> Waiting<'_> {
        let mut keys = self
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = keys
            .entry(key.clone())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Waiting {
            waiters: self,
            key: key.clone(),
            notify: entry.0.clone(),
        }
    }

    fn wake(&self, key: &IdempotencyKey) {
        let keys = self
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((notify, _)) = keys.get(key) {
            notify.notify_waiters();
        }
    }
}

/// How many recent executions per operation the estimate is the median of.
const SAMPLES: usize = 16;

/// How long each operation's executions take: the last [`SAMPLES`] durations per operation name.
#[derive(Debug, Default)]
pub(crate) struct Estimates {
    micros: Mutex<HashMap<String, Samples>>,
}

#[derive(Debug, Default)]
struct Samples {
    last: Vec<u64>,
    next: usize,
}

impl Samples {
    fn add(&mut self, micros: u64) {
        if self.last.len() < SAMPLES {
            self.last.push(micros);
        } else {
            self.last[self.next] = micros;
        }
        self.next = (self.next + 1) % SAMPLES;
    }

    fn median(&self) -> Option<u64> {
        let mut sorted = self.last.clone();
        sorted.sort_unstable();
        sorted.get(sorted.len() / 2).copied()
    }
}

impl Estimates {
    /// Adds one execution of `operation` that took `took`.
    pub(crate) fn record(&self, operation: &str, took: Duration) {
        let took = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let Ok(mut micros) = self.micros.lock() else {
            return;
        };
        match micros.get_mut(operation) {
            Some(samples) => samples.add(took),
            None => {
                let mut samples = Samples::default();
                samples.add(took);
                micros.insert(operation.to_owned(), samples);
            }
        }
    }

    /// The hint for a duplicate of `operation`: the estimate, within [`MIN_HINT`] and the
    /// engine's `ceiling`.
    pub(crate) fn hint(&self, operation: &str, ceiling: Duration) -> Duration {
        let estimate = self
            .micros
            .lock()
            .ok()
            .and_then(|micros| micros.get(operation).and_then(Samples::median))
            .map(Duration::from_micros);
        match estimate {
            Some(estimate) => estimate.max(MIN_HINT).min(ceiling),
            None => ceiling,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hint_is_the_median_within_bounds() {
        let estimates = Estimates::default();
        let ceiling = Duration::from_secs(1);
        assert_eq!(estimates.hint("purchase", ceiling), ceiling);
        estimates.record("purchase", Duration::from_millis(700));
        assert_eq!(
            estimates.hint("purchase", ceiling),
            Duration::from_millis(700)
        );
        // A cold first execution is outvoted by the next two.
        estimates.record("purchase", Duration::from_millis(50));
        estimates.record("purchase", Duration::from_millis(60));
        assert_eq!(
            estimates.hint("purchase", ceiling),
            Duration::from_millis(60)
        );
        for _ in 0..SAMPLES {
            estimates.record("purchase", Duration::from_millis(40));
        }
        assert_eq!(
            estimates.hint("purchase", ceiling),
            Duration::from_millis(40)
        );
        estimates.record("transfer", Duration::from_millis(2));
        assert_eq!(estimates.hint("transfer", ceiling), MIN_HINT);
        estimates.record("report", Duration::from_secs(30));
        assert_eq!(estimates.hint("report", ceiling), ceiling);
    }
}
