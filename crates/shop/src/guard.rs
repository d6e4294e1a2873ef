//! The `Idempotency-Key` guard around the shop's keyed routes, built on the core's
//! [`Idempotency::reserve`] and [`Lease::finish`](idempotency::Lease::finish).
//!
//! For each request, in the article's order:
//! 1. **reserve** `(user, operation, key)` with the request's fingerprint, committed on its own;
//!    a completed key replays its stored response, another fingerprint is 422, a key still in
//!    progress is 409 with `Retry-After`, a parked key is 409;
//! 2. **run** the handler inside a business transaction it reaches through [`TxSlot`];
//! 3. **complete** the key with the response in that same transaction and commit both;
//! 4. on failure roll back and **release** the key, only if still pending with our lease (or
//!    **park** it as *needs review* when the handler says an outside effect may have happened).
//!
//! The unprotected twin ([`plain_tx`]) runs the same handlers in a plain transaction, for the
//! routes whose defence is a constraint or a guarded transition, and for the benchmark.

use crate::{
    app::{App, Engine, UserId},
    db::{Backend, Tx},
    metrics as m,
    problem::{too_large, Disposition, Problem},
};
use axum::{
    body::Body,
    extract::{FromRequestParts, Request, State},
    http::{header, request::Parts, HeaderValue, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use idempotency::{
    Attempt, Effects, Error as IdemError, Fingerprint, Idempotency, IdempotencyKey, KeyState,
    Reservation,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tokio::sync::Mutex;

/// The request header carrying the client's key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header set on replayed answers.
pub const REPLAYED: &str = "idempotent-replayed";

/// A keyed route: the operation name that scopes its keys, and what its work touches.
#[derive(Debug, Clone, Copy)]
pub struct KeyedRoute {
    /// Operation part of the key (`"purchase"`).
    pub operation: &'static str,
    /// Whether the work calls an outside service.
    pub effects: Effects,
}

/// The key this request holds, for handlers that pass it on (to an idempotent provider).
#[derive(Debug, Clone)]
pub struct HeldKey(pub IdempotencyKey);

/// The business transaction of this request, opened by the guard (or by [`plain_tx`]).
///
/// Lock it, run statements on `tx.conn()`, and let the guard commit or roll back.
#[derive(Debug, Clone)]
pub struct TxSlot(Arc<Mutex<Option<Tx>>>);

impl TxSlot {
    fn new(tx: Tx) -> Self {
        Self(Arc::new(Mutex::new(Some(tx))))
    }

    /// Locks the transaction.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, Option<Tx>> {
        self.0.lock().await
    }

    async fn take(&self) -> Option<Tx> {
        self.0.lock().await.take()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for TxSlot {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts.extensions.get::<TxSlot>().cloned().ok_or_else(|| {
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no-transaction",
                "No transaction",
                "route is missing its transaction layer",
            )
        })
    }
}

/// A response as stored with the key and replayed.
#[derive(Debug, Serialize, Deserialize)]
struct StoredResponse {
    status: u16,
    content_type: Option<String>,
    body: String,
}

/// What to do with the key after the handler answered.
fn disposition(response: &Response) -> Disposition {
    if let Some(d) = response.extensions().get::<Disposition>() {
        return d.clone();
    }
    if response.status().is_success() {
        Disposition::Store
    } else {
        Disposition::Release
    }
}

/// The guard middleware (see the module docs). State: the app and the route's key policy.
pub async fn protect(
    State((app, route)): State<(App, KeyedRoute)>,
    request: Request,
    next: Next,
) -> Response {
    let response = match app.engine() {
        Engine::Pg(engine) => guard(engine.clone(), route, request, next).await,
        Engine::Sqlite(engine) => guard(engine.clone(), route, request, next).await,
    };
    response.unwrap_or_else(IntoResponse::into_response)
}

fn panicked(error: &tokio::task::JoinError) -> Response {
    tracing::error!(%error, "request task failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "Internal error",
        "the request failed; nothing was kept, retry with the same Idempotency-Key",
    )
    .into_response()
}

async fn guard<S: Backend>(
    engine: Idempotency<S>,
    route: KeyedRoute,
    request: Request,
    next: Next,
) -> Result<Response, Problem> {
    let op = route.operation;
    let Some(user) = request.extensions().get::<UserId>().cloned() else {
        return Err(crate::app::unauthenticated());
    };
    let client_key = match request.headers().get(IDEMPOTENCY_KEY) {
        None => {
            m::outcome(op, "rejected");
            return Err(Problem::bad_request(
                "idempotency-key-missing",
                "Idempotency-Key required",
                format!("{} needs an Idempotency-Key header: a fresh random string (a UUID) per logical operation, the same one on every retry", request.uri().path()),
            ));
        }
        // Both the IETF draft form (a Structured Field String, `"abc"`) and the bare token form,
        // parsed by the HTTP layer's parser.
        Some(value) => match idempotency_http::header::parse_idempotency_key(value) {
            Ok(key) => key,
            Err(e) => {
                m::outcome(op, "rejected");
                return Err(invalid_key(e.to_string()));
            }
        },
    };
    let key = IdempotencyKey::new(user.0.clone(), op, client_key).map_err(|e| {
        m::outcome(op, "rejected");
        invalid_key(e.to_string())
    })?;

    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, crate::problem::BODY_LIMIT)
        .await
        .map_err(|_| too_large())?;
    let fingerprint = Fingerprint::builder()
        .part("method", parts.method.as_str().as_bytes())
        .part("path", parts.uri.path().as_bytes())
        .json_part("body", &bytes)
        .map_err(|e| {
            Problem::bad_request(
                "malformed-json",
                "Malformed JSON",
                format!("the body is not JSON: {e}"),
            )
        })?
        .finish();
    let attempt = Attempt::new(key, fingerprint).effects(route.effects);

    // Replays first: a plain read of the key, never a write. Only a completed, unexpired key with
    // the same fingerprint is answered here; everything else goes through the reservation, which
    // alone decides.
    match engine.store().find(&attempt.key).await {
        Ok(Some(record))
            if record.state == KeyState::Completed
                && !record.expired
                && record.fingerprint == attempt.fingerprint =>
        {
            m::outcome(op, "replayed");
            return replay(record.result.as_deref().unwrap_or_default());
        }
        Ok(_) => {}
        Err(e) => {
            m::outcome(op, "unavailable");
            return Err(store_problem(&e));
        }
    }

    // From the reservation on, the work runs in a task of its own: a client that gives up
    // (timeout, closed connection) does not cancel it half-way, so the work finishes, the key
    // completes, and the client's retry gets the stored response instead of a 409.
    tokio::spawn(execute(engine, op, attempt, parts, bytes, next))
        .await
        .unwrap_or_else(|e| Ok(panicked(&e)))
}

async fn execute<S: Backend>(
    engine: Idempotency<S>,
    op: &'static str,
    attempt: Attempt,
    mut parts: Parts,
    bytes: axum::body::Bytes,
    next: Next,
) -> Result<Response, Problem> {
    let key = attempt.key.clone();

    // 1. Reserve the key, committed before any work.
    let lease = match engine.reserve(&attempt).await {
        Ok(Reservation::Completed(stored)) => {
            m::outcome(op, "replayed");
            return replay(&stored);
        }
        Ok(Reservation::Acquired(lease)) => lease,
        Err(e) => {
            return Err(refusal(op, e));
        }
    };

    // 2. Run the handler in the business transaction.
    let tx = match engine.store().begin().await {
        Ok(tx) => tx,
        Err(e) => {
            let _ = lease.release().await;
            m::outcome(op, "unavailable");
            return Err(store_problem(&e));
        }
    };
    let slot = TxSlot::new(S::wrap(tx));
    parts.extensions.insert(slot.clone());
    parts.extensions.insert(HeldKey(key));
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;

    let tx = slot.take().await.and_then(S::unwrap);
    match disposition(&response) {
        // 3. Complete the key with the response in the same transaction; commit both.
        Disposition::Store => {
            let Some(tx) = tx else {
                return Err(Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "no-transaction",
                    "Transaction lost",
                    "the handler did not leave its transaction",
                ));
            };
            let (head, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .unwrap_or_default();
            let stored = StoredResponse {
                status: head.status.as_u16(),
                content_type: head
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                body: String::from_utf8_lossy(&body).into_owned(),
            };
            let stored = serde_json::to_vec(&stored).expect("a stored response serialises");
            match lease.finish(tx, &stored).await {
                Ok(()) => {
                    m::outcome(op, "executed");
                    Ok(Response::from_parts(head, Body::from(body)))
                }
                Err(e) => Err(refusal(op, e)),
            }
        }
        // 4. Roll back, and release the key only if it is still ours.
        Disposition::Release => {
            if let Some(tx) = tx {
                let _ = tx.rollback().await;
            }
            if let Err(error) = lease.release().await {
                tracing::warn!(%error, "could not release idempotency key");
            }
            m::outcome(op, "released");
            Ok(response)
        }
        Disposition::Park(reason) => {
            if let Some(tx) = tx {
                let _ = tx.rollback().await;
            }
            if let Err(error) = lease.park(&reason).await {
                tracing::error!(%error, "could not park idempotency key");
            }
            m::outcome(op, "parked");
            Ok(response)
        }
    }
}

fn invalid_key(detail: String) -> Problem {
    Problem::bad_request(
        "idempotency-key-invalid",
        "Invalid Idempotency-Key",
        format!("{detail}; use 1 to 255 printable ASCII characters"),
    )
}

fn store_problem(e: &idempotency::StoreError) -> Problem {
    tracing::error!(error = %e, "idempotency store failed");
    let status = if e.is_unavailable() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    Problem::new(
        status,
        "idempotency-store",
        "Idempotency store unavailable",
        "the request was not run; retry with the same Idempotency-Key",
    )
    .retry_after(1)
}

/// The answer for a request the guard did not let through.
fn refusal(op: &'static str, e: IdemError) -> Problem {
    match e {
        IdemError::KeyReused => {
            m::outcome(op, "key_reused");
            Problem::unprocessable(
                "idempotency-key-reused",
                "Idempotency-Key reused",
                "this Idempotency-Key was already used with a different request; a new operation needs a new key",
            )
        }
        IdemError::InProgress { retry_after } => {
            m::outcome(op, "in_progress");
            Problem::new(
                StatusCode::CONFLICT,
                "request-in-progress",
                "Request in progress",
                "a request with this Idempotency-Key is still being processed; retry shortly with the same key",
            )
            .retry_after(retry_after.as_secs_f64().ceil().max(1.0) as u64)
        }
        IdemError::NeedsReview => {
            m::outcome(op, "needs_review");
            Problem::new(
                StatusCode::CONFLICT,
                "needs-review",
                "Needs review",
                "an earlier request with this Idempotency-Key may or may not have taken effect at an outside service; an operator must resolve it before it can be retried",
            )
        }
        IdemError::LeaseLost => {
            m::outcome(op, "lease_lost");
            Problem::new(
                StatusCode::CONFLICT,
                "lease-lost",
                "Lease lost",
                "this request took too long and another took the key over; nothing was kept, retry with the same key",
            )
        }
        IdemError::InvalidKey(e) => {
            m::outcome(op, "rejected");
            invalid_key(e.to_string())
        }
        IdemError::Store(e) => {
            m::outcome(op, "unavailable");
            store_problem(&e)
        }
        IdemError::Serialization(e) => {
            tracing::error!(error = %e, "stored response unreadable");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored-response",
                "Stored response unreadable",
                "the stored response for this key cannot be read",
            )
        }
        IdemError::Operation(never) => match never {},
    }
}

fn replay(stored: &[u8]) -> Result<Response, Problem> {
    let stored: StoredResponse = serde_json::from_slice(stored)
        .map_err(|e| refusal("replay", IdemError::Serialization(e)))?;
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut response = (status, stored.body).into_response();
    if let Some(ct) = stored
        .content_type
        .and_then(|ct| HeaderValue::from_str(&ct).ok())
    {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    Ok(response)
}

/// Runs a handler in a plain transaction: committed on 2xx, rolled back otherwise. No key.
pub async fn plain_tx(State(app): State<App>, request: Request, next: Next) -> Response {
    // In a task of its own, like the guard: a vanished client does not cut a transaction short.
    tokio::spawn(in_plain_tx(app, request, next))
        .await
        .unwrap_or_else(|e| panicked(&e))
}

async fn in_plain_tx(app: App, mut request: Request, next: Next) -> Response {
    let tx = match app.db().begin().await {
        Ok(tx) => tx,
        Err(e) => return Problem::database(&e).into_response(),
    };
    let slot = TxSlot::new(tx);
    request.extensions_mut().insert(slot.clone());
    let response = next.run(request).await;
    let Some(tx) = slot.take().await else {
        return response;
    };
    if response.status().is_success() {
        if let Err(e) = tx.commit().await {
            return Problem::database(&e).into_response();
        }
    } else {
        let _ = tx.rollback().await;
    }
    response
}
