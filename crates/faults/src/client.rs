//! A client that keeps retrying one logical purchase with the same key, as a real client must:
//! the fault proof drives its purchases with `idempotency-client`, the crate users get.

use idempotency_client::{
    reqwest_middleware::ClientBuilder, wire::header::IDEMPOTENCY_KEY, IdempotencyMiddleware,
    Outcome, Probe, RetryPolicy,
};
use reqwest::StatusCode;
use serde_json::Value;
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

/// How one logical operation ended, seen from the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// 201 (or a replay of it).
    Created,
    /// The definitive 502 `payment-failed` (or a replay of it): settled as failed, the order
    /// cancelled and the debit given back.
    Failed,
    /// 409 needs-review: parked for an operator.
    NeedsReview,
    /// Gave up (deadline or an unexpected client error).
    GaveUp(String),
}

/// What the client saw for one logical operation.
#[derive(Debug, Clone)]
pub struct OpReport {
    /// `X-User-Id`.
    pub user: String,
    /// `Idempotency-Key`.
    pub key: String,
    /// The request's body (the same on every attempt).
    pub body: Value,
    /// How it ended.
    pub settled: Settled,
    /// Every `purchase_id` received (must be one).
    pub purchase_ids: BTreeSet<String>,
    /// Count of answers by status code; `0` stands for a transport error.
    pub statuses: BTreeMap<u16, usize>,
    /// Answers marked `Idempotent-Replayed: true`.
    pub replays: usize,
    /// 5xx answers that were not `application/problem+json`.
    pub bare_5xx: usize,
    /// 503 answers without a retry hint (`Retry-After` or `Retry-After-Ms`).
    pub unhinted_503: usize,
}

impl OpReport {
    /// An operation that has no answer yet (it gave up for `why`, until an answer says more).
    pub fn gave_up(user: &str, key: &str, body: Value, why: &str) -> Self {
        OpReport {
            user: user.to_owned(),
            key: key.to_owned(),
            body,
            settled: Settled::GaveUp(why.to_owned()),
            purchase_ids: BTreeSet::new(),
            statuses: BTreeMap::new(),
            replays: 0,
            bare_5xx: 0,
            unhinted_503: 0,
        }
    }

    /// All requests sent.
    pub fn requests(&self) -> usize {
        self.statuses.values().sum()
    }
}

/// POSTs `/purchases` until it is created, settled as failed (the definitive 502
/// `payment-failed`), parked, or `limit` passes, through [`idempotency_client`]: the same key on
/// every attempt, transport errors and 502/503/504 retried with jittered backoff, 409 in
/// progress and 503 `purchase-pending` after the shop's hint, and never a 400 or 422.
pub async fn purchase_until_settled(
    http: &reqwest::Client,
    base_url: &str,
    user: &str,
    key: &str,
    body: &Value,
    limit: Duration,
) -> OpReport {
    let client = ClientBuilder::new(http.clone())
        .with(IdempotencyMiddleware::new())
        .build();
    let policy = RetryPolicy::default()
        .with_max_attempts(u32::MAX)
        .with_deadline(limit)
        .with_backoff(Duration::from_millis(20), Duration::from_millis(500));
    let probe = Probe::new();
    let sent = client
        .post(format!("{base_url}/purchases"))
        .header("X-User-Id", user)
        .header(IDEMPOTENCY_KEY, key)
        .json(body)
        .timeout(Duration::from_secs(10))
        .with_extension(policy)
        .with_extension(probe.clone())
        .send()
        .await;
    let outcome = match &sent {
        Ok(response) => Outcome::of(response).cloned(),
        Err(_) => None,
    }
    .unwrap_or_else(|| probe.outcome());
    let mut report = OpReport {
        user: user.to_owned(),
        key: key.to_owned(),
        body: body.clone(),
        settled: Settled::GaveUp("deadline".into()),
        purchase_ids: BTreeSet::new(),
        statuses: BTreeMap::new(),
        replays: usize::from(outcome.replayed),
        bare_5xx: 0,
        unhinted_503: 0,
    };
    for attempt in &outcome.attempts {
        let status = attempt.result.status();
        *report
            .statuses
            .entry(status.map_or(0, |s| s.as_u16()))
            .or_default() += 1;
        if status.is_some_and(|s| s.is_server_error()) && !attempt.problem_json {
            report.bare_5xx += 1;
        }
        if status == Some(StatusCode::SERVICE_UNAVAILABLE) && attempt.retry_after.is_none() {
            report.unhinted_503 += 1;
        }
    }
    let response = match sent {
        Ok(response) => response,
        Err(error) => {
            report.settled = Settled::GaveUp(format!("{error} after {:?}", outcome.stopped));
            return report;
        }
    };
    let status = response.status();
    let json: Value = match response.bytes().await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        Err(error) => {
            report.settled = Settled::GaveUp(format!("reading the answer: {error}"));
            return report;
        }
    };
    let problem = json.get("type").and_then(Value::as_str).unwrap_or_default();
    report.settled = match status {
        StatusCode::CREATED | StatusCode::OK => {
            if let Some(id) = json.get("purchase_id") {
                report.purchase_ids.insert(id.to_string());
            }
            Settled::Created
        }
        StatusCode::CONFLICT if problem.ends_with("needs-review") => Settled::NeedsReview,
        StatusCode::BAD_GATEWAY if problem.ends_with("/payment-failed") => Settled::Failed,
        other => Settled::GaveUp(format!("{other} after {:?}: {json}", outcome.stopped)),
    };
    report
}
