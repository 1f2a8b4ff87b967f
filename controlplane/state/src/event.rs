//! Events: what applying an entry did. Past-tense names.

use keel_proto::entry as pb;
use serde::{Deserialize, Serialize};

use crate::acl::Role;
use crate::model::{FailedGpu, Gpu, GpuRef, JobId, JobState, ProgressSample};
use crate::proto_form::ProtoForm;

/// Each variant's protobuf form is the `Event.kind` oneof's variant of the
/// same name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ProtoForm)]
#[proto(oneof = "pb::event::Kind", messages = "pb")]
pub enum Event {
    NodeRegistered {
        name: String,
        gpus: Vec<Gpu>,
    },
    NodeLost {
        name: String,
        reason: String,
    },
    NodeRecovered {
        name: String,
    },
    /// A node was forgotten (`RemoveNode`); the jobs that held its GPUs
    /// were preempted first (their own events).
    NodeRemoved {
        name: String,
    },
    JobSubmitted {
        job_id: JobId,
        name: String,
        user: String,
    },
    JobCancelled {
        job_id: JobId,
        reason: String,
    },
    JobAllocated {
        job_id: JobId,
        epoch: u64,
        gpus: Vec<GpuRef>,
        based_on: u64,
        policy: String,
        round: u64,
        /// The job sharing these GPUs (space sharing), if any.
        shared_with: Option<JobId>,
    },
    JobPreempted {
        job_id: JobId,
        reason: String,
    },
    /// One job's part of an allocation plan no longer held and was not applied.
    PlacementRefused {
        job_id: JobId,
        reason: String,
    },
    WorkerStarted {
        job_id: JobId,
        epoch: u64,
        rank: u32,
        node: String,
    },
    WorkerExited {
        job_id: JobId,
        epoch: u64,
        rank: u32,
        exit_code: Option<i32>,
        reason: String,
    },
    JobProgressReported {
        job_id: JobId,
        latest: ProgressSample,
        samples: u32,
    },
    /// An attempt failed and the job went back to the queue for another.
    JobRequeued {
        job_id: JobId,
        retries: u32,
        reason: String,
    },
    JobFinished {
        job_id: JobId,
        state: JobState,
        reason: String,
    },
    JobRemoved {
        job_id: JobId,
    },
    /// The scheduling policy changed (`from` is empty when it was the
    /// server's configured one).
    PolicyChanged {
        from: String,
        to: String,
    },
    /// A decision's policy memory was not kept: the decision was planned
    /// on a state older than the memory in force.
    PolicyMemoryRefused {
        policy: String,
        reason: String,
    },
    /// A client's request applied again (a retry after a lost answer):
    /// nothing changed; the client was answered with the outcome of the
    /// entry at `first_index` (see [`crate::requests`]).
    RequestRepeated {
        request_id: String,
        first_index: u64,
    },
    /// Added after the others (issue 33; postcard numbers variants in
    /// order, so new ones go last). A known node's GPUs changed (`RecordNodeInventory`): GPUs offered
    /// anew or again, and GPUs gone with why. The jobs that held a gone
    /// GPU were preempted (their own events).
    NodeInventoryChanged {
        name: String,
        added: Vec<Gpu>,
        gone: Vec<FailedGpu>,
    },
    /// Added after the others (issue 22). Access control is on: the first
    /// token, an `admin` one, is `name`.
    AclBootstrapped {
        name: String,
    },
    /// A token was made (never its secret: that is shown once, to whoever
    /// asked).
    TokenCreated {
        name: String,
        role: Role,
        /// When it stops being accepted, in log time; `None`: never.
        expires_at_ms: Option<u64>,
    },
    TokenRevoked {
        name: String,
    },
    /// A membership change an operator asked for (`RecordMembershipChange`).
    MembershipChangeRecorded {
        member: u64,
        change: String,
        membership_index: u64,
    },
    /// Added after the others (issue 23).
    QueueCreated {
        name: String,
    },
    QueueUpdated {
        name: String,
    },
    QueueDeleted {
        name: String,
    },
    /// Added after the others (issue 35): its keys, never their values.
    SecretPut {
        name: String,
        keys: Vec<String>,
        revision: u64,
    },
    SecretDeleted {
        name: String,
    },
}

impl Event {
    /// The job this event is about, if any.
    pub fn job_id(&self) -> Option<JobId> {
        match self {
            Event::NodeRegistered { .. }
            | Event::NodeInventoryChanged { .. }
            | Event::NodeLost { .. }
            | Event::NodeRecovered { .. }
            | Event::NodeRemoved { .. }
            | Event::PolicyChanged { .. }
            | Event::PolicyMemoryRefused { .. }
            | Event::RequestRepeated { .. }
            | Event::AclBootstrapped { .. }
            | Event::TokenCreated { .. }
            | Event::TokenRevoked { .. }
            | Event::MembershipChangeRecorded { .. }
            | Event::QueueCreated { .. }
            | Event::QueueUpdated { .. }
            | Event::QueueDeleted { .. }
            | Event::SecretPut { .. }
            | Event::SecretDeleted { .. } => None,
            Event::JobSubmitted { job_id, .. }
            | Event::JobCancelled { job_id, .. }
            | Event::JobAllocated { job_id, .. }
            | Event::JobPreempted { job_id, .. }
            | Event::PlacementRefused { job_id, .. }
            | Event::WorkerStarted { job_id, .. }
            | Event::WorkerExited { job_id, .. }
            | Event::JobProgressReported { job_id, .. }
            | Event::JobRequeued { job_id, .. }
            | Event::JobFinished { job_id, .. }
            | Event::JobRemoved { job_id } => Some(*job_id),
        }
    }
}
