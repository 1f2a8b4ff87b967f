//! Executors: how Keel runs workers.
//!
//! - [`book`]: the worker book every executor keeps (generation fencing,
//!   exit records, the progress buffer, probes, the injected clock);
//! - [`contract`]: the worker contract (environment, progress lines, exit
//!   codes), the same for every executor;
//! - [`declared_nodes`]: the node markers that tell the servers sharing
//!   an executor directory which nodes they run (local and hollow);
//! - [`reconcile`]: the reconciler's decision as a pure function (desired
//!   workers + observed workers → actions);
//! - [`reconcile_engine`]: the reconcile loop's decisions as a pure engine
//!   (leadership, passes, progress interval, shutdown) that the leader's
//!   driver performs;
//! - [`executor`]: the [`Executor`] trait the leader's reconcile loop drives;
//! - [`local`]: workers as local child processes (the embedded default);
//! - [`ssh`]: workers on hosts reached over SSH, under a shell supervisor
//!   that outlives the connection;
//! - [`kubernetes`]: one Pod per worker through the API server (kube);
//! - [`hollow`]: hollow workers, real to the control plane but without a
//!   process (scale tests: thousands of simulated nodes on one machine);
//! - [`supervisor`]: `keel supervise`, the parent that lets a worker outlive
//!   its server and keeps its exit status;
//! - [`discovery`]: GPU inventory from `nvidia-smi`, or simulated;
//! - [`gpu_health`]: which GPUs a machine can offer, and why not the
//!   others (lost by the driver, a critical Xid in the kernel's log);
//! - [`trainer`]: the simulated trainer behind `keel trainer`.
//!
//! A worker's identity is (job, allocation epoch, rank): reconciling twice
//! launches nothing twice, and a new allocation epoch is a new worker.

pub mod book;
pub mod containment;
pub mod contract;
pub mod declared_nodes;
pub mod discovery;
pub mod executor;
pub mod gpu_health;
pub mod hollow;
pub mod kubernetes;
pub mod local;
pub mod reconcile;
pub mod reconcile_engine;
pub mod ssh;
pub mod supervisor;
pub mod trainer;
pub mod worker_log;

use keel_state::JobId;

pub use executor::{Executor, ExecutorError, NodeProbe, RemovedLogs, WorkerLog};
pub use hollow::{HollowConfig, HollowExecutor};
pub use kubernetes::{KubeConfig, KubeExecutor};
pub use local::{LocalConfig, LocalExecutor};
pub use reconcile::{Action, Observed};
pub use ssh::{SshConfig, SshExecutor};
/// A worker's identity. Reconciling twice launches nothing twice: an
/// executor that already runs a worker with this identity leaves it alone,
/// and a new allocation epoch is a new identity.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerId {
    pub job_id: JobId,
    pub epoch: u64,
    pub rank: u32,
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "job-{}-e{}-r{}", self.job_id, self.epoch, self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_gpus_in_order_and_ids_print() {
        let allocation = keel_state::Allocation {
            epoch: 1,
            gpus: (0..4)
                .map(|index| keel_state::GpuRef {
                    node: "n0".into(),
                    index,
                })
                .collect(),
            based_on: 0,
            policy: "fifo".into(),
            round: 1,
            decided_at_ms: 0,
            shared_with: None,
        };
        let r = allocation.ranks(2);
        assert_eq!(r.len(), 2);
        assert_eq!(r[1][0].index, 2);
        assert_eq!(
            WorkerId {
                job_id: 3,
                epoch: 2,
                rank: 1
            }
            .to_string(),
            "job-3-e2-r1"
        );
    }
}
