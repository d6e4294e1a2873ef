//! [`IdempotencyLayer`]: the configuration and builder, and the [`tower::Layer`] impl.

use crate::{
    config::{
        Config, IdempotencyScope, KeyRequirement, MissingScope, OperationSource, State,
        DEFAULT_BODY_LIMIT,
    },
    service::IdempotencyService,
};
use http::{request::Parts, HeaderName, Method, StatusCode};
use idempotency::{Disposition, Effects, Idempotency, Store};
use std::{fmt, sync::Arc, time::Duration};

/// A [`tower::Layer`] that makes non-idempotent requests carrying an `Idempotency-Key` run at most
/// once, replaying the stored response to retries.
///
/// Build one per route (or per group of routes sharing a policy) and attach it with
/// `Router::route_layer`, so axum's [`MatchedPath`](axum::extract::MatchedPath) names the
/// operation. The defaults: POST and PATCH protected, key required, scope from the
/// [`IdempotencyScope`] extension (401 when absent), operation `"POST /orders/{id}/pay"`, no
/// headers in the fingerprint, 1 MiB body limit, definitive responses stored
/// ([`is_definitive`](crate::is_definitive): only 2xx and 3xx commit the handler's writes),
/// [`Effects::Local`], no waiting for a duplicate's original
/// ([`wait_for_in_flight`](Self::with_wait_for_in_flight)), and the lease and retention of the
/// [`Idempotency`] engine.
///
/// ```
/// use axum::{routing::post, Router};
/// use http::{HeaderName, Method};
/// use idempotency::{SqliteStore, Effects, Idempotency};
/// use idempotency_http::{IdempotencyLayer, KeyRequirement, MissingScope};
/// use std::time::Duration;
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
/// let engine = Idempotency::new(store)
///     .with_lease(Duration::from_secs(30))
///     .with_retention(Duration::from_secs(24 * 3600));
/// let layer = IdempotencyLayer::new(engine)
///     .with_methods([Method::POST])
///     .with_key_requirement(KeyRequirement::Required)
///     .with_scope_from(|parts| parts.headers.get("x-user-id")?.to_str().ok().map(str::to_owned))
///     .with_missing_scope(MissingScope::Reject)
///     .with_fingerprint_headers([HeaderName::from_static("x-currency")])
///     .with_stored_headers([HeaderName::from_static("x-order-id")])
///     .with_body_limit(64 * 1024)
///     .with_effects(Effects::External);
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .route_layer(layer);
/// # });
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<S> {
    config: Config<S>,
    /// Shared by the layer's clones and every service they make.
    state: Arc<State>,
}

impl<S> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("methods", &s.methods)
            .field("key_requirement", &s.key_requirement)
            .field("missing_scope", &s.missing_scope)
            .field("effects", &s.effects)
            .field("journaled", &s.journaled)
            .field("fingerprint_headers", &s.fingerprint_headers)
            .field("stored_headers", &s.stored_headers)
            .field("body_limit", &s.body_limit)
            .field("wait_for_in_flight", &s.wait_for_in_flight)
            .finish_non_exhaustive()
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// A layer with the defaults described on [`IdempotencyLayer`], on `idempotency`'s store,
    /// lease and retention.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use idempotency::{SqliteStore, Store, Idempotency};
    /// let store = SqliteStore::connect("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let layer = idempotency_http::IdempotencyLayer::new(Idempotency::new(store));
    /// # Ok::<(), idempotency::StoreError>(()) }).unwrap();
    /// ```
    pub fn new(idempotency: Idempotency<S>) -> Self {
        Self {
            state: Arc::default(),
            config: Config {
                idempotency,
                methods: vec![Method::POST, Method::PATCH],
                key_requirement: KeyRequirement::Required,
                scope: Arc::new(|parts: &Parts| {
                    parts
                        .extensions
                        .get::<IdempotencyScope>()
                        .map(|scope| scope.0.clone())
                }),
                missing_scope: MissingScope::Reject,
                operation: OperationSource::MethodAndRoute,
                effects: Effects::Local,
                journaled: false,
                fingerprint_headers: Vec::new(),
                stored_headers: Vec::new(),
                body_limit: DEFAULT_BODY_LIMIT,
                disposition_by_status: Arc::new(crate::default_disposition),
                retention_header: false,
                replay_header: idempotency_wire::header::IDEMPOTENT_REPLAYED,
                problem_base: Arc::from(idempotency_wire::DEFAULT_PROBLEM_BASE),
                detach: false,
                wait_for_in_flight: None,
            },
        }
    }

    /// The methods the layer protects (default POST and PATCH); others pass through untouched.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_methods([http::Method::POST, http::Method::PATCH, http::Method::DELETE]);
    /// # });
    /// ```
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether the key is required (missing → 400) or optional (missing → run unprotected).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_key_requirement(idempotency_http::KeyRequirement::Optional);
    /// # });
    /// ```
    pub fn with_key_requirement(mut self, requirement: KeyRequirement) -> Self {
        self.config.key_requirement = requirement;
        self
    }

    /// Where the scope (whose key space) comes from: a function of the request head, typically
    /// reading what the auth layer put into the extensions. Replaces the default, which reads
    /// the [`IdempotencyScope`] extension.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// #[derive(Clone)]
    /// struct User { id: u64 }
    /// let layer = layer.with_scope_from(|parts| parts.extensions.get::<User>().map(|u| format!("user-{}", u.id)));
    /// # });
    /// ```
    pub fn with_scope_from(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.scope = Arc::new(scope);
        self
    }

    /// What to do when there is no scope (default: reject with 401).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_missing_scope(idempotency_http::MissingScope::Fixed("public".into()));
    /// # });
    /// ```
    pub fn with_missing_scope(mut self, missing: MissingScope) -> Self {
        self.config.missing_scope = missing;
        self
    }

    /// A fixed operation name for the route, instead of `METHOD /route/{template}`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_operation("purchase");
    /// # });
    /// ```
    pub fn with_operation(mut self, operation: impl Into<String>) -> Self {
        self.config.operation = OperationSource::Fixed(operation.into());
        self
    }

    /// The operation name as a function of the request head.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.operation_from(|parts| format!("{} v2", parts.method));
    /// # });
    /// ```
    pub fn operation_from(
        mut self,
        operation: impl Fn(&Parts) -> String + Send + Sync + 'static,
    ) -> Self {
        self.config.operation = OperationSource::Custom(Arc::new(operation));
        self
    }

    /// What the handler touches (default [`Effects::Local`]): with [`Effects::External`] a key
    /// whose worker vanished is never taken over automatically (the recovery job or an operator
    /// decides), and retries get 409 until then.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_effects(idempotency::Effects::External);
    /// # });
    /// ```
    pub fn with_effects(mut self, effects: Effects) -> Self {
        self.config.effects = effects;
        self
    }

    /// Declares that the handler runs a durable operation through [`KeyLease`](crate::KeyLease),
    /// so it makes no outside call before a recovery point is committed. Set only by
    /// [`DurableRoute::layer`](crate::DurableRoute::layer), which takes the operation from the
    /// registry the worker resumes with. The reservation is then not flushed on its own
    /// ([`Attempt::with_journaled`](idempotency::Attempt::with_journaled)). An answer given before
    /// the handler took the lease is settled like any route's: a definitive one (a rejected body,
    /// 4xx) is stored and replayed; a 5xx, a panic or a cancellation releases the key even with
    /// [`Effects::External`], since nothing can have gone out.
    pub(crate) fn with_journaled(mut self, journaled: bool) -> Self {
        self.config.journaled = journaled;
        self
    }

    /// Request headers that are part of the fingerprint (beside method, path and body): a retry
    /// with another value is a different request (422).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_fingerprint_headers([http::HeaderName::from_static("x-currency")]);
    /// # });
    /// ```
    pub fn with_fingerprint_headers(
        mut self,
        headers: impl IntoIterator<Item = HeaderName>,
    ) -> Self {
        self.config.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// Response headers stored and replayed beside `Content-Type` and `Location`. Cookies and
    /// authentication headers are never stored ([`NEVER_STORED`](crate::stored::NEVER_STORED)).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_stored_headers([http::HeaderName::from_static("x-order-id")]);
    /// # });
    /// ```
    pub fn with_stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.stored_headers = headers.into_iter().collect();
        self
    }

    /// The largest request body read (default 1 MiB); a larger one is refused with 413 before
    /// anything is reserved.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_body_limit(16 * 1024);
    /// # });
    /// ```
    pub fn with_body_limit(mut self, bytes: usize) -> Self {
        self.config.body_limit = bytes;
        self
    }

    /// What happens to the key after a response whose handler gave no [`Disposition`], by its
    /// status. Default: [`default_disposition`](crate::default_disposition), which stores the
    /// definitive responses ([`is_definitive`](crate::is_definitive): 2xx, 3xx, and 4xx except
    /// 404, 408, 409, 425 and 429) and answers `None` for the rest.
    ///
    /// - [`Disposition::Store`]: the response is stored and replayed. The handler's writes
    ///   commit only after a 2xx or 3xx ([`commits_writes`](crate::commits_writes)); a stored
    ///   4xx is stored without them, in a short transaction of its own.
    /// - [`Disposition::Release`]: roll back and release the key; only when nothing went out.
    /// - [`Disposition::Park`]: roll back and keep the key as *needs review* (retries get 409
    ///   `needs-review` until an operator resolves it with `idem keys resolve`).
    /// - `None`: roll back, and the default for the route's [`effects`](Self::with_effects):
    ///   [`Effects::Local`] work is released, so a retry runs again; [`Effects::External`] work
    ///   is **never released** (its outside effect may have happened): the key stays pending, and
    ///   the recovery job settles it after its lease (asking the provider, or parking it). The
    ///   same holds after a panic.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// use idempotency_http::{default_disposition, Disposition};
    /// // Store only successes (every 4xx may be retried), and park after a gateway error.
    /// let layer = layer.with_disposition_by_status(|status| match status.as_u16() {
    ///     502 | 504 => Some(Disposition::Park(format!("payment provider answered {status}"))),
    ///     _ if status.is_success() => default_disposition(status),
    ///     _ => None,
    /// });
    /// # });
    /// ```
    pub fn with_disposition_by_status(
        mut self,
        decide: impl Fn(StatusCode) -> Option<Disposition> + Send + Sync + 'static,
    ) -> Self {
        self.config.disposition_by_status = Arc::new(decide);
        self
    }

    /// Adds `Idempotency-Key-Retention: <seconds>` to protected responses (first and replayed),
    /// telling clients how long after completion the key is remembered (default off).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_retention_header(true);
    /// # });
    /// ```
    pub fn with_retention_header(mut self, enabled: bool) -> Self {
        self.config.retention_header = enabled;
        self
    }

    /// The header that marks a replayed response with `true` (default
    /// [`Idempotent-Replayed`](idempotency_wire::header::IDEMPOTENT_REPLAYED), as Stripe and the IETF
    /// draft's examples use; the draft has not settled on a name, and some clients expect
    /// another, such as `Idempotency-Replayed`).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_replay_header(http::HeaderName::from_static("idempotency-replayed"));
    /// # });
    /// ```
    pub fn with_replay_header(mut self, header: HeaderName) -> Self {
        self.config.replay_header = header;
        self
    }

    /// Puts the `type` URIs of the layer's problems under `base` instead of
    /// [`DEFAULT_PROBLEM_BASE`](idempotency_wire::DEFAULT_PROBLEM_BASE): `{base}key-reused`, `{base}in-progress` …
    /// (end it with `/`). Give clients the same base (`idempotency-client`'s
    /// `IdempotencyMiddleware::with_problem_base`): they recognise the layer's
    /// [`ProblemType`](idempotency_wire::ProblemType)s only under it.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_problem_base("https://api.shop.example/problems/idempotency/");
    /// # });
    /// ```
    pub fn with_problem_base(mut self, base: impl Into<String>) -> Self {
        self.config.problem_base = Arc::from(base.into());
        self
    }

    /// Runs the handler, once its key is reserved, in a task of its own (default off; needs a
    /// tokio runtime).
    ///
    /// Without it, a client that goes away (timeout, closed connection) makes the server drop
    /// the request half-way: the business transaction rolls back and a local key is released, so
    /// the retry runs the work again, but an external call may have been made and its key waits
    /// for the recovery job. Detached, the work finishes and completes its key whatever the
    /// client does, and the retry gets the stored response. Replays are read before anything is
    /// spawned, so they cost no task. (The reservation itself is cancellation-safe either way:
    /// see [`Idempotency::reserve`].)
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_detach(true);
    /// # });
    /// ```
    pub fn with_detach(mut self, enabled: bool) -> Self {
        self.config.detach = enabled;
        self
    }

    /// Lets a duplicate that arrives while the original request still runs **wait** for it, at
    /// most `bound`, and answer with the original's stored response (`Idempotent-Replayed:
    /// true`) instead of a 409 (default off: 409 at once).
    ///
    /// A double click then costs the second tab the rest of the original's time, not a 409 and
    /// a `Retry-After: 1`. The wait is woken at once by an original running behind this layer in
    /// this process, by PostgreSQL's `NOTIFY` for one in another process (sent after its commit
    /// by a layer with this setting), and polls otherwise (1 ms doubling to 25 ms); it never
    /// lasts longer than `bound`. If the key changes otherwise meanwhile (released after a 5xx, parked, its lease
    /// ended), the request reserves it again and is decided as a new one; if the original is
    /// still running at the bound, the answer is the 409 it would have had. Each waiting request
    /// holds its connection and a little memory, and reads the key a few times: pick a bound
    /// near the slow end of the route's normal latency (a second or two), not a minute. See
    /// [`in_flight`](crate::in_flight).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_wait_for_in_flight(std::time::Duration::from_secs(2));
    /// # });
    /// ```
    pub fn with_wait_for_in_flight(mut self, bound: Duration) -> Self
    where
        S: idempotency::store::CompletionSignal,
    {
        self.config.wait_for_in_flight =
            (!bound.is_zero()).then(|| crate::in_flight::InFlightWait::new(bound));
        self
    }

    /// The engine: store, lease and retention.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let store = layer.idempotency().store(); // the pool, for the application's own queries
    /// let _ = store.pool();
    /// # });
    /// ```
    pub fn idempotency(&self) -> &Idempotency<S> {
        &self.config.idempotency
    }

    /// How long a handler may run before its key may be taken over (local effects).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// let engine = idempotency::Idempotency::new(store);
    /// let engine_default = engine.lease();
    /// let layer = idempotency_http::IdempotencyLayer::new(engine);
    /// assert_eq!(layer.lease(), engine_default); // the engine's default
    /// assert_eq!(layer.with_lease(std::time::Duration::from_secs(30)).lease().as_secs(), 30);
    /// # });
    /// ```
    pub fn lease(&self) -> Duration {
        self.config.idempotency.lease()
    }

    /// How long a completed key and its stored response are kept.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// let engine = idempotency::Idempotency::new(store);
    /// let engine_default = engine.retention();
    /// let layer = idempotency_http::IdempotencyLayer::new(engine);
    /// assert_eq!(layer.retention(), engine_default); // the engine's default
    /// # });
    /// ```
    pub fn retention(&self) -> Duration {
        self.config.idempotency.retention()
    }

    /// Replaces the lease length.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_lease(std::time::Duration::from_secs(10));
    /// assert_eq!(layer.lease().as_secs(), 10);
    /// # });
    /// ```
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.config.idempotency = self.config.idempotency.with_lease(lease);
        self
    }

    /// Whether a held key's lease is extended while the handler runs (default `true`; see
    /// [`Idempotency::with_heartbeat`]). With it, a handler may run longer than the lease and
    /// keeps its key (duplicates get 409 meanwhile); the lease only bounds how long a crashed
    /// process blocks a key.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// // The lease must then outlast the slowest handler.
    /// let layer = layer.with_heartbeat(false).with_lease(std::time::Duration::from_secs(120));
    /// # });
    /// ```
    pub fn with_heartbeat(mut self, heartbeat: bool) -> Self {
        self.config.idempotency = self.config.idempotency.with_heartbeat(heartbeat);
        self
    }

    /// Replaces the retention.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let store = idempotency::SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// # let layer = idempotency_http::IdempotencyLayer::new(idempotency::Idempotency::new(store));
    /// let layer = layer.with_retention(std::time::Duration::from_secs(3600));
    /// # });
    /// ```
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.config.idempotency = self.config.idempotency.with_retention(retention);
        self
    }
}

impl<S: Store, Inner> tower::Layer<Inner> for IdempotencyLayer<S> {
    type Service = IdempotencyService<S, Inner>;

    fn layer(&self, inner: Inner) -> Self::Service {
        IdempotencyService::new(Arc::new(self.config.clone()), self.state.clone(), inner)
    }
}
