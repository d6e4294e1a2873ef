//! Step 2: the key reserved, on its own commit, or inside the business transaction in the
//! engine's single-transaction mode.

use super::Layered;
use crate::in_flight;
use idempotency::{
    protocol::{Begun, Reservation},
    Attempt, Idempotency, Store,
};

/// The key reserved, and the business transaction when the reservation was written inside it.
pub(super) type Reserved<S> = (
    Reservation<S>,
    Option<sqlx::Transaction<'static, <S as Store>::Database>>,
);

/// The key reserved on its own commit, waiting for a duplicate's original as the layer says;
/// or, in the engine's single-transaction mode
/// ([`Idempotency::with_single_transaction`]), inside the business transaction, where the
/// database makes duplicates wait.
pub(super) async fn key<S: Store>(
    layer: &Layered<S>,
    operation: &str,
    engine: &Idempotency<S>,
    attempt: &Attempt,
) -> Result<Reserved<S>, idempotency::Error> {
    if engine.single_transaction_wait(attempt).is_some() {
        return Ok(match engine.begin_reserved(attempt).await? {
            Begun::Acquired(lease, tx) => (Reservation::Acquired(lease), Some(tx)),
            Begun::Completed(bytes) => (Reservation::Completed(bytes), None),
        });
    }
    in_flight::reserve(
        engine,
        attempt,
        layer.config.wait_for_in_flight.as_ref(),
        &layer.state.waiters,
        operation,
    )
    .await
    .map(|reservation| (reservation, None))
}
