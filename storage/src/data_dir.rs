//! A data directory, locked for the one process that uses it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("cannot create data directory {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("data directory {path} is in use by another keel process (lock file {lock} is held)")]
    InUse { path: PathBuf, lock: PathBuf },
    #[error("cannot lock data directory {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A locked data directory. The lock is released when this is dropped (or
/// the process dies: it is an `flock`, so the kernel drops it).
#[derive(Debug)]
pub struct DataDir {
    root: PathBuf,
    _lock: File,
}

impl DataDir {
    /// Creates the directory if needed and takes its lock, failing at once
    /// if another process holds it.
    pub fn open(root: impl AsRef<Path>) -> Result<DataDir, DataDirError> {
        let root = root.as_ref().to_path_buf();
        std::fs::create_dir_all(&root).map_err(|source| DataDirError::Create {
            path: root.clone(),
            source,
        })?;
        let lock_path = root.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| DataDirError::Lock {
                path: root.clone(),
                source,
            })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(DataDirError::InUse {
                    path: root,
                    lock: lock_path,
                })
            }
            Err(std::fs::TryLockError::Error(source)) => {
                return Err(DataDirError::Lock { path: root, source })
            }
        }
        Ok(DataDir { root, _lock: lock })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn raft_log_dir(&self) -> PathBuf {
        self.root.join("raft-log")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root.join("state")
    }
}
