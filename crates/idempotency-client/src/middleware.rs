//! [`IdempotencyMiddleware`]: the key, then the retry loop, for one logical operation per
//! `send()`.

use crate::{
    error::IdempotencyError,
    outcome::{AttemptRecord, AttemptResult, Outcome, Probe, StopReason, TransportKind},
    policy::{KeyFormat, KeyGenerator, RequestKey, Resendable, RetryPolicy},
    retry::{classify, hint, is_idempotent, AfterAttempt, Inspected},
};
use http::{Extensions, HeaderValue, Method};
use idempotency_wire::{
    header::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED},
    ProblemType, DEFAULT_PROBLEM_BASE,
};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use std::{
    fmt,
    sync::Arc,
    time::{Duration, Instant},
};

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
    problem_base: Arc<str>,
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
            .field("problem_base", &self.problem_base)
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
            problem_base: Arc::from(DEFAULT_PROBLEM_BASE),
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

    /// The base of the server's problem `type` URIs (default
    /// [`DEFAULT_PROBLEM_BASE`](idempotency_wire::DEFAULT_PROBLEM_BASE)): give the base the
    /// server's layer was given (`IdempotencyLayer::with_problem_base`). A problem document is
    /// one of the layer's ([`ProblemType`]) only when its `type` is this base followed by one of
    /// the slugs; any other is the application's own, judged by its status and hints alone.
    ///
    /// ```
    /// use idempotency_client::IdempotencyMiddleware;
    /// let middleware = IdempotencyMiddleware::new().with_problem_base("https://errors.example.com/idempotency/");
    /// # let _ = middleware;
    /// ```
    pub fn with_problem_base(mut self, base: impl Into<String>) -> Self {
        self.problem_base = Arc::from(base.into());
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

/// What one attempt got back: the answer read in full with its replay mark, or the error.
type Read = reqwest_middleware::Result<(Inspected, bool)>;

/// One logical operation: its rules, and what it did so far.
struct Operation {
    policy: RetryPolicy,
    probe: Option<Probe>,
    started: Instant,
    resendable: bool,
    replayable: bool,
    outcome: Outcome,
}

impl Operation {
    /// The request to send as attempt `number`: a copy while another attempt may follow, else
    /// the original itself.
    fn request(&self, request: &mut Option<Request>, number: u32) -> Request {
        let last_allowed = number >= self.policy.max_attempts.max(1) || !self.replayable;
        match (last_allowed, request.as_ref().and_then(Request::try_clone)) {
            (false, Some(copy)) => copy,
            _ => request
                .take()
                .expect("the request is sent at most once more"),
        }
    }

    /// Stop (and why), or the pause before the next attempt.
    fn decide(
        &self,
        after: AfterAttempt,
        number: u32,
        retry_after: Option<Duration>,
    ) -> Result<Duration, StopReason> {
        let stop = match after {
            AfterAttempt::Final => Some(StopReason::Answered),
            AfterAttempt::KeyReused => Some(StopReason::KeyReused),
            AfterAttempt::RetryIfResendable if !self.resendable => Some(StopReason::NotRetryable),
            _ if !self.replayable => Some(StopReason::BodyNotReplayable),
            _ if number >= self.policy.max_attempts.max(1) => Some(StopReason::MaxAttempts),
            _ => None,
        };
        if let Some(stop) = stop {
            return Err(stop);
        }
        let pause =
            retry_after.unwrap_or_else(|| self.policy.backoff_pause(number.saturating_sub(1)));
        if self.started.elapsed() + pause < self.policy.deadline {
            Ok(pause)
        } else {
            Err(StopReason::Deadline)
        }
    }
}

/// Sends one attempt with what is `left` of the deadline; `None` if the deadline passed during
/// it.
async fn send(
    mut request: Request,
    left: Duration,
    extensions: &mut Extensions,
    next: Next<'_>,
) -> Option<reqwest_middleware::Result<Response>> {
    let own_timeout = request.timeout().copied();
    if let Some(timeout) = own_timeout {
        *request.timeout_mut() = Some(timeout.min(left.max(Duration::from_millis(1))));
    }
    match own_timeout {
        // A timeout of its own, lowered to the deadline: reqwest cuts the attempt.
        Some(_) => Some(next.run(request, extensions).await),
        None => tokio::time::timeout(left, next.run(request, extensions))
            .await
            .ok(),
    }
}

/// Reads the answer: status, replay mark, hint, and for 409/422 the problem type (one of the
/// layer's when its `type` is under `problem_base`).
async fn read(
    response: Response,
    number: u32,
    took: Duration,
    problem_base: &str,
) -> (Read, AttemptRecord, AfterAttempt) {
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
            let problem_type = inspected.problem_type();
            let problem = problem_type.and_then(|t| ProblemType::from_type_uri(t, problem_base));
            let after = classify(status, replayed, retry_after, problem);
            let record = AttemptRecord {
                number,
                result: AttemptResult::Status(status),
                replayed,
                problem,
                problem_type: problem_type.map(str::to_owned),
                problem_json,
                retry_after,
                took,
                pause: None,
            };
            (Ok((inspected, replayed)), record, after)
        }
        Err(error) => {
            let record = AttemptRecord {
                number,
                result: AttemptResult::Transport {
                    kind: TransportKind::Body,
                    message: error.to_string(),
                },
                replayed,
                problem: None,
                problem_type: None,
                problem_json,
                retry_after,
                took,
                pause: None,
            };
            (Err(error.into()), record, AfterAttempt::RetryIfResendable)
        }
    }
}

/// An attempt that got no answer: what kind of failure, and whether it may be retried.
fn failed(
    error: reqwest_middleware::Error,
    number: u32,
    took: Duration,
) -> (Read, AttemptRecord, AfterAttempt) {
    let (result, after) = match &error {
        reqwest_middleware::Error::Reqwest(e) => {
            let kind = TransportKind::of(e);
            let after = match kind {
                TransportKind::Connect => AfterAttempt::Retry,
                TransportKind::Timeout | TransportKind::Request | TransportKind::Body => {
                    AfterAttempt::RetryIfResendable
                }
                TransportKind::Other => AfterAttempt::Final,
            };
            let result = AttemptResult::Transport {
                kind,
                message: e.to_string(),
            };
            (result, after)
        }
        reqwest_middleware::Error::Middleware(e) => (
            AttemptResult::Transport {
                kind: TransportKind::Other,
                message: e.to_string(),
            },
            AfterAttempt::Final,
        ),
    };
    let record = AttemptRecord {
        number,
        result,
        replayed: false,
        problem: None,
        problem_type: None,
        problem_json: false,
        retry_after: None,
        took,
        pause: None,
    };
    (Err(error), record, after)
}

impl IdempotencyMiddleware {
    /// The deadline passed during attempt `number`, which had no timeout of its own.
    fn deadline_passed(&self, mut operation: Operation, number: u32, took: Duration) -> Answer {
        operation.outcome.attempts.push(AttemptRecord {
            number,
            result: AttemptResult::Transport {
                kind: TransportKind::Timeout,
                message: "the operation's deadline passed".into(),
            },
            replayed: false,
            problem: None,
            problem_type: None,
            problem_json: false,
            retry_after: None,
            took,
            pause: None,
        });
        operation.outcome.stopped = Some(StopReason::Deadline);
        operation.outcome.elapsed = operation.started.elapsed();
        self.report(&operation.outcome, operation.probe.as_ref());
        Err(reqwest_middleware::Error::middleware(
            IdempotencyError::Deadline {
                deadline: operation.policy.deadline,
                attempt: number,
                outcome: Box::new(operation.outcome),
            },
        ))
    }

    /// Stops with the last attempt's answer, the outcome attached.
    fn stop(&self, operation: Operation, answer: Read, stop: StopReason) -> Answer {
        let mut outcome = operation.outcome;
        outcome.stopped = Some(stop);
        outcome.replayed = matches!(&answer, Ok((_, true)));
        outcome.elapsed = operation.started.elapsed();
        self.report(&outcome, operation.probe.as_ref());
        match answer {
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
        }
    }
}

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
        let outcome = Outcome {
            key: key.clone(),
            ..Outcome::default()
        };
        // Only a keyed request, or one of an idempotent method, may be sent again after the
        // server may have seen it.
        let resendable = key.is_some()
            || is_idempotent(request.method())
            || extensions.get::<Resendable>().is_some();
        let replayable = request.try_clone().is_some();
        let mut operation = Operation {
            policy,
            probe,
            started,
            resendable,
            replayable,
            outcome,
        };
        let mut request = Some(request);

        loop {
            let number = operation.outcome.attempts.len() as u32 + 1;
            let left = policy.deadline.saturating_sub(started.elapsed());
            let this = operation.request(&mut request, number);
            let sent_at = Instant::now();
            let ran = send(this, left, extensions, next.clone()).await;
            let took = sent_at.elapsed();
            let (answer, record, after) = match ran {
                // The deadline passed during an attempt without a timeout of its own.
                None => return self.deadline_passed(operation, number, took),
                Some(Ok(response)) => read(response, number, took, &self.problem_base).await,
                Some(Err(error)) => failed(error, number, took),
            };
            tracing::debug!(key = ?operation.outcome.key, attempt = number, result = ?record.result, replayed = record.replayed, retry_after = ?record.retry_after, "idempotent request attempt");
            let retry_after = record.retry_after;
            operation.outcome.attempts.push(record);

            // Decide: stop with this answer, or pause and send again.
            let pause = match operation.decide(after, number, retry_after) {
                Ok(pause) => pause,
                Err(stop) => return self.stop(operation, answer, stop),
            };
            if let Some(last) = operation.outcome.attempts.last_mut() {
                last.pause = Some(pause);
            }
            self.report(&operation.outcome, operation.probe.as_ref());
            drop(answer);
            tokio::time::sleep(pause).await;
        }
    }
}
