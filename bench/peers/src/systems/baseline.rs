//! The unprotected handler.

use crate::{
    orders::{self, Orders},
    server::{self, Server},
};
use axum::{Router, routing::post};

pub async fn start(database_url: &str) -> anyhow::Result<Server> {
    let orders = Orders::create(server::pool(database_url).await?, "peers_baseline_orders").await?;
    let router = Router::new()
        .route("/orders", post(orders::create_order))
        .with_state(orders.clone());
    Ok(Server {
        name: "baseline",
        url: server::serve(router).await?,
        orders,
        login: false,
    })
}
