//! Ten concurrent copies of one purchase (a double click, a retry storm): one runs, the others
//! are told "in progress" or get the stored result. Runs on a SQLite file in a temporary folder.
//!
//! ```text
//! cargo run -p idempotency --example double_click
//! ```

use idempotency::{
    Attempt, Error, Fingerprint, Idempotency, IdempotencyKey, Outcome, SqliteStore, Store,
};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("shop.db").display()
    ))
    .await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE charges (id INTEGER PRIMARY KEY, amount_cents INTEGER NOT NULL)")
        .execute(store.pool())
        .await?;
    let idem = Idempotency::new(store.clone());

    let request = serde_json::json!({"sku": "tea", "quantity": 2});
    let attempt = Attempt::new(
        IdempotencyKey::new("user-42", "purchase", "2f1c7d5e-double-click")?,
        Fingerprint::of_json(&request)?,
    );
    let clicks: Vec<_> = (0..10)
        .map(|click| {
            let (idem, attempt) = (idem.clone(), attempt.clone());
            tokio::spawn(async move {
                let outcome = idem
                    .run(&attempt, async |tx| {
                        tokio::time::sleep(Duration::from_millis(50)).await; // the payment call
                        let id: i64 = sqlx::query_scalar(
                            "INSERT INTO charges (amount_cents) VALUES (700) RETURNING id",
                        )
                        .fetch_one(&mut **tx)
                        .await?;
                        Ok::<_, sqlx::Error>(
                            serde_json::json!({"charge_id": id, "amount_cents": 700}),
                        )
                    })
                    .await;
                (click, outcome)
            })
        })
        .collect();
    for click in clicks {
        let (n, outcome) = click.await?;
        match outcome {
            Ok(Outcome::Executed(result)) => println!("click {n}: executed  {result}"),
            Ok(Outcome::Replayed(result)) => println!("click {n}: replayed  {result}"),
            Err(Error::InProgress { retry_after }) => {
                println!("click {n}: 409 in progress, retry after {retry_after:?}")
            }
            Err(other) => println!("click {n}: error {other}"),
        }
    }
    let again = idem
        .run(&attempt, async |_tx| {
            Ok::<_, sqlx::Error>(serde_json::json!("never runs"))
        })
        .await?;
    println!(
        "a later retry: replayed = {}, {}",
        again.is_replayed(),
        again.value()
    );
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(store.pool())
        .await?;
    println!("charges in the database: {charges}");
    assert_eq!(charges, 1);
    Ok(())
}
