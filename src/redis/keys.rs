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

#[cfg(test)]
mod tests {
    use redis::cluster_routing::{Route, SlotAddr};

    use super::Keys;
    use crate::redis::scripts;

    /// Every script, as Redis runs it (helpers included).
    const SCRIPTS: [(&str, &str); 8] = [
        ("batch", scripts::BATCH),
        ("replace", scripts::REPLACE),
        ("reap", scripts::REAP),
        ("rebuild", scripts::REBUILD),
        ("heartbeat", scripts::HEARTBEAT),
        ("restore_keys", scripts::RESTORE_KEYS),
        ("retire_keys", scripts::RETIRE_KEYS),
        ("renew_keys", scripts::RENEW_KEYS),
    ];

    /// The literal after each `base .. ` of `source`: the key names it builds from the base.
    fn suffixes(source: &str) -> Vec<&str> {
        source
            .match_indices("base .. ")
            .map(|(at, found)| {
                let rest = &source[at + found.len()..];
                let quote = rest.chars().next().filter(|c| *c == '\'' || *c == '"');
                let Some(quote) = quote else {
                    panic!(
                        "`base .. ` followed by no literal: {}",
                        &rest[..40.min(rest.len())]
                    )
                };
                let body = &rest[1..];
                &body[..body.find(quote).expect("a closed literal")]
            })
            .collect()
    }

    #[test]
    fn every_key_the_scripts_can_touch_is_in_the_deployments_one_cluster_slot() {
        for prefix in ["admission", "a:b", "t", "tenant-7.prod", "x@y!z"] {
            let keys = Keys::new(prefix);
            let slot = Route::with_key(&keys.base, SlotAddr::Master);
            // What the call sites pass as KEYS and as key names in ARGV.
            let mut names = vec![
                keys.counts.clone(),
                keys.ops.clone(),
                keys.replicas.clone(),
                keys.epoch.clone(),
                keys.recovery.clone(),
                keys.expected.clone(),
                keys.members.clone(),
                keys.notices.clone(),
                keys.lease("r1"),
                keys.held("r1"),
                keys.idempotency("amy", "k:{other}"),
            ];
            // What the scripts build from `base` (ARGV[1]: the call sites pass `keys.base`),
            // with the tail some add (a replica's or a client's name, a key).
            for (_, source) in SCRIPTS {
                for suffix in suffixes(source) {
                    names.push(format!("{}{suffix}r1:{{other}}", keys.base));
                }
            }
            for name in names {
                assert!(name.starts_with(&keys.base), "{name}");
                assert_eq!(
                    Route::with_key(&name, SlotAddr::Master),
                    slot,
                    "{name} is outside the slot of {}",
                    keys.base
                );
            }
            // The slot of `{prefix}` is the slot of the prefix alone: the hash tag is the prefix.
            assert_eq!(Route::with_key(prefix, SlotAddr::Master), slot);
        }
    }

    #[test]
    fn the_scripts_build_key_names_only_from_their_keys_and_the_base_they_are_given() {
        for (name, source) in SCRIPTS {
            // `base` is ARGV[1] wherever a script names it (the helpers take it as a parameter).
            for line in source.lines().filter(|l| l.starts_with("local base")) {
                let (names, values) = line.split_once('=').expect("an assignment");
                let at = names.split(',').position(|n| n.trim().ends_with("base"));
                let value = values.split(',').nth(at.expect("base among the names"));
                assert_eq!(value.map(str::trim), Some("ARGV[1]"), "{name}: {line}");
            }
            // Every name built from it continues the hash tag with `:`.
            for suffix in suffixes(source) {
                assert!(suffix.starts_with(':'), "{name}: base .. '{suffix}'");
            }
            // No call names a key by a literal of its own.
            for (at, found) in source.match_indices("redis.call(") {
                let args = &source[at + found.len()..];
                let args = &args[..args.find(')').unwrap_or(args.len())];
                let mut parts = args.split(',').map(str::trim);
                let command = parts.next().unwrap_or("");
                if let Some(first) = parts.next() {
                    assert!(
                        !first.starts_with('\'') && !first.starts_with('"'),
                        "{name}: redis.call({command}, {first} ...) names a key by a literal"
                    );
                }
            }
        }
    }
}
