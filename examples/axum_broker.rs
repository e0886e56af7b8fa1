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
    live: Mutex<HashMap<String, Arc<Live>>>,
    key_locks: Vec<Arc<tokio::sync::Mutex<()>>>,
    registry: Registry,
}

type Reply = (StatusCode, Json<Value>);

fn error(status: StatusCode, code: &str, message: &str) -> Reply {
    (status, Json(json!({"error": {"code": code, "message": message}})))
}

impl App {
    /// Runs `f` on the store off the async threads; `slow` adds the configured write latency.
    async fn store<T: Send + 'static>(
        &self,
        slow: bool,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> rusqlite::Result<T> {
        let (db, delay) = (Arc::clone(&self.db), self.settings.store_delay);
        tokio::task::spawn_blocking(move || {
            if slow {
                std::thread::sleep(delay);
            }
            f(&db.lock().unwrap())
        })
        .await
        .expect("store task")
    }

    async fn set_state(&self, id: &str, state: OperationState) {
        let id = id.to_owned();
        self.store(true, move |db| {
            let sql = "UPDATE operations SET state = ?1 WHERE id = ?2";
            db.execute(sql, params![state.as_str(), id])
        })
        .await
        .expect("store write");
    }

    /// Authenticates a bearer token against the secrets in force (constant time).
    fn identify(&self, headers: &HeaderMap) -> Result<Identity, Reply> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .ok_or_else(|| error(StatusCode::UNAUTHORIZED, "authentication_failed", "No token."))?;
        let secrets = Arc::clone(&self.secrets.read().unwrap());
        secrets.identify(token).cloned().ok_or_else(|| {
            error(StatusCode::FORBIDDEN, "authentication_failed", "Unknown token.")
        })
    }

    fn operator(&self, headers: &HeaderMap) -> Result<(), Reply> {
        match self.identify(headers)?.as_str() {
            "operator" => Ok(()),
            _ => Err(error(StatusCode::FORBIDDEN, "authentication_failed", "Operators only.")),
        }
    }

    fn key_lock(&self, client: &str, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hashed = BuildHasherDefault::<DefaultHasher>::default().hash_one((client, key));
        let stripe = hashed as usize % self.key_locks.len();
        Arc::clone(&self.key_locks[stripe])
    }

    /// The store's count of operations in each live state, for comparison with the controller.
    pub async fn stored_counts(&self) -> HashMap<String, u64> {
        self.store(false, |db| {
            let mut q = db.prepare("SELECT state, COUNT(*) FROM operations GROUP BY state")?;
            let rows = q.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64)))?;
            rows.collect()
        })
        .await
        .expect("store read")
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
        "CREATE TABLE IF NOT EXISTS operations (id TEXT PRIMARY KEY, client TEXT NOT NULL,
         key TEXT NOT NULL, duration_ms INTEGER NOT NULL, state TEXT NOT NULL,
         UNIQUE (client, key));
         -- Work that was executing when the process stopped may or may not have happened: it
         -- must never run twice, so it ends failed and is not restored.
         UPDATE operations SET state = 'failed' WHERE state = 'executing';",
    )
    .expect("schema");
    let mut registry = Registry::default();
    metrics::register(&mut registry, &controller);
    let listener = tokio::net::TcpListener::bind(settings.listen).await.expect("bind");
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
    let rows: Vec<(String, String, i64, String)> = app
        .store(false, |db| {
            let sql = "SELECT id, client, duration_ms, state FROM operations
                       WHERE state IN ('pending', 'approved')";
            let mut q = db.prepare(sql)?;
            let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            rows.collect()
        })
        .await
        .expect("store read");
    for (id, client, duration_ms, state) in rows {
        let state = OperationState::parse(&state).expect("a stored state");
        let handle = app.controller.restore(&client, state).expect("a live state");
        let duration = Duration::from_millis(duration_ms as u64);
        let live = Arc::new(Live { client, handle, duration, lock: Default::default() });
        app.live.lock().unwrap().insert(id.clone(), Arc::clone(&live));
        if state == OperationState::Approved {
            tokio::spawn(execute(Arc::clone(app), id, live));
        }
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
        let quota = app.settings.quota_path.as_deref();
        let identities = secrets.identities().cloned().collect::<Vec<_>>();
        if app.controller.reload_from_optional_path(quota, identities).is_ok() {
            *app.secrets.write().unwrap() = Arc::new(secrets);
        }
    }
}

async fn submit(State(app): State<Arc<App>>, headers: HeaderMap, body: Json<Value>) -> Response {
    submit_inner(app, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn submit_inner(app: Arc<App>, headers: HeaderMap, body: Json<Value>) -> Result<Response, Reply> {
    // Authenticate and validate: no quota, no write.
    let client = app.identify(&headers)?;
    let (Some(key), Some(kind)) = (body["idempotency_key"].as_str(), body["operation"].as_str())
    else {
        return Err(error(StatusCode::BAD_REQUEST, "invalid_request", "Missing fields."));
    };
    let needs_approval = match kind {
        "demo.run" => false,
        "demo.request" => true,
        _ => return Err(error(StatusCode::BAD_REQUEST, "operation_not_registered", "Unknown.")),
    };
    let duration_ms = body["duration_ms"].as_u64().unwrap_or(0).min(600_000);
    // Replay under the key's lock, so concurrent duplicates create exactly one operation. A
    // hangup while waiting for the lock or the read drops the guard: nothing changed.
    let guard = app.key_lock(client.as_str(), key).lock_owned().await;
    let (c, k) = (client.to_string(), key.to_owned());
    let existing = app
        .store(false, move |db| {
            let sql = "SELECT id, state FROM operations WHERE client = ?1 AND key = ?2";
            db.query_row(sql, params![c, k], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .optional()
        })
        .await
        .expect("store read");
    if let Some((id, state)) = existing {
        return Ok((StatusCode::OK, Json(json!({"id": id, "state": state}))).into_response());
    }
    // Decided: admit, insert, commit (or refund) and hand off run detached, still under the key's
    // lock. A permit never crosses an `.await` of the handler.
    let (app2, key) = (Arc::clone(&app), key.to_owned());
    let work = tokio::spawn(async move {
        let _guard = guard;
        let permit = match app2.controller.admit(&client, needs_approval) {
            Ok(permit) => permit,
            Err(refusal) => {
                let status = StatusCode::from_u16(refusal.http_status()).expect("a status");
                let body = error(status, refusal.code.as_str(), refusal.message());
                return match refusal.retry_after_header() {
                    Some(secs) => ([(header::RETRY_AFTER, secs.to_string())], body).into_response(),
                    None => body.into_response(), // 403: retrying cannot help.
                };
            }
        };
        let id = format!("op_{:016x}", rand_id());
        let state = if needs_approval { "pending" } else { "approved" };
        let row = (id.clone(), client.to_string(), key, duration_ms as i64, state);
        let inserted = app2
            .store(true, move |db| {
                let sql = "INSERT INTO operations VALUES (?1, ?2, ?3, ?4, ?5)";
                db.execute(sql, params![row.0, row.1, row.2, row.3, row.4])
            })
            .await;
        if inserted.is_err() {
            permit.refund(); // Our fault, not the client's: give the token back too.
            let reply = error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "Retry.");
            return reply.into_response();
        }
        let duration = Duration::from_millis(duration_ms);
        let handle = permit.commit();
        let live = Arc::new(Live { client: client.to_string(), handle, duration, lock: Default::default() });
        app2.live.lock().unwrap().insert(id.clone(), Arc::clone(&live));
        if !needs_approval {
            tokio::spawn(execute(Arc::clone(&app2), id.clone(), live));
        }
        (StatusCode::ACCEPTED, Json(json!({"id": id, "state": state}))).into_response()
    });
    Ok(work.await.expect("submission task"))
}

fn live_op(app: &App, id: &str) -> Option<Arc<Live>> {
    app.live.lock().unwrap().get(id).cloned()
}

async fn cancel(State(app): State<Arc<App>>, headers: HeaderMap, Path(id): Path<String>) -> Reply {
    let client = match app.identify(&headers) {
        Ok(client) => client,
        Err(reply) => return reply,
    };
    let Some(live) = live_op(&app, &id).filter(|l| l.client == client.as_str()) else {
        return error(StatusCode::NOT_FOUND, "not_found", "No such live operation.");
    };
    // Decided: the transition and its store write run to their end together.
    tokio::spawn(async move {
        let _order = live.lock.lock().await;
        match live.handle.cancel() {
            Ok(CancelOutcome::Canceled { .. }) => {
                app.set_state(&id, OperationState::Canceled).await;
                app.live.lock().unwrap().remove(&id);
                (StatusCode::OK, Json(json!({"id": id, "state": "canceled"})))
            }
            // Already terminal: the store has it right; write nothing.
            Ok(CancelOutcome::AlreadyTerminal(state)) => {
                (StatusCode::OK, Json(json!({"id": id, "state": state.as_str()})))
            }
            Err(_) => error(StatusCode::CONFLICT, "operation_not_cancelable", "It is executing."),
        }
    })
    .await
    .expect("cancel task")
}

async fn decide(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((id, decision)): Path<(String, String)>,
) -> Reply {
    if let Err(reply) = app.operator(&headers) {
        return reply;
    }
    let Some(live) = live_op(&app, &id) else {
        return error(StatusCode::NOT_FOUND, "not_found", "No such live operation.");
    };
    tokio::spawn(async move {
        let _order = live.lock.lock().await;
        let (outcome, to) = match decision.as_str() {
            "approve" => (live.handle.approve(), OperationState::Approved),
            _ => (live.handle.deny(), OperationState::Denied),
        };
        if outcome.is_err() {
            return error(StatusCode::CONFLICT, "request_not_pending", "Not pending.");
        }
        app.set_state(&id, to).await;
        if to == OperationState::Approved {
            tokio::spawn(execute(Arc::clone(&app), id.clone(), Arc::clone(&live)));
        } else {
            app.live.lock().unwrap().remove(&id);
        }
        (StatusCode::OK, Json(json!({"id": id, "state": to.as_str()})))
    })
    .await
    .expect("decision task")
}

/// Runs one approved operation: waits for an execution slot (no polling), records each step.
async fn execute(app: Arc<App>, id: String, live: Arc<Live>) {
    if live.handle.start().await.is_err() {
        return; // Canceled or expired while queued: whoever did it wrote the store.
    }
    {
        let _order = live.lock.lock().await;
        app.set_state(&id, OperationState::Executing).await;
    }
    tokio::time::sleep(live.duration).await; // The work itself.
    // The store first: should the process die in between, the row is not run again.
    let _order = live.lock.lock().await;
    app.set_state(&id, OperationState::Succeeded).await;
    live.handle.succeed().expect("only the executor finishes executing work");
    app.live.lock().unwrap().remove(&id);
}

async fn render_metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(reply) = app.operator(&headers) {
        return reply.into_response();
    }
    let mut text = String::new();
    encode(&mut text, &app.registry).expect("encode");
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0")], text).into_response()
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    RandomState::new().hash_one(nanos.map(|d| d.as_nanos()).unwrap_or(0))
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let secrets_path = args.next().expect("usage: axum_broker SECRETS_FILE [QUOTA_FILE]");
    let settings = Settings {
        listen: "127.0.0.1:8080".parse().expect("address"),
        db_path: "axum-broker.sqlite".into(),
        secrets_path,
        quota_path: args.next(),
        store_delay: Duration::ZERO,
    };
    let (addr, _app) = start(settings).await;
    println!("listening on {addr}");
    std::future::pending::<()>().await;
}
