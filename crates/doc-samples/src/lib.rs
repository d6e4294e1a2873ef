//! The Rust samples of the user documentation, compiled (and run, unless marked `no_run`) as
//! doctests by `cargo test -p doc-samples`: a sample that no longer matches the crates fails
//! CI. The crate READMEs that are their crate's own documentation (`idempotency`,
//! `idempotency-http`, `idempotency-wire`) are compiled by their crate instead.

/// `README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct Readme;

/// `docs/external-calls.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/external-calls.md")]
pub struct ExternalCalls;

/// `docs/implementing-a-store.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/implementing-a-store.md")]
pub struct ImplementingAStore;

/// `docs/operations.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/operations.md")]
pub struct Operations;

/// `docs/queues.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/queues.md")]
pub struct Queues;

/// `docs/shop.md`.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/shop.md")]
pub struct Shop;

/// `docs/design.md`, `docs/isolation-matrix.md`, `docs/proofs.md` and `docs/benchmarks.md`
/// hold no Rust; they are here so that a sample added to them is compiled too.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/design.md")]
#[doc = include_str!("../../../docs/isolation-matrix.md")]
#[doc = include_str!("../../../docs/proofs.md")]
#[doc = include_str!("../../../docs/benchmarks.md")]
pub struct OtherDocs;

/// `crates/idempotency-client/README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../idempotency-client/README.md")]
pub struct ClientReadme;

/// `crates/idempotency-amqp/README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../idempotency-amqp/README.md")]
pub struct AmqpReadme;

/// `crates/idempotency-cli/README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../idempotency-cli/README.md")]
pub struct CliReadme;
