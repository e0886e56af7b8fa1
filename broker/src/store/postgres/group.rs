//! Group commit on PostgreSQL: the creations and state changes that reach the store together are
//! sent down one connection as one transaction, pipelined, so a burst pays one round trip and
//! one commit flush for many rows instead of one each (as `sqlite::group` does for SQLite).
//!
//! Each write is one statement (a creation: the row, its event and its notification; a state
//! change: the guarded update, its event and its notification), so it means the same alone or
//! among others. A call queues its statement and waits. At most [`COMMITTERS`] committers run
//! at once (tasks started by the writes that find fewer at work); each takes what is queued (up
//! to the batch's bound), sends `BEGIN`, every statement, then `COMMIT`, and answers each caller
//! with its own rows once the commit returned. The writes that arrive while a batch is on its
//! way form the next, so no write waits for company, only for a committer.
//!
//! A statement that fails aborts its transaction on the server: the batch commits nothing, and
//! each of its writes is then sent again alone (its own transaction), so only the failing one
//! answers its error. A key already taken is not a failure (`ON CONFLICT DO NOTHING`: no row
//! back is that request's `Duplicate`), nor is a state change that finds the row moved (no row
//! back). Only a `COMMIT` whose answer never came (the connection cut while it was on its way)
//! leaves the batch's outcome unknown: each of its writes answers `Unavailable`, as a single
//! statement cut the same way would. A caller that stops waiting changes nothing: its write is
//! its batch's, committed or not with it.
//!
//! A batch bound of 1 sends each write alone on a pooled connection (one transaction, one
//! commit flush each): the baseline the benchmarks compare against.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use deadpool_postgres::Pool;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::super::error::StoreError;
use super::error::{Failed, sort_pool};

/// The most committers (connections writing batches) at once: while one batch is on its way to
/// disk the next can be executing, and a write waiting for a row lock another session holds
/// (a decision, a takeover) holds up only its own batch.
pub(super) const COMMITTERS: usize = 4;

/// A statement parameter the write owns (it outlives its caller, who may stop waiting).
pub(super) type Param = Box<dyn ToSql + Send + Sync>;

/// One write: a single statement and its parameters.
pub(super) struct Write {
    pub(super) sql: &'static str,
    pub(super) params: Vec<Param>,
}

impl Write {
    /// The parameters as the driver takes them.
    pub(super) fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect()
    }
}

/// A queued write and where its answer goes.
struct Job {
    write: Write,
    answer: tokio::sync::oneshot::Sender<Result<Vec<Row>, Failed>>,
}

impl Job {
    fn answer(self, result: Result<Vec<Row>, Failed>) {
        // The caller may have stopped waiting: the write is the batch's either way.
        let _ = self.answer.send(result);
    }
}

/// The queue of writes and how many committers work on it.
pub(super) struct GroupCommit {
    pool: Pool,
    shown: Arc<str>,
    /// The most writes in one transaction (at least 1).
    most: usize,
    queue: Mutex<Queue>,
}

struct Queue {
    jobs: VecDeque<Job>,
    committers: usize,
}

/// A committer's place: given back under the queue's lock when it finds the queue empty (so a
/// write queued after that look starts another), or when it is dropped unfinished (a panic, the
/// runtime stopping).
struct Committing {
    group: Arc<GroupCommit>,
    counted: bool,
}

impl Drop for Committing {
    fn drop(&mut self) {
        if self.counted {
            crate::sync::lock(&self.group.queue).committers -= 1;
        }
    }
}

impl GroupCommit {
    pub(super) fn new(pool: Pool, shown: Arc<str>, most: usize) -> GroupCommit {
        GroupCommit {
            pool,
            shown,
            most: most.max(1),
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                committers: 0,
            }),
        }
    }

    /// Runs `write` in the next batch and answers once the batch is committed: its rows, its own
    /// error (the batch's other writes unaffected), or `Unavailable` if the commit's outcome is
    /// unknown.
    pub(super) async fn write(self: &Arc<Self>, write: Write) -> Result<Vec<Row>, Failed> {
        if self.most == 1 {
            return self.alone(&write).await;
        }
        let (answer, answered) = tokio::sync::oneshot::channel();
        let start = {
            let mut queue = crate::sync::lock(&self.queue);
            queue.jobs.push_back(Job { write, answer });
            let start = queue.committers < COMMITTERS;
            if start {
                queue.committers += 1;
            }
            start
        };
        if start {
            let mut committing = Committing {
                group: Arc::clone(self),
                counted: true,
            };
            tokio::spawn(async move {
                committing
                    .group
                    .clone()
                    .commit_queued(&mut committing)
                    .await
            });
        }
        answered.await.unwrap_or_else(|_| {
            Err(Failed::Store(StoreError::Inconsistent(
                "the group commit ended without answering".to_owned(),
            )))
        })
    }

    /// A committer: commits batches of queued writes until the queue is empty.
    async fn commit_queued(&self, committing: &mut Committing) {
        loop {
            let batch: Vec<Job> = {
                let mut queue = crate::sync::lock(&self.queue);
                if queue.jobs.is_empty() {
                    queue.committers -= 1;
                    committing.counted = false;
                    return;
                }
                let n = queue.jobs.len().min(self.most);
                queue.jobs.drain(..n).collect()
            };
            match batch.len() {
                // Alone: one statement is its own transaction, one round trip.
                1 => {
                    for job in batch {
                        let result = self.alone(&job.write).await;
                        job.answer(result);
                    }
                }
                _ => self.commit(batch).await,
            }
        }
    }

    /// One batch in one transaction (see the module docs).
    async fn commit(&self, batch: Vec<Job>) {
        let mut client = match self.pool.get().await {
            Ok(client) => client,
            Err(_) => return self.each_alone(batch).await,
        };
        let mut statements = Vec::with_capacity(batch.len());
        for job in &batch {
            // Prepared once per connection (cached): no round trip after the first.
            match client.prepare_cached(job.write.sql).await {
                Ok(statement) => statements.push(statement),
                Err(_) => return self.each_alone(batch).await,
            }
        }
        let Ok(tx) = client.transaction().await else {
            return self.each_alone(batch).await;
        };
        let params: Vec<_> = batch.iter().map(|job| job.write.refs()).collect();
        // Polled together, the statements are pipelined: sent at once, answered in order.
        let results = futures_util::future::join_all(
            statements
                .iter()
                .zip(&params)
                .map(|(statement, params)| tx.query(statement, params)),
        )
        .await;
        if results.iter().any(Result::is_err) {
            // The server aborted the transaction: nothing of it commits (dropping it rolls it
            // back). Each write again, alone, answers for itself.
            drop(tx);
            drop(client);
            return self.each_alone(batch).await;
        }
        match tx.commit().await {
            Ok(()) => {
                for (job, rows) in batch.into_iter().zip(results) {
                    job.answer(rows.map_err(Failed::Statement));
                }
            }
            // The server answered: it rolled the transaction back.
            Err(err) if err.code().is_some() => {
                drop(client);
                self.each_alone(batch).await;
            }
            // No answer: the batch may or may not have committed.
            Err(err) => {
                let detail = err.to_string();
                for job in batch {
                    job.answer(Err(Failed::Store(StoreError::Unavailable {
                        database: self.shown.to_string(),
                        source: format!(
                            "the connection was lost while a commit was on its way: {detail}"
                        )
                        .into(),
                    })));
                }
            }
        }
    }

    /// Each write of `batch` alone, at once.
    async fn each_alone(&self, batch: Vec<Job>) {
        futures_util::future::join_all(batch.into_iter().map(|job| async move {
            let result = self.alone(&job.write).await;
            job.answer(result);
        }))
        .await;
    }

    /// `write` alone on a pooled connection: one statement, its own transaction.
    async fn alone(&self, write: &Write) -> Result<Vec<Row>, Failed> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| Failed::Store(sort_pool(&self.shown, e)))?;
        let statement = client.prepare_cached(write.sql).await?;
        Ok(client.query(&statement, &write.refs()).await?)
    }
}
