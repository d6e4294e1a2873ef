//! [`Disposition`]: what happens to a key after an answer that is not a plain success.

/// What happens to the key (and the business transaction) after an answer: the one word the
/// core's [`run_with`](crate::Idempotency::run_with), the HTTP layer's per-status policy and a
/// handler's response all use.
///
/// ```
/// use idempotency::Disposition;
/// // A mail provider that timed out may have sent the mail: park the key for a human.
/// let decide = |e: &std::io::Error| match e.kind() {
///     std::io::ErrorKind::TimedOut => Disposition::Park(format!("mail provider: {e}")),
///     _ => Disposition::Release,
/// };
/// assert_eq!(
///     decide(&std::io::ErrorKind::TimedOut.into()),
///     Disposition::Park("mail provider: timed out".into())
/// );
/// assert_eq!(decide(&std::io::ErrorKind::InvalidInput.into()), Disposition::Release);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// A definitive answer: complete the key with it and replay it to every retry. In the HTTP
    /// layer, the handler's writes commit with it after a 2xx or 3xx and roll back after any
    /// other status (the response is then stored in a short transaction of its own). The core
    /// stores only a work's `Ok` value: [`run_with`](crate::Idempotency::run_with) treats `Store`
    /// for an *error* as [`Park`](Self::Park), since it has no encoding for the error; return a
    /// definitive refusal as `Ok(…)` to have it stored and replayed.
    Store,
    /// Nothing happened that a retry could duplicate: roll back and release the key, so a retry
    /// runs again.
    Release,
    /// An outside effect may have happened: roll back and park the key as *needs review* with
    /// this reason; retries are refused (HTTP 409 `needs-review`) until an operator settles it
    /// (`idem keys resolve`, [`resolve`](crate::maintenance::resolve)).
    Park(String),
}
