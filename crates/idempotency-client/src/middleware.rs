//! [`IdempotencyMiddleware`]: the key, then the retry loop, for one logical operation per
//! `send()`.

use crate::{
    error::IdempotencyError,
    outcome::{AttemptRecord, AttemptResult, Outcome, Probe, StopReason, TransportKind},
    policy::{KeyFormat, KeyGenerator, RequestKey, Resendable, RetryPolicy},
    retry::{classify, hint, is_idempotent, Inspected, Verdict},
};
use http::{Extensions, HeaderValue, Method};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

/// `Idempotency-Key`, the request header the middleware sets.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// `Idempotent-Replayed: true`, which marks an answer the server replayed from its store.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// `Retry-After-Ms: <milliseconds>`, the millisecond retry hint of `idempotency-http`; preferred
/// over `Retry-After` (whole seconds) when both are present.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

type Observer = dyn Fn(&Outcome) + Send + Sync;

/// The middleware: one key per operation, reused on every retry, and the retry rules of the
/// crate's documentation.
///
/// ```
/// use idempotency_client::{IdempotencyMiddleware, KeyGenerator, RetryPolicy};
/// use std::time::Duration;
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(
///         IdempotencyMiddleware::new()
///             .with_methods([reqwest::Method::POST, reqwest::Method::PATCH, reqwest::Method::DELETE])
///             .with_key_generator(KeyGenerator::UuidV7)
///             .with_policy(RetryPolicy::default().with_max_attempts(8).with_deadline(Duration::from_secs(20))),
///     )
///     .build();
/// # let _ = client;
/// ```
#[derive(Clone)]
pub struct IdempotencyMiddleware {
    methods: Vec<Method>,
    generator: KeyGenerator,
    format: KeyFormat,
    policy: RetryPolicy,
    observer: Option<Arc<Observer>>,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for IdempotencyMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .field("methods", &self.methods)
            .field("generator", &self.generator)
            .field("format", &self.format)
            .field("policy", &self.policy)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

impl IdempotencyMiddleware {
    /// Keys POST and PATCH with a UUID v4 in the bare form, and retries with
    /// [`RetryPolicy::default`] (5 attempts, 30 s, backoff 100 ms doubling to 5 s, full jitter).
    pub fn new() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            generator: KeyGenerator::UuidV4,
            format: KeyFormat::Bare,
            policy: RetryPolicy::default(),
            observer: None,
        }
    }

    /// The methods whose requests get a key (default POST and PATCH: the methods
    /// `idempotency-http` protects by default). Keep it to the methods the server protects: a
    /// key the server ignores makes a retry after a lost answer run twice.
    ///
    /// ```
    /// let middleware = idempotency_client::IdempotencyMiddleware::new().with_methods([reqwest::Method::POST]);
    /// # let _ = middleware;
    /// ```
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// How keys are made (default [`KeyGenerator::UuidV4`]).
    pub fn with_key_generator(mut self, generator: KeyGenerator) -> Self {
        self.generator = generator;
        self
    }

    /// How the key is written (default [`KeyFormat::Bare`]).
    pub fn with_key_format(mut self, format: KeyFormat) -> Self {
        self.format = format;
        self
    }

    /// Attempts, deadline and backoff (default [`RetryPolicy::default`]); a [`RetryPolicy`]
    /// extension on a request replaces it for that request.
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Calls `observe` after every attempt with the operation's outcome so far (its last
    /// [`AttemptRecord`] is the attempt just made), and once more when it stops (then
    /// [`Outcome::stopped`] is set). For logs and metrics; keep it quick.
    ///
    /// ```
    /// let middleware = idempotency_client::IdempotencyMiddleware::new().with_attempt_observer(|outcome| {
    ///     if let Some(last) = outcome.attempts.last() {
    ///         eprintln!("key {:?} attempt {}: {:?}", outcome.key, last.number, last.result);
    ///     }
    /// });
    /// # let _ = middleware;
    /// ```
    pub fn with_attempt_observer(
        mut self,
        observe: impl Fn(&Outcome) + Send + Sync + 'static,
    ) -> Self {
        self.observer = Some(Arc::new(observe));
        self
    }

    /// The key for this request: the extension's choice, else the caller's header, else a new
    /// one for a keyed method. Sets (or removes) the header accordingly.
    fn key(&self, request: &mut Request, extensions: &Extensions) -> Option<String> {
        let chosen = extensions.get::<RequestKey>().cloned();
        let headers = request.headers_mut();
        let key = match chosen {
            Some(RequestKey::Omit) => {
                headers.remove(IDEMPOTENCY_KEY);
                return None;
            }
            Some(RequestKey::Use(key)) => key,
            None => {
                if let Some(existing) = headers.get(IDEMPOTENCY_KEY) {
                    return Some(String::from_utf8_lossy(existing.as_bytes()).into_owned());
                }
                if !self.methods.contains(request.method()) {
                    return None;
                }
                self.generator.generate()
            }
        };
        match HeaderValue::from_str(&self.format.render(&key)) {
            Ok(value) => {
                request.headers_mut().insert(IDEMPOTENCY_KEY, value);
                Some(key)
            }
            Err(_) => {
                // Not a valid header value: sent without (the server answers 400 if it needs one).
                tracing::warn!(
                    key,
                    "the idempotency key is not a valid header value; sent without"
                );
                None
            }
        }
    }

    fn report(&self, outcome: &Outcome, probe: Option<&Probe>) {
        if let Some(probe) = probe {
            probe.set(outcome);
        }
        if let Some(observe) = &self.observer {
            observe(outcome);
        }
    }
}

/// What ends the loop: the answer (or error) to give back.
type Answer = reqwest_middleware::Result<Response>;

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Answer {
        let policy = extensions
            .get::<RetryPolicy>()
            .copied()
            .unwrap_or(self.policy);
        let probe = extensions.get::<Probe>().cloned();
        let key = self.key(&mut request, extensions);
        let started = Instant::now();
        let mut outcome = Outcome {
            key: key.clone(),
            ..Outcome::default()
        };
        // Only a keyed request, or one of an idempotent method, may be sent again after the
        // server may have seen it.
        let resendable = key.is_some()
            || is_idempotent(request.method())
            || extensions.get::<Resendable>().is_some();
        let replayable = request.try_clone().is_some();
        let mut request = Some(request);

        loop {
            let number = outcome.attempts.len() as u32 + 1;
            let left = policy.deadline.saturating_sub(started.elapsed());
            let last_allowed = number >= policy.max_attempts.max(1) || !replayable;
            let mut this = match (last_allowed, request.as_ref().and_then(Request::try_clone)) {
                (false, Some(copy)) => copy,
                _ => request
                    .take()
                    .expect("the request is sent at most once more"),
            };
            let own_timeout = this.timeout().copied();
            if let Some(timeout) = own_timeout {
                *this.timeout_mut() = Some(timeout.min(left.max(Duration::from_millis(1))));
            }
            let sent_at = Instant::now();
            let ran = match own_timeout {
                // A timeout of its own, lowered to the deadline: reqwest cuts the attempt.
                Some(_) => Some(next.clone().run(this, extensions).await),
                None => tokio::time::timeout(left, next.clone().run(this, extensions))
                    .await
                    .ok(),
            };
            let took = sent_at.elapsed();
            let Some(ran) = ran else {
                // The deadline passed during an attempt without a timeout of its own.
                outcome.attempts.push(AttemptRecord {
                    number,
                    result: AttemptResult::Transport {
                        kind: TransportKind::Timeout,
                        message: "the operation's deadline passed".into(),
                    },
                    replayed: false,
                    problem_type: None,
                    problem_json: false,
                    retry_after: None,
                    took,
                    pause: None,
                });
                outcome.stopped = Some(StopReason::Deadline);
                outcome.elapsed = started.elapsed();
                self.report(&outcome, probe.as_ref());
                return Err(reqwest_middleware::Error::middleware(
                    IdempotencyError::Deadline {
                        deadline: policy.deadline,
                        attempt: number,
                        outcome: Box::new(outcome),
                    },
                ));
            };

            // Read the answer: status, replay mark, hint, and for 409/422 the problem type.
            let (answer, record, verdict) = match ran {
                Ok(response) => {
                    let replayed = response
                        .headers()
                        .get(IDEMPOTENT_REPLAYED)
                        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                    let retry_after = hint(response.headers());
                    let problem_json = response
                        .headers()
                        .get(reqwest::header::CONTENT_TYPE)
                        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
                    let status = response.status();
                    match Inspected::read(response).await {
                        Ok(inspected) => {
                            let verdict = classify(status, replayed, retry_after, &inspected);
                            let record = AttemptRecord {
                                number,
                                result: AttemptResult::Status(status),
                                replayed,
                                problem_type: inspected.problem_type().map(str::to_owned),
                                problem_json,
                                retry_after,
                                took,
                                pause: None,
                            };
                            (Ok((inspected, replayed)), record, verdict)
                        }
                        Err(error) => {
                            let record = AttemptRecord {
                                number,
                                result: AttemptResult::Transport {
                                    kind: TransportKind::Body,
                                    message: error.to_string(),
                                },
                                replayed,
                                problem_type: None,
                                problem_json,
                                retry_after,
                                took,
                                pause: None,
                            };
                            (Err(error.into()), record, Verdict::RetryIfResendable)
                        }
                    }
                }
                Err(error) => {
                    let (result, verdict) = match &error {
                        reqwest_middleware::Error::Reqwest(e) => {
                            let kind = TransportKind::of(e);
                            let verdict = match kind {
                                TransportKind::Connect => Verdict::Retry,
                                TransportKind::Timeout
                                | TransportKind::Request
                                | TransportKind::Body => Verdict::RetryIfResendable,
                                TransportKind::Other => Verdict::Final,
                            };
                            let result = AttemptResult::Transport {
                                kind,
                                message: e.to_string(),
                            };
                            (result, verdict)
                        }
                        reqwest_middleware::Error::Middleware(e) => (
                            AttemptResult::Transport {
                                kind: TransportKind::Other,
                                message: e.to_string(),
                            },
                            Verdict::Final,
                        ),
                    };
                    let record = AttemptRecord {
                        number,
                        result,
                        replayed: false,
                        problem_type: None,
                        problem_json: false,
                        retry_after: None,
                        took,
                        pause: None,
                    };
                    (Err(error), record, verdict)
                }
            };
            tracing::debug!(key = ?outcome.key, attempt = number, result = ?record.result, replayed = record.replayed, retry_after = ?record.retry_after, "idempotent request attempt");
            let retry_after = record.retry_after;
            outcome.attempts.push(record);

            // Decide: stop with this answer, or pause and send again.
            let stop = match verdict {
                Verdict::Final => Some(StopReason::Answered),
                Verdict::KeyReused => Some(StopReason::KeyReused),
                Verdict::RetryIfResendable if !resendable => Some(StopReason::NotRetryable),
                _ if !replayable => Some(StopReason::BodyNotReplayable),
                _ if number >= policy.max_attempts.max(1) => Some(StopReason::MaxAttempts),
                _ => None,
            };
            let pause = match stop {
                Some(_) => None,
                None => {
                    let pause = retry_after
                        .unwrap_or_else(|| policy.backoff_pause(number.saturating_sub(1)));
                    (started.elapsed() + pause < policy.deadline).then_some(pause)
                }
            };
            let stop = match (stop, pause) {
                (Some(stop), _) => Some(stop),
                (None, None) => Some(StopReason::Deadline),
                (None, Some(_)) => None,
            };
            if let Some(stop) = stop {
                outcome.stopped = Some(stop);
                outcome.replayed = matches!(&answer, Ok((_, true)));
                outcome.elapsed = started.elapsed();
                self.report(&outcome, probe.as_ref());
                return match answer {
                    Ok((inspected, _)) if stop == StopReason::KeyReused => {
                        let detail = inspected.detail();
                        Err(reqwest_middleware::Error::middleware(
                            IdempotencyError::KeyReused {
                                key: outcome.key.clone(),
                                detail,
                                outcome: Box::new(outcome),
                            },
                        ))
                    }
                    Ok((inspected, _)) => {
                        let mut response = inspected.into_response();
                        response.extensions_mut().insert(outcome);
                        Ok(response)
                    }
                    Err(error) => Err(error),
                };
            }
            let pause = pause.expect("a retry has its pause");
            if let Some(last) = outcome.attempts.last_mut() {
                last.pause = Some(pause);
            }
            self.report(&outcome, probe.as_ref());
            drop(answer);
            tokio::time::sleep(pause).await;
        }
    }
}
