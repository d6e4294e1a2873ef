//! What a paid purchase's event sets off, as one durable operation ([`PurchaseEvents`]), run by
//! `shop worker` for each event and by the maintenance worker for an event whose worker died:
//!
//! 1. **points**: one grant of loyalty points for the order, under the business unique
//!    constraint `shop_point_grants.order_id` (a second defence behind the message id);
//! 2. **receipt**: an e-mail through the mail provider, which has no idempotency keys: the call
//!    is marked as started before it is made, and an unknown outcome (or a worker killed during
//!    the call) parks the key as *needs review*, never a second e-mail.

use crate::{
    db::{sql, Conn, StoreConn},
    outbox::{PurchasePaid, PURCHASE_PAID},
    providers::MailProvider,
    purchase::call_error,
};
use idempotency::durable::{Finished, Operation, StepError, Steps};
use serde_json::{json, Value};

/// What a purchase event sets off: the points, then the receipt.
#[derive(Debug, Clone)]
pub struct PurchaseEvents {
    mail: MailProvider,
}

impl PurchaseEvents {
    /// Sending receipts through `mail`.
    pub fn new(mail: MailProvider) -> Self {
        Self { mail }
    }
}

/// Grants the order's points once: the unique constraint on `order_id` turns a second grant
/// into nothing. Returns whether this call granted them.
async fn grant_points(mut conn: Conn<'_>, event: &PurchasePaid) -> Result<bool, sqlx::Error> {
    let granted = conn
        .execute(
            sql(
                "INSERT INTO shop_point_grants (order_id, user_id, points) VALUES ($1, $2, $3)
                 ON CONFLICT (order_id) DO NOTHING",
            )
            .on_mysql(
                "INSERT IGNORE INTO shop_point_grants (order_id, user_id, points)
                 VALUES ($1, $2, $3)",
            )
            .bind(event.order_id)
            .bind(&event.user_id)
            .bind(event.points()),
        )
        .await?;
    Ok(granted == 1)
}

async fn record_receipt(
    mut conn: Conn<'_>,
    event: &PurchasePaid,
    message_id: &str,
) -> Result<(), sqlx::Error> {
    conn.execute(
        sql("INSERT INTO shop_emails (user_id, recipient, subject,
             message_id) VALUES ($1, $2, $3, $4)")
        .bind(&event.user_id)
        .bind(recipient(event))
        .bind(subject(event))
        .bind(message_id),
    )
    .await?;
    Ok(())
}

fn recipient(event: &PurchasePaid) -> String {
    format!("{}@example.com", event.user_id)
}

fn subject(event: &PurchasePaid) -> String {
    format!("receipt for purchase {}", event.purchase_id)
}

impl<S: StoreConn> Operation<S> for PurchaseEvents {
    type Request = PurchasePaid;
    type Response = Value;

    fn name(&self) -> &str {
        PURCHASE_PAID
    }

    async fn run(
        &self,
        steps: &mut Steps<S>,
        event: &PurchasePaid,
    ) -> Result<Finished<Value>, StepError> {
        let granted = steps
            .local("points", async |tx| grant_points(S::conn(tx), event).await)
            .await?;
        let mail = self.mail.clone();
        let sending = event.clone();
        let message_id: String = steps
            .call_unkeyed("receipt", move || async move {
                mail.send(
                    &sending.user_id,
                    &recipient(&sending),
                    &subject(&sending),
                    &sending.message_id(),
                )
                .await
                .map_err(call_error)
            })
            .await?;
        steps
            .finish(async |tx| {
                record_receipt(S::conn(tx), event, &message_id).await?;
                Ok::<_, sqlx::Error>(json!({
                    "order_id": event.order_id,
                    "points_granted": granted,
                    "receipt": message_id,
                }))
            })
            .await
    }
}
