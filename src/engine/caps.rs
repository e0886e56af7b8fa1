//! What the storage quotas are: the capped stores and their file and byte caps. Plain values,
//! below the per-client state that holds them in its settings and the reservations that obey them.

use super::refusal::RefusalCode;

const MIB: u64 = 1024 * 1024;

/// A store whose files and bytes are capped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Store {
    /// Uploaded streams.
    Stream = 0,
    /// Sealed payloads.
    SealedPayload = 1,
}

impl Store {
    /// Both stores.
    pub const ALL: [Store; 2] = [Store::Stream, Store::SealedPayload];

    /// The store's name in metrics: `stream` or `sealed_payload`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Store::Stream => "stream",
            Store::SealedPayload => "sealed_payload",
        }
    }

    /// The refusal code when this store is full.
    pub const fn refusal_code(self) -> RefusalCode {
        match self {
            Store::Stream => RefusalCode::StreamStorageLimit,
            Store::SealedPayload => RefusalCode::SealedPayloadStorageLimit,
        }
    }
}

/// File and byte caps of one store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreCaps {
    /// Files across all clients.
    pub global_files: u64,
    /// Bytes across all clients.
    pub global_bytes: u64,
    /// Files per client.
    pub client_files: u64,
    /// Bytes per client.
    pub client_bytes: u64,
}

/// The caps of every capped store. The defaults are the contract's; brokers may set others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageCaps {
    /// The stream store (default 64 files / 1 GiB globally, 16 files / 512 MiB per client).
    pub stream: StoreCaps,
    /// The sealed-payload store (default 256 files / 64 MiB globally, 64 files / 16 MiB per client).
    pub sealed_payload: StoreCaps,
    /// Pending grants across all clients (default 512).
    pub grant_global: u64,
    /// Pending grants per client (default 10); binds before a client's `pending` above it.
    pub grant_client: u64,
}

impl Default for StorageCaps {
    fn default() -> Self {
        StorageCaps {
            stream: StoreCaps {
                global_files: 64,
                global_bytes: 1024 * MIB,
                client_files: 16,
                client_bytes: 512 * MIB,
            },
            sealed_payload: StoreCaps {
                global_files: 256,
                global_bytes: 64 * MIB,
                client_files: 64,
                client_bytes: 16 * MIB,
            },
            grant_global: 512,
            grant_client: u64::from(crate::config::PENDING_GRANT_CLIENT_CAP),
        }
    }
}

impl StorageCaps {
    /// The caps of `store`.
    pub fn of(&self, store: Store) -> &StoreCaps {
        match store {
            Store::Stream => &self.stream,
            Store::SealedPayload => &self.sealed_payload,
        }
    }
}
