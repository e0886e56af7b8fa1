//! The quota an answer carries: the client's bucket and its counts on every replica, built from
//! what Redis read as the in-process engine builds its own ([`QuotaStatus::of`], with the
//! engine's bucket arithmetic), so the quota fields say the same thing whichever backend
//! decided. From a decision's reading, or (`quota_now`) from a plain read that decides nothing.

use redis::Value;

use super::replica::RedisController;
use super::reply::{self, Reading};
use super::units::{rate_micros, secs_at_least_one};
use crate::admission::options::ReplicaOptions;
use crate::admission::outcome::{Unavailable, UnavailableReason};
use crate::config::ClientLimits;
use crate::engine::QuotaStatus;
use crate::engine::gcra::{self, Rate};

/// The client's quota from what the admission decision read (its bucket in µs of Redis time and
/// its counts on every replica), built as the in-process engine builds its own
/// ([`QuotaStatus::of`], with the engine's bucket arithmetic, [`gcra::level`]), so the quota
/// fields say the same thing whichever backend decided.
pub(super) fn quota(
    limits: ClientLimits,
    options: &ReplicaOptions,
    (interval, span): (u64, u64),
    reading: &Reading,
) -> QuotaStatus {
    let (remaining, next_micros) = gcra::level(
        reading.tat_micros,
        reading.now_micros,
        Rate { interval, span },
    );
    QuotaStatus::of(
        limits,
        options.caps.grant_client,
        secs_at_least_one(options.capacity_retry),
        (remaining, next_micros.saturating_mul(1000)),
        reading.active,
        reading.pending,
    )
}

impl RedisController {
    /// The client's quota as the deployment sees it now (its bucket, and its counts on every
    /// replica), for an answer that decided nothing, such as a replay: one `MULTI` of plain
    /// reads on Redis time, no script, nothing written. A bucket written under another rate is
    /// read in the rate in force, as the next decision would rescale it. `Ok(None)` for an
    /// identity with no quota (not configured). While the circuit is open it answers at once,
    /// unavailable, without asking Redis.
    pub(crate) async fn quota_now(
        &self,
        identity: &str,
    ) -> Result<Option<QuotaStatus>, Unavailable> {
        let inner = &self.inner;
        let Some(limits) = inner.config.load().effective(identity) else {
            return Ok(None);
        };
        if inner.circuit.is_open() {
            return Err(inner.unavailable(UnavailableReason::CircuitOpen));
        }
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("TIME")
            .hget(format!("{}:buckets", inner.keys.base), identity)
            .cmd("HMGET")
            .arg(&inner.keys.counts)
            .arg(format!("a:{identity}"))
            .arg(format!("p:{identity}"));
        let mut conn = inner.conn.clone();
        let value: Value =
            match tokio::time::timeout(inner.options.call_timeout, pipe.query_async(&mut conn))
                .await
            {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
        let read = reply::parse_client_reading(&value)
            .map_err(|e| inner.unavailable(UnavailableReason::Reply(e.to_string())))?;
        let now = read.now_micros;
        let tat = read.bucket.map_or(0, |bucket| match bucket.span_micros {
            Some(old) if old != span => gcra::rescaled(bucket.tat_micros, now, old, span),
            _ => bucket.tat_micros,
        });
        let reading = Reading {
            tat_micros: tat,
            now_micros: now,
            active: read.active,
            pending: read.pending,
        };
        Ok(Some(quota(
            limits,
            &inner.options,
            (interval, span),
            &reading,
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::config::{Config, Identity, Limits};
    use crate::engine::{Controller, StorageCaps};

    #[test]
    fn a_quota_from_a_redis_reading_is_the_engines_quota_for_the_same_bucket_and_counts() {
        let limits = Limits {
            requests_per_window: 3,
            window_seconds: 60,
            client_active: 5,
            client_pending: 4,
            global_active: 10,
            global_executing: 2,
        };
        let config = Config::new(limits, BTreeMap::new(), [Identity::new("amy").unwrap()]).unwrap();
        // The pending-grant cap is below the client's pending limit: the quota names the lower.
        let caps = StorageCaps {
            grant_client: 2,
            ..StorageCaps::default()
        };
        let start_secs = 1_000;
        let clock = ManualClock::new();
        clock.set_nanos(start_secs * 1_000_000_000);
        let engine = Controller::builder(config.clone())
            .clock(clock.clone())
            .storage_caps(caps)
            .build();
        let mut options = ReplicaOptions::new("redis://127.0.0.1:1/", "r1");
        options.caps = caps;
        options.capacity_retry = engine.capacity_retry();
        let amy = config.effective("amy").unwrap();
        let rate = rate_micros(3, 60);
        let start = start_secs * 1_000_000;
        // What the script reads after `taken` admissions at `start`, from a full bucket (TAT
        // `max(TAT, now) + interval` each), of which the first two need approval.
        let reading = |taken: u64, now: u64| Reading {
            tat_micros: start + taken * rate.0,
            now_micros: now,
            active: taken,
            pending: taken.min(2),
        };
        let mut held = Vec::new();
        for taken in 1..=3 {
            held.push(engine.admit("amy", taken <= 2).unwrap().commit());
            let redis = quota(amy, &options, rate, &reading(taken, start));
            assert_eq!(Some(redis), engine.quota("amy"), "{taken} taken");
            assert_eq!(redis.rate.remaining, 3 - taken);
            assert_eq!((redis.active.used, redis.active.limit), (taken, 5));
            assert_eq!((redis.pending.used, redis.pending.limit), (taken.min(2), 2));
        }
        // Empty: the next token in exactly the wait a rate refusal reports (20 s).
        let empty = quota(amy, &options, rate, &reading(3, start));
        assert_eq!(empty.rate.next_token_nanos, 20_000_000_000);
        let refusal = engine.admit("amy", false).unwrap_err();
        assert_eq!(
            refusal.retry_after,
            Duration::from_nanos(empty.rate.next_token_nanos)
        );
        // Time passes on both clocks: tokens come back alike, to a full bucket.
        for (elapsed, remaining) in [(5, 0), (20, 1), (45, 2), (61, 3), (600, 3)] {
            clock.set_nanos((start_secs + elapsed) * 1_000_000_000);
            let redis = quota(
                amy,
                &options,
                rate,
                &reading(3, start + elapsed * 1_000_000),
            );
            assert_eq!(Some(redis), engine.quota("amy"), "after {elapsed} s");
            assert_eq!(redis.rate.remaining, remaining, "after {elapsed} s");
        }
        assert_eq!(
            quota(amy, &options, rate, &reading(3, start + 600_000_000))
                .rate
                .next_token_nanos,
            0
        );
    }
}
