//! A real broker started in-process on 127.0.0.1 (port 0) in a temporary data dir, and the
//! harness that talks to it over HTTP; every reply it reads is checked against the contract.

use serde_json::Value;
use unyolo_admission::config::Identity;
use unyolo_admission::{Config, Snapshot, StorageCaps};
use unyolo_admission_broker::store::StoreLocation;
use unyolo_admission_broker::{Broker, BrokerSettings, ListenAddr, RestoreSummary};

use super::contract;
use super::http::Reply;
use super::operator::Operator;
use super::postgres::PostgresServer;
use super::secrets::{operators, secrets};

/// Roomy limits: nothing binds unless a test makes it.
pub const ROOMY: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

pub fn settings(dir: &std::path::Path, limits: &str, caps: StorageCaps) -> BrokerSettings {
    let secrets = secrets();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let config = Config::from_bytes(limits.as_bytes(), identities).unwrap();
    BrokerSettings {
        config,
        storage_caps: caps,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.to_owned(),
            secrets,
            operators(),
        )
    }
}

pub struct Harness {
    pub broker: Broker,
    pub restored: RestoreSummary,
    /// The agent listener, `http://ADDR`.
    pub base: String,
    pub http: reqwest::Client,
    /// The operator (`OPERATOR`) on the operator listener.
    pub operator: Operator,
}

pub async fn start(dir: &std::path::Path, limits: &str) -> Harness {
    start_with(settings(dir, limits, StorageCaps::default())).await
}

pub async fn start_with(settings: BrokerSettings) -> Harness {
    let (broker, restored) = Broker::start(chosen_store(settings)).await.unwrap();
    Harness::of(broker, restored)
}

/// A replica sharing admission through Redis with `options`, otherwise as [`start_with`].
pub async fn start_shared(
    settings: BrokerSettings,
    options: unyolo_admission::redis::RedisOptions,
) -> Harness {
    let (broker, restored) = Broker::start_shared(chosen_store(settings), options)
        .await
        .unwrap();
    Harness::of(broker, restored)
}

/// The variable that chooses the store of every broker the harness starts with `store: None`:
/// `postgres` for a PostgreSQL database per data dir, anything else (or unset) for SQLite in the
/// data dir. CI runs the broker's suites both ways (.ci/run): one set of tests, both stores.
pub const STORE_VARIABLE: &str = "ADMISSION_TEST_STORE";

/// Whether this run puts the brokers' operations in PostgreSQL ([`STORE_VARIABLE`]).
pub fn on_postgres() -> bool {
    std::env::var(STORE_VARIABLE).is_ok_and(|v| v.eq_ignore_ascii_case("postgres"))
}

/// `true` when the test may go on: it pokes SQLite itself (opens the file, holds its lock,
/// reads its pages or plans), so under PostgreSQL it says so and the caller returns.
pub fn sqlite_only(why: &str) -> bool {
    if on_postgres() {
        eprintln!("SKIPPED under postgres: {why}");
        return false;
    }
    true
}

/// `settings` with the store this run asks for: unchanged when they name one or the run is on
/// SQLite; otherwise the PostgreSQL database of their data dir ([`store_for`]).
pub fn chosen_store(mut settings: BrokerSettings) -> BrokerSettings {
    if settings.store.is_none() {
        settings.store = store_for(&settings.data_dir);
    }
    settings
}

/// Under PostgreSQL ([`STORE_VARIABLE`]), the store of a broker whose data dir is `data`: a
/// database of this test binary's server, named after the dir and created the first time, so a
/// broker restarted on the same dir finds its operations. `None` on SQLite. Panics if the run
/// asks for PostgreSQL and it cannot be run here: testing SQLite instead would be a lie.
pub fn store_for(data: &std::path::Path) -> Option<StoreLocation> {
    if !on_postgres() {
        return None;
    }
    Some(StoreLocation::parse(&postgres_url_for(data)).unwrap())
}

/// The URL of [`store_for`] (`serve --store URL` for a test that runs the binary).
pub fn postgres_url_for(data: &std::path::Path) -> String {
    use std::sync::Mutex;
    static CREATING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    test_server().database_if_missing(&database_for(data))
}

/// Runs `sql` with `psql` in the PostgreSQL database of the broker whose data dir is `data`
/// (what a fault test reads behind the broker's back, as it opens the SQLite file on SQLite).
pub fn psql_for(data: &std::path::Path, sql: &str) -> String {
    test_server().psql(&database_for(data), sql)
}

/// One server for the whole test binary: it outlives every broker restart in a test, and its
/// watchdog stops it when the binary ends.
fn test_server() -> &'static PostgresServer {
    use std::sync::OnceLock;
    static SERVER: OnceLock<Option<PostgresServer>> = OnceLock::new();
    SERVER
        .get_or_init(PostgresServer::for_this_process)
        .as_ref()
        .unwrap_or_else(|| {
            panic!(
                "{STORE_VARIABLE}=postgres, but PostgreSQL cannot be run here (see the line \
                 above); unset it to test on SQLite"
            )
        })
}

/// The database of the broker whose data dir is `data`: the path as the test names it (the same
/// on every restart), hashed into a valid name.
fn database_for(data: &std::path::Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    data.hash(&mut hasher);
    format!("t_{:016x}", hasher.finish())
}

/// The flags of `admission serve` naming `files`, and under PostgreSQL ([`STORE_VARIABLE`])
/// `--store` with the database of their data dir ([`store_for`]).
pub fn serve_args(files: &super::serve::Files) -> Vec<String> {
    let mut args = files.args();
    if on_postgres() {
        args.extend(["--store".to_owned(), postgres_url_for(&files.data)]);
    }
    args
}

impl Harness {
    fn of(broker: Broker, restored: RestoreSummary) -> Harness {
        Harness {
            base: format!("http://{}", broker.local_addr()),
            operator: Operator::new(operator_base(&broker)),
            broker,
            restored,
            http: reqwest::Client::new(),
        }
    }

    /// The operator listener's TCP address.
    pub fn operator_addr(&self) -> std::net::SocketAddr {
        match self.broker.operator_addr() {
            ListenAddr::Tcp(addr) => *addr,
            ListenAddr::Unix(path) => panic!("the operator listens on {}", path.display()),
        }
    }

    /// An operator with `token` on this broker's operator listener.
    pub fn operator_with(&self, token: &str) -> Operator {
        Operator::with_token(self.operator.base.clone(), token)
    }

    pub async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<reqwest::Body>,
    ) -> Reply {
        let method_name = method;
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        if let Some(body) = body {
            req = req.body(body);
        }
        let reply = Reply::read(req.send().await.unwrap()).await.unwrap();
        // Every body the broker sends in these tests is checked against the contract's schema.
        contract::check_reply(method_name, path, reply.status, &reply.body);
        reply
    }

    pub async fn submit(&self, token: &str, body: &Value) -> Reply {
        self.send(
            "POST",
            "/api/agent/v1/operations",
            Some(token),
            Some(body.to_string().into()),
        )
        .await
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.send("GET", path, token, None).await
    }

    pub async fn post(&self, path: &str, token: Option<&str>) -> Reply {
        self.send("POST", path, token, None).await
    }

    pub async fn rows(&self) -> u64 {
        self.broker.database().count_operations().await.unwrap()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.broker.controller().snapshot()
    }

    /// The broker's `/metrics` (on the operator listener).
    pub async fn metrics(&self) -> String {
        self.operator.metrics().await
    }
}

/// `http://ADDR` of a broker's TCP operator listener.
pub fn operator_base(broker: &Broker) -> String {
    match broker.operator_addr() {
        ListenAddr::Tcp(addr) => format!("http://{addr}"),
        ListenAddr::Unix(path) => format!("unix:{}", path.display()),
    }
}

/// Asserts that nothing was admitted, refused, counted or spent between two snapshots. Rate
/// tokens may only have refilled (time passes between the two); a spent token still shows.
#[track_caller]
pub fn assert_unchanged(before: &Snapshot, after: &Snapshot, what: &str) {
    let mut after = after.clone();
    for (now, then) in after.clients.iter_mut().zip(&before.clients) {
        if now.tokens >= then.tokens {
            now.tokens = then.tokens;
        }
    }
    assert_eq!(&after, before, "{what}");
}
