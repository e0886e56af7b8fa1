//! Why a quota file was refused, as a value a person can act on.
//!
//! Every error is one line that names where the problem is (the JSON path, such as
//! `clients.bot-7.pending`, or the file) and which rule it broke. The rule is also available as a
//! [`Rule`] so callers and tests can match on it without parsing text.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The rule of the quota file contract an input broke.
///
/// The set may grow; match with a wildcard arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// The bytes are not JSON (or not UTF-8, or empty).
    Syntax,
    /// Something follows the top-level JSON value.
    TrailingContent,
    /// The file is larger than [`MAX_FILE_BYTES`](super::MAX_FILE_BYTES).
    FileTooLarge,
    /// An object was expected (the top level, `clients`, or an override) and something else found.
    ExpectedObject,
    /// A `null` where a value is required.
    Null,
    /// A key appears twice in one object.
    DuplicateKey,
    /// A field the contract does not define (names are case-sensitive).
    UnknownField,
    /// A required field is absent.
    MissingField,
    /// A limit that is not a JSON integer literal (`60.0`, `6e1`, `"60"`, `true`, ...).
    NotAnInteger,
    /// A limit of zero.
    Zero,
    /// A negative limit.
    Negative,
    /// A limit above its maximum (1,000,000; 86,400 for `window_seconds`).
    AboveMaximum,
    /// A pending limit above the active limit it belongs with.
    PendingAboveActive,
    /// A client's active limit above `global_active`.
    ActiveAboveGlobalActive,
    /// `global_executing` above `global_active`.
    ExecutingAboveGlobalActive,
    /// An override key that is not exactly a configured identity.
    UnknownIdentity,
    /// A fair-share `reserve` not below its pool's global limit (`global_active` or
    /// `global_executing`): nothing of the pool would be left to share.
    ReserveNotBelowGlobal,
    /// A fair-share `floor` above some client's own limit for the pool (its `active`): that
    /// client would always count as small.
    FloorAboveClientLimit,
    /// The file path is not absolute.
    PathNotAbsolute,
    /// The file path has `.`, `..`, repeated or trailing separators.
    PathNotNormalized,
    /// No file exists at the path.
    FileNotFound,
    /// The path names a directory.
    IsDirectory,
    /// Reading the file failed for another reason (permissions, I/O), or the path names a
    /// named pipe or a socket (refused before it is opened, which could wait forever).
    Unreadable,
}

impl Rule {
    /// A stable kebab-case name for the rule, e.g. `pending-above-active`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Syntax => "syntax",
            Rule::TrailingContent => "trailing-content",
            Rule::FileTooLarge => "file-too-large",
            Rule::ExpectedObject => "expected-object",
            Rule::Null => "null",
            Rule::DuplicateKey => "duplicate-key",
            Rule::UnknownField => "unknown-field",
            Rule::MissingField => "missing-field",
            Rule::NotAnInteger => "not-an-integer",
            Rule::Zero => "zero",
            Rule::Negative => "negative",
            Rule::AboveMaximum => "above-maximum",
            Rule::PendingAboveActive => "pending-above-active",
            Rule::ActiveAboveGlobalActive => "active-above-global-active",
            Rule::ExecutingAboveGlobalActive => "executing-above-global-active",
            Rule::UnknownIdentity => "unknown-identity",
            Rule::ReserveNotBelowGlobal => "reserve-not-below-global",
            Rule::FloorAboveClientLimit => "floor-above-client-limit",
            Rule::PathNotAbsolute => "path-not-absolute",
            Rule::PathNotNormalized => "path-not-normalized",
            Rule::FileNotFound => "file-not-found",
            Rule::IsDirectory => "is-directory",
            Rule::Unreadable => "unreadable",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a quota file (or a programmatic [`Config`](super::Config)) was refused.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConfigError {
    /// The contents break a rule. `path` is the JSON path (empty for the top level) and `detail`
    /// says what was found and what the rule wants.
    Invalid {
        /// The file the contents came from, when they came from a file.
        file: Option<PathBuf>,
        /// The JSON path, e.g. `clients.bot-7.pending`; empty for the top level.
        path: String,
        /// The rule broken.
        rule: Rule,
        /// One line: what was found and what is expected.
        detail: String,
    },
    /// The file path cannot be used: not absolute, not normalized, missing, or a directory.
    Path {
        /// The path as given.
        file: PathBuf,
        /// [`Rule::PathNotAbsolute`], [`Rule::PathNotNormalized`], [`Rule::FileNotFound`],
        /// [`Rule::IsDirectory`], or [`Rule::Unreadable`] for a named pipe or a socket.
        rule: Rule,
        /// One line: what is wrong and how to fix it.
        detail: String,
    },
    /// Opening or reading the file failed ([`Rule::Unreadable`]).
    Io {
        /// The path as given.
        file: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

impl ConfigError {
    /// The JSON path the error is about, e.g. `clients.bot-7.pending`; empty for the top level and
    /// for errors about the file itself.
    pub fn path(&self) -> &str {
        match self {
            ConfigError::Invalid { path, .. } => path,
            ConfigError::Path { .. } | ConfigError::Io { .. } => "",
        }
    }

    /// The rule that was broken.
    pub fn rule(&self) -> Rule {
        match self {
            ConfigError::Invalid { rule, .. } | ConfigError::Path { rule, .. } => *rule,
            ConfigError::Io { .. } => Rule::Unreadable,
        }
    }

    /// The file the error is about, when there is one.
    pub fn file(&self) -> Option<&Path> {
        match self {
            ConfigError::Invalid { file, .. } => file.as_deref(),
            ConfigError::Path { file, .. } | ConfigError::Io { file, .. } => Some(file),
        }
    }

    pub(crate) fn invalid(path: impl Into<String>, rule: Rule, detail: impl Into<String>) -> Self {
        ConfigError::Invalid {
            file: None,
            path: path.into(),
            rule,
            detail: detail.into(),
        }
    }

    /// Attaches the file name to a contents error, so a broker's log line says which file.
    pub(crate) fn in_file(self, name: &Path) -> Self {
        match self {
            ConfigError::Invalid {
                path, rule, detail, ..
            } => ConfigError::Invalid {
                file: Some(name.to_path_buf()),
                path,
                rule,
                detail,
            },
            other => other,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Invalid {
                file,
                path,
                rule: _,
                detail,
            } => {
                if let Some(file) = file {
                    write!(f, "{}: ", one_line_path(file))?;
                }
                let path = if path.is_empty() { "top level" } else { path };
                write!(f, "{path}: {detail}")
            }
            ConfigError::Path { file, detail, .. } => {
                write!(f, "{}: {detail}", one_line_path(file))
            }
            ConfigError::Io { file, source } => {
                write!(f, "{}: cannot read: {source}", one_line_path(file))
            }
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A file path shown on one line: as is when it is plain, quoted and escaped when it holds control
/// characters (a newline in a file name must not split an error message).
pub(crate) fn one_line_path(path: &Path) -> String {
    let shown = path.display().to_string();
    if shown.chars().any(char::is_control) {
        format!("{shown:?}")
    } else {
        shown
    }
}

/// A JSON object key shown inside a path: bare when it is made of identity characters other
/// than `.`, otherwise quoted and escaped so the path stays on one line and unambiguous (a client
/// `ci.bot` is `clients."ci.bot".pending`, never read as three levels).
pub(crate) fn path_segment(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'-'));
    if plain {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

/// Joins a parent JSON path and a key.
pub(crate) fn join_path(parent: &str, key: &str) -> String {
    let segment = path_segment(key);
    if parent.is_empty() {
        segment
    } else {
        format!("{parent}.{segment}")
    }
}

/// The candidate closest to `key` by edit distance, when it is close enough to be a likely typo
/// (a case-only difference, or at most two edits and not more than a third of the candidate).
pub(crate) fn nearest<'a>(
    key: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let key_len = key.chars().count();
    let mut best: Option<(usize, &'a str)> = None;
    for candidate in candidates {
        let distance = if candidate.eq_ignore_ascii_case(key) {
            0
        } else {
            let len = candidate.chars().count();
            // The distance is at least the length difference; skip far candidates cheaply, which
            // also keeps the quadratic distance off very long keys.
            if len.abs_diff(key_len) > 2 {
                continue;
            }
            let d = edit_distance(key, candidate);
            if d > 2 || d * 3 > len.max(3) {
                continue;
            }
            d
        };
        if best.is_none_or(|(b, _)| distance < b) {
            best = Some((distance, candidate));
        }
    }
    best.map(|(_, c)| c)
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if ca == *cb {
                diagonal
            } else {
                1 + diagonal.min(above).min(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_suggests_a_one_edit_typo() {
        assert_eq!(nearest("bot7", ["bot-7", "automation-a"]), Some("bot-7"));
    }

    #[test]
    fn nearest_suggests_a_case_variant() {
        assert_eq!(nearest("Bot-7", ["bot-7"]), Some("bot-7"));
    }

    #[test]
    fn nearest_suggests_nothing_for_an_unrelated_name() {
        assert_eq!(nearest("ci-runner", ["bot-7", "automation-a"]), None);
    }

    #[test]
    fn path_segments_with_odd_characters_are_quoted() {
        assert_eq!(join_path("clients", "bot-7"), "clients.bot-7");
        assert_eq!(join_path("clients", "a b\n"), "clients.\"a b\\n\"");
        assert_eq!(join_path("", ""), "\"\"");
        // A dot inside a key is quoted: the path's dots are its levels.
        assert_eq!(join_path("clients", "ci.bot"), "clients.\"ci.bot\"");
        assert_eq!(
            join_path(&join_path("clients", "ci.bot"), "pending"),
            "clients.\"ci.bot\".pending"
        );
    }
}
