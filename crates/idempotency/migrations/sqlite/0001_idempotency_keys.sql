-- The key table of the idempotency crate (SQLite). Times are milliseconds since the Unix epoch,
-- taken from SQLite's own clock (unixepoch('subsec')).
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope             TEXT    NOT NULL,
    operation         TEXT    NOT NULL,
    idem_key          TEXT    NOT NULL,
    state             TEXT    NOT NULL CHECK (state IN ('pending', 'completed', 'needs_review', 'failed')),
    effects           TEXT    NOT NULL CHECK (effects IN ('local', 'external')),
    fingerprint       BLOB    NOT NULL,
    lease_token       BLOB    NOT NULL,
    lease_until       INTEGER NOT NULL,
    result            BLOB,
    reason            TEXT,
    recovery_attempts INTEGER NOT NULL DEFAULT 0,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (scope, operation, idem_key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
CREATE INDEX IF NOT EXISTS idempotency_keys_pending_lease ON idempotency_keys (lease_until)
    WHERE state = 'pending';
