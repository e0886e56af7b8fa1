//! A decided change runs to its end: [`detached`] hands it to a task of its own
//! ([`run_to_end`]) and only waits for its answer, so a client that hangs up cannot leave it half
//! made (the broker module's docs say where each mutating route decides).

use axum::http::StatusCode;

use super::error::{ApiError, ApiResult};
use crate::core::run_to_end;

/// Runs a decided change to its end ([`run_to_end`]) and returns its answer; a panic in it is a
/// 500.
pub(crate) async fn detached(work: impl Future<Output = ApiResult> + Send + 'static) -> ApiResult {
    let outcome = run_to_end(work);
    outcome.await.unwrap_or_else(|err| {
        tracing::error!(error = %err, "a detached change did not finish");
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "The change did not finish; check the operation before retrying.",
        ))
    })
}
