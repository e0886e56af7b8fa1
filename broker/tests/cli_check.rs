//! The real `admission` binary: exit codes, the effective-limits table, the store-cap warning, and
//! the `defaults | check` round trip.

use std::path::{Path, PathBuf};

use assert_cmd::Command;

fn admission() -> Command {
    Command::cargo_bin("admission").unwrap()
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quota.json")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(args: &[&str]) -> Run {
    let output = admission().args(args).output().unwrap();
    Run {
        code: output.status.code().unwrap(),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

fn write(dir: &Path, name: &str, contents: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn check_accepts_the_shipped_example_and_prints_every_identity() {
    let out = run(&[
        "check",
        "--identities",
        "automation-a,bot-7",
        example().to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    let rows: Vec<Vec<&str>> = out
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
        [
            "identity",
            "requests_per_window",
            "window_seconds",
            "active",
            "pending",
            "source"
        ]
    );
    assert_eq!(
        rows[1],
        ["automation-a", "600", "60", "100", "5", "override"]
    );
    assert_eq!(rows[2], ["bot-7", "60", "60", "25", "10", "default"]);
    assert!(out.stdout.contains("global_active     512"));
    assert!(out.stdout.contains("global_executing  64"));
}

#[test]
fn identities_may_be_repeated_and_come_from_a_secrets_file() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = write(dir.path(), "secrets", "# clients\nci-runner = abc\n");
    let out = run(&[
        "check",
        "--identities",
        "automation-a",
        "--identities",
        "bot-7",
        "--secrets",
        &secrets,
        example().to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for name in ["automation-a", "bot-7", "ci-runner"] {
        assert!(
            out.stdout.contains(name),
            "{name} missing from {}",
            out.stdout
        );
    }
    assert!(!out.stdout.contains("abc"));
}

#[test]
fn check_without_identities_refuses_any_override() {
    let out = run(&["check", example().to_str().unwrap()]);
    assert_eq!(out.code, 1);
    assert!(out.stderr.starts_with("error: "), "{}", out.stderr);
    assert!(
        out.stderr.contains("clients.automation-a"),
        "{}",
        out.stderr
    );
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
}

#[test]
fn an_invalid_file_exits_1_with_a_one_line_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "quota.json",
        r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
           "client_pending": 10, "global_active": 512, "global_executing": 64,
           "clients": {"bot-7": {"requests_per_window": 5, "window_seconds": 60,
                                 "active": 8, "pending": 12}}}"#,
    );
    let out = run(&["check", "--identities", "bot-7", &file]);
    assert_eq!(out.code, 1);
    assert_eq!(
        out.stderr,
        format!("error: {file}: clients.bot-7.pending: 12 is above active 8\n")
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn an_unusable_path_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.json");
    for path in [
        "relative.json",
        "/etc/./x.json",
        missing.to_str().unwrap(),
        dir.path().to_str().unwrap(),
    ] {
        let out = run(&["check", path]);
        assert_eq!(out.code, 1, "{path}: {}", out.stderr);
        assert!(out.stderr.starts_with("error: "), "{}", out.stderr);
    }
}

#[test]
fn an_invalid_secrets_file_exits_1_without_showing_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = write(dir.path(), "secrets", "bot-7 = hunter2\nbot-7 = hunter3\n");
    let out = run(&["check", "--secrets", &secrets, example().to_str().unwrap()]);
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("line 2"), "{}", out.stderr);
    assert!(!out.stderr.contains("hunter"), "{}", out.stderr);
}

#[test]
fn usage_errors_exit_2() {
    let example = example();
    let example = example.to_str().unwrap();
    for args in [
        vec!["check"],
        vec!["check", "--bogus", example],
        vec!["check", "--identities", "bad name", example],
        vec!["check", "--identities", "a,,b", example],
        vec!["frobnicate"],
        vec![],
    ] {
        let out = run(&args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
    }
}

#[test]
fn a_pending_limit_above_the_grant_store_cap_warns_but_passes() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "quota.json",
        r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
           "client_pending": 10, "global_active": 512, "global_executing": 64,
           "clients": {"bot-7": {"requests_per_window": 5, "window_seconds": 60,
                                 "active": 20, "pending": 15}}}"#,
    );
    let out = run(&["check", "--identities", "bot-7", &file]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .starts_with("warning: clients.bot-7.pending: 15 is above"),
        "{}",
        out.stderr
    );
}

#[test]
fn defaults_prints_a_file_that_check_accepts() {
    let defaults = run(&["defaults"]);
    assert_eq!(defaults.code, 0);
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "quota.json", &defaults.stdout);
    let out = run(&["check", "--identities", "bot-7", &file]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    let bot: Vec<&str> = out
        .stdout
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(bot, ["bot-7", "60", "60", "25", "10", "default"]);
}

/// Output that cannot be written (`admission defaults > quota.json` on a full disk) is an error
/// that says so, exit 1, never a panic.
#[test]
fn output_that_cannot_be_written_exits_1_saying_why() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped: /dev/full is not available here");
        return;
    };
    let example = example();
    for args in [
        vec!["defaults"],
        vec![
            "check",
            "--identities",
            "automation-a,bot-7",
            example.to_str().unwrap(),
        ],
    ] {
        let output = std::process::Command::new(assert_cmd::cargo::cargo_bin("admission"))
            .args(&args)
            .stdout(full.try_clone().unwrap())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: cannot write to stdout: "),
            "{args:?}: {stderr}"
        );
    }
}

/// The shipped example's top level and `automation-a`'s override (`active` 100), with `fair_share`
/// set to `section`.
fn with_fair_share(section: &str) -> String {
    format!(
        r#"{{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
           "client_pending": 10, "global_active": 512, "global_executing": 64,
           "clients": {{"automation-a": {{"requests_per_window": 600, "window_seconds": 60,
                                          "active": 100, "pending": 5}}}},
           "fair_share": {section}}}"#
    )
}

#[test]
fn check_prints_each_pools_reserve_floor_and_shared_part_when_the_file_has_a_fair_share() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "quota.json",
        &with_fair_share(
            r#"{"active": {"reserve": 32, "floor": 2}, "executing": {"reserve": 4, "floor": 1}}"#,
        ),
    );
    let out = run(&["check", "--identities", "automation-a,bot-7", &file]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        [
            "identity      requests_per_window  window_seconds  active  pending  source",
            "automation-a  600                  60              100     5        override",
            "bot-7         60                   60              25      10       default",
            "",
            "pool              limit  reserve  floor  shared",
            "global_active     512    32       2      480",
            "global_executing  64     4        1      60",
            "(fair_share: a client holding fewer than its pool's floor may take any free slot; \
             the others divide the shared part among the clients holding in the pool)",
        ]
    );
}

#[test]
fn check_says_the_pools_are_first_come_first_served_when_the_file_has_no_fair_share() {
    let out = run(&[
        "check",
        "--identities",
        "automation-a,bot-7",
        example().to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let pools: Vec<&str> = out.stdout.lines().skip_while(|l| !l.is_empty()).collect();
    assert_eq!(
        pools,
        [
            "",
            "pool              limit",
            "global_active     512",
            "global_executing  64",
            "(no fair_share: the global pools are first come, first served)",
        ]
    );
}

#[test]
fn an_invalid_fair_share_exits_1_with_a_one_line_error_naming_the_file_and_the_json_path() {
    let dir = tempfile::tempdir().unwrap();
    for (section, error) in [
        (
            r#"{"active": {"reserve": 32, "floor": 2}, "executing": {"reserve": 64, "floor": 1}}"#,
            "fair_share.executing.reserve: 64 is not below global_executing 64",
        ),
        (
            r#"{"active": {"reserve": 32, "floor": 26}, "executing": {"reserve": 4, "floor": 1}}"#,
            "fair_share.active.floor: 26 is above client_active 25; that client would always \
             count as small",
        ),
        (
            r#"{"active": {"reserve": 32}, "executing": {"reserve": 4, "floor": 1}}"#,
            "fair_share.active.floor: missing required field; a pool's entry needs both reserve \
             and floor",
        ),
        (
            r#"{"active": {"reserve": 32, "floor": 2}, "executing": {"reserve": 4, "floor": 0}}"#,
            "fair_share.executing.floor: 0 is not allowed; a floor is a positive integer",
        ),
        (
            r#"{"active": {"reserve": 32, "floor": 2}}"#,
            "fair_share.executing: missing required field; fair_share needs both pools, active \
             and executing",
        ),
    ] {
        let file = write(dir.path(), "quota.json", &with_fair_share(section));
        let out = run(&["check", "--identities", "automation-a,bot-7", &file]);
        assert_eq!(out.code, 1, "{section}: {}", out.stdout);
        assert_eq!(out.stderr, format!("error: {file}: {error}\n"), "{section}");
        assert!(out.stdout.is_empty(), "{section}: {}", out.stdout);
    }
}
