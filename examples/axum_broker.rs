//! A complete broker embedding the admission controller, written so that a client hanging up can
//! never leave the counts and the store disagreeing. Run it with
//! `cargo run --example axum_broker -- SECRETS_FILE [QUOTA_FILE]` (the secrets file holds
//! `name = secret` lines; the client named `operator` decides approvals; `kill -HUP` reloads both).
//!
//! The rule it follows: a handler future is dropped at whatever `.await` it is parked on when its
//! client hangs up. So each mutating handler only authenticates, validates and reads until it
//! *decides*; from there the whole change runs in `tokio::spawn`ed work the handler merely awaits
//! (dropping a `JoinHandle` does not cancel its task). `Permit`s and `Operation`s never live in a
//! handler's future.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::prometheus_client::{encoding::text::encode, registry::Registry};
use unyolo_admission::{CancelOutcome, Config, Controller, Operation, OperationState, metrics};

/// What the broker starts from.
pub struct Settings {
    pub listen: SocketAddr,
    pub db_path: PathBuf,
    pub secrets_path: PathBuf,
    pub quota_path: Option<PathBuf>,
    /// Extra latency on every store write (a slow disk; the test uses it to hang up mid-write).
    pub store_delay: Duration,
}

/// One live operation: its lifecycle handle, and a lock that keeps each transition and its store
/// write together, so two decisions racing are written in the order they were made.
struct Live {
    client: String,
    handle: Operation,
    duration: Duration,
    lock: tokio::sync::Mutex<()>,
}

pub struct App {
    pub controller: Controller,
    secrets: RwLock<Arc<Secrets>>,
    settings: Settings,
    db: Arc<Mutex<Connection>>,
    live: Mutex<HashMap<i64, Arc<Live>>>,
    key_locks: Vec<Arc<tokio::sync::Mutex<()>>>,
    registry: Registry,
}

type Reply = (StatusCode, Json<Value>);

fn reply(status: u16, body: Value) -> Reply {
    (StatusCode::from_u16(status).expect("a status"), Json(body))
}

fn error(status: u16, code: &str, message: &str) -> Reply {
    reply(status, json!({"error": {"code": code, "message": message}}))
}

fn operation(status: u16, id: i64, state: &str) -> Reply {
    reply(status, json!({"id": id, "state": state}))
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

    async fn set_state(&self, id: i64, state: OperationState) {
        let sql = "UPDATE operations SET state = ?1 WHERE id = ?2";
        let write = self.store(true, move |db| db.execute(sql, params![state.as_str(), id]));
        write.await.expect("store write");
    }

    /// The client whose bearer token this is (`Secrets::identify` compares in constant time).
    fn identify(&self, headers: &HeaderMap) -> Result<Identity, Reply> {
        let bearer = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        let Some(token) = bearer.and_then(|v| v.strip_prefix(b"Bearer ")) else {
            return Err(error(401, "authentication_failed", "No token."));
        };
        let secrets = Arc::clone(&self.secrets.read().unwrap());
        let identity = secrets.identify(token).cloned();
        identity.ok_or_else(|| error(403, "authentication_failed", "Unknown token."))
    }

    fn operator(&self, headers: &HeaderMap) -> Result<(), Reply> {
        match self.identify(headers)?.as_str() {
            "operator" => Ok(()),
            _ => Err(error(403, "authentication_failed", "Operators only.")),
        }
    }

    fn key_lock(&self, client: &str, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hashed = BuildHasherDefault::<DefaultHasher>::default().hash_one((client, key));
        Arc::clone(&self.key_locks[hashed as usize % self.key_locks.len()])
    }

    fn live(&self, id: i64) -> Option<Arc<Live>> {
        self.live.lock().unwrap().get(&id).cloned()
    }

    /// Keeps a committed or restored handle where no request owns it; approved work goes to the
    /// executor.
    fn track(self: &Arc<Self>, id: i64, client: String, handle: Operation, duration_ms: u64) {
        let approved = handle.state() == OperationState::Approved;
        let duration = Duration::from_millis(duration_ms);
        let live = Arc::new(Live {
            client,
            handle,
            duration,
            lock: Default::default(),
        });
        self.live.lock().unwrap().insert(id, Arc::clone(&live));
        if approved {
            tokio::spawn(execute(Arc::clone(self), id, live));
        }
    }

    /// The store's count of operations in each state, for comparison with the controller.
    pub async fn stored_counts(&self) -> HashMap<String, u64> {
        let sql = "SELECT state, COUNT(*) FROM operations GROUP BY state";
        let read = self.store(false, move |db| {
            let mut query = db.prepare(sql)?;
            let rows = query.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64)))?;
            rows.collect()
        });
        read.await.expect("store read")
    }
}

/// Opens the store, restores live operations, and serves until the process ends.
pub async fn start(settings: Settings) -> (SocketAddr, Arc<App>) {
    let secrets = Secrets::from_path(&settings.secrets_path).expect("secrets file");
    let quota = settings.quota_path.as_deref();
    let config = Config::from_optional_path(quota, secrets.identities().cloned()).expect("quota");
    let controller = Controller::new(config);
    let db = Connection::open(&settings.db_path).expect("store");
    db.execute_batch(
        "CREATE TABLE IF NOT EXISTS operations (id INTEGER PRIMARY KEY, client TEXT NOT NULL,
         key TEXT NOT NULL, duration_ms INTEGER NOT NULL, state TEXT NOT NULL,
         UNIQUE (client, key));
         -- Work that was executing when the process stopped may or may not have happened: it
         -- must never run twice, so it ends failed and is not restored.
         UPDATE operations SET state = 'failed' WHERE state = 'executing';",
    )
    .expect("schema");
    let mut registry = Registry::default();
    metrics::register(&mut registry, &controller);
    let listener = tokio::net::TcpListener::bind(settings.listen).await;
    let listener = listener.expect("bind");
    let app = Arc::new(App {
        controller,
        secrets: RwLock::new(Arc::new(secrets)),
        settings,
        db: Arc::new(Mutex::new(db)),
        live: Mutex::new(HashMap::new()),
        key_locks: (0..64).map(|_| Default::default()).collect(),
        registry,
    });
    restore(&app).await;
    tokio::spawn(reload_on_sighup(Arc::clone(&app)));
    let addr = listener.local_addr().expect("address");
    let routes = Router::new()
        .route("/operations", post(submit))
        .route("/operations/{id}/cancel", post(cancel))
        .route("/requests/{id}/{decision}", post(decide))
        .route("/metrics", get(render_metrics))
        .with_state(Arc::clone(&app));
    tokio::spawn(async move { axum::serve(listener, routes).await.expect("serve") });
    (addr, app)
}

/// Puts every live row back under the controller's counts; approved ones go to the executor.
async fn restore(app: &Arc<App>) {
    let sql = "SELECT id, client, duration_ms, state FROM operations
               WHERE state IN ('pending', 'approved')";
    let read = app.store(false, move |db| {
        let mut query = db.prepare(sql)?;
        let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
        rows.collect::<rusqlite::Result<Vec<(i64, String, u64, String)>>>()
    });
    for (id, client, duration_ms, state) in read.await.expect("store read") {
        let state = OperationState::parse(&state).expect("a stored state");
        let handle = app.controller.restore(&client, state);
        app.track(
            id,
            client.clone(),
            handle.expect("a live state"),
            duration_ms,
        );
    }
}

async fn reload_on_sighup(app: Arc<App>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup()).expect("SIGHUP handler");
    while hangups.recv().await.is_some() {
        // New secrets may add clients: the controller takes the new identities with the limits.
        let Ok(secrets) = Secrets::from_path(&app.settings.secrets_path) else {
            app.controller.record_failed_reload();
            continue;
        };
        let (quota, identities) = (app.settings.quota_path.as_deref(), secrets.identities());
        let controller = &app.controller;
        if controller
            .reload_from_optional_path(quota, identities.cloned())
            .is_ok()
        {
            *app.secrets.write().unwrap() = Arc::new(secrets);
        }
    }
}

async fn submit(State(app): State<Arc<App>>, headers: HeaderMap, body: Json<Value>) -> Response {
    // Authenticate and validate: no quota, no write.
    let client = match app.identify(&headers) {
        Ok(client) => client,
        Err(reply) => return reply.into_response(),
    };
    let (key, kind) = (body["idempotency_key"].as_str(), body["operation"].as_str());
    let needs_approval = match kind {
        Some("demo.run") => false,
        Some("demo.request") => true,
        _ => return error(400, "operation_not_registered", "Unknown.").into_response(),
    };
    let Some(key) = key.map(str::to_owned) else {
        return error(400, "invalid_request", "No idempotency_key.").into_response();
    };
    let duration_ms = body["duration_ms"].as_u64().unwrap_or(0).min(600_000);
    // Replay under the key's lock, so concurrent duplicates create exactly one operation. A
    // hangup while waiting for the lock or the read drops the guard: nothing changed.
    let guard = app.key_lock(client.as_str(), &key).lock_owned().await;
    let sql = "SELECT id, state FROM operations WHERE client = ?1 AND key = ?2";
    let (c, k) = (client.to_string(), key.clone());
    let row = |r: &rusqlite::Row| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?));
    let read = app.store(false, move |db| {
        db.query_row(sql, params![c, k], row).optional()
    });
    if let Some((id, state)) = read.await.expect("store read") {
        return operation(200, id, &state).into_response();
    }
    // Decided: admit, insert, commit (or refund) and hand-off run detached, still under the
    // key's lock. No permit is ever held across an `.await` of the handler.
    let work = tokio::spawn(async move {
        let _guard = guard;
        let permit = match app.controller.admit(&client, needs_approval) {
            Ok(permit) => permit,
            Err(refusal) => {
                let body = error(
                    refusal.http_status(),
                    refusal.code.as_str(),
                    refusal.message(),
                );
                return match refusal.retry_after_header() {
                    Some(secs) => ([(header::RETRY_AFTER, secs)], body).into_response(),
                    None => body.into_response(), // 403: retrying cannot help.
                };
            }
        };
        let state = if needs_approval {
            OperationState::Pending
        } else {
            OperationState::Approved
        };
        let sql =
            "INSERT INTO operations (client, key, duration_ms, state) VALUES (?1, ?2, ?3, ?4)";
        let row = (client.to_string(), key, duration_ms, state.as_str());
        let insert = move |db: &Connection| {
            db.execute(sql, params![row.0, row.1, row.2, row.3])?;
            Ok(db.last_insert_rowid())
        };
        let Ok(id) = app.store(true, insert).await else {
            permit.refund(); // Our fault, not the client's: give the token back too.
            return error(503, "store_unavailable", "Retry.").into_response();
        };
        app.track(id, client.to_string(), permit.commit(), duration_ms);
        operation(202, id, state.as_str()).into_response()
    });
    work.await.expect("submission task")
}

async fn cancel(State(app): State<Arc<App>>, headers: HeaderMap, Path(id): Path<i64>) -> Reply {
    let client = match app.identify(&headers) {
        Ok(client) => client,
        Err(reply) => return reply,
    };
    let Some(live) = app.live(id).filter(|live| live.client == client.as_str()) else {
        return error(404, "not_found", "No such live operation.");
    };
    // Decided: the transition and its store write run to their end together.
    let work = tokio::spawn(async move {
        let _order = live.lock.lock().await;
        match live.handle.cancel() {
            Ok(CancelOutcome::Canceled { .. }) => {
                app.set_state(id, OperationState::Canceled).await;
                app.live.lock().unwrap().remove(&id);
                operation(200, id, "canceled")
            }
            // Already terminal: the store has it right; write nothing over it.
            Ok(CancelOutcome::AlreadyTerminal(state)) => operation(200, id, state.as_str()),
            Err(_) => error(409, "operation_not_cancelable", "Executing."),
        }
    });
    work.await.expect("cancel task")
}

async fn decide(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((id, decision)): Path<(i64, String)>,
) -> Reply {
    if let Err(reply) = app.operator(&headers) {
        return reply;
    }
    let Some(live) = app.live(id) else {
        return error(404, "not_found", "No such live operation.");
    };
    let work = tokio::spawn(async move {
        let _order = live.lock.lock().await;
        let (decided, to) = match decision.as_str() {
            "approve" => (live.handle.approve(), OperationState::Approved),
            _ => (live.handle.deny(), OperationState::Denied),
        };
        if decided.is_err() {
            return error(409, "request_not_pending", "Not pending.");
        }
        app.set_state(id, to).await;
        if to == OperationState::Approved {
            tokio::spawn(execute(Arc::clone(&app), id, Arc::clone(&live)));
        } else {
            app.live.lock().unwrap().remove(&id);
        }
        operation(200, id, to.as_str())
    });
    work.await.expect("decision task")
}

/// Runs one approved operation: waits for an execution slot (no polling), records each step.
async fn execute(app: Arc<App>, id: i64, live: Arc<Live>) {
    if live.handle.start().await.is_err() {
        return; // Canceled or expired while queued: whoever did it wrote the store.
    }
    {
        let _order = live.lock.lock().await;
        app.set_state(id, OperationState::Executing).await;
    }
    tokio::time::sleep(live.duration).await; // The work itself.
    // The store first: should the process die in between, the row is not run again.
    let _order = live.lock.lock().await;
    app.set_state(id, OperationState::Succeeded).await;
    let finished = live.handle.succeed();
    finished.expect("only the executor finishes executing work");
    app.live.lock().unwrap().remove(&id);
}

/// The controller's metrics in the embedder's own registry, beside any of its own.
async fn render_metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(reply) = app.operator(&headers) {
        return reply.into_response();
    }
    let mut text = String::new();
    encode(&mut text, &app.registry).expect("encode");
    let content_type = "application/openmetrics-text; version=1.0.0";
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let usage = "usage: axum_broker SECRETS_FILE [QUOTA_FILE]";
    let settings = Settings {
        listen: "127.0.0.1:8080".parse().expect("address"),
        db_path: "axum-broker.sqlite".into(),
        secrets_path: args.next().expect(usage),
        quota_path: args.next(),
        store_delay: Duration::ZERO,
    };
    let (addr, _app) = start(settings).await;
    println!("listening on {addr}");
    std::future::pending::<()>().await;
}
