//! The conformance suite every store must pass, published for stores written outside this
//! crate (feature `testing`).
//!
//! [`store_conformance!`] turns each scenario of the suites a store
//! asks for into a `#[tokio::test]` of its own. A suite per capability:
//!
//! | suite | the store implements | what it proves |
//! |---|---|---|
//! | `protocol` | [`Store`] | the article's protocol through [`Idempotency`]: replays, reused keys, releases after failures, panics and cancellations, takeover and fencing, the heartbeat, the replay read, racing duplicates executing once, failure counters counting every concurrent failure |
//! | `journal` | [`Journal`](crate::store::Journal) | the statements of durable steps and recovery, fenced by the lease token |
//! | `reserve_in_transaction` | [`ReserveInTransaction`](crate::store::ReserveInTransaction) | the single-transaction mode |
//! | `completion_signal` | [`CompletionSignal`](crate::store::CompletionSignal) | waiting for a pending key to settle |
//! | `maintenance` | [`Maintenance`](crate::store::Maintenance) | operator resolution and hand-back of parked keys, fenced on the row the operator saw, the key's history read back in order, plain local keys recording nothing, and keyset paging of listings visiting every row once |
//!
//! A scenario gets a fresh, migrated store from the function the macro is given (an `async fn`
//! returning `Option<S>`; `None` skips the test, e.g. when no database server is configured),
//! writes its business rows in the table `idempotency_conformance_effects`, which
//! [`prepare`] creates through [`Store::begin`], and counts them there. That table needs an SQL
//! database: any `sqlx` database whose connections execute plain SQL ([`BusinessTable`]).
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # mod demo {
//! use idempotency::{SqliteStore, Store};
//!
//! /// A fresh store on an empty database.
//! async fn fresh_store() -> Option<SqliteStore> {
//!     let store = SqliteStore::connect("sqlite::memory:").await.ok()?;
//!     store.migrate().await.ok()?;
//!     Some(store)
//! }
//!
//! // SQLite's one writer queues transactions: a stalled transaction blocks the retry.
//! idempotency::store::testing::store_conformance!(fresh_store, [protocol, journal, completion_signal], single_writer);
//! # }
//! ```

#[doc(hidden)]
pub mod completion_signal;
#[doc(hidden)]
pub mod failure_count;
#[doc(hidden)]
pub mod journal;
#[doc(hidden)]
pub mod maintenance;
#[doc(hidden)]
pub mod protocol;
#[doc(hidden)]
pub mod reserve_in_transaction;

use crate::{Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, Outcome, Store};
use futures_util::future::BoxFuture;
use serde_json::json;
use sqlx::Transaction;
use std::{future::Future, sync::Arc, time::Duration};

/// What a scenario may expect of the store beyond its traits, where correct stores differ.
///
/// ```
/// use idempotency::store::testing::Profile;
/// assert!(!Profile::default().single_writer);
/// assert!(Profile::single_writer().single_writer);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Profile {
    /// An open business transaction blocks every other write to the key table until it ends
    /// (SQLite's single writer): a retry of a stalled holder waits for it instead of taking
    /// its key over.
    pub single_writer: bool,
}

impl Profile {
    /// The profile of a store whose business transactions block each other's writes.
    pub fn single_writer() -> Self {
        Self {
            single_writer: true,
        }
    }
}

/// The business table of the scenarios, in the store's database: implemented for the `sqlx`
/// databases of this crate's features (PostgreSQL, MySQL and MariaDB, SQLite).
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # fn demo() {
/// fn has_a_table<DB: idempotency::store::testing::BusinessTable>() {}
/// has_a_table::<sqlx::Sqlite>();
/// # }
/// ```
pub trait BusinessTable: sqlx::Database {
    /// Creates `idempotency_conformance_effects` if it does not exist.
    fn create_effects_table<'t>(
        tx: &'t mut Transaction<'_, Self>,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>>;

    /// The business write: one row for `trial`, inside the business transaction.
    fn insert_effect<'t>(
        tx: &'t mut Transaction<'_, Self>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<(), sqlx::Error>>;

    /// How many rows `trial` has.
    fn count_effects<'t>(
        tx: &'t mut Transaction<'_, Self>,
        trial: &'t str,
    ) -> BoxFuture<'t, Result<i64, sqlx::Error>>;
}

/// [`BusinessTable`] for one `sqlx` database.
macro_rules! business_table {
    ($database:ty) => {
        impl BusinessTable for $database {
            fn create_effects_table<'t>(
                tx: &'t mut Transaction<'_, Self>,
            ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query(
                        "CREATE TABLE IF NOT EXISTS idempotency_conformance_effects \
                         (trial VARCHAR(200) NOT NULL)",
                    )
                    .persistent(false)
                    .execute(&mut **tx)
                    .await
                    .map(drop)
                })
            }

            fn insert_effect<'t>(
                tx: &'t mut Transaction<'_, Self>,
                trial: &'t str,
            ) -> BoxFuture<'t, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO idempotency_conformance_effects (trial) VALUES ('{}')",
                        literal(trial)
                    );
                    // Unnamed: the statements also run behind a transaction pooler.
                    sqlx::query(&sql)
                        .persistent(false)
                        .execute(&mut **tx)
                        .await
                        .map(drop)
                })
            }

            fn count_effects<'t>(
                tx: &'t mut Transaction<'_, Self>,
                trial: &'t str,
            ) -> BoxFuture<'t, Result<i64, sqlx::Error>> {
                Box::pin(async move {
                    let sql = format!(
                        "SELECT COUNT(*) FROM idempotency_conformance_effects WHERE trial = '{}'",
                        literal(trial)
                    );
                    sqlx::query_scalar::<_, i64>(&sql)
                        .persistent(false)
                        .fetch_one(&mut **tx)
                        .await
                })
            }
        }
    };
}

#[cfg(feature = "postgres")]
business_table!(sqlx::Postgres);
#[cfg(feature = "sqlite")]
business_table!(sqlx::Sqlite);
#[cfg(feature = "mysql")]
business_table!(sqlx::MySql);

/// `trial` as an SQL string literal's content: the scenarios' trial names are letters, digits,
/// `-` and `_` only, so nothing needs quoting.
fn literal(trial: &str) -> &str {
    assert!(
        trial
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
        "a trial name outside [A-Za-z0-9_-]: {trial:?}"
    );
    trial
}

/// Creates the scenarios' business table through `store`'s own transaction.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let store = idempotency::SqliteStore::connect("sqlite::memory:").await?;
/// idempotency::store::testing::prepare(&store).await;
/// # Ok(()) }
/// ```
pub async fn prepare<S>(store: &S)
where
    S: Store,
    S::Database: BusinessTable,
{
    let mut tx = store.begin().await.expect("begin the table's transaction");
    <S::Database as BusinessTable>::create_effects_table(&mut tx)
        .await
        .expect("create idempotency_conformance_effects");
    tx.commit().await.expect("commit the business table");
}

/// Runs one scenario on a store `open` returns (nothing when it returns `None`), after
/// [`prepare`]: what each test of [`store_conformance!`] does.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() {
/// use idempotency::{SqliteStore, Store, store::testing};
/// async fn fresh() -> Option<SqliteStore> {
///     let store = SqliteStore::connect("sqlite::memory:").await.ok()?;
///     store.migrate().await.ok()?;
///     Some(store)
/// }
/// testing::run(fresh, testing::Profile::single_writer(), |store, _| async move {
///     assert!(store.find(&idempotency::IdempotencyKey::new("u", "op", "k").unwrap()).await.unwrap().is_none());
/// })
/// .await;
/// # }
/// ```
pub async fn run<S, Opened, Scenario, Done>(
    open: impl FnOnce() -> Opened,
    profile: Profile,
    scenario: Scenario,
) where
    S: Store,
    S::Database: BusinessTable,
    Opened: Future<Output = Option<S>>,
    Scenario: FnOnce(S, Profile) -> Done,
    Done: Future<Output = ()>,
{
    let Some(store) = open().await else {
        return;
    };
    prepare(&store).await;
    scenario(store, profile).await;
}

/// The business write of the scenarios, inside the business transaction `tx`.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency::Store;
/// let mut tx = store.begin().await?;
/// idempotency::store::testing::insert_effect(&mut tx, "trial-1").await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub fn insert_effect<'t, DB: BusinessTable>(
    tx: &'t mut Transaction<'_, DB>,
    trial: &'t str,
) -> BoxFuture<'t, Result<(), sqlx::Error>> {
    DB::insert_effect(tx, trial)
}

/// How many committed business rows `trial` has.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) {
/// assert_eq!(idempotency::store::testing::count_effects(&store, "trial-1").await, 0);
/// # }
/// ```
pub async fn count_effects<S>(store: &S, trial: &str) -> i64
where
    S: Store,
    S::Database: BusinessTable,
{
    let mut tx = store.begin().await.expect("begin a read");
    let count = <S::Database as BusinessTable>::count_effects(&mut tx, trial)
        .await
        .expect("count effects");
    tx.rollback().await.expect("end the read");
    count
}

/// A local attempt of the operation `purchase`, keyed `key` in `scope`, for the request `body`.
///
/// ```
/// let attempt = idempotency::store::testing::attempt("user-1", "k1", serde_json::json!({"sku": "tea"}));
/// assert_eq!(attempt.key().operation(), "purchase");
/// ```
pub fn attempt(scope: &str, key: &str, body: serde_json::Value) -> Attempt {
    Attempt::new(
        IdempotencyKey::new(scope, "purchase", key).expect("a valid key"),
        Fingerprint::of_json(&body).expect("a JSON request"),
    )
}

/// A name no other test uses: `prefix` and a random suffix.
///
/// ```
/// let (a, b) = (idempotency::store::testing::unique("t"), idempotency::store::testing::unique("t"));
/// assert_ne!(a, b);
/// assert!(a.starts_with("t-"));
/// ```
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Runs a purchase that writes one effect for `trial` and returns `{"trial": …, "n": n}`.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(idem: idempotency::Idempotency<idempotency::SqliteStore>) {
/// use idempotency::store::testing::{attempt, purchase};
/// let a = attempt("user-1", "k1", serde_json::json!({}));
/// assert!(!purchase(&idem, &a, "k1", 1).await.unwrap().is_replayed());
/// # }
/// ```
pub async fn purchase<S>(
    idem: &Idempotency<S>,
    attempt: &Attempt,
    trial: &str,
    n: u64,
) -> Result<Outcome<serde_json::Value>, Error<sqlx::Error>>
where
    S: Store,
    S::Database: BusinessTable,
{
    idem.run(attempt, async |tx| {
        insert_effect(tx, trial).await?;
        Ok(json!({"trial": trial, "n": n}))
    })
    .await
}

/// Races `tasks` tasks on one new key, `trials` times, and asserts that each trial executed
/// once and wrote one effect; odd trials without the replay read, so both ways into the
/// reservation are raced. Needs [`prepare`] first.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) {
/// idempotency::store::testing::prepare(&store).await;
/// idempotency::store::testing::race(store, 20, 4).await;
/// # }
/// ```
pub async fn race<S>(store: S, trials: usize, tasks: usize)
where
    S: Store,
    S::Database: BusinessTable,
{
    let name = store_name::<S>();
    let (mut executed, mut replayed, mut in_progress) = (0, 0, 0);
    for trial in 0..trials {
        let idem = Idempotency::new(store.clone()).with_replay_first(trial % 2 == 0);
        let trial = format!("{}-{trial}", unique("race"));
        let barrier = Arc::new(tokio::sync::Barrier::new(tasks));
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let (idem, barrier, trial) = (idem.clone(), barrier.clone(), trial.clone());
                tokio::spawn(async move {
                    let a = attempt("racer", &trial, json!({"trial": trial}));
                    barrier.wait().await;
                    let t = trial.clone();
                    idem.run(&a, async move |tx| {
                        insert_effect(tx, &t).await?;
                        tokio::time::sleep(Duration::from_millis(3)).await;
                        Ok::<_, sqlx::Error>(json!({"trial": t}))
                    })
                    .await
                })
            })
            .collect();
        for handle in handles {
            match handle.await.expect("a racer") {
                Ok(Outcome::Executed(_)) => executed += 1,
                Ok(Outcome::Replayed(v)) => {
                    assert_eq!(v, json!({"trial": trial}));
                    replayed += 1
                }
                Err(Error::InProgress { .. }) => in_progress += 1,
                Err(other) => panic!("{name}: trial {trial}: unexpected {other:?}"),
            }
        }
        assert_eq!(
            count_effects(&store, &trial).await,
            1,
            "{name}: trial {trial}"
        );
    }
    assert_eq!(executed, trials, "exactly one execution per trial");
    eprintln!(
        "{name}: {trials} trials x {tasks} tasks: executed {executed}, replayed {replayed}, in progress {in_progress}"
    );
}

/// Polls `check` every 20 ms until it holds or `limit` has passed; whether it held.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// assert!(idempotency::store::testing::wait_until(Duration::from_secs(1), || async { true }).await);
/// # }
/// ```
pub async fn wait_until<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The store's type, for messages.
fn store_name<S>() -> &'static str {
    std::any::type_name::<S>()
}

/// Polls `future` at most `polls` times (yielding to the runtime between polls), then drops
/// it: its output if it finished.
async fn poll_then_drop<F: Future>(future: F, polls: u64) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx)));
        if let std::task::Poll::Ready(output) = polled.await {
            return Some(output);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// Turns the conformance suites a store asks for into tests: one `#[tokio::test]` per
/// scenario, in a module per suite (`protocol::replay_returns_the_stored_result` …).
///
/// `open` is an `async fn() -> Option<S>` (or a closure returning such a future) giving a
/// fresh, migrated store on an empty database for each test (`None` skips the test). The
/// suites: `protocol` ([`Store`]), `journal` ([`Journal`](crate::store::Journal)),
/// `reserve_in_transaction` ([`ReserveInTransaction`](crate::store::ReserveInTransaction)),
/// `completion_signal` ([`CompletionSignal`](crate::store::CompletionSignal)), `maintenance`
/// ([`Maintenance`](crate::store::Maintenance)). End with
/// `single_writer` for a store whose business transactions block each other's writes
/// ([`Profile::single_writer`]). The calling crate needs `tokio` with the `macros` and
/// `rt-multi-thread` features.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # mod demo {
/// use idempotency::{PgStore, Store};
///
/// async fn fresh_store() -> Option<PgStore> {
///     let url = std::env::var("TEST_POSTGRES_URL").ok()?;
///     let store = PgStore::connect(&url).await.ok()?;
///     store.migrate().await.ok()?;
///     Some(store)
/// }
///
/// idempotency::store::testing::store_conformance!(
///     fresh_store,
///     [protocol, journal, reserve_in_transaction, completion_signal]
/// );
/// # }
/// ```
#[doc(inline)]
pub use crate::__store_conformance as store_conformance;

#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance {
    ($open:expr, [$($suite:ident),+ $(,)?] $(,)?) => {
        $(
            $crate::__conformance_suite!(
                $suite,
                $open,
                $crate::store::testing::Profile::default()
            );
        )+
    };
    ($open:expr, [$($suite:ident),+ $(,)?], single_writer $(,)?) => {
        $(
            $crate::__conformance_suite!(
                $suite,
                $open,
                $crate::store::testing::Profile::single_writer()
            );
        )+
    };
}

/// The scenarios of each suite (for [`store_conformance!`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_suite {
    (protocol, $open:expr, $profile:expr) => {
        $crate::__conformance_tests!(
            protocol,
            $open,
            $profile,
            replay_returns_the_stored_result,
            another_payload_under_the_same_key_is_rejected,
            scopes_and_operations_are_independent,
            a_failing_operation_releases_the_key,
            a_panicking_operation_releases_the_key,
            a_cancelled_operation_releases_the_key,
            a_completed_key_is_never_released,
            an_expired_lease_is_taken_over_and_the_stale_holder_is_fenced,
            a_worker_stalled_inside_its_transaction_is_fenced,
            an_external_operation_is_not_taken_over,
            abandoned_external_work_stays_pending,
            an_expired_key_runs_anew,
            a_definitive_refusal_is_stored_and_replayed,
            an_unknown_external_outcome_parks_the_key,
            a_failed_external_run_keeps_its_key_pending,
            store_for_an_error_parks_the_key,
            release_for_an_error_lets_a_retry_run,
            work_lasting_five_leases_completes_once,
            migrate_is_idempotent_and_concurrent,
            the_replay_read_answers_only_completed_matching_rows,
            without_the_replay_read_the_insert_decides,
            the_default_replay_read_follows_the_recent_replays,
            a_cancelled_reservation_leaves_no_pending_key,
            work_borrowing_the_request_is_send_and_runs_once,
            concurrent_duplicates_execute_exactly_once,
            failures_are_counted_one_by_one,
            concurrent_failures_each_count,
        );
    };
    (journal, $open:expr, $profile:expr) => {
        $crate::__conformance_tests!(
            journal,
            $open,
            $profile,
            progress_is_fenced_and_the_request_kept_until_completion,
            progress_rolls_back_with_its_step,
            unknown_outcomes_are_counted_for_the_holder_only,
            a_claim_keeps_the_journal_and_fences_the_old_holder,
        );
    };
    (reserve_in_transaction, $open:expr, $profile:expr) => {
        $crate::__conformance_tests!(
            reserve_in_transaction,
            $open,
            $profile,
            racers_wait_for_the_holder_then_replay,
            the_key_is_invisible_until_commit_and_gone_after_rollback,
            a_duplicate_waits_at_most_the_wait,
            a_park_commits_a_row_of_its_own,
            external_work_reserves_on_its_own_commit,
        );
    };
    (maintenance, $open:expr, $profile:expr) => {
        $crate::__conformance_tests!(
            maintenance,
            $open,
            $profile,
            a_resolution_on_a_stale_page_is_refused,
            a_hand_back_returns_the_key_to_the_resumer,
            the_history_reads_back_in_order,
            pages_after_a_cursor_visit_every_row_once,
            a_plain_local_key_records_nothing,
        );
    };
    (completion_signal, $open:expr, $profile:expr) => {
        $crate::__conformance_tests!(
            completion_signal,
            $open,
            $profile,
            a_waiter_gets_the_completed_result,
            a_waiter_times_out_while_the_holder_works,
            a_release_settles_the_wait,
            another_requests_completion_settles_the_wait,
        );
    };
}

/// One test per scenario (for [`store_conformance!`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($suite:ident, $open:expr, $profile:expr, $($scenario:ident),+ $(,)?) => {
        mod $suite {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $scenario() {
                    $crate::store::testing::run($open, $profile, $crate::store::testing::$suite::$scenario)
                        .await;
                }
            )+
        }
    };
}
