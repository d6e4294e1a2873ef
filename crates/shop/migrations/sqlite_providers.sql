-- The simulated providers (SQLite, in a file of their own next to the shop's). They stand for outside services: they are written
-- through their own connection pool, never inside the shop's transaction.

-- A payment provider that honours idempotency keys: one charge per provider_key.
CREATE TABLE IF NOT EXISTS payment_provider_charges (
    provider_key TEXT        PRIMARY KEY,
    charge_id    TEXT        NOT NULL UNIQUE,
    account      TEXT        NOT NULL,
    amount_cents INTEGER     NOT NULL,
    created_at   INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
CREATE INDEX IF NOT EXISTS payment_provider_charges_account ON payment_provider_charges (account);

-- Refunds of charges, one per refund key (and at most one per charge).
CREATE TABLE IF NOT EXISTS payment_provider_refunds (
    refund_key   TEXT        PRIMARY KEY,
    charge_id    TEXT        NOT NULL UNIQUE REFERENCES payment_provider_charges (charge_id),
    amount_cents INTEGER      NOT NULL,
    created_at   INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

-- A mail provider without idempotency support: every call is a new message.
CREATE TABLE IF NOT EXISTS mail_provider_messages (
    message_id TEXT        PRIMARY KEY,
    account    TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    subject    TEXT        NOT NULL,
    client_ref TEXT        NOT NULL,
    created_at INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
CREATE INDEX IF NOT EXISTS mail_provider_messages_account ON mail_provider_messages (account);
