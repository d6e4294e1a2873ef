//! The header names of the protocol, as [`http::HeaderName`]s (usable with `http`, `axum`,
//! `hyper` and `reqwest` header maps alike).
//!
//! ```
//! use idempotency_wire::header;
//! let mut headers = http::HeaderMap::new();
//! headers.insert(header::IDEMPOTENCY_KEY, http::HeaderValue::from_static("order-42"));
//! assert_eq!(headers["idempotency-key"], "order-42");
//! ```

use http::HeaderName;

/// `Idempotency-Key`: the request header that names one logical operation; every retry of the
/// operation carries the same value.
///
/// ```
/// assert_eq!(idempotency_wire::header::IDEMPOTENCY_KEY, "idempotency-key");
/// ```
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed: true`: marks a response the server replayed from its store (the
/// operation's one answer, sent again).
///
/// ```
/// assert_eq!(idempotency_wire::header::IDEMPOTENT_REPLAYED, "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotency-Key-Retention: <seconds>`: how long after completion the server remembers the
/// key and its response (sent when the server is configured to).
///
/// ```
/// assert_eq!(idempotency_wire::header::IDEMPOTENCY_KEY_RETENTION, "idempotency-key-retention");
/// ```
pub const IDEMPOTENCY_KEY_RETENTION: HeaderName =
    HeaderName::from_static("idempotency-key-retention");

/// `Retry-After-Ms: <milliseconds>`: beside `Retry-After` on the answers a retry can outlast
/// (409 `in-progress`, 409 `lease-lost`, 503), the same hint in milliseconds.
///
/// `Retry-After` is whole seconds (RFC 9110), rounded up to at least 1, which is far too coarse
/// for a double click on an operation of a few milliseconds. A client that knows
/// `Retry-After-Ms` waits that long instead; one that does not keeps reading `Retry-After`.
///
/// ```
/// assert_eq!(idempotency_wire::header::RETRY_AFTER_MS, "retry-after-ms");
/// ```
pub const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
