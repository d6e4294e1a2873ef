//! Protected requests run in an `idempotency` span naming scope and operation; nothing the layer
//! records holds the request body (its own process: the subscriber is global).

mod common;

use common::{new_key, Answer, TestApp};
use serde_json::json;
use std::{
    fmt::Debug,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, OnceLock,
    },
};
use tracing::{
    field::{Field, Visit},
    span::{Attributes, Id, Record},
    Event, Metadata, Subscriber,
};

/// A span's name and its `(field, value)` pairs.
type SpanRecord = (String, Vec<(String, String)>);

/// Every span (name and fields) and every event field the process recorded, as text.
#[derive(Default)]
struct Recorded {
    spans: Mutex<Vec<SpanRecord>>,
    fields: Mutex<Vec<String>>,
    next_id: AtomicU64,
}

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

struct Recorder(&'static Recorded);

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = Fields(Vec::new());
        span.record(&mut fields);
        let mut all = self.0.fields.lock().unwrap();
        all.extend(fields.0.iter().map(|(_, v)| v.clone()));
        self.0
            .spans
            .lock()
            .unwrap()
            .push((span.metadata().name().to_owned(), fields.0));
        Id::from_u64(self.0.next_id.fetch_add(1, Ordering::SeqCst) + 1)
    }
    fn record(&self, _: &Id, values: &Record<'_>) {
        let mut fields = Fields(Vec::new());
        values.record(&mut fields);
        let mut all = self.0.fields.lock().unwrap();
        all.extend(fields.0.into_iter().map(|(_, v)| v));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(Vec::new());
        event.record(&mut fields);
        let mut all = self.0.fields.lock().unwrap();
        all.extend(fields.0.into_iter().map(|(_, v)| v));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn recorded() -> &'static Recorded {
    static RECORDED: OnceLock<&'static Recorded> = OnceLock::new();
    RECORDED.get_or_init(|| {
        let recorded: &'static Recorded = Box::leak(Box::default());
        tracing::subscriber::set_global_default(Recorder(recorded)).unwrap();
        recorded
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spans_name_scope_and_operation_but_never_the_body() {
    let recorded = recorded();
    let app = TestApp::sqlite().await;
    let secret = "card-4242-4242-4242-4242";
    let key = new_key();
    let body = json!({"sku": secret});
    assert_eq!(
        Answer::of(app.post("/orders", "carol", Some(&key), &body))
            .await
            .status,
        201
    );
    assert!(Answer::of(app.post("/orders", "carol", Some(&key), &body))
        .await
        .replayed());
    let other = json!({"sku": format!("{secret}-2")});
    assert_eq!(
        Answer::of(app.post("/orders", "carol", Some(&key), &other))
            .await
            .status,
        422
    );
    let bad = app
        .client
        .post(format!("{}/orders", app.url))
        .header("x-user", "carol")
        .header("idempotency-key", new_key())
        .header("content-type", "application/json")
        .body(format!("{{{secret}"));
    assert_eq!(Answer::of(bad).await.status, 400);

    let spans = recorded.spans.lock().unwrap().clone();
    let ours: Vec<_> = spans
        .iter()
        .filter(|(name, _)| name == "idempotency")
        .collect();
    assert_eq!(ours.len(), 4, "{spans:?}");
    for (_, fields) in &ours {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(field("scope"), Some("carol"));
        assert_eq!(field("operation"), Some("POST /orders"));
        assert_eq!(field("method"), Some("POST"));
    }
    let fields = recorded.fields.lock().unwrap();
    assert!(
        fields.iter().any(|v| v.contains("replayed")),
        "events were recorded: {fields:?}"
    );
    for value in fields.iter() {
        assert!(
            !value.contains(secret),
            "a recorded value holds the body: {value}"
        );
        assert!(
            !value.contains(&key),
            "a recorded value holds the client key: {value}"
        );
    }
}
