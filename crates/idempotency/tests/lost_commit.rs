//! A lost COMMIT acknowledgement on PostgreSQL and on MariaDB: the business write and the
//! completed key are committed, but the client sees an I/O error. `release_if_pending` must not
//! release the key, and the client's retry must get the replay: nothing runs twice.

mod common;

use common::{attempt, purchase, unique, Harness};
use idempotency::{store::KeyState, Error, Idempotency, MySqlStore, Outcome, PgStore};
use serde_json::json;
use std::net::SocketAddr;
use test_support::proxy::{FaultProxy, Protocol};

async fn resolve(host: &str, port: u16) -> SocketAddr {
    tokio::net::lookup_host((host, port))
        .await
        .unwrap()
        .next()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_commit_acknowledgement_keeps_the_completed_key_on_postgres() {
    let Some(direct) = <PgStore as Harness>::open().await else {
        return;
    };
    let options = direct.pool().connect_options();
    let upstream = resolve(options.get_host(), options.get_port()).await;
    let proxy = FaultProxy::start_for(upstream, Protocol::Postgres).await;
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
    lose_commit_acknowledgements(direct, proxied, &proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_commit_acknowledgement_keeps_the_completed_key_on_mariadb() {
    let Some(direct) = <MySqlStore as Harness>::open().await else {
        return;
    };
    let options = direct.pool().connect_options();
    let upstream = resolve(options.get_host(), options.get_port()).await;
    let proxy = FaultProxy::start_for(upstream, Protocol::Mysql).await;
    let proxied_options = (*options)
        .clone()
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled);
    let proxied = MySqlStore::new(
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .connect_with(proxied_options)
            .await
            .unwrap(),
    );
    lose_commit_acknowledgements(direct, proxied, &proxy).await;
}

/// Twenty purchases through `proxied`, each with its COMMIT reply cut; checked and retried on
/// `direct`.
async fn lose_commit_acknowledgements<S: Harness + Clone>(
    direct: S,
    proxied: S,
    proxy: &FaultProxy,
) {
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
            "{}: the client sees a failed commit: {err:?}",
            S::NAME
        );

        // The commit happened: the key is completed (not released) with the business write.
        let row = direct
            .find(a.key())
            .await
            .unwrap()
            .expect("the key was kept");
        assert_eq!(row.state, KeyState::Completed, "{}: trial {trial}", S::NAME);
        assert_eq!(direct.count_effects(&trial).await, 1);

        // The client retries (over a healthy connection) and gets the stored result.
        let retry = purchase(&retrying, &a, &trial, 2).await.unwrap();
        assert_eq!(retry, Outcome::Replayed(json!({"trial": trial, "n": 1})));
        assert_eq!(direct.count_effects(&trial).await, 1, "nothing ran twice");
    }
    assert_eq!(proxy.commits_cut(), trials);
    eprintln!(
        "{}: lost COMMIT acknowledgements: {trials} cut, {trials} kept completed, {trials} replayed, 0 double effects",
        S::NAME
    );
}
