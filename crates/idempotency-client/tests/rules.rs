//! The retry rules against a counting server: what is never retried, what is, with which key,
//! after which pause, within which budget.

mod common;

use common::{client, client_with, fast, serve, serve_on};
use idempotency_client::wire::ProblemType;
use idempotency_client::{
    AttemptResult, IdempotencyError, IdempotencyMiddleware, KeyFormat, KeyGenerator, Outcome,
    Probe, RequestKey, Resendable, RetryPolicy, StopReason, TransportKind,
};
use reqwest::{Method, StatusCode};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn final_client_errors_are_never_retried() {
    let server = serve().await;
    let client = client(fast());
    for code in [
        400u16, 401, 403, 404, 405, 409, 410, 413, 422, 429, 500, 501,
    ] {
        for method in [Method::POST, Method::PATCH, Method::GET, Method::PUT] {
            let url = format!("{}/status/{code}", server.url);
            let response = client.request(method.clone(), &url).send().await.unwrap();
            assert_eq!(response.status().as_u16(), code);
            let outcome = Outcome::of(&response).unwrap();
            assert_eq!(outcome.attempt_count(), 1, "{method} {code}");
            assert_eq!(outcome.stopped, Some(StopReason::Answered));
        }
    }
    // Also with problem documents and hints that do not make them retryable.
    for path in [
        "/status/400?problem=key-invalid&retry_after=1",
        "/status/422?problem=invalid-body&retry_after_ms=5",
        "/status/409?problem=needs-review",
        "/status/401?retry_after_ms=5",
        "/status/403?retry_after_ms=5",
        "/status/404?retry_after_ms=5",
    ] {
        let response = client
            .post(format!("{}{path}", server.url))
            .send()
            .await
            .unwrap();
        assert_eq!(Outcome::of(&response).unwrap().attempt_count(), 1, "{path}");
    }
    // The counting server saw each exactly once.
    let counts = server.log.by_status();
    for code in [400u16, 401, 403, 404, 422] {
        // Four methods, plus the one with a problem document or a hint.
        assert_eq!(counts[&code], 5, "requests answered {code}");
    }
}

#[tokio::test]
async fn key_reused_is_a_typed_error_and_not_retried() {
    let server = serve().await;
    let client = client(fast());
    let error = client
        .post(format!("{}/status/422?problem=key-reused", server.url))
        .with_extension(RequestKey::Use("k-reused".into()))
        .send()
        .await
        .unwrap_err();
    match IdempotencyError::from_error(&error) {
        Some(IdempotencyError::KeyReused {
            key,
            detail,
            outcome,
        }) => {
            assert_eq!(key.as_deref(), Some("k-reused"));
            assert_eq!(detail, "the test server's key-reused");
            assert_eq!(outcome.attempt_count(), 1);
            assert_eq!(outcome.stopped, Some(StopReason::KeyReused));
        }
        other => panic!("expected KeyReused, got {other:?} for {error}"),
    }
    // The anyhow route works too.
    let reqwest_middleware::Error::Middleware(inner) = &error else {
        panic!("a middleware error")
    };
    assert!(inner.downcast_ref::<IdempotencyError>().is_some());
    assert_eq!(server.log.all().len(), 1);
}

#[tokio::test]
async fn in_progress_409_is_retried_with_the_same_key_after_the_hint() {
    let server = serve().await;
    let client = client(fast());
    let path = "/status/409?problem=in-progress&retry_after=1&retry_after_ms=150&succeed_after=2";
    let started = Instant::now();
    let response = client
        .post(format!("{}{path}", server.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(response.status(), StatusCode::CREATED);
    let outcome = Outcome::of(&response).unwrap().clone();
    assert_eq!(
        outcome.statuses(),
        vec![
            StatusCode::CONFLICT,
            StatusCode::CONFLICT,
            StatusCode::CREATED
        ]
    );
    assert_eq!(
        outcome.attempts[0].retry_after,
        Some(Duration::from_millis(150))
    );
    assert_eq!(outcome.attempts[0].pause, Some(Duration::from_millis(150)));
    assert_eq!(outcome.attempts[0].problem, Some(ProblemType::InProgress));
    assert_eq!(
        outcome.attempts[0].problem_type.as_deref(),
        Some("tag:idempotency,2026:problems/in-progress")
    );
    // Retry-After-Ms (150 ms) is preferred over Retry-After (1 s) and honoured: never sooner.
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
    let seen = server.log.all();
    assert_eq!(seen.len(), 3);
    let key = seen[0].key.clone().expect("a key");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())));
    assert_eq!(outcome.key.as_deref(), Some(key.as_str()));
    assert!(uuid::Uuid::parse_str(&key).is_ok());
    for pair in seen.windows(2) {
        assert!(pair[1].at - pair[0].at >= Duration::from_millis(150));
    }
}

#[tokio::test]
async fn retry_after_in_seconds_is_honoured() {
    let server = serve().await;
    let client = client(fast());
    let started = Instant::now();
    let response = client
        .post(format!(
            "{}/status/503?retry_after=1&succeed_after=1",
            server.url
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(started.elapsed() >= Duration::from_secs(1));
    let seen = server.log.all();
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(1));
}

#[tokio::test]
async fn gateway_errors_and_marked_500_are_retried() {
    let server = serve().await;
    let client = client(fast());
    for path in [
        "/status/502?succeed_after=2",
        "/status/503?succeed_after=2",
        "/status/504?succeed_after=2",
        "/status/408?succeed_after=2",
        "/status/500?retry_after_ms=5&succeed_after=2",
        "/status/429?retry_after_ms=5&succeed_after=2",
        "/status/409?retry_after_ms=5&succeed_after=2",
        "/status/409?problem=lease-lost&succeed_after=2",
    ] {
        let response = client
            .post(format!("{}{path}", server.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{path}");
        let outcome = Outcome::of(&response).unwrap();
        assert_eq!(outcome.attempt_count(), 3, "{path}");
        assert_eq!(server.log.count(path), 3, "{path}");
        let keys: Vec<_> = server
            .log
            .all()
            .into_iter()
            .filter(|s| s.path == path)
            .map(|s| s.key)
            .collect();
        assert!(keys[0].is_some() && keys.iter().all(|k| *k == keys[0]));
    }
}

#[tokio::test]
async fn a_replayed_answer_is_final_whatever_its_status() {
    let server = serve().await;
    let client = client(fast());
    let response = client
        .post(format!(
            "{}/status/502?replayed=true&problem=payment-failed",
            server.url
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    let outcome = Outcome::of(&response).unwrap();
    assert!(outcome.replayed);
    assert_eq!(outcome.attempt_count(), 1);
    // The same 502 not marked as a replay is retried like any 502.
    let response = client
        .post(format!("{}/status/502?problem=payment-failed", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(Outcome::of(&response).unwrap().attempt_count(), 5);
}

#[tokio::test]
async fn max_attempts_is_respected() {
    let server = serve().await;
    let client = client(fast().with_max_attempts(4));
    let response = client
        .post(format!("{}/status/503", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!(outcome.attempt_count(), 4);
    assert_eq!(outcome.stopped, Some(StopReason::MaxAttempts));
    assert_eq!(outcome.attempts[3].pause, None);
    assert_eq!(server.log.all().len(), 4);
    // RetryPolicy::once as a request extension: one request, the first error reported.
    let response = client
        .post(format!("{}/status/504", server.url))
        .with_extension(RetryPolicy::once())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(Outcome::of(&response).unwrap().attempt_count(), 1);
    assert_eq!(server.log.count("/status/504"), 1);
}

#[tokio::test]
async fn the_deadline_is_respected() {
    let server = serve().await;
    let deadline = Duration::from_millis(350);
    let client = client(fast().with_max_attempts(100).with_deadline(deadline));
    let started = Instant::now();
    let response = client
        .post(format!(
            "{}/status/409?problem=in-progress&retry_after_ms=100",
            server.url
        ))
        .send()
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!(outcome.stopped, Some(StopReason::Deadline));
    // 0, 100, 200, 300 ms: a fifth at 400 ms would pass the deadline.
    assert!((3..=4).contains(&outcome.attempt_count()), "{outcome:?}");
    assert!(
        elapsed < deadline + Duration::from_millis(50),
        "{elapsed:?}"
    );
    // A hint longer than what is left ends the operation at once.
    let started = Instant::now();
    let response = client
        .post(format!("{}/status/503?retry_after=5", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(started.elapsed() < Duration::from_millis(200));
    assert_eq!(
        Outcome::of(&response).unwrap().stopped,
        Some(StopReason::Deadline)
    );
}

#[tokio::test]
async fn the_deadline_cuts_a_hanging_attempt() {
    let server = serve().await;
    let client = client(fast().with_deadline(Duration::from_millis(300)));
    // Without a timeout of its own: the middleware's deadline error.
    let started = Instant::now();
    let error = client
        .post(format!("{}/status/201?delay_ms=5000", server.url))
        .send()
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(1000));
    match IdempotencyError::from_error(&error) {
        Some(IdempotencyError::Deadline {
            attempt, outcome, ..
        }) => {
            assert_eq!(*attempt, 1);
            assert_eq!(outcome.stopped, Some(StopReason::Deadline));
        }
        other => panic!("expected Deadline, got {other:?}"),
    }
    // With a timeout of its own (10 s): lowered to what is left, so reqwest's timeout error.
    let probe = Probe::new();
    let started = Instant::now();
    let error = client
        .post(format!("{}/status/201?delay_ms=5000", server.url))
        .timeout(Duration::from_secs(10))
        .with_extension(probe.clone())
        .send()
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(1000));
    assert!(matches!(&error, reqwest_middleware::Error::Reqwest(e) if e.is_timeout()));
    let outcome = probe.outcome();
    assert!(matches!(
        outcome.attempts[0].result,
        AttemptResult::Transport {
            kind: TransportKind::Timeout,
            ..
        }
    ));
    assert_eq!(outcome.stopped, Some(StopReason::Deadline));
}

#[tokio::test]
async fn keys_only_on_the_configured_methods() {
    let server = serve().await;
    let default = client(fast());
    for method in [
        Method::POST,
        Method::PATCH,
        Method::GET,
        Method::PUT,
        Method::DELETE,
    ] {
        default
            .request(method, format!("{}/status/200", server.url))
            .send()
            .await
            .unwrap();
    }
    let keyed: Vec<(String, bool)> = server
        .log
        .all()
        .into_iter()
        .map(|s| (s.method, s.key.is_some()))
        .collect();
    assert_eq!(
        keyed,
        vec![
            ("POST".into(), true),
            ("PATCH".into(), true),
            ("GET".into(), false),
            ("PUT".into(), false),
            ("DELETE".into(), false)
        ]
    );

    let server = serve().await;
    let post_only = client_with(
        IdempotencyMiddleware::new()
            .with_methods([Method::POST])
            .with_key_generator(KeyGenerator::UuidV7)
            .with_key_format(KeyFormat::StructuredField)
            .with_policy(fast()),
    );
    let url = format!("{}/status/200", server.url);
    post_only.post(&url).send().await.unwrap();
    post_only.patch(&url).send().await.unwrap();
    // The caller's own header is kept; RequestKey chooses per request.
    post_only
        .post(&url)
        .header("idempotency-key", "mine-1")
        .send()
        .await
        .unwrap();
    post_only
        .patch(&url)
        .with_extension(RequestKey::Use("mine-2".into()))
        .send()
        .await
        .unwrap();
    post_only
        .post(&url)
        .header("idempotency-key", "dropped")
        .with_extension(RequestKey::Omit)
        .send()
        .await
        .unwrap();
    let keys: Vec<Option<String>> = server.log.all().into_iter().map(|s| s.key).collect();
    let generated = keys[0].as_deref().unwrap();
    assert!(generated.starts_with('"') && generated.ends_with('"'));
    let uuid = uuid::Uuid::parse_str(generated.trim_matches('"')).unwrap();
    assert_eq!(uuid.get_version_num(), 7);
    assert_eq!(keys[1], None);
    assert_eq!(keys[2].as_deref(), Some("mine-1"));
    assert_eq!(keys[3].as_deref(), Some("\"mine-2\""));
    assert_eq!(keys[4], None);
}

#[tokio::test]
async fn an_unkeyed_post_is_not_resent_once_the_server_saw_it() {
    let server = serve().await;
    let client = client(fast());
    let response = client
        .post(format!("{}/status/503", server.url))
        .with_extension(RequestKey::Omit)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!(outcome.attempt_count(), 1);
    assert_eq!(outcome.stopped, Some(StopReason::NotRetryable));
    // A GET is idempotent by definition: retried without a key.
    let response = client
        .get(format!("{}/status/503?succeed_after=1", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(Outcome::of(&response).unwrap().attempt_count(), 2);
    // An unkeyed POST the caller marks as idempotent by design (a guarded transition) is.
    let path = "/status/502?succeed_after=2";
    let response = client
        .post(format!("{}{path}", server.url))
        .with_extension(RequestKey::Omit)
        .with_extension(Resendable)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(Outcome::of(&response).unwrap().attempt_count(), 3);
    assert_eq!(server.log.count(path), 3);
    assert!(server
        .log
        .all()
        .into_iter()
        .filter(|s| s.path == path)
        .all(|s| s.key.is_none()));
}

#[tokio::test]
async fn connection_refused_is_retried_until_the_server_is_back() {
    // A port nobody listens on, for 300 ms.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let starting = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        serve_on(tokio::net::TcpListener::bind(addr).await.unwrap()).await
    });
    let client = client(
        RetryPolicy::default()
            .with_max_attempts(50)
            .with_backoff(Duration::from_millis(20), Duration::from_millis(50))
            .with_deadline(Duration::from_secs(10)),
    );
    let probe = Probe::new();
    let response = client
        .post(format!("http://{addr}/status/201"))
        .body("{}")
        .with_extension(probe.clone())
        .send()
        .await
        .unwrap();
    let server = starting.await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let outcome = Outcome::of(&response).unwrap();
    assert!(outcome.transport_errors() >= 1, "{outcome:?}");
    assert!(outcome.attempts.iter().any(|a| matches!(
        a.result,
        AttemptResult::Transport {
            kind: TransportKind::Connect,
            ..
        }
    )));
    assert_eq!(probe.outcome(), *outcome);
    let seen = server.log.all();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, outcome.key);
}

/// A raw server that reads a request and closes the connection without answering, `drops` times,
/// then answers 201; returns the keys it saw.
async fn flaky_server(drops: usize) -> (String, tokio::task::JoinHandle<Vec<Option<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut keys = Vec::new();
        loop {
            let Ok(Ok((mut socket, _))) =
                tokio::time::timeout(Duration::from_secs(2), listener.accept()).await
            else {
                return keys;
            };
            let mut buffer = vec![0u8; 8192];
            let mut read = 0;
            loop {
                let n = socket.read(&mut buffer[read..]).await.unwrap_or(0);
                read += n;
                let text = String::from_utf8_lossy(&buffer[..read]);
                if n == 0 || text.contains("\r\n\r\n") {
                    break;
                }
            }
            let text = String::from_utf8_lossy(&buffer[..read]).to_lowercase();
            keys.push(
                text.lines()
                    .find_map(|l| l.strip_prefix("idempotency-key: "))
                    .map(|k| k.trim().to_owned()),
            );
            if keys.len() <= drops {
                drop(socket);
                continue;
            }
            let _ = socket
                .write_all(
                    b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                )
                .await;
        }
    });
    (url, task)
}

#[tokio::test]
async fn a_connection_closed_before_the_answer_is_retried_only_when_keyed() {
    let (url, server) = flaky_server(2).await;
    let client = client(fast());
    let response = client
        .post(format!("{url}/pay"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let outcome = Outcome::of(&response).unwrap().clone();
    assert_eq!(outcome.attempt_count(), 3);
    assert_eq!(outcome.transport_errors(), 2);
    let keys = server.await.unwrap();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| k.is_some() && *k == outcome.key));

    let (url, server) = flaky_server(2).await;
    let probe = Probe::new();
    let error = client
        .post(format!("{url}/pay"))
        .body("{}")
        .with_extension(RequestKey::Omit)
        .with_extension(probe.clone())
        .send()
        .await
        .unwrap_err();
    assert!(matches!(error, reqwest_middleware::Error::Reqwest(_)));
    assert_eq!(probe.outcome().attempt_count(), 1);
    assert_eq!(probe.outcome().stopped, Some(StopReason::NotRetryable));
    assert_eq!(server.await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_observer_sees_every_attempt() {
    let server = serve().await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let client = client_with(
        IdempotencyMiddleware::new()
            .with_policy(fast())
            .with_attempt_observer(move |outcome| {
                record
                    .lock()
                    .unwrap()
                    .push((outcome.attempt_count(), outcome.stopped))
            }),
    );
    client
        .post(format!("{}/status/503?succeed_after=2", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![(1, None), (2, None), (3, Some(StopReason::Answered))]
    );
}

/// The layer's problem types are recognised under the base the middleware is given, and only
/// there: the same 422 `key-reused` under another base is an application's own 422.
#[tokio::test]
async fn problem_types_are_matched_under_the_configured_base() {
    let server = serve().await;
    let base = "https://errors.example.com/idempotency/";
    let url = format!("{}/status/422?problem=key-reused&base={base}", server.url);
    let default_base = client(fast());
    let response = default_base.post(&url).body("{}").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!(outcome.stopped, Some(StopReason::Answered));
    assert_eq!(outcome.attempts[0].problem, None);
    let configured = client_with(
        IdempotencyMiddleware::new()
            .with_policy(fast())
            .with_problem_base(base),
    );
    let error = configured.post(&url).body("{}").send().await.unwrap_err();
    match IdempotencyError::from_error(&error) {
        Some(IdempotencyError::KeyReused { outcome, .. }) => {
            assert_eq!(outcome.attempts[0].problem, Some(ProblemType::KeyReused));
        }
        other => panic!("expected KeyReused, got {other:?}"),
    }
}
