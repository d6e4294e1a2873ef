//! The statements of durable steps and recovery on a [`Journal`] store: progress written in the
//! step's transaction and fenced by the lease token, the request kept until completion, unknown
//! outcomes counted, and a claim that keeps the journal and shuts the old holder out.

use super::{store_name, unique, BusinessTable, Profile};
use crate::{
    store::{Insertion, Journal, KeyState, LeaseToken, PendingRow, Progress},
    Effects, Fingerprint, IdempotencyKey, Store,
};
use std::time::Duration;

/// A key of its own for a scenario.
fn key(prefix: &str) -> IdempotencyKey {
    IdempotencyKey::new("journal", "transfer", unique(prefix)).expect("a valid key")
}

/// Reserves `key` for external, journaled work held with `token` for `lease`.
async fn reserve<S: Store>(store: &S, key: &IdempotencyKey, token: LeaseToken, lease: Duration) {
    let row = PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(b"transfer 10"),
        token,
        effects: Effects::External,
        journaled: true,
        lease,
        retention: Duration::from_secs(3600),
    };
    let inserted = store.insert_pending(&row).await.expect("insert_pending");
    assert_eq!(inserted, Insertion::Inserted, "{}", store_name::<S>());
}

/// Writes `point` (and `request`) for `key` in a transaction of its own; whether it was written.
async fn save<S: Journal>(
    store: &S,
    key: &IdempotencyKey,
    token: LeaseToken,
    point: &str,
    request: Option<&[u8]>,
) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let journal = format!(r#"{{"done":{{"{point}":1}}}}"#);
    let progress = Progress {
        recovery_point: point,
        journal: journal.as_bytes(),
        request,
    };
    let saved = store
        .save_progress(&mut tx, key, token, &progress)
        .await
        .expect("save_progress");
    tx.commit().await.expect("commit the step");
    saved
}

/// Progress is written only with the holder's token; the request only where none is stored
/// yet; completion clears the request.
pub async fn progress_is_fenced_and_the_request_kept_until_completion<S>(
    store: S,
    _profile: Profile,
) where
    S: Journal,
    S::Database: BusinessTable,
{
    let key = key("progress");
    let token = LeaseToken::new();
    reserve(&store, &key, token, Duration::from_secs(60)).await;
    assert!(!save(&store, &key, LeaseToken::new(), "debited", Some(b"req")).await);
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(
        row.recovery_point, None,
        "a stranger's progress was written"
    );
    assert!(save(&store, &key, token, "debited", Some(b"req")).await);
    assert!(save(&store, &key, token, "credited", Some(b"other")).await);
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(row.recovery_point.as_deref(), Some("credited"));
    assert_eq!(
        row.progress.as_deref(),
        Some(br#"{"done":{"credited":1}}"#.as_slice())
    );
    assert_eq!(row.request.as_deref(), Some(b"req".as_slice()), "kept");
    assert!(row.is_resumable());
    let mut tx = store.begin().await.unwrap();
    assert!(store
        .complete(&mut tx, &key, token, b"done", Duration::from_secs(60))
        .await
        .unwrap());
    tx.commit().await.unwrap();
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(row.request, None, "the request is cleared at completion");
}

/// Progress written in a transaction that rolls back is gone with it.
pub async fn progress_rolls_back_with_its_step<S>(store: S, _profile: Profile)
where
    S: Journal,
    S::Database: BusinessTable,
{
    let key = key("rollback");
    let token = LeaseToken::new();
    reserve(&store, &key, token, Duration::from_secs(60)).await;
    let mut tx = store.begin().await.unwrap();
    let progress = Progress {
        recovery_point: "debited",
        journal: b"{}",
        request: Some(b"req"),
    };
    assert!(store
        .save_progress(&mut tx, &key, token, &progress)
        .await
        .unwrap());
    tx.rollback().await.unwrap();
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(row.recovery_point, None);
    assert_eq!(row.request, None);
}

/// An unknown outcome counts one attempt and sets when to look again, only for the holder; the
/// key stays pending with its token.
pub async fn unknown_outcomes_are_counted_for_the_holder_only<S>(store: S, _profile: Profile)
where
    S: Journal,
    S::Database: BusinessTable,
{
    let key = key("unknown");
    let token = LeaseToken::new();
    reserve(&store, &key, token, Duration::from_secs(60)).await;
    assert!(!store
        .note_unknown(&key, LeaseToken::new(), Duration::from_millis(50))
        .await
        .unwrap());
    assert!(store
        .note_unknown(&key, token, Duration::from_millis(50))
        .await
        .unwrap());
    assert!(store
        .note_unknown(&key, token, Duration::from_millis(50))
        .await
        .unwrap());
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(row.recovery_attempts, 2);
    assert_eq!(row.state, KeyState::Pending);
    assert_eq!(row.lease_token, token);
    assert!(
        row.lease_remaining <= Duration::from_millis(50),
        "{:?}",
        row.lease_remaining
    );
}

/// A claim of an ended lease keeps the journal and the attempts, and shuts the old holder out;
/// a live lease cannot be claimed, nor a claimed one claimed again with the old token.
pub async fn a_claim_keeps_the_journal_and_fences_the_old_holder<S>(store: S, _profile: Profile)
where
    S: Journal,
    S::Database: BusinessTable,
{
    let key = key("claim");
    let old = LeaseToken::new();
    let lease = Duration::from_millis(200);
    reserve(&store, &key, old, lease).await;
    assert!(save(&store, &key, old, "debited", Some(b"req")).await);
    assert!(store.note_unknown(&key, old, lease).await.unwrap());
    let fresh = LeaseToken::new();
    assert!(
        !store
            .claim_for_recovery(&key, old, fresh, Duration::from_secs(60))
            .await
            .unwrap(),
        "a live lease was claimed"
    );
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    assert!(store
        .claim_for_recovery(&key, old, fresh, Duration::from_secs(60))
        .await
        .unwrap());
    assert!(!store
        .claim_for_recovery(&key, old, LeaseToken::new(), Duration::from_secs(60))
        .await
        .unwrap());
    assert!(!save(&store, &key, old, "credited", None).await, "fenced");
    let row = store.find(&key).await.unwrap().unwrap();
    assert_eq!(row.lease_token, fresh);
    assert_eq!(row.recovery_point.as_deref(), Some("debited"));
    assert_eq!(row.request.as_deref(), Some(b"req".as_slice()));
    assert_eq!(row.recovery_attempts, 1);
    assert!(!row.lease_expired());
    assert!(save(&store, &key, fresh, "credited", None).await);
}
