//! The share of recent reservations that were replays: what decides whether
//! [`Idempotency::reserve`](crate::Idempotency::reserve) reads for a stored result before its
//! reserving INSERT.

use std::sync::atomic::{AtomicU32, Ordering};

/// Fixed-point one (the share 1.0).
const ONE: u32 = 1 << 16;
/// Weight of the newest observation: 1/16, so the share follows about the last 16 to 50
/// reservations.
const SHIFT: u32 = 4;

/// An exponentially weighted share of reservations answered with a stored result, shared by
/// the clones of one engine. Lock-free; observations that race may be lost, which only blurs a
/// heuristic: either path answers every request correctly.
#[derive(Debug, Default)]
pub(crate) struct RecentReplays(AtomicU32);

impl RecentReplays {
    /// Records one reservation's answer: `replayed` when it was a stored result.
    pub(crate) fn observe(&self, replayed: bool) {
        let old = self.0.load(Ordering::Relaxed);
        let new = old - (old >> SHIFT) + if replayed { ONE >> SHIFT } else { 0 };
        self.0.store(new, Ordering::Relaxed);
    }

    /// Whether most recent reservations were replays: then a plain read answers most requests
    /// in one cheap statement, and the INSERT is the exception.
    pub(crate) fn mostly_replays(&self) -> bool {
        self.0.load(Ordering::Relaxed) > ONE / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_recent_share_of_replays() {
        let recent = RecentReplays::default();
        assert!(!recent.mostly_replays(), "starts with first requests");
        for _ in 0..20 {
            recent.observe(true);
        }
        assert!(recent.mostly_replays());
        for _ in 0..20 {
            recent.observe(false);
        }
        assert!(!recent.mostly_replays());
        // Alternating replays and first requests hover around one half, never above one.
        for i in 0..1000 {
            recent.observe(i % 2 == 0);
            assert!(recent.0.load(Ordering::Relaxed) <= ONE);
        }
    }
}
