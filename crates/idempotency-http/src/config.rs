//! What one [`IdempotencyLayer`](crate::IdempotencyLayer) is configured with (its builder fills
//! in a [`Config`], its services read it, never change it), the runtime [`State`] its services
//! share, and the small public types that name settings.

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

/// The scope of a request (whose key space: a user, a tenant), in the request extensions.
///
/// An auth layer puts it there for the layer's default scope source to read. The layer then
/// puts the scope the key is kept under back into the extensions of a protected request, from
/// whichever source it came ([`with_scope_from`](crate::IdempotencyLayer::with_scope_from),
/// [`MissingScope::Fixed`]), so that a handler can read it with
/// `Extension<IdempotencyScope>`.
///
/// ```
/// use axum::{body::Body, Extension};
/// use http::{Request, Response};
/// use idempotency_http::{IdempotencyLayer, IdempotencyScope, MissingScope};
/// use tower::{Layer, ServiceExt};
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let dir = tempfile::tempdir().unwrap();
/// let store = idempotency::SqliteStore::connect(&format!("sqlite://{}/keys.db", dir.path().display())).await.unwrap();
/// idempotency::Store::migrate(&store).await.unwrap();
/// let handler = axum::routing::post(|Extension(IdempotencyScope(scope)): Extension<IdempotencyScope>| async move {
///     format!("kept under {scope}")
/// });
/// let service = IdempotencyLayer::new(idempotency::Idempotency::new(store))
///     .with_missing_scope(MissingScope::Fixed("everyone".into()))
///     .layer(handler.with_state(()));
/// let request = Request::post("/").header("idempotency-key", "k-1").body(Body::empty()).unwrap();
/// let response = service.oneshot(request).await.unwrap();
/// let body = http_body_util::BodyExt::collect(response.into_body()).await.unwrap().to_bytes();
/// assert_eq!(&body[..], b"kept under everyone");
/// # });
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

/// The layer's configuration: filled in by the builder, then shared read-only behind an `Arc` by
/// every service the layer makes.
#[derive(Clone)]
pub(crate) struct Config<S> {
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
    /// The base of the problem `type` URIs (default
    /// [`DEFAULT_PROBLEM_BASE`](idempotency_wire::DEFAULT_PROBLEM_BASE)).
    pub(crate) problem_base: Arc<str>,
    pub(crate) detach: bool,
    pub(crate) wait_for_in_flight: Option<crate::in_flight::InFlightWait<S>>,
}

/// What the services of one layer learn and share while they run.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// How long executions take, per operation, for the 409's retry hint.
    pub(crate) estimates: Estimates,
    /// The requests waiting for a key in flight.
    pub(crate) waiters: Waiters,
}
