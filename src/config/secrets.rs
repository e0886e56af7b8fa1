//! Client and operator secret files.
//!
//! The broker authenticates each client by a bearer secret and learns the set of client identities
//! from the same file, so `admission check --secrets FILE` can judge a quota file against exactly
//! the identities a broker would configure. Secrets never appear in an error message or in `Debug`
//! output: errors name the line, not its contents.
//!
//! One piece past the usual size: the client and the operator secret files are read one way
//! (bounded, UTF-8, line by line) under one rule, that no error and no `Debug` shows a secret;
//! split, that rule would have two homes.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use super::error::{ConfigError, one_line_path};
use super::identity::Identity;
use super::load::read_bounded;

/// Largest secrets file (or operator secret file) read, in bytes.
pub const MAX_SECRETS_FILE_BYTES: usize = 1 << 20;

/// The client secrets of a broker: each configured identity and its bearer secret.
///
/// Read from a file with one `name = secret` per line; blank lines and lines starting with `#` are
/// ignored; whitespace around the name and the secret is trimmed; the secret is everything after
/// the first `=`, and holds no control character.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secrets {
    by_identity: BTreeMap<Identity, String>,
}

/// Why a secrets file was refused. Never contains a secret.
#[derive(Debug)]
#[non_exhaustive]
pub enum SecretsError {
    /// A line breaks the format; `line` is 1-based.
    Line {
        /// The 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: LineProblem,
    },
    /// The file could not be read, is missing, is a directory, or is too large.
    File {
        /// The path as given.
        file: PathBuf,
        /// One line: why.
        detail: String,
    },
    /// A problem inside a named file.
    InFile {
        /// The path as given.
        file: PathBuf,
        /// The problem.
        error: Box<SecretsError>,
    },
}

/// What is wrong with one line of a secrets file.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LineProblem {
    /// The line has no `=`.
    MissingEquals,
    /// The name is not a valid identity: the text before the `=`. Its `Display` says what is
    /// wrong with it without showing it: a line that is a bare secret (no name, and `=` padding)
    /// would show most of the secret.
    BadName(String),
    /// Nothing after the `=`.
    EmptySecret,
    /// The name was already given on an earlier line.
    DuplicateName {
        /// The name.
        name: String,
        /// The earlier line.
        first_line: usize,
    },
    /// The secret is the same as an earlier line's, which would make a bearer token ambiguous.
    DuplicateSecret {
        /// The earlier line.
        first_line: usize,
    },
    /// The line is not UTF-8 text.
    NotUtf8,
    /// An operator secret file holds more than one line.
    MoreThanOneLine,
    /// The secret holds a control character (a tab, a lone carriage return, an escape...): no
    /// client could send it as a bearer token, so the identity could never authenticate.
    ControlCharacter,
    /// An operator's name is empty, longer than 200 bytes, or holds a control character.
    BadOperatorName,
    /// An operator's secret is shorter than [`MIN_OPERATOR_SECRET_BYTES`] (the length is safe to
    /// show).
    ShortSecret {
        /// Its length in bytes.
        bytes: usize,
    },
}

impl fmt::Display for LineProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineProblem::MissingEquals => f.write_str("expected `name = secret`, found no '='"),
            LineProblem::BadName(name) => write!(
                f,
                "the name before '=' is not a valid identity: {} (1 to 64 characters from A-Z a-z \
                 0-9 . _ @ -, starting with a letter or digit; the name is not shown, in case the \
                 line is a secret)",
                name_problem(name)
            ),
            LineProblem::EmptySecret => f.write_str("the secret is empty"),
            LineProblem::DuplicateName { name, first_line } => {
                write!(f, "{name} is already defined on line {first_line}")
            }
            LineProblem::DuplicateSecret { first_line } => {
                write!(
                    f,
                    "the secret is the same as on line {first_line}; each client needs its own"
                )
            }
            LineProblem::NotUtf8 => f.write_str("not UTF-8 text"),
            LineProblem::MoreThanOneLine => {
                f.write_str("an operator secret file holds exactly one line")
            }
            LineProblem::ControlCharacter => f.write_str(
                "the secret holds a control character, which a bearer token cannot carry",
            ),
            LineProblem::BadOperatorName => write!(
                f,
                "an operator's name is 1 to {MAX_OPERATOR_NAME_BYTES} bytes without control characters"
            ),
            LineProblem::ShortSecret { bytes } => write!(
                f,
                "the secret is {bytes} bytes; an operator's secret is at least \
                 {MIN_OPERATOR_SECRET_BYTES} bytes"
            ),
        }
    }
}

impl SecretsError {
    /// The 1-based line the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            SecretsError::Line { line, .. } => Some(*line),
            SecretsError::File { .. } => None,
            SecretsError::InFile { error, .. } => error.line(),
        }
    }

    /// What is wrong with the line, if the error is about a line.
    pub fn problem(&self) -> Option<&LineProblem> {
        match self {
            SecretsError::Line { problem, .. } => Some(problem),
            SecretsError::File { .. } => None,
            SecretsError::InFile { error, .. } => error.problem(),
        }
    }

    fn in_file(self, file: &Path) -> SecretsError {
        SecretsError::InFile {
            file: file.to_path_buf(),
            error: Box::new(self),
        }
    }
}

impl fmt::Display for SecretsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretsError::Line { line, problem } => write!(f, "line {line}: {problem}"),
            SecretsError::File { file, detail } => write!(f, "{}: {detail}", one_line_path(file)),
            SecretsError::InFile { file, error } => write!(f, "{}: {error}", one_line_path(file)),
        }
    }
}

impl std::error::Error for SecretsError {}

/// What is wrong with `name` as an identity, in words that do not repeat it.
fn name_problem(name: &str) -> String {
    let length = name.chars().count();
    if length == 0 {
        return "it is empty".to_owned();
    }
    if length > 64 {
        return format!("it is {length} characters long");
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-');
    let mut wrong: Vec<String> = Vec::new();
    for c in name.chars().filter(|&c| !allowed(c)) {
        let shown = format!("{c:?}");
        if !wrong.contains(&shown) {
            wrong.push(shown);
        }
    }
    if !wrong.is_empty() {
        return format!("it holds {}", wrong.join(", "));
    }
    "it does not start with a letter or digit".to_owned()
}

impl Secrets {
    /// Parses the text of a secrets file.
    pub fn parse(text: &str) -> Result<Secrets, SecretsError> {
        let mut by_identity = BTreeMap::new();
        let mut lines_of_names: BTreeMap<Identity, usize> = BTreeMap::new();
        let mut lines_of_secrets: BTreeMap<&str, usize> = BTreeMap::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let fail = |problem| SecretsError::Line { line, problem };
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let (name, secret) = trimmed
                .split_once('=')
                .ok_or_else(|| fail(LineProblem::MissingEquals))?;
            let (name, secret) = (name.trim(), secret.trim());
            let identity =
                Identity::new(name).map_err(|_| fail(LineProblem::BadName(name.to_owned())))?;
            if secret.is_empty() {
                return Err(fail(LineProblem::EmptySecret));
            }
            if secret.contains(char::is_control) {
                return Err(fail(LineProblem::ControlCharacter));
            }
            if let Some(&first_line) = lines_of_names.get(&identity) {
                return Err(fail(LineProblem::DuplicateName {
                    name: name.to_owned(),
                    first_line,
                }));
            }
            if let Some(&first_line) = lines_of_secrets.get(secret) {
                return Err(fail(LineProblem::DuplicateSecret { first_line }));
            }
            lines_of_names.insert(identity.clone(), line);
            lines_of_secrets.insert(secret, line);
            by_identity.insert(identity, secret.to_owned());
        }
        Ok(Secrets { by_identity })
    }

    /// Parses the bytes of a secrets file; non-UTF-8 content is an error naming its line.
    pub fn from_bytes(bytes: &[u8]) -> Result<Secrets, SecretsError> {
        Secrets::parse(utf8(bytes)?)
    }

    /// Reads and parses a secrets file (at most [`MAX_SECRETS_FILE_BYTES`]).
    pub fn from_path(path: &Path) -> Result<Secrets, SecretsError> {
        let bytes = read_secret_file(path)?;
        Secrets::from_bytes(&bytes).map_err(|e| e.in_file(path))
    }

    /// The configured identities, in order.
    pub fn identities(&self) -> impl ExactSizeIterator<Item = &Identity> + '_ {
        self.by_identity.keys()
    }

    /// The secret of `identity`, if it is configured.
    pub fn secret(&self, identity: &str) -> Option<&str> {
        self.by_identity.get(identity).map(String::as_str)
    }

    /// The identity whose secret is `token` (a bearer token as the client sent it), if any.
    ///
    /// Every secret is compared, each in constant time (`subtle`), so the time taken depends on
    /// the number and lengths of the secrets, never on which one matched or how much of one did.
    /// Secrets are distinct (a file with two equal secrets is refused), so at most one matches.
    ///
    /// ```
    /// use unyolo_admission::config::Secrets;
    ///
    /// let secrets = Secrets::parse("bot-7 = s3cret-seven\nbot-8 = s3cret-eight\n").unwrap();
    /// assert_eq!(secrets.identify(b"s3cret-eight").map(|i| i.as_str()), Some("bot-8"));
    /// assert_eq!(secrets.identify(b"s3cret"), None);
    /// ```
    pub fn identify(&self, token: &[u8]) -> Option<&Identity> {
        use subtle::ConstantTimeEq;
        let mut found = None;
        for (identity, secret) in &self.by_identity {
            if bool::from(secret.as_bytes().ct_eq(token)) {
                found = Some(identity);
            }
        }
        found
    }

    /// Every identity with its secret, in identity order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&Identity, &str)> + '_ {
        self.by_identity.iter().map(|(i, s)| (i, s.as_str()))
    }

    /// How many identities are configured.
    pub fn len(&self) -> usize {
        self.by_identity.len()
    }

    /// Whether no identity is configured.
    pub fn is_empty(&self) -> bool {
        self.by_identity.is_empty()
    }

    /// The clients whose secrets are shorter than [`AGENT_CLIENT_SECRET_BYTES`], each with its
    /// secret's length in bytes (never the secret): unYOLO's agent clients refuse such a
    /// credential before they send it, so `serve` warns about them.
    pub fn shorter_than_agents_accept(&self) -> impl Iterator<Item = (&Identity, usize)> + '_ {
        self.by_identity
            .iter()
            .map(|(identity, secret)| (identity, secret.len()))
            .filter(|(_, len)| *len < AGENT_CLIENT_SECRET_BYTES)
    }
}

/// The shortest credential unYOLO's agent clients accept (its Go client and its own server
/// refuse anything shorter), in bytes. A shorter client secret works with `curl`, not with them.
pub const AGENT_CLIENT_SECRET_BYTES: usize = 32;

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.by_identity.keys().map(|i| (i, "<redacted>")))
            .finish()
    }
}

/// The shortest operator secret, in bytes (unYOLO's `auth.MinimumSecretBytes`; its Go client
/// refuses a shorter token).
pub const MIN_OPERATOR_SECRET_BYTES: usize = 32;

/// The longest operator name, in bytes.
pub const MAX_OPERATOR_NAME_BYTES: usize = 200;

/// The named operators of a broker (`--operator-secrets`): each name and its bearer secret, and
/// the line it was given on.
///
/// Read from a file with one `name = secret` per line, like the client secrets; blank lines and
/// lines starting with `#` are ignored, whitespace around the name and the secret is trimmed, the
/// secret is everything after the first `=`. A name is 1 to [`MAX_OPERATOR_NAME_BYTES`] bytes
/// without control characters (it becomes `decided_by`, e.g. `Ada Lovelace` or `telegram:42`); a
/// secret is at least [`MIN_OPERATOR_SECRET_BYTES`] bytes without control characters; names and
/// secrets are unique.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Operators {
    entries: Vec<OperatorEntry>,
}

#[derive(Clone, PartialEq, Eq)]
struct OperatorEntry {
    name: String,
    secret: String,
    line: usize,
}

impl Operators {
    /// Parses the text of an operator secrets file.
    pub fn parse(text: &str) -> Result<Operators, SecretsError> {
        let mut entries: Vec<OperatorEntry> = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let fail = |problem| SecretsError::Line { line, problem };
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let (name, secret) = trimmed
                .split_once('=')
                .ok_or_else(|| fail(LineProblem::MissingEquals))?;
            let (name, secret) = (name.trim(), secret.trim());
            if name.is_empty()
                || name.len() > MAX_OPERATOR_NAME_BYTES
                || name.contains(char::is_control)
            {
                return Err(fail(LineProblem::BadOperatorName));
            }
            if secret.is_empty() {
                return Err(fail(LineProblem::EmptySecret));
            }
            if secret.contains(char::is_control) {
                return Err(fail(LineProblem::ControlCharacter));
            }
            if secret.len() < MIN_OPERATOR_SECRET_BYTES {
                return Err(fail(LineProblem::ShortSecret {
                    bytes: secret.len(),
                }));
            }
            if let Some(first) = entries.iter().find(|e| e.name == name) {
                return Err(fail(LineProblem::DuplicateName {
                    name: name.to_owned(),
                    first_line: first.line,
                }));
            }
            if let Some(first) = entries.iter().find(|e| e.secret == secret) {
                return Err(fail(LineProblem::DuplicateSecret {
                    first_line: first.line,
                }));
            }
            entries.push(OperatorEntry {
                name: name.to_owned(),
                secret: secret.to_owned(),
                line,
            });
        }
        Ok(Operators { entries })
    }

    /// Parses the bytes of an operator secrets file; non-UTF-8 content is an error naming its
    /// line.
    pub fn from_bytes(bytes: &[u8]) -> Result<Operators, SecretsError> {
        Operators::parse(utf8(bytes)?)
    }

    /// Reads and parses an operator secrets file (at most [`MAX_SECRETS_FILE_BYTES`]).
    pub fn from_path(path: &Path) -> Result<Operators, SecretsError> {
        let bytes = read_secret_file(path)?;
        Operators::from_bytes(&bytes).map_err(|e| e.in_file(path))
    }

    /// One operator, `name`, with `secret` (given on line 1), if the secret meets the rules: for
    /// the one-line operator secret file of earlier releases, and for tests.
    pub fn single(name: &str, secret: &str) -> Result<Operators, SecretsError> {
        Operators::parse(&format!("{name} = {secret}\n"))
    }

    /// Reads the one-line operator secret file of earlier releases as operator `name`, if its
    /// secret meets today's rules (at least [`MIN_OPERATOR_SECRET_BYTES`] bytes).
    pub fn from_legacy_path(path: &Path, name: &str) -> Result<Operators, SecretsError> {
        let secret = read_operator_secret(path)?;
        Operators::single(name, &secret).map_err(|e| e.in_file(path))
    }

    /// The name of the operator whose secret is `token`, if any. Every secret is compared, each
    /// in constant time (`subtle`), as [`Secrets::identify`] does.
    pub fn identify(&self, token: &[u8]) -> Option<&str> {
        use subtle::ConstantTimeEq;
        let mut found = None;
        for entry in &self.entries {
            if bool::from(entry.secret.as_bytes().ct_eq(token)) {
                found = Some(entry.name.as_str());
            }
        }
        found
    }

    /// The first operator (by line) whose secret is also a client's secret in `clients`: its
    /// line and the client. Every secret compared in constant time.
    pub fn sharing_with<'a>(&self, clients: &'a Secrets) -> Option<(usize, &'a Identity)> {
        self.entries.iter().find_map(|entry| {
            clients
                .identify(entry.secret.as_bytes())
                .map(|client| (entry.line, client))
        })
    }

    /// The operators' names, in file order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.entries.iter().map(|e| e.name.as_str())
    }

    /// Every operator with its secret, in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.entries
            .iter()
            .map(|e| (e.name.as_str(), e.secret.as_str()))
    }

    /// The secret of operator `name`, if there is one.
    pub fn secret(&self, name: &str) -> Option<&str> {
        self.iter().find(|(n, _)| *n == name).map(|(_, s)| s)
    }

    /// How many operators there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl fmt::Debug for Operators {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|e| (&e.name, "<redacted>")))
            .finish()
    }
}

/// Parses the text of an operator secret file: one line, optionally ending in a newline; surrounding
/// whitespace is trimmed; empty, or holding a control character, is an error.
pub fn parse_operator_secret(text: &str) -> Result<String, SecretsError> {
    let secret = text.trim();
    if secret.is_empty() {
        return Err(SecretsError::Line {
            line: 1,
            problem: LineProblem::EmptySecret,
        });
    }
    if secret.contains(['\n', '\r']) {
        return Err(SecretsError::Line {
            line: 2,
            problem: LineProblem::MoreThanOneLine,
        });
    }
    if secret.contains(char::is_control) {
        return Err(SecretsError::Line {
            line: 1,
            problem: LineProblem::ControlCharacter,
        });
    }
    Ok(secret.to_owned())
}

/// Reads an operator secret file (see [`parse_operator_secret`]).
pub fn read_operator_secret(path: &Path) -> Result<String, SecretsError> {
    let bytes = read_secret_file(path)?;
    utf8(&bytes)
        .and_then(parse_operator_secret)
        .map_err(|e| e.in_file(path))
}

fn read_secret_file(path: &Path) -> Result<Vec<u8>, SecretsError> {
    let bytes = read_bounded(path, MAX_SECRETS_FILE_BYTES).map_err(|e| file_error(path, &e))?;
    if bytes.len() > MAX_SECRETS_FILE_BYTES {
        return Err(SecretsError::File {
            file: path.to_path_buf(),
            detail: format!("larger than {MAX_SECRETS_FILE_BYTES} bytes"),
        });
    }
    Ok(bytes)
}

/// Restates a file error from the shared bounded reader without the quota file's wording.
fn file_error(path: &Path, error: &ConfigError) -> SecretsError {
    let detail = match error {
        ConfigError::Io { source, .. } => format!("cannot read: {source}"),
        ConfigError::Path { detail, .. } => detail.clone(),
        other => other.to_string(),
    };
    SecretsError::File {
        file: path.to_path_buf(),
        detail,
    }
}

fn utf8(bytes: &[u8]) -> Result<&str, SecretsError> {
    std::str::from_utf8(bytes).map_err(|e| SecretsError::Line {
        line: 1 + bytes[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
        problem: LineProblem::NotUtf8,
    })
}
