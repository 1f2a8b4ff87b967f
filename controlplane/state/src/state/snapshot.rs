//! The state in protobuf (`keel.entry.v1.StateSnapshot`): what a snapshot
//! holds from format 8 on.
//!
//! Encoding is lossless: decoding what [`ClusterState::to_snapshot_proto`]
//! gave yields an equal state with the same hash. Decoding rebuilds the
//! derived indexes and refuses a state that breaks an invariant
//! ([`ClusterState::check_invariants`]), a name it does not know, or a job
//! or node listed twice.

use std::collections::BTreeMap;

use keel_proto::entry as pb;

use super::{ClusterState, FreeCache, JobIndexes};
use crate::acl::{Acl, Token};
use crate::codec::{event_from_proto, event_to_proto, DecodeError};
use crate::free_gpus::FreeGpus;
use crate::model::{GoneGpu, GpuHolders, GpuRef, Job, Node, NodeState};
use crate::policy_memory::PolicyMemorySlot;
use crate::proto_form::ProtoForm;
use crate::queue::{Queue, Queues};
use crate::requests::{RecentRequests, Remembered};
use crate::secret::{Secret, Secrets};

impl ClusterState {
    /// The bytes of its snapshot's encoding (for reports of its size).
    pub fn snapshot_len(&self) -> usize {
        prost::Message::encoded_len(&self.to_snapshot_proto())
    }

    /// The state as a snapshot's protobuf message (its `format_version`
    /// left for the snapshot's writer to set).
    pub fn to_snapshot_proto(&self) -> pb::StateSnapshot {
        let memory = self.policy_memory.memory.as_ref();
        pb::StateSnapshot {
            format_version: 0,
            next_job_id: self.next_job_id,
            jobs: self.jobs.values().map(|j| j.to_record()).collect(),
            nodes: self.nodes.values().map(node_to_proto).collect(),
            gpu_holders: self
                .gpu_holders
                .iter()
                .map(|(gpu, h)| pb::GpuHolding {
                    gpu: gpu.to_proto(),
                    job: h.job,
                    sharer: h.sharer,
                })
                .collect(),
            last_index: self.last_index,
            supply_demand_version: self.supply_demand_version,
            last_round: self.last_round,
            policy: self.policy.clone(),
            requests: self
                .requests
                .in_order()
                .map(|(id, r)| pb::RememberedRequest {
                    request_id: id.to_string(),
                    first_index: r.first_index,
                    at_ms: r.at_ms,
                    command_digest: r.command_digest.to_vec(),
                    events: r.events.iter().map(event_to_proto).collect(),
                })
                .collect(),
            policy_memory: memory.map(ProtoForm::to_proto),
            policy_memory_changed_at: self.policy_memory.changed_at,
            last_entry_at_ms: self.last_entry_at_ms(),
            acl: self.acl.is_bootstrapped().then(|| pb::AclState {
                bootstrapped: true,
                tokens: self
                    .acl
                    .tokens()
                    .iter()
                    .map(|(name, t)| pb::AclToken {
                        name: name.clone(),
                        role: t.role.to_proto(),
                        secret_hash: t.secret_hash.to_proto(),
                        created_at_ms: t.created_at_ms,
                        expires_at_ms: t.expires_at_ms,
                        created_by: t.created_by.clone(),
                        queues: t.queues.iter().cloned().collect(),
                    })
                    .collect(),
            }),
            queues: (!self.queues.is_unset()).then(|| pb::QueueState {
                queues: self
                    .queues
                    .stored()
                    .iter()
                    .map(|(name, q)| pb::QueueRecord {
                        name: name.clone(),
                        spec: q.spec.to_proto(),
                        changed_at_ms: q.changed_at_ms,
                        changed_by: q.changed_by.clone(),
                    })
                    .collect(),
            }),
            secrets: (!self.secrets.is_unset()).then(|| pb::SecretState {
                secrets: self
                    .secrets
                    .all()
                    .iter()
                    .map(|(name, secret)| pb::SecretRecord {
                        name: name.clone(),
                        values: secret.values.to_proto(),
                        owner: secret.owner.clone(),
                        queue: secret.queue.clone(),
                        revision: secret.revision,
                        changed_at_ms: secret.changed_at_ms,
                    })
                    .collect(),
            }),
        }
    }

    /// The state a snapshot's protobuf message holds.
    pub fn from_snapshot_proto(m: pb::StateSnapshot) -> Result<ClusterState, DecodeError> {
        let inconsistent = DecodeError::Inconsistent;
        let mut jobs = super::JobMap::new();
        for j in m.jobs {
            let job: Job = ProtoForm::from_proto(j, "state_snapshot.jobs")?;
            let id = job.id;
            if jobs.insert(id, Box::new(job)).is_some() {
                return Err(inconsistent(format!("job {id} is listed twice")));
            }
        }
        let mut nodes = BTreeMap::new();
        for n in m.nodes {
            let node = node_from_proto(n)?;
            let name = node.name.clone();
            if nodes.insert(name.clone(), node).is_some() {
                return Err(inconsistent(format!("node {name:?} is listed twice")));
            }
        }
        let mut gpu_holders = BTreeMap::new();
        for h in m.gpu_holders {
            let gpu: GpuRef = ProtoForm::from_proto(h.gpu, "gpu_holding.gpu")?;
            let holders = GpuHolders {
                job: h.job,
                sharer: h.sharer,
            };
            if let Some(_twice) = gpu_holders.insert(gpu.clone(), holders) {
                return Err(inconsistent(format!("GPU {gpu} is listed twice")));
            }
        }
        let requests = RecentRequests::from_order(
            m.requests
                .into_iter()
                .map(|r| {
                    let command_digest: [u8; 32] =
                        r.command_digest.as_slice().try_into().map_err(|_| {
                            inconsistent(format!(
                                "request {:?}: a command digest of {} bytes, not 32",
                                r.request_id,
                                r.command_digest.len()
                            ))
                        })?;
                    let events = r
                        .events
                        .into_iter()
                        .map(event_from_proto)
                        .collect::<Result<_, _>>()?;
                    Ok((
                        r.request_id,
                        Remembered {
                            first_index: r.first_index,
                            at_ms: r.at_ms,
                            command_digest,
                            events,
                        },
                    ))
                })
                .collect::<Result<Vec<_>, DecodeError>>()?,
        )
        .map_err(inconsistent)?;
        let policy_memory = PolicyMemorySlot {
            memory: ProtoForm::from_proto(m.policy_memory, "state_snapshot.policy_memory")?,
            changed_at: m.policy_memory_changed_at,
        };
        let acl = match m.acl {
            None => Acl::default(),
            Some(a) => {
                let mut tokens = BTreeMap::new();
                for t in a.tokens {
                    let token = Token {
                        role: ProtoForm::from_proto(t.role, "acl_token.role")?,
                        secret_hash: ProtoForm::from_proto(t.secret_hash, "acl_token.secret_hash")?,
                        created_at_ms: t.created_at_ms,
                        expires_at_ms: t.expires_at_ms,
                        created_by: t.created_by,
                        queues: t.queues.into_iter().collect(),
                    };
                    if tokens.insert(t.name.clone(), token).is_some() {
                        return Err(inconsistent(format!("token {:?} is listed twice", t.name)));
                    }
                }
                Acl::from_parts(a.bootstrapped, tokens)
                    .map_err(|e| inconsistent(format!("the tokens: {e}")))?
            }
        };
        let mut queues = BTreeMap::new();
        for q in m.queues.map(|q| q.queues).unwrap_or_default() {
            let queue = Queue {
                spec: ProtoForm::from_proto(q.spec, "queue_record.spec")?,
                changed_at_ms: q.changed_at_ms,
                changed_by: q.changed_by,
            };
            if queues.insert(q.name.clone(), queue).is_some() {
                return Err(inconsistent(format!("queue {:?} is listed twice", q.name)));
            }
        }
        let mut secrets = BTreeMap::new();
        for r in m.secrets.map(|s| s.secrets).unwrap_or_default() {
            let secret = Secret {
                values: ProtoForm::from_proto(r.values, "secret_record.values")?,
                owner: r.owner,
                queue: r.queue,
                revision: r.revision,
                changed_at_ms: r.changed_at_ms,
            };
            if secrets.insert(r.name.clone(), secret).is_some() {
                return Err(inconsistent(format!("secret {:?} is listed twice", r.name)));
            }
        }
        let state = ClusterState {
            acl,
            queues: Queues::from_parts(queues),
            secrets: Secrets::from_parts(secrets),
            next_job_id: m.next_job_id,
            indexes: JobIndexes::of(&jobs),
            queue_index: super::QueueIndex::default(),
            capacity: FreeGpus::of_nodes(&nodes),
            jobs,
            nodes,
            gpu_holders,
            last_index: m.last_index,
            last_entry_at_ms: super::EntryTimeFloor(m.last_entry_at_ms),
            supply_demand_version: m.supply_demand_version,
            last_round: m.last_round,
            policy: m.policy,
            requests,
            policy_memory,
            free: FreeCache::default(),
        };
        let mut state = state;
        state.queue_index =
            super::QueueIndex::of(&state.jobs, &state.nodes, &state.queues, &state.capacity);
        state.check_invariants().map_err(inconsistent)?;
        Ok(state)
    }
}

impl Job {
    /// The job as the state holds it, in protobuf: a snapshot's record of
    /// it, and what the API answers about it (`keel.api.v1.Job.record`), so
    /// that a field a job gains is encoded once for both.
    pub fn to_record(&self) -> pb::JobRecord {
        self.to_proto()
    }
}

fn node_to_proto(n: &Node) -> pb::NodeRecord {
    pb::NodeRecord {
        name: n.name.clone(),
        address: n.address.clone(),
        gpus: n
            .gpus
            .iter()
            .map(|(index, gpu_type)| pb::Gpu {
                index: *index,
                gpu_type: gpu_type.clone(),
            })
            .collect(),
        state: n.state.to_proto(),
        registered_at_ms: n.registered_at_ms,
        message: n.message.clone(),
        gone_gpus: n
            .gone_gpus
            .iter()
            .map(|(index, g)| pb::GoneGpu {
                index: *index,
                gpu_type: g.gpu_type.clone(),
                reason: g.reason.clone(),
                since_ms: g.since_ms,
            })
            .collect(),
    }
}

fn node_from_proto(n: pb::NodeRecord) -> Result<Node, DecodeError> {
    let state: NodeState = ProtoForm::from_proto(n.state, "node.state")?;
    let mut gpus = BTreeMap::new();
    for g in n.gpus {
        if gpus.insert(g.index, g.gpu_type).is_some() {
            return Err(DecodeError::Inconsistent(format!(
                "node {:?}: GPU {} is listed twice",
                n.name, g.index
            )));
        }
    }
    let mut gone_gpus = BTreeMap::new();
    for g in n.gone_gpus {
        let gone = GoneGpu {
            gpu_type: g.gpu_type,
            reason: g.reason,
            since_ms: g.since_ms,
        };
        if gpus.contains_key(&g.index) || gone_gpus.insert(g.index, gone).is_some() {
            return Err(DecodeError::Inconsistent(format!(
                "node {:?}: GPU {} is listed twice",
                n.name, g.index
            )));
        }
    }
    Ok(Node {
        name: n.name,
        address: n.address,
        gpus,
        state,
        registered_at_ms: n.registered_at_ms,
        message: n.message,
        gone_gpus,
    })
}
