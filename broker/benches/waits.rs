//! What an idle long-poll wait costs: thousands of concurrent
//! `GET …/operations/{id}/events?after_revision=1&wait_seconds=30` waits held open on loopback
//! against an in-process broker, with the broker's CPU time and the process's RSS measured over an
//! idle window, against the same window with no waits open.
//!
//! `cargo bench --bench waits` (release build). `WAITS` (default 2048) and `IDLE_SECONDS`
//! (default 5) tune it. A client may hold at most `MAX_WAITS_PER_CLIENT` (32) waits, so the run
//! configures `WAITS / 32` identities, each with one pending operation to wait on. Under
//! `cargo test` it runs a short smoke version with the same assertions.
//!
//! The broker runs on its own runtime threads; the client is the main thread with plain blocking
//! sockets, so every other thread's CPU time is the broker's (read per thread from
//! `/proc/self/task/*/schedstat`, in nanoseconds). RSS is the whole process's (`VmRSS`), so the
//! memory per wait includes the client's side of each connection; the kernel's socket buffers are
//! not in RSS.
//!
//! Checked, not assumed: every client's 33rd wait is refused with 429 (so its 32 are open in the
//! broker), no wait has answered by the end of the idle window, and a change to one operation
//! answers all of its waits at once.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::{Config, StorageCaps};
use unyolo_admission_broker::fairness::FairnessConfig;
use unyolo_admission_broker::waits::MAX_WAITS_PER_CLIENT;
use unyolo_admission_broker::{Broker, BrokerSettings, ConnectionSettings};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn secret(client: usize) -> String {
    format!("wait-bench-secret-{client:04}")
}

/// One request on its own connection (`Connection: close`): status and body.
fn exchange(addr: SocketAddr, method: &str, path: &str, client: usize, body: &str) -> (u16, Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        secret(client),
        body.len()
    )
    .unwrap();
    read_response(&mut stream)
}

fn read_response(stream: &mut TcpStream) -> (u16, Value) {
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn wait_path(operation: &str, after_revision: u64) -> String {
    format!(
        "/api/agent/v1/operations/{operation}/events?after_revision={after_revision}&wait_seconds=30"
    )
}

/// Opens a wait and leaves it waiting: the request is sent, the answer is not read.
fn open_wait(addr: SocketAddr, client: usize, operation: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        wait_path(operation, 1),
        secret(client)
    )
    .unwrap();
    stream
}

/// CPU time so far of each live thread, in nanoseconds, with whether it is the main thread.
fn thread_cpu() -> HashMap<u32, (bool, u64)> {
    let main = std::process::id();
    let mut threads = HashMap::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let entry = entry.unwrap();
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // The thread may have exited since the listing.
        let Ok(text) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        let ns = text.split_whitespace().next().unwrap().parse().unwrap();
        threads.insert(tid, (tid == main, ns));
    }
    threads
}

/// Broker and client (main thread) CPU time over `window`, counting threads alive at both ends.
fn cpu_over(window: Duration) -> (Duration, Duration) {
    let before = thread_cpu();
    std::thread::sleep(window);
    let after = thread_cpu();
    let (mut broker, mut client) = (0, 0);
    for (tid, (is_main, ns)) in after {
        if let Some((_, was)) = before.get(&tid) {
            let spent = ns - was;
            if is_main {
                client += spent;
            } else {
                broker += spent;
            }
        }
    }
    (Duration::from_nanos(broker), Duration::from_nanos(client))
}

/// Whether the broker has answered (or closed) this connection; it reads at most one byte.
fn answered(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let read = (&*stream).read(&mut byte);
    stream.set_nonblocking(false).unwrap();
    match read {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => panic!("a wait's connection failed: {e}"),
    }
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` a short smoke run checks
    // the same assertions.
    let full = std::env::args().any(|a| a == "--bench");
    let waits = env("WAITS", if full { 2048 } else { 64 }).max(MAX_WAITS_PER_CLIENT);
    let idle = Duration::from_secs(env("IDLE_SECONDS", if full { 5 } else { 1 }) as u64);
    assert!(idle < Duration::from_secs(20), "the waits would time out");
    let clients = waits.div_ceil(MAX_WAITS_PER_CLIENT);
    let waits = clients * MAX_WAITS_PER_CLIENT;

    let dir = tempfile::tempdir().unwrap();
    let secrets_file: String = (0..clients)
        .map(|c| format!("agent-{c:04} = {}\n", secret(c)))
        .collect();
    let secrets = Secrets::parse(&secrets_file).unwrap();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let limits = format!(
        r#"{{"requests_per_window": 1000, "window_seconds": 1, "client_active": 2,
            "client_pending": 1, "global_active": {clients}, "global_executing": 1}}"#
    );
    let config = Config::from_bytes(limits.as_bytes(), identities).unwrap();
    let share = 2 * MAX_WAITS_PER_CLIENT as u32;
    let settings = BrokerSettings {
        config,
        storage_caps: StorageCaps {
            grant_global: clients as u64,
            ..StorageCaps::default()
        },
        connections: ConnectionSettings {
            max_connections: Some(waits + 256),
            ..ConnectionSettings::default()
        },
        // The fairness layer's share (32 units by default, one a wait) raised past each client's
        // wait limit and its pool past every client's, so the limit measured here is the waits'.
        fairness: FairnessConfig {
            per_client_units: share,
            total_units: share * (clients as u32 + 1)
                + FairnessConfig::default().exempt_reserved_units,
            ..FairnessConfig::default()
        },
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().to_owned(),
            secrets,
            unyolo_admission::config::Operators::single(
                "bench",
                "wait-bench-operator-secret-0123456789abcdef",
            )
            .unwrap(),
        )
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("broker")
        .enable_all()
        .build()
        .unwrap();
    let (broker, _) = runtime.block_on(Broker::start(settings)).unwrap();
    let addr = broker.local_addr();
    println!(
        "broker on loopback; {waits} waits from {clients} clients ({MAX_WAITS_PER_CLIENT} each); \
         idle window {idle:?}; {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // One pending operation per client, at revision 1, to wait on.
    let operations: Vec<String> = (0..clients)
        .map(|c| {
            let body = json!({
                "idempotency_key": format!("wait-bench-{c}"),
                "operation": "demo.request",
                "target": {"repo": "unyolo/bench"},
                "arguments": {},
                "reason": "wait bench",
            });
            let (status, record) = exchange(
                addr,
                "POST",
                "/api/agent/v1/operations",
                c,
                &body.to_string(),
            );
            assert_eq!(status, 202, "{record}");
            assert_eq!(record["revision"], 1);
            record["id"].as_str().unwrap().to_owned()
        })
        .collect();

    std::thread::sleep(Duration::from_millis(500));
    let rss_before = rss_kib();
    let (base_broker, base_client) = cpu_over(idle);

    let opened = Instant::now();
    let mut streams: Vec<Vec<TcpStream>> = (0..clients)
        .map(|c| {
            (0..MAX_WAITS_PER_CLIENT)
                .map(|_| open_wait(addr, c, &operations[c]))
                .collect()
        })
        .collect();
    // A wait that would wait (one second past the current revision) is refused while the
    // client's 32 are open in the broker, and answered (200, after its second) until they are; a
    // wait that would answer at once takes no slot, so it cannot probe. A probe holds a slot
    // while it waits, so a wait arriving then is refused: such a wait is opened again, until a
    // round in which every probe is refused and no wait has answered.
    let mut reopened = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut settled = true;
        for (c, operation) in operations.iter().enumerate() {
            let probe = format!(
                "/api/agent/v1/operations/{operation}/events?after_revision=1&wait_seconds=1"
            );
            let (status, body) = exchange(addr, "GET", &probe, c, "");
            match status {
                429 => assert_eq!(body["error"]["code"], "too_many_waits"),
                200 => settled = false,
                other => panic!("probe answered {other}: {body}"),
            }
        }
        for (c, held) in streams.iter_mut().enumerate() {
            for stream in held.iter_mut() {
                if answered(stream) {
                    *stream = open_wait(addr, c, &operations[c]);
                    reopened += 1;
                    settled = false;
                }
            }
        }
        if settled {
            break;
        }
        assert!(Instant::now() < deadline, "the waits never all opened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let open_took = opened.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let rss_open = rss_kib();
    let (wait_broker, wait_client) = cpu_over(idle);

    // Still waiting: no answer has arrived on any connection.
    assert!(
        !streams.iter().flatten().any(answered),
        "a wait answered while idle"
    );
    // And live: one change answers every wait on that operation at once.
    let changed = Instant::now();
    let (status, record) = exchange(
        addr,
        "POST",
        &format!("/api/agent/v1/operations/{}/cancel", operations[0]),
        0,
        "",
    );
    assert_eq!((status, &record["revision"]), (200, &json!(2)), "{record}");
    for stream in &mut streams[0] {
        let (status, record) = read_response(stream);
        assert_eq!((status, &record["revision"]), (200, &json!(2)), "{record}");
    }
    let woke = changed.elapsed();
    drop(streams);

    let per_second = |d: Duration| d.as_secs_f64() / idle.as_secs_f64();
    println!(
        "opened {waits} waits in {open_took:.2?} (each client's 33rd refused with 429 \
         too_many_waits; {reopened} refused during the probes and opened again)"
    );
    println!(
        "broker CPU over {idle:?} idle: no waits {:.2?} ({:.3}% of a core); {waits} waits {:.2?} \
         ({:.3}% of a core)",
        base_broker,
        100.0 * per_second(base_broker),
        wait_broker,
        100.0 * per_second(wait_broker)
    );
    let extra = wait_broker.as_nanos() as f64 - base_broker.as_nanos() as f64;
    println!(
        "broker CPU per idle wait: {:.1} ns per second of waiting (difference; noise-level if ≤ 0); \
         client thread {base_client:.2?} / {wait_client:.2?}",
        extra / waits as f64 / idle.as_secs_f64()
    );
    println!(
        "RSS {rss_before} KiB -> {rss_open} KiB with {waits} waits open: {:.1} KiB per wait \
         (both ends of each connection)",
        (rss_open as f64 - rss_before as f64) / waits as f64
    );
    println!("a change answered its operation's {MAX_WAITS_PER_CLIENT} waits in {woke:.2?}");
    runtime.block_on(broker.shutdown());
}
