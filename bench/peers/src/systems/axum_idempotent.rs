//! `axum-idempotent` 0.6: responses cached in the caller's `ruts` session, here in PostgreSQL
//! (`ruts::store::postgres::PostgresStore`). A client logs in first (`POST /login`) and sends
//! the session cookie back.

use crate::{
    orders::{self, Orders},
    server::{self, Server},
};
use anyhow::Context;
use axum::{
    Router,
    http::{HeaderMap, StatusCode},
    routing::post,
};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::{
    CookieOptions, Session, SessionLayer,
    store::{
        Ttl,
        postgres::{PostgresStore, PostgresStoreBuilder},
    },
};
use std::sync::Arc;
use tower_cookies::CookieManagerLayer;

const SESSIONS: &str = "peers_axum_idempotent_sessions";
/// Session lifetime, seconds.
const SESSION_TTL: i64 = 3600;

pub async fn start(database_url: &str) -> anyhow::Result<Server> {
    let pool = server::pool(database_url).await?;
    let orders = Orders::create(pool.clone(), "peers_axum_idempotent_orders").await?;
    let sessions = PostgresStoreBuilder::new(pool.clone())
        .table_name(SESSIONS)?
        .create_table(true)
        .build()
        .await?;
    sqlx::query(&format!("TRUNCATE {SESSIONS}"))
        .execute(&pool)
        .await?;
    // The key is the Idempotency-Key header (required), like the other systems; its default
    // would hash the method, path, headers and body instead.
    let options = IdempotentOptions::default().use_idempotency_key_header(None, true);
    let cookie = CookieOptions::build()
        .name("session")
        .max_age(SESSION_TTL as u64)
        .path("/");
    let router = Router::new()
        .route("/orders", post(orders::create_order))
        .route_layer(IdempotentLayer::<PostgresStore>::new(options))
        .route("/login", post(login))
        .layer(SessionLayer::new(Arc::new(sessions)).with_cookie_options(cookie))
        .layer(CookieManagerLayer::new())
        .with_state(orders.clone());
    Ok(Server {
        name: "axum-idempotent",
        url: server::serve(router).await?,
        orders,
        login: true,
    })
}

/// Starts a session for the `x-user` caller: the response sets the session cookie.
async fn login(session: Session<PostgresStore>, headers: HeaderMap) -> Result<StatusCode, String> {
    let user = headers
        .get("x-user")
        .and_then(|user| user.to_str().ok())
        .context("no x-user")
        .map_err(|error| error.to_string())?;
    let ttl = Ttl::new(SESSION_TTL).map_err(|error| error.to_string())?;
    session
        .set("user", &user, ttl, None)
        .await
        .map_err(|error| error.to_string())?;
    Ok(StatusCode::NO_CONTENT)
}
