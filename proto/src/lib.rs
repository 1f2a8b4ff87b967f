//! Keel's protobuf types.
//!
//! - [`entry`]: the replicated log entries (`LogEntry`, commands) and the
//!   events applying them yields. Always available; depends on prost only.
//! - [`replication`]: Raft's records and messages (log ids, votes,
//!   membership, requests and replies). Always available.
//! - [`api`]: the gRPC client API (tonic services), behind the `grpc` feature.
//! - [`raft`]: Raft between replicas, behind the `grpc` feature.

#![allow(missing_debug_implementations, clippy::all)]

/// Log entries and events (`keel.entry.v1`).
pub mod entry {
    include!(concat!(env!("OUT_DIR"), "/keel.entry.v1.rs"));
}

/// Raft's own records (`keel.replication.v1`): log ids, votes,
/// membership, entries, and the Raft service's requests and replies.
pub mod replication {
    include!(concat!(env!("OUT_DIR"), "/keel.replication.v1.rs"));
}

/// The API's codec: decode errors are `INVALID_ARGUMENT`.
#[cfg(feature = "grpc")]
pub mod grpc_codec;

/// The client API (`keel.api.v1`).
#[cfg(feature = "grpc")]
pub mod api {
    include!(concat!(env!("OUT_DIR"), "/api/keel.api.v1.rs"));
}

/// Raft between replicas (`keel.raft.v1`).
#[cfg(feature = "grpc")]
pub mod raft {
    include!(concat!(env!("OUT_DIR"), "/raft/keel.raft.v1.rs"));
}

/// The log-entry format versions, each named by what it added. The newest
/// one a build reads and writes is `keel_state::codec::ENTRY_FORMAT_VERSION`,
/// the newest `#[proto(since = N)]` on its commands and their fields; a
/// version added after 10 is named there, on the field, not here.
///
/// - 1: the first format.
/// - 2: `JobPlacement.share_with` (space sharing). Only an entry that uses
///   it is written as 2, so a build that reads version 1 only refuses
///   exactly the entries it would misread (an unknown protobuf field would
///   otherwise be dropped silently) and reads every other.
/// - 3: `LogEntry.request_id` (exactly-once client writes). A build that
///   ignored it would apply a client's retry twice where others do not.
/// - 4: `DecideAllocation.memory` (a policy's memory in the log). A build
///   that ignored it would keep an older memory than the other replicas
///   and plan differently after a failover.
/// - 5: `LogEntry.actor` (who asked, issue 22). A build that ignored it
///   would keep no submitter on the job, and hash to another state.
/// - 6: `JobSpec.queue` (issue 23). A build that ignored it would put the
///   job in the default queue.
/// - 7: `JobSpec.not_preemptible` (issue 23, item 4). A build that ignored
///   it would let its policy preempt the job where the others refuse.
/// - 8: `CreateToken.queues` (issue 23, item 1). A build that ignored it
///   would let the token's holder submit to any queue.
/// - 9: `LogEntry.trace_parent` (issue 24, traces). A build that ignored it
///   would keep no trace on the job, and hash to another state.
/// - 10: secrets (issue 35): `PutSecret`, `DeleteSecret` and
///   `JobSpec.secret_env`. A build that ignored a spec's references would
///   launch the job without its credentials.
pub const ENTRY_FORMAT_VERSION_SECRETS: u32 = 10;

/// The version of an entry with a trace (and nothing of version 10).
pub const ENTRY_FORMAT_VERSION_TRACE: u32 = 9;

/// The version of a token limited to queues (and of no entry with a
/// trace).
pub const ENTRY_FORMAT_VERSION_TOKEN_QUEUES: u32 = 8;

/// The version of a submission that may not be preempted (and of nothing
/// of version 8).
pub const ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE: u32 = 7;

/// The version of an entry whose job names a queue (and is preemptible).
pub const ENTRY_FORMAT_VERSION_QUEUE: u32 = 6;

/// The version of an entry that carries an actor (and no job naming a
/// queue).
pub const ENTRY_FORMAT_VERSION_ACTOR: u32 = 5;

/// The version of an entry that carries a policy's memory (and no actor).
pub const ENTRY_FORMAT_VERSION_MEMORY: u32 = 4;

/// The version of an entry that carries a client's request id (and
/// nothing of version 4).
pub const ENTRY_FORMAT_VERSION_REQUEST_ID: u32 = 3;

/// The version of an entry that shares GPUs but carries no request id.
pub const ENTRY_FORMAT_VERSION_SHARES_GPUS: u32 = 2;

/// The version of an entry that uses nothing newer than the first format.
pub const ENTRY_FORMAT_VERSION_FIRST: u32 = 1;
