//! A lost COMMIT acknowledgement on PostgreSQL: the business write and the completed key are
//! committed, but the client sees an I/O error. `release_if_pending` must not release the key,
//! and the client's retry must get the replay: nothing runs twice.

mod common;

use common::{attempt, purchase, unique, Harness};
use idempotency::{Error, Idempotency, KeyState, Outcome, PgStore, Store};
use serde_json::json;
use test_support::proxy::FaultProxy;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_commit_acknowledgement_keeps_the_completed_key() {
    let Some(direct) = <PgStore as Harness>::open().await else {
        return;
    };
    let options = direct.pool().connect_options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let upstream = tokio::net::lookup_host(upstream)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let proxied_options = (*options)
        .clone()
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    let proxied = PgStore::new(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(proxied_options)
            .await
            .unwrap(),
    );
    let through_proxy = Idempotency::new(proxied);
    let retrying = Idempotency::new(direct.clone());

    let trials = 20;
    for trial in 0..trials {
        let trial = format!("{}-{trial}", unique("lost-ack"));
        let a = attempt("user-1", &trial, json!({"sku": "tea"}));
        proxy.cut_next_commit();
        let err = purchase(&through_proxy, &a, &trial, 1).await.unwrap_err();
        assert!(
            matches!(err, Error::Store(_)),
            "the client sees a failed commit: {err:?}"
        );

        // The commit happened: the key is completed (not released) with the business write.
        let row = direct
            .find(a.key())
            .await
            .unwrap()
            .expect("the key was kept");
        assert_eq!(row.state, KeyState::Completed, "trial {trial}");
        assert_eq!(direct.count_effects(&trial).await, 1);

        // The client retries (over a healthy connection) and gets the stored result.
        let retry = purchase(&retrying, &a, &trial, 2).await.unwrap();
        assert_eq!(retry, Outcome::Replayed(json!({"trial": trial, "n": 1})));
        assert_eq!(direct.count_effects(&trial).await, 1, "nothing ran twice");
    }
    assert_eq!(proxy.commits_cut(), trials);
    eprintln!("lost COMMIT acknowledgements: {trials} cut, {trials} kept completed, {trials} replayed, 0 double effects");
}
