//! A real PostgreSQL server for one test: `initdb` in a temporary directory, `postgres` on a free
//! loopback port with `fsync` on, stopped (and its files removed) when dropped. `initdb` and
//! `postgres` refuse to run as root, so as root both run as the package's `postgres` user. Tests
//! skip (and say why) only when the server cannot be run here at all.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::free_port;

/// The role every test connects as (trusted on loopback: the server is the test's own).
pub const ROLE: &str = "admission";

pub struct PostgresServer {
    child: Option<Child>,
    pub port: u16,
    bin: PathBuf,
    /// The uid and gid the server runs as (the `postgres` user when the tests run as root).
    user: Option<(u32, u32)>,
    dir: tempfile::TempDir,
}

impl PostgresServer {
    /// Starts a server, or `None` (having printed why) if PostgreSQL cannot be run here.
    pub fn start() -> Option<PostgresServer> {
        let bin = bin_dir()?;
        let user = server_user()?;
        let dir = tempfile::tempdir().expect("a temporary directory");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .expect("the server's directory is given to the postgres user");
        }
        let data = dir.path().join("data");
        let init = as_user(Command::new(bin.join("initdb")), user)
            .arg("-D")
            .arg(&data)
            .args(["-U", ROLE, "--auth=trust", "--encoding=UTF8", "--locale=C"])
            // Only initdb's own closing sync is skipped; the server runs with fsync on.
            .arg("--no-sync")
            .stdout(Stdio::null())
            .output()
            .expect("initdb runs");
        assert!(
            init.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let mut server = PostgresServer {
            child: None,
            port: 0,
            bin,
            user,
            dir,
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.run() {
                return Some(server);
            }
        }
        panic!("postgres did not start on any of five loopback ports");
    }

    /// The server the tests of this binary share while any of them runs (started by the first,
    /// stopped when the last lets it go), or `None` (having printed why) if PostgreSQL cannot
    /// be run here. Each test takes a database of its own ([`PostgresServer::database`]).
    pub fn shared() -> Option<std::sync::Arc<PostgresServer>> {
        use std::sync::{Arc, Mutex, Weak};
        static SHARED: Mutex<Weak<PostgresServer>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = shared.upgrade() {
            return Some(server);
        }
        let server = Arc::new(PostgresServer::start()?);
        *shared = Arc::downgrade(&server);
        Some(server)
    }

    /// A server for the rest of this test process, or `None` (having printed why) if PostgreSQL
    /// cannot be run here. Meant to be kept in a `static` (it is never dropped, so its files are
    /// never removed by `Drop`): a watchdog (`sh`, checking every second) stops `postgres` (fast
    /// shutdown, whatever pid its data dir names, so after a restart too) and removes its files
    /// once this process is gone, however it ended.
    // The watchdog is never waited for: it outlives this process by design (init reaps it).
    #[allow(clippy::zombie_processes)]
    pub fn for_this_process() -> Option<PostgresServer> {
        let server = PostgresServer::start()?;
        let script = r#"
            while kill -0 "$1" 2>/dev/null; do sleep 1; done
            pid=$(head -n 1 "$2/data/postmaster.pid" 2>/dev/null)
            if [ -n "$pid" ]; then
              kill -INT "$pid" 2>/dev/null
              i=0
              while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 30 ]; do sleep 1; i=$((i + 1)); done
              kill -KILL "$pid" 2>/dev/null
            fi
            rm -rf "$2"
        "#;
        Command::new("sh")
            .args(["-c", script, "postgres-watchdog"])
            .arg(std::process::id().to_string())
            .arg(server.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the watchdog of postgres starts");
        Some(server)
    }

    /// Creates the database `name` unless it exists already; its URL.
    pub fn database_if_missing(&self, name: &str) -> String {
        let exists = self.psql(
            "postgres",
            &format!("SELECT 1 FROM pg_database WHERE datname = '{name}'"),
        );
        if exists.is_empty() {
            self.psql("postgres", &format!("CREATE DATABASE \"{name}\""));
        }
        self.url(name)
    }

    /// `postgres://admission@127.0.0.1:PORT/DB`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{ROLE}@127.0.0.1:{}/{database}", self.port)
    }

    /// A fresh database of this server, named `name`, and its URL.
    pub fn database(&self, name: &str) -> String {
        self.psql("postgres", &format!("CREATE DATABASE \"{name}\""));
        self.url(name)
    }

    /// A session of its own holding the transaction-level advisory lock `key` in `database` for
    /// `seconds` (`pg_advisory_xact_lock`, then `pg_sleep`): whatever the broker does under that
    /// lock waits meanwhile. The lock goes with the session when the returned process ends.
    pub fn hold_advisory_lock(&self, database: &str, key: i64, seconds: u64) -> Child {
        let sql = format!(
            "BEGIN; SELECT pg_advisory_xact_lock({key}); SELECT pg_sleep({seconds}); COMMIT;"
        );
        Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", ROLE])
            .args(["-d", database, "-v", "ON_ERROR_STOP=1", "-At", "-c", &sql])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("psql runs")
    }

    /// [`PostgresServer::psql`], or `None` when it fails (the server away, say).
    pub fn try_psql(&self, database: &str, sql: &str) -> Option<String> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", ROLE])
            .args(["-d", database, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Runs `sql` in `database` with `psql` and returns what it printed (unaligned, no headers).
    pub fn psql(&self, database: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", ROLE])
            .args(["-d", database, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
            .output()
            .expect("psql runs");
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A streaming standby of this server (`pg_basebackup -R` into a temporary directory, on a
    /// free port of its own), read-only until [`PostgresServer::promote`]d; waits until it
    /// streams. With `synchronous`, this server then commits only once the standby has the
    /// commit (`synchronous_standby_names = '*'`, `synchronous_commit = on`): no commit a
    /// client saw is lost when the standby takes over.
    pub fn start_standby(&self, synchronous: bool) -> PostgresServer {
        self.standby_on(None, synchronous)
    }

    /// [`PostgresServer::start_standby`] on `port` (a failed primary's, so a multi-host URL
    /// naming both places still names the pair).
    pub fn start_standby_on(&self, port: u16, synchronous: bool) -> PostgresServer {
        self.standby_on(Some(port), synchronous)
    }

    fn standby_on(&self, port: Option<u16>, synchronous: bool) -> PostgresServer {
        let dir = tempfile::tempdir().expect("a temporary directory");
        if let Some((uid, gid)) = self.user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .expect("the standby's directory is given to the postgres user");
        }
        let data = dir.path().join("data");
        let backup = as_user(Command::new(self.bin.join("pg_basebackup")), self.user)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", ROLE])
            .arg("-D")
            .arg(&data)
            .args(["-R", "-X", "stream", "--no-sync", "--checkpoint=fast"])
            .stdout(Stdio::null())
            .output()
            .expect("pg_basebackup runs");
        assert!(
            backup.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&backup.stderr)
        );
        let mut standby = PostgresServer {
            child: None,
            port: 0,
            bin: self.bin.clone(),
            user: self.user,
            dir,
        };
        let started = match port {
            // A port a killed server held a moment ago: its backends may still hold it.
            Some(port) => {
                standby.port = port;
                standby.run_again()
            }
            None => (0..5).any(|_| {
                standby.port = free_port();
                standby.run()
            }),
        };
        assert!(started, "the standby did not start");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.psql(
            "postgres",
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
        ) == "0"
        {
            assert!(Instant::now() < deadline, "the standby never streamed");
            std::thread::sleep(Duration::from_millis(50));
        }
        if synchronous {
            self.psql(
                "postgres",
                "ALTER SYSTEM SET synchronous_standby_names = '*'",
            );
            self.psql("postgres", "SELECT pg_reload_conf()");
            while self.psql(
                "postgres",
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            ) == "0"
            {
                assert!(
                    Instant::now() < deadline,
                    "the standby never became synchronous"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        standby
    }

    /// Promotes this standby to a primary (`pg_promote`, waiting until it takes writes), as a
    /// failover does.
    pub fn promote(&self) {
        assert_eq!(self.psql("postgres", "SELECT pg_promote(true, 30)"), "t");
    }

    /// Stops the server at once (`kill -9`: no shutdown, no checkpoint), then starts it again on
    /// the same port and files, as a crashed PostgreSQL recovers from its WAL.
    pub fn crash_and_restart(&mut self) {
        self.kill();
        assert!(self.run_again(), "postgres came back after a crash");
    }

    /// Stops the server (`kill -9`) and leaves it stopped until [`PostgresServer::restart`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A crashed postmaster's backends end when they notice; its shared memory and pid file
        // are reclaimed by the next start.
    }

    /// Starts a stopped server again on its port.
    pub fn restart(&mut self) {
        assert!(self.run_again(), "postgres came back");
    }

    fn run_again(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        // The old backends may hold the port for a moment after the postmaster died.
        while Instant::now() < deadline {
            if self.run() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    }

    /// Starts `postgres` on `self.port`; whether it answers there.
    fn run(&mut self) -> bool {
        let child = as_user(Command::new(self.bin.join("postgres")), self.user)
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "fsync=on", "-c", "synchronous_commit=on"])
            .args(["-c", "max_connections=300"])
            // A standby whose primary restarted tries again within half a second (5 s by
            // default): a synchronous primary's commits wait for it meanwhile.
            .args(["-c", "wal_retrieve_retry_interval=500ms"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return false;
            }
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", ROLE])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `cmd`, run as `user` when one is given.
fn as_user(mut cmd: Command, user: Option<(u32, u32)>) -> Command {
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid).env("HOME", "/tmp");
    }
    cmd
}

/// Where `initdb` and `postgres` are: on the `PATH`, or where Debian's packages put them
/// (`/usr/lib/postgresql/VERSION/bin`, the newest version). `None` (having said why) if nowhere.
fn bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).find(|dir| dir.join("initdb").is_file()));
    let debian = || {
        let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .flatten()
            .filter_map(|entry| {
                let version = entry.file_name().to_str()?.parse().ok()?;
                let bin = entry.path().join("bin");
                bin.join("initdb").is_file().then_some((version, bin))
            })
            .collect();
        versions.sort();
        versions.pop().map(|(_, bin)| bin)
    };
    // `initdb` on the PATH may be a link into a version's folder; psql and pg_isready are
    // taken from the same folder.
    let found = on_path
        .map(|dir| {
            std::fs::canonicalize(dir.join("initdb"))
                .ok()
                .and_then(|initdb| initdb.parent().map(Path::to_path_buf))
                .unwrap_or(dir)
        })
        .or_else(debian);
    if found.is_none() {
        eprintln!(
            "SKIPPED: PostgreSQL is not installed (Debian: apt-get install postgresql; \
             .ci/run installs it)"
        );
    }
    found
}

/// Who the server runs as: `None` (this process's user) unless that is root, then the
/// `postgres` user's uid and gid. `None` overall (having said why) if root has no such user.
fn server_user() -> Option<Option<(u32, u32)>> {
    // `id` says who we are without unsafe code.
    let uid = |args: &[&str]| -> Option<u32> {
        let out = Command::new("id").args(args).output().ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    if uid(&["-u"])? != 0 {
        return Some(None);
    }
    match (uid(&["-u", "postgres"]), uid(&["-g", "postgres"])) {
        (Some(u), Some(g)) => Some(Some((u, g))),
        _ => {
            eprintln!(
                "SKIPPED: running as root and there is no postgres user to run PostgreSQL as \
                 (Debian's postgresql package creates it; .ci/run installs it)"
            );
            None
        }
    }
}

/// Starts a server or returns from the test (having said why).
#[macro_export]
macro_rules! postgres_or_skip {
    () => {
        match $crate::support::postgres::PostgresServer::start() {
            Some(server) => server,
            None => return,
        }
    };
}
