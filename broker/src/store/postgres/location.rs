//! A PostgreSQL URL, as the broker takes it: any libpq URL (`postgres://` or `postgresql://`),
//! with libpq's `sslmode` honoured (see `tls`) and its password never shown.
//!
//! tokio-postgres parses the URL itself, but knows only `sslmode=disable|prefer|require` and no
//! `sslrootcert`: those (and libpq's `allow`, `verify-ca`, `verify-full`) are taken out here and
//! the rest handed on, so a URL that works with `psql` works here.

use std::path::PathBuf;
use std::str::FromStr;

use unyolo_admission::admission::{BareUser, redact_url_with};

use super::super::error::StoreError;

/// `url` fit to print or log: a password in its user part or a `password` parameter is `***`
/// (the user name is shown).
pub fn redact_url(url: &str) -> String {
    redact_url_with(url, BareUser::Name)
}

/// How the server's certificate is checked, from `sslmode` (and `sslrootcert`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verify {
    /// No TLS (`disable`).
    Off,
    /// TLS, the certificate not checked (`prefer`, `require` without a root certificate: what
    /// libpq does).
    Unchecked,
    /// TLS, the certificate's chain checked but not its name (`verify-ca`; `require` with
    /// `sslrootcert`, as libpq does when it has a root certificate).
    Chain,
    /// TLS, the chain and the host name checked (`verify-full`).
    Full,
}

/// A parsed location: what tokio-postgres connects with, how TLS checks the server, and the URL
/// as it may be shown.
pub(super) struct Location {
    /// The connection settings (the TLS mode: `disable`, `prefer` or `require`).
    pub(super) config: tokio_postgres::Config,
    /// How the server's certificate is checked.
    pub(super) verify: Verify,
    /// A CA file (`sslrootcert`) trusted besides the built-in roots.
    pub(super) root_cert: Option<PathBuf>,
    /// The URL with its password redacted.
    pub(super) shown: String,
}

/// Decodes `%XX` escapes (a query value may hold a path with spaces).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(byte) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `location` names a PostgreSQL database (its scheme is `postgres` or `postgresql`).
pub(in crate::store) fn is_postgres_url(location: &str) -> bool {
    location.starts_with("postgres://") || location.starts_with("postgresql://")
}

impl Location {
    /// Parses `url`; a bad URL or setting is [`StoreError::BadLocation`], naming it redacted.
    pub(super) fn parse(url: &str) -> Result<Location, StoreError> {
        let shown = redact_url(url);
        let bad = |detail: String| StoreError::BadLocation {
            location: shown.clone(),
            detail,
        };
        if !is_postgres_url(url) {
            return Err(bad("expected a postgres:// or postgresql:// URL".to_owned()));
        }
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (url, None),
        };
        let mut kept = Vec::new();
        let mut mode = None;
        let mut root_cert = None;
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match percent_decode(key).as_str() {
                "sslmode" => mode = Some(percent_decode(value)),
                "sslrootcert" => root_cert = Some(PathBuf::from(percent_decode(value))),
                _ => kept.push(pair),
            }
        }
        let (handed, verify) = match mode.as_deref() {
            Some("disable") => ("disable", Verify::Off),
            // libpq's `allow` tries without TLS first; here it is `prefer` (TLS when offered).
            Some("allow" | "prefer") | None => ("prefer", Verify::Unchecked),
            Some("require") if root_cert.is_some() => ("require", Verify::Chain),
            Some("require") => ("require", Verify::Unchecked),
            Some("verify-ca") => ("require", Verify::Chain),
            Some("verify-full") => ("require", Verify::Full),
            Some(other) => {
                return Err(bad(format!(
                    "sslmode={other} is not one of disable, allow, prefer, require, verify-ca, \
                     verify-full"
                )));
            }
        };
        if verify == Verify::Off && root_cert.is_some() {
            // libpq ignores it then; so does this.
            root_cert = None;
        }
        kept.push(match handed {
            "disable" => "sslmode=disable",
            "require" => "sslmode=require",
            _ => "sslmode=prefer",
        });
        let rebuilt = format!("{base}?{}", kept.join("&"));
        // tokio-postgres's parse errors name the option, never its value.
        let config = tokio_postgres::Config::from_str(&rebuilt).map_err(|e| bad(e.to_string()))?;
        if config.get_hosts().is_empty() {
            return Err(bad("the URL names no host".to_owned()));
        }
        Ok(Location {
            config,
            verify,
            root_cert,
            shown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_postgres::config::SslMode;

    #[test]
    fn a_password_is_redacted_and_the_role_is_shown() {
        for (url, shown) in [
            (
                "postgres://admission@db:5432/fleet",
                "postgres://admission@db:5432/fleet",
            ),
            (
                "postgres://admission:hunter2@db/fleet",
                "postgres://admission:***@db/fleet",
            ),
            (
                "postgresql://db/fleet?user=a&password=hunter2",
                "postgresql://db/fleet?user=a&password=***",
            ),
            ("postgres://a:p@ss@db/fleet", "postgres://a:***@db/fleet"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn each_libpq_sslmode_maps_to_a_tls_mode_and_a_check() {
        let cases = [
            ("", SslMode::Prefer, Verify::Unchecked),
            ("?sslmode=disable", SslMode::Disable, Verify::Off),
            ("?sslmode=allow", SslMode::Prefer, Verify::Unchecked),
            ("?sslmode=prefer", SslMode::Prefer, Verify::Unchecked),
            ("?sslmode=require", SslMode::Require, Verify::Unchecked),
            (
                "?sslmode=require&sslrootcert=/ca.pem",
                SslMode::Require,
                Verify::Chain,
            ),
            ("?sslmode=verify-ca", SslMode::Require, Verify::Chain),
            (
                "?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fmy%20ca.pem",
                SslMode::Require,
                Verify::Full,
            ),
        ];
        for (query, mode, verify) in cases {
            let url = format!("postgres://u:secret@db:5433/fleet{query}");
            let location = Location::parse(&url).unwrap();
            assert_eq!(location.config.get_ssl_mode(), mode, "{url}");
            assert_eq!(location.verify, verify, "{url}");
            assert_eq!(location.config.get_dbname(), Some("fleet"));
            assert_eq!(location.config.get_ports(), [5433]);
            assert!(!location.shown.contains("secret"));
        }
        let location =
            Location::parse("postgres://db/f?sslmode=verify-full&sslrootcert=%2Fetc%2Fmy%20ca.pem")
                .unwrap();
        assert_eq!(
            location.root_cert.as_deref(),
            Some(std::path::Path::new("/etc/my ca.pem"))
        );
    }

    #[test]
    fn a_bad_url_is_refused_naming_it_without_its_password() {
        for url in [
            "mysql://u:hunter2@db/fleet",
            "postgres://u:hunter2@db/fleet?sslmode=sometimes",
            "postgres://u:hunter2@db/fleet?no_such_option=1",
        ] {
            let err = Location::parse(url).err().expect(url);
            assert!(matches!(err, StoreError::BadLocation { .. }), "{err}");
            let text = err.to_string();
            assert!(!text.contains("hunter2"), "{text}");
            assert!(text.contains("u:***@db/fleet"), "{text}");
        }
    }
}
