//! The layer's own answers: refusals (problem documents), replays of stored responses, and the
//! retention header they carry.

use crate::{
    config::Config,
    error::{IdempotencyRejection, InternalError},
    metrics::{self, count},
    stored::StoredResponse,
};
use axum::body::Body;
use http::{HeaderValue, Response};
use idempotency::{maintenance::signals, IdempotencyKey, Store};
use idempotency_wire::header::IDEMPOTENCY_KEY_RETENTION;

/// The stored response of `key`, marked as a replay (in an `idempotency.replay` span).
pub(super) fn replay<S: Store>(
    config: &Config<S>,
    key: &IdempotencyKey,
    op: &str,
    bytes: &[u8],
) -> Response<Body> {
    let _span = tracing::debug_span!(
        signals::SPAN_REPLAY,
        scope = key.scope(),
        operation = key.operation(),
    )
    .entered();
    match StoredResponse::from_bytes(bytes) {
        Ok(stored) => {
            count(op, metrics::REPLAYED);
            tracing::debug!(status = stored.status, "replayed stored response");
            let marker = config.replay_header.clone();
            with_retention(config, stored.into_replay_marked(marker))
        }
        Err(e) => refuse(
            &config.problem_base,
            op,
            InternalError::StoredResult(e).into(),
        ),
    }
}

/// The metrics outcome of a response whose handler settled the key itself.
pub(super) fn outcome_of_settled(status: http::StatusCode) -> &'static str {
    if status.is_success() {
        metrics::EXECUTED
    } else {
        metrics::SETTLED_BY_HANDLER
    }
}

/// Adds `Idempotency-Key-Retention` when the layer is configured to.
pub(super) fn with_retention<S: Store>(
    config: &Config<S>,
    mut response: Response<Body>,
) -> Response<Body> {
    if config.retention_header {
        let seconds = config.idempotency.retention().as_secs();
        response
            .headers_mut()
            .insert(IDEMPOTENCY_KEY_RETENTION, HeaderValue::from(seconds));
    }
    response
}

/// A refusal, counted and logged.
pub(super) fn refuse(
    base: &str,
    operation: &str,
    rejection: IdempotencyRejection,
) -> Response<Body> {
    count(operation, rejection.outcome());
    tracing::info!(%rejection, "idempotency layer refused the request");
    rejection.to_response_under(base)
}
