//! The admission quota file: its wire format, its validation, and where it is loaded from.
//!
//! A quota file is judged strictly because a typo in it silently changes who is protected: an
//! override for `bot7` when the identity is `bot-7` would leave that client on the defaults. So
//! every rule of the contract is checked here, before a controller ever sees the values, and every
//! error names the JSON path and the rule it broke.

mod error;
mod fair_share;
mod identity;
mod limits;
mod load;
pub mod secrets;
mod validate;
mod wire;

pub use error::{ConfigError, Rule};
pub use fair_share::{FairShare, Pool, PoolShare};
pub use identity::{Identity, IdentityError};
pub use limits::{
    ClientLimits, Limits, MAX_FILE_BYTES, MAX_LIMIT, MAX_WINDOW_SECONDS, PENDING_GRANT_CLIENT_CAP,
};
pub use load::{check_path, read_quota_file};
pub use secrets::{Operators, Secrets, SecretsError};

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

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
    /// How the global pools are shared; `None`: first come, first served.
    fair_share: Option<FairShare>,
}

impl Config {
    /// Builds a configuration from values in code, checking every rule a quota file must satisfy;
    /// an error names the JSON path a file with these values would have.
    pub fn new<I: IntoIterator<Item = Identity>>(
        limits: Limits,
        overrides: BTreeMap<Identity, ClientLimits>,
        identities: I,
    ) -> Result<Config, ConfigError> {
        let identities: BTreeSet<Identity> = identities.into_iter().collect();
        validate::validate(&limits, &overrides, &identities)?;
        Ok(Config {
            limits,
            overrides,
            identities,
            fair_share: None,
        })
    }

    /// The same configuration with the global pools shared as `fair_share` says (`None`: first
    /// come, first served), checked as a quota file's `fair_share` is: each `reserve` below its
    /// pool's global limit, each `floor` at least one and at most every client's own limit for
    /// the pool. An error names the JSON path a file would have (`fair_share.active.floor`).
    ///
    /// ```
    /// use unyolo_admission::config::{Config, FairShare, Identity, PoolShare};
    ///
    /// let config = Config::defaults([Identity::new("bot-7").unwrap()]);
    /// let share = |reserve, floor| PoolShare { reserve, floor };
    /// let err = config
    ///     .clone()
    ///     .with_fair_share(Some(FairShare { active: share(32, 2), executing: share(64, 1) }))
    ///     .unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "fair_share.executing.reserve: 64 is not below global_executing 64"
    /// );
    /// let fair = config
    ///     .with_fair_share(Some(FairShare { active: share(32, 2), executing: share(4, 1) }))
    ///     .unwrap();
    /// assert_eq!(fair.fair_share().unwrap().executing.reserve, 4);
    /// ```
    pub fn with_fair_share(self, fair_share: Option<FairShare>) -> Result<Config, ConfigError> {
        if let Some(share) = &fair_share {
            validate::validate_fair_share(&self.limits, &self.overrides, share)?;
        }
        Ok(Config { fair_share, ..self })
    }

    /// Parses and validates the bytes of a quota file for the given client identities.
    ///
    /// This is the single entry point for untrusted bytes: it never panics, and it refuses
    /// anything the quota file's rules do not allow (each a [`Rule`]; `docs/quota-file.md` lists them). With no
    /// identities, every override key is unknown.
    ///
    /// ```
    /// use unyolo_admission::config::{Config, Identity};
    ///
    /// let bot = Identity::new("bot-7").unwrap();
    /// let file = br#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
    ///   "client_pending": 10, "global_active": 512, "global_executing": 64,
    ///   "clients": {"bot-7": {"requests_per_window": 5, "window_seconds": 60,
    ///                          "active": 8, "pending": 12}}}"#;
    /// let err = Config::from_bytes(file, [bot]).unwrap_err();
    /// assert_eq!(err.to_string(), "clients.bot-7.pending: 12 is above active 8");
    /// ```
    pub fn from_bytes<I: IntoIterator<Item = Identity>>(
        bytes: &[u8],
        identities: I,
    ) -> Result<Config, ConfigError> {
        let identities: BTreeSet<Identity> = identities.into_iter().collect();
        let (limits, overrides, fair_share) = wire::parse(bytes, &identities)?;
        Config::new(limits, overrides, identities)?.with_fair_share(fair_share)
    }

    /// Reads and validates the quota file at `path`, which must be absolute and normalized (see
    /// [`check_path`]), an existing file, and at most [`MAX_FILE_BYTES`] long.
    pub fn from_path<I: IntoIterator<Item = Identity>>(
        path: &Path,
        identities: I,
    ) -> Result<Config, ConfigError> {
        let bytes = load::read_quota_file(path)?;
        Config::from_bytes(&bytes, identities).map_err(|e| e.in_file(path))
    }

    /// Reads the quota file at `path` if one is configured: `None` (no flag, no variable) means
    /// [`Config::defaults`]. A path that is given is loaded as with [`Config::from_path`], so a
    /// missing file is an error like any other (a quota file that was meant but is not there must
    /// not quietly become the defaults), as are a path that is not absolute and
    /// normalized, a directory, an unreadable or invalid file.
    ///
    /// ```
    /// use unyolo_admission::config::{Config, Identity, Rule};
    ///
    /// let bot = Identity::new("bot-7").unwrap();
    /// let config = Config::from_optional_path(None, [bot.clone()]);
    /// assert_eq!(config.unwrap(), Config::defaults([bot.clone()]));
    /// let missing = Config::from_optional_path(Some("/no/such/quota.json".as_ref()), [bot.clone()]);
    /// assert_eq!(missing.unwrap_err().rule(), Rule::FileNotFound);
    /// assert!(Config::from_optional_path(Some("quota.json".as_ref()), [bot]).is_err());
    /// ```
    pub fn from_optional_path<I: IntoIterator<Item = Identity>>(
        path: Option<&Path>,
        identities: I,
    ) -> Result<Config, ConfigError> {
        match path {
            None => Ok(Config::defaults(identities)),
            Some(path) => Config::from_path(path, identities),
        }
    }

    /// Loads the quota file whose path is the value of the environment variable `var` (brokers use
    /// `HF_BROKER_ADMISSION_CONFIG`, `GH_BROKER_ADMISSION_CONFIG`); unset or empty means
    /// [`Config::defaults`].
    pub fn from_env<I: IntoIterator<Item = Identity>>(
        var: &str,
        identities: I,
    ) -> Result<Config, ConfigError> {
        let value = std::env::var_os(var);
        match load::path_from_env(value.as_deref()) {
            // A path that is wrong (not absolute, missing, a directory) is fixed in the
            // variable, so its error names it; a file's contents are fixed in the file.
            Some(path) => Config::from_path(&path, identities).map_err(|err| match err {
                ConfigError::Path { file, rule, detail } => ConfigError::Path {
                    file,
                    rule,
                    detail: format!("{detail} (the path is the value of {var})"),
                },
                other => other,
            }),
            None => Ok(Config::defaults(identities)),
        }
    }

    /// The configuration as a complete quota file, pretty-printed and ending in a newline;
    /// [`Config::from_bytes`] with the same identities gives back an equal `Config`.
    pub fn to_json(&self) -> String {
        wire::write(&self.limits, &self.overrides, self.fair_share)
    }

    /// Where a store cap binds before a configured limit, so the limit can never be reached: the
    /// pending limit of the defaults or of an override above [`PENDING_GRANT_CLIENT_CAP`].
    pub fn warnings(&self) -> Vec<ConfigWarning> {
        let cap_note = |path: String, pending: u32| ConfigWarning {
            detail: format!(
                "{pending} is above the pending-grant store's per-client cap {PENDING_GRANT_CLIENT_CAP}, so at most {PENDING_GRANT_CLIENT_CAP} operations can await approval"
            ),
            path,
        };
        let mut warnings = Vec::new();
        if self.limits.client_pending > PENDING_GRANT_CLIENT_CAP {
            warnings.push(cap_note(
                "client_pending".to_owned(),
                self.limits.client_pending,
            ));
        }
        for (identity, o) in &self.overrides {
            if o.pending > PENDING_GRANT_CLIENT_CAP {
                warnings.push(cap_note(
                    error::join_path(&error::join_path("clients", identity.as_str()), "pending"),
                    o.pending,
                ));
            }
        }
        warnings
    }

    /// Every configured identity with the limits that apply to it and where they come from.
    pub fn effective_all(
        &self,
    ) -> impl ExactSizeIterator<Item = (&Identity, ClientLimits, LimitSource)> + '_ {
        self.identities
            .iter()
            .map(|identity| match self.overrides.get(identity) {
                Some(o) => (identity, *o, LimitSource::Override),
                None => (
                    identity,
                    self.limits.client_defaults(),
                    LimitSource::Default,
                ),
            })
    }

    /// The default limits for the given identities, with no overrides.
    pub fn defaults<I: IntoIterator<Item = Identity>>(identities: I) -> Config {
        Config {
            limits: Limits::DEFAULT,
            overrides: BTreeMap::new(),
            identities: identities.into_iter().collect(),
            fair_share: None,
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

    /// How the global pools are shared (the quota file's `fair_share`); `None` when they are
    /// served first come, first served.
    pub fn fair_share(&self) -> Option<FairShare> {
        self.fair_share
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

    /// The longest rate window of any configured client (zero with none): how far back a
    /// client's admissions can still weigh on its bucket under this configuration.
    pub fn longest_window(&self) -> std::time::Duration {
        let seconds = self
            .identities()
            .filter_map(|identity| self.effective(identity.as_str()))
            .map(|limits| limits.window_seconds)
            .max()
            .unwrap_or(0);
        std::time::Duration::from_secs(u64::from(seconds))
    }
}

/// Where a client's effective limits come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LimitSource {
    /// The client's entry under `clients`.
    Override,
    /// The top-level defaults.
    Default,
}

impl LimitSource {
    /// `override` or `default`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitSource::Override => "override",
            LimitSource::Default => "default",
        }
    }
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A valid configuration that will not behave as written: a store cap binds first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigWarning {
    path: String,
    detail: String,
}

impl ConfigWarning {
    /// The JSON path of the limit that cannot be reached, e.g. `clients.bot-7.pending`.
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.detail)
    }
}
