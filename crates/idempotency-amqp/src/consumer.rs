//! The consumer loop: prefetch, a bounded number of deliveries in flight, one action per
//! delivery turned into an ack, a delayed requeue or a dead letter, and a graceful shutdown.

use crate::{
    headers,
    incoming::{attempt_of, Incoming},
    report::{ConsumerError, ConsumerReport, Settled},
    topology::{text, Topology},
};
use futures_util::{FutureExt, StreamExt};
use idempotency::{
    queue::{DeadLetter, DeliveryAction, Inbox},
    store::CompletionSignal,
};
use lapin::{
    message::Delivery,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
        BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    },
    types::FieldTable,
    Acker, BasicProperties, Channel, Confirmation,
};
use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::{
    sync::{oneshot, watch, Semaphore},
    task::{JoinHandle, JoinSet},
};
use tracing::{field, Instrument};

/// How long the shutdown waits for each delivery still buffered after the consumer was cancelled.
const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// What a consumer does with each delivery: usually build the request from the payload and call
/// [`Incoming::handle`] (or [`Incoming::perform`]), and return its [`DeliveryAction`].
///
/// Any `Fn(Incoming<S>) -> impl Future<Output = DeliveryAction>` is a handler. A handler that panics
/// outside the work (which [`Inbox::handle`] already catches and counts) dead-letters its
/// delivery as [`DeadLetter::Definitive`]: a panic before the work is a bug no redelivery fixes.
///
/// ```
/// use idempotency::{SqliteStore, queue::{DeadLetter, DeliveryAction}};
/// use idempotency_amqp::Incoming;
///
/// #[derive(serde::Deserialize)]
/// struct OrderPaid { order: String }
///
/// async fn ship(incoming: Incoming<SqliteStore>) -> DeliveryAction {
///     let paid: OrderPaid = match incoming.json() {
///         Ok(paid) => paid,
///         Err(e) => return DeliveryAction::DeadLetter(DeadLetter::Invalid(e.to_string())),
///     };
///     incoming
///         .handle(async |tx| {
///             sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
///                 .bind(&paid.order)
///                 .execute(&mut **tx)
///                 .await?;
///             Ok::<_, sqlx::Error>(())
///         })
///         .await
/// }
/// ```
pub trait Handler<S: CompletionSignal>: Send + Sync + 'static {
    /// Decides one delivery.
    fn handle(&self, incoming: Incoming<S>) -> impl Future<Output = DeliveryAction> + Send;
}

impl<S, F, Fut> Handler<S> for F
where
    S: CompletionSignal,
    F: Fn(Incoming<S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = DeliveryAction> + Send,
{
    fn handle(&self, incoming: Incoming<S>) -> impl Future<Output = DeliveryAction> + Send {
        self(incoming)
    }
}

/// An idempotent RabbitMQ consumer: each delivery's work runs at most once per message (see
/// [`Inbox`]), and the delivery is settled only after its [`DeliveryAction`], so after the business
/// transaction committed.
///
/// | [`DeliveryAction`] | what is sent to the broker |
/// |---|---|
/// | `Ack` (executed or replayed) | `basic.ack` |
/// | `RetryLater { delay }`, `Retry { delay, .. }` | the delivery is held for `delay` (at most [`with_max_hold`](Self::with_max_hold)), then `basic.nack` with requeue |
/// | `DeadLetter(why)` | with a dead-letter exchange: a copy with the reason in [`headers`] is published to it (publisher confirms), then `basic.ack`; without one, or if that publish fails: `basic.nack` without requeue (the queue's own `x-dead-letter-exchange` applies) |
///
/// Use a channel of its own: the consumer sets its prefetch (`basic.qos`) and, with a
/// dead-letter exchange, puts it in confirm mode.
pub struct AmqpConsumer<S, H> {
    channel: Channel,
    queue: String,
    scope: String,
    inbox: Inbox<S>,
    handler: H,
    prefetch: u16,
    concurrency: usize,
    max_hold: Duration,
    dead_letter: Option<(String, String)>,
    tag: String,
}

impl<S, H> std::fmt::Debug for AmqpConsumer<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConsumer")
            .field("queue", &self.queue)
            .field("scope", &self.scope)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

impl<S: CompletionSignal, H: Handler<S>> AmqpConsumer<S, H> {
    /// A consumer of `queue` on `channel`: prefetch 32, 8 deliveries in flight, the queue's name
    /// as the keys' scope, requeue holds of at most 10 s, and no dead-letter exchange (dead
    /// letters are rejected; see [`for_topology`](Self::for_topology)).
    pub fn new(channel: Channel, queue: &str, inbox: Inbox<S>, handler: H) -> Self {
        Self {
            channel,
            queue: queue.to_owned(),
            scope: queue.to_owned(),
            inbox,
            handler,
            prefetch: 32,
            concurrency: 8,
            max_hold: Duration::from_secs(10),
            dead_letter: None,
            tag: String::new(),
        }
    }

    /// A consumer of `topology`'s queue that publishes dead letters to its dead-letter exchange.
    pub fn for_topology(
        channel: Channel,
        topology: &Topology,
        inbox: Inbox<S>,
        handler: H,
    ) -> Self {
        Self::new(channel, topology.queue(), inbox, handler).with_dead_letter_exchange(
            topology.dead_letter_exchange(),
            topology.dead_letter_routing_key(),
        )
    }

    /// How many unacknowledged deliveries the broker sends ahead (`basic.qos`, default 32). Keep
    /// it at least [`with_concurrency`](Self::with_concurrency).
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many deliveries are handled at once (default 8). Each holds a database connection
    /// while its work runs.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// The keys' scope (default: the queue's name). Consumers of several queues that apply the
    /// same messages to the same database share a scope, so a message is applied once across
    /// them; two consumer groups that must each apply it have scopes of their own.
    pub fn with_scope(mut self, scope: &str) -> Self {
        self.scope = scope.to_owned();
        self
    }

    /// The longest time a delivery is held before it is requeued (default 10 s): a retry's delay
    /// hint is cut to it. A held delivery occupies one of the concurrent slots.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = max_hold;
        self
    }

    /// Publishes dead letters to `exchange` with `routing_key`, with the reason in [`headers`],
    /// and acks them once the broker confirmed that copy.
    pub fn with_dead_letter_exchange(mut self, exchange: &str, routing_key: &str) -> Self {
        self.dead_letter = Some((exchange.to_owned(), routing_key.to_owned()));
        self
    }

    /// The consumer tag (default: one chosen by the broker).
    pub fn with_consumer_tag(mut self, tag: &str) -> Self {
        self.tag = tag.to_owned();
        self
    }

    /// Runs in a task of its own until [`RunningConsumer::shutdown`].
    pub fn spawn(self) -> RunningConsumer {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        RunningConsumer {
            stop: Some(stop),
            task,
        }
    }

    /// Consumes until `shutdown` completes, then shuts down gracefully: stops the deliveries
    /// (`basic.cancel`), requeues those received but not started, cuts requeue holds short, and
    /// waits for the deliveries whose work is running to finish and be settled. Returns what it
    /// did, or the error that stopped it (the channel or connection failed, or the broker
    /// cancelled the consumer); deliveries left unsettled then are requeued by the broker when
    /// the channel closes.
    pub async fn run_until<F>(self, shutdown: F) -> Result<ConsumerReport, ConsumerError>
    where
        F: Future<Output = ()> + Send,
    {
        let AmqpConsumer {
            channel,
            queue,
            scope,
            inbox,
            handler,
            prefetch,
            concurrency,
            max_hold,
            dead_letter,
            tag,
        } = self;
        let started = start(&channel, &queue, &tag, prefetch, dead_letter.is_some());
        let mut deliveries = match started.await {
            Ok(deliveries) => deliveries,
            Err(source) => {
                let report = ConsumerReport::default();
                return Err(ConsumerError::Amqp { source, report });
            }
        };
        tracing::info!(%queue, prefetch, concurrency, "consuming");
        let (stopping, stop_holds) = watch::channel(false);
        let settler = Arc::new(Settler {
            channel,
            queue,
            scope,
            max_hold,
            dead_letter,
            stopping: stop_holds,
            in_flight: AtomicU64::new(0),
        });
        let mut run = Run {
            settler,
            inbox: Arc::new(inbox),
            handler: Arc::new(handler),
            slots: Arc::new(Semaphore::new(concurrency)),
            tasks: JoinSet::new(),
            report: ConsumerReport::default(),
        };
        tokio::pin!(shutdown);
        let mut stopped_by = run.consume(&mut deliveries, shutdown).await;

        // Graceful shutdown: no new deliveries, the buffered ones back to the queue, the held
        // ones requeued now, the running ones finished.
        let _ = stopping.send(true);
        if stopped_by.is_none() {
            stopped_by = run.cancel(&mut deliveries).await;
        }
        run.finish(stopped_by).await
    }
}

/// Sets the prefetch, the confirm mode a dead-letter exchange needs, and starts consuming.
async fn start(
    channel: &Channel,
    queue: &str,
    tag: &str,
    prefetch: u16,
    confirms: bool,
) -> Result<lapin::Consumer, lapin::Error> {
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    if confirms {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
    }
    channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
}

/// One run of a consumer: the delivery tasks, what they share, and the report so far.
struct Run<S, H> {
    settler: Arc<Settler>,
    inbox: Arc<Inbox<S>>,
    handler: Arc<H>,
    slots: Arc<Semaphore>,
    tasks: JoinSet<Settled>,
    report: ConsumerReport,
}

impl<S: CompletionSignal, H: Handler<S>> Run<S, H> {
    /// Takes deliveries, each in a task of its own once a slot is free, until `shutdown`
    /// completes (`None`) or the deliveries stop: the error that stopped them.
    async fn consume<F: Future<Output = ()>>(
        &mut self,
        deliveries: &mut lapin::Consumer,
        mut shutdown: Pin<&mut F>,
    ) -> Option<ConsumerError> {
        loop {
            let slot = tokio::select! {
                biased;
                () = &mut shutdown => return None,
                slot = self.slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            };
            let delivery = tokio::select! {
                biased;
                () = &mut shutdown => return None,
                delivery = deliveries.next() => delivery,
            };
            match delivery {
                Some(Ok(delivery)) => {
                    let (settler, inbox, handler) = (
                        self.settler.clone(),
                        self.inbox.clone(),
                        self.handler.clone(),
                    );
                    self.tasks.spawn(async move {
                        let settled = settler.process(&inbox, &*handler, delivery).await;
                        drop(slot);
                        settled
                    });
                }
                Some(Err(source)) => {
                    let report = ConsumerReport::default();
                    return Some(ConsumerError::Amqp { source, report });
                }
                None => {
                    let report = ConsumerReport::default();
                    return Some(ConsumerError::Cancelled { report });
                }
            }
            while let Some(done) = self.tasks.try_join_next() {
                self.report.add(done.unwrap_or(Settled::Unsettled));
            }
        }
    }

    /// Stops the deliveries (`basic.cancel`) and requeues those received but not started; the
    /// error if the cancel failed.
    async fn cancel(&mut self, deliveries: &mut lapin::Consumer) -> Option<ConsumerError> {
        let tag = deliveries.tag();
        match self
            .settler
            .channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await
        {
            Ok(()) => {
                while let Ok(Some(Ok(delivery))) =
                    tokio::time::timeout(DRAIN_WAIT, deliveries.next()).await
                {
                    let settled = self.settler.requeue_unstarted(&delivery.acker).await;
                    self.report.add(settled);
                }
                None
            }
            Err(source) => {
                let report = ConsumerReport::default();
                Some(ConsumerError::Amqp { source, report })
            }
        }
    }

    /// Waits for the deliveries whose work is running to be settled, and returns the report
    /// (with the error that stopped the run, if one did).
    async fn finish(
        mut self,
        stopped_by: Option<ConsumerError>,
    ) -> Result<ConsumerReport, ConsumerError> {
        let settler = &self.settler;
        let in_flight = settler.in_flight.load(Ordering::Relaxed);
        tracing::info!(queue = %settler.queue, in_flight, "stopping: finishing the deliveries in flight");
        while let Some(done) = self.tasks.join_next().await {
            self.report.add(done.unwrap_or(Settled::Unsettled));
        }
        tracing::info!(queue = %settler.queue, report = %self.report, "stopped");
        match stopped_by {
            None => Ok(self.report),
            Some(error) => Err(error.with_report(self.report)),
        }
    }
}

/// A consumer running in its own task.
#[derive(Debug)]
pub struct RunningConsumer {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<ConsumerReport, ConsumerError>>,
}

impl RunningConsumer {
    /// Shuts the consumer down gracefully (see [`AmqpConsumer::run_until`]) and returns its
    /// report.
    pub async fn shutdown(mut self) -> Result<ConsumerReport, ConsumerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
    }

    /// Whether it stopped on its own (an error; [`shutdown`](Self::shutdown) returns it).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// What every delivery task shares: how to settle a delivery.
struct Settler {
    channel: Channel,
    queue: String,
    scope: String,
    max_hold: Duration,
    dead_letter: Option<(String, String)>,
    stopping: watch::Receiver<bool>,
    in_flight: AtomicU64,
}

impl Settler {
    /// One delivery: its message, the handler's action, and the settlement, in a span that
    /// names the message and says whether the broker redelivered it.
    async fn process<S: CompletionSignal, H: Handler<S>>(
        &self,
        inbox: &Inbox<S>,
        handler: &H,
        delivery: Delivery,
    ) -> Settled {
        let Delivery {
            delivery_tag,
            routing_key,
            redelivered,
            properties,
            data,
            acker,
            ..
        } = delivery;
        let span = tracing::info_span!(
            "amqp_delivery",
            queue = %self.queue,
            delivery_tag,
            redelivered,
            message_id = field::Empty,
            message_type = field::Empty,
        );
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let settled = async {
            let action = match attempt_of(&self.scope, &properties, routing_key.as_str(), &data) {
                Err(reason) => DeliveryAction::DeadLetter(DeadLetter::Invalid(reason)),
                Ok(attempt) => {
                    let key = attempt.key();
                    span.record("message_id", key.key());
                    span.record("message_type", key.operation());
                    if redelivered {
                        tracing::debug!("redelivered by the broker");
                    }
                    let incoming = Incoming {
                        attempt,
                        payload: data.clone(),
                        properties: properties.clone(),
                        routing_key: routing_key.to_string(),
                        redelivered,
                        inbox: inbox.clone(),
                    };
                    match AssertUnwindSafe(handler.handle(incoming))
                        .catch_unwind()
                        .await
                    {
                        Ok(action) => action,
                        Err(panic) => DeliveryAction::DeadLetter(DeadLetter::Definitive(format!(
                            "the handler panicked: {}",
                            panic_message(&*panic)
                        ))),
                    }
                }
            };
            self.settle(&acker, &properties, &data, action).await
        }
        .instrument(span.clone())
        .await;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        settled
    }

    /// Sends the broker what `action` says.
    async fn settle(
        &self,
        acker: &Acker,
        properties: &BasicProperties,
        data: &[u8],
        action: DeliveryAction,
    ) -> Settled {
        match action {
            DeliveryAction::Ack { replayed } => {
                tracing::debug!(replayed, "ack");
                let settled = if replayed {
                    Settled::Replayed
                } else {
                    Settled::Executed
                };
                confirm(acker.ack(BasicAckOptions::default()).await, settled)
            }
            DeliveryAction::DeadLetter(why) => {
                tracing::warn!(code = why.code(), reason = %why, "dead-lettered");
                self.dead_letter(acker, properties, data, &why).await
            }
            other => {
                let delay = other.delay().unwrap_or(self.max_hold).min(self.max_hold);
                let settled = match &other {
                    DeliveryAction::RetryLater { .. } => Settled::RetriedLater,
                    _ => Settled::Retried,
                };
                tracing::info!(action = %other, "requeued after {delay:?}");
                self.hold(delay).await;
                let requeue = BasicNackOptions {
                    requeue: true,
                    multiple: false,
                };
                confirm(acker.nack(requeue).await, settled)
            }
        }
    }

    /// Waits `delay`, or until the shutdown starts.
    async fn hold(&self, delay: Duration) {
        let mut stopping = self.stopping.clone();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = stopping.wait_for(|stopping| *stopping) => {}
        }
    }

    /// Publishes a copy with the reason to the dead-letter exchange and acks the delivery once
    /// the broker confirmed the copy; otherwise rejects it without requeue.
    async fn dead_letter(
        &self,
        acker: &Acker,
        properties: &BasicProperties,
        data: &[u8],
        why: &DeadLetter,
    ) -> Settled {
        if let Some((exchange, routing_key)) = &self.dead_letter {
            let mut headers_table = properties.headers().clone().unwrap_or_default();
            headers_table.insert(headers::CODE.into(), text(why.code()));
            headers_table.insert(headers::REASON.into(), text(&why.to_string()));
            headers_table.insert(headers::QUEUE.into(), text(&self.queue));
            let copy = properties.clone().with_headers(headers_table);
            let mandatory = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let published = self
                .channel
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    mandatory,
                    data,
                    copy,
                )
                .await;
            let confirmed = match published {
                Ok(confirm) => confirm.await,
                Err(error) => Err(error),
            };
            match confirmed {
                Ok(Confirmation::Ack(None)) => {
                    return confirm(
                        acker.ack(BasicAckOptions::default()).await,
                        Settled::DeadLettered,
                    )
                }
                Ok(other) => {
                    tracing::warn!(%exchange, returned = other.take_message().is_some(), "the dead-letter exchange refused the copy; rejecting instead")
                }
                Err(error) => {
                    tracing::warn!(%exchange, %error, "could not publish to the dead-letter exchange; rejecting instead")
                }
            }
        }
        let reject = BasicNackOptions {
            requeue: false,
            multiple: false,
        };
        confirm(acker.nack(reject).await, Settled::DeadLettered)
    }

    /// A delivery received but never started, at shutdown: back to the queue.
    async fn requeue_unstarted(&self, acker: &Acker) -> Settled {
        let requeue = BasicNackOptions {
            requeue: true,
            multiple: false,
        };
        confirm(acker.nack(requeue).await, Settled::RequeuedUnstarted)
    }
}

/// `settled` if the broker got the ack or nack, else [`Settled::Unsettled`] (the channel is gone:
/// the broker requeues the delivery, and its redelivery is acked as a replay or run again).
fn confirm(sent: Result<bool, lapin::Error>, settled: Settled) -> Settled {
    match sent {
        Ok(true) => settled,
        Ok(false) => {
            tracing::warn!("the delivery could not be settled: its channel is closed");
            Settled::Unsettled
        }
        Err(error) => {
            tracing::warn!(%error, "the delivery could not be settled");
            Settled::Unsettled
        }
    }
}

/// The message of a panic payload.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_owned()
    }
}
