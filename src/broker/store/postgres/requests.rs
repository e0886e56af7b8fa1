//! The operators' request pages on PostgreSQL: operations that need an operator's approval,
//! newest first (`created_at`, ties by id, both descending, in the `C` collation), filtered by
//! state, client, operation and target fields, after a position; each shape walks the
//! `operations_requests` indexes.

use tokio_postgres::types::ToSql;

use super::super::error::StoreError;
use super::super::records::OperationRecord;
use super::super::requests::{RequestQuery, StateFilter};
use super::handle::PostgresStore;
use super::rows::{RECORD_COLUMNS, record_of};

/// The SQL of `query` and its parameters, in order.
fn page_sql(query: &RequestQuery) -> (String, Vec<Box<dyn ToSql + Sync + Send>>) {
    let mut values: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
    let mut sql = format!("SELECT {RECORD_COLUMNS} FROM operations WHERE operation = ANY($1)");
    values.push(Box::new(query.operations.clone()));
    let states = |list: &[crate::engine::OperationState]| -> Vec<String> {
        list.iter().map(|s| s.as_str().to_owned()).collect()
    };
    match &query.states {
        StateFilter::Any => {}
        StateFilter::In(list) => {
            values.push(Box::new(states(list)));
            sql.push_str(&format!(" AND state = ANY(${})", values.len()));
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
        // A string by its value, any other scalar by its JSON text (`json` keeps a number's
        // text as stored).
        values.push(Box::new(field.clone()));
        let name = values.len();
        values.push(Box::new(wanted[0].clone()));
        let value = values.len();
        sql.push_str(&format!(
            " AND (CASE json_typeof(target::json -> ${name}) \
             WHEN 'string' THEN target::json ->> ${name} \
             ELSE (target::json -> ${name})::text END) = ${value}"
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
    sql.push_str(&format!(
        " ORDER BY created_at DESC, id DESC LIMIT ${}",
        values.len()
    ));
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
