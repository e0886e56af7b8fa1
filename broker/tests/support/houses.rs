//! A store of each house for the store conformance tests (`store_conformance*.rs`): what the
//! broker asks of its store, written once and run against SQLite on a temporary data dir and a
//! real PostgreSQL (one server shared by a binary's tests, a database of its own per test).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::postgres::PostgresServer;
use unyolo_admission_broker::store::{
    self, DurableStore, EventPage, OperationRecord, Presentation, StoreLocation, StoredEvent,
    now_rfc3339,
};

/// Writes `mod sqlite` and `mod postgres`, each with one test per name that runs the async
/// function of that name against its house.
#[macro_export]
macro_rules! store_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Postgres).await
                }
            )*
        }
    };
}

/// Which house a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
}

/// The operation whose changes are requests (they need an approval) in every test.
pub const REQUEST: &str = "demo.request";

/// A store of one house, and a way to write rows behind its back.
pub struct House {
    pub store: Arc<dyn DurableStore>,
    pub raw: Raw,
    _dir: tempfile::TempDir,
}

pub enum Raw {
    Sqlite(PathBuf),
    Postgres {
        server: Arc<PostgresServer>,
        database: String,
    },
}

impl House {
    /// A fresh store of `kind` named for `test`, or `None` (having said why) when PostgreSQL
    /// cannot be run here.
    pub async fn open(kind: Kind, test: &str) -> Option<House> {
        let dir = tempfile::tempdir().unwrap();
        match kind {
            Kind::Sqlite => {
                let location = StoreLocation::Dir(dir.path().to_owned());
                let store = store::open(&location, "admission", [REQUEST], dir.path())
                    .await
                    .unwrap();
                Some(House {
                    store,
                    raw: Raw::Sqlite(dir.path().join(store::DATABASE_FILE)),
                    _dir: dir,
                })
            }
            Kind::Postgres => {
                let server = PostgresServer::shared()?;
                let url = server.database(test);
                let location = StoreLocation::parse(&url).unwrap();
                let store = store::open(&location, "admission", [REQUEST], dir.path())
                    .await
                    .unwrap();
                Some(House {
                    store,
                    raw: Raw::Postgres {
                        server,
                        database: test.to_owned(),
                    },
                    _dir: dir,
                })
            }
        }
    }

    /// The store's write lock, held from another connection until released: writes queue.
    pub fn lock(&self) -> super::faults::StoreLock {
        match &self.raw {
            Raw::Sqlite(path) => super::faults::StoreLock::take_file(path),
            Raw::Postgres { server, database } => {
                super::faults::StoreLock::take_postgres(&server.url(database))
            }
        }
    }

    /// Runs `sql` on the store's database behind its back.
    pub fn execute(&self, sql: &str) {
        match &self.raw {
            Raw::Sqlite(path) => rusqlite::Connection::open(path)
                .unwrap()
                .execute_batch(sql)
                .unwrap(),
            Raw::Postgres { server, database } => {
                server.psql(database, sql);
            }
        }
    }
}

/// Opens the house for this test or returns from it.
#[macro_export]
macro_rules! house {
    ($kind:expr, $name:literal) => {
        match $crate::support::houses::House::open($kind, $name).await {
            Some(house) => house,
            None => return,
        }
    };
}

pub fn record(id: &str, key: &str) -> OperationRecord {
    let now = now_rfc3339();
    OperationRecord {
        client_id: "bot-7".to_owned(),
        idempotency_key: key.to_owned(),
        operation: "demo.run".to_owned(),
        created_at: now.clone(),
        updated_at: now,
        presentation: Presentation {
            title: format!("Run {id}"),
            summary: None,
        },
        ..OperationRecord::example(id)
    }
}

pub fn request(i: usize, operation: &str) -> OperationRecord {
    OperationRecord {
        operation: operation.to_owned(),
        reason: "r".to_owned(),
        presentation: Presentation {
            title: format!("Request {i}"),
            summary: None,
        },
        ..record(&request_id(i), &format!("k{i}"))
    }
}

pub fn request_id(i: usize) -> String {
    format!("op_{i:032}")
}

pub fn events_of(page: EventPage) -> Vec<StoredEvent> {
    match page {
        EventPage::Events { events, .. } => events,
        EventPage::Expired => panic!("expired"),
    }
}

/// Waits (at most 5 s) until every event written is in the log. SQLite's are at once;
/// PostgreSQL numbers an event once no transaction older than its writer is open on the server
/// (other tests' included), so its log catches up a moment later.
pub async fn settle(db: &Arc<dyn DurableStore>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let written = db.count_events().await.unwrap();
        let numbered = match db.events_after(None, 100_000).await.unwrap() {
            EventPage::Events { events, .. } => events.len() as u64,
            EventPage::Expired => 0,
        };
        if numbered == written {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{numbered} of {written} events numbered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (at most 5 s) until the bell has published `seq`.
pub async fn rung(db: &Arc<dyn DurableStore>, seq: i64) {
    let mut bell = db.event_bell().subscribe();
    let waited = tokio::time::timeout(Duration::from_secs(5), bell.wait_for(|n| *n >= seq)).await;
    assert!(waited.is_ok(), "the bell never rang {seq}");
}
