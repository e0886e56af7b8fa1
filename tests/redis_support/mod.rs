//! A real `redis-server` for one test: a free loopback port, no persistence, its own directory,
//! stopped when dropped. Tests skip (and say why) only when the binary cannot be run at all.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server, or `None` (having printed why) if `redis-server` cannot be run here.
    pub fn start() -> Option<RedisServer> {
        if !installed() {
            return None;
        }
        // A port taken between choosing it and the server binding it is retried with another.
        for _ in 0..5 {
            if let Some(server) = RedisServer::start_on(free_port()) {
                return Some(server);
            }
        }
        panic!("redis-server did not start on any of five loopback ports");
    }

    /// Starts a server on `port` (a replica may already be trying it), or `None` if it did not
    /// come up there.
    pub fn start_on(port: u16) -> Option<RedisServer> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) {
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .arg(sig)
            .arg(self.child.id().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {sig} failed");
    }
}

/// A loopback port free a moment ago (nothing listens on it now).
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A paused server must be thawed to die promptly on SIGKILL's reaping.
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server or returns from the test (having said why).
#[macro_export]
macro_rules! redis_or_skip {
    () => {
        match $crate::redis_support::RedisServer::start() {
            Some(server) => server,
            None => return,
        }
    };
}
