-- The key table of the idempotency crate (MariaDB 10.5+ / MySQL 8, InnoDB).
--
-- * One row per (scope, operation, idem_key); the primary key is the unique constraint that lets
--   exactly one concurrent request reserve a key.
-- * The three key columns are VARBINARY: compared byte for byte, so case-sensitive and exact.
--   (The `_bin` collations are PAD SPACE on MariaDB and on MySQL's utf8mb4_bin, so 'k' and 'k '
--   would collide; VARBINARY never pads.) 3 x 255 bytes keeps the key far below InnoDB's
--   3072-byte limit.
-- * Times are DATETIME(6) in UTC, always written from the server's UTC_TIMESTAMP(6), so neither
--   the session time zone nor the application's clock matters.
-- * DDL is not transactional in MySQL: the migration is one idempotent statement, with the
--   indexes declared inline (MySQL 8 has no CREATE INDEX IF NOT EXISTS).
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope             VARBINARY(255) NOT NULL,
    operation         VARBINARY(255) NOT NULL,
    idem_key          VARBINARY(255) NOT NULL,
    state             VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    effects           VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    fingerprint       BINARY(32)     NOT NULL,
    lease_token       BINARY(16)     NOT NULL,
    lease_until       DATETIME(6)    NOT NULL,
    result            LONGBLOB,
    reason            TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    recovery_attempts INT            NOT NULL DEFAULT 0,
    created_at        DATETIME(6)    NOT NULL,
    updated_at        DATETIME(6)    NOT NULL,
    expires_at        DATETIME(6)    NOT NULL,
    PRIMARY KEY (scope, operation, idem_key),
    -- Retention purge walks this index in bounded batches.
    KEY idempotency_keys_expires_at (expires_at),
    -- Recovery looks for pending rows whose lease ended (no partial indexes in MySQL).
    KEY idempotency_keys_pending_lease (state, lease_until),
    CONSTRAINT idempotency_keys_state_check
        CHECK (state IN ('pending', 'completed', 'needs_review', 'failed')),
    CONSTRAINT idempotency_keys_effects_check
        CHECK (effects IN ('local', 'external'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin ROW_FORMAT = DYNAMIC;
