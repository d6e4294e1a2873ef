//! Retention purge: keys and results are kept for as long as a retry may come (hours to days),

use crate::{error::StoreError, store::Maintenance};
use std::time::{Duration, Instant};

/// What a purge did.
///
/// ```
/// use idempotency::maintenance::PurgeReport;
/// let report = PurgeReport::default();
/// assert_eq!(report.deleted, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Rows deleted.
    pub deleted: u64,
    /// DELETE statements that deleted at least one row.
    pub batches: u64,
    /// Wall time of the purge.
    pub elapsed: Duration,
}

/// A retention purge: the store, the batch size and an optional pause between batches.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), idempotency::StoreError> {
/// use idempotency::maintenance::Purge;
/// use std::time::Duration;
/// let purge = Purge::new(store).with_batch(500).with_pause(Duration::from_millis(5));
/// println!("{} rows would be deleted", purge.count().await?);
/// purge.run(|_| {}).await?;
/// # Ok(()) }
/// ```
///
/// Retention purge: keys and results are kept for as long as a retry may come (hours to days),
/// then deleted, so the table does not grow without bound.
///
/// The purge deletes `completed` and `failed` rows past their `expires_at` in bounded batches (one
/// short statement each, 1,000 rows by default), so it never holds long locks and requests keep
/// reserving keys while it runs. Several instances may purge at once: on PostgreSQL each batch
/// skips rows another purge has locked. `pending` and `needs_review` rows are never deleted.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo(store: idempotency::SqliteStore) -> Result<(), idempotency::StoreError> {
/// use idempotency::maintenance::Purge;
/// let report = Purge::new(store).with_batch(1_000).run(|deleted| eprintln!("{deleted} rows")).await?;
/// println!("deleted {} rows in {} batches", report.deleted, report.batches);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Purge<S> {
    store: S,
    batch: u32,
    pause: Duration,
}

impl<S: Maintenance> Purge<S> {
    /// A purge with batches of 1,000 rows and a 10 ms pause between batches.
    ///
    /// The pause lets writers waiting for SQLite's single write lock in (its busy handler retries
    /// after 1, 2, 5, 10 … ms); on PostgreSQL and MySQL it only spreads the load.
    pub fn new(store: S) -> Self {
        Self {
            store,
            batch: 1_000,
            pause: Duration::from_millis(10),
        }
    }

    /// Rows per DELETE statement (at least 1).
    pub fn with_batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The pause between batches, leaving room to other writers (SQLite has one writer at a
    /// time); zero yields to the runtime only.
    pub fn with_pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// How many rows a purge would delete now (a dry run).
    pub async fn count(&self) -> Result<u64, StoreError> {
        self.store.count_purgeable().await
    }

    /// Deletes batches until one deletes nothing, calling `progress` with the running total after
    /// each batch.
    pub async fn run(&self, mut progress: impl FnMut(u64)) -> Result<PurgeReport, StoreError> {
        let started = Instant::now();
        let mut report = PurgeReport::default();
        loop {
            let deleted = self.store.purge_batch(self.batch).await?;
            if deleted == 0 {
                break;
            }
            report.deleted += deleted;
            report.batches += 1;
            progress(report.deleted);
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            } else {
                tokio::task::yield_now().await;
            }
        }
        report.elapsed = started.elapsed();
        tracing::info!(
            deleted = report.deleted,
            batches = report.batches,
            "idempotency keys purged"
        );
        Ok(report)
    }
}
