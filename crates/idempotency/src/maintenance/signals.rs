//! The signals to alert on: the names of the metrics the engine and the maintenance worker
//! export through the [`metrics`](https://docs.rs/metrics) facade, and of the `tracing` spans
//! of each phase of the protocol. The names are stable: dashboards and alert rules may use them.
//!
//! Install any `metrics` recorder (a Prometheus exporter …) to collect the metrics; without one
//! they cost a lookup and no allocation. Spans are at `debug` level under the target
//! `idempotency` (enable `idempotency=debug` in the subscriber's filter to see them; at a level
//! the subscriber disables they cost next to nothing).
//!
//! # Metrics
//!
//! | name | kind | labels | what it counts or holds |
//! |---|---|---|---|
//! | [`OUTCOMES_TOTAL`] | counter | `operation`, `outcome` | one per protocol outcome of an attempt (table below) |
//! | [`STEPS_TOTAL`] | counter | `operation`, `outcome` | one per durable step event (table below) |
//! | [`RECOVERED_TOTAL`] | counter | `operation`, `outcome` | one per key the recovery job acted on (table below) |
//! | [`KEYS`] | gauge | `operation`, `state` | rows by operation and state (`pending`, `completed`, `failed`, `needs_review`) |
//! | [`NEEDS_REVIEW`] | gauge | | rows parked for review, over all operations |
//! | [`OLDEST_PENDING_SECONDS`] | gauge | | age of the oldest pending row, by the database clock (0 when none) |
//! | [`PAST_LEASE`] | gauge | | pending rows whose lease has ended: holders that went away, waiting for a retry or the recovery job |
//!
//! The gauges are set by the maintenance worker from
//! [`Maintenance::stats`](crate::store::Maintenance::stats) (see
//! [`MaintenanceWorker::with_stats_interval`](crate::maintenance::MaintenanceWorker::with_stats_interval)).
//!
//! `outcome` of [`OUTCOMES_TOTAL`]:
//!
//! | value | meaning |
//! |---|---|
//! | [`EXECUTED`] | the work ran and the key was completed with its result, in its transaction |
//! | [`REPLAYED`] | a stored result was answered again |
//! | [`CONFLICT`] | the key is held by a live holder (in progress; HTTP 409) |
//! | [`MISMATCH`] | the key was reused with another request (HTTP 422) |
//! | [`NEEDS_REVIEW_OUTCOME`] | the key is parked for review; refused until an operator resolves it |
//! | [`RELEASED`] | the work failed (or was cancelled) with nothing sent out: the key was released for a retry |
//! | [`PARKED`] | the key was parked as *needs review* |
//! | [`LEASE_LOST`] | the holder's lease was taken by another holder: its completion was refused |
//! | [`LEFT_PENDING`] | external work ended without an answer: the key stays pending for the recovery job |
//!
//! `outcome` of [`STEPS_TOTAL`]:
//!
//! | value | meaning |
//! |---|---|
//! | [`STEP_COMMITTED`] | a local step committed its recovery point |
//! | [`CALL_ANSWERED`] | an outside call (or the provider's lookup) answered |
//! | [`CALL_UNKNOWN`] | an outside call's outcome is unknown (the provider will be asked) |
//! | [`CALL_FAILED`] | the provider declined, or did not do it after every call allowed |
//! | [`SETTLED_COMPLETED`] | the operation finished: its key completed with the response |
//! | [`SETTLED_FAILED`] | the operation failed definitively: its key completed with the failure |
//! | [`PARKED`] | the operation was parked for review |
//! | [`LEFT_PENDING`] | the operation stopped with an unknown outcome: pending for the resumer |
//!
//! `outcome` of [`RECOVERED_TOTAL`]: [`RELEASED`] (nothing went out), [`SETTLED_COMPLETED`],
//! [`SETTLED_FAILED`], [`PARKED`], [`UNKNOWN`] (still pending; asked again later) and
//! [`SKIPPED`] (another holder took the key first).
//!
//! # Spans
//!
//! | span | fields | the phase |
//! |---|---|---|
//! | [`SPAN_RESERVE`] | `scope`, `operation`, `outcome` | the reservation (its own commit), or the replay read before it |
//! | [`SPAN_WORK`] | `scope`, `operation`, `outcome` | the work in the business transaction ([`Idempotency::run`](crate::Idempotency::run)) |
//! | [`SPAN_COMPLETE`] | `scope`, `operation`, `outcome` | the key's completion and the commit of the transaction |
//! | [`SPAN_RELEASE`] | `scope`, `operation`, `outcome` | the release of a key whose work failed |
//! | [`SPAN_REPLAY`] | `scope`, `operation` | a stored result answered again |
//! | [`SPAN_WAIT`] | `scope`, `operation`, `outcome` | a duplicate waiting for the request in flight (HTTP layer) |
//! | [`SPAN_STEP`] | `scope`, `operation`, `step`, `outcome` | one durable step (`finish` and `fail` are steps too) |
//! | [`SPAN_CALL`] | `scope`, `operation`, `step`, `provider_key`, `outcome` | one outside call of a durable step |
//!
//! `outcome` is recorded when known, with the values of the metrics' tables (for the
//! reservation also `acquired`). The request itself is never recorded.
//!
//! ```
//! use idempotency::maintenance::signals;
//! assert_eq!(signals::OUTCOMES_TOTAL, "idempotency_outcomes_total");
//! assert_eq!(signals::SPAN_RESERVE, "idempotency.reserve");
//! ```

use metrics::{Key, Label, Level, Metadata};
use std::{
    collections::HashMap,
    sync::{OnceLock, RwLock},
};

/// Counter: protocol outcomes, labels `operation` and `outcome`.
pub const OUTCOMES_TOTAL: &str = "idempotency_outcomes_total";
/// Counter: durable step events, labels `operation` and `outcome`.
pub const STEPS_TOTAL: &str = "idempotency_steps_total";
/// Counter: what the recovery job did, labels `operation` and `outcome`.
pub const RECOVERED_TOTAL: &str = "idempotency_recovered_total";
/// Gauge: rows by `operation` and `state`.
pub const KEYS: &str = "idempotency_keys";
/// Gauge: rows parked for review.
pub const NEEDS_REVIEW: &str = "idempotency_keys_needs_review";
/// Gauge: age in seconds of the oldest pending row (0 when none).
pub const OLDEST_PENDING_SECONDS: &str = "idempotency_oldest_pending_seconds";
/// Gauge: pending rows whose lease has ended.
pub const PAST_LEASE: &str = "idempotency_keys_past_lease";

/// Label: the key's operation.
pub const LABEL_OPERATION: &str = "operation";
/// Label: the outcome (see the module's tables).
pub const LABEL_OUTCOME: &str = "outcome";
/// Label: a key state (`pending`, `completed`, `failed`, `needs_review`).
pub const LABEL_STATE: &str = "state";

/// Outcome: see the module's tables.
pub const EXECUTED: &str = "executed";
/// Outcome: see the module's tables.
pub const REPLAYED: &str = "replayed";
/// Outcome: see the module's tables.
pub const CONFLICT: &str = "conflict";
/// Outcome: see the module's tables.
pub const MISMATCH: &str = "mismatch";
/// Outcome: see the module's tables.
pub const NEEDS_REVIEW_OUTCOME: &str = "needs_review";
/// Outcome: see the module's tables.
pub const RELEASED: &str = "released";
/// Outcome: see the module's tables.
pub const PARKED: &str = "parked";
/// Outcome: see the module's tables.
pub const LEASE_LOST: &str = "lease_lost";
/// Outcome: see the module's tables.
pub const LEFT_PENDING: &str = "left_pending";
/// Outcome of a reservation span: the key is ours.
pub const ACQUIRED: &str = "acquired";
/// Outcome of a span whose phase failed with an error of the store or the work.
pub const ERROR: &str = "error";
/// Outcome: see the module's tables.
pub const STEP_COMMITTED: &str = "step_committed";
/// Outcome: see the module's tables.
pub const CALL_ANSWERED: &str = "call_answered";
/// Outcome: see the module's tables.
pub const CALL_UNKNOWN: &str = "call_unknown";
/// Outcome: see the module's tables.
pub const CALL_FAILED: &str = "call_failed";
/// Outcome: see the module's tables.
pub const SETTLED_COMPLETED: &str = "settled_completed";
/// Outcome: see the module's tables.
pub const SETTLED_FAILED: &str = "settled_failed";
/// Outcome: see the module's tables.
pub const UNKNOWN: &str = "unknown";
/// Outcome: see the module's tables.
pub const SKIPPED: &str = "skipped";

/// Span: see the module's table.
pub const SPAN_RESERVE: &str = "idempotency.reserve";
/// Span: see the module's table.
pub const SPAN_WORK: &str = "idempotency.work";
/// Span: see the module's table.
pub const SPAN_COMPLETE: &str = "idempotency.complete";
/// Span: see the module's table.
pub const SPAN_RELEASE: &str = "idempotency.release";
/// Span: see the module's table.
pub const SPAN_REPLAY: &str = "idempotency.replay";
/// Span: see the module's table.
pub const SPAN_WAIT: &str = "idempotency.wait";
/// Span: see the module's table.
pub const SPAN_STEP: &str = "idempotency.step";
/// Span: see the module's table.
pub const SPAN_CALL: &str = "idempotency.call";

/// Span field: the key's scope.
pub const FIELD_SCOPE: &str = "scope";
/// Span field: the key's operation.
pub const FIELD_OPERATION: &str = "operation";
/// Span field: the phase's outcome, recorded when known.
pub const FIELD_OUTCOME: &str = "outcome";
/// Span field: a durable step's name.
pub const FIELD_STEP: &str = "step";
/// Span field: the provider key of an outside call.
pub const FIELD_PROVIDER_KEY: &str = "provider_key";

/// At most this many distinct operations get a label of their own; later ones are counted
/// under [`OTHER_OPERATION`] (an operation is a route or a message type, so they are few; this
/// bounds the memory a misuse could take).
pub const MAX_OPERATIONS: usize = 1_000;
/// The `operation` label of operations beyond [`MAX_OPERATIONS`].
pub const OTHER_OPERATION: &str = "_other";

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// The label pairs of each `(operation, outcome)` seen, made once and kept for the process, so
/// that a count builds its metric key from static parts: no allocation per count, whatever
/// recorder is installed (or none).
type LabelSets = HashMap<Box<str>, Vec<(&'static str, &'static [Label])>>;

fn label_sets() -> &'static RwLock<LabelSets> {
    static SETS: OnceLock<RwLock<LabelSets>> = OnceLock::new();
    SETS.get_or_init(RwLock::default)
}

/// The static labels `operation`, `outcome` for these values.
fn labels(operation: &str, outcome: &'static str) -> &'static [Label] {
    {
        let sets = label_sets().read().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = sets.get(operation).and_then(|by_outcome| {
            by_outcome
                .iter()
                .find(|(o, _)| *o == outcome)
                .map(|(_, labels)| *labels)
        }) {
            return found;
        }
    }
    let mut sets = label_sets().write().unwrap_or_else(|e| e.into_inner());
    let operation = if sets.len() >= MAX_OPERATIONS && !sets.contains_key(operation) {
        OTHER_OPERATION
    } else {
        operation
    };
    let by_outcome = sets.entry(operation.into()).or_default();
    if let Some((_, labels)) = by_outcome.iter().find(|(o, _)| *o == outcome) {
        return labels;
    }
    let made: &'static [Label] = Box::leak(Box::new([
        Label::new(LABEL_OPERATION, operation.to_owned()),
        Label::from_static_parts(LABEL_OUTCOME, outcome),
    ]));
    by_outcome.push((outcome, made));
    made
}

/// Adds one to the counter `name{operation, outcome}` of the installed `metrics` recorder,
/// without allocating: the label set of each `(operation, outcome)` is made once, at its first
/// count, and kept for the process (at most [`MAX_OPERATIONS`] operations). For integrations
/// (an HTTP layer, a queue adapter) that count their own outcomes per operation.
///
/// ```
/// use idempotency::maintenance::signals;
/// signals::count("idempotency_requests_total", "POST /orders", signals::EXECUTED);
/// ```
pub fn count(name: &'static str, operation: &str, outcome: &'static str) {
    let key = Key::from_static_parts(name, labels(operation, outcome));
    metrics::with_recorder(|recorder| recorder.register_counter(&key, &METADATA)).increment(1);
}

/// Counts a protocol outcome ([`OUTCOMES_TOTAL`]).
pub(crate) fn outcome(operation: &str, outcome: &'static str) {
    count(OUTCOMES_TOTAL, operation, outcome);
}

/// Counts a durable step event ([`STEPS_TOTAL`]).
pub(crate) fn step(operation: &str, outcome: &'static str) {
    count(STEPS_TOTAL, operation, outcome);
}

/// A span of a protocol phase for `key`, with its `outcome` to be recorded.
macro_rules! phase_span {
    ($name:expr, $key:expr) => {
        ::tracing::debug_span!(
            $name,
            scope = $key.scope(),
            operation = $key.operation(),
            outcome = ::tracing::field::Empty,
        )
    };
}
pub(crate) use phase_span;

/// Records `outcome` on `span` (nothing when the span is disabled).
pub(crate) fn record(span: &tracing::Span, outcome: &'static str) {
    span.record(FIELD_OUTCOME, outcome);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        alloc::{GlobalAlloc, Layout, System},
        cell::Cell,
    };

    /// The system allocator, counting the allocations of a thread while it is told to.
    struct Counting;

    thread_local! {
        static COUNTING: Cell<bool> = const { Cell::new(false) };
        static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    }

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if COUNTING.with(Cell::get) {
                ALLOCATIONS.with(|n| n.set(n.get() + 1));
            }
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    fn allocations_of(f: impl FnOnce()) -> u64 {
        ALLOCATIONS.with(|n| n.set(0));
        COUNTING.with(|c| c.set(true));
        f();
        COUNTING.with(|c| c.set(false));
        ALLOCATIONS.with(Cell::get)
    }

    #[test]
    fn a_span_without_a_subscriber_allocates_nothing() {
        let key = crate::IdempotencyKey::new("user-1", "signals-span-op", "k-1").unwrap();
        let open = || {
            let span = phase_span!(SPAN_RESERVE, key);
            record(&span, ACQUIRED);
        };
        open();
        assert_eq!(allocations_of(open), 0);
    }

    #[test]
    fn a_count_without_a_recorder_allocates_nothing() {
        let operation = String::from("signals-alloc-op");
        // The first count of a pair makes its labels, once for the process.
        assert!(allocations_of(|| outcome(&operation, EXECUTED)) > 0);
        assert!(allocations_of(|| step(&operation, STEP_COMMITTED)) > 0);
        assert_eq!(
            allocations_of(|| {
                for _ in 0..1_000 {
                    outcome(&operation, EXECUTED);
                    step(&operation, STEP_COMMITTED);
                }
            }),
            0
        );
    }

    #[test]
    fn labels_are_made_once_per_pair() {
        let first = labels("signals-test-op", EXECUTED);
        let again = labels("signals-test-op", EXECUTED);
        assert!(std::ptr::eq(first, again));
        assert_eq!(first[0].value(), "signals-test-op");
        assert_eq!(first[1].value(), EXECUTED);
        let other = labels("signals-test-op", REPLAYED);
        assert!(!std::ptr::eq(first, other));
    }
}
