//! Commands: what a log entry asks the state machine to do.
//!
//! A [`LogEntry`] is a [`Command`] stamped by the leader with the time it was
//! proposed. Applying it is the only way `ClusterState` changes.

use std::collections::BTreeMap;

use keel_proto::entry as pb;
use serde::{Deserialize, Serialize};

use crate::acl::{Role, SecretHash};
use crate::model::{FailedGpu, Gpu, GpuRef, JobId, ProgressSample};
use crate::policy_memory::PolicyMemory;
use crate::proto_form::ProtoForm;
use crate::queue::QueueSpec;
use crate::secret::SealedValue;
use crate::spec::JobSpec;

/// The longest actor an entry records ([`LogEntry::actor`]).
pub const ACTOR_MAX_LEN: usize = 256;

/// The longest trace context an entry carries ([`LogEntry::trace_parent`]):
/// a W3C `traceparent` of version 00 is 55 bytes; later versions may add
/// fields after it.
pub const TRACE_PARENT_MAX_LEN: usize = 128;

/// One entry of the replicated log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// Unix time in milliseconds, stamped by the leader. The only clock the
    /// state machine ever sees.
    pub at_ms: u64,
    pub command: Command,
    /// A client's id for this write, kept across its retries: a repeat
    /// within the window is answered with the first outcome and applies
    /// nothing (see [`crate::requests`]). `None` for the leader's own
    /// entries and for clients that send none.
    pub request_id: Option<String>,
    /// Who asked for it (issue 22): the caller's identity, as the API
    /// resolved it ([`ACTOR_MAX_LEN`] bytes at most). `None` for
    /// the leader's own decisions and for callers without one. Not in the
    /// binary form of Raft wire format 1: an entry with one travels in
    /// protobuf only ([`Proposal::postcard_carries_whole`]).
    #[serde(skip)]
    pub actor: Option<String>,
    /// The trace this write belongs to (issue 24): the W3C `traceparent`
    /// of the API's span that proposed it, when that trace is sampled
    /// ([`TRACE_PARENT_MAX_LEN`] bytes at most). Opaque to the state
    /// machine, which only keeps a submission's on its job, so that the
    /// decision placing the job and its launch join the submitter's trace
    /// on whichever replica leads then. Travels in protobuf only, like
    /// `actor`.
    #[serde(skip)]
    pub trace_parent: Option<String>,
}

impl LogEntry {
    /// An entry without a request id.
    pub fn new(at_ms: u64, command: Command) -> LogEntry {
        LogEntry {
            at_ms,
            command,
            request_id: None,
            actor: None,
            trace_parent: None,
        }
    }
}

/// The commands one Raft log entry carries, batched by the leader so that
/// one fdatasync covers them all. Applied in order, each with its own outcome.
///
/// Its entries are never changed once it is built ([`Proposal::new`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Proposal {
    pub entries: Vec<LogEntry>,
    /// Its protobuf encoding, once made or read ([`crate::codec`]): the WAL
    /// and the Raft wire carry the same bytes, so a replica encodes a
    /// proposal once, not once per copy it writes or sends. Shared by
    /// clones; not part of the value (never compared, serialised or
    /// hashed).
    #[serde(skip)]
    pub(crate) encoded: EncodedOnce,
}

impl Proposal {
    pub fn new(entries: Vec<LogEntry>) -> Proposal {
        Proposal {
            entries,
            encoded: EncodedOnce::default(),
        }
    }

    /// Whether its postcard form (serde's binary form: Raft wire format 1)
    /// carries it whole. Fields added after that format (a job's
    /// `resources` and `logs`) and commands added after it
    /// (`RecordNodeInventory`) travel in protobuf only.
    pub fn postcard_carries_whole(&self) -> bool {
        self.entries.iter().all(|e| match &e.command {
            _ if e.actor.is_some() || e.trace_parent.is_some() => false,
            Command::SubmitJob { spec } => {
                spec.resources.is_unset()
                    && spec.logs.is_unset()
                    && spec.queue.is_empty()
                    && spec.preemptible
                    && spec.secret_env.is_empty()
            }
            // Commands the release before does not know.
            Command::RecordNodeInventory { .. }
            | Command::BootstrapAcl { .. }
            | Command::CreateToken { .. }
            | Command::RevokeToken { .. }
            | Command::RecordMembershipChange { .. }
            | Command::CreateQueue { .. }
            | Command::UpdateQueue { .. }
            | Command::DeleteQueue { .. }
            | Command::PutSecret { .. }
            | Command::DeleteSecret { .. } => false,
            _ => true,
        })
    }
}

impl PartialEq for Proposal {
    fn eq(&self, other: &Proposal) -> bool {
        self.entries == other.entries
    }
}

/// A proposal's encoding, made at most once.
#[derive(Clone, Default)]
pub(crate) struct EncodedOnce(pub(crate) std::sync::Arc<std::sync::OnceLock<Vec<u8>>>);

impl std::fmt::Debug for EncodedOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.get() {
            Some(bytes) => write!(f, "{} bytes", bytes.len()),
            None => f.write_str("not encoded"),
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ProtoForm)]
#[proto(enumeration = "pb::JobOutcome")]
pub enum JobOutcome {
    Succeeded,
    Failed,
}

/// A job's placement in an allocation plan: every GPU it should hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::JobPlacement")]
pub struct JobPlacement {
    pub job_id: JobId,
    /// Empty: release the job's GPUs (preempt it).
    pub gpus: Vec<GpuRef>,
    /// Space sharing: the job that runs on the same GPUs at the same time.
    /// The partner must be placed in the same decision on the identical
    /// GPUs, naming this job; otherwise both placements are refused.
    #[proto(since = 2)]
    pub share_with: Option<JobId>,
}

impl JobPlacement {
    /// A placement on GPUs the job holds alone.
    pub fn alone(job_id: JobId, gpus: Vec<GpuRef>) -> JobPlacement {
        JobPlacement {
            job_id,
            gpus,
            share_with: None,
        }
    }
}

/// Each variant's protobuf form is the `LogEntry.command` oneof's variant
/// of the same name; `#[proto(since = N)]` marks what a build reading only
/// entry formats before `N` would drop ([`crate::proto_form`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ProtoForm)]
#[proto(oneof = "pb::log_entry::Command", messages = "pb")]
// `SubmitJob` (a whole spec) is the largest and the most common command;
// boxing it would add an allocation to every submission to save bytes on
// the rare small ones.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    RegisterNode {
        name: String,
        address: String,
        gpus: Vec<Gpu>,
        /// Why the node offers these GPUs when it has more (unhealthy
        /// devices, other workloads', cordoned); empty when it offers all.
        note: String,
    },
    MarkNodeLost {
        name: String,
        reason: String,
    },
    MarkNodeRecovered {
        name: String,
    },
    /// Forget a node (retired, or never real). Refused while jobs hold its
    /// GPUs unless `force`, which sends those jobs back to the queue.
    RemoveNode {
        name: String,
        force: bool,
    },
    SubmitJob {
        spec: JobSpec,
    },
    CancelJob {
        job_id: JobId,
        reason: String,
    },
    /// A policy's plan, computed by the leader on the state at `based_on`.
    DecideAllocation {
        based_on: u64,
        policy: String,
        round: u64,
        placements: Vec<JobPlacement>,
        /// The policy's memory after this round, when it keeps one
        /// ([`crate::policy_memory`]): recorded with the decision, so
        /// the two are applied together or not at all.
        #[proto(since = 4)]
        memory: Option<PolicyMemory>,
    },
    RecordWorkerStarted {
        job_id: JobId,
        epoch: u64,
        rank: u32,
        node: String,
    },
    RecordWorkerExited {
        job_id: JobId,
        epoch: u64,
        rank: u32,
        exit_code: Option<i32>,
        reason: String,
        /// The node refused to start it (a kubelet admission error): the
        /// attempt was not the job's, so it spends no retry.
        not_admitted: bool,
    },
    /// A batch of progress samples for one job.
    ReportProgress {
        job_id: JobId,
        samples: Vec<ProgressSample>,
    },
    FinishJob {
        job_id: JobId,
        outcome: JobOutcome,
        reason: String,
    },
    /// Forget a job that has ended. The only way a job leaves the state.
    RemoveJob {
        job_id: JobId,
    },
    /// Switch the scheduling policy at run time; every later round uses it.
    /// `apply` checks the name's form; the API, that a policy of that name
    /// exists (`policy::all_policy_names`).
    SetPolicy {
        name: String,
    },
    /// Added after the others (issue 33): postcard numbers variants in
    /// order, so new ones go last.
    ///
    /// What a node's agent reports now, decided against the
    /// state it meets: a node not known is registered; for a known one, a
    /// GPU it had and no longer offers (missing, failed, or of another
    /// type now) is gone, with the reason `failed` gives or "no longer in
    /// the node's inventory", and the jobs holding it are preempted; a GPU
    /// it offers again or anew is added. Unlike `RegisterNode`, which
    /// older logs hold and which still refuses to drop a held GPU, it is
    /// never refused for what jobs hold.
    RecordNodeInventory {
        name: String,
        address: String,
        /// The GPUs it offers.
        gpus: Vec<Gpu>,
        /// GPUs it has but reports failed (none of them in `gpus`).
        failed: Vec<FailedGpu>,
        note: String,
    },
    /// Added after the others (issue 22). Turns access control on for
    /// good: the first token, an `admin` one. Refused once done.
    BootstrapAcl {
        name: String,
        /// The token's secret's hash: the log never holds the secret.
        secret_hash: SecretHash,
    },
    /// A token for `role`, expiring `ttl_ms` after the entry's time
    /// (`None`: never). Refused before `BootstrapAcl`.
    CreateToken {
        name: String,
        role: Role,
        secret_hash: SecretHash,
        ttl_ms: Option<u64>,
        /// The queues its holder may submit to (issue 23; a `user` token
        /// only; empty: any). Entry format 8 when set.
        #[proto(since = 8)]
        queues: Vec<String>,
    },
    /// Drops a token: its secret is refused from the entry on.
    RevokeToken {
        name: String,
    },
    /// Records, for the audit, a change of the Raft membership that an
    /// operator asked for (`AddMember`, `RemoveMember`), with its actor.
    /// The change itself is a Raft membership entry at
    /// `membership_index`, which carries no actor; this entry changes no
    /// state.
    RecordMembershipChange {
        member: u64,
        /// "added as a voter", "added as a learner", "removed".
        change: String,
        membership_index: u64,
    },
    /// Added after the others (issue 23). Makes a queue jobs may name.
    CreateQueue {
        name: String,
        spec: QueueSpec,
    },
    /// Replaces a queue's quota, cohort, limits and weight (the default
    /// queue's too).
    UpdateQueue {
        name: String,
        spec: QueueSpec,
    },
    /// Removes a queue; refused while an unfinished job names it.
    DeleteQueue {
        name: String,
    },
    /// Added after the others (issue 35). Creates or replaces a secret:
    /// its keys' values sealed by the server that took the request (the
    /// state never holds a value in the clear).
    #[proto(since = 10)]
    PutSecret {
        name: String,
        values: BTreeMap<String, SealedValue>,
        /// The queue whose jobs may use it besides its owner's.
        queue: String,
        /// A re-seal: the revision it read (refused if it moved).
        replaces_revision: Option<u64>,
    },
    /// Removes a secret; refused while an unfinished job uses it.
    #[proto(since = 10)]
    DeleteSecret {
        name: String,
    },
}

/// Constructors, one per command: the fields every caller names, in the
/// order the variant declares them. A field with a natural default (an
/// empty note, no policy memory, not a kubelet refusal) is left out and
/// takes that default, so that a field added to a command later changes
/// this block and the places that set it, not every place that builds the
/// command (ARCHITECTURE.md, "What one new field costs"). A caller that
/// sets a defaulted field writes the variant out whole.
impl Command {
    /// Registers a node offering all the GPUs it has (no note).
    pub fn register_node(
        name: impl Into<String>,
        address: impl Into<String>,
        gpus: Vec<Gpu>,
    ) -> Command {
        Command::RegisterNode {
            name: name.into(),
            address: address.into(),
            gpus,
            note: String::new(),
        }
    }

    /// A node's agent's report of the GPUs it offers, none failed and no note.
    pub fn record_node_inventory(
        name: impl Into<String>,
        address: impl Into<String>,
        gpus: Vec<Gpu>,
    ) -> Command {
        Command::RecordNodeInventory {
            name: name.into(),
            address: address.into(),
            gpus,
            failed: Vec::new(),
            note: String::new(),
        }
    }

    pub fn mark_node_lost(name: impl Into<String>, reason: impl Into<String>) -> Command {
        Command::MarkNodeLost {
            name: name.into(),
            reason: reason.into(),
        }
    }

    pub fn mark_node_recovered(name: impl Into<String>) -> Command {
        Command::MarkNodeRecovered { name: name.into() }
    }

    pub fn remove_node(name: impl Into<String>, force: bool) -> Command {
        Command::RemoveNode {
            name: name.into(),
            force,
        }
    }

    pub fn submit_job(spec: JobSpec) -> Command {
        Command::SubmitJob { spec }
    }

    pub fn cancel_job(job_id: JobId, reason: impl Into<String>) -> Command {
        Command::CancelJob {
            job_id,
            reason: reason.into(),
        }
    }

    /// A policy's plan, with no policy memory recorded beside it.
    pub fn decide_allocation(
        based_on: u64,
        policy: impl Into<String>,
        round: u64,
        placements: Vec<JobPlacement>,
    ) -> Command {
        Command::DecideAllocation {
            based_on,
            policy: policy.into(),
            round,
            placements,
            memory: None,
        }
    }

    pub fn record_worker_started(
        job_id: JobId,
        epoch: u64,
        rank: u32,
        node: impl Into<String>,
    ) -> Command {
        Command::RecordWorkerStarted {
            job_id,
            epoch,
            rank,
            node: node.into(),
        }
    }

    /// A worker's exit; one its node refused to start is written out whole
    /// (`not_admitted: true`).
    pub fn record_worker_exited(
        job_id: JobId,
        epoch: u64,
        rank: u32,
        exit_code: Option<i32>,
        reason: impl Into<String>,
    ) -> Command {
        Command::RecordWorkerExited {
            job_id,
            epoch,
            rank,
            exit_code,
            reason: reason.into(),
            not_admitted: false,
        }
    }

    pub fn report_progress(job_id: JobId, samples: Vec<ProgressSample>) -> Command {
        Command::ReportProgress { job_id, samples }
    }

    pub fn finish_job(job_id: JobId, outcome: JobOutcome, reason: impl Into<String>) -> Command {
        Command::FinishJob {
            job_id,
            outcome,
            reason: reason.into(),
        }
    }

    pub fn remove_job(job_id: JobId) -> Command {
        Command::RemoveJob { job_id }
    }

    pub fn set_policy(name: impl Into<String>) -> Command {
        Command::SetPolicy { name: name.into() }
    }

    pub fn bootstrap_acl(name: impl Into<String>, secret_hash: SecretHash) -> Command {
        Command::BootstrapAcl {
            name: name.into(),
            secret_hash,
        }
    }

    /// A token for any queue its role allows.
    pub fn create_token(
        name: impl Into<String>,
        role: Role,
        secret_hash: SecretHash,
        ttl_ms: Option<u64>,
    ) -> Command {
        Command::CreateToken {
            name: name.into(),
            role,
            secret_hash,
            ttl_ms,
            queues: Vec::new(),
        }
    }

    pub fn revoke_token(name: impl Into<String>) -> Command {
        Command::RevokeToken { name: name.into() }
    }

    pub fn record_membership_change(
        member: u64,
        change: impl Into<String>,
        membership_index: u64,
    ) -> Command {
        Command::RecordMembershipChange {
            member,
            change: change.into(),
            membership_index,
        }
    }

    pub fn create_queue(name: impl Into<String>, spec: QueueSpec) -> Command {
        Command::CreateQueue {
            name: name.into(),
            spec,
        }
    }

    pub fn update_queue(name: impl Into<String>, spec: QueueSpec) -> Command {
        Command::UpdateQueue {
            name: name.into(),
            spec,
        }
    }

    pub fn delete_queue(name: impl Into<String>) -> Command {
        Command::DeleteQueue { name: name.into() }
    }

    /// A new secret or a replacement that does not check the revision it
    /// read.
    pub fn put_secret(
        name: impl Into<String>,
        values: BTreeMap<String, SealedValue>,
        queue: impl Into<String>,
    ) -> Command {
        Command::PutSecret {
            name: name.into(),
            values,
            queue: queue.into(),
            replaces_revision: None,
        }
    }

    pub fn delete_secret(name: impl Into<String>) -> Command {
        Command::DeleteSecret { name: name.into() }
    }
}

impl Command {
    /// The node a node command names (`RegisterNode`,
    /// `RecordNodeInventory`, `MarkNodeLost`, `MarkNodeRecovered`,
    /// `RemoveNode`).
    pub fn node_name(&self) -> Option<&str> {
        match self {
            Command::RegisterNode { name, .. }
            | Command::RecordNodeInventory { name, .. }
            | Command::MarkNodeLost { name, .. }
            | Command::MarkNodeRecovered { name }
            | Command::RemoveNode { name, .. } => Some(name),
            _ => None,
        }
    }

    /// The one job this command is about, if it names one.
    pub fn job_id(&self) -> Option<JobId> {
        match self {
            Command::CancelJob { job_id, .. }
            | Command::RecordWorkerStarted { job_id, .. }
            | Command::RecordWorkerExited { job_id, .. }
            | Command::ReportProgress { job_id, .. }
            | Command::FinishJob { job_id, .. }
            | Command::RemoveJob { job_id } => Some(*job_id),
            Command::RegisterNode { .. }
            | Command::RecordNodeInventory { .. }
            | Command::MarkNodeLost { .. }
            | Command::MarkNodeRecovered { .. }
            | Command::RemoveNode { .. }
            | Command::SubmitJob { .. }
            | Command::SetPolicy { .. }
            | Command::DecideAllocation { .. }
            | Command::BootstrapAcl { .. }
            | Command::CreateToken { .. }
            | Command::RevokeToken { .. }
            | Command::RecordMembershipChange { .. }
            | Command::CreateQueue { .. }
            | Command::UpdateQueue { .. }
            | Command::DeleteQueue { .. }
            | Command::PutSecret { .. }
            | Command::DeleteSecret { .. } => None,
        }
    }

    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::RegisterNode { .. } => "register_node",
            Command::RecordNodeInventory { .. } => "record_node_inventory",
            Command::MarkNodeLost { .. } => "mark_node_lost",
            Command::MarkNodeRecovered { .. } => "mark_node_recovered",
            Command::RemoveNode { .. } => "remove_node",
            Command::SubmitJob { .. } => "submit_job",
            Command::CancelJob { .. } => "cancel_job",
            Command::DecideAllocation { .. } => "decide_allocation",
            Command::RecordWorkerStarted { .. } => "record_worker_started",
            Command::RecordWorkerExited { .. } => "record_worker_exited",
            Command::ReportProgress { .. } => "report_progress",
            Command::FinishJob { .. } => "finish_job",
            Command::RemoveJob { .. } => "remove_job",
            Command::SetPolicy { .. } => "set_policy",
            Command::BootstrapAcl { .. } => "bootstrap_acl",
            Command::CreateToken { .. } => "create_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::RecordMembershipChange { .. } => "record_membership_change",
            Command::CreateQueue { .. } => "create_queue",
            Command::UpdateQueue { .. } => "update_queue",
            Command::DeleteQueue { .. } => "delete_queue",
            Command::PutSecret { .. } => "put_secret",
            Command::DeleteSecret { .. } => "delete_secret",
        }
    }
}
