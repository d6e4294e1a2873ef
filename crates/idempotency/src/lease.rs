//! The right to run the work for one key: [`Lease`].

use crate::{
    error::{Error, StoreError},
    heartbeat::Heartbeat,
    maintenance::signals,
    replay_cache::ReplayCache,
    store::{history::EventKind, Effects, KeyRecord, LeaseToken, Store},
    Fingerprint, IdempotencyKey,
};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tracing::Instrument;

/// The right to run the work for one key, until the lease ends.
///
/// Dropping a lease that was neither finished, released nor parked (a panic, a cancelled future)
/// *abandons* it: for [`Effects::Local`] work the key is released in a background task, so a
/// cancelled request does not keep the key pending until its lease ends (nothing was committed:
/// completion commits with the work). For [`Effects::External`] work the key is left pending, since
/// the outside effect may have happened: the recovery job asks the provider once the lease ends, or
/// parks the key for a human.
#[derive(Debug)]
pub struct Lease<S: Store> {
    pub(crate) store: S,
    pub(crate) key: IdempotencyKey,
    pub(crate) token: LeaseToken,
    pub(crate) effects: Effects,
    pub(crate) retention: Duration,
    pub(crate) armed: bool,
    /// The row as it was when this lease took it over from an earlier holder (a durable
    /// operation resumed by a retry or the resumer), with its journal.
    pub(crate) resumed: Option<Box<KeyRecord>>,
    /// Extends the lease while it is held (`None`: off, or no runtime to beat on).
    pub(crate) heartbeat: Option<Heartbeat>,
    /// Where a committed completion is remembered, with the fingerprint of the request it
    /// answers (`None`: no cache).
    pub(crate) replay_cache: Option<(Arc<ReplayCache>, Fingerprint)>,
    /// The key row was written inside the business transaction and never committed on its
    /// own (the single-transaction mode): rolling that transaction back is the release, and
    /// nothing is ever released, parked or left pending through the store.
    pub(crate) in_transaction: bool,
    /// The key records a history (external or durable work): its transitions write events.
    /// A plain local key records nothing, so it costs no extra statement.
    pub(crate) records_history: bool,
}

impl<S: Store> Lease<S> {
    /// The key held.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Our lease token.
    pub fn token(&self) -> LeaseToken {
        self.token
    }

    /// Whether the key row lives only in the business transaction, uncommitted (the
    /// single-transaction mode, [`Idempotency::with_single_transaction`](crate::Idempotency::with_single_transaction)):
    /// the key is released by rolling that transaction back, and a refusal stored without the
    /// work's writes, or a park, needs a committed reservation
    /// ([`Idempotency::reserve_committed`](crate::Idempotency::reserve_committed)).
    ///
    /// ```no_run
    /// # fn demo(lease: idempotency::Lease<idempotency::PgStore>) {
    /// if lease.is_in_transaction() {
    ///     // Nobody else sees this key until the transaction commits.
    /// }
    /// # }
    /// ```
    pub fn is_in_transaction(&self) -> bool {
        self.in_transaction
    }

    /// Whether this lease took the key over from an earlier holder of a durable operation (its
    /// steps continue from the recovery point).
    pub fn is_resumed(&self) -> bool {
        self.resumed.is_some()
    }

    pub(crate) fn store(&self) -> &S {
        &self.store
    }

    /// After the completion started at `started` committed: remembers `result` in the replay
    /// cache, if there is one, until no later than the row's `expires_at`.
    pub(crate) fn remember(&self, started: Instant, result: &[u8]) {
        if let Some((cache, fingerprint)) = &self.replay_cache {
            // The row expires at the database's now() during the completion plus the
            // retention; the completion started no earlier than `started`.
            cache.insert(&self.key, *fingerprint, result, started + self.retention);
        }
    }

    /// Whether the heartbeat found this lease gone while the work ran (taken over after a
    /// stall, or settled by an operator): the work's completion will fail with
    /// [`Error::LeaseLost`].
    ///
    /// ```no_run
    /// # async fn demo(lease: idempotency::Lease<idempotency::SqliteStore>) {
    /// if lease.is_lost() {
    ///     // Stop early: nothing this holder writes can commit.
    /// }
    /// # }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.heartbeat.as_ref().is_some_and(Heartbeat::is_lost)
    }

    /// Stops extending the lease; the holder is about to settle the key (or give it up).
    pub(crate) fn stop_heartbeat(&mut self) {
        self.heartbeat = None;
    }

    /// The key was settled, parked or noted by other means: dropping the lease does nothing,
    /// and the lease is no longer extended.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
        self.heartbeat = None;
    }

    /// Releases the key now if it is still pending with our token, logging a failure.
    pub(crate) async fn release_now(&mut self) {
        self.release_quietly().await;
    }

    /// Marks the key completed with `result` **inside** `tx` (only if still pending with our
    /// token), then commits `tx`. If the lease was lost, rolls `tx` back and returns
    /// [`Error::LeaseLost`]; if the commit fails, releases the key only if it is still pending
    /// (a lost COMMIT acknowledgement may hide a commit that happened).
    pub async fn finish(
        mut self,
        tx: sqlx::Transaction<'static, S::Database>,
        result: &[u8],
    ) -> Result<(), Error> {
        let span = signals::phase_span!(signals::SPAN_COMPLETE, self.key);
        let finished = self.finish_once(tx, result).instrument(span.clone()).await;
        let outcome = match &finished {
            Ok(()) => signals::EXECUTED,
            Err(Error::LeaseLost) => signals::LEASE_LOST,
            Err(_) => {
                signals::record(&span, signals::ERROR);
                return finished;
            }
        };
        signals::record(&span, outcome);
        signals::outcome(self.key.operation(), outcome);
        finished
    }

    /// [`finish`](Self::finish), without its span and counts. Every path disarms the lease.
    async fn finish_once(
        &mut self,
        mut tx: sqlx::Transaction<'static, S::Database>,
        result: &[u8],
    ) -> Result<(), Error> {
        if self.is_lost() {
            self.disarm();
            let _ = tx.rollback().await;
            return Err(Error::LeaseLost);
        }
        // The remaining lease (at least two thirds of it) covers the completion.
        self.stop_heartbeat();
        let started = Instant::now();
        let completed = self
            .store
            .complete(&mut tx, &self.key, self.token, result, self.retention)
            .await;
        let completed = match completed {
            Ok(true) if self.records_history => self
                .store
                .append_event(&mut tx, &self.key, EventKind::Completed, None)
                .await
                .map(|()| true),
            other => other,
        };
        match completed {
            Ok(true) => {}
            Ok(false) => {
                self.disarm();
                let _ = tx.rollback().await;
                self.note_lease_lost("the completion found the lease taken")
                    .await;
                return Err(Error::LeaseLost);
            }
            Err(e) => {
                let _ = tx.rollback().await;
                self.release_quietly().await;
                return Err(e.into());
            }
        }
        match tx.commit().await {
            Ok(()) => {
                self.disarm();
                self.remember(started, result);
                Ok(())
            }
            Err(e) => {
                self.release_quietly().await;
                Err(StoreError::from(e).into())
            }
        }
    }

    /// Releases the key if it is still pending with our token. Returns whether it was released.
    ///
    /// A lease that [resumed](Self::is_resumed) a durable operation never releases: steps of
    /// that operation took effect, and deleting the key would lose its journal. Its key stays
    /// pending with our token until the lease ends; then the resumer carries it on.
    pub async fn release(mut self) -> Result<bool, StoreError> {
        self.disarm();
        if self.releases_nothing() {
            return Ok(false);
        }
        self.release_fenced().await
    }

    /// The store's fenced release (with a `released` event for a key that records a history),
    /// in its span, counted when it released.
    async fn release_fenced(&self) -> Result<bool, StoreError> {
        let span = signals::phase_span!(signals::SPAN_RELEASE, self.key);
        let released = if self.records_history {
            self.store
                .release_recorded(&self.key, self.token)
                .instrument(span.clone())
                .await
        } else {
            self.store
                .release(&self.key, self.token)
                .instrument(span.clone())
                .await
        };
        match released {
            Ok(true) => {
                signals::record(&span, signals::RELEASED);
                signals::outcome(self.key.operation(), signals::RELEASED);
            }
            Ok(false) => signals::record(&span, signals::LEASE_LOST),
            Err(_) => signals::record(&span, signals::ERROR),
        }
        released
    }

    /// For a key that records a history: appends a `lease_lost` event (actor: this holder) in a
    /// transaction of its own, after a fenced write found the lease taken. Best effort: a
    /// failure is logged.
    pub(crate) async fn note_lease_lost(&self, detail: &str) {
        if self.records_history && !self.in_transaction {
            append_on_its_own(&self.store, &self.key, EventKind::LeaseLost, Some(detail)).await;
        }
    }

    /// Whether a release must not touch the store: the key row lives only in the business
    /// transaction (its rollback is the release), or it holds progress a release would lose.
    fn releases_nothing(&self) -> bool {
        self.in_transaction || self.keeps_progress()
    }

    /// Whether this lease holds recorded progress that a release would lose (see
    /// [`release`](Self::release)).
    fn keeps_progress(&self) -> bool {
        if self.resumed.is_some() {
            tracing::warn!(key = %self.key, "a resumed durable operation is never released; it stays pending for the resumer");
            return true;
        }
        false
    }

    /// Gives the key up **without releasing it**: it stays pending until its lease ends, and
    /// then the recovery job settles it (asking the provider, or parking it for review). For
    /// work whose outside effect may have happened and nobody knows (a handler that failed or
    /// panicked after calling a provider).
    ///
    /// ```no_run
    /// # async fn demo(lease: idempotency::Lease<idempotency::SqliteStore>) {
    /// lease.leave_pending();
    /// # }
    /// ```
    pub fn leave_pending(mut self) {
        self.disarm();
        signals::outcome(self.key.operation(), signals::LEFT_PENDING);
        tracing::warn!(key = %self.key, "outcome unknown; the key stays pending for the recovery job");
    }

    /// Parks the key as `needs_review` if it is still pending with our token.
    /// A lease [in the transaction](Self::is_in_transaction) parks nothing (`Ok(false)`): its
    /// row went with the rollback.
    pub async fn park(mut self, reason: &str) -> Result<bool, StoreError> {
        self.disarm();
        if self.in_transaction {
            return Ok(false);
        }
        let parked = if self.records_history {
            self.store
                .park_recorded(&self.key, self.token, reason)
                .await
        } else {
            self.store.park(&self.key, self.token, reason).await
        };
        if let Ok(true) = parked {
            signals::outcome(self.key.operation(), signals::PARKED);
        }
        parked
    }

    /// The work was abandoned (panic): release a local key, leave an external one pending.
    pub(crate) async fn abandon(&mut self) {
        if self.effects == Effects::External {
            self.disarm();
            signals::outcome(self.key.operation(), signals::LEFT_PENDING);
            tracing::warn!(key = %self.key, "external work abandoned; the key stays pending for the recovery job");
            return;
        }
        self.release_quietly().await;
    }

    pub(crate) async fn release_quietly(&mut self) {
        self.disarm();
        if self.releases_nothing() {
            return;
        }
        if let Err(error) = self.release_fenced().await {
            tracing::warn!(%error, key = %self.key, "could not release idempotency key; it stays pending until its lease ends");
        }
    }
}

impl<S: Store> Lease<S> {
    /// From a drop: releases the key in a task of its own (a drop cannot wait).
    pub(crate) fn release_in_background(&mut self) {
        self.disarm();
        if self.releases_nothing() {
            return;
        }
        let (store, key, token) = (self.store.clone(), self.key.clone(), self.token);
        let recorded = self.records_history;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let released = if recorded {
                        store.release_recorded(&key, token).await
                    } else {
                        store.release(&key, token).await
                    };
                    match released {
                        Ok(true) => signals::outcome(key.operation(), signals::RELEASED),
                        Ok(false) => {}
                        Err(error) => tracing::warn!(%error, %key, "could not release abandoned idempotency key"),
                    }
                });
            }
            Err(_) => {
                tracing::warn!(%key, "idempotency lease dropped outside a tokio runtime; the key stays pending until its lease ends")
            }
        }
    }
}

impl<S: Store> Drop for Lease<S> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.effects == Effects::External {
            signals::outcome(self.key.operation(), signals::LEFT_PENDING);
            tracing::warn!(key = %self.key, "external work abandoned (cancelled); the key stays pending for the recovery job");
            return;
        }
        self.release_in_background();
    }
}

/// Appends an event to the history of `key` in a transaction of its own (an outside call
/// started, an unknown answer, a lost lease): events that record no change of the row. Best
/// effort: a failure is logged, and the work goes on.
pub(crate) async fn append_on_its_own<S: Store>(
    store: &S,
    key: &IdempotencyKey,
    kind: EventKind,
    detail: Option<&str>,
) {
    let appended = async {
        let mut tx = store.begin().await?;
        store.append_event(&mut tx, key, kind, detail).await?;
        tx.commit().await?;
        Ok::<(), StoreError>(())
    };
    if let Err(error) = appended.await {
        tracing::warn!(%error, %key, kind = %kind, "could not append to the key's history");
    }
}
