//! What one logical operation went through: its key, every attempt, whether the answer was a
//! replay, and why the middleware stopped ([`Outcome`]); and a [`Probe`] to read it even when
//! the operation ends in an error.

use idempotency_wire::ProblemType;
use reqwest::StatusCode;
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

/// What one attempt (one request on the wire) ended with.
///
/// ```
/// use idempotency_client::{AttemptResult, TransportKind};
/// let refused = AttemptResult::Transport { kind: TransportKind::Connect, message: "connection refused".into() };
/// assert_eq!(refused.status(), None);
/// assert_eq!(AttemptResult::Status(reqwest::StatusCode::CONFLICT).status(), Some(reqwest::StatusCode::CONFLICT));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptResult {
    /// The server answered with this status.
    Status(StatusCode),
    /// No answer: the connection failed, timed out or broke.
    Transport {
        /// What failed.
        kind: TransportKind,
        /// The error, as text.
        message: String,
    },
}

impl AttemptResult {
    /// The status, for an answer.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            AttemptResult::Status(status) => Some(*status),
            AttemptResult::Transport { .. } => None,
        }
    }
}

/// The kind of a transport failure.
///
/// ```
/// use idempotency_client::TransportKind;
/// assert!(TransportKind::Connect.request_not_sent());
/// assert!(!TransportKind::Timeout.request_not_sent());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportKind {
    /// The connection could not be made: the request was not sent.
    Connect,
    /// No answer in time (the request's timeout, or the operation's deadline): the server may
    /// have run it.
    Timeout,
    /// The connection broke while the request was sent or its answer awaited (reset, closed,
    /// incomplete message): the server may have run it.
    Request,
    /// The answer's body broke while the middleware read it (for a 409 or 422 it inspects).
    Body,
    /// Anything else (a redirect loop, a builder error): never retried.
    Other,
}

impl TransportKind {
    /// Whether the request certainly never reached the server.
    pub fn request_not_sent(self) -> bool {
        self == TransportKind::Connect
    }

    pub(crate) fn of(error: &reqwest::Error) -> Self {
        if error.is_connect() {
            TransportKind::Connect
        } else if error.is_timeout() {
            TransportKind::Timeout
        } else if error.is_request() {
            TransportKind::Request
        } else if error.is_body() || error.is_decode() {
            TransportKind::Body
        } else {
            TransportKind::Other
        }
    }
}

/// One attempt of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttemptRecord {
    /// 1 for the first request, 2 for the first retry …
    pub number: u32,
    /// The answer or the failure.
    pub result: AttemptResult,
    /// Whether the answer carried `Idempotent-Replayed: true` (the server's stored answer).
    pub replayed: bool,
    /// The layer's problem the answer was, where the middleware read it (409, 422) and its
    /// `type` is under the middleware's base
    /// ([`with_problem_base`](crate::IdempotencyMiddleware::with_problem_base)).
    pub problem: Option<ProblemType>,
    /// The problem `type` URI of the answer as sent, where the middleware read it (409, 422):
    /// also the application's own.
    pub problem_type: Option<String>,
    /// Whether the answer was `application/problem+json` (RFC 9457), as every error answer of
    /// `idempotency-http` is; a 5xx without it came from something else (a proxy, a crash page).
    pub problem_json: bool,
    /// The server's retry hint (`Retry-After-Ms`, else `Retry-After`), if any.
    pub retry_after: Option<Duration>,
    /// How long the attempt took, from sending to the answer's head.
    pub took: Duration,
    /// The pause before the next attempt, if there was one.
    pub pause: Option<Duration>,
}

/// Why the middleware stopped sending.
///
/// ```
/// use idempotency_client::StopReason;
/// assert!(StopReason::Answered.is_final_answer());
/// assert!(!StopReason::MaxAttempts.is_final_answer());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StopReason {
    /// A final answer: a success, a replay, or a status that is never retried.
    Answered,
    /// The 422 `key-reused`: surfaced as [`IdempotencyError::KeyReused`](crate::IdempotencyError).
    KeyReused,
    /// The last attempt was retryable, but the attempts were used up.
    MaxAttempts,
    /// The last attempt was retryable, but the deadline left no room for the next (or the
    /// server's hint would have passed it).
    Deadline,
    /// The request is neither keyed nor idempotent (a POST of a method not configured to be
    /// keyed): it is sent once, since a retry could run it twice.
    NotRetryable,
    /// The body is a stream that cannot be sent again.
    BodyNotReplayable,
}

impl StopReason {
    /// Whether the last answer is final (not a retryable failure the budget cut short).
    pub fn is_final_answer(self) -> bool {
        matches!(self, StopReason::Answered | StopReason::KeyReused)
    }
}

/// What one logical operation went through. Put into the final response's extensions (see
/// [`Outcome::of`]) and kept in a [`Probe`] when the request carries one.
///
/// ```
/// use idempotency_client::Outcome;
/// let outcome = Outcome::default();
/// assert_eq!(outcome.attempt_count(), 0);
/// assert!(!outcome.replayed);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outcome {
    /// The `Idempotency-Key` sent with every attempt (`None` for an unkeyed request).
    pub key: Option<String>,
    /// Every attempt, in order.
    pub attempts: Vec<AttemptRecord>,
    /// Whether the final answer was a replay of a stored answer (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// Why the middleware stopped (`None` while it still runs).
    pub stopped: Option<StopReason>,
    /// From the first request to the final answer (or error).
    pub elapsed: Duration,
}

impl Outcome {
    /// The outcome the middleware put into `response`'s extensions.
    ///
    /// ```no_run
    /// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), reqwest_middleware::Error> {
    /// let response = client.post("http://127.0.0.1:8080/purchases").body("{}").send().await?;
    /// if let Some(outcome) = idempotency_client::Outcome::of(&response) {
    ///     println!("{} attempts, replayed: {}", outcome.attempt_count(), outcome.replayed);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn of(response: &reqwest::Response) -> Option<&Outcome> {
        response.extensions().get::<Outcome>()
    }

    /// How many requests were sent.
    pub fn attempt_count(&self) -> u32 {
        self.attempts.len() as u32
    }

    /// The statuses answered, in order (transport failures left out).
    pub fn statuses(&self) -> Vec<StatusCode> {
        self.attempts
            .iter()
            .filter_map(|attempt| attempt.result.status())
            .collect()
    }

    /// How many attempts failed without an answer.
    pub fn transport_errors(&self) -> usize {
        self.attempts
            .iter()
            .filter(|attempt| matches!(attempt.result, AttemptResult::Transport { .. }))
            .count()
    }
}

/// A window on an operation's [`Outcome`] while it runs and after it ended, also when it ended in
/// an error (the response's extensions only exist for an answer). Pass one per operation with
/// `RequestBuilder::with_extension`.
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) {
/// use idempotency_client::Probe;
/// let probe = Probe::new();
/// let sent = client.post("http://127.0.0.1:8080/purchases").with_extension(probe.clone()).send().await;
/// let outcome = probe.outcome();
/// println!("{:?} after {} attempts ({} transport errors): {:?}", outcome.stopped, outcome.attempt_count(), outcome.transport_errors(), sent.map(|r| r.status()));
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Probe(Arc<Mutex<Outcome>>);

impl Probe {
    /// An empty probe.
    pub fn new() -> Self {
        Self::default()
    }

    /// The outcome so far.
    pub fn outcome(&self) -> Outcome {
        self.0.lock().map(|o| o.clone()).unwrap_or_default()
    }

    pub(crate) fn set(&self, outcome: &Outcome) {
        if let Ok(mut slot) = self.0.lock() {
            slot.clone_from(outcome);
        }
    }
}
