//! [`KeyLease`]: the key's reservation, taken by a handler that settles the key itself, as a
//! durable operation does ([`Idempotency::perform_reserved`](idempotency::Idempotency::perform_reserved)).
//!
//! The layer reserves the key, answers replays, 422 and 409 as usual, and puts the lease into the
//! request extensions. A handler that extracts [`KeyLease`] owns it from then on: the layer stores
//! nothing and releases nothing after such a handler; the operation completes the key with its own
//! response (which must be a [`StoredResponse`](crate::StoredResponse), the form replays are read
//! in), leaves it pending for the resumer, or parks it.
//!
//! Reserve such routes with [`Effects::External`](idempotency::Effects::External): a durable
//! operation's key must never be taken over as abandoned local work.

use crate::problem::Problem;
use axum::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::request::Parts;
use idempotency::{Lease, Store};
use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
use std::sync::{Arc, Mutex};

/// Where the layer keeps the lease while the handler runs.
pub(crate) struct LeaseSlot<S: Store>(Arc<Mutex<Option<Lease<S>>>>);

impl<S: Store> Clone for LeaseSlot<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S: Store> LeaseSlot<S> {
    pub(crate) fn new(lease: Lease<S>) -> Self {
        Self(Arc::new(Mutex::new(Some(lease))))
    }

    /// Whether the lease is still in the slot.
    pub(crate) fn holds(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Whether the lease in the slot reserved its key inside the business transaction
    /// ([`Lease::is_in_transaction`]); `false` once taken.
    pub(crate) fn is_in_transaction(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(Lease::is_in_transaction)
    }

    /// The lease, if no handler took it.
    pub(crate) fn take(&self) -> Option<Lease<S>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The reservation of the request's key, for a handler that settles the key itself.
///
/// Extracting it takes nothing yet: [`take`](Self::take) the lease once the request is known to
/// be acceptable. A handler that never takes it is treated like any other (its response is
/// stored, or the key released).
///
/// ```no_run
/// use idempotency::{SqliteStore, Idempotency, durable::{PerformError, Operation}};
/// use idempotency_http::{KeyLease, Problem, StoredResponse};
/// use idempotency_http::wire::{ProblemType, DEFAULT_PROBLEM_BASE};
///
/// async fn purchase<O>(engine: Idempotency<SqliteStore>, operation: O, lease: KeyLease<SqliteStore>, request: O::Request) -> Result<StoredResponse, Problem>
/// where
///     O: Operation<SqliteStore, Response = StoredResponse>,
/// {
///     let internal = || Problem::of(ProblemType::Internal, DEFAULT_PROBLEM_BASE);
///     let lease = lease.take().ok_or_else(internal)?;
///     let finished = engine
///         .perform_reserved(&operation, lease, &request)
///         .await
///         .map_err(|error: PerformError| internal().with_detail(error.to_string()))?;
///     Ok(finished.into())
/// }
/// ```
pub struct KeyLease<S: Store>(LeaseSlot<S>);

impl<S: Store> std::fmt::Debug for KeyLease<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyLease").finish_non_exhaustive()
    }
}

impl<S: Store> KeyLease<S> {
    /// The lease, to hand to the operation: from then on the handler settles the key. `None`
    /// if it was taken already.
    pub fn take(&self) -> Option<Lease<S>> {
        self.0.take()
    }
}

/// Why [`KeyLease`] could not be extracted: the route has no [`IdempotencyLayer`](crate::IdempotencyLayer)
/// for this store, the request ran unprotected, or the lease was taken already.
///
/// ```
/// use axum::response::IntoResponse;
/// assert_eq!(idempotency_http::LeaseRejection.into_response().status(), 500);
/// ```
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no idempotency key is held for this request (no layer, an unprotected request, or the lease was taken twice)")]
pub struct LeaseRejection;

impl IntoResponse for LeaseRejection {
    fn into_response(self) -> Response {
        Problem::of(ProblemType::Internal, DEFAULT_PROBLEM_BASE)
            .with_detail(self.to_string())
            .into_response()
    }
}

impl<S: Store, AppState: Send + Sync> FromRequestParts<AppState> for KeyLease<S> {
    type Rejection = LeaseRejection;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<LeaseSlot<S>>()
            .filter(|slot| slot.holds())
            .cloned()
            .map(KeyLease)
            .ok_or(LeaseRejection)
    }
}
