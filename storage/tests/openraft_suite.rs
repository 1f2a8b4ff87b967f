//! openraft's own storage test suite, run against the WAL log store and the
//! sled state machine, on real files in a temporary directory.

use keel_storage::{LogStore, StateMachineStore, StorageError, TypeConfig};
use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = TempDir::new().map_err(|e| {
            StorageError::from_io_error(
                openraft::ErrorSubject::Store,
                openraft::ErrorVerb::Write,
                e,
            )
        })?;
        let log = LogStore::open(&dir.path().join("raft-log")).map_err(|e| {
            StorageError::from_io_error(openraft::ErrorSubject::Logs, openraft::ErrorVerb::Write, e)
        })?;
        let sm = StateMachineStore::open(&dir.path().join("state")).map_err(|e| {
            e.into_raft(
                openraft::ErrorSubject::StateMachine,
                openraft::ErrorVerb::Read,
            )
        })?;
        Ok((dir, log, sm))
    }
}

#[test]
fn passes_openraft_storage_suite() {
    if let Err(e) = Suite::test_all(Builder) {
        panic!("openraft storage suite failed: {e}");
    }
}
