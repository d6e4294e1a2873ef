//! The identity of one logical operation: who, which operation, and the client's key.

use std::fmt;

/// Longest accepted length, in bytes, of each part of an [`IdempotencyKey`].
pub const MAX_PART_LEN: usize = 255;

/// Which part of an [`IdempotencyKey`] was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyPart {
    /// Who the key belongs to (user or tenant id).
    Scope,
    /// Which kind of operation (`"purchase"`).
    Operation,
    /// The client's string.
    Key,
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyPart::Scope => "scope",
            KeyPart::Operation => "operation",
            KeyPart::Key => "key",
        })
    }
}

/// Why a key was rejected; returned by [`IdempotencyKey::new`].
///
/// ```
/// use idempotency::{IdempotencyKey, key::{InvalidKey, KeyPart}};
/// let err = IdempotencyKey::new("user-1", "purchase", "").unwrap_err();
/// assert_eq!(err, InvalidKey::Empty(KeyPart::Key));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The part is the empty string.
    #[error("the idempotency {0} is empty")]
    Empty(KeyPart),
    /// The part is longer than [`MAX_PART_LEN`] bytes.
    #[error("the idempotency {part} is {len} bytes long; at most {max} are allowed", max = MAX_PART_LEN)]
    TooLong {
        /// The offending part.
        part: KeyPart,
        /// Its length in bytes.
        len: usize,
    },
    /// The client key holds a byte outside printable ASCII (`0x20..=0x7E`), or scope/operation hold
    /// a control character.
    #[error("the idempotency {part} contains a forbidden character at byte {position}")]
    ForbiddenCharacter {
        /// The offending part.
        part: KeyPart,
        /// Byte offset of the first forbidden character.
        position: usize,
    },
}

/// `(scope, operation, key)`: the unique identity of one logical operation.
///
/// The client's string alone never identifies an operation: two users who send the same key, or one
/// user who sends it to two different operations, get independent keys.
///
/// ```
/// use idempotency::IdempotencyKey;
/// let key = IdempotencyKey::new("user-42", "purchase", "8e03978e-40d5-43e8-bc93-6894a57f9324")?;
/// assert_eq!(key.scope(), "user-42");
/// assert_eq!(key.operation(), "purchase");
/// # Ok::<(), idempotency::key::InvalidKey>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    scope: String,
    operation: String,
    key: String,
}

impl IdempotencyKey {
    /// Validates and builds a key.
    ///
    /// * `scope`: 1..=255 bytes of UTF-8 without control characters;
    /// * `operation`: the same;
    /// * `key`: 1..=255 characters of printable ASCII (`' '..='~'`).
    pub fn new(
        scope: impl Into<String>,
        operation: impl Into<String>,
        key: impl Into<String>,
    ) -> Result<Self, InvalidKey> {
        let (scope, operation, key) = (scope.into(), operation.into(), key.into());
        check(KeyPart::Scope, &scope, |c| !c.is_control())?;
        check(KeyPart::Operation, &operation, |c| !c.is_control())?;
        check(KeyPart::Key, &key, |c| (' '..='~').contains(&c))?;
        Ok(Self {
            scope,
            operation,
            key,
        })
    }

    /// Who the key belongs to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Which kind of operation it protects.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The client's string.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.scope, self.operation, self.key)
    }
}

fn check(part: KeyPart, value: &str, allowed: impl Fn(char) -> bool) -> Result<(), InvalidKey> {
    if value.is_empty() {
        return Err(InvalidKey::Empty(part));
    }
    if value.len() > MAX_PART_LEN {
        return Err(InvalidKey::TooLong {
            part,
            len: value.len(),
        });
    }
    match value.char_indices().find(|&(_, c)| !allowed(c)) {
        Some((position, _)) => Err(InvalidKey::ForbiddenCharacter { part, position }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_printable_ascii_keys() {
        let key = IdempotencyKey::new("u", "op", "a-B_9 ~!\"'%;--").unwrap();
        assert_eq!(key.key(), "a-B_9 ~!\"'%;--");
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(
            IdempotencyKey::new("u", "op", "k\u{e9}").unwrap_err(),
            InvalidKey::ForbiddenCharacter {
                part: KeyPart::Key,
                position: 1
            }
        );
        assert_eq!(
            IdempotencyKey::new("u", "op", "a\nb").unwrap_err(),
            InvalidKey::ForbiddenCharacter {
                part: KeyPart::Key,
                position: 1
            }
        );
        assert_eq!(
            IdempotencyKey::new("u", "op", "x".repeat(256)).unwrap_err(),
            InvalidKey::TooLong {
                part: KeyPart::Key,
                len: 256
            }
        );
        assert!(IdempotencyKey::new("u", "op", "x".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::new("", "op", "k").unwrap_err(),
            InvalidKey::Empty(KeyPart::Scope)
        );
        assert_eq!(
            IdempotencyKey::new("u", "o\u{0}p", "k").unwrap_err(),
            InvalidKey::ForbiddenCharacter {
                part: KeyPart::Operation,
                position: 1
            }
        );
        // Non-ASCII scopes are fine (user names, tenant slugs).
        assert!(IdempotencyKey::new("テナント", "op", "k").is_ok());
    }
}
