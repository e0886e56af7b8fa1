//! The scripts' replies, parsed strictly: a reply that is not exactly one of the shapes a script
//! returns is an error naming what came back, never a guess (a wrong guess could admit work, or
//! free slots twice).

use std::fmt;

use redis::Value;

use crate::engine::RefusalCode;

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
}

/// What the heartbeat script found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseReply {
    /// Renewed.
    Renewed,
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
        Value::BulkString(_) | Value::SimpleString(_) => {
            let s = text(value)?;
            // Digits only: no sign, no exponent, no fraction.
            (!s.is_empty() && s.len() <= 19 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())?
        }
        _ => None,
    }
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

/// A reading: `{tat, now, active, pending}`, four counts.
fn reading(value: &Value) -> Option<Reading> {
    match array(value)? {
        [tat, now, active, pending] => Some(Reading {
            tat_micros: int(tat)?,
            now_micros: int(now)?,
            active: int(active)?,
            pending: int(pending)?,
        }),
        _ => None,
    }
}

/// Parses an admission's reply (one element of the batch script's).
pub fn parse_admit(value: &Value) -> Result<AdmitReply, ReplyError> {
    let items = array(value).ok_or_else(|| bad("admit", value))?;
    let head = items.first().and_then(text);
    let reply = match (head, items.len()) {
        // An admission counts itself: at least one live operation.
        (Some("admitted"), 2) => match reading(&items[1]) {
            Some(reading) if reading.active >= 1 => AdmitReply::Admitted(reading),
            _ => return Err(bad("admit reading", value)),
        },
        (Some("duplicate"), 1) => AdmitReply::Duplicate,
        (Some("lease"), 1) => AdmitReply::Lease,
        (Some("recovering"), 1) => AdmitReply::Recovering,
        (Some("replay"), 3) => match (text(&items[1]), text(&items[2])) {
            (Some(id), Some(replica)) if !id.is_empty() && !replica.is_empty() => {
                AdmitReply::Replay {
                    id: id.to_string(),
                    replica: replica.to_string(),
                }
            }
            _ => return Err(bad("admit replay", value)),
        },
        (Some("refused"), 5) => {
            let code = text(&items[1]).and_then(refusal_code);
            let wait = int(&items[2]);
            let capacity = match int(&items[3]) {
                Some(0) => Some(false),
                Some(1) => Some(true),
                _ => None,
            };
            match (code, wait, capacity, reading(&items[4])) {
                // A capacity code always means a capacity dimension is exhausted.
                (Some(code), Some(rate_wait_micros), Some(capacity), Some(reading))
                    if capacity || !code.is_capacity() =>
                {
                    AdmitReply::Refused {
                        code,
                        rate_wait_micros,
                        capacity,
                        reading,
                    }
                }
                _ => return Err(bad("admit refusal", value)),
            }
        }
        _ => return Err(bad("admit", value)),
    };
    Ok(reply)
}

/// Parses a transition's reply (one element of the batch script's).
pub fn parse_transition(value: &Value) -> Result<TransitionReply, ReplyError> {
    let items = array(value).ok_or_else(|| bad("transition", value))?;
    let reply = match (items.first().and_then(text), items.len()) {
        (Some("moved"), 2) => {
            TransitionReply::Moved(state(&items[1]).ok_or_else(|| bad("transition", value))?)
        }
        (Some("not_allowed"), 2) => {
            TransitionReply::NotAllowed(state(&items[1]).ok_or_else(|| bad("transition", value))?)
        }
        (Some("same"), 1) => TransitionReply::Same,
        (Some("absent"), 1) => TransitionReply::Absent,
        (Some("saturated"), 1) => TransitionReply::Saturated,
        _ => return Err(bad("transition", value)),
    };
    Ok(reply)
}

/// What a decision in a batch is, so its reply is parsed as that kind's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// An admission: its reply is an admission reply ([`parse_admit`]).
    Admit,
    /// A transition: its reply is a transition reply ([`parse_transition`]).
    Transition,
}

/// The batch script's answer to one decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decided {
    /// An admission's.
    Admit(AdmitReply),
    /// A transition's.
    Transition(TransitionReply),
}

/// Parses the batch script's reply: one reply per decision asked, in order, each as strictly as
/// alone. A reply that is not an array of exactly that many is an error for all of them; one
/// decision's unreadable reply is an error for that decision only.
pub fn parse_batch(
    value: &Value,
    asked: &[Asked],
) -> Result<Vec<Result<Decided, ReplyError>>, ReplyError> {
    match array(value) {
        Some(items) if items.len() == asked.len() && !items.is_empty() => Ok(items
            .iter()
            .zip(asked)
            .map(|(item, asked)| match asked {
                Asked::Admit => parse_admit(item).map(Decided::Admit),
                Asked::Transition => parse_transition(item).map(Decided::Transition),
            })
            .collect()),
        _ => Err(bad("batch", value)),
    }
}

/// Parses the heartbeat script's reply.
pub fn parse_lease(value: &Value) -> Result<LeaseReply, ReplyError> {
    match text(value) {
        Some("ok") => Ok(LeaseReply::Renewed),
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

/// Parses the replace script's reply: `{released, counted, epoch, recovering, restored}`.
pub fn parse_replace(value: &Value) -> Result<ReplaceReply, ReplyError> {
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
                    Ok(ReplaceReply {
                        released,
                        counted,
                        epoch: epoch.to_string(),
                        recovering,
                        restored,
                    })
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
            if let Ok(AdmitReply::Refused { code, capacity, .. }) = parse_admit(&v) {
                prop_assert!(capacity || !code.is_capacity());
                prop_assert!(code != RefusalCode::ClientUnconfigured);
            }
            let _ = parse_transition(&v);
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
        let ok = |items: Vec<Value>| parse_admit(&Value::Array(items));
        let at = |tat: &str, now: &str, a: i64, p: i64| {
            Value::Array(vec![bulk(tat), bulk(now), Value::Int(a), Value::Int(p)])
        };
        let read = Reading {
            tat_micros: 1_700_000_020_000_000,
            now_micros: 1_700_000_000_000_000,
            active: 2,
            pending: 1,
        };
        assert_eq!(
            ok(vec![
                bulk("admitted"),
                at("1700000020000000", "1700000000000000", 2, 1)
            ]),
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
            ok(vec![
                bulk("refused"),
                bulk("client_pending_limit"),
                bulk("0"),
                Value::Int(1),
                at("1700000020000000", "1700000000000000", 2, 1)
            ]),
            Ok(AdmitReply::Refused {
                code: RefusalCode::ClientPendingLimit,
                rate_wait_micros: 0,
                capacity: true,
                reading: read,
            })
        );
        for bad_reply in [
            vec![],
            vec![bulk("admitted")],
            vec![bulk("admitted"), bulk("x")],
            vec![bulk("admitted"), at("1", "1", 0, 0)],
            vec![bulk("admitted"), at("1", "-1", 1, 0)],
            vec![bulk("admitted"), at("1", "1", 1, -1)],
            vec![bulk("admitted"), at("1.5", "1", 1, 0)],
            vec![
                bulk("admitted"),
                Value::Array(vec![bulk("1"), bulk("1"), Value::Int(1)]),
            ],
            vec![
                bulk("refused"),
                bulk("client_pending_limit"),
                bulk("0"),
                Value::Int(1),
            ],
            vec![
                bulk("refused"),
                bulk("client_pending_limit"),
                bulk("0"),
                Value::Int(1),
                bulk("1 1 1 1"),
            ],
            vec![bulk("replay"), bulk(""), bulk("r")],
            vec![
                bulk("refused"),
                bulk("client_unconfigured"),
                bulk("0"),
                Value::Int(0),
                at("1", "1", 0, 0),
            ],
            vec![
                bulk("refused"),
                bulk("client_operation_limit"),
                bulk("0"),
                Value::Int(0),
                at("1", "1", 0, 0),
            ],
            vec![
                bulk("refused"),
                bulk("submission_rate_limited"),
                bulk("-1"),
                Value::Int(0),
                at("1", "1", 0, 0),
            ],
            vec![
                bulk("refused"),
                bulk("submission_rate_limited"),
                bulk("1e9"),
                Value::Int(0),
                at("1", "1", 0, 0),
            ],
            vec![
                bulk("refused"),
                bulk("submission_rate_limited"),
                bulk("5"),
                Value::Int(2),
                at("1", "1", 0, 0),
            ],
            vec![bulk("admit")],
        ] {
            assert!(ok(bad_reply.clone()).is_err(), "{bad_reply:?}");
        }
        assert!(parse_admit(&bulk("admitted")).is_err());
    }

    #[test]
    fn transition_lease_and_count_replies_are_strict() {
        let t = |items: Vec<Value>| parse_transition(&Value::Array(items));
        assert_eq!(
            t(vec![bulk("moved"), bulk("p")]),
            Ok(TransitionReply::Moved(b'p'))
        );
        assert_eq!(t(vec![bulk("absent")]), Ok(TransitionReply::Absent));
        assert_eq!(
            t(vec![bulk("not_allowed"), bulk("e")]),
            Ok(TransitionReply::NotAllowed(b'e'))
        );
        assert!(t(vec![bulk("moved"), bulk("x")]).is_err());
        assert!(t(vec![bulk("moved")]).is_err());
        assert_eq!(parse_lease(&bulk("ok")), Ok(LeaseReply::Renewed));
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
    }
}
