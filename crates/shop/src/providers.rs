//! The simulated outside services, with fault injection.
//!
//! * [`PaymentProvider`] honours idempotency keys, like real card processors: a charge is kept
//!   by its provider key, and the same key returns the same charge. It can be asked what became
//!   of a key ([`PaymentProvider::lookup`]) and refund a charge ([`PaymentProvider::refund`]).
//!   The shop passes a key derived from its own idempotency key, so neither a retry nor the
//!   resumer ever charges twice. Faults are injected into charges only: lookups and refunds
//!   always answer (with the configured latency).
//! * [`MailProvider`] has no idempotency support: every call sends a new message. When a call
//!   fails, the shop cannot know whether the message went out.
//!
//! Both write through their own pool ([`ProviderDb`]), never inside the shop's transaction,
//! exactly like a remote service would.

use crate::db::{sql, ProviderDb};
use rand::Rng;
use std::time::Duration;

/// How a simulated provider call failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The call failed; it may or may not have taken effect (timeout, connection reset).
    #[error("the provider did not answer ({0}); the call may or may not have taken effect")]
    Unknown(&'static str),
    /// The provider refused: the key was used with another amount.
    #[error("the provider refused: {0}")]
    Refused(String),
    /// The provider's storage failed.
    #[error("provider storage failed: {0}")]
    Storage(#[from] sqlx::Error),
}

/// Fault injection settings of a provider.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Probability in `0..=1` that a call fails; half of the failures happen after the effect.
    pub fail_rate: f64,
    /// Added latency per call.
    pub latency: Duration,
}

impl Faults {
    /// Draws whether this call fails, and if so whether before or after taking effect.
    fn draw(&self) -> Option<bool> {
        let mut rng = rand::thread_rng();
        (self.fail_rate > 0.0 && rng.gen_bool(self.fail_rate.clamp(0.0, 1.0)))
            .then(|| rng.gen_bool(0.5))
    }
}

/// A charge made by the payment provider.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Charge {
    /// The provider's id of the charge.
    pub charge_id: String,
    /// What was charged.
    pub amount_cents: i64,
}

/// The simulated payment provider (honours idempotency keys).
#[derive(Debug, Clone)]
pub struct PaymentProvider {
    db: ProviderDb,
    faults: Faults,
}

impl PaymentProvider {
    /// A provider keeping its charges in `db`.
    pub fn new(db: ProviderDb, faults: Faults) -> Self {
        Self { db, faults }
    }

    /// Charges `account` `amount_cents`, once per `provider_key`: a second call with the same key
    /// returns the first charge; with another amount it is refused.
    pub async fn charge(
        &self,
        provider_key: &str,
        account: &str,
        amount_cents: i64,
    ) -> Result<Charge, ProviderError> {
        if !self.faults.latency.is_zero() {
            tokio::time::sleep(self.faults.latency).await;
        }
        let fault = self.faults.draw();
        if fault == Some(false) {
            return Err(ProviderError::Unknown("timeout before the charge"));
        }
        let charge_id = format!("ch_{}", uuid::Uuid::new_v4().simple());
        let mut conn = self.db.conn().await?;
        let (charge_id, charged_account, charged): (String, String, i64) = {
            let mut c = conn.conn();
            c.execute(
                sql(
                    "INSERT INTO payment_provider_charges (provider_key, charge_id,
                     account, amount_cents)
                     VALUES ($1, $2, $3, $4) ON CONFLICT (provider_key) DO NOTHING",
                )
                .on_mysql(
                    "INSERT IGNORE INTO payment_provider_charges (provider_key, charge_id,
                     account, amount_cents) VALUES ($1, $2, $3, $4)",
                )
                .bind(provider_key)
                .bind(&charge_id)
                .bind(account)
                .bind(amount_cents),
            )
            .await?;
            c.fetch_one(
                sql("SELECT charge_id, account, amount_cents FROM
                     payment_provider_charges WHERE provider_key = $1")
                .bind(provider_key),
            )
            .await?
        };
        if charged != amount_cents || charged_account != account {
            return Err(ProviderError::Refused(format!(
                "key {provider_key} was used for {charged} cents on another request"
            )));
        }
        if fault == Some(true) {
            return Err(ProviderError::Unknown("connection reset after the charge"));
        }
        Ok(Charge {
            charge_id,
            amount_cents,
        })
    }
}

impl PaymentProvider {
    /// What became of the charge made with `provider_key`: `Some` if it was made, `None` if no
    /// charge with that key exists. Never fails by injection.
    pub async fn lookup(&self, provider_key: &str) -> Result<Option<Charge>, ProviderError> {
        if !self.faults.latency.is_zero() {
            tokio::time::sleep(self.faults.latency).await;
        }
        let mut conn = self.db.conn().await?;
        let found: Option<(String, i64)> = conn
            .conn()
            .fetch_optional(
                sql(
                    "SELECT charge_id, amount_cents FROM payment_provider_charges
                     WHERE provider_key = $1",
                )
                .bind(provider_key),
            )
            .await?;
        Ok(found.map(|(charge_id, amount_cents)| Charge {
            charge_id,
            amount_cents,
        }))
    }

    /// Refunds `charge_id` in full, once per `refund_key` (and at most once per charge): a
    /// second call returns the first refund's id. Never fails by injection.
    pub async fn refund(&self, refund_key: &str, charge_id: &str) -> Result<String, ProviderError> {
        let mut conn = self.db.conn().await?;
        let refunded: Option<String> = {
            let mut c = conn.conn();
            let refund = sql(
                "INSERT INTO payment_provider_refunds (refund_key, charge_id, amount_cents)
                 SELECT $1, charge_id, amount_cents FROM payment_provider_charges
                 WHERE charge_id = $2
                 ON CONFLICT DO NOTHING",
            )
            .on_mysql(
                "INSERT IGNORE INTO payment_provider_refunds (refund_key, charge_id, amount_cents)
                 SELECT $1, charge_id, amount_cents FROM payment_provider_charges
                 WHERE charge_id = $2",
            );
            c.execute(refund.bind(refund_key).bind(charge_id)).await?;
            c.scalar_optional(
                sql("SELECT refund_key FROM payment_provider_refunds WHERE charge_id = $1")
                    .bind(charge_id),
            )
            .await?
        };
        refunded.ok_or_else(|| ProviderError::Refused(format!("no charge {charge_id} to refund")))
    }
}

/// The simulated mail provider (no idempotency support).
#[derive(Debug, Clone)]
pub struct MailProvider {
    db: ProviderDb,
    faults: Faults,
}

impl MailProvider {
    /// A provider keeping its sent messages in `db`.
    pub fn new(db: ProviderDb, faults: Faults) -> Self {
        Self { db, faults }
    }

    /// Sends one message and returns its id. `client_ref` is only recorded (for audits); the
    /// provider does not deduplicate on it.
    pub async fn send(
        &self,
        account: &str,
        recipient: &str,
        subject: &str,
        client_ref: &str,
    ) -> Result<String, ProviderError> {
        let fault = self.faults.draw();
        if fault == Some(false) {
            return Err(ProviderError::Unknown("timeout before sending"));
        }
        let message_id = format!("msg_{}", uuid::Uuid::new_v4().simple());
        let mut conn = self.db.conn().await?;
        conn.conn()
            .execute(
                sql("INSERT INTO mail_provider_messages (message_id, account,
                     recipient, subject, client_ref)
                     VALUES ($1, $2, $3, $4, $5)")
                .bind(&message_id)
                .bind(account)
                .bind(recipient)
                .bind(subject)
                .bind(client_ref),
            )
            .await?;
        if fault == Some(true) {
            return Err(ProviderError::Unknown("connection reset after sending"));
        }
        Ok(message_id)
    }
}
