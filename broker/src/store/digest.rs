//! The digest of a submitted request, stored with its operation so a replay compares 32 bytes
//! instead of re-reading and re-parsing the stored `target` and `arguments`.
//!
//! The replay rule is "the same request up to JSON key order", so the digest is SHA-256 over a
//! canonical encoding of `operation`, `target`, `arguments` and `reason`: objects with their keys
//! sorted (by their UTF-8 bytes) at every depth, no whitespace, strings and numbers as
//! `serde_json` writes them, `-0.0` as `0.0`, each of the four parts length-prefixed. Two requests
//! have the same digest exactly when `serde_json::Value` equality says they are the same request
//! (short of a SHA-256 collision), so `409 idempotency_conflict` stays exact: a change to any of
//! the four parts, however deep, changes the digest.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The request digest: 64 lowercase hex digits.
pub fn request_digest(operation: &str, target: &Value, arguments: &Value, reason: &str) -> String {
    let mut hasher = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    let mut canonical = Vec::new();
    part(b"unyolo-admission request 1");
    part(operation.as_bytes());
    for value in [target, arguments] {
        canonical.clear();
        write_canonical(&mut canonical, value);
        part(&canonical);
    }
    part(reason.as_bytes());
    let digest = hasher.finalize();
    let mut hex = String::with_capacity(64);
    for byte in digest {
        // Writing to a String cannot fail.
        let _ = std::fmt::Write::write_fmt(&mut hex, format_args!("{byte:02x}"));
    }
    hex
}

/// `value` as canonical JSON: object keys sorted at every depth, no whitespace.
fn write_canonical(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Object(fields) => {
            let mut names: Vec<&String> = fields.keys().collect();
            names.sort_unstable();
            out.push(b'{');
            for (n, name) in names.into_iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                write_string(out, name);
                out.push(b':');
                write_canonical(out, &fields[name]);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                write_canonical(out, item);
            }
            out.push(b']');
        }
        // A string, a number (its text as the request gave it: serde_json keeps it with
        // `arbitrary_precision`, so `1.50` and `1.5`, or two 20-digit integers an `f64` would
        // round alike, are different requests, as unYOLO's byte comparison has them), a boolean
        // or null, as serde_json writes it (writing to a Vec cannot fail).
        Value::String(text) => write_string(out, text),
        other => {
            let _ = serde_json::to_writer(&mut *out, other);
        }
    }
}

fn write_string(out: &mut Vec<u8>, text: &str) {
    // Writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn key_order_at_any_depth_does_not_change_the_digest() {
        let a: Value =
            serde_json::from_str(r#"{"repo":"u/t","deep":{"x":[1,{"b":2,"a":1}],"y":null}}"#)
                .unwrap();
        let b: Value =
            serde_json::from_str(r#"{"deep":{"y":null,"x":[1,{"a":1,"b":2}]},"repo":"u/t"}"#)
                .unwrap();
        let args = json!({"duration_ms": 5});
        let digest = request_digest("demo.run", &a, &args, "why");
        assert_eq!(digest, request_digest("demo.run", &b, &args, "why"));
        assert_eq!(digest.len(), 64);
        assert!(
            digest
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
    }

    #[test]
    fn any_change_to_any_part_changes_the_digest() {
        let target = json!({"repo": "u/t", "list": [1, 2]});
        let args = json!({"duration_ms": 5});
        let base = request_digest("demo.run", &target, &args, "why");
        let changed = [
            request_digest("demo.request", &target, &args, "why"),
            request_digest(
                "demo.run",
                &json!({"repo": "u/t", "list": [2, 1]}),
                &args,
                "why",
            ),
            request_digest(
                "demo.run",
                &json!({"repo": "u/t", "list": [1, 2.0]}),
                &args,
                "why",
            ),
            request_digest("demo.run", &target, &json!({"duration_ms": 6}), "why"),
            request_digest("demo.run", &target, &json!({"duration_ms": "5"}), "why"),
            request_digest("demo.run", &target, &args, "why "),
            // A value moved from one part to the other is a different request.
            request_digest("demo.run", &args, &target, "why"),
            // The parts are length-prefixed: text moved across a boundary changes the digest.
            request_digest("demo.ru", &target, &args, "nwhy"),
        ];
        for (n, digest) in changed.iter().enumerate() {
            assert_ne!(digest, &base, "change {n}");
        }
    }

    #[test]
    fn the_digest_agrees_with_value_equality_on_numbers() {
        let args = json!({});
        let digest = |target: &str| {
            let target: Value = serde_json::from_str(target).unwrap();
            request_digest("demo.run", &target, &args, "r")
        };
        // Numbers are compared as the text they came as, never through an f64.
        for (a, b) in [
            (r#"{"n": 0.0}"#, r#"{"n": -0.0}"#),
            (r#"{"n": 0}"#, r#"{"n": 0.0}"#),
            (r#"{"n": 1e2}"#, r#"{"n": 100.0}"#),
            (r#"{"n": 1.5}"#, r#"{"n": 1.50}"#),
            (
                r#"{"n": 12345678901234567890123}"#,
                r#"{"n": 12345678901234567890124}"#,
            ),
        ] {
            let (x, y): (Value, Value) = (
                serde_json::from_str(a).unwrap(),
                serde_json::from_str(b).unwrap(),
            );
            assert_ne!(x, y, "{a} {b}");
            assert_ne!(digest(a), digest(b), "{a} {b}");
        }
        // The same text is the same request, whatever the whitespace and key order around it.
        assert_eq!(
            digest(r#"{"n": 12345678901234567890123, "m": 1.50}"#),
            digest(r#"{"m":1.50,"n":12345678901234567890123}"#)
        );
    }
}
