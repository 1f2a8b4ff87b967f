//! The executor a server runs workers with: local processes (the embedded
//! default), hosts reached over SSH (`keel server --ssh-nodes FILE`), or
//! Pods on Kubernetes (`keel server --kubernetes`), or hollow workers
//! without processes (`keel server --hollow`, for scale tests).
//!
//! `Executor` returns `impl Future`s, so it is not object-safe; this enum
//! hands each call to the executor chosen at start.

use std::collections::BTreeMap;
use std::time::Duration;

use keel_executors::contract::WorkerLaunch;
use keel_executors::{
    Executor, ExecutorError, HollowExecutor, KubeExecutor, LocalExecutor, NodeProbe, Observed,
    SshExecutor, WorkerId, WorkerLog,
};
use keel_state::{JobId, ProgressSample};

/// One of Keel's executors.
#[derive(Debug, Clone)]
pub enum AnyExecutor {
    Local(LocalExecutor),
    Ssh(SshExecutor),
    Kube(KubeExecutor),
    Hollow(HollowExecutor),
}

macro_rules! each {
    ($self:ident, $e:ident => $body:expr) => {
        match $self {
            AnyExecutor::Local($e) => $body,
            AnyExecutor::Ssh($e) => $body,
            AnyExecutor::Kube($e) => $body,
            AnyExecutor::Hollow($e) => $body,
        }
    };
}

impl Executor for AnyExecutor {
    fn kind(&self) -> &'static str {
        each!(self, e => e.kind())
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        each!(self, e => e.launch(launch).await)
    }

    async fn stop(&self, id: &WorkerId, grace: Duration) -> Result<(), ExecutorError> {
        each!(self, e => e.stop(id, grace).await)
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        each!(self, e => e.observe().await)
    }

    async fn forget(&self, id: &WorkerId) {
        each!(self, e => e.forget(id).await)
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        each!(self, e => e.take_progress().await)
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        each!(self, e => e.logs(job_id, tail_bytes).await)
    }

    async fn remove_logs(
        &self,
        job_id: JobId,
    ) -> Result<Option<keel_executors::RemovedLogs>, ExecutorError> {
        each!(self, e => e.remove_logs(job_id).await)
    }

    fn cannot_share_gpus(&self) -> Option<&'static str> {
        each!(self, e => e.cannot_share_gpus())
    }

    fn owns(&self, node: &str) -> bool {
        each!(self, e => e.owns(node))
    }

    async fn take_over(&self) {
        each!(self, e => e.take_over().await)
    }

    async fn release(&self) {
        each!(self, e => e.release().await)
    }

    async fn take_node_probes(&self) -> Vec<NodeProbe> {
        each!(self, e => e.take_node_probes().await)
    }

    async fn shutdown(&self, grace: Duration) {
        each!(self, e => e.shutdown(grace).await)
    }
}
