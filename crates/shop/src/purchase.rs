//! `POST /purchases` as a **durable operation** ([`Purchase`]): three steps, each a recovery point
//! committed with the key, so that a purchase whose client went away (or whose process died) is
//! carried to its end by the shop's maintenance worker, never left charged without an order.
//!
//! 1. **order** (local): create the user if new, debit the balance (a conditional UPDATE) and
//!    insert the order in `pending_payment`. A balance too low is a definitive 402, stored.
//! 2. **charge** (outside): charge the payment provider with a key derived from ours
//!    ([`idempotency::durable::provider_key`]). A lost answer is settled by asking the provider with
//!    the same key ([`PaymentProvider::lookup`]).
//! 3. **finish** (local): mark the order `paid` (guarded: only from `pending_payment`), record the
//!    purchase, and complete the key with the 201 response, in one transaction.
//!
//! A payment that did not happen (the provider says *not done* after the step's calls, or
//! declines) settles the purchase as **failed**: the debit is given back and the order cancelled,
//! with a definitive 502 stored and replayed. If the order was cancelled meanwhile after the
//! charge, the charge is refunded ([`PaymentProvider::refund`]) before the purchase settles as
//! failed.

use crate::{
    db::{sql, Conn, StoreConn},
    problem::{Problem, ShopProblem},
    providers::{Charge, PaymentProvider, ProviderError},
};
use axum::http::StatusCode;
use idempotency::durable::{CallError, Finished, Lookup, Operation, StepError, Steps};
use idempotency_http::StoredResponse;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Every user's balance before their first purchase.
pub const START_BALANCE_CENTS: i64 = 100_000;

/// What the shop sells: `(sku, price in cents)`.
pub const CATALOG: &[(&str, i64)] = &[("tea", 450), ("coffee", 380), ("mug", 1_200), ("pencil", 1)];

/// Largest quantity of one line.
pub const MAX_QUANTITY: i64 = 100;

/// The price of `quantity` × `sku`, or why the line is unacceptable (422).
///
/// ```
/// assert_eq!(shop::purchase::price("tea", 2).unwrap(), 900);
/// assert_eq!(shop::purchase::price("tea", 0).unwrap_err().status(), 422);
/// ```
pub fn price(sku: &str, quantity: i64) -> Result<i64, Problem> {
    let Some(&(_, unit)) = CATALOG.iter().find(|(known, _)| *known == sku) else {
        let known: Vec<&str> = CATALOG.iter().map(|(sku, _)| *sku).collect();
        return Err(Problem::unprocessable(
            "unknown-sku",
            "Unknown SKU",
            format!(
                "there is no product {sku:?}; known SKUs: {}",
                known.join(", ")
            ),
        ));
    };
    if !(1..=MAX_QUANTITY).contains(&quantity) {
        return Err(Problem::unprocessable(
            "invalid-quantity",
            "Invalid quantity",
            format!("quantity must be between 1 and {MAX_QUANTITY}, not {quantity}"),
        ));
    }
    Ok(unit * quantity)
}

/// A purchase as stored with its key: who buys what (the resumer needs no client).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurchaseRequest {
    /// The buyer.
    pub user: String,
    /// A SKU from [`CATALOG`].
    pub sku: String,
    /// 1 to [`MAX_QUANTITY`].
    pub quantity: i64,
}

/// What step 1 did.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum Placed {
    /// The order, debited and awaiting payment.
    Order(i64),
    /// The balance did not cover the amount: nothing was written.
    Refused {
        /// The balance at the time.
        balance: i64,
    },
}

/// Creates the user with the start balance if it is new.
pub async fn ensure_user(conn: &mut Conn<'_>, user: &str) -> Result<(), sqlx::Error> {
    conn.execute(
        sql("INSERT INTO shop_users (id, balance_cents) VALUES ($1, $2)
             ON CONFLICT (id) DO NOTHING")
        // Not INSERT IGNORE: its shared lock on an existing row, upgraded by the debit that
        // follows, deadlocks two purchases of one user; this takes the exclusive lock at once.
        .on_mysql(
            "INSERT INTO shop_users (id, balance_cents) VALUES ($1, $2)
             ON DUPLICATE KEY UPDATE id = id",
        )
        .bind(user)
        .bind(START_BALANCE_CENTS),
    )
    .await?;
    Ok(())
}

/// Takes `amount` from the balance only if it covers it (a conditional UPDATE, so two concurrent
/// debits can never overdraw). `Err(balance)` when it does not.
pub async fn debit(
    conn: &mut Conn<'_>,
    user: &str,
    amount: i64,
) -> Result<Result<(), i64>, sqlx::Error> {
    let debited = conn
        .execute(
            sql("UPDATE shop_users SET balance_cents = balance_cents - $2
                 WHERE id = $1 AND balance_cents >= $2")
            .bind(user)
            .bind(amount),
        )
        .await?;
    if debited == 1 {
        return Ok(Ok(()));
    }
    let balance: i64 = conn
        .scalar(sql("SELECT balance_cents FROM shop_users WHERE id = $1").bind(user))
        .await?;
    Ok(Err(balance))
}

/// Inserts an order for `user` in `status`; returns its id.
pub async fn insert_order(
    conn: &mut Conn<'_>,
    user: &str,
    sku: &str,
    quantity: i64,
    amount: i64,
    status: &str,
) -> Result<i64, sqlx::Error> {
    let insert = sql(
        "INSERT INTO shop_orders (user_id, sku, quantity, amount_cents, status)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    );
    conn.scalar(
        insert
            .bind(user)
            .bind(sku)
            .bind(quantity)
            .bind(amount)
            .bind(status),
    )
    .await
}

/// Step 1: the user, the debit and the order in `pending_payment`.
pub async fn place_order(
    mut conn: Conn<'_>,
    request: &PurchaseRequest,
    amount: i64,
) -> Result<Placed, sqlx::Error> {
    ensure_user(&mut conn, &request.user).await?;
    if let Err(balance) = debit(&mut conn, &request.user, amount).await? {
        return Ok(Placed::Refused { balance });
    }
    let order = insert_order(
        &mut conn,
        &request.user,
        &request.sku,
        request.quantity,
        amount,
        "pending_payment",
    )
    .await?;
    Ok(Placed::Order(order))
}

/// The order is no longer awaiting payment (cancelled by someone else): it cannot be paid.
#[derive(Debug, thiserror::Error)]
#[error("order {0} is no longer awaiting payment")]
pub struct OrderGone(pub i64);

/// The order is already paid: another runner of the same purchase (the resumer, or a retry that
/// claimed the key after this runner's lease ended) finished it. This runner is stale and must
/// not compensate anything.
#[derive(Debug, thiserror::Error)]
#[error("order {0} was paid by another runner of the purchase")]
pub struct PaidByAnother(pub i64);

/// Step 3: `pending_payment → paid` (guarded) and the purchase row, and with `outbox` the
/// purchase's event in the outbox (same transaction); returns the 201 body.
pub async fn mark_paid(
    mut conn: Conn<'_>,
    request: &PurchaseRequest,
    order: i64,
    amount: i64,
    charge: &Charge,
    outbox: bool,
) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
    let paid = conn
        .execute(
            sql(
                "UPDATE shop_orders SET status = 'paid', charge_id = $2 WHERE
                 id = $1 AND status = 'pending_payment'",
            )
            .bind(order)
            .bind(&charge.charge_id),
        )
        .await?;
    if paid != 1 {
        let status: Option<String> = conn
            .scalar_optional(sql("SELECT status FROM shop_orders WHERE id = $1").bind(order))
            .await?;
        if status.as_deref() == Some("paid") {
            return Err(Box::new(PaidByAnother(order)));
        }
        return Err(Box::new(OrderGone(order)));
    }
    let purchase_id: i64 = conn
        .scalar(
            sql("INSERT INTO shop_purchases (user_id, order_id) VALUES ($1, $2) RETURNING id")
                .bind(&request.user)
                .bind(order),
        )
        .await?;
    if outbox {
        let event = crate::outbox::PurchasePaid {
            purchase_id,
            order_id: order,
            user_id: request.user.clone(),
            sku: request.sku.clone(),
            quantity: request.quantity,
            amount_cents: amount,
        };
        crate::outbox::record(conn.reborrow(), &event).await?;
    }
    Ok(json!({
        "purchase_id": purchase_id,
        "order_id": order,
        "sku": request.sku,
        "quantity": request.quantity,
        "amount_cents": amount,
        "charge_id": charge.charge_id,
    }))
}

/// The compensation of step 1: the debit given back, the order cancelled (guarded).
pub async fn cancel_order(
    mut conn: Conn<'_>,
    user: &str,
    order: i64,
    amount: i64,
) -> Result<(), sqlx::Error> {
    let cancelled = conn
        .execute(
            sql("UPDATE shop_orders SET status = 'cancelled' WHERE id = $1
                 AND status = 'pending_payment'")
            .bind(order),
        )
        .await?;
    if cancelled == 1 {
        conn.execute(
            sql("UPDATE shop_users SET balance_cents = balance_cents + $2 WHERE id = $1")
                .bind(user)
                .bind(amount),
        )
        .await?;
    }
    Ok(())
}

/// A JSON body as a stored response.
pub fn stored_json(status: StatusCode, body: &Value) -> StoredResponse {
    StoredResponse {
        status: status.as_u16(),
        headers: vec![("content-type".into(), "application/json".into())],
        body: serde_json::to_vec(body).expect("a JSON value serialises"),
    }
}

fn refusal(amount: i64, balance: i64) -> StoredResponse {
    Problem::shop(
        StatusCode::PAYMENT_REQUIRED,
        "insufficient-balance",
        "Insufficient balance",
        format!("this costs {amount} cents but the balance is {balance} cents"),
    )
    .with_extension("amount_cents", amount)
    .with_extension("balance_cents", balance)
    .to_stored()
}

fn payment_failed(why: &str, order: i64) -> StoredResponse {
    Problem::shop(
        StatusCode::BAD_GATEWAY,
        "payment-failed",
        "Payment failed",
        format!("{why}; the order was cancelled and the balance given back. This answer is final for this Idempotency-Key: use a new key to buy again"),
    )
    .with_extension("order_id", order)
    .with_extension("order_status", "cancelled")
    .to_stored()
}

pub(crate) fn call_error(error: ProviderError) -> CallError {
    match error {
        ProviderError::Refused(reason) => CallError::Declined(reason),
        other => CallError::Unknown(other.to_string()),
    }
}

/// The purchase, as one function of its steps, run alike by the request, a retry and the
/// resumer.
#[derive(Debug, Clone)]
pub struct Purchase {
    payment: PaymentProvider,
    outbox: bool,
}

/// The operation name of the durable purchase (`POST /purchases`), under which it is registered.
/// A durable operation with an outside step (the charge): its key is never taken over as
/// abandoned local work nor released after a step took effect; a retry or the worker continues
/// it from its recovery point.
pub const PURCHASE: &str = "purchase";

impl Purchase {
    /// The operation, charging through `payment`; with `outbox`, a paid purchase writes its
    /// event into the outbox in its last step's transaction.
    pub fn new(payment: PaymentProvider, outbox: bool) -> Self {
        Self { payment, outbox }
    }
}

impl<S: StoreConn> Operation<S> for Purchase {
    type Request = PurchaseRequest;
    type Response = StoredResponse;

    fn name(&self) -> &str {
        PURCHASE
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        request: &PurchaseRequest,
    ) -> Result<Finished<StoredResponse>, StepError> {
        let amount = price(&request.sku, request.quantity).map_err(|_| StepError::Local {
            step: "price".into(),
            source: format!("{} × {} is not for sale", request.quantity, request.sku).into(),
        })?;

        // 1. The debit and the order, committed with the recovery point "order".
        let placed = steps
            .local("order", async |tx| {
                place_order(S::conn(tx), request, amount).await
            })
            .await?;
        let order = match placed {
            Placed::Order(order) => order,
            Placed::Refused { balance } => {
                // Nothing was written: the refusal itself is the definitive answer.
                let refused = refusal(amount, balance);
                return steps
                    .finish(async move |_| Ok::<_, sqlx::Error>(refused))
                    .await;
            }
        };

        // 2. The charge, with a key derived from ours; a lost answer is looked up by that key.
        let payment = &self.payment;
        let user = request.user.as_str();
        let charged = steps
            .call(
                "charge",
                |key| async move { payment.charge(&key, user, amount).await.map_err(call_error) },
                |key| async move {
                    match payment.lookup(&key).await {
                        Ok(Some(charge)) => Lookup::Done(charge),
                        Ok(None) => Lookup::NotDone,
                        Err(e) => Lookup::Unknown(e.to_string()),
                    }
                },
            )
            .await;
        let charge = match charged {
            Ok(charge) => charge,
            Err(StepError::NotDone { .. }) => {
                return fail(
                    steps,
                    request,
                    order,
                    amount,
                    "the payment did not go through",
                )
                .await
            }
            Err(StepError::Declined { reason, .. }) => {
                let why = format!("the payment was declined: {reason}");
                return fail(steps, request, order, amount, &why).await;
            }
            Err(other) => return Err(other),
        };

        // 3. Paid, recorded, and the key completed with the 201, in one transaction.
        let outbox = self.outbox;
        let finished = steps
            .finish(async |tx| {
                let body = mark_paid(S::conn(tx), request, order, amount, &charge, outbox).await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(stored_json(
                    StatusCode::CREATED,
                    &body,
                ))
            })
            .await;
        match finished {
            // Another runner finished the purchase while this one was stalled past its lease:
            // its charge is the one the order holds (same provider key); nothing to undo here.
            Err(StepError::Local { source, .. }) if source.is::<PaidByAnother>() => {
                Err(StepError::LeaseLost)
            }
            Err(StepError::Local { source, .. }) if source.is::<OrderGone>() => {
                // Charged for an order nobody can pay any more: refund, then settle as failed.
                let charge_id = charge.charge_id.clone();
                steps
                    .call(
                        "refund",
                        |key| {
                            let charge_id = charge_id.clone();
                            async move { payment.refund(&key, &charge_id).await.map_err(call_error) }
                        },
                        |_key| async { Lookup::NotDone },
                    )
                    .await?;
                fail(
                    steps,
                    request,
                    order,
                    amount,
                    "the order was cancelled; the charge was refunded",
                )
                .await
            }
            other => other,
        }
    }
}

/// Settles the purchase as failed: the debit back, the order cancelled, a definitive 502.
async fn fail<S: StoreConn>(
    steps: &mut Steps<S>,
    request: &PurchaseRequest,
    order: i64,
    amount: i64,
    why: &str,
) -> Result<Finished<StoredResponse>, StepError> {
    let answer = payment_failed(why, order);
    steps
        .fail(why, async |tx| {
            cancel_order(S::conn(tx), &request.user, order, amount).await?;
            Ok::<_, sqlx::Error>(answer)
        })
        .await
}
