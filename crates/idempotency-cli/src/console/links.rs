//! The console's addresses, and how it writes times (which forms read back).

use chrono::{DateTime, SecondsFormat, Utc};
use idempotency::IdempotencyKey;
use serde::{Deserialize, Serialize};

/// A time as the console shows it (and reads it back from a form's `seen`): RFC 3339, UTC, to
/// the microsecond (the finest any store keeps).
pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The query string naming one key.
#[derive(Debug, Serialize, Deserialize, Default)]
pub struct KeyQuery {
    /// Who the key belongs to.
    #[serde(default)]
    pub scope: String,
    /// The operation it protects.
    #[serde(default)]
    pub operation: String,
    /// The client's key.
    #[serde(default)]
    pub key: String,
    /// What was just done to it (shown once, as a flash).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub done: String,
}

/// The address of `key`'s page (with a flash naming `done`, when not empty).
pub fn key_href(key: &IdempotencyKey, done: &str) -> String {
    let query = KeyQuery {
        scope: key.scope().into(),
        operation: key.operation().into(),
        key: key.key().into(),
        done: done.into(),
    };
    format!(
        "/key?{}",
        serde_urlencoded::to_string(query).unwrap_or_default()
    )
}
