//! The JSON projection of stored records: an [`OperationRecord`] as the Agent V1 operation object
//! and as its summary. It lives in the API layer, beside the wire contract it follows (the API
//! version, the operator's `presentation`), so the store knows rows and nothing of JSON answers.
//!
//! An extension trait rather than free functions so a handler reads `record.to_json()`, as it
//! did when the method was the record's own.

use serde_json::{Value, json};

use super::contract::API_VERSION;
use super::presentation::presentation_json;
use crate::registry;
use crate::store::{OperationRecord, OperationSummary};

/// The Agent V1 JSON forms of an operation.
pub trait OperationJson {
    /// The Agent V1 operation object: every field the contract has, optional ones only when
    /// they have a value (never a `null`); an operation that needs approval carries
    /// `approval_id`, the id of its Operator V1 request (its own id).
    fn to_json(&self) -> Value;

    /// [`OperationJson::to_json`], moving the request's values into the object instead of
    /// copying them (for a heavy operation, one copy of its `target` and `arguments` fewer).
    fn into_json(self) -> Value;

    /// The Agent V1 operation summary: the operation object without `target`, `arguments`,
    /// `reason`, `result`, `error`, `approval_id` and `plan_digest`.
    fn to_summary_json(&self) -> Value;
}

impl OperationJson for OperationRecord {
    fn to_json(&self) -> Value {
        self.clone().into_json()
    }

    fn into_json(self) -> Value {
        let mut object = self.to_summary_json();
        let fields = object.as_object_mut().expect("a summary is an object");
        fields.insert("target".to_owned(), self.target);
        fields.insert("arguments".to_owned(), self.arguments);
        fields.insert("reason".to_owned(), Value::from(self.reason));
        if let Some(error) = self.error {
            fields.insert(
                "error".to_owned(),
                json!({"code": error.code, "message": error.message}),
            );
        }
        if registry::needs_approval(&self.operation) {
            // Its Operator V1 request is the operation itself.
            fields.insert("approval_id".to_owned(), Value::from(self.id.as_str()));
        }
        object
    }

    fn to_summary_json(&self) -> Value {
        self.summary().to_summary_json()
    }
}

impl OperationSummary {
    /// The Agent V1 operation summary (see [`OperationJson::to_summary_json`]).
    pub fn to_summary_json(&self) -> Value {
        let mut object = json!({
            "api_version": API_VERSION,
            "id": self.id,
            "broker": self.broker,
            "client_id": self.client_id,
            "idempotency_key": self.idempotency_key,
            "operation": self.operation,
            "state": self.state.as_str(),
            "revision": self.revision,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "presentation": presentation_json(&self.presentation),
        });
        if let Some(terminal_at) = &self.terminal_at {
            object["terminal_at"] = Value::from(terminal_at.as_str());
        }
        object
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::OperationError;
    use unyolo_admission::engine::OperationState;

    fn record() -> OperationRecord {
        OperationRecord {
            client_id: "bot-7".to_owned(),
            operation: "demo.run".to_owned(),
            target: json!({"repo": "unyolo/test"}),
            arguments: json!({"duration_ms": 0}),
            reason: "try it".to_owned(),
            presentation: crate::store::Presentation {
                title: "Run the demo".to_owned(),
                summary: Some("try it".to_owned()),
            },
            ..OperationRecord::example("op_1")
        }
    }

    #[test]
    fn a_live_operation_shows_no_null_and_its_summary_no_request_fields() {
        let full = record().to_json();
        let fields = full.as_object().unwrap();
        assert!(fields.values().all(|v| !v.is_null()), "{full}");
        assert!(!fields.contains_key("terminal_at") && !fields.contains_key("error"));
        assert!(
            !fields.contains_key("approval_id"),
            "demo.run needs no approval"
        );
        let request = OperationRecord {
            operation: "demo.request".to_owned(),
            ..record()
        };
        assert_eq!(request.to_json()["approval_id"], "op_1");
        assert!(request.to_summary_json().get("approval_id").is_none());
        assert_eq!(full["target"], json!({"repo": "unyolo/test"}));
        let summary = record().to_summary_json();
        for absent in ["target", "arguments", "reason", "error"] {
            assert!(summary.get(absent).is_none(), "{absent} in {summary}");
        }
        assert_eq!(summary["api_version"], API_VERSION);
    }

    #[test]
    fn a_failed_operation_shows_when_it_ended_and_why() {
        let failed = OperationRecord {
            state: OperationState::Failed,
            terminal_at: Some("2026-01-01T00:00:01.000Z".to_owned()),
            error: Some(OperationError {
                code: "execution_interrupted".to_owned(),
                message: "stopped".to_owned(),
            }),
            ..record()
        };
        let full = failed.to_json();
        assert_eq!(full["terminal_at"], "2026-01-01T00:00:01.000Z");
        assert_eq!(
            full["error"],
            json!({"code": "execution_interrupted", "message": "stopped"})
        );
        assert_eq!(failed.to_summary_json()["terminal_at"], full["terminal_at"]);
    }
}
