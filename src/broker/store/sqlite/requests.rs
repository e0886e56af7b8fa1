//! The operators' request pages: operations that need an operator's approval, newest first
//! (`created_at`, ties by id, both descending), filtered by state, client, operation and target
//! fields, after a position. Each page walks the `operations_requests` indexes (see `schema`) and
//! stops after its rows, so a page costs the same however many requests are stored.

use rusqlite::types::Value as SqlValue;

use crate::engine::OperationState;

use super::super::error::StoreError;
use super::super::records::OperationRecord;
use super::super::requests::{RequestQuery, StateFilter};
use super::database::SqliteStore;
use super::operations::SELECT_OPERATION;

/// The SQL of `query` and its parameters, in order.
fn page_sql(query: &RequestQuery) -> (String, Vec<SqlValue>) {
    let mut sql = format!("{SELECT_OPERATION} WHERE operation IN (");
    let mut values: Vec<SqlValue> = Vec::new();
    for (n, operation) in query.operations.iter().enumerate() {
        sql.push_str(if n == 0 { "?" } else { ", ?" });
        values.push(SqlValue::Text(operation.clone()));
    }
    sql.push(')');
    let states = |sql: &mut String, values: &mut Vec<SqlValue>, list: &[OperationState]| {
        for (n, state) in list.iter().enumerate() {
            sql.push_str(if n == 0 { "?" } else { ", ?" });
            values.push(SqlValue::Text(state.as_str().to_owned()));
        }
        sql.push(')');
    };
    match &query.states {
        StateFilter::Any => {}
        StateFilter::In(list) => {
            sql.push_str(" AND state IN (");
            states(&mut sql, &mut values, list);
        }
        StateFilter::NotIn(list) => {
            sql.push_str(" AND state NOT IN (");
            states(&mut sql, &mut values, list);
        }
    }
    if let Some(requester) = &query.requester {
        sql.push_str(" AND client_id = ?");
        values.push(SqlValue::Text(requester.clone()));
    }
    for (field, wanted) in &query.target {
        if wanted.len() != 1 || field.contains(['"', '\\']) {
            sql.push_str(" AND 0");
            continue;
        }
        // A string by its value, any other scalar by its JSON text: SQLite's `json_extract`
        // gives `true` as 1 and `null` as NULL, so those are named by their type.
        // The path is bound once and named twice by its number (the next `?` numbers on).
        let (path, value) = (values.len() + 1, values.len() + 2);
        sql.push_str(&format!(
            " AND (CASE json_type(target, ?{path}) WHEN 'true' THEN 'true' \
             WHEN 'false' THEN 'false' WHEN 'null' THEN 'null' \
             ELSE CAST(json_extract(target, ?{path}) AS TEXT) END) = ?{value}"
        ));
        values.push(SqlValue::Text(format!("$.\"{field}\"")));
        values.push(SqlValue::Text(wanted[0].clone()));
    }
    if let Some((created_at, id)) = &query.before {
        // A row value, so SQLite seeks the index to the position instead of walking to it.
        sql.push_str(" AND (created_at, id) < (?, ?)");
        values.push(SqlValue::Text(created_at.clone()));
        values.push(SqlValue::Text(id.clone()));
    }
    sql.push_str(" ORDER BY created_at DESC, id DESC LIMIT ?");
    values.push(SqlValue::Integer(i64::from(query.limit)));
    (sql, values)
}

impl SqliteStore {
    /// One page of requests matching `query`, newest first.
    pub async fn request_page(
        &self,
        query: RequestQuery,
    ) -> Result<Vec<OperationRecord>, StoreError> {
        if query.operations.is_empty() || query.limit == 0 {
            return Ok(Vec::new());
        }
        self.read(move |conn, broker| {
            let (sql, values) = page_sql(&query);
            let mut stmt = conn.prepare_cached(&sql)?;
            let rows = stmt.query_map(rusqlite::params_from_iter(values), |row| {
                OperationRecord::from_row(row, broker)
            })?;
            rows.collect()
        })
        .await
    }

    /// How SQLite plans the request page for `query`, one line per step (for the test that every
    /// page shape walks an index and sorts nothing it need not).
    pub async fn explain_request_page(
        &self,
        query: RequestQuery,
    ) -> Result<Vec<String>, StoreError> {
        self.read(move |conn, _| {
            let (sql, values) = page_sql(&query);
            let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
            let rows = stmt.query_map(rusqlite::params_from_iter(values), |row| {
                row.get::<_, String>(3)
            })?;
            rows.collect()
        })
        .await
    }
}
