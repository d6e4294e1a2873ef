//! The real `idem` binary against real databases (SQLite always; PostgreSQL and MySQL/MariaDB
//! from `TEST_POSTGRES_URL` and `TEST_MYSQL_URL`), checking output and exit codes.

use assert_cmd::Command;
use idempotency::{
    protocol::Reservation, Attempt, Effects, Fingerprint, Idempotency, IdempotencyKey, MySqlStore,
    PgStore, SqliteStore, Store,
};
use predicates::prelude::*;
use serde_json::{json, Value};
use std::time::Duration;

/// One database under test: its URL and a store on it for setting up rows.
struct Db {
    url: String,
    store: AnyStore,
    _file: Option<test_support::SqliteFile>,
}

#[derive(Clone)]
enum AnyStore {
    Postgres(PgStore),
    Sqlite(SqliteStore),
    MySql(MySqlStore),
}

impl Db {
    fn name(&self) -> &'static str {
        match self.store {
            AnyStore::Postgres(_) => "postgres",
            AnyStore::Sqlite(_) => "sqlite",
            AnyStore::MySql(_) => "mysql",
        }
    }

    fn idem(&self, args: &[&str]) -> assert_cmd::assert::Assert {
        Command::cargo_bin("idem")
            .unwrap()
            .env_remove("DATABASE_URL")
            .arg("--database-url")
            .arg(&self.url)
            .args(args)
            .timeout(Duration::from_secs(60))
            .assert()
    }

    fn json(&self, args: &[&str]) -> Value {
        let out = self.idem(args).success().get_output().stdout.clone();
        serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!(
                "{}: {args:?}: not JSON ({e}): {}",
                self.name(),
                String::from_utf8_lossy(&out)
            )
        })
    }

    /// A completed purchase.
    async fn complete(&self, scope: &str, key: &str) {
        let attempt = attempt(scope, key, Effects::Local);
        match &self.store {
            AnyStore::Postgres(s) => run(s, &attempt).await,
            AnyStore::Sqlite(s) => run(s, &attempt).await,
            AnyStore::MySql(s) => run(s, &attempt).await,
        }
    }

    /// A key whose worker died: reserved with a short lease that is then forgotten.
    async fn abandon(&self, scope: &str, key: &str, effects: Effects) {
        let attempt = attempt(scope, key, effects);
        match &self.store {
            AnyStore::Postgres(s) => abandon(s, &attempt).await,
            AnyStore::Sqlite(s) => abandon(s, &attempt).await,
            AnyStore::MySql(s) => abandon(s, &attempt).await,
        }
    }

    /// `n` completed rows in `scope`, expiring `expires_in_ms` from now by the database clock.
    async fn bulk(&self, scope: &str, n: i64, expires_in_ms: i64) {
        match &self.store {
            AnyStore::Postgres(s) => sqlx::query(
                "INSERT INTO idempotency_keys
                    (scope, operation, idem_key, state, effects, fingerprint, lease_token,
                     lease_until, result, expires_at)
                 SELECT $1, 'bulk', 'k' || i, 'completed', 'local', sha256(i::TEXT::BYTEA),
                        gen_random_uuid(), now(), '{}'::BYTEA,
                        now() + $2 * INTERVAL '1 millisecond'
                 FROM generate_series(1, $3) AS i",
            )
            .bind(scope)
            .bind(expires_in_ms)
            .bind(n)
            .execute(s.pool())
            .await
            .map(drop),
            AnyStore::Sqlite(s) => sqlx::query(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?3),
                      clock(ms) AS (SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER))
                 INSERT INTO idempotency_keys
                    (scope, operation, idem_key, state, effects, fingerprint, lease_token,
                     lease_until, result, created_at, updated_at, expires_at)
                 SELECT ?1, 'bulk', 'k' || i, 'completed', 'local', zeroblob(32), randomblob(16),
                        ms, X'7B7D', ms, ms, ms + ?2
                 FROM n, clock",
            )
            .bind(scope)
            .bind(expires_in_ms)
            .bind(n)
            .execute(s.pool())
            .await
            .map(drop),
            // Numbers 1..=n from a cross join of digits (n < 10,000).
            AnyStore::MySql(s) => sqlx::query(
                "INSERT INTO idempotency_keys
                    (scope, operation, idem_key, state, effects, fingerprint, lease_token,
                     lease_until, result, created_at, updated_at, expires_at)
                 SELECT ?, 'bulk', CONCAT('k', i), 'completed', 'local', UNHEX(SHA2(i, 256)),
                        UNHEX(REPLACE(UUID(), '-', '')), UTC_TIMESTAMP(6), '{}',
                        UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
                        UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND
                 FROM (SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS i
                       FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                             UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                             UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) a,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                             UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                             UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) b,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                             UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                             UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) c,
                            (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                             UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6
                             UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) e) numbers
                 WHERE i <= ?",
            )
            .bind(scope)
            .bind(expires_in_ms)
            .bind(n)
            .execute(s.pool())
            .await
            .map(drop),
        }
        .expect("bulk insert");
    }
}

fn attempt(scope: &str, key: &str, effects: Effects) -> Attempt {
    Attempt::new(
        IdempotencyKey::new(scope, "charge", key).unwrap(),
        Fingerprint::of_json(&json!({"key": key})).unwrap(),
    )
    .with_effects(effects)
}

async fn run<S: Store>(store: &S, attempt: &Attempt) {
    Idempotency::new(store.clone())
        .run(attempt, async |_tx| {
            Ok::<_, std::convert::Infallible>(json!({"order": 1}))
        })
        .await
        .expect("purchase");
}

async fn abandon<S: Store>(store: &S, attempt: &Attempt) {
    let idem = Idempotency::new(store.clone())
        .with_lease(Duration::from_millis(30))
        .with_heartbeat(false);
    let Reservation::Acquired(lease) = idem.reserve(attempt).await.expect("reserve") else {
        panic!("fresh key")
    };
    std::mem::forget(lease);
    tokio::time::sleep(Duration::from_millis(120)).await;
}

/// A migrated (by `idem migrate`) database per configured backend.
async fn databases() -> Vec<Db> {
    let mut dbs = Vec::new();
    let file = test_support::fresh_sqlite();
    let url = file.url.clone();
    Command::cargo_bin("idem")
        .unwrap()
        .args(["--database-url", &url, "migrate"])
        .assert()
        .success()
        .stdout(predicate::str::contains("up to date"));
    let store = SqliteStore::connect(&url).await.unwrap();
    dbs.push(Db {
        url,
        store: AnyStore::Sqlite(store),
        _file: Some(file),
    });
    if let Some(url) = test_support::fresh_postgres_url().await {
        Command::cargo_bin("idem")
            .unwrap()
            .args(["--database-url", &url, "migrate"])
            .assert()
            .success();
        let store = PgStore::connect(&url).await.unwrap();
        dbs.push(Db {
            url,
            store: AnyStore::Postgres(store),
            _file: None,
        });
    }
    if let Some(url) = test_support::fresh_mysql_url().await {
        Command::cargo_bin("idem")
            .unwrap()
            .args(["--database-url", &url, "migrate"])
            .assert()
            .success();
        let store = MySqlStore::connect(&url).await.unwrap();
        dbs.push(Db {
            url,
            store: AnyStore::MySql(store),
            _file: None,
        });
    }
    dbs
}

fn idem_without_db(args: &[&str]) -> assert_cmd::assert::Assert {
    Command::cargo_bin("idem")
        .unwrap()
        .env_remove("DATABASE_URL")
        .args(args)
        .timeout(Duration::from_secs(30))
        .assert()
}

#[test]
fn bad_input_exits_with_2() {
    let db = ["--database-url", "sqlite:///nonexistent/never-opened.db"];
    let cases: &[(&[&str], &str)] = &[
        (
            &["keys", "list", "--older-than", "5 parsecs"],
            "--older-than",
        ),
        (&["keys", "list", "--older-than", "soon"], "--older-than"),
        (&["keys", "list", "--state", "done"], "possible values"),
        (&["recover", "--interval", "30"], "--interval"),
        (&["recover", "--max-attempts", "0"], "--max-attempts"),
        (&["purge", "--batch", "0"], "--batch"),
        (&["keys", "resolve", "s", "o", "k", "--failed"], "--reason"),
        (&["keys", "hand-back", "s", "o", "k"], "--reason"),
        (
            &[
                "keys",
                "resolve",
                "s",
                "o",
                "k",
                "--failed",
                "--reason",
                "x",
                "--operator",
                " ",
            ],
            "--operator",
        ),
        (
            &["keys", "resolve", "s", "o", "k", "--reason", "x"],
            "--failed",
        ),
        (
            &[
                "keys",
                "resolve",
                "s",
                "o",
                "k",
                "--failed",
                "--completed-with",
                "f",
                "--reason",
                "x",
            ],
            "cannot be used with",
        ),
        (
            &[
                "keys", "resolve", "s", "o", "k", "--failed", "--reason", " ",
            ],
            "reason",
        ),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, message) in cases {
        idem_without_db(&[&db[..], args].concat())
            .code(2)
            .stderr(predicate::str::contains(*message));
    }
    idem_without_db(&["--database-url", "redis://cache", "stats"])
        .code(2)
        .stderr(predicate::str::contains("postgres://"));
    idem_without_db(&["stats"])
        .code(2)
        .stderr(predicate::str::contains("DATABASE_URL"));
}

#[test]
fn help_never_shows_the_password_from_the_environment() {
    Command::cargo_bin("idem")
        .unwrap()
        .env("DATABASE_URL", "postgres://idem:hunter2@db/idem")
        .arg("--help")
        .assert()
        .success()
        .stdout(
            predicate::str::contains("DATABASE_URL").and(predicate::str::contains("hunter2").not()),
        );
}

#[test]
fn unreachable_database_exits_with_1_and_says_why() {
    idem_without_db(&[
        "--database-url",
        "postgres://idem:secret@127.0.0.1:1/idem",
        "stats",
    ])
    .code(1)
    .stderr(
        predicate::str::contains("could not connect to the database")
            .and(predicate::str::contains("idem:***@127.0.0.1:1"))
            .and(predicate::str::contains("secret").not()),
    );
    // The URL may come from the environment too.
    Command::cargo_bin("idem")
        .unwrap()
        .env("DATABASE_URL", "mysql://idem:secret@127.0.0.1:1/idem")
        .args(["keys", "list"])
        .timeout(Duration::from_secs(30))
        .assert()
        .code(1)
        .stderr(predicate::str::contains("could not connect"));
    // A SQLite file is never created by accident.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("typo.db").display());
    idem_without_db(&["--database-url", &url, "stats"])
        .code(1)
        .stderr(predicate::str::contains("idem migrate"));
    assert!(!dir.path().join("typo.db").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_recover_and_resolve() {
    for db in databases().await {
        let name = db.name();
        db.idem(&["migrate"]).success();
        db.complete("alice", "done-1").await;
        db.abandon("bob", "ext-1", Effects::External).await;
        db.abandon("carol", "local-1", Effects::Local).await;

        let all = db.json(&["keys", "list", "--json"]);
        assert_eq!(all.as_array().unwrap().len(), 3, "{name}: {all}");
        db.idem(&["keys", "list", "--state", "pending"])
            .success()
            .stdout(
                predicate::str::contains("bob")
                    .and(predicate::str::contains("carol"))
                    .and(predicate::str::contains("alice").not())
                    .and(predicate::str::contains("2 key(s)")),
            );
        let alice = db.json(&[
            "keys",
            "list",
            "--scope",
            "alice",
            "--operation",
            "charge",
            "--json",
        ]);
        assert_eq!(alice[0]["state"], "completed", "{name}");
        assert_eq!(alice[0]["result"], json!({"order": 1}));
        let old = db.json(&["keys", "list", "--older-than", "1h", "--json"]);
        assert_eq!(old, json!([]), "{name}");
        let one = db.json(&["keys", "list", "--limit", "1", "--json"]);
        assert_eq!(one.as_array().unwrap().len(), 1);

        let stats = db.json(&["stats", "--json"]);
        assert_eq!(stats["total"], 3, "{name}: {stats}");
        assert_eq!(stats["expired_leases"], 2);
        assert!(stats["oldest_pending_age_ms"].as_u64().unwrap() >= 30);
        db.idem(&["stats"])
            .success()
            .stdout(predicate::str::contains("charge").and(predicate::str::contains("pending")));

        // No resolver in the CLI: the external key is parked, the local one released.
        let report = db.json(&["recover", "--once", "--json"]);
        assert_eq!(report["released"], 1, "{name}: {report}");
        assert_eq!(report["parked"], 1, "{name}: {report}");
        let parked = db.json(&["keys", "list", "--state", "needs-review", "--json"]);
        assert_eq!(parked.as_array().unwrap().len(), 1, "{name}");
        assert!(parked[0]["reason"]
            .as_str()
            .unwrap()
            .contains("no resolver"));
        db.idem(&["keys", "show", "carol", "charge", "local-1"])
            .code(1)
            .stderr(predicate::str::contains("no key carol/charge/local-1"));

        // Resolve: only JSON results, only parked keys, the reason kept.
        let dir = tempfile::tempdir().unwrap();
        let not_json = dir.path().join("result.txt");
        std::fs::write(&not_json, "charged!").unwrap();
        db.idem(&[
            "keys",
            "resolve",
            "bob",
            "charge",
            "ext-1",
            "--completed-with",
            not_json.to_str().unwrap(),
            "--reason",
            "x",
        ])
        .code(2)
        .stderr(predicate::str::contains("not JSON"));
        let result = dir.path().join("result.json");
        std::fs::write(&result, r#"{"charge": "ch_42"}"#).unwrap();
        db.idem(&[
            "keys",
            "resolve",
            "bob",
            "charge",
            "ext-1",
            "--completed-with",
            result.to_str().unwrap(),
            "--reason",
            "provider dashboard shows ch_42",
            "--operator",
            "alice-ops",
            "--evidence",
            "dashboard ch_42",
        ])
        .success()
        .stdout(predicate::str::contains("completed"));
        // The history: reserved (by the test process), claimed and parked by the recovery
        // pass, resolved by the operator, oldest first.
        let history = db.json(&["keys", "history", "bob", "charge", "ext-1", "--json"]);
        let kinds: Vec<&str> = history
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["kind"].as_str().unwrap())
            .collect();
        let expected = ["reserved", "claimed", "parked", "resolved"];
        assert_eq!(kinds, expected, "{name}: {history}");
        assert_eq!(history[3]["actor"], "alice-ops", "{name}: {history}");
        let detail = history[3]["detail"].as_str().unwrap();
        assert!(detail.contains("dashboard ch_42"), "{name}: {detail}");
        db.idem(&["keys", "history", "bob", "charge", "ext-1"])
            .success()
            .stdout(
                predicate::str::contains("resolved")
                    .and(predicate::str::contains("alice-ops"))
                    .and(predicate::str::contains("parked")),
            );
        db.idem(&["keys", "history", "bob", "charge", "never"])
            .code(1)
            .stderr(predicate::str::contains("no key"));
        let shown = db.json(&["keys", "show", "bob", "charge", "ext-1", "--json"]);
        assert_eq!(shown["state"], "completed", "{name}: {shown}");
        assert_eq!(shown["reason"], "provider dashboard shows ch_42");
        assert_eq!(shown["result"], json!({"charge": "ch_42"}));
        db.idem(&["keys", "show", "bob", "charge", "ext-1"])
            .success()
            .stdout(predicate::str::contains("provider dashboard shows ch_42"));
        db.idem(&[
            "keys", "resolve", "bob", "charge", "ext-1", "--failed", "--reason", "again",
        ])
        .code(1)
        .stderr(predicate::str::contains("not needs_review"));
        db.idem(&[
            "keys", "resolve", "alice", "charge", "nope", "--failed", "--reason", "x",
        ])
        .code(1)
        .stderr(predicate::str::contains("no idempotency key"));

        // --failed on another parked key.
        db.abandon("dave", "ext-2", Effects::External).await;
        db.idem(&["recover", "--once"])
            .success()
            .stdout(predicate::str::contains("parked 1"));
        db.idem(&[
            "keys",
            "resolve",
            "dave",
            "charge",
            "ext-2",
            "--failed",
            "--reason",
            "no charge",
        ])
        .success();
        let shown = db.json(&["keys", "show", "dave", "charge", "ext-2", "--json"]);
        assert_eq!(shown["state"], "failed", "{name}");
        assert_eq!(shown["reason"], "no charge");

        // Hand-back: a parked key goes back to pending with its lease ended.
        db.abandon("erin", "ext-3", Effects::External).await;
        db.idem(&["recover", "--once"])
            .success()
            .stdout(predicate::str::contains("parked 1"));
        db.idem(&[
            "keys",
            "hand-back",
            "erin",
            "charge",
            "ext-3",
            "--reason",
            "ask again",
            "--operator",
            "bob-ops",
        ])
        .success()
        .stdout(predicate::str::contains("handed"));
        let shown = db.json(&["keys", "show", "erin", "charge", "ext-3", "--json"]);
        assert_eq!(shown["state"], "pending", "{name}: {shown}");
        assert_eq!(shown["lease_remaining_ms"], 0, "{name}: {shown}");
        let history = db.json(&["keys", "history", "erin", "charge", "ext-3", "--json"]);
        let last = history.as_array().unwrap().last().unwrap().clone();
        assert_eq!(last["kind"], "handed_back", "{name}: {history}");
        assert_eq!(last["actor"], "bob-ops", "{name}: {history}");
        db.idem(&[
            "keys",
            "hand-back",
            "erin",
            "charge",
            "ext-3",
            "--reason",
            "again",
        ])
        .code(1)
        .stderr(predicate::str::contains("not needs_review"));
        eprintln!("{name}: inspect, recover and resolve ok");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_only_expired_keys() {
    for db in databases().await {
        let name = db.name();
        db.bulk("old", 2_500, -60_000).await;
        db.bulk("fresh", 10, 3_600_000).await;
        db.abandon("bob", "ext-1", Effects::External).await;
        db.idem(&["recover", "--once"]).success();
        let dry = db.json(&["purge", "--dry-run", "--json"]);
        assert_eq!(dry["would_delete"], 2_500, "{name}");
        db.idem(&["purge", "--dry-run"])
            .success()
            .stdout(predicate::str::contains(
                "2500 expired key(s) would be deleted",
            ));
        assert_eq!(db.json(&["stats", "--json"])["total"], 2_511);
        // Not a terminal: no progress bar on stderr.
        let out = db
            .idem(&["purge", "--batch", "1000", "--pause", "0s", "--json"])
            .success()
            .stderr(predicate::str::is_empty())
            .get_output()
            .stdout
            .clone();
        let report: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(report["deleted"], 2_500, "{name}: {report}");
        assert_eq!(report["batches"], 3);
        let stats = db.json(&["stats", "--json"]);
        assert_eq!(stats["total"], 11, "{name}: fresh and parked keys stay");
        assert_eq!(stats["purgeable"], 0);
        db.idem(&["purge"])
            .success()
            .stdout(predicate::str::contains("deleted 0 expired key(s)"));
    }
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_loop_runs_until_sigterm() {
    for db in databases().await {
        let name = db.name();
        let bin = assert_cmd::cargo::cargo_bin("idem");
        let child = std::process::Command::new(bin)
            .args(["--database-url", &db.url, "recover", "--interval", "100ms"])
            .env_remove("DATABASE_URL")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        db.abandon("erin", "local-9", Effects::Local).await;
        let mut released = false;
        for _ in 0..100 {
            let left = db.json(&["keys", "list", "--scope", "erin", "--json"]);
            if left == json!([]) {
                released = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            released,
            "{name}: the loop released the key; {stdout} {stderr}"
        );
        assert!(out.status.success(), "{name}: {:?} {stderr}", out.status);
        assert!(stdout.contains("released 1"), "{name}: {stdout}");
        assert!(
            stderr.contains("stopped; in total: released 1"),
            "{name}: {stderr}"
        );
    }
}

/// A durable charge for the history test: a local step, then a keyed outside call to a provider
/// that is slow until told otherwise, then the completion.
#[derive(Clone)]
struct SlowCharge {
    /// Whether the provider answers at once (the resumer's turn) or hangs (the first worker's).
    answers: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl idempotency::durable::Operation<SqliteStore> for SlowCharge {
    type Request = Value;
    type Response = Value;

    fn name(&self) -> &str {
        "charge"
    }

    async fn run(
        &self,
        steps: &mut idempotency::durable::Steps<SqliteStore>,
        _request: &Value,
    ) -> Result<idempotency::durable::Finished<Value>, idempotency::durable::StepError> {
        use idempotency::durable::Lookup;
        use std::sync::atomic::Ordering;
        steps
            .local("order", async |_tx| {
                Ok::<_, sqlx::Error>(json!({"order": 7}))
            })
            .await?;
        let answers = self.answers.clone();
        let charge = steps
            .call(
                "charge",
                |key| {
                    let answers = answers.clone();
                    async move {
                        if !answers.load(Ordering::SeqCst) {
                            std::future::pending::<()>().await;
                        }
                        Ok(json!({"charge_id": "ch_42", "key": key}))
                    }
                },
                |_key| async { Lookup::NotDone },
            )
            .await?;
        steps
            .finish(async move |_tx| Ok::<_, sqlx::Error>(json!({"paid": charge})))
            .await
    }
}

/// `idem keys history` of a durable charge abandoned in the middle of its outside call and
/// finished by the resumer (SQLite): reserved, the step, the call started, the claim by the
/// resumer, the call answered, the completion, in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_of_a_durable_key_resumed_after_a_crash() {
    use idempotency::{durable::Operations, maintenance::Recovery};
    use std::sync::{atomic::AtomicBool, Arc};
    let file = test_support::fresh_sqlite();
    let store = SqliteStore::connect(&file.url).await.unwrap();
    store.migrate().await.unwrap();
    let db = Db {
        url: file.url.clone(),
        store: AnyStore::Sqlite(store.clone()),
        _file: Some(file),
    };
    let charge = SlowCharge {
        answers: Arc::new(AtomicBool::new(false)),
    };
    let web = Idempotency::new(store.clone().with_worker_name("web-1"))
        .with_lease(Duration::from_millis(300));
    let worker = {
        let (web, charge) = (web.clone(), charge.clone());
        tokio::spawn(async move { web.perform(&charge, "alice", "k-1", &json!({"n": 1})).await })
    };
    let key = IdempotencyKey::new("alice", "charge", "k-1").unwrap();
    let mut started = false;
    for _ in 0..200 {
        let history = idempotency::store::Maintenance::history(&store, &key, 100)
            .await
            .unwrap();
        if history.iter().any(|e| e.kind.as_str() == "call_started") {
            started = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(started, "the call never started");
    worker.abort();
    let _ = worker.await;
    charge
        .answers
        .store(true, std::sync::atomic::Ordering::SeqCst);

    let resumer = store.clone().with_worker_name("resumer");
    let engine = Idempotency::new(resumer.clone());
    let recovery = Recovery::new(resumer).with_operations(engine, Operations::new().with(charge));
    let mut completed = false;
    for _ in 0..100 {
        recovery.run_once().await.unwrap();
        if db.json(&["keys", "show", "alice", "charge", "k-1", "--json"])["state"] == "completed" {
            completed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(completed, "the resumer did not finish");

    let history = db.json(&["keys", "history", "alice", "charge", "k-1", "--json"]);
    let events: Vec<(&str, &str)> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let actor = e["actor"].as_str().unwrap_or_default();
            (e["kind"].as_str().unwrap(), actor)
        })
        .collect();
    assert_eq!(
        events,
        [
            ("reserved", "web-1"),
            ("step_committed", "web-1"),
            ("call_started", "web-1"),
            ("claimed", "resumer"),
            ("call_started", "resumer"),
            ("call_answered", "resumer"),
            ("completed", "resumer"),
        ],
        "{history:#}"
    );
    db.idem(&["keys", "history", "alice", "charge", "k-1"])
        .success()
        .stdout(
            predicate::str::contains("claimed")
                .and(predicate::str::contains("resumer"))
                .and(predicate::str::contains("call_answered"))
                .and(predicate::str::contains("ch_42")),
        );
}
