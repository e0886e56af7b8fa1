//! The values a quota file sets — one client's limits, and the defaults and global limits at its
//! top level — and the bounds every value (and the file itself) must keep. A leaf: the wire
//! format, the validation and the loading all read these, and none is read back from here.

/// Largest value any count limit may take.
pub const MAX_LIMIT: u32 = 1_000_000;
/// Largest `window_seconds` (one day).
pub const MAX_WINDOW_SECONDS: u32 = 86_400;
/// Largest quota file accepted, in bytes (exactly this many is allowed).
pub const MAX_FILE_BYTES: usize = 65_536;
/// The pending-grant store's default per-client cap: at most this many grants may await an
/// operator decision per client, whatever the client's `pending` limit says. A `pending` limit
/// above it never binds, which `admission check` warns about.
pub const PENDING_GRANT_CLIENT_CAP: u32 = 10;

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
    /// Most operations executing across all clients (GE). While this many execute, every new
    /// submission is refused `global_execution_limit` — one that needs approval too, although it
    /// would not run soon: a saturated pool is the signal to take no new work until it drains.
    /// Queued work waits for a slot ([`Operation::start`](crate::Operation::start)).
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
