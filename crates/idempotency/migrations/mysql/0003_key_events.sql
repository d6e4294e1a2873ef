-- The history of each key: an append-only list of what happened to it, written in the same
-- transaction as the change it records. No foreign key: a released key keeps its history, and a
-- later reservation of the same key continues it. The purge deletes a key's events with the key.
-- One idempotent statement (DDL is not transactional in MySQL), the index declared inline.
CREATE TABLE IF NOT EXISTS idempotency_key_events (
    id        BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    scope     VARBINARY(255)  NOT NULL,
    operation VARBINARY(255)  NOT NULL,
    idem_key  VARBINARY(255)  NOT NULL,
    at        DATETIME(3)     NOT NULL,
    kind      VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    detail    TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    actor     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    PRIMARY KEY (id),
    KEY idempotency_key_events_key (scope, operation, idem_key, id),
    -- The purge looks for orphaned histories among the old events only.
    KEY idempotency_key_events_at (at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin ROW_FORMAT = DYNAMIC;
