//! Why the layer refused a request, and the problem response for each reason.

use crate::{header::KeyHeaderError, problem::Problem};
use idempotency::StoreError;
use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
use std::time::Duration;

/// Why the layer answered instead of the handler (or after it, for [`LeaseLost`](Self::LeaseLost)).
///
/// Each maps to an RFC 9457 [`Problem`] of one [`ProblemType`].
///
/// ```
/// use idempotency_http::IdempotencyRejection;
/// let problem = IdempotencyRejection::KeyReused.to_problem();
/// assert_eq!(problem.status, 422);
/// assert_eq!(problem.type_uri, "tag:idempotency,2026:problems/key-reused");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The route requires a key and the request has none (400).
    #[error("this request needs an Idempotency-Key header")]
    KeyMissing,
    /// The header is malformed, repeated or too long (400).
    #[error(transparent)]
    KeyInvalid(#[from] KeyHeaderError),
    /// No scope for the request and the layer is configured to reject (401).
    #[error("no scope (authenticated user or tenant) for this request")]
    ScopeMissing,
    /// The request body is larger than the limit (413); nothing was reserved.
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge {
        /// The layer's limit in bytes.
        limit: usize,
    },
    /// A JSON content type with a body that is not JSON (400); nothing was reserved.
    #[error("the request body is not valid JSON: {0}")]
    BodyNotJson(#[source] serde_json::Error),
    /// The request body could not be read (400).
    #[error("the request body could not be read: {0}")]
    BodyUnreadable(#[source] BoxError),
    /// The key was used before with a different request (422).
    #[error("the idempotency key was already used with a different request")]
    KeyReused,
    /// A request with the same key is still running (409 with `Retry-After`).
    #[error("a request with this idempotency key is still in progress")]
    InProgress {
        /// When to retry.
        retry_after: Duration,
    },
    /// The key is parked for an operator (409).
    #[error("the operation for this idempotency key needs review by an operator")]
    NeedsReview,
    /// The lease was lost while the handler ran; its work was rolled back (409).
    #[error("the lease on the idempotency key was lost; the work was rolled back")]
    LeaseLost,
    /// The store cannot be reached (503); the handler was not run.
    #[error("the idempotency store is unavailable: {0}")]
    StoreUnavailable(#[source] StoreError),
    /// Anything else (500): a corrupt stored response, a store failure that is not an outage, a
    /// transaction held past the response (see [`InternalError`]).
    #[error("internal error: {0}")]
    Internal(#[from] InternalError),
}

/// A body or handler error, as `http-body` and tower pass them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What went wrong behind an [`IdempotencyRejection::Internal`] (500), with its source.
///
/// ```
/// use idempotency_http::{IdempotencyRejection, InternalError};
/// let rejection = IdempotencyRejection::from(InternalError::TransactionKept);
/// assert_eq!(rejection.to_problem().status, 500);
/// assert!(matches!(rejection, IdempotencyRejection::Internal(InternalError::TransactionKept)));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InternalError {
    /// The scope or operation the layer derived is not a valid key part.
    #[error("invalid scope or operation: {0}")]
    InvalidKey(#[source] idempotency::key::InvalidKey),
    /// A store failure that is not an outage (a corrupt row, a failed migration …).
    #[error("store failure: {0}")]
    Store(#[source] StoreError),
    /// A stored result could not be encoded or decoded.
    #[error("stored result unreadable: {0}")]
    StoredResult(#[source] serde_json::Error),
    /// The task that ran the request ended without an answer (the runtime shut down).
    #[error("the request's task ended: {0}")]
    TaskEnded(#[source] tokio::task::JoinError),
    /// The engine answered with a reservation this version of the layer does not know.
    #[error("a reservation this layer does not know")]
    UnknownReservation,
    /// The handler still held its [`IdempotentTx`](crate::IdempotentTx) after it answered.
    #[error("the handler kept IdempotentTx past its response")]
    TransactionKept,
    /// The handler's response body failed while it was being read for storing.
    #[error("response body: {0}")]
    ResponseBody(#[source] BoxError),
    /// Any other engine error.
    #[error(transparent)]
    Engine(idempotency::Error),
}

impl IdempotencyRejection {
    /// The kind of problem this rejection is answered with.
    ///
    /// ```
    /// use idempotency_http::IdempotencyRejection;
    /// use idempotency_wire::ProblemType;
    /// assert_eq!(IdempotencyRejection::KeyReused.problem_type(), ProblemType::KeyReused);
    /// ```
    pub fn problem_type(&self) -> ProblemType {
        use IdempotencyRejection::*;
        match self {
            KeyMissing => ProblemType::KeyMissing,
            KeyInvalid(_) => ProblemType::KeyInvalid,
            ScopeMissing => ProblemType::ScopeMissing,
            BodyTooLarge { .. } => ProblemType::BodyTooLarge,
            BodyNotJson(_) => ProblemType::BodyNotJson,
            BodyUnreadable(_) => ProblemType::BodyUnreadable,
            KeyReused => ProblemType::KeyReused,
            InProgress { .. } => ProblemType::InProgress,
            NeedsReview => ProblemType::NeedsReview,
            LeaseLost => ProblemType::LeaseLost,
            StoreUnavailable(_) => ProblemType::StoreUnavailable,
            Internal(_) => ProblemType::Internal,
        }
    }

    /// The problem document for this rejection, its `type` under
    /// [`DEFAULT_PROBLEM_BASE`](idempotency_wire::DEFAULT_PROBLEM_BASE).
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// # use std::time::Duration;
    /// let p = IdempotencyRejection::InProgress { retry_after: Duration::from_millis(300) }.to_problem();
    /// assert_eq!(p.status, 409);
    /// assert_eq!(p.retry_after, Some(Duration::from_millis(300)));
    /// ```
    pub fn to_problem(&self) -> Problem {
        self.to_problem_under(DEFAULT_PROBLEM_BASE)
    }

    fn to_problem_under(&self, base: &str) -> Problem {
        let problem = Problem::of(self.problem_type(), base).with_detail(self.to_string());
        match self.retry_after() {
            Some(retry_after) => problem.with_retry_after(retry_after),
            None => problem,
        }
    }

    /// When a retry may succeed, for the refusals a retry can outlast: 409 `in-progress` (the
    /// hint given), 409 `lease-lost` (another worker carries the operation on: 1 s) and 503
    /// (1 s). Sent as `Retry-After` (whole seconds) and
    /// [`Retry-After-Ms`](idempotency_wire::header::RETRY_AFTER_MS). The others are final for this request.
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// # use std::time::Duration;
    /// let busy = IdempotencyRejection::InProgress { retry_after: Duration::from_millis(40) };
    /// assert_eq!(busy.retry_after(), Some(Duration::from_millis(40)));
    /// assert_eq!(IdempotencyRejection::KeyReused.retry_after(), None);
    /// assert_eq!(IdempotencyRejection::NeedsReview.retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        use IdempotencyRejection::*;
        match self {
            InProgress { retry_after } => Some(*retry_after),
            LeaseLost | StoreUnavailable(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The problem response: status, `application/problem+json`, and for a rejection with a
    /// [`retry_after`](Self::retry_after) both `Retry-After` (whole seconds, at least 1) and
    /// `Retry-After-Ms` (milliseconds, at least 1).
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// # use std::time::Duration;
    /// let busy = IdempotencyRejection::InProgress { retry_after: Duration::from_millis(40) };
    /// let response = busy.to_response();
    /// assert_eq!(response.status(), 409);
    /// assert_eq!(response.headers()["retry-after"], "1");
    /// assert_eq!(response.headers()["retry-after-ms"], "40");
    /// ```
    pub fn to_response(&self) -> http::Response<axum::body::Body> {
        self.to_response_under(DEFAULT_PROBLEM_BASE)
    }

    /// [`to_response`](Self::to_response) with the problem `type` under another base URI (see
    /// [`IdempotencyLayer::with_problem_base`](crate::IdempotencyLayer::with_problem_base)).
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// let response = IdempotencyRejection::KeyReused.to_response_under("https://errors.example.com/");
    /// assert_eq!(response.status(), 422);
    /// ```
    pub fn to_response_under(&self, base: &str) -> http::Response<axum::body::Body> {
        let mut response = self.to_problem_under(base).into_http_response();
        if let Some(retry_after) = self.retry_after() {
            let millis = u64::try_from(retry_after.as_millis())
                .unwrap_or(u64::MAX)
                .max(1);
            response.headers_mut().insert(
                idempotency_wire::header::RETRY_AFTER_MS,
                http::HeaderValue::from(millis),
            );
        }
        response
    }

    /// The `outcome` label counted in `idempotency_requests_total` for this rejection.
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// assert_eq!(IdempotencyRejection::KeyReused.outcome(), "reused");
    /// assert_eq!(IdempotencyRejection::KeyMissing.outcome(), "rejected");
    /// ```
    pub fn outcome(&self) -> &'static str {
        use IdempotencyRejection::*;
        match self {
            InProgress { .. } | NeedsReview | LeaseLost => crate::metrics::CONFLICT,
            KeyReused => crate::metrics::REUSED,
            StoreUnavailable(_) => crate::metrics::UNAVAILABLE,
            Internal(_) => crate::metrics::FAILED,
            _ => crate::metrics::REJECTED,
        }
    }

    /// Classifies an engine error: an outage or contention is 503, other store failures 500.
    ///
    /// ```
    /// # use idempotency_http::IdempotencyRejection;
    /// let outage = idempotency::Error::Store(sqlx::Error::PoolTimedOut.into());
    /// assert_eq!(IdempotencyRejection::from_engine(outage).to_problem().status, 503);
    /// let corrupt = idempotency::Error::Store(idempotency::StoreError::Corrupt("x".into()));
    /// assert_eq!(IdempotencyRejection::from_engine(corrupt).to_problem().status, 500);
    /// ```
    pub fn from_engine(error: idempotency::Error) -> Self {
        use idempotency::Error;
        match error {
            Error::KeyReused => Self::KeyReused,
            Error::InProgress { retry_after } => Self::InProgress { retry_after },
            Error::NeedsReview => Self::NeedsReview,
            Error::LeaseLost => Self::LeaseLost,
            Error::InvalidKey(e) => InternalError::InvalidKey(e).into(),
            Error::Store(e) if e.is_unavailable() || matches!(e, StoreError::Contention(_)) => {
                Self::StoreUnavailable(e)
            }
            Error::Store(e) => InternalError::Store(e).into(),
            Error::Serialization(e) => InternalError::StoredResult(e).into(),
            Error::Operation(never) => match never {},
            other => InternalError::Engine(other).into(),
        }
    }
}

impl axum::response::IntoResponse for IdempotencyRejection {
    fn into_response(self) -> axum::response::Response {
        self.to_response()
    }
}
