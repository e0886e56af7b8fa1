//! A real `redis-server` for one test: a free loopback port, no persistence, its own directory,
//! stopped with every process it forked when dropped (hold it for the whole test: a server
//! leaked with `mem::forget` outlives the test run, and CI fails on it). Tests skip (and say why) only when the binary cannot be run at all.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server, or `None` (having printed why) if `redis-server` cannot be run here.
    pub fn start() -> Option<RedisServer> {
        on_a_free_port(RedisServer::start_on)
    }

    /// Starts a server on `port` (a replica may already be trying it), or `None` if it did not
    /// come up there.
    pub fn start_on(port: u16) -> Option<RedisServer> {
        RedisServer::start_with(port, &[])
    }

    /// Starts a Redis replica of the server on `primary` (`--replicaof`), on a free port, and
    /// waits until it is in sync.
    pub fn start_replica_of(primary: u16) -> RedisServer {
        let primary = primary.to_string();
        let server = on_a_free_port(|port| {
            RedisServer::start_with(port, &["--replicaof", "127.0.0.1", &primary])
        })
        .expect("redis-server runs (the primary did)");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cli(server.port, &["INFO", "replication"]).contains("master_link_status:up") {
            assert!(Instant::now() < deadline, "the replica never synced");
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// Cuts this Redis replica off its primary: it follows a primary that does not exist (a free
    /// port) and keeps what it has, receiving nothing more.
    pub fn cut_off(&self) {
        cli(
            self.port,
            &["REPLICAOF", "127.0.0.1", &free_port().to_string()],
        );
    }

    /// Promotes this Redis replica to a primary (`REPLICAOF NO ONE`), as a failover does.
    pub fn promote(&self) {
        cli(self.port, &["REPLICAOF", "NO", "ONE"]);
    }

    /// Waits until every write made so far on this primary is held by `replicas` Redis replicas
    /// (a write of its own, then `WAIT` on the same connection: the replication stream is in
    /// order); whether they acknowledged within `timeout`.
    pub fn replicated(&self, replicas: u32, timeout: Duration) -> bool {
        let mut child = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("redis-cli runs");
        let commands = format!(
            "INCR replication-probe\nWAIT {replicas} {}\n",
            timeout.as_millis()
        );
        child
            .stdin
            .take()
            .unwrap()
            .write_all(commands.as_bytes())
            .unwrap();
        let out = child.wait_with_output().expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|n| n.trim().parse::<u32>().ok())
            .is_some_and(|n| n >= replicas)
    }

    fn start_with(port: u16, extra: &[&str]) -> Option<RedisServer> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // A process group of its own, so a stop reaches the children it forks too (a
        // replication sync's `redis-rdb-to-slaves`), and a stop of the test process group (a
        // Ctrl-C) does not reach it half-way through a test.
        let child = Command::new("redis-server")
            .args(server_args(port, dir.path()))
            .args(extra)
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let mut server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        server.wait_ready().then_some(server)
    }

    fn wait_ready(&mut self) -> bool {
        wait_ready(&mut self.child, self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (`kill -9`, no persistence: everything it held is gone) and starts an
    /// empty one on the same port, as a Redis restarted without persistence is.
    pub fn restart_empty(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let port = self.port;
        for _ in 0..50 {
            if let Some(fresh) = RedisServer::start_on(port) {
                *self = fresh;
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("redis-server did not come back on port {port}");
    }

    /// `FLUSHALL`: the server forgets every key at once.
    pub fn flush_all(&self) {
        let status = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "FLUSHALL"])
            .stdout(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(status.success(), "FLUSHALL failed");
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Sends `sig` to the server and every process it forked (its process group).
    fn signal(&self, sig: &str) {
        let status = signal_group(sig, self.child.id());
        assert!(status.is_ok_and(|s| s.success()), "kill {sig} failed");
    }
}

/// `redis-cli -p port args...`'s output (it must succeed).
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli runs");
    assert!(out.status.success(), "redis-cli {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One whole lifecycle of `client` on `replica` (admitted, committed, failed, the release sent),
/// so every script is loaded and each call after it is one EVALSHA (a first call is an EVALSHA
/// refused, then an EVAL): what a test counting script calls does before it counts.
pub async fn warm(replica: &unyolo_admission::Admission, client: &str) {
    replica
        .admit(client, false, None)
        .await
        .unwrap()
        .commit()
        .fail()
        .await
        .unwrap();
    assert!(replica.flush().await);
}

/// Script calls (`EVALSHA` and `EVAL`) the server on `port` has run since it started (or since
/// `CONFIG RESETSTAT`), from `INFO commandstats`.
pub fn script_calls(port: u16) -> u64 {
    cli(port, &["INFO", "commandstats"])
        .lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix("cmdstat_evalsha:")
                .or_else(|| line.strip_prefix("cmdstat_eval:"))?;
            rest.split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Closes every subscriber connection on the server on `port` (`CLIENT KILL TYPE pubsub`):
/// each replica's notice subscription is lost.
pub fn kill_subscribers(port: u16) {
    cli(port, &["CLIENT", "KILL", "TYPE", "pubsub"]);
}

/// Waits until the server under `child` answers PING on `port`; false if `child` exits first or
/// ten seconds pass.
fn wait_ready(child: &mut Child, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let mut buf = [0u8; 7];
            if stream.write_all(b"PING\r\n").is_ok()
                && stream.read_exact(&mut buf).is_ok()
                && &buf == b"+PONG\r\n"
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// One server for the whole test process: started by the first test that asks, stopped when the
/// process ends, however it ends (a static is never dropped, so the server runs under a shell
/// that holds a pipe from this process and stops the server when the pipe closes). Tests sharing
/// it keep apart by key prefix.
pub struct ProcessServer {
    /// The shell; its stdin is the pipe (held open here until the process exits).
    _shell: Child,
    pub port: u16,
}

impl ProcessServer {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn start_on(port: u16) -> Option<ProcessServer> {
        // The shell ends with the server (so a server that cannot bind is seen at once); the
        // watcher in the background stops the server once this process's end of stdin closes.
        // (A background job's stdin is /dev/null unless redirected: the pipe goes through fd 3.)
        let script = r#"exec 3<&0
redis-server "$@" 3<&- & pid=$!
(cat <&3 >/dev/null; kill "$pid" 2>/dev/null) &
exec 3<&-
wait "$pid""#;
        let mut shell = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("sh")
            .args(server_args(port, &std::env::temp_dir()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("sh starts");
        if wait_ready(&mut shell, port) {
            Some(ProcessServer {
                _shell: shell,
                port,
            })
        } else {
            let _ = shell.kill();
            let _ = shell.wait();
            None
        }
    }
}

/// The test process's server (see [`ProcessServer`]), or `None` (having printed why) if
/// `redis-server` cannot be run here.
pub fn process_server() -> Option<&'static ProcessServer> {
    static SERVER: OnceLock<Option<ProcessServer>> = OnceLock::new();
    SERVER
        .get_or_init(|| on_a_free_port(ProcessServer::start_on))
        .as_ref()
}

/// A server started by `start_on` on a free loopback port, or `None` (having printed why) if
/// `redis-server` cannot be run here. A port taken between choosing it and the server binding it
/// is retried with another.
fn on_a_free_port<S>(start_on: impl Fn(u16) -> Option<S>) -> Option<S> {
    if !installed() {
        return None;
    }
    for _ in 0..5 {
        if let Some(server) = start_on(free_port()) {
            return Some(server);
        }
    }
    panic!("redis-server did not start on any of five loopback ports");
}

/// `redis-server`'s flags: `port` on loopback, no persistence, its files in `dir`.
fn server_args(port: u16, dir: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
    ]
    .map(OsString::from)
    .into();
    args.push(dir.into());
    args
}

/// A loopback port free a moment ago (nothing listens on it now): for a server a test starts,
/// or an address where nothing answers yet.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Whether `redis-server` can be run here (if not, says so: the test then skips).
pub fn installed() -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        eprintln!(
            "SKIPPED: redis-server is not installed (Debian: apt-get install redis-server; \
             .ci/run installs it)"
        );
    }
    ok
}

/// `kill SIG -PGID`: `sig` to every process of the group `leader` leads.
fn signal_group(sig: &str, leader: u32) -> std::io::Result<std::process::ExitStatus> {
    Command::new("kill")
        .arg(sig)
        .arg("--")
        .arg(format!("-{leader}"))
        .stderr(Stdio::null())
        .status()
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // The whole group: a child the server forked (a replication sync) outlives a SIGKILL
        // of the server alone. A paused server is thawed first, so it dies promptly.
        let _ = signal_group("-CONT", self.child.id());
        let _ = signal_group("-KILL", self.child.id());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server or returns from the test (having said why).
#[macro_export]
macro_rules! redis_or_skip {
    () => {
        match $crate::support::redis::RedisServer::start() {
            Some(server) => server,
            None => return,
        }
    };
}
