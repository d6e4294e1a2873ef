#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod disposition;
mod error;
mod fingerprint;
mod heartbeat;
mod inbox;
mod key;
mod lease;
mod operation;
mod outcome;
mod protocol;
mod recent_replays;
mod recovery;
mod replay_cache;
mod retention;
mod steps;
mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod worker;

pub use disposition::Disposition;
pub use error::{is_unavailable_error, BoxError, Error, PerformError, StepError, StoreError};
pub use fingerprint::{canonical_json, Fingerprint, FingerprintBuilder};
pub use inbox::{
    DeadLetter, DeliveryAction, FailureKind, Inbox, InvalidMessage, MAX_MESSAGE_TYPE_LEN,
};
pub use key::{IdempotencyKey, InvalidKey, KeyPart, MAX_PART_LEN};
pub use lease::Lease;
pub use operation::{Operation, Operations};
pub use outcome::Outcome;
pub use protocol::{Attempt, Begun, Idempotency, Reservation};
pub use recovery::{
    resolve, NoResolver, ProviderAnswer, Recovery, RecoveryReport, ResolveError, Resolver,
};
pub use retention::{Purge, PurgeReport};
pub use steps::{
    provider_key, CallError, Finished, Lookup, Settlement, StepPolicy, Steps, MAX_STORED_REQUEST,
};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::{completion_payload, PgStore, COMPLETION_CHANNEL, NOTIFIED_POLL};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite::SqliteStore;
pub use store::{
    Awaited, CompletionSignal, Effects, Insertion, Journal, KeyFilter, KeyRecord, KeyState,
    KeyStats, LeaseToken, Maintenance, PendingRow, Progress, ReserveInTransaction, ReservedIn,
    Resolution, StateCount, Store, POLL_FIRST, POLL_MAX,
};
pub use worker::{MaintenanceWorker, WorkerHandle, WorkerReport};
