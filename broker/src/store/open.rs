//! Where a store lives, and opening the one a location names: the one place that knows which
//! backends there are.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::dir_lock::lock_data_dir;
use super::durable::DEFAULT_COMMIT_BATCH;
use super::durable::DurableStore;
use super::error::StoreError;
use super::postgres::{PostgresSettings, PostgresStore, is_postgres_url, redact_url};
use super::sqlite::SqliteStore;

/// Where a store lives. Its `Display` (and `Debug`) never shows a password.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file in this data dir (created if needed), owned by one broker.
    Dir(PathBuf),
    /// A PostgreSQL database (any libpq URL, `sslmode` honoured), shared by a fleet.
    Postgres {
        /// The URL, password included: shown only through [`redact_url`].
        url: String,
    },
}

impl StoreLocation {
    /// The location `text` names: a `postgres://` or `postgresql://` URL. Anything else is an
    /// error that says what is expected (a data dir is given as a path, not parsed here).
    pub fn parse(text: &str) -> Result<StoreLocation, String> {
        if is_postgres_url(text) {
            Ok(StoreLocation::Postgres {
                url: text.to_owned(),
            })
        } else {
            Err(format!(
                "{} is not a store location: expected a PostgreSQL URL, \
                 postgres://USER@HOST:PORT/DATABASE (or postgresql://...)",
                redact_url(text)
            ))
        }
    }
}

impl std::fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Dir(dir) => write!(f, "{}", dir.display()),
            StoreLocation::Postgres { url } => f.write_str(&redact_url(url)),
        }
    }
}

impl std::fmt::Debug for StoreLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLocation::Dir(dir) => f.debug_tuple("Dir").field(dir).finish(),
            StoreLocation::Postgres { url } => f
                .debug_struct("Postgres")
                .field("url", &redact_url(url))
                .finish(),
        }
    }
}

/// Opens the store at `location` (creating its schema, or migrating an older one), with
/// operations showing `broker` as their broker's name and the changes of the operations named
/// in `requests` (those that need an operator's approval) recorded in the event log. `data_dir`
/// is the broker's own, locked against a second broker whichever store is opened (two brokers on
/// one dir would take each other for one restarting); a PostgreSQL store writes stream bodies
/// under its `streams` (a SQLite store's data dir is `location`'s own).
pub async fn open(
    location: &StoreLocation,
    broker: &str,
    requests: impl IntoIterator<Item = &str>,
    data_dir: &Path,
) -> Result<Arc<dyn DurableStore>, StoreError> {
    open_batched(location, broker, requests, data_dir, DEFAULT_COMMIT_BATCH).await
}

/// [`open`], the store committing at most `commit_batch` creations and state changes in one
/// transaction (group commit; 1 commits each alone).
pub async fn open_batched(
    location: &StoreLocation,
    broker: &str,
    requests: impl IntoIterator<Item = &str>,
    data_dir: &Path,
    commit_batch: usize,
) -> Result<Arc<dyn DurableStore>, StoreError> {
    let requests: Vec<String> = requests.into_iter().map(str::to_owned).collect();
    match location {
        StoreLocation::Dir(dir) => {
            let (dir, broker) = (dir.clone(), broker.to_owned());
            let store = tokio::task::spawn_blocking(move || {
                SqliteStore::open_as(&dir, &broker).map(|db| {
                    db.with_requests(requests.iter().map(String::as_str))
                        .with_commit_batch(commit_batch)
                })
            })
            .await
            .map_err(|e| StoreError::unfinished("opening the store", e))??;
            Ok(Arc::new(store))
        }
        StoreLocation::Postgres { url } => {
            let dir = data_dir.to_owned();
            let lock = tokio::task::spawn_blocking(move || lock_data_dir(&dir))
                .await
                .map_err(|e| StoreError::unfinished("locking the data dir", e))??;
            let store = PostgresStore::connect_with(
                url,
                broker,
                requests.iter().map(String::as_str),
                data_dir.join("streams"),
                PostgresSettings {
                    commit_batch,
                    ..PostgresSettings::default()
                },
            )
            .await?;
            Ok(Arc::new(store.holding(lock)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_postgres_url_parses_and_shows_no_password() {
        let location = StoreLocation::parse("postgres://ops:hunter2@db:5432/fleet").unwrap();
        assert_eq!(location.to_string(), "postgres://ops:***@db:5432/fleet");
        assert!(!format!("{location:?}").contains("hunter2"));
        assert!(StoreLocation::parse("postgresql://db/fleet").is_ok());
        let err = StoreLocation::parse("mysql://ops:hunter2@db/fleet").unwrap_err();
        assert!(err.contains("expected a PostgreSQL URL"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
