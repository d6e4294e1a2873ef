//! Messages per second consumed from one RabbitMQ queue into one database, in one run, by
//!
//! * (a) a **plain** lapin consumer: per delivery, a transaction with the business insert, commit,
//!   `basic.ack`;
//! * (b) the **idempotent** consumer ([`AmqpConsumer`] + [`Inbox::handle`]): per delivery, the
//!   same insert, plus the key's reservation and completion;
//! * (c) the idempotent consumer when **every message arrives twice** (deliveries per second: half
//!   of them are replays);
//! * (d) on a database that offers it (PostgreSQL), the idempotent consumer with the engine's
//!   single-transaction mode (`Idempotency::with_single_transaction`): the key row is written in
//!   the business transaction, not in a reservation committed on its own.
//!
//! Both consumers use the same prefetch and the same number of deliveries in flight. Rounds
//! alternate (a), (b), (c) so that a drift of the machine affects all of them alike.
//!
//! ```sh
//! . .ci/rabbitmq.sh   # TEST_AMQP_URL
//! cargo run --release -p idempotency-amqp --example throughput -- \
//!     --messages 20000 --database-url postgres://idem:idem@127.0.0.1:5432/idem
//! ```
//!
//! Options: `--messages N` (default 20000), `--rounds N` (3), `--concurrency N` (16),
//! `--prefetch N` (64), `--database-url URL` (default: a SQLite file in a temporary folder),
//! `--amqp-url URL` (default `TEST_AMQP_URL`, else `amqp://idem:idem@127.0.0.1:5672/idem`),
//! `--replay-first` / `--no-replay-first` (force the engine's replay read before the
//! reservation on or off; by default the engine decides, as it does for a user who does not
//! set it: it reads first only while most recent reservations were replays).

use futures_util::{future::BoxFuture, StreamExt};
use idempotency::{queue::Inbox, Idempotency, PgStore, SqliteStore, Store};
use idempotency_amqp::{AmqpConsumer, Incoming, Topology};
use lapin::{
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions, QueueDeleteOptions,
    },
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use std::fmt::Write as _;
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tokio::{sync::Semaphore, task::JoinSet};

#[derive(Debug, Clone)]
struct Options {
    messages: u64,
    rounds: u32,
    concurrency: usize,
    prefetch: u16,
    database_url: Option<String>,
    amqp_url: String,
    /// `None`: the engine's adaptive default.
    replay_first: Option<bool>,
}

impl Options {
    fn parse() -> anyhow::Result<Self> {
        let mut options = Options {
            messages: 20_000,
            rounds: 3,
            concurrency: 16,
            prefetch: 64,
            database_url: None,
            amqp_url: std::env::var("TEST_AMQP_URL")
                .unwrap_or_else(|_| "amqp://idem:idem@127.0.0.1:5672/idem".into()),
            replay_first: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let mut value = || {
                args.next()
                    .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
            };
            match flag.as_str() {
                "--messages" => options.messages = value()?.parse()?,
                "--rounds" => options.rounds = value()?.parse()?,
                "--concurrency" => options.concurrency = value()?.parse()?,
                "--prefetch" => options.prefetch = value()?.parse()?,
                "--database-url" => options.database_url = Some(value()?),
                "--amqp-url" => options.amqp_url = value()?,
                "--replay-first" => options.replay_first = Some(true),
                "--no-replay-first" => options.replay_first = Some(false),
                other => anyhow::bail!("unknown option {other}"),
            }
        }
        Ok(options)
    }
}

/// The business table and its insert, per database.
trait Sink: Store + idempotency::store::CompletionSignal {
    const NAME: &'static str;
    fn insert<'t>(
        tx: &'t mut sqlx::Transaction<'_, Self::Database>,
        id: &'t str,
        body: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>>;
    fn begin_plain(
        &self,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, sqlx::Error>>;
    fn reset(&self) -> BoxFuture<'_, Result<(), sqlx::Error>>;
    fn count(&self) -> BoxFuture<'_, Result<i64, sqlx::Error>>;
    /// `engine` in the single-transaction mode, where the store offers it.
    fn single_transaction(engine: Idempotency<Self>, wait: Duration) -> Option<Idempotency<Self>> {
        let _ = (engine, wait);
        None
    }
}

impl Sink for PgStore {
    const NAME: &'static str = "PostgreSQL";
    fn insert<'t>(
        tx: &'t mut sqlx::Transaction<'_, sqlx::Postgres>,
        id: &'t str,
        body: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO throughput_orders (message_id, body) VALUES ($1, $2)")
                .bind(id)
                .bind(body)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }
    fn begin_plain(
        &self,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error>> {
        Box::pin(self.pool().begin())
    }
    fn reset(&self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("DROP TABLE IF EXISTS throughput_orders")
                .execute(self.pool())
                .await?;
            sqlx::query(
                "CREATE TABLE throughput_orders (message_id TEXT NOT NULL, body TEXT NOT NULL)",
            )
            .execute(self.pool())
            .await?;
            sqlx::query("DELETE FROM idempotency_keys WHERE scope LIKE 'throughput-%'")
                .execute(self.pool())
                .await
                .map(drop)
        })
    }
    fn count(&self) -> BoxFuture<'_, Result<i64, sqlx::Error>> {
        Box::pin(
            sqlx::query_scalar("SELECT count(*) FROM throughput_orders").fetch_one(self.pool()),
        )
    }
    fn single_transaction(engine: Idempotency<Self>, wait: Duration) -> Option<Idempotency<Self>> {
        Some(engine.with_single_transaction(wait))
    }
}

impl Sink for SqliteStore {
    const NAME: &'static str = "SQLite";
    fn insert<'t>(
        tx: &'t mut sqlx::Transaction<'_, sqlx::Sqlite>,
        id: &'t str,
        body: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO throughput_orders (message_id, body) VALUES (?1, ?2)")
                .bind(id)
                .bind(body)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }
    fn begin_plain(
        &self,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error>> {
        // The same `BEGIN IMMEDIATE` the store uses for business transactions.
        Box::pin(async move {
            self.begin()
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))
        })
    }
    fn reset(&self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("DROP TABLE IF EXISTS throughput_orders")
                .execute(self.pool())
                .await?;
            sqlx::query(
                "CREATE TABLE throughput_orders (message_id TEXT NOT NULL, body TEXT NOT NULL)",
            )
            .execute(self.pool())
            .await?;
            sqlx::query("DELETE FROM idempotency_keys WHERE scope LIKE 'throughput-%'")
                .execute(self.pool())
                .await
                .map(drop)
        })
    }
    fn count(&self) -> BoxFuture<'_, Result<i64, sqlx::Error>> {
        Box::pin(
            sqlx::query_scalar("SELECT count(*) FROM throughput_orders").fetch_one(self.pool()),
        )
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let options = Options::parse()?;
    let connection =
        Connection::connect(&options.amqp_url, ConnectionProperties::default()).await?;
    match options.database_url.clone() {
        Some(url) if url.starts_with("postgres") => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(options.concurrency as u32 + 4)
                .connect(&url)
                .await?;
            bench(PgStore::new(pool), &connection, &options).await
        }
        Some(url) => bench(SqliteStore::connect(&url).await?, &connection, &options).await,
        None => {
            let dir = tempfile::tempdir()?;
            let url = format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("throughput.db").display()
            );
            bench(SqliteStore::connect(&url).await?, &connection, &options).await
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Plain,
    Idempotent,
    IdempotentTwice,
    SingleTransaction,
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Plain => "(a) plain consumer: insert + commit + ack",
            Variant::Idempotent => "(b) idempotent consumer (Inbox::handle)",
            Variant::IdempotentTwice => "(c) idempotent, every message delivered twice",
            Variant::SingleTransaction => "(d) idempotent, single-transaction mode",
        }
    }
}

async fn bench<S: Sink>(
    store: S,
    connection: &Connection,
    options: &Options,
) -> anyhow::Result<()> {
    store.migrate().await?;
    let version = broker_version();
    let replay_first = match options.replay_first {
        None => "adaptive (the engine's default)".to_owned(),
        Some(forced) => format!("forced {forced}"),
    };
    println!(
        "{} messages per round, {} rounds; prefetch {}, {} deliveries in flight; {}; RabbitMQ {version}; replay read first: {replay_first}",
        options.messages, options.rounds, options.prefetch, options.concurrency, S::NAME
    );
    let mut variants = vec![
        Variant::Plain,
        Variant::Idempotent,
        Variant::IdempotentTwice,
    ];
    if S::single_transaction(Idempotency::new(store.clone()), Duration::ZERO).is_some() {
        variants.push(Variant::SingleTransaction);
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 1..=options.rounds {
        for (i, &variant) in variants.iter().enumerate() {
            store.reset().await?;
            let rate = measure(&store, connection, options, variant, round).await?;
            println!(
                "round {round}  {:<48} {rate:>8.0} deliveries/s",
                variant.label()
            );
            rates[i].push(rate);
        }
    }
    println!();
    let plain = median(&rates[0]);
    for (variant, rates) in variants.iter().zip(&rates) {
        let rate = median(rates);
        let mut line = format!("median  {:<48} {rate:>8.0} ", variant.label());
        match variant {
            Variant::Plain => line.push_str("messages/s"),
            Variant::IdempotentTwice => {
                let _ = write!(line, "deliveries/s ({:.0} messages/s)", rate / 2.0);
            }
            _ => {
                let _ = write!(line, "messages/s = {:.2}x plain", rate / plain);
            }
        }
        let _ = write!(line, "; spread {}", spread(rates));
        println!("{line}");
    }
    Ok(())
}

/// The median of `rates`.
fn median(rates: &[f64]) -> f64 {
    let mut sorted = rates.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The lowest and highest of `rates`: `min–max`.
fn spread(rates: &[f64]) -> String {
    let low = rates.iter().copied().fold(f64::INFINITY, f64::min);
    let high = rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{low:.0}–{high:.0}")
}

/// The broker's version, as `.ci/rabbitmq.sh` exports it.
fn broker_version() -> String {
    std::env::var("RABBITMQ_VERSION").unwrap_or_else(|_| "(version unknown)".into())
}

/// Publishes the round's messages, then times one consumer from its start until every delivery
/// is settled. Returns deliveries per second.
async fn measure<S: Sink>(
    store: &S,
    connection: &Connection,
    options: &Options,
    variant: Variant,
    round: u32,
) -> anyhow::Result<f64> {
    let run = format!(
        "throughput-{}-{round}-{}",
        variant as u8,
        std::process::id()
    );
    let topology = Topology::new(&run);
    let setup = connection.create_channel().await?;
    topology.declare(&setup).await?;
    let copies = if variant == Variant::IdempotentTwice {
        2
    } else {
        1
    };
    publish(connection, topology.queue(), options.messages, copies).await?;
    let deliveries = options.messages * copies;

    let done = Arc::new(AtomicU64::new(0));
    let channel = connection.create_channel().await?;
    let started = Instant::now();
    match variant {
        Variant::Plain => {
            plain(store, channel, topology.queue(), options, deliveries, done).await?
        }
        Variant::Idempotent | Variant::IdempotentTwice | Variant::SingleTransaction => {
            let handler = {
                let done = done.clone();
                move |incoming: Incoming<S>| {
                    let done = done.clone();
                    async move {
                        let id = incoming.attempt().key().key().to_owned();
                        let body = String::from_utf8_lossy(incoming.payload()).into_owned();
                        let action = incoming
                            .handle(async move |tx| S::insert(tx, &id, &body).await)
                            .await;
                        if action.is_ack() {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        action
                    }
                }
            };
            let mut engine = Idempotency::new(store.clone());
            if let Some(forced) = options.replay_first {
                engine = engine.with_replay_first(forced);
            }
            if variant == Variant::SingleTransaction {
                engine = S::single_transaction(engine, Duration::from_secs(5))
                    .expect("offered by the store");
            }
            let inbox = Inbox::new(engine);
            let running = AmqpConsumer::for_topology(channel, &topology, inbox, handler)
                .with_prefetch(options.prefetch)
                .with_concurrency(options.concurrency)
                .spawn();
            while done.load(Ordering::Relaxed) < deliveries {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let report = running.shutdown().await?;
            anyhow::ensure!(report.executed == options.messages, "{report}");
        }
    }
    let elapsed = started.elapsed();
    anyhow::ensure!(
        store.count().await? == options.messages as i64,
        "every message applied exactly once"
    );
    for queue in [topology.queue(), topology.dead_letter_queue()] {
        setup
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await?;
    }
    Ok(deliveries as f64 / elapsed.as_secs_f64())
}

/// Publishes `messages` JSON messages (each `copies` times in a row) with confirms.
async fn publish(
    connection: &Connection,
    queue: &str,
    messages: u64,
    copies: u64,
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for n in 0..messages {
        let body = format!(
            r#"{{"order": {n}, "sku": "tea", "cents": {}}}"#,
            100 + n % 900
        );
        for _ in 0..copies {
            let properties = BasicProperties::default()
                .with_message_id(format!("m-{n}").into())
                .with_type("order.paid".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            // Not awaited one by one: the broker confirms in batches, waited for below.
            drop(
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        properties,
                    )
                    .await?,
            );
        }
    }
    channel.wait_for_confirms().await?;
    channel.close(200, "published".into()).await?;
    Ok(())
}

/// The plain consumer: the same prefetch and deliveries in flight; insert, commit, ack.
async fn plain<S: Sink>(
    store: &S,
    channel: Channel,
    queue: &str,
    options: &Options,
    deliveries: u64,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    channel
        .basic_qos(options.prefetch, BasicQosOptions::default())
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let slots = Arc::new(Semaphore::new(options.concurrency));
    let mut tasks = JoinSet::new();
    let mut received = 0;
    while received < deliveries {
        let slot = slots.clone().acquire_owned().await?;
        let Some(delivery) = consumer.next().await else {
            anyhow::bail!("the consumer was cancelled");
        };
        let delivery = delivery?;
        received += 1;
        let (store, done) = (store.clone(), done.clone());
        tasks.spawn(async move {
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default();
            let body = String::from_utf8_lossy(&delivery.data).into_owned();
            let mut tx = store.begin_plain().await?;
            S::insert(&mut tx, &id, &body).await?;
            tx.commit().await?;
            delivery
                .ack(BasicAckOptions::default())
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            done.fetch_add(1, Ordering::Relaxed);
            drop(slot);
            Ok::<_, sqlx::Error>(())
        });
    }
    while let Some(task) = tasks.join_next().await {
        task??;
    }
    channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await?;
    Ok(())
}
