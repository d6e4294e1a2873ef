//! The knobs: how many attempts, for how long, with what backoff ([`RetryPolicy`]); how keys are
//! made ([`KeyGenerator`], [`KeyFormat`]) or given per request ([`RequestKey`]).

use std::{fmt, sync::Arc, time::Duration};

/// How long and how often one operation is tried.
///
/// Set it on the middleware ([`IdempotencyMiddleware::with_policy`](crate::IdempotencyMiddleware::with_policy))
/// or per request as an extension, which replaces the middleware's for that request:
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), reqwest_middleware::Error> {
/// use idempotency_client::RetryPolicy;
/// // Send once and report: no retry after the first error.
/// let response = client.post("http://127.0.0.1:8080/purchases").with_extension(RetryPolicy::once()).send().await?;
/// # Ok(()) }
/// ```
///
/// ```
/// use idempotency_client::RetryPolicy;
/// use std::time::Duration;
/// let policy = RetryPolicy::default();
/// assert_eq!(policy.max_attempts(), 5);
/// assert_eq!(policy.deadline(), Duration::from_secs(30));
/// let patient = policy.with_max_attempts(20).with_deadline(Duration::from_secs(120));
/// assert_eq!(patient.max_attempts(), 20);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Requests sent at most, the first included (at least 1). Default 5.
    pub(crate) max_attempts: u32,
    /// The whole operation's budget, pauses included, from its first request (default 30 s). An
    /// attempt still running at the deadline is cut (reqwest's timeout is lowered to what is
    /// left when the request has one; otherwise the attempt is abandoned with
    /// [`IdempotencyError::Deadline`](crate::IdempotencyError::Deadline)); no pause is begun that
    /// would end past it.
    pub(crate) deadline: Duration,
    /// The backoff's first ceiling (default 100 ms): retry `n` (from 0) waits a uniformly random
    /// time in `[0, min(backoff_max, backoff_min × 2ⁿ)]` ("full jitter").
    pub(crate) backoff_min: Duration,
    /// The backoff's largest ceiling (default 5 s).
    pub(crate) backoff_max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            deadline: Duration::from_secs(30),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// Requests sent at most, the first included (default 5).
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The whole operation's budget, pauses included (default 30 s).
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The backoff's first ceiling (default 100 ms).
    pub fn backoff_min(&self) -> Duration {
        self.backoff_min
    }

    /// The backoff's largest ceiling (default 5 s).
    pub fn backoff_max(&self) -> Duration {
        self.backoff_max
    }

    /// One attempt, no retry: the answer or error of the first request, with its [`Outcome`](crate::Outcome).
    ///
    /// ```
    /// assert_eq!(idempotency_client::RetryPolicy::once().max_attempts(), 1);
    /// ```
    pub fn once() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Sets [`max_attempts`](Self::max_attempts) (0 counts as 1).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Sets [`deadline`](Self::deadline).
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Sets the backoff's bounds ([`backoff_min`](Self::backoff_min),
    /// [`backoff_max`](Self::backoff_max)); a `max` below `min` is raised to `min`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let policy = idempotency_client::RetryPolicy::default().with_backoff(Duration::from_millis(20), Duration::from_secs(1));
    /// assert_eq!(policy.backoff_min(), Duration::from_millis(20));
    /// ```
    pub fn with_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max.max(min);
        self
    }

    /// The pause before retry number `past_retries` (0 for the first retry) when the server gave
    /// no hint: exponential backoff with full jitter, from `retry-policies`.
    pub(crate) fn backoff_pause(&self, past_retries: u32) -> Duration {
        use retry_policies::{
            policies::ExponentialBackoff, Jitter, RetryDecision, RetryPolicy as _,
        };
        let backoff = ExponentialBackoff::builder()
            .retry_bounds(self.backoff_min, self.backoff_max.max(self.backoff_min))
            .jitter(Jitter::Full)
            .base(2)
            .build_with_max_retries(u32::MAX);
        let now = std::time::SystemTime::now();
        match backoff.should_retry(now, past_retries) {
            RetryDecision::Retry { execute_after } => {
                execute_after.duration_since(now).unwrap_or_default()
            }
            RetryDecision::DoNotRetry => self.backoff_max,
        }
    }
}

/// How the middleware makes a key for an operation that has none.
///
/// ```
/// use idempotency_client::KeyGenerator;
/// let v7 = KeyGenerator::UuidV7.generate();
/// assert_eq!(v7.len(), 36);
/// let counter = std::sync::atomic::AtomicU64::new(0);
/// let custom = KeyGenerator::custom(move || format!("job-{}", counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
/// assert_eq!(custom.generate(), "job-0");
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum KeyGenerator {
    /// A random UUID v4 (default): 122 random bits, unguessable, unordered.
    #[default]
    UuidV4,
    /// A UUID v7: a millisecond timestamp then random bits, so keys sort by creation time
    /// (friendlier to B-tree indexes and logs); still 74 random bits.
    UuidV7,
    /// Your own (a business identifier, a ULID …). It must be unique per operation, and at most
    /// 255 printable ASCII characters to pass the server's check.
    Custom(Arc<dyn Fn() -> String + Send + Sync>),
}

impl KeyGenerator {
    /// A generator from a function.
    pub fn custom(generate: impl Fn() -> String + Send + Sync + 'static) -> Self {
        KeyGenerator::Custom(Arc::new(generate))
    }

    /// A new key.
    pub fn generate(&self) -> String {
        match self {
            KeyGenerator::UuidV4 => uuid::Uuid::new_v4().to_string(),
            KeyGenerator::UuidV7 => uuid::Uuid::now_v7().to_string(),
            KeyGenerator::Custom(generate) => generate(),
        }
    }
}

impl fmt::Debug for KeyGenerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyGenerator::UuidV4 => f.write_str("UuidV4"),
            KeyGenerator::UuidV7 => f.write_str("UuidV7"),
            KeyGenerator::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// How the key is written into the `Idempotency-Key` header.
///
/// ```
/// use idempotency_client::KeyFormat;
/// assert_eq!(KeyFormat::Bare.render("abc"), "abc");
/// assert_eq!(KeyFormat::StructuredField.render("say \"hi\""), "\"say \\\"hi\\\"\"");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFormat {
    /// The bare value, as Stripe and most SDKs send it (default): `Idempotency-Key: 8e03…`.
    #[default]
    Bare,
    /// A Structured Field String, as the IETF draft writes it: `Idempotency-Key: "8e03…"`.
    StructuredField,
}

impl KeyFormat {
    /// The header value for `key`.
    pub fn render(self, key: &str) -> String {
        match self {
            KeyFormat::Bare => key.to_owned(),
            KeyFormat::StructuredField => {
                let mut value = String::with_capacity(key.len() + 2);
                value.push('"');
                for c in key.chars() {
                    if c == '"' || c == '\\' {
                        value.push('\\');
                    }
                    value.push(c);
                }
                value.push('"');
                value
            }
        }
    }
}

/// A per-request choice of key, as a request extension: use this key, or send none.
///
/// A request that already carries an `Idempotency-Key` header keeps it (the caller's key wins
/// over generation); this extension wins over both.
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), reqwest_middleware::Error> {
/// use idempotency_client::RequestKey;
/// // The operation's key comes from the caller's own record (a retry after a restart).
/// client.post("http://127.0.0.1:8080/purchases").with_extension(RequestKey::Use("order-42-pay".into())).send().await?;
/// // No key on this one (to see the server's 400).
/// client.post("http://127.0.0.1:8080/purchases").with_extension(RequestKey::Omit).send().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestKey {
    /// Send this key with every attempt.
    Use(String),
    /// Send no key (and so retry only as an unkeyed request of its method may be).
    Omit,
}

/// A request extension declaring an **unkeyed** request safe to send again after the server may
/// have run it, because the endpoint is idempotent by design: a guarded state transition
/// (`UPDATE … WHERE state = 'pending_payment'`), an insert under a business unique constraint, an
/// overwrite. The middleware then retries it like a keyed request (timeouts, 502/503/504 …).
/// Without it, an unkeyed POST is sent again only when it never reached the server.
///
/// ```no_run
/// # async fn demo(client: reqwest_middleware::ClientWithMiddleware) -> Result<(), reqwest_middleware::Error> {
/// use idempotency_client::{RequestKey, Resendable};
/// // Paying an order is a guarded transition: a second payment finds it paid.
/// client
///     .post("http://127.0.0.1:8080/orders/42/pay")
///     .with_extension(RequestKey::Omit)
///     .with_extension(Resendable)
///     .send()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resendable;
