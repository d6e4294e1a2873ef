-- The history of each key: an append-only list of what happened to it, written in the same
-- transaction as the change it records. No foreign key: a released key keeps its history, and a
-- later reservation of the same key continues it. The purge deletes a key's events with the key.
-- `at` is milliseconds since the Unix epoch by SQLite's clock, as in the key table.
CREATE TABLE IF NOT EXISTS idempotency_key_events (
    id        INTEGER PRIMARY KEY,
    scope     TEXT    NOT NULL,
    operation TEXT    NOT NULL,
    idem_key  TEXT    NOT NULL,
    at        INTEGER NOT NULL,
    kind      TEXT    NOT NULL,
    detail    TEXT,
    actor     TEXT
);

CREATE INDEX IF NOT EXISTS idempotency_key_events_key
    ON idempotency_key_events (scope, operation, idem_key, id);

-- The purge looks for orphaned histories among the old events only.
CREATE INDEX IF NOT EXISTS idempotency_key_events_at ON idempotency_key_events (at);
