//! Keel's scheduling: what the leader decides from the replicated state.
//!
//! - [`engine`]: the scheduling loop's decisions (when a round runs, which
//!   policy, what it proposes) as a pure engine its async driver performs;
//! - [`policy`]: the `Policy` trait and one file per policy (queue,
//!   elastic, Optimus, and the heterogeneity-aware ones run round by
//!   round), all `&` functions of a state view and the time;
//! - [`placement`]: gang placement on the state's free-GPU index;
//! - [`topology`]: sizes to GPUs with the fewest moves;
//! - [`perf`]: Optimus's performance models, fitted on the progress history
//!   the state records;
//! - [`gavel`]: Gavel's fractional allocations over GPU types (LPs) and its
//!   round mechanism;
//! - [`throughput`]: the project's throughput table.
//!
//! Invariants, stated as absences: no I/O, no clock (time is an input), no
//! randomness but seeded generators, no hash-ordered iteration, no
//! dependency on a runtime, network, Raft or storage crate, nor on
//! `keel-sim` (a tidy test checks this). It reads `keel-state`; nothing
//! in `keel-state` reads it.

pub mod admission;
pub mod engine;
pub mod gavel;
pub mod perf;
pub mod placement;
pub mod policy;
pub mod throughput;
pub mod topology;
