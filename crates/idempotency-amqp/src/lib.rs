//! An idempotent RabbitMQ consumer on [`lapin`]: **exactly-once effects** in the consumer's
//! database on **at-least-once delivery**, with the [`idempotency`] crate's
//! [`Inbox`](idempotency::queue::Inbox).
//!
//! # What the consumer does, per delivery
//!
//! 1. Reads the message's identity ([`Incoming`]): the `message-id` property (none → dead
//!    letter), the `type` property or the routing key, the consumer's scope, and the payload's
//!    fingerprint (canonical JSON for a JSON `content-type`). The span `amqp_delivery` carries the
//!    queue, the delivery tag, the message id and type, and the broker's `redelivered` flag.
//! 2. Calls the [`Handler`], which runs the work with [`Incoming::handle`]: reserve the key,
//!    run the work in the business transaction, complete the key in that transaction, commit.
//! 3. Settles the delivery **after** the handler's
//!    [`DeliveryAction`](idempotency::queue::DeliveryAction), so after the commit: ack (executed or
//!    replayed); a delayed requeue (in progress elsewhere, or a failure with the key released);
//!    or a dead letter with its reason. A crash between the commit and the ack costs a
//!    redelivery, which is acked as a replay.
//!
//! Prefetch (`basic.qos`) bounds what the broker sends ahead, and a semaphore the deliveries
//! handled at once. [`AmqpConsumer::run_until`] and [`RunningConsumer::shutdown`] stop
//! gracefully: cancel the consumer, requeue what was received but not started, finish what is
//! running. [`Topology`] declares the queue with its dead-letter exchange and queue (quorum queues
//! on a cluster), and [`Brokers`] connects to the cluster's nodes in turn.
//!
//! ```no_run
//! use idempotency::{Idempotency, SqliteStore, Store, queue::{DeliveryAction, Inbox}};
//! use idempotency_amqp::{AmqpConsumer, Incoming, Topology};
//! use lapin::{Connection, ConnectionProperties};
//!
//! async fn ship(incoming: Incoming<SqliteStore>) -> DeliveryAction {
//!     let order = String::from_utf8_lossy(incoming.payload()).into_owned();
//!     incoming
//!         .handle(async |tx| {
//!             sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)").bind(&order).execute(&mut **tx).await?;
//!             Ok::<_, sqlx::Error>(())
//!         })
//!         .await
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite://shop.db?mode=rwc").await?;
//! store.migrate().await?;
//! let connection = Connection::connect("amqp://idem:idem@127.0.0.1:5672/idem", ConnectionProperties::default()).await?;
//! let channel = connection.create_channel().await?;
//! let topology = Topology::new("shipments");
//! topology.declare(&channel).await?;
//!
//! let inbox = Inbox::new(Idempotency::new(store)).with_max_failures(5);
//! let running = AmqpConsumer::for_topology(channel, &topology, inbox, ship)
//!     .with_prefetch(32)
//!     .with_concurrency(8)
//!     .spawn();
//! tokio::signal::ctrl_c().await?;
//! let report = running.shutdown().await?;
//! println!("{report}");
//! # Ok(()) }
//! ```
//!
//! See `docs/queues.md` in the repository for the guarantee, the other brokers, and measured
//! throughput.

#![warn(missing_docs)]

mod brokers;
mod consumer;
mod incoming;
mod report;
mod topology;

pub use brokers::Brokers;
pub use consumer::{AmqpConsumer, Handler, RunningConsumer};
pub use incoming::Incoming;
pub use report::{ConsumerError, ConsumerReport};
pub use topology::Topology;

/// The headers of a dead letter published to a dead-letter exchange.
pub mod headers {
    /// A stable name for why it was dead-lettered:
    /// [`DeadLetter::code`](idempotency::queue::DeadLetter::code) (`payload-mismatch`,
    /// `poison`, `definitive`, `needs-review`, `invalid`).
    pub const CODE: &str = "x-dead-letter-code";
    /// Why, for a human (the last error of a poison message, for example).
    pub const REASON: &str = "x-dead-letter-reason";
    /// The queue it was consumed from.
    pub const QUEUE: &str = "x-dead-letter-queue";
}
