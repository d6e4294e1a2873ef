//! The keyed routes: `POST /purchases`, `POST /orders` and `POST /emails` run behind the
//! `idempotency-http` middleware ([`IdempotencyLayer`]), configured per route by a
//! [`KeyedRoute`].
//!
//! Per request, in the article's order: the layer **reserves** `(user, operation, key)` with
//! the request's fingerprint (committed on its own); a completed key replays its stored
//! response, another fingerprint is 422, a key in progress is 409 with `Retry-After`, a parked
//! key is 409. Otherwise the handler **runs** in the business transaction ([`BusinessTx`]), the
//! key is **completed** with the response in that transaction, and both commit. A non-2xx
//! answer rolls back and **releases** the key, unless the handler says otherwise with a
//! [`Disposition`](idempotency_http::Disposition): a 402 refusal is stored and replayed, an
//! unknown mail outcome **parks** the key as *needs review*.
//!
//! [`BusinessTx`]: crate::tx::BusinessTx

use crate::{auth::UserId, problem::BODY_LIMIT};
use axum::http::Method;
use idempotency::{Effects, Idempotency, Store};
use idempotency_http::{Disposition, IdempotencyLayer};

/// A keyed route: the operation name that scopes its keys, and what its work touches.
#[derive(Debug, Clone, Copy)]
pub struct KeyedRoute {
    /// Operation part of the key (`"purchase"`).
    pub operation: &'static str,
    /// Whether the work calls an outside service that cannot be asked again.
    pub effects: Effects,
    /// Whether the handler is a durable operation whose first outside call follows a committed
    /// recovery point (its reservation is then not flushed on its own).
    pub journaled: bool,
}

/// The shop's policy for one keyed route: POST only, the key required, scoped by the
/// authenticated user, the shop's body limit, and only 2xx answers stored by default.
///
/// ```no_run
/// # async fn demo(store: idempotency::SqliteStore) {
/// use shop::protect::{layer, PURCHASE};
/// let layer = layer(idempotency::Idempotency::new(store), PURCHASE);
/// # }
/// ```
pub fn layer<S: Store>(engine: Idempotency<S>, route: KeyedRoute) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(engine)
        .with_methods([Method::POST])
        .with_operation(route.operation)
        .with_effects(route.effects)
        .with_journaled(route.journaled)
        .with_scope_from(|parts| parts.extensions.get::<UserId>().map(|user| user.0.clone()))
        .with_body_limit(BODY_LIMIT)
        .with_disposition_by_status(|status| status.is_success().then_some(Disposition::Store))
        // Once reserved, the work runs in a task of its own: a client that gives up (timeout,
        // closed connection) does not cancel it half-way, so it finishes, the key completes,
        // and the client's retry gets the stored response instead of a 409.
        .with_detach(true)
}

/// Keyed routes and their key policies.
pub const PURCHASE: KeyedRoute = KeyedRoute {
    operation: "purchase",
    // A durable operation with an outside step (the charge): its key is never taken over as
    // abandoned local work nor released after a step took effect; a retry or the worker
    // continues it from its recovery point (see `crate::purchase`).
    effects: Effects::External,
    journaled: true,
};
/// `POST /orders`.
pub const CREATE_ORDER: KeyedRoute = KeyedRoute {
    operation: "create-order",
    effects: Effects::Local,
    journaled: false,
};
/// `POST /emails`.
pub const SEND_EMAIL: KeyedRoute = KeyedRoute {
    operation: "send-email",
    effects: Effects::External,
    journaled: false,
};
