//! Step (c) of a purchase tells an order paid by another runner of the same purchase (a stale
//! runner must stop, fenced out, and refund nothing) from a cancelled one (whose charge is
//! refunded). Found by `faults` db-restart: a runner stalled past its lease refunded the charge of
//! an order the resumer had paid.

use shop::{
    db,
    providers::Charge,
    purchase::{ensure_user, insert_order, mark_paid, OrderGone, PaidByAnother, PurchaseRequest},
};

#[tokio::test]
async fn step_c_tells_paid_by_another_from_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("shop.db").display());
    let (shop, _providers) = db::connect(&url, 4).await.unwrap();
    shop.migrate().await.unwrap();
    let request = PurchaseRequest {
        user: "alice".into(),
        sku: "tea".into(),
        quantity: 1,
    };
    let charge = Charge {
        charge_id: "ch_test".into(),
        amount_cents: 450,
    };
    for (status, paid_by_another) in [("paid", true), ("cancelled", false)] {
        let mut tx = shop.begin().await.unwrap();
        ensure_user(&mut tx.conn(), "alice").await.unwrap();
        let order = insert_order(&mut tx.conn(), "alice", "tea", 1, 450, status)
            .await
            .unwrap();
        let refused = mark_paid(tx.conn(), &request, order, 450, &charge, false)
            .await
            .expect_err("the order is not awaiting payment");
        assert_eq!(refused.is::<PaidByAnother>(), paid_by_another, "{status}");
        assert_eq!(refused.is::<OrderGone>(), !paid_by_another, "{status}");
        tx.rollback().await.unwrap();
    }
}
