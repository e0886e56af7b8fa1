//! Client identity names.

use std::borrow::Borrow;
use std::fmt;

/// An authenticated client identity: `^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity(Box<str>);

/// Why a string is not an identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityError {
    name: String,
}

impl fmt::Display for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a valid identity (1 to 64 characters from A-Z a-z 0-9 . _ @ -, starting with a letter or digit)",
            self.name
        )
    }
}

impl std::error::Error for IdentityError {}

impl Identity {
    /// Validates `name` as an identity.
    pub fn new(name: &str) -> Result<Identity, IdentityError> {
        if is_identity(name) {
            Ok(Identity(name.into()))
        } else {
            Err(IdentityError {
                name: name.to_owned(),
            })
        }
    }

    /// The identity as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Whether `name` matches `^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$`.
pub fn is_identity(name: &str) -> bool {
    let bytes = name.as_bytes();
    match bytes.split_first() {
        Some((first, rest)) => {
            first.is_ascii_alphanumeric()
                && rest.len() <= 63
                && rest
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-'))
        }
        None => false,
    }
}

impl std::str::FromStr for Identity {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Identity::new(s)
    }
}

impl Borrow<str> for Identity {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Identity {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
