//! What Redis gets back from the embedder's store when it forgets ([`RecoverySource`]): the
//! idempotency key records, written back bound to this replica, and each client's rate debt,
//! replayed from its recent admissions as the in-process engine's `restore_rate` does. The key
//! records' later life is here too: unbound when the store retires their operations, given
//! their whole lifetime again while they live.

use std::sync::Arc;
use std::time::Duration;

use redis::{Script, Value};

use super::connect::connection::Connection;
use super::replica::{Inner, RedisController, random_hex};
use super::units::{rate_micros, ttl_millis};
use crate::admission::outcome::{Unavailable, UnavailableReason};
use crate::admission::recovery::{KeyRecord, RecoverySource};
use crate::config::{Config, Identity};

/// Idempotency records sent to Redis in one script call, when restoring or retiring them.
const KEY_RECORDS_PER_CALL: usize = 500;

impl RedisController {
    /// Where re-registration after Redis forgot reads the key records and the rate history.
    /// The first source set stays.
    pub fn set_source(&self, source: Arc<dyn RecoverySource>) {
        let _ = self.inner.source.set(source);
    }

    /// Unbinds retired operations' keys (see [`crate::Admission::retire_keys`]).
    pub async fn retire_keys(&self, records: &[KeyRecord]) -> Result<(), Unavailable> {
        self.inner.retire_keys(records).await
    }

    /// Unbinds retired operations' keys, runs `delete`, then unbinds them again while no
    /// recovery is restoring keys (see [`crate::Admission::retire_keys_then`]). A recovery that
    /// read the rows before the deletion restored its keys either before that second unbinding
    /// (which removes them again) or, excluded, not at all; one that reads after it finds no
    /// row. Nothing waits on the store under the exclusion, so a recovery never waits for a busy
    /// store.
    pub async fn retire_keys_then<T>(
        &self,
        records: &[KeyRecord],
        delete: impl std::future::Future<Output = T>,
    ) -> Result<T, Unavailable> {
        self.inner.retire_keys(records).await?;
        let deleted = delete.await;
        let _no_restore = self.inner.restoring.read().await;
        if let Err(err) = self.inner.retire_keys(records).await {
            // Only a recovery that ran between the deletion and now could have bound them
            // again; the other replicas then answer them as held elsewhere until the key
            // lifetime ends, and this replica unbinds one as stale when it is submitted here.
            tracing::warn!(error = %err, "retired keys could not be unbound a second time after their rows were deleted");
        }
        Ok(deleted)
    }

    /// Gives live operations' keys their whole lifetime again (see
    /// [`crate::Admission::renew_keys`]); how many were renewed.
    pub async fn renew_keys(&self, records: &[KeyRecord]) -> Result<u64, Unavailable> {
        self.inner.renew_keys(records).await
    }
}

impl Inner {
    /// Runs one plain command within the call timeout, counting a failure as scripts' are.
    async fn timed<T: redis::FromRedisValue>(
        &self,
        command: &redis::Cmd,
        conn: &mut Connection,
    ) -> Result<T, Unavailable> {
        match tokio::time::timeout(self.options.call_timeout, command.query_async(conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(self.failed(UnavailableReason::Redis(e.to_string()))),
            Err(_) => Err(self.failed(UnavailableReason::Timeout)),
        }
    }

    /// At start-up, once this replica has registered: unbinds every key Redis binds to an
    /// operation of this replica that its store does not hold (its rows were lost, or it stopped
    /// between an admission and the row), so no key stays bound to work nothing will ever answer
    /// for. One pass of `SCAN` over the deployment's keys (at start-up only, where no admission
    /// of this process is in flight); a key bound since to new work is left alone. How many were
    /// unbound.
    pub(super) async fn unbind_unheld_keys(
        &self,
        source: &dyn RecoverySource,
    ) -> Result<u64, Unavailable> {
        let stored: std::collections::HashSet<String> = source
            .key_records()
            .await
            .map_err(|e| {
                self.unavailable(UnavailableReason::Reply(format!(
                    "the store's key records could not be read: {e}"
                )))
            })?
            .into_iter()
            .map(|record| record.operation)
            .collect();
        let prefix = format!("{}:key:", self.keys.base);
        // `SCAN`'s pattern is a glob: the prefix's own `*`, `?`, `[`, `]` and `\` match
        // themselves only.
        let mut pattern = String::with_capacity(prefix.len() + 2);
        for c in prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push('*');
        let mut conn = self.conn.clone();
        let mut cursor: u64 = 0;
        let mut unheld = Vec::new();
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(KEY_RECORDS_PER_CALL);
            let (next, names): (u64, Vec<String>) = self.timed(&scan, &mut conn).await?;
            if !names.is_empty() {
                let mut mget = redis::cmd("MGET");
                mget.arg(&names);
                let owners: Vec<Option<String>> = self.timed(&mget, &mut conn).await?;
                for (name, owner) in names.iter().zip(owners) {
                    let Some((operation, replica)) =
                        owner.as_deref().and_then(|o| o.split_once(' '))
                    else {
                        continue;
                    };
                    if replica != self.options.replica || stored.contains(operation) {
                        continue;
                    }
                    // `<base>:key:<client>:<key>`: a client name holds no `:`.
                    let Some((client, key)) = name[prefix.len()..].split_once(':') else {
                        continue;
                    };
                    let Ok(client) = Identity::new(client) else {
                        continue;
                    };
                    unheld.push(KeyRecord {
                        client,
                        key: key.to_owned(),
                        operation: operation.to_owned(),
                    });
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        if !unheld.is_empty() {
            self.retire_keys(&unheld).await?;
        }
        Ok(unheld.len() as u64)
    }

    /// Writes `records` back as idempotency records bound to this replica (where the key is not
    /// bound already), in calls of [`KEY_RECORDS_PER_CALL`] (one at least, so Redis holds the
    /// restore's marker even with no record). The restore's nonce, for the registration to check
    /// that Redis still holds them; `None` if Redis forgot them before the last call.
    pub(super) async fn restore_keys(
        &self,
        records: &[KeyRecord],
    ) -> Result<Option<String>, Unavailable> {
        let ttl = self.options.idempotency_ttl.map_or(0, ttl_millis);
        let nonce = random_hex();
        let whole = self
            .send_key_records(
                &self.scripts.restore_keys,
                records,
                true,
                |invocation, n| {
                    invocation
                        .arg(&self.keys.base)
                        .arg(&self.options.replica)
                        .arg(ttl)
                        .arg(&nonce)
                        .arg(u8::from(n == 0));
                },
            )
            .await?;
        if !whole {
            return Ok(None);
        }
        Ok(Some(nonce))
    }

    /// Unbinds each key from its operation (if it still names it), in calls of
    /// [`KEY_RECORDS_PER_CALL`]: the operations were retired, and a retired key is new work.
    pub(crate) async fn retire_keys(&self, records: &[KeyRecord]) -> Result<(), Unavailable> {
        self.send_key_records(
            &self.scripts.retire_keys,
            records,
            false,
            |invocation, _| {
                invocation.arg(&self.keys.base);
            },
        )
        .await
        .map(|_| ())
    }

    pub(crate) async fn renew_keys(&self, records: &[KeyRecord]) -> Result<u64, Unavailable> {
        let Some(ttl) = self.options.idempotency_ttl else {
            return Ok(0);
        };
        let mut renewed = 0;
        for chunk in records.chunks(KEY_RECORDS_PER_CALL) {
            let mut invocation = self.scripts.renew_keys.prepare_invoke();
            invocation.arg(&self.keys.base).arg(ttl_millis(ttl));
            for record in chunk {
                invocation
                    .arg(record.client.as_str())
                    .arg(&record.key)
                    .arg(&record.operation);
            }
            let value = self
                .call(&invocation)
                .await
                .map_err(|r| self.unavailable(r))?;
            match value {
                Value::Int(n) => renewed += u64::try_from(n).unwrap_or(0),
                other => {
                    return Err(self.unavailable(UnavailableReason::Reply(format!(
                        "renew_keys answered {other:?}"
                    ))));
                }
            }
        }
        Ok(renewed)
    }

    /// Runs `script` over `records` in calls of [`KEY_RECORDS_PER_CALL`] (one at least, if
    /// `at_least_once`, even with no record): `head` writes the script's leading arguments for
    /// the `n`th call, then each record's client, key and operation follow. Whether every call
    /// ran through: a call answering -1 (a restore whose marker Redis lost) ends the run.
    async fn send_key_records(
        &self,
        script: &Script,
        records: &[KeyRecord],
        at_least_once: bool,
        head: impl Fn(&mut redis::ScriptInvocation<'_>, usize),
    ) -> Result<bool, Unavailable> {
        let mut chunks: Vec<&[KeyRecord]> = records.chunks(KEY_RECORDS_PER_CALL).collect();
        if chunks.is_empty() && at_least_once {
            chunks.push(&[]);
        }
        for (n, chunk) in chunks.into_iter().enumerate() {
            let mut invocation = script.prepare_invoke();
            head(&mut invocation, n);
            for record in chunk {
                invocation
                    .arg(record.client.as_str())
                    .arg(&record.key)
                    .arg(&record.operation);
            }
            let value = self
                .call(&invocation)
                .await
                .map_err(|r| self.unavailable(r))?;
            if value == Value::Int(-1) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A client's rate debt: how far its bucket's TAT must move past now (µs), in its rate.
pub(super) struct RateDebt {
    pub(super) client: Identity,
    pub(super) interval: u64,
    pub(super) span: u64,
    pub(super) micros: u64,
}

/// Appends `debts` to a script's arguments as the registration scripts read them: how many,
/// then per debt its client, interval, span and debt (µs).
pub(super) fn push_debts(invocation: &mut redis::ScriptInvocation<'_>, debts: &[RateDebt]) {
    invocation.arg(debts.len());
    for debt in debts {
        invocation
            .arg(debt.client.as_str())
            .arg(debt.interval)
            .arg(debt.span)
            .arg(debt.micros);
    }
}

/// A live state as the scripts record it (`p`, `a` or `e`); `None` for a terminal one, which
/// holds nothing.
pub(super) fn held_state(state: crate::engine::OperationState) -> Option<&'static str> {
    use crate::engine::OperationState;
    match state {
        OperationState::Pending => Some("p"),
        OperationState::Approved => Some("a"),
        OperationState::Executing => Some("e"),
        _ => None,
    }
}

/// Each client's debt from its admissions `ago`: GCRA replayed over them, oldest first, as the
/// in-process engine's `restore_rate` does (an admission a whole window old counts nothing).
pub(super) fn rate_debts(config: &Config, admissions: &[(Identity, Duration)]) -> Vec<RateDebt> {
    let mut ages: std::collections::BTreeMap<&str, Vec<u64>> = std::collections::BTreeMap::new();
    for (client, ago) in admissions {
        let micros = u64::try_from(ago.as_micros()).unwrap_or(u64::MAX);
        ages.entry(client.as_str()).or_default().push(micros);
    }
    let mut debts = Vec::new();
    for (client, mut ages) in ages {
        let Some(limits) = config.effective(client) else {
            continue;
        };
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        // Oldest first; times as "span minus age" so nothing goes below zero.
        ages.sort_unstable_by(|a, b| b.cmp(a));
        let now = span;
        let mut tat = 0u64;
        for age in ages.into_iter().filter(|&age| age < span) {
            let at = now - age;
            tat = tat.max(at) + interval;
        }
        let micros = tat.saturating_sub(now).min(span);
        if micros > 0 {
            debts.push(RateDebt {
                client: Identity::new(client).expect("a configured identity is valid"),
                interval,
                span,
                micros,
            });
        }
    }
    debts
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::Limits;

    #[test]
    fn rate_debts_replay_the_admissions_as_the_engine_restores_a_bucket() {
        let bob = Identity::new("bob").unwrap();
        let limits = Limits {
            requests_per_window: 5,
            window_seconds: 600,
            ..Limits::default()
        };
        let config = Config::new(limits, BTreeMap::new(), [bob.clone()]).unwrap();
        let secs = Duration::from_secs;
        // Five tokens spent 25 s ago: the bucket is empty and the next token is 95 s away, so the
        // TAT lies 575 s past now (a full span of 600 s, less the 25 s that passed).
        let spent: Vec<(Identity, Duration)> = (0..5).map(|_| (bob.clone(), secs(25))).collect();
        let debts = rate_debts(&config, &spent);
        assert_eq!(debts.len(), 1);
        assert_eq!(debts[0].micros, 575_000_000);
        assert_eq!(
            (debts[0].interval, debts[0].span),
            (120_000_000, 600_000_000)
        );
        // One admission a whole window old (or older) counts nothing; an unknown client neither.
        let stale = [
            (bob.clone(), secs(600)),
            (Identity::new("eve").unwrap(), secs(1)),
        ];
        assert!(rate_debts(&config, &stale).is_empty());
        // Spread out: tokens 10 minutes apart never pile up beyond the last one's interval.
        let spread = [
            (bob.clone(), secs(599)),
            (bob.clone(), secs(300)),
            (bob.clone(), secs(1)),
        ];
        assert_eq!(rate_debts(&config, &spread)[0].micros, 119_000_000);
    }
}
