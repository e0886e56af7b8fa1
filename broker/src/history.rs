//! `admission check --history STORE CANDIDATE.json`: a candidate quota file judged on the
//! history a store holds before it meets live traffic.
//!
//! The store's operations (every one still stored: retention decides how far back that goes)
//! are read once ([`DurableStore::history`](super::store::DurableStore::history)), their creation, approval and end times replayed in
//! order through a fresh engine with the candidate's limits ([`Shadow::replay`]), and what it
//! would have refused — per client, with the code and when — is printed with the peak counts
//! against each limit. Reads only: a data dir's SQLite file through a read-only connection (so
//! the dir of a broker that is serving can be read), or a PostgreSQL database by plain `SELECT`s.
//!
//! The times are the store's: an approval's is the last decision's (a later revoke or cancel
//! moves it to then), and work that needs no approval is taken to execute from its creation.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;
use std::time::SystemTime;

use super::registry;
use super::store::{self, DATABASE_FILE, OperationTimes, StoreLocation};
use unyolo_admission::admission::{Replay, Shadow, StoredOperation};
use unyolo_admission::config::{Config, Identity};
use unyolo_admission::engine::OperationState;

/// Exit status of `admission check --history` when the candidate would have refused something.
pub const EXIT_WOULD_REFUSE: u8 = 3;

/// What a history check read and found.
#[derive(Debug)]
pub struct HistoryCheck {
    /// How many stored operations were replayed.
    pub operations: usize,
    /// What the candidate would have done.
    pub replay: Replay,
}

/// Reads the history in `store` (a data dir holding a SQLite store, or a `postgres://` URL) and
/// replays it through `candidate`'s limits, for the identities in the history and `identities`.
/// Nothing is created: a data dir without a store is an error.
pub fn check(
    store: &str,
    candidate: &Path,
    identities: BTreeSet<Identity>,
) -> Result<HistoryCheck, String> {
    // The candidate's path and size before the store is touched.
    unyolo_admission::config::read_quota_file(candidate).map_err(|e| e.to_string())?;
    let location = if store.contains("://") {
        StoreLocation::parse(store).map_err(|e| format!("--history: {e}"))?
    } else {
        let dir = Path::new(store);
        if !dir.join(DATABASE_FILE).is_file() {
            return Err(format!(
                "--history: {store}: no store here (no {DATABASE_FILE}); give a broker's data dir \
                 or a postgres:// URL"
            ));
        }
        StoreLocation::Dir(dir.to_path_buf())
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let stored = runtime.block_on(read(&location))?;
    let mut known = identities;
    for op in &stored {
        if let Ok(identity) = Identity::new(&op.client_id) {
            known.insert(identity);
        }
    }
    let config = Config::from_path(candidate, known).map_err(|e| e.to_string())?;
    let history: Vec<StoredOperation> = stored.iter().filter_map(replayed).collect();
    Ok(HistoryCheck {
        operations: history.len(),
        replay: Shadow::replay(config, &history),
    })
}

/// Every stored operation of the store at `location`: a data dir's SQLite file through a
/// read-only connection (no lock, no migration: a serving broker's dir can be read); a
/// PostgreSQL store opened with a data dir of its own for the call (its lock and streams
/// folder), removed after.
async fn read(location: &StoreLocation) -> Result<Vec<OperationTimes>, String> {
    let scratch = match location {
        // Read-only, beside whatever broker serves the dir.
        StoreLocation::Dir(dir) => {
            let dir = dir.clone();
            return tokio::task::spawn_blocking(move || store::SqliteStore::read_history(&dir))
                .await
                .map_err(|e| format!("--history: {e}"))?
                .map_err(|e| format!("--history {location}: {e}"));
        }
        StoreLocation::Postgres { .. } => std::env::temp_dir().join(format!(
            "admission-history-{}",
            unyolo_admission::admission::random_id("check")
        )),
    };
    let opened = store::open(
        location,
        store::DEFAULT_BROKER_NAME,
        registry::approval_operations(),
        &scratch,
    )
    .await;
    let history = match opened {
        Ok(db) => db.history().await,
        Err(err) => Err(err),
    };
    let _ = std::fs::remove_dir_all(&scratch);
    history.map_err(|e| format!("--history {location}: {e}"))
}

fn time(text: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339(text).ok()
}

/// One stored operation as the replay takes it; `None` when its creation time does not parse.
fn replayed(op: &OperationTimes) -> Option<StoredOperation> {
    use OperationState::{Approved, Executing, Succeeded};
    let needs_approval = registry::needs_approval(&op.operation);
    let was_approved = matches!(op.state, Approved | Executing | Succeeded)
        || matches!(op.ended_from, Some(Approved | Executing));
    let created_at = time(&op.created_at)?;
    Some(StoredOperation {
        client: op.client_id.clone(),
        needs_approval,
        created_at,
        approved_at: (needs_approval && was_approved).then(|| {
            op.decided_at
                .as_deref()
                .and_then(time)
                .unwrap_or(created_at)
        }),
        ended_at: op.terminal_at.as_deref().and_then(time),
    })
}

fn at(time: SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

/// The report `admission check --history` prints: one line per client (admitted, refused by
/// code, peaks against each limit), then every would-be refusal with its time, then the verdict.
pub fn render(check: &HistoryCheck) -> String {
    let report = &check.replay.report;
    let mut out = String::new();
    let _ = writeln!(out, "replayed {} stored operations", check.operations);
    let _ = writeln!(
        out,
        "global: active peak {}/{}, executing peak {}/{}",
        report.global_active.1,
        report.global_active.0,
        report.global_executing.1,
        report.global_executing.0
    );
    for client in &report.clients {
        let refused: u64 = client.refused.iter().map(|(_, n)| n).sum();
        let codes: Vec<String> = client
            .refused
            .iter()
            .map(|(code, n)| format!("{code}={n}"))
            .collect();
        let (limits, peaks) = (client.limits, client.peaks);
        let _ = writeln!(
            out,
            "client {}: admitted {}, refused {}{}; peaks: requests {}/{} per {}s, active {}/{}, \
             pending {}/{}, executing {}",
            client.identity,
            client.admitted,
            refused,
            if codes.is_empty() {
                String::new()
            } else {
                format!(" ({})", codes.join(", "))
            },
            peaks.rate_used,
            limits.requests_per_window,
            limits.window_seconds,
            peaks.active,
            limits.active,
            peaks.pending,
            limits.pending,
            peaks.executing,
        );
    }
    for refusal in &check.replay.refusals {
        let _ = writeln!(
            out,
            "would refuse {} at {}: {}",
            refusal.client,
            at(refusal.at),
            refusal.code
        );
    }
    match check.replay.refusals.len() {
        0 => out.push_str("the candidate would refuse nothing\n"),
        n => {
            let _ = writeln!(out, "the candidate would refuse {n} submissions");
        }
    }
    out
}
