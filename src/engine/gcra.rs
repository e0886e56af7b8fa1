//! Rate: the generic cell rate algorithm on one atomic word.
//!
//! A bucket of capacity N refilling one token every T = W/N is fully described by its
//! *theoretical arrival time* (TAT): the instant at which it will be full again. Taking a token
//! moves the TAT forward by T (from `max(TAT, now)`); the token is there if the new TAT is no more
//! than `N·T` ahead of now. A TAT in the past means a full bucket, so a new bucket (TAT 0) starts
//! full. One word means one compare-and-swap per decision, and no timer ever runs.
//!
//! This module knows nothing of clients or time sources: callers pass `now` and the parameters.

use crate::sync::{AtomicU64, Ordering};

/// The shape of a bucket: the emission interval T and the burst span N·T, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rate {
    pub(crate) interval: u64,
    pub(crate) span: u64,
}

impl Rate {
    /// N tokens per `window_seconds`. `requests` and `window_seconds` are at least 1.
    pub(crate) fn new(requests: u32, window_seconds: u32) -> Rate {
        let requests = u64::from(requests.max(1));
        let window = u64::from(window_seconds.max(1)) * 1_000_000_000;
        let interval = (window / requests).max(1);
        Rate {
            interval,
            span: interval * requests,
        }
    }
}

impl Rate {
    /// One token taken at `self`, in the span of a bucket since rescaled to `now`: a rescale keeps
    /// the fraction of the span used, so the token is the same fraction of the new span. Rounded
    /// down, as a rescale rounds the usage up, so a refund never gives back more than was taken.
    pub(crate) fn token_in(self, now: Rate) -> u64 {
        if self.span == now.span {
            return self.interval;
        }
        let scaled =
            u128::from(self.interval) * u128::from(now.span) / u128::from(self.span.max(1));
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }
}

/// One client's token bucket.
#[derive(Debug)]
pub(crate) struct Bucket {
    tat: AtomicU64,
}

impl Bucket {
    /// A full bucket.
    pub(crate) fn new() -> Bucket {
        Bucket {
            tat: AtomicU64::new(0),
        }
    }

    /// Takes one token at `now`, or returns the nanoseconds until one will be there.
    #[inline]
    pub(crate) fn try_take(&self, now: u64, rate: Rate) -> Result<(), u64> {
        // Relaxed: the TAT is the bucket's only state; the CAS orders the decisions on it.
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now).saturating_add(rate.interval);
            let ahead = next - now;
            if ahead > rate.span {
                return Err(ahead - rate.span);
            }
            match self
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(actual) => tat = actual,
            }
        }
    }

    /// Nanoseconds until a token is there at `now` (zero if one is there now). Takes nothing.
    #[inline]
    pub(crate) fn wait(&self, now: u64, rate: Rate) -> u64 {
        let tat = self.tat.load(Ordering::Relaxed);
        let ahead = tat.max(now).saturating_add(rate.interval) - now;
        ahead.saturating_sub(rate.span)
    }

    /// Gives back one token taken earlier at `rate` (a refusal's rollback).
    #[inline]
    pub(crate) fn give_back(&self, rate: Rate) {
        self.give_back_nanos(rate.interval);
    }

    /// Gives back `nanos` of the bucket's span: a token taken earlier, as measured in the rate
    /// the bucket has now (see [`Rate::token_in`]).
    #[inline]
    pub(crate) fn give_back_nanos(&self, nanos: u64) {
        // Relaxed: as in try_take.
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(tat.saturating_sub(nanos))
            });
    }

    /// Rescales the fill level from `old` to `new` at `now`: a bucket that was a third used stays a
    /// third used, so a reload never hands out a fresh burst nor confiscates one.
    pub(crate) fn rescale(&self, now: u64, old: Rate, new: Rate) {
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                Some(rescaled(tat, now, old.span, new.span))
            });
    }

    /// Replays admissions made `ages` nanoseconds before `now` into the bucket (see [`replay`]);
    /// the bucket only ever becomes emptier, never fuller.
    pub(crate) fn replay(&self, now: u64, rate: Rate, ages: impl IntoIterator<Item = u64>) {
        let replayed = replay(now, rate, ages);
        // Relaxed: as in try_take; a take racing this replay keeps its token either way.
        let _ = self
            .tat
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |tat| {
                (replayed > tat).then_some(replayed)
            });
    }

    /// Tokens there at `now`, and the nanoseconds until one more will be (zero when full), from
    /// one load of the TAT so the two agree. Takes nothing.
    pub(crate) fn level(&self, now: u64, rate: Rate) -> (u64, u64) {
        // Relaxed: a lone reading of the bucket's only state.
        level(self.tat.load(Ordering::Relaxed), now, rate)
    }

    /// Whether every token is back at `now`: forgetting the bucket then loses nothing.
    pub(crate) fn is_full(&self, now: u64) -> bool {
        // Relaxed: a lone reading of the bucket's only state.
        self.tat.load(Ordering::Relaxed) <= now
    }

    /// Tokens there at `now` (for metrics and tests).
    pub(crate) fn available(&self, now: u64, rate: Rate) -> u64 {
        let used = self
            .tat
            .load(Ordering::Relaxed)
            .saturating_sub(now)
            .min(rate.span);
        (rate.span - used) / rate.interval
    }
}

/// The TAT `tat`, written under a burst span `old`, in a span `new` at `now`: the used part of the
/// old span (at most all of it) keeps its fraction, rounded up (see [`Bucket::rescale`]; the Redis
/// scripts do the same on their buckets, in microseconds).
pub(crate) fn rescaled(tat: u64, now: u64, old: u64, new: u64) -> u64 {
    let used = tat.saturating_sub(now).min(old);
    let scaled = (u128::from(used) * u128::from(new)).div_ceil(u128::from(old.max(1)));
    now.saturating_add(u64::try_from(scaled).unwrap_or(u64::MAX))
}

/// Tokens a bucket whose TAT is `tat` holds at `now`, and the time until one more will be there
/// (zero when full), in the unit of `tat`, `now` and `rate` (nanoseconds in this engine; the Redis
/// backend reads its buckets in microseconds through this same function).
pub(crate) fn level(tat: u64, now: u64, rate: Rate) -> (u64, u64) {
    let used = tat.saturating_sub(now).min(rate.span);
    let tokens = (rate.span - used) / rate.interval;
    let full = rate.span / rate.interval;
    if tokens >= full {
        return (tokens, 0);
    }
    // One more token is there once `used` has fallen to `span - (tokens + 1)·interval`.
    let next_in = used - (rate.span - (tokens + 1) * rate.interval);
    (tokens, next_in)
}

/// The TAT of a bucket, full before them, after admissions made `ages` nanoseconds before `now`:
/// each admission at `t = now - age`, oldest first, moves the TAT to `max(TAT, t) + T`, as
/// [`Bucket::try_take`] did when it admitted it. An age of a whole window or more counts nothing
/// (its token is back by `now`), and the result is at most `N·T` ahead of `now`, so a replay never
/// locks a client out for longer than one window.
pub(crate) fn replay(now: u64, rate: Rate, ages: impl IntoIterator<Item = u64>) -> u64 {
    let mut ages: Vec<u64> = ages.into_iter().filter(|&age| age < rate.span).collect();
    ages.sort_unstable_by(|a, b| b.cmp(a));
    // Relative to `now`, signed: `now` counts from the clock's start, and an admission may
    // predate it (it was made by an earlier process). `None`: full since before any admission.
    let mut ahead: Option<i128> = None;
    for age in ages {
        let at = -i128::from(age);
        ahead = Some(ahead.map_or(at, |tat| tat.max(at)) + i128::from(rate.interval));
    }
    let Some(ahead) = ahead else { return 0 };
    let ahead = ahead.min(i128::from(rate.span));
    u64::try_from((i128::from(now) + ahead).max(0)).unwrap_or(u64::MAX)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn new_bucket_is_full_and_holds_exactly_its_capacity() {
        let b = Bucket::new();
        let r = Rate::new(3, 60);
        for _ in 0..3 {
            assert!(b.try_take(SEC, r).is_ok());
        }
        assert_eq!(b.try_take(SEC, r), Err(20 * SEC));
    }

    #[test]
    fn awkward_ratios_still_hold_exactly_n() {
        let r = Rate::new(999_999, 1);
        let b = Bucket::new();
        let taken = (0..1_000_001)
            .take_while(|_| b.try_take(5, r).is_ok())
            .count();
        assert_eq!(taken, 999_999);
    }

    #[test]
    fn refused_take_changes_nothing() {
        let b = Bucket::new();
        let r = Rate::new(1, 10);
        assert!(b.try_take(0, r).is_ok());
        let before = b.tat.load(Ordering::Relaxed);
        assert!(b.try_take(SEC, r).is_err());
        assert_eq!(b.tat.load(Ordering::Relaxed), before);
        assert_eq!(b.wait(SEC, r), 9 * SEC);
    }

    #[test]
    fn one_token_returns_every_interval() {
        let b = Bucket::new();
        let r = Rate::new(2, 2);
        assert!(b.try_take(0, r).is_ok());
        assert!(b.try_take(0, r).is_ok());
        assert!(b.try_take(SEC - 1, r).is_err());
        assert!(b.try_take(SEC, r).is_ok());
    }

    #[test]
    fn give_back_returns_a_token() {
        let b = Bucket::new();
        let r = Rate::new(1, 60);
        assert!(b.try_take(0, r).is_ok());
        b.give_back(r);
        assert!(b.try_take(0, r).is_ok());
    }

    #[test]
    fn replayed_admissions_spend_the_bucket_as_they_did_when_made() {
        let r = Rate::new(3, 3600);
        let now = 10 * SEC;
        // Three admissions a minute, two minutes and three minutes ago spent a 3-per-hour bucket.
        let b = Bucket::new();
        b.replay(now, r, [60 * SEC, 180 * SEC, 120 * SEC]);
        // The oldest admission's token is back 20 minutes after it was taken.
        assert_eq!(b.try_take(now, r), Err(1200 * SEC - 180 * SEC));
        assert_eq!(b.available(now, r), 0);
    }

    #[test]
    fn replay_matches_taking_the_tokens_live() {
        let r = Rate::new(5, 10);
        let live = Bucket::new();
        let times = [100 * SEC, 101 * SEC, 101 * SEC, 104 * SEC, 108 * SEC];
        for t in times {
            live.try_take(t, r).unwrap();
        }
        let now = 109 * SEC;
        let replayed = Bucket::new();
        replayed.replay(now, r, times.map(|t| now - t));
        assert_eq!(
            replayed.tat.load(Ordering::Relaxed),
            live.tat.load(Ordering::Relaxed)
        );
    }

    #[test]
    fn admissions_a_window_old_or_older_count_nothing() {
        let r = Rate::new(2, 2);
        let b = Bucket::new();
        b.replay(10 * SEC, r, [2 * SEC, 3 * SEC, 50 * SEC]);
        assert_eq!(b.available(10 * SEC, r), 2);
    }

    #[test]
    fn replay_never_refills_a_bucket() {
        let r = Rate::new(2, 60);
        let b = Bucket::new();
        b.try_take(SEC, r).unwrap();
        b.try_take(SEC, r).unwrap();
        let before = b.tat.load(Ordering::Relaxed);
        // One old admission says less than the live bucket knows: the bucket stays as it was.
        b.replay(2 * SEC, r, [50 * SEC]);
        assert_eq!(b.tat.load(Ordering::Relaxed), before);
        assert_eq!(b.available(2 * SEC, r), 0);
    }

    #[test]
    fn replay_never_locks_out_for_more_than_a_window() {
        // More admissions than the bucket holds (the limit was lowered since): empty, with the
        // next token one interval away, never later.
        let r = Rate::new(2, 10);
        let b = Bucket::new();
        b.replay(20 * SEC, r, [0; 50]);
        assert_eq!(b.wait(20 * SEC, r), 5 * SEC);
    }

    #[test]
    fn replay_handles_admissions_older_than_the_clock_start() {
        // A fresh process's clock reads near zero; admissions from the last process predate it.
        let r = Rate::new(3, 3600);
        let b = Bucket::new();
        b.replay(SEC, r, [30 * SEC, 20 * SEC, 10 * SEC]);
        assert_eq!(b.available(SEC, r), 0);
        assert_eq!(b.wait(SEC, r), 1200 * SEC - 30 * SEC);
    }

    #[test]
    fn level_reports_the_wait_a_refusal_would_report() {
        let b = Bucket::new();
        let r = Rate::new(3, 60);
        assert_eq!(b.level(SEC, r), (3, 0));
        b.try_take(SEC, r).unwrap();
        assert_eq!(b.level(SEC, r), (2, 20 * SEC));
        b.try_take(SEC, r).unwrap();
        b.try_take(SEC, r).unwrap();
        assert_eq!(b.level(SEC, r), (0, b.wait(SEC, r)));
        assert_eq!(b.level(SEC + 5 * SEC, r), (0, 15 * SEC));
        assert_eq!(b.level(21 * SEC, r), (1, 20 * SEC));
    }

    #[test]
    fn a_token_given_back_after_a_rescale_is_the_fraction_it_took() {
        let old = Rate::new(10, 10);
        let new = Rate::new(10, 100);
        let (b, twin) = (Bucket::new(), Bucket::new());
        for _ in 0..3 {
            b.try_take(0, old).unwrap();
            twin.try_take(0, old).unwrap();
        }
        b.try_take(0, old).unwrap();
        b.rescale(0, old, new);
        twin.rescale(0, old, new);
        b.give_back_nanos(old.token_in(new));
        assert_eq!(
            b.tat.load(Ordering::Relaxed),
            twin.tat.load(Ordering::Relaxed)
        );
        assert_eq!(old.token_in(old), old.interval);
    }

    #[test]
    fn rescale_keeps_the_fill_fraction() {
        let b = Bucket::new();
        let old = Rate::new(10, 10);
        for _ in 0..5 {
            b.try_take(0, old).unwrap();
        }
        let new = Rate::new(100, 10);
        b.rescale(0, old, new);
        assert_eq!(b.available(0, new), 50);
        let smaller = Rate::new(2, 10);
        b.rescale(0, new, smaller);
        assert_eq!(b.available(0, smaller), 1);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two threads race for the last token: exactly one gets it.
    #[test]
    fn loom_bucket_hands_out_each_token_once() {
        loom::model(|| {
            let rate = Rate::new(2, 1);
            let bucket = Arc::new(Bucket::new());
            bucket.try_take(0, rate).unwrap();
            let b2 = bucket.clone();
            let t = thread::spawn(move || b2.try_take(0, rate).is_ok());
            let mine = bucket.try_take(0, rate).is_ok();
            let theirs = t.join().unwrap();
            assert!(mine ^ theirs);
            assert!(bucket.try_take(0, rate).is_err());
        });
    }

    /// A give-back racing a take never loses or duplicates a token.
    #[test]
    fn loom_give_back_racing_take_conserves_tokens() {
        loom::model(|| {
            let rate = Rate::new(1, 1);
            let bucket = Arc::new(Bucket::new());
            bucket.try_take(0, rate).unwrap();
            let b2 = bucket.clone();
            let t = thread::spawn(move || b2.give_back(rate));
            let got = bucket.try_take(0, rate).is_ok();
            t.join().unwrap();
            // Either the take saw the returned token, or the token is still there now.
            let left = bucket.try_take(0, rate).is_ok();
            assert!(got ^ left);
        });
    }
}
