//! The quota file's `fair_share` section (SPEC section 11): every rule it must keep, each refused
//! with the one-line error naming its JSON path, the exact text and the rule; what it may be; that
//! values in code are judged as the file is; and that a file without it is what it always was.

use std::collections::BTreeMap;

use unyolo_admission::config::{
    ClientLimits, Config, FairShare, Identity, Limits, Pool, PoolShare, Rule,
};

fn identities() -> Vec<Identity> {
    ["bot-7", "automation-a"]
        .into_iter()
        .map(|n| Identity::new(n).unwrap())
        .collect()
}

const TOP: &str = r#""requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 512, "global_executing": 64"#;

const BOT: &str = r#""clients": {"bot-7": {"requests_per_window": 5, "window_seconds": 60, "active": 8, "pending": 4}}"#;

/// The valid pool entries.
const ACTIVE: &str = r#""active": {"reserve": 32, "floor": 2}"#;
const EXECUTING: &str = r#""executing": {"reserve": 4, "floor": 1}"#;

/// A file with the valid top level and `"fair_share": <section>`.
fn with_section(section: &str) -> String {
    format!(r#"{{{TOP}, "fair_share": {section}}}"#)
}

/// A file whose `fair_share` has the valid executing entry and this active one.
fn active(entry: &str) -> String {
    with_section(&format!(r#"{{"active": {entry}, {EXECUTING}}}"#))
}

/// A file whose `fair_share` has the valid active entry and this executing one.
fn executing(entry: &str) -> String {
    with_section(&format!(r#"{{{ACTIVE}, "executing": {entry}}}"#))
}

/// A file with bot-7's override (`active` 8) and this `fair_share`.
fn with_bot(section: &str) -> String {
    format!(r#"{{{TOP}, {BOT}, "fair_share": {section}}}"#)
}

fn parse(file: &str) -> Result<Config, unyolo_admission::config::ConfigError> {
    Config::from_bytes(file.as_bytes(), identities())
}

/// (what, file, the whole error line, the rule).
fn rejecting_cases() -> Vec<(&'static str, String, &'static str, Rule)> {
    vec![
        // The section's shape.
        (
            "null section",
            with_section("null"),
            "fair_share: null is not allowed; omit fair_share to serve the pools first come, \
             first served",
            Rule::Null,
        ),
        (
            "array section",
            with_section("[]"),
            "fair_share: fair_share must be a JSON object, found an array",
            Rule::ExpectedObject,
        ),
        (
            "empty section",
            with_section("{}"),
            "fair_share.active: missing required field; fair_share needs both pools, active and \
             executing",
            Rule::MissingField,
        ),
        (
            "one pool only",
            with_section(&format!("{{{ACTIVE}}}")),
            "fair_share.executing: missing required field; fair_share needs both pools, active \
             and executing",
            Rule::MissingField,
        ),
        (
            "an unknown pool",
            with_section(&format!(
                r#"{{{ACTIVE}, {EXECUTING}, "pending": {{"reserve": 1, "floor": 1}}}}"#
            )),
            "fair_share.pending: unknown field; allowed: active, executing",
            Rule::UnknownField,
        ),
        (
            "a misspelt pool",
            with_section(&format!(
                r#"{{{ACTIVE}, "executin": {{"reserve": 1, "floor": 1}}}}"#
            )),
            "fair_share.executin: unknown field (did you mean executing?); allowed: active, \
             executing",
            Rule::UnknownField,
        ),
        (
            "a pool twice",
            with_section(&format!("{{{ACTIVE}, {ACTIVE}, {EXECUTING}}}")),
            "fair_share.active: duplicate key: it appears more than once in the same object",
            Rule::DuplicateKey,
        ),
        (
            "the section misspelt",
            format!(r#"{{{TOP}, "fair-share": {{{ACTIVE}, {EXECUTING}}}}}"#),
            "fair-share: unknown field (did you mean fair_share?); allowed: \
             requests_per_window, window_seconds, client_active, client_pending, global_active, \
             global_executing, clients, fair_share",
            Rule::UnknownField,
        ),
        // A pool's entry.
        (
            "null entry",
            active("null"),
            "fair_share.active: null is not allowed; a pool's entry is a JSON object with \
             reserve and floor",
            Rule::Null,
        ),
        (
            "number entry",
            active("3"),
            "fair_share.active: a pool's entry must be a JSON object, found a number",
            Rule::ExpectedObject,
        ),
        (
            "missing floor",
            active(r#"{"reserve": 3}"#),
            "fair_share.active.floor: missing required field; a pool's entry needs both reserve \
             and floor",
            Rule::MissingField,
        ),
        (
            "missing reserve",
            executing(r#"{"floor": 1}"#),
            "fair_share.executing.reserve: missing required field; a pool's entry needs both \
             reserve and floor",
            Rule::MissingField,
        ),
        (
            "an unknown field",
            active(r#"{"reserve": 3, "floor": 1, "share": 10}"#),
            "fair_share.active.share: unknown field; allowed: reserve, floor",
            Rule::UnknownField,
        ),
        (
            "a case variant field",
            active(r#"{"Reserve": 3, "floor": 1}"#),
            "fair_share.active.Reserve: unknown field (did you mean reserve?); allowed: \
             reserve, floor",
            Rule::UnknownField,
        ),
        (
            "a field twice",
            active(r#"{"reserve": 3, "floor": 1, "floor": 2}"#),
            "fair_share.active.floor: duplicate key: it appears more than once in the same object",
            Rule::DuplicateKey,
        ),
        // Its values: JSON integer literals.
        (
            "quoted reserve",
            active(r#"{"reserve": "3", "floor": 1}"#),
            r#"fair_share.active.reserve: "3" is a string; write the number without quotes"#,
            Rule::NotAnInteger,
        ),
        (
            "fractional reserve",
            active(r#"{"reserve": 3.0, "floor": 1}"#),
            "fair_share.active.reserve: 3.0 is not an integer literal; write a whole number \
             without a fraction or exponent, at most 1000000",
            Rule::NotAnInteger,
        ),
        (
            "exponent floor",
            executing(r#"{"reserve": 3, "floor": 1e0}"#),
            "fair_share.executing.floor: 1e0 is not an integer literal; write a whole number \
             without a fraction or exponent, at most 1000000",
            Rule::NotAnInteger,
        ),
        (
            "boolean reserve",
            active(r#"{"reserve": true, "floor": 1}"#),
            "fair_share.active.reserve: expected zero or a positive integer, found a boolean",
            Rule::NotAnInteger,
        ),
        (
            "null floor",
            active(r#"{"reserve": 3, "floor": null}"#),
            "fair_share.active.floor: null is not allowed; a floor is a positive integer",
            Rule::Null,
        ),
        (
            "negative reserve",
            active(r#"{"reserve": -1, "floor": 1}"#),
            "fair_share.active.reserve: -1 is negative; a reserve is zero or a positive integer",
            Rule::Negative,
        ),
        (
            "reserve above the maximum",
            active(r#"{"reserve": 1000001, "floor": 1}"#),
            "fair_share.active.reserve: 1000001 is above the maximum 1000000",
            Rule::AboveMaximum,
        ),
        (
            "zero floor",
            executing(r#"{"reserve": 4, "floor": 0}"#),
            "fair_share.executing.floor: 0 is not allowed; a floor is a positive integer",
            Rule::Zero,
        ),
        (
            "negative zero floor",
            active(r#"{"reserve": 4, "floor": -0}"#),
            "fair_share.active.floor: -0 is not allowed; a floor is a positive integer",
            Rule::Zero,
        ),
        (
            "negative floor",
            active(r#"{"reserve": 4, "floor": -2}"#),
            "fair_share.active.floor: -2 is negative; a floor is a positive integer",
            Rule::Negative,
        ),
        // The rules across fields.
        (
            "active reserve the whole pool",
            active(r#"{"reserve": 512, "floor": 1}"#),
            "fair_share.active.reserve: 512 is not below global_active 512",
            Rule::ReserveNotBelowGlobal,
        ),
        (
            "executing reserve the whole pool",
            executing(r#"{"reserve": 64, "floor": 1}"#),
            "fair_share.executing.reserve: 64 is not below global_executing 64",
            Rule::ReserveNotBelowGlobal,
        ),
        (
            "executing reserve past the pool",
            executing(r#"{"reserve": 100, "floor": 1}"#),
            "fair_share.executing.reserve: 100 is not below global_executing 64",
            Rule::ReserveNotBelowGlobal,
        ),
        (
            "active floor above the defaults' client_active",
            active(r#"{"reserve": 32, "floor": 26}"#),
            "fair_share.active.floor: 26 is above client_active 25; that client would always \
             count as small",
            Rule::FloorAboveClientLimit,
        ),
        (
            "executing floor above the defaults' client_active",
            executing(r#"{"reserve": 4, "floor": 26}"#),
            "fair_share.executing.floor: 26 is above client_active 25; that client would always \
             count as small",
            Rule::FloorAboveClientLimit,
        ),
        (
            "active floor above an override's active",
            with_bot(&format!(
                r#"{{"active": {{"reserve": 32, "floor": 9}}, {EXECUTING}}}"#
            )),
            "fair_share.active.floor: 9 is above clients.bot-7.active 8; that client would \
             always count as small",
            Rule::FloorAboveClientLimit,
        ),
        (
            "executing floor above an override's active",
            with_bot(&format!(
                r#"{{{ACTIVE}, "executing": {{"reserve": 4, "floor": 9}}}}"#
            )),
            "fair_share.executing.floor: 9 is above clients.bot-7.active 8; that client would \
             always count as small",
            Rule::FloorAboveClientLimit,
        ),
    ]
}

#[test]
fn every_fair_share_rule_refuses_with_its_path_its_rule_and_one_exact_line() {
    for (what, file, line, rule) in rejecting_cases() {
        let err = parse(&file).expect_err(what);
        assert_eq!(err.to_string(), line, "{what}");
        assert_eq!(err.rule(), rule, "{what}");
        assert_eq!(
            err.path(),
            line.split(": ").next().unwrap(),
            "{what}: the path leads the line"
        );
    }
}

#[test]
fn a_file_with_fair_share_gives_both_pools_as_written() {
    let config = parse(&with_section(&format!("{{{ACTIVE}, {EXECUTING}}}"))).unwrap();
    let share = config.fair_share().expect("the section is there");
    assert_eq!(
        share,
        FairShare {
            active: PoolShare {
                reserve: 32,
                floor: 2
            },
            executing: PoolShare {
                reserve: 4,
                floor: 1
            },
        }
    );
    assert_eq!(share.pool(Pool::Active), share.active);
    assert_eq!(share.pool(Pool::Executing), share.executing);
}

#[test]
fn a_reserve_of_zero_and_each_value_at_its_bound_are_allowed() {
    // Zero reserve (no headroom, shares only), the largest reserve below each pool, floors equal
    // to the client limits they may not pass, written in either order.
    let config = with_bot(
        r#"{"executing": {"floor": 8, "reserve": 63}, "active": {"reserve": 0, "floor": 8}}"#,
    );
    let share = parse(&config).unwrap().fair_share().unwrap();
    assert_eq!(
        (share.active, share.executing),
        (
            PoolShare {
                reserve: 0,
                floor: 8
            },
            PoolShare {
                reserve: 63,
                floor: 8
            }
        )
    );
    assert!(parse(&active(r#"{"reserve": 511, "floor": 25}"#)).is_ok());
    assert!(parse(&active(r#"{"reserve": -0, "floor": 1}"#)).is_ok());
}

#[test]
fn values_in_code_are_judged_as_the_file_is_with_the_same_lines() {
    let limits = Limits::DEFAULT;
    let bot = ClientLimits {
        requests_per_window: 5,
        window_seconds: 60,
        active: 8,
        pending: 4,
    };
    let overrides: BTreeMap<Identity, ClientLimits> =
        [(Identity::new("bot-7").unwrap(), bot)].into();
    let base = Config::new(limits, overrides, identities()).unwrap();
    let share = |a: (u32, u32), e: (u32, u32)| FairShare {
        active: PoolShare {
            reserve: a.0,
            floor: a.1,
        },
        executing: PoolShare {
            reserve: e.0,
            floor: e.1,
        },
    };
    let cases = [
        (
            share((512, 1), (4, 1)),
            "fair_share.active.reserve: 512 is not below global_active 512",
        ),
        (
            share((32, 1), (64, 1)),
            "fair_share.executing.reserve: 64 is not below global_executing 64",
        ),
        (
            share((32, 0), (4, 1)),
            "fair_share.active.floor: 0 is not allowed; a floor is a positive integer",
        ),
        (
            share((32, 9), (4, 1)),
            "fair_share.active.floor: 9 is above clients.bot-7.active 8; that client would \
             always count as small",
        ),
        (
            share((1_000_001, 1), (4, 1)),
            "fair_share.active.reserve: 1000001 is above the maximum 1000000",
        ),
    ];
    for (fair, line) in cases {
        let err = base.clone().with_fair_share(Some(fair)).unwrap_err();
        assert_eq!(err.to_string(), line);
    }
    // The same values written in a file give the same configuration as in code.
    let fair = share((32, 2), (4, 1));
    let in_code = base.clone().with_fair_share(Some(fair)).unwrap();
    let in_file = parse(&with_bot(&format!("{{{ACTIVE}, {EXECUTING}}}"))).unwrap();
    assert_eq!(in_code, in_file);
    // And `None` takes it away.
    assert_eq!(in_code.with_fair_share(None).unwrap(), base);
}

#[test]
fn to_json_writes_fair_share_and_reads_back_an_equal_config() {
    let config = parse(&with_bot(&format!("{{{ACTIVE}, {EXECUTING}}}"))).unwrap();
    let json = config.to_json();
    assert!(json.contains(r#""fair_share""#), "{json}");
    assert_eq!(parse(&json).unwrap(), config);
}

#[test]
fn a_file_without_fair_share_is_what_it_always_was() {
    // The same file parses to the configuration the values make in code, with no fair share,
    // and writes itself back without the section (the defaults too: `admission defaults`).
    let file = format!("{{{TOP}, {BOT}}}");
    let config = parse(&file).unwrap();
    assert_eq!(config.fair_share(), None);
    let bot = config.effective("bot-7").unwrap();
    let in_code = Config::new(
        *config.limits(),
        [(Identity::new("bot-7").unwrap(), bot)].into(),
        identities(),
    )
    .unwrap();
    assert_eq!(config, in_code);
    assert!(!config.to_json().contains("fair_share"));
    let defaults = Config::defaults(identities());
    assert_eq!(defaults.fair_share(), None);
    assert_eq!(parse(&defaults.to_json()).unwrap(), defaults);
    assert!(!defaults.to_json().contains("fair_share"));
}
