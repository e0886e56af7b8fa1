//! The registered operations: what this broker can do, and what a submission's `operation` and
//! `arguments` must say for it to be work this broker will run.
//!
//! Two demo operations, `demo.run` (no approval needed) and `demo.request` (needs an operator's
//! approval); both execute by sleeping `arguments.duration_ms` (0 to [`MAX_DURATION_MS`], 0 when
//! absent), then succeed. The discovery descriptor lists them, a submission is judged against
//! them, the executor reads the duration, and the inbox presentation says what they will do. It
//! knows nothing of HTTP: the route answers a [`NotRunnable`] with its code and text.

use serde_json::Value;

/// Longest `arguments.duration_ms` the demo executor accepts (ten minutes).
pub(crate) const MAX_DURATION_MS: u64 = 600_000;

/// The registered operations: name and whether it needs an operator's approval.
pub(crate) const OPERATIONS: [(&str, bool); 2] = [("demo.run", false), ("demo.request", true)];

/// Whether `operation` is registered and needs an operator's approval: its operations are the
/// requests operators see (Operator V1).
pub(crate) fn needs_approval(operation: &str) -> bool {
    OPERATIONS
        .iter()
        .any(|(name, approval)| *approval && *name == operation)
}

/// The registered operations that need an operator's approval.
pub(crate) fn approval_operations() -> impl Iterator<Item = &'static str> {
    OPERATIONS
        .iter()
        .filter(|(_, approval)| *approval)
        .map(|(name, _)| *name)
}

/// The kind of an operation's target, as operators filter by it (`target_kind`): the part of the
/// operation's name before its first `.` (`demo` for `demo.request`), the provider it acts on.
pub(crate) fn target_kind(operation: &str) -> &str {
    operation
        .split_once('.')
        .map_or(operation, |(kind, _)| kind)
}

/// Why a submission is not work this broker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotRunnable {
    /// No operation of that name is registered.
    NotRegistered,
    /// `arguments.duration_ms` is not an integer from 0 to [`MAX_DURATION_MS`].
    Duration,
}

/// Whether `operation` with `arguments` is registered work, and if so whether it needs an
/// operator's approval.
pub(crate) fn judge(operation: &str, arguments: &Value) -> Result<bool, NotRunnable> {
    let Some(&(_, needs_approval)) = OPERATIONS.iter().find(|(name, _)| *name == operation) else {
        return Err(NotRunnable::NotRegistered);
    };
    if duration_ms(arguments).is_none() {
        return Err(NotRunnable::Duration);
    }
    Ok(needs_approval)
}

/// `arguments.duration_ms`: absent means 0; anything but an integer in 0..=600000 is `None`.
pub(crate) fn duration_ms(arguments: &Value) -> Option<u64> {
    match arguments.get("duration_ms") {
        None => Some(0),
        Some(value) => value.as_u64().filter(|ms| *ms <= MAX_DURATION_MS),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn registered_work_is_judged_by_name_then_duration() {
        assert_eq!(judge("demo.run", &json!({})), Ok(false));
        assert_eq!(
            judge("demo.request", &json!({"duration_ms": 600_000})),
            Ok(true)
        );
        assert_eq!(
            judge("demo.nope", &json!({"duration_ms": -1})),
            Err(NotRunnable::NotRegistered)
        );
        for bad in [json!(600_001), json!(-1), json!(1.5), json!("10")] {
            assert_eq!(
                judge("demo.run", &json!({ "duration_ms": bad })),
                Err(NotRunnable::Duration)
            );
        }
    }
}
