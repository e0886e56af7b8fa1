//! One budget for the bytes a server holds on behalf of its requests: bodies being read and rows
//! being rendered. Per-client fairness bounds how many requests a client has in flight, not how
//! big each one is; without a global bound, a thousand trickled 1 MiB bodies are a thousand MiB
//! of heap. Past the budget a new body waits for room (briefly) or is refused, rather than grow
//! the heap.
//!
//! Built on tokio's semaphore, one permit a byte: reservations are served first come, first
//! served (a large one waiting is not overtaken by small ones), and a reservation future dropped
//! while it waits gives back whatever it had been assigned.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bytes a server may hold buffered at once, shared by every request. Cheap to clone.
#[derive(Clone)]
pub struct ByteBudget {
    shared: Arc<Budget>,
}

struct Budget {
    total: usize,
    room: Arc<Semaphore>,
    buffered: Gauge,
    limit: Gauge,
    refused: Counter,
}

/// Bytes reserved against a [`ByteBudget`], given back when dropped.
#[must_use = "the bytes are given back as soon as the reservation drops"]
pub struct BytesReservation {
    permit: Option<OwnedSemaphorePermit>,
    shared: Arc<Budget>,
}

/// Why a reservation was not made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetRefusal {
    /// More bytes than the whole budget: it could never fit.
    LargerThanBudget {
        /// The bytes asked for.
        bytes: usize,
        /// The whole budget.
        total: usize,
    },
    /// The budget has no room now ([`ByteBudget::try_reserve`]) or got none in time
    /// ([`ByteBudget::reserve`]).
    Full {
        /// The bytes asked for.
        bytes: usize,
    },
}

impl fmt::Display for BudgetRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetRefusal::LargerThanBudget { bytes, total } => write!(
                f,
                "{bytes} bytes is more than the whole buffered-bytes budget of {total}"
            ),
            BudgetRefusal::Full { bytes } => {
                write!(f, "no room for {bytes} more buffered bytes now")
            }
        }
    }
}

impl std::error::Error for BudgetRefusal {}

impl ByteBudget {
    /// A budget of `total` bytes (at most [`Semaphore::MAX_PERMITS`]; more is clamped to it).
    pub fn new(total: usize) -> ByteBudget {
        let total = total.min(Semaphore::MAX_PERMITS);
        let limit = Gauge::default();
        limit.set(i64::try_from(total).unwrap_or(i64::MAX));
        ByteBudget {
            shared: Arc::new(Budget {
                total,
                room: Arc::new(Semaphore::new(total)),
                buffered: Gauge::default(),
                limit,
                refused: Counter::default(),
            }),
        }
    }

    /// The whole budget.
    pub fn total(&self) -> usize {
        self.shared.total
    }

    /// Bytes not free now: those reserved, and those already set aside for the first reservation
    /// waiting for the rest of its room.
    pub fn reserved(&self) -> usize {
        self.shared.total - self.shared.room.available_permits()
    }

    /// `bytes` now, or a refusal if the budget has no room for them this moment (nor when
    /// someone is already waiting: they come first).
    pub fn try_reserve(&self, bytes: usize) -> Result<BytesReservation, BudgetRefusal> {
        let permits = self.permits_for(bytes)?;
        match Arc::clone(&self.shared.room).try_acquire_many_owned(permits) {
            Ok(permit) => Ok(self.reserved_with(permit)),
            Err(_) => Err(self.refuse(BudgetRefusal::Full { bytes })),
        }
    }

    /// `bytes` once there is room, waiting at most `wait` (behind the reservations already
    /// waiting). Cancel-safe: dropped while it waits, it holds nothing.
    pub async fn reserve(
        &self,
        bytes: usize,
        wait: Duration,
    ) -> Result<BytesReservation, BudgetRefusal> {
        let permits = self.permits_for(bytes)?;
        // Room now (the usual case) arms no timer; `try_acquire` fails while others wait, so
        // the room still goes in order.
        if let Ok(permit) = Arc::clone(&self.shared.room).try_acquire_many_owned(permits) {
            return Ok(self.reserved_with(permit));
        }
        let acquire = Arc::clone(&self.shared.room).acquire_many_owned(permits);
        match tokio::time::timeout(wait, acquire).await {
            Ok(Ok(permit)) => Ok(self.reserved_with(permit)),
            // The semaphore is never closed; a timeout is the only other way out.
            Ok(Err(_)) | Err(_) => Err(self.refuse(BudgetRefusal::Full { bytes })),
        }
    }

    /// Registers `broker_buffered_bytes` (reserved now), `broker_buffered_bytes_limit` (the
    /// budget) and `broker_buffered_bytes_refused_total` (reservations refused) in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        self.register_as(
            registry,
            "broker_buffered_bytes",
            "request bodies being read and responses being rendered",
        );
    }

    /// Registers this budget's three metrics under `name` (reserved now), `{name}_limit` (the
    /// budget) and `{name}_refused_total` (reservations refused), `what` saying what it holds:
    /// for a budget other than the agents' buffered bytes, such as the operator decisions' room.
    pub fn register_as(&self, registry: &mut Registry, name: &str, what: &str) {
        registry.register(
            name,
            format!("Bytes reserved for {what}."),
            self.shared.buffered.clone(),
        );
        registry.register(
            format!("{name}_limit"),
            format!("The budget for {what}, in bytes."),
            self.shared.limit.clone(),
        );
        registry.register(
            format!("{name}_refused"),
            format!(
                "Reservations of bytes for {what} refused: no room within the wait, or larger \
                 than the whole budget."
            ),
            self.shared.refused.clone(),
        );
    }

    fn permits_for(&self, bytes: usize) -> Result<u32, BudgetRefusal> {
        let too_large = BudgetRefusal::LargerThanBudget {
            bytes,
            total: self.shared.total,
        };
        if bytes > self.shared.total {
            return Err(self.refuse(too_large));
        }
        u32::try_from(bytes).map_err(|_| self.refuse(too_large))
    }

    fn reserved_with(&self, permit: OwnedSemaphorePermit) -> BytesReservation {
        self.shared.buffered.inc_by(permit.num_permits() as i64);
        BytesReservation {
            permit: Some(permit),
            shared: Arc::clone(&self.shared),
        }
    }

    fn refuse(&self, refusal: BudgetRefusal) -> BudgetRefusal {
        self.shared.refused.inc();
        refusal
    }
}

impl BytesReservation {
    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.permit.as_ref().map_or(0, |p| p.num_permits())
    }

    /// Gives back all but `bytes` (a body found shorter than the room reserved for it); keeps
    /// everything if it holds no more than that.
    pub fn shrink_to(&mut self, bytes: usize) {
        let held = self.bytes();
        if bytes >= held {
            return;
        }
        if let Some(extra) = self.permit.as_mut().and_then(|p| p.split(held - bytes)) {
            self.shared.buffered.dec_by(extra.num_permits() as i64);
        }
    }
}

/// A response body of bytes already rendered, holding their [`BytesReservation`] until the body
/// has been sent (or dropped): what a server answers so the bytes count against the budget for
/// as long as they are held, not only while they were being made.
///
/// The bytes go out in frames of at most [`HELD_FRAME_BYTES`]: a server (hyper) asks for the next
/// frame only once it has room to write it, so a client that stops reading keeps the body, and its
/// reservation, unfinished, instead of the whole answer leaving the budget for the server's write
/// queue at the first poll.
pub struct HeldBytes {
    bytes: Option<Bytes>,
    reservation: Option<BytesReservation>,
}

impl BytesReservation {
    /// A body of `bytes` that holds this reservation, shrunk to their length, until it ends.
    pub fn hold(mut self, bytes: Bytes) -> HeldBytes {
        self.shrink_to(bytes.len());
        HeldBytes {
            bytes: Some(bytes).filter(|b| !b.is_empty()),
            reservation: Some(self),
        }
    }
}

/// The most bytes one frame of a [`HeldBytes`] carries.
pub const HELD_FRAME_BYTES: usize = 16 << 10;

impl Body for HeldBytes {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let frame = match &mut this.bytes {
            Some(rest) if rest.len() > HELD_FRAME_BYTES => Some(rest.split_to(HELD_FRAME_BYTES)),
            rest => rest.take(),
        };
        if frame.is_none() {
            // Sent: the last frame was taken, the bytes are the transport's now.
            this.reservation.take();
        }
        Poll::Ready(frame.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

impl fmt::Debug for HeldBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldBytes")
            .field("bytes", &self.bytes.as_ref().map_or(0, Bytes::len))
            .finish()
    }
}

impl Drop for BytesReservation {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.shared.buffered.dec_by(permit.num_permits() as i64);
        }
    }
}

impl fmt::Debug for BytesReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BytesReservation")
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl fmt::Debug for ByteBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ByteBudget")
            .field("total", &self.total())
            .field("reserved", &self.reserved())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Context;

    use super::*;

    #[tokio::test]
    async fn a_reservation_is_given_back_when_dropped_or_shrunk() {
        let budget = ByteBudget::new(100);
        let mut reservation = budget.try_reserve(60).unwrap();
        assert_eq!(budget.reserved(), 60);
        assert_eq!(
            budget.try_reserve(41).unwrap_err(),
            BudgetRefusal::Full { bytes: 41 }
        );
        reservation.shrink_to(10);
        assert_eq!((reservation.bytes(), budget.reserved()), (10, 10));
        let other = budget.try_reserve(90).unwrap();
        drop((reservation, other));
        assert_eq!(budget.reserved(), 0);
        assert!(matches!(
            budget.try_reserve(101),
            Err(BudgetRefusal::LargerThanBudget { .. })
        ));
    }

    #[tokio::test]
    async fn held_bytes_keep_their_room_until_the_body_is_sent() {
        use http_body_util::BodyExt;
        let budget = ByteBudget::new(100);
        let body = budget
            .try_reserve(80)
            .unwrap()
            .hold(Bytes::from_static(b"rendered"));
        // Shrunk to what was rendered, and held while the body waits to be sent.
        assert_eq!(budget.reserved(), 8);
        assert_eq!(body.size_hint().exact(), Some(8));
        let sent = body.collect().await.unwrap().to_bytes();
        assert_eq!(&sent[..], b"rendered");
        assert_eq!(budget.reserved(), 0);
        let dropped = budget
            .try_reserve(50)
            .unwrap()
            .hold(Bytes::from_static(b"x"));
        drop(dropped);
        assert_eq!(budget.reserved(), 0);
    }

    #[tokio::test]
    async fn held_bytes_go_out_in_frames_and_keep_their_room_until_the_last() {
        use http_body_util::BodyExt;
        let size = 2 * HELD_FRAME_BYTES + 100;
        let budget = ByteBudget::new(1 << 20);
        let rendered = Bytes::from(vec![7u8; size]);
        let mut body = budget.try_reserve(size).unwrap().hold(rendered.clone());
        let mut sent = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            assert!(data.len() <= HELD_FRAME_BYTES);
            sent.push(data);
            // A frame taken is not yet a body sent: the room stays until the last is.
            if sent.iter().map(Bytes::len).sum::<usize>() < size {
                assert_eq!(budget.reserved(), size);
                assert_eq!(
                    body.size_hint().exact(),
                    Some((size - sent.iter().map(Bytes::len).sum::<usize>()) as u64)
                );
            }
        }
        assert_eq!(sent.len(), 3);
        assert_eq!(sent.concat(), rendered);
        assert_eq!(budget.reserved(), 0);
    }

    #[tokio::test]
    async fn a_waiting_reservation_dropped_leaves_nothing_reserved() {
        let budget = ByteBudget::new(100);
        let holder = budget.try_reserve(70).unwrap();
        let noop = &mut Context::from_waker(std::task::Waker::noop());
        let mut waiting = Box::pin(budget.reserve(50, Duration::from_secs(60)));
        assert!(waiting.as_mut().poll(noop).is_pending());
        // The waiter is first in line: a newcomer that would fit does not overtake it.
        assert!(budget.try_reserve(30).is_err());
        drop(waiting);
        drop(holder);
        assert_eq!(budget.reserved(), 0);
        assert_eq!(budget.try_reserve(100).unwrap().bytes(), 100);
    }

    #[tokio::test]
    async fn a_reservation_waits_for_room_then_times_out_and_is_counted() {
        let budget = ByteBudget::new(10);
        let mut registry = Registry::default();
        budget.register(&mut registry);
        let holder = budget.try_reserve(10).unwrap();
        let refused = budget.reserve(5, Duration::from_millis(10)).await;
        assert_eq!(refused.unwrap_err(), BudgetRefusal::Full { bytes: 5 });
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move {
                budget
                    .reserve(5, Duration::from_secs(60))
                    .await
                    .map(|r| r.bytes())
            }
        });
        drop(holder);
        assert_eq!(waiting.await.unwrap(), Ok(5));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("broker_buffered_bytes 0"), "{text}");
        assert!(text.contains("broker_buffered_bytes_limit 10"), "{text}");
        assert!(
            text.contains("broker_buffered_bytes_refused_total 1"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn under_a_crowd_reservations_never_pass_the_budget_and_all_come_back() {
        const TOTAL: usize = 1_000;
        let budget = ByteBudget::new(TOTAL);
        // What the tasks themselves hold, and the most ever seen.
        let held = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for n in 0..400usize {
            let (budget, held, most) = (budget.clone(), held.clone(), most.clone());
            tasks.spawn(async move {
                let bytes = 1 + (n * 37) % 300;
                let reservation = if n % 3 == 0 {
                    budget.try_reserve(bytes)
                } else {
                    budget.reserve(bytes, Duration::from_secs(10)).await
                };
                let Ok(reservation) = reservation else {
                    return false;
                };
                // AcqRel: the sum must include every holder that reserved before this one.
                let now =
                    held.fetch_add(reservation.bytes(), Ordering::AcqRel) + reservation.bytes();
                // Relaxed: only the maximum matters, read after every task was joined.
                most.fetch_max(now, Ordering::Relaxed);
                tokio::task::yield_now().await;
                // AcqRel: taken off before the reservation drops and lets another in.
                held.fetch_sub(reservation.bytes(), Ordering::AcqRel);
                drop(reservation);
                true
            });
        }
        let mut granted = 0;
        while let Some(ok) = tasks.join_next().await {
            granted += usize::from(ok.unwrap());
        }
        assert!(granted > 0);
        // Relaxed: every task was joined.
        assert!(most.load(Ordering::Relaxed) <= TOTAL);
        assert_eq!(budget.reserved(), 0);
    }
}
