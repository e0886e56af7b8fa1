//! The `admission` command: flags in, library calls out.
//!
//! Exit codes: 0 success; 1 an invalid or unreadable file (the quota file or a secrets file), or
//! one `kit` would not or could not write; 2 a usage error (unknown flag, missing argument, a malformed name in `--identities`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use unyolo_admission::config::{Config, Identity, Pool, PoolShare, Secrets};

/// Admission control for agent brokers: check quota files, print the defaults, run the reference
/// broker and its overload drill, and write the rules and dashboard that fit its metrics.
#[derive(Parser)]
#[command(name = "admission", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a quota file against the client identities and print every client's effective
    /// limits (exit 0), or the first problem found (exit 1). With --history, replay a store's
    /// operations through the file's limits instead: exit 0 when it would refuse nothing, 3 when
    /// it would refuse something.
    Check(CheckArgs),
    /// Print the default configuration as a complete, valid quota file.
    Defaults,
    /// Run the reference broker: Agent V1 and Operator V1 over HTTP, operations in SQLite under
    /// the data dir or in PostgreSQL (--store).
    Serve(Box<ServeArgs>),
    /// Walk the overload drill against an in-process broker on loopback; exit 0 only if every
    /// step held.
    Drill(DrillArgs),
    /// Write the Prometheus rules (with their promtool tests) and the Grafana dashboard that fit
    /// the broker's metrics into a directory, laid out as under `deploy/` in the source tree.
    Kit(KitArgs),
}

/// The flags of `admission kit`.
#[derive(Args)]
struct KitArgs {
    /// The directory to write into; created when absent.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Overwrite files already there.
    #[arg(long)]
    force: bool,
}

/// The flags of `admission drill`.
#[derive(Args)]
struct DrillArgs {
    /// Walk the drill across this many in-process replicas sharing one Redis instead (at least 2).
    #[arg(long, value_name = "N")]
    replicas: Option<usize>,
    /// The Redis the replicas share; without it the drill starts its own `redis-server`.
    #[arg(long, value_name = "URL", requires = "replicas")]
    redis: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    /// Where agents connect (Agent V1).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// Where operators connect (Operator V1, /metrics, /admission/v1/drift): ADDR:PORT, or
    /// `unix:/abs/path` for a Unix socket (created mode 0600, removed on shutdown).
    #[arg(long, value_name = "ADDR", default_value = unyolo_admission_broker::DEFAULT_OPERATOR_LISTEN)]
    operator_listen: unyolo_admission_broker::ListenAddr,
    /// The data dir (the SQLite file unless --store names PostgreSQL, uploads, generated
    /// secrets).
    #[arg(long, value_name = "DIR", default_value = "./admission-data")]
    data: PathBuf,
    /// Client secrets (`name = secret` per line); generated in the data dir when absent.
    #[arg(long, value_name = "FILE")]
    secrets: Option<PathBuf>,
    /// The operators (`name = secret` per line, secrets of at least 32 bytes); generated in the
    /// data dir, with an operator `operator`, when absent.
    #[arg(long, value_name = "FILE")]
    operator_secrets: Option<PathBuf>,
    /// The quota file (absolute path), re-read on SIGHUP; the defaults when absent.
    #[arg(long, value_name = "PATH")]
    admission_config: Option<PathBuf>,
    /// A shadow quota file (absolute path, the same rules), re-read with --admission-config on
    /// SIGHUP: every submission is also judged against it, never changing the real decision
    /// (verdicts in admission_shadow_decisions_total and GET /admission/v1/shadow).
    #[arg(long, value_name = "PATH")]
    shadow_config: Option<PathBuf>,
    /// The broker's name, shown as every operation's `broker` (1 to 64 characters).
    #[arg(long, value_name = "NAME", default_value = "admission", value_parser = broker_name)]
    broker_name: String,
    /// How long a connection may take to send a request head, from when it opens or its last
    /// response was sent; an idle keep-alive connection closes after it too (e.g. `10s`).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: std::time::Duration,
    /// The longest wait for the next part of a request body (e.g. `30s`).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    body_timeout: std::time::Duration,
    /// The longest a whole request body may take, from when the broker starts reading it (e.g.
    /// `5min`); past it the body is cut off (408).
    #[arg(long, value_name = "DURATION", default_value = "5min", value_parser = humantime::parse_duration)]
    body_deadline: std::time::Duration,
    /// The least average rate of a request body after its first 2 s, in bytes a second; a slower
    /// body is cut off (408). 0 turns the minimum off.
    #[arg(long, value_name = "BYTES", default_value_t = unyolo_admission_broker::listener::DEFAULT_BODY_MIN_RATE)]
    body_min_rate: u64,
    /// The most connections open at once; derived from the open-file limit when absent.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// The most units one client's requests hold in flight (a GET, a wait or a cancel costs 1, a
    /// submission or an upload 2, a page of summaries 1 + limit/10); past it a request waits up
    /// to 1 s, then gets 429 `client_request_limit`.
    #[arg(long, value_name = "N", default_value_t = unyolo_admission_broker::fairness::FairnessConfig::default().per_client_units)]
    client_requests: u32,
    /// Units of the total (512) that only health, readiness, metrics, cancellation and operator
    /// requests may use.
    #[arg(long, value_name = "N", default_value_t = unyolo_admission_broker::fairness::FairnessConfig::default().exempt_reserved_units)]
    exempt_reserved: u32,
    /// The most bytes of request bodies the broker holds buffered at once, across every agent
    /// request (operator decisions read theirs within a room of their own, 96 KiB per
    /// --exempt-reserved unit); past it a body waits up to 1 s for room, then gets 503
    /// `body_budget_exhausted`, unread.
    #[arg(long, value_name = "BYTES", default_value_t = unyolo_admission_broker::DEFAULT_BUFFERED_BYTES)]
    buffered_bytes: usize,
    /// How long terminal operations are kept before they are deleted (e.g. `7days`, `12h`); `0`
    /// or `forever` keeps everything. A replay of a deleted operation's key is new work.
    #[arg(long, value_name = "DURATION", default_value = "7days")]
    retention: unyolo_admission_broker::Keep,
    /// How long a request that needs an operator's approval may stay pending before it expires
    /// (e.g. `5min`, `90s`); not zero. Each request's deadline is fixed when it is created
    #[arg(long, value_name = "DURATION", default_value = "5min", value_parser = humantime::parse_duration)]
    pending_timeout: std::time::Duration,
    /// Keep operations in this PostgreSQL database instead of a SQLite file in the data dir
    /// (a libpq URL, `sslmode` honoured; a password in it is never printed). Several hosts with
    /// `target_session_attrs=read-write` (`postgres://USER@H1:5432,H2:5432/DB?...`) follow a
    /// standby's promotion without a restart. The schema is created or migrated at start-up.
    // A plain string, parsed in `serve`: clap's own error would echo the value, password and all.
    #[arg(long, value_name = "postgres://USER@HOST:PORT/DB")]
    store: Option<String>,
    /// Share admission with other replicas through this Redis: one server
    /// (`redis://[:PASSWORD@]HOST:PORT[/DB]`), a primary found and followed through its Sentinels
    /// (`redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`), or a Cluster
    /// (`redis+cluster://HOST:PORT[,HOST:PORT...]`); a password is never printed. Needs
    /// `--replica`. Without it, this process counts alone (the in-process controller).
    #[arg(long, value_name = "URL", requires = "replica")]
    redis: Option<String>,
    /// This replica's name, unique among the replicas and stable across restarts.
    #[arg(long, value_name = "NAME", requires = "redis")]
    replica: Option<String>,
    /// Every replica of the deployment, this one included (comma-separated). At a deployment's
    /// first start and after Redis forgets it (a restart without persistence, a flush), no
    /// replica admits for one lease period unless this list names the whole fleet: then
    /// admissions resume as soon as all of them have registered. With --store, the store's
    /// membership names the fleet and this list is not needed.
    #[arg(
        long,
        value_name = "NAME,NAME,...",
        value_delimiter = ',',
        requires = "redis"
    )]
    replicas: Vec<String>,
    /// The key prefix (hash tag) of this deployment's keys in Redis.
    #[arg(
        long,
        value_name = "PREFIX",
        default_value = "admission",
        requires = "redis"
    )]
    redis_prefix: String,
    /// The most admission decisions this replica has in flight to Redis at once; past it a
    /// submission waits up to 250 ms for room, then gets 503 `admission_unavailable`.
    /// Releases, cancels and heartbeats never wait for it.
    #[arg(long, value_name = "N", default_value_t = unyolo_admission::admission::DEFAULT_DECISIONS_IN_FLIGHT, requires = "redis")]
    redis_decisions: usize,
    /// The most admission decisions one client has in flight to Redis at once on this replica
    /// (its next submission waits for its last one's answer, and a refusal then answers it from
    /// memory).
    #[arg(long, value_name = "N", default_value_t = unyolo_admission::admission::DEFAULT_CLIENT_DECISIONS_IN_FLIGHT, requires = "redis")]
    redis_client_decisions: usize,
    /// Answer an admission only once this many Redis replicas acknowledged it (`WAIT`; 0, the
    /// default, does not wait): no admission answered is lost to a failover to an acknowledging
    /// replica, at the cost of a replication round trip per admission.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "redis")]
    redis_wait_replicas: u32,
    /// Turn off answering refused clients from memory (every submission is then a Redis call).
    #[arg(long, requires = "redis")]
    no_refusal_memory: bool,
}

/// A `--broker-name` within its bounds.
fn broker_name(name: &str) -> Result<String, String> {
    unyolo_admission_broker::validate_broker_name(name).map(|()| name.to_owned())
}

#[derive(Args)]
struct CheckArgs {
    /// Client identities, comma-separated; repeatable.
    #[arg(long, value_name = "NAME,NAME,...", value_delimiter = ',')]
    identities: Vec<Identity>,
    /// A secrets file (`name = secret` per line) whose names are added to the identities.
    #[arg(long, value_name = "FILE")]
    secrets: Option<PathBuf>,
    /// Judge the file on a store's history: replay the creation, approval and end times of
    /// every operation stored in this data dir (its SQLite store, read-only: a serving broker's
    /// dir can be read) or PostgreSQL database (postgres://...), and print per client what the
    /// file would have refused, with which code and when, and the peak counts against each
    /// limit. Exit 0 when it would refuse nothing, 3 when it would refuse something.
    #[arg(long, value_name = "DATA_DIR|postgres://...")]
    history: Option<String>,
    /// The quota file: an absolute, normalized path, as a broker would be given.
    #[arg(value_name = "PATH")]
    path: PathBuf,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check(args) => check(args),
        Command::Defaults => write_out(&Config::defaults([]).to_json()),
        Command::Serve(args) => serve(*args),
        Command::Drill(args) => {
            if let Some(replicas) = args.replicas {
                return if unyolo_admission_broker::drill_replicas::run(replicas, args.redis) {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                };
            }
            if unyolo_admission_broker::drill::run() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Kit(args) => {
            match unyolo_admission_broker::serve::write_kit(&args.out, args.force) {
                Ok(written) => {
                    for path in written {
                        println!("{}", path.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("error: {err}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    use unyolo_admission_broker::serve::{ServeOptions, run};
    use unyolo_admission_broker::store::StoreLocation;
    // A usage error, as clap's are, but never echoing the value: its password stays unprinted.
    let store = match args.store.as_deref().map(StoreLocation::parse).transpose() {
        Ok(store) => store,
        Err(err) => {
            eprintln!("error: --store: {err}");
            return ExitCode::from(2);
        }
    };
    let options = ServeOptions {
        listen: args.listen,
        data_dir: args.data,
        secrets: args.secrets,
        operator_listen: args.operator_listen,
        operator_secrets: args.operator_secrets,
        admission_config: args.admission_config,
        shadow_config: args.shadow_config,
        broker_name: args.broker_name,
        connections: unyolo_admission_broker::ConnectionSettings {
            header_timeout: args.header_timeout,
            body_timeout: args.body_timeout,
            body_deadline: args.body_deadline,
            body_min_rate: args.body_min_rate,
            max_connections: args.max_connections,
            ..unyolo_admission_broker::ConnectionSettings::default()
        },
        retention: args.retention,
        store,
        redis: args.redis.map(|url| {
            let mut options =
                unyolo_admission::ReplicaOptions::new(url, args.replica.unwrap_or_default());
            options.prefix = args.redis_prefix;
            options.replicas = args.replicas;
            options.decisions_in_flight = args.redis_decisions;
            options.client_decisions_in_flight = args.redis_client_decisions;
            options.wait_replicas = args.redis_wait_replicas;
            options.refusal_memory = !args.no_refusal_memory;
            options
        }),
        fairness: unyolo_admission_broker::fairness::FairnessConfig {
            per_client_units: args.client_requests,
            exempt_reserved_units: args.exempt_reserved,
            ..unyolo_admission_broker::fairness::FairnessConfig::default()
        },
        buffered_bytes: args.buffered_bytes,
        pending_timeout: args.pending_timeout,
    };
    match run(options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

fn check(args: CheckArgs) -> ExitCode {
    let mut identities: BTreeSet<Identity> = args.identities.into_iter().collect();
    if let Some(file) = &args.secrets {
        match Secrets::from_path(file) {
            Ok(secrets) => identities.extend(secrets.identities().cloned()),
            Err(err) => {
                eprintln!("error: secrets file {err}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(store) = &args.history {
        use unyolo_admission_broker::history;
        return match history::check(store, &args.path, identities) {
            Ok(check) => match write_out(&history::render(&check)) {
                ExitCode::SUCCESS if !check.replay.refusals.is_empty() => {
                    ExitCode::from(history::EXIT_WOULD_REFUSE)
                }
                written => written,
            },
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        };
    }
    let config = match Config::from_path(&args.path, identities) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::FAILURE;
        }
    };
    for warning in config.warnings() {
        eprintln!("warning: {warning}");
    }
    write_out(&limits_table(&config))
}

/// Writes `text` to stdout: exit 0, or 1 saying why it could not be written (a full disk under
/// `admission defaults > quota.json`, a closed pipe), never a panic.
fn write_out(text: &str) -> ExitCode {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: cannot write to stdout: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Every identity's effective limits, then the global pools, as aligned columns.
fn limits_table(config: &Config) -> String {
    let header = [
        "identity",
        "requests_per_window",
        "window_seconds",
        "active",
        "pending",
        "source",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.map(str::to_owned).to_vec()];
    for (identity, limits, source) in config.effective_all() {
        rows.push(vec![
            identity.to_string(),
            limits.requests_per_window.to_string(),
            limits.window_seconds.to_string(),
            limits.active.to_string(),
            limits.pending.to_string(),
            source.to_string(),
        ]);
    }
    let mut out = columns(&rows);
    if rows.len() == 1 {
        out.push_str(
            "(no identities given: every client would be refused as client_unconfigured)\n",
        );
    }
    out.push('\n');
    out.push_str(&pools_table(config));
    out
}

/// The global pools: each one's limit and, when the file has `fair_share`, its reserve, its
/// floor and its shared part (the pool less its reserve, what the clients at or above the floor
/// divide); without one, a line saying the pools are first come, first served.
fn pools_table(config: &Config) -> String {
    let limits = config.limits();
    let share = config.fair_share();
    let mut rows: Vec<Vec<String>> = vec![match share {
        Some(_) => ["pool", "limit", "reserve", "floor", "shared"]
            .map(str::to_owned)
            .to_vec(),
        None => ["pool", "limit"].map(str::to_owned).to_vec(),
    }];
    for pool in Pool::ALL {
        let limit = match pool {
            Pool::Active => limits.global_active,
            Pool::Executing => limits.global_executing,
        };
        let mut row = vec![pool.limit_name().to_owned(), limit.to_string()];
        if let Some(share) = share {
            let PoolShare { reserve, floor } = share.pool(pool);
            row.extend([reserve, floor, limit.saturating_sub(reserve)].map(|n| n.to_string()));
        }
        rows.push(row);
    }
    let mut out = columns(&rows);
    out.push_str(match share {
        Some(_) => {
            "(fair_share: a client holding fewer than its pool's floor may take any free slot; \
             the others divide the shared part among the clients holding in the pool)\n"
        }
        None => "(no fair_share: the global pools are first come, first served)\n",
    });
    out
}

/// `rows` as aligned columns, two spaces apart, one line each.
fn columns(rows: &[Vec<String>]) -> String {
    let mut widths = vec![0; rows.iter().map(Vec::len).max().unwrap_or(0)];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, &width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
