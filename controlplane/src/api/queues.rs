//! The queue calls of the API (issue 23, item 1): make, change, delete
//! and list queues. A spec is checked here against the cluster's GPU types
//! before it is proposed (and again by `apply`); refusals name the field.

use std::collections::BTreeMap;

use keel_proto::api;
use keel_state::codec::{queue_spec_from_proto, queue_spec_to_proto};
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
    let spec = queue_spec_from_proto(spec.ok_or(ApiError::InvalidArgument {
        field: "spec",
        message: "a queue's spec (quota, cohort, limits, weight) is required".into(),
    })?);
    spec.validate(|t| state.knows_gpu_type(t))
        .map_err(|e| ApiError::Refused(e.into()))?;
    Ok(spec)
}

/// What a queue holds and waits for, from the state.
fn status_of(state: &ClusterState, name: &str, spec: QueueSpec) -> api::QueueStatus {
    let mut used: BTreeMap<String, u32> = BTreeMap::new();
    let (mut running_jobs, mut pending_jobs, mut pending_gpus) = (0u32, 0u32, 0u32);
    let in_queue = |q: &str| q == name || (q.is_empty() && name == DEFAULT_QUEUE);
    for job in state.unfinished_jobs().filter(|j| in_queue(&j.spec.queue)) {
        match &job.allocation {
            Some(a) => {
                running_jobs += 1;
                for g in &a.gpus {
                    let gpu_type = state
                        .nodes()
                        .get(&g.node)
                        .and_then(|n| n.gpus.get(&g.index))
                        .cloned()
                        .unwrap_or_default();
                    *used.entry(gpu_type).or_default() += 1;
                }
            }
            None => {
                pending_jobs += 1;
                pending_gpus =
                    pending_gpus.saturating_add(job.spec.gpus.saturating_mul(job.spec.workers.min));
            }
        }
    }
    let borrowed = match &spec.quota {
        None => BTreeMap::new(),
        Some(quota) => used
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
        spec: Some(queue_spec_to_proto(&spec)),
        changed_at_ms: stored.map_or(0, |q| q.changed_at_ms),
        changed_by: stored
            .and_then(|q| q.changed_by.clone())
            .unwrap_or_default(),
        used: used.into_iter().collect(),
        borrowed: borrowed.into_iter().collect(),
        running_jobs,
        pending_jobs,
        pending_gpus,
    }
}

impl KeelApi {
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
        let command = Command::CreateQueue {
            name: req.name.clone(),
            spec,
        };
        let (index, _) = self.propose_request(command, req.request_id, actor).await?;
        tracing::info!(queue = %req.name, index, "queue created");
        Ok(Response::new(api::QueueChangeResponse { index }))
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
        let command = Command::UpdateQueue {
            name: req.name.clone(),
            spec,
        };
        let (index, _) = self.propose_request(command, req.request_id, actor).await?;
        tracing::info!(queue = %req.name, index, "queue changed");
        Ok(Response::new(api::QueueChangeResponse { index }))
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
        let command = Command::DeleteQueue {
            name: req.name.clone(),
        };
        let (index, _) = self.propose_request(command, req.request_id, actor).await?;
        tracing::info!(queue = %req.name, index, "queue deleted");
        Ok(Response::new(api::QueueChangeResponse { index }))
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
        let queues = applied
            .state
            .queues()
            .all()
            .into_iter()
            .map(|(name, spec)| status_of(&applied.state, &name, spec))
            .collect();
        Ok(Response::new(api::ListQueuesResponse { queues }))
    }
}
