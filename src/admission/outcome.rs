//! What the admission calls answer besides a permit: refusals, "cannot decide now", starts that
//! did not happen, and the readings of the deployment. Plain values, the same for both backends;
//! the in-process backend simply never answers [`Unavailable`] or [`AdmitError::Replay`].

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::config::Identity;
use crate::engine::{FairShareRefusal, OperationState, QuotaStatus, Refusal};

/// A refused submission: the refusal (code and Retry-After) and the client's quota as the backend
/// that decided saw it, for the answer's quota fields (`RateLimit-Policy`, `RateLimit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The first check that failed, in the contract's order, and when to retry.
    pub refusal: Refusal,
    /// The client's quota at the decision (`None` for an identity that has none): replicated,
    /// Redis's reading when Redis refused (the deployment's counts), this process's engine's
    /// when the engine did.
    pub quota: Option<QuotaStatus>,
    /// Set when a global pool's fair share made the refusal (where first come, first served
    /// would have admitted): which pool and why. The code is still the pool's.
    pub fair_share: Option<FairShareRefusal>,
}

/// Why [`Admission::admit`](super::Admission::admit) gave no permit. Nothing is held for any of
/// them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// Refused by the limits: 429 with Retry-After, or 403 for an unconfigured client.
    Refused(Refused),
    /// The client's idempotency key already names `operation`, admitted by `replica` (replicated
    /// backend only): answer it as a replay where the store has it, else say where it lives.
    Replay {
        /// The operation's id.
        operation: String,
        /// The replica that admitted it.
        replica: String,
    },
    /// Admission cannot be decided now (replicated backend only): 503 with Retry-After, never an
    /// admission unchecked.
    Unavailable(Unavailable),
}

impl AdmitError {
    /// The refusal, if this is one.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            AdmitError::Refused(refused) => Some(&refused.refusal),
            _ => None,
        }
    }
}

impl fmt::Display for AdmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmitError::Refused(r) => r.refusal.fmt(f),
            AdmitError::Replay { operation, replica } => {
                write!(
                    f,
                    "the idempotency key names operation {operation} on replica {replica}"
                )
            }
            AdmitError::Unavailable(u) => u.fmt(f),
        }
    }
}

impl std::error::Error for AdmitError {}

/// Why admission could not be decided: answered as 503 `admission_unavailable`, never as an
/// unchecked admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable {
    /// What went wrong.
    pub reason: UnavailableReason,
    /// When to try again (whole seconds, at least one).
    pub retry_after: Duration,
}

impl Unavailable {
    /// The wire code: `admission_unavailable`.
    pub const CODE: &'static str = "admission_unavailable";

    /// The HTTP status: 503.
    pub const fn http_status(&self) -> u16 {
        503
    }

    /// `retry_after` in whole seconds, as the `Retry-After` header carries it (at least one).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs().max(1)
    }
}

/// Why the shared store could not decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnavailableReason {
    /// The call did not answer within the call timeout.
    Timeout,
    /// Redis answered with an error, or the connection failed (the message says which).
    Redis(String),
    /// Recent calls failed; this one was not sent.
    CircuitOpen,
    /// This replica does not hold its lease (not registered, lapsed, or taken by another process
    /// under the same name).
    LeaseNotHeld,
    /// This replica has not begun [`Admission::restore`](super::Admission::restore): it takes
    /// its lease only by registering what its store holds, so it admits nothing until the
    /// embedder calls `restore` once at start-up (with nothing, if the store holds nothing).
    NotRestored,
    /// A script replied with something no script returns, or the store's recovery source failed.
    Reply(String),
    /// Redis forgot the deployment's state (a restart without persistence, a flush, a failover)
    /// and the replicas are registering again: no admission until all are back or one lease
    /// period has passed.
    Recovering,
    /// This replica already has as many decisions in flight to Redis as it allows (in all, or
    /// for this client) and none finished within the decision wait.
    Busy,
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match &self.reason {
            UnavailableReason::Timeout => "redis did not answer in time".to_string(),
            UnavailableReason::Redis(m) => format!("redis error: {m}"),
            UnavailableReason::CircuitOpen => "redis is failing; calls paused".to_string(),
            UnavailableReason::LeaseNotHeld => "this replica does not hold its lease".to_string(),
            UnavailableReason::NotRestored => {
                "this replica has not registered: call Admission::restore once at start-up"
                    .to_string()
            }
            UnavailableReason::Reply(m) => m.clone(),
            UnavailableReason::Recovering => {
                "redis forgot this deployment; its replicas are registering again".to_string()
            }
            UnavailableReason::Busy => {
                "too many admission decisions in flight on this replica".to_string()
            }
        };
        write!(
            f,
            "{} ({why}; retry after {}s)",
            Self::CODE,
            self.retry_after_secs()
        )
    }
}

impl std::error::Error for Unavailable {}

/// Why an operation did not start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotStarted {
    /// Every execution slot (across every replica) is taken; the operation stays queued.
    Saturated(Refusal),
    /// The operation is not approved, in this state: still `pending` (not decided yet),
    /// already `executing` (started before), or ended while queued (canceled, expired, failed).
    NotApproved(OperationState),
    /// The shared store did not answer; the operation stays queued and can retry.
    Unavailable(Unavailable),
}

impl fmt::Display for NotStarted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotStarted::Saturated(r) => write!(f, "execution pool saturated: {r}"),
            NotStarted::NotApproved(s) => write!(f, "cannot start a {s} operation"),
            NotStarted::Unavailable(u) => u.fmt(f),
        }
    }
}

impl std::error::Error for NotStarted {}

/// An operation a broker restores from its store at start-up.
#[derive(Clone, Debug)]
pub struct RestoredOperation {
    /// Its id, as stored.
    pub id: String,
    /// Its client.
    pub identity: Identity,
    /// Its state (a terminal one restores nothing).
    pub state: OperationState,
}

/// Why an admission backend cannot be set up.
#[derive(Debug)]
pub enum SetupError {
    /// An option is unusable (the message names it).
    Options(String),
    /// Redis could not be reached or refused.
    Redis(String),
    /// Replicas were asked for, but this build has no Redis backend (cargo feature `redis`).
    NoRedisBackend,
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Options(m) => write!(f, "redis options: {m}"),
            SetupError::Redis(m) => write!(f, "redis: {m}"),
            SetupError::NoRedisBackend => f.write_str(
                "this build has no Redis backend: rebuild with the cargo feature `redis` to run replicas",
            ),
        }
    }
}

impl std::error::Error for SetupError {}

/// The counts of a whole deployment, read at one moment: every replica's on the replicated
/// backend, this process's in-process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeploymentCounts {
    /// Live operations.
    pub active: u64,
    /// Operations awaiting approval.
    pub pending: u64,
    /// Operations executing.
    pub executing: u64,
    /// Clients holding at least one live operation (the active pool's holders).
    pub active_holders: u64,
    /// Clients holding at least one executing operation (the executing pool's holders).
    pub executing_holders: u64,
    /// Per client: (active, pending, executing), only clients holding something.
    pub clients: BTreeMap<String, (u64, u64, u64)>,
    /// Operations recorded (every live operation of every replica).
    pub operations: u64,
}

impl DeploymentCounts {
    /// Whether nothing is held anywhere.
    pub fn is_idle(&self) -> bool {
        self.active == 0
            && self.pending == 0
            && self.executing == 0
            && self.active_holders == 0
            && self.executing_holders == 0
            && self.clients.is_empty()
            && self.operations == 0
    }
}

/// What the replicated backend has seen, for metrics (all zero in-process).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Calls that failed or timed out.
    pub errors: u64,
    /// Times this replica's lease was taken, lost or taken back.
    pub lease_changes: u64,
    /// Operations of lapsed replicas this replica released.
    pub reaped: u64,
    /// Admissions answered unavailable.
    pub unavailable: u64,
    /// Releases waiting to be sent.
    pub outbox: u64,
    /// Whether this replica holds its lease now.
    pub lease_held: bool,
    /// Whether the circuit is open now.
    pub circuit_open: bool,
    /// Whether the replicas were still registering again, after Redis forgot, at this
    /// replica's last registration.
    pub recovering: bool,
    /// Submissions refused from memory, without a Redis call.
    pub refusals_from_memory: u64,
    /// Remembered refusals forgotten, by why: expired, a refund seen, a release for the client
    /// seen, any release seen (a global limit), a replica's holdings reaped or registered again,
    /// the notice subscription lost or made again, a reload, an admission of the client on this
    /// replica (in that order; see [`BackendStats::FORGOTTEN_REASONS`]).
    pub refusals_forgotten: [u64; 8],
    /// Whether this replica hears the deployment's notices now (the refusal memory works only
    /// then).
    pub notices_live: bool,
    /// Submissions answered unavailable because too many decisions were in flight.
    pub busy: u64,
}

impl BackendStats {
    /// The label of each of [`BackendStats::refusals_forgotten`], in order.
    pub const FORGOTTEN_REASONS: [&'static str; 8] = [
        "expired",
        "refund",
        "release",
        "any_release",
        "replaced",
        "resubscribed",
        "reload",
        "admitted",
    ];
}
