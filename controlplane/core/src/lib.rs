//! Keel's pure core: the domain model, commands and events, and the
//! deterministic state machine [`ClusterState::apply`], the scheduling
//! policies and placement, and the throughput table.
//!
//! Invariants of this crate, stated as absences:
//! - no I/O, no clock, no threads, no async: time arrives in each entry;
//! - no randomness (a future simulator takes an explicit seed);
//! - no hash-ordered iteration: every map is a `BTreeMap`;
//! - no dependency on tokio, tonic, openraft, sled or kube (a tidy test
//!   checks this).

pub mod codec;
pub mod command;
pub mod event;
pub mod fixtures;
pub mod gavel;
pub mod liveness;
pub mod model;
pub mod perf;
pub mod placement;
pub mod policy;
pub mod requests;
pub mod rng;
pub mod sim;
pub mod spec;
pub mod state;
pub mod throughput;
pub mod topology;

pub use command::{Command, JobOutcome, JobPlacement, LogEntry, Proposal};
pub use event::Event;
pub use model::{
    Allocation, Gpu, GpuHolders, GpuRef, Job, JobId, JobState, Node, NodeState, ProgressSample,
    Worker, WorkerState,
};
pub use spec::{JobSpec, SpecError};
pub use state::{ApplyError, ClusterState, StateHash};
