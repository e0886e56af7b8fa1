//! The Operator V1 event log: one row per revision change of a request (an operation that needs
//! an operator's approval), written in the same transaction as the change itself, so the log and
//! the operations never disagree, after a crash either.
//!
//! - **What an event says** ([`StoredEvent`]): its sequence (`seq`, the cursor), its kind (from
//!   the contract's closed enum only, [`EventKind`]), the request, the request's revision and
//!   Operator V1 status after the change ([`RequestStatus`], by [`request_status`]), when, and
//!   the use count. [`event_kind`] names the change: a state move `from` → `to`.
//! - **Who writes it**: every statement that creates a request or changes its state calls
//!   `append` inside its transaction (creation, each state change, recovery's
//!   `execution_interrupted`), and after the commit `EventBell::rang` publishes the newest
//!   sequence, so streams wake on a change without polling the store.
//! - **Reading** ([`DurableStore::events_after`](super::DurableStore::events_after)): strictly after a cursor, in sequence order, one page
//!   at a time, with the check that the cursor is still within what is retained, all in one read
//!   transaction.
//! - **Retention** ([`DurableStore::trim_events`](super::DurableStore::trim_events)): the newest [`MAX_EVENTS`] and none older than the
//!   retention, deleted oldest first in small batches by the retention sweep; only ever a prefix
//!   of the log, so what is retained has no gap.
//!
//! Cursors ([`encode_cursor`], [`decode_cursor`]) are unYOLO's: base64url without padding of the
//! sequence as 8 big-endian bytes (11 characters).
//!
//! Just past the usual size only because its tests live beside it; the log itself is about 440
//! lines.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use unyolo_admission::engine::OperationState;

pub use super::bell::EventBell;

/// How many events the log keeps at most (the newest; unYOLO's `MaxEvents`).
pub const MAX_EVENTS: u32 = 10_000;

/// The longest cursor the contract allows.
pub const MAX_CURSOR_CHARS: usize = 1024;

/// An Operator V1 request status (the contract's `Status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Awaiting a decision.
    Pending,
    /// Approved: waiting for an execution slot, or executing.
    Active,
    /// Denied by an operator.
    Denied,
    /// Failed before it ran.
    Failed,
    /// Canceled by its requester while pending.
    Canceled,
    /// Nobody decided within the pending timeout.
    Expired,
    /// Ran (succeeded, or failed while running): its one use is spent.
    Consumed,
    /// Canceled after approval: by its requester, or revoked by an operator.
    Revoked,
}

impl RequestStatus {
    /// Every status.
    pub const ALL: [RequestStatus; 8] = [
        RequestStatus::Pending,
        RequestStatus::Active,
        RequestStatus::Denied,
        RequestStatus::Failed,
        RequestStatus::Canceled,
        RequestStatus::Expired,
        RequestStatus::Consumed,
        RequestStatus::Revoked,
    ];

    /// The contract's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Pending => "pending",
            RequestStatus::Active => "active",
            RequestStatus::Denied => "denied",
            RequestStatus::Failed => "failed",
            RequestStatus::Canceled => "canceled",
            RequestStatus::Expired => "expired",
            RequestStatus::Consumed => "consumed",
            RequestStatus::Revoked => "revoked",
        }
    }

    /// The status named `name`.
    pub fn parse(name: &str) -> Option<RequestStatus> {
        RequestStatus::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The request's `used_count` in this status: 1 once it ran, else 0 (a request is one
    /// execution).
    pub const fn used_count(self) -> u64 {
        match self {
            RequestStatus::Consumed => 1,
            _ => 0,
        }
    }
}

/// The Operator V1 status of a request in `state`; `ended_from` is the state a terminal
/// operation left (`operations.ended_from`), which tells a revocation (canceled from approved)
/// from a cancel while pending, and a failure while running (consumed) from one before it.
/// One mapping for both readers of it: the event log and the request projection.
pub const fn request_status(
    state: OperationState,
    ended_from: Option<OperationState>,
) -> RequestStatus {
    match (state, ended_from) {
        (OperationState::Pending, _) => RequestStatus::Pending,
        (OperationState::Approved | OperationState::Executing, _) => RequestStatus::Active,
        (OperationState::Succeeded, _) => RequestStatus::Consumed,
        (OperationState::Failed, Some(OperationState::Executing)) => RequestStatus::Consumed,
        (OperationState::Failed, _) => RequestStatus::Failed,
        (OperationState::Denied, _) => RequestStatus::Denied,
        (OperationState::Canceled, Some(OperationState::Approved)) => RequestStatus::Revoked,
        (OperationState::Canceled, _) => RequestStatus::Canceled,
        (OperationState::Expired, _) => RequestStatus::Expired,
    }
}

/// An event's kind: the values of the contract's `BrokerEvent.kind` enum this broker emits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A request was created (revision 1).
    RequestCreated,
    /// An operator approved it.
    RequestApproved,
    /// An operator denied it.
    RequestDenied,
    /// It failed before it ran.
    RequestFailed,
    /// Its requester canceled it while pending.
    RequestCanceled,
    /// Nobody decided within the pending timeout.
    RequestExpired,
    /// Canceled after approval (by its requester, or revoked by an operator).
    GrantRevoked,
    /// It took an execution slot and started.
    GrantReserved,
    /// It ran and succeeded: its one use is consumed.
    GrantConsumed,
    /// It failed while running (e.g. `execution_interrupted` after a crash).
    ExecutionFailed,
}

impl EventKind {
    /// Every kind this broker emits.
    pub const ALL: [EventKind; 10] = [
        EventKind::RequestCreated,
        EventKind::RequestApproved,
        EventKind::RequestDenied,
        EventKind::RequestFailed,
        EventKind::RequestCanceled,
        EventKind::RequestExpired,
        EventKind::GrantRevoked,
        EventKind::GrantReserved,
        EventKind::GrantConsumed,
        EventKind::ExecutionFailed,
    ];

    /// The contract's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::RequestCreated => "request.created",
            EventKind::RequestApproved => "request.approved",
            EventKind::RequestDenied => "request.denied",
            EventKind::RequestFailed => "request.failed",
            EventKind::RequestCanceled => "request.canceled",
            EventKind::RequestExpired => "request.expired",
            EventKind::GrantRevoked => "grant.revoked",
            EventKind::GrantReserved => "grant.reserved",
            EventKind::GrantConsumed => "grant.consumed",
            EventKind::ExecutionFailed => "execution.failed",
        }
    }

    /// The kind named `name`.
    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// The event of a request's move from `from` (`None`: its creation) to `to`; one per revision.
pub const fn event_kind(from: Option<OperationState>, to: OperationState) -> EventKind {
    use OperationState as S;
    match (from, to) {
        (None, _) | (Some(_), S::Pending) => EventKind::RequestCreated,
        (Some(_), S::Approved) => EventKind::RequestApproved,
        (Some(_), S::Executing) => EventKind::GrantReserved,
        (Some(_), S::Succeeded) => EventKind::GrantConsumed,
        (Some(S::Executing), S::Failed) => EventKind::ExecutionFailed,
        (Some(_), S::Failed) => EventKind::RequestFailed,
        (Some(_), S::Denied) => EventKind::RequestDenied,
        (Some(S::Approved), S::Canceled) => EventKind::GrantRevoked,
        (Some(_), S::Canceled) => EventKind::RequestCanceled,
        (Some(_), S::Expired) => EventKind::RequestExpired,
    }
}

/// One stored event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    /// Its sequence: monotonic, never reused; the cursor encodes it.
    pub seq: i64,
    /// What happened.
    pub kind: EventKind,
    /// The request (operation) id.
    pub request_id: String,
    /// The request's revision after the change.
    pub revision: u64,
    /// The request's Operator V1 status after the change.
    pub status: RequestStatus,
    /// When (RFC 3339, UTC, milliseconds).
    pub occurred_at: String,
    /// The request's use count after the change.
    pub used_count: u64,
}

impl StoredEvent {
    /// Its cursor.
    pub fn cursor(&self) -> String {
        encode_cursor(self.seq)
    }
}

/// The cursor of sequence `seq`.
pub fn encode_cursor(seq: i64) -> String {
    URL_SAFE_NO_PAD.encode(seq.max(0).to_be_bytes())
}

/// Why a cursor is not one this broker hands out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MalformedCursor;

/// The sequence a cursor names: base64url without padding of 8 big-endian bytes, at most
/// [`MAX_CURSOR_CHARS`] long, within `i64` (the store's integer).
pub fn decode_cursor(cursor: &str) -> Result<i64, MalformedCursor> {
    if cursor.len() > MAX_CURSOR_CHARS {
        return Err(MalformedCursor);
    }
    let bytes = URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| MalformedCursor)?;
    let bytes: [u8; 8] = bytes.try_into().map_err(|_| MalformedCursor)?;
    let seq = i64::from_be_bytes(bytes);
    if seq < 0 {
        return Err(MalformedCursor);
    }
    Ok(seq)
}

/// What [`DurableStore::events_after`](super::DurableStore::events_after) found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventPage {
    /// The events after the cursor, oldest first (at most the limit), and whether more follow.
    Events {
        /// The sequence they follow: the cursor's, or for no cursor the one before the oldest
        /// retained (the high-water mark when none is). A stream goes on from here.
        after: i64,
        /// The events.
        events: Vec<StoredEvent>,
        /// Whether events after the last one are already stored.
        more: bool,
    },
    /// Events after the cursor are no longer retained (410 `cursor_expired`).
    Expired,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_and_is_unyolos_eleven_characters() {
        assert_eq!(encode_cursor(1), "AAAAAAAAAAE");
        for seq in [0, 1, 255, 1 << 40, i64::MAX] {
            let cursor = encode_cursor(seq);
            assert_eq!(cursor.len(), 11);
            assert_eq!(decode_cursor(&cursor), Ok(seq));
        }
    }

    #[test]
    fn a_cursor_that_is_not_eight_base64url_bytes_is_malformed() {
        for bad in [
            "",
            "AAAAAAAAAA",
            "AAAAAAAAAAAE",
            "AAAAAAAAAA=",
            "AAAAAAAAAA+",
            "AAAAAAAAAA/",
            "gAAAAAAAAAA",
            "AAAAAAAAAAE=",
            " AAAAAAAAAAE",
        ] {
            assert_eq!(decode_cursor(bad), Err(MalformedCursor), "{bad:?}");
        }
        assert_eq!(decode_cursor(&"A".repeat(2000)), Err(MalformedCursor));
    }

    #[test]
    fn each_state_maps_to_the_spec_status_and_each_move_to_one_enum_kind() {
        use OperationState as S;
        use RequestStatus as R;
        let cases = [
            (S::Pending, None, R::Pending),
            (S::Approved, None, R::Active),
            (S::Executing, None, R::Active),
            (S::Succeeded, Some(S::Executing), R::Consumed),
            (S::Failed, Some(S::Executing), R::Consumed),
            (S::Failed, Some(S::Approved), R::Failed),
            (S::Failed, Some(S::Pending), R::Failed),
            (S::Denied, Some(S::Pending), R::Denied),
            (S::Canceled, Some(S::Pending), R::Canceled),
            (S::Canceled, Some(S::Approved), R::Revoked),
            (S::Expired, Some(S::Pending), R::Expired),
        ];
        for (state, ended_from, status) in cases {
            assert_eq!(
                request_status(state, ended_from),
                status,
                "{state} from {ended_from:?}"
            );
        }
        let moves = [
            (None, S::Pending, EventKind::RequestCreated),
            (Some(S::Pending), S::Approved, EventKind::RequestApproved),
            (Some(S::Approved), S::Executing, EventKind::GrantReserved),
            (Some(S::Executing), S::Succeeded, EventKind::GrantConsumed),
            (Some(S::Executing), S::Failed, EventKind::ExecutionFailed),
            (Some(S::Approved), S::Failed, EventKind::RequestFailed),
            (Some(S::Pending), S::Denied, EventKind::RequestDenied),
            (Some(S::Pending), S::Canceled, EventKind::RequestCanceled),
            (Some(S::Approved), S::Canceled, EventKind::GrantRevoked),
            (Some(S::Pending), S::Expired, EventKind::RequestExpired),
        ];
        for (from, to, kind) in moves {
            assert_eq!(event_kind(from, to), kind, "{from:?} → {to}");
            assert_eq!(EventKind::parse(kind.as_str()), Some(kind));
        }
        for status in RequestStatus::ALL {
            assert_eq!(RequestStatus::parse(status.as_str()), Some(status));
        }
    }
}
