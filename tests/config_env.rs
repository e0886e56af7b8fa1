//! Loading from a named environment variable. One test function, so no other thread of this test
//! binary reads the environment while it is changed.

use unyolo_admission::config::{Config, Identity, Rule};

#[test]
fn an_unset_or_empty_variable_means_the_defaults_and_a_set_one_names_the_file() {
    let bot = || [Identity::new("bot-7").unwrap()];
    let var = "UNYOLO_ADMISSION_TEST_CONFIG_ENV_7F3A";

    // Unset: never set by anyone.
    assert_eq!(
        Config::from_env(var, bot()).unwrap(),
        Config::defaults(bot())
    );

    // SAFETY: this test binary runs this single test, so no other thread touches the environment.
    unsafe { std::env::set_var(var, "") };
    assert_eq!(
        Config::from_env(var, bot()).unwrap(),
        Config::defaults(bot())
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quota.json");
    std::fs::write(
        &path,
        r#"{"requests_per_window": 1, "window_seconds": 60, "client_active": 25,
            "client_pending": 10, "global_active": 512, "global_executing": 64}"#,
    )
    .unwrap();
    // SAFETY: as above.
    unsafe { std::env::set_var(var, &path) };
    assert_eq!(
        Config::from_env(var, bot())
            .unwrap()
            .limits()
            .requests_per_window,
        1
    );

    // SAFETY: as above.
    unsafe { std::env::set_var(var, "quota.json") };
    let err = Config::from_env(var, bot()).unwrap_err();
    assert_eq!(err.rule(), Rule::PathNotAbsolute);
    // The fix is in the variable, so the error names it.
    let message = err.to_string();
    assert!(
        message.contains(&format!("(the path is the value of {var})")),
        "{message}"
    );

    // SAFETY: as above.
    unsafe { std::env::remove_var(var) };
}
