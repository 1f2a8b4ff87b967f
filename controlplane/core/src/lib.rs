//! Keel's pure core: the domain model, commands and events, and the
//! deterministic state machine [`ClusterState::apply`], the scheduling
//! policies and placement, and the throughput table. The simulators that
//! drive them on a virtual clock are the `keel-sim` crate.
//!
//! Invariants of this crate, stated as absences:
//! - no I/O, no clock, no threads, no async: time arrives in each entry;
//! - no randomness but seeded generators ([`rng`]);
//! - no hash-ordered iteration: every map is a `BTreeMap`;
//! - `apply` knows no policy names: which policies exist is the API's and
//!   the leader's check, so a log replays the same in every version;
//! - no dependency on tokio, tonic, openraft, sled or kube, nor on
//!   `keel-sim` (a tidy test checks this).

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
