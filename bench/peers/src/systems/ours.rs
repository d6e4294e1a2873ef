//! Our layer: `IdempotencyLayer` on `PgStore`; the handler writes in `IdempotentTx`, so its row
//! commits together with the key's completion.

use crate::{
    orders::{self, Order, Orders},
    server::{self, Server},
};
use axum::{Json, Router, extract::State, response::Response, routing::post};
use idempotency::{Idempotency, PgStore, Store};
use idempotency_http::{IdempotencyLayer, IdempotentTx};
use sqlx::Postgres;
use std::time::Duration;

/// How our engine is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The defaults: the reservation commits on its own.
    Plain,
    /// The replay cache on (100,000 results).
    Cached,
    /// The single-transaction mode (duplicates wait up to 5 s).
    SingleTx,
}

/// Starts our layer in `mode`.
pub async fn start(database_url: &str, mode: Mode) -> anyhow::Result<Server> {
    let pool = server::pool(database_url).await?;
    let store = PgStore::new(pool.clone());
    store.migrate().await?;
    // The key table is the store's own (`idempotency_keys`): only earlier runs' keys go.
    sqlx::query("DELETE FROM idempotency_keys WHERE scope LIKE $1")
        .bind(format!("{}%", server::USER_PREFIX))
        .execute(&pool)
        .await?;
    let (name, table) = match mode {
        Mode::Plain => ("ours", "peers_ours_orders"),
        Mode::Cached => ("ours + replay cache", "peers_ours_cached_orders"),
        Mode::SingleTx => ("ours, single transaction", "peers_ours_single_tx_orders"),
    };
    let orders = Orders::create(pool, table).await?;
    let engine = Idempotency::new(store);
    let engine = match mode {
        Mode::Plain => engine,
        Mode::Cached => engine.with_replay_cache(100_000),
        Mode::SingleTx => engine.with_single_transaction(Duration::from_secs(5)),
    };
    let layer = IdempotencyLayer::new(engine).with_scope_from(server::user);
    let router = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer)
        .with_state(orders.clone());
    Ok(Server {
        name,
        url: server::serve(router).await?,
        orders,
        login: false,
    })
}

/// The handler, writing in the layer's transaction.
async fn create_order(
    State(orders): State<Orders>,
    mut tx: IdempotentTx<Postgres>,
    Json(order): Json<Order>,
) -> Response {
    let inserted = orders.insert(&mut **tx, &order).await;
    orders::finish(inserted, &order).await
}
