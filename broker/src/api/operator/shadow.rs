//! `GET /admission/v1/shadow`: what the shadow quota file (`serve --shadow-config`) would have
//! decided since the broker started, per client — would-be refusals by code, the highest counts
//! the shadow saw against its limits, and since when. Admission's own route, like the drift
//! reading, beside Operator V1 rather than part of it.

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Map, Value, json};

use super::credential::OperatorName;
use super::error::{ErrorCode, OperatorError, OperatorResult};
use crate::api::error::json_response;
use crate::core::Core;
use unyolo_admission::admission::{ShadowClient, ShadowReport};

/// The handler: 404 `not_found` when no shadow file is set.
pub(super) async fn shadow(
    State(core): State<Arc<Core>>,
    _operator: OperatorName,
) -> OperatorResult {
    let Some(shadow) = &core.shadow else {
        return Err(OperatorError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "no shadow admission config is set (admission serve --shadow-config PATH)",
        ));
    };
    Ok(json_response(StatusCode::OK, report_json(&shadow.report())))
}

fn time(at: SystemTime) -> Value {
    Value::String(humantime::format_rfc3339_millis(at).to_string())
}

fn against(limit: impl Into<u64>, peak: u64) -> Value {
    json!({ "limit": limit.into(), "peak": peak })
}

/// The report as JSON: `since`, `reloaded_at`, the global peaks, and one entry per client.
pub(crate) fn report_json(report: &ShadowReport) -> Value {
    json!({
        "since": time(report.since),
        "reloaded_at": report.reloaded_at.map_or(Value::Null, time),
        "refused_any": report.refused_any(),
        "global": {
            "active": against(report.global_active.0, report.global_active.1),
            "executing": against(report.global_executing.0, report.global_executing.1),
        },
        "clients": report.clients.iter().map(client_json).collect::<Vec<_>>(),
    })
}

fn client_json(client: &ShadowClient) -> Value {
    let refused: Map<String, Value> = client
        .refused
        .iter()
        .map(|(code, n)| (code.as_str().to_owned(), Value::from(*n)))
        .collect();
    let limits = client.limits;
    let peaks = client.peaks;
    json!({
        "client": client.identity.as_str(),
        "admitted": client.admitted,
        "refused": refused,
        "first_refusal": client.first_refusal.map_or(Value::Null, |(at, code)| json!({
            "at": time(at),
            "code": code.as_str(),
        })),
        "peaks": {
            "requests_per_window": against(limits.requests_per_window, peaks.rate_used),
            "window_seconds": limits.window_seconds,
            "active": against(limits.active, peaks.active),
            "pending": against(limits.pending, peaks.pending),
            "executing": { "peak": peaks.executing },
        },
    })
}
