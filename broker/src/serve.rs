//! `admission serve`: resolve the secrets and the quota file, start the broker, reload on
//! `SIGHUP`, stop on `SIGINT`/`SIGTERM`.
//!
//! With no secrets given, a client `default` and an operator `operator` are generated once into
//! the data dir (mode 0600) and reused on every later start; their paths are printed, never their
//! contents. A data dir an earlier release wrote holds a one-line operator secret file
//! (`operator-secret`) instead: it is read as operator `operator` when its secret meets today's
//! rules (at least 32 bytes, which every generated one does).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::{Broker, BrokerSettings, ConnectionSettings, Keep, ListenAddr, RetentionSettings};
use unyolo_admission::config::secrets::AGENT_CLIENT_SECRET_BYTES;
use unyolo_admission::config::{Operators, Secrets};
use unyolo_admission::{Config, StorageCaps};

/// The generated client secrets file's name in the data dir.
pub const GENERATED_SECRETS: &str = "client-secrets";
/// The generated operator secrets file's name in the data dir.
pub const GENERATED_OPERATOR_SECRETS: &str = "operator-secrets";
/// The one-line operator secret file earlier releases generated in the data dir; read as
/// operator [`DEFAULT_OPERATOR`] when no [`GENERATED_OPERATOR_SECRETS`] is there.
pub const LEGACY_OPERATOR_SECRET: &str = "operator-secret";
/// The name of the operator generated (or read from a [`LEGACY_OPERATOR_SECRET`]).
pub const DEFAULT_OPERATOR: &str = "operator";

/// The Prometheus rule file that fits this broker's metrics, in the source tree.
pub const RULES_FILE: &str = "deploy/prometheus/admission.rules.yml";
/// The Grafana dashboard for this broker's metrics, in the source tree.
pub const DASHBOARD_FILE: &str = "deploy/grafana/admission.json";

/// What `deploy/` holds, built into the binary so an installed one, with no source tree, can
/// write it out (`admission kit --out DIR`): the rules ([`RULES_FILE`]), their `promtool` tests
/// and the dashboard ([`DASHBOARD_FILE`]), each by its path under `deploy/`.
pub const KIT: [(&str, &str); 3] = [
    (
        "prometheus/admission.rules.yml",
        include_str!("../deploy/prometheus/admission.rules.yml"),
    ),
    (
        "prometheus/tests/admission.rules.test.yml",
        include_str!("../deploy/prometheus/tests/admission.rules.test.yml"),
    ),
    (
        "grafana/admission.json",
        include_str!("../deploy/grafana/admission.json"),
    ),
];

/// Writes [`KIT`] under `out` as it lies under `deploy/` (creating `out` and the folders in it),
/// and returns the paths written. Writes nothing when `out` or a folder in it is not a directory,
/// or, unless `force`, when one of the files is already there.
pub fn write_kit(out: &Path, force: bool) -> Result<Vec<PathBuf>, String> {
    let files: Vec<(PathBuf, &str)> = KIT
        .iter()
        .map(|&(name, contents)| (out.join(name), contents))
        .collect();
    for (path, _) in &files {
        let mut folders = path.ancestors().skip(1).take_while(|a| a.starts_with(out));
        if let Some(folder) = folders.find(|a| a.exists() && !a.is_dir()) {
            return Err(format!(
                "{} is not a directory; nothing was written",
                folder.display()
            ));
        }
        if path.is_dir() {
            return Err(format!(
                "{} is a directory; nothing was written",
                path.display()
            ));
        }
        if path.exists() && !force {
            return Err(format!(
                "{} exists; nothing was written (--force overwrites)",
                path.display()
            ));
        }
    }
    for (path, contents) in &files {
        if let Some(folder) = path.parent() {
            std::fs::create_dir_all(folder)
                .map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
        }
        std::fs::write(path, contents)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(files.into_iter().map(|(path, _)| path).collect())
}

/// The flags of `admission serve`.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Where agents connect.
    pub listen: SocketAddr,
    /// Where operators connect.
    pub operator_listen: ListenAddr,
    /// The data dir.
    pub data_dir: PathBuf,
    /// A client secrets file; generated in the data dir when absent.
    pub secrets: Option<PathBuf>,
    /// An operator secrets file; generated in the data dir when absent.
    pub operator_secrets: Option<PathBuf>,
    /// The quota file, re-read on `SIGHUP`; the defaults when absent.
    pub admission_config: Option<PathBuf>,
    /// A shadow quota file (`--shadow-config`), re-read with the quota file on `SIGHUP`: every
    /// submission is judged against it too, never changing the real decision.
    pub shadow_config: Option<PathBuf>,
    /// The broker's name, shown as every operation's `broker`.
    pub broker_name: String,
    /// Header, body and idle timeouts and the connection cap.
    pub connections: ConnectionSettings,
    /// How long terminal operations are kept (`--retention`).
    pub retention: Keep,
    /// Where operations live (`--store`): `None` for a SQLite file in the data dir.
    pub store: Option<crate::store::StoreLocation>,
    /// One replica of several sharing admission through Redis (`--redis URL --replica NAME`);
    /// `None`: the in-process controller alone.
    pub redis: Option<unyolo_admission::admission::ReplicaOptions>,
    /// Each client's share of requests in flight (`--client-requests`) and the exempt reserve
    /// (`--exempt-reserved`).
    pub fairness: crate::fairness::FairnessConfig,
    /// The most bytes of request bodies held buffered at once (`--buffered-bytes`).
    pub buffered_bytes: usize,
    /// How long a request may stay pending before it expires (`--pending-timeout`; not zero).
    pub pending_timeout: std::time::Duration,
}

/// Runs the broker until `SIGINT` or `SIGTERM`. Prints `listening on ADDR` once it serves.
pub fn run(options: ServeOptions) -> Result<(), String> {
    // Before anything is created: the shadow file's path, size and readability (its contents
    // are judged below, once the identities are known).
    if let Some(path) = &options.shadow_config {
        unyolo_admission::config::read_quota_file(path)
            .map_err(|e| format!("--shadow-config: {e}"))?;
    }
    std::fs::create_dir_all(&options.data_dir)
        .map_err(|e| format!("cannot create {}: {e}", options.data_dir.display()))?;
    if let Some(problem) = options.connections.problem() {
        return Err(problem);
    }
    if let Some(problem) = options.fairness.problem() {
        return Err(format!("fairness: {problem}"));
    }
    if options.pending_timeout.is_zero() {
        return Err(
            "--pending-timeout must be above zero (a request would expire as it is made)"
                .to_owned(),
        );
    }
    let secrets_path = match &options.secrets {
        Some(path) => path.clone(),
        None => {
            let path = options.data_dir.join(GENERATED_SECRETS);
            ensure_secret_file(&path, |secret| format!("default = {secret}\n"))?;
            println!("client secrets: {}", path.display());
            path
        }
    };
    let secrets = Secrets::from_path(&secrets_path).map_err(|e| format!("secrets file {e}"))?;
    if secrets.is_empty() {
        return Err(format!(
            "secrets file {}: no client; give at least one `name = secret` line",
            secrets_path.display()
        ));
    }
    let (operators, operator_path) = operators(&options)?;
    if let Some((line, client)) = operators.sharing_with(&secrets) {
        return Err(format!(
            "operator secrets {}: line {line}: the secret is also the secret of client `{client}` \
             in {}; that client could decide its own requests, so give the operator a secret of \
             its own",
            operator_path.display(),
            secrets_path.display()
        ));
    }
    let identities: Vec<_> = secrets.identities().cloned().collect();
    let config = match &options.admission_config {
        Some(path) => Config::from_path(path, identities.clone()).map_err(|e| e.to_string())?,
        None => Config::defaults(identities.clone()),
    };
    for warning in config.warnings() {
        eprintln!("warning: {warning}");
    }
    let shadow = match &options.shadow_config {
        Some(path) => Some(
            Config::from_path(path, identities.clone())
                .map_err(|e| format!("--shadow-config: {e}"))?,
        ),
        None => None,
    };
    for warning in shadow.iter().flat_map(Config::warnings) {
        eprintln!("warning: --shadow-config: {warning}");
    }
    // Said once the broker serves (a start that fails says only why it failed).
    let short_secrets: Vec<String> = secrets
        .shorter_than_agents_accept()
        .map(|(client, bytes)| {
            format!(
                "warning: secrets file {}: client `{client}`'s secret is {bytes} bytes; unYOLO's \
                 agent clients refuse a credential shorter than {AGENT_CLIENT_SECRET_BYTES} \
                 bytes, so give it a longer one",
                secrets_path.display()
            )
        })
        .collect();
    if options.retention == Keep::Forever {
        eprintln!(
            "warning: --retention forever: terminal operations are never deleted; the store grows \
             without bound"
        );
    }
    init_tracing();
    let settings = BrokerSettings {
        config,
        shadow,
        storage_caps: StorageCaps::default(),
        broker_name: options.broker_name.clone(),
        connections: options.connections,
        fairness: options.fairness,
        buffered_bytes: options.buffered_bytes,
        pending_timeout: options.pending_timeout,
        retention: RetentionSettings {
            keep: options.retention,
            ..RetentionSettings::default()
        },
        operator_listen: options.operator_listen.clone(),
        ..BrokerSettings::new(options.listen, options.data_dir.clone(), secrets, operators)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let mut settings = settings;
    settings.replicas = options.redis;
    settings.store = options.store;
    let files = ConfigFiles {
        admission: options.admission_config,
        shadow: options.shadow_config,
    };
    runtime.block_on(serve(settings, files, short_secrets))
}

/// The files `SIGHUP` re-reads: the quota file and the shadow quota file.
struct ConfigFiles {
    admission: Option<PathBuf>,
    shadow: Option<PathBuf>,
}

async fn serve(
    settings: BrokerSettings,
    files: ConfigFiles,
    warnings: Vec<String>,
) -> Result<(), String> {
    use tokio::signal::unix::{SignalKind, signal};
    // Each listened to from before the broker starts until it stops, so none is missed while
    // the broker starts or a reload runs.
    let mut hangup = signal(SignalKind::hangup()).map_err(|e| e.to_string())?;
    let mut terminate = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let data_dir = settings.data_dir.clone();
    if let Some(store) = &settings.store {
        println!("store: {store}");
    }
    if let Some(options) = &settings.replicas {
        println!(
            "replica: {} (admission shared through {})",
            options.replica,
            options.url_redacted()
        );
    }
    let (broker, restored) = Broker::start(settings).await.map_err(|e| e.to_string())?;
    for warning in warnings {
        eprintln!("{warning}");
    }
    println!("data: {}", data_dir.display());
    println!(
        "restored: {} pending, {} approved, {} interrupted, {} streams",
        restored.pending, restored.approved, restored.interrupted, restored.streams
    );
    // Before "listening on": whoever waits for that line may stop reading there.
    let operator_addr = broker.operator_addr();
    let metrics_url = match operator_addr {
        ListenAddr::Tcp(addr) => format!("http://{addr}/metrics"),
        ListenAddr::Unix(path) => format!("/metrics on the socket {}", path.display()),
    };
    println!("metrics: {metrics_url} (Authorization: Bearer <operator secret>)");
    println!("rules for these metrics: {RULES_FILE} (dashboard: {DASHBOARD_FILE})");
    println!("  (no source tree? `admission kit --out DIR` writes both)");
    println!("operators on {operator_addr}");
    println!("listening on {}", broker.local_addr());
    let _ = std::io::stdout().flush();
    loop {
        tokio::select! {
            _ = hangup.recv() => {
                match &files.admission {
                    Some(path) => {
                        let _ = broker.reload_from_path(path);
                    }
                    None => tracing::warn!("SIGHUP: no --admission-config to reload"),
                }
                // Each file on its own: an invalid one leaves its old limits in force, whatever
                // the other's fate.
                if let Some(path) = &files.shadow {
                    let _ = broker.reload_shadow_from_path(path);
                }
            }
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    tracing::info!("shutting down");
    broker.shutdown().await;
    Ok(())
}

/// The operators and the file they came from: `--operator-secrets`, else the data dir's
/// generated file (created with an operator `operator` if missing), else an earlier release's
/// one-line file there, read as operator `operator`. Prints which.
fn operators(options: &ServeOptions) -> Result<(Operators, PathBuf), String> {
    let read = |path: &Path| match Operators::from_path(path) {
        Ok(operators) if operators.is_empty() => Err(format!(
            "operator secrets {}: no operator; give at least one `name = secret` line",
            path.display()
        )),
        Ok(operators) => Ok(operators),
        Err(e) => Err(format!("operator secrets {e}")),
    };
    if let Some(path) = &options.operator_secrets {
        return Ok((read(path)?, path.clone()));
    }
    let generated = options.data_dir.join(GENERATED_OPERATOR_SECRETS);
    let legacy = options.data_dir.join(LEGACY_OPERATOR_SECRET);
    if !generated.exists() && legacy.exists() {
        let operators = Operators::from_legacy_path(&legacy, DEFAULT_OPERATOR).map_err(|e| {
            format!(
                "operator secret {e} (an earlier release's one-line file, read as operator \
                 `{DEFAULT_OPERATOR}`; write {} with `name = secret` lines instead)",
                generated.display()
            )
        })?;
        println!(
            "operator secrets: {} (an earlier release's one-line file, read as operator `{DEFAULT_OPERATOR}`)",
            legacy.display()
        );
        return Ok((operators, legacy));
    }
    ensure_secret_file(&generated, |secret| {
        format!("{DEFAULT_OPERATOR} = {secret}\n")
    })?;
    println!("operator secrets: {}", generated.display());
    Ok((read(&generated)?, generated))
}

/// Logs to stderr, one structured line per event; `RUST_LOG` filters (default `info`).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Creates `path` (mode 0600) holding `contents(new secret)` unless it exists. The file appears
/// whole or not at all: written and synced under a temporary name, then linked into place (a
/// link never replaces a file another `serve` made meanwhile), so no crash or full disk leaves an
/// empty secrets file behind to be read as one with no secret.
fn ensure_secret_file(path: &Path, contents: impl FnOnce(&str) -> String) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    if path.exists() {
        return Ok(());
    }
    let name = path.file_name().map_or_else(
        || "secrets".into(),
        |name| name.to_string_lossy().into_owned(),
    );
    let temporary = path.with_file_name(format!(".{name}.{}", super::core::new_id("new")));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)?;
        file.write_all(contents(&super::core::new_id("sk")).as_bytes())?;
        file.sync_all()?;
        match std::fs::hard_link(&temporary, path) {
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            linked => linked,
        }
    })();
    let _ = std::fs::remove_file(&temporary);
    written.map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    if let Some(dir) = path.parent()
        && let Ok(dir) = std::fs::File::open(dir)
    {
        let _ = dir.sync_all();
    }
    Ok(())
}
