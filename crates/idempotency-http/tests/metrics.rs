//! `idempotency_requests_total{outcome}` counts each outcome once (its own process: the recorder
//! is global).

mod common;

use common::{new_key, Answer, TestApp};
use futures_util::future::join_all;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use serde_json::json;
use std::{
    collections::HashMap,
    sync::{atomic::AtomicU64, atomic::Ordering, Arc, Mutex, OnceLock},
};

#[derive(Default)]
struct Outcomes(Mutex<HashMap<String, Arc<AtomicU64>>>);

impl Outcomes {
    fn get(&self, outcome: &str) -> u64 {
        let map = self.0.lock().unwrap();
        map.get(outcome).map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

struct CountingRecorder(Arc<Outcomes>);

impl Recorder for CountingRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        // The engine counts its own outcomes too (`idempotency::maintenance::signals`).
        if key.name() != "idempotency_requests_total" {
            return Counter::noop();
        }
        let outcome = key
            .labels()
            .find(|label| label.key() == "outcome")
            .expect("an outcome label")
            .value()
            .to_owned();
        let mut map = (self.0).0.lock().unwrap();
        Counter::from_arc(map.entry(outcome).or_default().clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn outcomes() -> &'static Arc<Outcomes> {
    static OUTCOMES: OnceLock<Arc<Outcomes>> = OnceLock::new();
    OUTCOMES.get_or_init(|| {
        let outcomes = Arc::new(Outcomes::default());
        metrics::set_global_recorder(CountingRecorder(outcomes.clone())).unwrap();
        outcomes
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_outcome_is_counted() {
    let counted = outcomes();
    let app = TestApp::sqlite().await;
    let key = new_key();
    let body = json!({"sku": "counted"});
    assert_eq!(
        Answer::of(app.post("/orders", "u", Some(&key), &body))
            .await
            .status,
        201
    );
    assert!(Answer::of(app.post("/orders", "u", Some(&key), &body))
        .await
        .replayed());
    assert!(Answer::of(app.post("/orders", "u", Some(&key), &body))
        .await
        .replayed());
    let other = json!({"sku": "other"});
    assert_eq!(
        Answer::of(app.post("/orders", "u", Some(&key), &other))
            .await
            .status,
        422
    );
    assert_eq!(
        Answer::of(app.post("/orders", "u", None, &body))
            .await
            .status,
        400
    );
    assert_eq!(
        Answer::of(app.post("/optional-orders", "u", None, &body))
            .await
            .status,
        201
    );
    let failing = app
        .post("/orders", "u", Some(&new_key()), &body)
        .header("x-fail", "500");
    assert_eq!(Answer::of(failing).await.status, 500);

    // One slow holder, three duplicates while it runs: three conflicts.
    let slow_key = new_key();
    let slow = Answer::of(
        app.post("/orders", "u", Some(&slow_key), &body)
            .header("x-sleep-ms", "2000"),
    );
    let duplicates = async {
        assert_eq!(
            app.db
                .wait_for_keys(2, std::time::Duration::from_secs(5))
                .await,
            2
        );
        join_all((0..3).map(|_| Answer::of(app.post("/orders", "u", Some(&slow_key), &body)))).await
    };
    let (slow, duplicates) = tokio::join!(slow, duplicates);
    assert_eq!(slow.status, 201);
    assert!(duplicates.iter().all(|a| a.status == 409), "{duplicates:?}");

    assert_eq!(counted.get("executed"), 2);
    assert_eq!(counted.get("replayed"), 2);
    assert_eq!(counted.get("reused"), 1);
    assert_eq!(counted.get("rejected"), 1);
    assert_eq!(counted.get("unprotected"), 1);
    assert_eq!(counted.get("released"), 1);
    assert_eq!(counted.get("conflict"), 3);
    assert_eq!(counted.get("unavailable"), 0);
}
