//! [`DurableRoute`]: a route that runs one durable operation, built from the operation itself.
//!
//! A durable route needs four things to agree: the key's operation name, [`Effects::External`],
//! journaling, and the operation's registration in the [`Operations`] the resumer runs. Set by
//! hand, a route whose operation name differs from the registered one works while the process
//! lives, and after a crash its keys are never resumed. [`DurableRoute::new`] takes all four from
//! the registry, by the operation's name, and refuses to build when the registry lacks it.

use crate::{error::IdempotencyRejection, IdempotencyLayer, KeyLease, Problem, StoredResponse};
use axum::response::{IntoResponse, Response};
use idempotency::{
    durable::{Operation, Operations, PerformError},
    store::Journal,
    Effects, Idempotency, Store,
};
use idempotency_wire::{ProblemType, DEFAULT_PROBLEM_BASE};
use std::{sync::Arc, time::Duration};

/// A route that runs the durable operation `O`, taken from the same [`Operations`] registry the
/// maintenance worker resumes with.
///
/// [`layer`](Self::layer) protects the route (the key's operation is the operation's name, its
/// effects external, its progress journaled); [`perform`](Self::perform), called by the
/// handler, takes the key's lease, runs the operation and answers every outcome, with
/// `application/problem+json` for the ones that are not the operation's own response.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{response::Response, routing::post, Json, Router};
/// use idempotency::{Idempotency, SqliteStore, Store, durable::{Finished, Operation, Operations, StepError, Steps}};
/// use idempotency_http::{DurableRoute, IdempotencyScope, KeyLease, StoredResponse};
///
/// struct Charge;
/// impl Operation<SqliteStore> for Charge {
///     type Request = serde_json::Value;
///     type Response = StoredResponse;
///     fn name(&self) -> &str { "charge" }
///     async fn run(&self, steps: &mut Steps<SqliteStore>, _: &serde_json::Value) -> Result<Finished<StoredResponse>, StepError> {
///         steps.finish(async |_tx| {
///             StoredResponse::json(http::StatusCode::CREATED, &serde_json::json!({"charged": true}))
///         }).await
///     }
/// }
///
/// let store = SqliteStore::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// let engine = Idempotency::new(store);
/// // One registry, for the routes and for the worker that resumes them after a crash.
/// let operations = Operations::new().with(Charge);
/// let charge: DurableRoute<SqliteStore, Charge> = DurableRoute::new(engine, &operations, "charge")?;
/// let layer = charge.layer();
/// let app: Router = Router::new().route(
///     "/charges",
///     post(move |held: KeyLease<SqliteStore>, Json(request): Json<serde_json::Value>| async move {
///         charge.perform(held, &request).await
///     })
///     .layer(layer),
/// );
/// # let _ = app;
/// // A name the registry does not have refuses to build:
/// # let engine = Idempotency::new(SqliteStore::connect("sqlite::memory:").await?);
/// assert!(DurableRoute::<SqliteStore, Charge>::new(engine, &operations, "charges").is_err());
/// # Ok(()) }
/// # #[cfg(not(feature = "sqlite"))]
/// # fn main() {}
/// ```
pub struct DurableRoute<S: Store, O> {
    engine: Idempotency<S>,
    operation: Arc<O>,
    problem_base: String,
}

impl<S: Store, O> Clone for DurableRoute<S, O> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            operation: self.operation.clone(),
            problem_base: self.problem_base.clone(),
        }
    }
}

impl<S: Store, O> std::fmt::Debug for DurableRoute<S, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableRoute").finish_non_exhaustive()
    }
}

/// Why a [`DurableRoute`] refused to build: the registry has no operation of that type under
/// that name, so a key reserved by the route could never be resumed after a crash.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # {
/// use idempotency_http::UnregisteredOperation;
/// fn explain(error: &UnregisteredOperation) -> String { error.to_string() }
/// # }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("no durable operation {name:?} of type {type_name} in the registry: register it in the Operations the worker resumes with, under the name the route uses")]
pub struct UnregisteredOperation {
    name: String,
    type_name: &'static str,
}

impl UnregisteredOperation {
    /// The operation name the route asked for.
    ///
    /// ```
    /// # fn demo(error: idempotency_http::UnregisteredOperation) { let _: &str = error.name(); }
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<S, O> DurableRoute<S, O>
where
    S: Journal,
    O: Operation<S, Response = StoredResponse>,
{
    /// The route of the operation registered in `operations` under `name`; an error if there is
    /// none of type `O` (the route would reserve keys no worker can resume).
    pub fn new(
        engine: Idempotency<S>,
        operations: &Operations<S>,
        name: &str,
    ) -> Result<Self, UnregisteredOperation> {
        let operation = operations
            .get::<O>(name)
            .ok_or_else(|| UnregisteredOperation {
                name: name.to_owned(),
                type_name: std::any::type_name::<O>(),
            })?;
        Ok(Self {
            engine,
            operation,
            problem_base: DEFAULT_PROBLEM_BASE.to_owned(),
        })
    }

    /// Puts the problem `type` URIs of this route's layer and answers under `base` (see
    /// [`IdempotencyLayer::with_problem_base`]).
    pub fn with_problem_base(mut self, base: impl Into<String>) -> Self {
        self.problem_base = base.into();
        self
    }

    /// The operation.
    pub fn operation(&self) -> &O {
        &self.operation
    }

    /// The layer that protects the route: the key's operation is the operation's name, its
    /// effects [`Effects::External`], its progress journaled (a retry or the worker continues it
    /// from its last recovery point). Other settings may be added to it; do not change those.
    pub fn layer(&self) -> IdempotencyLayer<S> {
        IdempotencyLayer::new(self.engine.clone())
            .with_operation(self.operation.name())
            .with_effects(Effects::External)
            .with_journaled(true)
            .with_problem_base(self.problem_base.clone())
    }

    /// Takes the key's lease from `held`, runs (or continues) the operation for `request`, and
    /// answers: the operation's [`StoredResponse`] once it finished (completed or failed for
    /// good), otherwise a problem document that says whether to retry:
    ///
    /// | outcome | answer |
    /// |---|---|
    /// | an outside outcome is unknown, or the run was interrupted after a step took effect | 503 `operation-pending`, `Retry-After`: carried on in the background; retry with the same key |
    /// | parked for an operator | 409 `needs-review` |
    /// | another worker took the key over | 409 `lease-lost`, `Retry-After` |
    /// | failed before any step took effect, the database unreachable | 503 `store-unavailable`, `Retry-After`: nothing was kept |
    /// | failed before any step took effect, otherwise | 500 `internal`: nothing was kept, the key released |
    pub async fn perform(&self, held: KeyLease<S>, request: &O::Request) -> Response {
        let Some(lease) = held.take() else {
            return self.refuse(IdempotencyRejection::LeaseLost);
        };
        match self
            .engine
            .perform_reserved(&*self.operation, lease, request)
            .await
        {
            Ok(finished) => StoredResponse::from(finished).into_response(),
            Err(error) => self.answer(error),
        }
    }

    fn refuse(&self, rejection: IdempotencyRejection) -> Response {
        rejection.to_response_under(&self.problem_base)
    }

    /// The answer to an operation that did not finish in this request.
    fn answer(&self, error: PerformError) -> Response {
        let base = &self.problem_base;
        match error {
            PerformError::Parked { .. } => self.refuse(IdempotencyRejection::NeedsReview),
            PerformError::LeaseLost => self.refuse(IdempotencyRejection::LeaseLost),
            PerformError::Released(error) if error.is_unavailable() => {
                Problem::of(ProblemType::StoreUnavailable, base)
                    .with_detail(format!("{error}; nothing was kept"))
                    .with_retry_after(Duration::from_secs(1))
                    .into_response()
            }
            PerformError::Pending {
                retry_after,
                reason,
            } => self.pending(retry_after, &reason),
            PerformError::Interrupted(error) => {
                tracing::warn!(%error, "durable operation interrupted; the worker resumes it");
                self.pending(Duration::from_secs(1), "the operation stopped half-way")
            }
            other => {
                tracing::error!(error = %other, "durable operation failed");
                Problem::of(ProblemType::Internal, base)
                    .with_detail(format!("{other}; nothing was kept (the key was released)"))
                    .into_response()
            }
        }
    }

    fn pending(&self, retry_after: Duration, reason: &str) -> Response {
        Problem::of(ProblemType::OperationPending, &self.problem_base)
            .with_detail(format!(
                "{reason}; the operation is carried on in the background. Retry with the same \
                 Idempotency-Key: 409 until it settles, then its answer"
            ))
            .with_retry_after(retry_after)
            .into_response()
    }
}
