//! A broker from `TEST_AMQP_URL`, stores on fresh databases with a business table `applied` (and
//! the map from a backend to its store for `test_support::backend_tests!`), and helpers to publish
//! and to wait.
//!
//! Without `TEST_AMQP_URL` the tests print `SKIPPED` and pass, **except under CI** (`CI` set),
//! where they fail; with it set, an unreachable broker fails them. `. .ci/rabbitmq.sh` starts one.
#![allow(dead_code)]

use idempotency::{MySqlStore, PgStore, SqliteStore, Store};
use lapin::{
    options::{
        BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions,
        QueueDeleteOptions,
    },
    types::FieldTable,
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
};
use sqlx::Transaction;
use std::{future::Future, time::Duration};

const AMQP_VAR: &str = "TEST_AMQP_URL";

/// How long a test waits for anything before it fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// A connection to the test broker, or `None` when the tests are skipped (never under CI).
pub async fn broker() -> Option<Connection> {
    let url = match std::env::var(AMQP_VAR) {
        Ok(url) if !url.is_empty() => url,
        _ if test_support::in_ci() => {
            panic!("{AMQP_VAR} is not set, but CI is: the RabbitMQ tests must run in CI")
        }
        _ => {
            // Written to stderr directly, past the test harness's capture, so a skip is seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {AMQP_VAR} is not set; this test needs RabbitMQ (see .ci/rabbitmq.sh)"
            );
            return None;
        }
    };
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("{AMQP_VAR}={url} is set but the broker is unreachable: {e}"));
    Some(connection)
}

/// A fresh queue name.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A store on a fresh database with the business table `applied (message_id, body)`.
pub trait TestStore: Store + idempotency::store::CompletionSignal + Sized {
    /// The backend's name, for messages.
    const NAME: &'static str;

    /// A migrated store, or `None` when the backend is not configured (never under CI).
    fn open() -> impl Future<Output = Option<Self>> + Send;

    /// The business write, in the business transaction.
    fn apply<'t>(
        tx: &'t mut Transaction<'_, Self::Database>,
        message_id: &'t str,
        body: &'t str,
    ) -> futures_util::future::BoxFuture<'t, Result<(), sqlx::Error>>;

    /// How many rows `message_id` has.
    fn applied(&self, message_id: &str) -> impl Future<Output = i64> + Send;

    /// All rows.
    fn applied_total(&self) -> impl Future<Output = i64> + Send;
}

/// Keeps the SQLite files alive for the whole test binary.
static SQLITE_FILES: std::sync::Mutex<Vec<test_support::SqliteFile>> =
    std::sync::Mutex::new(Vec::new());

impl TestStore for SqliteStore {
    const NAME: &'static str = "sqlite";

    async fn open() -> Option<Self> {
        let file = test_support::fresh_sqlite();
        let store = SqliteStore::connect(&file.url).await.expect("open sqlite");
        SQLITE_FILES.lock().unwrap().push(file);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE applied (message_id TEXT NOT NULL, body TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("business table");
        Some(store)
    }

    fn apply<'t>(
        tx: &'t mut Transaction<'_, sqlx::Sqlite>,
        message_id: &'t str,
        body: &'t str,
    ) -> futures_util::future::BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO applied (message_id, body) VALUES (?1, ?2)")
                .bind(message_id)
                .bind(body)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn applied(&self, message_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied WHERE message_id = ?1")
            .bind(message_id)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }

    async fn applied_total(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied")
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
}

impl TestStore for PgStore {
    const NAME: &'static str = "postgres";

    async fn open() -> Option<Self> {
        let url = test_support::fresh_postgres_url().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .expect("connect to the fresh postgres database");
        let store = PgStore::new(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE applied (message_id TEXT NOT NULL, body TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .expect("business table");
        Some(store)
    }

    fn apply<'t>(
        tx: &'t mut Transaction<'_, sqlx::Postgres>,
        message_id: &'t str,
        body: &'t str,
    ) -> futures_util::future::BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO applied (message_id, body) VALUES ($1, $2)")
                .bind(message_id)
                .bind(body)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn applied(&self, message_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied WHERE message_id = $1")
            .bind(message_id)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }

    async fn applied_total(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied")
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
}

impl TestStore for MySqlStore {
    const NAME: &'static str = "mysql";

    async fn open() -> Option<Self> {
        let url = test_support::fresh_mysql_url().await?;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .expect("connect to the fresh mysql database");
        let store = MySqlStore::new(pool);
        store.migrate().await.expect("migrate");
        sqlx::query(
            "CREATE TABLE applied (message_id VARCHAR(255) NOT NULL, body TEXT NOT NULL) ENGINE = InnoDB",
        )
        .execute(store.pool())
        .await
        .expect("business table");
        Some(store)
    }

    fn apply<'t>(
        tx: &'t mut Transaction<'_, sqlx::MySql>,
        message_id: &'t str,
        body: &'t str,
    ) -> futures_util::future::BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO applied (message_id, body) VALUES (?, ?)")
                .bind(message_id)
                .bind(body)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    async fn applied(&self, message_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied WHERE message_id = ?")
            .bind(message_id)
            .fetch_one(self.pool())
            .await
            .expect("count")
    }

    async fn applied_total(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM applied")
            .fetch_one(self.pool())
            .await
            .expect("count")
    }
}

/// Runs the generic test `$test` (`async fn name<S: TestStore>(store: S)`) on `$backend`'s store:
/// this crate's map from a backend to its store type, for the `via` of
/// `test_support::backend_tests!`, which lists the backends. Exhaustive: a backend added there
/// must be given its store here.
#[macro_export]
macro_rules! on_store {
    ($backend:expr, $test:path) => {
        match $backend {
            test_support::TestDatabase::Sqlite => {
                $crate::common::run_on_fresh::<idempotency::SqliteStore, _>($test).await
            }
            test_support::TestDatabase::Postgres => {
                $crate::common::run_on_fresh::<idempotency::PgStore, _>($test).await
            }
            test_support::TestDatabase::MySql => {
                $crate::common::run_on_fresh::<idempotency::MySqlStore, _>($test).await
            }
        }
    };
}

/// Runs `test` on a fresh `S`; nothing when the backend is skipped.
pub async fn run_on_fresh<S: TestStore, Fut: Future<Output = ()>>(test: impl FnOnce(S) -> Fut) {
    if let Some(store) = S::open().await {
        test(store).await;
    }
}

/// A publishing channel with publisher confirms.
pub async fn publisher(connection: &Connection) -> Channel {
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    channel
}

/// JSON message properties with `message_id` (none when `None`).
pub fn json_properties(message_id: Option<&str>) -> BasicProperties {
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_type("order.paid".into())
        .with_delivery_mode(2);
    match message_id {
        Some(id) => properties.with_message_id(id.into()),
        None => properties,
    }
}

/// Publishes `body` to `queue` (default exchange) and waits for the broker's confirm.
pub async fn publish(channel: &Channel, queue: &str, properties: BasicProperties, body: &[u8]) {
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(matches!(confirm, Confirmation::Ack(None)), "{confirm:?}");
}

/// How many messages are ready in `queue`.
pub async fn ready(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
}

/// Deletes a topology's queues and exchange.
pub async fn delete(channel: &Channel, topology: &idempotency_amqp::Topology) {
    for queue in [topology.queue(), topology.dead_letter_queue()] {
        let _ = channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = channel
        .exchange_delete(
            topology.dead_letter_exchange().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
}

/// Waits until `check` holds, or fails after [`WAIT`] with `what`.
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}
