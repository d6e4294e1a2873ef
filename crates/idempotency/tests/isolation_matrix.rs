//! The isolation matrix of `docs/isolation-matrix.md`, asserted: concurrent duplicates race one
//! fresh key (≥ 200 trials x ≥ 8 workers per cell). The naive guards must visibly fail in every
//! cell (proof that the race window is really exercised), each the way the article says; the
//! reserve-first protocol must run the work exactly once in every cell, with no deadlock, no
//! serialization failure and no other error.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

#[path = "../examples/isolation_matrix/matrix.rs"]
mod matrix;

use matrix::{Approach, Config, Engine, EngineReport, Level};

async fn measure(backend: Engine) -> Option<EngineReport> {
    let config = Config::default();
    assert!(config.trials >= 200 && config.workers >= 8);
    let report = matrix::run_backend(backend, config).await?;
    eprintln!("{}", matrix::render(&config, std::slice::from_ref(&report)));
    for cell in &report.cells {
        let c = &cell.counts;
        let name = format!("{} {} {:?}", cell.backend, cell.level, cell.approach);
        assert_eq!(c.trials, config.trials, "{name}");
        if cell.approach == Approach::ReserveFirst {
            assert_eq!(c.ran_twice, 0, "{name}: ran twice");
            assert_eq!(c.committed_twice, 0, "{name}: committed twice");
            assert_eq!(c.deadlocks, 0, "{name}: deadlocks");
            assert_eq!(
                c.serialization_failures, 0,
                "{name}: serialization failures"
            );
            assert_eq!(c.other_errors, 0, "{name}: {:?}", c.first_other_error);
            assert_eq!(c.clean, c.trials, "{name}: every trial runs exactly once");
        } else {
            assert!(
                c.failed_somewhere(),
                "{name}: the naive guard never failed, so the race window was not exercised: {c:?}"
            );
        }
    }
    Some(report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_matrix() {
    let Some(report) = measure(Engine::Postgres).await else {
        return;
    };
    for approach in [Approach::CheckThenInsert, Approach::ForUpdate] {
        // No lock on a row that does not exist: both proceed, and both commit.
        for level in [Level::ReadCommitted, Level::RepeatableRead] {
            let c = &report.cell(level, approach).counts;
            assert!(c.committed_twice > 0, "{level} {approach:?}: {c:?}");
        }
        // SSI: never two commits, but the loser gets a serialization failure to retry.
        let c = &report.cell(Level::Serializable, approach).counts;
        assert_eq!(c.committed_twice, 0, "SERIALIZABLE {approach:?}: {c:?}");
        assert!(
            c.serialization_failures > 0,
            "SERIALIZABLE {approach:?}: {c:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_matrix() {
    let Some(report) = measure(Engine::MariaDb).await else {
        return;
    };
    // READ COMMITTED takes no gap lock, and a plain read takes no lock at all: double commits.
    for (level, approach) in [
        (Level::ReadCommitted, Approach::CheckThenInsert),
        (Level::ReadCommitted, Approach::ForUpdate),
        (Level::RepeatableRead, Approach::CheckThenInsert),
    ] {
        let c = &report.cell(level, approach).counts;
        assert!(c.committed_twice > 0, "{level} {approach:?}: {c:?}");
    }
    // REPEATABLE READ + FOR UPDATE: shared gap locks, then both INSERT: deadlock.
    let c = &report
        .cell(Level::RepeatableRead, Approach::ForUpdate)
        .counts;
    assert!(c.deadlocks > 0, "REPEATABLE READ FOR UPDATE: {c:?}");
    assert_eq!(c.committed_twice, 0, "REPEATABLE READ FOR UPDATE: {c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_matrix() {
    let Some(report) = measure(Engine::Sqlite).await else {
        return;
    };
    let level = Level::SqliteSerializable;
    // The pre-check outside the write transaction: every worker passes it.
    let c = &report.cell(level, Approach::CheckThenInsert).counts;
    assert!(c.committed_twice > 0, "pre-check: {c:?}");
    // Deferred transactions: a reader cannot upgrade to the write lock another connection holds
    // (SQLITE_BUSY at once, deadlock avoidance) nor from a stale snapshot (SQLITE_BUSY_SNAPSHOT).
    let c = &report.cell(level, Approach::ForUpdate).counts;
    assert_eq!(c.committed_twice, 0, "deferred: {c:?}");
    assert!(
        c.deadlocks + c.serialization_failures > 0,
        "deferred: {c:?}"
    );
}
