//! A holder SIGKILLed mid-work: while it lived, its heartbeat kept its key past the lease; once
//! killed, its lease ends within one lease plus one heartbeat interval of the kill (by the
//! database's clock), and a retry then takes the key over, on every backend. The holder is this
//! test binary run again as a child process (`the_child_holds_a_key_until_killed`), so the kill
//! is a real SIGKILL.

use idempotency::{
    protocol::Reservation, Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, MySqlStore,
    PgStore, SqliteStore, Store,
};
use std::time::{Duration, Instant};
use test_support::TestDatabase;

/// The holder's lease; its heartbeat beats every third of it.
const LEASE: Duration = Duration::from_millis(600);
const BEAT: Duration = Duration::from_millis(200);
const TRIALS: u32 = 20;
/// How the child finds its database and key.
const URL_VAR: &str = "HEARTBEAT_CHILD_URL";
const KEY_VAR: &str = "HEARTBEAT_CHILD_KEY";
/// What the child prints once it holds its key.
const HELD: &str = "the key is held";

fn attempt(key: &str) -> Attempt {
    Attempt::new(
        IdempotencyKey::new("killed", "hold", key).expect("a valid key"),
        Fingerprint::of_bytes(b"hold"),
    )
}

/// The child process of `a_killed_holder_is_taken_over_within_a_lease_and_a_beat`, not a test
/// of its own: it reserves the key it is given (heartbeat on), says `held`, and works until it is
/// killed.
#[tokio::test]
#[ignore = "the child process of the SIGKILL test, which runs it"]
async fn the_child_holds_a_key_until_killed() {
    let url = std::env::var(URL_VAR).expect("run by the SIGKILL test");
    let key = std::env::var(KEY_VAR).expect("run by the SIGKILL test");
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&url).await.expect("connect");
        hold(PgStore::new(pool), &key).await;
    } else if url.starts_with("mysql") {
        let pool = sqlx::MySqlPool::connect(&url).await.expect("connect");
        hold(MySqlStore::new(pool), &key).await;
    } else {
        hold(SqliteStore::connect(&url).await.expect("open"), &key).await;
    }
}

async fn hold<S: Store>(store: S, key: &str) {
    let idem = Idempotency::new(store).with_lease(LEASE);
    let Reservation::Acquired(_lease) = idem.reserve(&attempt(key)).await.expect("reserve") else {
        panic!("the key must be fresh")
    };
    println!("{HELD}");
    // The work, until the SIGKILL; the lease's heartbeat runs meanwhile.
    std::future::pending::<()>().await;
}

async fn a_killed_holder_is_taken_over_within_a_lease_and_a_beat(backend: TestDatabase) {
    let db = backend
        .fresh_database()
        .await
        .expect("an available backend");
    match backend {
        TestDatabase::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
            measure(PgStore::new(pool), &db.url, backend).await
        }
        TestDatabase::MySql => {
            let pool = sqlx::MySqlPool::connect(&db.url).await.expect("connect");
            measure(MySqlStore::new(pool), &db.url, backend).await
        }
        TestDatabase::Sqlite => {
            let store = SqliteStore::connect(&db.url).await.expect("open");
            measure(store, &db.url, backend).await
        }
    }
}

/// Per trial: a child holds a key and works for one to three leases (several beats), is
/// SIGKILLed; the key's remaining lease is read right after the kill (by the database's clock,
/// so this process's scheduling cannot stretch it), and a retry polls the key every 5 ms until
/// it takes it over.
async fn measure<S: Store>(store: S, url: &str, backend: TestDatabase) {
    store.migrate().await.expect("migrate");
    let retry = Idempotency::new(store).with_lease(LEASE);
    let (mut lease_ends, mut waits) = (Vec::new(), Vec::new());
    for trial in 0..TRIALS {
        let key = format!("k-{trial}");
        let mut child = test_support::spawn_child_test(
            "the_child_holds_a_key_until_killed",
            &[(URL_VAR, url), (KEY_VAR, &key)],
            HELD,
        )
        .await;
        // Killed at a different phase of its beats in each trial, after at least one lease.
        tokio::time::sleep(
            LEASE + LEASE * (trial % 7) / 3 + Duration::from_millis(17 * u64::from(trial % 11)),
        )
        .await;
        child.kill().expect("SIGKILL");
        let killed = Instant::now();
        child.wait().expect("reap the holder");
        // When the dead holder's lease ends, after the kill: the time to this read plus what the
        // database says remains. A stall before the read shortens the remainder as much as it
        // lengthens the time, so the sum is the lease's end by the database's clock (at most the
        // read's one-way trip early).
        let before_read = killed.elapsed();
        let row = retry
            .store()
            .find(attempt(&key).key())
            .await
            .expect("read the key")
            .expect("the key is kept");
        lease_ends.push(before_read + row.lease_remaining);
        loop {
            match retry.reserve(&attempt(&key)).await {
                Ok(Reservation::Acquired(lease)) => {
                    waits.push(killed.elapsed());
                    lease.release().await.expect("release");
                    break;
                }
                Err(Error::InProgress { .. }) => tokio::time::sleep(Duration::from_millis(5)).await,
                Ok(Reservation::Completed(_)) => panic!("{backend}: trial {trial}: completed"),
                Ok(_) => panic!("{backend}: trial {trial}: an unknown reservation"),
                Err(other) => panic!("{backend}: trial {trial}: {other:?}"),
            }
            assert!(
                killed.elapsed() < LEASE * 5,
                "{backend}: trial {trial}: the key was never taken over"
            );
        }
    }
    let ms = |d: Duration| d.as_millis();
    let distribution = |what: &str, values: &mut Vec<Duration>| {
        values.sort();
        let at = |q: usize| values[(values.len() - 1) * q / 100];
        println!(
            "{backend}: {TRIALS} SIGKILLed holders (lease {} ms, a beat every {} ms): {what} min {} ms, p50 {} ms, p90 {} ms, max {} ms after the kill; all: {:?}",
            ms(LEASE),
            ms(BEAT),
            ms(values[0]),
            ms(at(50)),
            ms(at(90)),
            ms(values[values.len() - 1]),
            values.iter().map(|d| d.as_millis()).collect::<Vec<_>>()
        );
    };
    distribution("the lease ended (database clock)", &mut lease_ends);
    distribution("a retry polling every 5 ms took the key over", &mut waits);
    // Alive, the holder kept its key past its lease (it was killed at least one lease after it
    // reserved, so without beats a retry would take the key at once): the last beat before the
    // kill was about one interval earlier, so the key stays its own for about `LEASE - BEAT`
    // after the kill or more. Half a lease leaves room for a late beat on a loaded machine.
    assert!(
        waits[0] >= LEASE / 2,
        "{backend}: taken over {} ms after the kill: the heartbeat did not keep the lease",
        ms(waits[0])
    );
    let latest_end = lease_ends[lease_ends.len() - 1];
    assert!(
        latest_end <= LEASE + BEAT,
        "{backend}: a lease ended {} ms after the kill, beyond a lease and a beat",
        ms(latest_end)
    );
}

test_support::backend_tests! {
    #[tokio::test]
    a_killed_holder_is_taken_over_within_a_lease_and_a_beat,
}
