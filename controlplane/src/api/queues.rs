//! The queue calls of the API (issue 23, item 1): make, change, delete
//! and list queues. A spec is checked here against the cluster's GPU types
//! before it is proposed (and again by `apply`); refusals name the field.

use std::collections::BTreeMap;

use keel_proto::api;
use keel_state::proto_form::ProtoForm;
use keel_state::queue::{self, QueueSpec, DEFAULT_QUEUE};
use keel_state::{ClusterState, Command};
use tonic::{Request, Response, Status};

use super::KeelApi;
use crate::authz::Right;
use crate::grpc_status::ApiError;

/// The spec a request carries, checked against `state`'s GPU types.
fn checked_spec(
    name: &str,
    spec: Option<keel_proto::entry::QueueSpec>,
    state: &ClusterState,
) -> Result<QueueSpec, ApiError> {
    queue::validate_queue_name("name", name).map_err(|e| ApiError::Refused(e.into()))?;
    let spec = spec.ok_or(ApiError::InvalidArgument {
        field: "spec",
        message: "a queue's spec (quota, cohort, limits, weight) is required".into(),
    })?;
    let spec = QueueSpec::from_proto(spec, "spec").map_err(|e| ApiError::InvalidArgument {
        field: "spec",
        message: e.to_string(),
    })?;
    spec.validate(|t| state.knows_gpu_type(t))
        .map_err(|e| ApiError::Refused(e.into()))?;
    Ok(spec)
}

/// What a queue's unfinished jobs hold and wait for (`keel queue list`,
/// the queue metrics and the console read the same).
#[derive(Default)]
pub(crate) struct Usage {
    /// GPUs its jobs hold, by type.
    pub(crate) used: BTreeMap<String, u32>,
    /// Its jobs holding GPUs.
    pub(crate) running_jobs: u32,
    /// Its jobs waiting for GPUs.
    pub(crate) pending_jobs: u32,
    pending_gpus: u32,
    pending_by_type: BTreeMap<String, u32>,
}

/// The key a waiting job's GPUs are counted under in `pending_by_type`:
/// the types it may use, joined by '|', or "any".
fn pending_key(allowed: &[String]) -> String {
    if allowed.is_empty() {
        "any".into()
    } else {
        let mut types: Vec<&str> = allowed.iter().map(String::as_str).collect();
        types.sort_unstable();
        types.dedup();
        types.join("|")
    }
}

/// Every queue's usage, by name, from one pass over the unfinished jobs
/// (a job naming no queue is the default queue's).
pub(crate) fn usage_by_queue(state: &ClusterState) -> BTreeMap<&str, Usage> {
    let mut by_queue: BTreeMap<&str, Usage> = BTreeMap::new();
    for job in state.unfinished_jobs() {
        let name = if job.spec.queue.is_empty() {
            DEFAULT_QUEUE
        } else {
            job.spec.queue.as_str()
        };
        let usage = by_queue.entry(name).or_default();
        match &job.allocation {
            Some(a) => {
                usage.running_jobs += 1;
                for (gpu_type, n) in state.gpus_by_type(&a.gpus) {
                    *usage.used.entry(gpu_type).or_default() += n;
                }
            }
            None => {
                let gpus = job.spec.gpus.saturating_mul(job.spec.workers.min);
                usage.pending_jobs += 1;
                usage.pending_gpus = usage.pending_gpus.saturating_add(gpus);
                let by_type = usage
                    .pending_by_type
                    .entry(pending_key(&job.spec.gpu_types.allowed))
                    .or_default();
                *by_type = by_type.saturating_add(gpus);
            }
        }
    }
    by_queue
}

/// Queue `name`'s status: its spec, what it uses, and what it borrows
/// beyond its quota.
fn status_of(state: &ClusterState, name: &str, spec: QueueSpec, usage: Usage) -> api::QueueStatus {
    let borrowed = match &spec.quota {
        None => BTreeMap::new(),
        Some(quota) => usage
            .used
            .iter()
            .filter_map(|(t, n)| {
                let over = n.saturating_sub(quota.get(t).copied().unwrap_or(0));
                (over > 0).then(|| (t.clone(), over))
            })
            .collect(),
    };
    let stored = state.queues().stored().get(name);
    api::QueueStatus {
        name: name.to_string(),
        spec: Some(spec.to_proto()),
        changed_at_ms: stored.map_or(0, |q| q.changed_at_ms),
        changed_by: stored
            .and_then(|q| q.changed_by.clone())
            .unwrap_or_default(),
        used: usage.used,
        borrowed,
        running_jobs: usage.running_jobs,
        pending_jobs: usage.pending_jobs,
        pending_gpus: usage.pending_gpus,
        pending_by_type: usage.pending_by_type,
    }
}

impl KeelApi {
    /// Proposes a queue command and answers with its index.
    async fn propose_queue_change(
        &self,
        command: Command,
        name: &str,
        request_id: String,
        actor: Option<String>,
        what: &str,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        let (index, _) = self.propose_request(command, request_id, actor).await?;
        tracing::info!(queue = %name, index, "queue {what}");
        Ok(Response::new(api::QueueChangeResponse { index }))
    }

    pub(super) async fn create_queue_call(
        &self,
        request: Request<api::CreateQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        let actor = self.authorize(&request, Right::ManageQueues)?.actor();
        let req = request.into_inner();
        let spec = {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            checked_spec(&req.name, req.spec, &applied.state)?
        };
        let command = Command::create_queue(req.name.clone(), spec);
        self.propose_queue_change(command, &req.name, req.request_id, actor, "created")
            .await
    }

    pub(super) async fn update_queue_call(
        &self,
        request: Request<api::UpdateQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        let actor = self.authorize(&request, Right::ManageQueues)?.actor();
        let req = request.into_inner();
        let spec = {
            let shared = self.node.state_machine.shared();
            let applied = shared.read();
            let spec = checked_spec(&req.name, req.spec, &applied.state)?;
            if !applied.state.queues().exists(&req.name) {
                return Err(ApiError::Refused(queue::QueueError::Unknown(req.name).into()).into());
            }
            spec
        };
        let command = Command::update_queue(req.name.clone(), spec);
        self.propose_queue_change(command, &req.name, req.request_id, actor, "changed")
            .await
    }

    pub(super) async fn delete_queue_call(
        &self,
        request: Request<api::DeleteQueueRequest>,
    ) -> Result<Response<api::QueueChangeResponse>, Status> {
        let actor = self.authorize(&request, Right::ManageQueues)?.actor();
        let req = request.into_inner();
        queue::validate_queue_name("name", &req.name).map_err(|e| ApiError::Refused(e.into()))?;
        if req.name == DEFAULT_QUEUE {
            return Err(ApiError::Refused(queue::QueueError::DefaultKept.into()).into());
        }
        let command = Command::delete_queue(req.name.clone());
        self.propose_queue_change(command, &req.name, req.request_id, actor, "deleted")
            .await
    }

    pub(super) async fn list_queues_call(
        &self,
        request: Request<api::ListQueuesRequest>,
        stale: bool,
    ) -> Result<Response<api::ListQueuesResponse>, Status> {
        self.authorize(&request, Right::ReadStatus)?;
        if !stale {
            self.linearizable().await?;
        }
        let shared = self.node.state_machine.shared();
        let applied = shared.read();
        let mut usage = usage_by_queue(&applied.state);
        let queues = applied
            .state
            .queues()
            .all()
            .into_iter()
            .map(|(name, spec)| {
                let used = usage.remove(name.as_str()).unwrap_or_default();
                status_of(&applied.state, &name, spec, used)
            })
            .collect();
        Ok(Response::new(api::ListQueuesResponse { queues }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::fixtures::job_spec;
    use keel_state::{Command, LogEntry};

    #[test]
    fn a_queue_counts_what_its_waiting_jobs_need_by_the_types_they_may_use() {
        let mut state = ClusterState::new();
        let mut index = 0;
        let mut apply = |state: &mut ClusterState, command| {
            index += 1;
            state
                .apply(index, &LogEntry::new(index * 1000, command))
                .expect("applies");
        };
        let mut v100 = job_spec("v100", 2, 2);
        v100.gpu_types.allowed = vec!["v100".into()];
        let mut either = job_spec("either", 1, 1);
        either.gpu_types.allowed = vec!["v100".into(), "a100".into(), "v100".into()];
        let any = job_spec("any", 4, 1);
        for spec in [v100, either, any] {
            apply(&mut state, Command::submit_job(spec));
        }
        let usage = usage_by_queue(&state);
        let default = &usage[DEFAULT_QUEUE];
        assert_eq!((default.pending_jobs, default.pending_gpus), (3, 9));
        assert_eq!(
            default.pending_by_type,
            BTreeMap::from([
                ("a100|v100".to_string(), 1),
                ("any".to_string(), 4),
                ("v100".to_string(), 4),
            ])
        );
    }
}
