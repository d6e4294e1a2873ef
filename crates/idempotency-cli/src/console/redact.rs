//! What the console shows of stored JSON: fields named in the redaction list masked at any
//! depth, and at most a bounded number of bytes.

use serde_json::Value;

/// The fields masked when `--redact` is not given.
pub const DEFAULT_FIELDS: &[&str] = &[
    "password",
    "card",
    "card_number",
    "cvc",
    "token",
    "secret",
    "authorization",
];

/// How many bytes of a stored document a page shows.
pub const SHOWN_BYTES: usize = 4096;

/// What a masked value is replaced with.
pub const MASK: &str = "***";

/// Replaces, at any depth, the value of every object member whose name is in `fields`
/// (compared without regard to ASCII case) with [`MASK`].
pub fn mask(value: &mut Value, fields: &[String]) {
    match value {
        Value::Object(members) => {
            for (name, member) in members.iter_mut() {
                if fields.iter().any(|f| f.eq_ignore_ascii_case(name)) {
                    *member = Value::String(MASK.into());
                } else {
                    mask(member, fields);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| mask(item, fields)),
        _ => {}
    }
}

/// The stored `bytes` as a page shows them: JSON masked and pretty-printed, cut after
/// [`SHOWN_BYTES`] bytes (saying how much was left out). Bytes that are not JSON cannot be
/// masked, so only their length is shown.
pub fn shown(bytes: &[u8], fields: &[String]) -> String {
    let Ok(mut value) = serde_json::from_slice::<Value>(bytes) else {
        return format!("({} bytes, not JSON: not shown)", bytes.len());
    };
    mask(&mut value, fields);
    let mut text = serde_json::to_string_pretty(&value).unwrap_or_default();
    if text.len() > SHOWN_BYTES {
        let mut end = SHOWN_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let left_out = text.len() - end;
        text.truncate(end);
        text.push_str(&format!("\n… ({left_out} more bytes not shown)"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::{shown, DEFAULT_FIELDS, SHOWN_BYTES};

    fn fields() -> Vec<String> {
        DEFAULT_FIELDS.iter().map(|f| f.to_string()).collect()
    }

    #[test]
    fn masks_at_any_depth_and_any_case() {
        let stored = br#"{"sku":"tea","Card":{"number":"4242"},"items":[{"cvc":"123","n":1}],"auth":{"token":"t"}}"#;
        let text = shown(stored, &fields());
        assert!(!text.contains("4242") && !text.contains("123") && !text.contains("\"t\""));
        assert!(text.contains("\"sku\": \"tea\""));
        assert_eq!(text.matches("***").count(), 3);
    }

    #[test]
    fn bounds_what_it_shows() {
        let big = serde_json::json!({ "note": "é".repeat(5000) }).to_string();
        let text = shown(big.as_bytes(), &fields());
        assert!(text.len() < SHOWN_BYTES + 64);
        assert!(text.ends_with("more bytes not shown)"));
        assert_eq!(
            shown(b"\x00\x01", &fields()),
            "(2 bytes, not JSON: not shown)"
        );
    }
}
