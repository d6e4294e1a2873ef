//! What a protected call produced: run now, or replayed from the store.

/// The result of [`Idempotency::run`](crate::Idempotency::run).
///
/// Deliberately exhaustive: a completed operation is either run by this call or replayed, the
/// article's two answers that carry a result (the others are [`Error`](crate::Error) variants).
///
/// ```
/// use idempotency::Outcome;
/// let first: Outcome<u32> = Outcome::Executed(7);
/// assert!(!first.is_replayed());
/// assert_eq!(first.into_inner(), 7);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// This call reserved the key, ran the work and committed it with its result.
    Executed(R),
    /// An earlier call with the same key and request completed; this is its stored result.
    Replayed(R),
}

impl<R> Outcome<R> {
    /// The result, however it was obtained.
    pub fn into_inner(self) -> R {
        match self {
            Outcome::Executed(r) | Outcome::Replayed(r) => r,
        }
    }

    /// A reference to the result.
    pub fn value(&self) -> &R {
        match self {
            Outcome::Executed(r) | Outcome::Replayed(r) => r,
        }
    }

    /// Whether the result came from the store rather than from running the work.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }
}
