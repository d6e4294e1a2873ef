//! Fresh databases for integration tests, one per test, from the URLs CI exports, and one harness
//! that runs a test on every backend.
//!
//! * `TEST_POSTGRES_URL`: a PostgreSQL server (any database on it); each test gets a new database.
//! * `TEST_MYSQL_URL`: a MySQL/MariaDB server; likewise.
//! * SQLite needs nothing: each test gets a file in a temporary folder.
//!
//! When a URL is missing the server's tests are skipped with a loud note, **except under CI**
//! (`CI` set), where a missing URL or an unreachable server fails the test.
//!
//! ```no_run
//! # async fn demo() {
//! if let Some(url) = test_support::fresh_postgres_url().await {
//!     let pool = sqlx::PgPool::connect(&url).await.unwrap();
//! }
//! # }
//! ```
//!
//! # Every test on every backend
//!
//! [`backend_tests!`] is the only place that lists the backends ([`TestDatabase`]): it turns each
//! scenario into one test per backend, `sqlite::name`, `postgres::name` and `mysql::name`, so a new
//! backend gets every crate's suite as its conformance suite. A scenario takes a [`Fixture`]
//! (a test app, a service...) opened on the backend, or the [`TestDatabase`] itself; tests generic over
//! a store type go `via` a macro of the test crate that maps a backend to its store. A system that
//! does not support a backend yet names it in `except`, with the reason.
//!
//! ```
//! use test_support::{TestDatabase, Database, Fixture};
//!
//! /// What the scenarios need: here, just a fresh database.
//! struct Db(Database);
//!
//! impl Fixture for Db {
//!     async fn open(backend: TestDatabase) -> Option<Self> {
//!         backend.fresh_database().await.map(Db)
//!     }
//! }
//!
//! async fn has_a_url(db: Db) {
//!     assert!(!db.0.url.is_empty());
//! }
//!
//! /// The scenario may set up what it needs itself.
//! async fn knows_its_backend(backend: TestDatabase) {
//!     assert!(["sqlite", "postgres", "mysql"].contains(&backend.name()));
//! }
//!
//! // Tests `sqlite::has_a_url`, `postgres::has_a_url`, `mysql::has_a_url`, and likewise.
//! test_support::backend_tests! {
//!     #[tokio::test]
//!     has_a_url,
//!     knows_its_backend,
//! }
//!
//! mod subset {
//!     async fn runs(backend: test_support::TestDatabase) {}
//!
//!     // Tests `sqlite::runs` and `postgres::runs`.
//!     test_support::backend_tests! {
//!         #[tokio::test]
//!         except MySql = "this system has no MySQL store yet";
//!         runs,
//!     }
//! }
//! # fn main() {}
//! ```

mod harness;
pub mod proxy;

pub use harness::{run, Database, Fixture, TestDatabase};

use sqlx::{Connection, Executor};
use std::path::PathBuf;

/// Which server a URL variable names.
const POSTGRES_VAR: &str = "TEST_POSTGRES_URL";
const MYSQL_VAR: &str = "TEST_MYSQL_URL";

/// Whether we run under CI, where skipping is not allowed.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

fn server_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if in_ci() => panic!("{var} is not set, but CI is: the database tests must run in CI"),
        _ => {
            // Written to stderr directly, past the test harness's capture, so a skip is seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {var} is not set; this test needs that server (see .ci/databases.sh)"
            );
            None
        }
    }
}

fn fresh_name() -> String {
    fresh_name_with_prefix("t")
}

fn fresh_name_with_prefix(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// Replaces the database name (the path) of a server URL.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{}", &base[..path_start], database);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// Creates a new, empty PostgreSQL database and returns its URL; `None` when skipped.
///
/// Panics (fails the test) when the server is configured but cannot be reached.
pub async fn fresh_postgres_url() -> Option<String> {
    fresh_postgres_url_with_prefix("t").await
}

/// [`fresh_postgres_url`] with a database named `{prefix}_{uuid}` (a prefix that says who made
/// it).
pub async fn fresh_postgres_url_with_prefix(prefix: &str) -> Option<String> {
    let url = server_url(POSTGRES_VAR)?;
    let name = fresh_name_with_prefix(prefix);
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{POSTGRES_VAR}={url} is set but unreachable: {e}"));
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    Some(with_database(&url, &name))
}

/// Creates a new, empty MySQL/MariaDB database and returns its URL; `None` when skipped.
pub async fn fresh_mysql_url() -> Option<String> {
    let url = server_url(MYSQL_VAR)?;
    let name = fresh_name();
    let mut admin = sqlx::MySqlConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{MYSQL_VAR}={url} is set but unreachable: {e}"));
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    Some(with_database(&url, &name))
}

/// A SQLite database file in a fresh temporary folder, removed when the guard drops.
#[derive(Debug)]
pub struct SqliteFile {
    /// `sqlite://…?mode=rwc` for the file.
    pub url: String,
    /// The file's path.
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

/// A fresh SQLite file (always available).
pub fn fresh_sqlite() -> SqliteFile {
    let dir = tempfile::tempdir().expect("temporary folder");
    let path = dir.path().join("test.db");
    SqliteFile {
        url: format!("sqlite://{}?mode=rwc", path.display()),
        path,
        _dir: dir,
    }
}

/// Polls `future` at most `polls` times, then drops it; its output if it finished. Between polls
/// it yields to the runtime (so the future's I/O and the tasks it spawned go on) and then blocks
/// its thread for `pause` (time for a database's own worker thread to answer; zero for none).
/// Cancels work at a point set by a count rather than by a timer, whose millisecond ticks a fast
/// machine outruns.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// assert_eq!(test_support::poll_then_drop(async { 7 }, 1, Duration::ZERO).await, Some(7));
/// assert_eq!(test_support::poll_then_drop(async { 7 }, 0, Duration::ZERO).await, None);
/// # }
/// ```
pub async fn poll_then_drop<F: std::future::Future>(
    future: F,
    polls: u64,
    pause: std::time::Duration,
) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx)));
        if let std::task::Poll::Ready(output) = polled.await {
            return Some(output);
        }
        tokio::task::yield_now().await;
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    None
}

/// Runs the ignored test `test` of the current test binary as a child process, with `env`, and
/// waits (off the runtime's threads) until it prints a line ending in `marker`: a real process
/// for a test to SIGKILL at a known point of its work. Panics if the child ends first.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut child = test_support::spawn_child_test("the_child_holds", &[("KEY", "k1")], "held").await;
/// child.kill().expect("SIGKILL");
/// child.wait().expect("reap it");
/// # }
/// ```
pub async fn spawn_child_test(
    test: &str,
    env: &[(&str, &str)],
    marker: &'static str,
) -> std::process::Child {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the child test");
    let stdout = child.stdout.take().expect("piped");
    tokio::task::spawn_blocking(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            // libtest's "test <name> ... " has no newline before it: the marker ends a line.
            if line.expect("the child's output").ends_with(marker) {
                return;
            }
        }
        panic!("the child test ended before it printed {marker:?}");
    })
    .await
    .expect("reading the child");
    child
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/idem", "t_1"),
            "postgres://u:p@h:5432/t_1"
        );
        assert_eq!(with_database("mysql://u@h", "t_1"), "mysql://u@h/t_1");
        assert_eq!(
            with_database("postgres://h/db?sslmode=disable", "x"),
            "postgres://h/x?sslmode=disable"
        );
    }
}
