//! The decoding of a key row, shared by the backends: each reads its columns into a [`KeyRow`]
//! (its own types for timestamps, booleans, integer widths and text), and one
//! [`KeyRow::into_record`] validates and converts it into a [`KeyRecord`].

use super::{KeyRecord, LeaseToken};
use crate::{error::StoreError, Fingerprint, IdempotencyKey};
use chrono::{DateTime, Utc};
use std::time::Duration;
use uuid::Uuid;

/// A key row as read from any backend, before validation.
pub(crate) struct KeyRow {
    pub(crate) scope: String,
    pub(crate) operation: String,
    pub(crate) idem_key: String,
    pub(crate) state: String,
    pub(crate) effects: String,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) lease_token: Uuid,
    pub(crate) lease_remaining_ms: i64,
    pub(crate) expired: bool,
    pub(crate) result: Option<Vec<u8>>,
    pub(crate) reason: Option<String>,
    pub(crate) recovery_attempts: i64,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) updated_at: DateTime<Utc>,
    pub(crate) lease_until: DateTime<Utc>,
    pub(crate) expires_at: DateTime<Utc>,
    pub(crate) recovery_point: Option<String>,
    pub(crate) request: Option<Vec<u8>>,
    pub(crate) progress: Option<Vec<u8>>,
}

impl KeyRow {
    /// The record: a valid key, known state and effects, a 32-byte fingerprint; a negative
    /// remaining lease or attempt count reads as 0.
    pub(crate) fn into_record(self) -> Result<KeyRecord, StoreError> {
        let key = IdempotencyKey::new(self.scope, self.operation, self.idem_key)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        Ok(KeyRecord {
            key,
            state: self.state.parse()?,
            effects: self.effects.parse()?,
            fingerprint: Fingerprint::try_from(self.fingerprint.as_slice())
                .map_err(|_| StoreError::Corrupt("fingerprint is not 32 bytes".into()))?,
            lease_token: LeaseToken(self.lease_token),
            lease_remaining: Duration::from_millis(self.lease_remaining_ms.max(0) as u64),
            expired: self.expired,
            result: self.result,
            reason: self.reason,
            recovery_attempts: self.recovery_attempts.max(0) as u32,
            created_at: self.created_at,
            updated_at: self.updated_at,
            lease_until: self.lease_until,
            expires_at: self.expires_at,
            recovery_point: self.recovery_point,
            request: self.request,
            progress: self.progress,
        })
    }
}

/// A lease token stored as 16 bytes (SQLite, MySQL).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn uuid(bytes: &[u8]) -> Result<Uuid, StoreError> {
    Uuid::from_slice(bytes).map_err(|e| StoreError::Corrupt(e.to_string()))
}
