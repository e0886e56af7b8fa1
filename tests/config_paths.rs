//! Loading a quota file from a path: the path must be absolute and normalized, name an existing
//! regular file, and the file is read with a bound.

use std::path::{Path, PathBuf};

use unyolo_admission::config::{Config, Identity, MAX_FILE_BYTES, Rule, check_path};

const VALID: &str = r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 512, "global_executing": 64}"#;

fn rule_of(path: &str) -> Option<Rule> {
    check_path(Path::new(path)).err().map(|e| e.rule())
}

#[test]
fn a_plain_absolute_path_is_accepted() {
    assert_eq!(rule_of("/etc/admission/quota.json"), None);
    assert_eq!(rule_of("/a/b"), None);
    assert_eq!(rule_of("/a/.hidden/b..c"), None);
}

#[test]
fn a_relative_path_is_refused() {
    assert_eq!(rule_of("a"), Some(Rule::PathNotAbsolute));
    assert_eq!(rule_of("relative.json"), Some(Rule::PathNotAbsolute));
    assert_eq!(rule_of("./a"), Some(Rule::PathNotAbsolute));
    assert_eq!(rule_of(""), Some(Rule::PathNotAbsolute));
}

#[test]
fn a_dot_component_is_refused() {
    assert_eq!(rule_of("/a/./b"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("/etc/./x.json"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("/a/b/."), Some(Rule::PathNotNormalized));
}

#[test]
fn a_dot_dot_component_is_refused() {
    assert_eq!(rule_of("/a/../b"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("/etc/../x.json"), Some(Rule::PathNotNormalized));
}

#[test]
fn a_repeated_separator_is_refused() {
    assert_eq!(rule_of("//a"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("//etc/x.json"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("/etc//x.json"), Some(Rule::PathNotNormalized));
}

#[test]
fn a_trailing_separator_is_refused() {
    assert_eq!(rule_of("/a/"), Some(Rule::PathNotNormalized));
    assert_eq!(rule_of("/etc/x.json/"), Some(Rule::PathNotNormalized));
}

#[test]
fn a_relative_path_error_suggests_the_absolute_one() {
    let err = check_path(Path::new("relative.json")).unwrap_err();
    let absolute = std::env::current_dir().unwrap().join("relative.json");
    assert!(
        err.to_string().contains(&absolute.display().to_string()),
        "{err}"
    );
}

/// The path a relative path's error suggests is one `check_path` accepts: `..` resolved by
/// name, `.` and a trailing separator dropped.
#[test]
fn a_relative_path_error_suggests_only_a_path_that_would_pass() {
    let cwd = std::env::current_dir().unwrap();
    for (given, meant) in [
        ("../x.json", cwd.parent().unwrap().join("x.json")),
        ("a/../x.json", cwd.join("x.json")),
        ("x.json/", cwd.join("x.json")),
        ("./a//x.json", cwd.join("a").join("x.json")),
    ] {
        let message = check_path(Path::new(given)).unwrap_err().to_string();
        let hint = format!("(did you mean {}?)", meant.display());
        assert!(message.contains(&hint), "{given}: {message}");
        assert!(check_path(&meant).is_ok(), "{given}: {meant:?}");
    }
}

fn write(dir: &Path, name: &str, contents: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn a_valid_file_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "quota.json", VALID.as_bytes());
    let config = Config::from_path(&path, [Identity::new("bot-7").unwrap()]).unwrap();
    assert_eq!(config.limits().global_active, 512);
}

#[test]
fn a_missing_file_is_reported_as_missing() {
    let dir = tempfile::tempdir().unwrap();
    let err = Config::from_path(&dir.path().join("absent.json"), []).unwrap_err();
    assert_eq!(err.rule(), Rule::FileNotFound);
}

#[test]
fn a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = Config::from_path(dir.path(), []).unwrap_err();
    assert_eq!(err.rule(), Rule::IsDirectory);
}

#[test]
fn a_file_of_exactly_65536_bytes_loads_and_one_more_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pad = |n: usize| format!("{VALID}{}", " ".repeat(n - VALID.len()));
    let exact = write(dir.path(), "exact.json", pad(MAX_FILE_BYTES).as_bytes());
    assert!(Config::from_path(&exact, []).is_ok());
    let over = write(dir.path(), "over.json", pad(MAX_FILE_BYTES + 1).as_bytes());
    let err = Config::from_path(&over, []).unwrap_err();
    assert_eq!(err.rule(), Rule::FileTooLarge);
}

/// A named pipe would block the open until a writer came (hanging `check`, and a reload's
/// signal handling with it): it is refused by its type, at once, saying what it is.
#[test]
fn a_named_pipe_is_refused_without_waiting_for_a_writer() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("quota.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|status| status.success()) {
        eprintln!("skipped: mkfifo is not available here");
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || tx.send(Config::from_path(&path, []).map(|_| ())));
    // Generous: only a hang (the open waiting for a writer) takes anywhere near this long.
    let answer = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the read waited for a writer");
    let err = answer.unwrap_err();
    assert_eq!(err.rule(), Rule::Unreadable);
    assert!(
        err.to_string()
            .contains("is a named pipe (FIFO), not a file"),
        "{err}"
    );
}

#[test]
fn an_endless_file_is_refused_without_reading_it_all() {
    let err = Config::from_path(Path::new("/dev/zero"), []).unwrap_err();
    assert_eq!(err.rule(), Rule::FileTooLarge);
}

#[test]
fn a_contents_error_names_the_file_and_the_json_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "quota.json",
        VALID.replace("512", "0").as_bytes(),
    );
    let err = Config::from_path(&path, []).unwrap_err();
    assert_eq!((err.path(), err.rule()), ("global_active", Rule::Zero));
    assert_eq!(err.file(), Some(path.as_path()));
    assert!(
        err.to_string()
            .starts_with(&format!("{}: global_active: ", path.display())),
        "{err}"
    );
}

/// An absolute path that is not normalized gets the same hint as a relative one: the path by
/// name, only when it would pass (a `..` above the root gives none).
#[test]
fn an_unnormalized_path_error_suggests_the_normalized_one() {
    for (given, meant) in [
        ("/srv/q/sub/../quota.json", Some("/srv/q/quota.json")),
        ("/srv/q//quota.json", Some("/srv/q/quota.json")),
        ("/srv/./quota.json", Some("/srv/quota.json")),
        ("/srv/quota.json/", Some("/srv/quota.json")),
        ("/../quota.json", None),
    ] {
        let message = check_path(Path::new(given)).unwrap_err().to_string();
        match meant {
            Some(meant) => {
                let hint = format!("(did you mean {meant}?)");
                assert!(message.contains(&hint), "{given}: {message}");
                assert!(check_path(Path::new(meant)).is_ok(), "{meant}");
            }
            None => assert!(!message.contains("did you mean"), "{given}: {message}"),
        }
    }
}
