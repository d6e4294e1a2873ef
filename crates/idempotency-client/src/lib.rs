//! A [`reqwest-middleware`](reqwest_middleware) middleware that keys and retries like a payment
//! SDK: **one `Idempotency-Key` per logical operation, reused on every retry**, retries where a
//! retry can help and never where it cannot, and an [`Outcome`] saying how it went.
//!
//! Only the key lets a server tell "the same operation, sent again" from "a new operation", so
//! retrying correctly is the client's half of the protocol. A server running `idempotency-http`
//! runs a keyed request at most once and replays its stored answer to every copy
//! (`Idempotent-Replayed: true`); this crate is the client that relies on that.
//!
//! ```no_run
//! use idempotency_client::{IdempotencyError, IdempotencyMiddleware, Outcome};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new())
//!     .build();
//! // One send() is one operation: one key, up to 5 attempts within 30 s.
//! let sent = client
//!     .post("http://127.0.0.1:8080/purchases")
//!     .header("x-user-id", "alice")
//!     .header("content-type", "application/json")
//!     .body(r#"{"sku": "tea", "quantity": 2}"#)
//!     .send()
//!     .await;
//! match sent {
//!     Ok(response) => {
//!         let outcome = Outcome::of(&response).expect("the middleware's outcome");
//!         println!(
//!             "{} after {} attempt(s), key {:?}, replayed: {}",
//!             response.status(),
//!             outcome.attempt_count(),
//!             outcome.key,
//!             outcome.replayed
//!         );
//!     }
//!     Err(error) => match IdempotencyError::from_error(&error) {
//!         Some(IdempotencyError::KeyReused { .. }) => eprintln!("the key was used for another request"),
//!         _ => eprintln!("gave up: {error}"),
//!     },
//! }
//! # Ok(()) }
//! ```
//!
//! # The key
//!
//! * Requests of the keyed methods (default **POST and PATCH**, the methods `idempotency-http`
//!   protects by default; [`IdempotencyMiddleware::with_methods`]) get a new key per `send()`:
//!   UUID v4 by default, UUID v7 for keys that sort by time, or your own ([`KeyGenerator`]).
//!   Other methods get none: a key the server does not read protects nothing.
//! * A request that already carries an `Idempotency-Key` keeps it: the caller owns the key when it
//!   must survive the process (a job queue that retries tomorrow stores the key with the job). A
//!   [`RequestKey`] extension chooses per request (`Use(key)` or `Omit`).
//! * The key is sent, unchanged, with **every attempt** of the operation: that is what makes the
//!   retry of a request whose answer was lost safe.
//!
//! # The retry rules, and why
//!
//! After each attempt the middleware gives the answer back, or pauses and sends the same request
//! (same key, same body) again. *Resendable* below means keyed, or of a method idempotent by
//! definition (GET, HEAD, OPTIONS, TRACE, PUT, DELETE), or marked [`Resendable`] by the caller (an
//! endpoint idempotent by design: a guarded state transition, a business unique constraint); an
//! unkeyed POST is otherwise sent again only if it never reached the server.
//!
//! | attempt ended with | done | why |
//! |---|---|---|
//! | connection refused / failed to connect | retry | the request was never sent, so sending it is always safe; the server may be restarting |
//! | timeout, connection reset or closed before the answer | retry if resendable | the server may have run it; with the key, a retry gets its stored answer (or runs it if it did not), never a second execution |
//! | an answer marked `Idempotent-Replayed: true` (any status) | **final** | it is the server's stored answer: every retry would replay the same bytes |
//! | 1xx, 2xx, 3xx | final | success (redirects are reqwest's business) |
//! | 409 `in-progress` or `lease-lost`, or any 409 with `Retry-After`/`Retry-After-Ms` | retry after the hint | the same key is running right now (a double click, a retry that overtook a slow original); waiting lets it finish, and the retry gets its answer |
//! | 409 `needs-review`, or a 409 with neither marker | final | the key is parked for an operator, or it is the application's own conflict: retrying now changes nothing |
//! | **400, 401, 403, 404**, 405, 410, 413, 415 … (other 4xx) | **final, never retried** | the request itself is wrong (malformed, unauthenticated, forbidden, unknown route, too large): the same bytes get the same refusal |
//! | **422** | **final, never retried** | the request is well-formed but refused; the 422 `key-reused` (the key was used with a *different* request) is returned as [`IdempotencyError::KeyReused`], since it is a bug in the caller and a new key would make a new operation, which only the caller may decide |
//! | 429 with `Retry-After`/`Retry-After-Ms` | retry after the hint | the server says when it will take the request; without a hint it is final (no guess at a rate limit) |
//! | 408 | retry if resendable | the server gave up waiting for the request and did not run it |
//! | 500 with `Retry-After`/`Retry-After-Ms` | retry after the hint | a 500 is retryable only where **the server marks it** so: by a retry hint it promises that nothing was kept (`idempotency-http` releases the key after a 5xx it did not store) |
//! | 500 without a hint, 501, 505 … | final | an unknown failure: repeating it blindly repeats the failure |
//! | 502, 503, 504 | retry (after the hint if any) | a gateway or dependency is down or slow, or the store is unreachable (`idempotency-http` answers 503 before running anything); a 5xx the server *stored* as final (a `payment-failed` 502) comes back replayed on the retry and stops there |
//!
//! **Hints.** A retry waits the server's hint when it gives one: `Retry-After-Ms` (milliseconds,
//! sent by `idempotency-http` beside `Retry-After`) is preferred; else `Retry-After` as seconds or
//! an HTTP-date. The hint is honoured as given (never earlier), since the server knows why it
//! refused. Without a hint the pause is **exponential backoff with full jitter** (from
//! `retry-policies`): retry `n` (from 0) waits a uniformly random time in
//! `[0, min(backoff_max, backoff_min × 2ⁿ)]`, default 100 ms doubling to 5 s. Full jitter
//! spreads clients that failed together (a restart) instead of sending them back together.
//!
//! **Budget.** At most [`RetryPolicy::max_attempts`] requests (default 5) within
//! [`RetryPolicy::deadline`] (default 30 s) from the first: no pause is begun that would end past
//! the deadline (a hint that does so ends the operation with the last answer), and an attempt
//! still running at the deadline is cut (via the request's own timeout lowered to what is left,
//! or [`IdempotencyError::Deadline`] for a request without one). When the budget runs out, the
//! last answer (a response) or error (reqwest's) is given back as it was; [`Outcome::stopped`]
//! says [`StopReason::MaxAttempts`] or [`StopReason::Deadline`]. [`RetryPolicy::once`] as a
//! request extension sends once and reports: no retry after the first error.
//!
//! A request whose body is a stream cannot be cloned and is sent once
//! ([`StopReason::BodyNotReplayable`]). The answer's body is read by the caller after the
//! middleware returned (except a 409's or 422's, which the middleware reads for its problem type,
//! up to 64 KiB, then hands back rebuilt); if reading it fails, send again with the same key
//! ([`RequestKey::Use`] with [`Outcome::key`]) to get the stored answer.
//!
//! # What it went through
//!
//! The final response carries an [`Outcome`] in its extensions ([`Outcome::of`]): the key, each
//! attempt ([`AttemptRecord`]: status or transport failure, replay mark, problem type, the
//! server's hint, time taken, pause after), whether the answer was a replay, how many attempts,
//! and why it stopped. A [`Probe`] extension gives the same outcome when the operation ends in an
//! error (a transport failure after the last attempt), and
//! [`IdempotencyMiddleware::with_attempt_observer`] is called after each attempt.
//!
//! # Errors
//!
//! Errors are `reqwest_middleware::Error`: `Reqwest(_)` for the last transport failure, and
//! `Middleware(anyhow::Error)` wrapping an [`IdempotencyError`] for the middleware's own (422
//! `key-reused`, deadline during an attempt without a timeout). Match with
//! [`IdempotencyError::from_error`] or `error.downcast_ref::<IdempotencyError>()` on the `anyhow`
//! error.
//!
//! # Problem types
//!
//! The layer's refusals are problem documents (RFC 9457) whose `type` is a base URI followed by
//! a slug. The middleware reads a 409's or 422's `type` into a
//! [`ProblemType`](idempotency_wire::ProblemType) (re-exported under [`wire`]) only when it is
//! under the base it was given ([`IdempotencyMiddleware::with_problem_base`], default the layer's
//! default `tag:idempotency,2026:problems/`), and decides by that type, never by text; any other
//! problem is the application's own and is judged by its status and retry hints alone. The
//! recognised type of each attempt is [`AttemptRecord::problem`].
//!
//! # The server side
//!
//! `idempotency_http::IdempotencyLayer::with_wait_for_in_flight` lets the server hold a duplicate
//! until the original finishes and answer it with the replay, so that a double click gets two
//! 201s and no 409 at all; without it, the 409's `Retry-After-Ms` is the layer's estimate of the
//! operation's duration, and this client waits just that long.

#![warn(missing_docs)]

mod error;
mod middleware;
mod outcome;
mod policy;
mod retry;

pub use error::IdempotencyError;
/// The wire vocabulary shared with the server: header names and problem types.
pub use idempotency_wire as wire;
pub use middleware::IdempotencyMiddleware;
pub use outcome::{AttemptRecord, AttemptResult, Outcome, Probe, StopReason, TransportKind};
pub use policy::{KeyFormat, KeyGenerator, RequestKey, Resendable, RetryPolicy};
pub use reqwest_middleware;
pub use retry::hint as retry_hint;
