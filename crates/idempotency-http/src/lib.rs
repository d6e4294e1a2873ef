//! tower/axum middleware for the `Idempotency-Key` header (work in progress).
