//! `idempotent` 2.x: its tower middleware (`idempotent::middleware::IdempotencyLayer`) on its
//! Valkey/Redis store (`idempotent::valkey::ValkeyStore`); the handler writes through the pool.

use crate::{
    orders::{self, Orders},
    server::{self, Server},
};
use axum::{Router, routing::post};
use idempotent::{middleware::IdempotencyLayer, valkey::ValkeyStore};
use std::time::Duration;

/// How long completed keys stay in Redis (the default is a day; this bounds Redis's memory
/// across runs and changes nothing within one).
const COMPLETED_TTL: Duration = Duration::from_secs(600);

pub async fn start(database_url: &str, redis_url: &str) -> anyhow::Result<Server> {
    let orders =
        Orders::create(server::pool(database_url).await?, "peers_idempotent_orders").await?;
    let store = ValkeyStore::with_url(redis_url)
        .prefix("peers")
        .try_build()
        .await?;
    store.ping().await?;
    let layer = IdempotencyLayer::new(store)
        .scope(server::user)
        .completed_ttl(COMPLETED_TTL);
    let router = Router::new()
        .route("/orders", post(orders::create_order))
        .route_layer(layer)
        .with_state(orders.clone());
    Ok(Server {
        name: "idempotent",
        url: server::serve(router).await?,
        orders,
        login: false,
    })
}
