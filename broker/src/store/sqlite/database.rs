//! The store's handle: the data dir (locked against a second broker), the one writer connection
//! and the pool of readers, the clock the rows are stamped with, and the two ways every query
//! runs (`write` and `read`, off the async threads). Each concern's queries are `impl SqliteStore`
//! blocks in their own files; this one knows none of them.

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::super::bell::EventBell;
use super::super::dir_lock::lock_data_dir;
use super::super::durable::DEFAULT_COMMIT_BATCH;
use super::super::error::StoreError;
use super::super::records::DEFAULT_BROKER_NAME;
use super::group::GroupCommit;
use super::schema;

/// How many reader connections serve gets, list pages and waits.
pub const READERS: u32 = 4;

/// The database file's name inside the data dir.
pub const DATABASE_FILE: &str = "admission.sqlite3";

/// The bytes the write-ahead log is cut back to after a checkpoint.
const WAL_SIZE_LIMIT: i64 = 4 * 1024 * 1024;

/// The free space, in bytes, the data dir's filesystem must have for the store to be ready: a
/// write may need the largest submission (a 1 MiB body) in the log and again in the database
/// at the next checkpoint, and the log may hold its cut-back size (4 MiB) besides. Below it
/// SQLite fails writes half-way (`SQLITE_FULL`), so `/readyz` takes the broker out of rotation
/// before that, rather than after.
pub const MIN_FREE_BYTES: u64 = 8 * 1024 * 1024;

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    pub(super) writer: Arc<Mutex<Connection>>,
    /// The creations and state changes waiting to be committed together on `writer`.
    pub(super) group: Arc<GroupCommit>,
    pub(super) readers: r2d2::Pool<SqliteConnectionManager>,
    pub(super) dir: PathBuf,
    /// The broker name operations show.
    pub(super) broker: Arc<str>,
    /// The operations whose changes the event log records: those that need an operator's
    /// approval (Operator V1 requests). None until [`SqliteStore::with_requests`].
    pub(super) requests: Arc<[String]>,
    /// Where the newest committed event is published.
    pub(super) events: EventBell,
    /// The data dir's lock, held until the last handle is dropped (closing the file unlocks it).
    _lock: Arc<std::fs::File>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("dir", &self.dir)
            .finish()
    }
}

fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    // Before WAL, whose switch writes a new file's header: a new file is incremental from the start.
    conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: a commit is on disk before it returns, in WAL mode too.
    conn.pragma_update(None, "synchronous", "FULL")?;
    // When the log restarts after a checkpoint, it is cut back to this size: a burst of writes (a
    // large sweep) does not leave a large log file behind.
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    // 32 MiB of page cache (negative: KiB): a sweep's batch touches index pages all over the
    // file, and re-reading them for every batch is most of its cost.
    conn.pragma_update(None, "cache_size", -32_768)?;
    Ok(conn)
}

/// Whether the filesystem holding `dir` has `needed` bytes free for this process (`statvfs`'s
/// blocks available to an unprivileged user: root's reserve does not count).
fn has_room(dir: &Path, needed: u64) -> Result<(), StoreError> {
    let stat = rustix::fs::statvfs(dir).map_err(|e| StoreError::io("measure", dir, e.into()))?;
    let available = stat.f_bavail.saturating_mul(stat.f_frsize);
    if available < needed {
        return Err(StoreError::NoRoom {
            dir: dir.to_owned(),
            available,
            needed,
        });
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating if needed) the database in `dir`, creating the schema on first start and
    /// migrating an older one; operations show [`DEFAULT_BROKER_NAME`]. Fails if another broker
    /// holds the data dir. Blocking; call it before serving.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_as(dir, DEFAULT_BROKER_NAME)
    }

    /// [`SqliteStore::open`], with operations showing `broker` as their broker's name.
    pub fn open_as(dir: &Path, broker: &str) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::io("create", dir, e))?;
        let lock = lock_data_dir(dir)?;
        let path = dir.join(DATABASE_FILE);
        let writer = open_connection(&path)?;
        schema::migrate(&writer, &path)?;
        // Readers only read: WAL is already on (it is a property of the file), and a reader never
        // takes the write lock.
        let manager = SqliteConnectionManager::file(&path).with_init(|conn| {
            conn.busy_timeout(std::time::Duration::from_secs(5))?;
            conn.pragma_update(None, "query_only", true)
        });
        let readers = r2d2::Pool::builder()
            .max_size(READERS)
            .connection_timeout(std::time::Duration::from_secs(5))
            .build(manager)
            .map_err(|source| StoreError::NoReader {
                path: path.clone(),
                source,
            })?;
        schema::ensure_indexes(&writer)?;
        let events = super::bell::open_bell(&writer)?;
        Ok(SqliteStore {
            writer: Arc::new(Mutex::new(writer)),
            group: Arc::new(GroupCommit::new(DEFAULT_COMMIT_BATCH)),
            readers,
            broker: Arc::from(broker),
            requests: Arc::from([]),
            events,
            dir: dir.to_owned(),
            _lock: Arc::new(lock),
        })
    }

    /// This handle, recording in the event log the changes of the operations named in
    /// `requests` (the registered operations that need an operator's approval). The broker
    /// passes them at start-up; the store knows no operation by name.
    pub fn with_requests<'a>(mut self, requests: impl IntoIterator<Item = &'a str>) -> SqliteStore {
        self.requests = requests.into_iter().map(str::to_owned).collect();
        self
    }

    /// This handle, committing at most `most` creations and state changes in one transaction
    /// ([`DEFAULT_COMMIT_BATCH`] by default; 1 commits each alone). Call it before the first write.
    pub fn with_commit_batch(mut self, most: usize) -> SqliteStore {
        self.group = Arc::new(GroupCommit::new(most));
        self
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The broker name operations show.
    pub fn broker(&self) -> &str {
        &self.broker
    }

    /// Whether the store would take a write now: its filesystem has [`MIN_FREE_BYTES`] free for
    /// this process, and the write connection takes SQLite's write lock and lets it go, writing
    /// nothing. Fails with [`StoreError::NoRoom`] on a (nearly) full disk, after the busy timeout
    /// while another process holds the database's write lock, and if the file cannot be read or
    /// locked: the states in which a submission could not be made durable.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || has_room(&dir, MIN_FREE_BYTES))
            .await
            .map_err(|e| StoreError::unfinished("the free space reading", e))??;
        self.write(|conn| {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            conn.execute_batch("ROLLBACK")
        })
        .await
    }

    /// A reader connection from the pool (blocking until one is free, at most its timeout).
    pub(super) fn reader(
        &self,
    ) -> Result<r2d2::PooledConnection<SqliteConnectionManager>, StoreError> {
        self.readers.get().map_err(|source| StoreError::NoReader {
            path: self.dir.join(DATABASE_FILE),
            source,
        })
    }

    /// The write connection, blocking until no other call holds it (for the blocking calls made
    /// before serving: recovery, seeding).
    pub(super) fn writer(&self) -> std::sync::MutexGuard<'_, Connection> {
        crate::sync::lock(&self.writer)
    }

    /// Runs `f` on the write connection, off the async threads.
    pub(super) async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = Arc::clone(&self.writer);
        tokio::task::spawn_blocking(move || {
            let mut conn = crate::sync::lock(&conn);
            f(&mut conn).map_err(StoreError::from)
        })
        .await
        .map_err(|e| StoreError::unfinished("the store task", e))?
    }

    /// Runs `f` on the write connection in the next group commit (its own savepoint of the
    /// batch's transaction), answered once the batch is committed; `committed` runs after a
    /// commit that kept `f`'s value, whether or not the caller still waits. See `group`.
    pub(super) async fn write_grouped<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        committed: impl FnOnce(&T) + Send + 'static,
    ) -> Result<T, StoreError> {
        self.group.write(&self.writer, f, committed).await
    }

    /// Runs `f` on a pooled reader connection, off the async threads; `f` gets the broker name
    /// records show.
    pub(super) async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, &str) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = self.clone();
        tokio::task::spawn_blocking(move || {
            let conn = db.reader()?;
            f(&conn, &db.broker).map_err(StoreError::from)
        })
        .await
        .map_err(|e| StoreError::unfinished("the store task", e))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_measured_on_the_data_dirs_filesystem_and_a_shortfall_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        has_room(dir.path(), 0).unwrap();
        let err = has_room(dir.path(), u64::MAX).unwrap_err();
        let StoreError::NoRoom {
            available, needed, ..
        } = err
        else {
            panic!("{err}");
        };
        assert_eq!(needed, u64::MAX);
        assert!(available < u64::MAX);
        let text = err.to_string();
        assert!(
            text.contains(&dir.path().display().to_string())
                && text.contains(&format!("has {available} bytes free"))
                && text.contains("free space on it or move --data"),
            "{text}"
        );
        let gone = dir.path().join("missing");
        let err = has_room(&gone, 0).unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Io {
                    action: "measure",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().starts_with("store: cannot measure "),
            "{err}"
        );
    }
}
