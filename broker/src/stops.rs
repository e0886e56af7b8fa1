//! Where the process tests stop a `serve` at an exact point of its work, to pause it there as
//! an operator's `SIGSTOP` or a stalled machine would: debug builds only (`cargo test` builds
//! `serve` so); a release build has none of it.
//!
//! `ADMISSION_TEST_STOP_AFTER_INSERT=PREFIX`: a submission whose idempotency key starts with
//! `PREFIX` stops the whole process (`SIGSTOP` to itself) once its row is committed, before its
//! permit is committed and its answer sent. The test sees the process stopped
//! (`/proc/PID/stat`), moves the world on (decides the request on another replica, lets a third
//! take it over and run it), then continues it with `SIGCONT`.

/// The environment variable naming the keys whose submissions stop after their row's commit.
#[cfg(debug_assertions)]
const STOP_AFTER_INSERT: &str = "ADMISSION_TEST_STOP_AFTER_INSERT";

/// Called once a submission's row is committed: stops the process here if the test asked for
/// this key.
#[cfg(debug_assertions)]
pub(crate) fn after_insert(key: &str) {
    static PREFIX: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let prefix = PREFIX.get_or_init(|| {
        std::env::var(STOP_AFTER_INSERT)
            .ok()
            .filter(|prefix| !prefix.is_empty())
    });
    if let Some(prefix) = prefix
        && key.starts_with(prefix.as_str())
    {
        tracing::warn!(
            key,
            "{STOP_AFTER_INSERT}: stopping this process after the row's commit"
        );
        if let Err(err) =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)
        {
            tracing::error!(error = %err, "{STOP_AFTER_INSERT}: could not stop this process");
        }
    }
}

/// A release build stops nowhere.
#[cfg(not(debug_assertions))]
pub(crate) fn after_insert(_key: &str) {}
