//! A copy of a message that finds it in progress in the **same** inbox is woken when that run
//! ends, without the store's help: here the store's own wait never sees the completion (it only
//! times out), and the copy is still acked as a replay as soon as the first copy committed.

use idempotency::{
    queue::{DeliveryAction, Inbox},
    store::{Awaited, CompletionSignal, Insertion, KeyRecord, LeaseToken, PendingRow},
    Attempt, Fingerprint, Idempotency, IdempotencyKey, SqliteStore, Store, StoreError,
};
use sqlx::{Sqlite, Transaction};
use std::{sync::Arc, time::Duration};
use tokio::sync::{oneshot, Notify};

/// A SQLite store whose `wait_for_completion` sees nothing: it says it was entered, then waits
/// out its timeout.
#[derive(Debug, Clone)]
struct Blind(SqliteStore, Arc<Notify>);

impl Store for Blind {
    type Database = Sqlite;

    async fn migrate(&self) -> Result<(), StoreError> {
        self.0.migrate().await
    }
    async fn insert_pending(&self, row: &PendingRow<'_>) -> Result<Insertion, StoreError> {
        self.0.insert_pending(row).await
    }
    async fn find(&self, key: &IdempotencyKey) -> Result<Option<KeyRecord>, StoreError> {
        self.0.find(key).await
    }
    async fn find_replay(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.find_replay(key, fingerprint).await
    }
    async fn take_over(&self, row: &PendingRow<'_>, stale: LeaseToken) -> Result<bool, StoreError> {
        self.0.take_over(row, stale).await
    }
    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        self.0.begin().await
    }
    async fn complete(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        key: &IdempotencyKey,
        token: LeaseToken,
        result: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.0.complete(tx, key, token, result, retention).await
    }
    async fn release(&self, key: &IdempotencyKey, token: LeaseToken) -> Result<bool, StoreError> {
        self.0.release(key, token).await
    }
    async fn park(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        reason: &str,
    ) -> Result<bool, StoreError> {
        self.0.park(key, token, reason).await
    }
    async fn extend_lease(
        &self,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.0.extend_lease(key, token, lease).await
    }
    async fn claim_for_recovery(
        &self,
        key: &IdempotencyKey,
        stale: LeaseToken,
        fresh: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.0.claim_for_recovery(key, stale, fresh, lease).await
    }
}

impl CompletionSignal for Blind {
    async fn wait_for_completion(
        &self,
        _key: &IdempotencyKey,
        _fingerprint: &Fingerprint,
        timeout: Duration,
    ) -> Result<Awaited, StoreError> {
        self.1.notify_one();
        tokio::time::sleep(timeout).await;
        Ok(Awaited::TimedOut)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_in_progress_in_the_same_inbox_is_woken_when_its_run_ends() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("wake.db").display());
    let store = Blind(SqliteStore::connect(&url).await.unwrap(), Arc::default());
    store.migrate().await.unwrap();
    // Far longer than the test may take: only the wake-up can end the copy's wait in time.
    let inbox = Inbox::new(Idempotency::new(store.clone()))
        .with_in_progress_wait(Duration::from_secs(3600));
    let message = Attempt::message_bytes("queue", "order.paid", "m-1", b"payload").unwrap();

    let (started, running) = oneshot::channel();
    let (finish, finishing) = oneshot::channel::<()>();
    let first = tokio::spawn({
        let (inbox, message) = (inbox.clone(), message.clone());
        async move {
            inbox
                .handle(&message, async move |_tx| {
                    let _ = started.send(());
                    let _ = finishing.await;
                    Ok::<_, sqlx::Error>("applied".to_owned())
                })
                .await
        }
    });
    running.await.expect("the first copy runs");
    let copy = tokio::spawn({
        let (inbox, message) = (inbox.clone(), message.clone());
        async move {
            inbox
                .handle(&message, async |_tx| {
                    Ok::<_, sqlx::Error>("applied again".to_owned())
                })
                .await
        }
    });
    // The copy is refused while the first one holds the key, and waits: then the first finishes.
    store.1.notified().await;
    finish.send(()).unwrap();
    assert_eq!(
        first.await.unwrap(),
        DeliveryAction::Ack { replayed: false }
    );
    let copied = tokio::time::timeout(Duration::from_secs(60), copy)
        .await
        .expect("the copy was woken, not left to its hour-long wait")
        .unwrap();
    assert_eq!(copied, DeliveryAction::Ack { replayed: true });
}
