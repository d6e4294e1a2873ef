//! The `idempotency_requests_total{operation, outcome}` counter, through the `metrics` facade.
//!
//! `operation` is the key's operation (by default `METHOD /route/{template}`, so its values are
//! as few as the routes).
//!
//! Install any `metrics` recorder (Prometheus exporter …) to collect it. It counts HTTP answers,
//! including those the engine never sees (400, 401, 413, 503); the engine's own counters and
//! gauges, per attempt whatever the transport, are those of
//! [`idempotency::maintenance::signals`]. Outcomes:
//!
//! | outcome | meaning |
//! |---|---|
//! | `executed` | the handler ran and its response was stored with its transaction |
//! | `replayed` | a stored response was sent again |
//! | `conflict` | 409: in progress, needs review, or lease lost |
//! | `reused` | 422: key reused with a different request |
//! | `released` | the handler answered 5xx (or unstored), panicked or was cancelled; the key was released |
//! | `left_pending` | external work answered unstored, panicked or was cancelled: its outside effect may have happened, so the key was not released; the recovery job settles it |
//! | `parked` | an unstored response for which the route decided to park the key as *needs review* |
//! | `rejected` | 400/401/413 before anything was reserved |
//! | `unavailable` | 503: the store could not be reached; the handler did not run |
//! | `failed` | 500: an internal failure of the layer |
//! | `unprotected` | optional key absent: the handler ran without protection |
//! | `settled_by_handler` | a handler that took the [`KeyLease`](crate::KeyLease) answered other than 2xx (a durable operation settled as failed, pending or parked) |

/// The counter's name.
///
/// ```
/// assert_eq!(idempotency_http::metrics::REQUESTS_TOTAL, "idempotency_requests_total");
/// ```
pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
/// See the module table.
pub const EXECUTED: &str = "executed";
/// See the module table.
pub const REPLAYED: &str = "replayed";
/// See the module table.
pub const CONFLICT: &str = "conflict";
/// See the module table.
pub const REUSED: &str = "reused";
/// See the module table.
pub const RELEASED: &str = "released";
/// See the module table.
pub const PARKED: &str = "parked";
/// See the module table.
pub const LEFT_PENDING: &str = "left_pending";
/// See the module table.
pub const REJECTED: &str = "rejected";
/// See the module table.
pub const UNAVAILABLE: &str = "unavailable";
/// See the module table.
pub const FAILED: &str = "failed";
/// See the module table.
pub const UNPROTECTED: &str = "unprotected";
/// See the module table.
pub const SETTLED_BY_HANDLER: &str = "settled_by_handler";

/// Counts one request (through the core's counting, which allocates nothing per count).
pub(crate) fn count(operation: &str, outcome: &'static str) {
    idempotency::maintenance::signals::count(REQUESTS_TOTAL, operation, outcome);
}
