//! The operator's statements on a [`Maintenance`] store: listings paged by a keyset cursor.

use super::{store_name, unique, Profile};
use crate::{
    maintenance::{KeyCursor, KeyFilter},
    store::{Insertion, Maintenance, PendingRow},
    Effects, Fingerprint, IdempotencyKey,
};
use std::time::Duration;

/// Reserves `key` (local work, a long lease).
async fn reserve<S: Maintenance>(store: &S, key: &IdempotencyKey) {
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
            reserve(&store, &key).await;
            keys.push(key);
        }
    }
    // Another scope's row is not listed.
    reserve(
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
        loop {
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
