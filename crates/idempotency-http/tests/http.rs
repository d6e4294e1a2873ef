//! The layer in a real axum app over HTTP, against SQLite, PostgreSQL and MySQL/MariaDB.

mod common;

use common::{new_key, Answer, TestApp};
use futures_util::future::join_all;
use idempotency_wire::ProblemType;
use serde_json::json;
use std::time::Duration;

// Each scenario gets a `TestApp` on a fresh database of each backend.
test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    a_write_then_404_commits_nothing_and_keeps_no_key,
    a_write_then_422_is_stored_without_the_writes,
    transient_4xx_are_never_stored,
    a_redirect_commits_and_is_stored,
    external_work_answering_5xx_keeps_its_key_pending,
    external_work_that_panics_keeps_its_key_pending,
    concurrent_identical_posts_execute_once,
    replay_is_identical_and_marked,
    changed_payload_is_422,
    missing_key_on_required_route_is_400,
    invalid_key_is_400,
    optional_route_without_key_runs_unprotected,
    other_user_same_key_executes_separately,
    server_error_releases_the_key,
    panic_releases_the_key,
    client_disconnect_releases_the_key,
    body_over_limit_is_413_and_nothing_stored,
    json_content_type_with_bad_json_is_400,
    handler_without_transaction_is_stored,
    other_methods_pass_through,
    lost_lease_rolls_back_the_handlers_rows,
    a_handler_working_past_its_lease_keeps_its_key,
    parked_key_is_409_needs_review,
    handler_disposition_overrides_the_status_policy,
    detached_work_outlives_the_client,
    single_transaction_racers_wait_and_replay,
    single_transaction_settles_like_the_article,
}

const TRIALS: usize = 100;
const RACERS: usize = 16;

async fn concurrent_identical_posts_execute_once(app: TestApp) {
    let (mut conflicts, mut replays) = (0, 0);
    for trial in 0..TRIALS {
        let key = new_key();
        let sku = format!("race-{trial}-{}", new_key());
        let body = json!({"sku": sku, "quantity": 1});
        let answers = join_all((0..RACERS).map(|_| {
            Answer::of(
                app.post("/orders", "alice", Some(&key), &body)
                    .header("x-sleep-ms", "2"),
            )
        }))
        .await;
        let executed: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed())
            .collect();
        assert_eq!(executed.len(), 1, "trial {trial}: {answers:?}");
        let first = executed[0];
        for answer in &answers {
            match answer.status {
                201 if answer.replayed() => {
                    replays += 1;
                    assert_eq!(answer.body, first.body, "trial {trial}: replay differs");
                    assert_eq!(answer.headers["location"], first.headers["location"]);
                }
                201 => {}
                409 => {
                    conflicts += 1;
                    answer.assert_problem(409, ProblemType::InProgress);
                    let retry_after: u64 = answer.headers["retry-after"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap();
                    assert!(retry_after >= 1);
                }
                other => panic!("trial {trial}: unexpected status {other}: {answer:?}"),
            }
        }
        assert_eq!(app.db.orders(&sku).await, 1, "trial {trial}: business rows");
    }
    assert_eq!(app.db.keys_in_state("completed").await, TRIALS as i64);
    eprintln!(
        "{TRIALS} trials x {RACERS} racers: {} executed, {replays} replays, {conflicts} conflicts",
        TRIALS
    );
}

async fn replay_is_identical_and_marked(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "tea"});
    let first = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(first.headers["set-cookie"], "session=secret");
    // Same JSON, other formatting and member order: the same request.
    let again = Answer::of(
        app.client
            .post(format!("{}/orders", app.url))
            .header("x-user", "alice")
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json; charset=utf-8")
            .body("{ \"sku\" : \"tea\" }"),
    )
    .await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(again.headers["location"], first.headers["location"]);
    assert_eq!(again.headers["x-order-id"], first.headers["x-order-id"]);
    assert!(
        again.headers.get("set-cookie").is_none(),
        "cookies are never replayed"
    );
    assert!(again.headers.get("x-not-stored").is_none());
    assert_eq!(app.db.orders("tea").await, 1);
}

async fn changed_payload_is_422(app: TestApp) {
    let key = new_key();
    let first = Answer::of(app.post("/orders", "alice", Some(&key), &json!({"sku": "a"}))).await;
    assert_eq!(first.status, 201);
    let reused = Answer::of(app.post("/orders", "alice", Some(&key), &json!({"sku": "b"}))).await;
    reused.assert_problem(422, ProblemType::KeyReused);
    // Another path under the same route template is another request too.
    let key = new_key();
    let one = Answer::of(app.post("/orders/1", "alice", Some(&key), &json!({"sku": "c"}))).await;
    assert_eq!(one.status, 201);
    let two = Answer::of(app.post("/orders/2", "alice", Some(&key), &json!({"sku": "c"}))).await;
    two.assert_problem(422, ProblemType::KeyReused);
    assert_eq!(app.db.orders("b").await, 0);
    assert_eq!(app.db.orders("c").await, 1);
}

async fn missing_key_on_required_route_is_400(app: TestApp) {
    let answer = Answer::of(app.post("/orders", "alice", None, &json!({"sku": "nokey"}))).await;
    answer.assert_problem(400, ProblemType::KeyMissing);
    assert_eq!(app.db.orders("nokey").await, 0);
    assert_eq!(app.db.keys().await, 0);
}

async fn invalid_key_is_400(app: TestApp) {
    for bad in ["\"unterminated", "\"\"", &"k".repeat(256), "\"a\";p=1"] {
        let answer =
            Answer::of(app.post("/orders", "alice", Some(bad), &json!({"sku": "bad"}))).await;
        answer.assert_problem(400, ProblemType::KeyInvalid);
    }
    let longest = "k".repeat(255);
    let answer =
        Answer::of(app.post("/orders", "alice", Some(&longest), &json!({"sku": "ok"}))).await;
    assert_eq!(answer.status, 201);
    assert_eq!(app.db.orders("bad").await, 0);
    assert_eq!(app.db.keys().await, 1);
}

async fn optional_route_without_key_runs_unprotected(app: TestApp) {
    for _ in 0..2 {
        let answer =
            Answer::of(app.post("/optional-orders", "alice", None, &json!({"sku": "free"}))).await;
        assert_eq!(answer.status, 201);
        assert!(!answer.replayed());
        assert!(answer.headers.get("idempotency-key-retention").is_none());
    }
    // Unprotected, but the handler's transaction was committed.
    assert_eq!(app.db.orders("free").await, 2);
    assert_eq!(app.db.keys().await, 0);
    // With a key, the optional route is protected.
    let key = new_key();
    let first = Answer::of(app.post(
        "/optional-orders",
        "alice",
        Some(&key),
        &json!({"sku": "kept"}),
    ))
    .await;
    let second = Answer::of(app.post(
        "/optional-orders",
        "alice",
        Some(&key),
        &json!({"sku": "kept"}),
    ))
    .await;
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(app.db.orders("kept").await, 1);
    // Protected responses, first and replayed, tell how long the key is remembered.
    assert_eq!(first.headers["idempotency-key-retention"], "86400");
    assert_eq!(second.headers["idempotency-key-retention"], "86400");
}

async fn other_user_same_key_executes_separately(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "shared"});
    let alice = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    let bob = Answer::of(app.post("/orders", "bob", Some(&key), &body)).await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.body, bob.body);
    assert_eq!(app.db.orders("shared").await, 2);
    // No user: 401 problem, nothing run.
    let anonymous = Answer::of(
        app.client
            .post(format!("{}/orders", app.url))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(body.to_string()),
    )
    .await;
    anonymous.assert_problem(401, ProblemType::ScopeMissing);
    let empty = Answer::of(app.post("/orders", "", Some(&key), &body)).await;
    empty.assert_problem(401, ProblemType::ScopeMissing);
    assert_eq!(app.db.orders("shared").await, 2);
}

async fn server_error_releases_the_key(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "flaky"});
    let failed = Answer::of(
        app.post("/orders", "alice", Some(&key), &body)
            .header("x-fail", "500"),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(app.db.keys().await, 0, "the key is released");
    assert_eq!(
        app.db.orders("flaky").await,
        0,
        "the handler's row is rolled back"
    );
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "the retry executes");
    assert_eq!(app.db.orders("flaky").await, 1);
    let replay = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

async fn panic_releases_the_key(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "panicky"});
    // The connection dies with the handler (no catch-panic layer in this app) or answers 500.
    let outcome = app
        .post("/orders", "alice", Some(&key), &body)
        .header("x-fail", "panic")
        .send()
        .await;
    if let Ok(response) = outcome {
        assert!(response.status().is_server_error());
    }
    assert_eq!(app.db.wait_for_keys(0, Duration::from_secs(5)).await, 0);
    assert_eq!(app.db.orders("panicky").await, 0);
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(app.db.orders("panicky").await, 1);
}

async fn client_disconnect_releases_the_key(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "impatient"});
    let slow = app
        .post("/orders", "alice", Some(&key), &body)
        .header("x-sleep-ms", "30000")
        .timeout(Duration::from_millis(1500))
        .send();
    let client = tokio::spawn(slow);
    // The key is reserved while the handler sleeps …
    assert_eq!(app.db.wait_for_keys(1, Duration::from_secs(5)).await, 1);
    assert_eq!(app.db.keys_in_state("pending").await, 1);
    // … the client gives up and closes the connection …
    assert!(client.await.unwrap().is_err(), "the client timed out");
    // … and the key is released long before its 10 s lease ends.
    assert_eq!(app.db.wait_for_keys(0, Duration::from_secs(10)).await, 0);
    assert_eq!(
        app.db.orders("impatient").await,
        0,
        "the handler's row is rolled back"
    );
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(app.db.orders("impatient").await, 1);
}

/// With `detach(true)` a client that gives up does not cancel the work: it finishes, the key
/// completes, and the retry is a replay (compare `client_disconnect_releases_the_key`).
async fn detached_work_outlives_the_client(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "patient"});
    let slow = app
        .post("/detached", "alice", Some(&key), &body)
        .header("x-sleep-ms", "1500")
        .timeout(Duration::from_millis(300))
        .send();
    assert!(slow.await.is_err(), "the client timed out");
    assert_eq!(app.db.keys_in_state("pending").await, 1, "still working");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while app.db.keys_in_state("completed").await != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the work should complete its key after the client left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(app.db.orders("patient").await, 1);
    let retry = Answer::of(app.post("/detached", "alice", Some(&key), &body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(app.db.orders("patient").await, 1);
}

async fn body_over_limit_is_413_and_nothing_stored(app: TestApp) {
    let key = new_key();
    let big = json!({"sku": "big", "padding": "x".repeat(2000)});
    let answer = Answer::of(app.post("/small", "alice", Some(&key), &big)).await;
    answer.assert_problem(413, ProblemType::BodyTooLarge);
    assert_eq!(app.db.keys().await, 0);
    assert_eq!(app.db.orders("big").await, 0);
    // Just under the limit passes.
    let fits = json!({"sku": "fits", "padding": "x".repeat(900)});
    let answer = Answer::of(app.post("/small", "alice", Some(&key), &fits)).await;
    assert_eq!(answer.status, 201);
    assert_eq!(app.db.keys().await, 1);
}

async fn json_content_type_with_bad_json_is_400(app: TestApp) {
    let answer = Answer::of(
        app.client
            .post(format!("{}/orders", app.url))
            .header("x-user", "alice")
            .header("idempotency-key", new_key())
            .header("content-type", "application/json")
            .body("{not json"),
    )
    .await;
    answer.assert_problem(400, ProblemType::BodyNotJson);
    assert_eq!(app.db.keys().await, 0);
    // A non-JSON content type is fingerprinted as raw bytes.
    let key = new_key();
    let text = |body: &'static str| {
        app.client
            .post(format!("{}/nonce", app.url))
            .header("x-user", "alice")
            .header("idempotency-key", &key)
            .header("content-type", "text/plain")
            .body(body)
    };
    assert_eq!(Answer::of(text("{not json")).await.status, 200);
    assert!(Answer::of(text("{not json")).await.replayed());
    Answer::of(text("{not json "))
        .await
        .assert_problem(422, ProblemType::KeyReused);
}

async fn handler_without_transaction_is_stored(app: TestApp) {
    let key = new_key();
    let first = Answer::of(app.post("/nonce", "alice", Some(&key), &json!({}))).await;
    assert_eq!(first.status, 200);
    let second = Answer::of(app.post("/nonce", "alice", Some(&key), &json!({}))).await;
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    // The handler saw the key it runs under.
    assert_eq!(first.json()["held"], json!(["alice", "POST /nonce", key]));
    assert_eq!(app.db.keys_in_state("completed").await, 1);
}

async fn other_methods_pass_through(app: TestApp) {
    let url = format!("{}/orders/7", app.url);
    for _ in 0..2 {
        let read = Answer::of(app.client.get(&url)).await;
        assert_eq!((read.status, &read.body[..]), (200, &b"read"[..]));
        let put = Answer::of(app.client.put(&url).header("x-user", "alice")).await;
        assert_eq!((put.status, &put.body[..]), (200, &b"replaced"[..]));
        let delete = Answer::of(app.client.delete(&url).header("x-user", "alice")).await;
        assert_eq!((delete.status, &delete.body[..]), (200, &b"deleted"[..]));
    }
    assert_eq!(app.db.keys().await, 0);
    // PATCH is protected by default.
    let patch = |key: Option<&str>| {
        let mut request = app
            .client
            .patch(&url)
            .header("x-user", "alice")
            .header("content-type", "application/json")
            .body(r#"{"sku":"patched"}"#);
        if let Some(key) = key {
            request = request.header("idempotency-key", key.to_owned());
        }
        Answer::of(request)
    };
    patch(None)
        .await
        .assert_problem(400, ProblemType::KeyMissing);
    let key = new_key();
    let first = patch(Some(&key)).await;
    assert_eq!(first.status, 201);
    let second = patch(Some(&key)).await;
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(app.db.orders("patched").await, 1);
}

/// The same-transaction claim: a handler whose lease was taken over while it ran has its rows
/// rolled back with the failed completion. Were the key completed in a transaction of its own,
/// its order would stay and there would be two.
async fn lost_lease_rolls_back_the_handlers_rows(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "overtaken"});
    let slow = Answer::of(
        app.post("/short-lease", "alice", Some(&key), &body)
            .header("x-delay-before-tx-ms", "1500"),
    );
    let fast = async {
        // Once the slow request holds the key: past its 300 ms lease, well before it wakes.
        assert_eq!(app.db.wait_for_keys(1, Duration::from_secs(5)).await, 1);
        tokio::time::sleep(common::SHORT_LEASE + Duration::from_millis(200)).await;
        Answer::of(app.post("/short-lease", "alice", Some(&key), &body)).await
    };
    let (slow, fast) = tokio::join!(slow, fast);
    assert_eq!(fast.status, 201, "{fast:?}");
    assert!(!fast.replayed(), "the expired lease was taken over");
    slow.assert_problem(409, ProblemType::LeaseLost);
    assert_eq!(
        app.db.orders("overtaken").await,
        1,
        "the slow handler's row was rolled back"
    );
    let replay = Answer::of(app.post("/short-lease", "alice", Some(&key), &body)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, fast.body);
}

/// The heartbeat: a handler that works four times its 1.5 s lease keeps its key. Duplicates
/// sent meanwhile (each well past the lease, timed from the reservation so that slow answers do
/// not push them past the handler's end) are refused with 409 `in-progress` instead of taking
/// the key over, and the slow handler's answer is the one stored.
async fn a_handler_working_past_its_lease_keeps_its_key(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "long-work"});
    let work = common::BEATING_LEASE * 4;
    let slow = Answer::of(
        app.post("/beating", "alice", Some(&key), &body)
            .header("x-delay-before-tx-ms", work.as_millis().to_string()),
    );
    let duplicates = async {
        assert_eq!(app.db.wait_for_keys(1, Duration::from_secs(5)).await, 1);
        let reserved = tokio::time::Instant::now();
        let mut answers = Vec::new();
        for n in 1..=3 {
            let due = (common::BEATING_LEASE + Duration::from_millis(100)) * n;
            tokio::time::sleep_until(reserved + due).await;
            answers.push(Answer::of(app.post("/beating", "alice", Some(&key), &body)).await);
        }
        answers
    };
    let (slow, duplicates) = tokio::join!(slow, duplicates);
    assert_eq!(slow.status, 201, "{slow:?}");
    for duplicate in duplicates {
        duplicate.assert_problem(409, ProblemType::InProgress);
    }
    assert_eq!(app.db.orders("long-work").await, 1);
    let replay = Answer::of(app.post("/beating", "alice", Some(&key), &body)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, slow.body);
}

async fn parked_key_is_409_needs_review(app: TestApp) {
    let key = new_key();
    let body = json!({"sku": "charged?"});
    let failed = Answer::of(
        app.post("/payments", "alice", Some(&key), &body)
            .header("x-fail", "502"),
    )
    .await;
    assert_eq!(failed.status, 502);
    assert_eq!(app.db.keys_in_state("needs_review").await, 1);
    assert_eq!(app.db.orders("charged?").await, 0, "rolled back");
    for _ in 0..2 {
        let retry = Answer::of(app.post("/payments", "alice", Some(&key), &body)).await;
        retry.assert_problem(409, ProblemType::NeedsReview);
    }
    // A 500 on the same route releases as usual.
    let key = new_key();
    let failed = Answer::of(
        app.post("/payments", "alice", Some(&key), &body)
            .header("x-fail", "500"),
    )
    .await;
    assert_eq!(failed.status, 500);
    let retry = Answer::of(app.post("/payments", "alice", Some(&key), &body)).await;
    assert_eq!(retry.status, 201);
    assert_eq!(app.db.orders("charged?").await, 1);
}

/// The store is down (nothing listens on the port): 503, and the handler never runs.
#[tokio::test]
async fn store_down_is_503_and_the_handler_is_not_run() {
    use std::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    };
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&format!("postgres://idem:idem@127.0.0.1:{port}/idem"))
        .unwrap();
    let store = idempotency::PgStore::new(pool);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = axum::Router::new()
        .route(
            "/orders",
            axum::routing::post(move || {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    "ran"
                }
            }),
        )
        .route_layer(common::layer(store));
    let url = common::serve(router).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let answer = Answer::of(
            client
                .post(format!("{url}/orders"))
                .header("x-user", "alice")
                .header("idempotency-key", new_key())
                .header("content-type", "application/json")
                .body("{}"),
        )
        .await;
        answer.assert_problem(503, ProblemType::StoreUnavailable);
        assert!(answer.headers.contains_key("retry-after"));
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the handler never ran unprotected"
    );
}

/// `/strict` stores only 2xx, but a handler's [`Disposition`] decides for its own response.
async fn handler_disposition_overrides_the_status_policy(app: TestApp) {
    // Store: a 402 is kept (without the handler's rows) and replayed byte for byte.
    let key = new_key();
    let body = json!({"sku": "refused"});
    let first = Answer::of(
        app.post("/strict", "alice", Some(&key), &body)
            .header("x-disposition", "store-402"),
    )
    .await;
    assert_eq!(first.status, 402, "{first:?}");
    let replay = Answer::of(app.post("/strict", "alice", Some(&key), &body)).await;
    assert_eq!(
        (replay.status, replay.replayed()),
        (402, true),
        "{replay:?}"
    );
    assert_eq!(replay.body, first.body);
    assert_eq!(
        app.db.orders("refused").await,
        0,
        "a stored refusal is stored without the handler's writes"
    );

    // Release: a 201 is not stored; its rows are rolled back and a retry runs again.
    let key = new_key();
    let body = json!({"sku": "released"});
    let first = Answer::of(
        app.post("/strict", "alice", Some(&key), &body)
            .header("x-disposition", "release"),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(app.db.orders("released").await, 0, "rolled back");
    let retry = Answer::of(app.post("/strict", "alice", Some(&key), &body)).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(app.db.orders("released").await, 1);

    // Park: rolled back, the key needs review, retries are 409.
    let key = new_key();
    let body = json!({"sku": "parked"});
    let before = app.db.keys_in_state("needs_review").await;
    let first = Answer::of(
        app.post("/strict", "alice", Some(&key), &body)
            .header("x-disposition", "park"),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(app.db.keys_in_state("needs_review").await, before + 1);
    assert_eq!(app.db.orders("parked").await, 0, "rolled back");
    Answer::of(app.post("/strict", "alice", Some(&key), &body))
        .await
        .assert_problem(409, ProblemType::NeedsReview);
}

// --- Safe defaults: only a success commits; only a definitive answer is stored -------------------

/// A handler that writes, then answers 404 ("unknown target"): its write is rolled back and the
/// key released (a 404 may not be final: the target may exist later), so the retry runs again.
async fn a_write_then_404_commits_nothing_and_keeps_no_key(app: TestApp) {
    let key = new_key();
    let sku = format!("after-404-{key}");
    let body = json!({"sku": sku});
    let first = Answer::of(
        app.post("/orders", "alice", Some(&key), &body)
            .header("x-fail", "404"),
    )
    .await;
    assert_eq!(first.status, 404, "{first:?}");
    assert_eq!(
        app.db.orders(&sku).await,
        0,
        "the write before the 404 was committed"
    );
    assert_eq!(
        app.db.state_of(&key).await,
        None,
        "the key was kept after a 404"
    );
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(app.db.orders(&sku).await, 1);
}

/// 422 is definitive: stored and replayed, but the handler's writes are rolled back.
async fn a_write_then_422_is_stored_without_the_writes(app: TestApp) {
    let key = new_key();
    let sku = format!("after-422-{key}");
    let body = json!({"sku": sku});
    let first = Answer::of(
        app.post("/orders", "alice", Some(&key), &body)
            .header("x-fail", "422"),
    )
    .await;
    assert_eq!(first.status, 422, "{first:?}");
    assert_eq!(
        app.db.orders(&sku).await,
        0,
        "the write before the 422 was committed"
    );
    assert_eq!(app.db.state_of(&key).await.as_deref(), Some("completed"));
    // The retry (which would now succeed) gets the stored 422, byte for byte, and runs nothing.
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!((retry.status, retry.replayed()), (422, true), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(app.db.orders(&sku).await, 0);
}

/// 408, 409, 425 and 429 say "try again": never stored, writes rolled back, the retry runs.
async fn transient_4xx_are_never_stored(app: TestApp) {
    for status in ["408", "409", "425", "429"] {
        let key = new_key();
        let sku = format!("after-{status}-{key}");
        let body = json!({"sku": sku});
        let first = Answer::of(
            app.post("/orders", "alice", Some(&key), &body)
                .header("x-fail", status),
        )
        .await;
        assert_eq!(first.status.to_string(), status, "{first:?}");
        assert_eq!(app.db.orders(&sku).await, 0, "{status}: write committed");
        assert_eq!(app.db.state_of(&key).await, None, "{status}: key kept");
        let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (201, false),
            "{status}: {retry:?}"
        );
        assert_eq!(app.db.orders(&sku).await, 1, "{status}");
    }
}

/// A redirection (redirect-after-POST) commits like a success, and is stored.
async fn a_redirect_commits_and_is_stored(app: TestApp) {
    let key = new_key();
    let sku = format!("after-303-{key}");
    let body = json!({"sku": sku});
    let first = Answer::of(
        app.post("/orders", "alice", Some(&key), &body)
            .header("x-fail", "303"),
    )
    .await;
    assert_eq!(first.status, 303, "{first:?}");
    assert_eq!(app.db.orders(&sku).await, 1);
    let retry = Answer::of(app.post("/orders", "alice", Some(&key), &body)).await;
    assert_eq!((retry.status, retry.replayed()), (303, true), "{retry:?}");
    assert_eq!(app.db.orders(&sku).await, 1);
}

/// With outside effects and no policy of its own, a 5xx neither commits nor releases: the outside
/// call may have happened, so the key stays pending for the recovery job and retries get 409.
async fn external_work_answering_5xx_keeps_its_key_pending(app: TestApp) {
    let key = new_key();
    let sku = format!("external-500-{key}");
    let body = json!({"sku": sku});
    let first = Answer::of(
        app.post("/external-default", "alice", Some(&key), &body)
            .header("x-fail", "500"),
    )
    .await;
    assert_eq!(first.status, 500, "{first:?}");
    assert_eq!(app.db.orders(&sku).await, 0);
    assert_eq!(app.db.state_of(&key).await.as_deref(), Some("pending"));
    Answer::of(app.post("/external-default", "alice", Some(&key), &body))
        .await
        .assert_problem(409, ProblemType::InProgress);
    assert_eq!(app.db.orders(&sku).await, 0);
}

/// The same after a panic: the key of external work is never released by the layer.
async fn external_work_that_panics_keeps_its_key_pending(app: TestApp) {
    let key = new_key();
    let sku = format!("external-panic-{key}");
    let body = json!({"sku": sku});
    // The connection dies with the handler (no catch-panic layer in this app) or answers 500.
    let outcome = app
        .post("/external-default", "alice", Some(&key), &body)
        .header("x-fail", "panic")
        .send()
        .await;
    if let Ok(response) = outcome {
        assert!(response.status().is_server_error());
    }
    // Whatever the layer does with the key, it has done it once the handler's write is gone.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(app.db.orders(&sku).await, 0);
    assert_eq!(app.db.state_of(&key).await.as_deref(), Some("pending"));
    Answer::of(app.post("/external-default", "alice", Some(&key), &body))
        .await
        .assert_problem(409, ProblemType::InProgress);
}

/// The replay marker's name and the problems' base URI are configurable; the defaults are then
/// absent.
#[tokio::test]
async fn the_replay_header_and_the_problem_base_can_be_configured() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("keys.db").display());
    let store = idempotency::SqliteStore::connect(&url).await.unwrap();
    idempotency::Store::migrate(&store).await.unwrap();
    let router = axum::Router::new()
        .route("/orders", axum::routing::post(|| async { "ran" }))
        .route_layer(
            common::layer(store)
                .with_replay_header(http::HeaderName::from_static("idempotency-replayed"))
                .with_problem_base("https://errors.example.com/idempotency/"),
        );
    let url = common::serve(router).await;
    let client = reqwest::Client::new();
    let key = new_key();
    let send = || {
        client
            .post(format!("{url}/orders"))
            .header("x-user", "alice")
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body("{}")
    };
    let first = Answer::of(send()).await;
    assert_eq!(first.status, 200);
    assert!(!first.headers.contains_key("idempotency-replayed"));
    let again = Answer::of(send()).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.headers["idempotency-replayed"], "true");
    assert!(!again.headers.contains_key("idempotent-replayed"));
    let reused = Answer::of(send().body(r#"{"other": 1}"#)).await;
    let base = "https://errors.example.com/idempotency/";
    reused.assert_problem_under(422, ProblemType::KeyReused, base);
    let keyless = Answer::of(
        client
            .post(format!("{url}/orders"))
            .header("x-user", "alice")
            .header("content-type", "application/json")
            .body("{}"),
    )
    .await;
    keyless.assert_problem_under(400, ProblemType::KeyMissing, base);
}

// --- The engine's single-transaction mode (`/single-tx-orders`) --------------------------------

/// Racers on one key of a route in the single-transaction mode: one runs; on PostgreSQL and
/// MariaDB every other one waits for its commit and replays it (none is told 409); on SQLite
/// the mode does not apply and 409s are allowed, as on `/orders`.
async fn single_transaction_racers_wait_and_replay(app: TestApp) {
    let waits = !matches!(app.db, common::Db::Lite(_));
    let mut replays = 0;
    for trial in 0..TRIALS {
        let key = new_key();
        let sku = format!("single-{trial}-{key}");
        let body = json!({"sku": sku, "quantity": 1});
        let answers = join_all((0..RACERS).map(|_| {
            Answer::of(
                app.post("/single-tx-orders", "alice", Some(&key), &body)
                    .header("x-sleep-ms", "2"),
            )
        }))
        .await;
        let executed = answers.iter().filter(|a| a.status == 201 && !a.replayed());
        assert_eq!(executed.count(), 1, "trial {trial}: {answers:?}");
        for answer in &answers {
            match answer.status {
                201 => replays += usize::from(answer.replayed()),
                409 if !waits => answer.assert_problem(409, ProblemType::InProgress),
                other => panic!("trial {trial}: unexpected status {other}: {answer:?}"),
            }
        }
        assert_eq!(app.db.orders(&sku).await, 1, "trial {trial}: business rows");
    }
    if waits {
        assert_eq!(replays, TRIALS * (RACERS - 1));
    }
    eprintln!(
        "{TRIALS} trials x {RACERS} racers on the single-transaction route: {replays} replays"
    );
}

/// The single-transaction route answers as `/orders` does: a success is stored and replayed; a
/// 422 is stored without the handler's write (under a reservation committed for it after the
/// rollback); a 404 and a 500 roll back and keep no key.
async fn single_transaction_settles_like_the_article(app: TestApp) {
    let post = |key: &str, body: &serde_json::Value, fail: Option<&str>| {
        let request = app.post("/single-tx-orders", "alice", Some(key), body);
        Answer::of(match fail {
            Some(status) => request.header("x-fail", status),
            None => request,
        })
    };
    let key = new_key();
    let body = json!({"sku": format!("ok-{key}")});
    let first = post(&key, &body, None).await;
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    let again = post(&key, &body, None).await;
    assert_eq!((again.status, again.replayed()), (201, true), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(app.db.orders(&format!("ok-{key}")).await, 1);

    let key = new_key();
    let sku = format!("after-422-{key}");
    let body = json!({"sku": sku});
    let refused = post(&key, &body, Some("422")).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert_eq!(
        app.db.orders(&sku).await,
        0,
        "the write before the 422 was committed"
    );
    assert_eq!(app.db.state_of(&key).await.as_deref(), Some("completed"));
    let retry = post(&key, &body, None).await;
    assert_eq!((retry.status, retry.replayed()), (422, true), "{retry:?}");
    assert_eq!(app.db.orders(&sku).await, 0);

    for status in ["404", "500"] {
        let key = new_key();
        let sku = format!("after-{status}-{key}");
        let body = json!({"sku": sku});
        let failed = post(&key, &body, Some(status)).await;
        assert_eq!(failed.status.to_string(), status, "{failed:?}");
        assert_eq!(
            app.db.orders(&sku).await,
            0,
            "{status}: the write was committed"
        );
        assert_eq!(
            app.db.state_of(&key).await,
            None,
            "{status}: a key was kept"
        );
        let retry = post(&key, &body, None).await;
        assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
        assert_eq!(app.db.orders(&sku).await, 1);
    }
}
