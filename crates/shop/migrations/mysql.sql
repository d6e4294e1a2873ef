-- The shop's own tables (MariaDB, InnoDB). Applied under a GET_LOCK, so several `shop`
-- processes may start at once against one database. The identifiers (user ids, SKUs, states,
-- charge and message ids, all ASCII without spaces) are case-sensitive, as on PostgreSQL and
-- SQLite ('Alice' and 'alice' are two users): latin1_general_cs, not a _bin collation, whose
-- columns sqlx reads as bytes, never as text. Free text (subjects, payloads) is utf8mb4.
CREATE TABLE IF NOT EXISTS shop_users (
    id            VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL PRIMARY KEY,
    balance_cents BIGINT       NOT NULL CHECK (balance_cents >= 0),
    created_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- State transition defence: status only moves by conditional UPDATEs: unpaid -> paid (pay),
-- pending_payment -> paid | cancelled (a purchase's payment step settles it).
CREATE TABLE IF NOT EXISTS shop_orders (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    user_id      VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    sku          VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    quantity     BIGINT       NOT NULL CHECK (quantity > 0),
    amount_cents BIGINT       NOT NULL CHECK (amount_cents > 0),
    status       VARCHAR(32) CHARACTER SET latin1 COLLATE latin1_general_cs  NOT NULL CHECK (status IN ('unpaid', 'pending_payment', 'paid', 'cancelled')),
    charge_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs UNIQUE,
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    FOREIGN KEY (user_id) REFERENCES shop_users (id),
    INDEX shop_orders_user (user_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS shop_purchases (
    id         BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    user_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    order_id   BIGINT       NOT NULL UNIQUE,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    FOREIGN KEY (user_id) REFERENCES shop_users (id),
    FOREIGN KEY (order_id) REFERENCES shop_orders (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Business unique constraint defence: one grant per order, whatever the application checked.
CREATE TABLE IF NOT EXISTS shop_point_grants (
    id         BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    order_id   BIGINT       NOT NULL UNIQUE,
    user_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    points     BIGINT       NOT NULL CHECK (points > 0),
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    FOREIGN KEY (order_id) REFERENCES shop_orders (id),
    FOREIGN KEY (user_id) REFERENCES shop_users (id),
    INDEX shop_point_grants_user (user_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS shop_emails (
    id         BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    user_id    VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    recipient  TEXT         NOT NULL,
    subject    TEXT         NOT NULL,
    message_id VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    INDEX shop_emails_user (user_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- The transactional outbox: a paid purchase's event, written in the purchase's transaction,
-- deleted by the relay once the broker confirmed it.
CREATE TABLE IF NOT EXISTS shop_outbox (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id   VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    message_type VARCHAR(191) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    payload      TEXT         NOT NULL,
    created_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
