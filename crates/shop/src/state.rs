//! The service's shared state ([`App`]) and its configuration ([`Config`]).

use crate::{
    db::{self, Kind, ProviderDb, ShopDb, StoreConn},
    events::PurchaseEvents,
    providers::{Faults, MailProvider, PaymentProvider},
    purchase::Purchase,
};
use idempotency::{
    durable::Operations,
    maintenance::{MaintenanceWorker, WorkerHandle},
    store::Maintenance,
    Idempotency, MySqlStore, PgStore, SqliteStore,
};
use std::{sync::Arc, time::Duration};

/// How the service is configured.
#[derive(Debug, Clone)]
pub struct Config {
    /// `sqlite://FILE`, `postgres://…` or `mysql://…` (MariaDB).
    pub database_url: String,
    /// Where the simulated providers keep their state (any of the same kinds of URL); `None`:
    /// in the shop's database (a SQLite shop: `FILE.providers`). A real provider's state lives
    /// outside the shop's database: give it one of its own where that matters, e.g. when the
    /// shop's database fails over and may lose its last commits.
    pub provider_database_url: Option<String>,
    /// Payment provider faults.
    pub payment: Faults,
    /// Mail provider faults.
    pub mail: Faults,
    /// Also mount `POST /unprotected/purchases` (the purchase handler without the idempotency middleware), for
    /// the benchmark.
    pub bench_routes: bool,
    /// Size of the shop's connection pool (PostgreSQL, MariaDB).
    pub max_connections: u32,
    /// Serve `POST /purchases` **without** the idempotency middleware (a deliberately broken shop, to show that
    /// the storm catches double charges).
    pub unguarded_purchases: bool,
    /// How long a request may hold its key before another may take it over (local routes) or
    /// the recovery job may look at it (external routes).
    pub lease: Duration,
    /// Whether a held lease is extended while its request works (`Idempotency::with_heartbeat`);
    /// off, a request working longer than `lease` loses its key to a retry.
    pub heartbeat: bool,
    /// Replays of results this process completed answered from memory
    /// (`Idempotency::with_replay_cache`), at most this many; `None`: off (the default).
    pub replay_cache: Option<usize>,
    /// The pause between passes of the maintenance worker (resume, recover, purge); `None`
    /// runs no worker.
    pub worker_interval: Option<Duration>,
    /// How long a duplicate of a keyed request still in flight waits for it, to answer with its
    /// stored response instead of a 409 (`IdempotencyLayer::with_wait_for_in_flight`); `None`: 409 at
    /// once.
    pub wait_for_in_flight: Option<Duration>,
    /// Local keyed work reserves its key inside the business transaction, a duplicate waiting
    /// at most this long for the holder's commit (`Idempotency::with_single_transaction`;
    /// PostgreSQL and MariaDB; `None`: off).
    pub single_transaction: Option<Duration>,
    /// The broker the outbox relay publishes purchase events to (`amqp://…`, or the
    /// comma-separated URLs of a cluster's nodes); `None`: no outbox rows are written and no
    /// relay runs.
    pub amqp_url: Option<String>,
    /// Declare the purchase events' queues as quorum queues (a RabbitMQ cluster).
    pub amqp_quorum_queues: bool,
    /// The share of outbox rows the relay publishes twice on purpose (fault proof).
    pub outbox_duplicate_share: f64,
}

impl Config {
    /// Defaults for a database URL: no faults, no bench routes.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            provider_database_url: None,
            payment: Faults::default(),
            mail: Faults::default(),
            bench_routes: false,
            max_connections: 16,
            unguarded_purchases: false,
            lease: Duration::from_secs(10),
            heartbeat: true,
            replay_cache: None,
            worker_interval: Some(Duration::from_secs(1)),
            wait_for_in_flight: None,
            single_transaction: None,
            amqp_url: None,
            amqp_quorum_queues: false,
            outbox_duplicate_share: 0.0,
        }
    }
}

/// An engine on `store` with the configured lease, heartbeat and replay cache.
fn configured<S: idempotency::Store>(store: &S, config: &Config) -> Idempotency<S> {
    let engine = Idempotency::new(store.clone())
        .with_lease(config.lease)
        .with_heartbeat(config.heartbeat);
    match config.replay_cache {
        Some(capacity) => engine.with_replay_cache(capacity),
        None => engine,
    }
}

/// The idempotency engine on the shop's backend.
#[derive(Debug, Clone)]
pub enum Engine {
    /// On PostgreSQL.
    Pg(Idempotency<PgStore>),
    /// On SQLite.
    Sqlite(Idempotency<SqliteStore>),
    /// On MariaDB.
    My(Idempotency<MySqlStore>),
}

struct Inner {
    db: ShopDb,
    engine: Engine,
    providers: ProviderDb,
    payment: PaymentProvider,
    mail: MailProvider,
    purchase: Arc<Purchase>,
    events: Arc<PurchaseEvents>,
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
        let (db, providers) = db::connect_with(
            &config.database_url,
            config.provider_database_url.as_deref(),
            config.max_connections,
        )
        .await?;
        db.migrate().await?;
        providers.migrate().await?;
        let engine = match &db {
            ShopDb::Pg(store) => Engine::Pg(match config.single_transaction {
                Some(wait) => configured(store, config).with_single_transaction(wait),
                None => configured(store, config),
            }),
            ShopDb::Sqlite(store) => Engine::Sqlite(configured(store, config)),
            ShopDb::My(store) => Engine::My(match config.single_transaction {
                Some(wait) => configured(store, config).with_single_transaction(wait),
                None => configured(store, config),
            }),
        };
        let payment = PaymentProvider::new(providers.clone(), config.payment);
        Ok(Self(Arc::new(Inner {
            purchase: Arc::new(Purchase::new(payment.clone(), config.amqp_url.is_some())),
            payment,
            mail: MailProvider::new(providers.clone(), config.mail),
            events: Arc::new(PurchaseEvents::new(MailProvider::new(
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
    pub fn purchase_events(&self) -> &Arc<PurchaseEvents> {
        &self.0.events
    }

    /// Starts the maintenance worker: purchases (and purchase events) whose client or process
    /// went away are carried on from their recovery point, abandoned local keys released, e-mails of unknown outcome
    /// parked, expired keys purged.
    pub fn spawn_worker(&self, interval: Duration) -> WorkerHandle {
        match self.engine() {
            Engine::Pg(engine) => self.worker_on(engine, interval),
            Engine::Sqlite(engine) => self.worker_on(engine, interval),
            Engine::My(engine) => self.worker_on(engine, interval),
        }
    }

    fn worker_on<S: Maintenance + StoreConn>(
        &self,
        engine: &Idempotency<S>,
        interval: Duration,
    ) -> WorkerHandle {
        MaintenanceWorker::new(engine.store().clone())
            .with_operations(engine.clone(), self.operations())
            .with_interval(interval)
            .spawn()
    }

    /// The durable operations, by name: one registry for the routes
    /// ([`purchase_route`](crate::protect::purchase_route)) and for the worker that resumes them,
    /// whichever process runs it.
    pub fn operations<S: StoreConn>(&self) -> Operations<S> {
        Operations::new()
            .with_shared(self.0.purchase.clone())
            .with_shared(self.0.events.clone())
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
