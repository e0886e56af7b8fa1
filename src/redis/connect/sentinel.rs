//! Asking Sentinels: where each says the service's primary is (`SENTINEL MASTER`: its address
//! and the configuration epoch it was learnt in), the newest answer taken (mid-failover a
//! Sentinel may still name the old primary, which may still say it is one), and that primary
//! confirmed by itself (`ROLE` must say `master`); and their `+switch-master` announcements.
//! Plain commands on short-lived connections: a replica asks only at start-up and after a
//! failover.
//!
//! The URL's password is the primary's, and the Sentinels' too when they ask for one (a
//! Sentinel without `requirepass` refuses an `AUTH`: it is then asked without one).

use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, ConnectionInfo, ErrorKind, RedisError, Value};

use super::node::info;
use crate::admission::redis_url::{Credentials, HostPort, SentinelTarget};

/// Where a Sentinel announces a new primary: `SERVICE OLD-IP OLD-PORT NEW-IP NEW-PORT`.
const SWITCHED: &str = "+switch-master";
/// Where the Sentinel that starts a failover says so: `master SERVICE IP PORT`.
const BEGUN: &str = "+try-failover";
/// Where a failover that ended without a new primary is announced (`-failover-abort-...`,
/// `+failover-end-for-timeout`): `master SERVICE IP PORT`.
const ENDED_WITHOUT: [&str; 2] = ["-failover-abort-*", "+failover-end-for-timeout"];

/// What a Sentinel announced about the service.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Announcement {
    /// A failover began: the primary is about to change.
    Begun,
    /// The failover ended with no new primary.
    Abandoned,
    /// The new primary.
    Switched(HostPort),
}

/// A primary found and confirmed: where it is, a connection to it, and how to open more.
pub(super) struct Found {
    pub(super) at: HostPort,
    pub(super) conn: MultiplexedConnection,
    pub(super) info: ConnectionInfo,
}

/// Where one Sentinel says the primary is, in which configuration epoch it learnt it, and
/// whether it doubts it (it finds it down, or is failing it over itself: the Sentinel leading a
/// failover names the old primary under the new epoch until the failover ends, while the
/// others already name the new one).
struct View {
    at: HostPort,
    epoch: u64,
    doubted: bool,
}

/// The service's primary: `announced` first (a Sentinel's `+switch-master` just named it),
/// then of the addresses the Sentinels give, newest epoch first (undoubted first), the first
/// that says it is the primary. The error lists what each Sentinel and each address said.
pub(super) async fn primary(
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
    announced: Option<HostPort>,
) -> Result<Found, RedisError> {
    let mut said = Vec::new();
    if let Some(at) = announced {
        match confirm(&at, target, config).await {
            Ok((conn, info)) => return Ok(Found { at, conn, info }),
            Err(why) => said.push(format!("{at} (announced): {why}")),
        }
    }
    let (candidates, told) = candidates(target, config).await;
    said.extend(told);
    for at in candidates {
        match confirm(&at, target, config).await {
            Ok((conn, info)) => return Ok(Found { at, conn, info }),
            Err(why) => said.push(format!("{at}: {why}")),
        }
    }
    Err(RedisError::from((
        ErrorKind::MasterNameNotFoundBySentinel,
        "no primary found through the Sentinels",
        format!("service {}: {}", target.service, said.join("; ")),
    )))
}

/// Where the Sentinels say the service's primary is now (the newest answer), unconfirmed.
pub(super) async fn named(
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
) -> Option<HostPort> {
    candidates(target, config).await.0.into_iter().next()
}

/// The addresses the Sentinels name, newest epoch first, each once; and what each Sentinel
/// that named none said. Every Sentinel is asked at once.
async fn candidates(
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
) -> (Vec<HostPort>, Vec<String>) {
    let mut asked = tokio::task::JoinSet::new();
    for (n, sentinel) in target.sentinels.iter().enumerate() {
        let (sentinel, service, credentials, config) = (
            sentinel.clone(),
            target.service.clone(),
            target.credentials.clone(),
            config.clone(),
        );
        asked.spawn(async move {
            let view = ask(&sentinel, &service, &credentials, &config).await;
            (n, sentinel, view)
        });
    }
    let mut views = Vec::new();
    let mut said = Vec::new();
    while let Some(answer) = asked.join_next().await {
        let Ok((n, sentinel, view)) = answer else {
            continue;
        };
        match view {
            Ok(Some(view)) => views.push((n, view)),
            Ok(None) => said.push(format!("{sentinel}: does not monitor this service")),
            Err(e) => said.push(format!("{sentinel}: {e}")),
        }
    }
    // Newest epoch first; among equals, undoubted first, then the URL's order.
    views.sort_by(|(a, x), (b, y)| {
        y.epoch
            .cmp(&x.epoch)
            .then(x.doubted.cmp(&y.doubted))
            .then(a.cmp(b))
    });
    let mut candidates: Vec<HostPort> = Vec::new();
    for (_, view) in views {
        if !candidates.contains(&view.at) {
            candidates.push(view.at);
        }
    }
    (candidates, said)
}

/// A subscription to `sentinel`'s failover announcements.
pub(super) async fn announcements(
    sentinel: &HostPort,
    credentials: &Credentials,
) -> Result<PubSub, RedisError> {
    let open = |credentials: Option<&Credentials>| {
        let info = info(sentinel, 0, credentials);
        async move {
            let mut pubsub = redis::Client::open(info?)?.get_async_pubsub().await?;
            pubsub.subscribe(&[SWITCHED, BEGUN]).await?;
            pubsub.psubscribe(&ENDED_WITHOUT).await?;
            Ok::<_, RedisError>(pubsub)
        }
    };
    match open(Some(credentials)).await {
        Err(e) if wants_no_password(&e, credentials) => open(None).await,
        other => other,
    }
}

/// What a message on `channel` says about `service`, if anything.
pub(super) fn announcement(channel: &str, payload: &[u8], service: &str) -> Option<Announcement> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut words = text.split(' ');
    if channel == SWITCHED {
        if words.next()? != service {
            return None;
        }
        let mut words = words.skip(2);
        let host = words.next()?;
        let port = words.next()?.parse().ok()?;
        return Some(Announcement::Switched(HostPort {
            host: host.to_owned(),
            port,
        }));
    }
    // The other events name the primary as an instance: `master SERVICE IP PORT ...`.
    if words.next()? != "master" || words.next()? != service {
        return None;
    }
    if channel == BEGUN {
        Some(Announcement::Begun)
    } else if channel.starts_with("-failover-abort-") || channel == ENDED_WITHOUT[1] {
        Some(Announcement::Abandoned)
    } else {
        None
    }
}

/// A connection to `at`, if it says it is the primary.
async fn confirm(
    at: &HostPort,
    target: &SentinelTarget,
    config: &AsyncConnectionConfig,
) -> Result<(MultiplexedConnection, ConnectionInfo), String> {
    let primary = info(at, target.db, Some(&target.credentials)).map_err(|e| e.to_string())?;
    let connected = async {
        let mut conn = redis::Client::open(primary.clone())?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        let role: Value = redis::cmd("ROLE").query_async(&mut conn).await?;
        Ok::<_, RedisError>((conn, role))
    };
    let (conn, role) = connected
        .await
        .map_err(|e| format!("did not answer: {e}"))?;
    match role_of(&role) {
        Some("master") => Ok((conn, primary)),
        Some(role) => Err(format!("says it is a {role}")),
        None => Err("its ROLE is unreadable".to_owned()),
    }
}

/// Where `sentinel` says the service's primary is (`None`: it monitors no such service).
async fn ask(
    sentinel: &HostPort,
    service: &str,
    credentials: &Credentials,
    config: &AsyncConnectionConfig,
) -> Result<Option<View>, RedisError> {
    let asked = |credentials: Option<&Credentials>| {
        let info = info(sentinel, 0, credentials);
        async move {
            let mut conn = redis::Client::open(info?)?
                .get_multiplexed_async_connection_with_config(config)
                .await?;
            redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(service)
                .query_async::<Value>(&mut conn)
                .await
        }
    };
    let answer = match asked(Some(credentials)).await {
        Err(e) if wants_no_password(&e, credentials) => asked(None).await,
        other => other,
    };
    match answer {
        Ok(fields) => Ok(view(&fields)),
        Err(e) if e.to_string().contains("No such master") => Ok(None),
        Err(e) => Err(e),
    }
}

/// The address, epoch and doubts in a `SENTINEL MASTER` answer (a flat list of fields and values, or
/// a map).
fn view(answer: &Value) -> Option<View> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok().map(str::to_owned),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    };
    let pairs: Vec<(String, String)> = match answer {
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|pair| Some((text(pair.first()?)?, text(pair.get(1)?)?)))
            .collect(),
        Value::Map(items) => items
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
            .collect(),
        _ => return None,
    };
    let field = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let doubted = field("flags").is_some_and(|flags| {
        flags
            .split(',')
            .any(|f| matches!(f, "s_down" | "o_down" | "failover_in_progress"))
    });
    Some(View {
        at: HostPort {
            host: field("ip")?.to_owned(),
            port: field("port")?.parse().ok()?,
        },
        epoch: field("config-epoch")
            .and_then(|e| e.parse().ok())
            .unwrap_or(0),
        doubted,
    })
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
    fn announcements_about_the_service_say_a_failover_began_was_abandoned_or_switched() {
        let said = b"mymaster 127.0.0.1 6379 127.0.0.1 6380";
        assert_eq!(
            announcement("+switch-master", said, "mymaster"),
            Some(Announcement::Switched(HostPort {
                host: "127.0.0.1".into(),
                port: 6380
            }))
        );
        assert_eq!(announcement("+switch-master", said, "other"), None);
        assert_eq!(
            announcement("+switch-master", b"mymaster 1.2.3.4 1", "mymaster"),
            None
        );
        let master = b"master mymaster 127.0.0.1 6379";
        assert_eq!(
            announcement("+try-failover", master, "mymaster"),
            Some(Announcement::Begun)
        );
        assert_eq!(announcement("+try-failover", master, "other"), None);
        for ended in ["-failover-abort-not-elected", "+failover-end-for-timeout"] {
            assert_eq!(
                announcement(ended, master, "mymaster"),
                Some(Announcement::Abandoned),
                "{ended}"
            );
        }
        // A replica's event names the service after `@`: not the primary's.
        let replica = b"slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379";
        assert_eq!(announcement("+try-failover", replica, "mymaster"), None);
    }

    #[test]
    fn a_sentinels_view_is_the_address_and_epoch_it_gives() {
        let words = |w: &[&str]| {
            Value::Array(
                w.iter()
                    .map(|s| Value::BulkString(s.as_bytes().to_vec()))
                    .collect(),
            )
        };
        let seen = view(&words(&[
            "name",
            "mymaster",
            "ip",
            "10.0.0.2",
            "port",
            "6380",
            "flags",
            "master",
            "config-epoch",
            "7",
        ]))
        .unwrap();
        assert_eq!(
            (seen.at.to_string(), seen.epoch),
            ("10.0.0.2:6380".to_owned(), 7)
        );
        assert!(view(&words(&["name", "mymaster", "ip", "10.0.0.2"])).is_none());
    }
}
