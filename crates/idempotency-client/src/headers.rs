//! The header names the client sends and reads.

/// `Idempotency-Key`, the request header the middleware sets.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// `Idempotent-Replayed: true`, which marks an answer the server replayed from its store.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// `Retry-After-Ms: <milliseconds>`, the millisecond retry hint of `idempotency-http`; preferred
/// over `Retry-After` (whole seconds) when both are present.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";
