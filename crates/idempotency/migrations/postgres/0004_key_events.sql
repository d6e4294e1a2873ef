-- The history of each key: an append-only list of what happened to it, written in the same
-- statement or transaction as the change it records. No foreign key: a released key keeps its
-- history, and a later reservation of the same key continues it. The purge deletes a key's
-- events with the key.
CREATE TABLE IF NOT EXISTS idempotency_key_events (
    id        BIGSERIAL   PRIMARY KEY,
    scope     TEXT COLLATE "C" NOT NULL,
    operation TEXT COLLATE "C" NOT NULL,
    idem_key  TEXT COLLATE "C" NOT NULL,
    at        TIMESTAMPTZ(3) NOT NULL DEFAULT now(),
    kind      TEXT        NOT NULL,
    detail    TEXT,
    actor     TEXT
);

CREATE INDEX IF NOT EXISTS idempotency_key_events_key
    ON idempotency_key_events (scope, operation, idem_key, id);

-- The purge looks for orphaned histories among the old events only.
CREATE INDEX IF NOT EXISTS idempotency_key_events_at ON idempotency_key_events (at);
