//! `shop worker`: consumes the purchase events the outbox relay publishes
//! ([`PURCHASES_QUEUE`]) with [`idempotency_amqp`], exactly once per event whatever the broker
//! redelivers. Each event is a durable operation ([`PurchaseEvents`]) of two steps:
//!
//! 1. **points**: one grant of loyalty points for the order, under the business unique
//!    constraint `shop_point_grants.order_id` (a second defence behind the message id);
//! 2. **receipt**: an e-mail through the mail provider, which has no idempotency keys: the call
//!    is marked as started before it is made, and an unknown outcome (or a worker killed during
//!    the call) parks the key as *needs review* and dead-letters the delivery with the reason,
//!    never a second e-mail.
//!
//! The delivery is acked only after the operation committed; a worker killed before that gets
//! the delivery again from the broker, which the key turns into a replay (or a resumption from
//! the last step).

use crate::{
    app::{App, Config, Engine},
    db::{Backend, Conn},
    on_conn,
    outbox::{PurchasePaid, PURCHASES_QUEUE, PURCHASE_PAID},
    providers::{Faults, MailProvider},
    purchase::call_error,
};
use anyhow::Context;
use idempotency::{
    consumer::DeadLetter,
    steps::{Finished, StepError, Steps},
    Consumer, Decision, Idempotency, Operation,
};
use idempotency_amqp::{AmqpConsumer, Incoming, Topology};
use lapin::{Connection, ConnectionProperties};
use serde_json::{json, Value};
use std::{sync::Arc, time::Duration};

/// Options of `shop worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The shop's database (the same as the shop's).
    #[arg(long, env = "SHOP_DATABASE_URL", default_value = "sqlite://shop.db")]
    pub database_url: String,
    /// The broker.
    #[arg(
        long,
        env = "SHOP_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
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
    /// carry on the event of a worker that died, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
}

/// The consumer's scope in the key table.
pub const SCOPE: &str = "shop.worker";

/// What a purchase event sets off: the points, then the receipt.
#[derive(Debug, Clone)]
pub struct PurchaseEvents {
    mail: MailProvider,
}

impl PurchaseEvents {
    /// Sending receipts through `mail`.
    pub fn new(mail: MailProvider) -> Self {
        Self { mail }
    }
}

/// Grants the order's points once: the unique constraint on `order_id` turns a second grant
/// into nothing. Returns whether this call granted them.
async fn grant_points(mut conn: Conn<'_>, event: &PurchasePaid) -> Result<bool, sqlx::Error> {
    let granted = on_conn!(conn.reborrow(), |c| sqlx::query(
        "INSERT INTO shop_point_grants (order_id, user_id, points) VALUES ($1, $2, $3)
         ON CONFLICT (order_id) DO NOTHING"
    )
    .bind(event.order_id)
    .bind(&event.user_id)
    .bind(event.points())
    .execute(&mut *c)
    .await?
    .rows_affected());
    Ok(granted == 1)
}

async fn record_receipt(
    mut conn: Conn<'_>,
    event: &PurchasePaid,
    message_id: &str,
) -> Result<(), sqlx::Error> {
    on_conn!(conn.reborrow(), |c| sqlx::query(
        "INSERT INTO shop_emails (user_id, recipient, subject, message_id) VALUES ($1, $2, $3, $4)"
    )
    .bind(&event.user_id)
    .bind(recipient(event))
    .bind(subject(event))
    .bind(message_id)
    .execute(&mut *c)
    .await?
    .rows_affected());
    Ok(())
}

fn recipient(event: &PurchasePaid) -> String {
    format!("{}@example.com", event.user_id)
}

fn subject(event: &PurchasePaid) -> String {
    format!("receipt for purchase {}", event.purchase_id)
}

impl<S: Backend> Operation<S> for PurchaseEvents {
    type Request = PurchasePaid;
    type Response = Value;

    fn name(&self) -> &str {
        PURCHASE_PAID
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        event: &PurchasePaid,
    ) -> Result<Finished<Value>, StepError> {
        let granting = event.clone();
        let granted = steps
            .local("points", move |tx| {
                Box::pin(async move { grant_points(S::conn(tx), &granting).await })
            })
            .await?;
        let mail = self.mail.clone();
        let sending = event.clone();
        let message_id: String = steps
            .call_unkeyed("receipt", move || async move {
                mail.send(
                    &sending.user_id,
                    &recipient(&sending),
                    &subject(&sending),
                    &sending.message_id(),
                )
                .await
                .map_err(call_error)
            })
            .await?;
        let recording = event.clone();
        steps
            .finish(move |tx| {
                Box::pin(async move {
                    record_receipt(S::conn(tx), &recording, &message_id).await?;
                    Ok::<_, sqlx::Error>(json!({
                        "order_id": recording.order_id,
                        "points_granted": granted,
                        "receipt": message_id,
                    }))
                })
            })
            .await
    }
}

/// Runs the worker until Ctrl-C or SIGTERM; reconnects after the broker went away.
pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let mut config = Config::new(&args.database_url);
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
    println!(
        "shop worker consuming {PURCHASES_QUEUE} from {}",
        args.amqp_url.rsplit('@').next().unwrap_or_default()
    );
    loop {
        let consumed = match app.engine() {
            Engine::Pg(engine) => consume(engine.clone(), operation.clone(), &args).await,
            Engine::Sqlite(engine) => consume(engine.clone(), operation.clone(), &args).await,
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
async fn consume<S: Backend + Clone>(
    engine: Idempotency<S>,
    operation: Arc<PurchaseEvents>,
    args: &WorkerArgs,
) -> anyhow::Result<bool> {
    let connection = Connection::connect(&args.amqp_url, ConnectionProperties::default())
        .await
        .context("connecting to the broker")?;
    let channel = connection.create_channel().await?;
    let topology = Topology::new(PURCHASES_QUEUE);
    topology.declare(&channel).await?;
    let consumer = Consumer::new(engine).with_max_failures(5);
    let handler = move |incoming: Incoming<S>| {
        let operation = operation.clone();
        async move {
            let event: PurchasePaid = match incoming.json() {
                Ok(event) => event,
                Err(error) => return Decision::DeadLetter(DeadLetter::Invalid(error.to_string())),
            };
            let key = incoming.message().key();
            incoming
                .consumer()
                .perform(key.scope(), key.key(), &*operation, &event)
                .await
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let signals = tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(());
    });
    let report = AmqpConsumer::for_topology(channel, &topology, consumer, handler)
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
