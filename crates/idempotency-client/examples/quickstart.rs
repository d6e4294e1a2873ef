//! The client and the server side by side, in one process: an `idempotency-http` layer on a
//! temporary SQLite file in front of a handler that fails its first call with a 503 and takes
//! 50 ms, and the middleware sending to it.
//!
//! ```sh
//! cargo run -p idempotency-client --example quickstart
//! ```
//!
//! It shows one key reused across a retry (503, then 201), a double click answered twice with
//! 201 (the second a replay, thanks to `wait_for_in_flight`), the outcome of each operation, and
//! the 422 key-reused as a typed error.

use axum::{http::StatusCode, response::IntoResponse, routing::post, Json, Router};
use idempotency::{Idempotency, SqliteStore, Store};
use idempotency_client::{
    IdempotencyError, IdempotencyMiddleware, Outcome, RequestKey, RetryPolicy,
};
use idempotency_http::{IdempotencyLayer, MissingScope};
use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

fn show(label: &str, status: StatusCode, outcome: &Outcome) {
    let attempts: Vec<String> = outcome
        .attempts
        .iter()
        .map(|a| match a.result.status() {
            Some(status) => format!(
                "{}{}",
                status.as_u16(),
                if a.replayed { " (replay)" } else { "" }
            ),
            None => "transport error".into(),
        })
        .collect();
    println!(
        "{label}: {status}, key {}, attempts [{}], replayed {}, {:.0} ms",
        outcome.key.as_deref().unwrap_or("-"),
        attempts.join(", "),
        outcome.replayed,
        outcome.elapsed.as_secs_f64() * 1000.0
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server: the first call answers 503 (the key is released), later ones take 50 ms.
    let dir = std::env::temp_dir().join(format!("quickstart-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir)?;
    let store = SqliteStore::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("keys.db").display()
    ))
    .await?;
    store.migrate().await?;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let handler = move || {
        let counter = counter.clone();
        async move {
            let call = counter.fetch_add(1, Ordering::SeqCst) + 1;
            if call == 1 {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [("retry-after", "1")],
                    "warming up",
                )
                    .into_response();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            (
                StatusCode::CREATED,
                Json(serde_json::json!({ "transfer": call })),
            )
                .into_response()
        }
    };
    let layer = IdempotencyLayer::new(Idempotency::new(store))
        .with_missing_scope(MissingScope::Fixed("demo".into()))
        .with_wait_for_in_flight(Duration::from_secs(2));
    let app = Router::new().route("/transfers", post(handler).route_layer(layer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/transfers", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The client.
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new()
                .with_policy(RetryPolicy::default().with_deadline(Duration::from_secs(10))),
        )
        .build();

    // 1. A 503 with Retry-After: 1, then the 201, under one key.
    let response = client
        .post(&url)
        .json(&serde_json::json!({"amount": 5}))
        .send()
        .await?;
    show(
        "retried",
        response.status(),
        Outcome::of(&response).expect("an outcome"),
    );

    // 2. A double click: two sends of one operation (one key) at once; the server holds the
    //    second until the first is done and replays it.
    let key = RequestKey::Use(uuid::Uuid::now_v7().to_string());
    let click = || {
        client
            .post(&url)
            .json(&serde_json::json!({"amount": 7}))
            .with_extension(key.clone())
            .send()
    };
    let (first, second) = tokio::join!(click(), click());
    for (label, response) in [("click 1", first?), ("click 2", second?)] {
        show(
            label,
            response.status(),
            Outcome::of(&response).expect("an outcome"),
        );
    }

    // 3. The same key with another body: 422 key-reused, as a typed error.
    let reused = client
        .post(&url)
        .json(&serde_json::json!({"amount": 8}))
        .with_extension(key)
        .send()
        .await;
    match reused.as_ref().map_err(IdempotencyError::from_error) {
        Err(Some(error @ IdempotencyError::KeyReused { .. })) => println!("reused: {error}"),
        other => println!("reused: unexpected {other:?}"),
    }
    println!(
        "the handler ran {} times: the 503, the retried transfer, and the double-clicked one once; the reused key never reached it",
        calls.load(Ordering::SeqCst)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
