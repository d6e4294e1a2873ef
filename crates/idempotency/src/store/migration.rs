//! One runner for the key table's migrations. Each backend holds its own lock around it (an
//! advisory lock in a transaction on PostgreSQL, `BEGIN IMMEDIATE` on SQLite, `GET_LOCK` on
//! MySQL) and supplies its bookkeeping SQL; the loop that skips what is recorded, applies the
//! rest in order and records each one is written once, here.

use crate::error::StoreError;

/// One schema change of the key table, applied once per database.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Migration {
    /// Applied in increasing order; recorded in `idempotency_schema_migrations`.
    pub(crate) version: i64,
    /// What the change does, recorded beside its version.
    pub(crate) description: &'static str,
    /// The statements, separated by `;` (see [`statements`]).
    pub(crate) sql: &'static str,
}

/// A dialect's statements for keeping track of applied migrations.
pub(crate) struct Bookkeeping {
    /// Creates `idempotency_schema_migrations` if it is missing.
    pub(crate) create_table: &'static str,
    /// Returns a row when the version bound as its one parameter is recorded.
    pub(crate) find_version: &'static str,
    /// Records the version and description bound as its two parameters.
    pub(crate) record_version: &'static str,
    /// Statement errors that mean the change is in place already: a dialect whose DDL commits
    /// on its own (MySQL) can crash between a change and its bookkeeping row, and then applies
    /// the migration again.
    pub(crate) already_applied: fn(&sqlx::Error) -> bool,
    /// `record_version` errors that mean another process recorded the version meanwhile (a
    /// duplicate): where the dialect's lock does not exclude every other process, as MySQL's
    /// `GET_LOCK` on a Galera node, which holds on that node only.
    pub(crate) recorded_meanwhile: fn(&sqlx::Error) -> bool,
    /// `record_version` errors that rolled the insert back and may be retried (a deadlock, a
    /// Galera certification conflict with another node's insert of the same version).
    pub(crate) rolled_back: fn(&sqlx::Error) -> bool,
}

/// How many times a bookkeeping insert that was rolled back is tried again.
const RECORD_ATTEMPTS: u32 = 4;

/// Applies, in order, each migration not yet recorded, and records it. The caller holds the
/// dialect's migration lock on `conn` for the whole call.
pub(crate) async fn apply_pending<DB>(
    conn: &mut DB::Connection,
    bookkeeping: &Bookkeeping,
    migrations: &[Migration],
) -> Result<(), StoreError>
where
    DB: sqlx::Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    // Unnamed statements (`persistent(false)`): a migration runs once, and behind a transaction
    // pooler a named statement could meet one of the same name another client left on the server.
    sqlx::query::<DB>(bookkeeping.create_table)
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    for migration in migrations {
        let recorded = sqlx::query::<DB>(bookkeeping.find_version)
            .bind(migration.version)
            .persistent(false)
            .fetch_optional(&mut *conn)
            .await?;
        if recorded.is_some() {
            continue;
        }
        for statement in statements(migration.sql) {
            match sqlx::query::<DB>(&statement)
                .persistent(false)
                .execute(&mut *conn)
                .await
            {
                Ok(_) => {}
                Err(source) if (bookkeeping.already_applied)(&source) => {}
                Err(source) => {
                    return Err(StoreError::Migration {
                        version: migration.version,
                        description: migration.description,
                        source,
                    })
                }
            }
        }
        record::<DB>(conn, bookkeeping, migration).await?;
    }
    Ok(())
}

/// Records `migration` as applied; a duplicate means another process recorded it meanwhile.
async fn record<DB>(
    conn: &mut DB::Connection,
    bookkeeping: &Bookkeeping,
    migration: &Migration,
) -> Result<(), StoreError>
where
    DB: sqlx::Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut attempt = 1;
    loop {
        let recorded = sqlx::query::<DB>(bookkeeping.record_version)
            .bind(migration.version)
            .bind(migration.description.to_owned())
            .persistent(false)
            .execute(&mut *conn)
            .await;
        match recorded {
            Ok(_) => return Ok(()),
            Err(e) if (bookkeeping.recorded_meanwhile)(&e) => return Ok(()),
            Err(e) if attempt < RECORD_ATTEMPTS && (bookkeeping.rolled_back)(&e) => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

/// For dialects whose migrations run in one transaction: no statement error is expected.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn never_applied(_: &sqlx::Error) -> bool {
    false
}

/// The statements of a migration file: comment lines dropped, then split on `;`. Migration files
/// keep no `;` inside literals.
pub(crate) fn statements(sql: &str) -> Vec<String> {
    let code: Vec<&str> = sql
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect();
    code.join("\n")
        .split(';')
        .map(str::trim)
        .filter(|statement| !statement.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn splits_statements_and_drops_comments() {
        let sql = "-- a comment; with a semicolon\nCREATE TABLE a (x INT);\n\n-- another\nCREATE INDEX i ON a (x);\n";
        assert_eq!(
            super::statements(sql),
            vec!["CREATE TABLE a (x INT)", "CREATE INDEX i ON a (x)"]
        );
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_failing_statement_stops_the_run_and_keeps_the_database_error() {
        use super::{apply_pending, Bookkeeping, Migration};
        use crate::error::StoreError;
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .unwrap();
        let bookkeeping = Bookkeeping {
            create_table: "CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
                version INTEGER PRIMARY KEY, description TEXT NOT NULL)",
            find_version: "SELECT version FROM idempotency_schema_migrations WHERE version = ?1",
            record_version:
                "INSERT INTO idempotency_schema_migrations (version, description) VALUES (?1, ?2)",
            already_applied: super::never_applied,
            recorded_meanwhile: super::never_applied,
            rolled_back: super::never_applied,
        };
        let migrations = [
            Migration {
                version: 1,
                description: "one",
                sql: "CREATE TABLE one (x INT);",
            },
            Migration {
                version: 2,
                description: "broken",
                sql: "CREATE TABLE two (x INT); CREATE TABL three (x INT);",
            },
            Migration {
                version: 3,
                description: "after",
                sql: "CREATE TABLE after_broken (x INT);",
            },
        ];
        let error = apply_pending::<sqlx::Sqlite>(&mut conn, &bookkeeping, &migrations)
            .await
            .unwrap_err();
        match &error {
            StoreError::Migration {
                version: 2,
                description: "broken",
                source,
            } => {
                assert!(matches!(source, sqlx::Error::Database(_)), "{source:?}");
            }
            other => panic!("expected migration 2 to fail, got {other:?}"),
        }
        assert!(std::error::Error::source(&error).is_some());
        let recorded: Vec<i64> = sqlx::query_scalar(
            "SELECT version FROM idempotency_schema_migrations ORDER BY version",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            recorded,
            vec![1],
            "only the migration that succeeded is recorded"
        );
        let later: Option<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE name = 'after_broken'")
                .fetch_optional(&mut conn)
                .await
                .unwrap();
        assert_eq!(later, None, "nothing after the failure ran");
        // Run again with the broken migration fixed: it and the one after it are applied.
        let fixed = [
            migrations[0],
            Migration {
                version: 2,
                description: "fixed",
                sql: "CREATE TABLE IF NOT EXISTS two (x INT);",
            },
            migrations[2],
        ];
        apply_pending::<sqlx::Sqlite>(&mut conn, &bookkeeping, &fixed)
            .await
            .unwrap();
        let recorded: Vec<i64> = sqlx::query_scalar(
            "SELECT version FROM idempotency_schema_migrations ORDER BY version",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(recorded, vec![1, 2, 3]);
    }
}
