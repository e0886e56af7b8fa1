//! The Redis scripts' replies (`crate::redis::reply`): arbitrary bytes decoded into a bounded
//! `redis::Value` tree and fed to every reply parser.

use ::redis::Value;

use crate::engine::{FairShareRefusal, RefusalCode};
use crate::redis::reply::{
    AdmitReply, Asked, ClientReading, Decided, LeaseReply, Reading, TransitionReply, parse_admit,
    parse_batch, parse_client_reading, parse_lease, parse_pair, parse_reaped, parse_rebuilt,
    parse_transition,
};

/// Deepest nesting a decoded reply has (the batch script returns one flat array).
const MAX_DEPTH: usize = 4;
/// Most values one decoded reply holds.
const MAX_NODES: usize = 64;

/// Decodes fuzz bytes into a reply, one tagged value at a time (text-friendly, so seeds are
/// readable): `*` then a count byte (`% 16`: a digit is its value, `:` to `?` are 10 to 15) and
/// that many values is an array; `$` and `+` take the
/// bytes up to the next newline as a bulk string / simple string; `:` takes them as an integer
/// (decimal when it parses, else the bytes little-endian); `_` is nil, `O` OK, `#` a boolean (next
/// byte odd), `,` a double, `%` a map of a count byte's pairs, `~` a set; any other byte is nil.
/// Running out of bytes ends the tree early; depth and size are bounded.
struct Decoder<'a> {
    data: &'a [u8],
    nodes: usize,
}

impl Decoder<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.data.split_first()?;
        self.data = rest;
        Some(first)
    }

    fn line(&mut self) -> &[u8] {
        let end = self
            .data
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(self.data.len());
        let (line, rest) = self.data.split_at(end);
        self.data = rest.get(1..).unwrap_or(&[]);
        line
    }

    fn children(&mut self, depth: usize) -> Vec<Value> {
        let count = self.byte().map_or(0, |b| usize::from(b % 16));
        (0..count)
            .map_while(|_| (!self.data.is_empty()).then(|| self.value(depth + 1)))
            .collect()
    }

    fn value(&mut self, depth: usize) -> Value {
        self.nodes += 1;
        let Some(tag) = self.byte() else {
            return Value::Nil;
        };
        let nested = depth < MAX_DEPTH && self.nodes < MAX_NODES;
        match tag {
            b'*' if nested => Value::Array(self.children(depth)),
            b'~' if nested => Value::Set(self.children(depth)),
            b'%' if nested => {
                let items = self.children(depth);
                let mut items = items.into_iter();
                let mut pairs = Vec::new();
                while let (Some(k), Some(v)) = (items.next(), items.next()) {
                    pairs.push((k, v));
                }
                Value::Map(pairs)
            }
            b'$' => Value::BulkString(self.line().to_vec()),
            b'+' => Value::SimpleString(String::from_utf8_lossy(self.line()).into_owned()),
            b':' => {
                let line = self.line();
                let n = std::str::from_utf8(line)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .unwrap_or_else(|| {
                        let mut raw = [0u8; 8];
                        let len = line.len().min(8);
                        raw[..len].copy_from_slice(&line[..len]);
                        i64::from_le_bytes(raw)
                    });
                Value::Int(n)
            }
            b'O' => Value::Okay,
            b'#' => Value::Boolean(self.byte().is_some_and(|b| b % 2 == 1)),
            b',' => Value::Double(f64::from(self.byte().unwrap_or(0)) / 4.0),
            _ => Value::Nil,
        }
    }
}

/// The reply fuzz bytes decode to (see `redis_reply` for the format).
pub fn redis_reply_value(data: &[u8]) -> Value {
    Decoder { data, nodes: 0 }.value(0)
}

fn bulk(s: &str) -> Value {
    Value::BulkString(s.as_bytes().to_vec())
}

fn int(n: u64) -> Value {
    Value::Int(i64::try_from(n).expect("a parsed count fits an i64"))
}

fn state_text(state: u8) -> &'static str {
    match state {
        b'p' => "p",
        b'a' => "a",
        b'e' => "e",
        other => panic!("a parsed state is not p, a or e: {other}"),
    }
}

/// An admission's reading as a reply's last four elements: the times as decimal text, the counts
/// as integers (the reply parser reads either).
fn encode_reading(reading: &Reading) -> [Value; 4] {
    [
        bulk(&reading.tat_micros.to_string()),
        bulk(&reading.now_micros.to_string()),
        int_or_text(reading.active),
        int_or_text(reading.pending),
    ]
}

/// How the batch script writes an admission decision: its elements in the flat reply.
fn encode_admit(reply: &AdmitReply) -> Vec<Value> {
    match reply {
        AdmitReply::Admitted(reading) => {
            let mut items = vec![bulk("admitted")];
            items.extend(encode_reading(reading));
            items
        }
        AdmitReply::Duplicate => vec![bulk("duplicate")],
        AdmitReply::Lease => vec![bulk("lease")],
        AdmitReply::Recovering => vec![bulk("recovering")],
        AdmitReply::Replay { id, replica } => vec![bulk("replay"), bulk(id), bulk(replica)],
        AdmitReply::Refused {
            code,
            rate_wait_micros,
            capacity,
            reading,
            fair_share,
        } => {
            let mut items = match fair_share {
                None => vec![bulk("refused"), bulk(code.as_str())],
                Some(reason) => vec![
                    bulk("refused_fair"),
                    bulk(code.as_str()),
                    bulk(reason.as_str()),
                ],
            };
            items.extend([int(*rate_wait_micros), Value::Int(i64::from(*capacity))]);
            items.extend(encode_reading(reading));
            items
        }
    }
}

/// How the batch script writes a transition's reply: its elements in the flat reply.
fn encode_transition(reply: TransitionReply) -> Vec<Value> {
    match reply {
        TransitionReply::Moved(from) => vec![bulk("moved"), bulk(state_text(from))],
        TransitionReply::NotAllowed(at) => vec![bulk("not_allowed"), bulk(state_text(at))],
        TransitionReply::Same => vec![bulk("same")],
        TransitionReply::Absent => vec![bulk("absent")],
        TransitionReply::Saturated => vec![bulk("saturated")],
        TransitionReply::Recounting => vec![bulk("recounting")],
    }
}

/// A reply's elements as one decision's reply in a batch: an array's items, or the value alone.
fn items(value: &Value) -> &[Value] {
    match value {
        Value::Array(items) => items,
        other => std::slice::from_ref(other),
    }
}

/// A reply element's text, as the parsers read a reply's word.
fn word(value: &Value) -> Option<&str> {
    match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn encode_lease(reply: LeaseReply) -> Value {
    Value::SimpleString(
        match reply {
            LeaseReply::Renewed => "ok",
            LeaseReply::RenewedRecovering => "ok-recovering",
            LeaseReply::Lapsed => "lapsed",
            LeaseReply::Taken => "taken",
            LeaseReply::Lost => "lost",
        }
        .to_string(),
    )
}

fn assert_error_message(err: &impl std::fmt::Display) {
    let message = err.to_string();
    assert!(
        message.starts_with("unexpected script reply: "),
        "error does not say what it is: {message:?}"
    );
    // The quoted reply is cut, so a huge reply never floods the log.
    assert!(message.len() <= 250, "error is not bounded: {message:?}");
}

/// Arbitrary bytes as a Redis script reply, fed to every parser in `redis::reply`.
///
/// No parser panics. A refusal names a known code other than `client_unconfigured` (the scripts
/// never see an unconfigured identity), and a capacity code always comes with the capacity flag;
/// an admission's reading counts at least the operation it admitted; a replay names a non-empty
/// id and replica; a moved or refused transition names a state `p`, `a` or `e`; a reaped replica
/// is named. Each accepted reply, written back the way the script
/// writes it, parses to the same value; a rejected one has a bounded error naming it. Read as
/// the batch script's flat reply (their kinds taken from the bytes), an array parses only when it
/// splits into one reply per decision, each part exactly as its kind's parser reads it. An array
/// is read as one decision's elements by the admission and transition parsers. The admission,
/// transition and heartbeat replies have disjoint shapes, so at most one of them accepts any
/// reply.
pub fn redis_reply(data: &[u8]) {
    let value = redis_reply_value(data);
    let mut accepted_by = 0;

    match parse_admit(items(&value)) {
        Ok(reply) => {
            accepted_by += 1;
            match &reply {
                AdmitReply::Refused {
                    code,
                    capacity,
                    fair_share,
                    ..
                } => {
                    assert!(RefusalCode::ALL.contains(code));
                    assert_ne!(*code, RefusalCode::ClientUnconfigured);
                    assert!(*capacity || !code.is_capacity(), "{reply:?}");
                    // Only a global pool's refusal has a fair-share reason.
                    if let Some(reason) = fair_share {
                        assert!(FairShareRefusal::of(*code, *reason).is_some(), "{reply:?}");
                    }
                }
                AdmitReply::Replay { id, replica } => {
                    assert!(!id.is_empty() && !replica.is_empty(), "{reply:?}");
                }
                AdmitReply::Admitted(reading) => assert!(reading.active >= 1, "{reply:?}"),
                AdmitReply::Duplicate | AdmitReply::Lease | AdmitReply::Recovering => {}
            }
            assert_eq!(parse_admit(&encode_admit(&reply)), Ok(reply));
        }
        Err(err) => assert_error_message(&err),
    }

    match parse_transition(items(&value)) {
        Ok(reply) => {
            accepted_by += 1;
            // `encode_transition` panics on a state other than p, a or e.
            assert_eq!(parse_transition(&encode_transition(reply)), Ok(reply));
        }
        Err(err) => assert_error_message(&err),
    }

    match parse_lease(&value) {
        Ok(reply) => {
            accepted_by += 1;
            assert_eq!(parse_lease(&encode_lease(reply)), Ok(reply));
            assert_eq!(
                parse_lease(&bulk(match reply {
                    LeaseReply::Renewed => "ok",
                    LeaseReply::RenewedRecovering => "ok-recovering",
                    LeaseReply::Lapsed => "lapsed",
                    LeaseReply::Taken => "taken",
                    LeaseReply::Lost => "lost",
                })),
                Ok(reply)
            );
        }
        Err(err) => assert_error_message(&err),
    }
    assert!(accepted_by <= 1, "{value:?} parses as two kinds of reply");

    match parse_pair(&value) {
        Ok((a, b)) => {
            let again = parse_pair(&Value::Array(vec![int_or_text(a), int_or_text(b)]));
            assert_eq!(again, Ok((a, b)));
        }
        Err(err) => assert_error_message(&err),
    }

    batch(data, &value);

    match parse_reaped(&value) {
        Ok(reaped) => {
            let Value::Array(items) = &value else {
                panic!("a reap reply that is not an array parsed: {value:?}");
            };
            assert_eq!(items.len(), reaped.len() * 2);
            let encoded = reaped
                .iter()
                .flat_map(|(replica, n)| [bulk(replica), int_or_text(*n)])
                .collect();
            let again = parse_reaped(&Value::Array(encoded));
            for (replica, _) in &reaped {
                assert!(!replica.is_empty(), "{reaped:?}");
            }
            assert_eq!(again, Ok(reaped));
        }
        Err(err) => assert_error_message(&err),
    }

    // The rebuild's reply is the reap's, or `moved`.
    match parse_rebuilt(&value) {
        Ok(None) => assert!(
            matches!(&value, Value::BulkString(b) if b == b"moved")
                || matches!(&value, Value::SimpleString(s) if s == "moved"),
            "only `moved` is nothing done: {value:?}"
        ),
        Ok(Some(counted)) => assert_eq!(parse_reaped(&value), Ok(counted)),
        Err(err) => {
            assert_error_message(&err);
            assert!(parse_reaped(&value).is_err(), "{value:?}");
        }
    }

    match parse_client_reading(&value) {
        Ok(reading) => {
            assert_eq!(
                parse_client_reading(&encode_client_reading(&reading)),
                Ok(reading)
            );
        }
        Err(err) => assert_error_message(&err),
    }
}

/// A client reading as Redis sends it: `TIME`'s two texts, the bucket's field, the two counts.
fn encode_client_reading(reading: &ClientReading) -> Value {
    let now = reading.now_micros;
    let bucket = match reading.bucket {
        None => Value::Nil,
        Some(b) => match b.span_micros {
            None => bulk(&b.tat_micros.to_string()),
            Some(span) => bulk(&format!("{} 1 {span}", b.tat_micros)),
        },
    };
    Value::Array(vec![
        Value::Array(vec![
            bulk(&(now / 1_000_000).to_string()),
            bulk(&(now % 1_000_000).to_string()),
        ]),
        bucket,
        Value::Array(vec![
            int_or_text(reading.active),
            int_or_text(reading.pending),
        ]),
    ])
}

/// The batch script's reply, asked as the bytes say (bit 0 of byte `i`: decision `i` is a
/// transition, else an admission): a flat array that parses only when it splits into exactly one
/// reply per decision asked (each its kind's word and that reply's fields), each part exactly as
/// its kind's parser reads it alone; one decision more or fewer does not parse; and what parses,
/// written back, parses the same.
fn batch(data: &[u8], value: &Value) {
    let Value::Array(items) = value else {
        assert!(parse_batch(value, &[Asked::Admit]).is_err());
        return;
    };
    let mut parts = Vec::new();
    let mut at = 0;
    for i in 0..items.len() {
        let kind = match data.get(i) {
            Some(b) if b & 1 == 1 => Asked::Transition,
            _ => Asked::Admit,
        };
        let len = items.get(at).and_then(word).and_then(|w| kind.reply_len(w));
        let Some(part) = len.and_then(|len| items.get(at..at + len)) else {
            break;
        };
        parts.push((kind, part));
        at += part.len();
        if at == items.len() {
            break;
        }
    }
    let splits = at == items.len() && !parts.is_empty();
    let asked: Vec<Asked> = parts.iter().map(|(kind, _)| *kind).collect();
    match parse_batch(value, &asked) {
        Ok(answers) => {
            assert!(splits, "{value:?} parsed as {asked:?} without splitting");
            assert_eq!(answers.len(), parts.len());
            let mut encoded = Vec::new();
            for ((kind, part), answer) in parts.iter().zip(&answers) {
                match (kind, answer) {
                    (Asked::Admit, Ok(Decided::Admit(reply))) => {
                        assert_eq!(parse_admit(part).as_ref(), Ok(reply));
                        encoded.extend(encode_admit(reply));
                    }
                    (Asked::Transition, Ok(Decided::Transition(reply))) => {
                        assert_eq!(parse_transition(part), Ok(*reply));
                        encoded.extend(encode_transition(*reply));
                    }
                    (Asked::Admit, Err(err)) => {
                        assert!(parse_admit(part).is_err());
                        assert_error_message(err);
                        encoded.extend(part.iter().cloned());
                    }
                    (Asked::Transition, Err(err)) => {
                        assert!(parse_transition(part).is_err());
                        assert_error_message(err);
                        encoded.extend(part.iter().cloned());
                    }
                    (asked, answer) => panic!("{asked:?} answered as {answer:?}"),
                }
            }
            assert_eq!(parse_batch(&Value::Array(encoded), &asked), Ok(answers));
            let mut longer = asked.clone();
            longer.push(Asked::Admit);
            assert!(parse_batch(value, &longer).is_err());
            assert!(parse_batch(value, &asked[..asked.len() - 1]).is_err());
        }
        Err(err) => {
            assert!(!splits, "{value:?} refused whole as {asked:?}: {err}");
            assert_error_message(&err);
        }
    }
}

/// A count as the scripts write it: an integer, or its decimal text when it exceeds an i64 (Lua
/// numbers reach Redis as integers; a text count is parsed the same way).
fn int_or_text(n: u64) -> Value {
    i64::try_from(n).map_or_else(|_| bulk(&n.to_string()), Value::Int)
}

/// Whether any parser accepts the reply these bytes decode to (the seed corpus names say which).
pub fn redis_reply_accepted(data: &[u8]) -> bool {
    let value = redis_reply_value(data);
    parse_admit(items(&value)).is_ok()
        || parse_transition(items(&value)).is_ok()
        || parse_lease(&value).is_ok()
        || parse_pair(&value).is_ok()
        || parse_reaped(&value).is_ok()
        || parse_rebuilt(&value).is_ok()
        || parse_client_reading(&value).is_ok()
}

/// Arbitrary bytes as the notices a replica hears (one per line) while it remembers three
/// refusals — amy's own capacity, bob's rate, cat's global limit — made afresh before each
/// notice. Hearing a notice never panics, and it forgets exactly what it may have changed: a
/// notice not of the form `r <client>` or `f <client>` forgets everything; `r amy` or `f amy`
/// ends amy's refusal; `f bob` ends bob's (a release `r bob` does not: it gives no token back);
/// every notice ends cat's; nothing else is forgotten.
pub fn refusal_notices(data: &[u8]) {
    use std::time::{Duration, Instant};

    use crate::config::ClientLimits;
    use crate::redis::memory::{Answer, RefusalMemory};

    let memory = RefusalMemory::default();
    memory.subscribed();
    let limits = ClientLimits {
        requests_per_window: 1,
        window_seconds: 3600,
        active: 1,
        pending: 1,
    };
    let remember = |client: &str, code: RefusalCode| {
        let ticket = memory.ticket(client).expect("the subscription is live");
        memory.remember(
            client,
            ticket,
            Answer {
                code,
                fair_share: None,
                needs_approval: false,
                rate_wait_micros: 3_600_000_000,
                capacity_hint: code.is_capacity().then_some(Duration::from_secs(3600)),
                limits,
                rate: (3_600_000_000, 3_600_000_000),
                reading: Reading {
                    tat_micros: 0,
                    now_micros: 0,
                    active: 1,
                    pending: 0,
                },
            },
        );
    };
    for payload in data.split(|&b| b == b'\n').take(64) {
        remember("amy", RefusalCode::ClientOperationLimit);
        remember("bob", RefusalCode::SubmissionRateLimited);
        remember("cat", RefusalCode::GlobalOperationLimit);
        memory.notice(payload);
        let now = Instant::now();
        let kept = |client: &str| memory.recall(client, false, now).is_some();
        let (kind, client) = match payload {
            [kind @ (b'r' | b'f'), b' ', client @ ..] => (Some(*kind), client),
            _ => (None, &[][..]),
        };
        let Some(kind) = kind else {
            assert!(
                !kept("amy") && !kept("bob") && !kept("cat"),
                "{payload:?} forgot nothing"
            );
            continue;
        };
        assert!(
            !kept("cat"),
            "{payload:?}: a global refusal outlived a release"
        );
        assert_eq!(kept("amy"), client != b"amy", "{payload:?}: amy");
        assert_eq!(
            kept("bob"),
            client != b"bob" || kind == b'r',
            "{payload:?}: bob"
        );
    }
}
