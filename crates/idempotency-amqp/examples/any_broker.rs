//! The core inbox alone (`idempotency::queue::Inbox`), on a stand-in for any broker: the same
//! four answers map onto SQS, Kafka, NATS JetStream or a database queue (see `docs/queues.md`).
//!
//! The in-memory broker below delivers at least once: a publisher retries (every order is
//! published twice), a consumer dies after its commit and before its ack (the broker redelivers
//! after a visibility timeout), a producer reuses an id with another body, and one message can
//! never be applied. Four consumers compete for the queue; every order is applied exactly once.
//!
//! ```sh
//! cargo run -p idempotency-amqp --example any_broker
//! ```

use idempotency::{
    queue::{DeliveryAction, Inbox},
    Attempt, Idempotency, SqliteStore, Store,
};
use serde::{Deserialize, Serialize};
use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

/// What the producer sends: the id is chosen once and kept on every resend.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Envelope {
    id: String,
    body: OrderPaid,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OrderPaid {
    order: u32,
    cents: i64,
}

/// A queue with at-least-once delivery: a received message is gone until it is acked (deleted),
/// sent back after a delay, or dead-lettered.
#[derive(Default)]
struct Broker {
    ready: Mutex<VecDeque<Envelope>>,
    dead: Mutex<Vec<(Envelope, String)>>,
}

impl Broker {
    fn publish(&self, envelope: Envelope) {
        self.ready.lock().unwrap().push_back(envelope);
    }

    fn receive(&self) -> Option<Envelope> {
        self.ready.lock().unwrap().pop_front()
    }

    /// SQS `ChangeMessageVisibility`, JetStream `nak` with a delay, RabbitMQ a delayed requeue.
    fn redeliver_after(self: &Arc<Self>, envelope: Envelope, delay: Duration) {
        let broker = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            broker.publish(envelope);
        });
    }

    fn dead_letter(&self, envelope: Envelope, reason: String) {
        self.dead.lock().unwrap().push((envelope, reason));
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("shop.db").display());
    let store = SqliteStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE payments (order_id INTEGER NOT NULL, cents INTEGER NOT NULL)")
        .execute(store.pool())
        .await?;

    let broker = Arc::new(Broker::default());
    for order in 1..=100 {
        let envelope = Envelope {
            id: format!("order-paid-{order}"),
            body: OrderPaid { order, cents: 250 },
        };
        broker.publish(envelope.clone());
        broker.publish(envelope); // the publisher's retry after a lost confirm
    }
    // A producer bug: a used id with another body.
    broker.publish(Envelope {
        id: "order-paid-7".into(),
        body: OrderPaid {
            order: 7,
            cents: 99_999,
        },
    });
    // A message no redelivery can apply (order 0 does not exist).
    broker.publish(Envelope {
        id: "order-paid-0".into(),
        body: OrderPaid { order: 0, cents: 1 },
    });

    let inbox = Inbox::new(Idempotency::new(store.clone()))
        .with_max_failures(3)
        .with_retry_delay(Duration::from_millis(10));
    let crashed_once = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (broker, inbox) = (broker.clone(), inbox.clone());
            let crashed_once = crashed_once.clone();
            tokio::spawn(async move { consume(&broker, &inbox, &crashed_once).await })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }

    let applied: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT order_id, count(*) FROM payments GROUP BY order_id ORDER BY order_id",
    )
    .fetch_all(store.pool())
    .await?;
    assert_eq!(applied.len(), 100);
    assert!(applied.iter().all(|&(_, count)| count == 1), "{applied:?}");
    println!("100 orders, 202 messages, 1 consumer crash: each order applied exactly once");
    for (envelope, reason) in broker.dead.lock().unwrap().iter() {
        println!("dead letter {}: {reason}", envelope.id);
    }
    assert_eq!(broker.dead.lock().unwrap().len(), 2);
    Ok(())
}

/// One consumer: receive, handle, settle, until the queue stays empty.
async fn consume(
    broker: &Arc<Broker>,
    inbox: &Inbox<SqliteStore>,
    crashed_once: &AtomicBool,
) -> anyhow::Result<()> {
    let mut idle = 0;
    while idle < 50 {
        let Some(envelope) = broker.receive() else {
            idle += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        idle = 0;
        // (scope, type, id, payload): the payload's canonical JSON is its fingerprint.
        let message = Attempt::message_json("billing", "order.paid", &envelope.id, &envelope.body)?;
        let paid = &envelope.body; // borrowed by the work, no clone
        let action = inbox
            .handle(&message, async |tx| {
                if paid.order == 0 {
                    return Err(format!("order {} does not exist", paid.order));
                }
                sqlx::query("INSERT INTO payments (order_id, cents) VALUES (?1, ?2)")
                    .bind(paid.order)
                    .bind(paid.cents)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(())
            })
            .await;
        // The action exists only once the business transaction has committed (or rolled
        // back): settle the message now, never before.
        match action {
            DeliveryAction::Ack { replayed: false }
                if !crashed_once.swap(true, Ordering::SeqCst) =>
            {
                // This consumer "dies" after its commit, before its ack: the broker redelivers
                // the message after its visibility timeout, and that copy is acked as a replay.
                broker.redeliver_after(envelope, Duration::from_millis(50));
            }
            DeliveryAction::Ack { .. } => {} // delete the message
            DeliveryAction::RetryLater { delay } | DeliveryAction::Retry { delay, .. } => {
                broker.redeliver_after(envelope, delay)
            }
            DeliveryAction::DeadLetter(why) => {
                broker.dead_letter(envelope, format!("[{}] {why}", why.code()))
            }
            other => anyhow::bail!("an action this example does not know: {other}"),
        }
    }
    Ok(())
}
