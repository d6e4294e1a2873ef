//! The transactional outbox: a paid purchase writes its event (`purchase.paid`) into
//! `shop_outbox` **in the purchase's own transaction**, so the event exists exactly when the
//! purchase does. The [`Relay`] publishes outbox rows to RabbitMQ with publisher confirms and
//! deletes a row only after the broker confirmed it: publishing is at-least-once and never lost
//! (a crash between the confirm and the delete publishes the row again), and the consumer
//! (`shop worker`) removes the duplicates by message id.

use crate::db::{sql, Conn, ShopDb};
use anyhow::Context;
use idempotency_amqp::{Brokers, Topology};
use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    BasicProperties, Confirmation, ConnectionProperties,
};
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The queue the purchase events go to (with its dead-letter exchange and queue).
pub const PURCHASES_QUEUE: &str = "shop.purchases";

/// The topology of [`PURCHASES_QUEUE`]: quorum queues (a RabbitMQ cluster) or classic ones.
pub fn purchases_topology(quorum: bool) -> Topology {
    let topology = Topology::new(PURCHASES_QUEUE);
    if quorum {
        topology.quorum()
    } else {
        topology
    }
}

/// The message type (AMQP `type` property) of a paid purchase's event.
pub const PURCHASE_PAID: &str = "purchase.paid";

/// A paid purchase's event, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurchasePaid {
    /// The purchase.
    pub purchase_id: i64,
    /// Its order (one grant of points per order).
    pub order_id: i64,
    /// The buyer.
    pub user_id: String,
    /// What was bought.
    pub sku: String,
    /// How many.
    pub quantity: i64,
    /// What it cost.
    pub amount_cents: i64,
}

impl PurchasePaid {
    /// The event's message id: one per purchase, whoever publishes it and however often.
    pub fn message_id(&self) -> String {
        format!("purchase-{}", self.purchase_id)
    }

    /// The loyalty points it earns: one per started euro.
    pub fn points(&self) -> i64 {
        (self.amount_cents + 99) / 100
    }
}

/// Writes `event` into the outbox, on the purchase's transaction.
pub async fn record(mut conn: Conn<'_>, event: &PurchasePaid) -> Result<(), sqlx::Error> {
    let payload = serde_json::to_string(event).expect("an event serialises");
    conn.execute(
        sql("INSERT INTO shop_outbox (message_id, message_type, payload) VALUES ($1, $2, $3)")
            .bind(event.message_id())
            .bind(PURCHASE_PAID)
            .bind(&payload),
    )
    .await?;
    Ok(())
}

/// One outbox row.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Row {
    id: i64,
    message_id: String,
    message_type: String,
    payload: String,
}

/// How many rows wait in the outbox.
pub async fn pending(db: &ShopDb) -> Result<i64, sqlx::Error> {
    let mut read = db.read().await?;
    read.conn()
        .scalar(sql("SELECT count(*) FROM shop_outbox"))
        .await
}

/// The relay: publishes the outbox to [`PURCHASES_QUEUE`] with publisher confirms, then deletes
/// what the broker confirmed. It reconnects after a broker failure, to the next node of a
/// cluster ([`Brokers`]); what was published but not yet deleted is published again (the
/// consumer removes the duplicate).
#[derive(Debug, Clone)]
pub struct Relay {
    db: ShopDb,
    brokers: Brokers,
    topology: Topology,
    batch: i64,
    duplicate_share: f64,
}

impl Relay {
    /// A relay from `db`'s outbox to the broker at `amqp_url`: one URL, or the comma-separated
    /// URLs of a cluster's nodes (see [`Brokers::parse`]).
    pub fn new(db: ShopDb, amqp_url: &str) -> Self {
        Self {
            db,
            brokers: Brokers::parse(amqp_url),
            topology: purchases_topology(false),
            batch: 100,
            duplicate_share: 0.0,
        }
    }

    /// Declares the queues as quorum queues (a cluster; see [`purchases_topology`]).
    pub fn with_quorum_queues(mut self, quorum: bool) -> Self {
        self.topology = purchases_topology(quorum);
        self
    }

    /// Publishes this share of the rows twice on purpose (the fault proof's duplicates, as a
    /// relay that crashed between the confirm and the delete would).
    pub fn with_duplicate_share(mut self, share: f64) -> Self {
        self.duplicate_share = share;
        self
    }

    /// Runs until the task is dropped: relays, and after any failure (broker down, database
    /// unreachable) waits half a second and starts again.
    pub async fn run(self) {
        let mut brokers = self.brokers.clone();
        loop {
            if let Err(error) = self.relay(&mut brokers).await {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "outbox relay failed; retrying"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }

    async fn relay(&self, brokers: &mut Brokers) -> anyhow::Result<()> {
        let (connection, node) = brokers
            .connect(ConnectionProperties::default())
            .await
            .context("connecting to the broker")?;
        tracing::info!(node, "outbox relay connected");
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        self.topology.declare(&channel).await?;
        loop {
            let rows = self.next_rows().await?;
            if rows.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let mut confirms = Vec::with_capacity(rows.len());
            for row in &rows {
                let copies = if rand::thread_rng().gen_bool(self.duplicate_share) {
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let properties = BasicProperties::default()
                        .with_message_id(row.message_id.as_str().into())
                        .with_type(row.message_type.as_str().into())
                        .with_content_type("application/json".into())
                        .with_delivery_mode(2);
                    let confirm = channel
                        .basic_publish(
                            "".into(),
                            PURCHASES_QUEUE.into(),
                            BasicPublishOptions::default(),
                            row.payload.as_bytes(),
                            properties,
                        )
                        .await?;
                    confirms.push((row.id, confirm));
                }
            }
            let mut confirmed = Vec::with_capacity(rows.len());
            for (id, confirm) in confirms {
                match confirm.await? {
                    Confirmation::Ack(_) => confirmed.push(id),
                    other => anyhow::bail!("the broker did not confirm outbox row {id}: {other:?}"),
                }
            }
            confirmed.dedup();
            self.delete(&confirmed).await?;
        }
    }

    async fn next_rows(&self) -> Result<Vec<Row>, sqlx::Error> {
        let mut read = self.db.read().await?;
        let rows = sql(
            "SELECT id, message_id, message_type, payload FROM shop_outbox ORDER BY id LIMIT $1",
        );
        read.conn().fetch_all(rows.bind(self.batch)).await
    }

    async fn delete(&self, ids: &[i64]) -> Result<(), sqlx::Error> {
        let mut tx = self.db.begin().await?;
        for id in ids {
            tx.conn()
                .execute(sql("DELETE FROM shop_outbox WHERE id = $1").bind(*id))
                .await?;
        }
        tx.commit().await
    }
}
