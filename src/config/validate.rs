//! The rules of the quota file that hold across values: bounds, pending within active, a client
//! within the globals, overrides only for configured identities, and a fair share that leaves
//! each pool something to share and no client always small.
//!
//! These rules apply however a [`Config`](super::Config) is made — from a file or from values in
//! code — so both paths call the same functions here, and an error from code names the same JSON
//! path a file with those values would.

use std::collections::{BTreeMap, BTreeSet};

use super::error::{ConfigError, Rule, join_path, nearest};
use super::fair_share::{FairShare, Pool, PoolShare};
use super::identity::Identity;
use super::limits::{ClientLimits, Limits, MAX_LIMIT, MAX_WINDOW_SECONDS};

/// The JSON path of `field` in `pool`'s entry of `fair_share`, e.g. `fair_share.executing.floor`.
pub(crate) fn share_path(pool: Pool, field: &str) -> String {
    join_path(&join_path("fair_share", pool.as_str()), field)
}

/// The largest value `field` may take.
pub(crate) fn maximum_for(field: &str) -> u32 {
    if field == "window_seconds" {
        MAX_WINDOW_SECONDS
    } else {
        MAX_LIMIT
    }
}

/// Checks one limit: not zero and not above the field's maximum.
pub(crate) fn check_limit(value: u64, path: &str, field: &str) -> Result<u32, ConfigError> {
    let maximum = maximum_for(field);
    if value == 0 {
        return Err(ConfigError::invalid(
            path,
            Rule::Zero,
            "0 is not allowed; limits are positive integers",
        ));
    }
    match u32::try_from(value) {
        Ok(v) if v <= maximum => Ok(v),
        _ => Err(ConfigError::invalid(
            path,
            Rule::AboveMaximum,
            format!("{value} is above the maximum {maximum}"),
        )),
    }
}

/// Checks that an override key is exactly (byte for byte) a configured identity, suggesting the
/// identity probably meant when one is close.
pub(crate) fn check_override_key(
    key: &str,
    path: &str,
    identities: &BTreeSet<Identity>,
) -> Result<Identity, ConfigError> {
    if let Some(identity) = identities.get(key) {
        return Ok(identity.clone());
    }
    let hint = if identities.is_empty() {
        " (no identities are configured, so no override can apply)".to_owned()
    } else {
        match nearest(key, identities.iter().map(Identity::as_str)) {
            Some(identity) => format!(" (did you mean {identity}?)"),
            None => String::new(),
        }
    };
    Err(ConfigError::invalid(
        path,
        Rule::UnknownIdentity,
        format!("{key:?} is not a configured identity{hint}"),
    ))
}

/// Checks every rule that a [`Config`](super::Config) must satisfy.
pub(crate) fn validate(
    limits: &Limits,
    overrides: &BTreeMap<Identity, ClientLimits>,
    identities: &BTreeSet<Identity>,
) -> Result<(), ConfigError> {
    let top = [
        ("requests_per_window", limits.requests_per_window),
        ("window_seconds", limits.window_seconds),
        ("client_active", limits.client_active),
        ("client_pending", limits.client_pending),
        ("global_active", limits.global_active),
        ("global_executing", limits.global_executing),
    ];
    for (field, value) in top {
        check_limit(u64::from(value), field, field)?;
    }
    for (identity, o) in overrides {
        let path = join_path("clients", identity.as_str());
        check_override_key(identity.as_str(), &path, identities)?;
        let fields = [
            ("requests_per_window", o.requests_per_window),
            ("window_seconds", o.window_seconds),
            ("active", o.active),
            ("pending", o.pending),
        ];
        for (field, value) in fields {
            check_limit(u64::from(value), &join_path(&path, field), field)?;
        }
    }

    if limits.client_pending > limits.client_active {
        return Err(ConfigError::invalid(
            "client_pending",
            Rule::PendingAboveActive,
            format!(
                "{} is above client_active {}; pending operations count as active too",
                limits.client_pending, limits.client_active
            ),
        ));
    }
    if limits.client_active > limits.global_active {
        return Err(ConfigError::invalid(
            "client_active",
            Rule::ActiveAboveGlobalActive,
            format!(
                "{} is above global_active {}; a client may not hold more than the whole broker",
                limits.client_active, limits.global_active
            ),
        ));
    }
    if limits.global_executing > limits.global_active {
        return Err(ConfigError::invalid(
            "global_executing",
            Rule::ExecutingAboveGlobalActive,
            format!(
                "{} is above global_active {}; executing operations count as active too",
                limits.global_executing, limits.global_active
            ),
        ));
    }
    for (identity, o) in overrides {
        let path = join_path("clients", identity.as_str());
        if o.pending > o.active {
            return Err(ConfigError::invalid(
                join_path(&path, "pending"),
                Rule::PendingAboveActive,
                format!("{} is above active {}", o.pending, o.active),
            ));
        }
        if o.active > limits.global_active {
            return Err(ConfigError::invalid(
                join_path(&path, "active"),
                Rule::ActiveAboveGlobalActive,
                format!(
                    "{} is above global_active {}",
                    o.active, limits.global_active
                ),
            ));
        }
    }
    Ok(())
}

/// Checks a fair share against the limits and overrides it would apply with (themselves valid):
/// per pool, in the contract's order, `reserve` at most the maximum and below the pool's global
/// limit, then `floor` at least one, at most the maximum, and at most every client's own limit
/// for the pool (an override's `active` for both pools; `client_active` for clients on the
/// defaults).
pub(crate) fn validate_fair_share(
    limits: &Limits,
    overrides: &BTreeMap<Identity, ClientLimits>,
    share: &FairShare,
) -> Result<(), ConfigError> {
    for pool in Pool::ALL {
        let PoolShare { reserve, floor } = share.pool(pool);
        let global = match pool {
            Pool::Active => limits.global_active,
            Pool::Executing => limits.global_executing,
        };
        let path = share_path(pool, "reserve");
        if reserve > MAX_LIMIT {
            return Err(ConfigError::invalid(
                path,
                Rule::AboveMaximum,
                format!("{reserve} is above the maximum {MAX_LIMIT}"),
            ));
        }
        if reserve >= global {
            return Err(ConfigError::invalid(
                path,
                Rule::ReserveNotBelowGlobal,
                format!("{reserve} is not below {} {global}", pool.limit_name()),
            ));
        }
        let path = share_path(pool, "floor");
        if floor == 0 {
            return Err(ConfigError::invalid(
                path,
                Rule::Zero,
                "0 is not allowed; a floor is a positive integer",
            ));
        }
        if floor > MAX_LIMIT {
            return Err(ConfigError::invalid(
                path,
                Rule::AboveMaximum,
                format!("{floor} is above the maximum {MAX_LIMIT}"),
            ));
        }
        let always_small = "; that client would always count as small";
        if floor > limits.client_active {
            return Err(ConfigError::invalid(
                path,
                Rule::FloorAboveClientLimit,
                format!(
                    "{floor} is above client_active {}{always_small}",
                    limits.client_active
                ),
            ));
        }
        for (identity, o) in overrides {
            if floor > o.active {
                let active = join_path(&join_path("clients", identity.as_str()), "active");
                return Err(ConfigError::invalid(
                    path,
                    Rule::FloorAboveClientLimit,
                    format!("{floor} is above {active} {}{always_small}", o.active),
                ));
            }
        }
    }
    Ok(())
}
