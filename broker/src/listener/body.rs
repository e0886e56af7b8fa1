//! The pause between two parts of a request body, its whole-request deadline and its minimum
//! rate.
//!
//! The body timeout bounds the pause between two parts of a body (a pause past it is an error the
//! handler answers as a body it could not read, not a cut-off); a client that sends one byte just
//! before each pause ends would keep its connection forever, so [`LimitedBody`] also bounds the
//! whole: once the handler starts reading, the body must end within the deadline, and past a
//! grace period its average rate must stay at or above the minimum. A body that breaks either
//! ends in a [`BodyCutOff`] error, which the handler answers as any body it could not read; the
//! connection then closes, since its request was not read to its end.
//!
//! The clock starts when the handler first asks for the body, not when the head arrived: time a
//! request spends waiting for the broker (a lock, a fairness queue) is not the client's.
//!
//! One timer at most per body, armed only when the body has to wait for the client: a body that
//! is already in (most are, whole, with their head) is read without touching tokio's timer wheel.

use std::error::Error;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::time::Sleep;

type BoxError = Box<dyn Error + Send + Sync>;

/// The least time between two checks of a body's rate, so a check that lands exactly on the
/// limit does not spin.
const RECHECK: Duration = Duration::from_millis(1);

/// What a body must keep to: the whole within `deadline`; past `grace`, at least `min_rate`
/// bytes a second on average (0: no minimum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BodyLimits {
    pub(crate) deadline: Duration,
    pub(crate) min_rate: u64,
    pub(crate) grace: Duration,
}

impl BodyLimits {
    /// Whether a body that started `elapsed` ago and has brought `bytes` breaks a limit, and
    /// which.
    fn broken(&self, elapsed: Duration, bytes: u64) -> Option<CutOffReason> {
        if elapsed >= self.deadline {
            return Some(CutOffReason::Deadline);
        }
        let too_slow =
            u128::from(bytes) * 1_000_000_000 < u128::from(self.min_rate) * elapsed.as_nanos();
        (self.min_rate > 0 && elapsed >= self.grace && too_slow).then_some(CutOffReason::TooSlow)
    }

    /// When a body that started at `started` with `bytes` so far next needs checking: at its
    /// deadline, or when its average would fall below the minimum if nothing more came.
    fn next_check(&self, started: Instant, bytes: u64) -> Instant {
        let deadline = started + self.deadline;
        if self.min_rate == 0 {
            return deadline;
        }
        let secs = bytes as f64 / self.min_rate as f64;
        let starving = Duration::try_from_secs_f64(secs).unwrap_or(self.deadline);
        deadline.min(started + starving.max(self.grace))
    }
}

/// Why a body was cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutOffReason {
    /// The whole body took longer than [`super::ConnectionSettings::body_deadline`].
    Deadline,
    /// Past [`super::ConnectionSettings::body_rate_grace`], it arrived slower on average than
    /// [`super::ConnectionSettings::body_min_rate`].
    TooSlow,
}

impl CutOffReason {
    /// The metric label: `deadline` or `too_slow`.
    pub fn as_str(self) -> &'static str {
        match self {
            CutOffReason::Deadline => "deadline",
            CutOffReason::TooSlow => "too_slow",
        }
    }
}

/// The error a handler reads from a request body that was cut off. Find it in an error's source
/// chain with [`body_cut_off`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyCutOff {
    /// Why.
    pub reason: CutOffReason,
    /// How long the body had been read for.
    pub after: Duration,
    /// The bytes that had arrived.
    pub bytes: u64,
}

impl fmt::Display for BodyCutOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.after.as_secs_f64();
        match self.reason {
            CutOffReason::Deadline => write!(
                f,
                "the request body was cut off: it was still arriving after {secs:.1} s"
            ),
            CutOffReason::TooSlow => write!(
                f,
                "the request body was cut off: {} bytes in {secs:.1} s is below the minimum rate",
                self.bytes
            ),
        }
    }
}

impl Error for BodyCutOff {}

/// The error a handler reads from a request body that paused longer than the body timeout
/// between two of its parts (or before its first): not a cut-off, a body that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BodyPaused {
    /// The pause allowed.
    pub(crate) timeout: Duration,
}

impl fmt::Display for BodyPaused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request body paused longer than {:.1} s",
            self.timeout.as_secs_f64()
        )
    }
}

impl Error for BodyPaused {}

/// The [`BodyCutOff`] somewhere in `err`'s source chain (as wrapped by axum, tower-http or
/// `http_body_util::Limited`), if the body failed because it was cut off.
pub fn body_cut_off<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a BodyCutOff> {
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(cut) = err.downcast_ref::<BodyCutOff>() {
            return Some(cut);
        }
        next = err.source();
    }
    None
}

type ReasonLabels = [(&'static str, &'static str); 1];

/// The listener's count of bodies cut off, `broker_body_deadlines_total{reason}`; clones count
/// together. Give it to the broker's registry with [`BodyMetrics::register`].
#[derive(Clone, Debug, Default)]
pub struct BodyMetrics {
    cut_off: Family<ReasonLabels, Counter>,
}

impl BodyMetrics {
    /// Registers `broker_body_deadlines_total{reason="deadline"|"too_slow"}` in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        for reason in [CutOffReason::Deadline, CutOffReason::TooSlow] {
            let _ = self.cut_off.get_or_create(&[("reason", reason.as_str())]);
        }
        registry.register(
            "broker_body_deadlines",
            "Request bodies cut off, or their connection closed to make room, by reason: \
             deadline (the whole body took too long) or too_slow (below the minimum rate past \
             the grace period).",
            self.cut_off.clone(),
        );
    }

    /// Bodies cut off for `reason` so far.
    pub fn cut_off(&self, reason: CutOffReason) -> u64 {
        self.cut_off
            .get_or_create(&[("reason", reason.as_str())])
            .get()
    }

    fn count(&self, reason: CutOffReason) {
        self.cut_off
            .get_or_create(&[("reason", reason.as_str())])
            .inc();
    }
}

/// The body a connection is receiving now, if any, so the accept loop can tell a connection
/// stuck on a slow body from one whose handler is merely busy.
#[derive(Default)]
pub(crate) struct BodyProgress {
    receiving: Mutex<Option<Receiving>>,
}

struct Receiving {
    /// Which body of the connection: a body dropped late does not end the next one's record.
    body: u64,
    started: Instant,
    bytes: u64,
}

impl BodyProgress {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Receiving>> {
        self.receiving.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begin(&self, body: u64, started: Instant) {
        *self.lock() = Some(Receiving {
            body,
            started,
            bytes: 0,
        });
    }

    fn add(&self, body: u64, bytes: u64) {
        if let Some(receiving) = self.lock().as_mut().filter(|r| r.body == body) {
            receiving.bytes += bytes;
        }
    }

    fn end(&self, body: u64) {
        let mut receiving = self.lock();
        if receiving.as_ref().is_some_and(|r| r.body == body) {
            *receiving = None;
        }
    }

    fn is_receiving(&self, body: u64) -> bool {
        self.lock().as_ref().is_some_and(|r| r.body == body)
    }

    /// When the body being received started, if it breaks `limits` now (too slow past the
    /// grace, or past its deadline): the connection is stuck on it, and may be closed to make
    /// room.
    pub(crate) fn stuck_since(&self, limits: &BodyLimits, now: Instant) -> Option<Instant> {
        let receiving = self.lock();
        let r = receiving.as_ref()?;
        limits
            .broken(now.saturating_duration_since(r.started), r.bytes)
            .map(|_| r.started)
    }

    /// Claims the body being received for closing its connection, if it is stuck: counted (once)
    /// as cut off, and no longer being received. Whether it was.
    pub(crate) fn claim_stuck(&self, limits: &BodyLimits, metrics: &BodyMetrics) -> bool {
        let mut receiving = self.lock();
        let Some(r) = receiving.as_ref() else {
            return false;
        };
        let elapsed = Instant::now().saturating_duration_since(r.started);
        let Some(reason) = limits.broken(elapsed, r.bytes) else {
            return false;
        };
        *receiving = None;
        metrics.count(reason);
        true
    }
}

/// A request body held to [`BodyLimits`]; see the module docs.
pub(crate) struct LimitedBody<B> {
    inner: B,
    limits: BodyLimits,
    /// The longest pause before the next part of the body.
    pause: Duration,
    /// Since when the body has been waiting for its next part (`None` while it is not).
    last: Option<Instant>,
    /// Set once the body paused too long: every later poll repeats it.
    paused: bool,
    progress: Arc<BodyProgress>,
    metrics: BodyMetrics,
    body: u64,
    started: Option<Instant>,
    bytes: u64,
    check: Option<Pin<Box<Sleep>>>,
    /// The cut-off, once made: every later poll repeats it.
    cut: Option<BodyCutOff>,
    ended: bool,
}

impl<B> LimitedBody<B> {
    /// `inner`, the `body`-th of its connection, whose progress goes to `progress`.
    pub(crate) fn new(
        inner: B,
        limits: BodyLimits,
        pause: Duration,
        progress: Arc<BodyProgress>,
        body: u64,
        metrics: BodyMetrics,
    ) -> LimitedBody<B> {
        LimitedBody {
            inner,
            limits,
            pause,
            last: None,
            paused: false,
            progress,
            metrics,
            body,
            started: None,
            bytes: 0,
            check: None,
            cut: None,
            ended: false,
        }
    }

    fn end(&mut self) {
        if !self.ended {
            self.ended = true;
            self.progress.end(self.body);
        }
    }

    /// Cuts the body off if it breaks a limit now, or ends it if it paused too long; polls the
    /// next check's timer otherwise, so this task wakes when it is due.
    fn enforce(&mut self, cx: &mut Context<'_>, started: Instant) -> Option<BoxError> {
        let last = self.last.unwrap_or(started);
        loop {
            let now = Instant::now();
            let elapsed = now.saturating_duration_since(started);
            if let Some(reason) = self.limits.broken(elapsed, self.bytes) {
                let cut = BodyCutOff {
                    reason,
                    after: elapsed,
                    bytes: self.bytes,
                };
                // The accept loop may have claimed it meanwhile (and counted it): count once.
                if !self.ended && self.progress.is_receiving(self.body) {
                    self.metrics.count(reason);
                }
                self.end();
                self.cut = Some(cut.clone());
                return Some(Box::new(cut));
            }
            if now.saturating_duration_since(last) >= self.pause {
                self.end();
                self.paused = true;
                return Some(Box::new(BodyPaused {
                    timeout: self.pause,
                }));
            }
            let due = self
                .limits
                .next_check(started, self.bytes)
                .min(last + self.pause)
                .max(now + RECHECK);
            let due = tokio::time::Instant::from_std(due);
            let check = self
                .check
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if check.deadline() != due {
                check.as_mut().reset(due);
            }
            if check.as_mut().poll(cx).is_pending() {
                return None;
            }
        }
    }
}

impl<B> Body for LimitedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(cut) = &this.cut {
            return Poll::Ready(Some(Err(Box::new(cut.clone()))));
        }
        if this.paused {
            return Poll::Ready(Some(Err(Box::new(BodyPaused {
                timeout: this.pause,
            }))));
        }
        let started = *this.started.get_or_insert_with(|| {
            let now = Instant::now();
            this.progress.begin(this.body, now);
            now
        });
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.last = None;
                if let Some(data) = frame.data_ref() {
                    this.bytes += data.len() as u64;
                    this.progress.add(this.body, data.len() as u64);
                }
                if this.inner.is_end_stream() {
                    this.end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                this.end();
                Poll::Ready(Some(Err(err.into())))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                // The pause counts from the first poll of this wait that found nothing.
                this.last.get_or_insert_with(Instant::now);
                match this.enforce(cx, started) {
                    Some(err) => Poll::Ready(Some(Err(err))),
                    None => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.cut.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for LimitedBody<B> {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: BodyLimits = BodyLimits {
        deadline: Duration::from_secs(60),
        min_rate: 1000,
        grace: Duration::from_secs(2),
    };

    #[test]
    fn a_body_is_judged_by_its_average_only_past_the_grace() {
        let s = Duration::from_secs;
        assert_eq!(LIMITS.broken(Duration::from_millis(1999), 0), None);
        assert_eq!(LIMITS.broken(s(2), 0), Some(CutOffReason::TooSlow));
        assert_eq!(LIMITS.broken(s(2), 2000), None);
        assert_eq!(LIMITS.broken(s(10), 9_999), Some(CutOffReason::TooSlow));
        assert_eq!(LIMITS.broken(s(10), 10_000), None);
        assert_eq!(LIMITS.broken(s(60), 1 << 30), Some(CutOffReason::Deadline));
        let no_minimum = BodyLimits {
            min_rate: 0,
            ..LIMITS
        };
        assert_eq!(no_minimum.broken(s(59), 0), None);
    }

    #[test]
    fn the_next_check_is_when_the_average_would_fall_below_the_minimum() {
        let start = Instant::now();
        assert_eq!(LIMITS.next_check(start, 0), start + Duration::from_secs(2));
        assert_eq!(
            LIMITS.next_check(start, 5000),
            start + Duration::from_secs(5)
        );
        assert_eq!(
            LIMITS.next_check(start, 1 << 30),
            start + Duration::from_secs(60)
        );
    }

    #[test]
    fn a_cut_off_is_found_through_the_wrappers_of_a_body_error() {
        let cut = BodyCutOff {
            reason: CutOffReason::TooSlow,
            after: Duration::from_secs(3),
            bytes: 7,
        };
        let wrapped = axum::Error::new(Box::new(cut.clone()) as BoxError);
        assert_eq!(body_cut_off(&wrapped), Some(&cut));
        let other = axum::Error::new(std::io::Error::other("reset"));
        assert_eq!(body_cut_off(&other), None);
    }
}
