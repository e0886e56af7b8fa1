//! The operators' secrets (SPEC sections 6 and 8): `--operator-secrets FILE` holds `name =
//! secret` lines; `admission serve` refuses a bad file at start-up with the line and the problem,
//! refuses an operator secret that is also a client's (naming both files, never the secret),
//! generates a file with an operator `operator` when none is given, and reads the one-line file
//! of an earlier release as operator `operator`.

mod support;

use support::eventually::assert_eventually;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, operators, secrets};
use support::serve::{Files, Server, run_to_end};
use unyolo_admission::config::Operators;
use unyolo_admission::config::secrets::LineProblem;

const LIMITS: &str = r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

/// A client secret long enough to be an operator's too.
const LONG_CLIENT_SECRET: &str = "a-client-secret-long-enough-for-an-operator";

#[test]
fn an_operator_secret_equal_to_a_client_secret_stops_serve_naming_the_files_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    std::fs::write(
        &files.secrets,
        format!("agent = {AGENT_SECRET}\nother = {LONG_CLIENT_SECRET}\n"),
    )
    .unwrap();
    std::fs::write(
        &files.operator,
        format!("# operators\nada = {OPERATOR_SECRET}\nbob = {LONG_CLIENT_SECRET}\n"),
    )
    .unwrap();
    let out = run_to_end(&files.args());
    assert_eq!(out.code, Some(1));
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert!(!stdout.contains("listening on"), "{stdout}");
    assert!(
        stderr.contains(files.operator.to_str().unwrap()),
        "{stderr}"
    );
    assert!(stderr.contains("line 3"), "{stderr}");
    assert!(stderr.contains(files.secrets.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("`other`"), "{stderr}");
    for secret in [LONG_CLIENT_SECRET, AGENT_SECRET, OPERATOR_SECRET] {
        assert!(!stderr.contains(secret) && !stdout.contains(secret));
    }
    // Nothing was started: no store was created.
    assert!(!files.data.join("admission.sqlite3").exists());
}

#[test]
fn each_rule_of_the_operator_secrets_file_stops_serve_with_its_line() {
    let short = "s3cret-too-short";
    let good = "s3cret-0123456789abcdef0123456789";
    let cases = [
        (format!("ada = {short}\n"), 1, "at least 32 bytes"),
        (
            format!("ada = {good}\nada = {good}-2\n"),
            2,
            "already defined",
        ),
        (
            format!("ada = {good}\nbob = {good}\n"),
            2,
            "same as on line 1",
        ),
        (format!("# c\n\n = {good}\n"), 3, "1 to 200 bytes"),
        (
            format!("{} = {good}\n", "n".repeat(201)),
            1,
            "1 to 200 bytes",
        ),
        ("ada\n".to_owned(), 1, "expected `name = secret`"),
        ("ada =\n".to_owned(), 1, "the secret is empty"),
        (format!("ada = {good}\u{1b}x\n"), 1, "control character"),
    ];
    for (text, line, problem) in cases {
        let dir = tempfile::tempdir().unwrap();
        let files = Files::write(dir.path(), LIMITS);
        std::fs::write(&files.operator, &text).unwrap();
        let out = run_to_end(&files.args());
        assert_eq!(out.code, Some(1), "{text:?}: {}", out.stderr);
        let expected = format!(
            "error: operator secrets {}: line {line}: ",
            files.operator.display()
        );
        assert!(
            out.stderr.starts_with(&expected) && out.stderr.contains(problem),
            "{text:?}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("s3cret"), "{}", out.stderr);
        assert!(!files.data.join("admission.sqlite3").exists());
    }
}

#[test]
fn operator_names_are_people_or_handles_and_their_secrets_are_never_shown() {
    let parsed = operators();
    assert_eq!(
        parsed.names().collect::<Vec<_>>(),
        ["operator", "Grace Hopper"]
    );
    assert_eq!(
        parsed.identify(OPERATOR_SECRET.as_bytes()),
        Some("operator")
    );
    assert_eq!(parsed.identify(b"operator-secret"), None);
    let debug = format!("{parsed:?}");
    assert!(!debug.contains(OPERATOR_SECRET) && debug.contains("redacted"));
    let err = Operators::parse("ada = short\n").unwrap_err();
    assert_eq!(err.problem(), Some(&LineProblem::ShortSecret { bytes: 5 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_releases_one_line_operator_secret_is_read_as_operator_operator() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let legacy = "sk_0123456789abcdef0123456789abcdef";
    std::fs::write(data.join("operator-secret"), format!("{legacy}\n")).unwrap();
    std::fs::write(dir.path().join("secrets"), support::secrets::secrets_file()).unwrap();
    let server = Server::spawn(
        None,
        &[
            "--data",
            data.to_str().unwrap(),
            "--secrets",
            dir.path().join("secrets").to_str().unwrap(),
        ],
    );
    assert!(
        server
            .stdout
            .contains("an earlier release's one-line file, read as operator `operator`"),
        "{}",
        server.stdout
    );
    assert!(!server.stdout.contains(legacy));
    assert!(!data.join("operator-secrets").exists(), "nothing generated");
    let created = server
        .submit(
            AGENT_SECRET,
            &support::http::request("legacy", "demo.request", 0),
        )
        .await;
    let denied = server
        .operator
        .with_secret(legacy)
        .deny(&created.id())
        .await;
    assert_eq!(denied.status, 200, "{}", denied.body);
    assert_eq!(denied.body["decided_by"], "operator");
    drop(server);

    // One too short for today's rules stops serve, saying what to do.
    std::fs::write(data.join("operator-secret"), "short-legacy-secret\n").unwrap();
    let out = run_to_end(&[
        "--data",
        data.to_str().unwrap(),
        "--secrets",
        dir.path().join("secrets").to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("at least 32 bytes") && out.stderr.contains("operator-secrets"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("short-legacy-secret"));
}

#[test]
fn an_embedder_gets_the_collision_as_an_error_naming_the_client() {
    use unyolo_admission::config::Secrets;
    use unyolo_admission_broker::{Broker, BrokerError, BrokerSettings};
    let dir = tempfile::tempdir().unwrap();
    let clients = Secrets::parse(&format!("agent = {LONG_CLIENT_SECRET}\n")).unwrap();
    let settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().to_owned(),
        clients,
        Operators::single("ada", LONG_CLIENT_SECRET).unwrap(),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let err = runtime.block_on(Broker::start(settings)).unwrap_err();
    assert!(
        matches!(&err, BrokerError::SharedSecret(client) if client.as_str() == "agent"),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("`agent`") && !message.contains(LONG_CLIENT_SECRET),
        "{message}"
    );
}

#[test]
fn distinct_secrets_start() {
    use unyolo_admission_broker::BrokerSettings;
    let settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        std::env::temp_dir(),
        secrets(),
        operators(),
    );
    assert!(settings.validate().is_ok());
}

#[test]
fn a_commit_batch_of_zero_is_refused_and_one_commits_each_write_alone() {
    use unyolo_admission_broker::BrokerSettings;
    let settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        std::env::temp_dir(),
        secrets(),
        operators(),
    );
    assert!(settings.commit_batch > 1, "group commit is on by default");
    let alone = BrokerSettings {
        commit_batch: 1,
        ..settings.clone()
    };
    assert!(alone.validate().is_ok());
    let none = BrokerSettings {
        commit_batch: 0,
        ..settings
    };
    let err = none.validate().unwrap_err().to_string();
    assert!(err.contains("commit batch must be at least 1"), "{err}");
}

/// A client secret shorter than unYOLO's agent clients accept (32 bytes: its Go client refuses
/// to send one) starts, with a warning naming the client and the length, never the secret; a
/// long one draws none.
#[tokio::test]
async fn a_client_secret_too_short_for_unyolos_agent_clients_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    std::fs::write(
        &files.secrets,
        format!("agent = {AGENT_SECRET}\nlong = {LONG_CLIENT_SECRET}\n"),
    )
    .unwrap();
    let server = Server::spawn(None, &files.args());
    let warning = format!(
        "client `agent`'s secret is {} bytes; unYOLO's agent clients refuse a credential shorter \
         than 32 bytes",
        AGENT_SECRET.len()
    );
    // Said on stderr once the broker serves; read from there by a thread of the test's own.
    assert_eventually("the warning is logged", async || {
        server.logged().contains(&warning)
    })
    .await;
    let logged = server.logged();
    assert!(!logged.contains("`long`"), "{logged}");
    assert!(!logged.contains(AGENT_SECRET), "{logged}");
    // It serves the short secret all the same (the contract only refuses an empty one).
    let reply = server.get("/api/agent/v1/operations", AGENT_SECRET).await;
    assert_eq!(reply.status, 200);
}
