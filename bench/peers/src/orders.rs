//! The business operation every system serves: insert one order row, sleep 5 ms, answer 201.

use axum::{
    Json,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use sqlx::{PgExecutor, PgPool};
use std::{sync::Arc, time::Duration};

/// How long the handler works after its insert.
const WORK: Duration = Duration::from_millis(5);

/// The request body: `request_id` is unique per logical request (the racers count by it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    pub request_id: String,
    pub item: String,
}

/// One system's order table (`peers_<system>_orders`) and the pool that writes it.
#[derive(Clone)]
pub struct Orders {
    pub pool: PgPool,
    table: Arc<str>,
    insert: Arc<str>,
}

impl Orders {
    /// Creates (or empties) the table.
    pub async fn create(pool: PgPool, table: &str) -> sqlx::Result<Self> {
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {table} (id BIGSERIAL PRIMARY KEY, request_id TEXT NOT NULL, body TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS {table}_request_id ON {table} (request_id);
             TRUNCATE {table};"
        );
        sqlx::raw_sql(&create).execute(&pool).await?;
        Ok(Self {
            pool,
            insert: format!("INSERT INTO {table} (request_id, body) VALUES ($1, $2) RETURNING id")
                .into(),
            table: table.into(),
        })
    }

    /// Inserts the order through `executor` (the pool, or a transaction).
    pub async fn insert<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        order: &Order,
    ) -> sqlx::Result<i64> {
        sqlx::query_scalar(&self.insert)
            .bind(&order.request_id)
            .bind(&order.item)
            .fetch_one(executor)
            .await
    }

    /// All rows.
    pub async fn count(&self) -> sqlx::Result<i64> {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}", self.table))
            .fetch_one(&self.pool)
            .await
    }

    /// Rows written for one request.
    pub async fn count_request(&self, request_id: &str) -> sqlx::Result<i64> {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE request_id = $1",
            self.table
        ))
        .bind(request_id)
        .fetch_one(&self.pool)
        .await
    }
}

/// The rest of the handler once the row is written: the work, then 201.
pub async fn finish(inserted: sqlx::Result<i64>, order: &Order) -> Response {
    let id = match inserted {
        Ok(id) => id,
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    tokio::time::sleep(WORK).await;
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "id": id, "request_id": order.request_id })),
    )
        .into_response()
}

/// The handler writing through the pool (the baseline and the peers).
pub async fn create_order(State(orders): State<Orders>, Json(order): Json<Order>) -> Response {
    let inserted = orders.insert(&orders.pool, &order).await;
    finish(inserted, &order).await
}
