//! The Lua scripts, files in `scripts/` beside this one, built in with `include_str!`: `batch`
//! (every admission and transition, a batch of them in order), `replace` (registration), `reap`
//! (lapsed replicas), `rebuild` (other replicas' work, from a store the fleet shares),
//! `heartbeat` (the lease), and the key records' `restore_keys`, `retire_keys` and
//! `renew_keys`; `shared.lua` and `counts.lua` are helpers some of them share.

use redis::Script;

/// The script every admission and transition runs (a batch of them, in order), with the
/// helpers all scripts share. Public, hidden, for the tests that call it directly.
#[doc(hidden)]
pub const BATCH: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/batch.lua")
);
pub(super) const REPLACE: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/counts.lua"),
    include_str!("scripts/replace.lua")
);
pub(super) const REAP: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/counts.lua"),
    include_str!("scripts/reap.lua")
);
pub(super) const REBUILD: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/counts.lua"),
    include_str!("scripts/rebuild.lua")
);
pub(super) const HEARTBEAT: &str = include_str!("scripts/heartbeat.lua");
pub(super) const RESTORE_KEYS: &str = include_str!("scripts/restore_keys.lua");
pub(super) const RETIRE_KEYS: &str = include_str!("scripts/retire_keys.lua");
pub(super) const RENEW_KEYS: &str = include_str!("scripts/renew_keys.lua");

/// The benchmark's baseline: a rate token and nothing else.
#[doc(hidden)]
pub const RATE_ONLY: &str = include_str!("scripts/rate_only.lua");

/// The scripts, ready to run (`EVALSHA`, loaded again on `NOSCRIPT`).
pub(super) struct Scripts {
    pub(super) batch: Script,
    pub(super) replace: Script,
    pub(super) reap: Script,
    pub(super) rebuild: Script,
    pub(super) heartbeat: Script,
    pub(super) restore_keys: Script,
    pub(super) retire_keys: Script,
    pub(super) renew_keys: Script,
}

impl Scripts {
    pub(super) fn load() -> Scripts {
        Scripts {
            batch: Script::new(BATCH),
            replace: Script::new(REPLACE),
            reap: Script::new(REAP),
            rebuild: Script::new(REBUILD),
            heartbeat: Script::new(HEARTBEAT),
            restore_keys: Script::new(RESTORE_KEYS),
            retire_keys: Script::new(RETIRE_KEYS),
            renew_keys: Script::new(RENEW_KEYS),
        }
    }
}
