//! What one operators' request page selects: operations that need an operator's approval,
//! newest first (`created_at`, ties by id, both descending), filtered by state, client,
//! operation and target fields, after a position.

use crate::engine::OperationState;

/// Which states a page shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StateFilter {
    /// Every state.
    #[default]
    Any,
    /// Only these.
    In(Vec<OperationState>),
    /// All but these.
    NotIn(Vec<OperationState>),
}

/// What one request page selects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestQuery {
    /// The operations whose rows are requests here (those that need approval, narrowed by the
    /// query's filters); empty selects nothing.
    pub operations: Vec<String>,
    /// Which states.
    pub states: StateFilter,
    /// Only this client's.
    pub requester: Option<String>,
    /// Target fields: each name must hold exactly the value (a string field, or a scalar by its
    /// JSON text). A field given several distinct values matches nothing (a field holds one).
    pub target: Vec<(String, Vec<String>)>,
    /// Only requests older than this position: (`created_at`, id) of the previous page's last.
    pub before: Option<(String, String)>,
    /// At most this many.
    pub limit: u32,
}
