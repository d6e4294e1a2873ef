//! The run's tables, read straight from the databases: PostgreSQL or MariaDB (the shop's and
//! the providers' tables in one database, or, on PostgreSQL, the providers' in a database of
//! their own: [`Db::connect_split`]) or SQLite (the shop's file `FILE` and the providers' file
//! `FILE.providers`).

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
    MySqlPool, PgPool, SqlitePool,
};
use std::{str::FromStr, time::Duration};

/// Connections to a run's databases.
#[derive(Debug, Clone)]
pub enum Db {
    /// PostgreSQL: the shop's tables, and the providers' (the same pool when they share the
    /// database).
    Pg {
        /// `idempotency_keys` and the `shop_*` tables.
        shop: PgPool,
        /// `payment_provider_*`.
        providers: PgPool,
    },
    /// SQLite: the shop's file and the providers' file.
    Sqlite {
        /// `FILE`: `idempotency_keys` and the `shop_*` tables.
        shop: SqlitePool,
        /// `FILE.providers`: `payment_provider_*`.
        providers: SqlitePool,
    },
    /// MariaDB: every table in one database.
    My(MySqlPool),
}

/// What step 1 of a purchase recorded in the key's journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The order it placed (debited, `pending_payment`).
    Order(i64),
    /// The balance did not cover it: nothing was written.
    Refused,
}

/// One `idempotency_keys` row.
#[derive(Debug, Clone)]
pub struct KeyRow {
    /// `scope` (the user).
    pub scope: String,
    /// `operation`.
    pub operation: String,
    /// `idem_key`.
    pub key: String,
    /// `pending`, `completed`, `needs_review` or `failed`.
    pub state: String,
    /// The status of the stored response, if any.
    pub status: Option<u16>,
    /// What step 1 recorded (`progress` journal), if it ran.
    pub placed: Option<Placed>,
    /// `recovery_point`.
    pub recovery_point: Option<String>,
    /// `reason` (why it was parked).
    pub reason: Option<String>,
}

/// One `shop_orders` row.
#[derive(Debug, Clone)]
pub struct OrderRow {
    /// `id`.
    pub id: i64,
    /// `user_id`.
    pub user: String,
    /// `amount_cents`.
    pub amount: i64,
    /// `unpaid`, `pending_payment`, `paid` or `cancelled`.
    pub status: String,
    /// `charge_id` (set when paid).
    pub charge_id: Option<String>,
}

/// One `payment_provider_charges` row.
#[derive(Debug, Clone)]
pub struct ChargeRow {
    /// `provider_key`.
    pub provider_key: String,
    /// `charge_id`.
    pub charge_id: String,
    /// `account` (the user).
    pub account: String,
    /// `amount_cents`.
    pub amount: i64,
}

/// Every row the checks look at, read keys first (so that "no key pending" read first means
/// nothing else was still moving when the rest was read, once the traffic has stopped).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// `idempotency_keys`.
    pub keys: Vec<KeyRow>,
    /// `shop_users`: `(id, balance_cents)`.
    pub users: Vec<(String, i64)>,
    /// `shop_orders`.
    pub orders: Vec<OrderRow>,
    /// `shop_purchases`: `(id, user_id, order_id)`.
    pub purchases: Vec<(i64, String, i64)>,
    /// `payment_provider_charges`.
    pub charges: Vec<ChargeRow>,
    /// `payment_provider_refunds`: `(refund_key, charge_id, amount_cents)`.
    pub refunds: Vec<(String, String, i64)>,
}

type RawKey = (
    String,
    String,
    String,
    String,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<String>,
    Option<String>,
);

const KEYS: &str =
    "SELECT scope, operation, idem_key, state, result, progress, recovery_point, reason
                    FROM idempotency_keys";
/// MariaDB keeps the key columns as `VARBINARY` and the others in binary collations, which
/// sqlx reads as bytes: convert them to text.
const MYSQL_KEYS: &str = "SELECT CONVERT(scope USING utf8mb4), CONVERT(operation USING utf8mb4),
                    CONVERT(idem_key USING utf8mb4), CONVERT(state USING utf8mb4), result,
                    progress, CONVERT(recovery_point USING utf8mb4), CONVERT(reason USING utf8mb4)
                    FROM idempotency_keys";
const USERS: &str = "SELECT id, balance_cents FROM shop_users";
const ORDERS: &str = "SELECT id, user_id, amount_cents, status, charge_id FROM shop_orders";
const PURCHASES: &str = "SELECT id, user_id, order_id FROM shop_purchases";
const CHARGES: &str =
    "SELECT provider_key, charge_id, account, amount_cents FROM payment_provider_charges";
const REFUNDS: &str = "SELECT refund_key, charge_id, amount_cents FROM payment_provider_refunds";

/// Runs one `query_as` on whichever pool (the statement is the same text on both backends).
macro_rules! rows {
    ($pool:expr, $ty:ty, $sql:expr) => {
        sqlx::query_as::<_, $ty>($sql)
            .fetch_all($pool)
            .await
            .with_context(|| format!("reading: {}", $sql))?
    };
}

fn sqlite_path(url: &str) -> Result<&str> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .context("not a sqlite: URL")?;
    Ok(rest.split('?').next().unwrap_or(rest))
}

async fn pg_pool(url: &str) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))
}

async fn sqlite_pool(path: &str) -> Result<SqlitePool> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))?
        .create_if_missing(false)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .with_context(|| format!("opening {path}"))
}

impl Db {
    /// Connects to the databases of the shop URL `url` (`postgres://…`, `mysql://…` or
    /// `sqlite://FILE`; the shop must have created them).
    pub async fn connect(url: &str) -> Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = pg_pool(url).await?;
            Ok(Db::Pg {
                shop: pool.clone(),
                providers: pool,
            })
        } else if url.starts_with("mysql://") {
            let pool = MySqlPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .with_context(|| format!("connecting to {url}"))?;
            Ok(Db::My(pool))
        } else if url.starts_with("sqlite:") {
            let path = sqlite_path(url)?;
            Ok(Db::Sqlite {
                shop: sqlite_pool(path).await?,
                providers: sqlite_pool(&format!("{path}.providers")).await?,
            })
        } else {
            bail!("unsupported database URL {url}")
        }
    }

    /// Connects to a PostgreSQL shop whose providers keep their state in a database of their
    /// own (`shop --provider-database-url`).
    pub async fn connect_split(shop_url: &str, providers_url: &str) -> Result<Self> {
        Ok(Db::Pg {
            shop: pg_pool(shop_url).await?,
            providers: pg_pool(providers_url).await?,
        })
    }

    /// Reads every table the checks need.
    pub async fn snapshot(&self) -> Result<Snapshot> {
        let (keys, users, orders, purchases, charges, refunds) = match self {
            Db::Pg { shop, providers } => (
                rows!(shop, RawKey, KEYS),
                rows!(shop, (String, i64), USERS),
                rows!(shop, (i64, String, i64, String, Option<String>), ORDERS),
                rows!(shop, (i64, String, i64), PURCHASES),
                rows!(providers, (String, String, String, i64), CHARGES),
                rows!(providers, (String, String, i64), REFUNDS),
            ),
            Db::Sqlite { shop, providers } => (
                rows!(shop, RawKey, KEYS),
                rows!(shop, (String, i64), USERS),
                rows!(shop, (i64, String, i64, String, Option<String>), ORDERS),
                rows!(shop, (i64, String, i64), PURCHASES),
                rows!(providers, (String, String, String, i64), CHARGES),
                rows!(providers, (String, String, i64), REFUNDS),
            ),
            Db::My(pool) => (
                rows!(pool, RawKey, MYSQL_KEYS),
                rows!(pool, (String, i64), USERS),
                rows!(pool, (i64, String, i64, String, Option<String>), ORDERS),
                rows!(pool, (i64, String, i64), PURCHASES),
                rows!(pool, (String, String, String, i64), CHARGES),
                rows!(pool, (String, String, i64), REFUNDS),
            ),
        };
        Ok(Snapshot {
            keys: keys.into_iter().map(key_row).collect(),
            users,
            orders: orders
                .into_iter()
                .map(|(id, user, amount, status, charge_id)| OrderRow {
                    id,
                    user,
                    amount,
                    status,
                    charge_id,
                })
                .collect(),
            purchases,
            charges: charges
                .into_iter()
                .map(|(provider_key, charge_id, account, amount)| ChargeRow {
                    provider_key,
                    charge_id,
                    account,
                    amount,
                })
                .collect(),
            refunds,
        })
    }

    /// Counts rows of `idempotency_keys` and `shop_orders` (nothing may be stored by a refused
    /// request).
    pub async fn stored(&self) -> Result<(i64, i64)> {
        let keys = "SELECT count(*) FROM idempotency_keys";
        let orders = "SELECT count(*) FROM shop_orders";
        Ok(match self {
            Db::Pg { shop, .. } => (
                sqlx::query_scalar(keys).fetch_one(shop).await?,
                sqlx::query_scalar(orders).fetch_one(shop).await?,
            ),
            Db::Sqlite { shop, .. } => (
                sqlx::query_scalar(keys).fetch_one(shop).await?,
                sqlx::query_scalar(orders).fetch_one(shop).await?,
            ),
            Db::My(pool) => (
                sqlx::query_scalar(keys).fetch_one(pool).await?,
                sqlx::query_scalar(orders).fetch_one(pool).await?,
            ),
        })
    }

    /// SQLite: `PRAGMA integrity_check` of the shop's file and the providers' file must answer
    /// `ok` (nothing committed was lost or corrupted, e.g. by a SIGKILL amid writes, which WAL
    /// recovery must repair on the next open). PostgreSQL, MariaDB: nothing to check here. Says
    /// whether it checked.
    pub async fn integrity_check(&self) -> Result<bool> {
        let Db::Sqlite { shop, providers } = self else {
            return Ok(false);
        };
        for (name, pool) in [("shop", shop), ("providers", providers)] {
            let answers: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
                .fetch_all(pool)
                .await
                .with_context(|| format!("PRAGMA integrity_check of the {name} file"))?;
            ensure!(
                answers == ["ok"],
                "PRAGMA integrity_check of the {name} file: {}",
                answers.join("; ")
            );
        }
        Ok(true)
    }

    /// Closes the pools.
    pub async fn close(&self) {
        match self {
            Db::Pg { shop, providers } => {
                shop.close().await;
                providers.close().await;
            }
            Db::My(pool) => pool.close().await,
            Db::Sqlite { shop, providers } => {
                shop.close().await;
                providers.close().await;
            }
        }
    }
}

fn key_row(raw: RawKey) -> KeyRow {
    let (scope, operation, key, state, result, progress, recovery_point, reason) = raw;
    // The stored response is a JSON `StoredResponse` ({"status": 201, "headers": …, "body": …}).
    let status = result
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|v| v["status"].as_u64())
        .and_then(|s| u16::try_from(s).ok());
    // The journal: {"done": {"order": {"Order": 7} | {"Refused": {…}}, "charge": {…}}, …}.
    let placed = progress
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|journal| {
            let order = &journal["done"]["order"];
            if let Some(id) = order["Order"].as_i64() {
                Some(Placed::Order(id))
            } else if order.get("Refused").is_some() {
                Some(Placed::Refused)
            } else {
                None
            }
        });
    KeyRow {
        scope,
        operation,
        key,
        state,
        status,
        placed,
        recovery_point,
        reason,
    }
}
