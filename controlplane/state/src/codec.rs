//! Conversions between the domain types and their protobuf form
//! (`keel_proto::entry`), and the byte encoding of log entries.
//!
//! Decoding is strict: an entry with a newer `format_version`, or whose
//! command this build does not know (an unset oneof, which is what prost
//! leaves for an unknown field), is a [`DecodeError`], never skipped.

use keel_proto::entry as pb;
use keel_proto::{
    ENTRY_FORMAT_VERSION, ENTRY_FORMAT_VERSION_ACTOR, ENTRY_FORMAT_VERSION_FIRST,
    ENTRY_FORMAT_VERSION_MEMORY, ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE, ENTRY_FORMAT_VERSION_QUEUE,
    ENTRY_FORMAT_VERSION_REQUEST_ID, ENTRY_FORMAT_VERSION_SHARES_GPUS,
    ENTRY_FORMAT_VERSION_TOKEN_QUEUES, ENTRY_FORMAT_VERSION_TRACE,
};
use prost::Message;

use crate::acl::{Role, SecretHash};
use crate::command::{Command, JobOutcome, JobPlacement, LogEntry, Proposal};
use crate::event::Event;
use crate::model::{FailedGpu, Gpu, GpuRef, ProgressSample};
use crate::policy_memory::PolicyMemory;
use crate::queue::QueueSpec;
use crate::secret::{SealedValue, SecretRef};
use crate::spec::{GpuTypes, JobSpec, Workers};

/// Largest encoded log entry accepted, in bytes.
pub const ENTRY_MAX_BYTES: usize = 4 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("entry is not valid protobuf: {0}")]
    Protobuf(String),
    #[error("entry is {len} bytes; the limit is {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error(
        "entry format version {found} is newer than this build reads ({supported}); upgrade keel"
    )]
    UnsupportedFormatVersion { found: u32, supported: u32 },
    #[error("entry (format version {format_version}) holds a command this build does not know; upgrade keel")]
    UnknownCommand { format_version: u32 },
    #[error("entry field {0} is missing")]
    MissingField(&'static str),
    #[error("entry field {field} has an unknown value {value}")]
    UnknownValue { field: &'static str, value: i32 },
    #[error("field {field} has an unknown value {value:?}")]
    UnknownName { field: &'static str, value: String },
    #[error("{0}")]
    Inconsistent(String),
}

/// Encodes an entry in the current format version.
pub fn encode_entry(entry: &LogEntry) -> Vec<u8> {
    entry_to_proto(entry).encode_to_vec()
}

/// Decodes an entry, refusing unknown versions and commands.
pub fn decode_entry(bytes: &[u8]) -> Result<LogEntry, DecodeError> {
    if bytes.len() > ENTRY_MAX_BYTES {
        return Err(DecodeError::TooLarge {
            len: bytes.len(),
            limit: ENTRY_MAX_BYTES,
        });
    }
    let msg = pb::LogEntry::decode(bytes).map_err(|e| DecodeError::Protobuf(e.to_string()))?;
    entry_from_proto(msg)
}

/// Encodes a proposal (the payload of one Raft entry).
pub fn encode_proposal(proposal: &Proposal) -> Vec<u8> {
    proposal_bytes(proposal).to_vec()
}

/// A proposal's encoding, made on first use and kept with it (shared by
/// its clones), or the bytes it was decoded from.
pub fn proposal_bytes(proposal: &Proposal) -> &[u8] {
    proposal.encoded.0.get_or_init(|| {
        pb::Proposal {
            entries: proposal.entries.iter().map(entry_to_proto).collect(),
        }
        .encode_to_vec()
    })
}

/// Decodes a proposal, refusing any entry of an unknown version or command.
pub fn decode_proposal(bytes: &[u8]) -> Result<Proposal, DecodeError> {
    decode_proposal_owned(bytes.to_vec())
}

/// [`decode_proposal`] from bytes it keeps as the proposal's encoding.
pub fn decode_proposal_owned(bytes: Vec<u8>) -> Result<Proposal, DecodeError> {
    let msg =
        pb::Proposal::decode(bytes.as_slice()).map_err(|e| DecodeError::Protobuf(e.to_string()))?;
    let proposal = Proposal {
        entries: msg
            .entries
            .into_iter()
            .map(entry_from_proto)
            .collect::<Result<_, _>>()?,
        encoded: crate::command::EncodedOnce::default(),
    };
    // The bytes read are its encoding: a proposal sent on or written again
    // is these bytes, not a new encoding of what they decoded to.
    let _ = proposal.encoded.0.set(bytes);
    Ok(proposal)
}

pub fn failed_gpu_to_proto(f: &FailedGpu) -> pb::FailedGpu {
    pb::FailedGpu {
        index: f.index,
        gpu_type: f.gpu_type.clone(),
        reason: f.reason.clone(),
    }
}

pub fn failed_gpu_from_proto(f: pb::FailedGpu) -> FailedGpu {
    FailedGpu {
        index: f.index,
        gpu_type: f.gpu_type,
        reason: f.reason,
    }
}

pub fn entry_to_proto(entry: &LogEntry) -> pb::LogEntry {
    use pb::log_entry::Command as C;
    let command = match &entry.command {
        Command::RegisterNode {
            name,
            address,
            gpus,
            note,
        } => C::RegisterNode(pb::RegisterNode {
            name: name.clone(),
            address: address.clone(),
            gpus: gpus.iter().map(gpu_to_proto).collect(),
            note: note.clone(),
        }),
        Command::RecordNodeInventory {
            name,
            address,
            gpus,
            failed,
            note,
        } => C::RecordNodeInventory(pb::RecordNodeInventory {
            name: name.clone(),
            address: address.clone(),
            gpus: gpus.iter().map(gpu_to_proto).collect(),
            failed: failed.iter().map(failed_gpu_to_proto).collect(),
            note: note.clone(),
        }),
        Command::MarkNodeLost { name, reason } => C::MarkNodeLost(pb::MarkNodeLost {
            name: name.clone(),
            reason: reason.clone(),
        }),
        Command::MarkNodeRecovered { name } => {
            C::MarkNodeRecovered(pb::MarkNodeRecovered { name: name.clone() })
        }
        Command::SubmitJob { spec } => C::SubmitJob(pb::SubmitJob {
            spec: Some(spec_to_proto(spec)),
        }),
        Command::CancelJob { job_id, reason } => C::CancelJob(pb::CancelJob {
            job_id: *job_id,
            reason: reason.clone(),
        }),
        Command::DecideAllocation {
            based_on,
            policy,
            round,
            placements,
            memory,
        } => C::DecideAllocation(pb::DecideAllocation {
            based_on: *based_on,
            policy: policy.clone(),
            round: *round,
            placements: placements
                .iter()
                .map(|p| pb::JobPlacement {
                    job_id: p.job_id,
                    gpus: p.gpus.iter().map(gpu_ref_to_proto).collect(),
                    share_with: p.share_with,
                })
                .collect(),
            memory: memory.as_ref().map(|m| pb::PolicyMemory {
                policy: m.policy.clone(),
                format: m.format,
                bytes: m.bytes.clone(),
            }),
        }),
        Command::RecordWorkerStarted {
            job_id,
            epoch,
            rank,
            node,
        } => C::RecordWorkerStarted(pb::RecordWorkerStarted {
            job_id: *job_id,
            epoch: *epoch,
            rank: *rank,
            node: node.clone(),
        }),
        Command::RecordWorkerExited {
            job_id,
            epoch,
            rank,
            exit_code,
            reason,
            not_admitted,
        } => C::RecordWorkerExited(pb::RecordWorkerExited {
            job_id: *job_id,
            epoch: *epoch,
            rank: *rank,
            exit_code: *exit_code,
            reason: reason.clone(),
            not_admitted: *not_admitted,
        }),
        Command::ReportProgress { job_id, samples } => C::ReportProgress(pb::ReportProgress {
            job_id: *job_id,
            samples: samples.iter().map(sample_to_proto).collect(),
        }),
        Command::FinishJob {
            job_id,
            outcome,
            reason,
        } => C::FinishJob(pb::FinishJob {
            job_id: *job_id,
            outcome: match outcome {
                JobOutcome::Succeeded => pb::JobOutcome::Succeeded,
                JobOutcome::Failed => pb::JobOutcome::Failed,
            } as i32,
            reason: reason.clone(),
        }),
        Command::RemoveJob { job_id } => C::RemoveJob(pb::RemoveJob { job_id: *job_id }),
        Command::SetPolicy { name } => C::SetPolicy(pb::SetPolicy { name: name.clone() }),
        Command::RemoveNode { name, force } => C::RemoveNode(pb::RemoveNode {
            name: name.clone(),
            force: *force,
        }),
        Command::BootstrapAcl { name, secret_hash } => C::BootstrapAcl(pb::BootstrapAcl {
            name: name.clone(),
            secret_hash: secret_hash.0.to_vec(),
        }),
        Command::CreateToken {
            name,
            role,
            secret_hash,
            ttl_ms,
            queues,
        } => C::CreateToken(pb::CreateToken {
            name: name.clone(),
            role: role_to_proto(*role) as i32,
            secret_hash: secret_hash.0.to_vec(),
            ttl_ms: *ttl_ms,
            queues: queues.clone(),
        }),
        Command::RevokeToken { name } => C::RevokeToken(pb::RevokeToken { name: name.clone() }),
        Command::RecordMembershipChange {
            member,
            change,
            membership_index,
        } => C::RecordMembershipChange(pb::RecordMembershipChange {
            member: *member,
            change: change.clone(),
            membership_index: *membership_index,
        }),
        Command::CreateQueue { name, spec } => C::CreateQueue(pb::CreateQueue {
            name: name.clone(),
            spec: Some(queue_spec_to_proto(spec)),
        }),
        Command::UpdateQueue { name, spec } => C::UpdateQueue(pb::UpdateQueue {
            name: name.clone(),
            spec: Some(queue_spec_to_proto(spec)),
        }),
        Command::DeleteQueue { name } => C::DeleteQueue(pb::DeleteQueue { name: name.clone() }),
        Command::PutSecret {
            name,
            values,
            queue,
            replaces_revision,
        } => C::PutSecret(pb::PutSecret {
            name: name.clone(),
            values: values
                .iter()
                .map(|(k, v)| (k.clone(), sealed_to_proto(v)))
                .collect(),
            queue: queue.clone(),
            replaces_revision: *replaces_revision,
        }),
        Command::DeleteSecret { name } => C::DeleteSecret(pb::DeleteSecret { name: name.clone() }),
    };
    let uses_secrets = match &entry.command {
        Command::SubmitJob { spec } => !spec.secret_env.is_empty(),
        Command::PutSecret { .. } | Command::DeleteSecret { .. } => true,
        _ => false,
    };
    let names_a_queue =
        matches!(&entry.command, Command::SubmitJob { spec } if !spec.queue.is_empty());
    let not_preemptible =
        matches!(&entry.command, Command::SubmitJob { spec } if !spec.preemptible);
    let shares_gpus = matches!(&entry.command, Command::DecideAllocation { placements, .. }
        if placements.iter().any(|p| p.share_with.is_some()));
    let limits_queues =
        matches!(&entry.command, Command::CreateToken { queues, .. } if !queues.is_empty());
    let has_memory = matches!(
        &entry.command,
        Command::DecideAllocation {
            memory: Some(_),
            ..
        }
    );
    // The oldest version that expresses the entry, so a build one version
    // older refuses exactly the entries it would misread.
    pb::LogEntry {
        format_version: if uses_secrets {
            ENTRY_FORMAT_VERSION
        } else if entry.trace_parent.is_some() {
            ENTRY_FORMAT_VERSION_TRACE
        } else if limits_queues {
            ENTRY_FORMAT_VERSION_TOKEN_QUEUES
        } else if not_preemptible {
            ENTRY_FORMAT_VERSION_NOT_PREEMPTIBLE
        } else if names_a_queue {
            ENTRY_FORMAT_VERSION_QUEUE
        } else if entry.actor.is_some() {
            ENTRY_FORMAT_VERSION_ACTOR
        } else if has_memory {
            ENTRY_FORMAT_VERSION_MEMORY
        } else if entry.request_id.is_some() {
            ENTRY_FORMAT_VERSION_REQUEST_ID
        } else if shares_gpus {
            ENTRY_FORMAT_VERSION_SHARES_GPUS
        } else {
            ENTRY_FORMAT_VERSION_FIRST
        },
        at_ms: entry.at_ms,
        command: Some(command),
        request_id: entry.request_id.clone().unwrap_or_default(),
        actor: entry.actor.clone().unwrap_or_default(),
        trace_parent: entry.trace_parent.clone().unwrap_or_default(),
    }
}

pub fn entry_from_proto(msg: pb::LogEntry) -> Result<LogEntry, DecodeError> {
    use pb::log_entry::Command as C;
    if msg.format_version > ENTRY_FORMAT_VERSION || msg.format_version == 0 {
        return Err(DecodeError::UnsupportedFormatVersion {
            found: msg.format_version,
            supported: ENTRY_FORMAT_VERSION,
        });
    }
    let command = match msg.command {
        None => {
            return Err(DecodeError::UnknownCommand {
                format_version: msg.format_version,
            })
        }
        Some(C::RegisterNode(c)) => Command::RegisterNode {
            name: c.name,
            address: c.address,
            gpus: c.gpus.into_iter().map(gpu_from_proto).collect(),
            note: c.note,
        },
        Some(C::RecordNodeInventory(c)) => Command::RecordNodeInventory {
            name: c.name,
            address: c.address,
            gpus: c.gpus.into_iter().map(gpu_from_proto).collect(),
            failed: c.failed.into_iter().map(failed_gpu_from_proto).collect(),
            note: c.note,
        },
        Some(C::MarkNodeLost(c)) => Command::MarkNodeLost {
            name: c.name,
            reason: c.reason,
        },
        Some(C::MarkNodeRecovered(c)) => Command::MarkNodeRecovered { name: c.name },
        Some(C::SubmitJob(c)) => Command::SubmitJob {
            spec: spec_from_proto(c.spec.ok_or(DecodeError::MissingField("submit_job.spec"))?),
        },
        Some(C::CancelJob(c)) => Command::CancelJob {
            job_id: c.job_id,
            reason: c.reason,
        },
        Some(C::DecideAllocation(c)) => Command::DecideAllocation {
            based_on: c.based_on,
            policy: c.policy,
            round: c.round,
            placements: c
                .placements
                .into_iter()
                .map(|p| JobPlacement {
                    job_id: p.job_id,
                    gpus: p.gpus.into_iter().map(gpu_ref_from_proto).collect(),
                    share_with: p.share_with,
                })
                .collect(),
            memory: c.memory.map(|m| PolicyMemory {
                policy: m.policy,
                format: m.format,
                bytes: m.bytes,
            }),
        },
        Some(C::RecordWorkerStarted(c)) => Command::RecordWorkerStarted {
            job_id: c.job_id,
            epoch: c.epoch,
            rank: c.rank,
            node: c.node,
        },
        Some(C::RecordWorkerExited(c)) => Command::RecordWorkerExited {
            job_id: c.job_id,
            epoch: c.epoch,
            rank: c.rank,
            exit_code: c.exit_code,
            reason: c.reason,
            not_admitted: c.not_admitted,
        },
        Some(C::ReportProgress(c)) => Command::ReportProgress {
            job_id: c.job_id,
            samples: c.samples.into_iter().map(sample_from_proto).collect(),
        },
        Some(C::FinishJob(c)) => Command::FinishJob {
            job_id: c.job_id,
            outcome: match pb::JobOutcome::try_from(c.outcome) {
                Ok(pb::JobOutcome::Succeeded) => JobOutcome::Succeeded,
                Ok(pb::JobOutcome::Failed) => JobOutcome::Failed,
                _ => {
                    return Err(DecodeError::UnknownValue {
                        field: "finish_job.outcome",
                        value: c.outcome,
                    })
                }
            },
            reason: c.reason,
        },
        Some(C::RemoveJob(c)) => Command::RemoveJob { job_id: c.job_id },
        Some(C::SetPolicy(c)) => Command::SetPolicy { name: c.name },
        Some(C::RemoveNode(c)) => Command::RemoveNode {
            name: c.name,
            force: c.force,
        },
        Some(C::BootstrapAcl(c)) => Command::BootstrapAcl {
            name: c.name,
            secret_hash: secret_hash_from_proto(&c.secret_hash)?,
        },
        Some(C::CreateToken(c)) => Command::CreateToken {
            name: c.name,
            role: role_from_proto(c.role)?,
            secret_hash: secret_hash_from_proto(&c.secret_hash)?,
            ttl_ms: c.ttl_ms,
            queues: c.queues,
        },
        Some(C::RevokeToken(c)) => Command::RevokeToken { name: c.name },
        Some(C::RecordMembershipChange(c)) => Command::RecordMembershipChange {
            member: c.member,
            change: c.change,
            membership_index: c.membership_index,
        },
        Some(C::CreateQueue(c)) => Command::CreateQueue {
            name: c.name,
            spec: queue_spec_from_proto(c.spec.ok_or(DecodeError::MissingField("spec"))?),
        },
        Some(C::UpdateQueue(c)) => Command::UpdateQueue {
            name: c.name,
            spec: queue_spec_from_proto(c.spec.ok_or(DecodeError::MissingField("spec"))?),
        },
        Some(C::DeleteQueue(c)) => Command::DeleteQueue { name: c.name },
        Some(C::PutSecret(c)) => Command::PutSecret {
            name: c.name,
            values: c
                .values
                .into_iter()
                .map(|(k, v)| (k, sealed_from_proto(v)))
                .collect(),
            queue: c.queue,
            replaces_revision: c.replaces_revision,
        },
        Some(C::DeleteSecret(c)) => Command::DeleteSecret { name: c.name },
    };
    if msg.actor.len() > crate::command::ACTOR_MAX_LEN {
        return Err(DecodeError::Inconsistent(format!(
            "the entry's actor is {} bytes, more than {}",
            msg.actor.len(),
            crate::command::ACTOR_MAX_LEN
        )));
    }
    if msg.trace_parent.len() > crate::command::TRACE_PARENT_MAX_LEN {
        return Err(DecodeError::Inconsistent(format!(
            "the entry's trace_parent is {} bytes, more than {}",
            msg.trace_parent.len(),
            crate::command::TRACE_PARENT_MAX_LEN
        )));
    }
    Ok(LogEntry {
        at_ms: msg.at_ms,
        command,
        request_id: Some(msg.request_id).filter(|id| !id.is_empty()),
        actor: Some(msg.actor).filter(|a| !a.is_empty()),
        trace_parent: Some(msg.trace_parent).filter(|t| !t.is_empty()),
    })
}

pub fn spec_to_proto(s: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        name: s.name.clone(),
        user: s.user.clone(),
        command: s.command.clone(),
        image: s.image.clone().unwrap_or_default(),
        env: s.env.clone(),
        gpus_per_worker: s.gpus,
        min_workers: s.workers.min,
        max_workers: s.workers.max,
        gpu_types_allowed: s.gpu_types.allowed.clone(),
        gpu_types_preferred: s.gpu_types.preferred.clone(),
        model: s.model.clone().unwrap_or_default(),
        total_steps: s.total_steps,
        epochs: s.epochs,
        priority: s.priority,
        max_retries: s.max_retries,
        retry_backoff_s: Some(s.retry_backoff_s),
        // Absent when unset, so specs without limits encode (and digest)
        // as they did before the field existed.
        resources: (!s.resources.is_unset()).then_some(pb::Resources {
            cpu_millis: s.resources.cpu_millis,
            memory_bytes: s.resources.memory_bytes,
        }),
        logs: (!s.logs.is_unset()).then_some(pb::LogLimits {
            max_file_bytes: s.logs.max_file_bytes,
            max_files: s.logs.max_files,
        }),
        queue: s.queue.clone(),
        not_preemptible: !s.preemptible,
        secret_env: s
            .secret_env
            .iter()
            .map(|(k, r)| (k.clone(), r.to_string()))
            .collect(),
    }
}

pub fn sealed_to_proto(v: &SealedValue) -> pb::SealedValue {
    pb::SealedValue {
        key_id: v.key_id.clone(),
        nonce: v.nonce.clone(),
        ciphertext: v.ciphertext.clone(),
    }
}

/// Validation happens in [`SealedValue::validate`], not here.
pub fn sealed_from_proto(v: pb::SealedValue) -> SealedValue {
    SealedValue {
        key_id: v.key_id,
        nonce: v.nonce,
        ciphertext: v.ciphertext,
    }
}

pub fn queue_spec_to_proto(q: &QueueSpec) -> pb::QueueSpec {
    pb::QueueSpec {
        quota: q.quota.as_ref().map(|gpus| pb::GpuCounts {
            gpus: gpus.clone().into_iter().collect(),
        }),
        cohort: q.cohort.clone(),
        borrow_limit: q.borrow_limit.clone().into_iter().collect(),
        lend_limit: q.lend_limit.clone().into_iter().collect(),
        weight: q.weight,
    }
}

/// Validation happens in [`QueueSpec::validate`], not here.
pub fn queue_spec_from_proto(q: pb::QueueSpec) -> QueueSpec {
    QueueSpec {
        quota: q.quota.map(|c| c.gpus.into_iter().collect()),
        cohort: q.cohort,
        borrow_limit: q.borrow_limit.into_iter().collect(),
        lend_limit: q.lend_limit.into_iter().collect(),
        weight: q.weight,
    }
}

/// The proto form uses empty strings for "absent", and presence for the
/// optional numbers (an explicit 0 stays 0, for validation to refuse);
/// validation happens in
/// [`JobSpec::validate`], not here.
pub fn spec_from_proto(s: pb::JobSpec) -> JobSpec {
    fn non_empty(s: String) -> Option<String> {
        (!s.is_empty()).then_some(s)
    }
    JobSpec {
        name: s.name,
        user: s.user,
        command: s.command,
        image: non_empty(s.image),
        env: s.env,
        gpus: s.gpus_per_worker,
        workers: Workers {
            min: s.min_workers,
            max: s.max_workers,
        },
        gpu_types: GpuTypes {
            allowed: s.gpu_types_allowed,
            preferred: s.gpu_types_preferred,
        },
        model: non_empty(s.model),
        total_steps: s.total_steps,
        epochs: s.epochs,
        priority: s.priority,
        max_retries: s.max_retries,
        retry_backoff_s: s
            .retry_backoff_s
            .unwrap_or(crate::spec::DEFAULT_RETRY_BACKOFF_S),
        resources: s
            .resources
            .map(|r| crate::spec::Resources {
                cpu_millis: r.cpu_millis,
                memory_bytes: r.memory_bytes,
            })
            .unwrap_or_default(),
        logs: s
            .logs
            .map(|l| crate::spec::LogLimits {
                max_file_bytes: l.max_file_bytes,
                max_files: l.max_files,
            })
            .unwrap_or_default(),
        queue: s.queue,
        preemptible: !s.not_preemptible,
        // `NAME/KEY`; one that is not stays as it came, for validation to
        // refuse naming the variable.
        secret_env: s
            .secret_env
            .into_iter()
            .map(|(k, r)| {
                let (name, key) = r.split_once('/').unwrap_or((r.as_str(), ""));
                let reference = SecretRef {
                    name: name.into(),
                    key: key.into(),
                };
                (k, reference)
            })
            .collect(),
    }
}

pub fn gpu_to_proto(g: &Gpu) -> pb::Gpu {
    pb::Gpu {
        index: g.index,
        gpu_type: g.gpu_type.clone(),
    }
}

pub fn gpu_from_proto(g: pb::Gpu) -> Gpu {
    Gpu {
        index: g.index,
        gpu_type: g.gpu_type,
    }
}

pub fn gpu_ref_to_proto(g: &GpuRef) -> pb::GpuRef {
    pb::GpuRef {
        node: g.node.clone(),
        index: g.index,
    }
}

pub fn gpu_ref_from_proto(g: pb::GpuRef) -> GpuRef {
    GpuRef {
        node: g.node,
        index: g.index,
    }
}

pub fn sample_to_proto(s: &ProgressSample) -> pb::ProgressSample {
    pb::ProgressSample {
        step: s.step,
        total_steps: s.total_steps,
        loss: s.loss,
        samples_per_s: s.samples_per_s,
        at_ms: s.at_ms,
    }
}

pub fn sample_from_proto(s: pb::ProgressSample) -> ProgressSample {
    ProgressSample {
        step: s.step,
        total_steps: s.total_steps,
        loss: s.loss,
        samples_per_s: s.samples_per_s,
        at_ms: s.at_ms,
    }
}

pub fn role_to_proto(role: Role) -> pb::Role {
    match role {
        Role::Admin => pb::Role::Admin,
        Role::Operator => pb::Role::Operator,
        Role::User => pb::Role::User,
        Role::Viewer => pb::Role::Viewer,
        Role::Node => pb::Role::Node,
    }
}

pub fn role_from_proto(value: i32) -> Result<Role, DecodeError> {
    match pb::Role::try_from(value) {
        Ok(pb::Role::Admin) => Ok(Role::Admin),
        Ok(pb::Role::Operator) => Ok(Role::Operator),
        Ok(pb::Role::User) => Ok(Role::User),
        Ok(pb::Role::Viewer) => Ok(Role::Viewer),
        Ok(pb::Role::Node) => Ok(Role::Node),
        Ok(pb::Role::Unspecified) | Err(_) => Err(DecodeError::UnknownValue {
            field: "role",
            value,
        }),
    }
}

pub fn secret_hash_from_proto(bytes: &[u8]) -> Result<SecretHash, DecodeError> {
    Ok(SecretHash(bytes.try_into().map_err(|_| {
        DecodeError::Inconsistent(format!("a secret hash of {} bytes, not 32", bytes.len()))
    })?))
}

pub fn event_to_proto(e: &Event) -> pb::Event {
    use pb::event::Kind as K;
    let kind = match e {
        Event::AclBootstrapped { name } => {
            K::AclBootstrapped(pb::AclBootstrapped { name: name.clone() })
        }
        Event::TokenCreated {
            name,
            role,
            expires_at_ms,
        } => K::TokenCreated(pb::TokenCreated {
            name: name.clone(),
            role: role_to_proto(*role) as i32,
            expires_at_ms: *expires_at_ms,
        }),
        Event::TokenRevoked { name } => K::TokenRevoked(pb::TokenRevoked { name: name.clone() }),
        Event::MembershipChangeRecorded {
            member,
            change,
            membership_index,
        } => K::MembershipChangeRecorded(pb::MembershipChangeRecorded {
            member: *member,
            change: change.clone(),
            membership_index: *membership_index,
        }),
        Event::QueueCreated { name } => K::QueueCreated(pb::QueueCreated { name: name.clone() }),
        Event::QueueUpdated { name } => K::QueueUpdated(pb::QueueUpdated { name: name.clone() }),
        Event::QueueDeleted { name } => K::QueueDeleted(pb::QueueDeleted { name: name.clone() }),
        Event::SecretPut {
            name,
            keys,
            revision,
        } => K::SecretPut(pb::SecretPut {
            name: name.clone(),
            keys: keys.clone(),
            revision: *revision,
        }),
        Event::SecretDeleted { name } => K::SecretDeleted(pb::SecretDeleted { name: name.clone() }),
        Event::NodeRegistered { name, gpus } => K::NodeRegistered(pb::NodeRegistered {
            name: name.clone(),
            gpus: gpus.iter().map(gpu_to_proto).collect(),
        }),
        Event::NodeInventoryChanged { name, added, gone } => {
            K::NodeInventoryChanged(pb::NodeInventoryChanged {
                name: name.clone(),
                added: added.iter().map(gpu_to_proto).collect(),
                gone: gone.iter().map(failed_gpu_to_proto).collect(),
            })
        }
        Event::NodeLost { name, reason } => K::NodeLost(pb::NodeLost {
            name: name.clone(),
            reason: reason.clone(),
        }),
        Event::NodeRecovered { name } => K::NodeRecovered(pb::NodeRecovered { name: name.clone() }),
        Event::NodeRemoved { name } => K::NodeRemoved(pb::NodeRemoved { name: name.clone() }),
        Event::JobSubmitted { job_id, name, user } => K::JobSubmitted(pb::JobSubmitted {
            job_id: *job_id,
            name: name.clone(),
            user: user.clone(),
        }),
        Event::JobCancelled { job_id, reason } => K::JobCancelled(pb::JobCancelled {
            job_id: *job_id,
            reason: reason.clone(),
        }),
        Event::JobAllocated {
            job_id,
            epoch,
            gpus,
            based_on,
            policy,
            round,
            shared_with,
        } => K::JobAllocated(pb::JobAllocated {
            job_id: *job_id,
            epoch: *epoch,
            gpus: gpus.iter().map(gpu_ref_to_proto).collect(),
            based_on: *based_on,
            policy: policy.clone(),
            round: *round,
            shared_with: *shared_with,
        }),
        Event::JobPreempted { job_id, reason } => K::JobPreempted(pb::JobPreempted {
            job_id: *job_id,
            reason: reason.clone(),
        }),
        Event::PlacementRefused { job_id, reason } => K::PlacementRefused(pb::PlacementRefused {
            job_id: *job_id,
            reason: reason.clone(),
        }),
        Event::WorkerStarted {
            job_id,
            epoch,
            rank,
            node,
        } => K::WorkerStarted(pb::WorkerStarted {
            job_id: *job_id,
            epoch: *epoch,
            rank: *rank,
            node: node.clone(),
        }),
        Event::WorkerExited {
            job_id,
            epoch,
            rank,
            exit_code,
            reason,
        } => K::WorkerExited(pb::WorkerExited {
            job_id: *job_id,
            epoch: *epoch,
            rank: *rank,
            exit_code: *exit_code,
            reason: reason.clone(),
        }),
        Event::JobProgressReported {
            job_id,
            latest,
            samples,
        } => K::JobProgressReported(pb::JobProgressReported {
            job_id: *job_id,
            latest: Some(sample_to_proto(latest)),
            samples: *samples,
        }),
        Event::JobFinished {
            job_id,
            state,
            reason,
        } => K::JobFinished(pb::JobFinished {
            job_id: *job_id,
            state: state.as_str().to_string(),
            reason: reason.clone(),
        }),
        Event::JobRemoved { job_id } => K::JobRemoved(pb::JobRemoved { job_id: *job_id }),
        Event::RequestRepeated {
            request_id,
            first_index,
        } => K::RequestRepeated(pb::RequestRepeated {
            request_id: request_id.clone(),
            first_index: *first_index,
        }),
        Event::PolicyMemoryRefused { policy, reason } => {
            K::PolicyMemoryRefused(pb::PolicyMemoryRefused {
                policy: policy.clone(),
                reason: reason.clone(),
            })
        }
        Event::PolicyChanged { from, to } => K::PolicyChanged(pb::PolicyChanged {
            from: from.clone(),
            to: to.clone(),
        }),
        Event::JobRequeued {
            job_id,
            retries,
            reason,
        } => K::JobRequeued(pb::JobRequeued {
            job_id: *job_id,
            retries: *retries,
            reason: reason.clone(),
        }),
    };
    pb::Event { kind: Some(kind) }
}

/// An event from its protobuf form (the snapshot keeps the events of the
/// requests it remembers); the inverse of [`event_to_proto`].
pub fn event_from_proto(e: pb::Event) -> Result<Event, DecodeError> {
    use pb::event::Kind as K;
    Ok(
        match e.kind.ok_or(DecodeError::MissingField("event.kind"))? {
            K::AclBootstrapped(e) => Event::AclBootstrapped { name: e.name },
            K::TokenCreated(e) => Event::TokenCreated {
                name: e.name,
                role: role_from_proto(e.role)?,
                expires_at_ms: e.expires_at_ms,
            },
            K::TokenRevoked(e) => Event::TokenRevoked { name: e.name },
            K::MembershipChangeRecorded(e) => Event::MembershipChangeRecorded {
                member: e.member,
                change: e.change,
                membership_index: e.membership_index,
            },
            K::QueueCreated(e) => Event::QueueCreated { name: e.name },
            K::QueueUpdated(e) => Event::QueueUpdated { name: e.name },
            K::QueueDeleted(e) => Event::QueueDeleted { name: e.name },
            K::SecretPut(e) => Event::SecretPut {
                name: e.name,
                keys: e.keys,
                revision: e.revision,
            },
            K::SecretDeleted(e) => Event::SecretDeleted { name: e.name },
            K::NodeRegistered(e) => Event::NodeRegistered {
                name: e.name,
                gpus: e.gpus.into_iter().map(gpu_from_proto).collect(),
            },
            K::NodeInventoryChanged(e) => Event::NodeInventoryChanged {
                name: e.name,
                added: e.added.into_iter().map(gpu_from_proto).collect(),
                gone: e.gone.into_iter().map(failed_gpu_from_proto).collect(),
            },
            K::NodeLost(e) => Event::NodeLost {
                name: e.name,
                reason: e.reason,
            },
            K::NodeRecovered(e) => Event::NodeRecovered { name: e.name },
            K::NodeRemoved(e) => Event::NodeRemoved { name: e.name },
            K::JobSubmitted(e) => Event::JobSubmitted {
                job_id: e.job_id,
                name: e.name,
                user: e.user,
            },
            K::JobCancelled(e) => Event::JobCancelled {
                job_id: e.job_id,
                reason: e.reason,
            },
            K::JobAllocated(e) => Event::JobAllocated {
                job_id: e.job_id,
                epoch: e.epoch,
                gpus: e.gpus.into_iter().map(gpu_ref_from_proto).collect(),
                based_on: e.based_on,
                policy: e.policy,
                round: e.round,
                shared_with: e.shared_with,
            },
            K::JobPreempted(e) => Event::JobPreempted {
                job_id: e.job_id,
                reason: e.reason,
            },
            K::PlacementRefused(e) => Event::PlacementRefused {
                job_id: e.job_id,
                reason: e.reason,
            },
            K::WorkerStarted(e) => Event::WorkerStarted {
                job_id: e.job_id,
                epoch: e.epoch,
                rank: e.rank,
                node: e.node,
            },
            K::WorkerExited(e) => Event::WorkerExited {
                job_id: e.job_id,
                epoch: e.epoch,
                rank: e.rank,
                exit_code: e.exit_code,
                reason: e.reason,
            },
            K::JobProgressReported(e) => Event::JobProgressReported {
                job_id: e.job_id,
                latest: sample_from_proto(
                    e.latest
                        .ok_or(DecodeError::MissingField("job_progress_reported.latest"))?,
                ),
                samples: e.samples,
            },
            K::JobFinished(e) => Event::JobFinished {
                job_id: e.job_id,
                state: crate::model::JobState::parse(&e.state).ok_or(DecodeError::UnknownName {
                    field: "job_finished.state",
                    value: e.state,
                })?,
                reason: e.reason,
            },
            K::JobRemoved(e) => Event::JobRemoved { job_id: e.job_id },
            K::RequestRepeated(e) => Event::RequestRepeated {
                request_id: e.request_id,
                first_index: e.first_index,
            },
            K::PolicyMemoryRefused(e) => Event::PolicyMemoryRefused {
                policy: e.policy,
                reason: e.reason,
            },
            K::PolicyChanged(e) => Event::PolicyChanged {
                from: e.from,
                to: e.to,
            },
            K::JobRequeued(e) => Event::JobRequeued {
                job_id: e.job_id,
                retries: e.retries,
                reason: e.reason,
            },
        },
    )
}

/// The record of what applying `entry` at `index` did, as stored in the
/// journal and streamed to watchers.
pub fn applied_entry_to_proto(
    index: u64,
    position: u32,
    entry: &LogEntry,
    outcome: &Result<Vec<Event>, crate::ApplyError>,
) -> pb::AppliedEntry {
    let (events, refused) = match outcome {
        Ok(events) => (events.iter().map(event_to_proto).collect(), String::new()),
        Err(e) => (Vec::new(), e.to_string()),
    };
    pb::AppliedEntry {
        index,
        at_ms: entry.at_ms,
        command: entry.command.kind().to_string(),
        events,
        refused,
        position,
        request_id: entry.request_id.clone().unwrap_or_default(),
        actor: entry.actor.clone().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proposal is encoded once per replica: the bytes it was read from
    /// (WAL or wire) are what it is written and sent as, and clones share
    /// the encoding; the cache is no part of its value.
    #[test]
    fn a_proposal_keeps_the_bytes_it_was_read_from() {
        let fresh = Proposal::new(vec![LogEntry::new(
            7,
            Command::SetPolicy {
                name: "fifo".into(),
            },
        )]);
        let bytes = encode_proposal(&fresh);
        let read = decode_proposal(&bytes).expect("decodes");
        assert_eq!(read, fresh);
        assert!(std::ptr::eq(
            proposal_bytes(&read),
            proposal_bytes(&read.clone())
        ));
        assert_eq!(proposal_bytes(&read), bytes.as_slice());
        // Made once, on first use, and shared with the clones made before.
        let copy = fresh.clone();
        assert!(std::ptr::eq(proposal_bytes(&fresh), proposal_bytes(&copy)));
    }

    /// Issue 19, item 9: an explicit `total_steps: 0` (or `epochs: 0`) from
    /// a client is refused with the field and its range, not stored as
    /// "unknown"; absent stays absent, and a value round-trips.
    #[test]
    fn an_explicit_zero_for_an_optional_number_is_refused_not_dropped() {
        let spec = || crate::spec::JobSpec {
            total_steps: None,
            ..crate::fixtures::job_spec("j", 1, 1)
        };
        let mut p = spec_to_proto(&spec());
        assert_eq!(spec_from_proto(p.clone()).total_steps, None);
        p.total_steps = Some(0);
        let err = spec_from_proto(p.clone()).validate().expect_err("refused");
        assert!(err.to_string().contains("total_steps"), "{err}");
        p.total_steps = None;
        p.epochs = Some(0);
        let err = spec_from_proto(p.clone()).validate().expect_err("refused");
        assert!(err.to_string().contains("epochs"), "{err}");
        let mut with = spec();
        with.total_steps = Some(500);
        assert_eq!(spec_from_proto(spec_to_proto(&with)), with);
    }

    #[test]
    fn unknown_command_is_an_error_not_a_skip() {
        // Field 99 is a command this build does not know.
        let mut bytes = pb::LogEntry {
            format_version: 1,
            at_ms: 5,
            command: None,
            request_id: String::new(),
            actor: String::new(),
            trace_parent: String::new(),
        }
        .encode_to_vec();
        // tag = (99 << 3) | 2 (length-delimited), length 0
        bytes.extend_from_slice(&[0x9a, 0x06, 0x00]);
        assert_eq!(
            decode_entry(&bytes),
            Err(DecodeError::UnknownCommand { format_version: 1 })
        );
    }

    #[test]
    fn newer_format_version_is_refused() {
        let bytes = pb::LogEntry {
            format_version: ENTRY_FORMAT_VERSION + 1,
            at_ms: 5,
            command: Some(pb::log_entry::Command::RemoveJob(pb::RemoveJob {
                job_id: 1,
            })),
            request_id: String::new(),
            actor: String::new(),
            trace_parent: String::new(),
        }
        .encode_to_vec();
        assert!(matches!(
            decode_entry(&bytes),
            Err(DecodeError::UnsupportedFormatVersion { .. })
        ));
    }

    #[test]
    fn garbage_is_a_protobuf_error() {
        assert!(matches!(
            decode_entry(&[0xff, 0xff, 0xff]),
            Err(DecodeError::Protobuf(_))
        ));
    }

    #[test]
    fn only_an_entry_that_shares_gpus_is_written_in_format_version_2() {
        let gpu = GpuRef {
            node: "n0".into(),
            index: 0,
        };
        let decision = |share: bool| LogEntry {
            at_ms: 5,
            command: Command::DecideAllocation {
                based_on: 3,
                policy: "max_min_fairness_packed".into(),
                round: 1,
                memory: None,
                placements: vec![
                    JobPlacement {
                        job_id: 1,
                        gpus: vec![gpu.clone()],
                        share_with: share.then_some(2),
                    },
                    JobPlacement {
                        job_id: 2,
                        gpus: vec![gpu.clone()],
                        share_with: share.then_some(1),
                    },
                ],
            },
            request_id: None,
            actor: None,
            trace_parent: None,
        };
        for (share, version) in [(false, 1), (true, 2)] {
            let entry = decision(share);
            assert_eq!(entry_to_proto(&entry).format_version, version);
            let bytes = encode_entry(&entry);
            assert_eq!(decode_entry(&bytes), Ok(entry), "round trip");
        }
        // A request id makes any entry version 3, and round-trips.
        let entry = LogEntry {
            request_id: Some("cli-1".into()),
            ..decision(true)
        };
        assert_eq!(entry_to_proto(&entry).format_version, 3);
        assert_eq!(decode_entry(&encode_entry(&entry)), Ok(entry.clone()));
        // A policy memory makes it version 4 (a version-3 reader would
        // drop the field and keep an older memory than its peers).
        let mut with_memory = entry;
        if let Command::DecideAllocation { memory, .. } = &mut with_memory.command {
            *memory = Some(PolicyMemory {
                policy: "max_min_fairness_packed".into(),
                format: 1,
                bytes: vec![1, 2, 3],
            });
        }
        assert_eq!(entry_to_proto(&with_memory).format_version, 4);
        assert_eq!(decode_entry(&encode_entry(&with_memory)), Ok(with_memory));
    }
}
