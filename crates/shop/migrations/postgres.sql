-- The shop's own tables (PostgreSQL). Applied under an advisory lock, so several `shop`
-- processes may start at once against one database.
CREATE TABLE IF NOT EXISTS shop_users (
    id            TEXT        PRIMARY KEY,
    balance_cents BIGINT      NOT NULL CHECK (balance_cents >= 0),
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- State transition defence: status only moves by conditional UPDATEs: unpaid -> paid (pay),
-- pending_payment -> paid | cancelled (a purchase's payment step settles it).
CREATE TABLE IF NOT EXISTS shop_orders (
    id           BIGSERIAL   PRIMARY KEY,
    user_id      TEXT        NOT NULL REFERENCES shop_users (id),
    sku          TEXT        NOT NULL,
    quantity     BIGINT      NOT NULL CHECK (quantity > 0),
    amount_cents BIGINT      NOT NULL CHECK (amount_cents > 0),
    status       TEXT        NOT NULL CHECK (status IN ('unpaid', 'pending_payment', 'paid', 'cancelled')),
    charge_id    TEXT        UNIQUE,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS shop_orders_user ON shop_orders (user_id);
-- Databases made before purchases had a payment step know only unpaid/paid.
ALTER TABLE shop_orders DROP CONSTRAINT IF EXISTS shop_orders_status_check;
ALTER TABLE shop_orders ADD CONSTRAINT shop_orders_status_check
    CHECK (status IN ('unpaid', 'pending_payment', 'paid', 'cancelled'));

CREATE TABLE IF NOT EXISTS shop_purchases (
    id         BIGSERIAL   PRIMARY KEY,
    user_id    TEXT        NOT NULL REFERENCES shop_users (id),
    order_id   BIGINT      NOT NULL UNIQUE REFERENCES shop_orders (id),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Business unique constraint defence: one grant per order, whatever the application checked.
CREATE TABLE IF NOT EXISTS shop_point_grants (
    id         BIGSERIAL   PRIMARY KEY,
    order_id   BIGINT      NOT NULL UNIQUE REFERENCES shop_orders (id),
    user_id    TEXT        NOT NULL REFERENCES shop_users (id),
    points     BIGINT      NOT NULL CHECK (points > 0),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS shop_point_grants_user ON shop_point_grants (user_id);

CREATE TABLE IF NOT EXISTS shop_emails (
    id         BIGSERIAL   PRIMARY KEY,
    user_id    TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    subject    TEXT        NOT NULL,
    message_id TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The ledger counts a user's e-mails: without it, a scan of the whole table on every read.
CREATE INDEX IF NOT EXISTS shop_emails_user ON shop_emails (user_id);

-- The transactional outbox: a paid purchase's event, written in the purchase's transaction,
-- deleted by the relay once the broker confirmed it.
CREATE TABLE IF NOT EXISTS shop_outbox (
    id           BIGSERIAL   PRIMARY KEY,
    message_id   TEXT        NOT NULL,
    message_type TEXT        NOT NULL,
    payload      TEXT        NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
