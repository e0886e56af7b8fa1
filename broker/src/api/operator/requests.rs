//! `GET /api/operator/v1/requests` (a page of requests, newest first, with every filter the
//! contract has and cursors bound to their query) and `GET /api/operator/v1/requests/{id}`.
//!
//! The query is judged whole before the credential is looked at (as unYOLO's server binds its
//! parameters first): any key but `status`, `requester`, `operation`, `target_kind`, `cursor`,
//! `limit` and `target.<field>` is a 400, so is any of the six given twice, a bad status group, a
//! limit outside 1–100 (absent or 0 is 50), a value past its bound, a `target.` field without
//! `target_kind`, and a cursor another query made. Every 400 is `request is invalid`.
//!
//! A page cursor is base64url (no padding) of `{"created_at","id","query_hash"}`: the position
//! of the page's last request and a hash of the query that made it (status group, requester,
//! operation, target, limit).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::credential::OperatorName;
use super::error::{OperatorError, OperatorResult};
use super::projection::broker_request;
use crate::api::error::json_response;
use crate::core::Core;
use crate::registry;
use crate::store::{OperationRecord, RequestQuery, StateFilter};
use unyolo_admission::engine::OperationState;

/// The default page size.
pub const DEFAULT_LIMIT: u32 = 50;
/// The largest page.
pub const MAX_LIMIT: u32 = 100;
/// The longest `requester`, `operation` and `target_kind`, in characters.
const MAX_FILTER_CHARS: usize = 128;
/// The longest cursor, in characters.
const MAX_CURSOR_CHARS: usize = 1024;
/// The longest request id, in characters.
const MAX_ID_CHARS: usize = 128;

/// A status group: which statuses a page shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatusGroup {
    /// Waiting for a decision.
    Pending,
    /// Approved, not yet used up.
    Active,
    /// Every other status.
    History,
    /// Every status.
    All,
}

/// A request page's query, judged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ListQuery {
    /// Which statuses.
    pub status: StatusGroup,
    /// Only this client's.
    pub requester: Option<String>,
    /// Only this operation's.
    pub operation: Option<String>,
    /// Only requests whose target is of this kind.
    pub target_kind: Option<String>,
    /// Target fields and the values each must hold (sorted, without repeats).
    pub target: BTreeMap<String, BTreeSet<String>>,
    /// The page size.
    pub limit: u32,
    /// Where the previous page ended: (`created_at`, id).
    #[serde(skip)]
    pub after: Option<(String, String)>,
}

#[derive(Serialize, Deserialize)]
struct Cursor {
    created_at: String,
    id: String,
    query_hash: String,
}

impl ListQuery {
    /// A hash of what the query selects (not where it is): a cursor carries it, and a cursor
    /// from another query is refused.
    fn hash(&self) -> String {
        let text = serde_json::to_string(self).expect("a query serializes");
        let digest = Sha256::digest(text.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The cursor of a page that ended at `record`.
    pub(crate) fn cursor_after(&self, record: &OperationRecord) -> String {
        let cursor = Cursor {
            created_at: record.created_at.clone(),
            id: record.id.clone(),
            query_hash: self.hash(),
        };
        let text = serde_json::to_string(&cursor).expect("a cursor serializes");
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
    }
}

/// Judges a request page's query string, given as its decoded `name=value` pairs in order (see
/// the module docs for the rules).
pub fn parse_list_query(pairs: &[(String, String)]) -> Result<ListQuery, OperatorError> {
    const SINGLE: [&str; 6] = [
        "status",
        "requester",
        "operation",
        "target_kind",
        "cursor",
        "limit",
    ];
    let mut single: BTreeMap<&str, &str> = BTreeMap::new();
    let mut target: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, value) in pairs {
        if let Some(field) = name.strip_prefix("target.") {
            // Blank is no filter, and upstream refuses it (its `normalizeGrantQuery`).
            if field.trim().is_empty() || value.trim().is_empty() {
                return Err(OperatorError::invalid());
            }
            target
                .entry(field.to_owned())
                .or_default()
                .insert(value.clone());
            continue;
        }
        let Some(known) = SINGLE.iter().find(|known| **known == name.as_str()) else {
            return Err(OperatorError::invalid());
        };
        if single.insert(known, value.as_str()).is_some() {
            return Err(OperatorError::invalid());
        }
    }
    let given = |name: &str| single.get(name).copied().filter(|v| !v.is_empty());
    let bounded = |name: &str| -> Result<Option<String>, OperatorError> {
        match given(name) {
            Some(value) if value.chars().count() > MAX_FILTER_CHARS => {
                Err(OperatorError::invalid())
            }
            value => Ok(value.map(str::to_owned)),
        }
    };
    let status = match given("status") {
        None | Some("all") => StatusGroup::All,
        Some("pending") => StatusGroup::Pending,
        Some("active") => StatusGroup::Active,
        Some("history") => StatusGroup::History,
        Some(_) => return Err(OperatorError::invalid()),
    };
    // `limit=` names no number: upstream's parameter binding refuses it (an empty `status` or
    // `cursor` is the default, as upstream's is).
    if single.get("limit") == Some(&"") {
        return Err(OperatorError::invalid());
    }
    let limit = match given("limit") {
        None => DEFAULT_LIMIT,
        Some(text) => match text.parse::<i64>() {
            Ok(0) => DEFAULT_LIMIT,
            Ok(n) if (1..=i64::from(MAX_LIMIT)).contains(&n) => n as u32,
            _ => return Err(OperatorError::invalid()),
        },
    };
    let target_kind = bounded("target_kind")?;
    if target_kind
        .as_deref()
        .is_some_and(|kind| kind.trim().is_empty())
    {
        return Err(OperatorError::invalid());
    }
    if target_kind.is_none() && !target.is_empty() {
        return Err(OperatorError::invalid());
    }
    let mut query = ListQuery {
        status,
        requester: bounded("requester")?,
        operation: bounded("operation")?,
        target_kind,
        target,
        limit,
        after: None,
    };
    if let Some(cursor) = given("cursor") {
        if cursor.chars().count() > MAX_CURSOR_CHARS {
            return Err(OperatorError::invalid());
        }
        let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(cursor)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Cursor>(&bytes).ok())
            .ok_or_else(OperatorError::invalid)?;
        if decoded.query_hash != query.hash() || decoded.id.is_empty() {
            return Err(OperatorError::invalid());
        }
        query.after = Some((decoded.created_at, decoded.id));
    }
    Ok(query)
}

/// The store's query for `query`: the operations that need approval (narrowed by the
/// operation and target-kind filters), the states of the group.
fn store_query(query: &ListQuery, limit: u32) -> RequestQuery {
    let operations = registry::approval_operations()
        .filter(|op| {
            query
                .operation
                .as_deref()
                .is_none_or(|wanted| wanted == *op)
        })
        .filter(|op| {
            query
                .target_kind
                .as_deref()
                .is_none_or(|kind| kind == registry::target_kind(op))
        })
        .map(str::to_owned)
        .collect();
    let live = vec![
        OperationState::Pending,
        OperationState::Approved,
        OperationState::Executing,
    ];
    let states = match query.status {
        StatusGroup::Pending => StateFilter::In(vec![OperationState::Pending]),
        StatusGroup::Active => {
            StateFilter::In(vec![OperationState::Approved, OperationState::Executing])
        }
        StatusGroup::History => StateFilter::NotIn(live),
        StatusGroup::All => StateFilter::Any,
    };
    RequestQuery {
        operations,
        states,
        requester: query.requester.clone(),
        target: query
            .target
            .iter()
            .map(|(field, values)| (field.clone(), values.iter().cloned().collect()))
            .collect(),
        before: query.after.clone(),
        limit,
    }
}

/// The query string of a request page, judged ([`parse_list_query`]) before the credential.
pub(crate) struct ListParams(ListQuery);

impl<S: Send + Sync> FromRequestParts<S> for ListParams {
    type Rejection = OperatorError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<ListParams, OperatorError> {
        let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(&parts.uri)
            .map_err(|_| OperatorError::invalid())?;
        parse_list_query(&pairs).map(ListParams)
    }
}

/// The most reads of one request page while due requests on it are settled.
const MAX_SETTLE_PASSES: u32 = 4;

/// `GET /api/operator/v1/requests`.
pub(crate) async fn list(
    State(core): State<Arc<Core>>,
    ListParams(query): ListParams,
    _operator: OperatorName,
) -> OperatorResult {
    core.settle_expiries().await;
    // The event cursor is read before the page: every event at or below it was committed before
    // the page's read began, so the page shows what it says and a consumer streaming from it
    // misses nothing. Read after, a change committed in between would be in neither.
    let event_cursor = query
        .after
        .is_none()
        .then(|| core.newest_event_cursor())
        .flatten();
    // A request on the page whose time ran out before this read is expired first (or its
    // move since the read waited out), and the page read again: it may have left a `pending`
    // or `active` page. Each pass ends every due request it read (expired, or moved on), so
    // the next finds none of them; the bound only guards against a page that keeps changing.
    let now = SystemTime::now();
    let mut passes = 0;
    let mut rows = loop {
        let rows = core
            .db
            .request_page(store_query(&query, query.limit + 1))
            .await?;
        passes += 1;
        if passes == MAX_SETTLE_PASSES || !core.expire_due_among(&rows, now).await? {
            break rows;
        }
    };
    let more = rows.len() > query.limit as usize;
    rows.truncate(query.limit as usize);
    let requests: Vec<Value> = rows
        .iter()
        .map(|record| broker_request(record, core.pending_timeout))
        .collect();
    let mut page = json!({ "requests": requests });
    if more && let Some(last) = rows.last() {
        page["next_cursor"] = Value::from(query.cursor_after(last));
    }
    if let Some(cursor) = event_cursor {
        page["event_cursor"] = Value::from(cursor);
    }
    Ok(json_response(StatusCode::OK, page))
}

/// The `{id}` of a request route: 1 to 128 characters, judged before the credential.
pub(crate) struct RequestId(pub(crate) String);

impl<S: Send + Sync> FromRequestParts<S> for RequestId {
    type Rejection = OperatorError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<RequestId, OperatorError> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| OperatorError::invalid())?;
        valid_id(&id)?;
        Ok(RequestId(id))
    }
}

/// A request id within the contract's bounds (1 to 128 characters), else 400.
pub(crate) fn valid_id(id: &str) -> Result<(), OperatorError> {
    if id.is_empty() || id.chars().count() > MAX_ID_CHARS {
        return Err(OperatorError::invalid());
    }
    Ok(())
}

/// The request `id`: an operation that needs approval; any other id is 404 `request not found`.
pub(crate) async fn find_request(core: &Core, id: &str) -> Result<OperationRecord, OperatorError> {
    match core.db.get(id).await? {
        Some(record) if registry::needs_approval(&record.operation) => Ok(record),
        _ => Err(OperatorError::no_request()),
    }
}

/// `GET /api/operator/v1/requests/{id}`.
pub(crate) async fn get_one(
    State(core): State<Arc<Core>>,
    RequestId(id): RequestId,
    _operator: OperatorName,
) -> OperatorResult {
    core.settle_expiries().await;
    let mut record = find_request(&core, &id).await?;
    // Its time ran out but its expiry is not written yet: expired first, then read again.
    if core
        .expire_due_among(std::slice::from_ref(&record), SystemTime::now())
        .await?
    {
        record = find_request(&core, &id).await?;
    }
    Ok(json_response(
        StatusCode::OK,
        broker_request(&record, core.pending_timeout),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::extract::test_pairs;

    fn parse(query: &[(&str, &str)]) -> Result<ListQuery, OperatorError> {
        parse_list_query(&test_pairs(query))
    }

    #[test]
    fn an_empty_query_is_every_status_fifty_at_a_time() {
        let query = parse(&[]).unwrap();
        assert_eq!(query.status, StatusGroup::All);
        assert_eq!(query.limit, DEFAULT_LIMIT);
        assert_eq!(parse(&[("limit", "0")]).unwrap().limit, DEFAULT_LIMIT);
        assert_eq!(parse(&[("status", "")]).unwrap().status, StatusGroup::All);
        assert_eq!(parse(&[("limit", "100")]).unwrap().limit, 100);
    }

    #[test]
    fn unknown_repeated_and_out_of_bounds_parameters_are_refused() {
        for bad in [
            vec![("state", "pending")],
            vec![("status", "pending"), ("status", "active")],
            vec![("status", "done")],
            vec![("limit", "101")],
            vec![("limit", "-1")],
            vec![("limit", "ten")],
            vec![("target.", "x")],
            vec![("target.repo", "demo")],
            vec![("target_kind", "demo"), ("target.repo", "")],
            // Blank, as upstream refuses: an empty limit, whitespace for a kind, field or value.
            vec![("limit", "")],
            vec![("target_kind", " ")],
            vec![("target_kind", "demo"), ("target. ", "x")],
            vec![("target_kind", "demo"), ("target.repo", " \t")],
            vec![("requester", &"a".repeat(129))],
            vec![("cursor", "not a cursor")],
        ] {
            let err = parse(&bad).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad:?}");
            assert_eq!(err.message(), "request is invalid", "{bad:?}");
        }
    }

    #[test]
    fn a_cursor_is_bound_to_the_query_that_made_it() {
        let query = parse(&[("status", "pending"), ("limit", "2")]).unwrap();
        let record = OperationRecord::example("op_2");
        let cursor = query.cursor_after(&record);
        let next = parse(&[("status", "pending"), ("limit", "2"), ("cursor", &cursor)]).unwrap();
        assert_eq!(
            next.after,
            Some(("2026-01-01T00:00:00.000Z".to_owned(), "op_2".to_owned()))
        );
        for other in [
            vec![
                ("status", "active"),
                ("limit", "2"),
                ("cursor", cursor.as_str()),
            ],
            vec![
                ("status", "pending"),
                ("limit", "3"),
                ("cursor", cursor.as_str()),
            ],
            vec![("status", "pending"), ("cursor", cursor.as_str())],
        ] {
            assert!(parse(&other).is_err(), "{other:?}");
        }
    }
}
