//! Refusals answered from memory, so that refusals cost Redis nothing after the first: when Redis
//! refuses a client, this replica remembers the answer and refuses that client's next
//! submissions itself, without calling Redis, until the answer can have changed.
//!
//! What can change a refusal into an admission, and so ends a remembered one:
//!
//! - **time**: a rate refusal ends at the exact moment the next token exists (Redis's wait,
//!   counted on this replica's monotonic clock from the moment the call was *sent*, never later
//!   than Redis's own moment); a capacity refusal ends when its hint (Retry-After) has passed;
//! - **a notice** from any replica, carried through Redis itself: the transition, reap and
//!   replace scripts `PUBLISH` on the deployment's channel (`{prefix}:notices`) whenever they
//!   lower a count — `r <client>` (a release, or an approval, which lowers the pending counts),
//!   `f <client>` (a refund: a release and the rate token back), `*` (a replica's holdings were
//!   reaped, or registered again in a way that may have lowered a count — something released,
//!   or Redis forgot: anything may have changed). The batch script publishes its `r` and `f`
//!   notices only while the refusal marker lives: the call that gives a refusal (from a replica
//!   whose memory is on) keeps it alive past the longest that refusal can be remembered
//!   (`Inner::remembered_millis`), so no remembered refusal misses a notice that ends it, and a
//!   deployment that refuses nothing publishes nothing. A rate refusal ends with a refund
//!   for that client; a refusal for the client's own capacity with a release for that client; a
//!   refusal for a global limit (or the pending grants) with any release;
//! - **this replica**: a reload (its limits are what the script is sent), and a lost
//!   subscription (a reconnect): notices may have been missed, so everything is forgotten, and
//!   nothing is remembered until the subscription is live again. And an admission of the client
//!   here: it spent a token and took slots, so what Redis would answer next (the code, the
//!   Retry-After) may differ from what is remembered — a remembered `client_pending_limit`
//!   covers only submissions needing approval, and one that needs none may take the last token,
//!   after which Redis answers `submission_rate_limited` with a longer wait. (An admission on
//!   another replica sends no notice: what is remembered then stays a refusal Redis would also
//!   give, possibly with another code, until its own end.)
//!
//! A notice that arrives while a call is in flight keeps that call's refusal from being
//! remembered at all (each entry carries the notice counters read when its call was sent, and
//! must still match them), so a notice is never lost between a refusal and its entry. A notice
//! that never arrives (a silent connection) can only make a refusal last until its own wait or
//! hint, which Redis itself would have answered: the memory only ever refuses.
//!
//! What a refusal covers decides which submissions it answers: a rate or client-active refusal
//! covers the client's submissions with and without approval; a pending refusal
//! (`client_pending_limit`, `pending_grant_limit`) only those that need approval; a global
//! refusal of a submission that needed approval covers both, one of a submission that did not
//! only those (a submission needing approval would meet the pending checks first, and so another
//! code). Memory is bounded by the configured identities (one small entry per client).
//!
//! Past the usual size only because its tests (refusals against notices, reloads and lost
//! subscriptions, in every order) live beside it; the memory itself is under 480 lines.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::reply::Reading;
use crate::config::ClientLimits;
use crate::engine::{FairShareRefusal, RefusalCode};

/// Why remembered refusals were forgotten, in the order of the metric's `reason` labels
/// ([`crate::admission::outcome::BackendStats::FORGOTTEN_REASONS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Forgotten {
    /// Its wait or hint had passed.
    Expired,
    /// A refund for the client was seen (ends a rate refusal).
    Refund,
    /// A release for the client was seen (ends a refusal for its own capacity).
    Release,
    /// A release for any client was seen (ends a refusal for a global limit).
    AnyRelease,
    /// A replica's holdings were reaped or registered again.
    Replaced,
    /// The notice subscription was lost or made again.
    Resubscribed,
    /// This replica reloaded its limits.
    Reload,
    /// This replica admitted the client (its bucket and counts moved).
    Admitted,
}

const _: () = assert!(
    Forgotten::ALL.len() == crate::admission::outcome::BackendStats::FORGOTTEN_REASONS.len()
);

impl Forgotten {
    pub(crate) const ALL: [Forgotten; 8] = [
        Forgotten::Expired,
        Forgotten::Refund,
        Forgotten::Release,
        Forgotten::AnyRelease,
        Forgotten::Replaced,
        Forgotten::Resubscribed,
        Forgotten::Reload,
        Forgotten::Admitted,
    ];
}

/// What a remembered refusal depends on besides time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// The client's rate: ends with a refund for it.
    Rate,
    /// The client's own counts: ends with a release for it.
    Client,
    /// A global count: ends with any release.
    Global,
}

/// The notice counters as a call was sent (or an entry was made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ticket {
    generation: u64,
    replaced: u64,
    any: u64,
    released: u64,
    refunded: u64,
    admitted: u64,
    /// When the call was sent.
    at: Instant,
}

/// A refusal Redis gave, as remembered.
#[derive(Clone, Copy, Debug)]
struct Entry {
    code: RefusalCode,
    /// Whether a pool's fair share made it.
    fair_share: Option<FairShareRefusal>,
    scope: Scope,
    seen: Ticket,
    /// Until when it answers (the next token, or the capacity hint).
    until: Instant,
    /// Until the next token, from `seen.at` (counts down).
    rate_wait: Duration,
    /// The capacity hint, if a capacity dimension was exhausted (does not count down: a
    /// capacity refusal's Retry-After is the hint, as Redis's would be).
    capacity_hint: Option<Duration>,
    limits: ClientLimits,
    rate: (u64, u64),
    reading: Reading,
}

/// A refusal answered from memory: the code, the wait left, and what the quota is read from
/// (the client's reading advanced by the time that passed).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recalled {
    pub(crate) code: RefusalCode,
    pub(crate) fair_share: Option<FairShareRefusal>,
    pub(crate) wait_left: Duration,
    pub(crate) limits: ClientLimits,
    pub(crate) rate: (u64, u64),
    pub(crate) reading: Reading,
}

/// What Redis answered, to remember.
pub(crate) struct Answer {
    pub(crate) code: RefusalCode,
    /// Whether a pool's fair share made it.
    pub(crate) fair_share: Option<FairShareRefusal>,
    pub(crate) needs_approval: bool,
    /// Until the next token (µs after the decision).
    pub(crate) rate_wait_micros: u64,
    /// The capacity hint, if a capacity dimension is exhausted.
    pub(crate) capacity_hint: Option<Duration>,
    pub(crate) limits: ClientLimits,
    pub(crate) rate: (u64, u64),
    pub(crate) reading: Reading,
}

#[derive(Default)]
struct Client {
    /// Releases seen for this client (refunds included).
    released: u64,
    /// Refunds seen for this client.
    refunded: u64,
    /// Admissions of this client made here.
    admitted: u64,
    /// Indexed by whether the submission needs approval.
    slots: [Option<Entry>; 2],
}

#[derive(Default)]
struct State {
    /// Whether the notice subscription is live: nothing is remembered or answered otherwise.
    live: bool,
    /// Bumped whenever the subscription is gained or lost and on every forget-all.
    generation: u64,
    /// `*` notices seen.
    replaced: u64,
    /// Notices seen (any release anywhere).
    any: u64,
    clients: HashMap<String, Client>,
}

/// One replica's refusal memory. Every method takes the one lock briefly (no await under it).
#[derive(Default)]
pub(crate) struct RefusalMemory {
    state: Mutex<State>,
    answered: AtomicU64,
    forgotten: [AtomicU64; Forgotten::ALL.len()],
}

impl RefusalMemory {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    fn count(&self, why: Forgotten, n: u64) {
        if n > 0 {
            // Relaxed: a statistic.
            self.forgotten[why as usize].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// A remembered refusal that answers `client`'s submission now, if one does. A stale entry
    /// met here is forgotten (and counted by why).
    pub(crate) fn recall(
        &self,
        client: &str,
        needs_approval: bool,
        now: Instant,
    ) -> Option<Recalled> {
        let mut state = self.lock();
        if !state.live {
            return None;
        }
        let (replaced, any) = (state.replaced, state.any);
        let memory = state.clients.get_mut(client)?;
        let slot = &mut memory.slots[usize::from(needs_approval)];
        let entry = (*slot)?;
        let stale = if entry.seen.replaced != replaced {
            Some(Forgotten::Replaced)
        } else {
            match entry.scope {
                Scope::Rate if entry.seen.refunded != memory.refunded => Some(Forgotten::Refund),
                Scope::Client if entry.seen.released != memory.released => Some(Forgotten::Release),
                Scope::Global if entry.seen.any != any => Some(Forgotten::AnyRelease),
                _ if now >= entry.until => Some(Forgotten::Expired),
                _ => None,
            }
        };
        if let Some(why) = stale {
            *slot = None;
            drop(state);
            self.count(why, 1);
            return None;
        }
        drop(state);
        // Relaxed: a statistic.
        self.answered.fetch_add(1, Ordering::Relaxed);
        let elapsed = now.saturating_duration_since(entry.seen.at);
        let mut reading = entry.reading;
        reading.now_micros = reading
            .now_micros
            .saturating_add(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX));
        Some(Recalled {
            code: entry.code,
            fair_share: entry.fair_share,
            // As Redis would answer now: the time to the next token, or the capacity hint if
            // that is longer (the largest hint wins).
            wait_left: entry
                .rate_wait
                .saturating_sub(elapsed)
                .max(entry.capacity_hint.unwrap_or(Duration::ZERO)),
            limits: entry.limits,
            rate: entry.rate,
            reading,
        })
    }

    /// The counters to send a call for `client` with, taken just before it is sent (`None` while
    /// the subscription is not live: its answer will not be remembered).
    pub(crate) fn ticket(&self, client: &str) -> Option<Ticket> {
        let mut state = self.lock();
        if !state.live {
            return None;
        }
        let (generation, replaced, any) = (state.generation, state.replaced, state.any);
        // The client's entry is made now (bounded by the configured identities), so a notice
        // for it that arrives while the call is in flight is counted and seen.
        let memory = state.clients.entry(client.to_owned()).or_default();
        Some(Ticket {
            generation,
            replaced,
            any,
            released: memory.released,
            refunded: memory.refunded,
            admitted: memory.admitted,
            at: Instant::now(),
        })
    }

    /// Remembers Redis's refusal of a call sent with `ticket`, unless a notice that may bear on it
    /// arrived meanwhile (or the subscription changed): then it is not remembered at all.
    pub(crate) fn remember(&self, client: &str, ticket: Ticket, answer: Answer) {
        let (scope, until) = match answer.code {
            RefusalCode::SubmissionRateLimited => (
                Scope::Rate,
                ticket.at + Duration::from_micros(answer.rate_wait_micros),
            ),
            RefusalCode::ClientOperationLimit | RefusalCode::ClientPendingLimit => {
                (Scope::Client, ticket.at + hint(&answer))
            }
            RefusalCode::PendingGrantLimit
            | RefusalCode::GlobalOperationLimit
            | RefusalCode::GlobalExecutionLimit => (Scope::Global, ticket.at + hint(&answer)),
            // Decided without Redis, or not a submission's refusal: nothing to remember.
            _ => return,
        };
        // Which submissions the refusal answers: [without approval, with approval].
        let covers = match answer.code {
            RefusalCode::SubmissionRateLimited | RefusalCode::ClientOperationLimit => [true; 2],
            RefusalCode::ClientPendingLimit | RefusalCode::PendingGrantLimit => [false, true],
            _ => [true, answer.needs_approval],
        };
        let mut state = self.lock();
        if !state.live
            || state.generation != ticket.generation
            || state.replaced != ticket.replaced
            || (scope == Scope::Global && state.any != ticket.any)
        {
            return;
        }
        let Some(memory) = state.clients.get_mut(client) else {
            return;
        };
        if (scope == Scope::Client && memory.released != ticket.released)
            || (scope == Scope::Rate && memory.refunded != ticket.refunded)
            || memory.admitted != ticket.admitted
        {
            return;
        }
        let entry = Entry {
            code: answer.code,
            fair_share: answer.fair_share,
            scope,
            seen: ticket,
            until,
            rate_wait: Duration::from_micros(answer.rate_wait_micros),
            capacity_hint: answer.capacity_hint,
            limits: answer.limits,
            rate: answer.rate,
            reading: answer.reading,
        };
        for (slot, covered) in memory.slots.iter_mut().zip(covers) {
            if covered {
                *slot = Some(entry);
            }
        }
    }

    /// A message from the deployment's channel: one notice a line (a batch of decisions
    /// publishes all of its notices in one message), each heard as [`RefusalMemory::notice_one`].
    pub(crate) fn notice(&self, payload: &[u8]) {
        for line in payload.split(|&b| b == b'\n') {
            self.notice_one(line);
        }
    }

    /// One notice: `r <client>`, `f <client>` or `*`. Anything else is treated as `*` (a notice
    /// not understood may have changed anything).
    fn notice_one(&self, payload: &[u8]) {
        let mut state = self.lock();
        state.any += 1;
        let (kind, client) = match payload {
            [kind @ (b'r' | b'f'), b' ', client @ ..] => (*kind, client),
            _ => {
                state.replaced += 1;
                let cleared = clear_entries(&mut state);
                drop(state);
                self.count(Forgotten::Replaced, cleared);
                return;
            }
        };
        let Some(memory) = std::str::from_utf8(client)
            .ok()
            .and_then(|c| state.clients.get_mut(c))
        else {
            // Nothing of this client is remembered or in flight here.
            return;
        };
        memory.released += 1;
        let why = if kind == b'f' {
            memory.refunded += 1;
            Forgotten::Refund
        } else {
            Forgotten::Release
        };
        // The client's own entries that this notice ends, forgotten now (global ones lazily).
        let mut ended = 0;
        for slot in &mut memory.slots {
            if slot.is_some_and(|e| e.scope == Scope::Client || why == Forgotten::Refund) {
                *slot = None;
                ended += 1;
            }
        }
        drop(state);
        self.count(why, ended);
    }

    /// A release (or, with `refund`, a refund) this replica made for `client`: heard at once,
    /// without waiting for its notice to come back from Redis.
    pub(crate) fn released_here(&self, client: &str, refund: bool) {
        let mut payload = Vec::with_capacity(client.len() + 2);
        payload.extend_from_slice(if refund { b"f " } else { b"r " });
        payload.extend_from_slice(client.as_bytes());
        self.notice(&payload);
    }

    /// This replica admitted `client`: its remembered refusals are forgotten, and a refusal of a
    /// call sent before it is not remembered (Redis's next answer may differ from either).
    pub(crate) fn admitted_here(&self, client: &str) {
        let mut state = self.lock();
        let Some(memory) = state.clients.get_mut(client) else {
            return;
        };
        memory.admitted += 1;
        let ended = memory
            .slots
            .iter_mut()
            .map(|slot| u64::from(slot.take().is_some()))
            .sum();
        drop(state);
        self.count(Forgotten::Admitted, ended);
    }

    /// The subscription is live (again): refusals may be remembered from now on.
    pub(crate) fn subscribed(&self) {
        let mut state = self.lock();
        state.live = true;
        state.generation += 1;
    }

    /// The subscription was lost: notices may be missed, so everything is forgotten and nothing
    /// is remembered until it is live again.
    pub(crate) fn unsubscribed(&self) {
        let mut state = self.lock();
        state.live = false;
        self.forget_locked(state, Forgotten::Resubscribed);
    }

    /// Forgets every remembered refusal (a reload: the limits changed).
    pub(crate) fn forget_all(&self, why: Forgotten) {
        let state = self.lock();
        self.forget_locked(state, why);
    }

    fn forget_locked(&self, mut state: std::sync::MutexGuard<'_, State>, why: Forgotten) {
        state.generation += 1;
        let cleared = clear_entries(&mut state);
        drop(state);
        self.count(why, cleared);
    }

    /// Whether the subscription is live now.
    pub(crate) fn is_live(&self) -> bool {
        self.lock().live
    }

    /// Submissions answered from memory so far.
    pub(crate) fn answered(&self) -> u64 {
        // Relaxed: a statistic.
        self.answered.load(Ordering::Relaxed)
    }

    /// Remembered refusals forgotten so far, by why.
    pub(crate) fn forgotten(&self) -> [u64; Forgotten::ALL.len()] {
        // Relaxed: statistics.
        std::array::from_fn(|i| self.forgotten[i].load(Ordering::Relaxed))
    }
}

/// The capacity hint of an answer (a capacity code always has one; at least a second).
fn hint(answer: &Answer) -> Duration {
    answer.capacity_hint.unwrap_or(Duration::from_secs(1))
}

/// Empties every client's slots; how many entries there were.
fn clear_entries(state: &mut State) -> u64 {
    let mut cleared = 0;
    for memory in state.clients.values_mut() {
        for slot in &mut memory.slots {
            cleared += u64::from(slot.take().is_some());
        }
    }
    cleared
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ClientLimits {
        ClientLimits {
            requests_per_window: 10,
            window_seconds: 60,
            active: 5,
            pending: 2,
        }
    }

    fn answer(code: RefusalCode, needs_approval: bool) -> Answer {
        Answer {
            code,
            fair_share: None,
            needs_approval,
            rate_wait_micros: if code == RefusalCode::SubmissionRateLimited {
                5_000_000
            } else {
                0
            },
            capacity_hint: code.is_capacity().then_some(Duration::from_secs(2)),
            limits: limits(),
            rate: (6_000_000, 60_000_000),
            reading: Reading {
                tat_micros: 100,
                now_micros: 50,
                active: 1,
                pending: 2,
            },
        }
    }

    fn live() -> RefusalMemory {
        let memory = RefusalMemory::default();
        memory.subscribed();
        memory
    }

    #[test]
    fn nothing_is_remembered_or_answered_while_the_subscription_is_not_live() {
        let memory = RefusalMemory::default();
        assert!(memory.ticket("amy").is_none());
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.unsubscribed();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::ClientOperationLimit, false),
        );
        memory.subscribed();
        assert!(memory.recall("amy", false, Instant::now()).is_none());
    }

    #[test]
    fn a_pending_refusal_answers_only_submissions_that_need_approval() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember("amy", ticket, answer(RefusalCode::ClientPendingLimit, true));
        let now = Instant::now();
        let recalled = memory.recall("amy", true, now).unwrap();
        assert_eq!(recalled.code, RefusalCode::ClientPendingLimit);
        assert!(memory.recall("amy", false, now).is_none());
        assert!(memory.recall("bob", true, now).is_none());
        assert_eq!(memory.answered(), 1);
    }

    #[test]
    fn an_admission_here_forgets_the_clients_refusals_and_keeps_an_earlier_call_from_remembering() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember("amy", ticket, answer(RefusalCode::ClientPendingLimit, true));
        let in_flight = memory.ticket("amy").unwrap();
        memory.admitted_here("amy");
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        // A refusal of a call sent before the admission is not remembered either.
        memory.remember(
            "amy",
            in_flight,
            answer(RefusalCode::SubmissionRateLimited, true),
        );
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        assert!(memory.recall("amy", false, Instant::now()).is_none());
        let admitted = Forgotten::ALL
            .iter()
            .position(|w| *w == Forgotten::Admitted)
            .unwrap();
        assert_eq!(memory.forgotten()[admitted], 1);
        // One sent after it is.
        let after = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            after,
            answer(RefusalCode::SubmissionRateLimited, true),
        );
        assert!(memory.recall("amy", false, Instant::now()).is_some());
    }

    #[test]
    fn a_global_refusal_without_approval_does_not_answer_one_with_approval() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::GlobalOperationLimit, false),
        );
        assert!(memory.recall("amy", false, Instant::now()).is_some());
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        let ticket = memory.ticket("bob").unwrap();
        memory.remember(
            "bob",
            ticket,
            answer(RefusalCode::GlobalOperationLimit, true),
        );
        assert!(memory.recall("bob", false, Instant::now()).is_some());
        assert!(memory.recall("bob", true, Instant::now()).is_some());
    }

    #[test]
    fn a_release_for_the_client_ends_its_capacity_refusal_but_not_its_rate_refusal() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::ClientOperationLimit, false),
        );
        let ticket = memory.ticket("bob").unwrap();
        memory.remember(
            "bob",
            ticket,
            answer(RefusalCode::SubmissionRateLimited, true),
        );
        memory.notice(b"r bob");
        assert!(memory.recall("amy", false, Instant::now()).is_some());
        assert!(memory.recall("bob", false, Instant::now()).is_some());
        memory.notice(b"r amy");
        assert!(memory.recall("amy", false, Instant::now()).is_none());
        memory.notice(b"f bob");
        assert!(memory.recall("bob", true, Instant::now()).is_none());
        let forgotten = memory.forgotten();
        assert_eq!(
            forgotten[Forgotten::Release as usize],
            2,
            "both of amy's slots"
        );
        assert_eq!(
            forgotten[Forgotten::Refund as usize],
            2,
            "both of bob's slots"
        );
    }

    #[test]
    fn a_batchs_notices_in_one_message_are_each_heard() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::ClientOperationLimit, false),
        );
        let ticket = memory.ticket("bob").unwrap();
        memory.remember(
            "bob",
            ticket,
            answer(RefusalCode::SubmissionRateLimited, true),
        );
        let ticket = memory.ticket("cat").unwrap();
        memory.remember("cat", ticket, answer(RefusalCode::ClientPendingLimit, true));
        // One batch released one of amy's and refunded one of bob's; cat was not named.
        memory.notice(b"r amy\nf bob");
        assert!(memory.recall("amy", false, Instant::now()).is_none());
        assert!(memory.recall("bob", true, Instant::now()).is_none());
        assert!(memory.recall("cat", true, Instant::now()).is_some());
    }

    #[test]
    fn any_release_ends_a_global_refusal_and_a_star_ends_everything() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::GlobalExecutionLimit, true),
        );
        memory.notice(b"r someone-else");
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        assert_eq!(memory.forgotten()[Forgotten::AnyRelease as usize], 1);
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::SubmissionRateLimited, false),
        );
        memory.notice(b"*");
        assert!(memory.recall("amy", false, Instant::now()).is_none());
        assert_eq!(memory.forgotten()[Forgotten::Replaced as usize], 2);
    }

    #[test]
    fn a_notice_while_the_call_is_in_flight_keeps_its_refusal_from_being_remembered() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.notice(b"r amy");
        memory.remember("amy", ticket, answer(RefusalCode::ClientPendingLimit, true));
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        // A global refusal is kept off by anyone's release in flight.
        let ticket = memory.ticket("amy").unwrap();
        memory.notice(b"r bob");
        memory.remember("amy", ticket, answer(RefusalCode::PendingGrantLimit, true));
        assert!(memory.recall("amy", true, Instant::now()).is_none());
        // A reload in flight too.
        let ticket = memory.ticket("amy").unwrap();
        memory.forget_all(Forgotten::Reload);
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::ClientOperationLimit, true),
        );
        assert!(memory.recall("amy", true, Instant::now()).is_none());
    }

    #[test]
    fn the_wait_counts_down_from_the_send_and_the_entry_ends_at_its_time() {
        let memory = live();
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::SubmissionRateLimited, false),
        );
        let later = ticket.at + Duration::from_secs(3);
        let recalled = memory.recall("amy", false, later).unwrap();
        assert_eq!(recalled.wait_left, Duration::from_secs(2));
        assert_eq!(recalled.reading.now_micros, 50 + 3_000_000);
        // The next token exists 5 s after the send: from then on Redis decides.
        assert!(
            memory
                .recall("amy", false, ticket.at + Duration::from_secs(5))
                .is_none()
        );
        assert_eq!(memory.forgotten()[Forgotten::Expired as usize], 1);
        // A capacity refusal lasts its hint (2 s), even though its whole wait is 5 s.
        let ticket = memory.ticket("amy").unwrap();
        memory.remember(
            "amy",
            ticket,
            answer(RefusalCode::ClientOperationLimit, false),
        );
        // Its Retry-After is the hint throughout, as Redis would answer it (it does not count
        // down as a token's wait does).
        let recalled = memory
            .recall("amy", false, ticket.at + Duration::from_millis(1200))
            .unwrap();
        assert_eq!(recalled.wait_left, Duration::from_secs(2));
        assert!(
            memory
                .recall("amy", false, ticket.at + Duration::from_millis(1999))
                .is_some()
        );
        assert!(
            memory
                .recall("amy", false, ticket.at + Duration::from_secs(2))
                .is_none()
        );
    }

    #[test]
    fn a_lost_subscription_forgets_everything() {
        let memory = live();
        for client in ["amy", "bob"] {
            let ticket = memory.ticket(client).unwrap();
            memory.remember(
                client,
                ticket,
                answer(RefusalCode::ClientOperationLimit, false),
            );
        }
        memory.unsubscribed();
        memory.subscribed();
        assert!(memory.recall("amy", false, Instant::now()).is_none());
        assert!(memory.recall("bob", true, Instant::now()).is_none());
        assert_eq!(memory.forgotten()[Forgotten::Resubscribed as usize], 4);
    }
}
