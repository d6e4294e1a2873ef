//! A client that keeps retrying one logical purchase with the same key, as a real client must.

use reqwest::StatusCode;
use serde_json::Value;
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
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
}

impl OpReport {
    /// All requests sent.
    pub fn requests(&self) -> usize {
        self.statuses.values().sum()
    }
}

/// POSTs `/purchases` until it is created, settled as failed (the definitive 502
/// `payment-failed`), parked, or `limit` passes. Transport errors and other 5xx (the shop was
/// killed, the database is restarting, the purchase is pending) are retried after a pause; 409
/// after `Retry-After` (capped at 500 ms to keep the run short).
pub async fn purchase_until_settled(
    http: &reqwest::Client,
    base_url: &str,
    user: &str,
    key: &str,
    body: &Value,
    limit: Duration,
) -> OpReport {
    let mut report = OpReport {
        user: user.to_owned(),
        key: key.to_owned(),
        settled: Settled::GaveUp("deadline".into()),
        purchase_ids: BTreeSet::new(),
        statuses: BTreeMap::new(),
        replays: 0,
        bare_5xx: 0,
    };
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let sent = http
            .post(format!("{base_url}/purchases"))
            .header("X-User-Id", user)
            .header("Idempotency-Key", key)
            .json(body)
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(_) => {
                *report.statuses.entry(0).or_default() += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let status = response.status();
        *report.statuses.entry(status.as_u16()).or_default() += 1;
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let is_problem = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map(Duration::from_secs);
        let json: Value = match response.bytes().await {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            Err(_) => {
                *report.statuses.entry(0).or_default() += 1;
                continue;
            }
        };
        match status {
            StatusCode::CREATED | StatusCode::OK => {
                if replayed {
                    report.replays += 1;
                }
                if let Some(id) = json.get("purchase_id") {
                    report.purchase_ids.insert(id.to_string());
                }
                report.settled = Settled::Created;
                return report;
            }
            StatusCode::CONFLICT => {
                let kind = json.get("type").and_then(Value::as_str).unwrap_or_default();
                if kind.ends_with("needs-review") {
                    report.settled = Settled::NeedsReview;
                    return report;
                }
                let pause = retry_after.unwrap_or(Duration::from_millis(200));
                tokio::time::sleep(pause.min(Duration::from_millis(500))).await;
            }
            StatusCode::BAD_GATEWAY
                if json
                    .get("type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t.ends_with("/payment-failed")) =>
            {
                if replayed {
                    report.replays += 1;
                }
                report.settled = Settled::Failed;
                return report;
            }
            s if s.is_server_error() => {
                if !is_problem {
                    report.bare_5xx += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => {
                report.settled = Settled::GaveUp(format!("{other}: {json}"));
                return report;
            }
        }
    }
    report
}
