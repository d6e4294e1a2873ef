-- The purge looks for settled keys ('completed', 'failed') whose retention ended: index only
-- those. A reservation (a pending row) then writes one index entry less, and its completion
-- enters this index once. The purge's and the count's condition is this index's predicate
-- exactly (`state IN ('completed', 'failed') AND expires_at <= …`), so SQLite's planner uses it.
CREATE INDEX IF NOT EXISTS idempotency_keys_settled_expiry ON idempotency_keys (expires_at)
    WHERE state IN ('completed', 'failed');
DROP INDEX IF EXISTS idempotency_keys_expires_at;
