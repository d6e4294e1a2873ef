//! Step 3: the handler run for a reserved key, then its response stored with the key (see
//! [`complete`](super::complete)) or the key released, parked or left pending ([`HeldLease`]);
//! and a request that runs unprotected.

use super::{
    answer::{outcome_of_settled, refuse, replay, with_retention},
    body::operation_name,
    complete::complete,
    held::HeldLease,
    reserve::Reserved,
    Handler, KeyedCall, Layered,
};
use crate::{
    commits_writes,
    config::Config,
    error::{IdempotencyRejection, InternalError},
    in_flight,
    lease::LeaseSlot,
    metrics::count,
    tx::{Returned, TxSlot},
};
use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::{request::Parts, Request, Response};
use idempotency::{protocol::Reservation, Attempt, Disposition, IdempotencyKey, Lease, Store};
use std::panic::AssertUnwindSafe;

/// After the reservation: run the handler for an acquired key, replay a completed one, refuse
/// the rest (422, 409, 503).
pub(super) async fn proceed<S: Store, H: Handler>(
    call: KeyedCall<S, H>,
    attempt: Attempt,
    reserved: Result<Reserved<S>, idempotency::Error>,
) -> Result<Response<Body>, H::Error> {
    let reserved = match reserved {
        Ok((Reservation::Acquired(lease), tx)) => {
            // With waiting on, duplicates may wait for this key: tell them when it is settled
            // (a key reserved inside the transaction is waited for by the database).
            let announce = (call.layer.config.wait_for_in_flight.is_some()
                && !lease.is_in_transaction())
            .then(|| (attempt.key().clone(), call.layer.clone()));
            let answer = execute(call, attempt, lease, tx).await;
            if let Some((key, layer)) = announce {
                if let Some(wait) = &layer.config.wait_for_in_flight {
                    let store = layer.config.idempotency.store();
                    in_flight::announce(store, wait, &layer.state.waiters, key);
                }
            }
            return answer;
        }
        Ok((other, _)) => Ok(other),
        Err(error) => Err(error),
    };
    let (config, operation) = (&*call.layer.config, call.operation.as_str());
    match reserved {
        Ok(Reservation::Completed(bytes)) => Ok(replay(config, attempt.key(), operation, &bytes)),
        Err(idempotency::Error::InProgress { retry_after }) => {
            // The finer hint: how long this operation usually takes, within the engine's.
            let retry_after = call.layer.state.estimates.hint(operation, retry_after);
            Ok(refuse(
                &config.problem_base,
                operation,
                IdempotencyRejection::InProgress { retry_after },
            ))
        }
        Err(error) => Ok(refuse(
            &config.problem_base,
            operation,
            IdempotencyRejection::from_engine(error),
        )),
        // `Acquired` was answered above.
        Ok(_) => Ok(refuse(
            &config.problem_base,
            operation,
            InternalError::UnknownReservation.into(),
        )),
    }
}

/// Steps 2 and 3 for a reserved key: run the handler, then complete (or release, or park).
async fn execute<S: Store, H: Handler>(
    mut call: KeyedCall<S, H>,
    attempt: Attempt,
    lease: Lease<S>,
    tx: Option<sqlx::Transaction<'static, S::Database>>,
) -> Result<Response<Body>, H::Error> {
    let (Layered { config, state }, op) = (call.layer, call.operation.as_str());
    let started = std::time::Instant::now();
    let mut lease = HeldLease {
        slot: LeaseSlot::new(lease),
        operation: op,
        effects: config.effects,
        journaled: config.journaled,
    };
    // 2. Run the handler, with the (lazily begun) business transaction and the lease in the
    //    extensions.
    let slot = TxSlot::new(config.idempotency.store().clone(), tx);
    let (parts, body) = (call.parts, call.body);
    let key = attempt.key().clone();
    let response = run_handler(&mut call.inner, parts, body, key, &slot, &mut lease).await?;
    if lease.taken_by_handler() {
        // The handler settled the key itself (a durable operation): nothing to store or release.
        rollback(slot.take_back()).await;
        count(op, outcome_of_settled(response.status()));
        state.estimates.record(op, started.elapsed());
        return Ok(with_retention(&config, response));
    }
    let tx = match slot.take_back() {
        Returned::Open(tx) => Some(tx),
        Returned::NotBegun => None,
        Returned::StillLent => {
            lease.give_up("the handler kept its transaction").await;
            return Ok(refuse(
                &config.problem_base,
                op,
                InternalError::TransactionKept.into(),
            ));
        }
    };
    let (mut response_parts, response_body) = response.into_parts();
    let disposition = disposition_of(&config, &mut response_parts);
    let store = disposition == Some(Disposition::Store);
    let tx = writes_to_commit(tx, store && commits_writes(response_parts.status)).await;
    // A key stored without the work's writes, or parked, needs a committed row of its own.
    let settled_alone =
        (store && tx.is_none()) || matches!(disposition, Some(Disposition::Park(_)));
    let held =
        !(settled_alone && lease.in_transaction()) || lease.recommit(&config, &attempt).await;
    if !store || !held {
        if held {
            lease.settle_unstored(disposition).await;
        }
        return Ok(Response::from_parts(response_parts, response_body));
    }
    // 3. Complete the key with the stored response in the handler's transaction, and commit both.
    let answer = complete(&config, &mut lease, tx, response_parts, response_body).await;
    if answer.is_ok() {
        state.estimates.record(op, started.elapsed());
    }
    Ok(answer.unwrap_or_else(|refused| refused))
}

/// The handler's transaction, if its writes are to commit with the key's completion (`commit`:
/// only a stored success or redirection); otherwise rolled back here, and a stored client error
/// is stored without them, in a transaction of its own.
async fn writes_to_commit<DB: sqlx::Database>(
    tx: Option<sqlx::Transaction<'static, DB>>,
    commit: bool,
) -> Option<sqlx::Transaction<'static, DB>> {
    match tx {
        Some(tx) if commit => Some(tx),
        Some(tx) => {
            let _ = tx.rollback().await;
            None
        }
        None => None,
    }
}

/// Calls the handler with the transaction slot, the lease and the key in the request's
/// extensions. If it fails or panics, its transaction is rolled back and the key given up (as
/// the route's effects say) before the error goes on, or the panic.
async fn run_handler<S: Store, H: Handler>(
    inner: &mut H,
    mut parts: Parts,
    body: Bytes,
    key: IdempotencyKey,
    slot: &TxSlot<S::Database>,
    lease: &mut HeldLease<'_, S>,
) -> Result<Response<Body>, H::Error> {
    parts.extensions.insert(slot.clone());
    // A key reserved inside the transaction is not the handler's to settle: whatever it did
    // with the lease outside that transaction would wait for the transaction itself.
    if !lease.in_transaction() {
        parts.extensions.insert(lease.slot.clone());
    }
    // The key, for handlers that pass it on to an idempotent provider.
    parts.extensions.insert(key);
    let request = Request::from_parts(parts, Body::from(body));
    match AssertUnwindSafe(inner.handle(request)).catch_unwind().await {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(error)) => {
            rollback(slot.take_back()).await;
            lease.give_up("the inner service failed").await;
            Err(error)
        }
        Err(panic) => {
            rollback(slot.take_back()).await;
            lease.give_up("the handler panicked").await;
            std::panic::resume_unwind(panic);
        }
    }
}

/// What becomes of the key after the handler's response: the handler's own word (a
/// [`Disposition`] in the response's extensions) first, then the layer's policy by status.
/// `None`: the default for the route's effects.
fn disposition_of<S: Store>(
    config: &Config<S>,
    response: &mut http::response::Parts,
) -> Option<Disposition> {
    response
        .extensions
        .remove::<Disposition>()
        .or_else(|| (config.disposition_by_status)(response.status))
}

/// Rolls back what the handler left in the slot, before the key is released (on SQLite the open
/// transaction holds the write lock the release needs).
async fn rollback<DB: sqlx::Database>(returned: Returned<DB>) {
    if let Returned::Open(tx) = returned {
        let _ = tx.rollback().await;
    }
}

/// A request that is not protected: the handler may still use the transaction, committed after a
/// response the layer would store (or one marked [`Disposition::Store`]) and rolled back otherwise.
pub(super) async fn unprotected<S: Store, H: Handler>(
    config: &Config<S>,
    mut inner: H,
    mut parts: Parts,
    body: Body,
) -> Result<Response<Body>, H::Error> {
    let operation = operation_name(&config.operation, &parts);
    let slot = TxSlot::new(config.idempotency.store().clone(), None);
    parts.extensions.insert(slot.clone());
    let mut response = inner.handle(Request::from_parts(parts, body)).await?;
    // Nothing is stored here; the writes commit after a success or a redirection only.
    response.extensions_mut().remove::<Disposition>();
    let commit = commits_writes(response.status());
    match slot.take_back() {
        Returned::NotBegun => Ok(response),
        Returned::StillLent => Ok(refuse(
            &config.problem_base,
            &operation,
            InternalError::TransactionKept.into(),
        )),
        Returned::Open(tx) if commit => match tx.commit().await {
            Ok(()) => Ok(response),
            Err(error) => Ok(refuse(
                &config.problem_base,
                &operation,
                IdempotencyRejection::from_engine(idempotency::StoreError::from(error).into()),
            )),
        },
        Returned::Open(tx) => {
            let _ = tx.rollback().await;
            Ok(response)
        }
    }
}
