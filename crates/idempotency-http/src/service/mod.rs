//! [`IdempotencyService`]: the protocol of the article, per request.
//!
//! Read [`route`] then [`protect`] top to bottom: parse the key, find the scope, read and
//! fingerprint the body ([`body`]), **reserve** the key ([`reserve`]), **run** the handler with
//! the business transaction in the request extensions ([`run`]), then **complete** the key with
//! the stored response in that transaction ([`complete`]), or **release** it on 5xx, panic or
//! cancellation ([`held`]). Refusals and replays are [`answer`]'s.

mod answer;
mod body;
mod complete;
mod future;
mod handler;
mod held;
mod reserve;
mod run;

pub use future::ResponseFuture;

use crate::{
    config::{Config, KeyRequirement, MissingScope, State},
    error::{BoxError, IdempotencyRejection, InternalError},
    header::key_from_headers,
    metrics::{self, count},
};
use answer::refuse;
use axum::body::Body;
use bytes::Bytes;
use handler::Handler;
use http::{request::Parts, Request, Response};
use idempotency::{Attempt, Store};
use std::{
    sync::Arc,
    task::{Context, Poll},
};
use tower::Service;
use tracing::Instrument;

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer); see there.
///
/// It accepts any request body and hands the inner service a `Request<axum::body::Body>` (the
/// body is read once for the fingerprint, then replayed to the handler), so it wraps plain tower
/// services as well as axum routes:
///
/// ```
/// use axum::body::Body;
/// use http::{Request, Response};
/// use idempotency::{SqliteStore, Store, Idempotency};
/// use idempotency_http::{IdempotencyLayer, MissingScope};
/// use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
/// use tower::{Layer, ServiceExt};
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let dir = tempfile::tempdir().unwrap();
/// let store = SqliteStore::connect(&format!("sqlite://{}/keys.db", dir.path().display())).await.unwrap();
/// store.migrate().await.unwrap();
/// let runs = Arc::new(AtomicUsize::new(0));
/// let counter = runs.clone();
/// let handler = tower::service_fn(move |_: Request<Body>| {
///     let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
///     async move { Ok::<_, std::convert::Infallible>(Response::new(Body::from(format!("run {n}")))) }
/// });
/// let service = IdempotencyLayer::new(Idempotency::new(store))
///     .with_missing_scope(MissingScope::Fixed("everyone".into()))
///     .layer(handler);
/// for _ in 0..3 {
///     let request = Request::post("/jobs").header("idempotency-key", "job-1").body(Body::from("x")).unwrap();
///     let response = service.clone().oneshot(request).await.unwrap();
///     let body = http_body_util::BodyExt::collect(response.into_body()).await.unwrap().to_bytes();
///     assert_eq!(&body[..], b"run 1");
/// }
/// assert_eq!(runs.load(Ordering::SeqCst), 1);
/// # });
/// ```
#[derive(Clone)]
pub struct IdempotencyService<S, Inner> {
    inner: Inner,
    config: Arc<Config<S>>,
    state: Arc<State>,
}

impl<S, Inner: std::fmt::Debug> std::fmt::Debug for IdempotencyService<S, Inner> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, Inner> IdempotencyService<S, Inner> {
    pub(crate) fn new(config: Arc<Config<S>>, state: Arc<State>, inner: Inner) -> Self {
        Self {
            inner,
            config,
            state,
        }
    }

    /// The inner service.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use tower::Layer;
    /// let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let mut service = layer.layer(tower::service_fn(|_: http::Request<axum::body::Body>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// }));
    /// let _inner = service.get_ref();
    /// let _inner = service.get_mut();
    /// let _inner = service.into_inner();
    /// # });
    /// ```
    pub fn get_ref(&self) -> &Inner {
        &self.inner
    }

    /// The inner service, mutably (see [`get_ref`](Self::get_ref)).
    pub fn get_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }

    /// The inner service, by value (see [`get_ref`](Self::get_ref)).
    pub fn into_inner(self) -> Inner {
        self.inner
    }
}

impl<S, Inner, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S, Inner>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Inner::Error;
    type Future = ResponseFuture<Inner::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; a clone takes its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = Layered {
            config: self.config.clone(),
            state: self.state.clone(),
        };
        ResponseFuture::new(route(layer, inner, request.map(Body::new)))
    }
}

/// What every step of a request reads: the layer's configuration and its shared state.
#[derive(Clone)]
pub(crate) struct Layered<S> {
    config: Arc<Config<S>>,
    state: Arc<State>,
}

/// Decides whether the request is protected (its method, its key, its scope), then runs it.
async fn route<S: Store, H: Handler>(
    layer: Layered<S>,
    inner: H,
    request: Request<Body>,
) -> Result<Response<Body>, H::Error> {
    let config = &layer.config;
    let (mut parts, body) = request.into_parts();
    if !config.methods.contains(&parts.method) {
        return run::unprotected(config, inner, parts, body).await;
    }
    let operation = body::operation_name(&config.operation, &parts);
    let refused = |rejection| Ok(refuse(&config.problem_base, &operation, rejection));
    let client_key = match key_from_headers(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if config.key_requirement == KeyRequirement::Required => {
            return refused(IdempotencyRejection::KeyMissing)
        }
        Ok(None) => {
            count(&operation, metrics::UNPROTECTED);
            return run::unprotected(config, inner, parts, body).await;
        }
        Err(invalid) => return refused(invalid.into()),
    };
    // An empty scope is no scope.
    let found = (config.scope)(&parts).filter(|scope| !scope.is_empty());
    let scope = match (found, &config.missing_scope) {
        (Some(scope), _) => scope,
        (None, MissingScope::Fixed(scope)) => scope.clone(),
        (None, _) => return refused(IdempotencyRejection::ScopeMissing),
    };
    // The scope the key is kept under, for the handler to read back.
    parts
        .extensions
        .insert(crate::IdempotencyScope(scope.clone()));
    let span = tracing::info_span!("idempotency", %scope, %operation, method = %parts.method);
    let call = KeyedCall {
        layer: layer.clone(),
        inner,
        parts,
        body: Bytes::new(),
        operation,
    };
    protect(call, body, client_key, scope)
        .instrument(span)
        .await
}

/// One keyed request on its way through the layer: what every step after the key check needs
/// (its body is read by [`protect`]).
pub(crate) struct KeyedCall<S, H> {
    layer: Layered<S>,
    inner: H,
    parts: Parts,
    body: Bytes,
    operation: String,
}

/// Reserve → run → complete | release, for one keyed request.
async fn protect<S: Store, H: Handler>(
    mut call: KeyedCall<S, H>,
    body: Body,
    client_key: String,
    scope: String,
) -> Result<Response<Body>, H::Error> {
    // 1. Read and fingerprint the body (400, 413 here); nothing is reserved before this.
    let attempt = match body::prepare(&mut call, body, client_key, scope).await {
        Ok(attempt) => attempt,
        Err(refused) => return Ok(refused),
    };
    if call.layer.config.detach {
        // The same steps, in a task of their own that finishes whatever the client does.
        return detached(call, attempt).await;
    }
    // 2. Reserve the key, committed on its own (a replay is read first); a duplicate of a
    //    request in flight may wait for it (`wait_for_in_flight`).
    let engine = &call.layer.config.idempotency;
    let reserved = reserve::key(&call.layer, &call.operation, engine, &attempt).await;
    // 3. Run the handler for an acquired key and complete (or release) it; replay a completed
    //    one; refuse the rest (422, 409, 503).
    run::proceed(call, attempt, reserved).await
}

/// [`protect`] for a detached layer: a replay is answered here, without a task; the rest runs
/// in a task of its own, which finishes whatever the client does.
async fn detached<S: Store, H: Handler>(
    call: KeyedCall<S, H>,
    attempt: Attempt,
) -> Result<Response<Body>, H::Error> {
    let (layer, operation) = (call.layer.clone(), call.operation.clone());
    let config = &layer.config;
    let engine = &config.idempotency;
    if engine.replays_first() {
        match engine.replay(&attempt).await {
            Ok(Some(bytes)) => {
                return Ok(answer::replay(config, attempt.key(), &operation, &bytes))
            }
            Ok(None) => {}
            Err(error) => {
                let rejection = IdempotencyRejection::from_engine(error);
                return Ok(refuse(&config.problem_base, &operation, rejection));
            }
        }
    }
    let engine = engine.clone().with_replay_first(false);
    let work = async move {
        let reserved = reserve::key(&call.layer, &call.operation, &engine, &attempt).await;
        run::proceed(call, attempt, reserved).await
    };
    match tokio::spawn(work.in_current_span()).await {
        Ok(answer) => answer,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Ok(refuse(
            &config.problem_base,
            &operation,
            InternalError::TaskEnded(error).into(),
        )),
    }
}
