//! Every rule of the quota file contract (SPEC section 3), one or more rejecting cases each, each
//! checked for the JSON path it names and the rule it reports.

use std::collections::BTreeMap;

use unyolo_admission::config::{
    ClientLimits, Config, Identity, LimitSource, Limits, MAX_FILE_BYTES, Rule,
};

fn identities() -> Vec<Identity> {
    ["bot-7", "automation-a"]
        .into_iter()
        .map(|n| Identity::new(n).unwrap())
        .collect()
}

const TOP: &str = r#""requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 512, "global_executing": 64"#;

const BOT: &str =
    r#""bot-7": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}"#;

/// A file with the valid top level plus `extra` (which starts with a comma when not empty).
fn file(extra: &str) -> String {
    format!("{{{TOP}{extra}}}")
}

/// A file whose top-level field `field` has the literal value `value`.
fn top_with(field: &str, value: &str) -> String {
    let mut fields: Vec<(String, String)> = [
        ("requests_per_window", "60"),
        ("window_seconds", "60"),
        ("client_active", "25"),
        ("client_pending", "10"),
        ("global_active", "512"),
        ("global_executing", "64"),
    ]
    .into_iter()
    .map(|(f, v)| (f.to_owned(), v.to_owned()))
    .collect();
    for entry in &mut fields {
        if entry.0 == field {
            entry.1 = value.to_owned();
        }
    }
    let body: Vec<String> = fields.iter().map(|(f, v)| format!("{f:?}: {v}")).collect();
    format!("{{{}}}", body.join(", "))
}

/// A file with one override for bot-7 whose body is `body`.
fn bot_with(body: &str) -> String {
    file(&format!(r#", "clients": {{"bot-7": {{{body}}}}}"#))
}

fn rejecting_cases() -> Vec<(&'static str, String, &'static str, Rule)> {
    vec![
        // Syntax and shape.
        ("empty file", String::new(), "", Rule::Syntax),
        ("not json", "quota: 60".to_owned(), "", Rule::Syntax),
        (
            "truncated object",
            "{\"requests_per_window\": 60,".to_owned(),
            "",
            Rule::Syntax,
        ),
        (
            "trailing content",
            format!("{} x", file("")),
            "",
            Rule::TrailingContent,
        ),
        (
            "second object",
            format!("{} {{}}", file("")),
            "",
            Rule::TrailingContent,
        ),
        ("top level array", "[]".to_owned(), "", Rule::ExpectedObject),
        (
            "top level number",
            "60".to_owned(),
            "",
            Rule::ExpectedObject,
        ),
        (
            "top level string",
            "\"quota\"".to_owned(),
            "",
            Rule::ExpectedObject,
        ),
        ("top level null", "null".to_owned(), "", Rule::Null),
        (
            "empty object",
            "{}".to_owned(),
            "requests_per_window",
            Rule::MissingField,
        ),
        // Unknown, case-variant and missing fields.
        (
            "unknown field",
            file(r#", "burst": 5"#),
            "burst",
            Rule::UnknownField,
        ),
        (
            "case variant field",
            top_with("client_active", "25").replace("client_active", "Client_Active"),
            "Client_Active",
            Rule::UnknownField,
        ),
        (
            "missing global_executing",
            top_with("global_executing", "64").replace(", \"global_executing\": 64", ""),
            "global_executing",
            Rule::MissingField,
        ),
        (
            "unknown override field",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4, "burst": 1"#,
            ),
            "clients.bot-7.burst",
            Rule::UnknownField,
        ),
        (
            "top-level name inside an override",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "client_active": 8, "pending": 4"#,
            ),
            "clients.bot-7.client_active",
            Rule::UnknownField,
        ),
        (
            "override missing pending",
            bot_with(r#""requests_per_window": 5, "window_seconds": 60, "active": 8"#),
            "clients.bot-7.pending",
            Rule::MissingField,
        ),
        (
            "empty override",
            bot_with(""),
            "clients.bot-7.requests_per_window",
            Rule::MissingField,
        ),
        // Duplicate keys at every depth.
        (
            "duplicate top-level key",
            file(r#", "global_active": 512"#),
            "global_active",
            Rule::DuplicateKey,
        ),
        (
            "two overrides for one client",
            file(&format!(r#", "clients": {{{BOT}, {BOT}}}"#)),
            "clients.bot-7",
            Rule::DuplicateKey,
        ),
        (
            "duplicate key inside an override",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4, "active": 9"#,
            ),
            "clients.bot-7.active",
            Rule::DuplicateKey,
        ),
        (
            "duplicate clients object",
            file(&format!(r#", "clients": {{{BOT}}}, "clients": {{}}"#)),
            "clients",
            Rule::DuplicateKey,
        ),
        (
            "duplicate key deep inside an unknown field",
            file(r#", "notes": [{"a": 1, "a": 2}]"#),
            "notes[0].a",
            Rule::DuplicateKey,
        ),
        // Null.
        (
            "null limit",
            top_with("client_pending", "null"),
            "client_pending",
            Rule::Null,
        ),
        (
            "null clients",
            file(r#", "clients": null"#),
            "clients",
            Rule::Null,
        ),
        (
            "null override",
            file(r#", "clients": {"bot-7": null}"#),
            "clients.bot-7",
            Rule::Null,
        ),
        (
            "null override field",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": null, "pending": 4"#,
            ),
            "clients.bot-7.active",
            Rule::Null,
        ),
        // Types of objects.
        (
            "clients is an array",
            file(r#", "clients": []"#),
            "clients",
            Rule::ExpectedObject,
        ),
        (
            "override is a number",
            file(r#", "clients": {"bot-7": 5}"#),
            "clients.bot-7",
            Rule::ExpectedObject,
        ),
        // Integer literals only.
        (
            "fraction",
            top_with("requests_per_window", "60.0"),
            "requests_per_window",
            Rule::NotAnInteger,
        ),
        (
            "exponent",
            top_with("requests_per_window", "6e1"),
            "requests_per_window",
            Rule::NotAnInteger,
        ),
        (
            "quoted number",
            top_with("requests_per_window", "\"60\""),
            "requests_per_window",
            Rule::NotAnInteger,
        ),
        (
            "boolean",
            top_with("global_active", "true"),
            "global_active",
            Rule::NotAnInteger,
        ),
        (
            "object as limit",
            top_with("global_active", "{}"),
            "global_active",
            Rule::NotAnInteger,
        ),
        (
            "minus zero (an integer literal: zero)",
            top_with("client_active", "-0"),
            "client_active",
            Rule::Zero,
        ),
        (
            "integer beyond 64 bits (above the maximum)",
            top_with("global_active", "123456789012345678901234567890"),
            "global_active",
            Rule::AboveMaximum,
        ),
        (
            "negative integer beyond 64 bits",
            top_with("global_active", "-99999999999999999999"),
            "global_active",
            Rule::Negative,
        ),
        (
            "exponent beyond a double",
            top_with("global_active", "1e400"),
            "global_active",
            Rule::NotAnInteger,
        ),
        (
            "fraction in an override",
            bot_with(
                r#""requests_per_window": 5.5, "window_seconds": 60, "active": 8, "pending": 4"#,
            ),
            "clients.bot-7.requests_per_window",
            Rule::NotAnInteger,
        ),
        // Zero, negatives, bounds.
        (
            "zero",
            top_with("global_executing", "0"),
            "global_executing",
            Rule::Zero,
        ),
        (
            "zero in an override",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 0"#,
            ),
            "clients.bot-7.pending",
            Rule::Zero,
        ),
        (
            "negative",
            top_with("client_pending", "-1"),
            "client_pending",
            Rule::Negative,
        ),
        (
            "very negative",
            top_with("client_pending", "-9223372036854775808"),
            "client_pending",
            Rule::Negative,
        ),
        (
            "above one million",
            top_with("global_active", "1000001"),
            "global_active",
            Rule::AboveMaximum,
        ),
        (
            "above u32",
            top_with("global_active", "4294967296"),
            "global_active",
            Rule::AboveMaximum,
        ),
        (
            "above u64 max fits",
            top_with("global_active", "18446744073709551615"),
            "global_active",
            Rule::AboveMaximum,
        ),
        (
            "window above a day",
            top_with("window_seconds", "86401"),
            "window_seconds",
            Rule::AboveMaximum,
        ),
        (
            "override window above a day",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 86401, "active": 8, "pending": 4"#,
            ),
            "clients.bot-7.window_seconds",
            Rule::AboveMaximum,
        ),
        // Relations.
        (
            "default pending above default active",
            top_with("client_pending", "26"),
            "client_pending",
            Rule::PendingAboveActive,
        ),
        (
            "override pending above its active",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 12"#,
            ),
            "clients.bot-7.pending",
            Rule::PendingAboveActive,
        ),
        (
            "default active above global active",
            top_with("global_active", "24")
                .replace("\"global_executing\": 64", "\"global_executing\": 4"),
            "client_active",
            Rule::ActiveAboveGlobalActive,
        ),
        (
            "override active above global active",
            bot_with(
                r#""requests_per_window": 5, "window_seconds": 60, "active": 513, "pending": 4"#,
            ),
            "clients.bot-7.active",
            Rule::ActiveAboveGlobalActive,
        ),
        (
            "executing above global active",
            top_with("global_executing", "513"),
            "global_executing",
            Rule::ExecutingAboveGlobalActive,
        ),
        // Override keys must be configured identities.
        (
            "override for an unknown identity",
            file(
                r#", "clients": {"ci-runner": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#,
            ),
            "clients.ci-runner",
            Rule::UnknownIdentity,
        ),
        (
            "override key differing only in case",
            file(
                r#", "clients": {"Bot-7": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#,
            ),
            "clients.Bot-7",
            Rule::UnknownIdentity,
        ),
        (
            "override key that is not even an identity",
            file(
                r#", "clients": {"bot 7": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#,
            ),
            "clients.\"bot 7\"",
            Rule::UnknownIdentity,
        ),
        // Size.
        (
            "file one byte over the limit",
            format!(
                "{}{}",
                file(""),
                " ".repeat(MAX_FILE_BYTES + 1 - file("").len())
            ),
            "",
            Rule::FileTooLarge,
        ),
    ]
}

#[test]
fn every_rejecting_case_names_its_path_and_rule() {
    let mut failures = Vec::new();
    for (name, input, path, rule) in rejecting_cases() {
        match Config::from_bytes(input.as_bytes(), identities()) {
            Ok(_) => failures.push(format!("{name}: accepted")),
            Err(err) => {
                let message = err.to_string();
                if err.path() != path || err.rule() != rule {
                    failures.push(format!(
                        "{name}: got path {:?} rule {}, want path {path:?} rule {rule} ({message})",
                        err.path(),
                        err.rule()
                    ));
                }
                if message.contains('\n') {
                    failures.push(format!("{name}: message spans lines: {message:?}"));
                }
                let shown = if path.is_empty() { "top level" } else { path };
                if !message.starts_with(&format!("{shown}: ")) {
                    failures.push(format!(
                        "{name}: message does not lead with the path: {message}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn pending_above_active_reads_as_the_contract_example() {
    let input =
        bot_with(r#""requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 12"#);
    let err = Config::from_bytes(input.as_bytes(), identities()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "clients.bot-7.pending: 12 is above active 8"
    );
}

#[test]
fn an_unknown_override_key_suggests_the_identity_meant() {
    let input = file(
        r#", "clients": {"bot7": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#,
    );
    let err = Config::from_bytes(input.as_bytes(), identities()).unwrap_err();
    assert_eq!(err.rule(), Rule::UnknownIdentity);
    let message = err.to_string();
    assert!(message.contains("\"bot7\""), "{message}");
    assert!(message.contains("did you mean bot-7?"), "{message}");
}

#[test]
fn an_unrelated_override_key_gets_no_suggestion() {
    let input = file(
        r#", "clients": {"ci-runner": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#,
    );
    let err = Config::from_bytes(input.as_bytes(), identities()).unwrap_err();
    assert!(!err.to_string().contains("did you mean"), "{err}");
}

#[test]
fn with_no_identities_every_override_key_is_unknown() {
    let input = file(&format!(r#", "clients": {{{BOT}}}"#));
    let err = Config::from_bytes(input.as_bytes(), []).unwrap_err();
    assert_eq!(err.path(), "clients.bot-7");
    assert_eq!(err.rule(), Rule::UnknownIdentity);
}

#[test]
fn a_case_variant_field_suggests_the_real_name() {
    let input = top_with("client_active", "25").replace("client_active", "Client_Active");
    let err = Config::from_bytes(input.as_bytes(), identities()).unwrap_err();
    assert!(
        err.to_string().contains("did you mean client_active?"),
        "{err}"
    );
}

#[test]
fn a_minimal_file_gives_its_values_and_no_overrides() {
    let config = Config::from_bytes(file("").as_bytes(), identities()).unwrap();
    assert_eq!(*config.limits(), Limits::DEFAULT);
    assert!(config.overrides().is_empty());
    assert_eq!(
        config.effective("bot-7"),
        Some(Limits::DEFAULT.client_defaults())
    );
}

#[test]
fn an_override_applies_to_its_client_and_the_defaults_to_the_others() {
    let input = file(&format!(r#", "clients": {{{BOT}}}"#));
    let config = Config::from_bytes(input.as_bytes(), identities()).unwrap();
    let bot = ClientLimits {
        requests_per_window: 5,
        window_seconds: 60,
        active: 8,
        pending: 4,
    };
    assert_eq!(config.effective("bot-7"), Some(bot));
    assert_eq!(
        config.effective("automation-a"),
        Some(Limits::DEFAULT.client_defaults())
    );
    assert_eq!(config.effective("stranger"), None);
    let sources: Vec<(String, LimitSource)> = config
        .effective_all()
        .map(|(i, _, s)| (i.to_string(), s))
        .collect();
    assert_eq!(
        sources,
        [
            ("automation-a".to_owned(), LimitSource::Default),
            ("bot-7".to_owned(), LimitSource::Override)
        ]
    );
}

#[test]
fn an_empty_clients_object_means_no_overrides() {
    let config = Config::from_bytes(file(r#", "clients": {}"#).as_bytes(), []).unwrap();
    assert!(config.overrides().is_empty());
}

#[test]
fn the_bounds_themselves_are_allowed() {
    let input = top_with("window_seconds", "86400")
        .replace("\"global_active\": 512", "\"global_active\": 1000000")
        .replace("\"requests_per_window\": 60", "\"requests_per_window\": 1");
    let config = Config::from_bytes(input.as_bytes(), []).unwrap();
    assert_eq!(config.limits().window_seconds, 86_400);
    assert_eq!(config.limits().global_active, 1_000_000);
}

#[test]
fn pending_equal_to_active_and_executing_equal_to_global_active_are_allowed() {
    let input = top_with("client_pending", "25")
        .replace("\"global_executing\": 64", "\"global_executing\": 512");
    assert!(Config::from_bytes(input.as_bytes(), []).is_ok());
}

#[test]
fn a_file_of_exactly_the_size_limit_is_allowed() {
    let body = file("");
    let input = format!("{body}{}", " ".repeat(MAX_FILE_BYTES - body.len()));
    assert_eq!(input.len(), MAX_FILE_BYTES);
    assert!(Config::from_bytes(input.as_bytes(), []).is_ok());
}

#[test]
fn to_json_round_trips_to_an_equal_config() {
    let input = file(&format!(r#", "clients": {{{BOT}}}"#));
    let config = Config::from_bytes(input.as_bytes(), identities()).unwrap();
    let again = Config::from_bytes(config.to_json().as_bytes(), identities()).unwrap();
    assert_eq!(again, config);
}

#[test]
fn the_defaults_serialize_to_a_file_that_parses_back_to_the_defaults() {
    let defaults = Config::defaults(identities());
    let again = Config::from_bytes(defaults.to_json().as_bytes(), identities()).unwrap();
    assert_eq!(again, defaults);
}

#[test]
fn config_new_applies_the_same_rules_with_the_same_paths() {
    let bot = Identity::new("bot-7").unwrap();
    let overrides = BTreeMap::from([(
        bot.clone(),
        ClientLimits {
            requests_per_window: 5,
            window_seconds: 60,
            active: 8,
            pending: 12,
        },
    )]);
    let err = Config::new(Limits::DEFAULT, overrides.clone(), [bot]).unwrap_err();
    assert_eq!(
        (err.path(), err.rule()),
        ("clients.bot-7.pending", Rule::PendingAboveActive)
    );

    let err = Config::new(Limits::DEFAULT, overrides, []).unwrap_err();
    assert_eq!(
        (err.path(), err.rule()),
        ("clients.bot-7", Rule::UnknownIdentity)
    );

    let zero = Limits {
        window_seconds: 0,
        ..Limits::DEFAULT
    };
    let err = Config::new(zero, BTreeMap::new(), []).unwrap_err();
    assert_eq!((err.path(), err.rule()), ("window_seconds", Rule::Zero));
}

#[test]
fn a_pending_limit_above_the_grant_store_cap_is_valid_but_warned_about() {
    let input =
        bot_with(r#""requests_per_window": 5, "window_seconds": 60, "active": 20, "pending": 11"#);
    let config = Config::from_bytes(input.as_bytes(), identities()).unwrap();
    let warnings = config.warnings();
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0].path(), "clients.bot-7.pending");
    assert!(
        warnings[0].to_string().contains("cap 10"),
        "{}",
        warnings[0]
    );
}

#[test]
fn arbitrary_bytes_never_panic() {
    let samples: [&[u8]; 8] = [
        b"\xff\xfe{}",
        b"{\"\xff\": 1}",
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        b"{\"clients\": {\"\\u0000\": {}}}",
        b"{\"requests_per_window\": 1e400}",
        b"\"\\ud800\"",
        b"{\"a\":",
        b"\x00",
    ];
    for sample in samples {
        assert!(Config::from_bytes(sample, identities()).is_err());
    }
    let deep = "[".repeat(60_000);
    assert!(Config::from_bytes(deep.as_bytes(), []).is_err());
    // Well formed, but nested past any quota file: refused by depth, the stack untouched.
    let balanced = format!("{{\"x\": {}{}}}", "[".repeat(30_000), "]".repeat(30_000));
    let err = Config::from_bytes(balanced.as_bytes(), []).expect_err("too deep");
    assert!(
        err.to_string()
            .ends_with("nested more than 64 deep; a quota file nests three deep"),
        "{err}"
    );
}

proptest::proptest! {
    #[test]
    fn any_bytes_are_judged_without_panicking(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        let _ = Config::from_bytes(&bytes, identities());
    }

    #[test]
    fn a_mutated_valid_file_is_either_refused_or_round_trips(
        position in 0usize..400,
        byte in proptest::sample::select(b"{}[],:\"0123456789-.e \\nx".to_vec()),
    ) {
        let mut bytes = file(&format!(r#", "clients": {{{BOT}}}"#)).into_bytes();
        let at = position % bytes.len();
        bytes[at] = byte;
        if let Ok(config) = Config::from_bytes(&bytes, identities()) {
            let again = Config::from_bytes(config.to_json().as_bytes(), identities()).unwrap();
            proptest::prop_assert_eq!(again, config);
        }
    }
}

#[test]
fn a_number_is_quoted_as_written_wherever_it_is() {
    let cases = [
        (
            top_with("global_active", "6e1"),
            "global_active: 6e1 is not an integer literal; write a whole number without a \
             fraction or exponent, at most 1000000",
        ),
        (
            top_with("global_active", "123456789012345678901234567890"),
            "global_active: 123456789012345678901234567890 is above the maximum 1000000",
        ),
        (
            top_with("client_active", "-0"),
            "client_active: -0 is not allowed; limits are positive integers",
        ),
        (
            bot_with(
                r#""requests_per_window": 60, "window_seconds": 60, "active": 8, "pending": 1e400"#,
            ),
            "clients.bot-7.pending: 1e400 is not an integer literal; write a whole number \
             without a fraction or exponent, at most 1000000",
        ),
        (
            bot_with(
                r#""requests_per_window": 60, "window_seconds": 90000, "active": 8, "pending": 4"#,
            ),
            "clients.bot-7.window_seconds: 90000 is above the maximum 86400",
        ),
    ];
    for (input, want) in cases {
        let err = Config::from_bytes(input.as_bytes(), identities()).expect_err(want);
        assert_eq!(err.to_string(), want);
    }
    // A string's bad escape deep in the file is named by its path (no position, which would be
    // the value's rather than the file's) and by the escape as written, to search for.
    let half = "is half of a UTF-16 surrogate pair, without its other half; \
                write the character itself, or both halves";
    for (value, escape) in [
        // A high half alone, then one followed by an escaped backslash and `u` (not a pair).
        (r#""\ud800""#, r"\ud800"),
        (r#""x\\\uDBFF\\udc00""#, r"\uDBFF"),
        // A low half alone, after a whole pair (which is fine) and an escaped backslash.
        (r#""\ud83d\ude00\\\udc00""#, r"\udc00"),
    ] {
        let input = bot_with(&format!(
            r#""requests_per_window": {value}, "window_seconds": 60"#
        ));
        let err = Config::from_bytes(input.as_bytes(), identities()).expect_err(value);
        assert_eq!(
            err.to_string(),
            format!(
                "clients.bot-7.requests_per_window: not valid JSON: the escape {escape} {half}"
            ),
        );
        assert_eq!(err.rule(), Rule::Syntax);
    }
    // In a key, the escape is named under the object that holds it.
    let input = bot_with(r#""requests\udfff": 1, "window_seconds": 60"#);
    let err = Config::from_bytes(input.as_bytes(), identities()).expect_err("a key");
    assert_eq!(
        err.to_string(),
        format!("clients.bot-7: not valid JSON: the escape \\udfff {half}")
    );
    // An escaped backslash before `u` is text, not an escape: that string is read (and then
    // refused for its type, like any string where a number belongs).
    let input = bot_with(r#""requests_per_window": "\\ud800", "window_seconds": 60"#);
    let err = Config::from_bytes(input.as_bytes(), identities()).expect_err("a string");
    assert!(!err.to_string().contains("surrogate"), "{err}");
}

/// A file that is not plain UTF-8 is named for what it is, not as a JSON error at an invisible
/// mark or a stray byte: a byte order mark, UTF-16 text, a byte that is not UTF-8 (with where).
#[test]
fn a_file_not_in_plain_utf8_says_what_it_is_and_how_to_save_it() {
    let valid = file("");
    let mut bom = vec![0xEF, 0xBB, 0xBF];
    bom.extend_from_slice(valid.as_bytes());
    let utf16: Vec<u8> = [0xFF, 0xFE]
        .into_iter()
        .chain(valid.encode_utf16().flat_map(u16::to_le_bytes))
        .collect();
    let latin1 = {
        let mut bytes = valid.as_bytes().to_vec();
        let at = bytes.len() - 1;
        bytes.splice(at..at, b",\n  \"caf\xE9\": 1".iter().copied());
        bytes
    };
    // UTF-16 without a byte order mark is known by its zero bytes too.
    let utf16_bare: Vec<u8> = valid.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let err = Config::from_bytes(&utf16_bare, identities()).unwrap_err();
    assert!(err.to_string().contains("UTF-16"), "{err}");
    // A lone NUL after a value is trailing content, not wide text.
    let err = Config::from_bytes(b"1\0", identities()).unwrap_err();
    assert_eq!(err.rule(), Rule::TrailingContent, "{err}");
    for (name, bytes, says) in [
        (
            "a byte order mark",
            bom,
            &"byte order mark (EF BB BF); save it as UTF-8 without one".to_owned(),
        ),
        (
            "UTF-16",
            utf16,
            &"the file is UTF-16 or UTF-32 text; save it as UTF-8".to_owned(),
        ),
        (
            "Latin-1",
            latin1,
            &format!(
                "the file is not UTF-8: byte 0xE9 at line {} column 7; save it as UTF-8",
                valid.matches('\n').count() + 2
            ),
        ),
    ] {
        let err = Config::from_bytes(&bytes, identities()).unwrap_err();
        assert_eq!(err.rule(), Rule::Syntax, "{name}");
        let message = err.to_string();
        assert!(message.contains(says), "{name}: {message}");
    }
}

/// A client whose name holds a dot is quoted in an error's path, so the path's dots stay its
/// levels: `clients."ci.bot".pending`, never `clients.ci.bot.pending` (three levels deep).
#[test]
fn a_client_named_with_a_dot_is_quoted_in_the_path_of_its_error() {
    let input = r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 4,
        "client_pending": 2, "global_active": 10, "global_executing": 4,
        "clients": {"ci.bot": {"requests_per_window": 60, "window_seconds": 60,
                               "active": 2, "pending": 3}}}"#;
    let ids = [Identity::new("ci.bot").unwrap()];
    let err = Config::from_bytes(input.as_bytes(), ids).expect_err("pending above active");
    assert_eq!(
        err.to_string(),
        r#"clients."ci.bot".pending: 3 is above active 2"#
    );
}
