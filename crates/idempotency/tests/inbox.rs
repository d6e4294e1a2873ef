//! The queue's inbox (`idempotency::queue::Inbox`) on PostgreSQL, SQLite and MySQL/MariaDB: the same
//! message delivered to many consumers at once takes effect once, another payload under a used id
//! is dead-lettered and never applied, failures release the key and are counted, and a poison
//! message ends in the dead-letter queue.

mod common;

use common::{unique, Harness};
use futures_util::future::join_all;
use idempotency::{
    durable::{CallError, Finished, Operation, StepError, Steps},
    queue::{DeadLetter, DeliveryAction, FailureKind, Inbox},
    store::{KeyState, Maintenance},
    Attempt, Idempotency, IdempotencyKey,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::{sync::Arc, time::Duration};
use tokio::sync::{Barrier, Notify};

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    concurrent_deliveries_of_one_message_take_effect_once,
    a_redelivery_after_completion_is_acked_as_a_replay,
    the_same_id_with_another_payload_is_dead_lettered_and_never_applied,
    a_delivery_while_another_runs_waits_for_it_or_is_retried_later,
    a_transient_failure_releases_the_key_and_a_redelivery_applies_once,
    a_poison_message_is_dead_lettered_after_max_failures,
    definitive_and_unavailable_failures_are_not_counted,
    concurrent_failures_of_one_message_are_each_counted,
    a_failure_counter_expires_with_its_retention_and_is_purged,
    durable_operations_consume_once,
    a_parked_durable_operation_is_dead_lettered_with_its_reason,
}

/// The queue the messages come from: the keys' scope.
const QUEUE: &str = "orders-queue";
/// The message type: the keys' operation.
const TYPE: &str = "order.paid";
/// How long a test waits for something that should happen.
const WAIT: Duration = Duration::from_secs(15);

fn message(id: &str, payload: serde_json::Value) -> Attempt {
    Attempt::message_json(QUEUE, TYPE, id, &payload).unwrap()
}

/// An inbox with short retry delays, so that tests do not wait.
fn inbox<S: Harness>(store: &S) -> Inbox<S> {
    Inbox::new(Idempotency::new(store.clone()))
        .with_retry_delay(Duration::from_millis(10))
        .with_max_retry_delay(Duration::from_millis(40))
}

/// Delivers `message` once: its work writes one effect for `trial`.
async fn deliver<S: Harness>(inbox: &Inbox<S>, message: &Attempt, trial: &str) -> DeliveryAction {
    let trial = trial.to_owned();
    inbox
        .handle(message, async move |tx| {
            S::insert_effect(tx, &trial).await?;
            Ok::<_, sqlx::Error>(json!({ "applied": trial }))
        })
        .await
}

/// A delivery whose work fails with `error` after writing an effect (rolled back).
async fn deliver_failing<S: Harness>(
    inbox: &Inbox<S>,
    message: &Attempt,
    trial: &str,
    error: &str,
) -> DeliveryAction {
    let (trial, error) = (trial.to_owned(), error.to_owned());
    inbox
        .handle(message, async move |tx| {
            S::insert_effect(tx, &trial)
                .await
                .map_err(|e| e.to_string())?;
            Err::<(), String>(error)
        })
        .await
}

/// A work that panics.
async fn panicking<DB: sqlx::Database>(_tx: &mut sqlx::Transaction<'_, DB>) -> Result<(), String> {
    panic!("cannot parse order")
}

/// A work that fails with `error` and writes nothing.
fn failing<DB: sqlx::Database>(
    error: &'static str,
) -> impl for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, DB>) -> Result<(), String> + Send {
    async move |_tx| Err(error.to_owned())
}

/// Delivers again, as a broker would, until the delivery is no longer `RetryLater` (waiting the
/// given delay each time).
async fn redeliver_until_settled<S: Harness>(
    inbox: &Inbox<S>,
    message: &Attempt,
    trial: &str,
) -> DeliveryAction {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let action = deliver(inbox, message, trial).await;
        match action {
            DeliveryAction::RetryLater { delay } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(delay).await
            }
            other => return other,
        }
    }
}

async fn concurrent_deliveries_of_one_message_take_effect_once<S: Harness>(store: S) {
    const TRIALS: usize = 200;
    const CONSUMERS: usize = 8;
    let (mut executed, mut replayed, mut later) = (0, 0, 0);
    let started = std::time::Instant::now();
    for trial in 0..TRIALS {
        // Odd trials without the replay read, so both ways into the reservation are raced; half
        // the trials answer `RetryLater` at once instead of waiting for the copy in progress.
        let wait = if trial % 4 < 2 {
            Duration::ZERO
        } else {
            Duration::from_secs(1)
        };
        let inbox = Inbox::new(Idempotency::new(store.clone()).with_replay_first(trial % 2 == 0))
            .with_in_progress_wait(wait);
        let trial = format!("{}-{trial}", unique("race"));
        let message = message(&trial, json!({ "order": trial, "cents": 1200 }));
        let barrier = Arc::new(Barrier::new(CONSUMERS));
        let deliveries = (0..CONSUMERS).map(|_| {
            let (inbox, message, barrier) = (inbox.clone(), message.clone(), barrier.clone());
            let trial = trial.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let applied = trial.clone();
                inbox
                    .handle(&message, async move |tx| {
                        S::insert_effect(tx, &applied).await?;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        Ok::<_, sqlx::Error>(())
                    })
                    .await
            })
        });
        let mut retried = 0;
        for action in join_all(deliveries).await {
            match action.unwrap() {
                DeliveryAction::Ack { replayed: false } => executed += 1,
                DeliveryAction::Ack { replayed: true } => replayed += 1,
                DeliveryAction::RetryLater { delay } => {
                    assert!(delay <= Duration::from_secs(1), "{delay:?}");
                    later += 1;
                    retried += 1;
                }
                other => panic!("{}: trial {trial}: unexpected {other:?}", S::NAME),
            }
        }
        // The broker redelivers what was retried later: each is acked as a replay.
        for _ in 0..retried {
            let action = redeliver_until_settled(&inbox, &message, &trial).await;
            assert_eq!(
                action,
                DeliveryAction::Ack { replayed: true },
                "{}",
                S::NAME
            );
        }
        assert_eq!(
            store.count_effects(&trial).await,
            1,
            "{}: trial {trial}",
            S::NAME
        );
    }
    assert_eq!(executed, TRIALS, "exactly one execution per message");
    eprintln!(
        "{}: {TRIALS} messages x {CONSUMERS} concurrent consumers: executed {executed}, replayed {replayed}, retried later {later} ({:.1} s)",
        S::NAME,
        started.elapsed().as_secs_f64()
    );
}

async fn a_redelivery_after_completion_is_acked_as_a_replay<S: Harness>(store: S) {
    let inbox = inbox(&store);
    let trial = unique("replay");
    let first =
        Attempt::message_json_bytes(QUEUE, TYPE, &trial, br#"{"order":"o-1","cents":5}"#).unwrap();
    assert_eq!(
        deliver(&inbox, &first, &trial).await,
        DeliveryAction::Ack { replayed: false }
    );
    // The same JSON, keys reordered and spaced differently: the same message.
    let again = Attempt::message_json_bytes(
        QUEUE,
        TYPE,
        &trial,
        b"{ \"cents\": 5,\n \"order\": \"o-1\" }",
    )
    .unwrap();
    assert_eq!(again.fingerprint(), first.fingerprint());
    for _ in 0..3 {
        assert_eq!(
            deliver(&inbox, &again, &trial).await,
            DeliveryAction::Ack { replayed: true }
        );
    }
    assert_eq!(store.count_effects(&trial).await, 1);
    // The same id in another scope (another consumer group) is another message.
    let other_group =
        Attempt::message_json_bytes("audit-queue", TYPE, &trial, br#"{"order":"o-1","cents":5}"#)
            .unwrap();
    assert_eq!(
        deliver(&inbox, &other_group, &trial).await,
        DeliveryAction::Ack { replayed: false }
    );
    assert_eq!(store.count_effects(&trial).await, 2);
}

async fn the_same_id_with_another_payload_is_dead_lettered_and_never_applied<S: Harness>(store: S) {
    let inbox = inbox(&store);
    let trial = unique("mismatch");
    let original = message(&trial, json!({ "cents": 100 }));
    let tampered = message(&trial, json!({ "cents": 999 }));
    let tampered_trial = format!("{trial}/tampered");

    // While the original is being applied …
    let gate = Arc::new(Notify::new());
    let running = Arc::new(Notify::new());
    let holder = {
        let (inbox, original, trial) = (inbox.clone(), original.clone(), trial.clone());
        let (gate, running) = (gate.clone(), running.clone());
        tokio::spawn(async move {
            inbox
                .handle(&original, async move |tx| {
                    S::insert_effect(tx, &trial).await?;
                    running.notify_one();
                    gate.notified().await;
                    Ok::<_, sqlx::Error>(())
                })
                .await
        })
    };
    tokio::time::timeout(WAIT, running.notified())
        .await
        .unwrap();
    assert_eq!(
        deliver(&inbox, &tampered, &tampered_trial).await,
        DeliveryAction::DeadLetter(DeadLetter::PayloadMismatch)
    );
    gate.notify_one();
    assert_eq!(
        holder.await.unwrap(),
        DeliveryAction::Ack { replayed: false }
    );

    // … and after it completed.
    let action = deliver(&inbox, &tampered, &tampered_trial).await;
    assert_eq!(
        action,
        DeliveryAction::DeadLetter(DeadLetter::PayloadMismatch)
    );
    assert_eq!(
        action.to_string(),
        "dead-letter: the message id was already used with another payload"
    );
    assert_eq!(
        store.count_effects(&tampered_trial).await,
        0,
        "never applied"
    );
    // The original is still acked as a replay, and applied once.
    assert_eq!(
        deliver(&inbox, &original, &trial).await,
        DeliveryAction::Ack { replayed: true }
    );
    assert_eq!(store.count_effects(&trial).await, 1);
    // Raw payloads are compared byte for byte.
    let bytes = unique("bytes");
    let raw = Attempt::message_bytes(QUEUE, TYPE, &bytes, b"\x08\x96\x01").unwrap();
    assert!(deliver(&inbox, &raw, &bytes).await.is_ack());
    let other_raw = Attempt::message_bytes(QUEUE, TYPE, &bytes, b"\x08\x96\x02").unwrap();
    assert_eq!(
        deliver(&inbox, &other_raw, &bytes).await,
        DeliveryAction::DeadLetter(DeadLetter::PayloadMismatch)
    );
    assert_eq!(store.count_effects(&bytes).await, 1);
}

async fn a_delivery_while_another_runs_waits_for_it_or_is_retried_later<S: Harness>(store: S) {
    let inbox = inbox(&store).with_in_progress_wait(Duration::ZERO);
    let trial = unique("in-progress");
    let message = message(&trial, json!({ "cents": 1 }));
    let gate = Arc::new(Notify::new());
    let running = Arc::new(Notify::new());
    let first = {
        let (inbox, message, trial) = (inbox.clone(), message.clone(), trial.clone());
        let (gate, running) = (gate.clone(), running.clone());
        tokio::spawn(async move {
            inbox
                .handle(&message, async move |tx| {
                    S::insert_effect(tx, &trial).await?;
                    running.notify_one();
                    gate.notified().await;
                    Ok::<_, sqlx::Error>(())
                })
                .await
        })
    };
    tokio::time::timeout(WAIT, running.notified())
        .await
        .unwrap();
    let second = deliver(&inbox, &message, &trial).await;
    let DeliveryAction::RetryLater { delay } = second else {
        panic!("{}: expected RetryLater, got {second:?}", S::NAME)
    };
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(1),
        "{delay:?}"
    );
    // In progress is not a failure.
    assert_eq!(inbox.recorded_failures(&message).await.unwrap(), 0);
    // With a wait, a delivery that arrives meanwhile is acked as soon as the first completes.
    let waiting = {
        let inbox = inbox.clone().with_in_progress_wait(WAIT);
        let (message, trial) = (message.clone(), trial.clone());
        tokio::spawn(async move { deliver(&inbox, &message, &trial).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "it waits for the copy in progress");
    gate.notify_one();
    assert_eq!(
        first.await.unwrap(),
        DeliveryAction::Ack { replayed: false }
    );
    assert_eq!(
        waiting.await.unwrap(),
        DeliveryAction::Ack { replayed: true }
    );
    assert_eq!(
        deliver(&inbox, &message, &trial).await,
        DeliveryAction::Ack { replayed: true }
    );
    assert_eq!(store.count_effects(&trial).await, 1);
}

async fn a_transient_failure_releases_the_key_and_a_redelivery_applies_once<S: Harness>(store: S) {
    let inbox = inbox(&store);
    let trial = unique("transient");
    let message = message(&trial, json!({ "cents": 7 }));
    let action = deliver_failing(&inbox, &message, &trial, "inventory service timed out").await;
    assert_eq!(
        action,
        DeliveryAction::Retry {
            delay: Duration::from_millis(10),
            reason: "inventory service timed out".into()
        }
    );
    // Nothing applied, the key released, the failure counted.
    assert_eq!(store.count_effects(&trial).await, 0);
    assert!(store.find(message.key()).await.unwrap().is_none());
    assert_eq!(inbox.recorded_failures(&message).await.unwrap(), 1);
    // The redelivery applies it, once.
    assert_eq!(
        deliver(&inbox, &message, &trial).await,
        DeliveryAction::Ack { replayed: false }
    );
    assert_eq!(
        deliver(&inbox, &message, &trial).await,
        DeliveryAction::Ack { replayed: true }
    );
    assert_eq!(store.count_effects(&trial).await, 1);
    let record = store.find(message.key()).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Completed);
}

async fn a_poison_message_is_dead_lettered_after_max_failures<S: Harness>(store: S) {
    let inbox = inbox(&store).with_max_failures(3);
    let trial = unique("poison");
    let message = message(&trial, json!({ "cents": 13 }));

    let first = deliver_failing(&inbox, &message, &trial, "boom 1").await;
    assert_eq!(first.delay(), Some(Duration::from_millis(10)), "{first:?}");
    // A panic is a failure too, and does not take the inbox down.
    let panicked = inbox.handle(&message, panicking::<S::Database>).await;
    let DeliveryAction::Retry { delay, reason } = panicked else {
        panic!("{}: expected Retry, got {panicked:?}", S::NAME)
    };
    assert_eq!(delay, Duration::from_millis(20), "the delay doubles");
    assert_eq!(reason, "the work panicked: cannot parse order");
    assert!(
        store.find(message.key()).await.unwrap().is_none(),
        "released after the panic"
    );

    let third = deliver_failing(&inbox, &message, &trial, "boom 3").await;
    assert_eq!(
        third,
        DeliveryAction::DeadLetter(DeadLetter::Poison {
            failures: 3,
            last_error: "boom 3".into()
        })
    );
    assert_eq!(
        third.to_string(),
        "dead-letter: the work failed 3 times; last: boom 3"
    );
    assert_eq!(store.count_effects(&trial).await, 0, "never applied");
    assert_eq!(inbox.recorded_failures(&message).await.unwrap(), 3);

    // Re-driven from the dead-letter queue: one more attempt per delivery. A failure goes
    // straight back; once the bug is fixed it is applied, once.
    let again = deliver_failing(&inbox, &message, &trial, "boom 4").await;
    assert!(
        matches!(
            again,
            DeliveryAction::DeadLetter(DeadLetter::Poison { failures: 3, .. })
        ),
        "{again:?}"
    );
    assert_eq!(
        deliver(&inbox, &message, &trial).await,
        DeliveryAction::Ack { replayed: false }
    );
    assert_eq!(
        deliver_failing(&inbox, &message, &trial, "not run").await,
        DeliveryAction::Ack { replayed: true }
    );
    assert_eq!(store.count_effects(&trial).await, 1);

    // A message that fails for good on its first failure, with max_failures = 1.
    let strict = inbox.clone().with_max_failures(1);
    let once = unique("poison-once");
    let message = self::message(&once, json!({}));
    assert!(matches!(
        deliver_failing(&strict, &message, &once, "boom").await,
        DeliveryAction::DeadLetter(DeadLetter::Poison { failures: 1, .. })
    ));
}

async fn definitive_and_unavailable_failures_are_not_counted<S: Harness>(store: S) {
    let inbox = inbox(&store);
    let trial = unique("classified");
    let message = message(&trial, json!({ "sku": "gone" }));
    let classify = |error: &String| {
        if error.starts_with("unknown sku") {
            FailureKind::Definitive
        } else {
            FailureKind::Unavailable
        }
    };
    let failing = failing::<S::Database>;

    let definitive = inbox
        .handle_with(&message, classify, failing("unknown sku: gone"))
        .await;
    assert_eq!(
        definitive,
        DeliveryAction::DeadLetter(DeadLetter::Definitive("unknown sku: gone".into()))
    );
    let unavailable = inbox
        .handle_with(
            &message,
            classify,
            failing("pricing service: connection refused"),
        )
        .await;
    assert_eq!(
        unavailable,
        DeliveryAction::Retry {
            delay: Duration::from_millis(10),
            reason: "pricing service: connection refused".into()
        }
    );
    assert_eq!(inbox.recorded_failures(&message).await.unwrap(), 0);
    assert!(
        store.find(message.key()).await.unwrap().is_none(),
        "released"
    );
    assert_eq!(
        deliver(&inbox, &message, &trial).await,
        DeliveryAction::Ack { replayed: false }
    );
    assert_eq!(store.count_effects(&trial).await, 1);
}

// --- Durable operations ------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Shipment {
    trial: String,
    fail_first_step: bool,
}

/// A durable operation: a local step writing `{trial}/reserved`, then `finish` writing
/// `{trial}` and completing the key. `fail_first_step` makes the first step fail.
struct Ship;

impl<S: Harness> Operation<S> for Ship {
    type Request = Shipment;
    type Response = String;

    fn name(&self) -> &str {
        "shipment.requested"
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        request: &Shipment,
    ) -> Result<Finished<String>, StepError> {
        let reserved = format!("{}/reserved", request.trial);
        let fail = request.fail_first_step;
        steps
            .local("reserve", async move |tx| {
                if fail {
                    return Err("warehouse locked".to_owned());
                }
                S::insert_effect(tx, &reserved)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok(())
            })
            .await?;
        let trial = request.trial.clone();
        steps
            .finish(async move |tx| {
                S::insert_effect(tx, &trial).await?;
                Ok::<_, sqlx::Error>(format!("shipped {trial}"))
            })
            .await
    }
}

/// A durable operation that sends a mail through a provider without keys, whose answer is lost:
/// its key is parked.
struct Mail;

impl<S: Harness> Operation<S> for Mail {
    type Request = String;
    type Response = String;

    fn name(&self) -> &str {
        "mail.requested"
    }

    async fn run(&self, steps: &mut Steps<S>, _to: &String) -> Result<Finished<String>, StepError> {
        steps
            .call_unkeyed("send", || async {
                Err::<String, _>(CallError::Unknown("smtp timeout after DATA".into()))
            })
            .await?;
        unreachable!("the answer is always lost")
    }
}

/// Copies of one message that fail at the same time: each failure is counted, never two as one.
/// `COPIES` consumers each deliver the message until their delivery fails (a delivery that finds
/// another copy running is redelivered); every failure then counts.
async fn concurrent_failures_of_one_message_are_each_counted<S: Harness>(store: S) {
    const COPIES: u32 = 12;
    let inbox = inbox(&store)
        .with_max_failures(10 * COPIES)
        .with_in_progress_wait(Duration::ZERO);
    let trial = unique("failing-copies");
    let message = message(&trial, json!({ "cents": 21 }));
    let barrier = Arc::new(Barrier::new(COPIES as usize));
    let copies: Vec<_> = (0..COPIES)
        .map(|_| {
            let (inbox, message, trial, barrier) = (
                inbox.clone(),
                message.clone(),
                trial.clone(),
                barrier.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                let deadline = tokio::time::Instant::now() + WAIT;
                loop {
                    match deliver_failing(&inbox, &message, &trial, "boom").await {
                        DeliveryAction::RetryLater { .. }
                            if tokio::time::Instant::now() < deadline =>
                        {
                            tokio::time::sleep(Duration::from_millis(1)).await
                        }
                        other => return other,
                    }
                }
            })
        })
        .collect();
    for copy in join_all(copies).await {
        let action = copy.expect("a copy");
        assert!(
            matches!(&action, DeliveryAction::Retry { reason, .. } if reason == "boom"),
            "{}: {action:?}",
            S::NAME
        );
    }
    assert_eq!(
        inbox.recorded_failures(&message).await.unwrap(),
        COPIES,
        "{}: every failure counted",
        S::NAME
    );
    assert_eq!(store.count_effects(&trial).await, 0, "never applied");
}

/// A failure counter lives one retention after its last failure: then it reads 0, the next
/// failure counts 1 again, and the purge deletes it with the keys.
async fn a_failure_counter_expires_with_its_retention_and_is_purged<S: Harness + Maintenance>(
    store: S,
) {
    // Retention zero: every row written is past its retention at once.
    let inbox = Inbox::new(Idempotency::new(store.clone()).with_retention(Duration::ZERO))
        .with_retry_delay(Duration::from_millis(10))
        .with_max_retry_delay(Duration::from_millis(40));
    let trial = unique("expiring");
    let message = message(&trial, json!({ "cents": 34 }));
    let first = deliver_failing(&inbox, &message, &trial, "boom 1").await;
    assert_eq!(first.delay(), Some(Duration::from_millis(10)), "{first:?}");
    assert_eq!(
        inbox.recorded_failures(&message).await.unwrap(),
        0,
        "expired"
    );
    // Counted from 1 again: the first delay, not the doubled one.
    let second = deliver_failing(&inbox, &message, &trial, "boom 2").await;
    assert_eq!(
        second.delay(),
        Some(Duration::from_millis(10)),
        "{second:?}"
    );

    let counter = IdempotencyKey::new(QUEUE, format!("{TYPE}#failures"), &trial).unwrap();
    let row = store
        .find(&counter)
        .await
        .unwrap()
        .expect("the counter's row");
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(row.recovery_attempts, 1);
    assert_eq!(
        row.result.as_deref(),
        Some(br#"{"error":"boom 2"}"#.as_slice())
    );
    while store.purge_batch(100).await.unwrap() > 0 {}
    assert!(
        store.find(&counter).await.unwrap().is_none(),
        "{}: purged with the keys",
        S::NAME
    );
}

async fn durable_operations_consume_once<S: Harness>(store: S) {
    const TRIALS: usize = 25;
    const CONSUMERS: usize = 8;
    let inbox = inbox(&store);
    for trial in 0..TRIALS {
        let trial = format!("{}-{trial}", unique("durable"));
        let request = Shipment {
            trial: trial.clone(),
            fail_first_step: false,
        };
        let barrier = Arc::new(Barrier::new(CONSUMERS));
        let deliveries = (0..CONSUMERS).map(|_| {
            let (inbox, request, barrier) = (inbox.clone(), request.clone(), barrier.clone());
            let id = trial.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                inbox.perform(QUEUE, &id, &Ship, &request).await
            })
        });
        let mut executed = 0;
        for action in join_all(deliveries).await {
            match action.unwrap() {
                DeliveryAction::Ack { replayed: false } => executed += 1,
                DeliveryAction::Ack { replayed: true } | DeliveryAction::RetryLater { .. } => {}
                other => panic!("{}: trial {trial}: unexpected {other:?}", S::NAME),
            }
        }
        assert_eq!(executed, 1, "{}: trial {trial}", S::NAME);
        assert_eq!(
            inbox.perform(QUEUE, &trial, &Ship, &request).await,
            DeliveryAction::Ack { replayed: true }
        );
        assert_eq!(store.count_effects(&trial).await, 1);
        assert_eq!(store.count_effects(&format!("{trial}/reserved")).await, 1);
    }

    // A first step that fails records nothing: the key is released and the failure counted.
    let trial = unique("durable-fail");
    let failing = Shipment {
        trial: trial.clone(),
        fail_first_step: true,
    };
    let action = inbox.perform(QUEUE, &trial, &Ship, &failing).await;
    assert!(
        matches!(&action, DeliveryAction::Retry { reason, .. } if reason.contains("warehouse locked")),
        "{action:?}"
    );
    let message = Attempt::message_json(QUEUE, "shipment.requested", &trial, &failing).unwrap();
    assert_eq!(inbox.recorded_failures(&message).await.unwrap(), 1);
    assert!(store.find(message.key()).await.unwrap().is_none());
}

async fn a_parked_durable_operation_is_dead_lettered_with_its_reason<S: Harness>(store: S) {
    let inbox = inbox(&store);
    let id = unique("mail");
    let request = "alice@example.com".to_owned();
    let first = inbox.perform(QUEUE, &id, &Mail, &request).await;
    let DeliveryAction::DeadLetter(DeadLetter::NeedsReview(Some(reason))) = &first else {
        panic!(
            "{}: expected a dead-letter for review, got {first:?}",
            S::NAME
        )
    };
    assert!(reason.contains("smtp timeout"), "{reason}");
    // A redelivery is dead-lettered with the same reason, read from the parked key.
    let again = inbox.perform(QUEUE, &id, &Mail, &request).await;
    assert_eq!(again, first);
    if let DeliveryAction::DeadLetter(why) = &again {
        assert_eq!(why.code(), "needs-review");
    }
}
