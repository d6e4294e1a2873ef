//! The shop's databases: the idempotency store and the shop's tables on one pool, and the
//! simulated providers on a pool of their own (they stand for outside services).
//!
//! The same SQL text runs on PostgreSQL, SQLite and MariaDB: `$1` placeholders work on the first
//! two and become `?` on MariaDB, and the few statements MariaDB spells differently carry that
//! spelling too ([`Sql::on_mysql`]). Every statement goes through [`Conn`], the one place that
//! dispatches on the backend.

use anyhow::{bail, Context};
use idempotency::{
    store::{CompletionSignal, Journal},
    MySqlStore, PgStore, SqliteStore, Store,
};
use sqlx::{
    mysql::{MySqlPoolOptions, MySqlRow},
    postgres::PgPoolOptions,
    postgres::PgRow,
    sqlite::SqliteRow,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous},
    Arguments, Database, Encode, FromRow, MySql, MySqlConnection, MySqlPool, PgConnection, PgPool,
    Postgres, Sqlite, SqliteConnection, SqlitePool, Transaction, Type,
};
use std::{
    str::FromStr,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

/// Whether the shop's PostgreSQL is reached through a transaction pooler (PgBouncer's
/// `pool_mode = transaction`; [`PgStore::behind_transaction_pooler`]), set once when the shop
/// connects. Its PostgreSQL statements are then unnamed (`persistent(false)`), and one run
/// outside a transaction runs inside one of its own, as the store's do: a prepared statement
/// may not outlive its transaction there.
static PG_BEHIND_POOLER: AtomicBool = AtomicBool::new(false);

/// Runs a PostgreSQL statement for [`Conn`] (see [`PG_BEHIND_POOLER`]); returns its rows and
/// the number of rows it affected.
async fn pg_run(c: &mut PgConnection, sql: &Sql<'_>) -> Result<(Vec<PgRow>, u64), sqlx::Error> {
    use futures_util::TryStreamExt;
    use sqlx::{Connection, Either, Executor};
    let pooled = PG_BEHIND_POOLER.load(Ordering::Relaxed);
    let query = sqlx::query_with(sql.text, sql.arguments::<Postgres>()?).persistent(!pooled);
    let collect = |results: Vec<Either<sqlx::postgres::PgQueryResult, PgRow>>| {
        let mut rows = Vec::new();
        let mut affected = 0;
        for result in results {
            match result {
                Either::Left(done) => affected += done.rows_affected(),
                Either::Right(row) => rows.push(row),
            }
        }
        (rows, affected)
    };
    if !pooled || c.is_in_transaction() {
        return Ok(collect((&mut *c).fetch_many(query).try_collect().await?));
    }
    let mut tx = c.begin().await?;
    let results = (&mut *tx).fetch_many(query).try_collect().await?;
    tx.commit().await?;
    Ok(collect(results))
}

/// Lock id for `pg_advisory_xact_lock` while the shop migrates ("shop" in ASCII).
const SHOP_MIGRATION_LOCK: i64 = 0x7368_6f70;

/// MariaDB: the `GET_LOCK` name serialising the shop's migrations of one database (lock names
/// are server-wide), and how long a process waits for another's, in seconds.
const MYSQL_MIGRATION_LOCK: &str = "CONCAT('shop_migrate_', MD5(COALESCE(DATABASE(), '')))";
const MYSQL_MIGRATION_LOCK_SECS: i64 = 60;

/// A borrowed connection of any backend (a pool connection or a transaction): the one way the
/// shop runs a statement. Write the SQL once ([`sql`]; `$1` placeholders, turned into `?` on
/// MariaDB) and run it with [`execute`](Self::execute), [`fetch_one`](Self::fetch_one),
/// [`fetch_optional`](Self::fetch_optional), [`fetch_all`](Self::fetch_all) or
/// [`scalar`](Self::scalar); each matches on the backend once.
#[derive(Debug)]
pub enum Conn<'a> {
    /// PostgreSQL.
    Pg(&'a mut PgConnection),
    /// SQLite.
    Sqlite(&'a mut SqliteConnection),
    /// MariaDB (or MySQL).
    My(&'a mut MySqlConnection),
}

/// A row type every backend decodes (`#[derive(sqlx::FromRow)]` structs and tuples).
pub trait Row:
    for<'r> FromRow<'r, PgRow>
    + for<'r> FromRow<'r, SqliteRow>
    + for<'r> FromRow<'r, MySqlRow>
    + Send
    + Unpin
{
}

impl<T> Row for T where
    T: for<'r> FromRow<'r, PgRow>
        + for<'r> FromRow<'r, SqliteRow>
        + for<'r> FromRow<'r, MySqlRow>
        + Send
        + Unpin
{
}

/// One argument of a [`Sql`] statement (made by `From` from integers and strings).
#[derive(Debug, Clone)]
pub enum Arg {
    /// An integer (`BIGINT` / `INTEGER`).
    Int(i64),
    /// Text.
    Text(String),
}

impl From<i64> for Arg {
    fn from(value: i64) -> Self {
        Arg::Int(value)
    }
}

impl From<u64> for Arg {
    fn from(value: u64) -> Self {
        Arg::Int(i64::try_from(value).unwrap_or(i64::MAX))
    }
}

impl From<&str> for Arg {
    fn from(value: &str) -> Self {
        Arg::Text(value.to_owned())
    }
}

impl From<&String> for Arg {
    fn from(value: &String) -> Self {
        Arg::Text(value.clone())
    }
}

impl From<String> for Arg {
    fn from(value: String) -> Self {
        Arg::Text(value)
    }
}

/// A statement and its arguments, for [`Conn`]: `sql("… WHERE id = $1").bind(id)`.
#[derive(Debug, Clone)]
pub struct Sql<'q> {
    text: &'q str,
    mysql_text: Option<&'q str>,
    args: Vec<Arg>,
}

/// Starts a statement (see [`Conn`]).
pub fn sql(text: &str) -> Sql<'_> {
    Sql {
        text,
        mysql_text: None,
        args: Vec::new(),
    }
}

impl<'q> Sql<'q> {
    /// Binds `$n`, for the next `n` (a placeholder may appear more than once).
    pub fn bind(mut self, value: impl Into<Arg>) -> Self {
        self.args.push(value.into());
        self
    }

    /// How MariaDB spells the same statement (still with `$n` placeholders), where it differs:
    /// `INSERT IGNORE` for `ON CONFLICT DO NOTHING`, `SIGNED` for `BIGINT` in a `CAST`.
    pub fn on_mysql(mut self, text: &'q str) -> Self {
        self.mysql_text = Some(text);
        self
    }

    fn arguments<DB: Database>(&self) -> Result<<DB as Database>::Arguments<'q>, sqlx::Error>
    where
        i64: for<'e> Encode<'e, DB> + Type<DB>,
        String: for<'e> Encode<'e, DB> + Type<DB>,
    {
        arguments::<DB>(self.args.iter())
    }

    /// The MariaDB text, its `$n` placeholders turned into `?`, and the arguments in the order
    /// of the `?`s (`$2 … $1 … $2` binds the second, the first, then the second again).
    fn for_mysql(&self) -> Result<(String, <MySql as Database>::Arguments<'q>), sqlx::Error> {
        let (text, order) = positional(self.mysql_text.unwrap_or(self.text));
        let args = order
            .iter()
            .map(|n| {
                self.args.get(n.wrapping_sub(1)).ok_or_else(|| {
                    sqlx::Error::Protocol(format!("${n} has no bound argument in {text}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((text, arguments::<MySql>(args.into_iter())?))
    }
}

fn arguments<'q, 'a, DB: Database>(
    args: impl Iterator<Item = &'a Arg>,
) -> Result<<DB as Database>::Arguments<'q>, sqlx::Error>
where
    i64: for<'e> Encode<'e, DB> + Type<DB>,
    String: for<'e> Encode<'e, DB> + Type<DB>,
{
    let mut arguments = <DB as Database>::Arguments::default();
    for arg in args {
        match arg {
            Arg::Int(value) => arguments.add(*value),
            Arg::Text(value) => arguments.add(value.clone()),
        }
        .map_err(sqlx::Error::Encode)?;
    }
    Ok(arguments)
}

/// `$n` placeholders to `?`: the new text and the `n` of each `?` in order. (The shop's SQL has
/// no `$` inside string literals.)
fn positional(text: &str) -> (String, Vec<usize>) {
    let mut out = String::with_capacity(text.len());
    let mut order = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let mut n = String::new();
        while let Some(&(_, d)) = chars.peek().filter(|(_, d)| d.is_ascii_digit()) {
            n.push(d);
            chars.next();
        }
        match n.parse::<usize>() {
            Ok(n) => {
                out.push('?');
                order.push(n);
            }
            Err(_) => out.push('$'),
        }
    }
    (out, order)
}

impl Conn<'_> {
    /// The same connection, borrowed again (for the next statement).
    pub fn reborrow(&mut self) -> Conn<'_> {
        match self {
            Conn::Pg(c) => Conn::Pg(c),
            Conn::Sqlite(c) => Conn::Sqlite(c),
            Conn::My(c) => Conn::My(c),
        }
    }

    /// Runs a statement; returns the number of rows it affected.
    pub async fn execute(&mut self, sql: Sql<'_>) -> Result<u64, sqlx::Error> {
        Ok(match self {
            Conn::Pg(c) => pg_run(c, &sql).await?.1,
            Conn::Sqlite(c) => sqlx::query_with(sql.text, sql.arguments::<Sqlite>()?)
                .execute(&mut **c)
                .await?
                .rows_affected(),
            Conn::My(c) => {
                let (text, arguments) = sql.for_mysql()?;
                sqlx::query_with(&text, arguments)
                    .execute(&mut **c)
                    .await?
                    .rows_affected()
            }
        })
    }

    /// The one row a statement returns.
    pub async fn fetch_one<T: Row>(&mut self, sql: Sql<'_>) -> Result<T, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let (rows, _) = pg_run(c, &sql).await?;
                T::from_row(rows.first().ok_or(sqlx::Error::RowNotFound)?)
            }
            Conn::Sqlite(c) => {
                sqlx::query_as_with(sql.text, sql.arguments::<Sqlite>()?)
                    .fetch_one(&mut **c)
                    .await
            }
            Conn::My(c) => {
                let (text, arguments) = sql.for_mysql()?;
                sqlx::query_as_with(&text, arguments)
                    .fetch_one(&mut **c)
                    .await
            }
        }
    }

    /// The row a statement returns, if any.
    pub async fn fetch_optional<T: Row>(&mut self, sql: Sql<'_>) -> Result<Option<T>, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let (rows, _) = pg_run(c, &sql).await?;
                rows.first().map(T::from_row).transpose()
            }
            Conn::Sqlite(c) => {
                sqlx::query_as_with(sql.text, sql.arguments::<Sqlite>()?)
                    .fetch_optional(&mut **c)
                    .await
            }
            Conn::My(c) => {
                let (text, arguments) = sql.for_mysql()?;
                sqlx::query_as_with(&text, arguments)
                    .fetch_optional(&mut **c)
                    .await
            }
        }
    }

    /// Every row a statement returns.
    pub async fn fetch_all<T: Row>(&mut self, sql: Sql<'_>) -> Result<Vec<T>, sqlx::Error> {
        match self {
            Conn::Pg(c) => {
                let (rows, _) = pg_run(c, &sql).await?;
                rows.iter().map(T::from_row).collect()
            }
            Conn::Sqlite(c) => {
                sqlx::query_as_with(sql.text, sql.arguments::<Sqlite>()?)
                    .fetch_all(&mut **c)
                    .await
            }
            Conn::My(c) => {
                let (text, arguments) = sql.for_mysql()?;
                sqlx::query_as_with(&text, arguments)
                    .fetch_all(&mut **c)
                    .await
            }
        }
    }

    /// The first column of the one row a statement returns.
    pub async fn scalar<T>(&mut self, sql: Sql<'_>) -> Result<T, sqlx::Error>
    where
        (T,): Row,
    {
        self.fetch_one::<(T,)>(sql).await.map(|(value,)| value)
    }

    /// The first column of the row a statement returns, if any.
    pub async fn scalar_optional<T>(&mut self, sql: Sql<'_>) -> Result<Option<T>, sqlx::Error>
    where
        (T,): Row,
    {
        Ok(self
            .fetch_optional::<(T,)>(sql)
            .await?
            .map(|(value,)| value))
    }
}

/// An open business transaction of any backend.
#[derive(Debug)]
pub enum Tx {
    /// PostgreSQL.
    Pg(Transaction<'static, Postgres>),
    /// SQLite.
    Sqlite(Transaction<'static, Sqlite>),
    /// MariaDB.
    My(Transaction<'static, MySql>),
}

impl Tx {
    /// The transaction's connection, for statements.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            Tx::Pg(tx) => Conn::Pg(tx),
            Tx::Sqlite(tx) => Conn::Sqlite(tx),
            Tx::My(tx) => Conn::My(tx),
        }
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Pg(tx) => tx.commit().await,
            Tx::Sqlite(tx) => tx.commit().await,
            Tx::My(tx) => tx.commit().await,
        }
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            Tx::Pg(tx) => tx.rollback().await,
            Tx::Sqlite(tx) => tx.rollback().await,
            Tx::My(tx) => tx.rollback().await,
        }
    }
}

/// A store whose business transactions the shop's statements run on, through [`Conn`]: what
/// lets an operation be written once for every backend (`impl<S: StoreConn> Operation<S>`).
pub trait StoreConn: Store + Journal + CompletionSignal {
    /// The connection of a transaction of this backend, for statements.
    fn conn<'a>(tx: &'a mut Transaction<'_, Self::Database>) -> Conn<'a>;
}

impl StoreConn for PgStore {
    fn conn<'a>(tx: &'a mut Transaction<'_, Postgres>) -> Conn<'a> {
        Conn::Pg(tx)
    }
}

impl StoreConn for SqliteStore {
    fn conn<'a>(tx: &'a mut Transaction<'_, Sqlite>) -> Conn<'a> {
        Conn::Sqlite(tx)
    }
}

impl StoreConn for MySqlStore {
    fn conn<'a>(tx: &'a mut Transaction<'_, MySql>) -> Conn<'a> {
        Conn::My(tx)
    }
}

/// The shop's database: the idempotency store, whose pool also holds the shop's tables.
#[derive(Debug, Clone)]
pub enum ShopDb {
    /// PostgreSQL.
    Pg(PgStore),
    /// SQLite (the default, a file).
    Sqlite(SqliteStore),
    /// MariaDB.
    My(MySqlStore),
}

/// The simulated providers' database: a pool of its own, so a provider call never runs inside
/// (or waits for) the shop's transaction.
#[derive(Debug, Clone)]
pub enum ProviderDb {
    /// Tables in the shop's PostgreSQL database, reached through another pool.
    Pg(PgPool),
    /// A SQLite file of its own next to the shop's file.
    Sqlite(SqlitePool),
    /// Tables in the shop's MariaDB database, reached through another pool.
    My(MySqlPool),
}

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `sqlite://` or `sqlite:`.
    Sqlite,
    /// `mysql://` (MariaDB).
    Mysql,
}

impl Kind {
    /// Reads the scheme of a database URL.
    pub fn of_url(url: &str) -> anyhow::Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Kind::Postgres)
        } else if url.starts_with("sqlite:") {
            Ok(Kind::Sqlite)
        } else if url.starts_with("mysql://") {
            Ok(Kind::Mysql)
        } else {
            bail!("unsupported database URL {url:?}: use sqlite://FILE, postgres://USER:PASS@HOST/DB or mysql://USER:PASS@HOST/DB")
        }
    }

    /// `"postgres"`, `"sqlite"` or `"mysql"`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Postgres => "postgres",
            Kind::Sqlite => "sqlite",
            Kind::Mysql => "mysql",
        }
    }
}

/// The file path of a `sqlite:` URL.
fn sqlite_path(url: &str) -> anyhow::Result<&str> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let path = rest.split('?').next().unwrap_or(rest);
    if path.is_empty() || path.contains(":memory:") {
        bail!("the shop needs a SQLite file (several connections share it), not {url:?}");
    }
    Ok(path)
}

async fn sqlite_pool(path: &str, max: u32) -> anyhow::Result<SqlitePool> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // Every commit synced (a paid order must survive a power loss); the store relaxes only
        // the reservations that may be (`PendingRow::must_flush_reservation`).
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(30));
    // Never reuse a connection whose transaction SQLite rolled back by itself (a full disk).
    Ok(SqliteStore::pool_options()
        .max_connections(max)
        .connect_with(options)
        .await?)
}

/// Connects both databases for `url` (the providers' SQLite file is `FILE.providers`).
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<(ShopDb, ProviderDb)> {
    connect_with(url, None, max_connections).await
}

/// Connects the shop's database `url` and the providers' database: `providers_url` when given
/// (a database of its own, on any backend: outside services keep their state outside the
/// shop's database, so it survives whatever happens to that one, e.g. a failover that loses
/// its last commits), else the shop's own (PostgreSQL, MariaDB: the same database through
/// another pool; SQLite: the file `FILE.providers`).
pub async fn connect_with(
    url: &str,
    providers_url: Option<&str>,
    max_connections: u32,
) -> anyhow::Result<(ShopDb, ProviderDb)> {
    let shop = connect_shop(url, max_connections).await?;
    let max = max_connections.div_ceil(2).max(2);
    let (providers_at, own) = match providers_url {
        Some(providers_url) => (providers_url, true),
        None => (url, false),
    };
    let providers = connect_providers(providers_at, own, max)
        .await
        .with_context(|| format!("connecting the providers' database {providers_at}"))?;
    Ok((shop, providers))
}

/// The providers' pool on the database of `url`: of their `own`, or the shop's (a SQLite shop's
/// providers then live in `FILE.providers`).
async fn connect_providers(url: &str, own: bool, max: u32) -> anyhow::Result<ProviderDb> {
    Ok(match Kind::of_url(url)? {
        Kind::Postgres => ProviderDb::Pg(
            PgPoolOptions::new()
                .max_connections(max)
                .connect(url)
                .await?,
        ),
        Kind::Sqlite => {
            let path = sqlite_path(url)?;
            let file = if own {
                path.to_owned()
            } else {
                format!("{path}.providers")
            };
            ProviderDb::Sqlite(sqlite_pool(&file, 4).await?)
        }
        Kind::Mysql => ProviderDb::My(
            MySqlPoolOptions::new()
                .max_connections(max)
                .connect(url)
                .await?,
        ),
    })
}

/// The shop's pool (the idempotency store and the shop's tables) on the database of `url`.
async fn connect_shop(url: &str, max_connections: u32) -> anyhow::Result<ShopDb> {
    match Kind::of_url(url)? {
        Kind::Postgres => {
            let shop = PgPoolOptions::new()
                .max_connections(max_connections)
                // Fail fast while the database is unreachable: the middleware answers 503 problem
                // JSON (never runs the handler unprotected), and clients retry with the same key.
                .acquire_timeout(Duration::from_secs(3))
                // No ping per checkout (sqlx's default): it doubles the round trips of every
                // one-statement request. A connection that died with the server fails its next
                // statement instead, and is dropped; the request answers 503 and is retried.
                .test_before_acquire(false)
                .connect(url)
                .await
                .with_context(|| format!("connecting to {url}"))?;
            let store = PgStore::new(shop);
            let pooled = store
                .behind_transaction_pooler()
                .await
                .with_context(|| format!("connecting to {url}"))?;
            PG_BEHIND_POOLER.store(pooled, Ordering::Relaxed);
            if pooled {
                tracing::info!("PostgreSQL through a transaction pooler: unnamed statements, each in a transaction");
            }
            Ok(ShopDb::Pg(store))
        }
        Kind::Sqlite => {
            let path = sqlite_path(url)?;
            let shop = sqlite_pool(path, 8)
                .await
                .with_context(|| format!("opening SQLite file {path}"))?;
            Ok(ShopDb::Sqlite(SqliteStore::new(shop)))
        }
        Kind::Mysql => {
            // As on PostgreSQL: fail fast while the server is down, no ping per checkout. And
            // PostgreSQL's isolation, READ COMMITTED: a handler whose `INSERT IGNORE` met a row
            // another transaction committed must then read that row, not an older snapshot
            // (InnoDB's REPEATABLE READ would hide it).
            let shop = MySqlPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(3))
                .test_before_acquire(false)
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                            .execute(conn)
                            .await
                            .map(drop)
                    })
                })
                .connect(url)
                .await
                .with_context(|| format!("connecting to {url}"))?;
            Ok(ShopDb::My(MySqlStore::new(shop)))
        }
    }
}

/// MariaDB runs DDL outside transactions (each statement commits): the statements run on one
/// connection holding a `GET_LOCK`, so that several processes may start at once.
async fn mysql_migrate(pool: &MySqlPool, suffix: &str, sql: &str) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    let lock = format!("CONCAT({MYSQL_MIGRATION_LOCK}, '{suffix}')");
    let locked: Option<i64> = sqlx::query_scalar(&format!("SELECT GET_LOCK({lock}, ?)"))
        .bind(MYSQL_MIGRATION_LOCK_SECS)
        .fetch_one(&mut *conn)
        .await?;
    if locked != Some(1) {
        bail!("another shop held the migration lock for {MYSQL_MIGRATION_LOCK_SECS} s");
    }
    let mut applied = Ok(());
    for statement in statements(sql) {
        if let Err(e) = sqlx::query(&statement).execute(&mut *conn).await {
            applied = Err(anyhow::Error::new(e).context(statement));
            break;
        }
    }
    sqlx::query(&format!("DO RELEASE_LOCK({lock})"))
        .execute(&mut *conn)
        .await?;
    applied
}

/// The statements of a migration file (comment lines dropped, split on `;`).
fn statements(sql: &str) -> impl Iterator<Item = String> + '_ {
    let code: String = sql
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .into_iter()
}

impl ShopDb {
    /// Which backend.
    pub fn kind(&self) -> Kind {
        match self {
            ShopDb::Pg(_) => Kind::Postgres,
            ShopDb::Sqlite(_) => Kind::Sqlite,
            ShopDb::My(_) => Kind::Mysql,
        }
    }

    /// Installs the idempotency crate's key table, then the shop's tables. Safe to run from
    /// several processes at once (advisory lock on PostgreSQL, `BEGIN IMMEDIATE` on SQLite,
    /// `GET_LOCK` on MariaDB).
    pub async fn migrate(&self) -> anyhow::Result<()> {
        match self {
            ShopDb::Pg(store) => {
                store.migrate().await.context("idempotency migrations")?;
                let mut tx = store.pool().begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(SHOP_MIGRATION_LOCK)
                    .persistent(false)
                    .execute(&mut *tx)
                    .await?;
                for statement in statements(include_str!("../migrations/postgres.sql")) {
                    sqlx::query(&statement)
                        .persistent(false)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
            ShopDb::Sqlite(store) => {
                store.migrate().await.context("idempotency migrations")?;
                let mut tx = store.writer().begin_with("BEGIN IMMEDIATE").await?;
                for statement in statements(include_str!("../migrations/sqlite.sql")) {
                    sqlx::query(&statement)
                        .persistent(false)
                        .execute(&mut *tx)
                        .await?;
                }
                let orders: String = sqlx::query_scalar(
                    "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'shop_orders'",
                )
                .fetch_one(&mut *tx)
                .await?;
                if !orders.contains("pending_payment") {
                    bail!("this SQLite file was made by an older shop (its orders know no 'pending_payment'); delete it and its .providers file, or use another --database-url");
                }
                tx.commit().await?;
            }
            ShopDb::My(store) => {
                store.migrate().await.context("idempotency migrations")?;
                mysql_migrate(store.pool(), "", include_str!("../migrations/mysql.sql")).await?;
            }
        }
        Ok(())
    }

    /// Opens a transaction for work that is not protected by a key (guarded transitions,
    /// unique-constraint inserts); on SQLite it queues for the store's one writer connection
    /// and takes the write lock at once.
    pub async fn begin(&self) -> Result<Tx, sqlx::Error> {
        Ok(match self {
            ShopDb::Pg(store) => Tx::Pg(store.pool().begin().await?),
            ShopDb::Sqlite(store) => {
                Tx::Sqlite(store.writer().begin_with("BEGIN IMMEDIATE").await?)
            }
            ShopDb::My(store) => Tx::My(store.pool().begin().await?),
        })
    }

    /// A pooled connection for reads.
    pub async fn read(&self) -> Result<ReadConn, sqlx::Error> {
        Ok(match self {
            ShopDb::Pg(store) => ReadConn::Pg(store.pool().acquire().await?),
            ShopDb::Sqlite(store) => ReadConn::Sqlite(store.pool().acquire().await?),
            ShopDb::My(store) => ReadConn::My(store.pool().acquire().await?),
        })
    }
}

/// A pooled connection of any backend.
#[derive(Debug)]
pub enum ReadConn {
    /// PostgreSQL.
    Pg(sqlx::pool::PoolConnection<Postgres>),
    /// SQLite.
    Sqlite(sqlx::pool::PoolConnection<Sqlite>),
    /// MariaDB.
    My(sqlx::pool::PoolConnection<MySql>),
}

impl ReadConn {
    /// The connection, for statements.
    pub fn conn(&mut self) -> Conn<'_> {
        match self {
            ReadConn::Pg(c) => Conn::Pg(c),
            ReadConn::Sqlite(c) => Conn::Sqlite(c),
            ReadConn::My(c) => Conn::My(c),
        }
    }
}

impl ProviderDb {
    /// Installs the providers' tables (idempotent, safe concurrently).
    pub async fn migrate(&self) -> anyhow::Result<()> {
        match self {
            ProviderDb::Pg(pool) => {
                let mut tx = pool.begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(SHOP_MIGRATION_LOCK + 1)
                    .persistent(false)
                    .execute(&mut *tx)
                    .await?;
                for statement in statements(include_str!("../migrations/postgres_providers.sql")) {
                    sqlx::query(&statement)
                        .persistent(false)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
            ProviderDb::Sqlite(pool) => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                for statement in statements(include_str!("../migrations/sqlite_providers.sql")) {
                    sqlx::query(&statement)
                        .persistent(false)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
            ProviderDb::My(pool) => {
                let sql = include_str!("../migrations/mysql_providers.sql");
                mysql_migrate(pool, "_providers", sql).await?;
            }
        }
        Ok(())
    }

    /// A pooled connection.
    pub async fn conn(&self) -> Result<ReadConn, sqlx::Error> {
        Ok(match self {
            ProviderDb::Pg(pool) => ReadConn::Pg(pool.acquire().await?),
            ProviderDb::Sqlite(pool) => ReadConn::Sqlite(pool.acquire().await?),
            ProviderDb::My(pool) => ReadConn::My(pool.acquire().await?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sqlite_paths() {
        assert_eq!(sqlite_path("sqlite://shop.db").unwrap(), "shop.db");
        assert_eq!(
            sqlite_path("sqlite:/tmp/x.db?mode=rwc").unwrap(),
            "/tmp/x.db"
        );
        assert!(sqlite_path("sqlite::memory:").is_err());
        assert_eq!(Kind::of_url("postgresql://h/db").unwrap(), Kind::Postgres);
        assert_eq!(Kind::of_url("mysql://h/db").unwrap(), Kind::Mysql);
        assert!(Kind::of_url("mssql://h/db").is_err());
    }

    #[test]
    fn placeholders_become_positional_on_mysql() {
        let (text, order) = positional("UPDATE t SET b = b - $2 WHERE id = $1 AND b >= $2");
        assert_eq!(text, "UPDATE t SET b = b - ? WHERE id = ? AND b >= ?");
        assert_eq!(order, [2, 1, 2]);
        let (text, order) = positional("SELECT $10, $ x");
        assert_eq!((text.as_str(), order), ("SELECT ?, $ x", vec![10]));
        let statement = sql("SELECT $2, $1").bind(7i64).bind("x");
        assert!(statement.for_mysql().is_ok());
        assert!(sql("SELECT $2").bind(7i64).for_mysql().is_err());
    }

    #[test]
    fn every_migration_statement_is_split() {
        let n = statements(include_str!("../migrations/sqlite.sql")).count();
        assert_eq!(n, 9);
        // PostgreSQL also replaces the status CHECK of databases made by older shops.
        assert_eq!(
            statements(include_str!("../migrations/postgres.sql")).count(),
            n + 2
        );
    }
}
