-- The shop's own tables (SQLite; times are milliseconds by SQLite's clock). Applied in one BEGIN IMMEDIATE transaction, so several `shop`
-- processes may start at once against one database.
CREATE TABLE IF NOT EXISTS shop_users (
    id            TEXT        PRIMARY KEY,
    balance_cents INTEGER     NOT NULL CHECK (balance_cents >= 0),
    created_at    INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

-- State transition defence: status only moves by conditional UPDATEs: unpaid -> paid (pay),
-- pending_payment -> paid | cancelled (a purchase's payment step settles it).
CREATE TABLE IF NOT EXISTS shop_orders (
    id           INTEGER     PRIMARY KEY,
    user_id      TEXT        NOT NULL REFERENCES shop_users (id),
    sku          TEXT        NOT NULL,
    quantity     INTEGER     NOT NULL CHECK (quantity > 0),
    amount_cents INTEGER     NOT NULL CHECK (amount_cents > 0),
    status       TEXT        NOT NULL CHECK (status IN ('unpaid', 'pending_payment', 'paid', 'cancelled')),
    charge_id    TEXT        UNIQUE,
    created_at   INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
CREATE INDEX IF NOT EXISTS shop_orders_user ON shop_orders (user_id);

CREATE TABLE IF NOT EXISTS shop_purchases (
    id         INTEGER     PRIMARY KEY,
    user_id    TEXT        NOT NULL REFERENCES shop_users (id),
    order_id   INTEGER     NOT NULL UNIQUE REFERENCES shop_orders (id),
    created_at INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

-- Business unique constraint defence: one grant per order, whatever the application checked.
CREATE TABLE IF NOT EXISTS shop_point_grants (
    id         INTEGER     PRIMARY KEY,
    order_id   INTEGER     NOT NULL UNIQUE REFERENCES shop_orders (id),
    user_id    TEXT        NOT NULL REFERENCES shop_users (id),
    points     INTEGER     NOT NULL CHECK (points > 0),
    created_at INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
CREATE INDEX IF NOT EXISTS shop_point_grants_user ON shop_point_grants (user_id);

CREATE TABLE IF NOT EXISTS shop_emails (
    id         INTEGER     PRIMARY KEY,
    user_id    TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    subject    TEXT        NOT NULL,
    message_id TEXT        NOT NULL,
    created_at INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

-- The ledger counts a user's e-mails: without it, a scan of the whole table on every read.
CREATE INDEX IF NOT EXISTS shop_emails_user ON shop_emails (user_id);

-- The transactional outbox: a paid purchase's event, written in the purchase's transaction,
-- deleted by the relay once the broker confirmed it.
CREATE TABLE IF NOT EXISTS shop_outbox (
    id           INTEGER     PRIMARY KEY,
    message_id   TEXT        NOT NULL,
    message_type TEXT        NOT NULL,
    payload      TEXT        NOT NULL,
    created_at   INTEGER     NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
