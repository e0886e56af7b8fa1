//! Every key of one deployment, under one hash tag: each starts with `{prefix}`, so all of them
//! live in one Redis Cluster slot, and two deployments can share a Redis under two prefixes.

/// Every key of one deployment, under one hash tag.
pub(super) struct Keys {
    pub(super) base: String,
    pub(super) counts: String,
    pub(super) ops: String,
    pub(super) replicas: String,
    /// The deployment's epoch: written by the first registration on a Redis that holds nothing
    /// of the deployment, so a Redis that forgot (restart, flush, failover) is told apart.
    pub(super) epoch: String,
    /// Present while the replicas register again after Redis forgot: no admission meanwhile.
    pub(super) recovery: String,
    /// The replicas expected to register again before the recovery ends.
    pub(super) expected: String,
    /// Replica → the epoch it last registered in.
    pub(super) members: String,
    /// The channel the scripts publish on when they lower a count (see `memory`).
    pub(super) notices: String,
}

impl Keys {
    pub(super) fn new(prefix: &str) -> Keys {
        let base = format!("{{{prefix}}}");
        Keys {
            counts: format!("{base}:counts"),
            ops: format!("{base}:ops"),
            replicas: format!("{base}:replicas"),
            epoch: format!("{base}:epoch"),
            recovery: format!("{base}:recovery"),
            expected: format!("{base}:expected"),
            members: format!("{base}:members"),
            notices: format!("{base}:notices"),
            base,
        }
    }
    pub(super) fn lease(&self, replica: &str) -> String {
        format!("{}:lease:{replica}", self.base)
    }
    /// The set of operation ids an older build kept per replica beside the records (the records
    /// name their replica now): registration deletes it.
    pub(super) fn held(&self, replica: &str) -> String {
        format!("{}:held:{replica}", self.base)
    }
    pub(super) fn idempotency(&self, client: &str, key: &str) -> String {
        format!("{}:key:{client}:{key}", self.base)
    }
}
