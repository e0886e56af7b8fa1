//! Who a bearer secret names: one of the configured clients, the operator, or nobody.
//!
//! The secrets live here, below the HTTP layer, so the core holds them without knowing a header;
//! `api::extract` reads the `Authorization` header and answers 401/403. Secrets are compared in
//! constant time and never logged.

use crate::config::{Identity, Secrets};

/// The client secrets and the operator's secret.
pub(crate) struct Auth {
    clients: Secrets,
    operator: Box<[u8]>,
}

impl Auth {
    pub(crate) fn new(secrets: &Secrets, operator: &str) -> Auth {
        Auth {
            clients: secrets.clone(),
            operator: operator.as_bytes().into(),
        }
    }

    /// The client whose secret `token` is, if any.
    pub(crate) fn client(&self, token: &[u8]) -> Option<&Identity> {
        // The library's lookup: every secret compared, each in constant time.
        self.clients.identify(token)
    }

    /// Whether `token` is the operator's secret.
    pub(crate) fn is_operator(&self, token: &[u8]) -> bool {
        constant_time_eq(&self.operator, token)
    }
}

/// Whether two secrets are equal, in time that depends on their lengths only (`subtle`).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_full_content() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secre"));
        assert!(!constant_time_eq(b"secret", b"secret!"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(!constant_time_eq(b"secret", b"Secret"));
    }
}
