//! A tiny order service on SQLite with the idempotency layer, and a client that retries.
//!
//! ```text
//! cargo run -p idempotency-http --example orders
//! ```
//!
//! It serves `POST /orders` on a loopback port, sends the same order three times with one
//! `Idempotency-Key` (the retries are replays), once with another body (422) and once without a
//! key (400), prints what came back, and exits.

use axum::{http::StatusCode, response::IntoResponse, routing::post, Json, Router};
use idempotency::{Idempotency, SqliteStore, Store};
use idempotency_http::{IdempotencyLayer, IdempotentTx};
use sqlx::Sqlite;

#[derive(serde::Deserialize)]
struct NewOrder {
    sku: String,
}

/// Writes the order in the layer's transaction: it commits together with the stored response.
async fn create_order(
    mut tx: IdempotentTx<Sqlite>,
    Json(order): Json<NewOrder>,
) -> impl IntoResponse {
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES (?1) RETURNING id")
        .bind(&order.sku)
        .fetch_one(&mut **tx)
        .await
        .expect("insert order");
    (
        StatusCode::CREATED,
        [("location", format!("/orders/{id}"))],
        Json(serde_json::json!({"id": id, "sku": order.sku})),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("orders.db").display()
    );
    let store = SqliteStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, sku TEXT NOT NULL)")
        .execute(store.pool())
        .await?;

    // Every caller of this demo is one user; a real service reads the authenticated user.
    let layer = IdempotencyLayer::new(Idempotency::new(store.clone())).with_scope_from(|parts| {
        parts
            .headers
            .get("x-user")?
            .to_str()
            .ok()
            .map(str::to_owned)
    });
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = reqwest::Client::new();
    let send = |key: Option<&'static str>, body: &'static str| {
        let mut request = client
            .post(format!("{base}/orders"))
            .header("x-user", "demo-user")
            .header("content-type", "application/json")
            .body(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        async move {
            let response = request.send().await?;
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = response.text().await?;
            println!("{status} replayed={replayed} {body}");
            Ok::<_, reqwest::Error>(())
        }
    };
    send(Some("\"order-1\""), r#"{"sku":"tea"}"#).await?;
    send(Some("\"order-1\""), r#"{"sku":"tea"}"#).await?; // replay
    send(Some("order-1"), r#"{ "sku": "tea" }"#).await?; // bare form, same JSON: replay
    send(Some("order-1"), r#"{"sku":"coffee"}"#).await?; // 422
    send(None, r#"{"sku":"tea"}"#).await?; // 400
    let orders: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(store.pool())
        .await?;
    println!("orders in the database: {orders}");
    assert_eq!(orders, 1);
    Ok(())
}
