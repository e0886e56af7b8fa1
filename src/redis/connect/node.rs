//! How to reach one Redis node found at run time (a primary a Sentinel names, a Sentinel, the
//! primary of a cluster slot): its address, with the URL's database and credentials.

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError};

use crate::admission::redis_url::{Credentials, HostPort};

/// How to reach a Redis at `at` (database `db`, the URL's credentials if any).
pub(super) fn info(
    at: &HostPort,
    db: i64,
    credentials: Option<&Credentials>,
) -> Result<ConnectionInfo, RedisError> {
    let mut settings = redis::RedisConnectionInfo::default().set_db(db);
    if let Some(credentials) = credentials {
        if let Some(username) = &credentials.username {
            settings = settings.set_username(username);
        }
        if let Some(password) = &credentials.password {
            settings = settings.set_password(password);
        }
    }
    Ok(ConnectionAddr::Tcp(at.host.clone(), at.port)
        .into_connection_info()?
        .set_redis_settings(settings))
}
