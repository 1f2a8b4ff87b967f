//! Keel's protobuf types.
//!
//! - [`entry`]: the replicated log entries (`LogEntry`, commands) and the
//!   events applying them yields. Always available; depends on prost only.
//! - [`api`]: the gRPC client API (tonic services), behind the `grpc` feature.
//! - [`raft`]: Raft between replicas, behind the `grpc` feature.

#![allow(missing_debug_implementations, clippy::all)]

/// Log entries and events (`keel.entry.v1`).
pub mod entry {
    include!(concat!(env!("OUT_DIR"), "/keel.entry.v1.rs"));
}

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

/// The highest log-entry format version this build reads and writes.
///
/// - 1: the first format.
/// - 2: `JobPlacement.share_with` (space sharing). Only an entry that uses
///   it is written as 2, so a build that reads version 1 only refuses
///   exactly the entries it would misread (an unknown protobuf field would
///   otherwise be dropped silently) and reads every other.
pub const ENTRY_FORMAT_VERSION: u32 = 2;

/// The version of an entry that uses nothing newer than the first format.
pub const ENTRY_FORMAT_VERSION_FIRST: u32 = 1;
