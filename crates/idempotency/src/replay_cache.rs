//! [`ReplayCache`]: an opt-in, bounded, in-process copy of the results this process completed, so
//! that a replay is answered without a database round trip
//! ([`Idempotency::with_replay_cache`](crate::Idempotency::with_replay_cache)).
//!
//! It is safe because a completed result never changes until its key expires: an entry holds
//! the key (scope, operation and client key), the fingerprint of the request that completed
//! it, the stored bytes, and a deadline no later than the row's `expires_at`. A lookup answers
//! only for the same key **and** the same fingerprint before the deadline; anything else (a
//! miss, another fingerprint, an expired entry) falls through to the database, which decides
//! as without the cache.

use crate::{Fingerprint, IdempotencyKey};
use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Instant,
};

/// One cached result.
#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    result: Arc<[u8]>,
    /// Never later than the row's `expires_at`.
    deadline: Instant,
    /// Matches the entry's place in the eviction queue.
    generation: u64,
}

#[derive(Debug, Default)]
struct Entries {
    by_key: HashMap<IdempotencyKey, Entry>,
    /// Insertion order, oldest first: `(key, generation)`; a pair whose generation no longer
    /// matches its entry is a leftover of a replaced or expired entry.
    order: VecDeque<(IdempotencyKey, u64)>,
    next_generation: u64,
}

/// A bounded map from a completed key to its result, evicting the oldest insertion first.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity: usize,
    entries: Mutex<Entries>,
}

impl ReplayCache {
    /// A cache of at most `capacity` results (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The result completed for `key` by a request with `fingerprint`, if cached and not
    /// expired. An expired entry is dropped.
    pub(crate) fn get(&self, key: &IdempotencyKey, fingerprint: &Fingerprint) -> Option<Vec<u8>> {
        let mut entries = self.lock();
        let entry = entries.by_key.get(key)?;
        if entry.deadline <= Instant::now() {
            entries.by_key.remove(key);
            return None;
        }
        (entry.fingerprint == *fingerprint).then(|| entry.result.to_vec())
    }

    /// Remembers that `key` completed with `result` for a request with `fingerprint`, until
    /// `deadline`. Call it only after the completion committed, with a deadline taken before
    /// the completing statement ran plus the retention, so it is never later than the row's
    /// `expires_at` (which the database sets from its own clock at completion).
    pub(crate) fn insert(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        result: &[u8],
        deadline: Instant,
    ) {
        let mut entries = self.lock();
        let generation = entries.next_generation;
        entries.next_generation += 1;
        entries.by_key.insert(
            key.clone(),
            Entry {
                fingerprint,
                result: Arc::from(result),
                deadline,
                generation,
            },
        );
        entries.order.push_back((key.clone(), generation));
        while entries.order.len() > self.capacity {
            let Some((oldest, generation)) = entries.order.pop_front() else {
                break;
            };
            if entries
                .by_key
                .get(&oldest)
                .is_some_and(|entry| entry.generation == generation)
            {
                entries.by_key.remove(&oldest);
            }
        }
    }

    /// How many results are cached (some may have expired).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new("alice", "purchase", k).unwrap()
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn answers_only_the_same_key_and_fingerprint() {
        let cache = ReplayCache::new(8);
        let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
        cache.insert(&key("k1"), a, b"result", later());
        assert_eq!(cache.get(&key("k1"), &a).as_deref(), Some(&b"result"[..]));
        assert_eq!(
            cache.get(&key("k1"), &b),
            None,
            "another request: the database decides"
        );
        assert_eq!(cache.get(&key("k2"), &a), None);
        let bob = IdempotencyKey::new("bob", "purchase", "k1").unwrap();
        assert_eq!(cache.get(&bob, &a), None, "another scope");
    }

    #[test]
    fn an_expired_entry_is_never_answered() {
        let cache = ReplayCache::new(8);
        let a = Fingerprint::of_bytes(b"a");
        cache.insert(&key("k1"), a, b"result", Instant::now());
        assert_eq!(cache.get(&key("k1"), &a), None);
        assert_eq!(cache.len(), 0, "dropped on lookup");
    }

    #[test]
    fn holds_at_most_its_capacity_evicting_the_oldest() {
        let cache = ReplayCache::new(3);
        let a = Fingerprint::of_bytes(b"a");
        for i in 0..10 {
            cache.insert(&key(&format!("k{i}")), a, b"r", later());
            assert!(cache.len() <= 3);
        }
        assert_eq!(cache.get(&key("k6"), &a), None);
        assert!(cache.get(&key("k7"), &a).is_some());
        assert!(cache.get(&key("k9"), &a).is_some());
        // Replacing an entry does not let a stale queue place evict the new one.
        cache.insert(&key("k7"), a, b"again", later());
        cache.insert(&key("k10"), a, b"r", later());
        assert_eq!(cache.get(&key("k7"), &a).as_deref(), Some(&b"again"[..]));
        assert!(cache.len() <= 3);
    }
}
