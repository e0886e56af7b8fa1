//! How a replica reaches the shared store and shares it: plain settings, checked before anything
//! connects, and the same type whether or not this build has the Redis backend (a build without
//! it refuses them with [`SetupError::NoRedisBackend`]).

use std::time::Duration;

use super::outcome::SetupError;
use crate::config::Identity;
use crate::engine::{DEFAULT_CAPACITY_RETRY, StorageCaps};

/// The default of [`ReplicaOptions::decisions_in_flight`].
pub const DEFAULT_DECISIONS_IN_FLIGHT: usize = 32;
/// The default of [`ReplicaOptions::client_decisions_in_flight`].
pub const DEFAULT_CLIENT_DECISIONS_IN_FLIGHT: usize = 1;

/// How a replica reaches Redis and shares it. Its `Debug` output shows the URL with any password
/// in it replaced ([`ReplicaOptions::url_redacted`]).
#[derive(Clone)]
pub struct ReplicaOptions {
    /// Where Redis is: one server (`redis://[:PASSWORD@]HOST:PORT/DB`), the primary a set of
    /// Sentinels watch (`redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`:
    /// found through them, and followed to the replica they promote when it fails), or a Redis
    /// Cluster (`redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]`: the deployment's keys
    /// all live in the one slot of its hash tag, followed through resharding and failovers).
    /// A password in it is never shown ([`ReplicaOptions::url_redacted`]).
    pub url: String,
    /// Starts every key, as the hash tag `{prefix}` (default `admission`). Two deployments sharing
    /// a Redis use two prefixes.
    pub prefix: String,
    /// This replica's name, unique in the deployment and stable across restarts (an identity-like
    /// name: `^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$`).
    pub replica: String,
    /// How long a lease lasts unrenewed (default 10 s). A replica that cannot renew for this long
    /// stops admitting, and the others release what it held.
    pub lease_ttl: Duration,
    /// How often the lease is renewed, lapsed leases reaped and kept releases retried (default a
    /// third of the lease).
    pub heartbeat: Duration,
    /// The longest any one call to Redis may take (default 500 ms).
    pub call_timeout: Duration,
    /// How long an idempotency key stays bound to its operation at most: `None` (the default)
    /// until the operation is retired ([`super::Admission::retire_keys`]) or its admission
    /// refunded or dropped. A lifetime, if set, must not be shorter than the store's retention,
    /// or a key could make a second operation while the first is still retained.
    pub idempotency_ttl: Option<Duration>,
    /// Every replica of the deployment, this one included, when known (the default: none
    /// listed). After Redis forgets the deployment, no replica admits for one lease period
    /// (a silent replica then counts as dead), unless a replica with this list has registered
    /// again and every replica listed (and every one Redis listed before) has too: then
    /// admissions resume at once. Without it no replica can know the whole deployment (one
    /// started a moment before Redis forgot may be unknown to all the others), so the wait is
    /// always the whole lease period: the list only shortens it. A recovery source over a store
    /// the whole fleet shares ([`crate::admission::RecoverySource::fleet`]) names the fleet as this list
    /// does.
    pub replicas: Vec<String>,
    /// Consecutive failed calls that open the circuit (default 3).
    pub circuit_threshold: u32,
    /// How long an open circuit refuses before a trial call (default 1 s).
    pub circuit_cool_down: Duration,
    /// Retry-After of a capacity refusal (default 2 s; [`super::Admission::new`] sets the
    /// controller's).
    pub capacity_retry: Duration,
    /// Retry-After of an [`super::Unavailable`] answer (default 2 s).
    pub unavailable_retry: Duration,
    /// The pending-grant caps (the storage caps are per replica and not used here;
    /// [`super::Admission::new`] sets the controller's).
    pub caps: StorageCaps,
    /// Whether Redis's refusals are remembered and answered here until they can have changed
    /// (default on): a refused client's next submissions cost Redis nothing until the next
    /// token's time, a release or refund that can free room for it (seen on any replica), or
    /// the capacity hint, whichever comes first. The memory only ever refuses; off, every
    /// submission is a Redis call.
    pub refusal_memory: bool,
    /// The most admission decisions this replica has in flight to Redis at once (default 32).
    /// Releases, transitions and heartbeats never wait for this limit.
    pub decisions_in_flight: usize,
    /// The most admission decisions one client has in flight to Redis at once on this replica
    /// (default 1: a client's next submission is decided after its last one, so a refusal it
    /// got answers its flood from memory).
    pub client_decisions_in_flight: usize,
    /// How long a submission waits for room under those limits before it is answered
    /// [`super::Unavailable`] ([`super::UnavailableReason::Busy`]; default 250 ms).
    pub decision_wait: Duration,
    /// After each admission, wait until this many Redis replicas acknowledged its write
    /// (`WAIT`, asked on the connection the write went on, once per batch; default 0: do not
    /// wait). With 1, a failover to an acknowledging Redis replica loses no admission that was
    /// answered; an admission whose acknowledgement did not come within the call timeout, or
    /// came while the Sentinels began a failover, is given back and answered
    /// [`super::Unavailable`]. The primary needs that many replicas after a failover too (run
    /// one more than this).
    pub wait_replicas: u32,
}

impl std::fmt::Debug for ReplicaOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaOptions")
            .field("url", &self.url_redacted())
            .field("prefix", &self.prefix)
            .field("replica", &self.replica)
            .field("lease_ttl", &self.lease_ttl)
            .field("heartbeat", &self.heartbeat)
            .field("call_timeout", &self.call_timeout)
            .field("idempotency_ttl", &self.idempotency_ttl)
            .field("replicas", &self.replicas)
            .field("circuit_threshold", &self.circuit_threshold)
            .field("circuit_cool_down", &self.circuit_cool_down)
            .field("capacity_retry", &self.capacity_retry)
            .field("unavailable_retry", &self.unavailable_retry)
            .field("caps", &self.caps)
            .field("refusal_memory", &self.refusal_memory)
            .field("decisions_in_flight", &self.decisions_in_flight)
            .field(
                "client_decisions_in_flight",
                &self.client_decisions_in_flight,
            )
            .field("decision_wait", &self.decision_wait)
            .field("wait_replicas", &self.wait_replicas)
            .finish()
    }
}

impl ReplicaOptions {
    /// The URL fit to print or log: a password in it (`redis://user:secret@host`, or the whole
    /// user part when it has no `:`, or a `pass`/`password` query parameter) is `***`.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }

    /// Options with the defaults for `url` and `replica`.
    pub fn new(url: impl Into<String>, replica: impl Into<String>) -> ReplicaOptions {
        ReplicaOptions {
            url: url.into(),
            prefix: "admission".to_string(),
            replica: replica.into(),
            lease_ttl: Duration::from_secs(10),
            heartbeat: Duration::from_millis(3333),
            call_timeout: Duration::from_millis(500),
            idempotency_ttl: None,
            replicas: Vec::new(),
            circuit_threshold: 3,
            circuit_cool_down: Duration::from_secs(1),
            capacity_retry: DEFAULT_CAPACITY_RETRY,
            unavailable_retry: Duration::from_secs(2),
            caps: StorageCaps::default(),
            refusal_memory: true,
            decisions_in_flight: DEFAULT_DECISIONS_IN_FLIGHT,
            client_decisions_in_flight: DEFAULT_CLIENT_DECISIONS_IN_FLIGHT,
            decision_wait: Duration::from_millis(250),
            wait_replicas: 0,
        }
    }

    /// Why these options cannot work, if they cannot: the message names the option.
    pub fn check(&self) -> Result<(), SetupError> {
        if let Err(problem) = super::redis_url::parse(&self.url) {
            return Err(SetupError::Options(format!(
                "url {}: {problem}",
                self.url_redacted()
            )));
        }
        if Identity::new(&self.replica).is_err() {
            return Err(SetupError::Options(format!(
                "replica {:?} must match ^[A-Za-z0-9][A-Za-z0-9._@-]{{0,63}}$",
                self.replica
            )));
        }
        if self.prefix.is_empty()
            || self.prefix.len() > 64
            || !self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(SetupError::Options(format!(
                "prefix {:?} must be 1 to 64 visible characters without braces",
                self.prefix
            )));
        }
        if let Some(bad) = self.replicas.iter().find(|r| Identity::new(r).is_err()) {
            return Err(SetupError::Options(format!(
                "replicas: {bad:?} must match ^[A-Za-z0-9][A-Za-z0-9._@-]{{0,63}}$"
            )));
        }
        if self
            .idempotency_ttl
            .is_some_and(|ttl| ttl < Duration::from_secs(1))
        {
            return Err(SetupError::Options(
                "the idempotency key lifetime must be at least one second".to_string(),
            ));
        }
        let durations = [
            ("lease_ttl", Some(self.lease_ttl)),
            ("heartbeat", Some(self.heartbeat)),
            ("call_timeout", Some(self.call_timeout)),
            ("idempotency_ttl", self.idempotency_ttl),
            ("circuit_cool_down", Some(self.circuit_cool_down)),
            ("capacity_retry", Some(self.capacity_retry)),
            ("unavailable_retry", Some(self.unavailable_retry)),
            ("decision_wait", Some(self.decision_wait)),
        ];
        if let Some((name, _)) = durations
            .iter()
            .find(|(_, d)| d.is_some_and(|d| d > MAX_DURATION))
        {
            return Err(SetupError::Options(format!(
                "{name} must be at most {} days (a longer one overflows the clock or Redis)",
                MAX_DURATION.as_secs() / 86_400
            )));
        }
        if self.decisions_in_flight == 0 || self.client_decisions_in_flight == 0 {
            return Err(SetupError::Options(
                "decisions in flight (per replica and per client) must be at least 1".to_string(),
            ));
        }
        if self.lease_ttl < Duration::from_millis(100)
            || self.heartbeat.is_zero()
            || self.heartbeat >= self.lease_ttl
            || self.call_timeout.is_zero()
        {
            return Err(SetupError::Options(
                "the heartbeat must be shorter than the lease (at least 100 ms), and the call \
                 timeout above zero"
                    .to_string(),
            ));
        }
        Ok(())
    }
}

/// The longest any duration option may be: a year. Longer ones would overflow a deadline
/// (`Instant` plus the duration) or a Redis expiry in milliseconds.
const MAX_DURATION: Duration = Duration::from_secs(366 * 86_400);

/// `url` with its password, if any, replaced by `***` (see [`ReplicaOptions::url_redacted`]).
fn redact_url(url: &str) -> String {
    redact_url_with(url, BareUser::Password)
}

/// What the user part of a URL without a `:` (`scheme://NAME@host`) is, for
/// [`redact_url_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BareUser {
    /// A password (Redis: `redis://SECRET@host`): redacted.
    Password,
    /// A user name (libpq: `postgres://ROLE@host`): shown.
    Name,
}

/// `url` with its password, if any, replaced by `***`: in the user part (`user:PASSWORD@`, or
/// the whole user part when `bare` says it is a password) and in a `pass` or `password` query
/// parameter. The one redaction for every URL the crate prints (Redis's, through one server, its
/// Sentinels or a Cluster, and PostgreSQL's, with one host or several).
///
/// The user part ends at the *last* `@`: a password may hold `@`, `/`, `?` or `#` unescaped, so
/// whatever comes before that `@` is treated as the user part. One that holds `/`, `?` or `#`
/// is not told apart from a path or query with an `@` in it and is hidden whole.
pub fn redact_url_with(url: &str, bare: BareUser) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (user, after) = match rest.rsplit_once('@') {
        Some((user, after)) => (Some(user), after),
        None => (None, rest),
    };
    let split = after.find(['/', '?']).unwrap_or(after.len());
    let (hosts, tail) = after.split_at(split);
    let user = match user {
        None => String::new(),
        Some(user) if user.contains(['/', '?', '#']) => "***@".to_owned(),
        Some(user) => match user.split_once(':') {
            Some((name, _)) => format!("{name}:***@"),
            None if bare == BareUser::Name => format!("{user}@"),
            None => "***@".to_owned(),
        },
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key == "pass" || key == "password" => format!("{key}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    if scheme.is_empty() && !url.contains("://") {
        format!("{user}{hosts}{tail}")
    } else {
        format!("{scheme}://{user}{hosts}{tail}")
    }
}

#[cfg(test)]
mod redaction {
    use super::*;

    #[test]
    fn a_password_in_the_url_is_never_shown() {
        for (url, shown) in [
            ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
            ("redis://:hunter2@host:6379/0", "redis://:***@host:6379/0"),
            ("redis://ops:hunter2@host:6379", "redis://ops:***@host:6379"),
            ("rediss://hunter2@host", "rediss://***@host"),
            ("redis://:p@ss@host/1", "redis://:***@host/1"),
            (
                "redis+unix:///run/redis.sock?db=1&pass=hunter2",
                "redis+unix:///run/redis.sock?db=1&pass=***",
            ),
            (
                "redis://host/0?password=hunter2",
                "redis://host/0?password=***",
            ),
            // A password with `/`, `?` or `@` in it, unescaped.
            ("redis://:hun/ter2@host:6379/0", "redis://***@host:6379/0"),
            ("redis://:hunter2?x@host/0", "redis://***@host/0"),
            ("redis://:hunter2@@host/0", "redis://:***@host/0"),
            // Through Sentinels, and to a Cluster.
            (
                "redis+sentinel://:hunter2@10.0.0.1:26379,10.0.0.2:26379/mymaster/1",
                "redis+sentinel://:***@10.0.0.1:26379,10.0.0.2:26379/mymaster/1",
            ),
            (
                "redis+sentinel://ops:hunter2@[::1]:26379/mymaster",
                "redis+sentinel://ops:***@[::1]:26379/mymaster",
            ),
            (
                "redis+sentinel://hunter2@s1,s2/mymaster",
                "redis+sentinel://***@s1,s2/mymaster",
            ),
            (
                "redis+sentinel://s1:26379/mymaster",
                "redis+sentinel://s1:26379/mymaster",
            ),
            (
                "redis+cluster://:hunter2@n1:7000,n2:7001,n3:7002",
                "redis+cluster://:***@n1:7000,n2:7001,n3:7002",
            ),
            (
                "redis+cluster://ops:hun@ter2@n1:7000/",
                "redis+cluster://ops:***@n1:7000/",
            ),
        ] {
            let options = ReplicaOptions::new(url, "r1");
            assert_eq!(options.url_redacted(), shown, "{url}");
            assert!(!format!("{options:?}").contains("hunter2"), "{url}");
        }
    }

    #[test]
    fn a_libpq_multi_host_url_keeps_its_hosts_and_role_and_loses_its_password() {
        for (url, shown) in [
            (
                "postgres://admission:hunter2@db1:5432,db2:5432/fleet?target_session_attrs=read-write",
                "postgres://admission:***@db1:5432,db2:5432/fleet?target_session_attrs=read-write",
            ),
            (
                "postgres://admission@db1,db2/fleet?password=hunter2",
                "postgres://admission@db1,db2/fleet?password=***",
            ),
        ] {
            assert_eq!(redact_url_with(url, BareUser::Name), shown, "{url}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_sentinel_url_is_refused_by_check_without_its_password() {
        let options = ReplicaOptions::new("redis+sentinel://:hunter2@s1:port/mymaster", "r1");
        let err = options.check().expect_err("a bad port").to_string();
        assert_eq!(
            err,
            "redis options: url redis+sentinel://:***@s1:port/mymaster: bad port \"port\" in \
             \"s1:port\" (a number from 1 to 65535)"
        );
        for good in [
            "redis+sentinel://:hunter2@s1:26379,s2:26379,s3:26379/mymaster/0",
            "redis+cluster://n1:7000,n2:7001",
        ] {
            assert!(ReplicaOptions::new(good, "r1").check().is_ok(), "{good}");
        }
    }

    #[test]
    fn a_duration_past_a_year_is_refused_by_name_and_a_year_is_not() {
        let ok = ReplicaOptions::new("redis://127.0.0.1:6379", "r1");
        assert!(ok.check().is_ok());
        type Set = fn(&mut ReplicaOptions, Duration);
        let setters: [(&str, Set); 8] = [
            ("lease_ttl", |o, d| o.lease_ttl = d),
            ("heartbeat", |o, d| {
                o.lease_ttl = MAX_DURATION;
                o.heartbeat = d;
            }),
            ("call_timeout", |o, d| o.call_timeout = d),
            ("idempotency_ttl", |o, d| o.idempotency_ttl = Some(d)),
            ("circuit_cool_down", |o, d| o.circuit_cool_down = d),
            ("capacity_retry", |o, d| o.capacity_retry = d),
            ("unavailable_retry", |o, d| o.unavailable_retry = d),
            ("decision_wait", |o, d| o.decision_wait = d),
        ];
        for (name, set) in setters {
            let mut huge = ok.clone();
            set(&mut huge, Duration::MAX / 4);
            let err = huge.check().expect_err(name).to_string();
            assert!(err.contains(name) && err.contains("366 days"), "{err}");
            let mut year = ok.clone();
            set(&mut year, Duration::from_secs(300 * 86_400));
            assert!(year.check().is_ok(), "{name}: {:?}", year.check());
        }
    }
}
