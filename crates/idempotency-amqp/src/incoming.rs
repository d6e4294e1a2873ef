//! One delivery as a handler sees it: the message's identity, its payload and properties, and
//! the [`Inbox`] that runs its work once.

use idempotency::{
    durable::{BoxError, Operation},
    queue::{DeliveryAction, FailureKind, Inbox, InvalidMessage},
    store::{CompletionSignal, Journal},
    Attempt,
};
use lapin::BasicProperties;
use serde::{de::DeserializeOwned, Serialize};
use std::fmt;

/// A delivery handed to a [`Handler`](crate::Handler). Its [`Attempt`] identifies it:
///
/// * **id**: the AMQP `message-id` property, which the producer sets once per logical message and
///   keeps on every resend (a delivery without one is dead-lettered as invalid);
/// * **type**: the AMQP `type` property, or the routing key when it is unset;
/// * **scope**: the consumer's scope, by default its queue's name (see
///   [`AmqpConsumer::with_scope`](crate::AmqpConsumer::with_scope));
/// * the payload's fingerprint: canonical JSON when the `content-type` is JSON
///   (`application/json` or `…+json`; a body that is not JSON is dead-lettered as invalid), the
///   bytes otherwise.
pub struct Incoming<S> {
    pub(crate) attempt: Attempt,
    pub(crate) payload: Vec<u8>,
    pub(crate) properties: BasicProperties,
    pub(crate) routing_key: String,
    pub(crate) redelivered: bool,
    pub(crate) inbox: Inbox<S>,
}

impl<S> fmt::Debug for Incoming<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("key", self.attempt.key())
            .field("bytes", &self.payload.len())
            .field("redelivered", &self.redelivered)
            .finish_non_exhaustive()
    }
}

impl<S: CompletionSignal> Incoming<S> {
    /// The message's identity: its idempotency key and payload fingerprint.
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// The body, as delivered.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The body, decoded from JSON. A handler answers a body it cannot decode with
    /// `DeliveryAction::DeadLetter(DeadLetter::Invalid(..))`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// The AMQP properties (headers, correlation id, reply-to …).
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// Whether the broker delivered it before (to this or another consumer) without an ack.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The inbox that runs the work.
    pub fn inbox(&self) -> &Inbox<S> {
        &self.inbox
    }

    /// Runs `work` in the business transaction, at most once per message
    /// ([`Inbox::handle`]). The work is the async closure of
    /// [`Idempotency::run`](idempotency::Idempotency::run), `async |tx| { … }`, with the same error
    /// bound.
    pub async fn handle<R, E, F>(&self, work: F) -> DeliveryAction
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
    {
        self.inbox.handle(&self.attempt, work).await
    }

    /// Like [`handle`](Self::handle), with `classify` deciding what the work's errors mean
    /// ([`Inbox::handle_with`]).
    pub async fn handle_with<R, E, F, C>(&self, classify: C, work: F) -> DeliveryAction
    where
        R: Serialize + DeserializeOwned + Send,
        E: Into<BoxError> + Send,
        F: for<'c> AsyncFnOnce(&mut sqlx::Transaction<'c, S::Database>) -> Result<R, E> + Send,
        C: FnOnce(&E) -> FailureKind + Send,
    {
        self.inbox.handle_with(&self.attempt, classify, work).await
    }

    /// Runs the durable operation `operation` for `request` under this message's scope and id
    /// ([`Inbox::perform`]; the key's operation is the operation's name).
    pub async fn perform<O: Operation<S>>(
        &self,
        operation: &O,
        request: &O::Request,
    ) -> DeliveryAction
    where
        S: Journal,
    {
        let key = self.attempt.key();
        self.inbox
            .perform(key.scope(), key.key(), operation, request)
            .await
    }
}

/// The [`Attempt`] of a delivery in `scope`, or why it has none.
pub(crate) fn attempt_of(
    scope: &str,
    properties: &BasicProperties,
    routing_key: &str,
    payload: &[u8],
) -> Result<Attempt, String> {
    let id = match properties.message_id() {
        Some(id) if !id.as_str().is_empty() => id.as_str(),
        _ => {
            return Err(
                "the message has no message-id property: the producer must give each \
                        logical message one id and keep it on every resend"
                    .to_owned(),
            )
        }
    };
    let message_type = match properties.kind() {
        Some(kind) if !kind.as_str().is_empty() => kind.as_str(),
        _ => routing_key,
    };
    let json = properties
        .content_type()
        .as_ref()
        .is_some_and(|content_type| is_json(content_type.as_str()));
    let attempt = if json {
        Attempt::message_json_bytes(scope, message_type, id, payload)
    } else {
        Attempt::message_bytes(scope, message_type, id, payload)
    };
    attempt.map_err(|error: InvalidMessage| error.to_string())
}

/// Whether a content type is JSON: `application/json` or a `+json` suffix, parameters ignored.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/vnd.order+json"));
        assert!(!is_json("application/octet-stream"));
        assert!(!is_json("text/plain"));
    }

    #[test]
    fn identifies_a_delivery() {
        let properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into());
        let message = attempt_of("orders", &properties, "order.paid", br#"{"b":1,"a":2}"#).unwrap();
        assert_eq!(message.key().to_string(), "orders/order.paid/m-1");
        let reordered = attempt_of("orders", &properties, "order.paid", br#"{"a":2,"b":1}"#);
        assert_eq!(reordered.unwrap().fingerprint(), message.fingerprint());

        let typed = properties.clone().with_type("invoice.sent".into());
        let message = attempt_of("orders", &typed, "ignored", b"{}").unwrap();
        assert_eq!(message.key().operation(), "invoice.sent");

        assert!(attempt_of("orders", &properties, "t", b"not json")
            .unwrap_err()
            .contains("not JSON"));
        let anonymous = BasicProperties::default();
        assert!(attempt_of("orders", &anonymous, "t", b"")
            .unwrap_err()
            .contains("message-id"));
    }
}
