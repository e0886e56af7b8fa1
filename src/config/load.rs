//! Where a quota file comes from: a path, or a path named by an environment variable.
//!
//! A broker resolves its quota file once at start and again on every reload, possibly from a
//! different working directory, so the path must mean one file without interpretation: absolute
//! and already normalized. The file is read with a hard bound, never trusting the size the file
//! system reports (a file can grow between `stat` and `read`, and `/dev/zero` reports zero).

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::error::{ConfigError, Rule, one_line_path};
use super::limits::MAX_FILE_BYTES;

/// Checks that `path` is absolute and normalized: it starts at the root, and has no `.` or `..`
/// component, no repeated separator and no trailing separator.
///
/// `/etc/admission/quota.json` passes; `quota.json`, `/etc/./quota.json`, `/etc/../quota.json`,
/// `//etc/quota.json` and `/etc/quota.json/` do not.
pub fn check_path(path: &Path) -> Result<(), ConfigError> {
    let bytes = path.as_os_str().as_encoded_bytes();
    if !path.is_absolute() || !bytes.first().is_some_and(|b| is_separator(*b)) {
        // A hint is only given if it would itself pass: `..` resolved by name, `.` and repeated
        // or trailing separators dropped (a `..` above the root gives none).
        let hint = std::path::absolute(path)
            .ok()
            .and_then(|p| lexically_normal(&p))
            .filter(|p| check_path(p).is_ok())
            .map(|p| format!(" (did you mean {}?)", one_line_path(&p)))
            .unwrap_or_default();
        return Err(ConfigError::Path {
            file: path.to_path_buf(),
            rule: Rule::PathNotAbsolute,
            detail: format!("the quota file path must be absolute{hint}"),
        });
    }
    if bytes.len() == 1 {
        // The root itself: normalized, and a directory, which opening reports.
        return Ok(());
    }
    let segments = bytes[1..].split(|b| is_separator(*b));
    for segment in segments {
        let problem = match segment {
            b"" => Some("a repeated or trailing separator"),
            b"." => Some("a '.' component"),
            b".." => Some("a '..' component"),
            _ => None,
        };
        if let Some(problem) = problem {
            // The same hint as for a relative path: by name, and only if it would pass.
            let hint = lexically_normal(path)
                .filter(|p| check_path(p).is_ok())
                .map(|p| format!(" (did you mean {}?)", one_line_path(&p)))
                .unwrap_or_default();
            return Err(ConfigError::Path {
                file: path.to_path_buf(),
                rule: Rule::PathNotNormalized,
                detail: format!(
                    "the quota file path must be normalized, and it has {problem}{hint}"
                ),
            });
        }
    }
    Ok(())
}

/// `path` (absolute) with `.` components and repeated or trailing separators dropped and each
/// `..` taking the component before it away, by name only (no symlink is read); `None` if a
/// `..` would climb above the root.
fn lexically_normal(path: &Path) -> Option<PathBuf> {
    use std::path::Component;
    let mut normal = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                if !normal.pop() {
                    return None;
                }
            }
            other => normal.push(other),
        }
    }
    Some(normal)
}

fn is_separator(b: u8) -> bool {
    b == b'/' || (cfg!(windows) && b == b'\\')
}

/// Reads at most `limit + 1` bytes of the file at `path`, so a caller can tell "exactly `limit`"
/// from "more". Refuses directories and reports a missing file as such.
pub(crate) fn read_bounded(path: &Path, limit: usize) -> Result<Vec<u8>, ConfigError> {
    let io_error = |source: io::Error| ConfigError::Io {
        file: path.to_path_buf(),
        source,
    };
    refuse_special(path)?;
    let file = File::open(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => ConfigError::Path {
            file: path.to_path_buf(),
            rule: Rule::FileNotFound,
            detail: "no such file".to_owned(),
        },
        io::ErrorKind::IsADirectory => is_directory(path),
        _ => io_error(source),
    })?;
    // Asked of the open file, so it describes the very thing about to be read.
    if file.metadata().map_err(io_error)?.is_dir() {
        return Err(is_directory(path));
    }
    let bound = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    let mut bytes = Vec::new();
    file.take(bound)
        .read_to_end(&mut bytes)
        .map_err(|source| match source.kind() {
            io::ErrorKind::IsADirectory => is_directory(path),
            _ => io_error(source),
        })?;
    Ok(bytes)
}

/// Refuses a named pipe or a socket by its type, before it is opened: opening one blocks until
/// a writer comes, which would hang `check` and, on a reload, the broker's signal handling.
/// (A character device such as `/dev/zero` is read, bounded like any file.)
fn refuse_special(path: &Path) -> Result<(), ConfigError> {
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        let kind = meta.file_type();
        let what = if kind.is_fifo() {
            Some("a named pipe (FIFO)")
        } else if kind.is_socket() {
            Some("a socket")
        } else {
            None
        };
        if let Some(what) = what {
            return Err(ConfigError::Path {
                file: path.to_path_buf(),
                rule: Rule::Unreadable,
                detail: format!("is {what}, not a file; give the path of the quota file itself"),
            });
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

fn is_directory(path: &Path) -> ConfigError {
    ConfigError::Path {
        file: path.to_path_buf(),
        rule: Rule::IsDirectory,
        detail: "is a directory, not a file".to_owned(),
    }
}

/// Reads a quota file's bytes from `path` after the checks [`Config::from_path`](super::Config)
/// makes of the path and the size (absolute and normalized, a file, at most
/// [`MAX_FILE_BYTES`]), without judging its contents: for a caller that judges them itself (a
/// candidate file replayed against history, a shadow file). Errors name the file.
pub fn read_quota_file(path: &Path) -> Result<Vec<u8>, ConfigError> {
    check_path(path)?;
    let bytes = read_bounded(path, MAX_FILE_BYTES)?;
    if bytes.len() > MAX_FILE_BYTES {
        return Err(ConfigError::invalid(
            "",
            Rule::FileTooLarge,
            format!("the file is larger than {MAX_FILE_BYTES} bytes, the most a quota file may be"),
        )
        .in_file(path));
    }
    Ok(bytes)
}

/// The quota file path named by an environment variable's value: `None` when the variable is unset
/// or empty, which means "use the defaults".
pub(crate) fn path_from_env(value: Option<&OsStr>) -> Option<PathBuf> {
    value.filter(|v| !v.is_empty()).map(PathBuf::from)
}
