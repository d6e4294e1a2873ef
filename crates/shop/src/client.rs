//! A small HTTP client for the storm and the benchmark, recording every request's latency.
//! Sending until a definitive answer goes through `idempotency-client`, the crate users get.

use hdrhistogram::Histogram;
use idempotency_client::{
    reqwest_middleware::{ClientBuilder, ClientWithMiddleware},
    IdempotencyError, IdempotencyMiddleware, Outcome, Probe, RequestKey, Resendable, RetryPolicy,
    StopReason,
};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// One answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status.
    pub status: StatusCode,
    /// The JSON body (`Null` when empty or not JSON).
    pub body: Value,
    /// Whether the middleware replayed a stored response (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// `Retry-After` in seconds, if given.
    pub retry_after: Option<u64>,
}

impl Answer {
    /// The problem `type`, for problem documents.
    pub fn problem_type(&self) -> Option<&str> {
        self.body.get("type").and_then(Value::as_str)
    }

    /// Whether this is the problem named `slug`: the last segment of its `type` URI (the shop's
    /// problems and the middleware's have distinct slugs).
    ///
    /// ```
    /// # use shop::client::Answer;
    /// let a = Answer { status: reqwest::StatusCode::CONFLICT, replayed: false, retry_after: None,
    ///     body: serde_json::json!({"type": "tag:idempotency,2026:problems/in-progress"}) };
    /// assert!(a.is_problem("in-progress") && !a.is_problem("progress"));
    /// ```
    pub fn is_problem(&self, slug: &str) -> bool {
        self.problem_type()
            .and_then(|t| t.rsplit('/').next())
            .is_some_and(|last| last == slug)
    }
}

/// A request to send.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    /// Method.
    pub method: Method,
    /// Path, e.g. `/purchases`.
    pub path: String,
    /// `X-User-Id`.
    pub user: &'a str,
    /// `Idempotency-Key`.
    pub key: Option<&'a str>,
    /// JSON body.
    pub body: Option<&'a Value>,
    /// Client-side timeout (the storm's "gave up waiting" retries).
    pub timeout: Option<Duration>,
}

impl<'a> Call<'a> {
    /// A POST with a JSON body.
    pub fn post(path: impl Into<String>, user: &'a str, body: &'a Value) -> Self {
        Self {
            method: Method::POST,
            path: path.into(),
            user,
            key: None,
            body: Some(body),
            timeout: None,
        }
    }

    /// A GET.
    pub fn get(path: impl Into<String>, user: &'a str) -> Self {
        Self {
            method: Method::GET,
            path: path.into(),
            user,
            key: None,
            body: None,
            timeout: None,
        }
    }

    /// Sets the `Idempotency-Key`.
    pub fn key(mut self, key: &'a str) -> Self {
        self.key = Some(key);
        self
    }

    /// Sets a client-side timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// A client over one or more service URLs (requests are spread over them), with a latency
/// histogram in microseconds.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    retrying: ClientWithMiddleware,
    bases: Arc<Vec<String>>,
    latency: Arc<Mutex<Histogram<u64>>>,
}

impl Client {
    /// A client for `bases` (`http://HOST:PORT`).
    pub fn new(bases: Vec<String>) -> Self {
        assert!(!bases.is_empty(), "at least one URL");
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .expect("HTTP client");
        Self {
            retrying: ClientBuilder::new(http.clone())
                .with(IdempotencyMiddleware::new())
                .build(),
            http,
            bases: Arc::new(bases),
            latency: Arc::new(Mutex::new(
                Histogram::new_with_bounds(1, 120_000_000, 3).expect("histogram bounds"),
            )),
        }
    }

    /// The service URLs.
    pub fn bases(&self) -> &[String] {
        &self.bases
    }

    /// Sends `call` to the `target`-th URL (modulo their number).
    pub async fn send(&self, target: usize, call: &Call<'_>) -> Result<Answer, reqwest::Error> {
        let base = &self.bases[target % self.bases.len()];
        let mut request = self
            .http
            .request(call.method.clone(), format!("{base}{}", call.path))
            .header("x-user-id", call.user);
        if let Some(key) = call.key {
            request = request.header("idempotency-key", key);
        }
        if let Some(body) = call.body {
            request = request.json(body);
        }
        if let Some(timeout) = call.timeout {
            request = request.timeout(timeout);
        }
        let started = Instant::now();
        let response = request.send().await?;
        let answer = Self::answer(response).await?;
        let elapsed = started.elapsed().as_micros().max(1) as u64;
        if let Ok(mut h) = self.latency.lock() {
            let _ = h.record(elapsed);
        }
        Ok(answer)
    }

    /// Sends `call` to the `target`-th URL through [`IdempotencyMiddleware`] until a definitive
    /// answer or `deadline`: the call's key (or none: the middleware adds no key of its own) on
    /// every attempt, transport errors, 409 in progress, 503 pending and 502/503/504 retried
    /// (after the server's hint, else a jittered backoff from 2 ms), never a 400 or a 422. An
    /// unkeyed call is marked [`Resendable`]: the storm sends unkeyed only what the shop makes
    /// idempotent by design (a guarded transition, a business unique constraint). The
    /// middleware's typed `KeyReused` error is given back as the 422 `key-reused` it stands for.
    /// The answer is `None` when the deadline passed first or the last attempt failed in
    /// transport; the outcome lists every attempt. Each attempt's latency is recorded.
    pub async fn send_until_definitive(
        &self,
        target: usize,
        call: &Call<'_>,
        deadline: Duration,
    ) -> (Option<Answer>, Outcome) {
        let base = &self.bases[target % self.bases.len()];
        let mut request = self
            .retrying
            .request(call.method.clone(), format!("{base}{}", call.path))
            .header("x-user-id", call.user)
            .with_extension(match call.key {
                Some(key) => RequestKey::Use(key.to_owned()),
                None => RequestKey::Omit,
            })
            .with_extension(Resendable)
            .with_extension(
                RetryPolicy::default()
                    .with_max_attempts(u32::MAX)
                    .with_deadline(deadline)
                    .with_backoff(Duration::from_millis(2), Duration::from_millis(250)),
            );
        if let Some(body) = call.body {
            request = request.json(body);
        }
        if let Some(timeout) = call.timeout {
            request = request.timeout(timeout);
        }
        let probe = Probe::new();
        let sent = request.with_extension(probe.clone()).send().await;
        let (answer, outcome) = match sent {
            Ok(response) => {
                let outcome = Outcome::of(&response)
                    .cloned()
                    .unwrap_or_else(|| probe.outcome());
                (Self::answer(response).await.ok(), outcome)
            }
            Err(error) => match IdempotencyError::from_error(&error) {
                Some(IdempotencyError::KeyReused {
                    detail, outcome, ..
                }) => {
                    let answer = Answer {
                        status: StatusCode::UNPROCESSABLE_ENTITY,
                        body: serde_json::json!({"type": "key-reused", "detail": detail}),
                        replayed: false,
                        retry_after: None,
                    };
                    (Some(answer), (**outcome).clone())
                }
                _ => (None, probe.outcome()),
            },
        };
        if let Ok(mut h) = self.latency.lock() {
            for attempt in &outcome.attempts {
                let _ = h.record(attempt.took.as_micros().max(1) as u64);
            }
        }
        let definitive = !matches!(
            outcome.stopped,
            Some(StopReason::Deadline | StopReason::MaxAttempts)
        );
        (answer.filter(|_| definitive), outcome)
    }

    async fn answer(response: reqwest::Response) -> Result<Answer, reqwest::Error> {
        let status = response.status();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let bytes = response.bytes().await?;
        Ok(Answer {
            status,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            replayed,
            retry_after,
        })
    }

    /// A copy of the latency histogram (µs), and resets it.
    pub fn take_latency(&self) -> Histogram<u64> {
        let mut h = self.latency.lock().expect("histogram lock");
        let copy = h.clone();
        h.reset();
        copy
    }
}
