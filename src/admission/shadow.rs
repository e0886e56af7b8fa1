//! A shadow quota file: a candidate's limits judging live traffic before they bind.
//!
//! A [`Shadow`] is a second, in-process engine built from the candidate file. The broker asks it
//! about every submission *after* the real decision, and never lets its answer change that
//! decision. It keeps its own counts of what it would have admitted: a submission the real file
//! admitted and the shadow would admit too leaves the shadow holding a lifecycle handle of its
//! own ([`crate::Operation`]), which follows the real operation's transitions and releases; one
//! the shadow would refuse is counted as a would-be refusal and holds nothing there. So the
//! shadow's pending, active and executing counts and rate buckets are what the candidate file
//! would have produced on the same traffic — with two limits, said in full in the operator docs:
//! a submission the real file refused and the shadow would admit spends the shadow's rate token
//! but holds no slot there (no operation exists for it to follow), and an operation the shadow
//! finds no execution slot for at its real start stays approved in the shadow.
//!
//! Judging is the engine's own lock-free decision plus one short lock on the shadow's
//! per-client record (its peaks and first refusal): no store, no Redis, nothing awaited.
//! Replicated, each replica judges its own submissions against its own shadow engine: the
//! shadow's counts are per replica.
//!
//! The same engine replays a store's history ([`Shadow::replay`]): `admission check --history`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::clock::ManualClock;
use crate::config::{ClientLimits, Config, ConfigError, Identity};
use crate::engine::{Controller, Operation, OperationState, Permit, RefusalCode};

/// The candidate's engine and what it has seen. Cheap to clone (every clone is the same shadow).
#[derive(Clone)]
pub struct Shadow {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Controller,
    /// When the shadow began judging.
    since: SystemTime,
    /// Peaks and first refusals, per client; and the global peaks.
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    clients: HashMap<String, ClientSeen>,
    peak_global_active: u64,
    peak_global_executing: u64,
    reloaded_at: Option<SystemTime>,
}

impl Seen {
    /// What has been seen of `identity`, allocating its entry only the first time.
    fn client(&mut self, identity: &str) -> &mut ClientSeen {
        if !self.clients.contains_key(identity) {
            self.clients
                .insert(identity.to_owned(), ClientSeen::default());
        }
        self.clients.get_mut(identity).expect("inserted just above")
    }
}

#[derive(Clone, Copy, Default)]
struct ClientSeen {
    peaks: ShadowPeaks,
    first_refusal: Option<(SystemTime, RefusalCode)>,
}

impl std::fmt::Debug for Shadow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shadow")
            .field("since", &self.inner.since)
            .finish()
    }
}

/// The shadow's answer to one submission.
#[derive(Debug)]
pub enum ShadowVerdict {
    /// It would have admitted: commit the permit beside the real one (or refund it with the
    /// real one). Dropped, its slots return and its rate token stays spent, as the candidate
    /// would have spent it.
    Admitted(Permit),
    /// It would have refused, with this code; `first` when it is the first time it would refuse
    /// this client (the broker logs it once).
    Refused {
        /// The refusal code the candidate would have answered.
        code: RefusalCode,
        /// Whether this is the client's first would-be refusal.
        first: bool,
    },
}

/// The highest counts the shadow saw for one client against its limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShadowPeaks {
    /// Tokens spent of the rate bucket (`requests_per_window` less those left), at its highest.
    pub rate_used: u64,
    /// Live operations (pending, approved or executing).
    pub active: u64,
    /// Operations awaiting approval.
    pub pending: u64,
    /// Operations executing.
    pub executing: u64,
}

/// What the shadow saw of one client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowClient {
    /// The client.
    pub identity: Identity,
    /// Its limits in the candidate file.
    pub limits: ClientLimits,
    /// Submissions the candidate would have admitted.
    pub admitted: u64,
    /// Would-be refusals by code (only codes with at least one), in check order.
    pub refused: Vec<(RefusalCode, u64)>,
    /// The highest counts seen against `limits`.
    pub peaks: ShadowPeaks,
    /// When the candidate would first have refused it, and with which code.
    pub first_refusal: Option<(SystemTime, RefusalCode)>,
}

/// Everything the shadow saw since it began: `GET /admission/v1/shadow`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowReport {
    /// When the shadow began judging.
    pub since: SystemTime,
    /// When its file was last re-read successfully, if ever.
    pub reloaded_at: Option<SystemTime>,
    /// The candidate's `global_active`, and the highest global active count seen.
    pub global_active: (u32, u64),
    /// The candidate's `global_executing`, and the highest global executing count seen.
    pub global_executing: (u32, u64),
    /// Each configured client, by name.
    pub clients: Vec<ShadowClient>,
}

impl ShadowReport {
    /// Whether the candidate would have refused anything.
    pub fn refused_any(&self) -> bool {
        self.clients.iter().any(|c| !c.refused.is_empty())
    }
}

impl Shadow {
    /// A shadow judging with `engine` (built from the candidate file, for the same identities as
    /// the real one).
    pub fn new(engine: Controller) -> Shadow {
        Shadow {
            inner: Arc::new(Inner {
                engine,
                since: SystemTime::now(),
                seen: Mutex::new(Seen::default()),
            }),
        }
    }

    /// The candidate's engine.
    pub fn engine(&self) -> &Controller {
        &self.inner.engine
    }

    /// Judges one submission by `identity` against the candidate's limits, at `now` (the wall
    /// clock time a first refusal is reported with).
    pub fn judge(&self, identity: &str, needs_approval: bool, now: SystemTime) -> ShadowVerdict {
        match self.inner.engine.admit(identity, needs_approval) {
            Ok(permit) => {
                self.note_held(identity);
                ShadowVerdict::Admitted(permit)
            }
            // Not one of the configured identities (the broker authenticates first, so only
            // after a reload removed it): nothing kept, so memory stays bounded by the config.
            Err(refusal) if refusal.code == RefusalCode::ClientUnconfigured => {
                ShadowVerdict::Refused {
                    code: refusal.code,
                    first: false,
                }
            }
            Err(refusal) => {
                let mut seen = crate::sync::lock(&self.inner.seen);
                let client = seen.client(identity);
                let first = client.first_refusal.is_none();
                if first {
                    client.first_refusal = Some((now, refusal.code));
                }
                ShadowVerdict::Refused {
                    code: refusal.code,
                    first,
                }
            }
        }
    }

    /// Follows the real operation's start: takes an execution slot in the shadow if the
    /// candidate has one free (if not, the shadow's operation stays approved).
    pub fn start(&self, operation: &Operation) -> bool {
        let started = operation.try_start().is_ok();
        if started {
            self.note_held(operation.identity().as_str());
        }
        started
    }

    /// Follows the real operation's move to `to` (not `executing`: see [`Shadow::start`]); a
    /// terminal move releases what the shadow's operation holds, whatever state it is in.
    pub fn follow(operation: &Operation, to: OperationState) {
        let moved = match to {
            OperationState::Approved => operation.approve(),
            OperationState::Denied => operation.deny(),
            OperationState::Canceled => operation.cancel().map(|_| ()),
            OperationState::Expired => operation.expire(),
            OperationState::Failed => operation.fail(),
            OperationState::Succeeded => operation.succeed(),
            OperationState::Pending | OperationState::Executing => Ok(()),
        };
        if to.is_terminal() && moved.is_err() {
            // Not in a state the move starts from here (it never started in the shadow, say):
            // ended all the same, so its slots return.
            let _ = operation.fail();
        }
    }

    /// Puts a stored live operation back under the shadow at start-up, as the real engine does.
    pub fn restore(&self, identity: &Identity, state: OperationState) -> Option<Operation> {
        let operation = self.inner.engine.restore(identity, state).ok()?;
        self.note_held(identity.as_str());
        Some(operation)
    }

    /// Re-reads the candidate file at `path` for the identities in force; an invalid file leaves
    /// the old candidate in force and is counted (`admission_shadow_config_reloads_total`).
    pub fn reload_from_path(&self, path: &Path) -> Result<(), ConfigError> {
        self.inner.engine.reload_from_path(path)?;
        crate::sync::lock(&self.inner.seen).reloaded_at = Some(SystemTime::now());
        Ok(())
    }

    /// Records the counts `identity` and the engine hold now as peaks where they are highest.
    fn note_held(&self, identity: &str) {
        let engine = &self.inner.engine;
        let Some(held) = engine.held(identity) else {
            return;
        };
        let rate_used = engine
            .quota(identity)
            .map(|q| u64::from(q.rate.quota).saturating_sub(q.rate.remaining))
            .unwrap_or(0);
        let mut seen = crate::sync::lock(&self.inner.seen);
        seen.peak_global_active = seen.peak_global_active.max(held.global_active);
        seen.peak_global_executing = seen.peak_global_executing.max(held.global_executing);
        let peaks = &mut seen.client(identity).peaks;
        peaks.rate_used = peaks.rate_used.max(rate_used);
        peaks.active = peaks.active.max(held.active);
        peaks.pending = peaks.pending.max(held.pending);
        peaks.executing = peaks.executing.max(held.executing);
    }

    /// Everything the shadow saw since it began, per configured client.
    pub fn report(&self) -> ShadowReport {
        let snapshot = self.inner.engine.snapshot();
        let config = self.inner.engine.config();
        let seen = crate::sync::lock(&self.inner.seen);
        let clients = snapshot
            .clients
            .iter()
            .filter(|c| c.configured)
            .filter_map(|c| {
                let limits = config.effective(c.identity.as_str())?;
                let client = seen
                    .clients
                    .get(c.identity.as_str())
                    .copied()
                    .unwrap_or_default();
                Some(ShadowClient {
                    identity: c.identity.clone(),
                    limits,
                    admitted: c.admitted,
                    refused: RefusalCode::ALL
                        .iter()
                        .map(|&code| (code, c.rejected[code.index()]))
                        .filter(|&(_, n)| n > 0)
                        .collect(),
                    peaks: client.peaks,
                    first_refusal: client.first_refusal,
                })
            })
            .collect();
        let limits = config.limits();
        ShadowReport {
            since: self.inner.since,
            reloaded_at: seen.reloaded_at,
            global_active: (limits.global_active, seen.peak_global_active),
            global_executing: (limits.global_executing, seen.peak_global_executing),
            clients,
        }
    }

    /// Replays `history` (each operation's client, whether it needed approval, and its creation,
    /// approval and end times) through a fresh engine with `candidate`'s limits, in time order,
    /// and answers what it would have refused and when, with the peaks. An operation the
    /// candidate refuses holds nothing afterwards; one it admits is pending (if it needed
    /// approval) until approved, executing from then (or from its creation, for work that needs
    /// none) if a slot is free, and releases at its end.
    pub fn replay(candidate: Config, history: &[StoredOperation]) -> Replay {
        let clock = ManualClock::new();
        let engine = Controller::builder(candidate).clock(clock.clone()).build();
        let shadow = Shadow::new(engine);
        let Some(start) = history.iter().map(|op| op.created_at).min() else {
            return Replay {
                refusals: Vec::new(),
                report: shadow.report(),
            };
        };
        // Events in time order; at one instant, ends before approvals before creations (an
        // operation created as another ends finds its slot free, as the broker's would). An
        // operation's own approval or end met before its creation (all at one instant) is
        // applied at its creation.
        let mut events: Vec<(SystemTime, u8, usize)> = Vec::new();
        for (n, op) in history.iter().enumerate() {
            events.push((op.created_at, 2, n));
            if let Some(at) = op.approved_at {
                events.push((at, 1, n));
            }
            if let Some(at) = op.ended_at {
                events.push((at, 0, n));
            }
        }
        events.sort();
        let mut held: Vec<Option<Operation>> = (0..history.len()).map(|_| None).collect();
        // Per operation: whether its approval, its end, have been met.
        let mut met = vec![(false, false); history.len()];
        let mut refusals = Vec::new();
        for (at, kind, n) in events {
            let since = at.duration_since(start).unwrap_or(Duration::ZERO);
            clock.set_nanos(crate::clock::duration_nanos(since));
            let op = &history[n];
            match kind {
                2 => match shadow.judge(&op.client, op.needs_approval, at) {
                    ShadowVerdict::Admitted(permit) => {
                        let operation = permit.commit();
                        let (approved, ended) = met[n];
                        if approved {
                            Shadow::follow(&operation, OperationState::Approved);
                        }
                        if approved || !op.needs_approval {
                            shadow.start(&operation);
                        }
                        if ended {
                            Shadow::follow(&operation, OperationState::Succeeded);
                        } else {
                            held[n] = Some(operation);
                        }
                    }
                    ShadowVerdict::Refused { code, .. } => refusals.push(ReplayedRefusal {
                        client: op.client.clone(),
                        code,
                        at,
                    }),
                },
                1 => {
                    met[n].0 = true;
                    if let Some(operation) = &held[n] {
                        Shadow::follow(operation, OperationState::Approved);
                        shadow.start(operation);
                    }
                }
                _ => {
                    met[n].1 = true;
                    if let Some(operation) = held[n].take() {
                        Shadow::follow(&operation, OperationState::Succeeded);
                    }
                }
            }
        }
        Replay {
            refusals,
            report: shadow.report(),
        }
    }
}

/// One stored operation as a history replay reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOperation {
    /// The client that submitted it.
    pub client: String,
    /// Whether it waited for an operator.
    pub needs_approval: bool,
    /// When it was created.
    pub created_at: SystemTime,
    /// When an operator approved it, if one did.
    pub approved_at: Option<SystemTime>,
    /// When it ended, if it has.
    pub ended_at: Option<SystemTime>,
}

/// One submission a candidate would have refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayedRefusal {
    /// The client.
    pub client: String,
    /// The code it would have answered.
    pub code: RefusalCode,
    /// When the submission was made.
    pub at: SystemTime,
}

/// What a history replay found ([`Shadow::replay`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replay {
    /// Every submission the candidate would have refused, in time order.
    pub refusals: Vec<ReplayedRefusal>,
    /// Per client: admitted, refused by code, peaks against the candidate's limits.
    pub report: ShadowReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pending: u32, rate: u32) -> Config {
        let text = format!(
            r#"{{"requests_per_window": {rate}, "window_seconds": 60, "client_active": 5,
                "client_pending": {pending}, "global_active": 100, "global_executing": 2}}"#
        );
        Config::from_bytes(text.as_bytes(), [Identity::new("bot").unwrap()]).unwrap()
    }

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + seconds)
    }

    fn request(created: u64, approved: Option<u64>, ended: Option<u64>) -> StoredOperation {
        StoredOperation {
            client: "bot".to_owned(),
            needs_approval: true,
            created_at: at(created),
            approved_at: approved.map(at),
            ended_at: ended.map(at),
        }
    }

    #[test]
    fn a_shadow_refusal_holds_nothing_and_is_reported_once_as_first() {
        let shadow = Shadow::new(Controller::new(config(1, 60)));
        let ShadowVerdict::Admitted(permit) = shadow.judge("bot", true, at(0)) else {
            panic!("the first request fits");
        };
        let held = permit.commit();
        for n in 0..2 {
            match shadow.judge("bot", true, at(n)) {
                ShadowVerdict::Refused { code, first } => {
                    assert_eq!(code, RefusalCode::ClientPendingLimit);
                    assert_eq!(first, n == 0);
                }
                other => panic!("{other:?}"),
            }
        }
        Shadow::follow(&held, OperationState::Approved);
        assert!(
            matches!(shadow.judge("bot", true, at(3)), ShadowVerdict::Admitted(_)),
            "the approval freed the pending slot in the shadow"
        );
        let report = shadow.report();
        let bot = &report.clients[0];
        assert_eq!(bot.refused, [(RefusalCode::ClientPendingLimit, 2)]);
        assert_eq!(
            bot.first_refusal,
            Some((at(0), RefusalCode::ClientPendingLimit))
        );
        assert_eq!((bot.peaks.pending, bot.peaks.active), (1, 2));
        Shadow::follow(&held, OperationState::Succeeded);
        assert_eq!(shadow.engine().snapshot().active, 0, "released at its end");
    }

    #[test]
    fn a_replay_refuses_what_the_candidate_would_and_frees_slots_at_each_end() {
        let history = [
            request(0, None, Some(10)),
            request(1, None, None),      // refused: one pending already
            request(10, Some(12), None), // created as the first ends: admitted
            request(13, None, None),     // admitted: the third was approved at 12
            request(14, None, None),     // refused: the fourth is pending
        ];
        let replay = Shadow::replay(config(1, 60), &history);
        let refused: Vec<(RefusalCode, SystemTime)> =
            replay.refusals.iter().map(|r| (r.code, r.at)).collect();
        assert_eq!(
            refused,
            [
                (RefusalCode::ClientPendingLimit, at(1)),
                (RefusalCode::ClientPendingLimit, at(14)),
            ]
        );
        let bot = &replay.report.clients[0];
        assert_eq!((bot.admitted, bot.peaks.executing), (3, 1));
        assert!(replay.report.refused_any());

        let roomy = Shadow::replay(config(5, 60), &history);
        assert!(roomy.refusals.is_empty() && !roomy.report.refused_any());
        assert_eq!(roomy.report.clients[0].peaks.pending, 3);
    }

    #[test]
    fn a_replay_spends_rate_tokens_at_the_stored_times() {
        // Two a minute: the third within the minute is refused, one 30 s later is not.
        let history = [
            request(0, None, Some(0)),
            request(1, None, Some(1)),
            request(2, None, Some(2)),
            request(31, None, Some(31)),
        ];
        let replay = Shadow::replay(config(1, 2), &history);
        let refused: Vec<(RefusalCode, SystemTime)> =
            replay.refusals.iter().map(|r| (r.code, r.at)).collect();
        assert_eq!(refused, [(RefusalCode::SubmissionRateLimited, at(2))]);
    }
}
