//! Which responses commit the handler's writes, and what happens to the key after each.
//!
//! The layer decides by status ([`default_disposition`], or your
//! [`with_disposition_by_status`](crate::IdempotencyLayer::with_disposition_by_status)). A
//! handler that knows better for one response (a 402 refusal that is final and must be
//! replayed, a 502 after which a mail may or may not have gone out) puts a [`Disposition`]
//! into the response's extensions (`axum::Extension(Disposition::Store)` as a response part,
//! or [`Problem::with_disposition`](crate::Problem::with_disposition)), and the layer follows
//! it instead.
//!
//! ```
//! use axum::{response::IntoResponse, Extension, Json};
//! use http::StatusCode;
//! use idempotency_http::Disposition;
//!
//! // A refusal that is final: stored with the key and replayed (the handler's rows roll back).
//! let refusal = (StatusCode::PAYMENT_REQUIRED, Extension(Disposition::Store), Json("balance too low"));
//! let response = refusal.into_response();
//! assert_eq!(response.extensions().get::<Disposition>(), Some(&Disposition::Store));
//!
//! // An outcome nobody knows: roll back, and park the key for an operator.
//! let unknown = Extension(Disposition::Park("mail provider timed out".into()));
//! let parked = (StatusCode::BAD_GATEWAY, unknown, "try later").into_response();
//! assert!(matches!(parked.extensions().get::<Disposition>(), Some(Disposition::Park(_))));
//! ```

use http::StatusCode;
use idempotency::Disposition;

/// Whether a response lets the handler's writes **commit**: a success (2xx) or a redirection
/// (3xx, redirect-after-POST). Any other response rolls them back, whether it is stored or not.
///
/// ```
/// use http::StatusCode;
/// use idempotency_http::commits_writes;
/// assert!(commits_writes(StatusCode::CREATED));
/// assert!(commits_writes(StatusCode::SEE_OTHER));
/// assert!(!commits_writes(StatusCode::NOT_FOUND));
/// assert!(!commits_writes(StatusCode::UNPROCESSABLE_ENTITY));
/// ```
pub fn commits_writes(status: StatusCode) -> bool {
    status.is_success() || status.is_redirection()
}

/// The layer's default rule for which responses are **stored** and replayed: the definitive
/// ones. A success or a redirection; and a client error except those that say *try again*
/// (404: the target may exist later; 408, 409, 425, 429). Never a server error.
///
/// A stored client error is stored **without** the handler's writes ([`commits_writes`]).
///
/// | status | handler's writes | key |
/// |---|---|---|
/// | 2xx, 3xx | committed with the key | completed, response replayed |
/// | 4xx except 404, 408, 409, 425, 429 | rolled back | completed, response replayed |
/// | 404, 408, 409, 425, 429 | rolled back | released: a retry runs again |
/// | 5xx, [`Effects::Local`](idempotency::Effects::Local) | rolled back | released |
/// | 5xx or panic, [`Effects::External`](idempotency::Effects::External) | rolled back | left pending for the recovery job, never released |
///
/// ```
/// use http::StatusCode;
/// use idempotency_http::is_definitive;
/// assert!(is_definitive(StatusCode::CREATED));
/// assert!(is_definitive(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!is_definitive(StatusCode::NOT_FOUND));
/// assert!(!is_definitive(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!is_definitive(StatusCode::INTERNAL_SERVER_ERROR));
/// ```
pub fn is_definitive(status: StatusCode) -> bool {
    match status.as_u16() {
        404 | 408 | 409 | 425 | 429 => false,
        _ => status.is_success() || status.is_redirection() || status.is_client_error(),
    }
}

/// The layer's default [`Disposition`] for a response by its status, when the handler gave
/// none: [`Store`](Disposition::Store) a definitive response ([`is_definitive`]); otherwise
/// `None`, the default by the route's effects (local work released, external work left pending
/// for the recovery job). Compose your own policy with it
/// ([`with_disposition_by_status`](crate::IdempotencyLayer::with_disposition_by_status)).
///
/// ```
/// use http::StatusCode;
/// use idempotency_http::{default_disposition, Disposition};
/// assert_eq!(default_disposition(StatusCode::CREATED), Some(Disposition::Store));
/// assert_eq!(default_disposition(StatusCode::UNPROCESSABLE_ENTITY), Some(Disposition::Store));
/// assert_eq!(default_disposition(StatusCode::TOO_MANY_REQUESTS), None);
/// assert_eq!(default_disposition(StatusCode::BAD_GATEWAY), None);
/// ```
pub fn default_disposition(status: StatusCode) -> Option<Disposition> {
    is_definitive(status).then_some(Disposition::Store)
}
