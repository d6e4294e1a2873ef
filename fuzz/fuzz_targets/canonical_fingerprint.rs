//! Canonical fingerprinting of arbitrary bytes: never panics; for JSON input the canonical form is
//! a fixed point (canonicalising it again changes nothing), it parses back to the same document,
//! and the fingerprint of the input is the fingerprint of its canonical form.
#![no_main]

use idempotency::{protocol::canonical_json, Fingerprint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        assert!(Fingerprint::of_json_bytes(data).is_err());
        return;
    };
    let canonical = canonical_json(&value).expect("a parsed document always serialises");
    let reparsed: serde_json::Value =
        serde_json::from_slice(&canonical).expect("canonical JSON parses");
    assert_eq!(
        canonical_json(&reparsed).unwrap(),
        canonical,
        "canonical form is a fixed point"
    );
    assert_eq!(
        Fingerprint::of_json_bytes(data).unwrap(),
        Fingerprint::of_bytes(&canonical),
        "fingerprint of input = fingerprint of its canonical form"
    );
    // The builder's parts are framed, so a body part never equals a raw-bytes part of the same text.
    let framed = Fingerprint::builder()
        .json_part("body", data)
        .unwrap()
        .finish();
    assert_ne!(framed, Fingerprint::of_bytes(&canonical));
});
