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
pub const ENTRY_FORMAT_VERSION: u32 = 1;
