//! Recovery of abandoned keys and operator resolution, on PostgreSQL and SQLite and MySQL/MariaDB.

mod common;

use common::{attempt, purchase, unique, wait_until, Harness};
use idempotency::{
    durable::{ProviderAnswer, Resolver},
    maintenance::{resolve, EventKind, OperatorNote, Recovery, Resolution, ResolveError},
    protocol::Reservation,
    store::{KeyRecord, KeyState, Maintenance},
    Attempt, Effects, Error, Idempotency, Outcome,
};
use serde_json::json;
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

// Every store implements `Maintenance`, so the shared per-backend macro serves.
test_support::backend_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    via crate::on_store;
    abandoned_local_key_is_released,
    abandoned_external_key_completed_by_the_resolver,
    abandoned_external_key_failed_by_the_resolver_is_released,
    unknown_answers_park_the_key_after_max_attempts,
    without_resolver_external_keys_are_parked,
    live_leases_are_left_alone,
    late_original_worker_cannot_complete_after_recovery,
    late_original_racing_recovery_never_both_act,
    a_hanging_or_panicking_resolver_counts_as_unknown,
    racing_recovery_workers_never_double_act,
    resolve_settles_parked_keys_and_keeps_the_reason,
    racing_resolutions_only_one_wins,
    recovery_loop_stops_on_shutdown,
    list_and_stats_see_the_table,
}

const SHORT_LEASE: Duration = Duration::from_millis(40);

/// A worker that reserved `attempt` and died: the lease is forgotten (no release on drop), and
/// we wait until the database clock says it has ended.
async fn abandon<S: Harness + Maintenance>(store: &S, attempt: &Attempt) -> KeyRecord {
    let idem = Idempotency::new(store.clone())
        .with_lease(SHORT_LEASE)
        .with_heartbeat(false);
    match idem.reserve(attempt).await.expect("reserve") {
        Reservation::Acquired(lease) => std::mem::forget(lease),
        _ => panic!("{}: fresh key was completed", S::NAME),
    }
    let key = attempt.key().clone();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let (store, key) = (store.clone(), key.clone());
            async move { store.find(&key).await.unwrap().unwrap().lease_expired() }
        })
        .await,
        "{}: lease never ended",
        S::NAME
    );
    let record = store.find(attempt.key()).await.unwrap().unwrap();
    assert_eq!(record.state, KeyState::Pending);
    record
}

fn external(scope: &str, key: &str) -> Attempt {
    attempt(scope, key, json!({"charge": key})).with_effects(Effects::External)
}

/// A resolver that answers the same every time and counts its calls.
#[derive(Clone)]
struct Scripted {
    answer: ProviderAnswer,
    calls: Arc<AtomicUsize>,
    delay: Duration,
}

impl Scripted {
    fn new(answer: ProviderAnswer) -> Self {
        Self {
            answer,
            calls: Arc::default(),
            delay: Duration::ZERO,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Resolver for Scripted {
    async fn resolve(&self, record: &KeyRecord) -> ProviderAnswer {
        assert_eq!(
            record.effects,
            Effects::External,
            "only external keys are resolved"
        );
        self.calls.fetch_add(1, Ordering::SeqCst);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.answer.clone()
    }
}

async fn abandoned_local_key_is_released<S: Harness + Maintenance>(store: S) {
    let trial = unique("local");
    let a = attempt("user-1", &trial, json!({"trial": trial}));
    abandon(&store, &a).await;
    let resolver = Scripted::new(ProviderAnswer::Completed(b"{}".to_vec()));
    let report = Recovery::new(store.clone())
        .with_resolver(resolver.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.released, 1, "{}: {report}", S::NAME);
    assert_eq!(report.acted(), 1);
    assert_eq!(resolver.calls(), 0, "local keys are never asked about");
    assert!(store.find(a.key()).await.unwrap().is_none());
    // A retry runs the work (nothing had been committed).
    let idem = Idempotency::new(store.clone());
    assert!(matches!(
        purchase(&idem, &a, &trial, 1).await.unwrap(),
        Outcome::Executed(_)
    ));
    assert_eq!(store.count_effects(&trial).await, 1);
}

async fn abandoned_external_key_completed_by_the_resolver<S: Harness + Maintenance>(store: S) {
    let trial = unique("ext-done");
    let a = external("user-1", &trial);
    abandon(&store, &a).await;
    let stored = serde_json::to_vec(&json!({"charge": "ch_1"})).unwrap();
    let resolver = Scripted::new(ProviderAnswer::Completed(stored.clone()));
    let report = Recovery::new(store.clone())
        .with_resolver(resolver.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.completed, 1, "{}: {report}", S::NAME);
    assert_eq!(resolver.calls(), 1);
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(row.result.as_deref(), Some(stored.as_slice()));
    assert!(row.reason.unwrap().contains("provider"));
    assert!(!row.expired);
    // A retry replays the provider's result and runs nothing.
    let idem = Idempotency::new(store.clone());
    let again = purchase(&idem, &a, &trial, 2).await.unwrap();
    assert_eq!(again, Outcome::Replayed(json!({"charge": "ch_1"})));
    assert_eq!(store.count_effects(&trial).await, 0);
}

async fn abandoned_external_key_failed_by_the_resolver_is_released<S: Harness + Maintenance>(
    store: S,
) {
    let trial = unique("ext-failed");
    let a = external("user-1", &trial);
    abandon(&store, &a).await;
    let resolver = Scripted::new(ProviderAnswer::Failed);
    let report = Recovery::new(store.clone())
        .with_resolver(resolver.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.failed, 1, "{}: {report}", S::NAME);
    assert_eq!(resolver.calls(), 1);
    assert!(store.find(a.key()).await.unwrap().is_none());
    let idem = Idempotency::new(store.clone());
    assert!(matches!(
        purchase(&idem, &a, &trial, 1).await.unwrap(),
        Outcome::Executed(_)
    ));
}

async fn unknown_answers_park_the_key_after_max_attempts<S: Harness + Maintenance>(store: S) {
    let trial = unique("ext-unknown");
    let a = external("user-1", &trial);
    abandon(&store, &a).await;
    let resolver = Scripted::new(ProviderAnswer::Unknown);
    let recovery = Recovery::new(store.clone())
        .with_resolver(resolver.clone())
        .with_max_attempts(3);
    for pass in 1..=2u32 {
        let report = recovery.run_once().await.unwrap();
        assert_eq!(report.unknown, 1, "{}: pass {pass}: {report}", S::NAME);
        let row = store.find(a.key()).await.unwrap().unwrap();
        assert_eq!(row.state, KeyState::Pending);
        assert_eq!(row.recovery_attempts, pass);
        // Still pending and never released: a retry must not run the work.
        let idem = Idempotency::new(store.clone());
        let err = purchase(&idem, &a, &trial, 9).await.unwrap_err();
        assert!(matches!(err, Error::InProgress { .. }), "{err:?}");
    }
    let report = recovery.run_once().await.unwrap();
    assert_eq!(report.parked, 1, "{}: {report}", S::NAME);
    assert_eq!(resolver.calls(), 3);
    let row = store.find(a.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::NeedsReview);
    assert!(row.reason.unwrap().contains("unknown 3 times"));
    // Parked keys are left alone by later passes and refuse retries.
    assert_eq!(recovery.run_once().await.unwrap().acted(), 0);
    assert_eq!(resolver.calls(), 3);
    let idem = Idempotency::new(store.clone());
    let err = purchase(&idem, &a, &trial, 9).await.unwrap_err();
    assert!(matches!(err, Error::NeedsReview), "{err:?}");
    assert_eq!(store.count_effects(&trial).await, 0);
}

async fn without_resolver_external_keys_are_parked<S: Harness + Maintenance>(store: S) {
    let trial = unique("ext-none");
    let ext = external("user-1", &trial);
    let local = attempt("user-1", &format!("{trial}-local"), json!({}));
    abandon(&store, &ext).await;
    abandon(&store, &local).await;
    let report = Recovery::new(store.clone()).run_once().await.unwrap();
    assert_eq!(
        (report.parked, report.released),
        (1, 1),
        "{}: {report}",
        S::NAME
    );
    let row = store.find(ext.key()).await.unwrap().unwrap();
    assert_eq!(row.state, KeyState::NeedsReview);
    assert!(row.reason.unwrap().contains("no resolver"));
    assert!(store.find(local.key()).await.unwrap().is_none());
    // Parked is final until a human decides: more passes change nothing.
    for _ in 0..3 {
        assert_eq!(
            Recovery::new(store.clone()).run_once().await.unwrap(),
            Default::default()
        );
    }
    assert_eq!(
        store.find(ext.key()).await.unwrap().unwrap().state,
        KeyState::NeedsReview
    );
}

async fn live_leases_are_left_alone<S: Harness + Maintenance>(store: S) {
    let trial = unique("live");
    let idem = Idempotency::new(store.clone()).with_lease(Duration::from_secs(60));
    let Reservation::Acquired(lease) = idem.reserve(&external("u", &trial)).await.unwrap() else {
        panic!("fresh key")
    };
    let resolver = Scripted::new(ProviderAnswer::Failed);
    let report = Recovery::new(store.clone())
        .with_resolver(resolver.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report, Default::default(), "{}", S::NAME);
    assert_eq!(resolver.calls(), 0);
    assert!(lease.release().await.unwrap());
}

async fn late_original_worker_cannot_complete_after_recovery<S: Harness + Maintenance>(store: S) {
    let trial = unique("late");
    let a = attempt("user-1", &trial, json!({"trial": trial}));
    let idem = Idempotency::new(store.clone())
        .with_lease(SHORT_LEASE)
        .with_heartbeat(false);
    let Reservation::Acquired(lease) = idem.reserve(&a).await.unwrap() else {
        panic!("fresh key")
    };
    // The worker is slow: its lease ends, recovery releases the key ...
    tokio::time::sleep(SHORT_LEASE * 3).await;
    let report = Recovery::new(store.clone()).run_once().await.unwrap();
    assert_eq!(report.released, 1, "{}: {report}", S::NAME);
    // ... a retry takes the key and completes it ...
    assert!(matches!(
        purchase(&Idempotency::new(store.clone()), &a, &trial, 2)
            .await
            .unwrap(),
        Outcome::Executed(_)
    ));
    // ... and the original's late completion is refused and rolled back.
    let mut tx = store.begin().await.unwrap();
    S::insert_effect(&mut tx, &trial).await.unwrap();
    let err = lease.finish(tx, b"{\"late\":true}").await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost), "{err:?}");
    assert_eq!(store.count_effects(&trial).await, 1);
}

async fn racing_recovery_workers_never_double_act<S: Harness + Maintenance>(store: S) {
    const TRIALS: usize = 25;
    const KEYS: usize = 4; // of each kind per trial
    const WORKERS: usize = 4;
    let (mut skipped, mut calls_total) = (0, 0);
    for trial in 0..TRIALS {
        let prefix = format!("{}-{trial}", unique("race"));
        let mut externals = Vec::new();
        // Reserve everything first, then wait once for the short leases to end.
        let idem = Idempotency::new(store.clone())
            .with_lease(SHORT_LEASE)
            .with_heartbeat(false);
        for i in 0..KEYS {
            for a in [
                external("racer", &format!("{prefix}-e{i}")),
                attempt("racer", &format!("{prefix}-l{i}"), json!({})),
            ] {
                let Reservation::Acquired(lease) = idem.reserve(&a).await.unwrap() else {
                    panic!("fresh key")
                };
                std::mem::forget(lease);
                if a.effects() == Effects::External {
                    externals.push(a.key().clone());
                }
            }
        }
        tokio::time::sleep(SHORT_LEASE * 2).await;
        assert!(
            wait_until(Duration::from_secs(5), || {
                let store = store.clone();
                async move { store.expired_leases(100).await.unwrap().len() == 2 * KEYS }
            })
            .await
        );
        // Half the keys the provider completed: a resolver per trial, shared by all workers.
        let mut resolver = Scripted::new(ProviderAnswer::Completed(b"{\"ok\":true}".to_vec()));
        resolver.delay = Duration::from_millis(2);
        let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let recovery = Recovery::new(store.clone()).with_resolver(resolver.clone());
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    recovery.run_once().await.unwrap()
                })
            })
            .collect();
        let mut total = idempotency::maintenance::RecoveryReport::default();
        for worker in workers {
            total.add(&worker.await.unwrap());
        }
        assert_eq!(
            (total.completed, total.released),
            (KEYS as u64, KEYS as u64),
            "{}: trial {trial}: {total}",
            S::NAME
        );
        assert_eq!((total.failed, total.parked, total.unknown), (0, 0, 0));
        assert_eq!(
            resolver.calls(),
            KEYS,
            "{}: the provider is asked once per key",
            S::NAME
        );
        for key in &externals {
            assert_eq!(
                store.find(key).await.unwrap().unwrap().state,
                KeyState::Completed
            );
        }
        skipped += total.skipped;
        calls_total += resolver.calls();
    }
    eprintln!(
        "{}: {TRIALS} trials x {WORKERS} workers x {} keys: each acted on once; {skipped} claims lost to another worker, {calls_total} resolver calls",
        S::NAME,
        2 * KEYS
    );
}

/// An operator note for `reason`.
fn note(reason: &str) -> OperatorNote {
    OperatorNote::new("alice", reason)
}

async fn resolve_settles_parked_keys_and_keeps_the_reason<S: Harness + Maintenance>(store: S) {
    let retention = Duration::from_secs(3600);
    let trial = unique("resolve");
    let done = external("user-1", &format!("{trial}-done"));
    let failed = external("user-1", &format!("{trial}-failed"));
    for a in [&done, &failed] {
        abandon(&store, a).await;
    }
    assert_eq!(
        Recovery::new(store.clone())
            .run_once()
            .await
            .unwrap()
            .parked,
        2
    );

    // A reason is required, and the key must exist and be parked.
    let err = resolve(
        &store,
        done.key(),
        &Resolution::Failed,
        &note("  "),
        retention,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ResolveError::EmptyReason), "{err:?}");
    let missing = external("user-1", &format!("{trial}-missing")).into_key();
    let err = resolve(&store, &missing, &Resolution::Failed, &note("x"), retention)
        .await
        .unwrap_err();
    assert!(matches!(err, ResolveError::NotFound(_)), "{err:?}");

    let bytes = serde_json::to_vec(&json!({"charge": "ch_9"})).unwrap();
    let row = resolve(
        &store,
        done.key(),
        &Resolution::Completed(bytes.clone()),
        &note("provider dashboard shows ch_9"),
        retention,
    )
    .await
    .unwrap();
    assert_eq!(row.state, KeyState::Completed);
    assert_eq!(row.reason.as_deref(), Some("provider dashboard shows ch_9"));
    assert_eq!(row.result.as_deref(), Some(bytes.as_slice()));
    assert!(!row.expired);
    let idem = Idempotency::new(store.clone());
    assert_eq!(
        purchase(&idem, &done, &trial, 1).await.unwrap(),
        Outcome::Replayed(json!({"charge": "ch_9"}))
    );
    // Only parked keys: a second resolution is refused.
    let err = resolve(
        &store,
        done.key(),
        &Resolution::Failed,
        &note("oops"),
        retention,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            ResolveError::NotParked {
                state: KeyState::Completed,
                ..
            }
        ),
        "{err:?}"
    );

    let row = resolve(
        &store,
        failed.key(),
        &Resolution::Failed,
        &note("no charge at the provider"),
        retention,
    )
    .await
    .unwrap();
    assert_eq!(row.state, KeyState::Failed);
    assert_eq!(row.reason.as_deref(), Some("no charge at the provider"));
    assert_eq!(row.result, None);
    // A failed key runs again on retry.
    let outcome = purchase(&idem, &failed, &trial, 2).await.unwrap();
    assert!(
        matches!(outcome, Outcome::Executed(_)),
        "{}: {outcome:?}",
        S::NAME
    );
    assert_eq!(store.count_effects(&trial).await, 1);
}

async fn racing_resolutions_only_one_wins<S: Harness + Maintenance>(store: S) {
    const TRIALS: usize = 20;
    let trial = unique("resolve-race");
    let mut keys = Vec::new();
    let idem = Idempotency::new(store.clone());
    for i in 0..TRIALS {
        let a = external("user-1", &format!("{trial}-{i}"));
        let Reservation::Acquired(lease) = idem.reserve(&a).await.unwrap() else {
            panic!("fresh key")
        };
        assert!(lease.park("timeout at provider").await.unwrap());
        keys.push(a.into_key());
    }
    for key in keys {
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let racers: Vec<_> = (0..4)
            .map(|i| {
                let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    let resolution = if i % 2 == 0 {
                        Resolution::Failed
                    } else {
                        Resolution::Completed(b"{}".to_vec())
                    };
                    barrier.wait().await;
                    resolve(
                        &store,
                        &key,
                        &resolution,
                        &OperatorNote::new(format!("operator {i}"), format!("operator {i}")),
                        Duration::from_secs(60),
                    )
                    .await
                })
            })
            .collect();
        let mut winners = Vec::new();
        for racer in racers {
            match racer.await.unwrap() {
                Ok(row) => winners.push(row),
                Err(ResolveError::NotParked { .. }) => {}
                Err(other) => panic!("{}: {other:?}", S::NAME),
            }
        }
        assert_eq!(winners.len(), 1, "{}: exactly one operator wins", S::NAME);
        let row = store.find(&key).await.unwrap().unwrap();
        assert_eq!(row.reason, winners[0].reason);
        let resolved: Vec<_> = store
            .history(&key, 100)
            .await
            .unwrap()
            .into_iter()
            .filter(|event| event.kind == EventKind::Resolved)
            .collect();
        assert_eq!(resolved.len(), 1, "{}: one resolved event", S::NAME);
        assert_eq!(resolved[0].actor, winners[0].reason, "{}", S::NAME);
    }
}

async fn recovery_loop_stops_on_shutdown<S: Harness + Maintenance>(store: S) {
    // Abandon first: a loop already running could release the key before `abandon` sees it.
    let trial = unique("loop");
    let a = attempt("user-1", &trial, json!({}));
    abandon(&store, &a).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let recovery = Recovery::new(store.clone());
    let job = tokio::spawn(async move {
        recovery
            .run(Duration::from_millis(25), async {
                let _ = stopped.await;
            })
            .await
    });
    assert!(
        wait_until(Duration::from_secs(5), || {
            let (store, key) = (store.clone(), a.key().clone());
            async move { store.find(&key).await.unwrap().is_none() }
        })
        .await,
        "{}: the loop released the key",
        S::NAME
    );
    stop.send(()).unwrap();
    let total = tokio::time::timeout(Duration::from_secs(5), job)
        .await
        .expect("loop stopped")
        .unwrap()
        .unwrap();
    assert_eq!(total.released, 1, "{}: {total}", S::NAME);
}

async fn list_and_stats_see_the_table<S: Harness + Maintenance>(store: S) {
    use idempotency::maintenance::KeyFilter;
    let trial = unique("list");
    let idem = Idempotency::new(store.clone());
    purchase(
        &idem,
        &attempt("alice", &format!("{trial}-1"), json!({})),
        &trial,
        1,
    )
    .await
    .unwrap();
    abandon(&store, &external("bob", &format!("{trial}-2"))).await;
    let all = store.list(&KeyFilter::default()).await.unwrap();
    assert_eq!(all.len(), 2);
    let pending = store
        .list(&KeyFilter::default().with_state(KeyState::Pending))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].key.scope(), "bob");
    let alice = store
        .list(
            &KeyFilter::default()
                .with_scope("alice")
                .with_operation("purchase"),
        )
        .await
        .unwrap();
    assert_eq!(alice.len(), 1);
    assert_eq!(alice[0].state, KeyState::Completed);
    let old = store
        .list(&KeyFilter::default().with_older_than(Duration::from_secs(3600)))
        .await
        .unwrap();
    assert!(old.is_empty(), "nothing is an hour old");
    let limited = store
        .list(&KeyFilter::default().with_limit(1))
        .await
        .unwrap();
    assert_eq!(limited.len(), 1);

    let stats = store.stats().await.unwrap();
    assert_eq!(stats.total(), 2, "{}: {stats:?}", S::NAME);
    assert_eq!(stats.in_state(KeyState::Pending), 1);
    assert_eq!(stats.in_state(KeyState::Completed), 1);
    assert_eq!(stats.expired_leases, 1);
    assert_eq!(stats.purgeable, 0);
    let age = stats.oldest_pending_age.expect("one pending row");
    assert!(
        age >= SHORT_LEASE && age < Duration::from_secs(30),
        "{age:?}"
    );
}

async fn late_original_racing_recovery_never_both_act<S: Harness + Maintenance>(store: S) {
    const TRIALS: usize = 30;
    let (mut original_won, mut recovery_won) = (0, 0);
    for trial in 0..TRIALS {
        let effects = if trial % 2 == 0 {
            Effects::Local
        } else {
            Effects::External
        };
        let name = format!("{}-{trial}", unique("late-race"));
        let a = attempt("user-1", &name, json!({"trial": name})).with_effects(effects);
        let idem = Idempotency::new(store.clone())
            .with_lease(SHORT_LEASE)
            .with_heartbeat(false);
        let Reservation::Acquired(lease) = idem.reserve(&a).await.unwrap() else {
            panic!("fresh key")
        };
        // The original did its work but is slow to commit: its lease ends first.
        let mut tx = store.begin().await.unwrap();
        S::insert_effect(&mut tx, &name).await.unwrap();
        assert!(
            wait_until(Duration::from_secs(5), || {
                let (store, key) = (store.clone(), a.key().clone());
                async move { store.find(&key).await.unwrap().unwrap().lease_expired() }
            })
            .await
        );
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let original = {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                lease.finish(tx, b"{\"by\":\"original\"}").await
            })
        };
        let resolver = Scripted::new(ProviderAnswer::Completed(b"{\"by\":\"provider\"}".to_vec()));
        let recovery = {
            let recovery = Recovery::new(store.clone()).with_resolver(resolver.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                recovery.run_once().await.unwrap()
            })
        };
        let finished = original.await.unwrap();
        let report = recovery.await.unwrap();
        let row = store.find(a.key()).await.unwrap();
        let effects_kept = store.count_effects(&name).await;
        match finished {
            Ok(()) => {
                original_won += 1;
                assert_eq!(
                    report.acted(),
                    0,
                    "{}: {trial}: both acted: {report}",
                    S::NAME
                );
                let row = row.expect("completed row");
                assert_eq!(row.state, KeyState::Completed);
                assert_eq!(row.result.as_deref(), Some(&b"{\"by\":\"original\"}"[..]));
                assert_eq!(effects_kept, 1);
            }
            Err(Error::LeaseLost) => {
                recovery_won += 1;
                assert_eq!(report.acted(), 1, "{}: {trial}: {report}", S::NAME);
                assert_eq!(effects_kept, 0, "the original's work was rolled back");
                match effects {
                    Effects::Local => assert!(row.is_none(), "released"),
                    Effects::External => assert_eq!(
                        row.unwrap().result.as_deref(),
                        Some(&b"{\"by\":\"provider\"}"[..])
                    ),
                    other => panic!("untested effects {other:?}"),
                }
            }
            Err(other) => panic!("{}: {trial}: {other:?}", S::NAME),
        }
    }
    assert_eq!(original_won + recovery_won, TRIALS);
    eprintln!(
        "{}: late original vs recovery, {TRIALS} races: original won {original_won}, recovery won {recovery_won}, never both",
        S::NAME
    );
}

struct Misbehaving {
    panics: bool,
}

impl Resolver for Misbehaving {
    async fn resolve(&self, _record: &KeyRecord) -> ProviderAnswer {
        if self.panics {
            panic!("resolver bug");
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
        ProviderAnswer::Failed
    }
}

async fn a_hanging_or_panicking_resolver_counts_as_unknown<S: Harness + Maintenance>(store: S) {
    for panics in [false, true] {
        let trial = unique("misbehaving");
        let a = external("user-1", &trial);
        abandon(&store, &a).await;
        let report = Recovery::new(store.clone())
            .with_resolver(Misbehaving { panics })
            .with_resolver_timeout(Duration::from_millis(50))
            .run_once()
            .await
            .unwrap();
        assert_eq!(report.unknown, 1, "{}: panics {panics}: {report}", S::NAME);
        let row = store.find(a.key()).await.unwrap().unwrap();
        assert_eq!((row.state, row.recovery_attempts), (KeyState::Pending, 1));
        // Settle it so the next round sees only its own key.
        assert_eq!(
            Recovery::new(store.clone())
                .run_once()
                .await
                .unwrap()
                .parked,
            1
        );
    }
}
