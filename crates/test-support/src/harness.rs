//! The backends every store runs on, and [`backend_tests!`](crate::backend_tests): the one place
//! that lists them.

use crate::{fresh_mysql_url, fresh_postgres_url, fresh_sqlite, server_url, SqliteFile};
use crate::{MYSQL_VAR, POSTGRES_VAR};
use std::{fmt, future::Future};

/// A database the stores run on. [`backend_tests!`](crate::backend_tests) makes one test module
/// per variant, named by [`TestDatabase::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TestDatabase {
    /// A file in a temporary folder: always available.
    Sqlite,
    /// The server of `TEST_POSTGRES_URL`.
    Postgres,
    /// The MySQL/MariaDB server of `TEST_MYSQL_URL`.
    MySql,
}

impl TestDatabase {
    /// `sqlite`, `postgres` or `mysql`: the name of its test module and of its URL scheme.
    pub fn name(self) -> &'static str {
        match self {
            TestDatabase::Sqlite => "sqlite",
            TestDatabase::Postgres => "postgres",
            TestDatabase::MySql => "mysql",
        }
    }

    /// Whether tests can run on it: SQLite always; a server when its `TEST_*_URL` is set. When
    /// it is not, says so loudly and answers `false`, or fails the test under CI.
    pub fn available(self) -> bool {
        match self {
            TestDatabase::Sqlite => true,
            TestDatabase::Postgres => server_url(POSTGRES_VAR).is_some(),
            TestDatabase::MySql => server_url(MYSQL_VAR).is_some(),
        }
    }

    /// A new, empty database on it; `None` when it is not [available](Self::available).
    pub async fn fresh_database(self) -> Option<Database> {
        match self {
            TestDatabase::Sqlite => {
                let file = fresh_sqlite();
                Some(Database {
                    url: file.url.clone(),
                    sqlite: Some(file),
                })
            }
            TestDatabase::Postgres => fresh_postgres_url().await.map(Database::server),
            TestDatabase::MySql => fresh_mysql_url().await.map(Database::server),
        }
    }
}

impl fmt::Display for TestDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fresh database of [`TestDatabase::fresh_database`].
#[derive(Debug)]
pub struct Database {
    /// Its URL.
    pub url: String,
    /// For SQLite, its file, removed when dropped: keep it as long as the database is used.
    pub sqlite: Option<SqliteFile>,
}

impl Database {
    fn server(url: String) -> Self {
        Database { url, sqlite: None }
    }
}

/// What a scenario of [`backend_tests!`](crate::backend_tests) runs against, set up on one
/// backend: a test app, a running service, a store... or the [`TestDatabase`] itself.
pub trait Fixture: Sized {
    /// Sets it up on `backend`; `None` when the backend is not [available](TestDatabase::available)
    /// (the test is then skipped, which CI does not allow).
    fn open(backend: TestDatabase) -> impl Future<Output = Option<Self>> + Send;
}

/// The scenario sets up what it needs itself.
impl Fixture for TestDatabase {
    async fn open(backend: TestDatabase) -> Option<Self> {
        backend.available().then_some(backend)
    }
}

/// Runs `scenario` with its fixture opened on `backend`; nothing when that is skipped. The
/// fixture's type is the scenario's parameter.
pub async fn run<F, Fut>(backend: TestDatabase, scenario: impl FnOnce(F) -> Fut)
where
    F: Fixture,
    Fut: Future<Output = ()>,
{
    if let Some(fixture) = F::open(backend).await {
        scenario(fixture).await;
    }
}

/// Instantiates each scenario once per [`TestDatabase`], as `sqlite::name`, `postgres::name` and
/// `mysql::name`: each passes or fails on its own. The list of backends is written here only.
///
/// ```text
/// backend_tests! {
///     #[test attribute]...                    // e.g. #[tokio::test]
///     [except Variant = "why", ...;]          // backends this system does not support (yet)
///     [via path::to::macro;]                  // for tests generic over a store type
///     scenario, ...
/// }
/// ```
///
/// * A scenario is an `async fn name(fixture: F)`, with `F` any [`Fixture`]: opened on each
///   backend (or the test skipped) and passed by value. `F` = [`TestDatabase`] lets the scenario set
///   up what it needs itself.
/// * With `via m;`, the test for backend `B` is `m!(TestDatabase::B, super::name)` instead: for
///   `async fn name<S: Store>(store: S)` scenarios, `m` matches on the backend to open its store
///   type, which only the test crate knows. `m` expands in the generated module, so its paths
///   must be absolute (`crate::…`, `$crate::…`, extern crates).
/// * `except MySql = "…";` leaves out the named backends (validated against [`TestDatabase`]); the
///   reason is mandatory. Prefer running everywhere: a new store gets the suite for free.
///
/// Invoke it once per module: it defines the modules `sqlite`, `postgres` and `mysql` there.
///
/// With `via`, for scenarios generic over a type that depends on the backend:
///
/// ```
/// trait Store {
///     fn open() -> Option<Self>
///     where
///         Self: Sized;
/// }
/// # macro_rules! store { ($($name:ident)*) => { $(struct $name; impl Store for $name {
/// #     fn open() -> Option<Self> { Some($name) } })* } }
/// # store!(SqliteStore PgStore MySqlStore);
///
/// /// The test crate's map from a backend to its store (exhaustive: a new backend must be added).
/// /// It expands in the generated modules: absolute paths.
/// macro_rules! on_store {
///     ($backend:expr, $test:path) => {
///         match $backend {
///             test_support::TestDatabase::Sqlite => $test(crate::SqliteStore::open()).await,
///             test_support::TestDatabase::Postgres => $test(crate::PgStore::open()).await,
///             test_support::TestDatabase::MySql => $test(crate::MySqlStore::open()).await,
///         }
///     };
/// }
///
/// async fn replays<S: Store>(store: Option<S>) {}
///
/// test_support::backend_tests! {
///     #[tokio::test]
///     via crate::on_store;
///     replays,
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! backend_tests {
    // The one list of backends: the test module's name and the `TestDatabase` variant, for `$callback`.
    (@for_each_backend [$($callback:tt)*] [$($lead:tt)*] $($args:tt)*) => {
        $($callback)*! { $($lead)* sqlite Sqlite $($args)* }
        $($callback)*! { $($lead)* postgres Postgres $($args)* }
        $($callback)*! { $($lead)* mysql MySql $($args)* }
    };
    // One backend's module.
    (@module $module:ident $variant:ident $attrs:tt via $via:path; $($test:ident),+ $(,)?) => {
        mod $module {
            $($crate::backend_tests! { @test $attrs $test { $via!($crate::TestDatabase::$variant, super::$test) } })+
        }
    };
    (@module $module:ident $variant:ident $attrs:tt $($test:ident),+ $(,)?) => {
        mod $module {
            $($crate::backend_tests! { @test $attrs $test { $crate::run($crate::TestDatabase::$variant, super::$test).await } })+
        }
    };
    (@test [$(#[$attr:meta])+] $test:ident { $($body:tt)* }) => {
        $(#[$attr])+
        async fn $test() {
            $($body)*;
        }
    };
    // A subset: a local macro drops the modules of the excepted backends.
    (@except ($d:tt) [$($attr:tt)+] [$($skip:ident)+] $($rest:tt)*) => {
        $(const _: $crate::TestDatabase = $crate::TestDatabase::$skip;)+
        macro_rules! __backend_tests_unless_excepted {
            $(($d module:ident $skip $d($d rest:tt)*) => {};)+
            ($d($d args:tt)*) => { $crate::backend_tests! { @module $d($d args)* } };
        }
        $crate::backend_tests! { @for_each_backend [__backend_tests_unless_excepted] [] [$($attr)+] $($rest)* }
    };
    // The entries.
    ($(#[$attr:meta])+ except $($skip:ident = $why:literal),+ $(,)?; $($rest:tt)+) => {
        $crate::backend_tests! { @except ($) [$(#[$attr])+] [$($skip)+] $($rest)+ }
    };
    ($(#[$attr:meta])+ $first:ident $($rest:tt)*) => {
        $crate::backend_tests! { @for_each_backend [$crate::backend_tests] [@module] [$(#[$attr])+] $first $($rest)* }
    };
}

#[cfg(test)]
mod tests {
    use super::{Database, Fixture, TestDatabase};

    /// The test's name, which its thread bears.
    fn test_name() -> String {
        std::thread::current().name().unwrap_or_default().to_owned()
    }

    /// Each module runs its own backend.
    async fn each_module_runs_its_backend(backend: TestDatabase) {
        let name = test_name();
        assert!(
            name.ends_with(&format!("{backend}::each_module_runs_its_backend")),
            "{name}"
        );
    }

    struct Fresh(Database);

    impl Fixture for Fresh {
        async fn open(backend: TestDatabase) -> Option<Self> {
            backend.fresh_database().await.map(Fresh)
        }
    }

    async fn a_fixture_is_opened_on_the_backend(fresh: Fresh) {
        let name = test_name();
        assert_eq!(
            fresh.0.sqlite.is_some(),
            name.contains("::sqlite::"),
            "{name}"
        );
    }

    crate::backend_tests! {
        #[tokio::test]
        each_module_runs_its_backend,
        a_fixture_is_opened_on_the_backend,
    }

    mod except {
        use crate::TestDatabase;

        async fn never_runs_on_the_excepted(backend: TestDatabase) {
            assert_ne!(backend, TestDatabase::MySql);
        }

        crate::backend_tests! {
            #[tokio::test]
            except MySql = "the test of `except`";
            never_runs_on_the_excepted,
        }
    }

    mod via {
        use crate::TestDatabase;

        /// Stands for a store type per backend.
        trait Store {
            const BACKEND: TestDatabase;
        }

        struct Lite;
        struct Pg;
        struct My;

        impl Store for Lite {
            const BACKEND: TestDatabase = TestDatabase::Sqlite;
        }
        impl Store for Pg {
            const BACKEND: TestDatabase = TestDatabase::Postgres;
        }
        impl Store for My {
            const BACKEND: TestDatabase = TestDatabase::MySql;
        }

        macro_rules! on_store {
            ($backend:expr, $test:path) => {
                match $backend {
                    $crate::TestDatabase::Sqlite => $test(super::Lite).await,
                    $crate::TestDatabase::Postgres => $test(super::Pg).await,
                    $crate::TestDatabase::MySql => $test(super::My).await,
                }
            };
        }
        pub(crate) use on_store;

        async fn gets_the_store_of_its_backend<S: Store>(_store: S) {
            let name = super::test_name();
            assert!(name.contains(&format!("::{}::", S::BACKEND)), "{name}");
        }

        crate::backend_tests! {
            #[tokio::test]
            via crate::harness::tests::via::on_store;
            gets_the_store_of_its_backend,
        }
    }
}
