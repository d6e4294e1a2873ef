//! The errors the middleware adds to reqwest's, as [`reqwest_middleware::Error::Middleware`].

use crate::Outcome;
use std::time::Duration;

/// Why the middleware answered an error of its own.
///
/// It travels inside `reqwest_middleware::Error::Middleware(anyhow::Error)`; match it with
/// [`IdempotencyError::from_error`] (or `anyhow::Error::downcast_ref`):
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) {
/// use idempotency_client::IdempotencyError;
/// match client.post("http://127.0.0.1:8080/purchases").body("{}").send().await {
///     Ok(response) => println!("{}", response.status()),
///     Err(error) => match IdempotencyError::from_error(&error) {
///         Some(IdempotencyError::KeyReused { key, .. }) => {
///             eprintln!("key {key:?} was used for another request: a bug in the caller")
///         }
///         Some(other) => eprintln!("{other}"),
///         None => eprintln!("transport: {error}"),
///     },
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The server answered 422 `key-reused`: this key was used before with a different request
    /// (another body, path or method). Never retried: the same request would get the same
    /// answer, and a new key would make it a *new* operation, which only the caller may decide.
    #[error(
        "the Idempotency-Key {} was already used with a different request (422 key-reused): {detail}",
        key.as_deref().unwrap_or("(none)")
    )]
    KeyReused {
        /// The key sent.
        key: Option<String>,
        /// The problem's `detail`, or its whole body when it has none.
        detail: String,
        /// What the operation went through.
        outcome: Box<Outcome>,
    },
    /// The operation's deadline passed during an attempt whose request had no timeout of its
    /// own (the attempt was abandoned; the server may have run it, and a retry with the same key
    /// would get its answer).
    #[error("the operation's deadline of {deadline:?} passed during attempt {attempt}")]
    Deadline {
        /// The policy's deadline.
        deadline: Duration,
        /// The attempt cut.
        attempt: u32,
        /// What the operation went through.
        outcome: Box<Outcome>,
    },
}

impl IdempotencyError {
    /// The middleware's error inside a `reqwest_middleware::Error`, if it is one.
    pub fn from_error(error: &reqwest_middleware::Error) -> Option<&IdempotencyError> {
        match error {
            reqwest_middleware::Error::Middleware(error) => error.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    /// What the operation went through.
    pub fn outcome(&self) -> &Outcome {
        match self {
            IdempotencyError::KeyReused { outcome, .. }
            | IdempotencyError::Deadline { outcome, .. } => outcome,
        }
    }
}
