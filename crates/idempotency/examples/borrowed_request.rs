//! The work of `Idempotency::run` as an async closure that borrows the request: the caller owns
//! the order, the closure only reads it by reference (no clone, no `move`, no `Box::pin`). The
//! same purchase is sent twice; the second call replays the stored result and the work does not
//! run again (the example exits non-zero if it did). Runs on a SQLite file in a temporary folder.
//!
//! ```text
//! cargo run -p idempotency --features sqlite --example borrowed_request
//! ```

use idempotency::{Attempt, Fingerprint, Idempotency, IdempotencyKey, SqliteStore, Store};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The request, owned by the caller.
#[derive(serde::Serialize)]
struct Order {
    user: String,
    sku: String,
    quantity: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("shop.db").display());
    let store = SqliteStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, user TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    let idem = Idempotency::new(store.clone());

    let order = Order {
        user: "user-42".into(),
        sku: "tea".into(),
        quantity: 2,
    };
    let attempt = Attempt::new(
        IdempotencyKey::new(&order.user, "purchase", "borrowed-request-1")?,
        Fingerprint::of_json(&order)?,
    );
    let runs = AtomicUsize::new(0);

    // The work borrows `order` and `runs`; both outlive the call.
    let place = async || {
        idem.run(&attempt, async |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO orders (user, sku, quantity) VALUES (?, ?, ?) RETURNING id",
            )
            .bind(&order.user)
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut **tx)
            .await?;
            Ok::<_, sqlx::Error>(serde_json::json!({"order_id": id, "sku": &order.sku}))
        })
        .await
    };

    let first = place().await?;
    println!(
        "first call:  replayed = {}, {}",
        first.is_replayed(),
        first.value()
    );
    let replay = place().await?;
    println!(
        "replay:      replayed = {}, {}",
        replay.is_replayed(),
        replay.value()
    );

    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(store.pool())
        .await?;
    let runs = runs.load(Ordering::SeqCst);
    println!("work ran {runs} time(s); orders in the database: {orders}");
    if first.is_replayed() || !replay.is_replayed() || runs != 1 || orders != 1 {
        eprintln!("borrowed_request: the replay ran the work again, or did not replay");
        std::process::exit(1);
    }
    if first.value() != replay.value() {
        eprintln!("borrowed_request: the replay answered something else");
        std::process::exit(1);
    }
    Ok(())
}
