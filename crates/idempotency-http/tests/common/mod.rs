//! One harness for the HTTP tests: a real axum app on a loopback port, on PostgreSQL, SQLite or
//! MySQL/MariaDB.
#![allow(dead_code)]

use axum::{
    body::Bytes,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Extension, Json, Router,
};
use futures_util::future::BoxFuture;
use idempotency::{
    store::ReserveInTransaction, Idempotency, MySqlStore, PgStore, SqliteStore, Store,
};
use idempotency_http::{
    default_disposition, Disposition, IdempotencyLayer, IdempotentTx, KeyRequirement,
};
use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
use sqlx::{MySql, MySqlPool, PgPool, Postgres, Sqlite, SqlitePool};
use std::time::Duration;

/// The business write of the test handler, per database.
pub trait Backend: sqlx::Database {
    fn insert_order<'a>(
        tx: &'a mut sqlx::Transaction<'static, Self>,
        scope: &'a str,
        sku: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>>;
}

impl Backend for Postgres {
    fn insert_order<'a>(
        tx: &'a mut sqlx::Transaction<'static, Self>,
        scope: &'a str,
        sku: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar("INSERT INTO orders (scope, sku) VALUES ($1, $2) RETURNING id")
                .bind(scope)
                .bind(sku)
                .fetch_one(&mut **tx)
                .await
        })
    }
}

impl Backend for Sqlite {
    fn insert_order<'a>(
        tx: &'a mut sqlx::Transaction<'static, Self>,
        scope: &'a str,
        sku: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar("INSERT INTO orders (scope, sku) VALUES (?1, ?2) RETURNING id")
                .bind(scope)
                .bind(sku)
                .fetch_one(&mut **tx)
                .await
        })
    }
}

impl Backend for MySql {
    fn insert_order<'a>(
        tx: &'a mut sqlx::Transaction<'static, Self>,
        scope: &'a str,
        sku: &'a str,
    ) -> BoxFuture<'a, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query("INSERT INTO orders (scope, sku) VALUES (?, ?)")
                .bind(scope)
                .bind(sku)
                .execute(&mut **tx)
                .await?;
            Ok(done.last_insert_id() as i64)
        })
    }
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Sleeps for `x-delay-before-tx-ms` before the next extractor (the transaction) runs.
pub struct DelayBeforeTx;

impl<AppState: Send + Sync> axum::extract::FromRequestParts<AppState> for DelayBeforeTx {
    type Rejection = std::convert::Infallible;
    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if let Some(ms) =
            header(&parts.headers, "x-delay-before-tx-ms").and_then(|v| v.parse().ok())
        {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Ok(DelayBeforeTx)
    }
}

/// Writes an order through the layer's transaction, then (per request headers, which are not in
/// the fingerprint) sleeps, fails with 500 or panics. The response carries a random nonce, so a
/// replay is told from a second execution by its bytes.
async fn create_order<DB: Backend>(
    headers: HeaderMap,
    _delay: DelayBeforeTx,
    mut tx: IdempotentTx<DB>,
    body: Bytes,
) -> Response {
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let sku = request["sku"].as_str().unwrap_or("none").to_owned();
    let scope = header(&headers, "x-user").unwrap_or("nobody").to_owned();
    let id = match DB::insert_order(&mut tx, &scope, &sku).await {
        Ok(id) => id,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    if let Some(ms) = header(&headers, "x-sleep-ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match header(&headers, "x-fail") {
        Some("500") => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "failed on purpose").into_response()
        }
        Some("502") => return (StatusCode::BAD_GATEWAY, "provider timed out").into_response(),
        Some("panic") => panic!("handler panics on purpose"),
        // Any other status after the write (404 "unknown target", 422, 429, 303, ...).
        Some(other) => {
            if let Some(status) = other
                .parse()
                .ok()
                .and_then(|s| StatusCode::from_u16(s).ok())
            {
                let body = Json(
                    serde_json::json!({"status": status.as_u16(), "nonce": uuid::Uuid::new_v4()}),
                );
                return (status, body).into_response();
            }
        }
        None => {}
    }
    // The handler's own word on the key, overriding the layer's policy by status.
    let disposition = match header(&headers, "x-disposition") {
        Some("store-402") => {
            let body = Json(serde_json::json!({"refused": sku, "nonce": uuid::Uuid::new_v4()}));
            return (
                StatusCode::PAYMENT_REQUIRED,
                Extension(Disposition::Store),
                body,
            )
                .into_response();
        }
        Some("release") => Some(Disposition::Release),
        Some("park") => Some(Disposition::Park("the handler cannot tell".into())),
        _ => None,
    };
    let mut response = (
        StatusCode::CREATED,
        [
            ("location", format!("/orders/{id}")),
            ("set-cookie", "session=secret".to_owned()),
            ("x-order-id", id.to_string()),
            ("x-not-stored", "1".to_owned()),
        ],
        Json(serde_json::json!({"order_id": id, "sku": sku, "nonce": uuid::Uuid::new_v4()})),
    )
        .into_response();
    if let Some(disposition) = disposition {
        response.extensions_mut().insert(disposition);
    }
    response
}

/// A handler that never touches the transaction; echoes the held key's parts.
async fn nonce(
    key: Option<axum::Extension<idempotency::IdempotencyKey>>,
) -> Json<serde_json::Value> {
    let held = key.map(|axum::Extension(key)| {
        [
            key.scope().to_owned(),
            key.operation().to_owned(),
            key.key().to_owned(),
        ]
    });
    Json(serde_json::json!({"nonce": uuid::Uuid::new_v4(), "held": held}))
}

/// The layer the tests use: scope from `x-user`, `x-order-id` stored.
pub fn layer<S: Store>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(Idempotency::new(store))
        .with_scope_from(|parts| header(&parts.headers, "x-user").map(str::to_owned))
        .with_stored_headers([http::HeaderName::from_static("x-order-id")])
}

/// The lease of `/short-lease`.
pub const SHORT_LEASE: Duration = Duration::from_millis(300);

/// The lease of `/beating` (heartbeat on): long enough that a heartbeat every third of it, run
/// late on a loaded machine, still lands before the lease ends.
pub const BEATING_LEASE: Duration = Duration::from_millis(1500);

/// An engine in the single-transaction mode.
fn single_transaction<S: ReserveInTransaction>(store: &S) -> Idempotency<S> {
    Idempotency::new(store.clone()).with_single_transaction(Duration::from_secs(5))
}

/// The test app: `/orders` (required key), `/optional-orders` (optional key), `/small` (1 KiB
/// limit), `/short-lease` (300 ms lease), `/payments`
/// (external effects, 502 parks the key), `/strict` (only 2xx stored), `/detached` (the work runs in
/// a task of its own), `/nonce` (no transaction), `/orders/{id}` (POST and PATCH
/// protected; GET, PUT and DELETE pass through), `/single-tx-orders` (on `single_tx`, an engine
/// in the single-transaction mode where the store offers it).
pub fn app<S: Store>(store: S, single_tx: Idempotency<S>) -> Router
where
    S::Database: Backend,
{
    let orders = Router::new()
        .route("/orders", post(create_order::<S::Database>))
        .route(
            "/orders/{id}",
            get(|| async { "read" })
                .post(create_order::<S::Database>)
                .patch(create_order::<S::Database>)
                .put(|| async { "replaced" })
                .delete(|| async { "deleted" }),
        )
        .route("/nonce", post(nonce))
        .route_layer(layer(store.clone()));
    let optional = Router::new()
        .route("/optional-orders", post(create_order::<S::Database>))
        .route_layer(
            layer(store.clone())
                .with_key_requirement(KeyRequirement::Optional)
                .with_retention_header(true),
        );
    let small = Router::new()
        .route("/small", post(create_order::<S::Database>))
        .route_layer(layer(store.clone()).with_body_limit(1024));
    let short_lease = Router::new()
        .route("/short-lease", post(create_order::<S::Database>))
        .route_layer(
            // A handler that stalls stands for a frozen process: its lease is not kept alive.
            layer(store.clone())
                .with_lease(SHORT_LEASE)
                .with_heartbeat(false),
        );
    // The same short lease, kept alive while the handler runs.
    let beating = Router::new()
        .route("/beating", post(create_order::<S::Database>))
        .route_layer(layer(store.clone()).with_lease(BEATING_LEASE));
    let external = Router::new()
        .route("/payments", post(create_order::<S::Database>))
        .route_layer(
            layer(store.clone())
                .with_effects(idempotency::Effects::External)
                .with_disposition_by_status(|status| match status.as_u16() {
                    502 => Some(Disposition::Park(format!("provider answered {status}"))),
                    _ => default_disposition(status).or(Some(Disposition::Release)),
                }),
        );
    // External effects with the layer's defaults (no policy of its own).
    let external_default = Router::new()
        .route("/external-default", post(create_order::<S::Database>))
        .route_layer(layer(store.clone()).with_effects(idempotency::Effects::External));
    let strict = Router::new()
        .route("/strict", post(create_order::<S::Database>))
        .route_layer(layer(store.clone()).with_disposition_by_status(|status| {
            status.is_success().then_some(Disposition::Store)
        }));
    let detached = Router::new()
        .route("/detached", post(create_order::<S::Database>))
        .route_layer(layer(store.clone()).with_detach(true));
    // The engine's single-transaction mode (PostgreSQL, MariaDB; SQLite reserves as usual).
    let single_tx = Router::new()
        .route("/single-tx-orders", post(create_order::<S::Database>))
        .route_layer(
            IdempotencyLayer::new(single_tx)
                .with_scope_from(|parts| header(&parts.headers, "x-user").map(str::to_owned))
                .with_stored_headers([http::HeaderName::from_static("x-order-id")]),
        );
    orders
        .merge(single_tx)
        .merge(strict)
        .merge(detached)
        .merge(optional)
        .merge(small)
        .merge(short_lease)
        .merge(beating)
        .merge(external)
        .merge(external_default)
}

/// Serves `router` on a random loopback port; returns its base URL.
pub async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{address}")
}

/// The database the app runs on, for inspecting its tables.
#[derive(Clone)]
pub enum Db {
    Pg(PgPool),
    Lite(SqlitePool),
    My(MySqlPool),
}

impl Db {
    pub async fn scalar(&self, sql: &str) -> i64 {
        match self {
            Db::Pg(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap(),
            Db::Lite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap(),
            Db::My(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap(),
        }
    }

    pub async fn orders(&self, sku: &str) -> i64 {
        self.scalar(&format!("SELECT COUNT(*) FROM orders WHERE sku = '{sku}'"))
            .await
    }

    pub async fn keys(&self) -> i64 {
        self.scalar("SELECT COUNT(*) FROM idempotency_keys").await
    }

    /// The state of the key the client sent as `key` (any scope and operation), if a row exists.
    pub async fn state_of(&self, key: &str) -> Option<String> {
        let sql = format!("SELECT state FROM idempotency_keys WHERE idem_key = '{key}'");
        match self {
            Db::Pg(pool) => sqlx::query_scalar(&sql).fetch_optional(pool).await.unwrap(),
            Db::Lite(pool) => sqlx::query_scalar(&sql).fetch_optional(pool).await.unwrap(),
            // `state` is `ascii_bin`, which sqlx reads as bytes.
            Db::My(pool) => sqlx::query_scalar(&sql.replacen(
                "SELECT state",
                "SELECT CONVERT(state USING utf8mb4)",
                1,
            ))
            .fetch_optional(pool)
            .await
            .unwrap(),
        }
    }

    pub async fn keys_in_state(&self, state: &str) -> i64 {
        self.scalar(&format!(
            "SELECT COUNT(*) FROM idempotency_keys WHERE state = '{state}'"
        ))
        .await
    }

    /// Polls until `count` returns `want`, for at most `within`; returns the last value.
    pub async fn wait_for_keys(&self, want: i64, within: Duration) -> i64 {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = self.keys().await;
            if now == want || tokio::time::Instant::now() > deadline {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A running test app: the fixture of the scenarios of `test_support::backend_tests!`.
pub struct TestApp {
    pub url: String,
    pub db: Db,
    pub client: reqwest::Client,
    _sqlite: Option<test_support::SqliteFile>,
}

impl TestApp {
    pub async fn postgres() -> Option<Self> {
        let url = test_support::fresh_postgres_url().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .unwrap();
        let store = PgStore::new(pool.clone());
        store.migrate().await.unwrap();
        let single_tx = single_transaction(&store);
        sqlx::query(
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, scope TEXT NOT NULL, sku TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        Some(Self {
            url: serve(app(store, single_tx)).await,
            db: Db::Pg(pool),
            client: reqwest::Client::new(),
            _sqlite: None,
        })
    }

    pub async fn mysql() -> Option<Self> {
        let url = test_support::fresh_mysql_url().await?;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .unwrap();
        let store = MySqlStore::new(pool.clone());
        store.migrate().await.unwrap();
        let single_tx = single_transaction(&store);
        sqlx::query(
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, scope VARCHAR(255) NOT NULL, sku VARCHAR(255) NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        Some(Self {
            url: serve(app(store, single_tx)).await,
            db: Db::My(pool),
            client: reqwest::Client::new(),
            _sqlite: None,
        })
    }

    pub async fn sqlite() -> Self {
        let file = test_support::fresh_sqlite();
        let store = SqliteStore::connect(&file.url).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::query(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL, sku TEXT NOT NULL)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        Self {
            // SQLite offers no single-transaction mode: that route reserves as usual.
            url: serve(app(store.clone(), Idempotency::new(store.clone()))).await,
            db: Db::Lite(store.pool().clone()),
            client: reqwest::Client::new(),
            _sqlite: Some(file),
        }
    }

    /// A POST to `path` as `user`, with an optional key and a JSON body.
    pub fn post(
        &self,
        path: &str,
        user: &str,
        key: Option<&str>,
        body: &serde_json::Value,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(format!("{}{path}", self.url))
            .header("x-user", user)
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request
    }
}

/// The app on a fresh database of the backend.
impl test_support::Fixture for TestApp {
    async fn open(backend: test_support::TestDatabase) -> Option<Self> {
        match backend {
            test_support::TestDatabase::Sqlite => Some(Self::sqlite().await),
            test_support::TestDatabase::Postgres => Self::postgres().await,
            test_support::TestDatabase::MySql => Self::mysql().await,
        }
    }
}

/// What a test needs of a response.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub async fn of(request: reqwest::RequestBuilder) -> Self {
        let response = request.send().await.expect("request sent");
        Self {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.bytes().await.expect("body read"),
        }
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts an RFC 9457 problem of `type_uri` with `status`.
    /// Asserts a problem document of the layer, under the default base.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, problem: ProblemType) {
        self.assert_problem_under(status, problem, DEFAULT_PROBLEM_BASE);
    }

    /// Asserts a problem document of the layer with its `type` under `base`: status, type,
    /// title, and the members that say what to do next.
    #[track_caller]
    pub fn assert_problem_under(&self, status: u16, problem: ProblemType, base: &str) {
        assert_eq!(problem.status(), status);
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let json = self.json();
        assert_eq!(json["type"], problem.type_uri(base), "{json}");
        assert_eq!(json["status"], status, "{json}");
        assert_eq!(json["title"], problem.title(), "{json}");
        assert_eq!(json["retry"], problem.retry().as_str(), "{json}");
        match problem.key_state() {
            Some(state) => assert_eq!(json["key_state"], state, "{json}"),
            None => assert!(json.get("key_state").is_none(), "{json}"),
        }
    }
}

pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}
