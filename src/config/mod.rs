//! The admission quota file: its wire format, its validation, and where it is loaded from.
//!
//! A quota file is judged strictly because a typo in it silently changes who is protected: an
//! override for `bot7` when the identity is `bot-7` would leave that client on the defaults. So
//! every rule of the contract is checked here, before a controller ever sees the values, and every
//! error names the JSON path and the rule it broke.

mod identity;

pub use identity::{Identity, IdentityError};

use std::collections::{BTreeMap, BTreeSet};

/// Largest value any count limit may take.
pub const MAX_LIMIT: u32 = 1_000_000;
/// Largest `window_seconds` (one day).
pub const MAX_WINDOW_SECONDS: u32 = 86_400;
/// Largest quota file accepted, in bytes (exactly this many is allowed).
pub const MAX_FILE_BYTES: usize = 65_536;

/// The limits that apply to one client: its rate and its share of the broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientLimits {
    /// Submissions admitted per window (the bucket's capacity, N).
    pub requests_per_window: u32,
    /// Length of the rate window in seconds (W); one token returns every W/N.
    pub window_seconds: u32,
    /// Most operations the client may have pending, approved or executing at once (A).
    pub active: u32,
    /// Most operations the client may have awaiting an operator decision (P).
    pub pending: u32,
}

/// The top level of a quota file: the per-client defaults and the global limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Default submissions per window for clients without an override.
    pub requests_per_window: u32,
    /// Default window length in seconds.
    pub window_seconds: u32,
    /// Default per-client active limit.
    pub client_active: u32,
    /// Default per-client pending limit.
    pub client_pending: u32,
    /// Most operations active across all clients (GA).
    pub global_active: u32,
    /// Most operations executing across all clients (GE).
    pub global_executing: u32,
}

impl Limits {
    /// The conservative defaults used when no quota file is configured.
    pub const DEFAULT: Limits = Limits {
        requests_per_window: 60,
        window_seconds: 60,
        client_active: 25,
        client_pending: 10,
        global_active: 512,
        global_executing: 64,
    };

    /// The per-client limits of a client without an override.
    pub fn client_defaults(&self) -> ClientLimits {
        ClientLimits {
            requests_per_window: self.requests_per_window,
            window_seconds: self.window_seconds,
            active: self.client_active,
            pending: self.client_pending,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A validated admission configuration: the limits of a quota file (or the defaults) bound to the
/// set of client identities the broker authenticates.
///
/// A `Config` can only be built through validation, so holding one means every rule of the quota
/// file contract holds, including that each override names a configured identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    limits: Limits,
    overrides: BTreeMap<Identity, ClientLimits>,
    identities: BTreeSet<Identity>,
}

impl Config {
    /// The default limits for the given identities, with no overrides.
    pub fn defaults<I: IntoIterator<Item = Identity>>(identities: I) -> Config {
        Config {
            limits: Limits::DEFAULT,
            overrides: BTreeMap::new(),
            identities: identities.into_iter().collect(),
        }
    }

    /// The defaults and global limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The configured client identities, in order.
    pub fn identities(&self) -> impl ExactSizeIterator<Item = &Identity> + '_ {
        self.identities.iter()
    }

    /// The per-client overrides, in order.
    pub fn overrides(&self) -> &BTreeMap<Identity, ClientLimits> {
        &self.overrides
    }

    /// The limits that apply to `identity`: its override, else the defaults. `None` when the
    /// identity is not configured.
    pub fn effective(&self, identity: &str) -> Option<ClientLimits> {
        if !self.identities.contains(identity) {
            return None;
        }
        Some(
            self.overrides
                .get(identity)
                .copied()
                .unwrap_or_else(|| self.limits.client_defaults()),
        )
    }
}
