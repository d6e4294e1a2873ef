//! Step 4: the handler's response captured as a [`StoredResponse`], and the key completed with
//! it inside the handler's transaction (or one of its own), committed together.

use super::{
    answer::{refuse, with_retention},
    held::HeldLease,
};
use crate::{
    config::Config,
    error::{IdempotencyRejection, InternalError},
    metrics::{self, count},
    stored::StoredResponse,
};
use axum::body::Body;
use http::{response::Parts, Response};
use http_body_util::BodyExt;
use idempotency::Store;

/// Captures the response, completes the key with it in `tx` (or a transaction of its own),
/// commits, and answers with the response: `Ok` once the key is completed, `Err` with the
/// refusal (500, 503) when it could not be, after the key was given up.
pub(super) async fn complete<S: Store>(
    config: &Config<S>,
    lease: &mut HeldLease<'_, S>,
    tx: Option<sqlx::Transaction<'static, S::Database>>,
    response_parts: Parts,
    response_body: Body,
) -> Result<Response<Body>, Response<Body>> {
    let op = lease.operation;
    let refused = |rejection| refuse(&config.problem_base, op, rejection);
    let response_body = match response_body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            lease.give_up("the response body failed").await;
            return Err(refused(InternalError::ResponseBody(error.into()).into()));
        }
    };
    let stored = StoredResponse::capture(
        response_parts.status,
        &response_parts.headers,
        &config.stored_headers,
        response_body.to_vec(),
    );
    let tx = match tx {
        Some(tx) => tx,
        None => match config.idempotency.store().begin().await {
            Ok(tx) => tx,
            Err(error) => {
                lease.give_up("could not begin a transaction").await;
                return Err(refused(IdempotencyRejection::from_engine(error.into())));
            }
        },
    };
    match lease.take().finish(tx, &stored.to_bytes()).await {
        Ok(()) => {
            count(op, metrics::EXECUTED);
            tracing::debug!(status = stored.status, "executed and stored response");
            let response = Response::from_parts(response_parts, Body::from(response_body));
            Ok(with_retention(config, response))
        }
        Err(error) => {
            tracing::warn!(%error, "could not complete the idempotency key");
            Err(refused(IdempotencyRejection::from_engine(error)))
        }
    }
}
