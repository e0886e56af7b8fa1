//! A complete broker embedding the admission controller, in which a client hanging up can never
//! leave the counts and the store disagreeing: `cargo run --example axum_broker -- SECRETS_FILE
//! [QUOTA_FILE]` (`name = secret` lines; `operator` decides approvals; `kill -HUP` reloads both).
//! One of several replicas: the same, with `ADMISSION_REDIS_URL=redis://127.0.0.1:6379`,
//! `ADMISSION_REPLICA=r1` and `ADMISSION_REPLICAS=r1,r2` (every replica's name, this one
//! included) in the environment — nothing else changes but the 503 answer. Without
//! `ADMISSION_REPLICAS`, at the deployment's first start and whenever Redis forgets it, no
//! replica admits for one lease period (10 s; 503 `admission_unavailable`); with it, admissions
//! resume as soon as every replica listed has registered again.
//!
//! At start-up it puts its live rows back under admission, spends again each client's rate
//! tokens of the last day's creations (a restart never hands out a fresh burst), and gives the
//! admission a recovery source: replicated, if Redis forgets the deployment, its store gives
//! back every key and those creations, so a retried key is never a second operation.
//!
//! Each mutating handler only authenticates, validates and reads until it *decides*; from there
//! the whole change runs in [`run_to_end`], so permits and operation handles never live in a
//! handler's future (the crate docs' "In an async broker" says what a dropped future does).
//!
//! One client cannot take the broker's own capacity either: the routes sit behind the library's
//! `FairnessLayer` (each client at most 64 units in flight, a submission costing 2; the
//! operator's decisions and metrics exempt, with a reserve of their own; a client's cancel exempt
//! up to its share), which answers 429 `client_request_limit` past a client's share.

use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::{Arc, Mutex, RwLock};
use std::{collections::HashMap, net::SocketAddr, path::PathBuf, time::Duration};

use axum::body::Bytes;
use axum::extract::{Extension, Json, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};
use unyolo_admission::OperationState::{self, Approved, Canceled, Denied, Executing, Pending};
use unyolo_admission::admission::{KeyRecord, RecoverySource, SourceFuture};
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::prometheus_client::{encoding::text::encode, registry::Registry};
use unyolo_admission::{Admission, AdmitError, CancelOutcome, Config, Controller, NotStarted};
use unyolo_admission::{OperationHandle, ReplicaOptions, RestoredOperation, Unavailable};
use unyolo_admission_broker::fairness::{Class, Fairness, FairnessConfig, FairnessLayer};

/// What the broker starts from.
pub struct Settings {
    pub listen: SocketAddr,
    pub db_path: PathBuf,
    pub secrets_path: PathBuf,
    pub quota_path: Option<PathBuf>,
    /// Extra latency on each write after start-up (a slow disk; the test hangs up mid-write).
    pub store_delay: Duration,
    /// Shared admission with other replicas (a Redis URL and this replica's name), or `None`.
    pub replicas: Option<ReplicaOptions>,
}

/// One live operation: its lifecycle handle, and a lock that keeps each transition and its store
/// write together, so two decisions racing are written in the order they were made.
struct Live {
    handle: OperationHandle,
    lock: tokio::sync::Mutex<()>,
}

pub struct App {
    pub admission: Admission,
    secrets: RwLock<Secrets>,
    settings: Settings,
    db: Arc<Mutex<Connection>>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    key_locks: Vec<Arc<tokio::sync::Mutex<()>>>,
    registry: Registry,
}

/// A handler's answer; refusals are `Err`, so `?` returns them.
type Answer = Result<Response, Response>;

fn reply(status: u16, body: Value) -> Response {
    (StatusCode::from_u16(status).expect("a status"), Json(body)).into_response()
}

fn error(status: u16, code: &str, message: &str) -> Response {
    reply(status, json!({"error": {"code": code, "message": message}}))
}

/// Why a request names no client: 401 without a bearer token, 403 for one no client has.
enum Unauthenticated {
    NoToken,
    UnknownToken,
}

impl From<Unauthenticated> for Response {
    fn from(denied: Unauthenticated) -> Response {
        match denied {
            Unauthenticated::NoToken => error(401, "authentication_failed", "No bearer token."),
            Unauthenticated::UnknownToken => {
                error(403, "authentication_failed", "Unknown bearer token.")
            }
        }
    }
}

fn operation(status: u16, id: &str, state: OperationState) -> Response {
    reply(status, json!({"id": id, "state": state.as_str()}))
}

/// No permit, as HTTP: a refusal's status and stable code, and `Retry-After` unless retrying
/// cannot help; with replicas also 503 (Redis cannot decide now) and a key used elsewhere.
fn refused(err: AdmitError) -> Response {
    let refusal = match err {
        AdmitError::Refused(refused) => refused.refusal,
        AdmitError::Unavailable(u) => {
            let retry_after = [(header::RETRY_AFTER, u.retry_after_secs())];
            return (retry_after, error(503, Unavailable::CODE, "Retry.")).into_response();
        }
        AdmitError::Replay { .. } => return error(409, "key_elsewhere", "On another replica."),
    };
    let (status, code) = (refusal.http_status(), refusal.code.as_str());
    let secs = refusal.retry_after_header();
    let retry_after = secs.map(|secs| [(header::RETRY_AFTER, secs)]);
    (retry_after, error(status, code, refusal.message())).into_response()
}

/// Runs `work` on a task of its own and waits for it. Dropped with its handler (the client hung
/// up), this stops waiting but the work runs on: dropping a `JoinHandle` does not cancel its task.
async fn run_to_end<T: Send + 'static>(work: impl Future<Output = T> + Send + 'static) -> T {
    tokio::spawn(work).await.expect("detached work")
}

/// Now, in milliseconds since the Unix epoch (what the store records creations in).
fn unix_ms() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl App {
    /// Runs `f` on the store off the async threads; `slow` adds the configured write latency.
    async fn store<T: Send + 'static>(
        &self,
        slow: bool,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> rusqlite::Result<T> {
        let (db, delay) = (Arc::clone(&self.db), self.settings.store_delay);
        let work = move || {
            std::thread::sleep(if slow { delay } else { Duration::ZERO });
            f(&db.lock().unwrap())
        };
        tokio::task::spawn_blocking(work).await.expect("store task")
    }

    /// The client whose bearer token this is (`Secrets::identify` compares in constant time).
    fn authenticate(&self, headers: &HeaderMap) -> Result<Identity, Unauthenticated> {
        let value = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        // The scheme is case-insensitive (RFC 9110); spaces around the token are not part of it.
        let token = value
            .and_then(|v| v.split_at_checked(7))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|(_, token)| token.trim_ascii())
            .filter(|token| !token.is_empty());
        let token = token.ok_or(Unauthenticated::NoToken)?;
        let known = self.secrets.read().unwrap().identify(token).cloned();
        known.ok_or(Unauthenticated::UnknownToken)
    }

    /// The client the fairness layer classified the request as (its classifier already compared
    /// the token with every secret, once), or the token looked up now if it named none: the
    /// handler answers 401 or 403 from that.
    fn client_of(
        &self,
        class: Option<&Class>,
        headers: &HeaderMap,
    ) -> Result<Identity, Unauthenticated> {
        match class {
            Some(Class::Client { key, .. } | Class::ExemptClient { key }) => {
                Identity::new(key).map_err(|_| Unauthenticated::UnknownToken)
            }
            _ => self.authenticate(headers),
        }
    }

    /// What a request is to the fairness layer. Only the operator's requests (its decisions and
    /// its metrics scrape) are exempt; a client's cancel is exempt up to its share and then its
    /// own; a submission costs its client 2 units and anything else it sends 1; a request
    /// naming no client shares the unkeyed share. So no client, and no one without a
    /// secret, can take the room kept for the operator by sending to a path that is not theirs.
    /// The classifier looks the client up (constant time) but never answers: the handler still
    /// says 401 or 403.
    pub fn classify(&self, path: &str, headers: &HeaderMap) -> Class {
        let submission = path == "/operations";
        let cost = if submission { 2 } else { 1 };
        let cancel = path
            .strip_prefix("/operations/")
            .and_then(|rest| rest.strip_suffix("/cancel"))
            .is_some_and(|id| !id.is_empty() && !id.contains('/'));
        match self.authenticate(headers).ok() {
            None => Class::Unkeyed { cost },
            Some(who) if who.as_str() == "operator" => Class::Exempt,
            Some(client) if cancel => Class::ExemptClient {
                key: client.as_str().into(),
            },
            Some(client) => Class::client(client.as_str(), cost),
        }
    }

    /// Keeps a handle where no request owns it; approved work goes to the executor.
    fn track(self: &Arc<Self>, id: String, handle: OperationHandle) {
        let (approved, lock) = (handle.state() == Approved, Default::default());
        let live = Arc::new(Live { handle, lock });
        self.live
            .lock()
            .unwrap()
            .insert(id.clone(), Arc::clone(&live));
        if approved {
            tokio::spawn(execute(Arc::clone(self), id, live));
        }
    }

    /// Writes the move to `to` its caller made (holding the operation's lock) to the store. The
    /// controller has moved already, so the store must follow: a failed write (another process
    /// holding the write lock, a full disk) is retried until it lands, never given up on. Giving
    /// up would leave the handle and the row disagreeing, and an execution slot held for good.
    async fn record(&self, id: &str, to: OperationState) {
        let sql = "UPDATE operations SET state = ?1 WHERE id = ?2";
        let mut pause = Duration::from_millis(50);
        loop {
            let i = id.to_owned();
            let write = self.store(true, move |db| db.execute(sql, params![to.as_str(), i]));
            match write.await {
                Ok(_) => break,
                Err(err) => eprintln!("cannot record {id} as {}: {err}; retrying", to.as_str()),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
        if to.is_terminal() {
            self.live.lock().unwrap().remove(id);
        }
    }
}

/// Opens the store, restores live operations, and serves until the process ends.
pub async fn start(settings: Settings) -> (SocketAddr, Arc<App>) {
    let secrets = Secrets::from_path(&settings.secrets_path).expect("secrets file");
    let quota = settings.quota_path.as_deref();
    let config = Config::from_optional_path(quota, secrets.identities().cloned()).expect("quota");
    let admission = Admission::new(Controller::new(config), settings.replicas.clone());
    let admission = admission.expect("replica options");
    let mut registry = Registry::default();
    admission.register_metrics(&mut registry);
    let fairness = Fairness::new(FairnessConfig::default()).expect("fairness numbers");
    fairness.register(&mut registry);
    let listener = tokio::net::TcpListener::bind(settings.listen).await;
    let listener = listener.expect("bind");
    let db = Connection::open(&settings.db_path).expect("store");
    let app = Arc::new(App {
        admission,
        secrets: RwLock::new(secrets),
        db: Arc::new(Mutex::new(db)),
        settings,
        live: Mutex::new(HashMap::new()),
        key_locks: (0..64).map(|_| Default::default()).collect(),
        registry,
    });
    restore(&app).await;
    tokio::spawn(reload_on_sighup(Arc::clone(&app)));
    let addr = listener.local_addr().expect("address");
    let classifier = Arc::clone(&app);
    let fair = FairnessLayer::new(fairness, move |head: &axum::http::request::Parts| {
        classifier.classify(head.uri.path(), &head.headers)
    });
    let routes = axum::Router::new()
        .route("/operations", post(submit))
        .route("/operations/{id}/{decision}", post(decide))
        .route("/metrics", get(render_metrics))
        .layer(fair)
        .with_state(Arc::clone(&app));
    tokio::spawn(async move { axum::serve(listener, routes).await.expect("serve") });
    (addr, app)
}

/// Creates the store if new and puts its live rows back under the controller's counts.
async fn restore(app: &Arc<App>) {
    // `operation` is what a replay compares; `created_ms` (Unix time) what rebuilds the rates.
    // (A store written by an older version of this example lacks both: start from a new file.)
    let schema = "CREATE TABLE IF NOT EXISTS operations (id TEXT PRIMARY KEY,
        client TEXT NOT NULL, key TEXT NOT NULL, operation TEXT NOT NULL,
        created_ms INTEGER NOT NULL, state TEXT NOT NULL, UNIQUE (client, key));
        -- Work found executing may or may not have run; it must never run twice: it ends failed.
        UPDATE operations SET state = 'failed' WHERE state = 'executing';";
    let sql = "SELECT id, client, state FROM operations WHERE state IN ('pending', 'approved')";
    let read = app.store(false, move |db| {
        db.execute_batch(schema)?;
        let mut query = db.prepare(sql)?;
        let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        let rows = rows.collect::<rusqlite::Result<Vec<(String, String, String)>>>()?;
        // A day: the longest window a quota file can give, whatever a reload makes it later.
        Ok((rows, created_within(db, Duration::from_secs(86_400))?))
    });
    let (rows, made) = read.await.expect("store read");
    // A restart never hands out a fresh burst: each client's bucket spends again the tokens of
    // what it created within its window (replicated, Redis keeps the buckets itself).
    let mut ages: HashMap<Identity, Vec<Duration>> = HashMap::new();
    for (client, age) in made {
        ages.entry(client).or_default().push(age);
    }
    for (client, ages) in ages {
        app.admission.controller().restore_rate(client, ages);
    }
    // Replicated: if Redis forgets the deployment, this store gives back its keys and rates.
    let source = StoreSource(Arc::clone(&app.db));
    app.admission.set_recovery_source(Arc::new(source));
    let rows = rows.into_iter().map(|(id, client, state)| {
        let state = OperationState::parse(&state).expect("a stored state");
        RestoredOperation {
            id,
            identity: client.parse().expect("a client"),
            state,
        }
    });
    let rows: Vec<RestoredOperation> = rows.collect();
    // Replicated, this also replaces what an earlier run under this replica's name held.
    let restored = app.admission.restore(rows.clone()).await;
    for (row, handle) in rows.into_iter().zip(restored.operations) {
        app.track(row.id, handle.expect("a live row"));
    }
}

/// Every operation created within `window`, in any state: its client and its age.
fn created_within(
    db: &Connection,
    window: Duration,
) -> rusqlite::Result<Vec<(Identity, Duration)>> {
    let sql = "SELECT client, created_ms FROM operations WHERE created_ms > ?1";
    let now = unix_ms();
    let since = now.saturating_sub(i64::try_from(window.as_millis()).unwrap_or(i64::MAX));
    let mut query = db.prepare(sql)?;
    let rows = query.query_map([since], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let rows = rows.collect::<rusqlite::Result<Vec<(String, i64)>>>()?;
    let age = |ms: i64| Duration::from_millis(u64::try_from(now - ms).unwrap_or(0));
    let rows = rows
        .into_iter()
        .filter_map(|(c, ms)| Some((c.parse().ok()?, age(ms))));
    Ok(rows.collect())
}

/// What a replica's store gives Redis again after Redis forgot the deployment (a restart
/// without persistence, a flush): every key's operation, so a retried key is never a second
/// operation on another replica, and its recent creations, so no bucket comes back full.
struct StoreSource(Arc<Mutex<Connection>>);

impl StoreSource {
    fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> SourceFuture<'_, T> {
        let db = Arc::clone(&self.0);
        let read = tokio::task::spawn_blocking(move || f(&db.lock().unwrap()));
        Box::pin(async move {
            read.await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        })
    }
}

impl RecoverySource for StoreSource {
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>> {
        self.read(|db| {
            let mut query = db.prepare("SELECT client, key, id FROM operations")?;
            let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            let rows = rows.collect::<rusqlite::Result<Vec<(String, String, String)>>>()?;
            let record = |(client, key, operation): (String, _, _)| {
                let client = client.parse().ok()?;
                Some(KeyRecord {
                    client,
                    key,
                    operation,
                })
            };
            Ok(rows.into_iter().filter_map(record).collect())
        })
    }

    /// `within`: the longest rate window in force now (a reload may have lengthened it).
    fn recent_admissions(&self, within: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>> {
        self.read(move |db| created_within(db, within))
    }
}

async fn reload_on_sighup(app: Arc<App>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup()).expect("SIGHUP handler");
    while hangups.recv().await.is_some() {
        let Ok(secrets) = Secrets::from_path(&app.settings.secrets_path) else {
            app.admission.controller().record_failed_reload();
            continue;
        };
        // New secrets may add clients: their tokens work once the controller has taken them.
        let quota = app.settings.quota_path.as_deref();
        let ids = secrets.identities().cloned();
        if app.admission.reload_from_optional_path(quota, ids).is_ok() {
            *app.secrets.write().unwrap() = secrets;
        }
    }
}

async fn submit(
    State(app): State<Arc<App>>,
    class: Option<Extension<Class>>,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    // Authenticate, then validate (the body is read as JSON only for a known client): no
    // quota, no write.
    let client = app.client_of(class.as_deref(), &headers)?;
    let body: Value = serde_json::from_slice(&body)
        .map_err(|_| error(400, "invalid_request", "The body is not JSON."))?;
    let (name, state) = match body["operation"].as_str() {
        Some("demo.run") => ("demo.run", Approved),
        Some("demo.request") => ("demo.request", Pending), // Waits for the operator's approval.
        _ => return Err(error(400, "operation_not_registered", "Unknown.")),
    };
    let key = body["idempotency_key"].as_str().map(str::to_owned);
    let key = key.ok_or_else(|| error(400, "invalid_request", "No idempotency_key."))?;
    // Replay under the key's lock, so concurrent duplicates create exactly one operation (without
    // it, the loser of the race would hold a permit it must refund). A hangup while waiting for
    // the lock or the read drops the guard: nothing changed.
    let stripe = BuildHasherDefault::<DefaultHasher>::default().hash_one((&client, &key));
    let lock = &app.key_locks[stripe as usize % app.key_locks.len()];
    let guard = Arc::clone(lock).lock_owned().await;
    let sql = "SELECT id, state, operation FROM operations WHERE client = ?1 AND key = ?2";
    let (c, k) = (client.to_string(), key.clone());
    let row = |r: &rusqlite::Row| -> rusqlite::Result<(String, String, String)> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    };
    let find = move |db: &Connection| db.query_row(sql, params![c, k], row).optional();
    match app.store(false, find).await.expect("store read") {
        // The same request again (a lost answer, retried): what it made, in any state.
        Some((id, state, operation)) if operation == name => {
            return Ok(reply(200, json!({"id": id, "state": state})));
        }
        // The key names another request: never answer one request with another's operation.
        Some(_) => return Err(error(409, "idempotency_conflict", "Key used for another.")),
        None => {}
    }
    // Decided: admit, insert, commit (or refund) and hand-off run to their end, still under the
    // key's lock, so a retry with the same key waits for them and then replays.
    run_to_end(async move {
        let _guard = guard;
        let admitted = app
            .admission
            .admit(&client, state == Pending, Some(&key))
            .await;
        let permit = admitted.map_err(refused)?;
        let id = permit.id().to_string(); // Made by the admission: unique across replicas.
        let sql = "INSERT INTO operations (id, client, key, operation, created_ms, state)
            VALUES (?1, ?2, ?3, ?4, ?5, ?6)";
        let (i, created) = (id.clone(), unix_ms());
        let insert = app.store(true, move |db| {
            let row = params![i, client.as_str(), key, name, created, state.as_str()];
            db.execute(sql, row)
        });
        if insert.await.is_err() {
            // Our failure, not the client's: `refund` gives the rate token back too (a dropped
            // permit returns only the slots, and counts as an embedder bug).
            permit.refund().await;
            return Err(error(503, "store_unavailable", "Retry."));
        }
        app.track(id.clone(), permit.commit());
        Ok(operation(202, &id, state))
    })
    .await
}

/// `approve` and `deny` are the operator's decisions; `cancel`, the operation's own client's.
async fn decide(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((id, decision)): Path<(String, String)>,
) -> Answer {
    let who = app.authenticate(&headers)?;
    let live = app.live.lock().unwrap().get(&id).cloned();
    let live = live.ok_or_else(|| error(404, "not_found", "Not live."))?;
    let to = match decision.as_str() {
        "approve" if who.as_str() == "operator" => Approved,
        "deny" if who.as_str() == "operator" => Denied,
        "cancel" if live.handle.identity() == &who => Canceled,
        _ => return Err(error(403, "forbidden", "Not yours to decide.")),
    };
    // Decided: the transition and its store write run to their end together.
    run_to_end(async move {
        let _order = live.lock.lock().await;
        let moved = match to {
            Approved => live.handle.approve().await,
            Denied => live.handle.deny().await,
            _ => match live.handle.cancel().await {
                Ok(CancelOutcome::Canceled { .. }) => Ok(()),
                // Already terminal: the store has it right; write nothing over it.
                Ok(CancelOutcome::AlreadyTerminal(now)) => return Ok(operation(200, &id, now)),
                Err(executing) => Err(executing),
            },
        };
        moved.map_err(|e| error(409, "conflict", &e.to_string()))?;
        app.record(&id, to).await;
        if to == Approved {
            tokio::spawn(execute(Arc::clone(&app), id.clone(), Arc::clone(&live)));
        }
        Ok(operation(200, &id, to))
    })
    .await
}

/// Runs one approved operation on a task of its own: no client's hangup cancels it.
async fn execute(app: Arc<App>, id: String, live: Arc<Live>) {
    // The start and its store write under the operation's lock, after any decision queued on it
    // (a cancel sent while the approval was being stored is decided first): a cancel never
    // finds it executing while the store says approved. No lock while waiting for a slot.
    loop {
        let freed = live.handle.slot_freed();
        let order = live.lock.lock().await;
        match live.handle.try_start().await {
            Ok(()) => {
                app.record(&id, Executing).await;
                break;
            }
            Err(NotStarted::NotApproved(_)) => return, // Canceled (or denied) meanwhile.
            Err(NotStarted::Saturated(_) | NotStarted::Unavailable(_)) => {
                drop(order);
                freed.await;
            }
        }
    }
    // The work (a stand-in), begun only once `executing` is stored: a crash never runs it twice.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _order = live.lock.lock().await;
    live.handle.succeed().await.expect("ours to end");
    app.record(&id, OperationState::Succeeded).await;
}

/// The controller's metrics in the embedder's own registry, beside any of its own.
async fn render_metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Answer {
    if app.authenticate(&headers)?.as_str() != "operator" {
        return Err(error(403, "forbidden", "Operators only."));
    }
    let mut text = String::new();
    encode(&mut text, &app.registry).expect("encode");
    let content_type = "application/openmetrics-text; version=1.0.0";
    Ok(([(header::CONTENT_TYPE, content_type)], text).into_response())
}

/// Shared admission as the environment asks for it, read through `var`: `None` without
/// `ADMISSION_REDIS_URL`; else replica `ADMISSION_REPLICA` of the deployment whose replicas are
/// `ADMISSION_REPLICAS` (comma-separated; none listed if unset).
pub fn replicas_from_env(var: impl Fn(&str) -> Option<String>) -> Option<ReplicaOptions> {
    let url = var("ADMISSION_REDIS_URL")?;
    let name = var("ADMISSION_REPLICA").expect("ADMISSION_REPLICA");
    let mut options = ReplicaOptions::new(url, name);
    options.replicas = var("ADMISSION_REPLICAS")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect();
    Some(options)
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let settings = Settings {
        listen: "127.0.0.1:8080".parse().expect("address"),
        db_path: "axum-broker.sqlite".into(),
        secrets_path: args.next().expect("usage: SECRETS_FILE [QUOTA_FILE]"),
        quota_path: args.next(),
        store_delay: Duration::ZERO,
        replicas: replicas_from_env(|name| std::env::var(name).ok()),
    };
    let (addr, _app) = start(settings).await;
    println!("listening on {addr}");
    std::future::pending::<()>().await;
}
