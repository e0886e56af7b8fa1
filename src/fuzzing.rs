//! The bodies of the library's cargo-fuzz targets in `fuzz/` (the quota file, the secrets files,
//! the controller's operations, Redis's replies and notices), kept in the library so that a plain
//! `cargo test` (`tests/fuzz_corpus_replay.rs`) replays every committed corpus file through exactly
//! the code the fuzzer runs. Not part of the public API, and behind the cargo feature `fuzzing`:
//! `fuzz/` turns it on, and so do this package's tests (through its dev-dependency on itself), while
//! a plain build of the library leaves this module out. The broker's parsers have theirs in the
//! broker crate (`unyolo_admission_broker::fuzzing`).
//!
//! Every function panics (through `assert!`) when an invariant of the contract breaks; that panic
//! is what the fuzzer reports as a crash and what the replay test reports as a failure.
//!
//! Past the usual size because each target's invariants are spelled out in full beside it; they are
//! one list of what the contract promises of each parser.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::clock::ManualClock;
use crate::config::secrets::{LineProblem, Secrets, parse_operator_secret};
use crate::config::{ClientLimits, Config, Identity, Limits, MAX_LIMIT, MAX_WINDOW_SECONDS};
use crate::engine::Snapshot;
use crate::engine::{
    Controller, Operation, OperationState, Permit, RefusalCode, StartError, StorageCaps,
};

/// The identities a fuzzed quota file is judged against.
pub const CONFIG_IDENTITIES: [&str; 3] = ["alice", "bot-7", "ci.runner@example"];

/// Arbitrary bytes as a quota file: parsing never panics; an accepted file satisfies every rule of
/// the quota file and re-serializes (`to_json`) to a file that parses to an equal `Config`; a
/// rejected one has a one-line error.
pub fn config_parse(data: &[u8]) {
    let identities = || CONFIG_IDENTITIES.map(|n| Identity::new(n).expect("valid identity"));
    match Config::from_bytes(data, identities()) {
        Ok(config) => {
            assert_config_invariants(&config);
            let json = config.to_json();
            let again = Config::from_bytes(json.as_bytes(), identities())
                .unwrap_or_else(|e| panic!("to_json output does not reparse: {e}\n{json}"));
            assert_eq!(again, config, "to_json does not round-trip:\n{json}");
            // One way to make a Config: values in code are judged like the file.
            let rebuilt = Config::new(
                *config.limits(),
                config.overrides().clone(),
                config.identities().cloned(),
            )
            .and_then(|c| c.with_fair_share(config.fair_share()))
            .expect("Config::new or with_fair_share refuses what the parser accepted");
            assert_eq!(rebuilt, config);
        }
        Err(err) => {
            let message = err.to_string();
            assert!(
                !message.contains('\n') && !message.contains('\r'),
                "error is not one line: {message:?}"
            );
            assert!(!message.is_empty());
        }
    }
}

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use redis::{redis_reply, redis_reply_accepted, redis_reply_value, refusal_notices};

/// Asserts that an error message reads as one line of text.
fn assert_one_line(message: &str) {
    assert!(!message.is_empty(), "empty error message");
    assert!(
        !message.chars().any(char::is_control),
        "error is not one line of text: {message:?}"
    );
}

/// Arbitrary bytes as a client secrets file, and as an operator secret file.
///
/// An accepted secrets file has one entry per line that is neither blank nor a comment, each with
/// a valid identity and a non-empty, trimmed, single-line secret that no other entry shares, and
/// re-rendered as `name = secret` lines it parses to an equal `Secrets`. A refused one has a
/// one-line error naming the first bad line: every line before it parses, and a bad name is
/// exactly the text before the line's first `=` (so no secret is ever quoted). An operator secret
/// is accepted exactly when the trimmed text is non-empty and free of control characters (line
/// breaks included), and is that text.
pub fn secrets_parse(data: &[u8]) {
    match Secrets::from_bytes(data) {
        Ok(secrets) => {
            let text = std::str::from_utf8(data).expect("accepted secrets are UTF-8");
            let entries = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .count();
            assert_eq!(secrets.len(), entries, "an entry line was dropped");
            let mut seen = std::collections::BTreeSet::new();
            let mut rendered = String::new();
            for (identity, secret) in secrets.iter() {
                assert!(Identity::new(identity.as_str()).is_ok(), "{identity}");
                assert!(!secret.is_empty(), "{identity} has an empty secret");
                assert_eq!(secret, secret.trim(), "{identity}'s secret is not trimmed");
                assert!(
                    !secret.contains(char::is_control),
                    "{identity}'s secret holds a control character"
                );
                assert!(seen.insert(secret), "two identities share a secret");
                assert_eq!(secrets.secret(identity.as_str()), Some(secret));
                rendered.push_str(&format!("{identity} = {secret}\n"));
            }
            let again = Secrets::parse(&rendered)
                .unwrap_or_else(|e| panic!("rendered secrets do not reparse: {e}"));
            assert!(again == secrets, "rendered secrets do not round-trip");
            let debug = format!("{secrets:?}");
            assert_eq!(
                debug.matches("<redacted>").count(),
                secrets.len(),
                "Debug shows something other than redacted secrets"
            );
        }
        Err(err) => {
            assert_one_line(&err.to_string());
            let line = err.line().expect("a parse error names its line");
            assert!(line >= 1);
            match err.problem().expect("a parse error names its problem") {
                LineProblem::NotUtf8 => {
                    let valid = std::str::from_utf8(data).expect_err("refused as not UTF-8");
                    let breaks = data[..valid.valid_up_to()]
                        .iter()
                        .filter(|b| **b == b'\n')
                        .count();
                    assert_eq!(line, breaks + 1, "wrong line for the invalid byte");
                }
                problem => {
                    let text = std::str::from_utf8(data).expect("line problems are in UTF-8 text");
                    let lines: Vec<&str> = text.lines().collect();
                    assert!(line <= lines.len(), "line {line} of {}", lines.len());
                    let before = lines[..line - 1].join("\n");
                    if let Err(e) = Secrets::parse(&before) {
                        panic!("line {line} reported, but an earlier line is bad: {e}");
                    }
                    let bad = lines[line - 1].trim();
                    match problem {
                        LineProblem::BadName(name) => {
                            let (before_equals, _) = bad.split_once('=').expect("has '='");
                            assert_eq!(name, before_equals.trim());
                        }
                        LineProblem::MissingEquals => assert!(!bad.contains('=')),
                        LineProblem::DuplicateName { first_line, .. }
                        | LineProblem::DuplicateSecret { first_line } => {
                            assert!(*first_line < line)
                        }
                        LineProblem::EmptySecret => assert!(bad.ends_with('=')),
                        LineProblem::ControlCharacter => {
                            let (_, secret) = bad.split_once('=').expect("has '='");
                            assert!(secret.contains(char::is_control));
                        }
                        other => panic!("secrets parse gave {other:?}"),
                    }
                }
            }
        }
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let trimmed = text.trim();
    let acceptable = !trimmed.is_empty() && !trimmed.contains(char::is_control);
    match parse_operator_secret(text) {
        Ok(secret) => {
            assert!(acceptable, "accepted {text:?}");
            assert_eq!(secret, trimmed);
        }
        Err(err) => {
            assert!(!acceptable, "refused {text:?}: {err}");
            assert_one_line(&err.to_string());
            assert!(matches!(err.line(), Some(1 | 2)), "{err}");
        }
    }
}

/// Asserts every rule of the quota file on an accepted configuration.
fn assert_config_invariants(config: &Config) {
    let l = config.limits();
    for v in [
        l.requests_per_window,
        l.client_active,
        l.client_pending,
        l.global_active,
        l.global_executing,
    ] {
        assert!((1..=MAX_LIMIT).contains(&v), "limit out of bounds: {l:?}");
    }
    assert!(
        (1..=MAX_WINDOW_SECONDS).contains(&l.window_seconds),
        "{l:?}"
    );
    assert!(l.client_pending <= l.client_active, "{l:?}");
    assert!(l.client_active <= l.global_active, "{l:?}");
    assert!(l.global_executing <= l.global_active, "{l:?}");
    for (identity, o) in config.overrides() {
        assert!(
            config.identities().any(|i| i == identity),
            "override for unconfigured {identity}"
        );
        for v in [o.requests_per_window, o.active, o.pending] {
            assert!((1..=MAX_LIMIT).contains(&v), "{identity}: {o:?}");
        }
        assert!(
            (1..=MAX_WINDOW_SECONDS).contains(&o.window_seconds),
            "{o:?}"
        );
        assert!(o.pending <= o.active, "{identity}: {o:?}");
        assert!(o.active <= l.global_active, "{identity}: {o:?}");
    }
    if let Some(share) = config.fair_share() {
        for (pool, global) in [
            (share.active, l.global_active),
            (share.executing, l.global_executing),
        ] {
            assert!(pool.reserve < global, "{share:?} against {l:?}");
            assert!((1..=MAX_LIMIT).contains(&pool.floor), "{share:?}");
            assert!(pool.floor <= l.client_active, "{share:?} against {l:?}");
            for (identity, o) in config.overrides() {
                assert!(
                    pool.floor <= o.active,
                    "{share:?} against {identity}: {o:?}"
                );
            }
        }
    }
    for identity in config.identities() {
        let effective = config.effective(identity.as_str()).expect("configured");
        let expected = config
            .overrides()
            .get(identity)
            .copied()
            .unwrap_or_else(|| l.client_defaults());
        assert_eq!(effective, expected);
    }
}

/// Identities a fuzzed controller may be configured with (a bitmask picks which).
const POOL: [&str; 4] = ["alice", "bot-7", "carol", "dave"];
/// Names `admit` is called with: the pool, one valid identity never configured, one invalid name.
const ADMIT_NAMES: [&str; 6] = ["alice", "bot-7", "carol", "dave", "zed", "not valid!"];

/// Reads bytes one at a time, yielding zero once exhausted.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// `1..=max`, from one byte.
    fn between_one_and(&mut self, max: u32) -> u32 {
        1 + u32::from(self.next()) % max
    }
}

/// A small but valid configuration decoded from bytes (small limits, so they bind quickly).
fn decode_config(bytes: &mut Bytes<'_>) -> Config {
    let mask = bytes.next();
    let identities: Vec<Identity> = POOL
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, n)| Identity::new(n).expect("valid identity"))
        .collect();
    let global_active = bytes.between_one_and(12);
    let global_executing = bytes.between_one_and(global_active);
    let client_active = bytes.between_one_and(global_active);
    let limits = Limits {
        requests_per_window: bytes.between_one_and(8),
        window_seconds: bytes.between_one_and(4),
        client_active,
        client_pending: bytes.between_one_and(client_active),
        global_active,
        global_executing,
    };
    let mut overrides = BTreeMap::new();
    for (i, identity) in identities.iter().enumerate() {
        if mask & (0x10 << i) != 0 {
            let active = bytes.between_one_and(global_active);
            overrides.insert(
                identity.clone(),
                ClientLimits {
                    requests_per_window: bytes.between_one_and(8),
                    window_seconds: bytes.between_one_and(4),
                    active,
                    pending: bytes.between_one_and(active),
                },
            );
        }
    }
    Config::new(limits, overrides, identities).expect("decoded config is valid by construction")
}

/// A live thing the fuzzer holds, with the client it belongs to.
struct Held<T> {
    identity: &'static str,
    item: T,
}

/// What the model expects one client to hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    active: u64,
    pending: u64,
    queued: u64,
    executing: u64,
}

/// The counters that have a limit, with the highest value each may legitimately hold above its
/// limit (restored work, or a reload lowering the limit); shrinks as usage drains.
#[derive(Default)]
struct Allowance {
    client_active: BTreeMap<&'static str, u64>,
    client_pending: BTreeMap<&'static str, u64>,
    global_active: u64,
    global_pending: u64,
    global_executing: u64,
}

struct Harness {
    controller: Controller,
    clock: ManualClock,
    caps: StorageCaps,
    permits: Vec<Held<Permit>>,
    ops: Vec<Held<Operation>>,
    allowance: Allowance,
}

/// Arbitrary bytes as a sequence of admit / commit / approve / deny / cancel / expire / fail /
/// start / finish / refund / drop / restore / reload / clock steps over several identities with a
/// manual clock. After every step the controller's counts must equal a model kept beside it, no
/// count may exceed its limit (beyond what restore or a lowering reload legitimately left), and
/// every admission decision must be the first failing check in the contract's order. At the end,
/// once everything is terminal, the controller must be idle.
pub fn controller_ops(data: &[u8]) {
    let mut bytes = Bytes { data };
    let config = decode_config(&mut bytes);
    let caps = StorageCaps {
        grant_global: u64::from(bytes.between_one_and(16)),
        grant_client: u64::from(bytes.between_one_and(10)),
        ..StorageCaps::default()
    };
    let clock = ManualClock::new();
    let controller = Controller::builder(config)
        .clock(clock.clone())
        .storage_caps(caps)
        .build();
    let mut h = Harness {
        controller,
        clock,
        caps,
        permits: Vec::new(),
        ops: Vec::new(),
        allowance: Allowance::default(),
    };
    h.check(false);
    let mut steps = 0;
    while !bytes.is_empty() && steps < 4096 {
        steps += 1;
        let raised = h.step(&mut bytes);
        h.check(raised);
    }
    h.terminate_everything();
}

impl Harness {
    /// Runs one decoded step; returns whether it may legitimately leave counts above limits.
    fn step(&mut self, bytes: &mut Bytes<'_>) -> bool {
        let op = bytes.next();
        let arg = bytes.next();
        match op % 16 {
            0..=3 => self.admit(
                ADMIT_NAMES[usize::from(arg) % ADMIT_NAMES.len()],
                op & 0x10 != 0,
            ),
            4 => {
                if let Some(p) = take(&mut self.permits, arg) {
                    let needs_approval = p.item.needs_approval();
                    let op = p.item.commit();
                    let expected = if needs_approval {
                        OperationState::Pending
                    } else {
                        OperationState::Approved
                    };
                    assert_eq!(op.state(), expected);
                    self.ops.push(Held {
                        identity: p.identity,
                        item: op,
                    });
                }
            }
            5 => {
                if let Some(p) = take(&mut self.permits, arg) {
                    p.item.refund();
                }
            }
            6 => drop(take(&mut self.permits, arg)),
            7 => self.transition(arg, bytes.next()),
            8 => self.transition(arg, 6), // try_start, the common case, weighted up
            9 => drop(take(&mut self.ops, arg)),
            10 => {
                let identity = POOL[usize::from(arg) % POOL.len()];
                let state = OperationState::ALL[usize::from(bytes.next()) % 8];
                let result = self.controller.restore(identity, state);
                match result {
                    Ok(op) => {
                        assert!(!state.is_terminal());
                        assert_eq!(op.state(), state);
                        self.ops.push(Held { identity, item: op });
                    }
                    Err(_) => assert!(state.is_terminal()),
                }
                return true;
            }
            11 => {
                let config = decode_config(bytes);
                self.controller.reload(config.clone());
                assert_eq!(self.controller.config(), config);
                return true;
            }
            12 | 13 => self
                .clock
                .advance(Duration::from_millis(u64::from(arg) * 97)),
            14 => self
                .clock
                .rewind(Duration::from_millis(u64::from(arg) * 131)),
            _ => {
                // Terminate one operation the way the broker's executor would.
                if let Some(held) = self.ops.get(usize::from(arg) % self.ops.len().max(1)) {
                    let _ = held.item.try_start();
                    let _ = held.item.succeed();
                }
            }
        }
        false
    }

    /// Admits, first predicting the decision from a snapshot taken just before.
    fn admit(&mut self, name: &'static str, needs_approval: bool) {
        let before = self.controller.snapshot();
        let expected = self.expected_decision(&before, name, needs_approval);
        match self.controller.admit(name, needs_approval) {
            Ok(permit) => {
                assert_eq!(
                    expected, None,
                    "{name} admitted; expected refusal {expected:?}"
                );
                assert_eq!(permit.identity().as_str(), name);
                assert_eq!(permit.needs_approval(), needs_approval);
                self.permits.push(Held {
                    identity: name,
                    item: permit,
                });
            }
            Err(refusal) => {
                assert_eq!(Some(refusal.code), expected, "{name} refused unexpectedly");
                if refusal.code == RefusalCode::ClientUnconfigured {
                    assert_eq!(refusal.retry_after, Duration::ZERO);
                } else {
                    assert!(refusal.retry_after >= Duration::from_secs(1));
                }
                // A refusal consumes nothing: no token, no slot.
                let after = self.controller.snapshot();
                assert_eq!(
                    (after.active, after.pending, after.executing),
                    (before.active, before.pending, before.executing)
                );
                if let (Some(b), Some(a)) = (before.client(name), after.client(name)) {
                    assert_eq!(
                        (a.active, a.pending, a.queued, a.executing, a.tokens),
                        (b.active, b.pending, b.queued, b.executing, b.tokens),
                        "refusal of {name} consumed something"
                    );
                }
            }
        }
    }

    /// The contract's decision order, evaluated on a snapshot: `None` means admitted.
    fn expected_decision(
        &self,
        s: &Snapshot,
        name: &str,
        needs_approval: bool,
    ) -> Option<RefusalCode> {
        let config = self.controller.config();
        let Some(limits) = config.effective(name) else {
            return Some(RefusalCode::ClientUnconfigured);
        };
        let global = config.limits();
        let client = s.client(name).expect("configured clients are tracked");
        if client.tokens == 0 {
            return Some(RefusalCode::SubmissionRateLimited);
        }
        if client.active >= u64::from(limits.active) {
            return Some(RefusalCode::ClientOperationLimit);
        }
        if needs_approval {
            if client.pending >= u64::from(limits.pending) {
                return Some(RefusalCode::ClientPendingLimit);
            }
            if client.pending >= self.caps.grant_client || s.pending >= self.caps.grant_global {
                return Some(RefusalCode::PendingGrantLimit);
            }
        }
        if s.active >= u64::from(global.global_active) {
            return Some(RefusalCode::GlobalOperationLimit);
        }
        if s.executing >= u64::from(global.global_executing) {
            return Some(RefusalCode::GlobalExecutionLimit);
        }
        None
    }

    /// One lifecycle call on a held operation, checked against the state it was in.
    fn transition(&mut self, index: u8, which: u8) {
        let Some(held) = self.ops.get(usize::from(index) % self.ops.len().max(1)) else {
            return;
        };
        let op = &held.item;
        let from = op.state();
        use OperationState::*;
        let (to, ok) = match which % 7 {
            0 => (Approved, op.approve().is_ok()),
            1 => (Denied, op.deny().is_ok()),
            2 => {
                let r = op.cancel();
                if from.is_terminal() {
                    assert_eq!(
                        r,
                        Ok(crate::CancelOutcome::AlreadyTerminal(from)),
                        "cancel of a terminal operation"
                    );
                    return;
                }
                (Canceled, r.is_ok_and(crate::CancelOutcome::changed))
            }
            3 => (Expired, op.expire().is_ok()),
            4 => (Failed, op.fail().is_ok()),
            5 => (Succeeded, op.succeed().is_ok()),
            _ => {
                let executing = self.controller.snapshot().executing;
                let ge = u64::from(self.controller.config().limits().global_executing);
                match op.try_start() {
                    Ok(()) => {
                        assert_eq!(from, Approved);
                        assert!(executing < ge);
                        assert_eq!(op.state(), Executing);
                    }
                    Err(StartError::Saturated(r)) => {
                        assert_eq!(from, Approved);
                        assert!(executing >= ge, "saturated with {executing} < {ge}");
                        assert_eq!(r.code, RefusalCode::GlobalExecutionLimit);
                        assert_eq!(op.state(), Approved);
                    }
                    Err(StartError::NotApproved(s)) => {
                        assert_ne!(from, Approved);
                        assert_eq!(s, from);
                    }
                }
                return;
            }
        };
        assert_eq!(ok, from.can_move_to(to), "{from} -> {to}");
        assert_eq!(op.state(), if ok { to } else { from });
    }

    /// Compares every count with the model and with its limit.
    fn check(&mut self, raised: bool) {
        let s = self.controller.snapshot();
        let config = self.controller.config();
        let mut model: BTreeMap<&'static str, Counts> = BTreeMap::new();
        for p in &self.permits {
            let c = model.entry(p.identity).or_default();
            c.active += 1;
            c.pending += u64::from(p.item.needs_approval());
            // Admitted work that needs no approval counts as queued until it starts.
            c.queued += u64::from(!p.item.needs_approval());
        }
        for o in &self.ops {
            let c = model.entry(o.identity).or_default();
            match o.item.state() {
                OperationState::Pending => c.pending += 1,
                OperationState::Approved => c.queued += 1,
                OperationState::Executing => c.executing += 1,
                _ => continue,
            }
            c.active += 1;
        }
        let mut total = Counts::default();
        for name in POOL {
            let expected = model.get(name).copied().unwrap_or_default();
            let actual = s.client(name).map_or(Counts::default(), |c| Counts {
                active: c.active,
                pending: c.pending,
                queued: c.queued,
                executing: c.executing,
            });
            assert_eq!(actual, expected, "counts of {name}");
            total.active += expected.active;
            total.pending += expected.pending;
            total.queued += expected.queued;
            total.executing += expected.executing;

            if let Some(c) = s.client(name) {
                assert_eq!(c.configured, config.effective(name).is_some(), "{name}");
            }
            if let Some(limits) = config.effective(name) {
                let c = s.client(name).expect("configured clients are tracked");
                assert!(c.tokens <= u64::from(limits.requests_per_window), "{name}");
                let pending_limit = u64::from(limits.pending).min(self.caps.grant_client);
                bounded(
                    &mut self.allowance.client_active,
                    name,
                    c.active,
                    limits.active.into(),
                    raised,
                );
                bounded(
                    &mut self.allowance.client_pending,
                    name,
                    c.pending,
                    pending_limit,
                    raised,
                );
            }
        }
        let actual = Counts {
            active: s.active,
            pending: s.pending,
            queued: s.queued,
            executing: s.executing,
        };
        assert_eq!(actual, total, "global counts");
        let l = config.limits();
        within(
            &mut self.allowance.global_active,
            s.active,
            l.global_active.into(),
            raised,
            "global active",
        );
        within(
            &mut self.allowance.global_pending,
            s.pending,
            self.caps.grant_global,
            raised,
            "global pending",
        );
        within(
            &mut self.allowance.global_executing,
            s.executing,
            l.global_executing.into(),
            raised,
            "global executing",
        );
    }

    /// Ends every permit and operation, then the controller must hold nothing.
    fn terminate_everything(mut self) {
        for (i, p) in std::mem::take(&mut self.permits).into_iter().enumerate() {
            if i % 2 == 0 {
                p.item.refund();
            }
        }
        for held in &self.ops {
            let op = &held.item;
            match op.state() {
                OperationState::Executing => op.succeed().expect("executing can succeed"),
                s if s.is_terminal() => {}
                _ => {
                    op.cancel().expect("pending or approved can be canceled");
                }
            }
            assert!(op.state().is_terminal());
        }
        self.check(false);
        drop(std::mem::take(&mut self.ops));
        let snapshot = self.controller.snapshot();
        assert!(snapshot.is_idle(), "not idle at the end: {snapshot:?}");
    }
}

/// Removes the held item `index` picks (modulo the count), if any.
fn take<T>(items: &mut Vec<Held<T>>, index: u8) -> Option<Held<T>> {
    if items.is_empty() {
        return None;
    }
    let i = usize::from(index) % items.len();
    Some(items.swap_remove(i))
}

/// Per-client form of [`within`].
fn bounded(
    allowance: &mut BTreeMap<&'static str, u64>,
    name: &'static str,
    value: u64,
    limit: u64,
    raised: bool,
) {
    let slot = allowance.entry(name).or_default();
    within(slot, value, limit, raised, name);
}

/// Asserts `value <= max(limit, allowance)`; a step that may raise counts above their limits
/// (restore, reload) raises the allowance to the value; draining lowers it.
fn within(allowance: &mut u64, value: u64, limit: u64, raised: bool, what: &str) {
    if raised {
        *allowance = (*allowance).max(value);
    }
    assert!(
        value <= limit.max(*allowance),
        "{what}: {value} above limit {limit} (allowed {allowance})"
    );
    *allowance = (*allowance).min(value);
}

/// The engine's rate check alone, for `benches/`: the real `Bucket` GCRA
/// word, the real clamped clock over `quanta`, and per-identity buckets in a `dashmap` looked up by
/// name, as the controller stores its clients. [`Controller::admit`] does this and then reserves
/// the counts, so it cannot be timed alone through the public API.
pub struct RateCheck {
    buckets: dashmap::DashMap<Identity, crate::engine::gcra::Bucket>,
    clock: crate::clock::MonotonicClock,
    rate: crate::engine::gcra::Rate,
}

impl RateCheck {
    /// Full buckets of `requests_per_window` per `window_seconds` for each identity.
    pub fn new(
        identities: impl IntoIterator<Item = Identity>,
        requests_per_window: u32,
        window_seconds: u32,
    ) -> RateCheck {
        RateCheck {
            buckets: identities
                .into_iter()
                .map(|i| (i, crate::engine::gcra::Bucket::new()))
                .collect(),
            clock: crate::clock::MonotonicClock::new(Box::new(crate::clock::QuantaClock::new())),
            rate: crate::engine::gcra::Rate::new(requests_per_window, window_seconds),
        }
    }

    /// Takes a token for `identity` now; `false` when rate limited or unknown.
    #[inline]
    pub fn check(&self, identity: &str) -> bool {
        match self.buckets.get(identity) {
            Some(bucket) => bucket.try_take(self.clock.now(), self.rate).is_ok(),
            None => false,
        }
    }
}
