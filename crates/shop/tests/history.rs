//! A key's history, on SQLite, PostgreSQL and MariaDB: a purchase abandoned in the middle of its
//! charge (the worker's task dropped while the provider is still answering) and finished by the
//! resumer (the recovery job with the shop's operations) reads back as reserved, the order step
//! committed, the charge started, the claim by the resumer (another actor), the charge answered
//! and the completion, in that order.

use idempotency::{
    durable::Operations,
    maintenance::{EventKind, KeyEvent, Recovery},
    store::{KeyState, Maintenance},
    Idempotency,
};
use shop::{
    db::{self, ShopDb, StoreConn},
    providers::{Faults, PaymentProvider},
    purchase::{Purchase, PurchaseRequest},
};
use std::time::Duration;
use test_support::TestDatabase;

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_purchase_abandoned_mid_call_and_resumed_reads_back_in_order,
}

/// On a fresh shop database of `backend`: the web worker's store and the resumer's (the same
/// database, two worker names), and a slow payment provider (the charge is still under way when
/// the worker goes away).
async fn a_purchase_abandoned_mid_call_and_resumed_reads_back_in_order(backend: TestDatabase) {
    let Some(database) = backend.fresh_database().await else {
        return;
    };
    let (shop, providers) = db::connect(&database.url, 8).await.expect("connect");
    shop.migrate().await.expect("migrate the shop");
    providers.migrate().await.expect("migrate the providers");
    let payment = PaymentProvider::new(
        providers,
        Faults {
            fail_rate: 0.0,
            latency: Duration::from_millis(700),
        },
    );
    match shop {
        ShopDb::Pg(store) => {
            let web = store.clone().with_worker_name("web-1");
            abandoned_then_resumed(web, store.with_worker_name("resumer"), payment).await
        }
        ShopDb::Sqlite(store) => {
            let web = store.clone().with_worker_name("web-1");
            abandoned_then_resumed(web, store.with_worker_name("resumer"), payment).await
        }
        ShopDb::My(store) => {
            let web = store.clone().with_worker_name("web-1");
            abandoned_then_resumed(web, store.with_worker_name("resumer"), payment).await
        }
    }
    drop(database);
}

/// The body: abandon a purchase mid-charge on `web`, resume it on `resumer`, read the history.
async fn abandoned_then_resumed<S>(web: S, resumer: S, payment: PaymentProvider)
where
    S: StoreConn + Maintenance,
{
    let purchase = Purchase::new(payment, false);
    let lease = Duration::from_millis(800);
    let request = PurchaseRequest {
        user: "alice".into(),
        sku: "tea".into(),
        quantity: 1,
    };
    let client_key = uuid::Uuid::new_v4().to_string();
    let key = idempotency::IdempotencyKey::new("alice", shop::purchase::PURCHASE, &client_key)
        .expect("a valid key");

    // 1. The web worker starts the purchase and goes away while the charge is under way.
    let engine = Idempotency::new(web.clone()).with_lease(lease);
    let worker = {
        let (engine, purchase, request, client_key) = (
            engine.clone(),
            purchase.clone(),
            request.clone(),
            client_key.clone(),
        );
        tokio::spawn(async move {
            engine
                .perform(&purchase, "alice", &client_key, &request)
                .await
        })
    };
    let started = wait_for(&web, &key, |history| {
        history.iter().any(|e| e.kind == EventKind::CallStarted)
    })
    .await;
    assert!(started, "the charge never started");
    worker.abort();
    let _ = worker.await;
    let row = web.find(&key).await.unwrap().expect("the abandoned key");
    assert_eq!(row.state, KeyState::Pending, "{row:?}");

    // 2. Once its lease has ended, the resumer claims the purchase and finishes it.
    let operations = Operations::new().with(purchase);
    let resumer_engine = Idempotency::new(resumer.clone()).with_lease(Duration::from_secs(30));
    let recovery = Recovery::new(resumer.clone()).with_operations(resumer_engine, operations);
    let mut completed = false;
    for _ in 0..100 {
        recovery.run_once().await.expect("a recovery pass");
        let row = resumer.find(&key).await.unwrap().expect("the key");
        if row.state == KeyState::Completed {
            completed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(completed, "the resumer did not finish the purchase");

    // 3. The history, oldest first.
    let history = resumer.history(&key, 100).await.expect("history");
    let expected = [
        EventKind::Reserved,
        EventKind::StepCommitted,
        EventKind::CallStarted,
        EventKind::Claimed,
        EventKind::CallAnswered,
        EventKind::Completed,
    ];
    let positions = in_order(&history, &expected);
    let claimed = &history[positions[3]];
    assert_eq!(claimed.actor.as_deref(), Some("resumer"), "{history:#?}");
    let reserved = &history[positions[0]];
    assert_eq!(reserved.actor.as_deref(), Some("web-1"), "{history:#?}");
    let step = &history[positions[1]];
    assert_eq!(step.detail.as_deref(), Some("order"), "{history:#?}");
    let charge_key = idempotency::durable::provider_key(&key, "charge");
    let answered = history[positions[4]].detail.as_deref().unwrap_or_default();
    assert!(answered.starts_with(&charge_key), "{answered}");
    assert!(answered.contains("ch_"), "the answer's excerpt: {answered}");
    assert_eq!(history.last().map(|e| e.kind), Some(EventKind::Completed));
}

/// The positions of `expected` in `history`, each after the one before; panics with the history
/// when one is missing.
fn in_order(history: &[KeyEvent], expected: &[EventKind]) -> Vec<usize> {
    let mut positions = Vec::new();
    let mut from = 0;
    for kind in expected {
        let Some(found) = history[from..].iter().position(|e| e.kind == *kind) else {
            panic!("no {kind} after position {from} in {history:#?}");
        };
        positions.push(from + found);
        from += found + 1;
    }
    positions
}

/// Polls the history of `key` until `done` holds (at most 20 s).
async fn wait_for<S: Maintenance>(
    store: &S,
    key: &idempotency::IdempotencyKey,
    done: impl Fn(&[KeyEvent]) -> bool,
) -> bool {
    for _ in 0..400 {
        let history = store.history(key, 100).await.expect("history");
        if done(&history) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
