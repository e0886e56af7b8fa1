//! What an operator reads in the inbox: each operation's `presentation`, derived from what the
//! operation will do (never stored, so it always matches the registered operations).
//!
//! The title says, in one line of at most [`TITLE_MAX`] characters, what `demo.run` or
//! `demo.request` will do and with which target; the summary carries the agent's reason, cut to
//! [`SUMMARY_MAX`] characters.

use serde_json::{Map, Value, json};

use crate::broker::registry::duration_ms;
use crate::broker::store::OperationRecord;

/// The longest title, in characters.
pub const TITLE_MAX: usize = 160;
/// The longest summary, in characters.
pub const SUMMARY_MAX: usize = 500;

/// The `presentation` object of `record`: `title`, and `summary` when the reason is not empty.
pub(crate) fn presentation(record: &OperationRecord) -> Value {
    let target = describe_target(&record.target);
    let ms = duration_ms(&record.arguments).unwrap_or(0);
    let title = match record.operation.as_str() {
        "demo.run" => format!("Run the demo: wait {ms} ms, then succeed, on {target}"),
        "demo.request" => {
            format!("Approve a demo run: wait {ms} ms, then succeed, on {target}")
        }
        other => format!("Run {other} on {target}"),
    };
    let mut object = json!({"title": truncate(&title, TITLE_MAX)});
    let summary = record.reason.trim();
    if !summary.is_empty() {
        object["summary"] = Value::from(truncate(summary, SUMMARY_MAX));
    }
    object
}

/// `branch=main, repo=unyolo/test` (by name; strings unquoted, other values as JSON), or
/// `no target`.
fn describe_target(target: &Value) -> String {
    let Some(fields) = target.as_object().filter(|fields| !fields.is_empty()) else {
        return "no target".to_owned();
    };
    describe_fields(fields)
}

fn describe_fields(fields: &Map<String, Value>) -> String {
    let parts: Vec<String> = fields
        .iter()
        .map(|(name, value)| match value {
            Value::String(text) => format!("{name}={text}"),
            other => format!("{name}={other}"),
        })
        .collect();
    parts.join(", ")
}

/// `text` cut to at most `max` characters, ending in `…` when cut; control characters become
/// spaces so a title stays one line.
fn truncate(text: &str, max: usize) -> String {
    let clean: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if clean.chars().count() <= max {
        return clean;
    }
    let mut cut: String = clean.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::OperationState;

    fn record(operation: &str, target: Value, reason: &str) -> OperationRecord {
        OperationRecord {
            id: "op_1".to_owned(),
            client_id: "agent".to_owned(),
            idempotency_key: "k".to_owned(),
            operation: operation.to_owned(),
            target,
            arguments: json!({"duration_ms": 250}),
            reason: reason.to_owned(),
            state: OperationState::Pending,
            created_at: "2026-01-01T00:00:00.000Z".to_owned(),
            updated_at: "2026-01-01T00:00:00.000Z".to_owned(),
            terminal_at: None,
            error: None,
            revision: 1,
            ended_from: None,
            broker: "admission".to_owned(),
        }
    }

    #[test]
    fn a_title_says_what_the_operation_does_and_with_which_target() {
        let run = presentation(&record("demo.run", json!({"repo": "u/t", "n": 2}), "why"));
        assert_eq!(
            run["title"],
            "Run the demo: wait 250 ms, then succeed, on n=2, repo=u/t"
        );
        assert_eq!(run["summary"], "why");
        let request = presentation(&record("demo.request", json!({}), "  "));
        assert_eq!(
            request,
            json!({"title": "Approve a demo run: wait 250 ms, then succeed, on no target"})
        );
    }

    #[test]
    fn long_titles_and_summaries_are_cut_to_their_bounds_on_character_boundaries() {
        let target = json!({"path": "é".repeat(400)});
        let shown = presentation(&record("demo.run", target, &"ü\n".repeat(600)));
        let title = shown["title"].as_str().unwrap();
        let summary = shown["summary"].as_str().unwrap();
        assert_eq!(title.chars().count(), TITLE_MAX);
        assert!(title.ends_with('…'));
        assert_eq!(summary.chars().count(), SUMMARY_MAX);
        assert!(!summary.contains('\n'));
    }
}
