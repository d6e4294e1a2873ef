//! `shop worker`: consumes the purchase events the outbox relay publishes
//! ([`PURCHASES_QUEUE`]) with [`idempotency_amqp`], exactly once per event whatever the broker
//! redelivers. Each event is the durable operation [`PurchaseEvents`] (points, then a receipt).
//!
//! The delivery is acked only after the operation committed; a worker killed before that gets
//! the delivery again from the broker, which the key turns into a replay (or a resumption from
//! the last step).

use crate::{
    db::StoreConn,
    events::PurchaseEvents,
    outbox::{purchases_topology, PurchasePaid, PURCHASES_QUEUE},
    providers::Faults,
    state::{App, Config, Engine},
};
use anyhow::Context;
use idempotency::{
    queue::{DeadLetter, DeliveryAction, Inbox},
    Idempotency,
};
use idempotency_amqp::{AmqpConsumer, Brokers, Incoming};
use lapin::ConnectionProperties;
use std::{sync::Arc, time::Duration};

/// Options of `shop worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The shop's database (the same as the shop's).
    #[arg(long, env = "SHOP_DATABASE_URL", default_value = "sqlite://shop.db")]
    pub database_url: String,
    /// The providers' database (the same as the shop's; default: the shop's database).
    #[arg(long, env = "SHOP_PROVIDER_DATABASE_URL")]
    pub provider_database_url: Option<String>,
    /// The broker: one URL, or the comma-separated URLs of a cluster's nodes (tried in turn on
    /// each reconnection).
    #[arg(
        long,
        env = "SHOP_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// Declare the queues as quorum queues (a RabbitMQ cluster; the shop's relay must say the
    /// same).
    #[arg(long, env = "SHOP_AMQP_QUORUM_QUEUES")]
    pub amqp_quorum_queues: bool,
    /// Deliveries the broker sends ahead.
    #[arg(long, default_value_t = 32)]
    pub prefetch: u16,
    /// Deliveries handled at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Probability that a mail provider call fails (half of the failures after sending).
    #[arg(long, default_value_t = 0.0)]
    pub mail_fail_rate: f64,
    /// How long an event's key is held before the next delivery (or the maintenance worker) may
    /// carry on the event of a worker that died, in milliseconds (a live worker's lease is
    /// extended while it works).
    #[arg(long, default_value_t = 10_000)]
    pub lease_ms: u64,
}

/// The consumer's scope in the key table.
pub const SCOPE: &str = "shop.worker";

/// Runs the worker until Ctrl-C or SIGTERM; reconnects after the broker went away.
pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let mut config = Config::new(&args.database_url);
    config.provider_database_url = args.provider_database_url.clone();
    config.mail = Faults {
        fail_rate: args.mail_fail_rate,
        latency: Duration::ZERO,
    };
    config.lease = Duration::from_millis(args.lease_ms);
    let app = App::connect(&config).await?;
    let operation = app.purchase_events().clone();
    // Carries on the events of a worker that died with their key pending, once its lease ended
    // (the next delivery would too, but a message may never come back: it was acked, or the
    // broker lost it).
    let _maintenance = app.spawn_worker(Duration::from_secs(1));
    let mut brokers = Brokers::parse(&args.amqp_url);
    let nodes: Vec<&str> = brokers
        .urls()
        .iter()
        .map(|url| url.rsplit('@').next().unwrap_or_default())
        .collect();
    println!(
        "shop worker consuming {PURCHASES_QUEUE} from {}",
        nodes.join(", ")
    );
    loop {
        let consumed = match app.engine() {
            Engine::Pg(engine) => {
                consume(engine.clone(), operation.clone(), &args, &mut brokers).await
            }
            Engine::Sqlite(engine) => {
                consume(engine.clone(), operation.clone(), &args, &mut brokers).await
            }
            Engine::My(engine) => {
                consume(engine.clone(), operation.clone(), &args, &mut brokers).await
            }
        };
        match consumed {
            Ok(true) => return Ok(()),
            Ok(false) => tracing::warn!("the broker closed the consumer; reconnecting"),
            Err(error) => {
                tracing::warn!(error = format!("{error:#}"), "worker failed; reconnecting")
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One connection's worth of consuming; `Ok(true)` when stopped by a signal.
async fn consume<S: StoreConn + Clone>(
    engine: Idempotency<S>,
    operation: Arc<PurchaseEvents>,
    args: &WorkerArgs,
    brokers: &mut Brokers,
) -> anyhow::Result<bool> {
    let (connection, node) = brokers
        .connect(ConnectionProperties::default())
        .await
        .context("connecting to the broker")?;
    tracing::info!(node, "worker connected");
    let channel = connection.create_channel().await?;
    let topology = purchases_topology(args.amqp_quorum_queues);
    topology.declare(&channel).await?;
    let inbox = Inbox::new(engine).with_max_failures(5);
    let handler = move |incoming: Incoming<S>| {
        let operation = operation.clone();
        async move {
            let event: PurchasePaid = match incoming.json() {
                Ok(event) => event,
                Err(error) => {
                    return DeliveryAction::DeadLetter(DeadLetter::Invalid(error.to_string()))
                }
            };
            let key = incoming.attempt().key();
            incoming
                .inbox()
                .perform(key.scope(), key.key(), &*operation, &event)
                .await
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let signals = tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(());
    });
    let report = AmqpConsumer::for_topology(channel, &topology, inbox, handler)
        .with_scope(SCOPE)
        .with_prefetch(args.prefetch)
        .with_concurrency(args.concurrency)
        .run_until(async {
            let _ = stopped.await;
        })
        .await;
    let by_signal = signals.is_finished();
    signals.abort();
    let report = report?;
    tracing::info!(%report, "consumer stopped");
    Ok(by_signal)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
