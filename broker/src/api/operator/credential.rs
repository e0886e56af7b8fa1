//! Which operator a request's credential names: the [`OperatorName`] extractor every operator
//! route but health and readiness takes first, and how an `Authorization` header presents a
//! secret. A leaf, so the routes' files (and the event stream, `api/events.rs`) take the operator
//! without importing the router that mounts them.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use base64::Engine;

use super::error::OperatorError;
use crate::core::Core;

/// The operator the credential names: `Authorization: Bearer <secret>`, or `Basic` with the
/// secret as the password; the scheme in any case. Missing or wrong: 401 `unauthorized` with
/// `WWW-Authenticate: Bearer realm="broker-operator"` (never 403).
pub(crate) struct OperatorName(pub(crate) String);

impl FromRequestParts<Arc<Core>> for OperatorName {
    type Rejection = OperatorError;

    async fn from_request_parts(
        parts: &mut Parts,
        core: &Arc<Core>,
    ) -> Result<OperatorName, OperatorError> {
        let secret = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|value| presented_secret(value.as_bytes()))
            .ok_or_else(OperatorError::unauthorized)?;
        core.auth
            .operator(&secret)
            .map(|name| OperatorName(name.to_owned()))
            .ok_or_else(OperatorError::unauthorized)
    }
}

/// The secret an `Authorization` header presents, as unYOLO's `SecretFromAuthorization` reads
/// it: trimmed, split at the first space; `Bearer` (any case) → the rest, trimmed; `Basic` (any
/// case) → base64 of `user:password`, the password (non-empty). Anything else presents none.
pub fn presented_secret(header: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(header).ok()?.trim();
    let (scheme, rest) = text.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return (!rest.is_empty()).then(|| rest.as_bytes().to_vec());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let colon = decoded.iter().position(|&b| b == b':')?;
        let password = &decoded[colon + 1..];
        return (!password.is_empty()).then(|| password.to_vec());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_presented_as_bearer_or_basic_password_in_any_case() {
        let basic = |userpass: &str| {
            format!(
                "bAsIc {}",
                base64::engine::general_purpose::STANDARD.encode(userpass)
            )
        };
        assert_eq!(presented_secret(b"Bearer abc").unwrap(), b"abc");
        assert_eq!(presented_secret(b"  bearer   abc  ").unwrap(), b"abc");
        assert_eq!(presented_secret(b"BEARER abc").unwrap(), b"abc");
        assert_eq!(
            presented_secret(basic("ada:s3cret").as_bytes()).unwrap(),
            b"s3cret"
        );
        assert_eq!(presented_secret(basic(":a:b").as_bytes()).unwrap(), b"a:b");
        assert_eq!(presented_secret(basic("ada:").as_bytes()), None);
        assert_eq!(presented_secret(basic("ada").as_bytes()), None);
        assert_eq!(presented_secret(b"Bearer"), None);
        assert_eq!(presented_secret(b"Bearer "), None);
        assert_eq!(presented_secret(b"Token abc"), None);
        assert_eq!(presented_secret(b"Basic !!!"), None);
    }
}
