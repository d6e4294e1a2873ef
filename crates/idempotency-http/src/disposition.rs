//! [`Disposition`]: a handler's own word on what happens to the key after its response.
//!
//! The layer decides by status ([`store_response_if`](crate::IdempotencyLayer::store_response_if),
//! [`on_unstored_response`](crate::IdempotencyLayer::on_unstored_response)). A handler that knows
//! better for one response (a 402 refusal that is final and must be replayed, a 502 after which
//! a mail may or may not have gone out) puts a [`Disposition`] into the response's extensions,
//! and the layer follows it instead.

use axum::response::{IntoResponseParts, ResponseParts};
use std::convert::Infallible;

/// What the layer does with the key (and the handler's transaction) after this response.
///
/// Insert it into the response extensions, or return it as a response part:
///
/// ```
/// use axum::{response::IntoResponse, Json};
/// use http::StatusCode;
/// use idempotency_http::Disposition;
///
/// // A refusal that is final: stored with the key (and the handler's rows) and replayed.
/// let response = (StatusCode::PAYMENT_REQUIRED, Disposition::Store, Json("balance too low")).into_response();
/// assert_eq!(response.extensions().get::<Disposition>(), Some(&Disposition::Store));
///
/// // An outcome nobody knows: roll back, and park the key for an operator.
/// let parked = (StatusCode::BAD_GATEWAY, Disposition::Park("mail provider timed out".into()), "try later").into_response();
/// assert!(matches!(parked.extensions().get::<Disposition>(), Some(Disposition::Park(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// A definitive answer: complete the key with this response in the handler's transaction,
    /// commit both, and replay it to every retry (whatever its status).
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
