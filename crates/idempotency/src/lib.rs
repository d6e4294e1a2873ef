#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod consumer;
pub mod error;
pub mod fingerprint;
pub mod key;
pub mod operation;
pub mod outcome;
pub mod protocol;
mod recent_replays;
pub mod recovery;
pub mod retention;
pub mod steps;
pub mod store;
pub mod worker;

pub use consumer::{Consumer, DeadLetter, Decision, FailureKind, Message};
pub use error::{Error, StoreError};
pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use key::{IdempotencyKey, InvalidKey, KeyPart};
pub use operation::{Operation, Operations};
pub use outcome::Outcome;
pub use protocol::{AfterError, Attempt, Idempotency, Lease, PerformError, Reservation};
pub use steps::{CallError, Finished, Lookup, Settlement, StepError, StepPolicy, Steps};
pub use store::{Effects, Insertion, KeyRecord, KeyState, LeaseToken, PendingRow, Progress, Store};
