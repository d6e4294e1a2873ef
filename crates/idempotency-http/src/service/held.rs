//! [`HeldLease`]: the key's lease while the handler runs, and what becomes of the key when the
//! response is not stored (released, parked, or left pending for the recovery job).

use crate::{
    config::Config,
    lease::LeaseSlot,
    metrics::{self, count},
};
use idempotency::{protocol::Reservation, Attempt, Disposition, Effects, Lease, Store};

/// The lease while the handler runs, in the slot a [`KeyLease`](crate::KeyLease) extractor takes
/// it from. Dropped while still held (the client went away and the server cancelled the
/// request), the key is released by [`Lease`]'s own drop; this counts it.
pub(super) struct HeldLease<'o, S: Store> {
    pub(super) slot: LeaseSlot<S>,
    pub(super) operation: &'o str,
    pub(super) effects: Effects,
    /// A durable operation's route: outside calls happen only under the lease the handler takes.
    pub(super) journaled: bool,
}

impl<S: Store> HeldLease<'_, S> {
    pub(super) fn take(&mut self) -> Lease<S> {
        self.slot.take().expect("the lease is taken once")
    }

    /// After a response that is not stored: release, park, or (`None`, or a decision this layer
    /// does not know) the default for the route's effects.
    pub(super) async fn settle_unstored(&mut self, disposition: Option<Disposition>) {
        match disposition {
            Some(Disposition::Release) => self.release("the response is not stored").await,
            Some(Disposition::Park(reason)) => self.park(&reason).await,
            _ => self.give_up("the response is not stored").await,
        }
    }

    /// Whether the key row was written inside the business transaction (the
    /// single-transaction mode).
    pub(super) fn in_transaction(&self) -> bool {
        self.slot.is_in_transaction()
    }

    /// For a key reserved inside the transaction, which rolled back: the key reserved again on
    /// its own commit, to be stored or parked without the work's writes. `false` when a
    /// duplicate holds or settled the key meanwhile (or the store failed): nothing of ours to
    /// settle, and the response goes out unstored.
    pub(super) async fn recommit(&mut self, config: &Config<S>, attempt: &Attempt) -> bool {
        let lease = self.take();
        match config.idempotency.reserve_committed(attempt, lease).await {
            Ok(Reservation::Acquired(lease)) => {
                self.slot = LeaseSlot::new(lease);
                true
            }
            Ok(_) => {
                tracing::warn!(
                    "a duplicate took the key after the rollback; the response is not stored"
                );
                false
            }
            Err(error) => {
                tracing::warn!(%error, "could not reserve the key again; the response is not stored");
                false
            }
        }
    }

    /// Whether the handler took the lease (and so settles the key itself).
    pub(super) fn taken_by_handler(&self) -> bool {
        !self.slot.holds()
    }

    async fn park(&mut self, reason: &str) {
        count(self.operation, metrics::PARKED);
        tracing::warn!(reason, "parking idempotency key for review");
        if let Err(error) = self.take().park(reason).await {
            tracing::error!(%error, "could not park idempotency key; it stays pending until its lease ends");
        }
    }

    /// After a failure that may have come after an outside effect: local work's key is
    /// released; external work's is never released by the layer, it stays pending for the
    /// recovery job. On a journaled route (a durable operation) outside calls are made only
    /// under the lease the handler takes: while the layer still holds it, nothing went out, and
    /// the key is released (a handler that took it settles the key itself).
    pub(super) async fn give_up(&mut self, why: &'static str) {
        match self.effects {
            Effects::External if !self.journaled => self.leave_pending(why),
            _ => self.release(why).await,
        }
    }

    fn leave_pending(&mut self, why: &'static str) {
        let Some(lease) = self.slot.take() else {
            // The handler took the lease (a durable operation): the key is its own to settle.
            tracing::warn!(
                reason = why,
                "the handler held the key's lease; left as it is"
            );
            return;
        };
        count(self.operation, metrics::LEFT_PENDING);
        tracing::warn!(
            reason = why,
            "outside effects may have happened; the key stays pending for the recovery job"
        );
        lease.leave_pending();
    }

    async fn release(&mut self, why: &'static str) {
        let Some(lease) = self.slot.take() else {
            // A handler that took the lease (a durable operation) and then failed or panicked:
            // the key is its own to settle; a dropped durable lease stays pending for the resumer.
            tracing::warn!(
                reason = why,
                "the handler held the key's lease; not released"
            );
            return;
        };
        count(self.operation, metrics::RELEASED);
        tracing::info!(reason = why, "releasing idempotency key");
        if let Err(error) = lease.release().await {
            tracing::warn!(%error, "could not release idempotency key; it stays pending until its lease ends");
        }
    }
}

impl<S: Store> Drop for HeldLease<'_, S> {
    fn drop(&mut self) {
        if self.slot.holds() {
            // The lease drops with us: local work's key is released, external work's stays
            // pending (see `idempotency::Lease`).
            match self.effects {
                Effects::Local => {
                    count(self.operation, metrics::RELEASED);
                    tracing::info!("request cancelled; releasing idempotency key");
                }
                // External, and anything a later version adds: the key is never released.
                _ => {
                    count(self.operation, metrics::LEFT_PENDING);
                    tracing::warn!("request cancelled; the key stays pending for the recovery job");
                }
            }
        }
    }
}
