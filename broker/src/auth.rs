//! Who a bearer secret names: one of the configured clients, one of the named operators, or
//! nobody.
//!
//! The secrets live here, below the HTTP layer, so the core holds them without knowing a header;
//! `api::extract` reads the `Authorization` header and answers 401/403 on the agent listener,
//! `api::operator` answers 401 on the operator listener. Secrets are compared in constant time
//! (every one of them, so the time says nothing about which matched) and never logged.

use std::sync::Arc;

use unyolo_admission::config::{Identity, Operators, Secrets};

/// The client secrets and the operators' secrets.
pub(crate) struct Auth {
    clients: Secrets,
    /// Each client's name as the fairness layer keys it, made once: classifying a request
    /// clones a pointer instead of allocating the name.
    keys: Vec<(Identity, Arc<str>)>,
    operators: Operators,
}

impl Auth {
    pub(crate) fn new(secrets: &Secrets, operators: &Operators) -> Auth {
        Auth {
            clients: secrets.clone(),
            keys: secrets
                .iter()
                .map(|(identity, _)| (identity.clone(), Arc::from(identity.as_str())))
                .collect(),
            operators: operators.clone(),
        }
    }

    /// The client whose secret `token` is, if any.
    pub(crate) fn client(&self, token: &[u8]) -> Option<&Identity> {
        // The library's lookup: every secret compared, each in constant time.
        self.clients.identify(token)
    }

    /// The configured client named `key` (as the fairness layer keyed a request it classified),
    /// found by name: the secret was already compared once, by the classifier.
    pub(crate) fn named(&self, key: &str) -> Option<&Identity> {
        self.keys
            .binary_search_by(|(identity, _)| identity.as_str().cmp(key))
            .ok()
            .map(|i| &self.keys[i].0)
    }

    /// The fairness layer's key of `client` (a configured identity): the name, made once.
    pub(crate) fn key_of(&self, client: &Identity) -> Arc<str> {
        match self
            .keys
            .binary_search_by(|(identity, _)| identity.cmp(client))
        {
            Ok(i) => Arc::clone(&self.keys[i].1),
            Err(_) => Arc::from(client.as_str()),
        }
    }

    /// The name of the operator whose secret `token` is, if any.
    pub(crate) fn operator(&self, token: &[u8]) -> Option<&str> {
        self.operators.identify(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operators_are_named_by_their_full_secret_only() {
        let clients = Secrets::parse("bot = bot-secret\n").unwrap();
        let operators = Operators::parse(&format!(
            "ada = {}\nbob = {}\n",
            "a".repeat(32),
            "b".repeat(40)
        ))
        .unwrap();
        let auth = Auth::new(&clients, &operators);
        assert_eq!(auth.operator("a".repeat(32).as_bytes()), Some("ada"));
        assert_eq!(auth.operator("b".repeat(40).as_bytes()), Some("bob"));
        assert_eq!(auth.operator("a".repeat(31).as_bytes()), None);
        assert_eq!(auth.operator("a".repeat(33).as_bytes()), None);
        assert_eq!(auth.operator(b"bot-secret"), None);
        assert_eq!(
            auth.client(b"bot-secret").map(Identity::as_str),
            Some("bot")
        );
    }
}
