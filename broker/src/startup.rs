//! Start-up and shutdown: how a broker comes to serve from what its store holds (a SQLite file in
//! its data dir, or a PostgreSQL database several replicas share), and how it lets go of it.
//!
//! [`Broker::start`] opens the store (on a shared one, it joins the replicas serving it first),
//! reads back what it needs before the first request (the live
//! operations, the replay filter's keys, the recent creations), builds the core, restores the
//! controller's counts from the store (`restore`: live operations, approved ones queued again,
//! stored streams; bodies never recorded are removed), rebuilds each client's rate bucket from its
//! recent creations (`restore_rates`: a restart hands out no fresh burst), takes a first drift
//! reading, and starts the executor, the drift watch, the retention sweep and the listeners (and,
//! on a shared store, the membership's renewal and the change feed: the `fleet` module).
//! [`Broker::shutdown`] stops them and waits, bounded, for every change in progress to finish.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::auth::Auth;
use super::core::{
    Core, DecisionLabels, ExecQueue, PendingExpiries, SubmissionCounters, SubmissionLabels,
};
use super::event_streams::EventStreams;
use super::keys::KeyFilter;
use super::listener::{ConnectionPool, ConnectionSettings, ListenAddr, UnixSocket};
use super::retention::{Keep, Retention};
use super::store::{self, DurableStore, StoreError};
use super::waits::Waits;
use super::{
    Broker, BrokerError, BrokerSettings, RestoreSummary, api, drift, exec, listener, retention,
    validate_broker_name,
};
use crate::fairness::{ByteBudget, Fairness};
use unyolo_admission::OperationState;
use unyolo_admission::admission::{Admission, ReplicaOptions, Shadow};
use unyolo_admission::config::{Config, Identity};
use unyolo_admission::engine::Controller;

/// How long [`Broker::shutdown`] waits for the broker's tasks to end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

impl Broker {
    /// Opens the store in the data dir, restores every non-terminal operation and stream into a
    /// new controller, starts the executor and serves. Must run inside a tokio runtime.
    ///
    /// With [`BrokerSettings::replicas`], the broker is one replica of several sharing admission
    /// through Redis: it registers what the store restores under the replica's name (replacing
    /// what an earlier run under that name held, in one step) and takes its lease. A Redis that
    /// does not answer at start-up does not stop it: the replica serves reads, cancels,
    /// decisions, health and metrics, answers new submissions 503 `admission_unavailable` with
    /// Retry-After, and registers (then admits) as soon as Redis answers. Only invalid options
    /// or URL fail.
    pub async fn start(settings: BrokerSettings) -> Result<(Broker, RestoreSummary), BrokerError> {
        validate_broker_name(&settings.broker_name).map_err(BrokerError::Settings)?;
        settings.validate()?;
        let connection_cap = settings.connections.connection_cap();
        if let (Some(asked), Some(limit)) =
            (settings.connections.max_connections, listener::file_limit())
            && asked > connection_cap
        {
            tracing::warn!(
                max_connections = asked,
                file_limit = limit,
                serving_at_most = connection_cap,
                "--max-connections is above what the open-file limit leaves for connections; \
                 lowered (raise the limit, ulimit -n, to allow more)"
            );
        }
        let rate_window = settings.config.longest_window().max(
            settings
                .shadow
                .as_ref()
                .map_or(Duration::ZERO, Config::longest_window),
        );
        let member = membership_name(&settings)?;
        let agent_bind = |e| BrokerError::Bind(ListenAddr::Tcp(settings.listen), e);
        let listener = listener::bind(settings.listen).map_err(agent_bind)?;
        let addr = listener.local_addr().map_err(agent_bind)?;
        let operator_listener = OperatorListener::bind(&settings.operator_listen).await?;
        let controller = Controller::builder(settings.config)
            .storage_caps(settings.storage_caps)
            .capacity_retry(settings.capacity_retry)
            .build();
        let mut replicas = settings.replicas.clone();
        if let Some(options) = &mut replicas
            && options.idempotency_ttl.is_none()
            && let Keep::For(keep) = settings.retention.keep
        {
            // A key lives as long as its operation: the sweep unbinds it when it retires the
            // row; the lifetime is only a net under that, a day past the retention.
            options.idempotency_ttl = Some(keep + Duration::from_secs(24 * 3600));
        }
        // The shadow: a second engine of the same kind, in-process whatever the backend.
        let shadow = settings.shadow.clone().map(|config| {
            Shadow::new(
                Controller::builder(config)
                    .storage_caps(settings.storage_caps)
                    .capacity_retry(settings.capacity_retry)
                    .build(),
            )
        });
        let admission = Admission::new(controller, replicas)
            .map_err(|e| BrokerError::Settings(e.to_string()))?;
        let data_dir = settings.data_dir.clone();
        let broker_name = settings.broker_name.clone();
        let location = settings
            .store
            .clone()
            .unwrap_or_else(|| store::StoreLocation::Dir(data_dir.clone()));
        let db = store::open_batched(
            &location,
            &broker_name,
            super::registry::approval_operations(),
            &data_dir,
            settings.commit_batch,
        )
        .await?;
        join_the_store(&*db, &member, settings.replicas.is_some()).await?;
        let (db, recovered, keys, created) = async {
            // Rows an older schema wrote get their presentation and digest once, before
            // anything reads them.
            let derived = db.fill_derived(super::presentation::derive).await?;
            if derived > 0 {
                tracing::info!(
                    rows = derived,
                    "stored the presentation and request digest of older operations"
                );
            }
            let recovered = db.recover().await?;
            let keys = KeyFilter::with_capacity(db.key_count().await? as usize);
            for (client, key) in db.keys().await? {
                keys.insert(&client, &key);
            }
            let since = SystemTime::now()
                .checked_sub(rate_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let created = db.created_since(since).await?;
            Ok::<_, StoreError>((db, recovered, keys, created))
        }
        .await?;

        let mut registry = Registry::default();
        // After Redis forgets, this replica's store gives back its keys and recent admissions.
        admission.set_recovery_source(Arc::new(super::recovery::StoreSource::new(db.clone())));
        admission.register_metrics(&mut registry);
        if let Some(shadow) = &shadow {
            unyolo_admission::metrics::register_shadow(&mut registry, shadow.engine());
        }
        let drift = Gauge::default();
        registry.register(
            "admission_store_drift",
            "Total absolute difference between the controller's counts and the store at the last \
             check (0 when they agree).",
            drift.clone(),
        );
        let fleet_drift = Gauge::default();
        registry.register(
            "admission_fleet_drift",
            "Operations the shared store (Redis) holds under this replica's name differently from \
             its store's live rows at the last check (0 when they agree; always 0 in-process).",
            fleet_drift.clone(),
        );
        let operator_decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "broker_operator_decisions",
            "Operator decisions (approve, deny, revoke) by outcome: committed, replayed, or the \
             error code that refused them.",
            operator_decisions.clone(),
        );
        let submissions = Family::<SubmissionLabels, Counter>::default();
        let submission_counters = SubmissionCounters::of(&submissions);
        registry.register(
            "broker_submissions",
            "Operation submissions by result: created, replayed, or rejected by admission.",
            submissions.clone(),
        );
        // 1: the store was just opened and recovered, writes included.
        let store_ready = Gauge::default();
        store_ready.set(1);
        registry.register(
            "broker_store_ready",
            "Whether the store would take a write (room on its disk, its write lock; as /readyz checks it) when these metrics were scraped: 1 or 0.",
            store_ready.clone(),
        );
        let fairness = Fairness::new(settings.fairness).map_err(BrokerError::Settings)?;
        fairness.register(&mut registry);
        let budget = ByteBudget::new(settings.buffered_bytes);
        budget.register(&mut registry);
        let decision_budget =
            ByteBudget::new(api::operator::decisions::decision_room(&settings.fairness));
        decision_budget.register_as(
            &mut registry,
            "broker_decision_bytes",
            "operator decision bodies being read (a room of their own, apart from the agents' \
             buffered bytes)",
        );
        let body_metrics = listener::BodyMetrics::default();
        body_metrics.register(&mut registry);
        let retention = Arc::new(Retention::new(settings.retention.clone(), &mut registry));
        match settings.retention.keep {
            Keep::Forever => tracing::warn!(
                "retention is forever: terminal operations are never deleted and the store grows \
                 without bound"
            ),
            Keep::For(keep) => tracing::info!(
                retention = %humantime::format_duration(keep),
                "terminal operations retire after the retention; a replay after it is new work"
            ),
        }
        let event_streams = EventStreams::new(settings.event_streams);
        event_streams.register(&mut registry, db.event_bell().written());
        let (stop, shutdown) = watch::channel(false);
        let core = Arc::new(Core {
            admission,
            shadow,
            db,
            live: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            executor: ExecQueue::default(),
            auth: Auth::new(&settings.secrets, &settings.operators),
            registry,
            submissions: submission_counters,
            store_ready,
            keys,
            key_locks: Arc::default(),
            counts_gate: Arc::new(tokio::sync::RwLock::new(())),
            uploading: Mutex::new(HashMap::new()),
            drift,
            fleet_drift,
            shutdown: shutdown.clone(),
            waits: Waits::default(),
            fairness,
            budget,
            decision_budget,
            pending_timeout: settings.pending_timeout,
            operator_decisions,
            expiries: PendingExpiries::default(),
            event_streams,
            adopting: tokio::sync::Mutex::new(()),
        });
        let summary = restore(&core, recovered).await;
        match drift::check(&core).await {
            Ok(report) if report.is_clean() => {}
            Ok(report) => {
                tracing::warn!(
                    drift = report.total(),
                    "restored counts differ from the store"
                )
            }
            Err(err) => tracing::warn!(error = %err, "start-up drift check failed"),
        }
        if let Some(shadow) = &core.shadow {
            restore_rates(shadow.engine(), created.clone(), SystemTime::now());
        }
        restore_rates(core.controller(), created, SystemTime::now());

        let membership = tokio::spawn(keep_membership(Arc::clone(&core), member));
        // Changes other replicas make to this store: waits woken, handles following their rows.
        tokio::spawn(super::fleet::follow_changes(Arc::clone(&core)));
        let executor = tokio::spawn(exec::run(Arc::clone(&core)));
        let drift = tokio::spawn(drift::watch(Arc::clone(&core), settings.drift_interval));
        let sweeper = tokio::spawn(retention::watch(
            Arc::clone(&core),
            Arc::clone(&retention),
            settings.retention.sweep_interval,
        ));
        // One connection cap for both listeners: each connection is a descriptor either way.
        let pool = listener::ConnectionPool::new(connection_cap);
        let expiry = tokio::spawn(super::expiry::run(Arc::clone(&core)));
        let server = tokio::spawn(listener::serve_counted(
            listener,
            api::agent_router(Arc::clone(&core)),
            settings.connections,
            Arc::clone(&pool),
            shutdown.clone(),
            body_metrics.clone(),
        ));
        let (operator_addr, operator_server) = operator_listener.serve(
            api::operator_router(Arc::clone(&core)),
            settings.connections,
            pool,
            shutdown.clone(),
            body_metrics,
        );
        tracing::info!(
            %addr,
            operator = %operator_addr,
            connection_cap,
            pending = summary.pending,
            approved = summary.approved,
            interrupted = summary.interrupted,
            streams = summary.streams,
            "broker started"
        );
        Ok((
            Broker {
                addr,
                operator_addr,
                core,
                stop,
                server,
                operator_server,
                executor,
                drift,
                sweeper,
                expiry,
                membership,
                retention,
            },
            summary,
        ))
    }

    /// [`Broker::start`] as one replica of several: `settings` with
    /// [`BrokerSettings::replicas`] set to `options`.
    pub async fn start_shared(
        mut settings: BrokerSettings,
        options: ReplicaOptions,
    ) -> Result<(Broker, RestoreSummary), BrokerError> {
        settings.replicas = Some(options);
        Box::pin(Broker::start(settings)).await
    }

    /// Stops serving and executing. A change already decided (a creation, decision, cancel,
    /// upload or delete in progress) runs to its end first; executing work is abandoned exactly
    /// as in a crash (it stays `executing` on disk), so a broker started on the same data dir
    /// recovers it. Returns once every
    /// task of this broker has let go of it, so the data dir's lock is released (unless the caller
    /// still holds a clone of [`Broker::database`]) and another broker may start on the dir.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.server.await;
        let _ = self.operator_server.await;
        let _ = self.executor.await;
        let _ = self.drift.await;
        let _ = self.sweeper.await;
        let _ = self.expiry.await;
        let _ = self.membership.await;
        // Connection and execution tasks see the stop and return; changes in progress (see
        // `run_to_end`) run to their end. Each holds the core until it ends. Bounded, so a stuck store call cannot hang shutdown forever.
        let deadline = std::time::Instant::now() + SHUTDOWN_GRACE;
        while Arc::strong_count(&self.core) > 1 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if Arc::strong_count(&self.core) > 1 {
            tracing::warn!("shutdown: some broker tasks are still running");
        }
        // Live work stays counted until the lease lapses (or a restart re-registers it).
        self.core.admission.shutdown().await;
    }
}

/// The operator listener, bound before anything else starts (so a bad address fails start-up
/// before the store is opened).
enum OperatorListener {
    Tcp(tokio::net::TcpListener),
    Unix(UnixSocket, std::path::PathBuf),
}

impl OperatorListener {
    async fn bind(addr: &ListenAddr) -> Result<OperatorListener, BrokerError> {
        let failed = |e| BrokerError::Bind(addr.clone(), e);
        match addr {
            ListenAddr::Tcp(tcp) => listener::bind(*tcp)
                .map(OperatorListener::Tcp)
                .map_err(failed),
            ListenAddr::Unix(path) => UnixSocket::bind(path)
                .map(|socket| OperatorListener::Unix(socket, path.clone()))
                .map_err(failed),
        }
    }

    /// Serves `app` on it; returns where it listens and the accept loop's task.
    fn serve(
        self,
        app: axum::Router,
        settings: ConnectionSettings,
        pool: Arc<ConnectionPool>,
        stop: watch::Receiver<bool>,
        metrics: listener::BodyMetrics,
    ) -> (ListenAddr, tokio::task::JoinHandle<()>) {
        match self {
            OperatorListener::Tcp(tcp) => {
                let addr = tcp
                    .local_addr()
                    .map(ListenAddr::Tcp)
                    .unwrap_or_else(|_| ListenAddr::Tcp(([127, 0, 0, 1], 0).into()));
                let task = listener::serve_counted(tcp, app, settings, pool, stop, metrics);
                (addr, tokio::spawn(task))
            }
            OperatorListener::Unix(socket, path) => {
                let task = listener::serve_counted(socket, app, settings, pool, stop, metrics);
                (ListenAddr::Unix(path), tokio::spawn(task))
            }
        }
    }
}

/// Puts what the store holds back under the controller: live operations (approved ones queued
/// for execution) and stored streams.
async fn restore(core: &Arc<Core>, recovered: store::Recovered) -> RestoreSummary {
    let mut summary = RestoreSummary {
        interrupted: recovered.interrupted.len(),
        ..RestoreSummary::default()
    };
    super::operations::log_interrupted(
        &recovered.interrupted,
        "the broker stopped while it executed",
    );
    let (records, restoring) = super::operations::to_count_again(recovered.live, "not restored");
    let restored = core.admission.restore(restoring).await;
    for state in core.make_live(records, restored.operations, "not restored") {
        match state {
            OperationState::Approved => summary.approved += 1,
            _ => summary.pending += 1,
        }
    }
    if let Some(replica) = core.admission.replica() {
        match restored.deferred {
            None => tracing::info!(
                replica,
                restored = summary.pending + summary.approved,
                "registered with redis"
            ),
            Some(err) => tracing::warn!(
                replica,
                restored = summary.pending + summary.approved,
                error = %err,
                "redis does not answer: new submissions are answered 503 admission_unavailable \
                 until it does, then this replica registers"
            ),
        }
    }
    let mut known = std::collections::HashSet::new();
    for stream in recovered.streams {
        let Ok(identity) = Identity::new(&stream.client_id) else {
            continue;
        };
        let object = core.controller().restore_storage(
            &identity,
            unyolo_admission::engine::Store::Stream,
            stream.size,
        );
        known.insert(stream.id.clone());
        core.stored_streams().insert(stream.id, object);
        summary.streams += 1;
    }
    // Bodies written but never recorded (a crash between the two) hold nothing; remove them.
    if let Ok(entries) = std::fs::read_dir(core.db.streams_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !known.contains(&name) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    summary
}

/// Rebuilds each client's rate bucket from the creation times of its operations created within
/// the largest window (`created`, read at start-up), as of `now`, so a restart never hands out a
/// fresh burst. It costs no write per admission: the operation's row is the record. What a restart
/// cannot know: tokens spent by admissions whose operation was never created (the store failed
/// after admission, or the process died in between); those come back early.
fn restore_rates(controller: &Controller, created: Vec<(String, SystemTime)>, now: SystemTime) {
    let admissions = created.len();
    let mut ages: HashMap<String, Vec<Duration>> = HashMap::new();
    for (client, at) in created {
        // A creation time after now (the wall clock stepped back) counts as just now.
        let age = now.duration_since(at).unwrap_or(Duration::ZERO);
        ages.entry(client).or_default().push(age);
    }
    let clients = ages.len();
    for (client, ages) in ages {
        if let Ok(identity) = Identity::new(&client) {
            controller.restore_rate(&identity, ages);
        }
    }
    tracing::info!(
        admissions,
        clients,
        "rate buckets rebuilt from recent operations"
    );
}

/// How long a replica's membership of its store lasts unrenewed; renewed every third of it.
const MEMBERSHIP_LEASE: Duration = Duration::from_secs(10);

/// The name this broker holds its membership of the store under: its replica name when it
/// shares admission, else an id made once for its data dir (`replica-id`), so a restart on the
/// same dir is the same member and another broker on another dir is not.
fn membership_name(settings: &BrokerSettings) -> Result<String, BrokerError> {
    if let Some(options) = &settings.replicas {
        return Ok(options.replica.clone());
    }
    if settings.store.is_none() {
        // A SQLite store is its data dir's alone (the dir's lock says so): no one to meet.
        return Ok(String::from("this-process"));
    }
    let path = settings.data_dir.join(REPLICA_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(BrokerError::Io(format!(
                "cannot read {}: {e}",
                path.display()
            )));
        }
    }
    let id = unyolo_admission::admission::random_id("solo");
    std::fs::create_dir_all(&settings.data_dir)
        .and_then(|()| std::fs::write(&path, format!("{id}\n")))
        .map_err(|e| BrokerError::Io(format!("cannot write {}: {e}", path.display())))?;
    Ok(id)
}

/// The file in the data dir naming this broker's membership of a shared store when it has no
/// replica name.
pub const REPLICA_ID_FILE: &str = "replica-id";

/// Joins the replicas serving `db` as `member`, or says why this broker must not serve it:
/// another replica's membership is live and this one does not share admission with it (each
/// would count alone and admit past every limit). Replicas sharing admission through Redis
/// serve one store together.
async fn join_the_store(
    db: &dyn DurableStore,
    member: &str,
    shares_admission: bool,
) -> Result<(), BrokerError> {
    let others = db.join_fleet(member, MEMBERSHIP_LEASE).await?;
    if others.is_empty() || shares_admission {
        if !others.is_empty() {
            tracing::info!(replicas = %others.join(", "), "joined the replicas serving this store");
        }
        return Ok(());
    }
    let named = others.join(", ");
    Err(BrokerError::Settings(format!(
        "another replica ({named}) is serving this store, and this one has no --redis: \
         replicas on one store must share admission through Redis (--redis, --replica), or \
         each would count alone and admit past every limit"
    )))
}

/// Renews `member`'s membership of the store every third of its lease until shutdown, taking
/// over the work of replicas whose membership lapsed on the way (`fleet::take_over`) and letting
/// go of its own work another replica took over (`fleet::let_go_of_taken`), then gives
/// the membership up, so a broker started next on the store need not wait for the lease to lapse.
async fn keep_membership(core: Arc<Core>, member: String) {
    let db = Arc::clone(&core.db);
    let mut shutdown = core.shutdown.clone();
    let every = MEMBERSHIP_LEASE / 3;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.wait_for(|stop| *stop) => break,
        }
        if let Err(err) = db.renew_membership(&member, MEMBERSHIP_LEASE).await {
            tracing::warn!(error = %err, "the store membership could not be renewed; retrying");
            continue;
        }
        if db.is_shared()
            && let Err(err) = super::fleet::take_over(&core, MEMBERSHIP_LEASE).await
        {
            tracing::warn!(error = %err, "the work of lapsed replicas could not be taken over; retrying");
        }
        if db.is_shared()
            && let Err(err) = super::fleet::let_go_of_taken(&core).await
        {
            tracing::warn!(error = %err, "the work taken over from this replica could not be let go yet; retrying");
        }
    }
    if let Err(err) = db.leave_fleet(&member).await {
        tracing::warn!(error = %err, "the store membership could not be given up; it lapses");
    }
}
