//! Highly available Redis for one test, on loopback: a primary with Redis replicas watched by
//! three `redis-server --sentinel`s ([`SentinelSet`]), and a Redis Cluster of three primaries,
//! each with a replica ([`Cluster`]). Every process is [`Watched`]: stopped when the test drops
//! it (a panic included), and by a watchdog when the test process is gone however it ended (a
//! killed test binary leaves no server behind). Tests skip (and say why) only when
//! `redis-server` cannot be run at all.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::{cli, free_port, installed};

/// One process run under a watchdog shell: the shell starts it, says its pid, and kills it
/// (`kill -9`) once its stdin (a pipe held by this test process) closes: when this is dropped,
/// or when the test process ends, however it ends.
pub struct Watched {
    shell: Child,
    pub pid: u32,
}

impl Watched {
    pub fn spawn(program: &str, args: &[OsString]) -> Watched {
        // fd 3 is the pipe; the program gets none of it (nor the shell's stdout), the watcher in
        // the background keeps it until the test's end closes it.
        let script = r#"exec 3<&0
"$@" 3<&- </dev/null >/dev/null 2>&1 & pid=$!
echo "$pid"
exec >/dev/null
(cat <&3 >/dev/null; kill -9 "$pid" 2>/dev/null) &
exec 3<&-
wait "$pid""#;
        let mut shell = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("sh")
            .arg(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("sh starts");
        let mut line = String::new();
        BufReader::new(shell.stdout.take().expect("the shell's stdout"))
            .read_line(&mut line)
            .expect("the shell says the pid");
        let pid = line.trim().parse().expect("a pid");
        Watched { shell, pid }
    }

    /// Whether the process still runs.
    pub fn alive(&self) -> bool {
        Path::new(&format!("/proc/{}", self.pid)).exists()
            && !std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
                .is_ok_and(|stat| stat.split(' ').nth(2) == Some("Z"))
    }

    /// Sends `sig` (`-STOP`, `-CONT`, `-KILL`).
    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(sig)
            .arg(self.pid.to_string())
            .stderr(Stdio::null())
            .status();
    }

    /// `kill -9`, and waits until it is gone.
    pub fn kill(&mut self) {
        self.signal("-CONT");
        self.signal("-KILL");
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.kill();
        // The watcher ends with its pipe.
        drop(self.shell.stdin.take());
        let _ = self.shell.wait();
    }
}

/// A `redis-server` (or Sentinel) on a loopback port, with its own directory.
pub struct Node {
    pub port: u16,
    process: Watched,
    _dir: tempfile::TempDir,
}

impl Node {
    /// `redis-server` on `port` with no persistence and `extra` flags, once it answers PING. A
    /// replica that must sync in full (one ahead of the replica promoted) is sent the data at
    /// once, not after the 5 s Redis waits by default for more replicas to share the transfer.
    fn start(port: u16, extra: &[&str]) -> Option<Node> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut args: Vec<OsString> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--repl-diskless-sync-delay",
            "0",
            "--dir",
        ]
        .map(OsString::from)
        .into();
        args.push(dir.path().into());
        args.extend(extra.iter().map(OsString::from));
        Node::run(port, dir, args)
    }

    /// A Sentinel on `port` with `config` (its monitor lines) in its own file, which it rewrites.
    fn sentinel(port: u16, config: &str) -> Option<Node> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("sentinel.conf");
        let config = format!(
            "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n{config}",
            dir.path().display()
        );
        std::fs::write(&path, config).expect("the config is written");
        Node::run(port, dir, vec![path.into(), "--sentinel".into()])
    }

    fn run(port: u16, dir: tempfile::TempDir, args: Vec<OsString>) -> Option<Node> {
        let process = Watched::spawn("redis-server", &args);
        let node = Node {
            port,
            process,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !node.process.alive() {
                return None;
            }
            if try_cli(port, &["PING"]).is_some_and(|o| o.trim() == "PONG") {
                return Some(node);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn alive(&self) -> bool {
        self.process.alive()
    }

    /// `kill -9`: gone at once, as a crashed server is.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    pub fn pause(&self) {
        self.process.signal("-STOP");
    }

    pub fn resume(&self) {
        self.process.signal("-CONT");
    }

    /// The first word of `ROLE`: `master`, `slave` or `sentinel` (`None`: no answer).
    pub fn role(&self) -> Option<String> {
        try_cli(self.port, &["ROLE"])?
            .lines()
            .next()
            .map(str::to_owned)
    }
}

/// `redis-cli -p port args...`'s output, or `None` if it failed (a server down).
pub fn try_cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success() && !text.starts_with("Could not connect")).then_some(text)
}

/// How many `kind` errors (`ASK`, `MOVED`, `NOSCRIPT`, `TRYAGAIN`) the server on `port` has
/// answered (`INFO errorstats`).
pub fn errors(port: u16, kind: &str) -> u64 {
    try_cli(port, &["INFO", "errorstats"])
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("errorstat_{kind}:count=")))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Polls `check` every 20 ms for up to `within`; whether it held.
pub fn wait_until(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// A starter that tries five free ports (one taken between choosing and binding is retried).
fn on_free_ports<S>(mut start: impl FnMut(u16) -> Option<S>, port: fn() -> u16) -> S {
    for _ in 0..5 {
        if let Some(started) = start(port()) {
            return started;
        }
    }
    panic!("redis-server did not start on any of five loopback ports");
}

/// A primary, its Redis replicas, and three Sentinels monitoring it as one service.
pub struct SentinelSet {
    pub service: String,
    /// The Redis servers: the first started as the primary, the others as its replicas.
    pub servers: Vec<Node>,
    pub sentinels: Vec<Node>,
}

impl SentinelSet {
    /// A primary with `replicas` Redis replicas in sync, and three Sentinels (quorum 2) that
    /// know all of them and each other; a primary silent for `down_after` is failed over.
    /// `None` (having said why) when `redis-server` is not installed.
    pub fn start(replicas: usize, down_after: Duration) -> Option<SentinelSet> {
        if !installed() {
            return None;
        }
        let service = "hot".to_owned();
        let primary = on_free_ports(|port| Node::start(port, &[]), free_port);
        let primary_port = primary.port.to_string();
        let mut servers = vec![primary];
        for _ in 0..replicas {
            let replica = on_free_ports(
                |port| Node::start(port, &["--replicaof", "127.0.0.1", &primary_port]),
                free_port,
            );
            servers.push(replica);
        }
        assert!(
            wait_until(Duration::from_secs(30), || servers[1..].iter().all(|r| {
                try_cli(r.port, &["INFO", "replication"])
                    .is_some_and(|i| i.contains("master_link_status:up"))
            })),
            "the replicas never synced"
        );
        let config = format!(
            "sentinel monitor {service} 127.0.0.1 {primary_port} 2\n\
             sentinel down-after-milliseconds {service} {}\n\
             sentinel failover-timeout {service} 4000\n\
             sentinel parallel-syncs {service} {replicas}\n",
            down_after.as_millis()
        );
        let sentinels: Vec<Node> = (0..3)
            .map(|_| on_free_ports(|port| Node::sentinel(port, &config), free_port))
            .collect();
        let set = SentinelSet {
            service,
            servers,
            sentinels,
        };
        // A failover needs each Sentinel to know the others (they meet through the primary's
        // hello channel, every 2 s) and the replicas (from the primary's INFO).
        assert!(
            wait_until(Duration::from_secs(30), || set.sentinels.iter().all(|s| {
                let others = try_cli(s.port, &["SENTINEL", "SENTINELS", &set.service]);
                let known = try_cli(s.port, &["SENTINEL", "REPLICAS", &set.service]);
                others.is_some_and(|o| o.matches("runid").count() == 2)
                    && known.is_some_and(|k| k.matches("runid").count() == replicas)
            })),
            "the sentinels never met each other and the replicas"
        );
        Some(set)
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/SERVICE`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), self.service)
    }

    /// The port of the primary the (first answering) Sentinel names.
    pub fn primary_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            if let Some(out) = try_cli(
                sentinel.port,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.service],
            ) && let Some(port) = out.lines().nth(1).and_then(|p| p.trim().parse().ok())
            {
                return port;
            }
        }
        panic!("no sentinel names a primary");
    }

    /// A failover as a crash makes one: the primary killed (`kill -9`), then, once the
    /// Sentinels name another (a promoted replica), the old one started again empty on its
    /// port as a replica of the new primary, so the set keeps its replicas for the next.
    pub fn fail_over(&mut self) {
        let old = self.primary_port();
        self.server(old).kill();
        assert!(
            wait_until(Duration::from_secs(30), || self.primary_port() != old),
            "the sentinels never promoted a replica"
        );
        let new = self.primary_port().to_string();
        let restarted = Node::start(old, &["--replicaof", "127.0.0.1", &new])
            .expect("the old primary starts again as a replica");
        let place = self
            .servers
            .iter()
            .position(|s| s.port == old)
            .expect("a server of this set");
        self.servers[place] = restarted;
    }

    /// The server on `port`.
    pub fn server(&mut self, port: u16) -> &mut Node {
        self.servers
            .iter_mut()
            .find(|s| s.port == port)
            .expect("a server of this set")
    }
}

/// A free loopback port whose cluster bus port (the port + 10000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port <= 55535 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// A cluster-enabled `redis-server` on a free port, whose peers are failed after `timeout`
/// milliseconds without an answer.
fn cluster_node(timeout: &str) -> Node {
    on_free_ports(
        |port| {
            Node::start(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    timeout,
                ],
            )
        },
        free_cluster_port,
    )
}

/// A Redis Cluster of three primaries, each with one replica, every slot covered.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// `None` (having said why) when `redis-server` is not installed. A primary silent for
    /// `node_timeout` is failed over by its replica.
    pub fn start(node_timeout: Duration) -> Option<Cluster> {
        if !installed() {
            return None;
        }
        let timeout = node_timeout.as_millis().to_string();
        let nodes: Vec<Node> = (0..6).map(|_| cluster_node(&timeout)).collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Cluster { nodes };
        cluster.wait_settled();
        Some(cluster)
    }

    /// Waits until every live node says the cluster is ok and `redis-cli --cluster check`
    /// finds every node agreeing on every slot.
    pub fn wait_settled(&self) {
        let live: Vec<u16> = self
            .nodes
            .iter()
            .filter(|n| n.alive())
            .map(|n| n.port)
            .collect();
        assert!(
            wait_until(Duration::from_secs(60), || {
                live.iter().all(|&port| {
                    try_cli(port, &["CLUSTER", "INFO"])
                        .is_some_and(|i| i.contains("cluster_state:ok"))
                }) && Command::new("redis-cli")
                    .args(["--cluster", "check", &format!("127.0.0.1:{}", live[0])])
                    .output()
                    .is_ok_and(|o| {
                        let text = String::from_utf8_lossy(&o.stdout);
                        text.contains("All nodes agree about slots configuration")
                            && text.contains("All 16384 slots covered")
                            && !text.contains("[WARNING]")
                    })
            }),
            "the cluster never settled"
        );
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3` (three nodes to start from).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes[..3]
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of a live node).
    pub fn keyslot(&self, key: &str) -> u16 {
        let port = self.live_port();
        cli(port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("a slot")
    }

    /// `(node id, port)` of the primary serving `slot`, as a live node sees it.
    pub fn owner(&self, slot: u16) -> (String, u16) {
        let port = self.live_port();
        for line in cli(port, &["CLUSTER", "NODES"]).lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => range.parse::<u16>().is_ok_and(|s| s == slot),
            });
            if serves {
                let port = fields[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit_once(':'))
                    .and_then(|(_, p)| p.parse().ok())
                    .expect("a node address");
                return (fields[0].to_owned(), port);
            }
        }
        panic!("no primary serves slot {slot}");
    }

    /// The port of a replica of the primary `id` (waited for: a replica is told whom it
    /// follows after the slots are assigned, and the others learn it by gossip).
    pub fn replica_of(&self, id: &str) -> u16 {
        let mut found = None;
        let heard = wait_until(Duration::from_secs(30), || {
            let nodes = try_cli(self.live_port(), &["CLUSTER", "NODES"]).unwrap_or_default();
            found = nodes.lines().find_map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                (fields.len() > 3 && fields[2].contains("slave") && fields[3] == id)
                    .then(|| {
                        fields[1]
                            .split('@')
                            .next()?
                            .rsplit_once(':')?
                            .1
                            .parse()
                            .ok()
                    })
                    .flatten()
            });
            found.is_some()
        });
        assert!(heard, "no replica of {id}");
        found.unwrap()
    }

    /// The node id of the node on `port`.
    pub fn id(&self, port: u16) -> String {
        cli(port, &["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// The node on `port`.
    pub fn node(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// Starts moving `slot` with every key in it from its primary to the primary on `to`: the
    /// slot is marked migrating there and importing here, and its keys go in one `MIGRATE`
    /// (nothing may write to the slot meanwhile: see the test). Until [`Migration::finish`], the
    /// old primary answers `ASK` for the slot's keys.
    pub fn begin_migration(&self, slot: u16, to: u16) -> Migration {
        let slot_s = slot.to_string();
        let (from_id, from) = self.owner(slot);
        let to_id = self.id(to);
        cli(to, &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &from_id]);
        cli(from, &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &to_id]);
        let keys: Vec<String> = cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot_s, "100000"])
            .lines()
            .map(str::to_owned)
            .filter(|k| !k.is_empty())
            .collect();
        if !keys.is_empty() {
            let to_s = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &to_s, "", "0", "10000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let out = cli(from, &args);
            assert!(out.trim() == "OK", "MIGRATE: {out}");
        }
        Migration {
            slot,
            from,
            to,
            to_id,
            others: self
                .nodes
                .iter()
                .filter(|n| n.alive())
                .map(|n| n.port)
                .collect(),
        }
    }

    /// Starts one more Redis replica of the primary `id` and waits until it is in sync.
    pub fn add_replica(&mut self, id: &str) -> u16 {
        let timeout = try_cli(self.live_port(), &["CONFIG", "GET", "cluster-node-timeout"])
            .and_then(|o| o.lines().nth(1).map(str::to_owned))
            .expect("the node timeout");
        let node = cluster_node(&timeout);
        let port = node.port;
        let seed = self.live_port().to_string();
        cli(port, &["CLUSTER", "MEET", "127.0.0.1", &seed]);
        assert!(
            wait_until(Duration::from_secs(30), || {
                try_cli(port, &["CLUSTER", "NODES"]).is_some_and(|n| n.contains(id))
            }),
            "the new node never met the cluster"
        );
        cli(port, &["CLUSTER", "REPLICATE", id]);
        assert!(
            wait_until(Duration::from_secs(30), || {
                try_cli(port, &["INFO", "replication"])
                    .is_some_and(|i| i.contains("master_link_status:up"))
            }),
            "the new replica never synced"
        );
        self.nodes.push(node);
        self.wait_settled();
        port
    }

    fn live_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.alive() && try_cli(n.port, &["PING"]).is_some())
            .expect("a live node")
            .port
    }
}

/// Admissions and releases on several replicas at once, through a failover: each worker admits
/// for one of the clients (a fresh idempotency key each time), holds the operation a few
/// milliseconds and fails it, and what it saw is kept ([`Seen`]).
pub struct Load {
    seen: std::sync::Arc<std::sync::Mutex<Seen>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    unavailable: std::sync::Arc<std::sync::atomic::AtomicU64>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

/// What a [`Load`] saw.
pub struct Seen {
    client_active: u32,
    global_active: u32,
    live: std::collections::BTreeMap<&'static str, u32>,
    /// Each moment more was held than a limit allows (empty when none was).
    pub over: Vec<String>,
    /// When each admission was asked for and when it was answered.
    pub admitted_at: Vec<(Instant, Instant)>,
    /// Each (client, idempotency key) admitted.
    pub acknowledged: Vec<(&'static str, String)>,
    /// Answers `Unavailable`.
    pub unavailable: u64,
    /// Why the last few answers `Unavailable` were (for a failure's message).
    pub why_unavailable: Vec<String>,
}

impl Seen {
    /// Counted as soon as the admission is answered, uncounted before its release is sent: what
    /// is counted here is never more than Redis holds.
    fn admitted(&mut self, client: &'static str, key: String, asked: Instant) {
        *self.live.entry(client).or_default() += 1;
        let total: u32 = self.live.values().sum();
        if self.live[client] > self.client_active || total > self.global_active {
            self.over
                .push(format!("{:?} at {:?}", self.live, Instant::now()));
        }
        self.admitted_at.push((asked, Instant::now()));
        self.acknowledged.push((client, key));
    }

    fn released(&mut self, client: &'static str) {
        *self.live.get_mut(client).expect("admitted before") -= 1;
    }

    /// When the first admission asked for after `at` was answered (one asked for before may
    /// be answered after, from a primary that died meanwhile).
    pub fn first_after(&self, at: Instant) -> Option<Instant> {
        self.admitted_at
            .iter()
            .filter(|(asked, _)| *asked > at)
            .map(|(_, answered)| *answered)
            .min()
    }

    /// The longest time without an admission answered, from `since` to the last answer.
    pub fn longest_pause(&self, since: Instant) -> Duration {
        let mut answered: Vec<Instant> = self.admitted_at.iter().map(|(_, at)| *at).collect();
        answered.sort();
        let mut last = since;
        let mut longest = Duration::ZERO;
        for at in answered.into_iter().filter(|at| *at > since) {
            longest = longest.max(at - last);
            last = at;
        }
        longest
    }

    /// The names of the key records of every admission acknowledged, under `prefix`.
    pub fn key_records(&self, prefix: &str) -> Vec<String> {
        self.acknowledged
            .iter()
            .map(|(client, key)| format!("{{{prefix}}}:key:{client}:{key}"))
            .collect()
    }
}

impl Load {
    /// Three workers per replica on `clients`, whose limits are `client_active` each and
    /// `global_active` in all.
    pub fn start(
        replicas: &[unyolo_admission::admission::Admission],
        clients: &'static [&'static str],
        client_active: u32,
        global_active: u32,
    ) -> Load {
        use std::sync::atomic::Ordering;
        use unyolo_admission::admission::AdmitError;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen {
            client_active,
            global_active,
            live: Default::default(),
            over: Vec::new(),
            admitted_at: Vec::new(),
            acknowledged: Vec::new(),
            unavailable: 0,
            why_unavailable: Vec::new(),
        }));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let unavailable = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut workers = Vec::new();
        for worker in 0..replicas.len() * 3 {
            let admission = replicas[worker % replicas.len()].clone();
            let seen = std::sync::Arc::clone(&seen);
            let stop = std::sync::Arc::clone(&stop);
            let unavailable = std::sync::Arc::clone(&unavailable);
            workers.push(tokio::spawn(async move {
                let mut round = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    let client = clients[(worker + round) % clients.len()];
                    let key = format!("w{worker}-{round}");
                    let asked = Instant::now();
                    match admission.admit(client, false, Some(&key)).await {
                        Ok(permit) => {
                            let op = permit.commit();
                            seen.lock().unwrap().admitted(client, key, asked);
                            let hold = 5 + (round % 4) as u64 * 5;
                            tokio::time::sleep(Duration::from_millis(hold)).await;
                            seen.lock().unwrap().released(client);
                            op.fail().await.unwrap();
                        }
                        Err(AdmitError::Refused(_)) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(AdmitError::Unavailable(why)) => {
                            // Relaxed: a count read once the workers ended.
                            unavailable.fetch_add(1, Ordering::Relaxed);
                            {
                                let mut seen = seen.lock().unwrap();
                                if seen.why_unavailable.len() == 8 {
                                    seen.why_unavailable.remove(0);
                                }
                                seen.why_unavailable.push(why.to_string());
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(other) => panic!("{other:?}"),
                    }
                }
            }));
        }
        Load {
            seen,
            stop,
            unavailable,
            workers,
        }
    }

    /// Admissions answered so far.
    pub fn admitted(&self) -> usize {
        self.seen.lock().unwrap().admitted_at.len()
    }

    /// Stops the workers (each releases what it holds first); what they saw.
    pub async fn stop(self) -> Seen {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            worker.await.unwrap();
        }
        let mut seen = std::sync::Arc::try_unwrap(self.seen)
            .ok()
            .expect("the workers ended")
            .into_inner()
            .unwrap();
        seen.unavailable = self.unavailable.load(Ordering::Relaxed);
        seen
    }
}

/// Of `names`, those `conn` holds no value for (MGET, 500 at a time).
pub async fn missing(conn: &mut impl redis::aio::ConnectionLike, names: &[String]) -> Vec<String> {
    let mut missing = Vec::new();
    for chunk in names.chunks(500) {
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(chunk)
            .query_async(conn)
            .await
            .unwrap();
        missing.extend(
            chunk
                .iter()
                .zip(values)
                .filter(|(_, v)| v.is_none())
                .map(|(name, _)| name.clone()),
        );
    }
    missing
}

/// A slot on its way from one primary to another ([`Cluster::begin_migration`]).
pub struct Migration {
    slot: u16,
    from: u16,
    to: u16,
    to_id: String,
    others: Vec<u16>,
}

impl Migration {
    /// The slot's new home, told to both primaries and then to every other node.
    pub fn finish(self) {
        let slot = self.slot.to_string();
        for port in [self.to, self.from] {
            cli(port, &["CLUSTER", "SETSLOT", &slot, "NODE", &self.to_id]);
        }
        for port in self.others {
            if port != self.to && port != self.from {
                let _ = try_cli(port, &["CLUSTER", "SETSLOT", &slot, "NODE", &self.to_id]);
            }
        }
    }
}

/// The refusal memory works on the Redis the replicas use now: each hears the deployment's
/// notices, and a refusal one of them remembers ends when another releases (the release's
/// notice heard, not the refusal's hint waited out). `client` may hold `limit` operations and
/// holds none once every release sent has reached Redis.
pub async fn assert_notices_heard(
    replicas: &[unyolo_admission::admission::Admission],
    client: &str,
    limit: u32,
) {
    use unyolo_admission::admission::{AdmitError, BackendStats};
    let release = BackendStats::FORGOTTEN_REASONS
        .iter()
        .position(|r| *r == "release")
        .expect("a reason named release");
    super::eventually::assert_eventually("every replica hears the notices", async || {
        replicas.iter().all(|r| r.stats().notices_live)
    })
    .await;
    // Right after a failover a release sent to the old primary may still be kept, to be sent
    // again: the client holds nothing once it has.
    super::eventually::assert_eventually(&format!("{client} holds nothing"), async || {
        replicas[0]
            .counts()
            .await
            .is_ok_and(|c| c.clients.get(client).is_none_or(|held| held.0 == 0))
    })
    .await;
    let (holder, refused) = (&replicas[0], &replicas[1]);
    let mut held = Vec::new();
    for _ in 0..limit {
        match holder.admit(client, false, None).await {
            Ok(permit) => held.push(permit.commit()),
            Err(err) => panic!("{client} was not admitted within its limit: {err:?}"),
        }
    }
    assert!(matches!(
        refused.admit(client, false, None).await,
        Err(AdmitError::Refused(_))
    ));
    let before = refused.stats().refusals_forgotten[release];
    held.pop().unwrap().fail().await.unwrap();
    super::eventually::assert_eventually("the release's notice is heard", async || {
        refused.stats().refusals_forgotten[release] > before
    })
    .await;
    for op in held {
        op.fail().await.unwrap();
    }
}
