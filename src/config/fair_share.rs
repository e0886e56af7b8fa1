//! What a quota file's `fair_share` sets: how each global pool (`global_active`,
//! `global_executing`) is divided between the clients that want it, rather than handed out first
//! come, first served. A leaf, like `limits`: the wire format and the validation read these; the
//! engine turns them into its own rule.
//!
//! Per pool, two numbers:
//!
//! - `reserve`: the last `reserve` slots of the pool go only to clients holding fewer than
//!   `floor` in it, so a client that holds (almost) nothing is admitted however full the big
//!   clients have made the rest;
//! - `floor`: below it a client counts as small, and is admitted while any slot of the pool is
//!   free. At or above it, a client may take a slot only while the pool less its reserve has
//!   room, and only below its share of that: the pool less its reserve, divided among the clients
//!   holding in it (itself included).
//!
//! `docs/quota-file.md` ("Fair share of the global pools") says how to choose them.

use std::fmt;

/// One of the two global pools a fair share divides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// Live operations across all clients (`global_active`): a client holds in it from its
    /// admission to its operation's end.
    Active,
    /// Operations executing across all clients (`global_executing`): a client holds in it from
    /// an operation's start to its end.
    Executing,
}

impl Pool {
    /// Both pools, in the order the quota file lists them.
    pub const ALL: [Pool; 2] = [Pool::Active, Pool::Executing];

    /// The pool's name in the quota file and in metric labels: `active` or `executing`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Pool::Active => "active",
            Pool::Executing => "executing",
        }
    }

    /// The top-level limit that sizes the pool: `global_active` or `global_executing`.
    pub const fn limit_name(self) -> &'static str {
        match self {
            Pool::Active => "global_active",
            Pool::Executing => "global_executing",
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one pool is shared: its `reserve` and its `floor` (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolShare {
    /// Slots at the end of the pool only clients holding fewer than `floor` may take. Zero or
    /// more, below the pool's global limit.
    pub reserve: u32,
    /// Below this many held in the pool a client is small: admitted while any slot is free. At
    /// least one, at most every client's own limit for the pool.
    pub floor: u32,
}

/// A quota file's `fair_share`: both pools, always together (a file that has the section sets
/// it whole).
///
/// ```
/// use unyolo_admission::config::{Config, FairShare, Identity, Pool, PoolShare};
///
/// let file = br#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
///   "client_pending": 10, "global_active": 512, "global_executing": 64,
///   "fair_share": {"active": {"reserve": 32, "floor": 2},
///                  "executing": {"reserve": 4, "floor": 1}}}"#;
/// let config = Config::from_bytes(file, [Identity::new("bot-7").unwrap()]).unwrap();
/// let share = config.fair_share().unwrap();
/// assert_eq!(share.pool(Pool::Executing), PoolShare { reserve: 4, floor: 1 });
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FairShare {
    /// How `global_active` is shared.
    pub active: PoolShare,
    /// How `global_executing` is shared.
    pub executing: PoolShare,
}

impl FairShare {
    /// How `pool` is shared.
    pub const fn pool(&self, pool: Pool) -> PoolShare {
        match pool {
            Pool::Active => self.active,
            Pool::Executing => self.executing,
        }
    }
}

/// The two fields of a pool's entry, in the order the contract lists them.
pub(crate) const POOL_FIELDS: [&str; 2] = ["reserve", "floor"];
