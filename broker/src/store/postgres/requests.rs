//! The operators' request pages on PostgreSQL: operations that need an operator's approval,
//! newest first (`created_at`, ties by id, both descending, in the `C` collation), filtered by
//! state, client, operation and target fields, after a position; each kind of request's rows
//! are walked newest first in `operations_requests` (several kinds: a page of each, merged), or
//! for live states only the live rows' partial index is read and sorted.

use tokio_postgres::types::ToSql;

use super::super::error::StoreError;
use super::super::records::OperationRecord;
use super::super::requests::{NUMBER_TEXT_MAX, RequestQuery, StateFilter, filter_number};
use super::handle::PostgresStore;
use super::rows::{RECORD_COLUMNS, record_of};
use super::schema::LIVE;

/// The SQL of `query` and its parameters, in order.
fn page_sql(query: &RequestQuery) -> (String, Vec<Box<dyn ToSql + Sync + Send>>) {
    let mut values: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
    // The filters every kind of request shares, written once: each kind's branch names the
    // same parameters.
    let mut sql = String::new();
    let states = |list: &[unyolo_admission::engine::OperationState]| -> Vec<String> {
        list.iter().map(|s| s.as_str().to_owned()).collect()
    };
    match &query.states {
        StateFilter::Any => {}
        StateFilter::In(list) => {
            values.push(Box::new(states(list)));
            sql.push_str(&format!(" AND state = ANY(${})", values.len()));
            // Live states only (pending, active): named as such, so a plan made for any list
            // may read the live rows' partial index (`schema::MIGRATE_3`).
            if list.iter().all(|s| !s.is_terminal()) {
                sql.push_str(&format!(" AND state IN {LIVE}"));
            }
        }
        StateFilter::NotIn(list) => {
            values.push(Box::new(states(list)));
            sql.push_str(&format!(" AND NOT (state = ANY(${}))", values.len()));
        }
    }
    if let Some(requester) = &query.requester {
        values.push(Box::new(requester.clone()));
        sql.push_str(&format!(" AND client_id = ${}", values.len()));
    }
    for (field, wanted) in &query.target {
        // As the SQLite store: a field given several values, or a name it cannot address,
        // matches nothing.
        if wanted.len() != 1 || field.contains(['"', '\\']) {
            sql.push_str(" AND false");
            continue;
        }
        // As `RequestQuery::target` says, and as the SQLite store compares: a string by its
        // text; a number by its value as a double, its JSON text (`json` keeps it as written)
        // read as an exact `numeric` only when that is safe (the bounds of `filter_number`),
        // and turned into a double only between the two limits (beyond them `float8` refuses
        // it: at least 2^1024 - 2^970 is infinite, at most 2^-1075 is zero); `true`, `false`
        // and `null` by their JSON text.
        values.push(Box::new(field.clone()));
        let name = values.len();
        values.push(Box::new(wanted[0].clone()));
        let text = values.len();
        values.push(Box::new(filter_number(&wanted[0])));
        let number = values.len();
        sql.push_str(&format!(
            " AND (SELECT CASE json_typeof(v) \
             WHEN 'string' THEN v #>> '{{}}' = ${text} \
             WHEN 'number' THEN CASE \
               WHEN length(v::text) > {NUMBER_TEXT_MAX} \
                 OR v::text ~ '[eE][-+]?0*[1-9][0-9]{{3}}' THEN false \
               WHEN abs(v::text::numeric) >= 2::numeric ^ 1024 - 2::numeric ^ 970 THEN false \
               WHEN abs(v::text::numeric) <= 5::numeric ^ 1075 * 1e-1075 \
                 THEN 0::float8 = ${number} \
               ELSE v::text::numeric::float8 = ${number} END \
             WHEN 'boolean' THEN v::text = ${text} \
             WHEN 'null' THEN v::text = ${text} \
             ELSE false END \
             FROM (SELECT target::json -> ${name} AS v) AS field)"
        ));
    }
    if let Some((created_at, id)) = &query.before {
        values.push(Box::new(created_at.clone()));
        values.push(Box::new(id.clone()));
        sql.push_str(&format!(
            " AND (created_at, id) < (${}, ${})",
            values.len() - 1,
            values.len()
        ));
    }
    values.push(Box::new(i64::from(query.limit)));
    let limit = values.len();
    // Each kind of request is named as such (`operation = $n`), so its rows are read from
    // `operations_requests` in page order and the read stops at the limit; an array on the
    // index's first column (`operation = ANY(..)`) gives no order, and the page would filter
    // every newer row of the table instead. Several kinds: a page of each, merged.
    let order = format!(" ORDER BY created_at DESC, id DESC LIMIT ${limit}");
    let mut branches = Vec::new();
    let mut kinds: Vec<&String> = query.operations.iter().collect();
    kinds.sort();
    kinds.dedup();
    for operation in kinds {
        values.push(Box::new(operation.clone()));
        branches.push(format!(
            "SELECT {RECORD_COLUMNS} FROM operations WHERE operation = ${}{sql}{order}",
            values.len()
        ));
    }
    let sql = match branches.as_slice() {
        [one] => one.clone(),
        _ => format!(
            "SELECT * FROM (({})) AS page{order}",
            branches.join(") UNION ALL (")
        ),
    };
    (sql, values)
}

impl PostgresStore {
    /// One page of requests matching `query`, newest first.
    pub async fn request_page(
        &self,
        query: RequestQuery,
    ) -> Result<Vec<OperationRecord>, StoreError> {
        if query.operations.is_empty() || query.limit == 0 {
            return Ok(Vec::new());
        }
        let (sql, values) = page_sql(&query);
        let params: Vec<&(dyn ToSql + Sync)> = values
            .iter()
            .map(|v| v.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&sql)
            .await
            .map_err(|e| self.sorted(e))?;
        let rows = client
            .query(&stmt, &params)
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter()
            .map(|row| record_of(row, &self.broker))
            .collect()
    }
}
