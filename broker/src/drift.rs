//! Drift: whether the controller's counts still equal what the store holds, as every fault must
//! leave them.
//!
//! The controller's counts are a promise about the store: each client's and the global pending,
//! queued (approved), executing and active counts equal the operation rows in those states, and
//! each store's files and bytes equal the stream rows plus the uploads whose room is reserved
//! while their body is still arriving. A reading compares the two, exports the total absolute
//! difference as `admission_store_drift` (0 when every count agrees) and logs each difference.
//!
//! **Why a reading cannot report drift that is not there.** Counts move while a reading is taken:
//! an admitted permit is counted before its row is written, a transition writes its row before
//! the handle moves. Every such change in the broker holds a shared hold on the *counts gate*
//! ([`super::core::Core::hold_counts`]) from the moment it first touches a count until both sides agree
//! again (row written and permit committed, row and handle moved, stream row and reservation
//! settled). A reading takes the gate exclusively, so it sees no change half made: it reads the
//! store (on the read connection; every gated write has committed) and the controller's
//! snapshot, then lets go. Retrying until two optimistic readings agree was the alternative; under
//! steady load two readings can agree on the same in-flight difference, so it can report drift
//! that is not there, and it may never settle. The gate's price: a reading waits for the changes
//! in progress, and (the gate is fair) new changes wait behind a waiting reading, then while it
//! holds the gate (one store query, a few milliseconds). With a slow store that is at most the
//! store's busy timeout, which those changes would spend on the store anyway. On a replica a
//! submission holds the gate across its Redis call, so with Redis slow a reading can wait up to
//! one call timeout (plus the decision wait) for it, then hold the gate for its fleet half up to
//! one more; cancels and decisions arriving meanwhile wait behind it: 1.25 s at most by default
//! (500 ms calls, a 250 ms decision wait), once per reading (every 30 s, or on demand).
//! Reads, replays and operator listings never take the gate; a submission takes it only to be
//! admitted.
//!
//! **Fleet drift.** On a replica the same reading also compares what the shared store holds under
//! this replica's name (operation id → state) with the store's live rows, and exports the
//! operations on which they disagree as `admission_fleet_drift` (0 while Redis counts exactly what
//! the replicas' stores hold; always 0 in-process). A Redis that does not answer skips that half of
//! the reading (the gauge keeps its last value) rather than hold the gate past one call's timeout
//! (the whole scan, every page, gets one), and one known not to answer (the circuit open) is not
//! asked at all.
//!
//! Just past the usual size only because its tests live beside it; the reading itself is about 410
//! lines.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde_json::{Value, json};

use super::core::Core;
use super::store::{StoreError, StoredCounts};
use unyolo_admission::engine::{OperationState, Store};
use unyolo_admission::metrics::Snapshot;

/// Which count differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DriftCount {
    /// Operations awaiting an operator decision.
    Pending,
    /// Approved operations waiting for an execution slot.
    Queued,
    /// Operations executing.
    Executing,
    /// Pending + queued + executing.
    Active,
    /// Files in a capped store.
    Files(Store),
    /// Bytes in a capped store.
    Bytes(Store),
}

impl fmt::Display for DriftCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriftCount::Pending => f.write_str("pending"),
            DriftCount::Queued => f.write_str("queued"),
            DriftCount::Executing => f.write_str("executing"),
            DriftCount::Active => f.write_str("active"),
            DriftCount::Files(store) => write!(f, "{}_files", store.as_str()),
            DriftCount::Bytes(store) => write!(f, "{}_bytes", store.as_str()),
        }
    }
}

/// One count on which the controller and the store disagree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// The client, or `None` for the global count.
    pub client: Option<String>,
    /// Which count.
    pub count: DriftCount,
    /// What the controller counts.
    pub controller: u64,
    /// What the store holds.
    pub store: u64,
}

impl Difference {
    /// How far apart the two are.
    pub fn size(&self) -> u64 {
        self.controller.abs_diff(self.store)
    }
}

/// One operation on which the store and the shared store (Redis) disagree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetDifference {
    /// The operation.
    pub id: String,
    /// Its state in the store, if live there.
    pub store: Option<OperationState>,
    /// Its state in the shared store under this replica's name, if held there.
    pub shared: Option<OperationState>,
}

/// The outcome of one comparison of the controller's counts with the store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriftReport {
    /// Every count that differs (none when the promise holds), global ones first.
    pub differences: Vec<Difference>,
    /// On a replica, every operation whose state the shared store holds differently from the
    /// store (`None` in-process, or when the shared store did not answer).
    pub fleet: Option<Vec<FleetDifference>>,
}

impl DriftReport {
    /// The sum of the absolute differences: the `admission_store_drift` gauge; 0 when every count
    /// agrees.
    pub fn total(&self) -> u64 {
        self.differences.iter().map(Difference::size).sum()
    }

    /// Whether every count agrees.
    pub fn is_clean(&self) -> bool {
        self.differences.is_empty()
    }

    /// The report as the operator route answers it:
    /// `{"drift": N, "differences": [{"client", "count", "controller", "store"}]}` with `client`
    /// `"*"` for a global count.
    pub fn to_json(&self) -> Value {
        let differences: Vec<Value> = self
            .differences
            .iter()
            .map(|d| {
                json!({
                    "client": d.client.as_deref().unwrap_or("*"),
                    "count": d.count.to_string(),
                    "controller": d.controller,
                    "store": d.store,
                })
            })
            .collect();
        let mut report = json!({"drift": self.total(), "differences": differences});
        if let Some(fleet) = &self.fleet {
            let fleet: Vec<Value> = fleet
                .iter()
                .map(|d| {
                    json!({
                        "operation": d.id,
                        "store": d.store.map(|s| s.as_str()),
                        "shared": d.shared.map(|s| s.as_str()),
                    })
                })
                .collect();
            report["fleet_drift"] = json!(fleet.len());
            report["fleet_differences"] = Value::Array(fleet);
        }
        report
    }
}

/// One side's counts for one client (or all of them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    pending: u64,
    queued: u64,
    executing: u64,
    active: u64,
    files: [u64; 2],
    bytes: [u64; 2],
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.pending += other.pending;
        self.queued += other.queued;
        self.executing += other.executing;
        self.active += other.active;
        for i in 0..2 {
            self.files[i] += other.files[i];
            self.bytes[i] += other.bytes[i];
        }
    }

    fn each(&self) -> impl Iterator<Item = (DriftCount, u64)> + '_ {
        [
            (DriftCount::Pending, self.pending),
            (DriftCount::Queued, self.queued),
            (DriftCount::Executing, self.executing),
            (DriftCount::Active, self.active),
        ]
        .into_iter()
        .chain(Store::ALL.into_iter().flat_map(|store| {
            [
                (DriftCount::Files(store), self.files[store as usize]),
                (DriftCount::Bytes(store), self.bytes[store as usize]),
            ]
        }))
    }
}

/// What the store holds, per client, with the uploads in progress counted as stored (their room
/// is reserved in the controller while their body arrives).
fn store_side(stored: &StoredCounts, uploading: &[(String, u64)]) -> BTreeMap<String, Counts> {
    let mut clients: BTreeMap<String, Counts> = BTreeMap::new();
    for (client, state, n) in &stored.operations {
        let c = clients.entry(client.clone()).or_default();
        match state {
            OperationState::Pending => c.pending += n,
            OperationState::Approved => c.queued += n,
            OperationState::Executing => c.executing += n,
            _ => continue,
        }
        c.active += n;
    }
    for (client, files, bytes) in &stored.streams {
        let c = clients.entry(client.clone()).or_default();
        c.files[Store::Stream as usize] += files;
        c.bytes[Store::Stream as usize] += bytes;
    }
    for (client, bytes) in uploading {
        let c = clients.entry(client.clone()).or_default();
        c.files[Store::Stream as usize] += 1;
        c.bytes[Store::Stream as usize] += bytes;
    }
    clients
}

fn controller_side(snapshot: &Snapshot) -> (Counts, BTreeMap<String, Counts>) {
    let per_store = |s: &[unyolo_admission::metrics::StoreSnapshot; 2]| {
        (
            std::array::from_fn(|i| s[i].files),
            std::array::from_fn(|i| s[i].bytes),
        )
    };
    let (files, bytes) = per_store(&snapshot.storage);
    let global = Counts {
        pending: snapshot.pending,
        queued: snapshot.queued,
        executing: snapshot.executing,
        active: snapshot.active,
        files,
        bytes,
    };
    let clients = snapshot
        .clients
        .iter()
        .map(|c| {
            let (files, bytes) = per_store(&c.storage);
            (
                c.identity.as_str().to_owned(),
                Counts {
                    pending: c.pending,
                    queued: c.queued,
                    executing: c.executing,
                    active: c.active,
                    files,
                    bytes,
                },
            )
        })
        .collect();
    (global, clients)
}

/// Compares a controller snapshot with the store's counts (and the uploads in progress).
fn compare(snapshot: &Snapshot, stored: &StoredCounts, uploading: &[(String, u64)]) -> DriftReport {
    let (controller_global, controller) = controller_side(snapshot);
    let store = store_side(stored, uploading);
    let mut store_global = Counts::default();
    for counts in store.values() {
        store_global.add(counts);
    }
    let mut differences = Vec::new();
    let mut push = |client: Option<&str>, ours: &Counts, theirs: &Counts| {
        for ((count, controller), (_, store)) in ours.each().zip(theirs.each()) {
            if controller != store {
                differences.push(Difference {
                    client: client.map(str::to_owned),
                    count,
                    controller,
                    store,
                });
            }
        }
    };
    push(None, &controller_global, &store_global);
    let none = Counts::default();
    let names: std::collections::BTreeSet<&String> =
        controller.keys().chain(store.keys()).collect();
    for name in names {
        push(
            Some(name),
            controller.get(name).unwrap_or(&none),
            store.get(name).unwrap_or(&none),
        );
    }
    DriftReport {
        differences,
        fleet: None,
    }
}

/// Takes one reading: holds the counts gate exclusively while it reads the store and the
/// controller, then exports the total and logs every difference. On a store the fleet shares,
/// this replica's handles first follow the rows that moved without it hearing
/// ([`super::fleet::let_go_of_taken`]: work taken over or ended elsewhere while it was paused),
/// so what a reading reports is what this replica could not catch up with, not a pause it has
/// come back from.
pub(crate) async fn check(core: &Arc<Core>) -> Result<DriftReport, StoreError> {
    if core.db.is_shared()
        && let Err(err) = super::fleet::let_go_of_taken(core).await
    {
        tracing::warn!(error = %err, "this replica's handles could not follow their rows before the drift reading");
    }
    let report = {
        let _quiet = core.counts_gate.write().await;
        let uploading = core.uploads_in_progress();
        let stored = core.db.counts().await?;
        let snapshot = core.controller().snapshot();
        let mut report = compare(&snapshot, &stored, &uploading);
        report.fleet = fleet(core).await?;
        report
    };
    core.drift
        .set(i64::try_from(report.total()).unwrap_or(i64::MAX));
    if let Some(fleet) = &report.fleet {
        core.fleet_drift
            .set(i64::try_from(fleet.len()).unwrap_or(i64::MAX));
        for d in fleet {
            tracing::warn!(
                operation = %d.id,
                store = d.store.map_or("-", |s| s.as_str()),
                shared = d.shared.map_or("-", |s| s.as_str()),
                "the shared store holds this replica's operation differently from its store"
            );
        }
    }
    for d in &report.differences {
        tracing::warn!(
            client = d.client.as_deref().unwrap_or("*"),
            count = %d.count,
            controller = d.controller,
            store = d.store,
            "admission counts differ from the store"
        );
    }
    Ok(report)
}

/// The fleet half of a reading, under the gate: `None` in-process or if Redis does not answer.
async fn fleet(core: &Core) -> Result<Option<Vec<FleetDifference>>, StoreError> {
    let shared = match core.admission.shared_holdings().await {
        Ok(Some(shared)) => shared,
        Ok(None) => return Ok(None),
        Err(err) => {
            tracing::warn!(error = %err, "fleet drift not read: redis does not answer");
            return Ok(None);
        }
    };
    let live: BTreeMap<String, OperationState> = core.db.live_states().await?.into_iter().collect();
    Ok(Some(fleet_differences(&live, &shared)))
}

/// The operations on which `store` (live rows) and `shared` (held in Redis) disagree.
fn fleet_differences(
    store: &BTreeMap<String, OperationState>,
    shared: &BTreeMap<String, OperationState>,
) -> Vec<FleetDifference> {
    let mut differences = Vec::new();
    for (id, &state) in store {
        if shared.get(id) != Some(&state) {
            differences.push(FleetDifference {
                id: id.clone(),
                store: Some(state),
                shared: shared.get(id).copied(),
            });
        }
    }
    for (id, &state) in shared {
        if !store.contains_key(id) {
            differences.push(FleetDifference {
                id: id.clone(),
                store: None,
                shared: Some(state),
            });
        }
    }
    differences
}

/// Takes a reading every `every` until the broker shuts down; a zero interval takes none.
pub(crate) async fn watch(core: std::sync::Arc<Core>, every: std::time::Duration) {
    if every.is_zero() {
        return;
    }
    let mut shutdown = core.shutdown.clone();
    // The operations Redis held differently from the store at the last reading.
    let mut differed = std::collections::BTreeSet::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let checked = tokio::select! {
            checked = check(&core) => checked,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        match checked {
            Ok(report) => {
                let now: std::collections::BTreeSet<String> = report
                    .fleet
                    .iter()
                    .flatten()
                    .map(|d| d.id.clone())
                    .collect();
                heal_if_persisting(&core, &differed, &now).await;
                differed = now;
            }
            Err(err) => tracing::warn!(error = %err, "drift check failed"),
        }
    }
}

/// A difference between Redis and the store that one reading saw may be a change on its way
/// (another replica's move its owner has not followed yet); one that two readings in a row saw
/// on the same operation persists (a Redis failover that lost writes, an older snapshot
/// restored): this replica's holdings are counted again from what it holds, which the store
/// says, in one atomic replace. The store is the truth.
async fn heal_if_persisting(
    core: &Core,
    before: &std::collections::BTreeSet<String>,
    now: &std::collections::BTreeSet<String>,
) {
    let persisting = before.intersection(now).count();
    if persisting == 0 {
        return;
    }
    match core.admission.recount_shared().await {
        Ok(()) => tracing::warn!(
            operations = persisting,
            "redis held operations differently from the store at two readings in a row; this \
             replica's holdings are counted again from the store"
        ),
        Err(err) => tracing::warn!(
            error = %err,
            "a drift between redis and the store persists, and could not be healed now; the \
             next reading tries again"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unyolo_admission::Config;
    use unyolo_admission::config::{Identity, Secrets};
    use unyolo_admission::engine::Controller;

    fn controller() -> Controller {
        let secrets = Secrets::parse("a = secret-a\nb = secret-b\n").unwrap();
        let identities: Vec<Identity> = secrets.identities().cloned().collect();
        Controller::new(Config::defaults(identities))
    }

    #[test]
    fn the_fleet_differs_where_a_state_differs_or_one_side_lacks_the_operation() {
        use OperationState::{Approved, Executing, Pending};
        let store: BTreeMap<String, OperationState> =
            [("a", Pending), ("b", Approved), ("c", Executing)]
                .map(|(id, s)| (id.to_string(), s))
                .into();
        assert!(fleet_differences(&store, &store).is_empty());
        let shared: BTreeMap<String, OperationState> =
            [("a", Pending), ("b", Executing), ("d", Approved)]
                .map(|(id, s)| (id.to_string(), s))
                .into();
        let differences = fleet_differences(&store, &shared);
        let seen: Vec<(&str, Option<OperationState>, Option<OperationState>)> = differences
            .iter()
            .map(|d| (d.id.as_str(), d.store, d.shared))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("b", Some(Approved), Some(Executing)),
                ("c", Some(Executing), None),
                ("d", None, Some(Approved)),
            ]
        );
    }

    #[test]
    fn counts_that_match_the_store_report_no_drift() {
        let controller = controller();
        let pending = controller.admit("a", true).unwrap().commit();
        let queued = controller.admit("b", false).unwrap().commit();
        let stream = controller
            .reserve_storage("a", Store::Stream, 10)
            .unwrap()
            .settle(10)
            .unwrap();
        let stored = StoredCounts {
            operations: vec![
                ("a".into(), OperationState::Pending, 1),
                ("b".into(), OperationState::Approved, 1),
                ("a".into(), OperationState::Succeeded, 7),
            ],
            streams: vec![("a".into(), 1, 10)],
        };
        let report = compare(&controller.snapshot(), &stored, &[]);
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.total(), 0);
        drop((pending, queued, stream));
    }

    #[test]
    fn a_row_the_controller_does_not_count_is_drift_per_client_and_global() {
        let controller = controller();
        let stored = StoredCounts {
            operations: vec![("a".into(), OperationState::Pending, 3)],
            streams: vec![],
        };
        let report = compare(&controller.snapshot(), &stored, &[]);
        // pending and active, each for client a and globally.
        assert_eq!(report.total(), 12);
        assert!(report.differences.contains(&Difference {
            client: Some("a".into()),
            count: DriftCount::Pending,
            controller: 0,
            store: 3,
        }));
        assert!(report.differences.contains(&Difference {
            client: None,
            count: DriftCount::Active,
            controller: 0,
            store: 3,
        }));
        assert_eq!(report.to_json()["drift"], 12);
    }

    #[test]
    fn an_upload_in_progress_counts_as_stored() {
        let controller = controller();
        let reservation = controller.reserve_storage("b", Store::Stream, 42).unwrap();
        let empty = StoredCounts::default();
        assert_eq!(compare(&controller.snapshot(), &empty, &[]).total(), 2 * 43);
        let report = compare(&controller.snapshot(), &empty, &[("b".into(), 42)]);
        assert!(report.is_clean(), "{report:?}");
        drop(reservation);
    }
}
