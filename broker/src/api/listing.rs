//! `GET /api/agent/v1/operations?idempotency_key=&state=&limit=&cursor=`: the caller's own
//! operations as pages of summaries, newest first.
//!
//! Pages are a keyset walk on the store's creation order: a cursor names the position of the
//! last operation shown, and the next page starts strictly below it. Operations created meanwhile
//! sit above every cursor, so a client paging while new work arrives sees each older operation
//! exactly once, and a page costs one index range scan whatever the table's size.
//!
//! A page reads only what a summary shows: the store selects the summary's columns (the
//! presentation stored at creation), never a row's `target` or `arguments`, and the page's room
//! in the buffered-bytes budget (a bound per row) is reserved before the page is read and held
//! until it has been sent.
//!
//! A cursor is opaque to clients: base64url of a version byte, the position, and a check value
//! over the position, the client and the filters. A cursor that does not decode, that was made
//! for another client or other filters, or that was tampered with is a 400; it carries nothing a
//! client could not see anyway, so the check guards against mistakes, not attackers.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::{Value, json};

use super::contract::API_VERSION;
use super::error::{ApiError, ApiResult};
use super::extract::{
    Client, QueryPairs, SUMMARY_ROW_BYTES, is_idempotency_key, parse_integer, rendered,
    reserve_render, single_params,
};
use crate::core::Core;
use crate::store::PageQuery;
use unyolo_admission::engine::OperationState;

/// The page size when the query names none.
pub const DEFAULT_LIMIT: u32 = 20;
/// The largest page.
pub const MAX_LIMIT: u32 = 50;

const CURSOR_VERSION: u8 = 1;
/// Version byte, position (8 bytes), check (8 bytes).
const CURSOR_BYTES: usize = 17;

/// A listing request, validated.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ListQuery {
    pub(crate) idempotency_key: Option<String>,
    pub(crate) state: Option<OperationState>,
    pub(crate) limit: u32,
    pub(crate) cursor: Option<String>,
}

pub(crate) fn parse_query(pairs: Vec<(String, String)>) -> Result<ListQuery, ApiError> {
    let mut params = single_params(pairs, &["idempotency_key", "state", "limit", "cursor"])?;
    // Trimmed, as a submission's key is (and as upstream's listing trims it).
    let idempotency_key = params
        .remove("idempotency_key")
        .map(|key| key.trim().to_owned());
    if let Some(key) = &idempotency_key
        && !is_idempotency_key(key)
    {
        return Err(ApiError::invalid(
            "idempotency_key must match ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$.",
        ));
    }
    let state = match params.remove("state") {
        None => None,
        Some(name) => Some(OperationState::parse(&name).ok_or_else(|| {
            ApiError::invalid(format!("state {name:?} is not an operation state."))
        })?),
    };
    let limit = match params.remove("limit") {
        None => DEFAULT_LIMIT,
        Some(text) => parse_integer(&text)
            .filter(|n| (1..=u64::from(MAX_LIMIT)).contains(n))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ApiError::invalid("limit must be an integer from 1 to 50."))?,
    };
    Ok(ListQuery {
        idempotency_key,
        state,
        limit,
        cursor: params.remove("cursor"),
    })
}

/// FNV-1a over the cursor's scope: stable across restarts and builds, so a cursor stays good
/// while the broker restarts between two pages.
fn check_value(position: i64, client: &str, query: &ListQuery) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator no field contains, so ("ab","c") and ("a","bc") differ.
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    };
    feed(b"unyolo-admission list cursor");
    feed(&position.to_be_bytes());
    feed(client.as_bytes());
    feed(query.idempotency_key.as_deref().unwrap_or("").as_bytes());
    feed(query.state.map(|s| s.as_str()).unwrap_or("").as_bytes());
    hash
}

pub(crate) fn encode_cursor(position: i64, client: &str, query: &ListQuery) -> String {
    let mut bytes = Vec::with_capacity(CURSOR_BYTES);
    bytes.push(CURSOR_VERSION);
    bytes.extend_from_slice(&position.to_be_bytes());
    bytes.extend_from_slice(&check_value(position, client, query).to_be_bytes());
    URL_SAFE_NO_PAD.encode(bytes)
}

pub(crate) fn decode_cursor(
    cursor: &str,
    client: &str,
    query: &ListQuery,
) -> Result<i64, ApiError> {
    let bad = || ApiError::invalid("cursor is not a next_cursor this listing gave.");
    if cursor.len() > 128 {
        return Err(bad());
    }
    let bytes = URL_SAFE_NO_PAD.decode(cursor).map_err(|_| bad())?;
    if bytes.len() != CURSOR_BYTES || bytes[0] != CURSOR_VERSION {
        return Err(bad());
    }
    let position = i64::from_be_bytes(bytes[1..9].try_into().map_err(|_| bad())?);
    let check = u64::from_be_bytes(bytes[9..17].try_into().map_err(|_| bad())?);
    if position < 1 || check != check_value(position, client, query) {
        return Err(bad());
    }
    Ok(position)
}

/// The listing route.
pub(crate) async fn list_operations(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    QueryPairs(pairs): QueryPairs,
) -> ApiResult {
    let query = parse_query(pairs)?;
    let before = match &query.cursor {
        None => None,
        Some(cursor) => Some(decode_cursor(cursor, client.as_str(), &query)?),
    };
    // One more than the page: whether it exists says whether there is a next page.
    let room = (query.limit as usize + 1) * SUMMARY_ROW_BYTES;
    let reservation = reserve_render(&core, room).await?;
    let mut rows = core
        .db
        .list_page(
            client.as_str(),
            PageQuery {
                idempotency_key: query.idempotency_key.clone(),
                state: query.state,
                before,
                limit: query.limit + 1,
            },
        )
        .await?;
    let more = rows.len() > query.limit as usize;
    rows.truncate(query.limit as usize);
    let next_cursor = match rows.last() {
        Some((position, _)) if more => {
            Value::from(encode_cursor(*position, client.as_str(), &query))
        }
        _ => Value::Null,
    };
    let operations: Vec<Value> = rows
        .iter()
        .map(|(_, record)| record.to_summary_json())
        .collect();
    drop(rows);
    Ok(rendered(
        StatusCode::OK,
        json!({
            "api_version": API_VERSION,
            "operations": operations,
            "next_cursor": next_cursor,
        }),
        reservation,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::extract::test_pairs as pairs;

    #[test]
    fn listing_parameters_are_bounded_and_strict() {
        let all = parse_query(pairs(&[
            ("idempotency_key", "k-1"),
            ("state", "pending"),
            ("limit", "50"),
        ]))
        .unwrap();
        assert_eq!(
            all,
            ListQuery {
                idempotency_key: Some("k-1".to_owned()),
                state: Some(OperationState::Pending),
                limit: 50,
                cursor: None,
            }
        );
        assert_eq!(parse_query(vec![]).unwrap().limit, DEFAULT_LIMIT);
        for bad in [
            &[("limit", "0")][..],
            &[("limit", "51")],
            &[("limit", "ten")],
            &[("limit", "+5")],
            &[("limit", "99999999999999999999999")],
            &[("state", "running")],
            &[("idempotency_key", "-bad")],
            &[("limit", "5"), ("limit", "6")],
            &[("page", "2")],
            &[("cursor", "")],
            &[("idempotency_key", "")],
            &[("limit", "")],
        ] {
            assert!(parse_query(pairs(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_cursor_is_good_only_for_its_client_and_filters() {
        let query = parse_query(pairs(&[("state", "pending")])).unwrap();
        let cursor = encode_cursor(42, "agent", &query);
        assert!(cursor.len() <= 128);
        assert_eq!(decode_cursor(&cursor, "agent", &query).unwrap(), 42);
        assert!(decode_cursor(&cursor, "other", &query).is_err());
        let unfiltered = parse_query(vec![]).unwrap();
        assert!(decode_cursor(&cursor, "agent", &unfiltered).is_err());
        // Tampered: the position changed, the check did not.
        let mut bytes = URL_SAFE_NO_PAD.decode(&cursor).unwrap();
        bytes[8] ^= 1;
        assert!(decode_cursor(&URL_SAFE_NO_PAD.encode(bytes), "agent", &query).is_err());
        for garbled in ["", "!!!", "AAAA", &"A".repeat(200), "bm90IGEgY3Vyc29y"] {
            assert!(
                decode_cursor(garbled, "agent", &query).is_err(),
                "{garbled}"
            );
        }
    }
}
