//! The PostgreSQL the store tests start: `initdb` in a temporary directory and `postgres` on a
//! loopback port with `fsync` on, run as the `postgres` user when the tests run as root.

mod support;

#[test]
fn a_test_postgres_starts_answers_and_survives_a_crash() {
    let mut server = postgres_or_skip!();
    let url = server.database("smoke");
    assert!(url.ends_with("/smoke"), "{url}");
    server.psql("smoke", "CREATE TABLE t (n int); INSERT INTO t VALUES (1)");
    assert_eq!(server.psql("smoke", "SHOW fsync"), "on");
    server.crash_and_restart();
    assert_eq!(
        server.psql("smoke", "SELECT n FROM t"),
        "1",
        "a committed row outlives a crash"
    );
}
