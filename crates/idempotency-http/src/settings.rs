//! What one [`IdempotencyLayer`](crate::IdempotencyLayer) is configured with: the settings its
//! builder fills in and its service reads, and the small types that name them.

use crate::in_flight::{Estimates, Waiters};
use http::{request::Parts, HeaderName, Method, StatusCode};
use idempotency::{Disposition, Effects, Idempotency};
use std::sync::Arc;

/// Default largest request body read for fingerprinting: 1 MiB.
///
/// ```
/// assert_eq!(idempotency_http::DEFAULT_BODY_LIMIT, 1 << 20);
/// ```
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// Whether a protected route needs an `Idempotency-Key`.
///
/// ```
/// use idempotency_http::KeyRequirement;
/// assert_eq!(KeyRequirement::default(), KeyRequirement::Required);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// A request without the header is refused with 400 (`key-missing`).
    #[default]
    Required,
    /// A request without the header runs unprotected (as if the layer were not there).
    Optional,
}

/// What to do when the scope source finds no scope (no authenticated user) for a request.
///
/// ```
/// use idempotency_http::MissingScope;
/// let shared = MissingScope::Fixed("anonymous".into());
/// assert_ne!(shared, MissingScope::Reject);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingScope {
    /// Refuse with 401 (`scope-missing`).
    #[default]
    Reject,
    /// Use this scope for every request without one (all such clients share one key space).
    Fixed(String),
}

/// The scope of a request, for auth layers to put into the request extensions; the layer's
/// default scope source reads it.
///
/// ```
/// use idempotency_http::IdempotencyScope;
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(IdempotencyScope("user-42".into()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyScope(pub String);

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type OperationFn = dyn Fn(&Parts) -> String + Send + Sync;
type DispositionByStatus = dyn Fn(StatusCode) -> Option<Disposition> + Send + Sync;

#[derive(Clone)]
pub(crate) enum OperationSource {
    /// `METHOD /matched/{template}` (or the literal path without a [`axum::extract::MatchedPath`]).
    MethodAndRoute,
    Fixed(String),
    Custom(Arc<OperationFn>),
}

/// Everything the service needs; shared behind an `Arc`.
pub(crate) struct Settings<S> {
    pub(crate) idempotency: Idempotency<S>,
    pub(crate) methods: Vec<Method>,
    pub(crate) key_requirement: KeyRequirement,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) missing_scope: MissingScope,
    pub(crate) operation: OperationSource,
    pub(crate) effects: Effects,
    pub(crate) journaled: bool,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) body_limit: usize,
    /// The key's disposition after a response whose handler gave none; `None` from it: the
    /// default by effects (release local work, leave external work pending).
    pub(crate) disposition_by_status: Arc<DispositionByStatus>,
    pub(crate) retention_header: bool,
    /// The header marking a replayed response (default `Idempotent-Replayed`).
    pub(crate) replay_header: HeaderName,
    /// The base of the problem `type` URIs (default [`crate::DEFAULT_PROBLEM_BASE`]).
    pub(crate) problem_base: Arc<str>,
    pub(crate) detach: bool,
    pub(crate) wait_for_in_flight: Option<crate::in_flight::InFlightWait<S>>,
    /// How long executions take, per operation, for the 409's retry hint; shared by clones.
    pub(crate) estimates: Arc<Estimates>,
    /// The requests waiting for a key in flight; shared by clones.
    pub(crate) waiters: Arc<Waiters>,
}

impl<S: Clone> Clone for Settings<S> {
    fn clone(&self) -> Self {
        Self {
            idempotency: self.idempotency.clone(),
            methods: self.methods.clone(),
            key_requirement: self.key_requirement,
            scope: self.scope.clone(),
            missing_scope: self.missing_scope.clone(),
            operation: self.operation.clone(),
            effects: self.effects,
            journaled: self.journaled,
            fingerprint_headers: self.fingerprint_headers.clone(),
            stored_headers: self.stored_headers.clone(),
            body_limit: self.body_limit,
            disposition_by_status: self.disposition_by_status.clone(),
            retention_header: self.retention_header,
            replay_header: self.replay_header.clone(),
            problem_base: self.problem_base.clone(),
            detach: self.detach,
            wait_for_in_flight: self.wait_for_in_flight.clone(),
            estimates: self.estimates.clone(),
            waiters: self.waiters.clone(),
        }
    }
}
