//! The scripts' replies, parsed strictly: a reply that is not exactly one of the shapes a script
//! returns is an error naming what came back, never a guess (a wrong guess could admit work, or
//! free slots twice).
//!
//! Past the usual size only because its tests, for every shape each script returns and for the
//! malformed ones, live beside the parser; the parser itself is about 545 lines, one strict reading
//! per script, which the fuzz target drives whole.

use std::fmt;

use redis::Value;

use crate::engine::{FairShareReason, FairShareRefusal, RefusalCode};

/// The client's bucket and counts just after an admission decision, as the script read them:
/// what its quota is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// The bucket's theoretical arrival time after the decision (µs of Redis time).
    pub tat_micros: u64,
    /// Redis's time at the decision (µs).
    pub now_micros: u64,
    /// The client's live operations after the decision, on every replica.
    pub active: u64,
    /// The client's operations awaiting approval after the decision, on every replica.
    pub pending: u64,
}

/// What the batch script decided for an admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmitReply {
    /// Admitted: the reservation is recorded under the operation's id (the reading counts it).
    Admitted(Reading),
    /// This operation id was admitted before (a retry after a lost reply): nothing counted again.
    Duplicate,
    /// The client's idempotency key already names an operation: `(id, replica)`.
    Replay {
        /// The operation the key names.
        id: String,
        /// The replica that admitted it.
        replica: String,
    },
    /// This replica does not hold its lease (or not in the deployment's epoch): it must not admit.
    Lease,
    /// Redis forgot the deployment and the replicas are registering again: no admission yet.
    Recovering,
    /// Refused: the first check that failed, the rate wait (µs), whether any capacity
    /// dimension is exhausted (then the capacity hint applies too), and the client's reading.
    Refused {
        /// The first check that failed.
        code: RefusalCode,
        /// Microseconds until the client's next rate token.
        rate_wait_micros: u64,
        /// Whether any capacity dimension is exhausted.
        capacity: bool,
        /// The client's bucket and counts (unchanged by the refusal).
        reading: Reading,
        /// Set when the pool of `code` (a global pool's) refused by its fair share, and why: the
        /// script's `refused_fair` reply.
        fair_share: Option<FairShareReason>,
    },
}

/// What the batch script did for a transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransitionReply {
    /// Moved, from the state it was recorded in (`p`, `a` or `e`).
    Moved(u8),
    /// Already in the target state (a retry).
    Same,
    /// No record: released already (a retry, or a lapsed lease).
    Absent,
    /// The recorded state does not allow the move.
    NotAllowed(u8),
    /// No execution slot free.
    Saturated,
    /// Redis forgot the deployment and the replicas are registering again: until all have, the
    /// executing count is not the deployment's, so no slot is taken (the operation stays
    /// approved).
    Recounting,
}

/// What the heartbeat script found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseReply {
    /// Renewed.
    Renewed,
    /// Renewed, while the replicas still register again after Redis forgot the deployment.
    RenewedRecovering,
    /// Nobody holds it.
    Lapsed,
    /// Another process under this replica's name holds it.
    Taken,
    /// Redis no longer holds the epoch this replica registered in: it forgot the deployment.
    Lost,
}

/// What the replace (registration) script did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplaceReply {
    /// Operations of this replica's earlier registration released.
    pub released: u64,
    /// Operations counted now.
    pub counted: u64,
    /// The deployment's epoch this replica is now registered in.
    pub epoch: String,
    /// Whether the replicas are still registering again after Redis forgot.
    pub recovering: bool,
    /// Whether Redis lacked this replica's part of the epoch (its rate debts were applied).
    pub restored: bool,
}

/// A reply of a shape no script returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyError(String);

impl fmt::Display for ReplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected script reply: {}", self.0)
    }
}

impl std::error::Error for ReplyError {}

fn bad(what: &str, value: &Value) -> ReplyError {
    let mut text = format!("{what}: {value:?}");
    // Cut on a character boundary: the reply may quote any text.
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    ReplyError(text)
}

fn text(value: &Value) -> Option<&str> {
    match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn array(value: &Value) -> Option<&[Value]> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

fn int(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(_) | Value::SimpleString(_) => digits(text(value)?),
        _ => None,
    }
}

/// A count written as text: digits only (no sign, no exponent, no fraction), at most 19.
fn digits(s: &str) -> Option<u64> {
    (!s.is_empty() && s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())?
}

fn state(value: &Value) -> Option<u8> {
    match text(value)? {
        "p" => Some(b'p'),
        "a" => Some(b'a'),
        "e" => Some(b'e'),
        _ => None,
    }
}

fn refusal_code(name: &str) -> Option<RefusalCode> {
    RefusalCode::ALL
        .into_iter()
        .find(|code| code.as_str() == name && *code != RefusalCode::ClientUnconfigured)
}

/// A reading: `tat, now, active, pending`, four counts.
fn reading(items: &[Value]) -> Option<Reading> {
    match items {
        [tat, now, active, pending] => Some(Reading {
            tat_micros: int(tat)?,
            now_micros: int(now)?,
            active: int(active)?,
            pending: int(pending)?,
        }),
        _ => None,
    }
}

fn bad_items(what: &str, items: &[Value]) -> ReplyError {
    bad(what, &Value::Array(items.to_vec()))
}

/// How many elements an admission's reply that starts with `head` has in the batch's flat
/// reply (none: no admission reply starts so).
fn admit_len(head: &str) -> Option<usize> {
    match head {
        "admitted" => Some(5),
        "refused" => Some(8),
        "refused_fair" => Some(9),
        "replay" => Some(3),
        "duplicate" | "lease" | "recovering" => Some(1),
        _ => None,
    }
}

/// How many elements a transition's reply that starts with `head` has in the batch's flat reply.
fn transition_len(head: &str) -> Option<usize> {
    match head {
        "moved" | "not_allowed" => Some(2),
        "same" | "absent" | "saturated" | "recounting" => Some(1),
        _ => None,
    }
}

/// Parses an admission's reply: its elements in the batch script's flat reply, e.g.
/// `admitted, tat, now, active, pending`.
pub fn parse_admit(items: &[Value]) -> Result<AdmitReply, ReplyError> {
    let head = items.first().and_then(text);
    if head.and_then(admit_len) != Some(items.len()) {
        return Err(bad_items("admit", items));
    }
    let reply = match head {
        // An admission counts itself: at least one live operation.
        Some("admitted") => match reading(&items[1..]) {
            Some(reading) if reading.active >= 1 => AdmitReply::Admitted(reading),
            _ => return Err(bad_items("admit reading", items)),
        },
        Some("duplicate") => AdmitReply::Duplicate,
        Some("lease") => AdmitReply::Lease,
        Some("recovering") => AdmitReply::Recovering,
        Some("replay") => match (text(&items[1]), text(&items[2])) {
            (Some(id), Some(replica)) if !id.is_empty() && !replica.is_empty() => {
                AdmitReply::Replay {
                    id: id.to_string(),
                    replica: replica.to_string(),
                }
            }
            _ => return Err(bad_items("admit replay", items)),
        },
        Some(head @ ("refused" | "refused_fair")) => {
            let code = text(&items[1]).and_then(refusal_code);
            // `refused_fair`: the reason comes after the code, and only a global pool's code
            // has one.
            let (fair_share, rest) = if head == "refused_fair" {
                let reason = text(&items[2]).and_then(FairShareReason::parse);
                match (code, reason) {
                    (Some(code), Some(reason)) if FairShareRefusal::of(code, reason).is_some() => {
                        (Some(reason), &items[3..])
                    }
                    _ => return Err(bad_items("admit refusal", items)),
                }
            } else {
                (None, &items[2..])
            };
            let wait = int(&rest[0]);
            let capacity = match int(&rest[1]) {
                Some(0) => Some(false),
                Some(1) => Some(true),
                _ => None,
            };
            match (code, wait, capacity, reading(&rest[2..])) {
                // A capacity code always means a capacity dimension is exhausted.
                (Some(code), Some(rate_wait_micros), Some(capacity), Some(reading))
                    if capacity || !code.is_capacity() =>
                {
                    AdmitReply::Refused {
                        code,
                        rate_wait_micros,
                        capacity,
                        reading,
                        fair_share,
                    }
                }
                _ => return Err(bad_items("admit refusal", items)),
            }
        }
        _ => return Err(bad_items("admit", items)),
    };
    Ok(reply)
}

/// Parses a transition's reply: its elements in the batch script's flat reply, e.g.
/// `moved, p`.
pub fn parse_transition(items: &[Value]) -> Result<TransitionReply, ReplyError> {
    let head = items.first().and_then(text);
    if head.and_then(transition_len) != Some(items.len()) {
        return Err(bad_items("transition", items));
    }
    let from = || state(&items[1]).ok_or_else(|| bad_items("transition", items));
    Ok(match head {
        Some("moved") => TransitionReply::Moved(from()?),
        Some("not_allowed") => TransitionReply::NotAllowed(from()?),
        Some("same") => TransitionReply::Same,
        Some("absent") => TransitionReply::Absent,
        Some("saturated") => TransitionReply::Saturated,
        Some("recounting") => TransitionReply::Recounting,
        _ => return Err(bad_items("transition", items)),
    })
}

/// What a decision in a batch is, so its reply is parsed as that kind's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// An admission: its reply is an admission reply ([`parse_admit`]).
    Admit,
    /// A transition: its reply is a transition reply ([`parse_transition`]).
    Transition,
}

impl Asked {
    /// How many elements this kind's reply starting with `head` has (none: no reply of this
    /// kind starts so).
    pub fn reply_len(self, head: &str) -> Option<usize> {
        match self {
            Asked::Admit => admit_len(head),
            Asked::Transition => transition_len(head),
        }
    }
}

/// The batch script's answer to one decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decided {
    /// An admission's.
    Admit(AdmitReply),
    /// A transition's.
    Transition(TransitionReply),
}

/// Parses the batch script's reply: one flat array, each decision's reply in order (its kind's
/// word, then that reply's fields), each as strictly as alone. A reply that does not split
/// into exactly one reply per decision asked (not an array, a word no reply of the decision's
/// kind starts with, a reply cut short, elements left over) is an error for all of them; a
/// decision's reply that splits but does not read (a bad count, an unknown code) is an error for
/// that decision only.
pub fn parse_batch(
    value: &Value,
    asked: &[Asked],
) -> Result<Vec<Result<Decided, ReplyError>>, ReplyError> {
    let items = array(value).ok_or_else(|| bad("batch", value))?;
    if asked.is_empty() {
        return Err(bad("batch", value));
    }
    let mut answers = Vec::with_capacity(asked.len());
    let mut at = 0;
    for &kind in asked {
        let len = items
            .get(at)
            .and_then(text)
            .and_then(|head| kind.reply_len(head));
        let Some(part) = len.and_then(|len| items.get(at..at + len)) else {
            return Err(bad("batch", value));
        };
        answers.push(match kind {
            Asked::Admit => parse_admit(part).map(Decided::Admit),
            Asked::Transition => parse_transition(part).map(Decided::Transition),
        });
        at += part.len();
    }
    if at != items.len() {
        return Err(bad("batch", value));
    }
    Ok(answers)
}

/// Parses the heartbeat script's reply.
pub fn parse_lease(value: &Value) -> Result<LeaseReply, ReplyError> {
    match text(value) {
        Some("ok") => Ok(LeaseReply::Renewed),
        Some("ok-recovering") => Ok(LeaseReply::RenewedRecovering),
        Some("lapsed") => Ok(LeaseReply::Lapsed),
        Some("taken") => Ok(LeaseReply::Taken),
        Some("lost") => Ok(LeaseReply::Lost),
        _ => Err(bad("heartbeat", value)),
    }
}

/// Parses a reply of counts: `{a, b}` (the replace script).
pub fn parse_pair(value: &Value) -> Result<(u64, u64), ReplyError> {
    match array(value) {
        Some([a, b]) => match (int(a), int(b)) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(bad("pair", value)),
        },
        _ => Err(bad("pair", value)),
    }
}

fn flag(value: &Value) -> Option<bool> {
    match int(value)? {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

/// What the replace script did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replaced {
    /// The replica is registered.
    Registered(ReplaceReply),
    /// Nothing: Redis lacks this replica's key records (it forgot the deployment after the
    /// replica checked, or during or after their restore); restore them and register again.
    Lacking,
}

/// Parses the replace script's reply: `{released, counted, epoch, recovering, restored}`, or
/// `lacking`.
pub fn parse_replace(value: &Value) -> Result<Replaced, ReplyError> {
    if text(value) == Some("lacking") {
        return Ok(Replaced::Lacking);
    }
    match array(value) {
        Some([released, counted, epoch, recovering, restored]) => {
            match (
                int(released),
                int(counted),
                text(epoch),
                flag(recovering),
                flag(restored),
            ) {
                (Some(released), Some(counted), Some(epoch), Some(recovering), Some(restored))
                    if !epoch.is_empty()
                        && epoch.len() <= 64
                        && epoch.bytes().all(|b| b.is_ascii_hexdigit()) =>
                {
                    Ok(Replaced::Registered(ReplaceReply {
                        released,
                        counted,
                        epoch: epoch.to_string(),
                        recovering,
                        restored,
                    }))
                }
                _ => Err(bad("replace", value)),
            }
        }
        _ => Err(bad("replace", value)),
    }
}

/// Parses the reap script's reply: each lapsed replica and how many operations it held.
pub fn parse_reaped(value: &Value) -> Result<Vec<(String, u64)>, ReplyError> {
    let items = array(value).ok_or_else(|| bad("reap", value))?;
    if items.len() % 2 != 0 {
        return Err(bad("reap", value));
    }
    items
        .chunks(2)
        .map(|pair| match (text(&pair[0]), int(&pair[1])) {
            (Some(replica), Some(n)) if !replica.is_empty() => Ok((replica.to_string(), n)),
            _ => Err(bad("reap", value)),
        })
        .collect()
}

/// Parses a reply that names replicas (the reap script asked only to name the replicas whose
/// leases lapsed): each a non-empty name.
pub fn parse_names(value: &Value) -> Result<Vec<String>, ReplyError> {
    let items = array(value).ok_or_else(|| bad("names", value))?;
    items
        .iter()
        .map(|item| match text(item) {
            Some(name) if !name.is_empty() => Ok(name.to_string()),
            _ => Err(bad("names", value)),
        })
        .collect()
}

/// Parses the rebuild script's reply: each replica whose work it counted and how many
/// operations, or `None` for `moved` (nothing done: Redis holds another epoch).
pub fn parse_rebuilt(value: &Value) -> Result<Option<Vec<(String, u64)>>, ReplyError> {
    if text(value) == Some("moved") {
        return Ok(None);
    }
    parse_reaped(value)
        .map(Some)
        .map_err(|_| bad("rebuild", value))
}

/// A client's rate bucket as its field of the buckets hash holds it: `"<TAT> <interval> <span>"`
/// (µs), or a bare TAT from an older build, whose rate is unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBucket {
    /// The theoretical arrival time (µs of Redis time).
    pub tat_micros: u64,
    /// The burst span the TAT was written under (µs), when the field says.
    pub span_micros: Option<u64>,
}

/// A client's bucket and counts read outside any decision (for the quota of an answer that
/// decided nothing, such as a replay): the `EXEC` reply of `TIME`, `HGET` of its bucket (nil:
/// none) and `HMGET` of its active and pending counts (nil: zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientReading {
    /// Redis's time at the reading (µs).
    pub now_micros: u64,
    /// The client's bucket, if Redis holds one.
    pub bucket: Option<StoredBucket>,
    /// The client's live operations, on every replica.
    pub active: u64,
    /// The client's operations awaiting approval, on every replica.
    pub pending: u64,
}

fn stored_bucket(value: &Value) -> Option<Option<StoredBucket>> {
    if let Value::Nil = value {
        return Some(None);
    }
    let words: Vec<&str> = text(value)?.split(' ').collect();
    let (tat, span_micros) = match words[..] {
        [tat] => (tat, None),
        [tat, interval, span] => {
            digits(interval)?;
            (tat, Some(digits(span)?))
        }
        _ => return None,
    };
    Some(Some(StoredBucket {
        tat_micros: digits(tat)?,
        span_micros,
    }))
}

fn count_or_zero(value: &Value) -> Option<u64> {
    match value {
        Value::Nil => Some(0),
        other => int(other),
    }
}

/// Parses a client's reading (see [`ClientReading`]): `{{seconds, microseconds}, bucket or nil,
/// {active or nil, pending or nil}}`.
pub fn parse_client_reading(value: &Value) -> Result<ClientReading, ReplyError> {
    let parsed = match array(value) {
        Some([time, bucket, counts]) => match (array(time), array(counts)) {
            (Some([secs, micros]), Some([active, pending])) => (|| {
                let (secs, micros) = (int(secs)?, int(micros)?);
                if micros >= 1_000_000 {
                    return None;
                }
                Some(ClientReading {
                    now_micros: secs.checked_mul(1_000_000)?.checked_add(micros)?,
                    bucket: stored_bucket(bucket)?,
                    active: count_or_zero(active)?,
                    pending: count_or_zero(pending)?,
                })
            })(),
            _ => None,
        },
        _ => None,
    };
    parsed.ok_or_else(|| bad("client reading", value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn value() -> impl Strategy<Value = Value> {
        let word = prop_oneof![
            Just("admitted".to_string()),
            Just("refused".to_string()),
            Just("replay".to_string()),
            Just("moved".to_string()),
            Just("client_pending_limit".to_string()),
            Just("p".to_string()),
            "[a-z_0-9 .-]{0,24}",
        ];
        let leaf = prop_oneof![
            Just(Value::Nil),
            any::<i64>().prop_map(Value::Int),
            word.prop_map(|w| Value::BulkString(w.into_bytes())),
            proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::BulkString),
        ];
        leaf.prop_recursive(3, 24, 5, |inner| {
            proptest::collection::vec(inner, 0..5).prop_map(Value::Array)
        })
    }

    proptest! {
        #[test]
        fn no_reply_makes_a_parser_panic_and_what_parses_is_well_formed(v in value()) {
            let items = match &v {
                Value::Array(items) => items.as_slice(),
                other => std::slice::from_ref(other),
            };
            if let Ok(AdmitReply::Refused { code, capacity, .. }) = parse_admit(items) {
                prop_assert!(capacity || !code.is_capacity());
                prop_assert!(code != RefusalCode::ClientUnconfigured);
            }
            let _ = parse_transition(items);
            let _ = parse_batch(&v, &[Asked::Admit, Asked::Transition]);
            let _ = parse_lease(&v);
            let _ = parse_pair(&v);
            let _ = parse_replace(&v);
            if let Ok(reaped) = parse_reaped(&v) {
                prop_assert!(reaped.iter().all(|(replica, _)| !replica.is_empty()));
            }
        }
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn every_admit_shape_parses_and_nothing_else_does() {
        let ok = |items: Vec<Value>| parse_admit(&items);
        let with = |mut head: Vec<Value>, reading: [Value; 4]| {
            head.extend(reading);
            head
        };
        let at = |tat: &str, now: &str, a: i64, p: i64| {
            [bulk(tat), bulk(now), Value::Int(a), Value::Int(p)]
        };
        let read = Reading {
            tat_micros: 1_700_000_020_000_000,
            now_micros: 1_700_000_000_000_000,
            active: 2,
            pending: 1,
        };
        assert_eq!(
            ok(with(
                vec![bulk("admitted")],
                at("1700000020000000", "1700000000000000", 2, 1)
            )),
            Ok(AdmitReply::Admitted(read))
        );
        assert_eq!(ok(vec![bulk("duplicate")]), Ok(AdmitReply::Duplicate));
        assert_eq!(ok(vec![bulk("lease")]), Ok(AdmitReply::Lease));
        assert_eq!(
            ok(vec![bulk("replay"), bulk("op-1"), bulk("r2")]),
            Ok(AdmitReply::Replay {
                id: "op-1".into(),
                replica: "r2".into()
            })
        );
        assert_eq!(
            ok(with(
                vec![
                    bulk("refused"),
                    bulk("client_pending_limit"),
                    bulk("0"),
                    Value::Int(1),
                ],
                at("1700000020000000", "1700000000000000", 2, 1)
            )),
            Ok(AdmitReply::Refused {
                code: RefusalCode::ClientPendingLimit,
                rate_wait_micros: 0,
                capacity: true,
                reading: read,
                fair_share: None,
            })
        );
        assert_eq!(
            ok(with(
                vec![
                    bulk("refused_fair"),
                    bulk("global_execution_limit"),
                    bulk("share"),
                    bulk("0"),
                    Value::Int(1),
                ],
                at("1700000020000000", "1700000000000000", 2, 1)
            )),
            Ok(AdmitReply::Refused {
                code: RefusalCode::GlobalExecutionLimit,
                rate_wait_micros: 0,
                capacity: true,
                reading: read,
                fair_share: Some(FairShareReason::Share),
            })
        );
        let fair = |code: &str, reason: &str| {
            with(
                vec![
                    bulk("refused_fair"),
                    bulk(code),
                    bulk(reason),
                    bulk("0"),
                    Value::Int(1),
                ],
                at("1", "1", 1, 0),
            )
        };
        assert!(ok(fair("global_operation_limit", "reserve")).is_ok());
        // A reason only a global pool's code has, and only the two reasons there are.
        assert!(ok(fair("client_operation_limit", "reserve")).is_err());
        assert!(ok(fair("global_operation_limit", "fair")).is_err());
        // A plain refusal never carries one, nor a fair one lacks it.
        assert!(
            ok(with(
                vec![
                    bulk("refused"),
                    bulk("global_operation_limit"),
                    bulk("share"),
                    bulk("0"),
                    Value::Int(1),
                ],
                at("1", "1", 1, 0)
            ))
            .is_err()
        );
        assert!(
            ok(with(
                vec![
                    bulk("refused_fair"),
                    bulk("global_operation_limit"),
                    bulk("0"),
                    Value::Int(1),
                ],
                at("1", "1", 1, 0)
            ))
            .is_err()
        );
        let refused = |code: &str, wait: &str, capacity: i64| {
            vec![
                bulk("refused"),
                bulk(code),
                bulk(wait),
                Value::Int(capacity),
            ]
        };
        for bad_reply in [
            vec![],
            vec![bulk("admitted")],
            vec![bulk("admitted"), bulk("x")],
            with(vec![bulk("admitted")], at("1", "1", 0, 0)),
            with(vec![bulk("admitted")], at("1", "-1", 1, 0)),
            with(vec![bulk("admitted")], at("1", "1", 1, -1)),
            with(vec![bulk("admitted")], at("1.5", "1", 1, 0)),
            // The old nested reading, and a reading cut short or too long.
            vec![bulk("admitted"), Value::Array(at("1", "1", 1, 0).to_vec())],
            vec![bulk("admitted"), bulk("1"), bulk("1"), Value::Int(1)],
            with(vec![bulk("admitted")], at("1", "1", 1, 0))
                .into_iter()
                .chain([Value::Int(0)])
                .collect(),
            refused("client_pending_limit", "0", 1),
            with(
                refused("client_pending_limit", "0", 1),
                [bulk("1"), bulk("1"), bulk("1"), bulk("x")],
            ),
            vec![bulk("replay"), bulk(""), bulk("r")],
            vec![bulk("replay"), bulk("op-1")],
            vec![bulk("duplicate"), bulk("op-1")],
            with(refused("client_unconfigured", "0", 0), at("1", "1", 0, 0)),
            with(
                refused("client_operation_limit", "0", 0),
                at("1", "1", 0, 0),
            ),
            with(
                refused("submission_rate_limited", "-1", 0),
                at("1", "1", 0, 0),
            ),
            with(
                refused("submission_rate_limited", "1e9", 0),
                at("1", "1", 0, 0),
            ),
            with(
                refused("submission_rate_limited", "5", 2),
                at("1", "1", 0, 0),
            ),
            vec![bulk("admit")],
            vec![bulk("moved"), bulk("p")],
        ] {
            assert!(ok(bad_reply.clone()).is_err(), "{bad_reply:?}");
        }
        assert!(parse_admit(&[Value::Array(vec![bulk("admitted")])]).is_err());
    }

    #[test]
    fn transition_lease_and_count_replies_are_strict() {
        let t = |items: Vec<Value>| parse_transition(&items);
        assert_eq!(
            t(vec![bulk("moved"), bulk("p")]),
            Ok(TransitionReply::Moved(b'p'))
        );
        assert_eq!(t(vec![bulk("absent")]), Ok(TransitionReply::Absent));
        assert_eq!(t(vec![bulk("recounting")]), Ok(TransitionReply::Recounting));
        assert!(t(vec![bulk("recounting"), bulk("e")]).is_err());
        assert!(t(vec![bulk("recovering")]).is_err());
        assert_eq!(
            t(vec![bulk("not_allowed"), bulk("e")]),
            Ok(TransitionReply::NotAllowed(b'e'))
        );
        assert!(t(vec![bulk("moved"), bulk("x")]).is_err());
        assert!(t(vec![bulk("moved")]).is_err());
        assert!(t(vec![bulk("same"), bulk("p")]).is_err());
        assert!(t(vec![bulk("duplicate")]).is_err());
        assert_eq!(parse_lease(&bulk("ok")), Ok(LeaseReply::Renewed));
        assert_eq!(
            parse_lease(&bulk("ok-recovering")),
            Ok(LeaseReply::RenewedRecovering)
        );
        // The admission's word for a recovery is not a renewal.
        assert!(parse_lease(&bulk("recovering")).is_err());
        assert!(parse_lease(&bulk("OK")).is_err());
        assert_eq!(
            parse_pair(&Value::Array(vec![Value::Int(2), Value::Int(3)])),
            Ok((2, 3))
        );
        assert!(parse_pair(&Value::Array(vec![Value::Int(-2), Value::Int(3)])).is_err());
        assert_eq!(
            parse_reaped(&Value::Array(vec![bulk("r1"), Value::Int(4)])),
            Ok(vec![("r1".to_string(), 4)])
        );
        assert!(parse_reaped(&Value::Array(vec![bulk("r1")])).is_err());
        assert_eq!(parse_replace(&bulk("lacking")), Ok(Replaced::Lacking));
        assert_eq!(
            parse_replace(&Value::Array(vec![
                Value::Int(1),
                Value::Int(2),
                bulk("0a"),
                Value::Int(0),
                Value::Int(1)
            ])),
            Ok(Replaced::Registered(ReplaceReply {
                released: 1,
                counted: 2,
                epoch: "0a".to_string(),
                recovering: false,
                restored: true,
            }))
        );
        assert!(parse_replace(&bulk("Lacking")).is_err());
        assert!(parse_replace(&Value::Array(vec![bulk("lacking")])).is_err());
    }

    #[test]
    fn a_client_reading_is_time_bucket_and_counts_or_refused_whole() {
        let time = |s: &str, us: &str| Value::Array(vec![bulk(s), bulk(us)]);
        let counts = |a: Value, p: Value| Value::Array(vec![a, p]);
        let reading =
            |t: Value, b: Value, c: Value| parse_client_reading(&Value::Array(vec![t, b, c]));
        assert_eq!(
            reading(
                time("1700000000", "250"),
                bulk("1700000001000000 1000000 60000000"),
                counts(bulk("3"), Value::Nil)
            ),
            Ok(ClientReading {
                now_micros: 1_700_000_000_000_250,
                bucket: Some(StoredBucket {
                    tat_micros: 1_700_000_001_000_000,
                    span_micros: Some(60_000_000),
                }),
                active: 3,
                pending: 0,
            })
        );
        // A bare TAT (an older build's) has no known rate; no bucket and no counts read as none.
        assert_eq!(
            reading(time("5", "0"), bulk("7"), counts(Value::Nil, Value::Nil)),
            Ok(ClientReading {
                now_micros: 5_000_000,
                bucket: Some(StoredBucket {
                    tat_micros: 7,
                    span_micros: None,
                }),
                active: 0,
                pending: 0,
            })
        );
        assert_eq!(
            reading(time("5", "0"), Value::Nil, counts(Value::Int(1), bulk("1"))).map(|r| r.bucket),
            Ok(None)
        );
        for (t, b, c) in [
            (
                time("5", "1000000"),
                Value::Nil,
                counts(Value::Nil, Value::Nil),
            ),
            (time("5", "-1"), Value::Nil, counts(Value::Nil, Value::Nil)),
            (time("5", "0"), bulk("7 1"), counts(Value::Nil, Value::Nil)),
            (
                time("5", "0"),
                bulk("7  1 2"),
                counts(Value::Nil, Value::Nil),
            ),
            (time("5", "0"), bulk("7.5"), counts(Value::Nil, Value::Nil)),
            (time("5", "0"), bulk(""), counts(Value::Nil, Value::Nil)),
            (time("5", "0"), Value::Nil, counts(bulk("x"), Value::Nil)),
            (time("5", "0"), Value::Nil, Value::Array(vec![Value::Nil])),
            (Value::Nil, Value::Nil, counts(Value::Nil, Value::Nil)),
            (
                time("99999999999999999", "0"),
                Value::Nil,
                counts(Value::Nil, Value::Nil),
            ),
        ] {
            let err = reading(t.clone(), b.clone(), c.clone()).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with("unexpected script reply: client reading: "),
                "{err}"
            );
        }
        assert!(parse_client_reading(&Value::Array(vec![time("5", "0"), Value::Nil])).is_err());
    }

    #[test]
    fn a_batch_reply_splits_into_one_reply_per_decision_or_is_refused_whole() {
        use Asked::{Admit, Transition};
        let admitted = [
            bulk("admitted"),
            Value::Int(20),
            Value::Int(10),
            Value::Int(1),
            Value::Int(0),
        ];
        let reading = Reading {
            tat_micros: 20,
            now_micros: 10,
            active: 1,
            pending: 0,
        };
        let flat = |parts: &[&[Value]]| Value::Array(parts.concat());
        let moved = [bulk("moved"), bulk("a")];
        let value = flat(&[&admitted, &moved, &[bulk("duplicate")], &[bulk("absent")]]);
        assert_eq!(
            parse_batch(&value, &[Admit, Transition, Admit, Transition]),
            Ok(vec![
                Ok(Decided::Admit(AdmitReply::Admitted(reading))),
                Ok(Decided::Transition(TransitionReply::Moved(b'a'))),
                Ok(Decided::Admit(AdmitReply::Duplicate)),
                Ok(Decided::Transition(TransitionReply::Absent)),
            ])
        );
        // A reply that splits but does not read is that decision's error alone.
        let zero_active = [
            bulk("admitted"),
            Value::Int(20),
            Value::Int(10),
            Value::Int(0),
            Value::Int(0),
        ];
        let answers = parse_batch(&flat(&[&zero_active, &moved]), &[Admit, Transition]).unwrap();
        assert!(answers[0].is_err());
        assert_eq!(
            answers[1],
            Ok(Decided::Transition(TransitionReply::Moved(b'a')))
        );
        // What does not split is refused whole: too few or too many decisions asked, a word of
        // the other kind, a reply cut short, elements left over, nothing asked, not an array.
        for (value, asked) in [
            (flat(&[&admitted, &moved]), vec![Admit]),
            (
                flat(&[&admitted, &moved]),
                vec![Admit, Transition, Transition],
            ),
            (flat(&[&admitted, &moved]), vec![Transition, Admit]),
            (flat(&[&admitted[..4]]), vec![Admit]),
            (flat(&[&admitted, &[Value::Int(1)]]), vec![Admit]),
            (flat(&[]), vec![]),
            (flat(&[]), vec![Admit]),
            (
                Value::Array(vec![Value::Array(admitted.to_vec())]),
                vec![Admit],
            ),
            (bulk("admitted"), vec![Admit]),
        ] {
            assert!(
                parse_batch(&value, &asked).is_err(),
                "{value:?} as {asked:?}"
            );
        }
    }
}
