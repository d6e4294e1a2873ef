//! [`Disposition`]: a handler's own word on what happens to the key after its response.
//!
//! The layer decides by status ([`store_response_if`](crate::IdempotencyLayer::with_store_response_if),
//! [`on_unstored_response`](crate::IdempotencyLayer::with_after_unstored_response)). A handler that knows
//! better for one response (a 402 refusal that is final and must be replayed, a 502 after which
//! a mail may or may not have gone out) puts a [`Disposition`] into the response's extensions,
//! and the layer follows it instead.

use axum::response::{IntoResponseParts, ResponseParts};
use http::StatusCode;
use std::convert::Infallible;

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

/// What the layer does with the key (and the handler's transaction) after this response.
///
/// Insert it into the response extensions, or return it as a response part:
///
/// ```
/// use axum::{response::IntoResponse, Json};
/// use http::StatusCode;
/// use idempotency_http::Disposition;
///
/// // A refusal that is final: stored with the key and replayed (the handler's rows roll back).
/// let response = (StatusCode::PAYMENT_REQUIRED, Disposition::Store, Json("balance too low")).into_response();
/// assert_eq!(response.extensions().get::<Disposition>(), Some(&Disposition::Store));
///
/// // An outcome nobody knows: roll back, and park the key for an operator.
/// let parked = (StatusCode::BAD_GATEWAY, Disposition::Park("mail provider timed out".into()), "try later").into_response();
/// assert!(matches!(parked.extensions().get::<Disposition>(), Some(Disposition::Park(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// A definitive answer: complete the key with this response and replay it to every retry
    /// (whatever its status). The handler's writes commit with it after a 2xx or 3xx
    /// ([`commits_writes`]); after any other status they roll back, and the response is stored
    /// in a short transaction of its own.
    Store,
    /// Nothing happened that a retry could duplicate: roll back and release the key, so a retry
    /// runs again (whatever the status).
    Release,
    /// An outside effect may have happened: roll back and park the key as *needs review*, with
    /// this reason; retries answer 409 until an operator (or `idem keys resolve`) decides.
    Park(String),
}

impl IntoResponseParts for Disposition {
    type Error = Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}
