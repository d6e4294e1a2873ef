//! The queues and exchange a consumer needs: its queue, a dead-letter exchange, and a dead-letter
//! queue, declared together so that no dead letter is ever dropped for want of a route.

use lapin::{
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, LongString},
    Channel, ExchangeKind,
};

/// A work queue with its dead-letter route.
///
/// * the queue `name` (durable), declared with `x-dead-letter-exchange` and
///   `x-dead-letter-routing-key`, so that anything the broker dead-letters on its own (a
///   rejection, a quorum queue's delivery limit) takes the same route;
/// * the dead-letter exchange `{name}.dlx` (durable, direct);
/// * the dead-letter queue `{name}.dead-letter` (durable), bound to it with the routing key `name`.
///
/// Classic queues by default; [`quorum`](Self::quorum) for replicated ones (a cluster).
///
/// [`AmqpConsumer::for_topology`](crate::AmqpConsumer::for_topology) republishes dead letters to
/// that exchange with the reason in headers (see [`headers`](crate::headers)).
///
/// ```
/// use idempotency_amqp::Topology;
/// let orders = Topology::new("orders").with_delivery_limit(20);
/// assert_eq!(orders.dead_letter_exchange(), "orders.dlx");
/// assert_eq!(orders.dead_letter_queue(), "orders.dead-letter");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    dead_letter_exchange: String,
    dead_letter_queue: String,
    delivery_limit: Option<u32>,
    quorum: bool,
}

impl Topology {
    /// The topology of the queue `queue`, with the default dead-letter names.
    pub fn new(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            dead_letter_exchange: format!("{queue}.dlx"),
            dead_letter_queue: format!("{queue}.dead-letter"),
            delivery_limit: None,
            quorum: false,
        }
    }

    /// Declares the work queue **and** the dead-letter queue as **quorum queues**
    /// (`x-queue-type: quorum`): replicated on the cluster's nodes, they keep every confirmed
    /// message while a minority of nodes is down, where a classic queue lives on one node only.
    /// What a cluster needs (with [`Brokers`](crate::Brokers) to reconnect to another node).
    /// Works on a single node too, but a queue that exists already as a classic queue must be
    /// deleted (or given another name) first: the broker refuses to redeclare a queue as
    /// another type. Needs RabbitMQ ≥ 3.8.
    pub fn quorum(mut self) -> Self {
        self.quorum = true;
        self
    }

    /// Whether the work queue is a quorum queue ([`quorum`](Self::quorum), or implied by
    /// [`with_delivery_limit`](Self::with_delivery_limit)).
    pub fn is_quorum(&self) -> bool {
        self.quorum || self.delivery_limit.is_some()
    }

    /// Declares the queue as a **quorum queue** with `x-delivery-limit = limit`: the broker
    /// dead-letters a message after `limit` redeliveries, whatever the consumer does. A backstop
    /// for messages that crash the consumer's process (which the consumer cannot count); set it
    /// well above [`Consumer::with_max_failures`](idempotency::queue::Inbox::with_max_failures), since
    /// requeued *in progress* deliveries count too. Needs RabbitMQ ≥ 3.8.
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The dead-letter exchange.
    pub fn dead_letter_exchange(&self) -> &str {
        &self.dead_letter_exchange
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> &str {
        &self.dead_letter_queue
    }

    /// The routing key of dead letters: the work queue's name.
    pub fn dead_letter_routing_key(&self) -> &str {
        &self.queue
    }

    /// Declares the exchange and both queues, and binds them (idempotent, as AMQP declarations
    /// are; a queue that exists with other arguments is an error from the broker).
    pub async fn declare(&self, channel: &Channel) -> Result<(), lapin::Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.dead_letter_exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let mut dead_letter_arguments = FieldTable::default();
        if self.quorum {
            dead_letter_arguments.insert("x-queue-type".into(), text("quorum"));
        }
        channel
            .queue_declare(
                self.dead_letter_queue.as_str().into(),
                durable,
                dead_letter_arguments,
            )
            .await?;
        channel
            .queue_bind(
                self.dead_letter_queue.as_str().into(),
                self.dead_letter_exchange.as_str().into(),
                self.dead_letter_routing_key().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(self.queue.as_str().into(), durable, self.queue_arguments())
            .await?;
        Ok(())
    }

    /// The work queue's arguments.
    fn queue_arguments(&self) -> FieldTable {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-dead-letter-exchange".into(),
            text(&self.dead_letter_exchange),
        );
        arguments.insert(
            "x-dead-letter-routing-key".into(),
            text(self.dead_letter_routing_key()),
        );
        if self.is_quorum() {
            arguments.insert("x-queue-type".into(), text("quorum"));
        }
        if let Some(limit) = self.delivery_limit {
            arguments.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(limit)),
            );
        }
        arguments
    }
}

/// A header or argument string.
pub(crate) fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes()))
}
