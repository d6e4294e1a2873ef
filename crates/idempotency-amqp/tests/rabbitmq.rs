//! The consumer against a real RabbitMQ (`TEST_AMQP_URL`), with a store on every backend for
//! duplicates applied once by competing consumers, and SQLite for the rest:
//! poison and mismatched messages dead-lettered with their reason, a graceful shutdown, and a
//! crash between the commit and the ack.

mod common;

use common::{
    broker, delete, json_properties, publish, publisher, ready, unique, wait_until, TestStore, WAIT,
};
use idempotency::{
    queue::{DeliveryAction, Inbox},
    Idempotency, SqliteStore,
};
use idempotency_amqp::{headers, AmqpConsumer, Brokers, Incoming, Topology};
use lapin::{
    options::BasicGetOptions,
    types::{AMQPValue, FieldTable},
    Channel,
};
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::sync::Notify;

/// A consumer with short delays, so that tests do not wait.
fn inbox<S: TestStore>(store: &S) -> Inbox<S> {
    Inbox::new(Idempotency::new(store.clone()))
        .with_max_failures(3)
        .with_retry_delay(Duration::from_millis(20))
        .with_max_retry_delay(Duration::from_millis(50))
}

/// The handler of most tests: applies the message (a row with its id and body), or fails when
/// the body holds `"fail"`; counts the acks it answered.
fn applying<S: TestStore>(
    acks: Arc<AtomicU64>,
) -> impl Fn(Incoming<S>) -> futures_util::future::BoxFuture<'static, DeliveryAction>
       + Send
       + Sync
       + 'static {
    move |incoming: Incoming<S>| {
        let acks = acks.clone();
        Box::pin(async move {
            let id = incoming.attempt().key().key().to_owned();
            let body = String::from_utf8_lossy(incoming.payload()).into_owned();
            let action = incoming
                .handle(async move |tx| {
                    if body.contains("fail") {
                        return Err(format!("cannot apply {body}"));
                    }
                    S::apply(tx, &id, &body).await.map_err(|e| e.to_string())?;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok(())
                })
                .await;
            if action.is_ack() {
                acks.fetch_add(1, Ordering::SeqCst);
            }
            action
        })
    }
}

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    duplicates_are_applied_once,
}

/// 150 messages, each published two or three times (a publisher's retries), consumed by two
/// competing consumers on their own connections: every message applied exactly once.
async fn duplicates_are_applied_once<S: TestStore>(store: S) {
    const MESSAGES: usize = 150;
    let Some(connection) = broker().await else {
        return;
    };
    let setup = connection.create_channel().await.unwrap();
    let topology = Topology::new(&unique("dupes"));
    topology.declare(&setup).await.unwrap();

    let publishing = publisher(&connection).await;
    // Each message twice in a row (the two copies race in competing consumers), and every
    // third once more, later (a redelivery after completion).
    let mut copies = 0;
    for (round, repeats) in [(0, 2), (1, 1)] {
        for n in 0..MESSAGES {
            if round == 1 && n % 3 != 0 {
                continue;
            }
            let id = format!("order-{n}");
            let body = format!(r#"{{"order": {n}, "cents": {}}}"#, 100 + n);
            for _ in 0..repeats {
                publish(
                    &publishing,
                    topology.queue(),
                    json_properties(Some(&id)),
                    body.as_bytes(),
                )
                .await;
                copies += 1;
            }
        }
    }

    let acks = Arc::new(AtomicU64::new(0));
    let second = broker().await.unwrap();
    let mut running = Vec::new();
    // The first waits for a copy in progress elsewhere; the second requeues it at once.
    for (connection, wait) in [(&connection, WAIT), (&second, Duration::ZERO)] {
        let channel = connection.create_channel().await.unwrap();
        running.push(
            AmqpConsumer::for_topology(
                channel,
                &topology,
                inbox(&store).with_in_progress_wait(wait),
                applying::<S>(acks.clone()),
            )
            .with_prefetch(16)
            .with_concurrency(8)
            .spawn(),
        );
    }
    wait_until("every copy is acked", || {
        let acks = acks.clone();
        async move { acks.load(Ordering::SeqCst) == copies }
    })
    .await;
    let mut executed = 0;
    let mut replayed = 0;
    for consumer in running {
        let report = consumer.shutdown().await.unwrap();
        executed += report.executed;
        replayed += report.replayed;
        assert_eq!(report.dead_lettered, 0, "{report}");
        eprintln!("{}: {report}", S::NAME);
    }
    assert_eq!(executed, MESSAGES as u64, "{}", S::NAME);
    assert_eq!(replayed, copies - MESSAGES as u64, "{}", S::NAME);
    for n in 0..MESSAGES {
        assert_eq!(store.applied(&format!("order-{n}")).await, 1, "order-{n}");
    }
    assert_eq!(store.applied_total().await, MESSAGES as i64);
    assert_eq!(ready(&setup, topology.dead_letter_queue()).await, 0);
    delete(&setup, &topology).await;
}

/// A dead letter read back from the dead-letter queue.
#[derive(Debug)]
struct DeadLetterCopy {
    message_id: Option<String>,
    body: String,
    headers: HashMap<String, String>,
}

async fn dead_letters(
    channel: &Channel,
    topology: &Topology,
    expected: usize,
) -> Vec<DeadLetterCopy> {
    let mut copies = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while copies.len() < expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} dead letters: {copies:?}",
            copies.len()
        );
        let got = channel
            .basic_get(
                topology.dead_letter_queue().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap();
        let Some(message) = got else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let headers = message
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default()
            .inner()
            .iter()
            .filter_map(|(name, value)| match value {
                AMQPValue::LongString(text) => Some((name.to_string(), text.to_string())),
                _ => None,
            })
            .collect();
        copies.push(DeadLetterCopy {
            message_id: message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string()),
            body: String::from_utf8_lossy(&message.delivery.data).into_owned(),
            headers,
        });
    }
    copies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_mismatched_and_invalid_messages_are_dead_lettered_with_their_reason() {
    let Some(connection) = broker().await else {
        return;
    };
    let store = SqliteStore::open().await.unwrap();
    let setup = connection.create_channel().await.unwrap();
    let topology = Topology::new(&unique("dead"));
    topology.declare(&setup).await.unwrap();
    let publishing = publisher(&connection).await;
    let queue = topology.queue();
    let with_header = |id: &str| {
        let mut table = FieldTable::default();
        table.insert("x-tenant".into(), AMQPValue::LongString("acme".into()));
        json_properties(Some(id)).with_headers(table)
    };
    publish(
        &publishing,
        queue,
        with_header("poison-1"),
        br#"{"fail": true}"#,
    )
    .await;
    publish(
        &publishing,
        queue,
        json_properties(Some("order-1")),
        br#"{"cents": 100}"#,
    )
    .await;
    publish(
        &publishing,
        queue,
        json_properties(None),
        br#"{"cents": 5}"#,
    )
    .await;
    publish(
        &publishing,
        queue,
        json_properties(Some("garbled")),
        b"{not json",
    )
    .await;

    let acks = Arc::new(AtomicU64::new(0));
    let channel = connection.create_channel().await.unwrap();
    let running =
        AmqpConsumer::for_topology(channel, &topology, inbox(&store), applying(acks.clone()))
            .spawn();
    wait_until("order-1 is applied", || {
        let acks = acks.clone();
        async move { acks.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // The same id with another payload: a producer's bug.
    publish(
        &publishing,
        queue,
        json_properties(Some("order-1")),
        br#"{"cents": 999}"#,
    )
    .await;

    let mut copies = dead_letters(&setup, &topology, 4).await;
    copies.sort_by_key(|copy| copy.headers[headers::CODE].clone());
    let report = running.shutdown().await.unwrap();
    assert_eq!(report.dead_lettered, 4, "{report}");
    assert_eq!(
        report.retried, 2,
        "two failures before the third dead-letters: {report}"
    );
    assert_eq!(report.executed, 1, "{report}");

    let codes: Vec<&str> = copies
        .iter()
        .map(|c| c.headers[headers::CODE].as_str())
        .collect();
    assert_eq!(codes, ["invalid", "invalid", "payload-mismatch", "poison"]);
    for copy in &copies {
        assert_eq!(copy.headers[headers::QUEUE], queue);
    }
    let poison = &copies[3];
    assert_eq!(poison.message_id.as_deref(), Some("poison-1"));
    assert_eq!(
        poison.headers[headers::REASON],
        r#"the work failed 3 times; last: cannot apply {"fail": true}"#
    );
    assert_eq!(
        poison.headers["x-tenant"], "acme",
        "the original headers are kept"
    );
    let mismatch = &copies[2];
    assert_eq!(mismatch.body, r#"{"cents": 999}"#);
    assert!(copies[..2]
        .iter()
        .any(|c| c.headers[headers::REASON].contains("message-id")));
    assert!(copies[..2]
        .iter()
        .any(|c| c.headers[headers::REASON].contains("not JSON")));

    assert_eq!(
        store.applied("order-1").await,
        1,
        "applied once, the other payload never"
    );
    assert_eq!(store.applied("poison-1").await, 0);
    assert_eq!(ready(&setup, queue).await, 0);
    delete(&setup, &topology).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_finishes_deliveries_in_flight_and_requeues_the_rest() {
    const MESSAGES: usize = 10;
    let Some(connection) = broker().await else {
        return;
    };
    let store = SqliteStore::open().await.unwrap();
    let setup = connection.create_channel().await.unwrap();
    let topology = Topology::new(&unique("shutdown"));
    topology.declare(&setup).await.unwrap();
    let publishing = publisher(&connection).await;
    for n in 0..MESSAGES {
        let id = format!("order-{n}");
        publish(
            &publishing,
            topology.queue(),
            json_properties(Some(&id)),
            b"{}",
        )
        .await;
    }

    // Two deliveries start and wait at a gate; the other eight are prefetched behind them.
    let gate = Arc::new(Notify::new());
    let entered = Arc::new(AtomicU64::new(0));
    let gated = {
        let (gate, entered) = (gate.clone(), entered.clone());
        move |incoming: Incoming<SqliteStore>| {
            let (gate, entered) = (gate.clone(), entered.clone());
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                gate.notified().await;
                let id = incoming.attempt().key().key().to_owned();
                incoming
                    .handle(async move |tx| SqliteStore::apply(tx, &id, "{}").await)
                    .await
            }
        }
    };
    let channel = connection.create_channel().await.unwrap();
    let running = AmqpConsumer::for_topology(channel, &topology, inbox(&store), gated)
        .with_prefetch(MESSAGES as u16)
        .with_concurrency(2)
        .spawn();
    wait_until("two deliveries are in flight", || {
        let entered = entered.clone();
        async move { entered.load(Ordering::SeqCst) == 2 }
    })
    .await;
    let shutdown = tokio::spawn(running.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !shutdown.is_finished(),
        "the shutdown waits for the deliveries in flight"
    );
    gate.notify_waiters();
    let report = tokio::time::timeout(WAIT, shutdown)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(report.executed, 2, "{report}");
    assert_eq!(
        report.requeued_at_shutdown,
        (MESSAGES - 2) as u64,
        "{report}"
    );
    assert_eq!(store.applied_total().await, 2);
    assert_eq!(
        entered.load(Ordering::SeqCst),
        2,
        "no delivery started after the shutdown"
    );
    wait_until("the rest is back in the queue", || {
        let setup = setup.clone();
        let queue = topology.queue().to_owned();
        async move { ready(&setup, &queue).await == (MESSAGES - 2) as u32 }
    })
    .await;

    // Another consumer applies the rest, once.
    let acks = Arc::new(AtomicU64::new(0));
    let channel = connection.create_channel().await.unwrap();
    let running =
        AmqpConsumer::for_topology(channel, &topology, inbox(&store), applying(acks.clone()))
            .spawn();
    wait_until("the rest is applied", || {
        let acks = acks.clone();
        async move { acks.load(Ordering::SeqCst) == (MESSAGES - 2) as u64 }
    })
    .await;
    let report = running.shutdown().await.unwrap();
    assert_eq!(report.executed, (MESSAGES - 2) as u64, "{report}");
    for n in 0..MESSAGES {
        assert_eq!(store.applied(&format!("order-{n}")).await, 1, "order-{n}");
    }
    delete(&setup, &topology).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_between_commit_and_ack_is_redelivered_and_acked_as_a_replay() {
    let Some(doomed) = broker().await else {
        return;
    };
    let store = SqliteStore::open().await.unwrap();
    let survivor = broker().await.unwrap();
    let setup = survivor.create_channel().await.unwrap();
    let topology = Topology::new(&unique("crash"));
    topology.declare(&setup).await.unwrap();
    let publishing = publisher(&survivor).await;
    publish(
        &publishing,
        topology.queue(),
        json_properties(Some("order-7")),
        b"{}",
    )
    .await;

    // The first consumer commits the work, then its process "dies" before the ack: its task is
    // aborted and its connection closed.
    let committed = Arc::new(Notify::new());
    let hangs_after_commit = {
        let committed = committed.clone();
        move |incoming: Incoming<SqliteStore>| {
            let committed = committed.clone();
            async move {
                let action = incoming
                    .handle(async |tx| SqliteStore::apply(tx, "order-7", "{}").await)
                    .await;
                assert_eq!(action, DeliveryAction::Ack { replayed: false });
                committed.notify_one();
                std::future::pending::<DeliveryAction>().await
            }
        }
    };
    let channel = doomed.create_channel().await.unwrap();
    let first = AmqpConsumer::for_topology(channel, &topology, inbox(&store), hangs_after_commit);
    let first = tokio::spawn(first.run_until(std::future::pending()));
    tokio::time::timeout(WAIT, committed.notified())
        .await
        .unwrap();
    first.abort();
    doomed.close(200, "simulated crash".into()).await.unwrap();

    // The broker redelivers it, flagged; the second consumer acks it as a replay.
    let seen = Arc::new(AtomicBool::new(false));
    let redelivered = Arc::new(AtomicBool::new(false));
    let replayed = Arc::new(AtomicBool::new(false));
    let observing = {
        let (seen, redelivered, replayed) = (seen.clone(), redelivered.clone(), replayed.clone());
        move |incoming: Incoming<SqliteStore>| {
            let (seen, redelivered, replayed) =
                (seen.clone(), redelivered.clone(), replayed.clone());
            async move {
                redelivered.store(incoming.redelivered(), Ordering::SeqCst);
                let action = incoming
                    .handle(async |tx| SqliteStore::apply(tx, "order-7", "{}").await)
                    .await;
                replayed.store(
                    action == DeliveryAction::Ack { replayed: true },
                    Ordering::SeqCst,
                );
                seen.store(true, Ordering::SeqCst);
                action
            }
        }
    };
    let channel = survivor.create_channel().await.unwrap();
    let second = AmqpConsumer::for_topology(channel, &topology, inbox(&store), observing).spawn();
    wait_until("the redelivery is handled", || {
        let seen = seen.clone();
        async move { seen.load(Ordering::SeqCst) }
    })
    .await;
    let report = second.shutdown().await.unwrap();
    assert!(
        redelivered.load(Ordering::SeqCst),
        "the broker flags the redelivery"
    );
    assert!(replayed.load(Ordering::SeqCst), "{report}");
    assert_eq!(report.replayed, 1, "{report}");
    assert_eq!(store.applied("order-7").await, 1);
    assert_eq!(ready(&setup, topology.queue()).await, 0);
    delete(&setup, &topology).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quorum_queue_dead_letters_a_message_that_keeps_crashing_the_consumer() {
    let Some(connection) = broker().await else {
        return;
    };
    let store = SqliteStore::open().await.unwrap();
    let setup = connection.create_channel().await.unwrap();
    let topology = Topology::new(&unique("crashloop")).with_delivery_limit(1);
    topology.declare(&setup).await.unwrap();
    let publishing = publisher(&connection).await;
    publish(
        &publishing,
        topology.queue(),
        json_properties(Some("order-9")),
        b"{}",
    )
    .await;

    // Each consumer "crashes" inside the work: the consumer cannot count that, the broker can.
    for _ in 0..2 {
        let process = broker().await.unwrap();
        let started = Arc::new(Notify::new());
        let crashing = {
            let started = started.clone();
            move |_incoming: Incoming<SqliteStore>| {
                let started = started.clone();
                async move {
                    started.notify_one();
                    std::future::pending::<DeliveryAction>().await
                }
            }
        };
        let channel = process.create_channel().await.unwrap();
        let consumer = AmqpConsumer::for_topology(channel, &topology, inbox(&store), crashing);
        let task = tokio::spawn(consumer.run_until(std::future::pending()));
        tokio::time::timeout(WAIT, started.notified())
            .await
            .unwrap();
        task.abort();
        process.close(200, "simulated crash".into()).await.unwrap();
    }
    let copies = dead_letters(&setup, &topology, 1).await;
    assert_eq!(copies[0].message_id.as_deref(), Some("order-9"));
    assert_eq!(ready(&setup, topology.queue()).await, 0);
    assert_eq!(store.applied("order-9").await, 0);
    delete(&setup, &topology).await;
}

/// `Topology::quorum` declares both queues as quorum queues (the broker then refuses them as
/// classic ones), redeclares them alike, and the consumer applies each message once from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quorum_queues_carry_the_messages_and_refuse_a_classic_redeclaration() {
    const MESSAGES: usize = 20;
    let Some(connection) = broker().await else {
        return;
    };
    let store = SqliteStore::open().await.unwrap();
    let setup = connection.create_channel().await.unwrap();
    let topology = Topology::new(&unique("quorum")).quorum();
    assert!(topology.is_quorum());
    topology.declare(&setup).await.unwrap();
    topology.declare(&setup).await.unwrap();
    // Both queues are quorum queues: declared as classic ones, the broker refuses them.
    let classic = Topology::new(topology.queue());
    let other_channel = connection.create_channel().await.unwrap();
    let refused = classic.declare(&other_channel);
    assert!(
        refused.await.is_err(),
        "the work queue is not a quorum queue"
    );
    let dead_letters_as_classic = connection
        .create_channel()
        .await
        .unwrap()
        .queue_declare(
            topology.dead_letter_queue().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(
        dead_letters_as_classic.is_err(),
        "the dead-letter queue is not a quorum queue"
    );

    let publishing = publisher(&connection).await;
    for n in 0..MESSAGES {
        for _ in 0..2 {
            let id = format!("order-{n}");
            publish(
                &publishing,
                topology.queue(),
                json_properties(Some(&id)),
                br#"{"cents": 100}"#,
            )
            .await;
        }
    }
    let acks = Arc::new(AtomicU64::new(0));
    let channel = connection.create_channel().await.unwrap();
    let running =
        AmqpConsumer::for_topology(channel, &topology, inbox(&store), applying(acks.clone()))
            .spawn();
    wait_until("every copy is acked", || {
        let acks = acks.clone();
        async move { acks.load(Ordering::SeqCst) == 2 * MESSAGES as u64 }
    })
    .await;
    let report = running.shutdown().await.unwrap();
    assert_eq!(
        (report.executed, report.replayed),
        (MESSAGES as u64, MESSAGES as u64),
        "{report}"
    );
    assert_eq!(store.applied_total().await, MESSAGES as i64);
    assert_eq!(ready(&setup, topology.queue()).await, 0);
    delete(&setup, &topology).await;
}

/// `Brokers` passes over a node that refuses, and starts each connection after the node it
/// connected to last (what a client reconnecting after its node died needs).
#[tokio::test]
async fn brokers_pass_over_a_node_that_refuses_and_turn_to_the_next() {
    let Some(connection) = broker().await else {
        return;
    };
    let _ = connection.close(200, "only checking".into()).await;
    let url = std::env::var("TEST_AMQP_URL").unwrap();
    // Nothing listens on port 1.
    let refusing = "amqp://idem:idem@127.0.0.1:1/idem";
    let properties = lapin::ConnectionProperties::default;

    let mut brokers = Brokers::parse(&format!("{refusing}, {url}"));
    assert_eq!(brokers.urls(), [refusing, url.as_str()]);
    for _ in 0..2 {
        let (connection, index) = brokers.connect(properties()).await.unwrap();
        assert_eq!(index, 1, "connected to the refusing node");
        connection.close(200, "done".into()).await.unwrap();
    }

    let mut brokers = Brokers::new([url.as_str(), url.as_str(), url.as_str()]);
    let mut turns = Vec::new();
    for _ in 0..4 {
        let (connection, index) = brokers.connect(properties()).await.unwrap();
        turns.push(index);
        connection.close(200, "done".into()).await.unwrap();
    }
    assert_eq!(turns, [0, 1, 2, 0]);

    let mut nobody = Brokers::new([refusing]);
    assert!(nobody.connect(properties()).await.is_err());
    assert!(Brokers::new(Vec::<String>::new())
        .connect(properties())
        .await
        .is_err());
}
