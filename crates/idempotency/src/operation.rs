//! Durable operations by name: the [`Operation`] trait, and the [`Operations`] registry through

use crate::{
    error::{Error, PerformError, StepError},
    lease::Lease,
    maintenance::signals,
    protocol::{Attempt, Idempotency, Reservation},
    steps::{Finished, Settlement, Steps},
    store::{Effects, Journal, KeyRecord},
    Fingerprint, IdempotencyKey, Outcome,
};
use futures_util::{future::BoxFuture, FutureExt};
use serde::{de::DeserializeOwned, Serialize};
use std::{any::Any, collections::HashMap, future::Future, panic::AssertUnwindSafe, sync::Arc};

/// A durable operation: a name, a request type, and one async function of [`Steps`].
///
/// `run` must be written so that running it again from the top is correct: every effect goes
/// through a step ([`Steps::local`], [`Steps::call`], [`Steps::call_unkeyed`]) and the last one is
/// [`Steps::finish`] or [`Steps::fail`]. Code between steps must not write anywhere.
///
/// Durable operations by name: the [`Operation`] trait, and the [`Operations`] registry through
/// which the resumer finds the function of a key it took over.
///
/// An operation is registered once, by its name (the operation part of its keys). The request
/// path ([`Idempotency::perform`]), a client's retry (the same call, which takes over a key whose
/// holder went away) and the resumer ([`Recovery::with_operations`](crate::recovery::Recovery::with_operations))
/// all run the same [`Operation::run`], which continues from the last recovery point.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # mod demo {
/// use idempotency::{durable::{Operation, Operations}};
/// use idempotency::{durable::{CallError, Finished, Lookup, StepError, Steps}};
/// use idempotency::SqliteStore;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// pub struct Charge { pub account: String, pub cents: i64 }
///
/// pub struct ChargeCard;
///
/// impl Operation<SqliteStore> for ChargeCard {
///     type Request = Charge;
///     type Response = String;
///     fn name(&self) -> &str { "charge-card" }
///     async fn run(&self, steps: &mut Steps<SqliteStore>, request: &Charge) -> Result<Finished<String>, StepError> {
///         let cents = request.cents; // the closures below borrow it
///         // (a) a local step: its writes commit with the recovery point.
///         steps.local("reserve-funds", async |tx| {
///             sqlx::query("UPDATE accounts SET held = held + ?1").bind(cents).execute(&mut **tx).await
///                 .map(|_| ())
///         }).await?;
///         // (b) an outside call with a key derived from ours, and a lookup by the same key.
///         let charge_id: String = steps.call(
///             "charge",
///             |provider_key| async move { Ok::<_, CallError>(format!("ch_{provider_key}")) },
///             |provider_key| async move { Lookup::Done(format!("ch_{provider_key}")) },
///         ).await?;
///         // (c) the last local writes and the key's completion, in one transaction.
///         steps.finish(async |tx| {
///             sqlx::query("UPDATE accounts SET held = held - ?1").bind(cents).execute(&mut **tx).await?;
///             Ok::<_, sqlx::Error>(charge_id)
///         }).await
///     }
/// }
///
/// pub fn registry() -> Operations<SqliteStore> {
///     Operations::new().with(ChargeCard)
/// }
/// # }
/// ```
pub trait Operation<S: Journal>: Send + Sync + 'static {
    /// What the client asks for; stored with the key (canonical JSON) so the operation can be
    /// resumed without the client.
    type Request: Serialize + DeserializeOwned + Send + Sync;
    /// What the operation answers; stored with the key and replayed.
    type Response: Serialize + DeserializeOwned + Send;

    /// The operation part of its keys, under which it is registered.
    fn name(&self) -> &str;

    /// Runs (or continues) the operation for `request`.
    fn run(
        &self,
        steps: &mut Steps<S>,
        request: &Self::Request,
    ) -> impl Future<Output = Result<Finished<Self::Response>, StepError>> + Send;
}

/// An operation behind a name, with its request decoded from the stored bytes.
trait Resumable<S: Journal>: Send + Sync {
    fn resume<'a>(
        &'a self,
        engine: &'a Idempotency<S>,
        lease: Lease<S>,
        request: &'a [u8],
    ) -> BoxFuture<'a, Result<Settlement, PerformError>>;
}

impl<S: Journal, O: Operation<S>> Resumable<S> for O {
    fn resume<'a>(
        &'a self,
        engine: &'a Idempotency<S>,
        lease: Lease<S>,
        request: &'a [u8],
    ) -> BoxFuture<'a, Result<Settlement, PerformError>> {
        Box::pin(async move {
            let request: O::Request = match serde_json::from_slice(request) {
                Ok(request) => request,
                // Parking is the safe answer to a request this version cannot read.
                Err(e) => {
                    let reason = format!("the stored request cannot be read: {e}");
                    return Err(match lease.park(&reason).await {
                        Ok(true) => PerformError::Parked { reason },
                        Ok(false) => PerformError::LeaseLost,
                        Err(e) => PerformError::Interrupted(e.into()),
                    });
                }
            };
            engine
                .perform_reserved(self, lease, &request)
                .await
                .map(|finished| finished.settlement())
        })
    }
}

/// The durable operations of a service, by name: what the resumer runs for a key it takes over.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # {
/// use idempotency::{SqliteStore, durable::Operations};
/// let registry: Operations<SqliteStore> = Operations::new();
/// assert!(!registry.contains("purchase"));
/// # }
/// ```
pub struct Operations<S: Journal> {
    by_name: HashMap<String, Registered<S>>,
}

/// One registered operation: as the resumer runs it (its request decoded from stored bytes),
/// and as registered, for a route that takes it back by name with its type ([`Operations::get`]).
struct Registered<S: Journal> {
    resumable: Arc<dyn Resumable<S>>,
    typed: Arc<dyn Any + Send + Sync>,
}

impl<S: Journal> Clone for Registered<S> {
    fn clone(&self) -> Self {
        Self {
            resumable: self.resumable.clone(),
            typed: self.typed.clone(),
        }
    }
}

impl<S: Journal> Clone for Operations<S> {
    fn clone(&self) -> Self {
        Self {
            by_name: self.by_name.clone(),
        }
    }
}

impl<S: Journal> Default for Operations<S> {
    fn default() -> Self {
        Self {
            by_name: HashMap::new(),
        }
    }
}

impl<S: Journal> std::fmt::Debug for Operations<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.by_name.keys().collect();
        names.sort();
        f.debug_struct("Operations").field("names", &names).finish()
    }
}

impl<S: Journal> Operations<S> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `operation` under its name (a later one with the same name replaces it).
    pub fn with<O: Operation<S>>(self, operation: O) -> Self {
        self.with_shared(Arc::new(operation))
    }

    /// Registers an operation already shared with the request path.
    pub fn with_shared<O: Operation<S>>(mut self, operation: Arc<O>) -> Self {
        let registered = Registered {
            resumable: operation.clone() as Arc<dyn Resumable<S>>,
            typed: operation.clone() as Arc<dyn Any + Send + Sync>,
        };
        self.by_name.insert(operation.name().to_owned(), registered);
        self
    }

    /// Whether an operation is registered under `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The operation registered under `name`, if it is an `O`: what a route runs, taken from
    /// the same registry (by the same name) as the resumer's, so that the two cannot disagree.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # {
    /// use idempotency::{SqliteStore, durable::{Finished, Operation, Operations, StepError, Steps}};
    ///
    /// struct Ping;
    /// impl Operation<SqliteStore> for Ping {
    ///     type Request = ();
    ///     type Response = String;
    ///     fn name(&self) -> &str { "ping" }
    ///     async fn run(&self, steps: &mut Steps<SqliteStore>, _: &()) -> Result<Finished<String>, StepError> {
    ///         steps.finish(async |_tx| Ok::<_, sqlx::Error>("pong".to_owned())).await
    ///     }
    /// }
    ///
    /// let registry = Operations::<SqliteStore>::new().with(Ping);
    /// assert!(registry.get::<Ping>("ping").is_some());
    /// assert!(registry.get::<Ping>("pong").is_none());
    /// # }
    /// ```
    pub fn get<O: Operation<S>>(&self, name: &str) -> Option<Arc<O>> {
        let registered = self.by_name.get(name)?;
        registered.typed.clone().downcast::<O>().ok()
    }

    /// Continues the operation of `record`, a key claimed by `lease`, from its recovery point. A
    /// key with no stored request made no outside call: it is released. `None` if no operation
    /// of that name is registered (the lease is handed back unused).
    pub(crate) async fn resume(
        &self,
        engine: &Idempotency<S>,
        lease: Lease<S>,
        record: &KeyRecord,
    ) -> Result<Resumed, Lease<S>> {
        let Some(operation) = self.by_name.get(record.key.operation()) else {
            return Err(lease);
        };
        let operation = &operation.resumable;
        let Some(request) = record.request.as_deref() else {
            return Ok(match lease.release().await {
                Ok(true) => Resumed::Released,
                Ok(false) => Resumed::Stopped(PerformError::LeaseLost),
                Err(e) => Resumed::Stopped(PerformError::Interrupted(e.into())),
            });
        };
        let resumed = AssertUnwindSafe(operation.resume(engine, lease, request))
            .catch_unwind()
            .await;
        Ok(match resumed {
            Ok(Ok(settlement)) => Resumed::Settled(settlement),
            Ok(Err(error)) => Resumed::Stopped(error),
            Err(_panic) => {
                tracing::error!(key = %record.key, "a durable operation panicked while resumed; its key stays pending");
                Resumed::Stopped(PerformError::Pending {
                    retry_after: engine.step_policy().retry_after,
                    reason: "the operation panicked".into(),
                })
            }
        })
    }
}

/// What resuming a key came to.
#[derive(Debug)]
pub(crate) enum Resumed {
    /// The operation settled its key.
    Settled(Settlement),
    /// Nothing was recorded, so no outside call was made: the key was released.
    Released,
    /// The run stopped: pending again, parked, fenced out, or an error.
    Stopped(PerformError),
}

impl<S: Journal> Idempotency<S> {
    /// Runs the durable operation `operation` for `request` at most once per
    /// `(scope, operation.name(), client_key)`: reserve (a key whose holder went away is taken
    /// over and continued from its recovery point), then [`Operation::run`] with its [`Steps`].
    /// A completed key replays its stored response (also a definitive failure).
    ///
    /// The fingerprint is that of the request's canonical JSON. See [`PerformError`] for what
    /// happens to the key when the run does not finish.
    pub async fn perform<O: Operation<S>>(
        &self,
        operation: &O,
        scope: &str,
        client_key: &str,
        request: &O::Request,
    ) -> Result<Outcome<O::Response>, PerformError> {
        let key = IdempotencyKey::new(scope, operation.name(), client_key)
            .map_err(|e| PerformError::Reserve(e.into()))?;
        let fingerprint = Fingerprint::of_json(request)
            .map_err(|e| PerformError::Reserve(Error::Serialization(e)))?;
        let attempt = Attempt::new(key, fingerprint)
            .with_effects(Effects::External)
            .with_journaled(true);
        match self
            .reserve(&attempt)
            .await
            .map_err(PerformError::Reserve)?
        {
            Reservation::Completed(bytes) => {
                let _replay = signals::phase_span!(signals::SPAN_REPLAY, attempt.key()).entered();
                serde_json::from_slice(&bytes)
                    .map(Outcome::Replayed)
                    .map_err(|e| PerformError::Reserve(Error::Serialization(e)))
            }
            Reservation::Acquired(lease) => self
                .perform_reserved(operation, lease, request)
                .await
                .map(|finished| Outcome::Executed(finished.into_response())),
        }
    }

    /// Runs (or continues) `operation` under a key already reserved by `lease` (for an HTTP layer
    /// that reserved it, with its own fingerprint, with [`Effects::External`]).
    pub async fn perform_reserved<O: Operation<S>>(
        &self,
        operation: &O,
        lease: Lease<S>,
        request: &O::Request,
    ) -> Result<Finished<O::Response>, PerformError> {
        let mut steps = match Steps::new(lease, request, self.step_policy(), self.retention()) {
            Ok(steps) => steps,
            Err(refused) => {
                let (mut lease, error) = *refused;
                if !lease.is_resumed() {
                    lease.release_now().await;
                    return Err(PerformError::Released(error));
                }
                let reason = format!("the operation's journal cannot be read: {error}");
                return Err(match lease.park(&reason).await {
                    Ok(true) => PerformError::Parked { reason },
                    Ok(false) => PerformError::LeaseLost,
                    Err(e) => PerformError::Interrupted(e.into()),
                });
            }
        };
        match operation.run(&mut steps, request).await {
            Ok(finished) => Ok(finished),
            Err(error) => Err(steps.after_error(error).await),
        }
    }
}
