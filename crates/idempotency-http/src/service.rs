//! [`IdempotencyService`] and its [`ResponseFuture`]: the protocol of the article, per request.
//!
//! Read `protect` (in this file) top to bottom: parse the key, read and fingerprint the body, **reserve**,
//! **run** the handler with the business transaction in the request extensions, then **complete**
//! the key with the stored response in that transaction (or **release** it on 5xx, panic or
//! cancellation).

use crate::{
    commits_writes,
    error::{BoxError, IdempotencyRejection, InternalError},
    header::{key_from_headers, IDEMPOTENCY_KEY_RETENTION},
    in_flight,
    lease::LeaseSlot,
    metrics::{self, count},
    settings::{KeyRequirement, MissingScope, OperationSource, Settings},
    stored::StoredResponse,
    tx::{Returned, TxSlot},
    Disposition,
};
use axum::{body::Body, extract::MatchedPath};
use bytes::Bytes;
use futures_util::{future::BoxFuture, FutureExt};
use http::{header, request::Parts, HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency::{
    Attempt, Begun, Effects, Fingerprint, Idempotency, IdempotencyKey, Lease, Reservation, Store,
};
use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
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
pub struct IdempotencyService<S, Inner> {
    settings: Arc<Settings<S>>,
    inner: Inner,
}

impl<S, Inner: Clone> Clone for IdempotencyService<S, Inner> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<S, Inner: std::fmt::Debug> std::fmt::Debug for IdempotencyService<S, Inner> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, Inner> IdempotencyService<S, Inner> {
    pub(crate) fn new(settings: Arc<Settings<S>>, inner: Inner) -> Self {
        Self { settings, inner }
    }
}

/// The response future of [`IdempotencyService`]: the whole protocol of one request (see the
/// example on [`IdempotencyService`]). Dropping it before it completes (the client went away)
/// rolls back the handler's transaction and releases the key.
pub struct ResponseFuture<E> {
    inner: BoxFuture<'static, Result<Response<Body>, E>>,
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
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
        let settings = self.settings.clone();
        ResponseFuture {
            inner: Box::pin(route(settings, inner, request)),
        }
    }
}

/// Decides whether the request is protected, then runs it.
async fn route<S, Inner, ReqBody, ResBody>(
    settings: Arc<Settings<S>>,
    inner: Inner,
    request: Request<ReqBody>,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    if !settings.methods.contains(&parts.method) {
        return run_unprotected(&settings, inner, parts, Body::new(body)).await;
    }
    let operation = operation_name(&settings.operation, &parts);
    let client_key = match key_from_headers(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) => match settings.key_requirement {
            KeyRequirement::Required => {
                return Ok(refuse(
                    &settings.problem_base,
                    &operation,
                    IdempotencyRejection::KeyMissing,
                ))
            }
            KeyRequirement::Optional => {
                count(&operation, metrics::UNPROTECTED);
                return run_unprotected(&settings, inner, parts, Body::new(body)).await;
            }
        },
        Err(invalid) => return Ok(refuse(&settings.problem_base, &operation, invalid.into())),
    };
    // An empty scope is no scope.
    let found = (settings.scope)(&parts).filter(|scope| !scope.is_empty());
    let scope = match (found, &settings.missing_scope) {
        (Some(scope), _) => scope,
        (None, MissingScope::Fixed(scope)) => scope.clone(),
        (None, MissingScope::Reject) => {
            return Ok(refuse(
                &settings.problem_base,
                &operation,
                IdempotencyRejection::ScopeMissing,
            ))
        }
    };
    let span = tracing::info_span!("idempotency", %scope, %operation, method = %parts.method);
    protect(settings, inner, parts, body, client_key, scope, operation)
        .instrument(span)
        .await
}

/// Reserve → run → complete | release, for one protected request.
async fn protect<S, Inner, ReqBody, ResBody>(
    settings: Arc<Settings<S>>,
    inner: Inner,
    parts: Parts,
    body: ReqBody,
    client_key: String,
    scope: String,
    operation: String,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (attempt, body) =
        match prepare(&settings, &parts, body, client_key, scope, &operation).await {
            Ok(prepared) => prepared,
            Err(refused) => return Ok(refused),
        };
    let call = KeyedCall {
        settings,
        inner,
        parts,
        body,
        operation,
    };
    if call.settings.detach {
        return protect_detached(call, attempt).await;
    }
    // 1. Reserve the key, committed on its own (a replay is read first); a duplicate of a
    //    request in flight may wait for it (`wait_for_in_flight`).
    let reserved = reserve_key(
        &call.settings,
        &call.operation,
        &call.settings.idempotency,
        &attempt,
    )
    .await;
    proceed(call, attempt, reserved).await
}

/// The key reserved, and the business transaction when the reservation was written inside it.
type Reserved<S> = (
    Reservation<S>,
    Option<sqlx::Transaction<'static, <S as Store>::Database>>,
);

/// Step 1: the key reserved on its own commit, waiting for a duplicate's original as the layer
/// says; or, in the engine's single-transaction mode
/// ([`Idempotency::with_single_transaction`]), inside the business transaction, where the
/// database makes duplicates wait.
async fn reserve_key<S: Store>(
    settings: &Settings<S>,
    operation: &str,
    engine: &Idempotency<S>,
    attempt: &Attempt,
) -> Result<Reserved<S>, idempotency::Error> {
    if engine.single_transaction_wait(attempt).is_some() {
        return Ok(match engine.begin_reserved(attempt).await? {
            Begun::Acquired(lease, tx) => (Reservation::Acquired(lease), Some(tx)),
            Begun::Completed(bytes) => (Reservation::Completed(bytes), None),
        });
    }
    in_flight::reserve(
        engine,
        attempt,
        settings.wait_for_in_flight.as_ref(),
        &settings.waiters,
        operation,
    )
    .await
    .map(|reservation| (reservation, None))
}

/// One keyed request on its way through the layer, once its body was read: what every step after
/// the key check needs.
struct KeyedCall<S: Store, Inner> {
    settings: Arc<Settings<S>>,
    inner: Inner,
    parts: Parts,
    body: Bytes,
    operation: String,
}

/// What the request asks for: its key, and its fingerprint over the body read within the limit.
/// Nothing is reserved yet; a refusal (400, 413, 500) is the answer.
async fn prepare<S, ReqBody>(
    settings: &Settings<S>,
    parts: &Parts,
    body: ReqBody,
    client_key: String,
    scope: String,
    operation: &str,
) -> Result<(Attempt, Bytes), Response<Body>>
where
    S: Store,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
{
    let refused = |rejection| refuse(&settings.problem_base, operation, rejection);
    // The client key was validated with the header; only a bad scope or operation fails here.
    let key = IdempotencyKey::new(scope, operation, client_key)
        .map_err(|invalid| refused(InternalError::InvalidKey(invalid).into()))?;
    let body = read_body(body, &parts.headers, settings.body_limit)
        .await
        .map_err(refused)?;
    let fingerprint = fingerprint(parts, &settings.fingerprint_headers, &body).map_err(refused)?;
    let attempt = Attempt::new(key, fingerprint)
        .with_effects(settings.effects)
        .with_journaled(settings.journaled);
    Ok((attempt, body))
}

/// [`protect`] for a detached layer: a replay is answered here, without a task; the rest runs
/// in a task of its own, which finishes whatever the client does.
async fn protect_detached<S, Inner, ResBody>(
    call: KeyedCall<S, Inner>,
    attempt: Attempt,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (settings, operation) = (call.settings.clone(), call.operation.clone());
    let engine = &settings.idempotency;
    if engine.replays_first() {
        match engine.replay(&attempt).await {
            Ok(Some(bytes)) => return Ok(replay(&settings, &operation, &bytes)),
            Ok(None) => {}
            Err(error) => {
                return Ok(refuse(
                    &settings.problem_base,
                    &operation,
                    IdempotencyRejection::from_engine(error),
                ))
            }
        }
    }
    let engine = engine.clone().with_replay_first(false);
    let work = async move {
        let reserved = reserve_key(&call.settings, &call.operation, &engine, &attempt).await;
        proceed(call, attempt, reserved).await
    };
    match tokio::spawn(work.in_current_span()).await {
        Ok(answer) => answer,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => Ok(refuse(
            &settings.problem_base,
            &operation,
            InternalError::TaskEnded(error).into(),
        )),
    }
}

/// After the reservation: run the handler for an acquired key, replay a completed one, refuse
/// the rest (422, 409, 503).
async fn proceed<S, Inner, ResBody>(
    call: KeyedCall<S, Inner>,
    attempt: Attempt,
    reserved: Result<Reserved<S>, idempotency::Error>,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let reserved = match reserved {
        Ok((Reservation::Acquired(lease), tx)) => {
            // With waiting on, duplicates may wait for this key: tell them when it is settled
            // (a key reserved inside the transaction is waited for by the database).
            let announce = (call.settings.wait_for_in_flight.is_some()
                && !lease.is_in_transaction())
            .then(|| (attempt.key().clone(), call.settings.clone()));
            let answer = execute(call, attempt, lease, tx).await;
            if let Some((key, settings)) = announce {
                if let Some(wait) = &settings.wait_for_in_flight {
                    in_flight::announce(settings.idempotency.store(), wait, &settings.waiters, key);
                }
            }
            return answer;
        }
        Ok((other, _)) => Ok(other),
        Err(error) => Err(error),
    };
    let (settings, operation) = (&*call.settings, call.operation.as_str());
    match reserved {
        Ok(Reservation::Completed(bytes)) => Ok(replay(settings, operation, &bytes)),
        Err(idempotency::Error::InProgress { retry_after }) => {
            // The finer hint: how long this operation usually takes, within the engine's.
            let retry_after = settings.estimates.hint(operation, retry_after);
            Ok(refuse(
                &settings.problem_base,
                operation,
                IdempotencyRejection::InProgress { retry_after },
            ))
        }
        Err(error) => Ok(refuse(
            &settings.problem_base,
            operation,
            IdempotencyRejection::from_engine(error),
        )),
        // `Acquired` was answered above.
        Ok(_) => Ok(refuse(
            &settings.problem_base,
            operation,
            InternalError::UnknownReservation.into(),
        )),
    }
}

/// The stored response, marked as a replay.
fn replay<S: Store>(settings: &Settings<S>, op: &str, bytes: &[u8]) -> Response<Body> {
    match StoredResponse::from_bytes(bytes) {
        Ok(stored) => {
            count(op, metrics::REPLAYED);
            tracing::debug!(status = stored.status, "replayed stored response");
            let marker = settings.replay_header.clone();
            with_retention(settings, stored.into_replay_marked(marker))
        }
        Err(e) => refuse(
            &settings.problem_base,
            op,
            InternalError::StoredResult(e).into(),
        ),
    }
}

/// Steps 2 and 3 for a reserved key: run the handler, then complete (or release, or park).
async fn execute<S, Inner, ResBody>(
    mut call: KeyedCall<S, Inner>,
    attempt: Attempt,
    lease: Lease<S>,
    tx: Option<sqlx::Transaction<'static, S::Database>>,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (settings, op) = (call.settings, call.operation.as_str());
    let started = std::time::Instant::now();
    let mut lease = HeldLease {
        slot: LeaseSlot::new(lease),
        operation: op,
        effects: settings.effects,
        journaled: settings.journaled,
    };
    // 2. Run the handler, with the (lazily begun) business transaction and the lease in the
    //    extensions.
    let slot = TxSlot::new(settings.idempotency.store().clone(), tx);
    let (parts, body) = (call.parts, call.body);
    let key = attempt.key().clone();
    let response = run_handler(&mut call.inner, parts, body, key, &slot, &mut lease).await?;
    if lease.taken_by_handler() {
        // The handler settled the key itself (a durable operation): nothing to store or release.
        rollback(slot.take_back()).await;
        count(op, outcome_of_settled(response.status()));
        settings.estimates.record(op, started.elapsed());
        let response = response.map(Body::new);
        return Ok(with_retention(&settings, response));
    }
    let tx = match slot.take_back() {
        Returned::Open(tx) => Some(tx),
        Returned::NotBegun => None,
        Returned::StillLent => {
            lease.give_up("the handler kept its transaction").await;
            return Ok(refuse(
                &settings.problem_base,
                op,
                InternalError::TransactionKept.into(),
            ));
        }
    };
    let (mut response_parts, response_body) = response.into_parts();
    let disposition = disposition_of(&settings, &mut response_parts);
    let store = disposition == Some(Disposition::Store);
    let tx = writes_to_commit(tx, store && commits_writes(response_parts.status)).await;
    // A key stored without the work's writes, or parked, needs a committed row of its own.
    let settled_alone =
        (store && tx.is_none()) || matches!(disposition, Some(Disposition::Park(_)));
    let held =
        !(settled_alone && lease.in_transaction()) || lease.recommit(&settings, &attempt).await;
    if !store || !held {
        if held {
            lease.settle_unstored(disposition).await;
        }
        return Ok(Response::from_parts(
            response_parts,
            Body::new(response_body),
        ));
    }
    // 3. Complete the key with the stored response in the handler's transaction, and commit both.
    Ok(complete(
        &settings,
        &mut lease,
        tx,
        response_parts,
        response_body,
        started,
    )
    .await)
}

/// The handler's transaction, if its writes are to commit with the key's completion (`commit`:
/// only a stored success or redirection); otherwise rolled back here, and a stored client error
/// is stored without them, in a transaction of its own.
async fn writes_to_commit<DB: sqlx::Database>(
    tx: Option<sqlx::Transaction<'static, DB>>,
    commit: bool,
) -> Option<sqlx::Transaction<'static, DB>> {
    match tx {
        Some(tx) if commit => Some(tx),
        Some(tx) => {
            let _ = tx.rollback().await;
            None
        }
        None => None,
    }
}

/// Calls the handler with the transaction slot, the lease and the key in the request's
/// extensions. If it fails or panics, its transaction is rolled back and the key given up (as
/// the route's effects say) before the error goes on, or the panic.
async fn run_handler<S, Inner, ResBody>(
    inner: &mut Inner,
    mut parts: Parts,
    body: Bytes,
    key: IdempotencyKey,
    slot: &TxSlot<S::Database>,
    lease: &mut HeldLease<'_, S>,
) -> Result<Response<ResBody>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>>,
{
    parts.extensions.insert(slot.clone());
    // A key reserved inside the transaction is not the handler's to settle: whatever it did
    // with the lease outside that transaction would wait for the transaction itself.
    if !lease.in_transaction() {
        parts.extensions.insert(lease.slot.clone());
    }
    // The key, for handlers that pass it on to an idempotent provider.
    parts.extensions.insert(key);
    let request = Request::from_parts(parts, Body::from(body));
    match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(error)) => {
            rollback(slot.take_back()).await;
            lease.give_up("the inner service failed").await;
            Err(error)
        }
        Err(panic) => {
            rollback(slot.take_back()).await;
            lease.give_up("the handler panicked").await;
            std::panic::resume_unwind(panic);
        }
    }
}

/// What becomes of the key after the handler's response: the handler's own word (a
/// [`Disposition`] in the response's extensions) first, then the layer's policy by status.
/// `None`: the default for the route's effects.
fn disposition_of<S: Store>(
    settings: &Settings<S>,
    response: &mut http::response::Parts,
) -> Option<Disposition> {
    response
        .extensions
        .remove::<Disposition>()
        .or_else(|| (settings.disposition_by_status)(response.status))
}

/// Step 3: captures the response, completes the key with it in the handler's transaction (or a
/// transaction of its own), commits, and answers with the response.
async fn complete<S, ResBody>(
    settings: &Settings<S>,
    lease: &mut HeldLease<'_, S>,
    tx: Option<sqlx::Transaction<'static, S::Database>>,
    response_parts: http::response::Parts,
    response_body: ResBody,
    started: std::time::Instant,
) -> Response<Body>
where
    S: Store,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let op = lease.operation;
    let collected: Result<Bytes, BoxError> = response_body
        .collect()
        .await
        .map(|collected| collected.to_bytes())
        .map_err(Into::into);
    let response_body = match collected {
        Ok(bytes) => bytes,
        Err(error) => {
            lease.give_up("the response body failed").await;
            return refuse(
                &settings.problem_base,
                op,
                InternalError::ResponseBody(error).into(),
            );
        }
    };
    let stored = StoredResponse::capture(
        response_parts.status,
        &response_parts.headers,
        &settings.stored_headers,
        response_body.to_vec(),
    );

    let tx = match tx {
        Some(tx) => tx,
        None => match settings.idempotency.store().begin().await {
            Ok(tx) => tx,
            Err(error) => {
                lease.give_up("could not begin a transaction").await;
                return refuse(
                    &settings.problem_base,
                    op,
                    IdempotencyRejection::from_engine(error.into()),
                );
            }
        },
    };
    match lease.take().finish(tx, &stored.to_bytes()).await {
        Ok(()) => {
            count(op, metrics::EXECUTED);
            settings.estimates.record(op, started.elapsed());
            tracing::debug!(status = stored.status, "executed and stored response");
            let response = Response::from_parts(response_parts, Body::from(response_body));
            with_retention(settings, response)
        }
        Err(error) => {
            tracing::warn!(%error, "could not complete the idempotency key");
            refuse(
                &settings.problem_base,
                op,
                IdempotencyRejection::from_engine(error),
            )
        }
    }
}

/// Rolls back what the handler left in the slot, before the key is released (on SQLite the open
/// transaction holds the write lock the release needs).
async fn rollback<DB: sqlx::Database>(returned: Returned<DB>) {
    if let Returned::Open(tx) = returned {
        let _ = tx.rollback().await;
    }
}

/// A request that is not protected: the handler may still use the transaction, committed after a
/// response the layer would store (or one marked [`Disposition::Store`]) and rolled back otherwise.
async fn run_unprotected<S, Inner, ResBody>(
    settings: &Settings<S>,
    mut inner: Inner,
    mut parts: Parts,
    body: Body,
) -> Result<Response<Body>, Inner::Error>
where
    S: Store,
    Inner: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let operation = operation_name(&settings.operation, &parts);
    let slot = TxSlot::new(settings.idempotency.store().clone(), None);
    parts.extensions.insert(slot.clone());
    let mut response = inner
        .call(Request::from_parts(parts, body))
        .await?
        .map(Body::new);
    // Nothing is stored here; the writes commit after a success or a redirection only.
    response.extensions_mut().remove::<Disposition>();
    let commit = commits_writes(response.status());
    match slot.take_back() {
        Returned::NotBegun => Ok(response),
        Returned::StillLent => Ok(refuse(
            &settings.problem_base,
            &operation,
            InternalError::TransactionKept.into(),
        )),
        Returned::Open(tx) if commit => match tx.commit().await {
            Ok(()) => Ok(response),
            Err(error) => Ok(refuse(
                &settings.problem_base,
                &operation,
                IdempotencyRejection::from_engine(idempotency::StoreError::from(error).into()),
            )),
        },
        Returned::Open(tx) => {
            let _ = tx.rollback().await;
            Ok(response)
        }
    }
}

/// The metrics outcome of a response whose handler settled the key itself.
fn outcome_of_settled(status: http::StatusCode) -> &'static str {
    if status.is_success() {
        metrics::EXECUTED
    } else {
        metrics::SETTLED_BY_HANDLER
    }
}

/// The lease while the handler runs, in the slot a [`KeyLease`](crate::KeyLease) extractor takes
/// it from. Dropped while still held (the client went away and the server cancelled the
/// request), the key is released by [`Lease`]'s own drop; this counts it.
struct HeldLease<'o, S: Store> {
    slot: LeaseSlot<S>,
    operation: &'o str,
    effects: Effects,
    /// A durable operation's route: outside calls happen only under the lease the handler takes.
    journaled: bool,
}

impl<S: Store> HeldLease<'_, S> {
    fn take(&mut self) -> Lease<S> {
        self.slot.take().expect("the lease is taken once")
    }

    /// After a response that is not stored: release, park, or (`None`, or a decision this layer
    /// does not know) the default for the route's effects.
    async fn settle_unstored(&mut self, disposition: Option<Disposition>) {
        match disposition {
            Some(Disposition::Release) => self.release("the response is not stored").await,
            Some(Disposition::Park(reason)) => self.park(&reason).await,
            _ => self.give_up("the response is not stored").await,
        }
    }

    /// Whether the key row was written inside the business transaction (the
    /// single-transaction mode).
    fn in_transaction(&self) -> bool {
        self.slot.is_in_transaction()
    }

    /// For a key reserved inside the transaction, which rolled back: the key reserved again on
    /// its own commit, to be stored or parked without the work's writes. `false` when a
    /// duplicate holds or settled the key meanwhile (or the store failed): nothing of ours to
    /// settle, and the response goes out unstored.
    async fn recommit(&mut self, settings: &Settings<S>, attempt: &Attempt) -> bool {
        let lease = self.take();
        match settings.idempotency.reserve_committed(attempt, lease).await {
            Ok(Reservation::Acquired(lease)) => {
                self.slot = LeaseSlot::new(lease);
                true
            }
            Ok(_) => {
                tracing::warn!(
                    "a duplicate took the key after the rollback; the response is not stored"
                );
                false
            }
            Err(error) => {
                tracing::warn!(%error, "could not reserve the key again; the response is not stored");
                false
            }
        }
    }

    /// Whether the handler took the lease (and so settles the key itself).
    fn taken_by_handler(&self) -> bool {
        !self.slot.holds()
    }

    async fn park(&mut self, reason: &str) {
        count(self.operation, metrics::PARKED);
        tracing::warn!(reason, "parking idempotency key for review");
        if let Err(error) = self.take().park(reason).await {
            tracing::error!(%error, "could not park idempotency key; it stays pending until its lease ends");
        }
    }

    /// After a failure that may have come after an outside effect: local work's key is
    /// released; external work's is never released by the layer, it stays pending for the
    /// recovery job. On a journaled route (a durable operation) outside calls are made only
    /// under the lease the handler takes: while the layer still holds it, nothing went out, and
    /// the key is released (a handler that took it settles the key itself).
    async fn give_up(&mut self, why: &'static str) {
        match self.effects {
            Effects::External if !self.journaled => self.leave_pending(why),
            _ => self.release(why).await,
        }
    }

    fn leave_pending(&mut self, why: &'static str) {
        let Some(lease) = self.slot.take() else {
            // The handler took the lease (a durable operation): the key is its own to settle.
            tracing::warn!(
                reason = why,
                "the handler held the key's lease; left as it is"
            );
            return;
        };
        count(self.operation, metrics::LEFT_PENDING);
        tracing::warn!(
            reason = why,
            "outside effects may have happened; the key stays pending for the recovery job"
        );
        lease.leave_pending();
    }

    async fn release(&mut self, why: &'static str) {
        let Some(lease) = self.slot.take() else {
            // A handler that took the lease (a durable operation) and then failed or panicked:
            // the key is its own to settle; a dropped durable lease stays pending for the resumer.
            tracing::warn!(
                reason = why,
                "the handler held the key's lease; not released"
            );
            return;
        };
        count(self.operation, metrics::RELEASED);
        tracing::info!(reason = why, "releasing idempotency key");
        if let Err(error) = lease.release().await {
            tracing::warn!(%error, "could not release idempotency key; it stays pending until its lease ends");
        }
    }
}

impl<S: Store> Drop for HeldLease<'_, S> {
    fn drop(&mut self) {
        if self.slot.holds() {
            // The lease drops with us: local work's key is released, external work's stays
            // pending (see `idempotency::Lease`).
            match self.effects {
                Effects::Local => {
                    count(self.operation, metrics::RELEASED);
                    tracing::info!("request cancelled; releasing idempotency key");
                }
                // External, and anything a later version adds: the key is never released.
                _ => {
                    count(self.operation, metrics::LEFT_PENDING);
                    tracing::warn!("request cancelled; the key stays pending for the recovery job");
                }
            }
        }
    }
}

fn operation_name(source: &OperationSource, parts: &Parts) -> String {
    match source {
        OperationSource::Fixed(name) => name.clone(),
        OperationSource::Custom(name) => name(parts),
        OperationSource::MethodAndRoute => {
            let path = parts
                .extensions
                .get::<MatchedPath>()
                .map(MatchedPath::as_str)
                .unwrap_or_else(|| parts.uri.path());
            format!("{} {}", parts.method, path)
        }
    }
}

async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, IdempotencyRejection>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(IdempotencyRejection::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => {
            Err(IdempotencyRejection::BodyTooLarge { limit })
        }
        Err(error) => Err(IdempotencyRejection::BodyUnreadable(error)),
    }
}

/// Whether a `Content-Type` is JSON: `application/json` or any `+json` suffix.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

/// Method, path and query, the configured headers, and the body (canonical JSON or raw bytes).
fn fingerprint(
    parts: &Parts,
    fingerprint_headers: &[http::HeaderName],
    body: &[u8],
) -> Result<Fingerprint, IdempotencyRejection> {
    let target = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let mut builder = Fingerprint::builder()
        .part("method", parts.method.as_str().as_bytes())
        .part("target", target.as_bytes());
    for name in fingerprint_headers {
        for value in parts.headers.get_all(name) {
            builder = builder.part(&format!("header {name}"), value.as_bytes());
        }
    }
    let builder = if is_json(&parts.headers) {
        builder
            .json_part("json body", body)
            .map_err(IdempotencyRejection::BodyNotJson)?
    } else {
        builder.part("body", body)
    };
    Ok(builder.finish())
}

fn with_retention<S: Store>(
    settings: &Settings<S>,
    mut response: Response<Body>,
) -> Response<Body> {
    if settings.retention_header {
        let seconds = settings.idempotency.retention().as_secs();
        response
            .headers_mut()
            .insert(IDEMPOTENCY_KEY_RETENTION, HeaderValue::from(seconds));
    }
    response
}

fn refuse(base: &str, operation: &str, rejection: IdempotencyRejection) -> Response<Body> {
    count(operation, rejection.outcome());
    tracing::info!(%rejection, "idempotency layer refused the request");
    rejection.to_response_under(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn body_limit_holds_without_content_length() {
        let headers = HeaderMap::new();
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; 2000]));
        assert!(matches!(
            read_body(body, &headers, 1999).await,
            Err(IdempotencyRejection::BodyTooLarge { limit: 1999 })
        ));
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; 2000]));
        assert_eq!(read_body(body, &headers, 2000).await.unwrap().len(), 2000);
        let mut lying = HeaderMap::new();
        lying.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5000"));
        let body = http_body_util::Full::new(Bytes::from_static(b"small"));
        assert!(matches!(
            read_body(body, &lying, 2000).await,
            Err(IdempotencyRejection::BodyTooLarge { .. })
        ));
    }

    #[test]
    fn recognises_json_content_types() {
        let mut headers = HeaderMap::new();
        assert!(!is_json(&headers));
        for (value, json) in [
            ("application/json", true),
            ("application/json; charset=utf-8", true),
            ("Application/JSON", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("json", false),
        ] {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            assert_eq!(is_json(&headers), json, "{value}");
        }
    }

    #[test]
    fn fingerprint_separates_method_path_headers_and_body() {
        let request = |method: &str, uri: &str, currency: &str| {
            let (parts, ()) = Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .header("x-currency", currency)
                .body(())
                .unwrap()
                .into_parts();
            parts
        };
        let headers = [http::HeaderName::from_static("x-currency")];
        let fp = |parts: &Parts, body: &[u8]| fingerprint(parts, &headers, body).unwrap();
        let base = fp(&request("POST", "/orders", "EUR"), br#"{"a":1,"b":2}"#);
        assert_eq!(
            base,
            fp(
                &request("POST", "/orders", "EUR"),
                b"{ \"b\": 2, \"a\": 1 }"
            )
        );
        assert_ne!(
            base,
            fp(&request("PATCH", "/orders", "EUR"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders?x=1", "EUR"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders", "USD"), br#"{"a":1,"b":2}"#)
        );
        assert_ne!(
            base,
            fp(&request("POST", "/orders", "EUR"), br#"{"a":1,"b":3}"#)
        );
        assert!(matches!(
            fingerprint(&request("POST", "/orders", "EUR"), &headers, b"not json"),
            Err(IdempotencyRejection::BodyNotJson(_))
        ));
    }
}
