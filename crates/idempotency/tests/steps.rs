//! Durable operations (steps with recovery points) on PostgreSQL, SQLite and MySQL/MariaDB.
//!
//! The operation under test, [`Transfer`], is (a) a local step writing a business row, (b) an
//! outside call to an in-memory keyed payment provider ([`Provider`]) whose output is committed
//! with the next step, (b') a local step writing a business row, and (c) `finish`, writing another
//! business row and completing the key with a receipt. A [`Hook`] stops a worker at a
//! chosen point: it panics there, hangs there (and the test drops the future), or blocks there
//! until the test lets it go on. Business rows are named `{trial}/a`, `{trial}/b`, `{trial}/c/{worker}` and
//! `{trial}/undo`, so every count names the worker that wrote it.

mod common;

use common::{unique, wait_until, Harness};
use idempotency::{
    durable::{
        provider_key, CallError, Finished, Lookup, Operation, Operations, PerformError, StepError,
        StepPolicy, Steps, MAX_STORED_REQUEST,
    },
    maintenance::{MaintenanceWorker, Recovery, RecoveryReport},
    protocol::canonical_json,
    store::{KeyRecord, KeyState, Maintenance},
    Error, Idempotency, IdempotencyKey, Outcome, Store,
};
use serde::{Deserialize, Serialize};
use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};
use tokio::sync::Notify;

test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    resumes_from_every_recovery_point,
    a_late_original_worker_is_fenced_out,
    a_retry_and_the_resumer_race_for_one_key,
    unknown_outcomes_end_in_review_never_in_a_release,
    a_declined_call_settles_as_a_stored_failure,
    an_unkeyed_call_whose_answer_is_lost_parks_the_key,
    a_lost_answer_is_looked_up_and_completes_inline,
    a_call_lasting_five_leases_keeps_its_key,
    a_client_retry_resumes_an_abandoned_operation,
    the_request_is_stored_while_pending_and_cleared_on_completion,
    an_oversized_request_is_refused_and_its_key_released,
    the_maintenance_worker_resumes_abandoned_operations,
    a_database_not_now_after_progress_is_not_counted_toward_review,
}

const SCOPE: &str = "user-7";
/// The lease of the worker that "crashes" in most tests.
const LEASE: Duration = Duration::from_millis(80);
/// The lease in the race test: short, so 200 trials stay fast.
const TINY_LEASE: Duration = Duration::from_millis(15);
/// How long anything that should happen may take before a test gives up.
const WAIT: Duration = Duration::from_secs(15);
/// The workers that may write a (c) row.
const TAGS: [&str; 3] = ["first", "retry", "resumer"];

// --- The fake payment provider -----------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Charge {
    id: String,
    cents: i64,
}

/// How the provider answers one call.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// Charges (once per provider key) and answers.
    Charge,
    /// Fails before the effect: nothing charged, no answer.
    LostBefore,
    /// Fails after the effect: charged, but the answer is lost.
    LostAfter,
    /// Refuses for good.
    Decline(String),
}

#[derive(Debug)]
struct ProviderState {
    /// By provider key: a keyed provider charges a key once.
    charges: HashMap<String, Charge>,
    calls: HashMap<String, u32>,
    lookups: HashMap<String, u32>,
    /// The answers of the next calls, then `otherwise`.
    script: VecDeque<Answer>,
    otherwise: Answer,
    lookup_unknown: bool,
    /// How long a call takes before it reaches the provider.
    delay: Duration,
    next_id: u64,
}

impl Default for ProviderState {
    fn default() -> Self {
        Self {
            charges: HashMap::new(),
            calls: HashMap::new(),
            lookups: HashMap::new(),
            script: VecDeque::new(),
            otherwise: Answer::Charge,
            lookup_unknown: false,
            delay: Duration::ZERO,
            next_id: 0,
        }
    }
}

impl ProviderState {
    fn apply(&mut self, key: &str, cents: i64) -> Charge {
        if let Some(charge) = self.charges.get(key) {
            return charge.clone();
        }
        self.next_id += 1;
        let charge = Charge {
            id: format!("ch_{}", self.next_id),
            cents,
        };
        self.charges.insert(key.to_owned(), charge.clone());
        charge
    }
}

/// An in-memory payment provider that honours idempotency keys.
#[derive(Debug, Clone, Default)]
struct Provider(Arc<Mutex<ProviderState>>);

impl Provider {
    fn script(&self, answers: impl IntoIterator<Item = Answer>) {
        self.0.lock().unwrap().script.extend(answers);
    }

    fn always(&self, answer: Answer) {
        self.0.lock().unwrap().otherwise = answer;
    }

    fn slow_calls(&self, delay: Duration) {
        self.0.lock().unwrap().delay = delay;
    }

    fn lookups_unknown(&self) {
        self.0.lock().unwrap().lookup_unknown = true;
    }

    async fn charge(&self, key: String, cents: i64) -> Result<Charge, CallError> {
        let delay = self.0.lock().unwrap().delay;
        tokio::time::sleep(delay).await;
        let mut guard = self.0.lock().unwrap();
        let state = &mut *guard;
        *state.calls.entry(key.clone()).or_default() += 1;
        let answer = state
            .script
            .pop_front()
            .unwrap_or_else(|| state.otherwise.clone());
        match answer {
            Answer::Charge => Ok(state.apply(&key, cents)),
            Answer::LostBefore => Err(CallError::Unknown(
                "timed out before reaching the provider".into(),
            )),
            Answer::LostAfter => {
                state.apply(&key, cents);
                Err(CallError::Unknown(
                    "connection reset after the charge".into(),
                ))
            }
            Answer::Decline(reason) => Err(CallError::Declined(reason)),
        }
    }

    async fn lookup(&self, key: String) -> Lookup<Charge> {
        tokio::task::yield_now().await;
        let mut state = self.0.lock().unwrap();
        *state.lookups.entry(key.clone()).or_default() += 1;
        if state.lookup_unknown {
            return Lookup::Unknown("the provider did not answer".into());
        }
        match state.charges.get(&key) {
            Some(charge) => Lookup::Done(charge.clone()),
            None => Lookup::NotDone,
        }
    }

    fn charge_of(&self, key: &str) -> Option<Charge> {
        self.0.lock().unwrap().charges.get(key).cloned()
    }

    fn total_charges(&self) -> usize {
        self.0.lock().unwrap().charges.len()
    }

    fn calls(&self, key: &str) -> u32 {
        self.0.lock().unwrap().calls.get(key).copied().unwrap_or(0)
    }

    fn lookups(&self, key: &str) -> u32 {
        self.0
            .lock()
            .unwrap()
            .lookups
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

/// A mailer without idempotency keys.
#[derive(Debug, Clone, Default)]
struct Mailer {
    sent: Arc<AtomicU32>,
    lose_answers: Arc<AtomicBool>,
}

impl Mailer {
    async fn send(&self, to: String) -> Result<String, CallError> {
        tokio::task::yield_now().await;
        let n = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        if self.lose_answers.load(Ordering::SeqCst) {
            Err(CallError::Unknown("smtp timeout after DATA".into()))
        } else {
            Ok(format!("msg-{n}-{to}"))
        }
    }

    fn sent(&self) -> u32 {
        self.sent.load(Ordering::SeqCst)
    }
}

// --- Test hooks ----------------------------------------------------------------------------------

/// Where an operation may be stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    /// Before (a): nothing recorded.
    Start,
    /// After (a) committed, before the call.
    AfterDebit,
    /// Inside the call, after the provider acted and before its answer was recorded (answer
    /// lost); for the mailer, after the "started" mark and before sending.
    CallMade,
    /// After (b) answered (its output noted, not yet committed), before (b').
    AfterCharge,
    /// After (b') committed (and (b)'s output with it), before (c).
    AfterNote,
    /// Inside (c): its row is written, the transaction is open, nothing is committed.
    InsideFinish,
}

/// How an operation stops at its point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// A crash: the operation panics.
    Panic,
    /// A cancellation: the operation never goes on, and the test drops its future.
    Hang,
    /// A slow worker: it waits until the test lets it go on.
    Block,
}

#[derive(Debug, Clone, Default)]
struct Hook {
    at: Option<(Point, Stop)>,
    reached: Arc<Notify>,
    go_on: Arc<Notify>,
}

impl Hook {
    fn at(point: Point, stop: Stop) -> Self {
        Self {
            at: Some((point, stop)),
            ..Self::default()
        }
    }

    async fn pass(&self, point: Point) {
        let Some((at, stop)) = self.at else { return };
        if at != point {
            return;
        }
        self.reached.notify_one();
        match stop {
            Stop::Panic => panic!("simulated crash at {point:?}"),
            Stop::Hang => std::future::pending::<()>().await,
            Stop::Block => self.go_on.notified().await,
        }
    }

    /// Waits until the operation reached its stop.
    async fn reached(&self) {
        tokio::time::timeout(WAIT, self.reached.notified())
            .await
            .expect("the operation never reached its stop");
    }
}

// --- The operations ------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TransferRequest {
    trial: String,
    cents: i64,
    memo: String,
}

impl TransferRequest {
    fn new(trial: &str, cents: i64) -> Self {
        Self {
            trial: trial.to_owned(),
            cents,
            memo: String::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    trial: String,
    status: String,
    charge: Option<String>,
    cents: i64,
    reason: Option<String>,
}

impl Receipt {
    fn charged(trial: &str, charge: &Charge) -> Self {
        Self {
            trial: trial.to_owned(),
            status: "charged".into(),
            charge: Some(charge.id.clone()),
            cents: charge.cents,
            reason: None,
        }
    }

    fn declined(trial: &str, cents: i64, reason: &str) -> Self {
        Self {
            trial: trial.to_owned(),
            status: "declined".into(),
            charge: None,
            cents,
            reason: Some(reason.to_owned()),
        }
    }
}

/// (a) `debit`: a business row; (b) `charge`: the provider; (c) `finish`: a business row and the
/// receipt. A declined charge is compensated in `fail` (an `undo` row) with a stored refusal.
#[derive(Debug, Clone)]
struct Transfer {
    provider: Provider,
    hook: Hook,
    /// Names the worker in its (c) row.
    tag: &'static str,
}

impl Transfer {
    fn new(provider: &Provider, tag: &'static str) -> Self {
        Self {
            provider: provider.clone(),
            hook: Hook::default(),
            tag,
        }
    }

    fn stopping(mut self, point: Point, stop: Stop) -> Self {
        self.hook = Hook::at(point, stop);
        self
    }
}

impl<S: Harness> Operation<S> for Transfer {
    type Request = TransferRequest;
    type Response = Receipt;

    fn name(&self) -> &str {
        "transfer"
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        request: &TransferRequest,
    ) -> Result<Finished<Receipt>, StepError> {
        self.hook.pass(Point::Start).await;

        // (a)
        let debit = format!("{}/a", request.trial);
        steps
            .local("debit", async move |tx| {
                S::insert_effect(tx, &debit).await?;
                Ok::<_, sqlx::Error>(debit)
            })
            .await?;
        self.hook.pass(Point::AfterDebit).await;

        // (b)
        let cents = request.cents;
        let (provider, hook) = (self.provider.clone(), self.hook.clone());
        let asked = self.provider.clone();
        let charged = steps
            .call(
                "charge",
                move |key| {
                    let (provider, hook) = (provider.clone(), hook.clone());
                    async move {
                        let answer = provider.charge(key, cents).await;
                        hook.pass(Point::CallMade).await;
                        answer
                    }
                },
                move |key| {
                    let asked = asked.clone();
                    async move { asked.lookup(key).await }
                },
            )
            .await;
        let charge = match charged {
            Ok(charge) => charge,
            Err(StepError::Declined { reason, .. }) => {
                let undo = format!("{}/undo", request.trial);
                let refusal = Receipt::declined(&request.trial, cents, &reason);
                return steps
                    .fail(&reason, async move |tx| {
                        S::insert_effect(tx, &undo).await?;
                        Ok::<_, sqlx::Error>(refusal)
                    })
                    .await;
            }
            Err(other) => return Err(other),
        };
        self.hook.pass(Point::AfterCharge).await;

        // (b')
        let note = format!("{}/b", request.trial);
        steps
            .local("note", async move |tx| {
                S::insert_effect(tx, &note).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await?;
        self.hook.pass(Point::AfterNote).await;

        // (c)
        let done = format!("{}/c/{}", request.trial, self.tag);
        let receipt = Receipt::charged(&request.trial, &charge);
        let hook = self.hook.clone();
        steps
            .finish(async move |tx| {
                S::insert_effect(tx, &done).await?;
                hook.pass(Point::InsideFinish).await;
                Ok::<_, sqlx::Error>(receipt)
            })
            .await
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct NoticeRequest {
    trial: String,
}

/// (a) a business row, (b) a mail through a provider without keys, (c) a business row.
#[derive(Debug, Clone)]
struct Notice {
    mailer: Mailer,
    hook: Hook,
}

impl<S: Harness> Operation<S> for Notice {
    type Request = NoticeRequest;
    type Response = String;

    fn name(&self) -> &str {
        "notice"
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        request: &NoticeRequest,
    ) -> Result<Finished<String>, StepError> {
        let noted = format!("{}/a", request.trial);
        steps
            .local("note", async move |tx| {
                S::insert_effect(tx, &noted).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await?;
        let (mailer, hook, to) = (
            self.mailer.clone(),
            self.hook.clone(),
            request.trial.clone(),
        );
        let message: String = steps
            .call_unkeyed("mail", move || async move {
                hook.pass(Point::CallMade).await;
                mailer.send(to).await
            })
            .await?;
        let done = format!("{}/c/first", request.trial);
        steps
            .finish(async move |tx| {
                S::insert_effect(tx, &done).await?;
                Ok::<_, sqlx::Error>(message)
            })
            .await
    }
}

// --- Helpers -------------------------------------------------------------------------------------

fn key_of(operation: &str, client_key: &str) -> IdempotencyKey {
    IdempotencyKey::new(SCOPE, operation, client_key).unwrap()
}

fn policy() -> StepPolicy {
    StepPolicy::default().with_retry_after(Duration::from_millis(50))
}

/// The engine of these tests. Their workers stall or die on purpose, so leases are not kept
/// alive (a frozen or dead process stops beating); the heartbeat is proven in `protocol.rs`.
fn engine<S: Store>(store: &S, lease: Duration) -> Idempotency<S> {
    Idempotency::new(store.clone())
        .with_lease(lease)
        .with_heartbeat(false)
        .with_step_policy(policy())
}

/// The resumer, running `operation` for the keys it takes over.
fn resumer<S: Harness + Maintenance, O: Operation<S>>(store: &S, operation: O) -> Recovery<S> {
    Recovery::new(store.clone())
        .with_operations(engine(store, LEASE), Operations::new().with(operation))
}

/// Runs `operation` until its hook stops it, then makes it die there: a panic, or a dropped
/// (cancelled) future.
async fn crash<S, O>(engine: &Idempotency<S>, operation: O, client_key: &str, request: &O::Request)
where
    S: Harness,
    O: Operation<S> + HasHook,
    O::Request: Clone,
{
    let hook = operation.hook().clone();
    let (_, stop) = hook.at.expect("a hook with a stop");
    let task = tokio::spawn({
        let (engine, client_key, request) =
            (engine.clone(), client_key.to_owned(), request.clone());
        async move {
            engine
                .perform(&operation, SCOPE, &client_key, &request)
                .await
                .map(drop)
        }
    });
    hook.reached().await;
    match stop {
        Stop::Panic => {
            let ended = task.await.expect_err("the operation must panic");
            assert!(ended.is_panic(), "{ended:?}");
        }
        Stop::Hang => {
            task.abort();
            let ended = task.await.expect_err("the operation must be cancelled");
            assert!(ended.is_cancelled(), "{ended:?}");
        }
        Stop::Block => unreachable!("a blocked worker is let go by the test itself"),
    }
}

trait HasHook {
    fn hook(&self) -> &Hook;
}

impl HasHook for Transfer {
    fn hook(&self) -> &Hook {
        &self.hook
    }
}

impl HasHook for Notice {
    fn hook(&self) -> &Hook {
        &self.hook
    }
}

/// Waits until the key's lease has ended by the database clock; the key must stay there.
async fn wait_lease_end<S: Harness>(store: &S, key: &IdempotencyKey) -> KeyRecord {
    let deadline = Instant::now() + WAIT;
    loop {
        let row = store
            .find(key)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{}: {key} vanished while pending", S::NAME));
        if row.lease_expired() {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "{}: the lease never ended",
            S::NAME
        );
        let pause = row.lease_remaining.min(Duration::from_millis(50));
        tokio::time::sleep(pause + Duration::from_millis(1)).await;
    }
}

async fn count<S: Harness>(store: &S, trial: &str, row: &str) -> i64 {
    store.count_effects(&format!("{trial}/{row}")).await
}

/// The (c) rows of `trial`, all workers together.
async fn finish_rows<S: Harness>(store: &S, trial: &str) -> i64 {
    let mut total = 0;
    for tag in TAGS {
        total += count(store, trial, &format!("c/{tag}")).await;
    }
    total
}

/// The key completed with a receipt for the one charge under the derived provider key, (a) and
/// (c) each written once, the request cleared. Returns the stored receipt.
async fn assert_charged_once<S: Harness>(
    store: &S,
    provider: &Provider,
    key: &IdempotencyKey,
    trial: &str,
    context: &str,
) -> Receipt {
    let row = store.find(key).await.unwrap().expect("the key exists");
    assert_eq!(row.state, KeyState::Completed, "{context}");
    assert_eq!(
        row.request, None,
        "{context}: request kept after completion"
    );
    let receipt: Receipt = serde_json::from_slice(row.result.as_deref().expect("a result"))
        .expect("the stored receipt");
    let charge = provider
        .charge_of(&provider_key(key, "charge"))
        .unwrap_or_else(|| panic!("{context}: no charge under the derived provider key"));
    assert_eq!(receipt, Receipt::charged(trial, &charge), "{context}");
    assert_eq!(count(store, trial, "a").await, 1, "{context}: (a) rows");
    assert_eq!(count(store, trial, "b").await, 1, "{context}: (b') rows");
    assert_eq!(finish_rows(store, trial).await, 1, "{context}: (c) rows");
    assert_eq!(count(store, trial, "undo").await, 0, "{context}: undo rows");
    receipt
}

// --- 1. Resume from every recovery point ---------------------------------------------------------

async fn resumes_from_every_recovery_point<S: Harness + Maintenance>(store: S) {
    let started = Instant::now();
    let points = [
        Point::Start,
        Point::AfterDebit,
        Point::CallMade,
        Point::AfterCharge,
        Point::AfterNote,
        Point::InsideFinish,
    ];
    for stop in [Stop::Panic, Stop::Hang] {
        for point in points {
            let context = format!("{}: {stop:?} at {point:?}", S::NAME);
            let provider = Provider::default();
            let trial = unique("resume");
            let key = key_of("transfer", &trial);
            let pk = provider_key(&key, "charge");
            let request = TransferRequest::new(&trial, 1250);
            let first = Transfer::new(&provider, "first").stopping(point, stop);
            crash(&engine(&store, LEASE), first, &trial, &request).await;

            // What the crashed worker left behind.
            let row = wait_lease_end(&store, &key).await;
            assert_eq!(row.state, KeyState::Pending, "{context}");
            let point_recorded = match point {
                Point::Start => None,
                Point::AfterDebit | Point::CallMade | Point::AfterCharge => Some("debit"),
                Point::AfterNote | Point::InsideFinish => Some("note"),
            };
            assert_eq!(row.recovery_point.as_deref(), point_recorded, "{context}");
            assert_eq!(row.request.is_some(), point != Point::Start, "{context}");
            assert_eq!(
                finish_rows(&store, &trial).await,
                0,
                "{context}: an uncommitted (c) survived the crash"
            );

            let recovery = resumer(&store, Transfer::new(&provider, "resumer"));
            let report = recovery.run_once().await.unwrap();
            if point == Point::Start {
                // Nothing recorded: no outside call was made, so the key is released.
                let released = {
                    let mut expected = RecoveryReport::default();
                    expected.released = 1;
                    expected
                };
                assert_eq!(report, released, "{context}: {report}");
                assert!(store.find(&key).await.unwrap().is_none(), "{context}");
                assert_eq!(provider.total_charges(), 0, "{context}");
                assert_eq!(provider.calls(&pk), 0, "{context}");
                assert_eq!(count(&store, &trial, "a").await, 0, "{context}");
                // ... and the client's retry runs it from the top.
                let again = engine(&store, LEASE)
                    .perform(&Transfer::new(&provider, "retry"), SCOPE, &trial, &request)
                    .await
                    .unwrap();
                let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
                assert_eq!(again, Outcome::Executed(receipt), "{context}");
                continue;
            }
            let completed = {
                let mut expected = RecoveryReport::default();
                expected.completed = 1;
                expected
            };
            assert_eq!(report, completed, "{context}: {report}");
            let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
            assert_eq!(count(&store, &trial, "c/resumer").await, 1, "{context}");
            assert_eq!(provider.total_charges(), 1, "{context}");
            // A recorded call is neither asked about nor made again; an unrecorded one (lost
            // answer, or an answer noted but not yet committed) is asked about first, and made
            // only when the provider has no record of it.
            let (calls, lookups) = match point {
                Point::AfterDebit | Point::CallMade | Point::AfterCharge => (1, 1),
                _ => (1, 0),
            };
            assert_eq!(
                (provider.calls(&pk), provider.lookups(&pk)),
                (calls, lookups),
                "{context}: (calls, lookups)"
            );

            // The client's retry replays the resumer's response and runs nothing.
            let replay = engine(&store, LEASE)
                .perform(&Transfer::new(&provider, "retry"), SCOPE, &trial, &request)
                .await
                .unwrap();
            assert_eq!(replay, Outcome::Replayed(receipt), "{context}");
            assert_eq!(provider.calls(&pk), calls, "{context}");
            assert_eq!(finish_rows(&store, &trial).await, 1, "{context}");
            assert_eq!(
                recovery.run_once().await.unwrap(),
                RecoveryReport::default(),
                "{context}: a settled key is left alone"
            );
        }
    }
    eprintln!(
        "{}: resumes_from_every_recovery_point: {:?}",
        S::NAME,
        started.elapsed()
    );
}

// --- 2. A late original worker is fenced out -----------------------------------------------------

async fn a_late_original_worker_is_fenced_out<S: Harness + Maintenance>(store: S) {
    // Inside (c) the worker holds a business transaction open with its (c) row written. SQLite
    // has one writer, whose lock that transaction holds: nobody can take the key over meanwhile,
    // so there the worker is held just before (c) instead (its (c) then runs after the takeover).
    let points: &[Point] = if S::NAME == "sqlite" {
        &[Point::AfterCharge]
    } else {
        &[Point::InsideFinish, Point::AfterCharge]
    };
    for &point in points {
        let context = format!("{}: late worker held at {point:?}", S::NAME);
        let provider = Provider::default();
        let trial = unique("late");
        let key = key_of("transfer", &trial);
        let request = TransferRequest::new(&trial, 700);
        let first = Transfer::new(&provider, "first").stopping(point, Stop::Block);
        let hook = first.hook.clone();
        let worker = tokio::spawn({
            let (engine, trial, request) = (engine(&store, LEASE), trial.clone(), request.clone());
            async move { engine.perform(&first, SCOPE, &trial, &request).await }
        });
        hook.reached().await;

        // The worker is slow: its lease ends, and the resumer takes the key over and finishes.
        wait_lease_end(&store, &key).await;
        let report = resumer(&store, Transfer::new(&provider, "resumer"))
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.completed, 1, "{context}: {report}");
        let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
        assert_eq!(count(&store, &trial, "c/resumer").await, 1, "{context}");

        // The original goes on: its step is refused, and its (c) writes rolled back.
        hook.go_on.notify_one();
        let late = tokio::time::timeout(WAIT, worker)
            .await
            .expect("the late worker finishes")
            .expect("no panic");
        assert!(
            matches!(late, Err(PerformError::LeaseLost)),
            "{context}: {late:?}"
        );
        assert_eq!(count(&store, &trial, "c/first").await, 0, "{context}");
        assert_eq!(count(&store, &trial, "c/resumer").await, 1, "{context}");
        let again = assert_charged_once(&store, &provider, &key, &trial, &context).await;
        assert_eq!(
            again, receipt,
            "{context}: the late worker changed the response"
        );
        assert_eq!(provider.total_charges(), 1, "{context}");
        let replay = engine(&store, LEASE)
            .perform(&Transfer::new(&provider, "retry"), SCOPE, &trial, &request)
            .await
            .unwrap();
        assert_eq!(replay, Outcome::Replayed(receipt), "{context}");
    }
}

// --- 3. A client retry and the resumer race for one key ------------------------------------------

async fn a_retry_and_the_resumer_race_for_one_key<S: Harness + Maintenance>(store: S) {
    const TRIALS: usize = 200;
    let started = Instant::now();
    let provider = Provider::default();
    // The resumer drives under a long lease: a claim it won is never taken from it by a slow
    // machine (with the usual 80 ms, a resumer slowed past its lease under load lets the retry
    // claim the key after it, and both ask the provider, which the even trials rule out).
    let recovery = Arc::new(Recovery::new(store.clone()).with_operations(
        engine(&store, Duration::from_secs(30)),
        Operations::new().with(Transfer::new(&provider, "resumer")),
    ));
    let retry_op = Arc::new(Transfer::new(&provider, "retry"));
    let crash_engine = engine(&store, TINY_LEASE);
    // How each trial went: who drove it, and what the other saw.
    let mut tally: HashMap<&'static str, usize> = HashMap::new();
    for trial_no in 0..TRIALS {
        let trial = format!("{}-{trial_no}", unique("race"));
        let key = key_of("transfer", &trial);
        let request = TransferRequest::new(&trial, 100 + trial_no as i64);
        let first = Transfer::new(&provider, "first").stopping(Point::AfterDebit, Stop::Hang);
        crash(&crash_engine, first, &trial, &request).await;
        wait_lease_end(&store, &key).await;

        // Half the retries hold a tiny lease, which the resumer may take over mid-run; in every
        // fourth trial the call is slow and the resumer comes a little late, so that it does.
        let retry_engine = engine(
            &store,
            if trial_no % 2 == 0 {
                Duration::from_secs(30)
            } else {
                TINY_LEASE
            },
        );
        let (late, slow) = if trial_no % 4 == 3 {
            (TINY_LEASE + Duration::from_millis(5), TINY_LEASE * 2)
        } else {
            (Duration::ZERO, Duration::ZERO)
        };
        provider.slow_calls(slow);
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let retry = tokio::spawn({
            let (barrier, retry_op) = (barrier.clone(), retry_op.clone());
            let (trial, request) = (trial.clone(), request.clone());
            async move {
                barrier.wait().await;
                retry_engine
                    .perform(&*retry_op, SCOPE, &trial, &request)
                    .await
            }
        });
        let resume = tokio::spawn({
            let (barrier, recovery) = (barrier.clone(), recovery.clone());
            async move {
                barrier.wait().await;
                tokio::time::sleep(late).await;
                recovery.run_once().await.unwrap()
            }
        });
        let retried = retry.await.unwrap();
        let report = resume.await.unwrap();

        let context = format!(
            "{}: trial {trial_no}: retry {retried:?}, resumer {report}",
            S::NAME
        );
        let executed = matches!(retried, Ok(Outcome::Executed(_)));
        assert_eq!(
            u64::from(executed) + report.completed,
            1,
            "{context}: exactly one of them must drive the operation"
        );
        assert_eq!(
            (
                report.released,
                report.failed,
                report.parked,
                report.unknown
            ),
            (0, 0, 0, 0),
            "{context}"
        );
        let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
        let winner = if executed { "retry" } else { "resumer" };
        assert_eq!(
            count(&store, &trial, &format!("c/{winner}")).await,
            1,
            "{context}"
        );
        // With a long retry lease nobody can take the key from whoever claimed it first: the
        // loser made no step at all, so the provider was asked once and called once (the winner
        // resumed after (a): "not done?", then the charge). With a tiny one the resumer may take
        // over a retry whose lease ran out mid-call: then both asked, and the provider charged
        // once for both calls under the one key.
        let pk = provider_key(&key, "charge");
        let asked = (provider.calls(&pk), provider.lookups(&pk));
        if trial_no % 2 == 0 {
            assert_eq!(asked, (1, 1), "{context}: (calls, lookups)");
        } else {
            assert!(asked.0 <= 2 && asked.1 <= 2, "{context}: {asked:?}");
        }
        let outcome = match retried {
            Ok(Outcome::Executed(response)) => {
                assert_eq!(response, receipt, "{context}");
                if report.skipped == 1 {
                    "retry drove; resumer skipped"
                } else {
                    "retry drove; resumer saw nothing"
                }
            }
            Ok(Outcome::Replayed(response)) => {
                assert_eq!(response, receipt, "{context}");
                "resumer drove; retry replayed"
            }
            Err(PerformError::Reserve(Error::InProgress { .. })) => {
                "resumer drove; retry in progress"
            }
            Err(PerformError::LeaseLost) => "resumer drove; retry fenced out",
            // A tiny lease can end between the retry's claim and its read of the journal (a
            // loaded machine): the resumer claimed the key after it, and the retry stopped
            // before any step. A 30 s lease cannot end there.
            Err(PerformError::Reserve(Error::LeaseLost)) if trial_no % 2 == 1 => {
                "resumer drove; retry fenced out before its first step"
            }
            Err(other) => panic!("{context}: unexpected {other:?}"),
        };
        *tally.entry(outcome).or_default() += 1;
    }
    assert_eq!(provider.total_charges(), TRIALS, "{}", S::NAME);
    let mut tally: Vec<_> = tally.into_iter().collect();
    tally.sort();
    eprintln!(
        "{}: {TRIALS} races of a retry and the resumer in {:?}: {tally:?}",
        S::NAME,
        started.elapsed()
    );
}

// --- 4. Unknown outcomes end in needs_review, never in a release ---------------------------------

async fn unknown_outcomes_end_in_review_never_in_a_release<S: Harness + Maintenance>(store: S) {
    let provider = Provider::default();
    provider.always(Answer::LostBefore);
    provider.lookups_unknown();
    let policy = StepPolicy::default()
        .with_max_unknown(3)
        .with_retry_after(Duration::from_millis(500))
        .with_calls_per_step(3);
    let engine = Idempotency::new(store.clone())
        .with_lease(LEASE)
        .with_heartbeat(false)
        .with_step_policy(policy);
    let trial = unique("unknown");
    let key = key_of("transfer", &trial);
    let pk = provider_key(&key, "charge");
    let request = TransferRequest::new(&trial, 990);
    let op = Transfer::new(&provider, "first");

    let first = engine.perform(&op, SCOPE, &trial, &request).await;
    match &first {
        Err(PerformError::Pending {
            retry_after,
            reason,
        }) => {
            assert_eq!(*retry_after, policy.retry_after());
            assert!(reason.contains("charge"), "{reason}");
        }
        other => panic!("{}: expected Pending, got {other:?}", S::NAME),
    }
    let row = store
        .find(&key)
        .await
        .unwrap()
        .expect("pending, not released");
    assert_eq!(row.state, KeyState::Pending);
    assert_eq!(row.recovery_attempts, 1);
    assert!(row.request.is_some());

    // From here on, watch the key: it must never be absent (released), nor settled otherwise.
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = tokio::spawn({
        let (store, key, watching) = (store.clone(), key.clone(), watching.clone());
        async move {
            let mut seen = Vec::new();
            while watching.load(Ordering::SeqCst) {
                match store.find(&key).await.unwrap() {
                    None => seen.push("absent".to_owned()),
                    Some(row) if row.state == KeyState::Pending => {}
                    Some(row) if row.state == KeyState::NeedsReview => {}
                    Some(row) => seen.push(row.state.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            seen
        }
    });

    // A retry within retry_after is told to wait; it runs nothing.
    let retried = engine.perform(&op, SCOPE, &trial, &request).await;
    assert!(
        matches!(
            retried,
            Err(PerformError::Reserve(Error::InProgress { .. }))
        ),
        "{}: {retried:?}",
        S::NAME
    );
    assert_eq!(provider.calls(&pk), 1);

    let recovery = Recovery::new(store.clone()).with_operations(
        engine.clone(),
        Operations::new().with(Transfer::new(&provider, "resumer")),
    );
    // The second unknown: still pending.
    wait_lease_end(&store, &key).await;
    let report = recovery.run_once().await.unwrap();
    let unknown = {
        let mut expected = RecoveryReport::default();
        expected.unknown = 1;
        expected
    };
    assert_eq!(report, unknown, "{}: {report}", S::NAME);
    let row = store
        .find(&key)
        .await
        .unwrap()
        .expect("pending, not released");
    assert_eq!(row.state, KeyState::Pending);
    assert_eq!(row.recovery_attempts, 2);
    // The third: parked.
    wait_lease_end(&store, &key).await;
    let report = recovery.run_once().await.unwrap();
    let parked = {
        let mut expected = RecoveryReport::default();
        expected.parked = 1;
        expected
    };
    assert_eq!(report, parked, "{}: {report}", S::NAME);
    let row = store
        .find(&key)
        .await
        .unwrap()
        .expect("parked, not released");
    assert_eq!(row.state, KeyState::NeedsReview);
    let reason = row.reason.expect("a reason");
    assert!(reason.contains("unknown 3 times"), "{reason}");

    // Parked is final: later passes leave it, and a retry is refused.
    tokio::time::sleep(policy.retry_after()).await;
    assert_eq!(
        recovery.run_once().await.unwrap(),
        RecoveryReport::default()
    );
    let retried = engine.perform(&op, SCOPE, &trial, &request).await;
    assert!(
        matches!(retried, Err(PerformError::Reserve(Error::NeedsReview))),
        "{}: {retried:?}",
        S::NAME
    );
    watching.store(false, Ordering::SeqCst);
    let seen = watcher.await.unwrap();
    assert!(seen.is_empty(), "{}: the key was {seen:?}", S::NAME);

    // One call (its answer lost), then only questions; nothing charged, (c) never ran.
    assert_eq!((provider.calls(&pk), provider.lookups(&pk)), (1, 3));
    assert_eq!(provider.total_charges(), 0);
    assert_eq!(count(&store, &trial, "a").await, 1);
    assert_eq!(finish_rows(&store, &trial).await, 0);
}

// --- 5. More ---------------------------------------------------------------------------------------

/// A declined call: the operation compensates in `fail`; the refusal is stored and replayed, also
/// with a long reason and when the decline comes to the resumer.
async fn a_declined_call_settles_as_a_stored_failure<S: Harness + Maintenance>(store: S) {
    // A provider's reason may be long, and not ASCII: the full refusal is replayed, whatever the
    // backend keeps of it as the recovery point (MySQL's column holds 255 characters).
    let long = format!(
        "do not honor — {}",
        "l'émetteur n'a donné aucun détail; ".repeat(12)
    );
    for reason in ["card declined".to_owned(), long] {
        let context = format!("{}: declined ({} chars)", S::NAME, reason.chars().count());
        let provider = Provider::default();
        provider.script([Answer::Decline(reason.clone())]);
        let trial = unique("declined");
        let key = key_of("transfer", &trial);
        let request = TransferRequest::new(&trial, 4200);
        let op = Transfer::new(&provider, "first");
        let engine = engine(&store, LEASE);

        let first = engine.perform(&op, SCOPE, &trial, &request).await;
        let refusal = Receipt::declined(&trial, 4200, &reason);
        match first {
            Ok(Outcome::Executed(response)) => assert_eq!(response, refusal, "{context}"),
            other => panic!("{context}: {other:?}"),
        }
        let row = store.find(&key).await.unwrap().expect("the key");
        assert_eq!(row.state, KeyState::Completed, "{context}");
        assert_eq!(row.request, None, "{context}");
        let point = row.recovery_point.expect("a recovery point");
        assert!(point.starts_with("failed: "), "{context}: {point}");
        assert!(point.chars().count() <= 255, "{context}: {point}");
        assert_eq!(count(&store, &trial, "a").await, 1, "{context}");
        assert_eq!(count(&store, &trial, "undo").await, 1, "{context}");
        assert_eq!(finish_rows(&store, &trial).await, 0, "{context}");
        assert_eq!(provider.total_charges(), 0, "{context}");

        let replay = engine.perform(&op, SCOPE, &trial, &request).await.unwrap();
        assert_eq!(replay, Outcome::Replayed(refusal), "{context}");
        assert_eq!(
            provider.calls(&provider_key(&key, "charge")),
            1,
            "{context}"
        );
        assert_eq!(count(&store, &trial, "undo").await, 1, "{context}");
    }

    // The decline comes to the resumer: it settles the key as failed, with the same refusal.
    let provider = Provider::default();
    let trial = unique("declined-resumed");
    let key = key_of("transfer", &trial);
    let request = TransferRequest::new(&trial, 4300);
    let first = Transfer::new(&provider, "first").stopping(Point::AfterDebit, Stop::Hang);
    crash(&engine(&store, LEASE), first, &trial, &request).await;
    provider.script([Answer::Decline("insufficient funds".into())]);
    wait_lease_end(&store, &key).await;
    let report = resumer(&store, Transfer::new(&provider, "resumer"))
        .run_once()
        .await
        .unwrap();
    let failed = {
        let mut expected = RecoveryReport::default();
        expected.failed = 1;
        expected
    };
    assert_eq!(report, failed, "{}: {report}", S::NAME);
    let refusal = Receipt::declined(&trial, 4300, "insufficient funds");
    let replay = engine(&store, LEASE)
        .perform(&Transfer::new(&provider, "retry"), SCOPE, &trial, &request)
        .await
        .unwrap();
    assert_eq!(replay, Outcome::Replayed(refusal), "{}", S::NAME);
    assert_eq!(count(&store, &trial, "a").await, 1);
    assert_eq!(count(&store, &trial, "undo").await, 1);
    assert_eq!(finish_rows(&store, &trial).await, 0);
    assert_eq!(provider.total_charges(), 0);
}

/// A provider without keys: a lost answer parks the key at once, and so does a resumed run that
/// finds the call started by a run that died.
async fn an_unkeyed_call_whose_answer_is_lost_parks_the_key<S: Harness + Maintenance>(store: S) {
    let engine = engine(&store, LEASE);

    let mailer = Mailer::default();
    mailer.lose_answers.store(true, Ordering::SeqCst);
    let op = Notice {
        mailer: mailer.clone(),
        hook: Hook::default(),
    };
    let trial = unique("mail-lost");
    let key = key_of("notice", &trial);
    let request = NoticeRequest {
        trial: trial.clone(),
    };
    let first = engine.perform(&op, SCOPE, &trial, &request).await;
    match &first {
        Err(PerformError::Parked { reason }) => assert!(reason.contains("mail"), "{reason}"),
        other => panic!("{}: expected Parked, got {other:?}", S::NAME),
    }
    let row = store
        .find(&key)
        .await
        .unwrap()
        .expect("parked, not released");
    assert_eq!(row.state, KeyState::NeedsReview);
    assert!(row.reason.is_some_and(|reason| reason.contains("mail")));
    assert_eq!(mailer.sent(), 1);
    let recovery = resumer(&store, op.clone());
    assert_eq!(
        recovery.run_once().await.unwrap(),
        RecoveryReport::default()
    );
    let retried = engine.perform(&op, SCOPE, &trial, &request).await;
    assert!(
        matches!(retried, Err(PerformError::Reserve(Error::NeedsReview))),
        "{}: {retried:?}",
        S::NAME
    );
    assert_eq!(mailer.sent(), 1, "never sent again");
    assert_eq!(count(&store, &trial, "a").await, 1);
    assert_eq!(finish_rows(&store, &trial).await, 0);

    // A worker dies after marking the mail as started: the resumer cannot tell, and parks.
    let mailer = Mailer::default();
    let trial = unique("mail-started");
    let key = key_of("notice", &trial);
    let request = NoticeRequest {
        trial: trial.clone(),
    };
    let dying = Notice {
        mailer: mailer.clone(),
        hook: Hook::at(Point::CallMade, Stop::Hang),
    };
    crash(&engine, dying, &trial, &request).await;
    let row = wait_lease_end(&store, &key).await;
    assert_eq!(row.recovery_point.as_deref(), Some("mail: started"));
    let recovery = resumer(
        &store,
        Notice {
            mailer: mailer.clone(),
            hook: Hook::default(),
        },
    );
    let report = recovery.run_once().await.unwrap();
    assert_eq!(report.parked, 1, "{}: {report}", S::NAME);
    let row = store
        .find(&key)
        .await
        .unwrap()
        .expect("parked, not released");
    assert_eq!(row.state, KeyState::NeedsReview);
    assert!(row.reason.is_some_and(|reason| reason.contains("started")));
    assert_eq!(
        mailer.sent(),
        0,
        "a started unkeyed call is never made again"
    );
    assert_eq!(finish_rows(&store, &trial).await, 0);
}

/// The heartbeat in a durable operation: an outside call lasting five leases keeps its key.
/// Polled past the lease three times meanwhile, the resumer takes nothing over and a retry is
/// told to wait; the operation completes once, with one charge.
async fn a_call_lasting_five_leases_keeps_its_key<S: Harness + Maintenance>(store: S) {
    let lease = Duration::from_millis(200);
    let provider = Provider::default();
    provider.slow_calls(lease * 5);
    let trial = unique("long-call");
    let key = key_of("transfer", &trial);
    let request = TransferRequest::new(&trial, 500);
    // This test's engine keeps its leases alive (the others' workers stall on purpose).
    let beating = Idempotency::new(store.clone())
        .with_lease(lease)
        .with_step_policy(policy());
    let worker = tokio::spawn({
        let (engine, operation) = (beating.clone(), Transfer::new(&provider, "first"));
        let (trial, request) = (trial.clone(), request.clone());
        async move { engine.perform(&operation, SCOPE, &trial, &request).await }
    });
    for poll in 0..3 {
        tokio::time::sleep(lease + Duration::from_millis(50)).await;
        let report = resumer(&store, Transfer::new(&provider, "resumer"))
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.acted(), 0, "{}: poll {poll}: {report}", S::NAME);
        let retry = beating
            .perform(&Transfer::new(&provider, "retry"), SCOPE, &trial, &request)
            .await;
        assert!(
            matches!(retry, Err(PerformError::Reserve(Error::InProgress { .. }))),
            "{}: poll {poll}: {retry:?}",
            S::NAME
        );
    }
    let outcome = worker.await.unwrap().unwrap();
    let context = format!("{}: a call lasting five leases", S::NAME);
    let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
    assert_eq!(outcome, Outcome::Executed(receipt), "{context}");
    assert_eq!(provider.total_charges(), 1, "{context}");
}

/// A keyed call whose answer is lost is looked up by the same key and completes inline; one whose
/// request never arrived is made again.
async fn a_lost_answer_is_looked_up_and_completes_inline<S: Harness + Maintenance>(store: S) {
    for (lost, calls) in [(Answer::LostAfter, 1), (Answer::LostBefore, 2)] {
        let context = format!("{}: {lost:?}", S::NAME);
        let provider = Provider::default();
        provider.script([lost]);
        let trial = unique("lost-answer");
        let key = key_of("transfer", &trial);
        let pk = provider_key(&key, "charge");
        let request = TransferRequest::new(&trial, 333);
        let outcome = engine(&store, LEASE)
            .perform(&Transfer::new(&provider, "first"), SCOPE, &trial, &request)
            .await
            .unwrap_or_else(|e| panic!("{context}: {e:?}"));
        let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
        assert_eq!(outcome, Outcome::Executed(receipt), "{context}");
        assert_eq!(
            (provider.calls(&pk), provider.lookups(&pk)),
            (calls, 1),
            "{context}: (calls, lookups)"
        );
        assert_eq!(provider.total_charges(), 1, "{context}");
    }
}

/// The client's own retry, once the lease has ended, resumes the operation (no resumer needed);
/// while the lease is live it is told to wait.
async fn a_client_retry_resumes_an_abandoned_operation<S: Harness + Maintenance>(store: S) {
    let provider = Provider::default();
    let trial = unique("retry-resumes");
    let key = key_of("transfer", &trial);
    let pk = provider_key(&key, "charge");
    let request = TransferRequest::new(&trial, 512);
    let first = Transfer::new(&provider, "first").stopping(Point::CallMade, Stop::Panic);
    let long_lease = Duration::from_millis(1500);
    crash(&engine(&store, long_lease), first, &trial, &request).await;
    let retry = Transfer::new(&provider, "retry");
    let early = engine(&store, LEASE)
        .perform(&retry, SCOPE, &trial, &request)
        .await;
    assert!(
        matches!(early, Err(PerformError::Reserve(Error::InProgress { .. }))),
        "{}: {early:?}",
        S::NAME
    );
    // Another request under the same key is still refused as a reuse.
    let other = TransferRequest::new(&trial, 513);
    let reused = engine(&store, LEASE)
        .perform(&retry, SCOPE, &trial, &other)
        .await;
    assert!(
        matches!(reused, Err(PerformError::Reserve(Error::KeyReused))),
        "{}: {reused:?}",
        S::NAME
    );
    wait_lease_end(&store, &key).await;
    let resumed = engine(&store, LEASE)
        .perform(&retry, SCOPE, &trial, &request)
        .await
        .unwrap();
    let receipt = assert_charged_once(&store, &provider, &key, &trial, S::NAME).await;
    assert_eq!(resumed, Outcome::Executed(receipt));
    assert_eq!(count(&store, &trial, "c/retry").await, 1);
    assert_eq!((provider.calls(&pk), provider.lookups(&pk)), (1, 1));
}

async fn the_request_is_stored_while_pending_and_cleared_on_completion<S: Harness + Maintenance>(
    store: S,
) {
    for point in [Point::Start, Point::AfterDebit, Point::AfterNote] {
        let context = format!("{}: held at {point:?}", S::NAME);
        let provider = Provider::default();
        let trial = unique("stored");
        let key = key_of("transfer", &trial);
        let request = TransferRequest::new(&trial, 77);
        let op = Transfer::new(&provider, "first").stopping(point, Stop::Block);
        let hook = op.hook.clone();
        let worker = tokio::spawn({
            let (engine, trial, request) = (engine(&store, WAIT), trial.clone(), request.clone());
            async move { engine.perform(&op, SCOPE, &trial, &request).await }
        });
        hook.reached().await;
        let row = store.find(&key).await.unwrap().expect("the key");
        assert_eq!(row.state, KeyState::Pending, "{context}");
        if point == Point::Start {
            // Nothing recorded yet: a key without a stored request made no outside call.
            assert_eq!(row.request, None, "{context}");
            assert_eq!(row.recovery_point, None, "{context}");
        } else {
            let stored = row.request.as_deref().expect("the stored request");
            assert_eq!(stored, canonical_json(&request).unwrap(), "{context}");
            let decoded: TransferRequest = serde_json::from_slice(stored).unwrap();
            assert_eq!(decoded, request, "{context}");
            let point_name = if point == Point::AfterDebit {
                "debit"
            } else {
                "note"
            };
            assert_eq!(row.recovery_point.as_deref(), Some(point_name), "{context}");
            let journal: serde_json::Value =
                serde_json::from_slice(row.progress.as_deref().expect("a journal")).unwrap();
            assert!(
                journal["done"].get(point_name).is_some(),
                "{context}: {journal}"
            );
            // The charge's output is committed with the step after it, not before.
            assert_eq!(
                journal["done"].get("charge").is_some(),
                point == Point::AfterNote,
                "{context}: {journal}"
            );
        }
        hook.go_on.notify_one();
        let outcome = tokio::time::timeout(WAIT, worker)
            .await
            .expect("the worker finishes")
            .expect("no panic")
            .unwrap_or_else(|e| panic!("{context}: {e:?}"));
        let receipt = assert_charged_once(&store, &provider, &key, &trial, &context).await;
        assert_eq!(outcome, Outcome::Executed(receipt), "{context}");
    }
}

async fn an_oversized_request_is_refused_and_its_key_released<S: Harness + Maintenance>(store: S) {
    let provider = Provider::default();
    let engine = engine(&store, LEASE);
    let op = Transfer::new(&provider, "first");

    // Exactly at the cap: stored and run.
    let trial = unique("at-cap");
    let mut request = TransferRequest::new(&trial, 5);
    let base = canonical_json(&request).unwrap().len();
    request.memo = "m".repeat(MAX_STORED_REQUEST - base);
    assert_eq!(canonical_json(&request).unwrap().len(), MAX_STORED_REQUEST);
    let outcome = engine.perform(&op, SCOPE, &trial, &request).await.unwrap();
    let key = key_of("transfer", &trial);
    let receipt = assert_charged_once(&store, &provider, &key, &trial, S::NAME).await;
    assert_eq!(outcome, Outcome::Executed(receipt));

    // One byte over: refused before any step, and the key released.
    let trial = unique("over-cap");
    let key = key_of("transfer", &trial);
    let mut request = TransferRequest::new(&trial, 5);
    let base = canonical_json(&request).unwrap().len();
    request.memo = "m".repeat(MAX_STORED_REQUEST - base + 1);
    for attempt in 0..2 {
        let refused = engine.perform(&op, SCOPE, &trial, &request).await;
        match refused {
            Err(PerformError::Released(StepError::RequestTooLarge { size, limit })) => {
                assert_eq!((size, limit), (MAX_STORED_REQUEST + 1, MAX_STORED_REQUEST));
            }
            other => panic!("{}: attempt {attempt}: {other:?}", S::NAME),
        }
        assert!(store.find(&key).await.unwrap().is_none(), "{}", S::NAME);
    }
    assert_eq!(count(&store, &trial, "a").await, 0);
    assert_eq!(provider.calls(&provider_key(&key, "charge")), 0);
    assert_eq!(provider.total_charges(), 1);
}

async fn the_maintenance_worker_resumes_abandoned_operations<S: Harness + Maintenance>(store: S) {
    let provider = Provider::default();
    let mut abandoned = Vec::new();
    for point in [
        Point::AfterDebit,
        Point::CallMade,
        Point::AfterCharge,
        Point::AfterNote,
    ] {
        let trial = unique("worker");
        let request = TransferRequest::new(&trial, 10);
        let first = Transfer::new(&provider, "first").stopping(point, Stop::Hang);
        crash(&engine(&store, LEASE), first, &trial, &request).await;
        abandoned.push(trial);
    }
    let worker = MaintenanceWorker::new(store.clone())
        .with_operations(
            engine(&store, LEASE),
            Operations::new().with(Transfer::new(&provider, "resumer")),
        )
        .with_interval(Duration::from_millis(20))
        .spawn();
    for trial in &abandoned {
        let key = key_of("transfer", trial);
        let settled = wait_until(WAIT, || {
            let (store, key) = (store.clone(), key.clone());
            async move {
                store
                    .find(&key)
                    .await
                    .unwrap()
                    .is_some_and(|row| row.state == KeyState::Completed)
            }
        })
        .await;
        assert!(settled, "{}: {key} was not resumed", S::NAME);
    }
    let report = worker.shutdown().await;
    assert_eq!(report.recovery.completed, 4, "{}: {report}", S::NAME);
    assert_eq!(report.recovery.acted(), 4, "{}: {report}", S::NAME);
    for trial in &abandoned {
        let key = key_of("transfer", trial);
        assert_charged_once(&store, &provider, &key, trial, S::NAME).await;
        assert_eq!(count(&store, trial, "c/resumer").await, 1);
    }
    assert_eq!(provider.total_charges(), 4);
}

// --- A database "not now" after progress is not an unknown outcome -------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct BusyRequest {
    trial: String,
}

/// (a) a business row, then (b) a local step whose transaction the database refuses ("not now",
/// as a pool timeout or a deadlock) while `refusals` is above zero, then the finish.
#[derive(Debug, Clone, Default)]
struct Busy {
    refusals: Arc<AtomicU32>,
}

impl<S: Harness> Operation<S> for Busy {
    type Request = BusyRequest;
    type Response = String;

    fn name(&self) -> &str {
        "busy"
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        request: &BusyRequest,
    ) -> Result<Finished<String>, StepError> {
        let debit = format!("{}/a", request.trial);
        steps
            .local("debit", async move |tx| {
                S::insert_effect(tx, &debit).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await?;
        let refusals = self.refusals.clone();
        steps
            .local("note", async move |_tx| {
                let left = refusals.load(Ordering::SeqCst);
                if left > 0 {
                    refusals.store(left - 1, Ordering::SeqCst);
                    return Err(sqlx::Error::PoolTimedOut);
                }
                Ok(())
            })
            .await?;
        let done = format!("{}/c/first", request.trial);
        steps
            .finish(async move |tx| {
                S::insert_effect(tx, &done).await?;
                Ok::<_, sqlx::Error>("done".to_owned())
            })
            .await
    }
}

/// A run whose later step meets the database's "not now" stops with `Interrupted` and leaves the
/// key pending **without counting an unknown outcome**: more such stops than `max_unknown` never
/// park the key, and the run after them carries on from the recovery point ((a) written once).
async fn a_database_not_now_after_progress_is_not_counted_toward_review<
    S: Harness + Maintenance,
>(
    store: S,
) {
    const REFUSALS: u32 = 4;
    let engine = engine(&store, LEASE).with_step_policy(policy().with_max_unknown(2));
    let trial = unique("not-now");
    let key = key_of("busy", &trial);
    let request = BusyRequest {
        trial: trial.clone(),
    };
    let op = Busy::default();
    op.refusals.store(REFUSALS, Ordering::SeqCst);
    for run in 1..=REFUSALS {
        let stopped = engine.perform(&op, SCOPE, &trial, &request).await;
        assert!(
            matches!(
                stopped,
                Err(PerformError::Interrupted(StepError::Local { .. }))
            ),
            "{}: run {run}: {stopped:?}",
            S::NAME
        );
        let row = wait_lease_end(&store, &key).await;
        assert_eq!(row.state, KeyState::Pending, "{}: run {run}", S::NAME);
        assert_eq!(row.recovery_attempts, 0, "{}: run {run}", S::NAME);
    }
    let finished = engine.perform(&op, SCOPE, &trial, &request).await.unwrap();
    assert_eq!(finished, Outcome::Executed("done".to_owned()));
    let row = store.find(&key).await.unwrap().expect("completed");
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(count(&store, &trial, "a").await, 1);
    assert_eq!(count(&store, &trial, "c/first").await, 1);
}
