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
use crate::codec::{
    event_from_proto, event_to_proto, gpu_ref_from_proto, gpu_ref_to_proto, queue_spec_from_proto,
    queue_spec_to_proto, role_from_proto, role_to_proto, sample_from_proto, sample_to_proto,
    sealed_from_proto, sealed_to_proto, secret_hash_from_proto, spec_from_proto, spec_to_proto,
    DecodeError,
};
use crate::free_gpus::FreeGpus;
use crate::model::{
    Allocation, GoneGpu, GpuHolders, Job, JobState, Node, NodeState, Worker, WorkerState,
};
use crate::perf_history::{PerfHistory, SpeedStat};
use crate::policy_memory::{PolicyMemory, PolicyMemorySlot};
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
                    gpu: Some(gpu_ref_to_proto(gpu)),
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
            policy_memory: memory.map(|m| pb::PolicyMemory {
                policy: m.policy.clone(),
                format: m.format,
                bytes: m.bytes.clone(),
            }),
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
                        role: role_to_proto(t.role) as i32,
                        secret_hash: t.secret_hash.0.to_vec(),
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
                        spec: Some(queue_spec_to_proto(&q.spec)),
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
                        values: secret
                            .values
                            .iter()
                            .map(|(k, v)| (k.clone(), sealed_to_proto(v)))
                            .collect(),
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
            let job = job_from_proto(j)?;
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
            let gpu =
                gpu_ref_from_proto(h.gpu.ok_or(DecodeError::MissingField("gpu_holders.gpu"))?);
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
            memory: m.policy_memory.map(|p| PolicyMemory {
                policy: p.policy,
                format: p.format,
                bytes: p.bytes,
            }),
            changed_at: m.policy_memory_changed_at,
        };
        let acl = match m.acl {
            None => Acl::default(),
            Some(a) => {
                let mut tokens = BTreeMap::new();
                for t in a.tokens {
                    let token = Token {
                        role: role_from_proto(t.role)?,
                        secret_hash: secret_hash_from_proto(&t.secret_hash)?,
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
                spec: queue_spec_from_proto(
                    q.spec
                        .ok_or_else(|| inconsistent(format!("queue {:?} has no spec", q.name)))?,
                ),
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
                values: r
                    .values
                    .into_iter()
                    .map(|(k, v)| (k, sealed_from_proto(v)))
                    .collect(),
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
        let j = self;
        pb::JobRecord {
            id: j.id,
            spec: Some(spec_to_proto(&j.spec)),
            state: j.state.as_str().to_string(),
            submitted_at_ms: j.submitted_at_ms,
            started_at_ms: j.started_at_ms,
            finished_at_ms: j.finished_at_ms,
            allocation: j.allocation.as_ref().map(|a| pb::Allocation {
                epoch: a.epoch,
                gpus: a.gpus.iter().map(gpu_ref_to_proto).collect(),
                based_on: a.based_on,
                policy: a.policy.clone(),
                round: a.round,
                decided_at_ms: a.decided_at_ms,
                shared_with: a.shared_with,
            }),
            last_epoch: j.last_epoch,
            workers: j
                .workers
                .iter()
                .map(|(rank, w)| pb::WorkerRecord {
                    rank: *rank,
                    epoch: w.epoch,
                    node: w.node.clone(),
                    state: w.state.as_str().to_string(),
                    exit_code: w.exit_code,
                })
                .collect(),
            progress: j.progress.as_ref().map(sample_to_proto),
            progress_samples: j.progress_samples,
            retries: j.retries,
            not_before_ms: j.not_before_ms,
            message: j.message.clone(),
            service_gpu_ms: j.service_gpu_ms,
            queued_since_ms: j.queued_since_ms,
            perf: Some(perf_to_proto(&j.perf)),
            submitted_by: j.submitted_by.clone(),
            trace_parent: j.trace_parent.clone(),
        }
    }
}

fn job_from_proto(j: pb::JobRecord) -> Result<Job, DecodeError> {
    let mut workers = BTreeMap::new();
    for w in j.workers {
        let state = WorkerState::parse(&w.state).ok_or_else(|| DecodeError::UnknownName {
            field: "worker.state",
            value: w.state.clone(),
        })?;
        let worker = Worker {
            epoch: w.epoch,
            node: w.node,
            state,
            exit_code: w.exit_code,
        };
        if workers.insert(w.rank, worker).is_some() {
            return Err(DecodeError::Inconsistent(format!(
                "job {}: rank {} is listed twice",
                j.id, w.rank
            )));
        }
    }
    Ok(Job {
        id: j.id,
        spec: spec_from_proto(j.spec.ok_or(DecodeError::MissingField("job.spec"))?),
        state: JobState::parse(&j.state).ok_or(DecodeError::UnknownName {
            field: "job.state",
            value: j.state,
        })?,
        submitted_at_ms: j.submitted_at_ms,
        started_at_ms: j.started_at_ms,
        finished_at_ms: j.finished_at_ms,
        allocation: j.allocation.map(|a| Allocation {
            epoch: a.epoch,
            gpus: a.gpus.into_iter().map(gpu_ref_from_proto).collect(),
            based_on: a.based_on,
            policy: a.policy,
            round: a.round,
            decided_at_ms: a.decided_at_ms,
            shared_with: a.shared_with,
        }),
        last_epoch: j.last_epoch,
        workers,
        progress: j.progress.map(sample_from_proto),
        progress_samples: j.progress_samples,
        retries: j.retries,
        not_before_ms: j.not_before_ms,
        message: j.message,
        service_gpu_ms: j.service_gpu_ms,
        queued_since_ms: j.queued_since_ms,
        perf: perf_from_proto(j.perf.unwrap_or_default()),
        submitted_by: j.submitted_by,
        trace_parent: j.trace_parent,
    })
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
        state: n.state.as_str().to_string(),
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
    let state = NodeState::parse(&n.state).ok_or_else(|| DecodeError::UnknownName {
        field: "node.state",
        value: n.state.clone(),
    })?;
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

fn stat_to_proto(s: &SpeedStat) -> pb::SpeedStat {
    pb::SpeedStat {
        sum_steps_per_s: s.sum_steps_per_s,
        count: s.count,
    }
}

fn stat_from_proto(s: Option<pb::SpeedStat>) -> SpeedStat {
    let s = s.unwrap_or_default();
    SpeedStat {
        sum_steps_per_s: s.sum_steps_per_s,
        count: s.count,
    }
}

fn speeds_to_proto(speeds: &BTreeMap<String, BTreeMap<u32, SpeedStat>>) -> Vec<pb::SpeedsOnType> {
    speeds
        .iter()
        .map(|(gpu_type, by_gpus)| pb::SpeedsOnType {
            gpu_type: gpu_type.clone(),
            by_gpus: by_gpus
                .iter()
                .map(|(gpus, stat)| pb::SpeedOnGpus {
                    gpus: *gpus,
                    stat: Some(stat_to_proto(stat)),
                })
                .collect(),
        })
        .collect()
}

fn speeds_from_proto(speeds: Vec<pb::SpeedsOnType>) -> BTreeMap<String, BTreeMap<u32, SpeedStat>> {
    speeds
        .into_iter()
        .map(|t| {
            let by_gpus = t
                .by_gpus
                .into_iter()
                .map(|g| (g.gpus, stat_from_proto(g.stat)))
                .collect();
            (t.gpu_type, by_gpus)
        })
        .collect()
}

fn perf_to_proto(p: &PerfHistory) -> pb::PerfHistory {
    pb::PerfHistory {
        loss_points: p
            .loss_points
            .iter()
            .map(|(step, loss)| pb::LossPoint {
                step: *step,
                loss: *loss,
            })
            .collect(),
        speeds: speeds_to_proto(&p.speeds),
        epoch_speed: Some(stat_to_proto(&p.epoch_speed)),
        epoch_gpus: p.epoch_gpus,
        last_sample: p.last_sample.map(|(epoch, step, at_ms)| pb::LastSample {
            epoch,
            step,
            at_ms,
        }),
        epoch_gpu_type: p.epoch_gpu_type.clone(),
        epoch_partner: p.epoch_partner.clone(),
        shared_speeds: p
            .shared_speeds
            .iter()
            .map(|(partner, by_type)| pb::SpeedsBesidePartner {
                partner_model: partner.clone(),
                by_type: speeds_to_proto(by_type),
            })
            .collect(),
    }
}

fn perf_from_proto(p: pb::PerfHistory) -> PerfHistory {
    PerfHistory {
        loss_points: p
            .loss_points
            .into_iter()
            .map(|l| (l.step, l.loss))
            .collect(),
        speeds: speeds_from_proto(p.speeds),
        epoch_speed: stat_from_proto(p.epoch_speed),
        epoch_gpus: p.epoch_gpus,
        last_sample: p.last_sample.map(|s| (s.epoch, s.step, s.at_ms)),
        epoch_gpu_type: p.epoch_gpu_type,
        epoch_partner: p.epoch_partner,
        shared_speeds: p
            .shared_speeds
            .into_iter()
            .map(|s| (s.partner_model, speeds_from_proto(s.by_type)))
            .collect(),
    }
}
