//! Deterministic simulation of the Raft layer (`keel-dst`).
//!
//! A cluster of 3 or 5 replicas runs in one thread on a Tokio runtime whose
//! clock is virtual (paused: time jumps to the next timer whenever every
//! task waits), so a minute of cluster time takes a fraction of a second.
//! Each replica is openraft with the configuration every Keel server runs
//! with (`RaftSettings::openraft_config`), Keel's state machine store
//! (`ClusterState` and its journal on sled), and, in place of the disk and
//! the network, a simulated log ([`log_store`]) and network ([`net`]).
//! Everything that varies comes from the seed: message delays and losses,
//! disk latency, the clients' operations, the faults, and openraft's
//! election timeouts (`keel_storage::seed_thread_rng`). The same seed
//! replays the same run: its trace digest is the same.
//!
//! A run ([`run_seed`]): the cluster starts, registers two GPU nodes, and
//! clients submit, place (`DecideAllocation` on the state they read, so
//! stale plans race), finish and cancel jobs against whichever replica
//! they believe leads; every replica runs the scheduler's pure engine
//! (`scheduler`: the heterogeneity-aware LAS in one-second rounds, its
//! memory in the log) and proposes its rounds while it leads, and the
//! reconcile engine (`reconciler`) over simulated machines; meanwhile a
//! seeded schedule crashes replicas (losing
//! what their disks had not flushed), isolates them, partitions the
//! cluster, cuts links one way, loses messages at random and slows disks.
//! Then everything heals and the checks run:
//!
//! - log matching: entries with the same log id are the same entry on
//!   every pair of replicas (after every heal and at the end). openraft's
//!   default mode, which Keel runs, lets two candidates win one term under
//!   different leader ids (term, node), and restores a restarted leader
//!   under its old id, so "one leader per term" is not its invariant; a
//!   log id used twice for different entries is what would break it;
//! - a write commits within the bound after the heal;
//! - every replica at the same applied index and state hash;
//! - every submission acknowledged is there exactly once, every one refused
//!   (not the leader) is absent, and none is there twice;
//! - each replica's journal, replayed offline, gives the same hash, with
//!   `ClusterState`'s invariants (no GPU held by two jobs outside a
//!   declared pair, ...) holding after every entry;
//! - every scheduling decision that carries a policy memory, planned again
//!   from its journal's state at its `based_on` index, is the logged entry
//!   (a scheduler that kept memory outside the log fails this in every
//!   seed);
//! - no replica launches or stops a worker after another replica took the
//!   workers over (the `stale_leader` fault pauses a leader's reconcile
//!   loop between deciding and acting; loops that skip the quorum's
//!   confirmation fail this).
//!
//! What it does not model: bytes on a real disk (the chaos suite's real
//! replicas and `kill -9` cover the WAL and sled), a whole process's
//! SIGSTOP (only the reconcile loop's pause). Each replica has its own
//! skewed, drifting wall clock and stamps entries with its log clock
//! ([`clocks`]), so failovers between clocks that disagree are simulated
//! too.

pub mod clocks;
mod leadership;
pub mod log_store;
pub mod net;
mod reconciler;
pub mod replica;
mod run;
mod scheduler;

pub use run::{run_seed, DstConfig, DstReport, Fault};

/// Why a simulation could not run (a finding is a failed check in the
/// report, not an error).
#[derive(Debug, thiserror::Error)]
pub enum DstError {
    #[error("storage: {0}")]
    Storage(#[from] keel_storage::StoreError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("setup: {0}")]
    Setup(String),
}
