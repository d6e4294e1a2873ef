#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod error;
pub mod fingerprint;
pub mod key;
pub mod outcome;
pub mod protocol;
pub mod recovery;
pub mod retention;
pub mod store;

pub use error::{Error, StoreError};
pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use key::{IdempotencyKey, InvalidKey, KeyPart};
pub use outcome::Outcome;
pub use protocol::{AfterError, Attempt, Idempotency, Lease, Reservation};
pub use store::{Effects, Insertion, KeyRecord, KeyState, LeaseToken, PendingRow, Store};
