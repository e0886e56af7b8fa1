//! Client secrets files and operator secret files.

use unyolo_admission::config::secrets::{
    LineProblem, Secrets, parse_operator_secret, read_operator_secret,
};

#[test]
fn names_and_secrets_are_read_with_comments_and_blank_lines_ignored() {
    let text = "# clients\n\nbot-7 = s3cret\n  automation-a=tok=en==  \r\n";
    let secrets = Secrets::parse(text).unwrap();
    let names: Vec<&str> = secrets.identities().map(|i| i.as_str()).collect();
    assert_eq!(names, ["automation-a", "bot-7"]);
    assert_eq!(secrets.secret("bot-7"), Some("s3cret"));
    assert_eq!(secrets.secret("automation-a"), Some("tok=en=="));
    assert_eq!(secrets.len(), 2);
}

#[test]
fn an_empty_file_has_no_identities() {
    assert!(Secrets::parse("").unwrap().is_empty());
    assert!(Secrets::parse("# nothing yet\n").unwrap().is_empty());
}

fn problem(text: &str) -> (usize, LineProblem) {
    let err = Secrets::parse(text).unwrap_err();
    (err.line().unwrap(), err.problem().unwrap().clone())
}

#[test]
fn a_duplicate_name_is_refused_with_both_lines() {
    assert_eq!(
        problem("bot-7 = a\n\nbot-7 = b\n"),
        (
            3,
            LineProblem::DuplicateName {
                name: "bot-7".to_owned(),
                first_line: 1
            }
        )
    );
}

#[test]
fn a_bad_name_is_refused() {
    assert_eq!(
        problem("bot 7 = a\n"),
        (1, LineProblem::BadName("bot 7".to_owned()))
    );
    assert_eq!(problem("= a\n"), (1, LineProblem::BadName(String::new())));
}

#[test]
fn an_empty_secret_is_refused() {
    assert_eq!(
        problem("ok = a\nbot-7 =   \n"),
        (2, LineProblem::EmptySecret)
    );
}

#[test]
fn a_secret_holding_a_control_character_is_refused() {
    // Found by the secrets_parse fuzz target: a lone carriage return inside a secret was accepted,
    // giving a client a bearer token no HTTP request can carry.
    for text in [
        "ok = a\nbot-7 = one\rtwo\n",
        "bot-7 = tab\tin\n",
        "bot-7 = esc\u{1b}[0m\n",
    ] {
        let (line, problem) = problem(text);
        assert_eq!(problem, LineProblem::ControlCharacter, "{text:?}");
        assert_eq!(line, if text.starts_with("ok") { 2 } else { 1 });
    }
    let err = parse_operator_secret("op\u{1b}secret\n").unwrap_err();
    assert_eq!(err.problem(), Some(&LineProblem::ControlCharacter));
    assert!(!err.to_string().contains("op"), "{err}");
}

#[test]
fn a_line_without_equals_is_refused() {
    assert_eq!(problem("bot-7 s3cret\n"), (1, LineProblem::MissingEquals));
}

#[test]
fn two_clients_sharing_a_secret_are_refused() {
    assert_eq!(
        problem("a = same\nb = same\n"),
        (2, LineProblem::DuplicateSecret { first_line: 1 })
    );
}

#[test]
fn errors_and_debug_output_never_show_a_secret() {
    let err = Secrets::parse("bot-7 = hunter2\nbot-7 = hunter3\n").unwrap_err();
    assert!(!err.to_string().contains("hunter"), "{err}");
    let err = Secrets::parse("a = hunter2\nb = hunter2\n").unwrap_err();
    assert!(!err.to_string().contains("hunter"), "{err}");
    let err = Secrets::parse("hunter2\n").unwrap_err();
    assert!(!err.to_string().contains("hunter"), "{err}");
    // A bare base64 secret where a `name = secret` line belongs: what precedes its padding is
    // no name, and is not shown.
    let err = Secrets::parse("Zm9v+aHVudGVy/YmF6==\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "line 1: the name before '=' is not a valid identity: it holds '+', '/' (1 to 64 \
         characters from A-Z a-z 0-9 . _ @ -, starting with a letter or digit; the name is not \
         shown, in case the line is a secret)"
    );
    for (line, problem) in [
        ("-bot = s", "it does not start with a letter or digit"),
        (
            &format!("{} = s", "a".repeat(65)),
            "it is 65 characters long",
        ),
        ("= s", "it is empty"),
    ] {
        let err = Secrets::parse(line).unwrap_err().to_string();
        assert!(err.contains(problem), "{line}: {err}");
    }
    let secrets = Secrets::parse("bot-7 = hunter2\n").unwrap();
    assert!(!format!("{secrets:?}").contains("hunter"));
}

#[test]
fn non_utf8_content_is_refused_with_its_line() {
    let err = Secrets::from_bytes(b"a = x\nb = \xff\n").unwrap_err();
    assert_eq!(err.line(), Some(2));
    assert_eq!(err.problem(), Some(&LineProblem::NotUtf8));
}

#[test]
fn a_secrets_file_error_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secrets");
    std::fs::write(&path, "bot-7 = a\nbot-7 = b\n").unwrap();
    let err = Secrets::from_path(&path).unwrap_err();
    assert_eq!(err.line(), Some(2));
    assert!(
        err.to_string()
            .starts_with(&format!("{}: line 2: ", path.display()))
    );
}

#[test]
fn a_missing_secrets_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    assert!(Secrets::from_path(&dir.path().join("absent")).is_err());
}

#[test]
fn an_operator_secret_is_one_line_with_the_newline_trimmed() {
    assert_eq!(parse_operator_secret("op-secret\n").unwrap(), "op-secret");
    assert_eq!(parse_operator_secret("op-secret").unwrap(), "op-secret");
    assert_eq!(parse_operator_secret("op-secret\r\n").unwrap(), "op-secret");
}

#[test]
fn an_empty_operator_secret_is_refused() {
    let err = parse_operator_secret("\n").unwrap_err();
    assert_eq!(err.problem(), Some(&LineProblem::EmptySecret));
}

#[test]
fn an_operator_secret_of_two_lines_is_refused() {
    let err = parse_operator_secret("one\ntwo\n").unwrap_err();
    assert_eq!(err.problem(), Some(&LineProblem::MoreThanOneLine));
}

#[test]
fn an_operator_secret_file_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("operator");
    std::fs::write(&path, "op-secret\n").unwrap();
    assert_eq!(read_operator_secret(&path).unwrap(), "op-secret");
}
