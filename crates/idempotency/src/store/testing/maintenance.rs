//! The operator's statements on a [`Maintenance`] store: resolution and hand-back of parked keys,
//! fenced on the row the operator saw, each recorded in the key's history, which reads back in
//! order; listings paged by a keyset cursor.

use super::{store_name, unique, BusinessTable, Profile};
use crate::{
    maintenance::{EventKind, KeyCursor, KeyEvent, KeyFilter, OperatorNote, Resolution},
    store::{Insertion, KeyRecord, KeyState, LeaseToken, Maintenance, PendingRow},
    Effects, Fingerprint, IdempotencyKey,
};
use std::time::Duration;

/// A key of its own for a scenario.
fn key(prefix: &str) -> IdempotencyKey {
    IdempotencyKey::new("maintenance", "charge", unique(prefix)).expect("a valid key")
}

/// Reserves `key` for external work and parks it, as a worker that cannot tell the outcome does;
/// returns the parked row.
async fn parked<S: Maintenance>(store: &S, key: &IdempotencyKey) -> KeyRecord {
    let token = LeaseToken::new();
    let row = PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(b"charge 10"),
        token,
        effects: Effects::External,
        journaled: false,
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
    };
    let inserted = store.insert_pending(&row).await.expect("insert_pending");
    assert_eq!(inserted, Insertion::Inserted, "{}", store_name::<S>());
    assert!(
        store
            .park(key, token, "timeout at the provider")
            .await
            .expect("park"),
        "{}: park",
        store_name::<S>()
    );
    let row = store.find(key).await.expect("find").expect("the row");
    assert_eq!(row.state, KeyState::NeedsReview, "{}", store_name::<S>());
    row
}

/// The events of `kind` in the history of `key`.
async fn events_of<S: Maintenance>(
    store: &S,
    key: &IdempotencyKey,
    kind: EventKind,
) -> Vec<KeyEvent> {
    let history = store.history(key, 1000).await.expect("history");
    history.into_iter().filter(|e| e.kind == kind).collect()
}

/// A resolution whose `seen` is not the row's `updated_at` any more writes nothing; with the
/// current `updated_at` it acts, and records who resolved, why and on what evidence.
pub async fn a_resolution_on_a_stale_page_is_refused<S>(store: S, _profile: Profile)
where
    S: Maintenance,
    S::Database: BusinessTable,
{
    let name = store_name::<S>();
    let key = key("stale");
    let row = parked(&store, &key).await;
    let stale = OperatorNote::new("alice", "provider shows ch_1")
        .with_seen(row.updated_at - chrono::Duration::seconds(5));
    let resolution = Resolution::Completed(br#"{"charge":"ch_1"}"#.to_vec());
    let retention = Duration::from_secs(3600);
    let acted = store.resolve(&key, &resolution, &stale, retention).await;
    assert!(!acted.expect("resolve"), "{name}: a stale page resolved");
    let now = store.find(&key).await.unwrap().unwrap();
    assert_eq!(now.state, KeyState::NeedsReview, "{name}");
    assert_eq!(now.reason.as_deref(), Some("timeout at the provider"));
    assert!(
        events_of(&store, &key, EventKind::Resolved)
            .await
            .is_empty(),
        "{name}: a refused resolution left an event"
    );

    let fresh = OperatorNote::new("alice", "provider shows ch_1")
        .with_evidence("dashboard ch_1")
        .with_seen(row.updated_at);
    let acted = store.resolve(&key, &resolution, &fresh, retention).await;
    assert!(
        acted.expect("resolve"),
        "{name}: a current page was refused"
    );
    let now = store.find(&key).await.unwrap().unwrap();
    assert_eq!(now.state, KeyState::Completed, "{name}");
    assert_eq!(now.reason.as_deref(), Some("provider shows ch_1"));
    let resolved = events_of(&store, &key, EventKind::Resolved).await;
    assert_eq!(resolved.len(), 1, "{name}: {resolved:?}");
    assert_eq!(resolved[0].actor.as_deref(), Some("alice"), "{name}");
    let detail = resolved[0].detail.as_deref().unwrap_or_default();
    for part in ["completed", "provider shows ch_1", "dashboard ch_1"] {
        assert!(detail.contains(part), "{name}: {detail:?} lacks {part:?}");
    }
    // Settled: a second resolution (even unfenced) is refused and writes nothing.
    let again = OperatorNote::new("bob", "again");
    let acted = store.resolve(&key, &Resolution::Failed, &again, retention);
    assert!(!acted.await.expect("resolve"), "{name}");
    assert_eq!(events_of(&store, &key, EventKind::Resolved).await.len(), 1);
}

/// A hand-back moves a parked key to `pending` with its lease ended and its attempts reset, so
/// the recovery job finds it again; only parked keys, fenced on `seen`.
pub async fn a_hand_back_returns_the_key_to_the_resumer<S>(store: S, _profile: Profile)
where
    S: Maintenance,
    S::Database: BusinessTable,
{
    let name = store_name::<S>();
    let key = key("hand-back");
    let row = parked(&store, &key).await;
    let stale = OperatorNote::new("alice", "ask again")
        .with_seen(row.updated_at + chrono::Duration::seconds(5));
    assert!(!store.hand_back(&key, &stale).await.expect("hand_back"));
    assert_eq!(
        store.find(&key).await.unwrap().unwrap().state,
        KeyState::NeedsReview,
        "{name}: a stale page handed the key back"
    );

    let note = OperatorNote::new("alice", "provider was down; ask again")
        .with_evidence("incident 812")
        .with_seen(row.updated_at);
    assert!(store.hand_back(&key, &note).await.expect("hand_back"));
    let now = store.find(&key).await.unwrap().unwrap();
    assert_eq!(now.state, KeyState::Pending, "{name}");
    assert_eq!(
        now.lease_remaining,
        Duration::ZERO,
        "{name}: lease not ended"
    );
    assert_eq!(now.recovery_attempts, 0, "{name}");
    assert_eq!(
        now.lease_token, row.lease_token,
        "{name}: the token is kept"
    );
    assert_eq!(now.reason.as_deref(), Some("provider was down; ask again"));
    let expired = store.expired_leases(1000).await.expect("expired_leases");
    assert!(
        expired.iter().any(|r| r.key == key),
        "{name}: the recovery job does not see the handed-back key"
    );
    let handed = events_of(&store, &key, EventKind::HandedBack).await;
    assert_eq!(handed.len(), 1, "{name}: {handed:?}");
    assert_eq!(handed[0].actor.as_deref(), Some("alice"), "{name}");
    let detail = handed[0].detail.as_deref().unwrap_or_default();
    assert!(detail.contains("ask again") && detail.contains("incident 812"));
    // Not parked any more: a second hand-back is refused.
    let again = OperatorNote::new("bob", "again");
    assert!(!store.hand_back(&key, &again).await.expect("hand_back"));
    assert_eq!(
        events_of(&store, &key, EventKind::HandedBack).await.len(),
        1
    );
}

/// A key's events read back oldest first, only its own, the newest `limit` of them.
pub async fn the_history_reads_back_in_order<S>(store: S, _profile: Profile)
where
    S: Maintenance,
    S::Database: BusinessTable,
{
    let name = store_name::<S>();
    let key = key("history");
    let other = key_of_other(&key);
    parked(&store, &key).await;
    parked(&store, &other).await;
    let before = store.find(&key).await.unwrap().unwrap().updated_at;
    assert!(store
        .hand_back(&key, &OperatorNote::new("alice", "first"))
        .await
        .unwrap());
    // The recovery job claims the handed-back key and parks it again.
    let row = store.find(&key).await.unwrap().unwrap();
    let mine = LeaseToken::new();
    let lease = Duration::from_secs(60);
    assert!(store
        .claim_for_recovery(&key, row.lease_token, mine, lease)
        .await
        .unwrap());
    assert!(store.park(&key, mine, "still unknown").await.unwrap());
    let note = OperatorNote::new("bob", "second");
    assert!(store
        .resolve(&key, &Resolution::Failed, &note, lease)
        .await
        .unwrap());

    let ours = [EventKind::HandedBack, EventKind::Resolved];
    let history = store.history(&key, 1000).await.expect("history");
    let operators: Vec<_> = history.iter().filter(|e| ours.contains(&e.kind)).collect();
    let kinds: Vec<_> = operators.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ours, "{name}: {history:?}");
    assert_eq!(operators[0].actor.as_deref(), Some("alice"), "{name}");
    assert_eq!(operators[1].actor.as_deref(), Some("bob"), "{name}");
    assert!(
        history.windows(2).all(|pair| pair[0].at <= pair[1].at),
        "{name}: not oldest first: {history:?}"
    );
    // By the database clock, after the row was parked (a second of slack for rounding).
    assert!(
        operators[0].at >= before - chrono::Duration::seconds(1),
        "{name}"
    );
    let newest = store.history(&key, 1).await.expect("history");
    assert_eq!(newest.len(), 1, "{name}");
    assert_eq!(newest[0].kind, EventKind::Resolved, "{name}: {newest:?}");
    assert!(
        events_of(&store, &other, EventKind::HandedBack)
            .await
            .is_empty(),
        "{name}: another key's history holds this key's events"
    );
    let nobody = key_of_other(&other);
    assert!(store.history(&nobody, 10).await.unwrap().is_empty());
}

/// A key of the same scope and operation as `key`, with another client key.
fn key_of_other(key: &IdempotencyKey) -> IdempotencyKey {
    IdempotencyKey::new(key.scope(), key.operation(), format!("{}-other", key.key()))
        .expect("a valid key")
}

/// Reserves `key` (local work, a long lease).
async fn reserve_local<S: Maintenance>(store: &S, key: &IdempotencyKey) {
    let row = PendingRow {
        key,
        fingerprint: Fingerprint::of_bytes(b"page"),
        token: crate::store::LeaseToken::new(),
        effects: Effects::Local,
        journaled: false,
        lease: Duration::from_secs(3600),
        retention: Duration::from_secs(3600),
    };
    let inserted = store.insert_pending(&row).await.expect("insert_pending");
    assert_eq!(inserted, Insertion::Inserted, "{}", store_name::<S>());
}

/// Paging with a cursor visits every matching row once, in the list's order, whatever the
/// page size, including rows created in the same instant (ties broken by scope, operation,
/// key); the last page is short and the one after it empty.
pub async fn pages_after_a_cursor_visit_every_row_once<S: Maintenance>(
    store: S,
    _profile: Profile,
) {
    let name = store_name::<S>();
    let scope = unique("pages");
    let mut keys = Vec::new();
    for (operation, n) in [("b-op", 3), ("a-op", 4)] {
        for i in 0..n {
            let key = IdempotencyKey::new(&scope, operation, format!("k{i}")).expect("key");
            reserve_local(&store, &key).await;
            keys.push(key);
        }
    }
    // Another scope's row is not listed.
    reserve_local(
        &store,
        &IdempotencyKey::new(unique("other"), "a-op", "k0").expect("key"),
    )
    .await;
    let all = store
        .list(&KeyFilter::default().with_scope(&scope))
        .await
        .expect("list");
    assert_eq!(all.len(), keys.len(), "{name}: one row per key");
    for size in [1, 2, 3, 7] {
        let mut seen = Vec::new();
        let mut filter = KeyFilter::default().with_scope(&scope).with_limit(size);
        for pages in 0.. {
            // A store that ignores the cursor would page forever.
            assert!(
                pages <= keys.len(),
                "{name}: more pages than rows (the cursor ignored?)"
            );
            let page = store.list(&filter).await.expect("list a page");
            assert!(page.len() <= size as usize, "{name}: at most the limit");
            let Some(last) = page.last() else { break };
            filter = filter.clone().with_after(KeyCursor::of(last));
            let short = page.len() < size as usize;
            seen.extend(page.into_iter().map(|record| record.key));
            if short {
                let rest = store.list(&filter).await.expect("list after the end");
                assert!(rest.is_empty(), "{name}: nothing after a short page");
                break;
            }
        }
        let expected: Vec<_> = all.iter().map(|record| record.key.clone()).collect();
        assert_eq!(
            seen, expected,
            "{name}: pages of {size} in the list's order"
        );
    }
}

/// A plain local key (not external, not a durable operation) records nothing: reserved,
/// completed and released without a single event, so its statements cost what they did.
pub async fn a_plain_local_key_records_nothing<S>(store: S, _profile: Profile)
where
    S: Maintenance,
    S::Database: BusinessTable,
{
    let name = store_name::<S>();
    let idem = crate::Idempotency::new(store.clone());
    let local = super::attempt("maintenance", &unique("local"), serde_json::json!({"n": 1}));
    let outcome = super::purchase(&idem, &local, &unique("local-trial"), 1).await;
    assert!(outcome.is_ok(), "{name}: {outcome:?}");
    assert_eq!(
        store.find(local.key()).await.unwrap().map(|r| r.state),
        Some(KeyState::Completed),
        "{name}"
    );
    let released = super::attempt("maintenance", &unique("local"), serde_json::json!({"n": 2}));
    let crate::protocol::Reservation::Acquired(lease) = idem.reserve(&released).await.unwrap()
    else {
        panic!("{name}: a fresh key")
    };
    assert!(lease.release().await.unwrap(), "{name}");
    for key in [local.key(), released.key()] {
        let history = store.history(key, 100).await.expect("history");
        assert!(
            history.is_empty(),
            "{name}: a local key recorded {history:?}"
        );
    }
}
