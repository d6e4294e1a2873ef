//! [`MaintenanceWorker`]: the one background task a service starts to keep its keys healthy.

use crate::{
    maintenance::signals,
    operation::Operations,
    protocol::Idempotency,
    recovery::{NoResolver, Recovery, RecoveryReport, Resolver},
    store::{maintenance::KeyStats, Journal, KeyState, Maintenance},
};
use std::{
    collections::BTreeSet,
    fmt,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::{sync::oneshot, task::JoinHandle};

/// What a worker did over its life.
///
/// ```
/// use idempotency::maintenance::WorkerReport;
/// let report = WorkerReport::default();
/// assert_eq!(report.to_string(), "passes 0, failed passes 0, purged 0; released 0, completed 0, failed 0, parked 0, unknown 0, skipped 0, unregistered 0");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Passes run.
    pub passes: u64,
    /// Passes in which the store failed (retried at the next pass).
    pub failed_passes: u64,
    /// Expired keys purged.
    pub purged: u64,
    /// What recovery decided, summed.
    pub recovery: RecoveryReport,
}

impl fmt::Display for WorkerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "passes {}, failed passes {}, purged {}; {}",
            self.passes, self.failed_passes, self.purged, self.recovery
        )
    }
}

/// [`MaintenanceWorker`]: the one background task a service starts to keep its keys healthy.
///
/// Every pass it
/// 1. **resumes** keys whose holder went away ([`Recovery`]): durable operations continue from
///    their recovery point, abandoned local keys are released, other external keys go to the
///    resolver or are parked;
/// 2. **purges** expired keys in bounded batches (at most [`with_purge_batches`] batches of
///    [`with_purge_batch`] rows per pass, so a backlog never makes one pass long);
/// 3. logs what it did at `debug`, never at `info` on a quiet pass;
/// 4. every [`with_stats_interval`] (15 s by default), reads the table's statistics and sets the
///    gauges of [`signals`](crate::maintenance::signals) ([`export_stats`]).
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), idempotency::StoreError> {
/// use idempotency::{SqliteStore, Store, maintenance::MaintenanceWorker};
/// let store = SqliteStore::connect("sqlite://shop.db").await?;
/// store.migrate().await?;
/// let worker = MaintenanceWorker::new(store).spawn();
/// // … serve …
/// let report = worker.shutdown().await;
/// println!("{report}");
/// # Ok(()) }
/// ```
///
/// [`with_purge_batches`]: MaintenanceWorker::with_purge_batches
/// [`with_purge_batch`]: MaintenanceWorker::with_purge_batch
/// [`with_stats_interval`]: MaintenanceWorker::with_stats_interval
/// [`export_stats`]: MaintenanceWorker::export_stats
#[derive(Debug, Clone)]
pub struct MaintenanceWorker<S: Maintenance + Journal, R = NoResolver> {
    recovery: Recovery<S, R>,
    interval: Duration,
    purge_batch: u32,
    purge_batches: u32,
    stats_interval: Option<Duration>,
    /// The operations whose `idempotency_keys` gauges were set, to zero them when their rows go.
    exported: Arc<Mutex<BTreeSet<String>>>,
}

impl<S: Maintenance + Journal> MaintenanceWorker<S, NoResolver> {
    /// A worker with a pass every second, no durable operations and no resolver (abandoned
    /// external keys are parked), purging at most 10 batches of 1,000 keys per pass.
    pub fn new(store: S) -> Self {
        Self {
            recovery: Recovery::new(store),
            interval: Duration::from_secs(1),
            purge_batch: 1_000,
            purge_batches: 10,
            stats_interval: Some(Duration::from_secs(15)),
            exported: Arc::default(),
        }
    }
}

impl<S: Maintenance + Journal, R: Resolver> MaintenanceWorker<S, R> {
    /// Resumes the durable `operations` (see [`Recovery::with_operations`]).
    pub fn with_operations(mut self, engine: Idempotency<S>, operations: Operations<S>) -> Self {
        self.recovery = self.recovery.with_operations(engine, operations);
        self
    }

    /// Replaces the recovery job's settings (resolver, attempts, claim lease, retention …).
    pub fn with_recovery<R2: Resolver>(
        self,
        recovery: Recovery<S, R2>,
    ) -> MaintenanceWorker<S, R2> {
        MaintenanceWorker {
            recovery,
            interval: self.interval,
            purge_batch: self.purge_batch,
            purge_batches: self.purge_batches,
            stats_interval: self.stats_interval,
            exported: self.exported,
        }
    }

    /// The pause between passes (default 1 s).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Rows per purge statement (default 1,000, at least 1).
    pub fn with_purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = rows.max(1);
        self
    }

    /// Purge statements per pass at most (default 10; 0 turns purging off).
    pub fn with_purge_batches(mut self, batches: u32) -> Self {
        self.purge_batches = batches;
        self
    }

    /// How often the running worker reads [`Maintenance::stats`] and sets the gauges of
    /// [`signals`](crate::maintenance::signals) (default every 15 s, at the end of a pass;
    /// `None` turns it off). The statistics count the table's rows, so keep this well above a
    /// pass on a large table.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(store: idempotency::SqliteStore) {
    /// use idempotency::maintenance::MaintenanceWorker;
    /// use std::time::Duration;
    /// let worker = MaintenanceWorker::new(store).with_stats_interval(Some(Duration::from_secs(60)));
    /// # }
    /// ```
    pub fn with_stats_interval(mut self, every: Option<Duration>) -> Self {
        self.stats_interval = every;
        self
    }

    /// Reads [`Maintenance::stats`] and sets the gauges of
    /// [`signals`](crate::maintenance::signals): keys by operation and state, needs review,
    /// the oldest pending key's age, keys past their lease. Every state of every operation seen
    /// is set, to zero when it has no rows. Returns the statistics read.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency::StoreError> {
    /// use idempotency::{SqliteStore, Store, maintenance::MaintenanceWorker};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let stats = MaintenanceWorker::new(store).export_stats().await?;
    /// assert_eq!(stats.total(), 0);
    /// # Ok(()) }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    pub async fn export_stats(&self) -> Result<KeyStats, crate::StoreError> {
        let stats = self.recovery.store().stats().await?;
        let mut exported = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        exported.extend(stats.counts.iter().map(|c| c.operation.clone()));
        for operation in exported.iter() {
            for state in KeyState::ALL {
                let count = stats
                    .counts
                    .iter()
                    .find(|c| c.state == state && &c.operation == operation)
                    .map_or(0, |c| c.count);
                metrics::gauge!(
                    signals::KEYS,
                    signals::LABEL_OPERATION => operation.clone(),
                    signals::LABEL_STATE => state.as_str()
                )
                .set(count as f64);
            }
        }
        metrics::gauge!(signals::NEEDS_REVIEW).set(stats.in_state(KeyState::NeedsReview) as f64);
        metrics::gauge!(signals::OLDEST_PENDING_SECONDS).set(
            stats
                .oldest_pending_age
                .map_or(0.0, |age| age.as_secs_f64()),
        );
        metrics::gauge!(signals::PAST_LEASE).set(stats.expired_leases as f64);
        Ok(stats)
    }

    /// One pass: recovery, then a bounded purge. Returns what it did; a store failure is the
    /// pass's error (the next pass tries again).
    pub async fn run_once(&self) -> Result<WorkerReport, crate::StoreError> {
        let recovered = self.recovery.run_once().await?;
        let mut purged = 0;
        for _ in 0..self.purge_batches {
            let deleted = self.recovery.store().purge_batch(self.purge_batch).await?;
            purged += deleted;
            if deleted < u64::from(self.purge_batch) {
                break;
            }
        }
        Ok(WorkerReport {
            passes: 1,
            failed_passes: 0,
            purged,
            recovery: recovered,
        })
    }

    /// Starts the worker in a task of its own. Stop it with [`WorkerHandle::shutdown`] (which
    /// finishes the pass under way); dropping the handle aborts it, so bind it for as long as
    /// the service runs:
    ///
    /// ```
    /// # #![deny(unused_must_use)]
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency::StoreError> {
    /// use idempotency::{SqliteStore, Store, maintenance::MaintenanceWorker};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let worker = MaintenanceWorker::new(store).spawn();
    /// // … serve …
    /// worker.shutdown().await;
    /// # Ok(()) }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    ///
    /// Written as a statement, the handle is dropped at once and the worker never runs a pass;
    /// the compiler warns (here, with the warning denied, it refuses):
    ///
    /// ```compile_fail
    /// # #![deny(unused_must_use)]
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency::StoreError> {
    /// use idempotency::{SqliteStore, Store, maintenance::MaintenanceWorker};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// MaintenanceWorker::new(store).spawn();
    /// # Ok(()) }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # compile_error!("needs the sqlite feature");
    /// ```
    #[must_use = "dropping the handle aborts the worker at once: bind it (`let worker = …spawn();`) and call `shutdown` when the service stops"]
    pub fn spawn(self) -> WorkerHandle
    where
        R: Clone,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut total = WorkerReport::default();
            let mut stopped = std::pin::pin!(stopped);
            let mut stats_read: Option<Instant> = None;
            loop {
                match self.run_once().await {
                    Ok(pass) => {
                        total.passes += 1;
                        total.purged += pass.purged;
                        total.recovery.add(&pass.recovery);
                        tracing::debug!(report = %pass, "idempotency maintenance pass");
                    }
                    Err(error) => {
                        total.passes += 1;
                        total.failed_passes += 1;
                        tracing::warn!(%error, "idempotency maintenance pass failed; retrying at the next one");
                    }
                }
                if self.stats_due(&mut stats_read) {
                    match self.export_stats().await {
                        Ok(stats) => tracing::debug!(
                            total = stats.total(),
                            expired_leases = stats.expired_leases,
                            purgeable = stats.purgeable,
                            "idempotency keys"
                        ),
                        Err(error) => {
                            tracing::warn!(%error, "idempotency key statistics unavailable")
                        }
                    }
                }
                tokio::select! {
                    _ = &mut stopped => return total,
                    _ = tokio::time::sleep(self.interval) => {}
                }
            }
        });
        WorkerHandle {
            stop: Some(stop),
            task: Some(task),
        }
    }
}

impl<S: Maintenance + Journal, R> MaintenanceWorker<S, R> {
    /// Whether the statistics are due at the end of this pass (the first pass always reads
    /// them); notes the read in `last`.
    fn stats_due(&self, last: &mut Option<Instant>) -> bool {
        let Some(every) = self.stats_interval else {
            return false;
        };
        if last.is_some_and(|read| read.elapsed() < every) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

/// A running [`MaintenanceWorker`].
#[derive(Debug)]
#[must_use = "dropping the handle aborts the worker at once: keep it for as long as the service runs"]
pub struct WorkerHandle {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<WorkerReport>>,
}

impl WorkerHandle {
    /// Stops the worker after the pass under way and returns what it did.
    pub async fn shutdown(mut self) -> WorkerReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.unwrap_or_default(),
            None => WorkerReport::default(),
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
