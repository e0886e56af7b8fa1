//! What a replica's Redis URL names, read without connecting: one server (`redis://`,
//! `rediss://`, `redis+unix://`, `unix://`: the redis crate reads those itself), a service its
//! Sentinels watch (`redis+sentinel://`), or a Redis Cluster (`redis+cluster://`). Checked when
//! the options are ([`super::ReplicaOptions::check`]), so a malformed URL stops a replica at
//! start-up with one line that says what is wrong; the Redis backend (`redis::connect`) reads
//! the same parse to find the Redis to talk to.
//!
//! A password may be in any of them (`redis+sentinel://:SECRET@h1:26379,h2:26379/mymaster`):
//! it is percent-decoded here and never formatted: no error below quotes any part of the URL's
//! user part, and [`Credentials`] has no `Debug` that shows it.

/// The default port of a Sentinel when a host of a `redis+sentinel://` URL names none.
const SENTINEL_PORT: u16 = 26379;
/// The default port of a cluster node when a host of a `redis+cluster://` URL names none.
const CLUSTER_PORT: u16 = 6379;

/// What a Redis URL names.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) enum RedisTarget {
    /// One server: the URL as given, read by the redis crate.
    Server,
    /// The primary of `service`, found through its Sentinels.
    Sentinel(SentinelTarget),
    /// A Redis Cluster, reached through any of its nodes.
    Cluster(ClusterTarget),
}

/// `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`.
#[derive(Clone)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct SentinelTarget {
    /// The Sentinels, in the URL's order.
    pub(crate) sentinels: Vec<HostPort>,
    /// The name the Sentinels monitor the primary under.
    pub(crate) service: String,
    /// The database on the primary.
    pub(crate) db: i64,
    /// For the primary, and for the Sentinels that ask for one.
    pub(crate) credentials: Credentials,
}

/// `redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]`: nodes to start from (the rest of
/// the cluster is learnt from them).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct ClusterTarget {
    pub(crate) nodes: Vec<HostPort>,
    pub(crate) credentials: Credentials,
}

/// One `HOST:PORT` of a host list.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct HostPort {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A URL's user name and password (percent-decoded). No `Debug`: nothing prints it.
#[derive(Clone, Default)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Credentials {
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
}

/// What `url` names, or why it names nothing usable (one line, quoting no part of the user
/// part: the caller adds the redacted URL).
pub(crate) fn parse(url: &str) -> Result<RedisTarget, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(RedisTarget::Server);
    };
    let (kind, default_port) = match scheme {
        "redis+sentinel" => ("redis+sentinel", SENTINEL_PORT),
        "redis+cluster" => ("redis+cluster", CLUSTER_PORT),
        _ => return Ok(RedisTarget::Server),
    };
    if rest.contains(['?', '#']) {
        return Err(format!(
            "a {kind} URL takes no query or fragment (nothing after ? or #)"
        ));
    }
    // The user part ends at the last `@` (a password may hold one); the hosts end at the first
    // `/` after it.
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((user, rest)) => (Some(user), rest),
        None => (None, rest),
    };
    let (hosts, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let credentials = match userinfo {
        Some(user) => credentials(user)?,
        None => Credentials::default(),
    };
    let hosts = host_list(hosts, default_port)?;
    if kind == "redis+cluster" {
        if !(path.is_empty() || path == "/") {
            return Err(
                "a Redis Cluster has one database, 0: nothing may follow the hosts".to_owned(),
            );
        }
        return Ok(RedisTarget::Cluster(ClusterTarget {
            nodes: hosts,
            credentials,
        }));
    }
    let mut parts = path.strip_prefix('/').unwrap_or("").split('/');
    let service = parts.next().unwrap_or("");
    if service.is_empty() {
        return Err(
            "no service name: the URL ends with /SERVICE, the name the Sentinels monitor the \
             primary under (as in `sentinel monitor SERVICE HOST PORT QUORUM`)"
                .to_owned(),
        );
    }
    if !service.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "service name {service:?} must be visible ASCII characters"
        ));
    }
    let db = match parts.next() {
        None | Some("") => 0,
        Some(db) => match db.parse::<i64>() {
            Ok(n) if n >= 0 && db.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => {
                return Err(format!(
                    "bad database {db:?} after the service name (a number from 0)"
                ));
            }
        },
    };
    if let Some(extra) = parts.find(|p| !p.is_empty()) {
        return Err(format!(
            "unexpected {extra:?} after the database: the path is /SERVICE or /SERVICE/DB"
        ));
    }
    Ok(RedisTarget::Sentinel(SentinelTarget {
        sentinels: hosts,
        service: service.to_owned(),
        db,
        credentials,
    }))
}

/// `USER:PASSWORD`, `:PASSWORD` or `PASSWORD` (the whole user part, as the redis crate reads
/// `redis://SECRET@host`), percent-decoded.
fn credentials(user: &str) -> Result<Credentials, String> {
    let (name, password) = match user.split_once(':') {
        Some((name, password)) => (name, password),
        None => ("", user),
    };
    let decode = |part: &str, what: &str| {
        percent_decode(part)
            .ok_or_else(|| format!("the {what} in the URL has a bad %-escape (write % as %25)"))
    };
    let username = decode(name, "user name")?;
    let password = decode(password, "password")?;
    Ok(Credentials {
        username: (!username.is_empty()).then_some(username),
        password: (!password.is_empty()).then_some(password),
    })
}

/// `%XX` escapes decoded; `None` for a bad escape or bytes that are not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `HOST:PORT[,HOST:PORT...]` (`[v6]:PORT` for an IPv6 address; a host alone takes
/// `default_port`).
fn host_list(list: &str, default_port: u16) -> Result<Vec<HostPort>, String> {
    if list.is_empty() {
        return Err("no host: name at least one HOST:PORT".to_owned());
    }
    list.split(',')
        .map(|item| {
            let (host, port) = if let Some(v6) = item.strip_prefix('[') {
                let Some((host, after)) = v6.split_once(']') else {
                    return Err(format!("{item:?} opens [ without closing it"));
                };
                match after {
                    "" => (host, None),
                    _ => match after.strip_prefix(':') {
                        Some(port) => (host, Some(port)),
                        None => return Err(format!("{item:?}: expected :PORT after ]")),
                    },
                }
            } else {
                match item.rsplit_once(':') {
                    Some((host, port)) => (host, Some(port)),
                    None => (item, None),
                }
            };
            if host.is_empty() {
                return Err(format!(
                    "no host in {item:?}: each of the comma-separated items is HOST:PORT"
                ));
            }
            if !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'))
            {
                return Err(format!("bad host {host:?} in {item:?}"));
            }
            let port = match port {
                None => default_port,
                Some(port) => match port.parse::<u16>() {
                    Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
                    _ => {
                        return Err(format!(
                            "bad port {port:?} in {item:?} (a number from 1 to 65535)"
                        ));
                    }
                },
            };
            Ok(HostPort {
                host: host.to_owned(),
                port,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sentinel(url: &str) -> SentinelTarget {
        match parse(url) {
            Ok(RedisTarget::Sentinel(target)) => target,
            Ok(_) => panic!("{url}: not read as a sentinel URL"),
            Err(e) => panic!("{url}: {e}"),
        }
    }

    #[test]
    fn a_sentinel_url_names_its_sentinels_service_database_and_password() {
        let target =
            sentinel("redis+sentinel://:s%40cret@10.0.0.1:26379,sen2,[::1]:5000/mymaster/3");
        assert_eq!(
            target.sentinels,
            [
                HostPort {
                    host: "10.0.0.1".into(),
                    port: 26379
                },
                HostPort {
                    host: "sen2".into(),
                    port: SENTINEL_PORT
                },
                HostPort {
                    host: "::1".into(),
                    port: 5000
                },
            ]
        );
        assert_eq!(target.service, "mymaster");
        assert_eq!(target.db, 3);
        assert_eq!(target.credentials.password.as_deref(), Some("s@cret"));
        assert_eq!(target.credentials.username, None);
        let plain = sentinel("redis+sentinel://ops:pw@h:1/svc/");
        assert_eq!(
            (plain.db, plain.credentials.username.as_deref()),
            (0, Some("ops"))
        );
    }

    #[test]
    fn a_cluster_url_names_its_nodes() {
        let Ok(RedisTarget::Cluster(target)) = parse("redis+cluster://n1:7000,n2:7001/") else {
            panic!("not a cluster URL");
        };
        assert_eq!(target.nodes.len(), 2);
        assert_eq!(target.nodes[1].to_string(), "n2:7001");
    }

    #[test]
    fn plain_urls_are_left_to_the_redis_crate() {
        for url in [
            "redis://127.0.0.1:6379/0",
            "rediss://h",
            "redis+unix:///run/r.sock",
        ] {
            assert!(matches!(parse(url), Ok(RedisTarget::Server)), "{url}");
        }
    }

    #[test]
    fn a_bad_sentinel_or_cluster_url_is_refused_with_what_is_wrong() {
        for (url, says) in [
            ("redis+sentinel:///mymaster", "no host"),
            ("redis+sentinel://h1:26379,/mymaster", "no host in \"\""),
            ("redis+sentinel://:26379/mymaster", "no host in \":26379\""),
            ("redis+sentinel://h1:x/mymaster", "bad port \"x\""),
            ("redis+sentinel://h1:0/mymaster", "bad port \"0\""),
            ("redis+sentinel://h1:70000/mymaster", "bad port \"70000\""),
            ("redis+sentinel://h1:26379", "no service name"),
            ("redis+sentinel://h1:26379/", "no service name"),
            ("redis+sentinel://h1/svc/x", "bad database \"x\""),
            ("redis+sentinel://h1/svc/-1", "bad database \"-1\""),
            ("redis+sentinel://h1/svc/0/extra", "unexpected \"extra\""),
            ("redis+sentinel://h1/svc?db=1", "no query"),
            ("redis+sentinel://[::1/svc", "opens ["),
            ("redis+sentinel://h 1/svc", "bad host"),
            ("redis+cluster://", "no host"),
            ("redis+cluster://n1:7000/1", "one database"),
            ("redis+cluster://n1:port", "bad port"),
            ("redis+cluster://:%zz@n1:7000", "bad %-escape"),
        ] {
            match parse(url) {
                Err(e) => {
                    assert!(e.contains(says), "{url}: {e}");
                    assert!(!e.contains('\n'), "{url}: one line: {e}");
                }
                Ok(_) => panic!("{url} was accepted"),
            }
        }
    }

    #[test]
    fn no_error_quotes_the_password() {
        for url in [
            "redis+sentinel://:hunter2@h1:x/svc",
            "redis+sentinel://:hunter2@/svc",
            "redis+sentinel://u:hunter2@h1/",
            "redis+cluster://:hunter2@n1:7000/2",
            "redis+cluster://:hunter2@",
        ] {
            let e = parse(url).err().expect(url);
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
    }
}
