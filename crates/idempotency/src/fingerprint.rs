//! A SHA-256 fingerprint of what the client asked for, so a reused key with another request is caught.

use serde::Serialize;
use sha2::{Digest, Sha256};
use std::fmt;

/// SHA-256 of a canonical form of a request.
///
/// Two requests that mean the same thing hash the same: JSON is put in [`canonical_json`] form
/// (sorted keys, no insignificant whitespace, one number format), so `{"a":1,"b":2}` and
/// `{ "b": 2, "a": 1 }` are one request, while any changed value is another.
///
/// ```
/// use idempotency::Fingerprint;
/// let a = Fingerprint::of_json_bytes(br#"{"a":1,"b":[true,null]}"#)?;
/// let b = Fingerprint::of_json_bytes(b"{ \"b\": [true, null],\n \"a\": 1.0 }")?;
/// assert_eq!(a, b);
/// assert_ne!(a, Fingerprint::of_json(&serde_json::json!({"a": 2, "b": [true, null]}))?);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprint of any serialisable value, through its canonical JSON form.
    pub fn of_json<T: Serialize>(value: &T) -> Result<Self, serde_json::Error> {
        Ok(Self::of_bytes(&canonical_json(value)?))
    }

    /// Fingerprint of a JSON document given as bytes; fails if they are not JSON.
    pub fn of_json_bytes(json: &[u8]) -> Result<Self, serde_json::Error> {
        let value: serde_json::Value = serde_json::from_slice(json)?;
        Self::of_json(&value)
    }

    /// Fingerprint of raw bytes, taken as they are.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// Starts a fingerprint over several labelled parts (method, path, headers, body …).
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder(Sha256::new())
    }

    /// Rebuilds a fingerprint from the 32 bytes a store kept.
    pub fn from_digest(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hexadecimal form, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl TryFrom<&[u8]> for Fingerprint {
    type Error = std::array::TryFromSliceError;
    fn try_from(bytes: &[u8]) -> Result<Self, Self::Error> {
        Ok(Self(bytes.try_into()?))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Hashes labelled parts unambiguously: each part is length-prefixed, so `("ab", "c")` and
/// `("a", "bc")` differ.
///
/// ```
/// use idempotency::Fingerprint;
/// let fp = Fingerprint::builder()
///     .part("method", b"POST")
///     .part("path", b"/purchases")
///     .json_part("body", br#"{"sku":"tea","quantity":1}"#)?
///     .finish();
/// assert_eq!(fp.to_hex().len(), 64);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone)]
pub struct FingerprintBuilder(Sha256);

impl FingerprintBuilder {
    /// Adds a part taken as raw bytes.
    pub fn part(mut self, label: &str, value: &[u8]) -> Self {
        for bytes in [label.as_bytes(), value] {
            self.0.update((bytes.len() as u64).to_be_bytes());
            self.0.update(bytes);
        }
        self
    }

    /// Adds a part that is a JSON document, canonicalised first.
    pub fn json_part(self, label: &str, json: &[u8]) -> Result<Self, serde_json::Error> {
        let value: serde_json::Value = serde_json::from_slice(json)?;
        let mut canonical = Vec::with_capacity(json.len());
        write_canonical(&value, &mut canonical)?;
        Ok(self.part(label, &canonical))
    }

    /// The fingerprint of all parts added.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

/// The canonical JSON bytes of a value: object keys sorted (by code point), no insignificant
/// whitespace, strings escaped as `serde_json` does, integers written exactly, and other numbers in
/// their shortest round-trip form, with integral values below 2^53 written as integers (so `1.0`,
/// `1` and `1e0` are one number).
///
/// This follows RFC 8785 (JCS) except in one place that matters for fingerprints: JCS writes every
/// number as an IEEE double, so `9007199254740993` and `9007199254740992` (64-bit ids) would be
/// the same request. Here 64-bit integers stay exact; only integers beyond 64 bits are compared as
/// doubles.
///
/// ```
/// let bytes = idempotency::protocol::canonical_json(&serde_json::json!({"b": 1, "a": [1.50, "x", 2.0]}))?;
/// assert_eq!(bytes, br#"{"a":[1.5,"x",2],"b":1}"#);
/// # Ok::<(), serde_json::Error>(())
/// ```
pub fn canonical_json<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::with_capacity(128);
    write_canonical(&value, &mut out)?;
    Ok(out)
}

/// 2^53: below it every integer is exactly representable as a double.
const EXACT_DOUBLE_INTEGERS: f64 = 9_007_199_254_740_992.0;

fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write_canonical(item, out)?;
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or_default();
            if f.fract() == 0.0 && f.abs() < EXACT_DOUBLE_INTEGERS {
                serde_json::to_writer(&mut *out, &(f as i64))?;
            } else {
                serde_json::to_writer(&mut *out, &f)?;
            }
        }
        other => serde_json::to_writer(&mut *out, other)?,
    }
    Ok(())
}
