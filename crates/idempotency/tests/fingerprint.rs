//! Property tests for canonical fingerprinting: key order and whitespace never change the hash;
//! any change of a value does.

use idempotency::Fingerprint;
use proptest::prelude::*;
use serde_json::{Map, Value};

/// Arbitrary JSON documents, a few levels deep.
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1.0e12f64..1.0e12).prop_map(Value::from),
        "[a-zA-Z0-9 _\\-\"\\\\é日]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Writes `value` as JSON text with object keys in the order `shuffle` picks and random
/// whitespace between tokens.
fn write_scrambled(value: &Value, seed: &mut u64, out: &mut String) {
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }
    let ws = |seed: &mut u64, out: &mut String| {
        for _ in 0..(next(seed) % 3) {
            out.push([' ', '\n', '\t', '\r'][(next(seed) % 4) as usize]);
        }
    };
    ws(seed, out);
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            // Fisher-Yates with our seed: a different key order each time.
            for i in (1..entries.len()).rev() {
                entries.swap(i, (next(seed) % (i as u64 + 1)) as usize);
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(seed, out);
                out.push_str(&serde_json::to_string(k).unwrap());
                ws(seed, out);
                out.push(':');
                write_scrambled(v, seed, out);
            }
            ws(seed, out);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_scrambled(v, seed, out);
            }
            ws(seed, out);
            out.push(']');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap()),
    }
    ws(seed, out);
}

/// Every leaf path of a document, so a test can change exactly one value.
fn leaf_paths(value: &Value, path: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                path.push(PathStep::Key(k.clone()));
                leaf_paths(v, path, out);
                path.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                path.push(PathStep::Index(i));
                leaf_paths(v, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

#[derive(Debug, Clone)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn leaf_mut<'a>(value: &'a mut Value, path: &[PathStep]) -> &'a mut Value {
    path.iter().fold(value, |v, step| match step {
        PathStep::Key(k) => v.get_mut(k.as_str()).unwrap(),
        PathStep::Index(i) => v.get_mut(*i).unwrap(),
    })
}

/// A different value of the same or another type.
fn changed(leaf: &Value) -> Value {
    match leaf {
        Value::Null => Value::Bool(false),
        Value::Bool(b) => Value::Bool(!b),
        Value::Number(n) if n.is_i64() => Value::from(n.as_i64().unwrap().wrapping_add(1)),
        Value::Number(n) => Value::from(n.as_f64().unwrap() + 1.0),
        Value::String(s) => Value::String(format!("{s}x")),
        _ => Value::Null,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn key_order_and_whitespace_do_not_change_the_fingerprint(value in json(), seed in 1u64..) {
        let mut text = String::new();
        let mut s = seed;
        write_scrambled(&value, &mut s, &mut text);
        let canonical = Fingerprint::of_json(&value).unwrap();
        prop_assert_eq!(Fingerprint::of_json_bytes(text.as_bytes()).unwrap(), canonical);
        let compact = serde_json::to_vec(&value).unwrap();
        prop_assert_eq!(Fingerprint::of_json_bytes(&compact).unwrap(), canonical);
    }

    #[test]
    fn any_changed_value_changes_the_fingerprint(value in json(), pick in any::<prop::sample::Index>()) {
        let mut paths = Vec::new();
        leaf_paths(&value, &mut Vec::new(), &mut paths);
        prop_assume!(!paths.is_empty());
        let path = &paths[pick.index(paths.len())];
        let mut other = value.clone();
        let leaf = leaf_mut(&mut other, path);
        *leaf = changed(leaf);
        prop_assert_ne!(Fingerprint::of_json(&value).unwrap(), Fingerprint::of_json(&other).unwrap());
    }

    #[test]
    fn an_added_or_removed_member_changes_the_fingerprint(value in json(), extra in "[a-z]{7,9}") {
        // Keys of the generated objects are at most 6 letters, so `extra` is always new.
        let wrapped = serde_json::json!({"doc": value.clone()});
        let mut grown = wrapped.clone();
        grown.as_object_mut().unwrap().insert(extra, Value::Null);
        prop_assert_ne!(Fingerprint::of_json(&wrapped).unwrap(), Fingerprint::of_json(&grown).unwrap());
    }
}

#[test]
fn equal_numbers_in_other_notations_are_one_request() {
    let a = Fingerprint::of_json_bytes(br#"{"amount": 100, "rate": 0.5}"#).unwrap();
    let b = Fingerprint::of_json_bytes(br#"{"rate": 5e-1, "amount": 1.00e2}"#).unwrap();
    assert_eq!(a, b);
}

#[test]
fn builder_parts_are_unambiguous() {
    let ab_c = Fingerprint::builder()
        .part("x", b"ab")
        .part("y", b"c")
        .finish();
    let a_bc = Fingerprint::builder()
        .part("x", b"a")
        .part("y", b"bc")
        .finish();
    assert_ne!(ab_c, a_bc);
}

#[test]
fn not_json_is_an_error() {
    assert!(Fingerprint::of_json_bytes(b"{\"a\": 1").is_err());
    assert!(Fingerprint::of_json_bytes(b"sku=tea").is_err());
}

#[test]
fn integers_beyond_double_precision_stay_distinct() {
    // RFC 8785 would write both as the double 9007199254740992.
    let a = Fingerprint::of_json_bytes(br#"{"order_id": 9007199254740993}"#).unwrap();
    let b = Fingerprint::of_json_bytes(br#"{"order_id": 9007199254740992}"#).unwrap();
    assert_ne!(a, b);
    let c = Fingerprint::of_json_bytes(br#"{"order_id": 18446744073709551615}"#).unwrap();
    let d = Fingerprint::of_json_bytes(br#"{"order_id": 18446744073709551614}"#).unwrap();
    assert_ne!(c, d);
}
