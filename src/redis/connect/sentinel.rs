//! Asking Sentinels: which primary they name for the service (`SENTINEL
//! get-master-addr-by-name`), confirmed by the primary itself (`ROLE` must say `master`: a
//! Sentinel's view can lag a failover), and their `+switch-master` announcements. Plain
//! commands on short-lived connections: a replica asks only at start-up and after a failover.
//!
//! The URL's password is the primary's, and the Sentinels' too when they ask for one (a
//! Sentinel without `requirepass` refuses an `AUTH`: it is then asked without one).

use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, ConnectionInfo, ErrorKind, RedisError, Value};

use super::node::info;

use crate::admission::redis_url::{Credentials, HostPort, SentinelTarget};

/// The channel Sentinels announce a failover on: `SERVICE OLD-IP OLD-PORT NEW-IP NEW-PORT`.
pub(super) const SWITCHES: &str = "+switch-master";

/// A primary found and confirmed: where it is, a connection to it, and how to open more.
pub(super) struct Found {
    /// Which of the URL's Sentinels named it (the one to ask first next time).
    pub(super) sentinel: usize,
    pub(super) at: HostPort,
    pub(super) conn: MultiplexedConnection,
    pub(super) info: ConnectionInfo,
}

/// The service's primary, asked of each Sentinel in turn (from `first`, round the list) until
/// one names a server that says it is the primary. The error lists what each Sentinel said.
pub(super) async fn primary(
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
    first: usize,
) -> Result<Found, RedisError> {
    let mut said = Vec::new();
    for (index, sentinel) in round(&target.sentinels, first) {
        match primary_named_by(sentinel, target, config).await {
            Ok((at, conn, info)) => {
                return Ok(Found {
                    sentinel: index,
                    at,
                    conn,
                    info,
                });
            }
            Err(why) => said.push(format!("{sentinel}: {why}")),
        }
    }
    Err(RedisError::from((
        ErrorKind::MasterNameNotFoundBySentinel,
        "no primary found through the Sentinels",
        format!("service {}: {}", target.service, said.join("; ")),
    )))
}

/// Where the Sentinels say the service's primary is now (the first that knows), unconfirmed.
pub(super) async fn named(
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
    first: usize,
) -> Option<HostPort> {
    for (_, sentinel) in round(&target.sentinels, first) {
        if let Ok(Some(at)) = ask(sentinel, target, config).await {
            return Some(at);
        }
    }
    None
}

/// A subscription to `sentinel`'s failover announcements.
pub(super) async fn switches(
    sentinel: &HostPort,
    credentials: &Credentials,
) -> Result<PubSub, RedisError> {
    let open = |credentials: Option<&Credentials>| {
        let info = info(sentinel, 0, credentials);
        async move {
            let mut pubsub = redis::Client::open(info?)?.get_async_pubsub().await?;
            pubsub.subscribe(SWITCHES).await?;
            Ok::<_, RedisError>(pubsub)
        }
    };
    match open(Some(credentials)).await {
        Err(e) if wants_no_password(&e, credentials) => open(None).await,
        other => other,
    }
}

/// The new primary a `+switch-master` announcement names, if it is for `service`.
pub(super) fn switched_to(payload: &[u8], service: &str) -> Option<HostPort> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut words = text.split(' ');
    if words.next()? != service {
        return None;
    }
    let mut words = words.skip(2);
    let host = words.next()?;
    let port = words.next()?.parse().ok()?;
    Some(HostPort {
        host: host.to_owned(),
        port,
    })
}

/// `list` (with each one's index) from `first` round to just before it.
fn round(list: &[HostPort], first: usize) -> impl Iterator<Item = (usize, &HostPort)> {
    let n = list.len().max(1);
    list.iter()
        .enumerate()
        .cycle()
        .skip(first % n)
        .take(list.len())
}

/// The primary `sentinel` names, connected, if it says it is the primary.
async fn primary_named_by(
    sentinel: &HostPort,
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
) -> Result<(HostPort, MultiplexedConnection, ConnectionInfo), String> {
    let at = match ask(sentinel, target, config).await {
        Ok(Some(at)) => at,
        Ok(None) => return Err("does not monitor this service".to_owned()),
        Err(e) => return Err(e.to_string()),
    };
    let primary = info(&at, target.db, Some(&target.credentials)).map_err(|e| e.to_string())?;
    let connected = async {
        let mut conn = redis::Client::open(primary.clone())?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let role: Value = redis::cmd("ROLE").query_async(&mut conn).await?;
        Ok::<_, RedisError>((conn, role))
    };
    let (conn, role) = connected
        .await
        .map_err(|e| format!("names {at}, which did not answer: {e}"))?;
    match role_of(&role) {
        Some("master") => Ok((at, conn, primary)),
        Some(role) => Err(format!("names {at}, which says it is a {role}")),
        None => Err(format!("names {at}, whose ROLE is unreadable")),
    }
}

/// The primary `sentinel` names for the service (`None`: it monitors no such service).
async fn ask(
    sentinel: &HostPort,
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
) -> Result<Option<HostPort>, RedisError> {
    let asked = |credentials: Option<&Credentials>| {
        let info = info(sentinel, 0, credentials);
        async move {
            let mut conn = redis::Client::open(info?)?
                .get_multiplexed_async_connection_with_config(config)
                .await?;
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&target.service)
                .query_async::<Option<(String, u16)>>(&mut conn)
                .await
        }
    };
    let named = match asked(Some(&target.credentials)).await {
        Err(e) if wants_no_password(&e, &target.credentials) => asked(None).await?,
        other => other?,
    };
    Ok(named.map(|(host, port)| HostPort { host, port }))
}

/// Whether `error` is a Sentinel refusing the `AUTH` it has no password for.
fn wants_no_password(error: &RedisError, credentials: &Credentials) -> bool {
    credentials.password.is_some()
        && error
            .to_string()
            .contains("called without any password configured")
}

/// The first word of a `ROLE` reply: `master`, `slave` or `sentinel`.
fn role_of(reply: &Value) -> Option<&str> {
    match reply {
        Value::Array(items) => match items.first()? {
            Value::BulkString(word) => std::str::from_utf8(word).ok(),
            Value::SimpleString(word) => Some(word),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_announcement_names_the_new_primary_of_its_service_only() {
        let said = b"mymaster 127.0.0.1 6379 127.0.0.1 6380";
        assert_eq!(
            switched_to(said, "mymaster"),
            Some(HostPort {
                host: "127.0.0.1".into(),
                port: 6380
            })
        );
        assert_eq!(switched_to(said, "other"), None);
        assert_eq!(switched_to(b"mymaster 1.2.3.4 1", "mymaster"), None);
    }

    #[test]
    fn sentinels_are_asked_round_the_list_from_the_last_that_answered() {
        let list: Vec<HostPort> = (1..=3)
            .map(|port| HostPort {
                host: "h".into(),
                port,
            })
            .collect();
        let ports: Vec<u16> = round(&list, 4).map(|(_, h)| h.port).collect();
        assert_eq!(ports, [2, 3, 1]);
    }
}
