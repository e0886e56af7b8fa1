//! Storage quotas: how many files and bytes the stream and sealed-payload stores may hold,
//! globally and per client, and how many pending grants the grant store may hold.
//!
//! They use the same reservation primitive as admission: bytes are reserved before a write (from
//! a declared size), settled to the real size after it, and released on delete or expiry.

use std::sync::atomic::{AtomicBool, Ordering};

use super::caps::{Store, StoreCaps};
use super::client::{ClientState, Settings};
use super::refusal::Refusal;
use crate::clock::duration_nanos;
use crate::config::Identity;
use crate::sync::Arc;

/// Takes `files` and `bytes` in the client's gauges then the global ones, all or nothing.
fn acquire(client: &ClientState, store: Store, files: u64, bytes: u64, caps: &StoreCaps) -> bool {
    let mine = &client.storage[store as usize];
    let all = &client.shared.storage[store as usize];
    if !mine.files.try_acquire(files, caps.client_files) {
        return false;
    }
    if !mine.bytes.try_acquire(bytes, caps.client_bytes) {
        mine.files.release(files);
        return false;
    }
    if !all.files.try_acquire(files, caps.global_files) {
        mine.bytes.release(bytes);
        mine.files.release(files);
        return false;
    }
    if !all.bytes.try_acquire(bytes, caps.global_bytes) {
        all.files.release(files);
        mine.bytes.release(bytes);
        mine.files.release(files);
        return false;
    }
    true
}

fn release(client: &ClientState, store: Store, files: u64, bytes: u64) {
    let mine = &client.storage[store as usize];
    let all = &client.shared.storage[store as usize];
    all.bytes.release(bytes);
    all.files.release(files);
    mine.bytes.release(bytes);
    mine.files.release(files);
}

/// The store's refusal, counted in the client's metrics.
fn refusal(client: &ClientState, store: Store, settings: &Settings) -> Refusal {
    // Storage codes are never ClientUnconfigured, so index - 1 is valid.
    client.rejected.bump(store.refusal_code().index() - 1);
    Refusal::after_nanos(
        store.refusal_code(),
        duration_nanos(settings.capacity_retry),
    )
}

/// Room reserved in a store before a write. Settle it to the real size once written; dropping it
/// (the write failed) releases everything.
#[must_use = "a reservation holds room until it is settled or dropped"]
pub struct StorageReservation {
    client: Arc<ClientState>,
    store: Store,
    bytes: u64,
    armed: bool,
}

impl StorageReservation {
    pub(crate) fn reserve(
        client: Arc<ClientState>,
        store: Store,
        bytes: u64,
        settings: &Settings,
    ) -> Result<StorageReservation, Refusal> {
        if acquire(&client, store, 1, bytes, settings.caps.of(store)) {
            Ok(StorageReservation {
                client,
                store,
                bytes,
                armed: true,
            })
        } else {
            Err(refusal(&client, store, settings))
        }
    }

    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The room fits this process's counts but not the store's as a whole (a store several
    /// processes write, which counts their objects too): releases everything and returns the
    /// store's refusal, counted as any of this store's refusals is.
    pub fn refuse(self) -> Refusal {
        let settings = self.client.shared.settings.load();
        refusal(&self.client, self.store, &settings)
        // Dropping `self` releases the reservation.
    }

    /// The write is done and took `real_bytes`: keep exactly that. Shrinking always succeeds;
    /// growing past the reservation must fit under the caps, else everything is released and the
    /// store's refusal returned.
    pub fn settle(mut self, real_bytes: u64) -> Result<StoredObject, Refusal> {
        let client = Arc::clone(&self.client);
        let store = self.store;
        if real_bytes <= self.bytes {
            release(&client, store, 0, self.bytes - real_bytes);
        } else {
            let settings = client.shared.settings.load();
            if !acquire(
                &client,
                store,
                0,
                real_bytes - self.bytes,
                settings.caps.of(store),
            ) {
                return Err(refusal(&client, store, &settings)); // Drop releases the reservation.
            }
        }
        self.armed = false;
        Ok(StoredObject {
            client,
            store,
            bytes: real_bytes,
            released: AtomicBool::new(false),
        })
    }
}

impl Drop for StorageReservation {
    fn drop(&mut self) {
        if self.armed {
            release(&self.client, self.store, 1, self.bytes);
        }
    }
}

impl std::fmt::Debug for StorageReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageReservation")
            .field("identity", &self.client.identity)
            .field("store", &self.store)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// An object held in a store. [`StoredObject::release`] (on delete or expiry) or dropping it
/// gives its file and bytes back, exactly once.
pub struct StoredObject {
    client: Arc<ClientState>,
    store: Store,
    bytes: u64,
    released: AtomicBool,
}

impl StoredObject {
    pub(crate) fn restore(client: Arc<ClientState>, store: Store, bytes: u64) -> StoredObject {
        client.storage[store as usize].files.force_acquire(1);
        client.storage[store as usize].bytes.force_acquire(bytes);
        client.shared.storage[store as usize].files.force_acquire(1);
        client.shared.storage[store as usize]
            .bytes
            .force_acquire(bytes);
        StoredObject {
            client,
            store,
            bytes,
            released: AtomicBool::new(false),
        }
    }

    /// The object's size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The owning client.
    pub fn identity(&self) -> &Identity {
        &self.client.identity
    }

    /// The object was deleted or expired. Returns whether this call released it.
    pub fn release(&self) -> bool {
        // Relaxed: the swap alone decides the one releaser; the counts carry no other data.
        let first = !self.released.swap(true, Ordering::Relaxed);
        if first {
            release(&self.client, self.store, 1, self.bytes);
        }
        first
    }
}

impl Drop for StoredObject {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for StoredObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredObject")
            .field("identity", &self.client.identity)
            .field("store", &self.store)
            .field("bytes", &self.bytes)
            .finish()
    }
}
