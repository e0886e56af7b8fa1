//! SPEC section 6, "secrets are distinct": `admission serve` refuses to start when the operator
//! secret is also a client's, naming the files and never the secret.
#![cfg(feature = "broker")]

mod support;

use support::secrets::{AGENT_SECRET, OTHER_SECRET, secrets};
use support::serve::{Files, run_to_end};

const LIMITS: &str = r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

#[test]
fn an_operator_secret_equal_to_a_client_secret_stops_serve_naming_the_files_not_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    std::fs::write(&files.operator, format!("{OTHER_SECRET}\n")).unwrap();
    let out = run_to_end(&files.args());
    assert_eq!(out.code, Some(1));
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert!(!stdout.contains("listening on"), "{stdout}");
    assert!(
        stderr.contains(files.operator.to_str().unwrap()),
        "{stderr}"
    );
    assert!(stderr.contains(files.secrets.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("`other`"), "{stderr}");
    for secret in [OTHER_SECRET, AGENT_SECRET] {
        assert!(!stderr.contains(secret) && !stdout.contains(secret));
    }
    // Nothing was started: no store was created.
    assert!(!files.data.join("admission.sqlite3").exists());
}

#[test]
fn an_embedder_gets_the_collision_as_an_error_naming_the_client() {
    use unyolo_admission::broker::{Broker, BrokerError, BrokerSettings};
    let dir = tempfile::tempdir().unwrap();
    let settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().to_owned(),
        secrets(),
        AGENT_SECRET.to_owned(),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let err = runtime.block_on(Broker::start(settings)).unwrap_err();
    assert!(
        matches!(&err, BrokerError::SharedSecret(client) if client.as_str() == "agent"),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("`agent`") && !message.contains(AGENT_SECRET),
        "{message}"
    );
}

#[test]
fn distinct_secrets_start() {
    use unyolo_admission::broker::BrokerSettings;
    let settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        std::env::temp_dir(),
        secrets(),
        format!("{AGENT_SECRET}-operator"),
    );
    assert!(settings.validate().is_ok());
}
