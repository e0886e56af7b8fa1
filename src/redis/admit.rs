//! The decision: [`RedisController::admit`] checks what it can here (the identity, a refusal
//! remembered, the lease, room to decide, the circuit), then sends one admission in the
//! replica's next batch and turns Redis's answer into a permit (with its quota), a refusal
//! (remembered), a replay or an unavailable answer. And reload, which changes the limits the
//! next decision is sent.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::circuit::Gate;
use super::decision::{self, Kept, Target};
use super::handles::RedisPermit;
use super::held::{Held, Uncommitted};
use super::memory::{Answer, Forgotten};
use super::quota::quota;
use super::releases::KeepOnDrop;
use super::replica::{Inner, RedisController};
use super::reply::{AdmitReply, Decided};
use super::units::{rate_micros, secs_at_least_one, ttl_millis};
use crate::admission::outcome::{AdmitError, Refused, UnavailableReason};
use crate::config::{Config, Identity};
use crate::engine::{FairShareRefusal, OperationState, Refusal, RefusalCode};

/// An operation id the scripts can record: 1 to 128 visible ASCII characters.
use crate::admission::id::shareable as valid_op_id;

/// How much longer than a remembered refusal can last Redis keeps the refusal marker (see
/// `scripts/batch.lua`): room for the reply's trip back and a replica clock that runs slow
/// against Redis's. A marker that ends early only lets a release go unheard, so a refusal lasts
/// to its own wait or hint, as Redis would have answered.
const MARKER_SLACK: Duration = Duration::from_secs(2);

impl RedisController {
    /// Decides one submission by `identity` for the operation `id` (unique, chosen by the
    /// broker before admitting), in the contract's order: the client is configured → a rate
    /// token → client active → (if it needs approval) client pending and the pending grants →
    /// global active → global executing. With an `idempotency_key`, the same key already bound
    /// to an operation (on any replica) answers [`AdmitError::Replay`] and reserves nothing.
    ///
    /// Retrying with the same `id` after a lost reply never counts twice.
    pub(crate) async fn admit(
        &self,
        identity: &str,
        needs_approval: bool,
        id: &str,
        idempotency_key: Option<&str>,
    ) -> Result<RedisPermit, AdmitError> {
        let inner = &self.inner;
        let unconfigured = || {
            Err(AdmitError::Refused(Refused {
                refusal: Refusal {
                    code: RefusalCode::ClientUnconfigured,
                    retry_after: Duration::ZERO,
                },
                quota: None,
                fair_share: None,
            }))
        };
        if inner.config.load().effective(identity).is_none() {
            return unconfigured();
        }
        // Before the limits are read: a reload (or a notice) from here on keeps the answer from
        // being remembered, so a refusal under limits no longer in force is never answered again.
        // (Only for a configured identity: the memory holds one entry per client it is given.)
        let ticket = inner.memory.ticket(identity);
        let config = inner.config.load();
        let Some(limits) = config.effective(identity) else {
            return unconfigured();
        };
        let identity = Identity::new(identity).expect("a configured identity is valid");
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        let idem_key = idempotency_key.map(|k| inner.keys.idempotency(identity.as_str(), k));
        if let Some(refused) = inner.recall(identity.as_str(), needs_approval) {
            return Err(inner.remembered(refused, idem_key.as_deref(), id).await);
        }
        if !valid_op_id(id) {
            return Err(AdmitError::Unavailable(inner.unavailable(
                UnavailableReason::Reply(format!("operation id {id:?} cannot be recorded")),
            )));
        }
        if inner.is_kept(id) {
            return Err(AdmitError::Unavailable(inner.unavailable(
                UnavailableReason::Reply(format!(
                    "operation id {id} was given up after an unanswered admission; use a new id"
                )),
            )));
        }
        if !inner.lease_held() {
            // Relaxed: see `restore_begun`.
            let reason = if inner.restore_begun.load(Ordering::Relaxed) {
                UnavailableReason::LeaseNotHeld
            } else {
                UnavailableReason::NotRestored
            };
            return Err(AdmitError::Unavailable(inner.unavailable(reason)));
        }
        // Room to decide: this client's share first, then the replica's, each waited for
        // briefly. Released when this call ends, however it ends.
        let _room = match inner.room(identity.as_str()).await {
            Some(room) => room,
            None => {
                // Relaxed: a statistic.
                inner.busy.fetch_add(1, Ordering::Relaxed);
                return Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::Busy),
                ));
            }
        };
        // A refusal that came back while this call waited answers it too.
        if let Some(refused) = inner.recall(identity.as_str(), needs_approval) {
            return Err(inner.remembered(refused, idem_key.as_deref(), id).await);
        }
        if let Gate::Open(_) = inner.circuit.enter() {
            return Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::CircuitOpen),
            ));
        }
        let caps = inner.options.caps;
        let global = config.limits();
        let decision = decision::Decision::Admit {
            id: id.to_string(),
            client: identity.as_str().to_string(),
            needs_approval,
            limits: decision::AdmitLimits {
                rate: (interval, span),
                client_active: limits.active,
                client_pending: limits.pending,
                grant_client: caps.grant_client,
                grant_global: caps.grant_global,
                global_active: global.global_active,
                global_executing: global.global_executing,
                remembered_millis: inner.remembered_millis(),
                fair_share: config.fair_share(),
            },
            key: idem_key.clone(),
            key_ttl_millis: inner.options.idempotency_ttl.map_or(0, ttl_millis),
        };
        let cell = Arc::new(Held {
            id: id.to_string(),
            identity: identity.clone(),
            state: std::sync::atomic::AtomicU8::new(if needs_approval {
                OperationState::Pending as u8
            } else {
                OperationState::Approved as u8
            }),
            uncommitted: Mutex::new(Some(Uncommitted {
                at: Instant::now(),
                key: idempotency_key.map(str::to_owned),
            })),
        });
        // From here on the script may run: if this future is dropped, or the reply is lost or
        // unreadable, release by id (a no-op if it never ran), key binding included, so a
        // reservation never outlives an answer that was not "admitted".
        let undo = KeepOnDrop::new(
            inner,
            Kept {
                id: id.to_string(),
                target: Target::Terminal,
                key: idem_key.clone(),
            },
        );
        let _shared = inner.registration.read().await;
        let reply = match inner.decide(decision).await {
            Ok(Decided::Admit(reply)) => reply,
            Ok(Decided::Transition(_)) => {
                return Err(AdmitError::Unavailable(inner.unavailable(
                    UnavailableReason::Reply("a transition's reply to an admission".into()),
                )));
            }
            Err(reason) => return Err(AdmitError::Unavailable(inner.unavailable(reason))),
        };
        // With `wait_replicas`, an admission no Redis replica acknowledged came back above as
        // unavailable (`commit` waits for them), and its armed undo keeps its release.
        // A definite answer: the permit below takes the reservation over, or nothing was made.
        undo.disarm();
        match reply {
            AdmitReply::Admitted(_) | AdmitReply::Duplicate => {
                if matches!(reply, AdmitReply::Admitted(_)) {
                    // What Redis would answer this client next may differ from what is
                    // remembered (a token spent, a slot taken).
                    inner.memory.admitted_here(identity.as_str());
                }
                let quota = match &reply {
                    AdmitReply::Admitted(reading) => {
                        Some(quota(limits, &inner.options, (interval, span), reading))
                    }
                    _ => None,
                };
                inner.lock_held().insert(cell.id.clone(), Arc::clone(&cell));
                Ok(RedisPermit::new(
                    Arc::clone(inner),
                    cell,
                    needs_approval,
                    (interval, span),
                    idem_key,
                    quota,
                ))
            }
            AdmitReply::Replay { id, replica } => Err(AdmitError::Replay {
                operation: id,
                replica,
            }),
            AdmitReply::Lease => {
                inner.lease_lost();
                // Register again now rather than at the next beat (Redis may have forgotten).
                inner.renew_soon();
                Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::LeaseNotHeld),
                ))
            }
            AdmitReply::Recovering => Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::Recovering),
            )),
            AdmitReply::Refused {
                code,
                rate_wait_micros,
                capacity,
                reading,
                fair_share,
            } => {
                let fair_share = fair_share.and_then(|reason| FairShareRefusal::of(code, reason));
                let capacity_hint =
                    capacity.then(|| secs_at_least_one(inner.options.capacity_retry));
                let wait_nanos = rate_wait_micros
                    .saturating_mul(1000)
                    .max(capacity_hint.map_or(0, |h| h.as_nanos() as u64));
                if let Some(ticket) = ticket {
                    inner.memory.remember(
                        identity.as_str(),
                        ticket,
                        Answer {
                            code,
                            fair_share,
                            needs_approval,
                            rate_wait_micros,
                            capacity_hint,
                            limits,
                            rate: (interval, span),
                            reading,
                        },
                    );
                }
                Err(AdmitError::Refused(Refused {
                    refusal: Refusal::after_nanos(code, wait_nanos),
                    quota: Some(quota(limits, &inner.options, (interval, span), &reading)),
                    fair_share,
                }))
            }
        }
    }

    /// Swaps in a new, already validated configuration; the next decision uses it (and no
    /// refusal remembered under the old limits answers again).
    pub(crate) fn reload(&self, config: Config) {
        // A removed client's room goes; a kept one's stays, with the decisions in flight on it
        // (made anew, it would let that many more in beside them).
        crate::sync::lock(&self.inner.client_decisions)
            .retain(|client, _| config.effective(client).is_some());
        self.inner.config.store(Arc::new(config));
        self.inner.memory.forget_all(Forgotten::Reload);
    }
}

impl Inner {
    /// How long past its rate wait this replica may remember a refusal, in ms (0 when it
    /// remembers none): a capacity refusal is remembered for its hint, a rate refusal for its
    /// wait (`memory`), and the slack on top.
    fn remembered_millis(&self) -> u64 {
        if !self.options.refusal_memory {
            return 0;
        }
        let longest = secs_at_least_one(self.options.capacity_retry) + MARKER_SLACK;
        u64::try_from(longest.as_millis()).unwrap_or(u64::MAX)
    }

    /// A remembered refusal answering `client`'s submission now, as the answer gives it: the
    /// code, Retry-After counted down from the remembered moment, and the quota read from the
    /// remembered reading advanced by the time that passed.
    fn recall(&self, client: &str, needs_approval: bool) -> Option<Refused> {
        let recalled = self.memory.recall(client, needs_approval, Instant::now())?;
        Some(Refused {
            refusal: Refusal::after_nanos(
                recalled.code,
                u64::try_from(recalled.wait_left.as_nanos()).unwrap_or(u64::MAX),
            ),
            quota: Some(quota(
                recalled.limits,
                &self.options,
                recalled.rate,
                &recalled.reading,
            )),
            fair_share: recalled.fair_share,
        })
    }

    /// The answer to a submission this replica refuses from memory: the remembered `refused`,
    /// unless the submission's idempotency key (`key`, its Redis key) is bound to another
    /// operation, on any replica: then that operation is the answer ([`AdmitError::Replay`]), as
    /// Redis's decision would have answered it before any limit. A client retrying correctly
    /// with a stable key is never refused for the retry. One `GET` of the key's record, no
    /// script; a Redis that does not answer it in time leaves the remembered refusal standing
    /// (the memory only ever refuses).
    async fn remembered(&self, refused: Refused, key: Option<&str>, id: &str) -> AdmitError {
        let Some(key) = key else {
            return AdmitError::Refused(refused);
        };
        let mut conn = self.conn.clone();
        let read = tokio::time::timeout(
            self.options.call_timeout,
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<String>>(&mut conn),
        )
        .await;
        match read {
            Ok(Ok(Some(bound))) => match bound.split_once(' ') {
                Some((operation, replica)) if operation != id => AdmitError::Replay {
                    operation: operation.to_owned(),
                    replica: replica.to_owned(),
                },
                _ => AdmitError::Refused(refused),
            },
            _ => AdmitError::Refused(refused),
        }
    }

    /// Room for one decision in flight: `client`'s share, then the replica's, each waited for at
    /// most the decision wait (`None`: no room came).
    async fn room(
        &self,
        client: &str,
    ) -> Option<(
        tokio::sync::OwnedSemaphorePermit,
        tokio::sync::OwnedSemaphorePermit,
    )> {
        let share = Arc::clone(
            crate::sync::lock(&self.client_decisions)
                .entry(client.to_owned())
                .or_insert_with(|| {
                    Arc::new(tokio::sync::Semaphore::new(
                        self.options.client_decisions_in_flight,
                    ))
                }),
        );
        let deadline = tokio::time::Instant::now() + self.options.decision_wait;
        let own = tokio::time::timeout_at(deadline, share.acquire_owned())
            .await
            .ok()?
            .ok()?;
        let all = tokio::time::timeout_at(deadline, Arc::clone(&self.decisions).acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some((own, all))
    }
}
