//! The `Executor` trait: what the leader's reconciler needs from whatever
//! runs workers.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use keel_state::liveness::NodeReport;
use keel_state::{JobId, ProgressSample};

use crate::contract::WorkerLaunch;
use crate::reconcile::Observed;
use crate::WorkerId;

/// Why an executor could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error("worker {id}: {source}")]
    Io {
        id: WorkerId,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

/// One worker's log, as `keel logs` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLog {
    pub id: WorkerId,
    /// The last bytes of the log (all of it when shorter than asked).
    pub content: Vec<u8>,
    /// The log's whole length, to say how much was left out.
    pub total_bytes: u64,
    /// Why its writer drops the worker's output, while it does (the
    /// filesystem is below the free-space floor).
    pub paused: Option<String>,
}

/// What [`Executor::remove_logs`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemovedLogs {
    pub files: u64,
    pub bytes: u64,
}

/// What an executor learned about one of its nodes by reaching it (the SSH
/// and Kubernetes executors' probes stand in for a node's heartbeat).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeProbe {
    /// The node answered, with its inventory.
    Answered(NodeReport),
    /// The node could not be reached or cannot run workers, and why.
    Unreachable { name: String, reason: String },
}

/// Runs workers. Every method is idempotent: launching a worker that runs
/// (or ran and is not forgotten) does nothing; stopping one that is stopping
/// or gone does nothing.
pub trait Executor: Send + Sync + 'static {
    /// Starts a worker. A worker that cannot start is reported as exited
    /// (with the reason) by [`Executor::observe`], not as an error here,
    /// so the job's retry policy sees it.
    fn launch(
        &self,
        launch: WorkerLaunch,
    ) -> impl Future<Output = Result<(), ExecutorError>> + Send;

    /// Asks a worker to stop: SIGTERM (checkpoint and exit), then SIGKILL
    /// after `grace`. Returns at once; the exit shows up in `observe`.
    fn stop(
        &self,
        id: &WorkerId,
        grace: Duration,
    ) -> impl Future<Output = Result<(), ExecutorError>> + Send;

    /// Every worker the executor runs or ran and has not forgotten.
    fn observe(
        &self,
    ) -> impl Future<Output = Result<BTreeMap<WorkerId, Observed>, ExecutorError>> + Send;

    /// Drops an exited worker whose exit is now in the log.
    fn forget(&self, id: &WorkerId) -> impl Future<Output = ()> + Send;

    /// Progress samples reported since the last call, per job.
    fn take_progress(&self) -> impl Future<Output = BTreeMap<JobId, Vec<ProgressSample>>> + Send;

    /// The logs of a job's workers (every epoch and rank this executor ran),
    /// at most `tail_bytes` of each.
    fn logs(
        &self,
        job_id: JobId,
        tail_bytes: u64,
    ) -> impl Future<Output = Result<Vec<WorkerLog>, ExecutorError>> + Send;

    /// Removes the logs of a finished job (retention): its files, and on
    /// every host. `Ok(None)` when a worker of the job still runs here
    /// (nothing removed; asked again later). Executors whose logs live
    /// elsewhere (the kubelet's) remove nothing.
    fn remove_logs(
        &self,
        job_id: JobId,
    ) -> impl Future<Output = Result<Option<RemovedLogs>, ExecutorError>> + Send {
        let _ = job_id;
        async { Ok(Some(RemovedLogs::default())) }
    }

    /// This server starts to lead: find the workers an earlier leader (or an
    /// earlier run of this server) left, re-adopt the running ones and
    /// report the exits that no one saw. Idempotent.
    fn take_over(&self) -> impl Future<Output = ()> + Send;

    /// This server stopped leading: stop watching every worker without
    /// touching it (the next leader takes them over) and forget them.
    fn release(&self) -> impl Future<Output = ()> + Send;

    /// What the executor's probes learned about its nodes since the last
    /// call, newest per node. Executors whose nodes report through the
    /// servers' heartbeats (the local one) have none.
    fn take_node_probes(&self) -> impl Future<Output = Vec<NodeProbe>> + Send {
        async { Vec::new() }
    }

    /// Whether this executor runs workers on `node`: the local executor on
    /// the nodes of the servers that share its executor directory (their
    /// machine), the SSH executor on the hosts of its nodes file, the
    /// Kubernetes executor on the GPU Nodes it lists. The reconciler
    /// launches nothing on a node it does not own: a node known only from a
    /// heartbeat (which any client can send) never runs a command.
    fn owns(&self, node: &str) -> bool;

    /// Its name in metrics and logs: `local`, `ssh`, `kubernetes`, `hollow`.
    fn kind(&self) -> &'static str;

    /// Whether two workers of a declared pair can run on the same GPUs
    /// (space sharing). `None`: they can; `Some(why)`: they cannot, and
    /// the space-sharing policies must not run.
    fn cannot_share_gpus(&self) -> Option<&'static str> {
        None
    }

    /// Stops every worker and waits (at most `grace` plus a little) for them
    /// to exit. Used when the server shuts down.
    fn shutdown(&self, grace: Duration) -> impl Future<Output = ()> + Send;
}
