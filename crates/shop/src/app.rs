//! The service: state, router, demo authentication, and serving.

use crate::{
    db::{self, Kind, ProviderDb, ShopDb},
    metrics,
    problem::{Problem, ShopProblem, BODY_LIMIT},
    protect::{keyed, KeyedRoute},
    providers::{Faults, MailProvider, PaymentProvider},
    purchase::Purchase,
    routes,
    tx::plain_tx,
};
use axum::{
    extract::{DefaultBodyLimit, Request, State},
    http::StatusCode,
    middleware::{from_fn, from_fn_with_state, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use idempotency::{
    Effects, Idempotency, MaintenanceWorker, Operations, PgStore, SqliteStore, WorkerHandle,
};
use std::{net::SocketAddr, sync::Arc, time::Duration};
use tower_http::catch_panic::CatchPanicLayer;

/// Every user's balance before their first purchase.
pub const START_BALANCE_CENTS: i64 = 100_000;

/// The demo authentication header.
pub const USER_HEADER: &str = "x-user-id";

/// How the service is configured.
#[derive(Debug, Clone)]
pub struct Config {
    /// `sqlite://FILE` or `postgres://…`.
    pub database_url: String,
    /// Payment provider faults.
    pub payment: Faults,
    /// Mail provider faults.
    pub mail: Faults,
    /// Also mount `POST /unprotected/purchases` (the purchase handler without the idempotency middleware), for
    /// the benchmark.
    pub bench_routes: bool,
    /// Size of the shop's connection pool (PostgreSQL).
    pub max_connections: u32,
    /// Serve `POST /purchases` **without** the idempotency middleware (a deliberately broken shop, to show that
    /// the storm catches double charges).
    pub unguarded_purchases: bool,
    /// How long a request may hold its key before another may take it over (local routes) or
    /// the recovery job may look at it (external routes).
    pub lease: Duration,
    /// The pause between passes of the maintenance worker (resume, recover, purge); `None`
    /// runs no worker.
    pub worker_interval: Option<Duration>,
    /// How long a duplicate of a keyed request still in flight waits for it, to answer with its
    /// stored response instead of a 409 (`IdempotencyLayer::with_wait_for_in_flight`); `None`: 409 at
    /// once.
    pub wait_for_in_flight: Option<Duration>,
    /// The broker the outbox relay publishes purchase events to (`amqp://…`); `None`: no
    /// outbox rows are written and no relay runs.
    pub amqp_url: Option<String>,
    /// The share of outbox rows the relay publishes twice on purpose (fault proof).
    pub outbox_duplicate_share: f64,
}

impl Config {
    /// Defaults for a database URL: no faults, no bench routes.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            payment: Faults::default(),
            mail: Faults::default(),
            bench_routes: false,
            max_connections: 16,
            unguarded_purchases: false,
            lease: Duration::from_secs(30),
            worker_interval: Some(Duration::from_secs(1)),
            wait_for_in_flight: None,
            amqp_url: None,
            outbox_duplicate_share: 0.0,
        }
    }
}

/// The idempotency engine on the shop's backend.
#[derive(Debug, Clone)]
pub enum Engine {
    /// On PostgreSQL.
    Pg(Idempotency<PgStore>),
    /// On SQLite.
    Sqlite(Idempotency<SqliteStore>),
}

/// The authenticated user (demo: taken from `X-User-Id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserId(pub String);

struct Inner {
    db: ShopDb,
    engine: Engine,
    providers: ProviderDb,
    payment: PaymentProvider,
    mail: MailProvider,
    purchase: Arc<Purchase>,
    events: Arc<crate::events::PurchaseEvents>,
    wait_for_in_flight: Option<Duration>,
}

/// Shared state of the service.
#[derive(Clone)]
pub struct App(Arc<Inner>);

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("db", &self.0.db.kind())
            .finish()
    }
}

impl App {
    /// Connects, migrates (the idempotency key table, the shop's and the providers' tables) and
    /// builds the state.
    pub async fn connect(config: &Config) -> anyhow::Result<Self> {
        let (db, providers) = db::connect(&config.database_url, config.max_connections).await?;
        db.migrate().await?;
        providers.migrate().await?;
        let lease = config.lease;
        let engine = match &db {
            ShopDb::Pg(store) => Engine::Pg(Idempotency::new(store.clone()).with_lease(lease)),
            ShopDb::Sqlite(store) => {
                Engine::Sqlite(Idempotency::new(store.clone()).with_lease(lease))
            }
        };
        let payment = PaymentProvider::new(providers.clone(), config.payment);
        Ok(Self(Arc::new(Inner {
            purchase: Arc::new(Purchase::new(payment.clone(), config.amqp_url.is_some())),
            payment,
            mail: MailProvider::new(providers.clone(), config.mail),
            events: Arc::new(crate::events::PurchaseEvents::new(MailProvider::new(
                providers.clone(),
                config.mail,
            ))),
            db,
            engine,
            providers,
            wait_for_in_flight: config.wait_for_in_flight,
        })))
    }

    /// The shop's database.
    pub fn db(&self) -> &ShopDb {
        &self.0.db
    }

    /// The idempotency engine.
    pub fn engine(&self) -> &Engine {
        &self.0.engine
    }

    /// The providers' database.
    pub fn providers(&self) -> &ProviderDb {
        &self.0.providers
    }

    /// The payment provider.
    pub fn payment(&self) -> &PaymentProvider {
        &self.0.payment
    }

    /// The mail provider.
    pub fn mail(&self) -> &MailProvider {
        &self.0.mail
    }

    /// The durable purchase operation.
    pub fn purchase(&self) -> &Purchase {
        &self.0.purchase
    }

    /// The durable operation `shop worker` runs per purchase event (registered with the
    /// maintenance worker too, which carries on an event whose worker died).
    pub fn purchase_events(&self) -> &Arc<crate::events::PurchaseEvents> {
        &self.0.events
    }

    /// Starts the maintenance worker: purchases (and purchase events) whose client or process
    /// went away are carried on from their recovery point, abandoned local keys released, e-mails of unknown outcome
    /// parked, expired keys purged.
    pub fn spawn_worker(&self, interval: Duration) -> WorkerHandle {
        match self.engine() {
            Engine::Pg(engine) => MaintenanceWorker::new(engine.store().clone())
                .with_operations(
                    engine.clone(),
                    Operations::new()
                        .with_shared(self.0.purchase.clone())
                        .with_shared(self.0.events.clone()),
                )
                .with_interval(interval)
                .spawn(),
            Engine::Sqlite(engine) => MaintenanceWorker::new(engine.store().clone())
                .with_operations(
                    engine.clone(),
                    Operations::new()
                        .with_shared(self.0.purchase.clone())
                        .with_shared(self.0.events.clone()),
                )
                .with_interval(interval)
                .spawn(),
        }
    }

    /// How long a duplicate of a keyed request in flight waits for it (see
    /// [`Config::wait_for_in_flight`]).
    pub fn wait_for_in_flight(&self) -> Option<Duration> {
        self.0.wait_for_in_flight
    }

    /// Which backend.
    pub fn kind(&self) -> Kind {
        self.0.db.kind()
    }
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

/// The router of the service.
pub fn router(app: App, config: &Config) -> Router {
    let plain = from_fn_with_state(app.clone(), plain_tx);
    let purchase = if config.unguarded_purchases {
        post(routes::purchase_unprotected)
    } else {
        keyed(&app, PURCHASE, post(routes::purchase))
    };
    let mut user_routes = Router::new()
        .route("/purchases", purchase)
        .route(
            "/orders",
            keyed(&app, CREATE_ORDER, post(routes::create_order)),
        )
        .route("/orders/{id}", get(routes::get_order))
        .route(
            "/orders/{id}/pay",
            post(routes::pay_order).layer(plain.clone()),
        )
        .route(
            "/points/grants",
            post(routes::grant_points).layer(plain.clone()),
        )
        .route("/emails", keyed(&app, SEND_EMAIL, post(routes::send_email)))
        .route("/users/{id}/ledger", get(routes::ledger));
    if config.bench_routes {
        user_routes =
            user_routes.route("/unprotected/purchases", post(routes::purchase_unprotected));
    }
    Router::new()
        .merge(user_routes.layer(from_fn(authenticate)))
        .route("/healthz", get(healthz))
        .route("/metrics", get(render_metrics))
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::shop(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "this route does not accept that method",
            )
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        // A panicking handler answers 500 problem JSON instead of closing the connection.
        .layer(CatchPanicLayer::custom(|_| {
            Problem::panicked().into_response()
        }))
        .with_state(app)
}

/// 401 for a request without a valid `X-User-Id`.
pub fn unauthenticated() -> Problem {
    Problem::shop(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "Authentication required",
        "send X-User-Id: <id> (1 to 64 characters of A-Z a-z 0-9 _ -)",
    )
}

/// Demo authentication: `X-User-Id` names the user.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get(USER_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|id| {
            !id.is_empty()
                && id.len() <= 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
        .map(|id| UserId(id.to_owned()));
    match user {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => unauthenticated().into_response(),
    }
}

async fn healthz(State(app): State<App>) -> Response {
    let ok = match app.db().read().await {
        Ok(mut conn) => crate::on_conn!(conn.conn(), |c| sqlx::query("SELECT 1")
            .execute(&mut *c)
            .await
            .is_ok()),
        Err(_) => false,
    };
    if ok {
        axum::Json(serde_json::json!({"status": "ok", "database": app.kind().name()}))
            .into_response()
    } else {
        Problem::shop(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy",
            "Database unreachable",
            "the database does not answer",
        )
        .into_response()
    }
}

async fn render_metrics() -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::handle().render(),
    )
        .into_response()
}

/// A running service (in this process).
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The state (for direct database checks).
    pub app: App,
    task: tokio::task::JoinHandle<()>,
    worker: Option<WorkerHandle>,
    relay: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// The base URL, `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the maintenance worker after its pass under way (a no-op without one).
    pub async fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            let report = worker.shutdown().await;
            tracing::debug!(%report, "maintenance worker stopped");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(relay) = &self.relay {
            relay.abort();
        }
    }
}

/// Connects, migrates, binds `listen` (port 0 picks a free port) and serves in a background task.
pub async fn start(config: &Config, listen: &str) -> anyhow::Result<Running> {
    metrics::handle();
    let app = App::connect(config).await?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let router = router(app.clone(), config);
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            tracing::error!(%error, "server stopped");
        }
    });
    let worker = config
        .worker_interval
        .map(|interval| app.spawn_worker(interval));
    let relay = config.amqp_url.as_ref().map(|url| {
        let relay = crate::outbox::Relay::new(app.db().clone(), url)
            .with_duplicate_share(config.outbox_duplicate_share);
        tokio::spawn(relay.run())
    });
    Ok(Running {
        addr,
        app,
        task,
        worker,
        relay,
    })
}
