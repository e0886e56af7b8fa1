//! What an operator reads in the inbox: each operation's `presentation`, derived from what the
//! operation will do, once, when it is created ([`derive()`]), and stored with it, so a listing
//! page shows it without reading the request (schema 4 derived it for the rows created before).
//!
//! The title says, in one line of at most [`TITLE_MAX`] characters, what `demo.run` or
//! `demo.request` will do and with which target; the summary carries the agent's reason, cut to
//! [`SUMMARY_MAX`] characters.

use serde_json::{Map, Value, json};

use crate::registry::duration_ms;
use crate::store::Presentation;

/// The longest title, in characters.
pub const TITLE_MAX: usize = 160;
/// The longest summary, in characters.
pub const SUMMARY_MAX: usize = 500;

/// The presentation of a request for `operation` on `target` with `arguments`, because
/// `reason`: a title, and a summary when the reason is not blank.
pub fn derive(operation: &str, target: &Value, arguments: &Value, reason: &str) -> Presentation {
    let target = describe_target(target);
    let ms = duration_ms(arguments).unwrap_or(0);
    let title = match operation {
        "demo.run" => format!("Run the demo: wait {ms} ms, then succeed, on {target}"),
        "demo.request" => {
            format!("Approve a demo run: wait {ms} ms, then succeed, on {target}")
        }
        other => format!("Run {other} on {target}"),
    };
    let summary = reason.trim();
    Presentation {
        title: truncate(&title, TITLE_MAX),
        summary: (!summary.is_empty()).then(|| truncate(summary, SUMMARY_MAX)),
    }
}

/// The `presentation` object: `title`, and `summary` when there is one.
pub(crate) fn presentation_json(shown: &Presentation) -> Value {
    let mut object = json!({"title": shown.title});
    if let Some(summary) = &shown.summary {
        object["summary"] = Value::from(summary.as_str());
    }
    object
}

/// `branch=main, repo=unyolo/test` (by name; strings unquoted, other values as JSON), or
/// `no target`.
pub(crate) fn describe_target(target: &Value) -> String {
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
pub(crate) fn truncate(text: &str, max: usize) -> String {
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

    fn presentation(operation: &str, target: Value, reason: &str) -> Value {
        presentation_json(&derive(
            operation,
            &target,
            &json!({"duration_ms": 250}),
            reason,
        ))
    }

    #[test]
    fn a_title_says_what_the_operation_does_and_with_which_target() {
        let run = presentation("demo.run", json!({"repo": "u/t", "n": 2}), "why");
        assert_eq!(
            run["title"],
            "Run the demo: wait 250 ms, then succeed, on n=2, repo=u/t"
        );
        assert_eq!(run["summary"], "why");
        let request = presentation("demo.request", json!({}), "  ");
        assert_eq!(
            request,
            json!({"title": "Approve a demo run: wait 250 ms, then succeed, on no target"})
        );
    }

    #[test]
    fn long_titles_and_summaries_are_cut_to_their_bounds_on_character_boundaries() {
        let target = json!({"path": "é".repeat(400)});
        let shown = presentation("demo.run", target, &"ü\n".repeat(600));
        let title = shown["title"].as_str().unwrap();
        let summary = shown["summary"].as_str().unwrap();
        assert_eq!(title.chars().count(), TITLE_MAX);
        assert!(title.ends_with('…'));
        assert_eq!(summary.chars().count(), SUMMARY_MAX);
        assert!(!summary.contains('\n'));
    }
}
