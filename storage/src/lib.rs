//! Keel's storage.
//!
//! - [`LogStore`]: the Raft log and vote, in a write-ahead log (`raft-log`)
//!   that calls `fdatasync` before openraft is told an entry is flushed.
//!   Records are checksummed; a torn final record is detected and truncated
//!   on open, never replayed.
//! - [`StateMachineStore`]: `ClusterState` in memory, with its durable parts
//!   on sled: the append-only journal (every applied entry and what it did),
//!   the last applied log id and membership, and snapshots. The journal is
//!   never purged by log compaction, so history can always be replayed.
//! - [`raft_wire`]: Raft's records and messages in protobuf, and the
//!   versioned encoding of the Raft service's payloads.
//! - [`replay`]: rebuilds the state offline from a data directory's journal.
//! - [`KeelRuntime`]: the async runtime openraft runs on (Tokio, with election
//!   timeouts drawn from a generator a simulation can seed).
//!
//! Layout of a data directory:
//!
//! ```text
//! DATA_DIR/
//!   LOCK          held (flock) by the one process using the directory
//!   raft-log/     WAL chunks: log entries, vote, committed id
//!   state/        sled: journal, applied state, snapshots
//! ```

pub mod audit;
mod data_dir;
mod error;
mod journal;
mod journal_writer;
mod latency;
mod log_store;
pub mod raft_wire;
mod recovery;
mod replay;
mod runtime;
mod state_machine;
pub mod trace_context;

use std::io::Cursor;

use keel_state::{ApplyError, Event};
use openraft::BasicNode;
use serde::{Deserialize, Serialize};

pub use data_dir::{DataDir, DataDirError};
pub use error::StoreError;
pub use journal::Visitor;

/// The snapshot's encoding (format 8, protobuf; 7 and 6, postcard, still
/// read), for the golden-bytes tests, tools that read snapshot files, and a
/// leader sending a snapshot to a replica of the release before.
pub mod snapshot_codec {
    pub use crate::state_machine::{
        decode_snapshot, decode_snapshot_up_to, encode_snapshot, encode_snapshot_as,
        snapshot_format_for_wire,
    };
}
pub use latency::{Latency, LatencyReading, SnapshotLatency};
pub use log_store::LogStore;

/// The state store's values for Raft's own records (last applied log id,
/// membership, snapshot meta): format 2, protobuf behind a format byte;
/// format 1, JSON, still read.
pub mod meta_codec {
    pub use crate::state_machine::meta_codec::{
        decode_last_applied, decode_membership, decode_snapshot_meta, encode_last_applied,
        encode_membership, encode_snapshot_meta,
    };
}

/// A journal page (`apply` writes one per batch), for the golden-bytes
/// tests and tools that read the journal.
pub mod journal_codec {
    pub use crate::journal::{decode_page_entries, encode_page};
}

/// A WAL record's payload (blank, proposal, membership), for the
/// golden-bytes tests and tools that read WAL records.
pub mod wal_codec {
    pub use crate::log_store::{decode_payload, encode_payload};
}
pub use recovery::{force_single_voter, found_from_snapshot, ForcedMembership, RecoveryError};
pub use replay::{
    for_each_entry, replay, replay_data_dir, replay_data_dir_checked, replay_until,
    replay_until_checked, replay_until_visiting, state_before_journal, JournalHistory, ReplayError,
    ReplaySummary, Until,
};
pub use runtime::{seed_thread_rng, KeelRuntime, RaftRng};
pub use state_machine::{Applied, JournalCursor, RemovedMembers, SharedState, StateMachineStore};

/// The result of applying one Raft entry: the outcome of each command in its
/// proposal, in order (empty for Raft's own entries).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplyResponse {
    pub index: u64,
    pub outcomes: Vec<Result<Vec<Event>, ApplyError>>,
}

openraft::declare_raft_types!(
    /// Keel's Raft types: entries carry a `keel_state::Proposal`.
    pub TypeConfig:
        D = keel_state::Proposal,
        R = ApplyResponse,
        NodeId = u64,
        Node = BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = crate::KeelRuntime,
);

/// A Raft log id, as openraft names it for this type config.
pub type LogId = openraft::LogId<u64>;
/// A Raft entry for this type config.
pub type Entry = openraft::Entry<TypeConfig>;
/// A storage error, as openraft wants it.
pub type StorageError = openraft::StorageError<u64>;
