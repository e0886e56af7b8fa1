//! The store stays bounded: terminal operations retire after the retention period, stream files
//! and rows are reconciled, and the space goes back to the filesystem.
//!
//! A sweep runs in a task of its own, off the request path, every
//! [`RetentionSettings::sweep_interval`] (one minute by default; the first one interval after
//! start-up, which already removed stream files without a row), or on demand
//! ([`super::Broker::sweep_now`]). Each sweep:
//!
//! 1. deletes terminal operations whose `terminal_at` is older than the retention, at most
//!    [`BATCH`] rows per write transaction, so a submission waits at most one small batch for
//!    the store (SQLite's one write lock; on PostgreSQL, only writes to those rows). Each batch
//!    holds the counts gate (`Core::hold_counts`) like every other change, though deleting
//!    terminal rows changes no count. Non-terminal operations are never touched, however old;
//! 2. trims the Operator V1 event log to its newest [`MAX_EVENTS`] and to none older than the
//!    retention, oldest first, [`BATCH`] events per write transaction;
//! 3. returns freed pages to the filesystem ([`VACUUM_STEP`] pages per transaction: the SQLite
//!    file uses incremental auto-vacuum; PostgreSQL's autovacuum needs nothing from here);
//! 4. reconciles streams under the counts gate: a row whose file is gone is deleted and its room
//!    released in the controller; a file with no row and no upload in progress is removed;
//! 5. rebuilds the replay filter from the store once a quarter of its keys have retired (see the
//!    `keys` module), and refreshes the store and filter metrics.
//!
//! On a store several replicas share, one replica at a time sweeps (the live member first by
//! name), so retention runs once for the fleet.
//!
//! **A replay after retention is new work.** The contract's replay window is the retention: once
//! an operation retired, its idempotency key is free again, and a submission with it creates a new
//! operation (admitted, counted and rate limited like any other). Clients that need a longer
//! window keep their own record of what they submitted, or the operator raises `--retention`.
//!
//! **Time is injectable.** The sweep asks [`WallClock`] what time it is, so tests move the clock
//! days forward instead of waiting.
//!
//! One file past the usual size: the sweep is one sequence of steps (above) over one set of
//! settings and metrics, and reads top to bottom.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::core::{Core, run_to_end};
use super::store::StoreError;
use super::store::events::MAX_EVENTS;
use unyolo_admission::OperationState;
use unyolo_admission::admission::KeyRecord;
use unyolo_admission::config::Identity;

/// Rows deleted per write transaction: small, so a submission waiting for the store's write lock
/// (SQLite's) waits for one short batch (500 rows held the lock ~0.6 s on a loaded 2-core machine).
pub const BATCH: u32 = 100;

/// Free pages returned to the filesystem per write transaction.
pub const VACUUM_STEP: u32 = 500;

/// A live operation older than this has its key's lifetime renewed at every sweep (the lifetime
/// is the retention plus a day, so it never runs out while the operation lives).
pub const RENEW_KEYS_AFTER: Duration = Duration::from_secs(12 * 3600);

/// The default retention: seven days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// How often, by default, a sweep runs.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// How long terminal operations are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// For ever: nothing retires and the store grows without bound.
    Forever,
    /// This long after they became terminal.
    For(Duration),
}

impl FromStr for Keep {
    type Err = String;

    /// A humantime duration (`7days`, `12h`), or `0` or `forever` for [`Keep::Forever`].
    fn from_str(text: &str) -> Result<Keep, String> {
        let text = text.trim();
        if text == "forever" {
            return Ok(Keep::Forever);
        }
        match humantime::parse_duration(text) {
            Ok(d) if d.is_zero() => Ok(Keep::Forever),
            Ok(d) => Ok(Keep::For(d)),
            Err(err) => Err(format!(
                "{text:?} is not a retention: give a duration such as `7days` or `12h`, or `forever` ({err})"
            )),
        }
    }
}

impl std::fmt::Display for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keep::Forever => f.write_str("forever"),
            Keep::For(d) => write!(f, "{}", humantime::format_duration(*d)),
        }
    }
}

/// Where the sweep reads the wall-clock time: the system clock, or a test's.
#[derive(Clone)]
pub struct WallClock(Arc<dyn Fn() -> SystemTime + Send + Sync>);

impl WallClock {
    /// The system clock.
    pub fn system() -> WallClock {
        WallClock(Arc::new(SystemTime::now))
    }

    /// A clock that answers `now()` (a test's).
    pub fn from_fn(now: impl Fn() -> SystemTime + Send + Sync + 'static) -> WallClock {
        WallClock(Arc::new(now))
    }

    /// The time now.
    pub fn now(&self) -> SystemTime {
        (self.0)()
    }
}

impl std::fmt::Debug for WallClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WallClock")
    }
}

/// How long terminal operations are kept, and how the sweep runs.
#[derive(Clone, Debug)]
pub struct RetentionSettings {
    /// How long terminal operations are kept ([`DEFAULT_RETENTION`] by default); never less than
    /// the longest rate window in force, whose buckets a restart rebuilds from the rows.
    pub keep: Keep,
    /// How often a sweep runs ([`DEFAULT_SWEEP_INTERVAL`]); zero for only on demand.
    pub sweep_interval: Duration,
    /// Where the sweep reads the time.
    pub clock: WallClock,
}

impl Default for RetentionSettings {
    fn default() -> RetentionSettings {
        RetentionSettings {
            keep: Keep::For(DEFAULT_RETENTION),
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            clock: WallClock::system(),
        }
    }
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Terminal operations deleted.
    pub retired: u64,
    /// Terminal operations due that stay until the next sweep, because the shared store could
    /// not unbind their keys.
    pub deferred: u64,
    /// Stream rows deleted because their file was gone.
    pub stream_rows_removed: u64,
    /// Stream files removed because they had no row and no upload in progress.
    pub stream_files_removed: u64,
    /// Whether the replay filter was rebuilt from the store.
    pub filter_rebuilt: bool,
    /// Operator V1 events deleted (past the newest [`MAX_EVENTS`] or older than the retention).
    pub events_trimmed: u64,
    /// Live operations older than [`RENEW_KEYS_AFTER`] whose keys got their whole lifetime in
    /// the shared store again (replicated, with a key lifetime).
    pub keys_renewed: u64,
}

type StateLabels = [(&'static str, &'static str); 1];
type FileLabels = [(&'static str, &'static str); 1];

/// The sweep's state and metrics, held by the broker and its sweeping task (not by the core: the
/// sweep acts on the core, the core knows nothing of it).
pub(crate) struct Retention {
    pub(crate) settings: RetentionSettings,
    /// One sweep at a time (the timer's and an on-demand one).
    running: tokio::sync::Mutex<()>,
    operations: Family<StateLabels, Gauge>,
    store_bytes: Family<FileLabels, Gauge>,
    last_sweep_time: Gauge,
    last_sweep_retired: Gauge,
    last_sweep_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    retired_total: Counter,
    filter_keys: Gauge,
    filter_bytes: Gauge,
    filter_false_positives: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Retention {
    /// The sweep's state, its metrics registered in `registry`.
    pub(crate) fn new(settings: RetentionSettings, registry: &mut Registry) -> Retention {
        let retention = Retention {
            settings,
            running: tokio::sync::Mutex::new(()),
            operations: Family::default(),
            store_bytes: Family::default(),
            last_sweep_time: Gauge::default(),
            last_sweep_retired: Gauge::default(),
            last_sweep_seconds: Gauge::default(),
            retired_total: Counter::default(),
            filter_keys: Gauge::default(),
            filter_bytes: Gauge::default(),
            filter_false_positives: Gauge::default(),
        };
        registry.register(
            "broker_store_operations",
            "Operation rows in the store by state, at the last sweep.",
            retention.operations.clone(),
        );
        registry.register(
            "broker_store_bytes",
            "Bytes the store's database takes on disk at the last sweep, by file: `database` (the \
             SQLite file) and `wal` (its write-ahead log).",
            retention.store_bytes.clone(),
        );
        registry.register(
            "broker_retention_last_sweep_timestamp_seconds",
            "When the last retention sweep ran (Unix seconds, by the sweep's clock).",
            retention.last_sweep_time.clone(),
        );
        registry.register(
            "broker_retention_last_sweep_retired",
            "Terminal operations the last retention sweep deleted.",
            retention.last_sweep_retired.clone(),
        );
        registry.register(
            "broker_retention_last_sweep_duration_seconds",
            "How long the last retention sweep took.",
            retention.last_sweep_seconds.clone(),
        );
        registry.register(
            "broker_retention_retired",
            "Terminal operations deleted by retention sweeps.",
            retention.retired_total.clone(),
        );
        registry.register(
            "broker_key_filter_keys",
            "Keys the replay filter holds (retired ones included until its next rebuild).",
            retention.filter_keys.clone(),
        );
        registry.register(
            "broker_key_filter_bytes",
            "Memory the replay filter's tables take.",
            retention.filter_bytes.clone(),
        );
        registry.register(
            "broker_key_filter_false_positive_ratio",
            "The share of never-used keys the replay filter answers \"maybe\" for (measured by probing it).",
            retention.filter_false_positives.clone(),
        );
        retention
    }
}

/// Refreshes the metrics at once, then sweeps every `interval` (the first one interval after
/// start-up) until the broker stops; zero for never.
pub(crate) async fn watch(core: Arc<Core>, retention: Arc<Retention>, interval: Duration) {
    if let Err(err) = refresh_metrics(&core, &retention).await {
        tracing::warn!(error = %err, "store metrics could not be read");
    }
    if interval.is_zero() {
        return;
    }
    let mut shutdown = core.shutdown.clone();
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                // Once for the whole store: on a shared one, only the replica leading the fleet.
                match core.db.leads_fleet().await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(err) => {
                        tracing::warn!(error = %err, "retention sweep skipped: the store does not answer");
                        continue;
                    }
                }
                if let Err(err) = sweep(&core, &retention).await {
                    tracing::warn!(error = %err, "retention sweep failed; the next one retries");
                }
            }
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

/// The longest rate window of `config`, its defaults' or any override's.
fn longest_window(config: &unyolo_admission::Config) -> Duration {
    let longest = config
        .overrides()
        .values()
        .map(|limits| limits.window_seconds)
        .chain([config.limits().window_seconds])
        .max()
        .unwrap_or(0);
    Duration::from_secs(u64::from(longest))
}

/// One sweep (see the module doc).
pub(crate) async fn sweep(
    core: &Arc<Core>,
    retention: &Retention,
) -> Result<SweepReport, StoreError> {
    let _one = retention.running.lock().await;
    let started = Instant::now();
    let now = retention.settings.clock.now();
    let mut report = SweepReport::default();

    // A row is kept at least as long as the longest rate window in force: a restart rebuilds the
    // rate buckets from the creation times of the rows still stored, so a row retired sooner
    // would hand its client that token again (a restart never resets a quota).
    if let Keep::For(keep) = retention.settings.keep
        && let Some(cutoff) = now.checked_sub(keep.max(longest_window(&core.controller().config())))
    {
        let cutoff = humantime::format_rfc3339_millis(cutoff).to_string();
        loop {
            let batch = core.db.retiring(cutoff.clone(), BATCH).await?;
            let full = batch.len() >= BATCH as usize;
            if batch.is_empty() {
                break;
            }
            // The keys go before the rows: a replay that finds a key still bound (on any
            // replica) finds its row, and one that finds it unbound is new work everywhere.
            // Replicated, a Redis that does not answer keeps the rows until the next sweep.
            let records: Vec<KeyRecord> = batch
                .iter()
                .filter_map(|row| {
                    Some(KeyRecord {
                        client: Identity::new(&row.client).ok()?,
                        key: row.key.clone(),
                        operation: row.id.clone(),
                    })
                })
                .collect();
            // No recovery leaves a key bound for a deleted row (see
            // `Admission::retire_keys_then`); on a task of its own, so a sweep dropped mid-batch
            // still finishes the batch whole.
            let rows = batch.len() as u64;
            let batch_core = Arc::clone(core);
            let retired = run_to_end(async move {
                let core = batch_core;
                let delete = async {
                    let _quiet = core.hold_counts().await;
                    core.db.retire(batch).await
                };
                core.admission.retire_keys_then(&records, delete).await
            });
            let retired = retired
                .await
                .map_err(|e| StoreError::unfinished("the retention batch", e))?;
            let deleted = match retired {
                Ok(deleted) => deleted?,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot unbind retired keys in redis; they retire at the next sweep");
                    report.deferred += rows;
                    break;
                }
            };
            report.retired += deleted;
            core.keys.retired(deleted);
            if !full {
                break;
            }
            // Let waiting writers (submissions, decisions) in between batches.
            tokio::task::yield_now().await;
        }
    }
    // A key's lifetime in the shared store (a net under the unbinding above) starts at its
    // admission; an operation that lives long (pending for days, queued, executing) has its
    // key's lifetime renewed, so the key outlives it by the retention. Nothing in-process.
    if core.admission.is_replicated() {
        let old = now.checked_sub(RENEW_KEYS_AFTER);
        let records: Vec<KeyRecord> = core
            .live_ops()
            .values()
            .filter(|op| old.is_some_and(|old| op.created_at <= old))
            .filter_map(|op| {
                Some(KeyRecord {
                    client: Identity::new(&op.client_id).ok()?,
                    key: op.key.clone(),
                    operation: op.id.clone(),
                })
            })
            .collect();
        if !records.is_empty() {
            match core.admission.renew_keys(&records).await {
                Ok(renewed) => report.keys_renewed = renewed,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot renew live operations' keys in redis; trying again at the next sweep");
                }
            }
        }
    }
    let event_cutoff = match retention.settings.keep {
        Keep::For(keep) => now
            .checked_sub(keep)
            .map(|cutoff| humantime::format_rfc3339_millis(cutoff).to_string()),
        Keep::Forever => None,
    };
    loop {
        let trimmed = core
            .db
            .trim_events(MAX_EVENTS, event_cutoff.clone(), BATCH)
            .await?;
        report.events_trimmed += trimmed;
        if trimmed < u64::from(BATCH) {
            break;
        }
        tokio::task::yield_now().await;
    }
    while core.db.release_space(VACUUM_STEP).await? > 0 {
        tokio::task::yield_now().await;
    }
    if report.retired > 0 || report.events_trimmed > 0 {
        core.db.checkpoint().await?;
    }
    let (rows_removed, files_removed) = reconcile_streams(core).await?;
    report.stream_rows_removed = rows_removed;
    report.stream_files_removed = files_removed;

    if core.keys.stale() {
        let rebuilding = Arc::clone(core);
        // The filter's rebuild scans the store while it takes the keys inserted meanwhile:
        // the scan runs inside it, on a blocking thread that waits for the store's answer.
        let store = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let expected = store.block_on(rebuilding.db.key_count())?;
            rebuilding.keys.rebuild(expected as usize, |visit| {
                for (client, key) in store.block_on(rebuilding.db.keys())? {
                    visit(&client, &key);
                }
                Ok::<_, StoreError>(())
            })
        })
        .await
        .map_err(|e| StoreError::unfinished("the filter rebuild", e))??;
        report.filter_rebuilt = true;
    }

    refresh_metrics(core, retention).await?;
    retention.retired_total.inc_by(report.retired);
    retention
        .last_sweep_retired
        .set(i64::try_from(report.retired).unwrap_or(i64::MAX));
    retention.last_sweep_time.set(
        now.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
    );
    retention
        .last_sweep_seconds
        .set(started.elapsed().as_secs_f64());
    if report != SweepReport::default() {
        tracing::info!(
            retired = report.retired,
            stream_rows_removed = report.stream_rows_removed,
            stream_files_removed = report.stream_files_removed,
            filter_rebuilt = report.filter_rebuilt,
            "retention sweep"
        );
    }
    Ok(report)
}

/// Stream rows whose file is gone (where the file is the body), and files with neither a row nor
/// an upload in progress. Returns (rows removed, files removed).
///
/// Uploads run beside this (the counts gate is held shared by both), so what is read is read in
/// the order an upload moves: an upload is recorded before its file exists and stays recorded
/// until its row is in (or its file gone). Hence the files are listed first, then the uploads
/// in progress, then the rows: a listed file whose upload had ended has its row among those
/// read after. A row read with no listed file may be a stream stored since the listing: its file
/// is looked for again before the row goes.
async fn reconcile_streams(core: &Arc<Core>) -> Result<(u64, u64), StoreError> {
    let _quiet = core.hold_counts().await;
    let dir = core.db.streams_dir();
    let listed = dir.clone();
    let files = tokio::task::spawn_blocking(move || {
        let mut names = std::collections::HashSet::new();
        if let Ok(entries) = std::fs::read_dir(&listed) {
            for entry in entries.flatten() {
                names.insert(entry.file_name().to_string_lossy().into_owned());
            }
        }
        names
    })
    .await
    .map_err(|e| StoreError::unfinished("the stream file listing", e))?;
    let uploading: std::collections::HashSet<String> = core.uploads().keys().cloned().collect();
    let rows = core.db.stream_ids().await?;
    let mut rows_removed = 0;
    // A store that keeps the bodies in its rows has no file for a row to miss (its files are
    // uploads being staged, or leftovers of one that never got its row).
    let bodies_in_rows = core.db.keeps_stream_bodies();
    for (id, client) in &rows {
        if bodies_in_rows
            || files.contains(id)
            || tokio::fs::try_exists(dir.join(id)).await.unwrap_or(true)
        {
            continue;
        }
        if core.db.delete_stream(id).await? {
            rows_removed += 1;
        }
        if let Some(object) = core.stored_streams().remove(id) {
            object.release();
        }
        tracing::warn!(stream = %id, client = %client, "stream row without a file removed");
    }
    let with_rows: std::collections::HashSet<&str> =
        rows.iter().map(|(id, _)| id.as_str()).collect();
    let mut files_removed = 0;
    for name in &files {
        if with_rows.contains(name.as_str()) || uploading.contains(name) {
            continue;
        }
        if tokio::fs::remove_file(dir.join(name)).await.is_ok() {
            files_removed += 1;
            tracing::warn!(stream = %name, "stream file without a row removed");
        }
    }
    Ok((rows_removed, files_removed))
}

/// Rows by state, database bytes and the filter's size and accuracy.
async fn refresh_metrics(core: &Arc<Core>, retention: &Retention) -> Result<(), StoreError> {
    let counts = core.db.operations_by_state().await?;
    for state in OperationState::ALL {
        let n = counts
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n);
        retention
            .operations
            .get_or_create(&[("state", state.as_str())])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    for (file, bytes) in core.db.sizes() {
        retention
            .store_bytes
            .get_or_create(&[("file", file)])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    let stats = core.keys.stats();
    retention
        .filter_keys
        .set(i64::try_from(stats.keys).unwrap_or(i64::MAX));
    retention
        .filter_bytes
        .set(i64::try_from(stats.bytes).unwrap_or(i64::MAX));
    retention
        .filter_false_positives
        .set(stats.false_positive_ratio);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retention_is_a_duration_or_forever() {
        assert_eq!(
            "7days".parse::<Keep>(),
            Ok(Keep::For(Duration::from_secs(7 * 86_400)))
        );
        assert_eq!("forever".parse::<Keep>(), Ok(Keep::Forever));
        assert_eq!("0".parse::<Keep>(), Ok(Keep::Forever));
        assert_eq!("0s".parse::<Keep>(), Ok(Keep::Forever));
        assert!("soon".parse::<Keep>().is_err());
    }
}
