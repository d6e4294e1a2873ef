//! tower/axum middleware for the `Idempotency-Key` header, on the reserve-first
//! [`idempotency`] engine: a retried, double-clicked or re-queued POST runs **once**; its retries
//! get the stored response back, byte for byte, with `Idempotent-Replayed: true`.
//!
//! # What the layer does, per request
//!
//! 1. Methods other than the configured ones (default POST and PATCH) pass through.
//! 2. Reads `Idempotency-Key`, in the IETF draft form (a Structured Field String, `"abc-123"`)
//!    or Stripe's bare form (`abc-123`); 1..=255 printable ASCII characters. Invalid → 400;
//!    missing → 400 on a [`KeyRequirement::Required`] route, or the request runs unprotected on an
//!    [`KeyRequirement::Optional`] one.
//! 3. Finds the **scope** (whose key space: user, tenant) with the configured source (default: the
//!    [`IdempotencyScope`] extension an auth layer inserted). None → 401 or a fixed scope
//!    ([`MissingScope`]). The key is `(scope, operation, key)`: two users sending the same key
//!    never see each other's responses.
//! 4. The **operation** is `METHOD /route/{template}` from axum's
//!    [`MatchedPath`](axum::extract::MatchedPath) (so attach the layer with
//!    `Router::route_layer`), or a fixed name ([`IdempotencyLayer::with_operation`]).
//! 5. Reads the body (over the limit, default 1 MiB → 413) and **fingerprints** method, path and
//!    query, the configured headers, and the body (canonical JSON, RFC 8785, for JSON content
//!    types, where a body that is not JSON → 400; raw bytes otherwise). Nothing is reserved before
//!    this point.
//! 6. **Reserves** the key (committed on its own). Completed before → replay. Same key, other
//!    fingerprint → 422. Still running → 409 with `Retry-After` and `Retry-After-Ms`, or, with
//!    [`IdempotencyLayer::with_wait_for_in_flight`], a bounded wait for the original and then its
//!    stored response ([`in_flight`]). Parked → 409. Store unreachable → 503, and the handler is
//!    **not** run. With the engine's opt-in single-transaction mode
//!    ([`Idempotency::with_single_transaction`](idempotency::Idempotency::with_single_transaction),
//!    local work on PostgreSQL or MySQL/MariaDB) the key row is instead written as the first
//!    statement of the business transaction, begun here: a duplicate waits on the unique index
//!    for the original's commit and replays it, and the handler's [`IdempotentTx`] is that
//!    transaction.
//! 7. Runs the handler. If it extracts [`IdempotentTx`], the business transaction is begun then
//!    (never for handlers that do not ask for it). The held
//!    [`IdempotencyKey`](idempotency::IdempotencyKey) is in the request extensions
//!    (`Option<Extension<IdempotencyKey>>`), for handlers that pass it on to a provider that
//!    accepts idempotency keys itself, and so is the scope it is kept under
//!    (`Extension<IdempotencyScope>`, whichever source it came from).
//! 8. Only a **success or a redirection** (2xx, 3xx) lets the handler's writes commit
//!    ([`commits_writes`]): such a response is captured as a [`StoredResponse`] (status,
//!    `Content-Type`, `Location` and the configured headers, never cookies or credentials, and
//!    the body) and the key is **completed with it inside the handler's transaction**, then that
//!    transaction commits: the handler's rows and the stored response exist together or not at
//!    all. Any other response rolls the writes back. A definitive client error
//!    ([`is_definitive`]: 4xx except 404, 408, 409, 425, 429) is still stored and replayed, in a
//!    short transaction of its own. The rest (a transient 4xx, a 5xx, a panic) release the key
//!    so a retry runs again, except for [`Effects::External`]
//!    work, whose key is never released by default: it stays pending for the recovery job.
//!
//!    | status | handler's writes | key |
//!    |---|---|---|
//!    | 2xx, 3xx | committed with the key | completed, replayed |
//!    | 4xx except 404, 408, 409, 425, 429 | rolled back | completed, replayed |
//!    | 404, 408, 409, 425, 429 | rolled back | released |
//!    | 5xx, panic: local work | rolled back | released |
//!    | 5xx, panic: external work | rolled back | pending, for the recovery job |
//!    A handler that knows better for one response says so with a [`Disposition`] in its
//!    extensions (`axum::Extension(Disposition::Store)`): `Store` a final refusal (a 402),
//!    `Release`, or `Park` the key as *needs review* when an outside effect may have happened.
//!    The layer's policy by status is [`default_disposition`]; replace it with
//!    [`IdempotencyLayer::with_disposition_by_status`].
//!
//! A handler that drives a **durable operation** (outside calls between local steps, see
//! [`idempotency::durable::Steps`] and `docs/external-calls.md`) takes the reservation with the
//! [`KeyLease`] extractor and settles the key itself
//! ([`Idempotency::perform_reserved`](idempotency::Idempotency::perform_reserved)); the layer
//! then stores and releases nothing after it. Configure such a route with
//! [`Effects::External`].
//!
//! Protected responses are buffered whole (to be stored), so do not protect streaming routes.
//!
//! A client that hangs up cancels the request. A reservation in flight is finished and
//! released in the background (see [`idempotency::Idempotency::reserve`]); a handler that was
//! running is dropped, its transaction rolls back and a local key is released, so the retry runs
//! it again. With [`IdempotencyLayer::with_detach`] the handler runs in a task of its own instead and
//! finishes whatever the client does; its retry gets the stored response.
//!
//! Refusals are `application/problem+json` (RFC 9457, [`Problem`]), one
//! [`ProblemType`](wire::ProblemType) each, with their `type` under a `tag:` URI by default
//! ([`IdempotencyLayer::with_problem_base`] for your own). Besides `type`, `title`, `status` and
//! `detail` they carry what a client may do next: `retry` (`same-key`, `new-key` or `no`) and,
//! where the layer knows it, `key_state` (`pending`, `needs_review`); see [`wire`], the
//! vocabulary shared with `idempotency-client`. A durable operation's handler returns its
//! answer as a [`StoredResponse`] (`StoredResponse::from(finished)`, or
//! [`StoredResponse::json`]), which is a response.
//!
//! # Handlers that do not take the transaction
//!
//! They work: the layer then completes the key in a transaction of its own after the handler
//! returned. What that gives up is atomicity: if the process dies (or the store fails) between
//! the handler's own commit and the key's completion, the work is done but the key is released
//! (or stays pending until its lease ends, then is taken over), and a retry runs the handler a
//! second time. Use [`IdempotentTx`] for every write the operation makes, or make the handler
//! itself idempotent (a unique constraint on a business key).
//!
//! # Key lifetime
//!
//! A pending key is held for the **lease** (default 10 s, [`IdempotencyLayer::with_lease`]),
//! extended every third of it while the handler runs
//! ([`IdempotencyLayer::with_heartbeat`]): retries meanwhile get 409 + `Retry-After`, however long
//! the handler works. A worker that died without releasing its key (a
//! crash, not a cancellation) leaves it pending until the lease ends; with [`Effects::Local`] the
//! next retry then takes it over, with [`Effects::External`] only the recovery job (`idem
//! recover`) or an operator may. A completed key and its stored response are kept for the
//! **retention** (default 24 h, [`IdempotencyLayer::with_retention`]), counted from completion;
//! after that the same key is a new request (rows are purged by `idem purge`). With
//! [`IdempotencyLayer::with_retention_header`] protected responses carry
//! `Idempotency-Key-Retention: <seconds>`.
//!
//! # Observability
//!
//! Each protected request runs in a `tracing` span `idempotency` with `scope`, `operation` and
//! `method` (never the body or the key), and counts one `idempotency_requests_total{operation, outcome}`
//! through the `metrics` facade (see [`metrics`](mod@crate::metrics) for the outcomes).
//!
//! # Example
//!
//! ```no_run
//! use axum::{extract::Request, middleware::{self, Next}, response::{IntoResponse, Response}, routing::post, Json, Router};
//! use http::StatusCode;
//! use idempotency::{PgStore, Store, Idempotency};
//! use idempotency_http::{Problem, IdempotencyLayer, IdempotencyScope, IdempotentTx, KeyRequirement};
//! use sqlx::Postgres;
//!
//! #[derive(serde::Deserialize)]
//! struct NewOrder { sku: String, quantity: i32 }
//!
//! // The business rows go into the layer's transaction: they commit with the stored response.
//! async fn create_order(mut tx: IdempotentTx<Postgres>, Json(order): Json<NewOrder>) -> Response {
//!     let id: i64 = match sqlx::query_scalar("INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id")
//!         .bind(&order.sku)
//!         .bind(order.quantity)
//!         .fetch_one(&mut **tx)
//!         .await
//!     {
//!         Ok(id) => id,
//!         // 5xx: rolled back, key released, a retry runs again.
//!         Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
//!     };
//!     (StatusCode::CREATED, [("location", format!("/orders/{id}"))], Json(serde_json::json!({"id": id}))).into_response()
//! }
//!
//! // The auth layer names the scope; the same helper answers its own errors as problem+json.
//! async fn authenticate(mut request: Request, next: Next) -> Response {
//!     let user = request.headers().get("x-user").and_then(|v| v.to_str().ok()).map(str::to_owned);
//!     match user {
//!         Some(user) => {
//!             request.extensions_mut().insert(IdempotencyScope(user));
//!             next.run(request).await
//!         }
//!         None => Problem::new(StatusCode::UNAUTHORIZED, "https://shop.example/problems/login", "Log in first")
//!             .into_response(),
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = sqlx::PgPool::connect("postgres://shop@127.0.0.1/shop").await?;
//!     let store = PgStore::new(pool);
//!     store.migrate().await?;
//!     let idempotency = IdempotencyLayer::new(Idempotency::new(store))
//!         .with_key_requirement(KeyRequirement::Required);
//!     let app = Router::new()
//!         .route("/orders", post(create_order))
//!         .route_layer(idempotency)
//!         .layer(middleware::from_fn(authenticate));
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app).await?;
//!     Ok(())
//! }
//! ```

#![warn(missing_docs)]

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod config;
mod disposition;
mod durable;
mod error;
pub mod header;
pub mod in_flight;
mod layer;
mod lease;
pub mod metrics;
mod problem;
mod service;
mod stored;
mod tx;

pub use config::{IdempotencyScope, KeyRequirement, MissingScope, DEFAULT_BODY_LIMIT};
pub use disposition::{commits_writes, default_disposition, is_definitive};
pub use durable::{DurableRoute, UnregisteredOperation};
pub use error::{BoxError, IdempotencyRejection, InternalError};
pub use layer::IdempotencyLayer;
pub use lease::{KeyLease, LeaseRejection};
pub use problem::Problem;
pub use service::{IdempotencyService, ResponseFuture};
pub use stored::{StoredResponse, ALWAYS_STORED, NEVER_STORED};
pub use tx::{IdempotentTx, TxRejection};

pub use idempotency::{Disposition, Effects, Idempotency};
/// The wire vocabulary shared with the client: header names and problem types.
pub use idempotency_wire as wire;
