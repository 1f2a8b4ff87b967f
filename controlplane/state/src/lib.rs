//! Keel's replicated state: the domain model, the job spec, commands and
//! events, and the deterministic state machine [`ClusterState::apply`] with
//! its invariants, hash and encoding. Scheduling (policies, placement,
//! performance models) is `keel-scheduling`; the simulators are
//! `keel-sim`. Both read this crate; it knows neither.
//!
//! Invariants of this crate, stated as absences:
//! - no I/O, no clock, no threads, no async: time arrives in each entry;
//! - no randomness but seeded generators ([`rng`]);
//! - no hash-ordered iteration: every map is a `BTreeMap`;
//! - `apply` knows no policy names and fits no model: which policies exist
//!   is the API's and the leader's check, and the progress history it
//!   records ([`perf_history`]) is fitted by the scheduler, so a log
//!   replays the same in every version;
//! - no dependency on tokio, tonic, openraft, sled or kube, nor on
//!   `keel-scheduling` or `keel-sim` (a tidy test checks this).

pub mod acl;
pub mod codec;
pub mod command;
pub mod event;
pub mod fixtures;
pub mod free_gpus;
pub mod liveness;
pub mod log_time;
pub mod model;
pub mod perf_history;
pub mod policy_memory;
pub mod proto_form;
pub mod queue;
pub mod quota;
pub mod requests;
pub mod resources;
pub mod rng;
pub mod secret;
pub mod spec;
pub mod state;

pub use command::{Command, JobOutcome, JobPlacement, LogEntry, Proposal};
pub use event::Event;
pub use model::{
    Allocation, FailedGpu, GoneGpu, Gpu, GpuHolders, GpuRef, Job, JobId, JobState, Node, NodeState,
    ProgressSample, Worker, WorkerState,
};
pub use policy_memory::PolicyMemory;
pub use spec::{JobSpec, SpecError};
pub use state::{ApplyError, ClusterState, StateHash};
