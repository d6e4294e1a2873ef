//! Errors a caller can match on.

use crate::key::InvalidKey;
use std::convert::Infallible;
use std::time::Duration;

/// Why a protected call did not produce an [`Outcome`](crate::Outcome).
///
/// `E` is the error type of the caller's own work; it appears only in [`Error::Operation`].
///
/// | variant | meaning | HTTP |
/// |---|---|---|
/// | `InvalidKey` | the key is malformed | 400 |
/// | `KeyReused` | same key, different request | 422 |
/// | `InProgress` | another call holds the key | 409 + `Retry-After` |
/// | `NeedsReview` | the key is parked for a human | 409 |
/// | `LeaseLost` | our lease was taken over; our work was rolled back | 409 |
/// | `Operation` | the work failed; the key was released (or parked) | the work's own |
/// | `Store` / `Serialization` | infrastructure | 503 / 500 |
///
/// ```
/// use idempotency::Error;
/// let err: Error<std::io::Error> = Error::KeyReused;
/// assert!(matches!(err, Error::KeyReused));
/// assert!(err.is_client_error());
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error<E = Infallible> {
    /// The key is malformed.
    #[error(transparent)]
    InvalidKey(#[from] InvalidKey),
    /// The key was used before with a different request: a client error, not a retry.
    #[error("the idempotency key was already used with a different request")]
    KeyReused,
    /// Another call holds the key and has not finished; retry after `retry_after`.
    #[error(
        "a request with this idempotency key is still in progress; retry after {retry_after:?}"
    )]
    InProgress {
        /// How long the caller should wait before retrying.
        retry_after: Duration,
    },
    /// The key is parked as *needs review*: an external effect may or may not have happened, and a
    /// human (or `idem keys resolve`) must decide.
    #[error("the operation for this idempotency key needs review by an operator")]
    NeedsReview,
    /// Our lease expired and another worker took the key over; our business transaction was rolled
    /// back, so nothing we wrote is kept.
    #[error("the lease on the idempotency key was lost; the work was rolled back")]
    LeaseLost,
    /// The caller's work failed; its transaction was rolled back and the key released (or parked).
    #[error("the protected operation failed: {0}")]
    Operation(E),
    /// The store failed (database unreachable, constraint, I/O …).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The result could not be serialised or a stored one could not be read back.
    #[error("could not (de)serialise the stored result: {0}")]
    Serialization(#[source] serde_json::Error),
}

impl<E> Error<E> {
    /// Whether the error is the client's to fix or wait out (400/409/422), as opposed to a failure
    /// of the work or the infrastructure.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey(_)
                | Error::KeyReused
                | Error::InProgress { .. }
                | Error::NeedsReview
                | Error::LeaseLost
        )
    }
}

impl Error<Infallible> {
    /// Re-types an error that cannot be [`Error::Operation`] for any operation error type.
    ///
    /// ```
    /// use idempotency::Error;
    /// let e: Error<String> = Error::KeyReused.widen();
    /// assert!(matches!(e, Error::KeyReused));
    /// ```
    pub fn widen<E>(self) -> Error<E> {
        match self {
            Error::InvalidKey(e) => Error::InvalidKey(e),
            Error::KeyReused => Error::KeyReused,
            Error::InProgress { retry_after } => Error::InProgress { retry_after },
            Error::NeedsReview => Error::NeedsReview,
            Error::LeaseLost => Error::LeaseLost,
            Error::Operation(never) => match never {},
            Error::Store(e) => Error::Store(e),
            Error::Serialization(e) => Error::Serialization(e),
        }
    }
}

/// A failure inside a [`Store`](crate::store::Store).
///
/// ```
/// use idempotency::StoreError;
/// let err = StoreError::Corrupt("state 'banana'".into());
/// assert!(err.to_string().contains("banana"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database answered with an error or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored row holds something this version cannot read.
    #[error("corrupt idempotency row: {0}")]
    Corrupt(String),
    /// The reservation kept changing under us (a key reserved and released over and over); gave up.
    #[error("the idempotency key kept changing during reservation; gave up after {0} attempts")]
    Contention(u32),
    /// A statement of a schema migration failed; nothing after it was applied.
    #[error("migration {version} ({description}) failed")]
    Migration {
        /// The migration's version.
        version: i64,
        /// What the migration does.
        description: &'static str,
        /// The database's answer.
        source: sqlx::Error,
    },
    /// Another process held the migration lock for longer than `migrate` waits.
    #[error("could not take the migration lock within {waited:?}")]
    MigrationLocked {
        /// How long `migrate` waited.
        waited: Duration,
    },
}

impl StoreError {
    /// Whether the database could not be reached (pool timeout, refused or broken connection)
    /// or has no room to write (a full disk): the service should answer 503 and never run the
    /// work unprotected. See [`is_unavailable_error`] for a bare `sqlx::Error`.
    ///
    /// ```
    /// use idempotency::StoreError;
    /// assert!(StoreError::Database(sqlx::Error::PoolTimedOut).is_unavailable());
    /// assert!(!StoreError::Database(sqlx::Error::RowNotFound).is_unavailable());
    /// ```
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Database(error) if is_unavailable_error(error))
    }
}

/// Whether a database error means "not now" rather than "never": a retry may succeed.
///
/// - The database could not be reached: a pool timeout, a refused or broken connection, a
///   crashed SQLite worker, or a server-side connection error (SQLSTATE class `08`, which
///   includes Galera's `1047 WSREP has not yet prepared node for application use` and MariaDB's
///   `1053` server shutdown).
/// - The server is going away or not yet serving: PostgreSQL's `57P01` (terminated by an
///   administrator, as on a fast shutdown), `57P02` (crash shutdown), `57P03` (cannot connect
///   now, as while starting or recovering) and `25006` (a write on a standby not yet promoted);
///   MariaDB's `1290` (`--read-only`) and `1927` (connection killed).
/// - It has no room to write: SQLite `SQLITE_FULL`, PostgreSQL `disk_full` 53100. MariaDB
///   reports a full disk with the generic SQLSTATE `HY000` and no distinct error number for
///   every engine, so it is not recognised.
/// - It rolled the transaction back to break a deadlock, a serialization conflict or a Galera
///   certification conflict (SQLSTATE 40001, which MariaDB's deadlock 1213 also reports, and
///   PostgreSQL's 40P01), or gave up waiting for a lock (MariaDB's `1205`).
///
/// None of these is read as "the work did not happen": a key is released only where the
/// caller knows its transaction rolled back.
///
/// ```
/// assert!(idempotency::store::is_unavailable_error(&sqlx::Error::PoolClosed));
/// assert!(!idempotency::store::is_unavailable_error(&sqlx::Error::RowNotFound));
/// ```
pub fn is_unavailable_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            is_transient_sqlstate(db.code().as_deref()) || is_transient_mysql_error(db.as_ref())
        }
        _ => false,
    }
}

/// The SQLSTATEs (and SQLite's extended code 13) that mean "not now".
fn is_transient_sqlstate(code: Option<&str>) -> bool {
    let Some(code) = code else { return false };
    code.starts_with("08")
        || matches!(
            code,
            "13" | "53100" | "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "25006"
        )
}

/// MariaDB's error numbers that mean "not now" under a generic SQLSTATE (`HY000`, `70100`).
#[cfg(feature = "mysql")]
fn is_transient_mysql_error(error: &dyn sqlx::error::DatabaseError) -> bool {
    error
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|e| matches!(e.number(), 1047 | 1053 | 1205 | 1290 | 1927))
}

#[cfg(not(feature = "mysql"))]
fn is_transient_mysql_error(_: &dyn sqlx::error::DatabaseError) -> bool {
    false
}

/// A boxed error from a step's own work.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a step, or a whole durable run, did not go on.
///
/// Inside an operation, propagate these with `?`, or match the ones your operation can answer
/// (a declined call, a step not done) and [`fail`](crate::durable::Steps::fail) the operation.
///
/// ```
/// use idempotency::durable::StepError;
/// let error = StepError::NotDone { step: "charge".into() };
/// assert!(error.to_string().contains("charge"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// Another worker (a retry, the resumer) holds the key now: this step was rolled back and this
    /// run must stop.
    #[error("the lease on the idempotency key was lost; the step was rolled back")]
    LeaseLost,
    /// An outside outcome is unknown: the key stays pending, and the resumer (or a retry after
    /// `retry_after`) carries the operation on.
    #[error("the operation is pending ({reason}); it is carried on in the background")]
    Pending {
        /// When to look again.
        retry_after: Duration,
        /// What is unknown.
        reason: String,
    },
    /// The key was parked as *needs review* for an operator.
    #[error("the operation needs review: {reason}")]
    Parked {
        /// Why.
        reason: String,
    },
    /// A local step's own work failed (its transaction was rolled back).
    #[error("step {step} failed: {source}")]
    Local {
        /// The step.
        step: String,
        /// Its error.
        #[source]
        source: BoxError,
    },
    /// An outside call was declined for good.
    #[error("step {step} was declined: {reason}")]
    Declined {
        /// The step.
        step: String,
        /// The provider's reason.
        reason: String,
    },
    /// An outside call did not take effect after [`StepPolicy::calls_per_step`](crate::durable::StepPolicy::calls_per_step) calls.
    #[error("step {step} did not take effect")]
    NotDone {
        /// The step.
        step: String,
    },
    /// The request is larger than [`MAX_STORED_REQUEST`](crate::durable::MAX_STORED_REQUEST).
    #[error("the request has {size} bytes; a durable operation stores at most {limit}")]
    RequestTooLarge {
        /// Its canonical size.
        size: usize,
        /// The cap.
        limit: usize,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A step's output or the response could not be (de)serialised.
    #[error("could not (de)serialise a step's output: {0}")]
    Serialization(#[from] serde_json::Error),
}

impl StepError {
    /// Whether this is the database saying "not now" (unavailable, a deadlock, a serialization
    /// failure), from the store or from a local step's own queries: nothing was decided, and the
    /// same work may be tried again.
    ///
    /// ```
    /// use idempotency::durable::StepError;
    /// let outage = StepError::Local { step: "order".into(), source: Box::new(sqlx::Error::PoolTimedOut) };
    /// assert!(outage.is_unavailable());
    /// assert!(!StepError::NotDone { step: "charge".into() }.is_unavailable());
    /// ```
    pub fn is_unavailable(&self) -> bool {
        match self {
            StepError::Store(store) => store.is_unavailable(),
            StepError::Local { source, .. } => {
                source
                    .downcast_ref::<sqlx::Error>()
                    .is_some_and(is_unavailable_error)
                    || source
                        .downcast_ref::<StoreError>()
                        .is_some_and(StoreError::is_unavailable)
            }
            _ => false,
        }
    }
}

impl From<sqlx::Error> for StepError {
    fn from(error: sqlx::Error) -> Self {
        StepError::Store(error.into())
    }
}

/// Why a durable operation ([`Idempotency::perform`](crate::Idempotency::perform)) did not produce its response.
///
/// | variant | the key | what a client should do |
/// |---|---|---|
/// | `Reserve` | untouched | as the inner [`Error`] says (422, 409, needs review, 503) |
/// | `Released` | released: nothing took effect | fix the request, or retry |
/// | `Pending` | pending: an outside outcome is unknown; the resumer carries it on | retry after `retry_after` (409 meanwhile, then the stored response) |
/// | `Parked` | needs review | wait for an operator |
/// | `LeaseLost` | held by another worker that carries it on | retry later |
/// | `Interrupted` | pending until its lease ends, then resumed | retry later |
///
/// ```
/// use idempotency::durable::PerformError;
/// use std::time::Duration;
/// let error = PerformError::Pending { retry_after: Duration::from_secs(1), reason: "charge: timeout".into() };
/// assert!(error.to_string().contains("background"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerformError {
    /// The reservation refused (the key was used with another request, is in progress, is
    /// parked) or the store failed before anything ran.
    #[error(transparent)]
    Reserve(Error),
    /// The operation failed before any step took effect: the key was released.
    #[error("the operation failed and its key was released: {0}")]
    Released(#[source] StepError),
    /// An outside outcome is unknown: the key stays pending and the resumer carries the operation
    /// on; a retry after `retry_after` gets 409 until it is settled, then the stored response.
    #[error("the operation is pending ({reason}); it is carried on in the background")]
    Pending {
        /// When to look again.
        retry_after: Duration,
        /// What is unknown.
        reason: String,
    },
    /// The key was parked as *needs review*.
    #[error("the operation needs review: {reason}")]
    Parked {
        /// Why.
        reason: String,
    },
    /// Another worker (a retry, the resumer) took the key over and carries the operation on.
    #[error("another worker took the operation over")]
    LeaseLost,
    /// The operation stopped after some steps took effect (the database failed, a step's own
    /// work failed and the failure could not be recorded): the key stays pending, is never
    /// released, and is resumed once its lease ends.
    #[error("the operation was interrupted and will be resumed: {0}")]
    Interrupted(#[source] StepError),
}

impl PerformError {
    /// The error for what [`Steps::after_error`] returned.
    pub(crate) fn stopped(error: StepError) -> Self {
        match error {
            StepError::LeaseLost => PerformError::LeaseLost,
            StepError::Pending {
                retry_after,
                reason,
            } => PerformError::Pending {
                retry_after,
                reason,
            },
            StepError::Parked { reason } => PerformError::Parked { reason },
            other => PerformError::Interrupted(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_transient_sqlstate;

    #[test]
    fn sqlstates_of_a_failover_a_rejoin_or_a_pooler_are_not_now() {
        for code in [
            "08000", "08006", "08S01", "57P01", "57P02", "57P03", "25006", "40001", "40P01",
            "53100", "13",
        ] {
            assert!(is_transient_sqlstate(Some(code)), "{code}");
        }
        for code in ["23505", "42P01", "22001", "HY000", "25P02"] {
            assert!(!is_transient_sqlstate(Some(code)), "{code}");
        }
        assert!(!is_transient_sqlstate(None));
    }
}
