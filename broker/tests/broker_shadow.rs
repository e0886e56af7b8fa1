//! Shadow quota files against the real `admission serve`: the real answers are the same with a
//! shadow file as without, the shadow's verdicts are what the candidate as the real file decides
//! on the same sequence (a stricter and a looser candidate, each run both ways), `SIGHUP`
//! re-reads both files, and `admission check --history` on the store a run wrote refuses what
//! `serve` with the candidate as the real file refuses. Bad input to both new options is refused
//! with its reason and creates nothing.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::eventually::eventually;
use support::http::{Reply, request};
use support::secrets::{AGENT, AGENT_SECRET, OTHER, OTHER_SECRET};
use support::serve::{Files, Server, run_to_end};

/// Nothing binds on the sequence below.
const LOOSE: &str = r#"{"requests_per_window": 1000, "window_seconds": 3600, "client_active": 5,
  "client_pending": 3, "global_active": 100, "global_executing": 10}"#;

/// One pending request per client and five submissions an hour: binds twice on the sequence.
const STRICT: &str = r#"{"requests_per_window": 5, "window_seconds": 3600, "client_active": 5,
  "client_pending": 1, "global_active": 100, "global_executing": 10}"#;

/// One step of the sequence every run replays.
enum Step {
    /// A client submits a request needing approval under this key.
    Submit(&'static str, &'static str),
    /// The agent cancels its request with this key, if it was created.
    Cancel(&'static str),
    /// The operator approves the request with this key, if it was created (it then executes
    /// for a minute: past the test's end).
    Approve(&'static str),
}

use Step::{Approve, Cancel, Submit};

const SEQUENCE: [Step; 13] = [
    Submit(AGENT, "a"),
    Submit(AGENT, "b"),
    Cancel("a"),
    Submit(AGENT, "c"),
    Submit(OTHER, "o1"),
    Approve("c"),
    Submit(AGENT, "d"),
    Cancel("d"),
    Submit(AGENT, "e"),
    Cancel("e"),
    Submit(AGENT, "f"),
    Cancel("f"),
    Submit(AGENT, "g"),
];

/// The answer to each submission: (client, key, status, refusal code).
type Answers = Vec<(&'static str, &'static str, u16, Option<String>)>;

fn secret(client: &str) -> &'static str {
    if client == AGENT {
        AGENT_SECRET
    } else {
        OTHER_SECRET
    }
}

async fn play(server: &Server) -> Answers {
    let mut answers = Vec::new();
    let mut created = std::collections::HashMap::new();
    for step in &SEQUENCE {
        match *step {
            Submit(client, key) => {
                let Reply { status, body, .. } = server
                    .submit(secret(client), &request(key, "demo.request", 60_000))
                    .await;
                if status == 202 {
                    created.insert(key, body["id"].as_str().unwrap().to_owned());
                }
                let code = body["error"]["code"].as_str().map(str::to_owned);
                answers.push((client, key, status, code));
            }
            Cancel(key) => {
                if let Some(id) = created.get(key) {
                    let path = format!("/api/agent/v1/operations/{id}/cancel");
                    assert_eq!(server.post(&path, AGENT_SECRET).await.status, 200);
                }
            }
            Approve(key) => {
                if let Some(id) = created.get(key) {
                    let reply = server.operator.approve(id).await;
                    assert_eq!(reply.status, 200, "{}", reply.body);
                }
            }
        }
    }
    answers
}

/// The quota file, the shadow file (if any) and the flags naming them with the other files.
struct Setup {
    files: Files,
    shadow: PathBuf,
    args: Vec<String>,
}

fn setup(dir: &Path, real: &str, shadow: Option<&str>) -> Setup {
    let files = Files::write(dir, real);
    let shadow_path = dir.join("shadow.json");
    let mut args = files.args();
    if let Some(limits) = shadow {
        std::fs::write(&shadow_path, limits).unwrap();
        args.extend(["--shadow-config".to_owned(), path_arg(&shadow_path)]);
    }
    Setup {
        files,
        shadow: shadow_path,
        args,
    }
}

fn path_arg(path: &Path) -> String {
    path.to_str().unwrap().to_owned()
}

const CODES: [&str; 3] = [
    "submission_rate_limited",
    "client_pending_limit",
    "client_operation_limit",
];

/// Per client: admitted, then refusals by each of [`CODES`], from the series `family`
/// (`admission_client_requests_total` for the real decisions, `admission_shadow_decisions_total`
/// for the shadow's; their admitted results are `accepted` and `admitted`).
async fn decisions(server: &Server, family: &str, admitted: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for client in [AGENT, OTHER] {
        let series = format!(r#"{family}{{client="{client}",result="{admitted}",code="none"}}"#);
        let count = server.metric(&series).await.unwrap_or(0);
        out.push((format!("{client} admitted"), count));
        for code in CODES {
            let series =
                format!(r#"{family}{{client="{client}",result="rejected",code="{code}"}}"#);
            let count = server.metric(&series).await.unwrap_or(0);
            out.push((format!("{client} {code}"), count));
        }
    }
    out
}

/// The real decisions, by client and result.
async fn real_decisions(server: &Server) -> Vec<(String, u64)> {
    decisions(server, "admission_client_requests_total", "accepted").await
}

/// The shadow's verdicts, by client and result.
async fn shadow_decisions(server: &Server) -> Vec<(String, u64)> {
    decisions(server, "admission_shadow_decisions_total", "admitted").await
}

fn refusals(answers: &Answers) -> Vec<(String, String)> {
    answers
        .iter()
        .filter(|(.., status, _)| *status != 202)
        .map(|(client, _, _, code)| (client.to_string(), code.clone().unwrap_or_default()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stricter_shadow_changes_no_answer_and_counts_what_the_candidate_would_refuse() {
    // The candidate as the real file, on the same sequence.
    let dir = tempfile::tempdir().unwrap();
    let candidate = Server::spawn(None, &setup(dir.path(), STRICT, None).args);
    let candidate_answers = play(&candidate).await;
    assert_eq!(
        refusals(&candidate_answers),
        [
            (AGENT.to_owned(), "client_pending_limit".to_owned()),
            (AGENT.to_owned(), "submission_rate_limited".to_owned()),
        ],
        "the sequence makes the strict file bind twice"
    );
    let candidate_decisions = real_decisions(&candidate).await;
    drop(candidate);

    // The loose file alone, then with the strict one as its shadow.
    let dir = tempfile::tempdir().unwrap();
    let alone = Server::spawn(None, &setup(dir.path(), LOOSE, None).args);
    let alone_answers = play(&alone).await;
    let not_found = alone.operator.get("/admission/v1/shadow").await;
    assert_eq!(not_found.status, 404, "{}", not_found.body);
    drop(alone);
    let dir = tempfile::tempdir().unwrap();
    let shadowed = Server::spawn(None, &setup(dir.path(), LOOSE, Some(STRICT)).args);
    let shadowed_answers = play(&shadowed).await;

    assert!(refusals(&alone_answers).is_empty(), "{alone_answers:?}");
    assert_eq!(
        shadowed_answers, alone_answers,
        "the shadow changes no answer"
    );
    assert_eq!(shadow_decisions(&shadowed).await, candidate_decisions);

    let Reply { status, body, .. } = shadowed.operator.get("/admission/v1/shadow").await;
    assert_eq!(status, 200, "{body}");
    let agent = client_of(&body, AGENT);
    assert_eq!(
        agent["refused"],
        serde_json::json!({"client_pending_limit": 1, "submission_rate_limited": 1})
    );
    assert_eq!(agent["admitted"], 5);
    assert_eq!(agent["first_refusal"]["code"], "client_pending_limit");
    assert_eq!(
        agent["peaks"]["pending"],
        serde_json::json!({"limit": 1, "peak": 1})
    );
    assert_eq!(
        agent["peaks"]["requests_per_window"],
        serde_json::json!({"limit": 5, "peak": 5})
    );
    // c starts on the executor's own time: the shadow follows it there.
    assert!(
        eventually(async || {
            let report = shadowed.operator.get("/admission/v1/shadow").await.body;
            client_of(&report, AGENT)["peaks"]["executing"]["peak"] == 1
        })
        .await,
        "c executes in the shadow too"
    );
    assert_eq!(client_of(&body, OTHER)["refused"], serde_json::json!({}));
    assert!(
        body["since"].is_string() && body["refused_any"] == true,
        "{body}"
    );
    let logged = shadowed.logged();
    let first_refusals: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains("would refuse this client"))
        .collect();
    assert_eq!(first_refusals.len(), 1, "one line, at the first: {logged}");
    assert!(
        first_refusals[0].contains("client_pending_limit"),
        "{logged}"
    );
}

fn client_of<'a>(report: &'a Value, client: &str) -> &'a Value {
    report["clients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["client"] == client)
        .unwrap_or_else(|| panic!("{client} in {report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looser_shadow_changes_no_answer_and_counts_what_the_candidate_would_admit() {
    let dir = tempfile::tempdir().unwrap();
    let candidate = Server::spawn(None, &setup(dir.path(), LOOSE, None).args);
    play(&candidate).await;
    let candidate_decisions = real_decisions(&candidate).await;
    drop(candidate);

    let dir = tempfile::tempdir().unwrap();
    let alone = Server::spawn(None, &setup(dir.path(), STRICT, None).args);
    let alone_answers = play(&alone).await;
    drop(alone);
    let dir = tempfile::tempdir().unwrap();
    let shadowed = Server::spawn(None, &setup(dir.path(), STRICT, Some(LOOSE)).args);
    let shadowed_answers = play(&shadowed).await;

    assert_eq!(refusals(&alone_answers).len(), 2, "{alone_answers:?}");
    assert_eq!(
        shadowed_answers, alone_answers,
        "the shadow changes no answer"
    );
    assert_eq!(shadow_decisions(&shadowed).await, candidate_decisions);
    let Reply { body, .. } = shadowed.operator.get("/admission/v1/shadow").await;
    assert_eq!(body["refused_any"], false, "{body}");
    assert_eq!(client_of(&body, AGENT)["admitted"], 7, "{body}");
    assert!(!shadowed.logged().contains("would refuse this client"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_swaps_the_real_and_the_shadow_file_and_keeps_the_old_shadow_on_an_invalid_one() {
    let dir = tempfile::tempdir().unwrap();
    let Setup {
        files,
        shadow,
        args,
    } = setup(dir.path(), LOOSE, Some(STRICT));
    let server = Server::spawn(None, &args);
    let submit = async |key: &str| {
        server
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await
    };
    let pending_refusals = async || {
        server
            .metric(
                r#"admission_shadow_decisions_total{client="agent",result="rejected",code="client_pending_limit"}"#,
            )
            .await
    };
    let shadow_admitted = async || {
        server
            .metric(
                r#"admission_shadow_decisions_total{client="agent",result="admitted",code="none"}"#,
            )
            .await
    };
    assert_eq!(submit("a").await.status, 202);
    assert_eq!(submit("b").await.status, 202);
    assert_eq!(
        pending_refusals().await,
        Some(1),
        "the strict shadow refuses b"
    );

    // The two files trade places.
    std::fs::write(&files.config, STRICT).unwrap();
    std::fs::write(&shadow, LOOSE).unwrap();
    server.sighup();
    let applied = async |family: &str| {
        server
            .metric(&format!(r#"{family}{{result="applied"}}"#))
            .await
    };
    assert!(
        eventually(async || {
            applied("admission_config_reloads_total").await == Some(1)
                && applied("admission_shadow_config_reloads_total").await == Some(1)
        })
        .await
    );
    let Reply { status, body, .. } = submit("c").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("client_pending_limit")),
        "the real file is the strict one now"
    );
    assert_eq!(
        shadow_admitted().await,
        Some(2),
        "the loose shadow admits c"
    );
    assert_eq!(pending_refusals().await, Some(1));

    // An invalid shadow file: rejected, counted, the loose shadow stays.
    std::fs::write(&shadow, r#"{"requests_per_window": 1}"#).unwrap();
    server.sighup();
    assert!(
        eventually(async || {
            server
                .metric(r#"admission_shadow_config_reloads_total{result="rejected"}"#)
                .await
                == Some(1)
        })
        .await
    );
    assert_eq!(submit("d").await.status, 429);
    assert_eq!(shadow_admitted().await, Some(3), "still the loose shadow");
    assert!(
        server.logged().contains("shadow admission config rejected"),
        "{}",
        server.logged()
    );
}

/// `admission check` with `args`: exit code, stdout, stderr.
fn check(args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_admission"))
        .arg("check")
        .args(args)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_history_refuses_what_serve_with_the_candidate_refuses_on_the_same_submissions() {
    // The history: the sequence under the loose file, which admits all of it.
    let dir = tempfile::tempdir().unwrap();
    let Setup { files, .. } = setup(dir.path(), LOOSE, None);
    let mut server = Server::spawn(None, &files.args());
    let stored = play(&server).await;
    assert!(refusals(&stored).is_empty(), "every submission is stored");
    let strict = dir.path().join("strict.json");
    std::fs::write(&strict, STRICT).unwrap();
    // Read beside the serving broker (no lock taken), and again once it has stopped.
    let (code, while_serving, stderr) =
        check(&["--history", &path_arg(&files.data), &path_arg(&strict)]);
    assert_eq!(code, Some(3), "{while_serving}{stderr}");
    server.sigterm();
    assert!(eventually(async || !server.is_alive()).await);
    drop(server);

    // The same submissions to `serve` with the candidate as the real file.
    let replay_dir = tempfile::tempdir().unwrap();
    let candidate = Server::spawn(None, &setup(replay_dir.path(), STRICT, None).args);
    let served = refusals(&play(&candidate).await);
    drop(candidate);

    let (code, stdout, stderr) = check(&["--history", &path_arg(&files.data), &path_arg(&strict)]);
    assert_eq!(code, Some(3), "{stdout}{stderr}");
    assert_eq!(judged(&while_serving), judged(&stdout));
    assert_eq!(judged(&stdout), served, "{stdout}");
    assert!(stdout.contains("replayed 8 stored operations"), "{stdout}");
    assert!(
        stdout.contains("client agent: admitted 5, refused 2"),
        "{stdout}"
    );

    // The loose file would refuse none of it.
    let loose = dir.path().join("loose.json");
    std::fs::write(&loose, LOOSE).unwrap();
    let (code, stdout, stderr) = check(&["--history", &path_arg(&files.data), &path_arg(&loose)]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.ends_with("the candidate would refuse nothing\n"),
        "{stdout}"
    );
}

/// The `would refuse CLIENT at TIME: CODE` lines of a `check --history` report.
fn judged(report: &str) -> Vec<(String, String)> {
    report
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("would refuse ")?;
            let (client, rest) = rest.split_once(" at ")?;
            let (_, code) = rest.rsplit_once(": ")?;
            Some((client.to_owned(), code.to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_history_reads_a_postgresql_store_as_it_reads_a_data_dir() {
    let Some(postgres) = support::postgres::PostgresServer::shared() else {
        return;
    };
    let url = postgres.database("shadow_history");
    let dir = tempfile::tempdir().unwrap();
    let Setup { files, .. } = setup(dir.path(), LOOSE, None);
    let mut args = files.args();
    args.extend(["--store".to_owned(), url.clone()]);
    let mut server = Server::spawn(None, &args);
    assert!(refusals(&play(&server).await).is_empty());
    server.sigterm();
    assert!(eventually(async || !server.is_alive()).await);
    drop(server);

    let strict = dir.path().join("strict.json");
    std::fs::write(&strict, STRICT).unwrap();
    let (code, stdout, stderr) = check(&["--history", &url, &path_arg(&strict)]);
    assert_eq!(code, Some(3), "{stdout}{stderr}");
    assert_eq!(
        judged(&stdout),
        [
            (AGENT.to_owned(), "client_pending_limit".to_owned()),
            (AGENT.to_owned(), "submission_rate_limited".to_owned()),
        ],
        "what the data dir's history gives: {stdout}"
    );
    assert!(stdout.contains("replayed 8 stored operations"), "{stdout}");
}

#[test]
fn check_history_refuses_bad_input_with_its_reason_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let candidate = dir.path().join("candidate.json");
    std::fs::write(&candidate, LOOSE).unwrap();
    let missing = dir.path().join("no-such-dir");

    let (code, _, stderr) = check(&["--history", &path_arg(&missing), &path_arg(&candidate)]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: --history: ") && stderr.contains("no store here"),
        "{stderr}"
    );
    assert!(!missing.exists(), "no data dir is made");

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, _, stderr) = check(&["--history", &path_arg(&empty), &path_arg(&candidate)]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("no store here"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(&empty).unwrap().count(),
        0,
        "no store is made"
    );

    let (code, _, stderr) = check(&[
        "--history",
        "mysql://ops:hunter2@db/fleet",
        &path_arg(&candidate),
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("not a store location"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");

    // The candidate's own rules come first: a relative path.
    let (code, _, stderr) = check(&["--history", &path_arg(&empty), "candidate.json"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains("absolute"),
        "{stderr}"
    );

    // No value.
    let (code, _, stderr) = check(&["--history"]);
    assert_eq!(code, Some(2), "{stderr}");
}

#[test]
fn serve_refuses_a_bad_shadow_config_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let Setup { files, .. } = setup(dir.path(), LOOSE, None);
    let with_shadow = |shadow: &str| {
        let mut args = files.args();
        args.extend(["--shadow-config".to_owned(), shadow.to_owned()]);
        run_to_end(&args)
    };

    // Path rules, checked before anything is created.
    for (shadow, reason) in [
        ("shadow.json".to_owned(), "absolute"),
        ("/etc/./shadow.json".to_owned(), "normalized"),
        (path_arg(&dir.path().join("missing.json")), "no such file"),
    ] {
        let exit = with_shadow(&shadow);
        assert_eq!(exit.code, Some(1), "{shadow}: {}", exit.stderr);
        assert!(
            exit.stderr.starts_with("error: --shadow-config: ") && exit.stderr.contains(reason),
            "{shadow}: {}",
            exit.stderr
        );
        assert!(!files.data.exists(), "{shadow}: no data dir is made");
    }

    // The same rules as --admission-config: pending above active.
    let shadow = dir.path().join("shadow.json");
    std::fs::write(
        &shadow,
        r#"{"requests_per_window": 10, "window_seconds": 60, "client_active": 1,
            "client_pending": 2, "global_active": 100, "global_executing": 1}"#,
    )
    .unwrap();
    let identities = [AGENT, OTHER].map(|n| unyolo_admission::Identity::new(n).unwrap());
    let expected = unyolo_admission::Config::from_path(&shadow, identities)
        .unwrap_err()
        .to_string();
    let exit = with_shadow(&path_arg(&shadow));
    assert_eq!(exit.code, Some(1), "{}", exit.stderr);
    assert_eq!(
        exit.stderr.trim_end(),
        format!("error: --shadow-config: {expected}")
    );
    assert!(!exit.stdout.contains("listening on"), "{}", exit.stdout);
}
