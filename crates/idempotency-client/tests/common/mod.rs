//! A counting test server: every request is recorded (path, method, `Idempotency-Key`, time), and
//! answered as its query asks.
#![allow(dead_code)]

use axum::{
    extract::{Query, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Router,
};
use idempotency_client::{wire::DEFAULT_PROBLEM_BASE, IdempotencyMiddleware, RetryPolicy};
use reqwest_middleware::ClientWithMiddleware;
use serde_json::json;
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// One request the server saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub key: Option<String>,
    pub at: Instant,
}

/// What the server saw, by path (with query).
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<Seen>>>);

impl Log {
    pub fn all(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }

    pub fn count(&self, path_and_query: &str) -> usize {
        self.all()
            .iter()
            .filter(|s| s.path == path_and_query)
            .count()
    }

    /// How many requests arrived, by the status their path asked for.
    pub fn by_status(&self) -> HashMap<u16, usize> {
        let mut counts = HashMap::new();
        for seen in self.all() {
            let status: u16 = seen
                .path
                .trim_start_matches("/status/")
                .split(['?', '/'])
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            *counts.entry(status).or_default() += 1;
        }
        counts
    }
}

/// `/status/{code}?...`: answers `code`, unless `succeed_after=N` and N requests to this
/// path+query were already answered (then 201). Query options: `retry_after` (seconds),
/// `retry_after_ms`, `problem` (slug of a problem type), `base` (the base of its `type`, default
/// the layer's default), `replayed=true`, `delay_ms` (sleep before answering).
async fn answer(
    State(log): State<Log>,
    Query(q): Query<HashMap<String, String>>,
    request: Request,
) -> Response {
    let path = request
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let seen_before = log.count(&path);
    log.0.lock().unwrap().push(Seen {
        method: request.method().to_string(),
        path: path.clone(),
        key: request
            .headers()
            .get("idempotency-key")
            .map(|v| v.to_str().unwrap().to_owned()),
        at: Instant::now(),
    });
    if let Some(ms) = q.get("delay_ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let code: u16 = request
        .uri()
        .path()
        .trim_start_matches("/status/")
        .parse()
        .unwrap_or(500);
    let succeed_after: Option<usize> = q.get("succeed_after").and_then(|v| v.parse().ok());
    if succeed_after.is_some_and(|n| seen_before >= n) {
        return (StatusCode::CREATED, axum::Json(json!({"ok": true}))).into_response();
    }
    let status = StatusCode::from_u16(code).unwrap();
    let mut headers = HeaderMap::new();
    if let Some(s) = q.get("retry_after") {
        headers.insert("retry-after", HeaderValue::from_str(s).unwrap());
    }
    if let Some(ms) = q.get("retry_after_ms") {
        headers.insert("retry-after-ms", HeaderValue::from_str(ms).unwrap());
    }
    if q.get("replayed").is_some_and(|v| v == "true") {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    match q.get("problem") {
        Some(slug) => {
            headers.insert(
                "content-type",
                HeaderValue::from_static("application/problem+json"),
            );
            let base = q.get("base").map_or(DEFAULT_PROBLEM_BASE, String::as_str);
            let body = json!({
                "type": format!("{base}{slug}"),
                "title": slug,
                "status": code,
                "detail": format!("the test server's {slug}"),
            });
            (status, headers, body.to_string()).into_response()
        }
        None => (status, headers, format!("status {code}")).into_response(),
    }
}

/// A running counting server.
pub struct Server {
    pub url: String,
    pub log: Log,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the counting server on `listener` (or a fresh loopback port).
pub async fn serve_on(listener: tokio::net::TcpListener) -> Server {
    let log = Log::default();
    let app = Router::new()
        .route("/status/{code}", axum::routing::any(answer))
        .with_state(log.clone());
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Server { url, log, task }
}

pub async fn serve() -> Server {
    serve_on(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()).await
}

/// A client with the middleware and a fast policy (the tests wait on backoff otherwise).
pub fn client(policy: RetryPolicy) -> ClientWithMiddleware {
    client_with(IdempotencyMiddleware::new().with_policy(policy))
}

pub fn client_with(middleware: IdempotencyMiddleware) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

/// A policy with small pauses.
pub fn fast() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(5)
        .with_backoff(Duration::from_millis(5), Duration::from_millis(20))
        .with_deadline(Duration::from_secs(10))
}
