//! The signals of `idempotency::maintenance::signals`, checked on SQLite: the span tree of one
//! request (first, replay, durable steps and calls) with a capturing subscriber, the protocol and
//! step counters, and the maintenance worker's gauges, with a debugging `metrics` recorder.

use idempotency::{
    durable::{CallError, Finished, Lookup, Operation, StepError, Steps},
    maintenance::{signals, MaintenanceWorker},
    Attempt, Disposition, Effects, Error, Fingerprint, Idempotency, IdempotencyKey, SqliteStore,
    Store,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};
use tracing::{
    field::{Field, Visit},
    span::{Attributes, Id, Record},
    Instrument, Subscriber,
};
use tracing_subscriber::{layer::Context, prelude::*, registry::LookupSpan, Layer};

/// One span as the capturing layer saw it.
#[derive(Debug, Clone)]
struct Captured {
    name: &'static str,
    parent: Option<&'static str>,
    fields: HashMap<String, String>,
}

/// The spans, in the order they were created.
#[derive(Default, Clone)]
struct Spans(Arc<Mutex<Vec<(Id, Captured)>>>);

impl Spans {
    fn all(&self) -> Vec<Captured> {
        let spans = self.0.lock().unwrap();
        spans.iter().map(|(_, span)| span.clone()).collect()
    }

    /// The spans whose parent is `parent`, by name, in order.
    fn children(&self, parent: &str) -> Vec<Captured> {
        self.all()
            .into_iter()
            .filter(|span| span.parent == Some(parent))
            .collect()
    }
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let parent = ctx
            .span(id)
            .and_then(|span| span.parent())
            .map(|parent| parent.name());
        let span = Captured {
            name: attrs.metadata().name(),
            parent,
            fields,
        };
        self.0.lock().unwrap().push((id.clone(), span));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut spans = self.0.lock().unwrap();
        if let Some((_, span)) = spans.iter_mut().rev().find(|(known, _)| known == id) {
            values.record(&mut Fields(&mut span.fields));
        }
    }
}

async fn store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("signals.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (store, dir)
}

fn attempt(operation: &str, key: &str, body: &str) -> Attempt {
    Attempt::new(
        IdempotencyKey::new("user-7", operation, key).unwrap(),
        Fingerprint::of_bytes(body.as_bytes()),
    )
}

fn names(spans: &[Captured]) -> Vec<&'static str> {
    spans.iter().map(|span| span.name).collect()
}

fn field<'a>(span: &'a Captured, name: &str) -> Option<&'a str> {
    span.fields.get(name).map(String::as_str)
}

/// A durable operation: a local step, a keyed outside call, then the finish.
struct Purchase {
    charged_with: Arc<Mutex<Option<String>>>,
}

impl Operation<SqliteStore> for Purchase {
    type Request = serde_json::Value;
    type Response = String;

    fn name(&self) -> &str {
        "purchase"
    }

    async fn run(
        &self,
        steps: &mut Steps<SqliteStore>,
        _request: &serde_json::Value,
    ) -> Result<Finished<String>, StepError> {
        steps
            .local("reserve-stock", async |_tx| Ok::<_, sqlx::Error>(1))
            .await?;
        let charged = self.charged_with.clone();
        let charge: String = steps
            .call(
                "charge",
                |provider_key| {
                    let charged = charged.clone();
                    async move {
                        *charged.lock().unwrap() = Some(provider_key.clone());
                        Ok::<_, CallError>(format!("ch_{provider_key}"))
                    }
                },
                |_| async { Lookup::<String>::NotDone },
            )
            .await?;
        steps
            .finish(async |_tx| Ok::<_, sqlx::Error>(charge.clone()))
            .await
    }
}

#[tokio::test]
async fn span_tree_of_a_first_request_a_replay_and_a_durable_operation() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    let (store, _dir) = store().await;
    let idem = Idempotency::new(store);
    let order = attempt("order", "k-1", r#"{"secret-card":"4242"}"#);

    // A first request: reserve → work → complete under the request's span.
    let first = idem
        .run(&order, async |_tx| Ok::<_, sqlx::Error>(7))
        .instrument(tracing::info_span!("first"))
        .await
        .unwrap();
    assert!(!first.is_replayed());
    let tree = spans.children("first");
    assert_eq!(
        names(&tree),
        [
            signals::SPAN_RESERVE,
            signals::SPAN_WORK,
            signals::SPAN_COMPLETE
        ]
    );
    for (span, outcome) in
        tree.iter()
            .zip([signals::ACQUIRED, signals::EXECUTED, signals::EXECUTED])
    {
        assert_eq!(
            field(span, signals::FIELD_SCOPE),
            Some("user-7"),
            "{span:?}"
        );
        assert_eq!(field(span, signals::FIELD_OPERATION), Some("order"));
        assert_eq!(
            field(span, signals::FIELD_OUTCOME),
            Some(outcome),
            "{span:?}"
        );
    }

    // Its replay: reserve → replay.
    let again = idem
        .run(&order, async |_tx| Ok::<_, sqlx::Error>(8))
        .instrument(tracing::info_span!("again"))
        .await
        .unwrap();
    assert!(again.is_replayed());
    let tree = spans.children("again");
    assert_eq!(names(&tree), [signals::SPAN_RESERVE, signals::SPAN_REPLAY]);
    assert_eq!(
        field(&tree[0], signals::FIELD_OUTCOME),
        Some(signals::REPLAYED)
    );
    assert_eq!(field(&tree[1], signals::FIELD_OPERATION), Some("order"));

    // Local work that fails: reserve → work → release.
    let declined = attempt("order", "k-2", "declined");
    let failed = idem
        .run(&declined, async |_tx| Err::<(), _>("card declined"))
        .instrument(tracing::info_span!("failing"))
        .await;
    assert!(matches!(failed, Err(Error::Operation(_))));
    let tree = spans.children("failing");
    assert_eq!(
        names(&tree),
        [
            signals::SPAN_RESERVE,
            signals::SPAN_WORK,
            signals::SPAN_RELEASE
        ]
    );
    assert_eq!(
        field(&tree[1], signals::FIELD_OUTCOME),
        Some(signals::ERROR)
    );
    assert_eq!(
        field(&tree[2], signals::FIELD_OUTCOME),
        Some(signals::RELEASED)
    );

    // A durable operation: reserve → step → call (with its provider key) → step (finish).
    let charged_with = Arc::new(Mutex::new(None));
    let purchase = Purchase {
        charged_with: charged_with.clone(),
    };
    let request = serde_json::json!({"sku": "oolong-secret"});
    idem.perform(&purchase, "user-7", "p-1", &request)
        .instrument(tracing::info_span!("purchase"))
        .await
        .unwrap();
    let tree = spans.children("purchase");
    assert_eq!(
        names(&tree),
        [
            signals::SPAN_RESERVE,
            signals::SPAN_STEP,
            signals::SPAN_CALL,
            signals::SPAN_STEP
        ]
    );
    assert_eq!(field(&tree[1], signals::FIELD_STEP), Some("reserve-stock"));
    assert_eq!(
        field(&tree[1], signals::FIELD_OUTCOME),
        Some(signals::STEP_COMMITTED)
    );
    assert_eq!(field(&tree[2], signals::FIELD_STEP), Some("charge"));
    let provider_key = charged_with.lock().unwrap().clone().expect("charged");
    assert_eq!(
        field(&tree[2], signals::FIELD_PROVIDER_KEY),
        Some(provider_key.as_str())
    );
    assert_eq!(
        field(&tree[2], signals::FIELD_OUTCOME),
        Some(signals::CALL_ANSWERED)
    );
    assert_eq!(field(&tree[3], signals::FIELD_STEP), Some("finish"));
    assert_eq!(
        field(&tree[3], signals::FIELD_OUTCOME),
        Some(signals::SETTLED_COMPLETED)
    );

    // The request itself is never recorded.
    for span in spans.all() {
        for value in span.fields.values() {
            assert!(
                !value.contains("4242") && !value.contains("oolong"),
                "{span:?}"
            );
        }
    }
}

/// The counters and gauges as a map from `name{label=value,…}` to their value.
fn snapshot(snapshotter: &Snapshotter) -> HashMap<String, f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            labels.sort();
            let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
            let value = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(h) => h.len() as f64,
            };
            (name, value)
        })
        .collect()
}

fn outcome(name: &str, operation: &str, outcome: &str) -> String {
    format!("{name}{{operation={operation},outcome={outcome}}}")
}

#[tokio::test]
async fn counters_for_each_outcome_and_the_workers_gauges() {
    // A subscriber here too: `tracing` caches whether a span's callsite is wanted across threads,
    // and a thread without one would tell it "never" while the span test runs beside this one.
    let _default =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(Spans::default()));
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (store, _dir) = store().await;
    let idem = Idempotency::new(store.clone()).with_max_retry_after(Duration::from_millis(1));

    // executed, replayed, mismatch (422).
    let order = attempt("order", "k-1", "tea");
    idem.run(&order, async |_tx| Ok::<_, sqlx::Error>(1))
        .await
        .unwrap();
    idem.run(&order, async |_tx| Ok::<_, sqlx::Error>(1))
        .await
        .unwrap();
    let other = attempt("order", "k-1", "coffee");
    let reused = idem.run(&other, async |_tx| Ok::<_, sqlx::Error>(1)).await;
    assert!(matches!(reused, Err(Error::KeyReused)));

    // conflict (409) while a holder has the key, then released when its work fails.
    let held = attempt("order", "k-2", "tea");
    let idempotency::protocol::Reservation::Acquired(lease) = idem.reserve(&held).await.unwrap()
    else {
        panic!("a new key is acquired");
    };
    let busy = idem.run(&held, async |_tx| Ok::<_, sqlx::Error>(1)).await;
    assert!(matches!(busy, Err(Error::InProgress { .. })));
    assert!(lease.release().await.unwrap());

    // parked: external work that failed, parked by its policy.
    let mail = attempt("mail", "m-1", "hello").with_effects(Effects::External);
    let parked = idem
        .run_with(
            &mail,
            |_: &String| Disposition::Park("mail provider timed out".into()),
            async |_tx| Err::<(), _>("timed out".to_owned()),
        )
        .await;
    assert!(matches!(parked, Err(Error::Operation(_))));
    // needs review (409) for a retry of the parked key.
    let refused = idem.run(&mail, async |_tx| Ok::<_, String>(())).await;
    assert!(matches!(refused, Err(Error::NeedsReview)));

    // left pending: external work that failed, with a lease that ends at once.
    let short = Idempotency::new(store.clone())
        .with_lease(Duration::from_millis(1))
        .with_heartbeat(false);
    let webhook = attempt("webhook", "w-1", "ping").with_effects(Effects::External);
    let left = short
        .run(&webhook, async |_tx| Err::<(), _>("provider unreachable"))
        .await;
    assert!(matches!(left, Err(Error::Operation(_))));

    // A durable operation's steps.
    let purchase = Purchase {
        charged_with: Arc::default(),
    };
    idem.perform(
        &purchase,
        "user-7",
        "p-1",
        &serde_json::json!({"sku": "oolong-secret"}),
    )
    .await
    .unwrap();

    let counted = snapshot(&snapshotter);
    let expect = |key: String, value: f64| {
        assert_eq!(counted.get(&key), Some(&value), "{key} in {counted:#?}");
    };
    expect(
        outcome(signals::OUTCOMES_TOTAL, "order", signals::EXECUTED),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "order", signals::REPLAYED),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "order", signals::MISMATCH),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "order", signals::CONFLICT),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "order", signals::RELEASED),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "mail", signals::PARKED),
        1.0,
    );
    expect(
        outcome(
            signals::OUTCOMES_TOTAL,
            "mail",
            signals::NEEDS_REVIEW_OUTCOME,
        ),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "webhook", signals::LEFT_PENDING),
        1.0,
    );
    expect(
        outcome(signals::OUTCOMES_TOTAL, "purchase", signals::EXECUTED),
        1.0,
    );
    expect(
        outcome(signals::STEPS_TOTAL, "purchase", signals::STEP_COMMITTED),
        1.0,
    );
    expect(
        outcome(signals::STEPS_TOTAL, "purchase", signals::CALL_ANSWERED),
        1.0,
    );
    expect(
        outcome(signals::STEPS_TOTAL, "purchase", signals::SETTLED_COMPLETED),
        1.0,
    );

    // The worker's gauges, from the table's statistics. The webhook's lease (1 ms) has ended
    // by the time the statistics are read: wait until the database says so.
    let worker = MaintenanceWorker::new(store.clone()).with_stats_interval(None);
    let mut stats = worker.export_stats().await.unwrap();
    for _ in 0..200 {
        if stats.expired_leases == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        stats = worker.export_stats().await.unwrap();
    }
    assert_eq!(stats.expired_leases, 1);
    let gauges = snapshot(&snapshotter);
    let gauge = |key: &str| {
        *gauges
            .get(key)
            .unwrap_or_else(|| panic!("{key} in {gauges:#?}"))
    };
    assert_eq!(gauge(&format!("{}{{}}", signals::NEEDS_REVIEW)), 1.0);
    assert_eq!(gauge(&format!("{}{{}}", signals::PAST_LEASE)), 1.0);
    assert!(gauge(&format!("{}{{}}", signals::OLDEST_PENDING_SECONDS)) >= 0.0);
    let keys = |operation: &str, state: &str| {
        gauge(&format!(
            "{}{{operation={operation},state={state}}}",
            signals::KEYS
        ))
    };
    assert_eq!(keys("order", "completed"), 1.0);
    assert_eq!(keys("order", "pending"), 0.0);
    assert_eq!(keys("mail", "needs_review"), 1.0);
    assert_eq!(keys("webhook", "pending"), 1.0);
    assert_eq!(keys("purchase", "completed"), 1.0);

    // The recovery job parks the abandoned webhook (no resolver), and counts it.
    let report = worker.run_once().await.unwrap();
    assert_eq!(report.recovery.parked, 1);
    let stats = worker.export_stats().await.unwrap();
    assert_eq!(stats.expired_leases, 0);
    let after = snapshot(&snapshotter);
    assert_eq!(
        after.get(&outcome(
            signals::RECOVERED_TOTAL,
            "webhook",
            signals::PARKED
        )),
        Some(&1.0)
    );
    assert_eq!(
        after.get(&format!("{}{{}}", signals::NEEDS_REVIEW)),
        Some(&2.0)
    );
    assert_eq!(
        after.get(&format!("{}{{}}", signals::PAST_LEASE)),
        Some(&0.0)
    );
    assert_eq!(
        after.get(&format!(
            "{}{{operation=webhook,state=pending}}",
            signals::KEYS
        )),
        Some(&0.0)
    );
}

#[tokio::test]
async fn the_running_worker_sets_the_gauges() {
    // A subscriber, as in the counters' test (the callsites' interest is shared).
    let _default =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(Spans::default()));
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (store, _dir) = store().await;
    let idem = Idempotency::new(store.clone());
    let mail = attempt("mail", "m-1", "hello").with_effects(Effects::External);
    let _ = idem
        .run_with(
            &mail,
            |_: &String| Disposition::Park("mail provider timed out".into()),
            async |_tx| Err::<(), _>("timed out".to_owned()),
        )
        .await;

    let worker = MaintenanceWorker::new(store)
        .with_interval(Duration::from_millis(10))
        .with_stats_interval(Some(Duration::ZERO))
        .spawn();
    let needs_review = format!("{}{{}}", signals::NEEDS_REVIEW);
    let mut seen = None;
    for _ in 0..500 {
        seen = snapshot(&snapshotter).get(&needs_review).copied();
        if seen.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.shutdown().await;
    assert_eq!(seen, Some(1.0));
}
