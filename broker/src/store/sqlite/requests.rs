//! The operators' request pages: operations that need an operator's approval, newest first
//! (`created_at`, ties by id, both descending), filtered by state, client, operation and target
//! fields, after a position. Each page walks the `operations_requests` indexes (see `schema`) and
//! stops after its rows, so a page costs the same however many requests are stored.

use rusqlite::types::Value as SqlValue;

use unyolo_admission::engine::OperationState;

use super::super::error::StoreError;
use super::super::records::OperationRecord;
use super::super::requests::{NUMBER_TEXT_MAX, RequestQuery, StateFilter, filter_number};
use super::database::SqliteStore;
use super::operations::SELECT_OPERATION;

/// Whether the JSON text of a number, `raw`, is one a filter compares: at most
/// `NUMBER_TEXT_MAX` characters, its exponent (what follows the `e`, less its sign and leading
/// zeros) under four digits.
fn comparable_number(raw: &str) -> String {
    format!(
        "(length({raw}) <= {NUMBER_TEXT_MAX} AND (instr(lower({raw}), 'e') = 0 \
         OR length(ltrim(substr({raw}, instr(lower({raw}), 'e') + 1), '+-0')) < 4))"
    )
}

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
        // As `RequestQuery::target` says: a string by its text, a number by its value as a
        // double (a number's JSON text, `target -> path`, bounds which are compared), `true`,
        // `false` and `null` by their JSON type's name (`json_extract` gives `true` as 1).
        // The path is bound once and named by its number (the next `?` numbers on).
        let (path, text, number) = (values.len() + 1, values.len() + 2, values.len() + 3);
        let same_number = format!(
            "{} AND CAST(json_extract(target, ?{path}) AS REAL) = ?{number}",
            comparable_number(&format!("(target -> ?{path})"))
        );
        sql.push_str(&format!(
            " AND (CASE json_type(target, ?{path}) \
             WHEN 'text' THEN json_extract(target, ?{path}) = ?{text} \
             WHEN 'integer' THEN {same_number} WHEN 'real' THEN {same_number} \
             WHEN 'true' THEN ?{text} = 'true' WHEN 'false' THEN ?{text} = 'false' \
             WHEN 'null' THEN ?{text} = 'null' ELSE 0 END)"
        ));
        values.push(SqlValue::Text(format!("$.\"{field}\"")));
        values.push(SqlValue::Text(wanted[0].clone()));
        values.push(filter_number(&wanted[0]).map_or(SqlValue::Null, SqlValue::Real));
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
