//! Black-box tests of every endpoint, against the real binary, on SQLite, PostgreSQL and MariaDB.

mod common;

use common::{send, start, Reply, Shop};
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::collections::HashSet;
use test_support::TestDatabase;

const TEA2: &str = r#"{"sku": "tea", "quantity": 2}"#;

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

async fn ledger(base: &str, user: &str) -> Value {
    let r = send(
        "GET",
        &format!("{base}/users/{user}/ledger"),
        Some(user),
        None,
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    r.body
}

/// Places an order of two teas for `user` and pays it; its id.
async fn paid_order(base: &str, user: &str) -> i64 {
    let order = send(
        "POST",
        &format!("{base}/orders"),
        Some(user),
        Some(&key()),
        Some(TEA2),
    )
    .await;
    assert_eq!(order.status, 201, "{order:?}");
    let id = order.body["order_id"].as_i64().unwrap();
    let paid = send(
        "POST",
        &format!("{base}/orders/{id}/pay"),
        Some(user),
        None,
        None,
    )
    .await;
    assert_eq!(paid.status, 200, "{paid:?}");
    id
}

/// `/healthz` names the backend; purchases need a valid user.
async fn health_and_authentication(backend: TestDatabase) {
    let Some(shop) = common::fresh_shop(backend).await else {
        return;
    };
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    // Health and authentication.
    let r = send("GET", &format!("{base}/healthz"), None, None, None).await;
    assert_eq!(
        (r.status, r.body["database"].as_str()),
        (200, Some(backend.name()))
    );
    send("POST", &purchases, None, Some(&key()), Some(TEA2))
        .await
        .assert_problem(401, "unauthenticated");
    send(
        "POST",
        &purchases,
        Some("bad user!"),
        Some(&key()),
        Some(TEA2),
    )
    .await
    .assert_problem(401, "unauthenticated");
}

/// Bad input on the keyed route: a clear problem, and nothing is reserved or charged.
async fn bad_input_reserves_and_charges_nothing(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // Bad input on the keyed route: nothing is reserved or charged.
    send("POST", &purchases, Some(alice), None, Some(TEA2))
        .await
        .assert_problem(400, "key-missing");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&"k".repeat(300)),
        Some(TEA2),
    )
    .await
    .assert_problem(400, "key-invalid");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&key()),
        Some("{not json"),
    )
    .await
    .assert_problem(400, "body-not-json");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&key()),
        Some(r#"{"sku": "caviar", "quantity": 1}"#),
    )
    .await
    .assert_problem(422, "unknown-sku");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&key()),
        Some(r#"{"sku": "tea", "quantity": 0}"#),
    )
    .await
    .assert_problem(422, "invalid-quantity");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&key()),
        Some(r#"{"sku": "tea"}"#),
    )
    .await
    .assert_problem(422, "invalid-body");
    let big = format!(
        r#"{{"sku": "tea", "quantity": 1, "pad": "{}"}}"#,
        "x".repeat(20_000)
    );
    send("POST", &purchases, Some(alice), Some(&key()), Some(&big))
        .await
        .assert_problem(413, "body-too-large");
    let start_ledger = ledger(base, alice).await;
    assert_eq!(start_ledger["balance_cents"], 100_000);
    assert_eq!(start_ledger["charges"], json!([]));
}

/// A purchase, its replay, the same key with another payload (422), and from another user (another operation).
async fn a_purchase_is_replayed_and_its_key_bound_to_its_request(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // A purchase, its replay, and the same key with another payload.
    let k = key();
    let first = send("POST", &purchases, Some(alice), Some(&k), Some(TEA2)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed);
    assert_eq!(first.body["amount_cents"], 900);
    for field in ["purchase_id", "order_id", "charge_id"] {
        assert!(!first.body[field].is_null(), "{field} in {first:?}");
    }
    let again = send(
        "POST",
        &purchases,
        Some(alice),
        Some(&k),
        Some(r#"{"quantity":2,"sku":"tea"}"#),
    )
    .await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    assert_eq!(again.body, first.body);
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&k),
        Some(r#"{"sku": "tea", "quantity": 3}"#),
    )
    .await
    .assert_problem(422, "key-reused");
    // The same key from another user is another operation.
    let bob = send("POST", &purchases, Some("bob"), Some(&k), Some(TEA2)).await;
    assert_eq!((bob.status, bob.replayed), (201, false), "{bob:?}");
    assert_ne!(bob.body["charge_id"], first.body["charge_id"]);
}

/// Concurrent duplicates: one purchase, one charge; the others replay it or get 409.
async fn concurrent_duplicates_make_one_purchase(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // Concurrent duplicates: one purchase, one charge.
    let k = key();
    let racing: Vec<Reply> =
        join_all((0..8).map(|_| send("POST", &purchases, Some(alice), Some(&k), Some(TEA2)))).await;
    let created: Vec<&Reply> = racing.iter().filter(|r| r.status == 201).collect();
    assert!(!created.is_empty(), "{racing:?}");
    for r in &racing {
        assert!(r.status == 201 || r.status == 409, "{r:?}");
        if r.status == 409 {
            r.assert_problem(409, "in-progress");
        }
    }
    let ids: HashSet<String> = created
        .iter()
        .map(|r| r.body["charge_id"].to_string())
        .collect();
    assert_eq!(ids.len(), 1, "{racing:?}");
    assert_eq!(created.iter().filter(|r| !r.replayed).count(), 1);
}

/// A definitive refusal (402) is stored and replayed, and its writes roll back.
async fn a_definitive_refusal_is_stored_and_replayed(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // A definitive refusal is stored and replayed.
    let k = key();
    let big_order = r#"{"sku": "mug", "quantity": 100}"#;
    let refused = send("POST", &purchases, Some(alice), Some(&k), Some(big_order)).await;
    refused.assert_problem(402, "insufficient-balance");
    assert!(!refused.replayed);
    let replayed = send("POST", &purchases, Some(alice), Some(&k), Some(big_order)).await;
    replayed.assert_problem(402, "insufficient-balance");
    assert!(replayed.replayed);
    let l = ledger(base, alice).await;
    assert_eq!(l["charges"], json!([]), "a refusal charges nothing: {l}");
    assert_eq!(
        l["balance_cents"], 100_000,
        "and its debit rolled back: {l}"
    );
}

/// Orders and the guarded transition unpaid → paid.
async fn orders_move_from_unpaid_to_paid_once(shop: Shop) {
    let base = shop.url.as_str();
    let alice = "alice";
    let orders = format!("{base}/orders");
    send("POST", &orders, Some(alice), None, Some(TEA2))
        .await
        .assert_problem(400, "key-missing");
    let k = key();
    let order = send("POST", &orders, Some(alice), Some(&k), Some(TEA2)).await;
    assert_eq!(
        (order.status, order.body["status"].as_str()),
        (201, Some("unpaid")),
        "{order:?}"
    );
    let replay = send("POST", &orders, Some(alice), Some(&k), Some(TEA2)).await;
    assert_eq!((replay.replayed, &replay.body), (true, &order.body));
    let id = order.body["order_id"].as_i64().unwrap();
    let pay = format!("{base}/orders/{id}/pay");
    let paid = send("POST", &pay, Some(alice), None, None).await;
    assert_eq!(
        (paid.status, &paid.body["already_paid"]),
        (200, &json!(false)),
        "{paid:?}"
    );
    let paid_again = send("POST", &pay, Some(alice), None, None).await;
    assert_eq!(
        (paid_again.status, &paid_again.body["already_paid"]),
        (200, &json!(true))
    );
    assert_eq!(paid_again.body["charge_id"], paid.body["charge_id"]);
    send(
        "POST",
        &format!("{base}/orders/{id}/pay"),
        Some("bob"),
        None,
        None,
    )
    .await
    .assert_problem(404, "not-found");
    send(
        "POST",
        &format!("{base}/orders/abc/pay"),
        Some(alice),
        None,
        None,
    )
    .await
    .assert_problem(400, "invalid-path");
    let r = send(
        "GET",
        &format!("{base}/orders/{id}"),
        Some(alice),
        None,
        None,
    )
    .await;
    assert_eq!((r.status, r.body["status"].as_str()), (200, Some("paid")));
}

/// Racing payments of one order: exactly one pays.
async fn racing_payments_pay_an_order_once(shop: Shop) {
    let base = shop.url.as_str();
    let orders = format!("{base}/orders");
    let alice = "alice";
    let order = send("POST", &orders, Some(alice), Some(&key()), Some(TEA2)).await;
    let id2 = order.body["order_id"].as_i64().unwrap();
    let pay2 = format!("{base}/orders/{id2}/pay");
    let racing: Vec<Reply> =
        join_all((0..8).map(|_| send("POST", &pay2, Some(alice), None, None))).await;
    assert!(racing.iter().all(|r| r.status == 200), "{racing:?}");
    assert_eq!(
        racing
            .iter()
            .filter(|r| r.body["already_paid"] == json!(false))
            .count(),
        1,
        "{racing:?}"
    );
}

/// Point grants: one per order (a business unique constraint), also under races.
async fn one_point_grant_per_order(shop: Shop) {
    let base = shop.url.as_str();
    let orders = format!("{base}/orders");
    let alice = "alice";
    // Two paid orders and an unpaid one.
    let id = paid_order(base, alice).await;
    let id2 = paid_order(base, alice).await;
    let grants = format!("{base}/points/grants");
    let unpaid = send("POST", &orders, Some(alice), Some(&key()), Some(TEA2)).await;
    let unpaid_id = unpaid.body["order_id"].as_i64().unwrap();
    send(
        "POST",
        &grants,
        Some(alice),
        None,
        Some(&json!({"order_id": unpaid_id, "points": 5}).to_string()),
    )
    .await
    .assert_problem(422, "order-unpaid");
    send(
        "POST",
        &grants,
        Some(alice),
        None,
        Some(&json!({"order_id": id, "points": 0}).to_string()),
    )
    .await
    .assert_problem(422, "invalid-points");
    send(
        "POST",
        &grants,
        Some(alice),
        None,
        Some(&json!({"order_id": 999_999, "points": 5}).to_string()),
    )
    .await
    .assert_problem(404, "not-found");
    let grant = send(
        "POST",
        &grants,
        Some(alice),
        None,
        Some(&json!({"order_id": id, "points": 50}).to_string()),
    )
    .await;
    assert_eq!(
        (grant.status, &grant.body["duplicate"]),
        (201, &json!(false)),
        "{grant:?}"
    );
    let dup = send(
        "POST",
        &grants,
        Some(alice),
        None,
        Some(&json!({"order_id": id, "points": 70}).to_string()),
    )
    .await;
    assert_eq!(
        (dup.status, &dup.body["duplicate"], &dup.body["points"]),
        (200, &json!(true), &json!(50)),
        "{dup:?}"
    );
    assert_eq!(dup.body["grant_id"], grant.body["grant_id"]);
    let body = json!({"order_id": id2, "points": 30}).to_string();
    let racing: Vec<Reply> =
        join_all((0..8).map(|_| send("POST", &grants, Some(alice), None, Some(&body)))).await;
    assert_eq!(
        racing.iter().filter(|r| r.status == 201).count(),
        1,
        "{racing:?}"
    );
    assert_eq!(
        racing
            .iter()
            .filter(|r| r.status == 200 && r.body["duplicate"] == json!(true))
            .count(),
        7
    );
}

/// E-mails: keyed; a replay does not send again.
async fn emails_are_keyed_and_never_sent_twice(shop: Shop) {
    let base = shop.url.as_str();
    let alice = "alice";
    let emails = format!("{base}/emails");
    let mail = r#"{"to": "alice@example.com", "subject": "Your receipt", "body": "Thanks!"}"#;
    send("POST", &emails, Some(alice), None, Some(mail))
        .await
        .assert_problem(400, "key-missing");
    // A refusal before anything was sent releases the key: the retry is refused again, not
    // kept waiting (409) behind a key left pending for the recovery job.
    let refused = key();
    for _ in 0..2 {
        send(
            "POST",
            &emails,
            Some(alice),
            Some(&refused),
            Some(r#"{"to": "nobody", "subject": "x"}"#),
        )
        .await
        .assert_problem(422, "invalid-recipient");
    }
    let unreadable = key();
    for _ in 0..2 {
        send(
            "POST",
            &emails,
            Some(alice),
            Some(&unreadable),
            Some(r#"{"to": 5, "subject": "x"}"#),
        )
        .await
        .assert_problem(422, "invalid-body");
    }
    let k = key();
    let sent = send("POST", &emails, Some(alice), Some(&k), Some(mail)).await;
    assert_eq!(sent.status, 201, "{sent:?}");
    let resent = send("POST", &emails, Some(alice), Some(&k), Some(mail)).await;
    assert_eq!(
        (resent.replayed, &resent.body["message_id"]),
        (true, &sent.body["message_id"])
    );
}

/// The ledger, read from the tables, and only by its owner; unknown routes are problems.
async fn the_ledger_is_read_from_the_tables_by_its_owner_only(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // One purchase, one paid order with 50 points, one e-mail.
    let bought = send("POST", &purchases, Some(alice), Some(&key()), Some(TEA2)).await;
    assert_eq!(bought.status, 201, "{bought:?}");
    let id = paid_order(base, alice).await;
    let grant = send(
        "POST",
        &format!("{base}/points/grants"),
        Some(alice),
        None,
        Some(&json!({"order_id": id, "points": 50}).to_string()),
    )
    .await;
    assert_eq!(grant.status, 201, "{grant:?}");
    let mail = r#"{"to": "alice@example.com", "subject": "Your receipt", "body": "Thanks!"}"#;
    let sent = send(
        "POST",
        &format!("{base}/emails"),
        Some(alice),
        Some(&key()),
        Some(mail),
    )
    .await;
    assert_eq!(sent.status, 201, "{sent:?}");
    // The ledger, read from the tables, and only by its owner.
    let l = ledger(base, alice).await;
    let charges = l["charges"].as_array().unwrap();
    assert_eq!(charges.len(), 2, "a purchase and a paid order: {l}");
    let total: i64 = charges
        .iter()
        .map(|c| c["amount_cents"].as_i64().unwrap())
        .sum();
    assert_eq!(l["charged_total_cents"], total);
    assert_eq!(l["paid_orders_total_cents"], total);
    assert_eq!(l["balance_cents"], 100_000 - total);
    assert_eq!(l["points_total"], 50);
    assert_eq!(l["emails_sent"], 1);
    send(
        "GET",
        &format!("{base}/users/bob/ledger"),
        Some(alice),
        None,
        None,
    )
    .await
    .assert_problem(403, "forbidden");
    send("GET", &format!("{base}/nowhere"), Some(alice), None, None)
        .await
        .assert_problem(404, "not-found");
}

/// Metrics: the middleware's outcome counters in Prometheus text format.
async fn metrics_count_each_outcome(shop: Shop) {
    let base = shop.url.as_str();
    let purchases = format!("{base}/purchases");
    let alice = "alice";
    // Each outcome once: executed, replayed, reused, rejected.
    let k = key();
    let first = send("POST", &purchases, Some(alice), Some(&k), Some(TEA2)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send("POST", &purchases, Some(alice), Some(&k), Some(TEA2)).await;
    assert!(again.replayed, "{again:?}");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&k),
        Some(r#"{"sku": "tea", "quantity": 3}"#),
    )
    .await
    .assert_problem(422, "key-reused");
    send("POST", &purchases, Some(alice), None, Some(TEA2))
        .await
        .assert_problem(400, "key-missing");
    send(
        "POST",
        &purchases,
        Some(alice),
        Some(&"k".repeat(300)),
        Some(TEA2),
    )
    .await
    .assert_problem(400, "key-invalid");
    // Metrics: the middleware's outcome counters in Prometheus text format.
    let client = reqwest::Client::new();
    let metrics = client.get(format!("{base}/metrics")).send().await.unwrap();
    assert!(metrics.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = metrics.text().await.unwrap();
    for outcome in ["executed", "replayed", "reused", "rejected"] {
        assert!(
            text.contains(&format!(
                r#"idempotency_requests_total{{operation="purchase",outcome="{outcome}"}}"#
            )),
            "{outcome} in {text}"
        );
    }
}

test_support::backend_tests! {
    #[tokio::test]
    health_and_authentication,
    bad_input_reserves_and_charges_nothing,
    a_purchase_is_replayed_and_its_key_bound_to_its_request,
    concurrent_duplicates_make_one_purchase,
    a_definitive_refusal_is_stored_and_replayed,
    orders_move_from_unpaid_to_paid_once,
    racing_payments_pay_an_order_once,
    one_point_grant_per_order,
    emails_are_keyed_and_never_sent_twice,
    the_ledger_is_read_from_the_tables_by_its_owner_only,
    metrics_count_each_outcome,
    unknown_outcomes,
}

/// Faults: a second process on the same database whose providers fail.
async fn unknown_outcomes(backend: TestDatabase) {
    let Some((url, sqlite)) = common::database(backend).await else {
        return;
    };
    let healthy = start(&url, None, &[]);
    let broken = start(
        &url,
        sqlite,
        &["--payment-fail-rate", "1", "--mail-fail-rate", "1"],
    );
    let user = "carol";

    // Every charge call fails, half of them after charging (the answer is lost). The purchase
    // asks the provider by the derived key: a charge that happened is found and the purchase
    // completes (201, one charge); one that did not is tried again, and after three misses the
    // purchase is settled as failed (a definitive 502: the order cancelled, the debit given
    // back, no charge). Either way a retry replays the same answer and never charges again.
    let mut balance = 100_000;
    let mut charges = 0;
    let mut outcomes = std::collections::BTreeSet::new();
    for _ in 0..8 {
        let k = key();
        let first = send(
            "POST",
            &format!("{}/purchases", broken.url),
            Some(user),
            Some(&k),
            Some(TEA2),
        )
        .await;
        match first.status {
            201 => {
                balance -= 900;
                charges += 1;
            }
            502 => first.assert_problem(502, "payment-failed"),
            other => panic!("unexpected answer {other}: {first:?}"),
        }
        outcomes.insert(first.status);
        for base in [&healthy.url, &broken.url] {
            let again = send(
                "POST",
                &format!("{base}/purchases"),
                Some(user),
                Some(&k),
                Some(TEA2),
            )
            .await;
            assert_eq!(
                (again.status, again.replayed, &again.body),
                (first.status, true, &first.body),
                "a retry replays the settled answer"
            );
        }
        let l = ledger(&healthy.url, user).await;
        assert_eq!(l["balance_cents"], balance, "{l}");
        assert_eq!(l["charges"].as_array().unwrap().len(), charges, "{l}");
        assert_eq!(
            l["charged_total_cents"], l["paid_orders_total_cents"],
            "{l}"
        );
    }
    assert!(outcomes.contains(&201), "a lost answer was found by lookup");

    // The mail provider failed: the message may have gone out, so the key is parked as needs
    // review; a retry, even on the healthy process, does not send again.
    let k = key();
    let mail = r#"{"to": "carol@example.com", "subject": "Receipt"}"#;
    send(
        "POST",
        &format!("{}/emails", broken.url),
        Some(user),
        Some(&k),
        Some(mail),
    )
    .await
    .assert_problem(502, "mail-outcome-unknown");
    let sent_before = ledger(&healthy.url, user).await["emails_sent"]
        .as_i64()
        .unwrap();
    assert!(sent_before <= 1);
    for base in [&healthy.url, &broken.url] {
        send(
            "POST",
            &format!("{base}/emails"),
            Some(user),
            Some(&k),
            Some(mail),
        )
        .await
        .assert_problem(409, "needs-review");
    }
    assert_eq!(ledger(&healthy.url, user).await["emails_sent"], sent_before);
    let metrics = reqwest::get(format!("{}/metrics", broken.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"operation="send-email",outcome="parked"} 1"#),
        "{metrics}"
    );
}
