//! `--provider-database-url`: the simulated providers keep their state in a database of their
//! own, as a real provider keeps it outside the shop's database (the server and `shop storm`;
//! the default, the shop's own database, is what every other test runs).

mod common;

use sqlx::{Connection, PgConnection};

/// PostgreSQL: a purchase's charge is in the providers' database, under the key derived from the
/// purchase's key, and the shop's database has no provider table at all; a retry replays and
/// charges nothing more.
#[tokio::test]
async fn the_providers_keep_their_state_in_their_own_database() {
    let Some(shop_url) = test_support::fresh_postgres_url().await else {
        return;
    };
    let Some(providers_url) = test_support::fresh_postgres_url().await else {
        return;
    };
    let shop = common::start(
        &shop_url,
        None,
        &["--provider-database-url", &providers_url],
    );
    let key = uuid::Uuid::new_v4().to_string();
    let body = r#"{"sku": "tea", "quantity": 2}"#;
    let url = format!("{}/purchases", shop.url);
    for attempt in 0..2 {
        let r = common::send("POST", &url, Some("alice"), Some(&key), Some(body)).await;
        assert_eq!(r.status, 201, "{r:?}");
        assert_eq!(r.replayed, attempt == 1, "{r:?}");
    }
    let mut providers = PgConnection::connect(&providers_url).await.unwrap();
    let charges: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT provider_key, account, amount_cents FROM payment_provider_charges")
            .fetch_all(&mut providers)
            .await
            .unwrap();
    assert_eq!(charges.len(), 1, "{charges:?}");
    let charge_key = idempotency::IdempotencyKey::new("alice", shop::purchase::PURCHASE, &key)
        .map(|k| idempotency::durable::provider_key(&k, "charge"))
        .unwrap();
    assert_eq!(charges[0].0, charge_key, "{charges:?}");
    assert_eq!((charges[0].1.as_str(), charges[0].2), ("alice", 900));
    let mut shop_db = PgConnection::connect(&shop_url).await.unwrap();
    let provider_tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE '%provider%'",
    )
    .fetch_one(&mut shop_db)
    .await
    .unwrap();
    assert_eq!(provider_tables, 0, "provider tables in the shop's database");
    let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM shop_orders WHERE status = 'paid'")
        .fetch_one(&mut shop_db)
        .await
        .unwrap();
    assert_eq!(paid, 1);
}

/// `shop storm` with its shop in a child process: the child gets the providers' database, and
/// the storm audits the charges there (it would find paid orders without their charges in the
/// shop's own files otherwise).
#[tokio::test]
async fn the_storm_and_its_shops_use_the_providers_database() {
    let shop = test_support::fresh_sqlite();
    let providers = test_support::fresh_sqlite();
    let mut storm = tokio::process::Command::new(env!("CARGO_BIN_EXE_shop"));
    storm
        .args(["storm", "--users", "4", "--operations", "6", "--quiet"])
        .args(["--processes", "1", "--database-url", &shop.url])
        .args(["--provider-database-url", &providers.url]);
    let output = storm.output().await.expect("run the storm");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "storm failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("invariants: OK"), "{stdout}");
    assert!(
        !std::path::Path::new(&format!("{}.providers", shop.path.display())).exists(),
        "the shop's own providers file was made"
    );
    let mut file = sqlx::SqliteConnection::connect(&providers.url)
        .await
        .unwrap();
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_provider_charges")
        .fetch_one(&mut file)
        .await
        .unwrap();
    assert!(charges > 0, "no charge in the providers' file");
}
