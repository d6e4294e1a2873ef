-- The key table of the idempotency crate (PostgreSQL).
-- One row per (scope, operation, idem_key); the primary key is the unique constraint that lets
-- exactly one concurrent request reserve a key.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope             TEXT        NOT NULL,
    operation         TEXT        NOT NULL,
    idem_key          TEXT        NOT NULL,
    state             TEXT        NOT NULL CHECK (state IN ('pending', 'completed', 'needs_review', 'failed')),
    effects           TEXT        NOT NULL CHECK (effects IN ('local', 'external')),
    fingerprint       BYTEA       NOT NULL,
    lease_token       UUID        NOT NULL,
    lease_until       TIMESTAMPTZ NOT NULL,
    result            BYTEA,
    reason            TEXT,
    recovery_attempts INTEGER     NOT NULL DEFAULT 0,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at        TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (scope, operation, idem_key)
);

-- Retention purge walks this index in bounded batches.
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- Recovery looks for pending rows whose lease ended.
CREATE INDEX IF NOT EXISTS idempotency_keys_pending_lease ON idempotency_keys (lease_until)
    WHERE state = 'pending';
