//! A durable route wired the shortest documented way ([`DurableRoute`]), its process SIGKILLed
//! in the middle of the provider call: the maintenance worker, with the same registry, finishes
//! the payment once (one charge at the provider, one payment row, the key completed with the
//! route's 201, replayed to the client's retry), on every backend. The process is this test
//! binary run again as a child (`the_child_pays_until_killed`), so the kill is a real SIGKILL.
//!
//! Also: a route whose operation is not in the registry refuses to build, and a worker whose
//! registry lacks the operation counts the key as `unregistered` and leaves it pending.

use axum::{body::Body, routing::post, Json, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{
    durable::{CallError, Finished, Lookup, Operation, Operations, StepError, Steps},
    maintenance::Recovery,
    store::KeyState,
    Idempotency, MySqlStore, PgStore, SqliteStore,
};
use idempotency_http::{DurableRoute, KeyLease, MissingScope, StoredResponse};
use serde_json::{json, Value};
use sqlx::SqlitePool;
use std::time::{Duration, Instant};
use test_support::TestDatabase as Backend;
use tower::ServiceExt;

const LEASE: Duration = Duration::from_millis(800);
const TRIALS: u32 = 3;
const URL_VAR: &str = "DURABLE_CHILD_URL";
const PROVIDER_VAR: &str = "DURABLE_CHILD_PROVIDER";
const KEY_VAR: &str = "DURABLE_CHILD_KEY";
/// What the child prints once the provider has charged, before it would answer.
const CHARGED: &str = "the provider charged";
const SCOPE: &str = "shop";
const NAME: &str = "pay";

/// The payment provider: a SQLite file of its own (outside the database that holds the keys),
/// keyed by our provider key. `calls` counts every call, `charges` holds one row per key.
#[derive(Clone)]
struct Provider {
    pool: SqlitePool,
    /// In the child: after charging, say so and never answer (the process is killed there).
    hang_after_charge: bool,
}

impl Provider {
    async fn open(url: &str, hang_after_charge: bool) -> Self {
        let pool = SqlitePool::connect(url).await.expect("the provider's file");
        for ddl in [
            "CREATE TABLE IF NOT EXISTS charges (provider_key TEXT PRIMARY KEY, cents INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS calls (provider_key TEXT NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&pool).await.expect("provider schema");
        }
        Self {
            pool,
            hang_after_charge,
        }
    }

    async fn charge(&self, provider_key: String, cents: i64) -> Result<String, CallError> {
        sqlx::query("INSERT INTO calls (provider_key) VALUES (?1)")
            .bind(&provider_key)
            .execute(&self.pool)
            .await
            .map_err(|e| CallError::Unknown(e.to_string()))?;
        sqlx::query("INSERT OR IGNORE INTO charges (provider_key, cents) VALUES (?1, ?2)")
            .bind(&provider_key)
            .bind(cents)
            .execute(&self.pool)
            .await
            .map_err(|e| CallError::Unknown(e.to_string()))?;
        if self.hang_after_charge {
            println!("{CHARGED}");
            std::future::pending::<()>().await;
        }
        Ok(format!("ch_{provider_key}"))
    }

    async fn lookup(&self, provider_key: String) -> Lookup<String> {
        match sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM charges WHERE provider_key = ?1")
            .bind(&provider_key)
            .fetch_one(&self.pool)
            .await
        {
            Ok(1) => Lookup::Done(format!("ch_{provider_key}")),
            Ok(_) => Lookup::NotDone,
            Err(e) => Lookup::Unknown(e.to_string()),
        }
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .expect("count at the provider")
    }
}

/// The durable operation: charge at the provider, then record the payment and answer 201.
struct Pay {
    provider: Provider,
}

/// `Operation` for each store type: the same steps, with the business write in its dialect.
macro_rules! pay_on {
    ($($store:ty),+) => {$(
        impl Operation<$store> for Pay {
            type Request = Value;
            type Response = StoredResponse;
            fn name(&self) -> &str {
                NAME
            }
            async fn run(
                &self,
                steps: &mut Steps<$store>,
                request: &Value,
            ) -> Result<Finished<StoredResponse>, StepError> {
                let cents = request["cents"].as_i64().unwrap_or(0);
                let provider = self.provider.clone();
                let lookup = self.provider.clone();
                let charge: String = steps
                    .call(
                        "charge",
                        move |provider_key| {
                            let provider = provider.clone();
                            async move { provider.charge(provider_key, cents).await }
                        },
                        move |provider_key| {
                            let lookup = lookup.clone();
                            async move { lookup.lookup(provider_key).await }
                        },
                    )
                    .await?;
                let insert = format!("INSERT INTO payments (charge) VALUES ('{charge}')");
                steps
                    .finish(async |tx| {
                        sqlx::query(&insert).execute(&mut **tx).await?;
                        StoredResponse::json(StatusCode::CREATED, &json!({ "charge": charge }))
                            .map_err(idempotency::durable::BoxError::from)
                    })
                    .await
            }
        }
    )+};
}
pay_on!(PgStore, SqliteStore, MySqlStore);

/// The registry of the service: the same for the route and for the worker.
fn operations<S: idempotency::store::Journal>(provider: Provider) -> Operations<S>
where
    Pay: Operation<S>,
{
    Operations::new().with(Pay { provider })
}

/// The service, wired as the `DurableRoute` docs show.
fn app<S: idempotency::store::Journal>(engine: Idempotency<S>, operations: &Operations<S>) -> Router
where
    Pay: Operation<S, Response = StoredResponse, Request = Value>,
{
    let pay: DurableRoute<S, Pay> =
        DurableRoute::new(engine, operations, NAME).expect("the operation is registered");
    let layer = pay
        .layer()
        .with_missing_scope(MissingScope::Fixed(SCOPE.into()));
    Router::new().route(
        "/payments",
        post(
            move |held: KeyLease<S>, Json(request): Json<Value>| async move {
                pay.perform(held, &request).await
            },
        )
        .layer(layer),
    )
}

fn payment(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"cents": 1250}"#))
        .expect("a request")
}

/// The child process of `a_killed_durable_route_is_finished_once_by_the_worker`: serves one
/// payment through the durable route, and is killed while the provider call has not answered.
#[tokio::test]
#[ignore = "the child process of the SIGKILL test, which runs it"]
async fn the_child_pays_until_killed() {
    let url = std::env::var(URL_VAR).expect("run by the SIGKILL test");
    let provider = std::env::var(PROVIDER_VAR).expect("run by the SIGKILL test");
    let key = std::env::var(KEY_VAR).expect("run by the SIGKILL test");
    let provider = Provider::open(&provider, true).await;
    let response = match backend_of(&url) {
        Backend::Postgres => {
            let store = PgStore::new(sqlx::PgPool::connect(&url).await.expect("connect"));
            serve_one(store, provider, &key).await
        }
        Backend::MySql => {
            let store = MySqlStore::new(sqlx::MySqlPool::connect(&url).await.expect("connect"));
            serve_one(store, provider, &key).await
        }
        Backend::Sqlite => {
            let store = SqliteStore::connect(&url).await.expect("open");
            serve_one(store, provider, &key).await
        }
    };
    panic!("the child answered ({response}) instead of being killed mid-call");
}

async fn serve_one<S: idempotency::store::Journal>(
    store: S,
    provider: Provider,
    key: &str,
) -> StatusCode
where
    Pay: Operation<S, Response = StoredResponse, Request = Value>,
{
    let engine = Idempotency::new(store).with_lease(LEASE);
    let operations = operations::<S>(provider);
    let response = app(engine, &operations)
        .oneshot(payment(key))
        .await
        .expect("infallible");
    response.status()
}

fn backend_of(url: &str) -> Backend {
    if url.starts_with("postgres") {
        Backend::Postgres
    } else if url.starts_with("mysql") {
        Backend::MySql
    } else {
        Backend::Sqlite
    }
}

const PAYMENTS_TABLE: &str = "CREATE TABLE payments (charge VARCHAR(200) PRIMARY KEY)";
const COUNT_PAYMENTS: &str = "SELECT COUNT(*) FROM payments";

async fn a_killed_durable_route_is_finished_once_by_the_worker(backend: Backend) {
    let db = backend
        .fresh_database()
        .await
        .expect("an available backend");
    let trials = i64::from(TRIALS);
    match backend {
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
            sqlx::query(PAYMENTS_TABLE)
                .execute(&pool)
                .await
                .expect("schema");
            kill_and_resume(PgStore::new(pool.clone()), &db.url).await;
            let payments: i64 = sqlx::query_scalar(COUNT_PAYMENTS)
                .fetch_one(&pool)
                .await
                .expect("count");
            assert_eq!(payments, trials, "one payment per key");
        }
        Backend::MySql => {
            let pool = sqlx::MySqlPool::connect(&db.url).await.expect("connect");
            sqlx::query(PAYMENTS_TABLE)
                .execute(&pool)
                .await
                .expect("schema");
            kill_and_resume(MySqlStore::new(pool.clone()), &db.url).await;
            let payments: i64 = sqlx::query_scalar(COUNT_PAYMENTS)
                .fetch_one(&pool)
                .await
                .expect("count");
            assert_eq!(payments, trials, "one payment per key");
        }
        Backend::Sqlite => {
            let pool = SqlitePool::connect(&db.url).await.expect("open");
            sqlx::query(PAYMENTS_TABLE)
                .execute(&pool)
                .await
                .expect("schema");
            kill_and_resume(SqliteStore::connect(&db.url).await.expect("open"), &db.url).await;
            let payments: i64 = sqlx::query_scalar(COUNT_PAYMENTS)
                .fetch_one(&pool)
                .await
                .expect("count");
            assert_eq!(payments, trials, "one payment per key");
        }
    }
}

/// Per trial: the child charges and is SIGKILLed before it answers. A worker without the
/// operation leaves the key pending and counts it; the worker with the service's registry
/// finishes it once the lease ends. Then one charge and one call per key at the provider, the
/// key completed with 201, and the client's retry gets that 201 replayed (the caller counts the
/// payment rows).
async fn kill_and_resume<S: idempotency::store::Journal + idempotency::store::Maintenance>(
    store: S,
    url: &str,
) where
    Pay: Operation<S, Response = StoredResponse, Request = Value>,
{
    store.migrate().await.expect("migrate");
    let dir = tempfile::tempdir().expect("a folder for the provider");
    let provider_url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("provider.db").display()
    );
    let provider = Provider::open(&provider_url, false).await;
    let engine = Idempotency::new(store.clone()).with_lease(LEASE);
    for trial in 0..TRIALS {
        let key = format!("pay-{trial}");
        let mut child = test_support::spawn_child_test(
            "the_child_pays_until_killed",
            &[
                (URL_VAR, url),
                (PROVIDER_VAR, &provider_url),
                (KEY_VAR, &key),
            ],
            CHARGED,
        )
        .await;
        child.kill().expect("SIGKILL");
        child.wait().expect("reap the child");

        let record_key = idempotency::IdempotencyKey::new(SCOPE, NAME, &key).expect("a key");
        let unregistered =
            Recovery::new(store.clone()).with_operations(engine.clone(), Operations::new());
        let resumer = Recovery::new(store.clone())
            .with_operations(engine.clone(), operations::<S>(provider.clone()));
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut counted_unregistered = false;
        loop {
            let record = store
                .find(&record_key)
                .await
                .expect("read")
                .expect("the key is kept");
            if record.state == KeyState::Completed {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the worker did not finish the payment: {record:?}"
            );
            if record.lease_expired() && !counted_unregistered {
                let report = unregistered.run_once().await.expect("a pass");
                assert_eq!(report.unregistered, 1, "{report}");
                assert_eq!(report.acted(), 0, "{report}");
                let still = store.find(&record_key).await.expect("read").expect("kept");
                assert_eq!(
                    still.state,
                    KeyState::Pending,
                    "left pending by a worker without the operation"
                );
                counted_unregistered = true;
            }
            if counted_unregistered {
                resumer.run_once().await.expect("a pass");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let record = store.find(&record_key).await.expect("read").expect("kept");
        let stored: StoredResponse =
            serde_json::from_slice(record.result.as_deref().expect("a stored response"))
                .expect("a stored response");
        assert_eq!(stored.status, 201);

        // The client's retry, to a new process of the service: the stored 201, replayed.
        let replay = app(engine.clone(), &operations::<S>(provider.clone()))
            .oneshot(payment(&key))
            .await
            .expect("infallible");
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let body = replay.into_body().collect().await.expect("body").to_bytes();
        let body: Value = serde_json::from_slice(&body).expect("json");
        assert!(body["charge"]
            .as_str()
            .is_some_and(|c| c.starts_with("ch_")));
    }
    let trials = i64::from(TRIALS);
    assert_eq!(
        provider.count("charges").await,
        trials,
        "one charge per payment"
    );
    assert_eq!(
        provider.count("calls").await,
        trials,
        "the worker asked by the key; it did not call again"
    );
}

test_support::backend_tests! {
    #[tokio::test]
    a_killed_durable_route_is_finished_once_by_the_worker,
}

#[tokio::test]
async fn a_route_whose_operation_is_not_registered_refuses_to_build() {
    let store = SqliteStore::connect("sqlite::memory:").await.expect("open");
    let dir = tempfile::tempdir().expect("a folder");
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("provider.db").display()
    );
    let provider = Provider::open(&url, false).await;
    let engine = Idempotency::new(store);
    let empty = Operations::<SqliteStore>::new();
    let refused = DurableRoute::<SqliteStore, Pay>::new(engine.clone(), &empty, NAME)
        .expect_err("an empty registry has no route");
    assert_eq!(refused.name(), NAME);
    let registry = operations::<SqliteStore>(provider);
    // Registered under its own name, not the route's: refused too.
    assert!(
        DurableRoute::<SqliteStore, Pay>::new(engine.clone(), &registry, "POST /payments").is_err()
    );
    assert!(DurableRoute::<SqliteStore, Pay>::new(engine, &registry, NAME).is_ok());
}
