-- The simulated providers (MariaDB). They stand for outside services: they are written
-- through their own connection pool, never inside the shop's transaction.

-- A payment provider that honours idempotency keys: one charge per provider_key.
CREATE TABLE IF NOT EXISTS payment_provider_charges (
    provider_key VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL PRIMARY KEY,
    charge_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL UNIQUE,
    account      VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    amount_cents BIGINT       NOT NULL,
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    INDEX payment_provider_charges_account (account)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Refunds of charges, one per refund key (and at most one per charge).
CREATE TABLE IF NOT EXISTS payment_provider_refunds (
    refund_key   VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL PRIMARY KEY,
    charge_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL UNIQUE,
    amount_cents BIGINT       NOT NULL,
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    FOREIGN KEY (charge_id) REFERENCES payment_provider_charges (charge_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- A mail provider without idempotency support: every call is a new message.
CREATE TABLE IF NOT EXISTS mail_provider_messages (
    message_id VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL PRIMARY KEY,
    account    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    recipient  TEXT         NOT NULL,
    subject    TEXT         NOT NULL,
    client_ref TEXT         NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    INDEX mail_provider_messages_account (account)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
