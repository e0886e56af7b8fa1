//! Group commit: the creations and state changes that reach the one writer together are
//! committed in one transaction, so a burst pays one `fsync` for many rows instead of one each.
//!
//! A call queues its statements as a job and waits. One committer at a time (a task on the
//! blocking pool, started by the first job of an idle queue) takes the writer, then up to the
//! batch's bound of queued jobs, runs each inside its own `SAVEPOINT`, and commits them all at once: the jobs that
//! arrived while the previous batch was on its way to disk form the next, so no job waits for
//! company, only for the commit before it. A job whose statements fail (a key conflict: that one
//! request's `Duplicate`) is rolled back to its savepoint alone; the others commit. Every caller
//! is answered only after the batch's commit returned, with its own result, or with the commit's
//! error if the batch did not reach the disk. A caller that stops waiting changes nothing: its
//! job is the batch's like any other, committed or not with it.
//!
//! A batch bound of 1 commits each job alone (one transaction, one `fsync` per row): the
//! baseline the benchmarks compare against.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, Transaction};

use super::super::error::StoreError;

/// What a job does once its batch's commit returned: answers its caller (with the commit's
/// error, if any).
type Deliver = Box<dyn FnOnce(Option<&rusqlite::Error>) + Send>;

/// A queued job: runs its statements in the batch's transaction (or learns that the transaction
/// could not begin), and returns how to answer once the batch is committed.
type Job = Box<dyn FnOnce(Result<&mut Transaction<'_>, &rusqlite::Error>) -> Deliver + Send>;

/// The queue of jobs waiting for the writer, and whether a committer is at work on it.
pub(super) struct GroupCommit {
    queue: Mutex<Queue>,
    /// The most jobs in one transaction (at least 1).
    most: usize,
    /// How many batches were committed (the transactions, hence `fsync`s, group commit paid).
    commits: AtomicU64,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// A committer is running: it takes whatever is queued before it stops.
    committing: bool,
}

impl GroupCommit {
    pub(super) fn new(most: usize) -> GroupCommit {
        GroupCommit {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                committing: false,
            }),
            most: most.max(1),
            commits: AtomicU64::new(0),
        }
    }

    /// How many batches were committed so far.
    #[cfg(test)]
    pub(super) fn commits(&self) -> u64 {
        // Relaxed: a count, publishing nothing else.
        self.commits.load(Ordering::Relaxed)
    }
}

/// A copy of `err` for each caller of a failed batch (SQLite's errors are not `Clone`): its code
/// and message, so the store sorts it the same way (busy, full disk, I/O).
fn copy_of(err: &rusqlite::Error) -> rusqlite::Error {
    match err {
        rusqlite::Error::SqliteFailure(code, message) => {
            rusqlite::Error::SqliteFailure(*code, message.clone())
        }
        other => rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            Some(other.to_string()),
        ),
    }
}

/// Runs `f` inside a savepoint of `tx`: kept if it succeeds, rolled back alone if it fails or
/// panics.
fn in_savepoint<T>(
    tx: &mut Transaction<'_>,
    f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    let savepoint = tx.savepoint()?;
    let value =
        std::panic::catch_unwind(AssertUnwindSafe(|| f(&savepoint))).unwrap_or_else(|_| {
            Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                Some("the store's statement panicked".to_owned()),
            ))
        })?;
    // Released into the batch's transaction; dropped on an error above: rolled back.
    savepoint.commit()?;
    Ok(value)
}

impl GroupCommit {
    /// Runs `f` on `writer` in the next batch (its own savepoint of the batch's transaction) and
    /// answers once the batch is committed: `f`'s value, `f`'s error (the others in the batch
    /// unaffected), or the commit's error. `committed` runs after a commit that kept `f`'s value,
    /// whether or not the caller still waits (to ring the event bell).
    pub(super) async fn write<T: Send + 'static>(
        self: &Arc<Self>,
        writer: &Arc<Mutex<Connection>>,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        committed: impl FnOnce(&T) + Send + 'static,
    ) -> Result<T, StoreError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |tx| {
            let result = match tx {
                Ok(tx) => in_savepoint(tx, f),
                Err(err) => Err(copy_of(err)),
            };
            Box::new(move |commit: Option<&rusqlite::Error>| {
                let result = match (result, commit) {
                    (Ok(value), None) => {
                        committed(&value);
                        Ok(value)
                    }
                    (Ok(_), Some(err)) => Err(StoreError::from(copy_of(err))),
                    (Err(err), _) => Err(StoreError::from(err)),
                };
                // The caller may have stopped waiting: the row is the batch's either way.
                let _ = answer.send(result);
            })
        });
        let start = {
            let mut queue = crate::sync::lock(&self.queue);
            queue.jobs.push_back(job);
            !std::mem::replace(&mut queue.committing, true)
        };
        if start {
            let (group, writer) = (Arc::clone(self), Arc::clone(writer));
            tokio::task::spawn_blocking(move || group.commit_queued(&writer));
        }
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::Inconsistent(
                "the group commit ended without answering".to_owned(),
            ))
        })
    }

    /// The committer: commits batches of queued jobs on `writer` until the queue is empty
    /// (blocking).
    fn commit_queued(&self, writer: &Mutex<Connection>) {
        loop {
            // The writer first, then the queue: the jobs that arrived while the writer was busy
            // join this batch.
            let mut conn = crate::sync::lock(writer);
            let batch: Vec<Job> = {
                let mut queue = crate::sync::lock(&self.queue);
                if queue.jobs.is_empty() {
                    queue.committing = false;
                    return;
                }
                let n = queue.jobs.len().min(self.most);
                queue.jobs.drain(..n).collect()
            };
            let delivers: Vec<Deliver>;
            let commit = match conn.transaction() {
                Ok(mut tx) => {
                    delivers = batch.into_iter().map(|job| job(Ok(&mut tx))).collect();
                    let commit = tx.commit().err();
                    if commit.is_none() {
                        // Relaxed: a count, publishing nothing else.
                        self.commits.fetch_add(1, Ordering::Relaxed);
                    }
                    commit
                }
                Err(err) => {
                    delivers = batch.into_iter().map(|job| job(Err(&err))).collect();
                    Some(err)
                }
            };
            drop(conn);
            for deliver in delivers {
                deliver(commit.as_ref());
            }
        }
    }
}

// The tests hold the writer across awaits on purpose: the jobs queue behind it as they would
// behind a commit on its way to disk.
#[cfg(test)]
#[allow(clippy::await_holding_lock)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A writer connection on a file of one table, and its group commit.
    #[derive(Clone)]
    struct Store {
        group: Arc<GroupCommit>,
        writer: Arc<Mutex<Connection>>,
    }

    impl Store {
        fn writer(&self) -> std::sync::MutexGuard<'_, Connection> {
            crate::sync::lock(&self.writer)
        }

        async fn write_grouped<T: Send + 'static>(
            &self,
            f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
            committed: impl FnOnce(&T) + Send + 'static,
        ) -> Result<T, StoreError> {
            self.group.write(&self.writer, f, committed).await
        }

        fn rows(&self) -> i64 {
            self.writer()
                .query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
                .unwrap()
        }
    }

    fn store(most: usize) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join("t.sqlite3")).unwrap();
        conn.execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (k TEXT UNIQUE)")
            .unwrap();
        let store = Store {
            group: Arc::new(GroupCommit::new(most)),
            writer: Arc::new(Mutex::new(conn)),
        };
        (dir, store)
    }

    fn commits(store: &Store) -> u64 {
        store.group.commits()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_conflict_in_a_batch_fails_only_its_own_job() {
        let (_dir, store) = store(64);
        // Hold the writer so every job queues behind it and they commit as one batch.
        let held = store.writer();
        let mut calls = Vec::new();
        for key in ["a", "b", "a", "c"] {
            let store = store.clone();
            calls.push(tokio::spawn(async move {
                store
                    .write_grouped(
                        move |conn| conn.execute("INSERT INTO t (k) VALUES (?1)", [key]),
                        |_| {},
                    )
                    .await
            }));
        }
        while crate::sync::lock(&store.group.queue).jobs.len() < 4 {
            tokio::task::yield_now().await;
        }
        drop(held);
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.unwrap());
        }
        let duplicates = answers
            .iter()
            .filter(|a| {
                a.as_ref()
                    .is_err_and(super::super::error::is_unique_violation)
            })
            .count();
        assert_eq!(duplicates, 1, "{answers:?}");
        assert_eq!(answers.iter().filter(|a| a.is_ok()).count(), 3);
        assert_eq!(commits(&store), 1, "the four were one batch");
        assert_eq!(store.rows(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_queued_together_commit_in_one_transaction_up_to_the_bound() {
        for (most, expected) in [(64, 1), (1, 8), (3, 3)] {
            let (_dir, store) = store(most);
            let before = commits(&store);
            let held = store.writer();
            let ran = Arc::new(AtomicUsize::new(0));
            let mut calls = Vec::new();
            for n in 0..8 {
                let (store, ran) = (store.clone(), Arc::clone(&ran));
                calls.push(tokio::spawn(async move {
                    store
                        .write_grouped(
                            move |conn| conn.execute("INSERT INTO t (k) VALUES (?1)", [n]),
                            move |_| {
                                ran.fetch_add(1, Ordering::Relaxed);
                            },
                        )
                        .await
                }));
            }
            // Every job queued before the writer is free: they wait as one queue.
            while crate::sync::lock(&store.group.queue).jobs.len() < 8 {
                tokio::task::yield_now().await;
            }
            drop(held);
            for call in calls {
                call.await.unwrap().unwrap();
            }
            assert_eq!(ran.load(Ordering::Relaxed), 8, "each commit hook ran once");
            assert_eq!(
                commits(&store) - before,
                expected,
                "8 jobs with a bound of {most}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_that_stops_waiting_still_has_its_row_committed_with_the_batch() {
        let (_dir, store) = store(64);
        let held = store.writer();
        let call = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .write_grouped(
                        |conn| conn.execute("INSERT INTO t (k) VALUES ('gone')", []),
                        |_| {},
                    )
                    .await
            })
        };
        while crate::sync::lock(&store.group.queue).jobs.is_empty() {
            tokio::task::yield_now().await;
        }
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        drop(held);
        // A later job commits after the abandoned one: once it is answered, both are on disk.
        store
            .write_grouped(
                |conn| conn.execute("INSERT INTO t (k) VALUES ('after')", []),
                |_| {},
            )
            .await
            .unwrap();
        assert_eq!(store.rows(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_job_fails_alone_and_the_committer_goes_on() {
        let (_dir, store) = store(64);
        let err = store
            .write_grouped(|_| -> rusqlite::Result<()> { panic!("a bug") }, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        store
            .write_grouped(
                |conn| conn.execute("INSERT INTO t (k) VALUES ('next')", []),
                |_| {},
            )
            .await
            .unwrap();
    }
}
