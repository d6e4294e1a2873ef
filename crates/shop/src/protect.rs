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

use crate::{
    auth::UserId,
    db::StoreConn,
    problem::BODY_LIMIT,
    purchase::{Purchase, PURCHASE},
};
use axum::http::Method;
use idempotency::{durable::Operations, Effects, Idempotency, Store};
use idempotency_http::{Disposition, DurableRoute, IdempotencyLayer, UnregisteredOperation};

/// A keyed route that runs in the business transaction: the operation name that scopes its keys,
/// and what its work touches. The durable purchase is not one of these: its route is built from
/// the registry the worker resumes with ([`purchase_route`]).
#[derive(Debug, Clone, Copy)]
pub struct KeyedRoute {
    /// Operation part of the key (`"create-order"`).
    pub operation: &'static str,
    /// Whether the work calls an outside service that cannot be asked again.
    pub effects: Effects,
}

/// The layer of a [`KeyedRoute`], under the shop's policy ([`policy`]).
///
/// ```no_run
/// # async fn demo(store: idempotency::SqliteStore) {
/// use shop::protect::{layer, CREATE_ORDER};
/// let layer = layer(idempotency::Idempotency::new(store), CREATE_ORDER);
/// # }
/// ```
pub fn layer<S: Store>(engine: Idempotency<S>, route: KeyedRoute) -> IdempotencyLayer<S> {
    policy(
        IdempotencyLayer::new(engine)
            .with_operation(route.operation)
            .with_effects(route.effects),
    )
}

/// The durable purchase's route, taken from `operations` by [`PURCHASE`](crate::purchase::PURCHASE): the layer's operation
/// name, effects and journaling come from the registered operation, and a registry without it
/// refuses to build (a purchase reserved there could never be resumed after a crash).
///
/// ```no_run
/// # async fn demo(store: idempotency::SqliteStore, operations: idempotency::durable::Operations<idempotency::SqliteStore>) {
/// let route = shop::protect::purchase_route(idempotency::Idempotency::new(store), &operations).unwrap();
/// # }
/// ```
pub fn purchase_route<S: StoreConn>(
    engine: Idempotency<S>,
    operations: &Operations<S>,
) -> Result<DurableRoute<S, Purchase>, UnregisteredOperation> {
    DurableRoute::new(engine, operations, PURCHASE)
}

/// The shop's policy for every keyed route: POST only, the key required, scoped by the
/// authenticated user, the shop's body limit, and only 2xx answers stored by default.
pub fn policy<S: Store>(layer: IdempotencyLayer<S>) -> IdempotencyLayer<S> {
    layer
        .with_methods([Method::POST])
        .with_scope_from(|parts| parts.extensions.get::<UserId>().map(|user| user.0.clone()))
        .with_body_limit(BODY_LIMIT)
        .with_disposition_by_status(|status| status.is_success().then_some(Disposition::Store))
        // Once reserved, the work runs in a task of its own: a client that gives up (timeout,
        // closed connection) does not cancel it half-way, so it finishes, the key completes,
        // and the client's retry gets the stored response instead of a 409.
        .with_detach(true)
}

/// `POST /orders`.
pub const CREATE_ORDER: KeyedRoute = KeyedRoute {
    operation: "create-order",
    effects: Effects::Local,
};
/// `POST /emails`.
pub const SEND_EMAIL: KeyedRoute = KeyedRoute {
    operation: "send-email",
    effects: Effects::External,
};
