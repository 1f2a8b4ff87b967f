//! The storage crate's own error type, and its conversion to openraft's.

use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageIOError};

use crate::StorageError;

/// What can go wrong in Keel's stores.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("WAL I/O failed: {0}")]
    Wal(#[from] std::io::Error),
    #[error("sled failed: {0}")]
    Sled(#[from] sled::Error),
    #[error("{what} is corrupt or from an unknown version: {message}")]
    Corrupt { what: String, message: String },
    /// Work handed to another thread that ended without an answer (the
    /// runtime shutting down).
    #[error("{what} did not finish: {message}")]
    Unfinished { what: String, message: String },
}

impl StoreError {
    pub(crate) fn corrupt(what: impl Into<String>, message: impl ToString) -> StoreError {
        StoreError::Corrupt {
            what: what.into(),
            message: message.to_string(),
        }
    }

    /// openraft's form of this error, for the storage traits.
    pub fn into_raft(self, subject: ErrorSubject<u64>, verb: ErrorVerb) -> StorageError {
        StorageIOError::new(subject, verb, AnyError::new(&self)).into()
    }
}
