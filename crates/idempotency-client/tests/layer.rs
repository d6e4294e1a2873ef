//! The client against the real `idempotency-http` layer, in process, on every backend:
//! double clicks with and without `wait_for_in_flight`, the wait's bound, a released key, and the
//! 422 key-reused.

use axum::{http::StatusCode, response::IntoResponse, routing::post, Json, Router};
use idempotency::{store::CompletionSignal, Idempotency, MySqlStore, PgStore, SqliteStore};
use idempotency_client::{
    IdempotencyError, IdempotencyMiddleware, Outcome, RequestKey, RetryPolicy,
};
use idempotency_http::{IdempotencyLayer, MissingScope};
use reqwest_middleware::ClientWithMiddleware;
use serde_json::json;
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use test_support::TestDatabase;

/// A protected `POST /work`: sleeps `delay`, counts its executions, answers 201 with the run
/// number; its `fail_first` executions answer 500 instead (the layer releases the key).
struct App {
    url: String,
    runs: Arc<AtomicUsize>,
    _database: test_support::Database,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn app_on<S: CompletionSignal>(
    store: S,
    delay: Duration,
    fail_first: usize,
    wait: Option<Duration>,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    store.migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move || {
        let counter = counter.clone();
        async move {
            let run = counter.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            if run <= fail_first {
                return (StatusCode::INTERNAL_SERVER_ERROR, "try again").into_response();
            }
            (StatusCode::CREATED, Json(json!({ "run": run }))).into_response()
        }
    };
    let mut layer = IdempotencyLayer::new(Idempotency::new(store))
        .with_missing_scope(MissingScope::Fixed("tests".into()));
    if let Some(bound) = wait {
        layer = layer.with_wait_for_in_flight(bound);
    }
    let router = Router::new().route("/work", post(handler).route_layer(layer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    (url, runs, task)
}

/// The app on `backend`'s store on the database at `url` (a second call: another instance of the
/// service on the same database).
async fn app_at(
    backend: TestDatabase,
    url: &str,
    delay: Duration,
    fail_first: usize,
    wait: Option<Duration>,
) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    match backend {
        TestDatabase::Sqlite => {
            let store = SqliteStore::connect(url).await.unwrap();
            app_on(store, delay, fail_first, wait).await
        }
        TestDatabase::Postgres => {
            let store = PgStore::connect(url).await.unwrap();
            app_on(store, delay, fail_first, wait).await
        }
        TestDatabase::MySql => {
            let store = MySqlStore::connect(url).await.unwrap();
            app_on(store, delay, fail_first, wait).await
        }
    }
}

/// The app on a fresh database of `backend`; `None` when it is skipped.
async fn app(
    backend: TestDatabase,
    delay: Duration,
    fail_first: usize,
    wait: Option<Duration>,
) -> Option<App> {
    let database = backend.fresh_database().await?;
    let (url, runs, task) = app_at(backend, &database.url, delay, fail_first, wait).await;
    Some(App {
        url,
        runs,
        _database: database,
        task,
    })
}

fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new().with_policy(policy))
        .build()
}

/// Waits until the handler has started `n` times in all: the request that started it holds its
/// key. A fixed sleep instead could let a duplicate reserve first on a loaded machine.
async fn started(runs: &AtomicUsize, n: usize) {
    let since = tokio::time::Instant::now();
    while runs.load(Ordering::SeqCst) < n {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the handler never started"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Sends `n` copies of one operation at once, with plain reqwest (every status is seen as sent).
async fn double_clicks(url: &str, key: &str, n: usize) -> Vec<(u16, bool, Duration)> {
    let http = reqwest::Client::new();
    let copies = (0..n).map(|_| {
        let http = http.clone();
        async move {
            let started = Instant::now();
            let response = http
                .post(format!("{url}/work"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(r#"{"amount": 5}"#)
                .send()
                .await
                .unwrap();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status().as_u16();
            let _ = response.bytes().await;
            (status, replayed, started.elapsed())
        }
    });
    futures_util::future::join_all(copies).await
}

async fn waiting_duplicates_get_the_replay(backend: TestDatabase) {
    let Some(app) = app(
        backend,
        Duration::from_millis(50),
        0,
        Some(Duration::from_secs(2)),
    )
    .await
    else {
        return;
    };
    for trial in 0..3 {
        let answers = double_clicks(&app.url, &format!("click-{trial}"), 16).await;
        let created = answers.iter().filter(|a| a.0 == 201).count();
        let replays = answers.iter().filter(|a| a.0 == 201 && a.1).count();
        let conflicts = answers.iter().filter(|a| a.0 == 409).count();
        assert_eq!(
            (created, replays, conflicts),
            (16, 15, 0),
            "{backend} trial {trial}: {answers:?}"
        );
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 3, "one execution per key");
}

async fn the_wait_is_bounded(backend: TestDatabase) {
    let bound = Duration::from_millis(200);
    // The original runs for 3 s: a duplicate that waited without the bound would get its 201.
    let Some(app) = app(backend, Duration::from_secs(3), 0, Some(bound)).await else {
        return;
    };
    let url = app.url.clone();
    let original = tokio::spawn(async move { double_clicks(&url, "slow", 1).await });
    started(&app.runs, 1).await;
    let duplicate = double_clicks(&app.url, "slow", 1).await[0];
    assert_eq!(duplicate.0, 409, "{duplicate:?}");
    assert!(duplicate.2 >= bound, "waited {:?}", duplicate.2);
    assert!(
        duplicate.2 < Duration::from_millis(2_500),
        "waited {:?}, past the bound and nearly the original's whole run",
        duplicate.2
    );
    assert_eq!(original.await.unwrap()[0].0, 201);
}

async fn a_released_key_is_run_by_the_waiting_duplicate(backend: TestDatabase) {
    let Some(app) = app(
        backend,
        Duration::from_millis(100),
        1,
        Some(Duration::from_secs(2)),
    )
    .await
    else {
        return;
    };
    let url = app.url.clone();
    let original = tokio::spawn(async move { double_clicks(&url, "flaky", 1).await });
    started(&app.runs, 1).await;
    let duplicate = double_clicks(&app.url, "flaky", 1).await[0];
    assert_eq!(original.await.unwrap()[0].0, 500);
    // The key was released after the 500: the waiting duplicate reserved it and ran.
    assert_eq!((duplicate.0, duplicate.1), (201, false), "{duplicate:?}");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// Without waiting, the 409's `Retry-After-Ms` is the operation's usual duration, and the
/// client's retries land just after the original: no second-long pause.
async fn the_millisecond_hint_shortens_the_retry(backend: TestDatabase) {
    let Some(app) = app(backend, Duration::from_millis(50), 0, None).await else {
        return;
    };
    // Executions teach the layer how long the operation takes (the median of the last ones, so
    // a cold first request does not count for much).
    for warm_up in ["warm-up-1", "warm-up-2", "warm-up-3"] {
        assert_eq!(double_clicks(&app.url, warm_up, 1).await[0].0, 201);
    }
    let raw = {
        let url = app.url.clone();
        let original = tokio::spawn(async move { double_clicks(&url, "raw", 1).await });
        started(&app.runs, 4).await;
        let response = reqwest::Client::new()
            .post(format!("{}/work", app.url))
            .header("idempotency-key", "raw")
            .header("content-type", "application/json")
            .body(r#"{"amount": 5}"#)
            .send()
            .await
            .unwrap();
        original.await.unwrap();
        response
    };
    assert_eq!(raw.status(), 409);
    assert_eq!(raw.headers()["retry-after"], "1");
    let millis: u64 = raw.headers()["retry-after-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((10..=200).contains(&millis), "Retry-After-Ms: {millis}");

    let client = client(RetryPolicy::default());
    let started = Instant::now();
    let copies = (0..8).map(|_| {
        client
            .post(format!("{}/work", app.url))
            .header("content-type", "application/json")
            .body(r#"{"amount": 5}"#)
            .with_extension(RequestKey::Use("hinted".into()))
            .send()
    });
    let answers = futures_util::future::join_all(copies).await;
    let elapsed = started.elapsed();
    let mut retried = 0;
    for answer in &answers {
        let response = answer.as_ref().unwrap();
        assert_eq!(response.status(), 201);
        let outcome = Outcome::of(response).unwrap();
        if outcome.attempt_count() > 1 {
            retried += 1;
            let hint = outcome.attempts[0].retry_after.unwrap();
            assert!(hint < Duration::from_millis(500), "{outcome:?}");
        }
    }
    assert!(retried >= 1, "some copies met the original in flight");
    assert!(elapsed < Duration::from_millis(900), "{elapsed:?}");
    assert_eq!(app.runs.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn key_reused_with_the_real_layer() {
    let app = app(TestDatabase::Sqlite, Duration::ZERO, 0, None)
        .await
        .unwrap();
    let client = client(RetryPolicy::default());
    let send = |amount: u32| {
        client
            .post(format!("{}/work", app.url))
            .header("content-type", "application/json")
            .body(format!(r#"{{"amount": {amount}}}"#))
            .with_extension(RequestKey::Use("same-key".into()))
            .send()
    };
    assert_eq!(send(5).await.unwrap().status(), 201);
    let replay = send(5).await.unwrap();
    assert!(Outcome::of(&replay).unwrap().replayed);
    let error = send(6).await.unwrap_err();
    let Some(IdempotencyError::KeyReused { key, outcome, .. }) =
        IdempotencyError::from_error(&error)
    else {
        panic!("expected KeyReused: {error}");
    };
    assert_eq!(key.as_deref(), Some("same-key"));
    assert_eq!(outcome.attempt_count(), 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// Two instances of the service on one database (two pools, two layers, as two processes would
/// be): duplicates sent to the second wait for the original running on the first, woken by
/// `NOTIFY` on PostgreSQL and by polling elsewhere.
async fn duplicates_on_another_instance_wait_too(backend: TestDatabase) {
    let wait = Some(Duration::from_secs(5));
    let delay = Duration::from_millis(300);
    let Some(database) = backend.fresh_database().await else {
        return;
    };
    let first = app_at(backend, &database.url, delay, 0, wait).await;
    let second = app_at(backend, &database.url, delay, 0, wait).await;
    for trial in 0..3 {
        let key = format!("cross-{trial}");
        let original = {
            let (url, key) = (first.0.clone(), key.clone());
            tokio::spawn(async move { double_clicks(&url, &key, 1).await })
        };
        // The duplicates go out once the original holds the key (its handler has started),
        // however slow the machine: sent earlier, one of them could reserve first.
        started(&first.1, trial + 1).await;
        let duplicates = double_clicks(&second.0, &key, 8).await;
        let original = original.await.unwrap()[0];
        assert_eq!((original.0, original.1), (201, false), "{backend}");
        assert!(
            duplicates.iter().all(|d| d.0 == 201 && d.1),
            "{backend}: {duplicates:?}"
        );
    }
    assert_eq!(first.1.load(Ordering::SeqCst), 3);
    assert_eq!(second.1.load(Ordering::SeqCst), 0);
    first.2.abort();
    second.2.abort();
}

test_support::backend_tests! {
    #[tokio::test]
    waiting_duplicates_get_the_replay,
    the_wait_is_bounded,
    a_released_key_is_run_by_the_waiting_duplicate,
    the_millisecond_hint_shortens_the_retry,
    duplicates_on_another_instance_wait_too,
}
