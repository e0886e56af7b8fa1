//! Waiting for what must happen "eventually": a condition polled until it holds, under one bound
//! for every test. The bound is patience, not a timing claim: the condition is what is tested.

use std::time::{Duration, Instant};

/// How long a test waits for something that must happen "eventually".
pub const PATIENCE: Duration = Duration::from_secs(30);

/// How long to wait between two checks.
const POLL: Duration = Duration::from_millis(20);

/// Polls `check` until it holds or [`PATIENCE`] has passed; whether it held.
pub async fn eventually(mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it holds; fails the test, saying `what` never happened, once
/// [`PATIENCE`] has passed.
pub async fn assert_eventually(what: &str, check: impl AsyncFnMut() -> bool) {
    assert!(eventually(check).await, "never happened: {what}");
}
