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
    /// Whether the database could not be reached (pool timeout, refused or broken connection):
    /// the service should answer 503 and never run the work unprotected.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            StoreError::Database(
                sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::WorkerCrashed
            )
        )
    }
}
