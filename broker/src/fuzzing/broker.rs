//! Fuzz bodies for the broker's parsers of untrusted input: the Agent V1 query strings (listing
//! with its opaque cursor, and the long poll) and the operation submission body.
//!
//! Each checks the parser against a second, plainer reading of the Agent V1 contract written here:
//! the parser accepts exactly what that reading accepts, an accepted value carries exactly what the
//! input said, and a refusal is a clean 400 with a stable code and a one-line message.
//!
//! Past the usual size because each target's plain reading of the contract is written out in full
//! beside the target that checks against it, as in `fuzzing.rs`: apart, a model would drift from
//! the only check that reads it.

use axum::extract::Query;
use axum::http::{StatusCode, Uri};
use serde_json::Value;

use crate::api::agent_operations::{MAX_ARGUMENT_PROPERTIES, MAX_TARGET_PROPERTIES, validate};
use crate::api::error::ApiError;
use crate::api::listing::{
    DEFAULT_LIMIT, ListQuery, MAX_LIMIT, decode_cursor, encode_cursor, parse_query,
};
use crate::api::waits::{self, MAX_WAIT_SECONDS};
use crate::registry::OPERATIONS;
use unyolo_admission::engine::OperationState;

/// Clients a cursor is made for and checked against.
const CLIENTS: [&str; 2] = ["agent", "bot-7"];

/// The longest error message of the contract, in characters.
const MAX_MESSAGE_CHARS: usize = 500;

/// Asserts that `err` is a 400 with `invalid_request` (or, for submissions, also
/// `operation_not_registered`) and a one-line message of 1 to 500 characters.
fn assert_bad_request(err: &ApiError, codes: &[&str]) {
    assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{err:?}");
    assert!(codes.contains(&err.code()), "{err:?}");
    let message = err.message();
    let chars = message.chars().count();
    assert!((1..=MAX_MESSAGE_CHARS).contains(&chars), "{err:?}");
    assert!(
        !message.chars().any(char::is_control),
        "error message is not one line: {message:?}"
    );
}

/// The non-empty value of `name`, if given (an empty value counts as absent, as the parsers say).
fn given<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Every name known, none twice, no value empty.
fn names_ok(pairs: &[(String, String)], known: &[&str]) -> bool {
    pairs.iter().enumerate().all(|(i, (name, value))| {
        known.contains(&name.as_str())
            && !value.is_empty()
            && pairs[..i].iter().all(|(earlier, _)| earlier != name)
    })
}

/// A plain decimal: 1 to 20 ASCII digits whose value fits `u64`.
fn decimal(text: &str) -> Option<u64> {
    (text.len() <= 20 && text.chars().all(|c| c.is_ascii_digit()))
        .then(|| text.parse().ok())
        .flatten()
}

/// `^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`, by characters.
fn key_pattern(key: &str) -> bool {
    let mut chars = key.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && key.chars().count() <= 128
        && chars.all(|c| c.is_ascii_alphanumeric() || ".:_-".contains(c))
}

/// Arbitrary bytes as the query string of the Agent V1 listing and of the long poll, decoded the
/// way their routes decode it.
///
/// Listing: accepted exactly when every parameter is known and given once, `limit` is a plain
/// integer 1–50, `state` an operation state and `idempotency_key` matches the contract's pattern;
/// an accepted query carries those values (limit 20 when absent). A given cursor decodes, for
/// each client, either to a position ≥ 1 whose encoding is that very cursor, or to a 400. Cursors
/// made for any position round-trip, are URL-safe and 1–128 characters, and are refused for
/// another client, for other filters, and with any one byte changed.
///
/// Long poll: accepted exactly when its parameters are known and given once, `after_revision` a
/// plain integer and `wait_seconds` 0–30; the accepted values are the given ones (0 and 30 when
/// absent). Every refusal is a 400 `invalid_request` with a one-line message.
pub fn agent_query(data: &[u8]) {
    let pairs = match query_pairs(data) {
        None => return,
        Some(Ok(pairs)) => pairs,
        Some(Err(err)) => {
            assert_bad_request(&err, &["invalid_request"]);
            return;
        }
    };
    list_query(&pairs, data);
    wait_query(&pairs);
}

/// The query string a request carries, as its routes decode it; `None` when it never reaches one.
fn query_pairs(data: &[u8]) -> Option<Result<Vec<(String, String)>, ApiError>> {
    let text = std::str::from_utf8(data).ok()?;
    // A request target that is not a URI never reaches a route.
    let uri = Uri::try_from(format!("/api/agent/v1/operations?{text}")).ok()?;
    Some(
        Query::<Vec<(String, String)>>::try_from_uri(&uri)
            .map(|Query(pairs)| pairs)
            .map_err(|rejection| ApiError::invalid(rejection.body_text())),
    )
}

/// Whether the listing (its cursor included, for the first of the fuzzed clients) or the long
/// poll accepts `data` as its query string: how the replay test checks that seed files named
/// `valid_*` and `invalid_*` reach the paths they were written for.
pub fn agent_query_accepted(data: &[u8]) -> bool {
    let Some(Ok(pairs)) = query_pairs(data) else {
        return false;
    };
    let listed = parse_query(pairs.clone()).is_ok_and(|query| {
        query
            .cursor
            .as_ref()
            .is_none_or(|cursor| decode_cursor(cursor, CLIENTS[0], &query).is_ok())
    });
    listed || waits::parse_query(pairs).is_ok()
}

/// Whether `data` is a submission body the broker accepts (see [`agent_query_accepted`]).
pub fn submission_accepted(data: &[u8]) -> bool {
    validate(data).is_ok()
}

fn list_query(pairs: &[(String, String)], data: &[u8]) {
    let expected = names_ok(pairs, &["idempotency_key", "state", "limit", "cursor"])
        && given(pairs, "idempotency_key").is_none_or(|key| key_pattern(key.trim()))
        && given(pairs, "state").is_none_or(|s| OperationState::parse(s).is_some())
        && given(pairs, "limit")
            .is_none_or(|l| decimal(l).is_some_and(|n| (1..=u64::from(MAX_LIMIT)).contains(&n)));
    let query = match parse_query(pairs.to_vec()) {
        Ok(query) => query,
        Err(err) => {
            assert!(!expected, "listing refused {pairs:?}: {err:?}");
            assert_bad_request(&err, &["invalid_request"]);
            return;
        }
    };
    assert!(expected, "listing accepted {pairs:?}");
    assert!((1..=MAX_LIMIT).contains(&query.limit), "{query:?}");
    let limit =
        given(pairs, "limit").map_or(u64::from(DEFAULT_LIMIT), |l| decimal(l).expect("checked"));
    assert_eq!(u64::from(query.limit), limit);
    assert_eq!(query.state.map(|s| s.as_str()), given(pairs, "state"));
    // Trimmed, as upstream's listing trims it.
    assert_eq!(
        query.idempotency_key.as_deref(),
        given(pairs, "idempotency_key").map(str::trim)
    );
    assert_eq!(query.cursor.as_deref(), given(pairs, "cursor"));

    if let Some(cursor) = &query.cursor {
        for client in CLIENTS {
            match decode_cursor(cursor, client, &query) {
                Ok(position) => {
                    assert!(position >= 1, "{cursor} decoded to {position}");
                    assert_eq!(&encode_cursor(position, client, &query), cursor);
                }
                Err(err) => assert_bad_request(&err, &["invalid_request"]),
            }
        }
    }

    // Positions from the input, so the fuzzer steers them, and the extremes.
    let seed = data.iter().fold(0u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    let from_input = i64::try_from(seed >> 1).expect("63 bits").max(1);
    for position in [1, from_input, i64::MAX] {
        for (i, client) in CLIENTS.into_iter().enumerate() {
            cursor_round_trip(position, client, CLIENTS[1 - i], &query, seed);
        }
    }
}

/// A cursor made for (`position`, `client`, `query`) decodes to `position` there and nowhere else.
fn cursor_round_trip(position: i64, client: &str, other: &str, query: &ListQuery, seed: u64) {
    let cursor = encode_cursor(position, client, query);
    assert!((1..=128).contains(&cursor.len()), "{cursor}");
    assert!(
        cursor
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "cursor is not URL-safe: {cursor}"
    );
    assert_eq!(decode_cursor(&cursor, client, query).ok(), Some(position));
    let refused = |cursor: &str, client: &str, query: &ListQuery| {
        let err = decode_cursor(cursor, client, query).expect_err("cursor out of its scope");
        assert_bad_request(&err, &["invalid_request"]);
    };
    refused(&cursor, other, query);
    // Other filters: a different state, or a different key.
    let other_state = OperationState::ALL
        .into_iter()
        .find(|s| Some(*s) != query.state);
    let refiltered = ListQuery {
        idempotency_key: query.idempotency_key.clone(),
        state: other_state,
        limit: query.limit,
        cursor: None,
    };
    refused(&cursor, client, &refiltered);
    let rekeyed = ListQuery {
        idempotency_key: Some(match &query.idempotency_key {
            Some(key) => format!("{key}x"),
            None => "x".to_owned(),
        }),
        state: query.state,
        limit: query.limit,
        cursor: None,
    };
    refused(&cursor, client, &rekeyed);
    // The page size is not part of a cursor's scope: a client may change it between pages.
    let resized = ListQuery {
        idempotency_key: query.idempotency_key.clone(),
        state: query.state,
        limit: 1 + query.limit % MAX_LIMIT,
        cursor: None,
    };
    assert_eq!(
        decode_cursor(&cursor, client, &resized).ok(),
        Some(position)
    );
    // One character changed to another of the alphabet: refused, either as base64 (the last
    // character's two padding bits must be zero) or by the check.
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut bytes = cursor.clone().into_bytes();
    let index = (seed % bytes.len() as u64) as usize;
    let current = ALPHABET
        .iter()
        .position(|c| *c == bytes[index])
        .expect("alphabet");
    let step = 1 + (seed >> 8) as usize % (ALPHABET.len() - 1);
    bytes[index] = ALPHABET[(current + step) % ALPHABET.len()];
    let tampered = String::from_utf8(bytes).expect("ASCII");
    refused(&tampered, client, query);
}

fn wait_query(pairs: &[(String, String)]) {
    let expected = names_ok(pairs, &["after_revision", "wait_seconds"])
        && given(pairs, "after_revision").is_none_or(|r| decimal(r).is_some())
        && given(pairs, "wait_seconds")
            .is_none_or(|s| decimal(s).is_some_and(|n| n <= MAX_WAIT_SECONDS));
    match waits::parse_query(pairs.to_vec()) {
        Ok(query) => {
            assert!(expected, "long poll accepted {pairs:?}");
            let after = given(pairs, "after_revision").map_or(0, |r| decimal(r).expect("checked"));
            assert_eq!(query.after_revision, after);
            let seconds = given(pairs, "wait_seconds")
                .map_or(MAX_WAIT_SECONDS, |s| decimal(s).expect("checked"));
            assert_eq!(query.wait, std::time::Duration::from_secs(seconds));
        }
        Err(err) => {
            assert!(!expected, "long poll refused {pairs:?}: {err:?}");
            assert_bad_request(&err, &["invalid_request"]);
        }
    }
}

/// Whether any JSON object in `data`, at any depth, names a key twice (false for input that is
/// not JSON at all).
fn names_a_field_twice(data: &[u8]) -> bool {
    use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

    /// Whether the value read, or anything inside it, repeats a key.
    struct Twice(bool);
    impl<'de> Deserialize<'de> for Twice {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Twice, D::Error> {
            deserializer.deserialize_any(Finder).map(Twice)
        }
    }
    struct Finder;
    impl<'de> Visitor<'de> for Finder {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_str<E>(self, _: &str) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_unit<E>(self) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            let mut twice = false;
            while let Some(Twice(inner)) = seq.next_element()? {
                twice |= inner;
            }
            Ok(twice)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut twice = false;
            while let Some(name) = map.next_key::<String>()? {
                twice |= !seen.insert(name);
                let Twice(inner) = map.next_value()?;
                twice |= inner;
            }
            Ok(twice)
        }
    }
    serde_json::from_slice::<Twice>(data).is_ok_and(|Twice(twice)| twice)
}

/// Why a plain reading of the Agent V1 contract refuses a submission body, or what it accepts.
fn submission_model(data: &[u8]) -> Result<(&'static str, bool), &'static str> {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(data) else {
        return Err("not a JSON object");
    };
    // A `Value` keeps only the last of a repeated name; every object in the body, at any depth,
    // names each key once (unYOLO's broker refuses a repeated key, and so does this one).
    if names_a_field_twice(data) {
        return Err("a key named twice");
    }
    const FIELDS: [&str; 5] = [
        "idempotency_key",
        "operation",
        "target",
        "arguments",
        "reason",
    ];
    if body.len() != FIELDS.len() || !FIELDS.iter().all(|f| body.contains_key(*f)) {
        return Err("not exactly the five fields");
    }
    let text = |name: &str| body[name].as_str().ok_or("a text field is not a string");
    // Whitespace around the key and the reason is not part of them (upstream trims both);
    // the reason's bound is on the text as sent.
    if !key_pattern(text("idempotency_key")?.trim()) {
        return Err("idempotency_key");
    }
    let operation = text("operation")?;
    if !(1..=128).contains(&operation.chars().count()) {
        return Err("operation");
    }
    let reason = text("reason")?;
    if reason.trim().is_empty() || reason.chars().count() > 2000 {
        return Err("reason");
    }
    let properties = |name: &str| body[name].as_object().map(|o| o.len());
    if properties("target").is_none_or(|n| n > MAX_TARGET_PROPERTIES) {
        return Err("target");
    }
    if properties("arguments").is_none_or(|n| n > MAX_ARGUMENT_PROPERTIES) {
        return Err("arguments");
    }
    // Within those bounds, a name is registered or not.
    let Some(&(name, needs_approval)) = OPERATIONS.iter().find(|(n, _)| *n == operation) else {
        return Err("operation not registered");
    };
    let duration = body["arguments"].get("duration_ms");
    if duration.is_some_and(|d| d.as_u64().is_none_or(|ms| ms > 600_000)) {
        return Err("duration_ms");
    }
    Ok((name, needs_approval))
}

/// Arbitrary bytes as the body of `POST /api/agent/v1/operations`.
///
/// Never panics; accepts exactly what a plain reading of the Agent V1 contract accepts (exactly the
/// five fields; `idempotency_key` of the contract's pattern once trimmed; a registered `operation`
/// of 1–128 characters; `target` an object of at most 32 properties, `arguments` of at most 128
/// with a `duration_ms` of 0–600000 if any; `reason` of at most 2000 characters, not blank; no
/// object at any depth naming a key twice); an accepted body carries exactly the input's values
/// (the key and the reason trimmed, as upstream trims them); a refusal is a 400 with a stable code
/// (`operation_not_registered` for an unknown name, `operation_input_invalid` for a bad
/// `duration_ms`, else `invalid_request`) and a one-line message of 1–500 characters.
pub fn submission(data: &[u8]) {
    let expected = submission_model(data);
    match validate(data) {
        Ok(valid) => {
            let (operation, needs_approval) = expected
                .unwrap_or_else(|why| panic!("accepted a body the contract refuses: {why}"));
            let body: Value = serde_json::from_slice(data).expect("accepted JSON");
            let request = &valid.request;
            assert_eq!(request.operation, operation);
            assert_eq!(valid.needs_approval, needs_approval);
            let trimmed = |name: &str| body[name].as_str().map(str::trim);
            assert_eq!(
                trimmed("idempotency_key"),
                Some(request.idempotency_key.as_str())
            );
            assert_eq!(trimmed("reason"), Some(request.reason.as_str()));
            assert_eq!(body["target"], request.target);
            assert_eq!(body["arguments"], request.arguments);
        }
        Err(err) => {
            assert_bad_request(
                &err,
                &[
                    "invalid_request",
                    "operation_not_registered",
                    "operation_input_invalid",
                ],
            );
            if let Ok((operation, _)) = expected {
                panic!("refused a {operation} body the contract accepts: {err:?}");
            }
            // Each of the two later codes for exactly its own reason, the rest invalid_request.
            let reason = match err.code() {
                "operation_not_registered" => Some("operation not registered"),
                "operation_input_invalid" => Some("duration_ms"),
                _ => None,
            };
            match reason {
                Some(reason) => assert_eq!(expected, Err(reason), "{err:?}"),
                None => assert!(
                    !matches!(expected, Err("operation not registered" | "duration_ms")),
                    "{err:?} for {expected:?}"
                ),
            }
        }
    }
}

/// Whether `text` is, by a plain reading of the cursor format, a cursor the event stream
/// accepts: 11 characters of the base64url alphabet encoding 8 bytes (so the last character's
/// two spare bits are zero) whose first bit, the sign of the sequence, is zero.
fn event_cursor_shape(text: &str) -> bool {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let values: Option<Vec<usize>> = text
        .bytes()
        .map(|b| ALPHABET.iter().position(|&a| a == b))
        .collect();
    values.is_some_and(|v| v.len() == 11 && v[0] < 32 && v[10] % 4 == 0)
}

/// Arbitrary bytes as the start of an Operator V1 event stream: as a cursor itself, as the
/// query string of `GET /api/operator/v1/events`, and as its `Last-Event-ID` header.
///
/// A cursor decodes exactly when [`event_cursor_shape`] says so, to a sequence ≥ 0 whose
/// encoding is that very cursor; the encoding of any sequence ≥ 0 (the first 8 bytes) decodes
/// back to it. The stream's start is the query's `cursor` when given once and non-empty (400
/// when given twice, or longer than 1024 characters), else the trimmed header when non-empty
/// (400 when longer), else none; every refusal is a 400 `invalid_request` with a one-line
/// message.
pub fn event_cursor(data: &[u8]) {
    use crate::api::events::stream_start;
    use crate::store::events::{MAX_CURSOR_CHARS, decode_cursor, encode_cursor};

    if let Ok(text) = std::str::from_utf8(data) {
        match decode_cursor(text) {
            Ok(seq) => {
                assert!(event_cursor_shape(text), "{text:?} decoded to {seq}");
                assert!(seq >= 0);
                assert_eq!(encode_cursor(seq), text);
            }
            Err(_) => assert!(!event_cursor_shape(text), "{text:?} refused"),
        }
    }
    if data.len() >= 8 {
        let seq = i64::from_be_bytes(data[..8].try_into().expect("8 bytes")) & i64::MAX;
        let cursor = encode_cursor(seq);
        assert_eq!(decode_cursor(&cursor), Ok(seq));
        assert!(event_cursor_shape(&cursor), "{cursor}");
    }

    let query = std::str::from_utf8(data)
        .ok()
        .filter(|text| Uri::try_from(format!("/api/operator/v1/events?{text}")).is_ok());
    let header = axum::http::HeaderValue::from_bytes(data).ok();
    let mut headers = axum::http::HeaderMap::new();
    if let Some(value) = &header {
        headers.insert("last-event-id", value.clone());
    }
    let pairs = match query.map(|q| query_pairs_of("/api/operator/v1/events", q)) {
        Some(Some(Ok(pairs))) => pairs,
        Some(Some(Err(_))) | Some(None) => {
            if let Some(query) = query {
                match stream_start(Some(query), &headers) {
                    Ok(start) => panic!("an undecodable query was accepted: {start:?}"),
                    Err(err) => assert_bad_request(&err, &["invalid_request"]),
                }
            }
            return;
        }
        None => Vec::new(),
    };
    let cursors: Vec<&str> = pairs
        .iter()
        .filter(|(name, _)| name == "cursor")
        .map(|(_, value)| value.as_str())
        .collect();
    let from_header: Result<Option<&str>, ()> = match &header {
        None => Ok(None),
        Some(value) => match value.to_str().map(str::trim) {
            Err(_) => Err(()),
            Ok("") => Ok(None),
            Ok(text) if text.chars().count() > MAX_CURSOR_CHARS => Err(()),
            Ok(text) => Ok(Some(text)),
        },
    };
    let expected = match cursors.as_slice() {
        [_, _, ..] => Err(()),
        [cursor] if cursor.chars().count() > MAX_CURSOR_CHARS => Err(()),
        [cursor] if !cursor.is_empty() => Ok(Some(*cursor)),
        _ => from_header,
    };
    match (stream_start(query, &headers), expected) {
        (Ok(start), Ok(expected)) => assert_eq!(start.as_deref(), expected, "{data:?}"),
        (Err(err), Err(())) => assert_bad_request(&err, &["invalid_request"]),
        (got, expected) => panic!("{data:?}: got {got:?}, expected {expected:?}"),
    }
}

/// The query string `query` of a request to `path`, decoded as its route decodes it; `None`
/// when it is not a request target at all.
fn query_pairs_of(path: &str, query: &str) -> Option<Result<Vec<(String, String)>, ApiError>> {
    let uri = Uri::try_from(format!("{path}?{query}")).ok()?;
    Some(
        Query::<Vec<(String, String)>>::try_from_uri(&uri)
            .map(|Query(pairs)| pairs)
            .map_err(|rejection| ApiError::invalid(rejection.body_text())),
    )
}

/// Whether the event stream accepts `data` as a cursor (see [`agent_query_accepted`]).
pub fn event_cursor_accepted(data: &[u8]) -> bool {
    std::str::from_utf8(data).is_ok_and(|text| crate::store::events::decode_cursor(text).is_ok())
}
