//! The data dir's lock: one broker owns a data dir, whichever store keeps its operations (its
//! stream bodies, generated secrets and membership id live there). Held while any handle on the
//! store lives; closing the file unlocks it, a crash included.

use std::path::Path;

use super::error::StoreError;

/// The lock file's name inside the data dir: locked exclusively by the broker that owns the dir.
pub const LOCK_FILE: &str = "admission.lock";

/// Takes the exclusive lock on `dir`'s [`LOCK_FILE`] (creating the dir if needed), or says which
/// dir is in use.
pub(crate) fn lock_data_dir(dir: &Path) -> Result<std::fs::File, StoreError> {
    std::fs::create_dir_all(dir).map_err(|e| StoreError::io("create", dir, e))?;
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StoreError::io("open", &path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::DirInUse {
            dir: dir.to_owned(),
            lock: path,
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::io("lock", &path, e)),
    }
}
