//! Which database a URL names, and a connected store for it.

use anyhow::{Context, Result};
use idempotency::{MySqlStore, PgStore, SqliteStore};
use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions},
};
use std::{fmt, str::FromStr, time::Duration};

/// The three backends the CLI speaks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `sqlite:`.
    Sqlite,
    /// `mysql://` or `mariadb://`.
    MySql,
}

/// A database URL whose scheme the CLI knows (checked while parsing the arguments).
#[derive(Debug, Clone)]
pub struct DatabaseUrl {
    /// The backend.
    pub backend: DatabaseKind,
    url: String,
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
        let backend =
            match scheme.as_deref() {
                Some("postgres" | "postgresql") => DatabaseKind::Postgres,
                Some("sqlite") => DatabaseKind::Sqlite,
                Some("mysql" | "mariadb") => DatabaseKind::MySql,
                _ => return Err(
                    "expected a postgres://, postgresql://, sqlite:, mysql:// or mariadb:// URL"
                        .into(),
                ),
            };
        let url = match url.strip_prefix("mariadb") {
            Some(rest) => format!("mysql{rest}"),
            None => url.to_owned(),
        };
        Ok(Self { backend, url })
    }
}

impl fmt::Display for DatabaseUrl {
    /// The URL with its password masked, for messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = &self.url;
        let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
            return f.write_str(url);
        };
        let authority_end = url[scheme_end..]
            .find('/')
            .map_or(url.len(), |i| scheme_end + i);
        match url[scheme_end..authority_end].rfind('@') {
            Some(at) => {
                let userinfo = &url[scheme_end..scheme_end + at];
                match userinfo.split_once(':') {
                    Some((user, _)) => write!(
                        f,
                        "{}{user}:***{}",
                        &url[..scheme_end],
                        &url[scheme_end + at..]
                    ),
                    None => f.write_str(url),
                }
            }
            None => f.write_str(url),
        }
    }
}

/// A connected store, whichever the backend.
#[derive(Debug, Clone)]
pub enum AnyStore {
    /// PostgreSQL.
    Postgres(PgStore),
    /// SQLite.
    Sqlite(SqliteStore),
    /// MySQL / MariaDB.
    MySql(MySqlStore),
}

/// Runs `$body` with `$store` bound to the concrete store inside an [`AnyStore`].
#[macro_export]
macro_rules! with_store {
    ($any:expr, $store:ident => $body:expr) => {
        match $any {
            $crate::db::AnyStore::Postgres($store) => $body,
            $crate::db::AnyStore::Sqlite($store) => $body,
            $crate::db::AnyStore::MySql($store) => $body,
        }
    };
}

/// Connects to `url`. A SQLite file is created only when `create` is set (for `migrate`), so a
/// mistyped path is an error rather than a new empty database.
pub async fn connect(url: &DatabaseUrl, timeout: Duration, create: bool) -> Result<AnyStore> {
    let context = || format!("could not connect to the database at {url}");
    // One direct connection first: a pool reports only "timed out" where the server said
    // "connection refused" or "password authentication failed".
    match url.backend {
        DatabaseKind::Postgres => probe::<sqlx::PgConnection>(url, timeout).await?,
        DatabaseKind::MySql => probe::<sqlx::MySqlConnection>(url, timeout).await?,
        DatabaseKind::Sqlite => {}
    }
    Ok(match url.backend {
        DatabaseKind::Postgres => AnyStore::Postgres(PgStore::new(
            PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(timeout)
                .connect(&url.url)
                .await
                .with_context(context)?,
        )),
        DatabaseKind::MySql => AnyStore::MySql(MySqlStore::new(
            MySqlPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(timeout)
                .connect(&url.url)
                .await
                .with_context(context)?,
        )),
        DatabaseKind::Sqlite => {
            let options = SqliteConnectOptions::from_str(&url.url)
                .with_context(context)?
                .create_if_missing(create)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30));
            AnyStore::Sqlite(SqliteStore::new(
                SqlitePoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(timeout)
                    .connect_with(options)
                    .await
                    .with_context(|| {
                        if create {
                            context()
                        } else {
                            format!(
                                "{} (run `idem migrate` to create a new database)",
                                context()
                            )
                        }
                    })?,
            ))
        }
    })
}

async fn probe<C: sqlx::Connection>(url: &DatabaseUrl, timeout: Duration) -> Result<()> {
    match tokio::time::timeout(timeout, C::connect(&url.url)).await {
        Ok(Ok(connection)) => {
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(error)) => {
            Err(error).with_context(|| format!("could not connect to the database at {url}"))
        }
        Err(_) => anyhow::bail!(
            "could not connect to the database at {url}: no answer within {}",
            humantime::format_duration(timeout)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{DatabaseKind, DatabaseUrl};

    #[test]
    fn knows_the_schemes() {
        let url: DatabaseUrl = "postgresql://idem:secret@db:5432/idem".parse().unwrap();
        assert_eq!(url.backend, DatabaseKind::Postgres);
        assert_eq!(url.to_string(), "postgresql://idem:***@db:5432/idem");
        let url: DatabaseUrl = "mariadb://u@h/db".parse().unwrap();
        assert_eq!(url.backend, DatabaseKind::MySql);
        assert_eq!(url.to_string(), "mysql://u@h/db");
        let url: DatabaseUrl = "sqlite://keys.db?mode=rwc".parse().unwrap();
        assert_eq!(url.backend, DatabaseKind::Sqlite);
        assert!("redis://h".parse::<DatabaseUrl>().is_err());
        assert!("keys.db".parse::<DatabaseUrl>().is_err());
    }
}
