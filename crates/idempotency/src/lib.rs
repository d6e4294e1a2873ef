#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod disposition;
mod error;
mod fingerprint;
mod heartbeat;
mod inbox;
pub mod key;
mod lease;
mod operation;
mod outcome;
pub mod protocol;
mod recent_replays;
mod recovery;
mod replay_cache;
mod retention;
mod steps;
pub mod store;
mod worker;

// What an application writes: the engine, its attempt and answers, the key and fingerprint, the
// store it runs on.
pub use disposition::Disposition;
pub use error::{Error, StoreError};
pub use fingerprint::Fingerprint;
#[doc(no_inline)]
pub use key::IdempotencyKey;
pub use lease::Lease;
pub use outcome::Outcome;
#[doc(no_inline)]
pub use protocol::{Attempt, Idempotency};
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres::PgStore;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite::SqliteStore;
#[doc(no_inline)]
pub use store::{Effects, Store};

pub mod durable {
    //! Durable operations: work that calls outside services, written as steps that commit recovery
    //! points, with provider keys derived from ours, resumed after a crash from the last step.
    //!
    //! An [`Operation`] runs its [`Steps`]; the [`Operations`] registry is what the maintenance
    //! worker resumes from; a [`Resolver`] asks a provider about an abandoned outside call.
    //!
    //! ```
    //! use idempotency::durable::{provider_key, StepPolicy};
    //! let key = idempotency::IdempotencyKey::new("user-42", "purchase", "k-1")?;
    //! assert!(provider_key(&key, "charge").len() > 10);
    //! assert!(StepPolicy::default().max_unknown() >= 1);
    //! # Ok::<(), idempotency::key::InvalidKey>(())
    //! ```

    pub use crate::error::{BoxError, PerformError, StepError};
    pub use crate::operation::{Operation, Operations};
    pub use crate::recovery::{NoResolver, ProviderAnswer, Resolver};
    pub use crate::steps::{
        provider_key, CallError, Finished, Lookup, Settlement, StepPolicy, Steps,
        MAX_STORED_REQUEST,
    };
}

pub mod queue {
    //! Queues: exactly-once effects on at-least-once delivery. An [`Inbox`] runs one message's work
    //! at most once per message key and answers what to do with the delivery ([`DeliveryAction`]).
    //!
    //! ```
    //! use idempotency::queue::{DeliveryAction, MAX_MESSAGE_TYPE_LEN};
    //! assert!(DeliveryAction::Ack { replayed: false }.is_ack());
    //! assert!(MAX_MESSAGE_TYPE_LEN < idempotency::key::MAX_PART_LEN);
    //! ```

    pub use crate::inbox::{
        DeadLetter, DeliveryAction, FailureKind, Inbox, InvalidMessage, MAX_MESSAGE_TYPE_LEN,
    };
}

pub mod maintenance {
    //! Operators: the maintenance worker (recovery of abandoned keys and the retention purge), key
    //! listings and statistics, and the resolution of keys parked for review.
    //!
    //! ```
    //! use idempotency::maintenance::{KeyFilter, RecoveryReport};
    //! let filter = KeyFilter::default().with_limit(10);
    //! assert_eq!(filter.limit(), 10);
    //! assert_eq!(RecoveryReport::default().acted(), 0);
    //! ```

    pub use crate::recovery::{hand_back, resolve, Recovery, RecoveryReport, ResolveError};
    pub use crate::retention::{Purge, PurgeReport};
    pub use crate::store::history::{EventKind, KeyEvent, OperatorNote};
    pub use crate::store::maintenance::{KeyCursor, KeyFilter, KeyStats, Resolution, StateCount};
    pub use crate::worker::{MaintenanceWorker, WorkerHandle, WorkerReport};

    pub mod signals;
}
