//! `Idempotency-Key` header parsing on arbitrary bytes: never panics; whatever it accepts is a
//! valid core key (1..=255 printable ASCII) and survives a format → parse round trip.
#![no_main]

use http::HeaderValue;
use idempotency::IdempotencyKey;
use idempotency_http::header::{format_idempotency_key, parse_idempotency_key};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let Ok(key) = parse_idempotency_key(&value) else {
        return;
    };
    assert!(
        !key.is_empty() && key.len() <= 255,
        "accepted key of {} bytes",
        key.len()
    );
    assert!(
        key.bytes().all(|b| (b' '..=b'~').contains(&b)),
        "accepted non-printable key {key:?}"
    );
    IdempotencyKey::new("scope", "operation", key.as_str())
        .expect("an accepted key is a valid core key");
    let formatted = format_idempotency_key(&key).expect("an accepted key can be formatted");
    assert_eq!(
        parse_idempotency_key(&formatted).unwrap(),
        key,
        "round trip"
    );
});
