-- The purge looks for settled keys ('completed', 'failed') whose retention ended: index only
-- those. A reservation (a pending row) then writes two index entries instead of three, and a
-- key reserved and completed inside one transaction (the single-transaction mode) never enters
-- the pending index, so its completion can be a HOT update (no index entry written).
-- On a large table the CREATE INDEX blocks writes while it runs: run `idem migrate` in a quiet
-- moment.
CREATE INDEX IF NOT EXISTS idempotency_keys_settled_expiry ON idempotency_keys (expires_at)
    WHERE state IN ('completed', 'failed');
DROP INDEX IF EXISTS idempotency_keys_expires_at;
