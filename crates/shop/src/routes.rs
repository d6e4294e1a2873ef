//! The handlers. Each shows one defence of the article:
//!
//! | route | defence |
//! |---|---|
//! | `POST /purchases` | Idempotency-Key (reserve first), business rows + stored response in one transaction, our key passed on to the idempotent payment provider, a definitive refusal stored and replayed |
//! | `POST /orders` | Idempotency-Key (local work only) |
//! | `POST /orders/{id}/pay` | guarded state transition: `UPDATE … WHERE status = 'unpaid'` |
//! | `POST /points/grants` | business unique constraint: one grant per order |
//! | `POST /emails` | Idempotency-Key on a provider *without* idempotency: an unknown outcome parks the key as *needs review* |

use crate::{
    auth::UserId,
    db::{sql, StoreConn},
    problem::{Disposition, JsonBody, Problem, ShopProblem},
    providers::ProviderError,
    purchase::{
        debit, ensure_user, insert_order, mark_paid, place_order, price, Placed, Purchase,
        PurchaseRequest, START_BALANCE_CENTS,
    },
    state::{App, Engine},
    tx::{no_tx, BusinessTx, HeldKey},
};
use axum::{
    extract::{rejection::PathRejection, Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    Extension, Json,
};
use idempotency::{
    durable::{Finished, PerformError},
    Idempotency, IdempotencyKey,
};
use idempotency_http::{KeyLease, StoredResponse};
use serde::Deserialize;
use serde_json::{json, Value};

pub use crate::purchase::{CATALOG, MAX_QUANTITY};

type Answer = Result<(StatusCode, Json<Value>), Problem>;

/// Body of `POST /purchases` and `POST /orders`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderRequest {
    /// A SKU from [`CATALOG`].
    pub sku: String,
    /// 1 to [`MAX_QUANTITY`].
    pub quantity: i64,
}

impl OrderRequest {
    /// The amount, or why the request is unacceptable (422).
    fn amount_cents(&self) -> Result<i64, Problem> {
        price(&self.sku, self.quantity)
    }
}

fn path_problem(rejection: PathRejection) -> Problem {
    Problem::bad_request("invalid-path", "Invalid path", rejection.body_text())
}

fn db(error: sqlx::Error) -> Problem {
    Problem::database(&error)
}

/// 402 with the balance, for a debit the balance does not cover.
fn insufficient(amount: i64, balance: i64) -> Problem {
    Problem::shop(
        StatusCode::PAYMENT_REQUIRED,
        "insufficient-balance",
        "Insufficient balance",
        format!("this costs {amount} cents but the balance is {balance} cents"),
    )
    .with_extension("amount_cents", amount)
    .with_extension("balance_cents", balance)
}

fn payment_problem(error: ProviderError) -> Problem {
    match error {
        ProviderError::Storage(e) => Problem::database(&e),
        other => Problem::shop(
            StatusCode::BAD_GATEWAY,
            "payment-provider",
            "Payment provider failed",
            format!("{other}; nothing was kept here, and the provider keeps charges by our key, so retrying with the same Idempotency-Key cannot charge twice"),
        )
        .with_retry_after(std::time::Duration::from_secs(1)),
    }
}

/// `POST /purchases`: the durable [`Purchase`](crate::purchase::Purchase) operation, under the
/// key the layer reserved (see [`crate::purchase`]). An unacceptable line is refused (422) before
/// the lease is taken, so the layer releases the key.
pub async fn purchase(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    held: HeldKey,
    JsonBody(request): JsonBody<OrderRequest>,
) -> Response {
    if let Err(problem) = request.amount_cents() {
        return problem.into_response();
    }
    let request = PurchaseRequest {
        user: user.0,
        sku: request.sku,
        quantity: request.quantity,
    };
    let performed = match (held, app.engine()) {
        (HeldKey::Pg(lease), Engine::Pg(engine)) => {
            perform(engine, app.purchase(), lease, &request).await
        }
        (HeldKey::Sqlite(lease), Engine::Sqlite(engine)) => {
            perform(engine, app.purchase(), lease, &request).await
        }
        (HeldKey::My(lease), Engine::My(engine)) => {
            perform(engine, app.purchase(), lease, &request).await
        }
        _ => Err(PerformError::LeaseLost),
    };
    match performed {
        Ok(stored) => stored.into_response(),
        Err(error) => perform_problem(error).into_response(),
    }
}

async fn perform<S: StoreConn>(
    engine: &Idempotency<S>,
    operation: &Purchase,
    held: KeyLease<S>,
    request: &PurchaseRequest,
) -> Result<StoredResponse, PerformError> {
    let lease = held.take().ok_or(PerformError::LeaseLost)?;
    engine
        .perform_reserved(operation, lease, request)
        .await
        .map(Finished::into_response)
}

/// The answer to a purchase that did not settle in this request.
fn perform_problem(error: PerformError) -> Problem {
    match error {
        PerformError::Pending { retry_after, reason } => Problem::shop(
            StatusCode::SERVICE_UNAVAILABLE,
            "purchase-pending",
            "Purchase pending",
            format!("{reason}; the purchase is carried on in the background. Retry with the same Idempotency-Key: 409 until it settles, then its answer"),
        )
        .with_retry_after(retry_after),
        PerformError::Parked { reason } => Problem::shop(
            StatusCode::CONFLICT,
            "needs-review",
            "Needs review",
            format!("{reason}; an operator settles this purchase"),
        ),
        PerformError::LeaseLost => Problem::shop(
            StatusCode::CONFLICT,
            "in-progress",
            "In progress",
            "another worker carries this purchase on; retry with the same Idempotency-Key",
        )
        .with_retry_after(std::time::Duration::from_secs(1)),
        PerformError::Released(error) if error.is_unavailable() => Problem::shop(
            StatusCode::SERVICE_UNAVAILABLE,
            "database",
            "Database unavailable",
            "nothing was kept; retry with the same Idempotency-Key",
        )
        .with_retry_after(std::time::Duration::from_secs(1)),
        PerformError::Interrupted(e) => {
            tracing::warn!(error = %e, "purchase interrupted; the worker resumes it");
            Problem::shop(
                StatusCode::SERVICE_UNAVAILABLE,
                "purchase-interrupted",
                "Purchase interrupted",
                "the purchase stopped half-way and is resumed in the background; retry with the same Idempotency-Key",
            )
            .with_retry_after(std::time::Duration::from_secs(1))
        }
        other => {
            tracing::error!(error = %other, "purchase failed");
            Problem::shop(
                StatusCode::INTERNAL_SERVER_ERROR,
                "purchase-failed",
                "Purchase failed",
                "nothing was kept; retry with the same Idempotency-Key",
            )
        }
    }
}

/// `POST /unprotected/purchases` (benchmark only): the same steps and the same provider without
/// any key: the order, the charge (with a random key), then paid, in two transactions.
pub async fn purchase_unprotected(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    JsonBody(request): JsonBody<OrderRequest>,
) -> Answer {
    let amount = request.amount_cents()?;
    let request = PurchaseRequest {
        user: user.0,
        sku: request.sku,
        quantity: request.quantity,
    };
    let mut tx = app.db().begin().await.map_err(db)?;
    let placed = place_order(tx.conn(), &request, amount).await.map_err(db)?;
    let order = match placed {
        Placed::Order(order) => order,
        Placed::Refused { balance } => return Err(insufficient(amount, balance)),
    };
    tx.commit().await.map_err(db)?;
    let key = format!("unprotected:{}", uuid::Uuid::new_v4());
    let charge = app
        .payment()
        .charge(&key, &request.user, amount)
        .await
        .map_err(payment_problem)?;
    let mut tx = app.db().begin().await.map_err(db)?;
    let body = mark_paid(tx.conn(), &request, order, amount, &charge, false)
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "unprotected purchase");
            no_tx()
        })?;
    tx.commit().await.map_err(db)?;
    Ok((StatusCode::CREATED, Json(body)))
}

/// `POST /orders`: creates an unpaid order (keyed, local work only).
pub async fn create_order(
    Extension(user): Extension<UserId>,
    mut tx: BusinessTx,
    JsonBody(request): JsonBody<OrderRequest>,
) -> Answer {
    let amount = request.amount_cents()?;
    let mut conn = tx.conn();
    ensure_user(&mut conn, &user.0).await.map_err(db)?;
    let order_id = insert_order(
        &mut conn,
        &user.0,
        &request.sku,
        request.quantity,
        amount,
        "unpaid",
    )
    .await
    .map_err(db)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "order_id": order_id,
            "sku": request.sku,
            "quantity": request.quantity,
            "amount_cents": amount,
            "status": "unpaid",
        })),
    ))
}

type OrderRow = (i64, String, i64, i64, String, Option<String>);

fn order_json(row: OrderRow) -> Value {
    let (id, sku, quantity, amount, status, charge_id) = row;
    json!({"order_id": id, "sku": sku, "quantity": quantity, "amount_cents": amount, "status": status, "charge_id": charge_id})
}

/// `GET /orders/{id}`: a plain indexed read (the benchmark's baseline for replays).
pub async fn get_order(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    id: Result<Path<i64>, PathRejection>,
) -> Answer {
    let Path(id) = id.map_err(path_problem)?;
    let mut conn = app.db().read().await.map_err(|e| Problem::database(&e))?;
    let row: Option<OrderRow> = conn
        .conn()
        .fetch_optional(
            sql(
                "SELECT id, sku, quantity, amount_cents, status, charge_id FROM shop_orders
                 WHERE id = $1 AND user_id = $2",
            )
            .bind(id)
            .bind(&user.0),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    match row {
        Some(row) => Ok((StatusCode::OK, Json(order_json(row)))),
        None => Err(Problem::not_found(format!("you have no order {id}"))),
    }
}

/// `POST /orders/{id}/pay`: the guarded transition `unpaid → paid`. The conditional UPDATE is
/// the last line of defence: of two concurrent calls exactly one finds the order unpaid; the
/// other answers `"already_paid": true` and charges nothing.
pub async fn pay_order(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    id: Result<Path<i64>, PathRejection>,
    mut tx: BusinessTx,
) -> Answer {
    let Path(id) = id.map_err(path_problem)?;
    // UPDATE, then SELECT (no UPDATE … RETURNING on MariaDB): the row stays locked between them.
    let paid = tx
        .conn()
        .execute(
            sql("UPDATE shop_orders SET status = 'paid'
                 WHERE id = $1 AND user_id = $2 AND status = 'unpaid'")
            .bind(id)
            .bind(&user.0),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    if paid != 1 {
        let existing: Option<OrderRow> = tx
            .conn()
            .fetch_optional(
                sql(
                    "SELECT id, sku, quantity, amount_cents, status, charge_id FROM shop_orders
                     WHERE id = $1 AND user_id = $2",
                )
                .bind(id)
                .bind(&user.0),
            )
            .await
            .map_err(|e| Problem::database(&e))?;
        let Some(existing) = existing else {
            return Err(Problem::not_found(format!("you have no order {id}")));
        };
        let mut body = order_json(existing);
        body["already_paid"] = json!(true);
        return Ok((StatusCode::OK, Json(body)));
    }
    let amount: i64 = tx
        .conn()
        .scalar(sql("SELECT amount_cents FROM shop_orders WHERE id = $1").bind(id))
        .await
        .map_err(db)?;
    if let Err(balance) = debit(&mut tx.conn(), &user.0, amount).await.map_err(db)? {
        return Err(insufficient(amount, balance));
    }
    // The order id names the payment: a retry after a failure charges the same charge.
    let charge = app
        .payment()
        .charge(&format!("shop:order-pay:{id}"), &user.0, amount)
        .await
        .map_err(payment_problem)?;
    tx.conn()
        .execute(
            sql("UPDATE shop_orders SET charge_id = $2 WHERE id = $1")
                .bind(id)
                .bind(&charge.charge_id),
        )
        .await
        .map_err(db)?;
    let row: OrderRow = tx
        .conn()
        .fetch_one(
            sql(
                "SELECT id, sku, quantity, amount_cents, status, charge_id FROM shop_orders
                 WHERE id = $1",
            )
            .bind(id),
        )
        .await
        .map_err(db)?;
    let mut body = order_json(row);
    body["already_paid"] = json!(false);
    Ok((StatusCode::OK, Json(body)))
}

/// Body of `POST /points/grants`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    /// A paid order of the user.
    pub order_id: i64,
    /// 1 to 100 000 points.
    pub points: i64,
}

/// `POST /points/grants`: one grant per order, enforced by a unique constraint on `order_id`
/// (`INSERT … ON CONFLICT DO NOTHING`); a duplicate answers 200 with the existing grant.
pub async fn grant_points(
    Extension(user): Extension<UserId>,
    mut tx: BusinessTx,
    JsonBody(request): JsonBody<GrantRequest>,
) -> Answer {
    if !(1..=100_000).contains(&request.points) {
        return Err(Problem::unprocessable(
            "invalid-points",
            "Invalid points",
            format!(
                "points must be between 1 and 100000, not {}",
                request.points
            ),
        ));
    }
    let status: Option<String> = tx
        .conn()
        .scalar_optional(
            sql("SELECT status FROM shop_orders WHERE id = $1 AND user_id = $2")
                .bind(request.order_id)
                .bind(&user.0),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    match status.as_deref() {
        None => {
            return Err(Problem::not_found(format!(
                "you have no order {}",
                request.order_id
            )))
        }
        Some("paid") => {}
        Some(_) => {
            return Err(Problem::unprocessable(
                "order-unpaid",
                "Order not paid",
                format!(
                    "order {} is not paid; points are granted for paid orders",
                    request.order_id
                ),
            ))
        }
    }
    let inserted: Option<i64> = tx
        .conn()
        .scalar_optional(
            sql(
                "INSERT INTO shop_point_grants (order_id, user_id, points) VALUES ($1, $2, $3)
                 ON CONFLICT (order_id) DO NOTHING RETURNING id",
            )
            .on_mysql(
                "INSERT IGNORE INTO shop_point_grants (order_id, user_id, points)
                 VALUES ($1, $2, $3) RETURNING id",
            )
            .bind(request.order_id)
            .bind(&user.0)
            .bind(request.points),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    if let Some(grant_id) = inserted {
        return Ok((
            StatusCode::CREATED,
            Json(
                json!({"grant_id": grant_id, "order_id": request.order_id, "points": request.points, "duplicate": false}),
            ),
        ));
    }
    let (grant_id, points): (i64, i64) = tx
        .conn()
        .fetch_one(
            sql("SELECT id, points FROM shop_point_grants WHERE order_id = $1")
                .bind(request.order_id),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    Ok((
        StatusCode::OK,
        Json(
            json!({"grant_id": grant_id, "order_id": request.order_id, "points": points, "duplicate": true}),
        ),
    ))
}

/// Body of `POST /emails`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmailRequest {
    /// Recipient address.
    pub to: String,
    /// Subject line (at most 200 bytes).
    pub subject: String,
    /// Text (at most 8 KiB).
    #[serde(default)]
    pub body: String,
}

/// `POST /emails`: sends through the mail provider, which has no idempotency support. When the
/// call fails the message may have gone out, so the key is **parked** as *needs review* instead
/// of released: a retry answers 409 instead of sending again. A request refused before the call
/// (an invalid recipient or message) releases its key: nothing was sent, and the route's
/// default for an unstored answer (keep the key pending for the recovery job, which would park
/// it) is for answers after the call.
pub async fn send_email(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    Extension(key): Extension<IdempotencyKey>,
    mut tx: BusinessTx,
    JsonBody(request): JsonBody<EmailRequest>,
) -> Answer {
    let to = request.to.trim();
    if to.len() > 254 || !to.contains('@') || to.starts_with('@') || to.ends_with('@') {
        return Err(Problem::unprocessable(
            "invalid-recipient",
            "Invalid recipient",
            format!("{to:?} is not an e-mail address"),
        )
        .with_disposition(Disposition::Release));
    }
    if request.subject.is_empty() || request.subject.len() > 200 || request.body.len() > 8192 {
        return Err(Problem::unprocessable(
            "invalid-message",
            "Invalid message",
            "the subject needs 1 to 200 bytes and the body at most 8192",
        )
        .with_disposition(Disposition::Release));
    }
    let message_id = match app
        .mail()
        .send(&user.0, to, &request.subject, &key.to_string())
        .await
    {
        Ok(id) => id,
        Err(ProviderError::Storage(e)) => return Err(Problem::database(&e)),
        Err(e) => {
            return Err(Problem::shop(
                StatusCode::BAD_GATEWAY,
                "mail-outcome-unknown",
                "Mail outcome unknown",
                format!("{e}; the mail provider cannot deduplicate, so this key is parked for review instead of being retried"),
            )
            .with_disposition(Disposition::Park(format!("mail provider: {e}"))))
        }
    };
    let email_id: i64 = tx
        .conn()
        .scalar(
            sql("INSERT INTO shop_emails (user_id, recipient, subject,
                 message_id) VALUES ($1, $2, $3, $4) RETURNING id")
            .bind(&user.0)
            .bind(to)
            .bind(&request.subject)
            .bind(&message_id),
        )
        .await
        .map_err(|e| Problem::database(&e))?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"email_id": email_id, "message_id": message_id, "status": "sent"})),
    ))
}

// The ledger's reads, each of one user's rows. Every one must find them through an index: a
// scan grows with the tables, and on SQLite each scan fills a connection's page cache (the shop's
// memory grew with the e-mail table until `shop_emails (user_id)` was indexed).
// `tests::every_ledger_read_searches_an_index` checks SQLite's plans.
const LEDGER_BALANCE: &str = "SELECT balance_cents FROM shop_users WHERE id = $1";
const LEDGER_ORDERS: &str = "SELECT id, sku, quantity, amount_cents, status, charge_id
     FROM shop_orders WHERE user_id = $1 ORDER BY id";
const LEDGER_POINTS: &str = "SELECT CAST(COALESCE(SUM(points), 0) AS BIGINT), COUNT(*)
     FROM shop_point_grants WHERE user_id = $1";
const LEDGER_POINTS_MYSQL: &str = "SELECT CAST(COALESCE(SUM(points), 0) AS SIGNED), COUNT(*)
     FROM shop_point_grants WHERE user_id = $1";
const LEDGER_EMAILS: &str = "SELECT COUNT(*) FROM shop_emails WHERE user_id = $1";
const LEDGER_CHARGES: &str = "SELECT charge_id, amount_cents FROM payment_provider_charges
     WHERE account = $1 ORDER BY charge_id";
const LEDGER_MAILS: &str = "SELECT COUNT(*) FROM mail_provider_messages WHERE account = $1";

/// `GET /users/{id}/ledger`: the user's money, points and mail, read straight from the tables
/// (the shop's and the providers'), for checking invariants.
pub async fn ledger(
    State(app): State<App>,
    Extension(user): Extension<UserId>,
    id: Result<Path<String>, PathRejection>,
) -> Answer {
    let Path(id) = id.map_err(path_problem)?;
    if id != user.0 {
        return Err(Problem::shop(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Forbidden",
            "you may only read your own ledger",
        ));
    }
    let db = |e: sqlx::Error| Problem::database(&e);
    let mut conn = app.db().read().await.map_err(db)?;
    let (balance, orders, points, grants, recorded) = {
        let mut c = conn.conn();
        let balance: Option<i64> = c
            .scalar_optional(sql(LEDGER_BALANCE).bind(&id))
            .await
            .map_err(db)?;
        let orders: Vec<OrderRow> = c
            .fetch_all(sql(LEDGER_ORDERS).bind(&id))
            .await
            .map_err(db)?;
        let (points, grants): (i64, i64) = c
            .fetch_one(sql(LEDGER_POINTS).on_mysql(LEDGER_POINTS_MYSQL).bind(&id))
            .await
            .map_err(db)?;
        let recorded: i64 = c.scalar(sql(LEDGER_EMAILS).bind(&id)).await.map_err(db)?;
        (balance, orders, points, grants, recorded)
    };
    drop(conn);
    let mut conn = app.providers().conn().await.map_err(db)?;
    let (charges, sent) = {
        let mut c = conn.conn();
        let charges: Vec<(String, i64)> = c
            .fetch_all(sql(LEDGER_CHARGES).bind(&id))
            .await
            .map_err(db)?;
        let sent: i64 = c.scalar(sql(LEDGER_MAILS).bind(&id)).await.map_err(db)?;
        (charges, sent)
    };
    let charged_total: i64 = charges.iter().map(|(_, amount)| amount).sum();
    let paid_total: i64 = orders.iter().filter(|o| o.4 == "paid").map(|o| o.3).sum();
    Ok((
        StatusCode::OK,
        Json(json!({
            "user_id": id,
            "start_balance_cents": START_BALANCE_CENTS,
            "balance_cents": balance.unwrap_or(START_BALANCE_CENTS),
            "charges": charges.iter().map(|(id, amount)| json!({"charge_id": id, "amount_cents": amount})).collect::<Vec<_>>(),
            "charged_total_cents": charged_total,
            "paid_orders_total_cents": paid_total,
            "orders": orders.into_iter().map(order_json).collect::<Vec<_>>(),
            "points_total": points,
            "point_grants": grants,
            "emails_sent": sent,
            "emails_recorded": recorded,
        })),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite's plan of each ledger read on freshly migrated files: a `SEARCH` through an index
    /// (or the primary key), never a `SCAN` of a table.
    #[tokio::test]
    async fn every_ledger_read_searches_an_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shop.db");
        let url = format!("sqlite://{}", path.display());
        let (shop, providers) = crate::db::connect(&url, 2).await.unwrap();
        shop.migrate().await.unwrap();
        providers.migrate().await.unwrap();
        let files = [
            (
                path.clone(),
                vec![LEDGER_BALANCE, LEDGER_ORDERS, LEDGER_POINTS, LEDGER_EMAILS],
            ),
            (
                dir.path().join("shop.db.providers"),
                vec![LEDGER_CHARGES, LEDGER_MAILS],
            ),
        ];
        for (file, reads) in files {
            let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", file.display()))
                .await
                .unwrap();
            for read in reads {
                let plan = explain(&pool, read).await;
                assert!(
                    plan.iter().any(|step| step.starts_with("SEARCH")),
                    "{read}: {plan:?}"
                );
                assert!(
                    !plan.iter().any(|step| step.starts_with("SCAN")),
                    "{read} scans a table: {plan:?}"
                );
            }
        }
    }

    /// The `detail` column of `EXPLAIN QUERY PLAN`.
    async fn explain(pool: &sqlx::SqlitePool, read: &str) -> Vec<String> {
        use sqlx::Row;
        sqlx::query(&format!("EXPLAIN QUERY PLAN {read}"))
            .fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>("detail"))
            .collect()
    }
}
