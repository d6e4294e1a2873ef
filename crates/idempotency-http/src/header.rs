//! The `Idempotency-Key` request header, in both forms clients send.
//!
//! * IETF draft (`draft-ietf-httpapi-idempotency-key-header`): a Structured Field **String**,
//!   `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`, parsed with [`sfv`].
//! * Stripe and most SDKs: the bare value, `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`.
//!
//! A value that starts with `"` is read as a Structured Field String; anything else as a bare key.
//! Either way the key must be 1..=255 characters of printable ASCII.
//!
//! The header names themselves are [`idempotency_wire::header`]'s.

use http::{HeaderMap, HeaderValue};
use idempotency::key::MAX_PART_LEN;
use idempotency_wire::header::IDEMPOTENCY_KEY;

/// Why an `Idempotency-Key` header was rejected (answered with 400).
///
/// ```
/// use idempotency_http::header::{parse_idempotency_key, KeyHeaderError};
/// let value = http::HeaderValue::from_static("\"unterminated");
/// assert!(matches!(parse_idempotency_key(&value), Err(KeyHeaderError::MalformedString(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The request carries the header more than once.
    #[error("the Idempotency-Key header is sent more than once")]
    Repeated,
    /// The value starts with `"` but is not a valid Structured Field String.
    #[error("the Idempotency-Key header is not a valid structured field string: {0}")]
    MalformedString(String),
    /// The value is a Structured Field item of another type (integer, token with parameters …).
    #[error("the Idempotency-Key header must be a string")]
    NotAString,
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than 255 characters.
    #[error("the idempotency key is {0} characters long; at most 255 are allowed")]
    TooLong(usize),
    /// The key holds a character outside printable ASCII.
    #[error("the idempotency key contains a forbidden character at byte {0}")]
    ForbiddenCharacter(usize),
}

/// Reads the key from a request's headers: `Ok(None)` when absent, an error when repeated or
/// malformed.
///
/// ```
/// use idempotency_http::header::key_from_headers;
/// use idempotency_wire::header::IDEMPOTENCY_KEY;
/// let mut headers = http::HeaderMap::new();
/// assert_eq!(key_from_headers(&headers), Ok(None));
/// headers.insert(IDEMPOTENCY_KEY, "\"abc-123\"".parse().unwrap());
/// assert_eq!(key_from_headers(&headers), Ok(Some("abc-123".to_owned())));
/// ```
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    parse_idempotency_key(value).map(Some)
}

/// Parses one `Idempotency-Key` value, in the Structured Field String form or the bare form.
///
/// ```
/// use http::HeaderValue;
/// use idempotency_http::header::{parse_idempotency_key, KeyHeaderError};
/// assert_eq!(parse_idempotency_key(&HeaderValue::from_static("\"abc-123\"")).unwrap(), "abc-123");
/// assert_eq!(parse_idempotency_key(&HeaderValue::from_static("abc-123")).unwrap(), "abc-123");
/// assert_eq!(parse_idempotency_key(&HeaderValue::from_static("\"say \\\"hi\\\"\"")).unwrap(), "say \"hi\"");
/// assert_eq!(parse_idempotency_key(&HeaderValue::from_static("\"\"")), Err(KeyHeaderError::Empty));
/// ```
pub fn parse_idempotency_key(value: &HeaderValue) -> Result<String, KeyHeaderError> {
    let raw = trim_ows(value.as_bytes());
    let key = if raw.first() == Some(&b'"') {
        let item: sfv::Item = sfv::Parser::new(raw)
            .parse_item()
            .map_err(|e| KeyHeaderError::MalformedString(e.to_string()))?;
        match item.bare_item.as_string() {
            Some(string) if item.params.is_empty() => string.as_str().to_owned(),
            _ => return Err(KeyHeaderError::NotAString),
        }
    } else {
        if let Some(position) = raw.iter().position(|b| !(b' '..=b'~').contains(b)) {
            return Err(KeyHeaderError::ForbiddenCharacter(position));
        }
        // Printable ASCII only, checked just above.
        String::from_utf8_lossy(raw).into_owned()
    };
    validate(&key)?;
    Ok(key)
}

/// Serialises a key in the IETF draft form, as a Structured Field String (for clients and tests).
///
/// ```
/// use idempotency_http::header::{format_idempotency_key, parse_idempotency_key};
/// let value = format_idempotency_key("a \"quoted\" key").unwrap();
/// assert_eq!(value, "\"a \\\"quoted\\\" key\"");
/// assert_eq!(parse_idempotency_key(&value).unwrap(), "a \"quoted\" key");
/// ```
pub fn format_idempotency_key(key: &str) -> Result<HeaderValue, KeyHeaderError> {
    validate(key)?;
    let string = <&sfv::StringRef>::try_from(key)
        .map_err(|e| KeyHeaderError::MalformedString(e.to_string()))?;
    let serialized = sfv::ItemSerializer::new().bare_item(string).finish();
    HeaderValue::from_str(&serialized).map_err(|e| KeyHeaderError::MalformedString(e.to_string()))
}

fn validate(key: &str) -> Result<(), KeyHeaderError> {
    if key.is_empty() {
        return Err(KeyHeaderError::Empty);
    }
    if key.len() > MAX_PART_LEN {
        return Err(KeyHeaderError::TooLong(key.len()));
    }
    match key.bytes().position(|b| !(b' '..=b'~').contains(&b)) {
        Some(position) => Err(KeyHeaderError::ForbiddenCharacter(position)),
        None => Ok(()),
    }
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(value: &str) -> Result<String, KeyHeaderError> {
        parse_idempotency_key(&HeaderValue::from_str(value).unwrap())
    }

    #[test]
    fn structured_field_string_form() {
        assert_eq!(parse("\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse("  \"abc-123\"  ").unwrap(), "abc-123");
        assert_eq!(parse(r#""a\\b""#).unwrap(), r"a\b");
        assert_eq!(parse(r#""with \"quotes\"""#).unwrap(), "with \"quotes\"");
        assert_eq!(parse("\"has space\"").unwrap(), "has space");
        assert!(matches!(
            parse("\"open"),
            Err(KeyHeaderError::MalformedString(_))
        ));
        assert!(matches!(
            parse("\"a\" trailing"),
            Err(KeyHeaderError::MalformedString(_))
        ));
        assert!(matches!(
            parse(r#""bad \x escape""#),
            Err(KeyHeaderError::MalformedString(_))
        ));
        assert_eq!(parse("\"a\";p=1"), Err(KeyHeaderError::NotAString));
        assert_eq!(parse("\"\""), Err(KeyHeaderError::Empty));
        let long = format!("\"{}\"", "k".repeat(256));
        assert_eq!(parse(&long), Err(KeyHeaderError::TooLong(256)));
        let longest = format!("\"{}\"", "k".repeat(255));
        assert_eq!(parse(&longest).unwrap().len(), 255);
    }

    #[test]
    fn bare_token_form() {
        assert_eq!(parse("abc-123").unwrap(), "abc-123");
        assert_eq!(
            parse("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse("sk_live:order/42=+").unwrap(), "sk_live:order/42=+");
        assert_eq!(parse(" padded\t").unwrap(), "padded");
        assert_eq!(parse(""), Err(KeyHeaderError::Empty));
        assert_eq!(parse("   "), Err(KeyHeaderError::Empty));
        assert_eq!(parse(&"k".repeat(256)), Err(KeyHeaderError::TooLong(256)));
        assert_eq!(parse(&"k".repeat(255)).unwrap().len(), 255);
        let tab_inside = HeaderValue::from_bytes(b"a\tb").unwrap();
        assert_eq!(
            parse_idempotency_key(&tab_inside),
            Err(KeyHeaderError::ForbiddenCharacter(1))
        );
        let non_ascii = HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap();
        assert_eq!(
            parse_idempotency_key(&non_ascii),
            Err(KeyHeaderError::ForbiddenCharacter(3))
        );
    }

    #[test]
    fn repeated_header_is_rejected() {
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("b"));
        assert_eq!(key_from_headers(&headers), Err(KeyHeaderError::Repeated));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                if let Ok(key) = parse_idempotency_key(&value) {
                    prop_assert!(!key.is_empty() && key.len() <= 255);
                    prop_assert!(key.bytes().all(|b| (b' '..=b'~').contains(&b)));
                }
            }
        }

        #[test]
        fn random_structured_strings_never_panic(s in "\"[ -~]{0,300}\"?") {
            let value = HeaderValue::from_str(&s).unwrap();
            let _ = parse_idempotency_key(&value);
        }

        #[test]
        fn valid_keys_round_trip_in_the_draft_form(key in "[ -~]{1,255}") {
            let value = format_idempotency_key(&key).unwrap();
            prop_assert_eq!(parse_idempotency_key(&value).unwrap(), key);
        }

        #[test]
        fn valid_keys_round_trip_in_the_bare_form(key in "[!#-~]([ -~]{0,253}[!-~])?") {
            let value = HeaderValue::from_str(&key).unwrap();
            prop_assert_eq!(parse_idempotency_key(&value).unwrap(), key);
        }
    }
}
