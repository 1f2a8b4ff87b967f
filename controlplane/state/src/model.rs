//! The domain model: jobs, nodes, GPUs and allocations, as `ClusterState` holds them.

use std::collections::BTreeMap;
use std::fmt;

use keel_proto::entry as pb;
use serde::{Deserialize, Serialize};

use crate::proto_form::ProtoForm;
use crate::spec::JobSpec;

/// The model name of a job that names none (the throughput table's
/// `generic` profile).
pub const GENERIC_MODEL: &str = "generic";

/// A job's id: assigned by the state machine, in submission order, from 1.
pub type JobId = u64;

/// One GPU in the cluster: a node's name and the GPU's index on it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::GpuRef")]
pub struct GpuRef {
    pub node: String,
    pub index: u32,
}

impl fmt::Display for GpuRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.node, self.index)
    }
}

/// A GPU as a node declares it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::Gpu")]
pub struct Gpu {
    pub index: u32,
    pub gpu_type: String,
}

/// A GPU a node has but cannot offer, as its agent reports it: fallen off
/// the bus, a critical Xid, lost to the driver (issue 33).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::FailedGpu")]
pub struct FailedGpu {
    pub index: u32,
    pub gpu_type: String,
    pub reason: String,
}

/// A GPU a node had and no longer offers: its type, why, and since when
/// (log time). Kept until a GPU at that index is offered again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoneGpu {
    pub gpu_type: String,
    pub reason: String,
    pub since_ms: u64,
}

/// Where a job is in its life.
///
/// ```text
/// pending ──allocated──► running ──finished──► succeeded | failed
///    ▲                     │
///    └──── preempted ◄─────┘          any non-terminal ──cancel──► cancelled
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Pending,
    Running,
    Preempted,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Pending,
        JobState::Running,
        JobState::Preempted,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    /// Terminal states never change again; only removal follows.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }

    /// The lower-case word used on the wire and in the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Preempted => "preempted",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The GPUs a job holds, and the decision that gave them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::Allocation")]
pub struct Allocation {
    /// Increases every time the job's GPU set changes. Workers are identified
    /// by (job, epoch, rank), so a relaunch after a change is a new identity.
    pub epoch: u64,
    /// Sorted, distinct.
    pub gpus: Vec<GpuRef>,
    pub based_on: u64,
    pub policy: String,
    pub round: u64,
    pub decided_at_ms: u64,
    /// The job that shares these GPUs (space sharing): its allocation names
    /// this job and lists the same GPUs. `None`: the GPUs are this job's
    /// alone. Cleared when the partner lets go of them.
    pub shared_with: Option<JobId>,
}

impl Allocation {
    /// The GPUs of each worker, by rank: rank r gets GPUs `r*g .. (r+1)*g`
    /// of the (sorted) allocation. Every executor, and the simulator, places
    /// ranks this way.
    pub fn ranks(&self, gpus_per_worker: u32) -> Vec<&[GpuRef]> {
        self.gpus.chunks(gpus_per_worker.max(1) as usize).collect()
    }

    /// GPU-milliseconds this allocation has given by `now_ms`.
    pub fn service_until(&self, now_ms: u64) -> u64 {
        let gpus = u64::try_from(self.gpus.len()).unwrap_or(u64::MAX);
        gpus.saturating_mul(now_ms.saturating_sub(self.decided_at_ms))
    }
}

/// The jobs holding one GPU: one job, or a declared pair (space sharing),
/// smaller id first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GpuHolders {
    pub job: JobId,
    /// The second job of a declared pair.
    pub sharer: Option<JobId>,
}

impl GpuHolders {
    /// One job alone.
    pub fn one(job: JobId) -> GpuHolders {
        GpuHolders { job, sharer: None }
    }

    pub fn contains(&self, job: JobId) -> bool {
        self.job == job || self.sharer == Some(job)
    }

    /// The holding jobs, smaller id first.
    pub fn jobs(&self) -> impl Iterator<Item = JobId> {
        std::iter::once(self.job).chain(self.sharer)
    }

    /// These holders and `job` (a GPU held by two already keeps its two).
    pub fn with(self, job: JobId) -> GpuHolders {
        match self.sharer {
            _ if self.contains(job) => self,
            None => GpuHolders {
                job: self.job.min(job),
                sharer: Some(self.job.max(job)),
            },
            Some(_) => self,
        }
    }

    /// These holders without `job`; `None` when none is left.
    pub fn without(self, job: JobId) -> Option<GpuHolders> {
        match self.sharer {
            Some(s) if self.job == job => Some(GpuHolders::one(s)),
            Some(s) if s == job => Some(GpuHolders::one(self.job)),
            _ if self.job == job => None,
            _ => Some(self),
        }
    }
}

impl fmt::Display for GpuHolders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.sharer {
            Some(s) => write!(f, "jobs {} and {s}", self.job),
            None => write!(f, "job {}", self.job),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    Running,
    Exited,
}

impl WorkerState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Running => "running",
            WorkerState::Exited => "exited",
        }
    }

    pub fn parse(s: &str) -> Option<WorkerState> {
        [WorkerState::Running, WorkerState::Exited]
            .into_iter()
            .find(|w| w.as_str() == s)
    }
}

/// A worker of a job's current or an earlier allocation epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Worker {
    pub epoch: u64,
    pub node: String,
    pub state: WorkerState,
    pub exit_code: Option<i32>,
}

/// One progress report from a training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::ProgressSample")]
pub struct ProgressSample {
    pub step: u64,
    pub total_steps: u64,
    pub loss: Option<f64>,
    pub samples_per_s: f64,
    pub at_ms: u64,
}

/// Its protobuf form is `keel.entry.v1.JobRecord`: a snapshot's record of
/// the job, and what the API answers about it (`keel.api.v1.Job.record`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ProtoForm)]
#[proto(message = "pb::JobRecord")]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// `Some` exactly while the job holds GPUs.
    pub allocation: Option<Allocation>,
    /// The last allocation epoch given to this job (0: never allocated).
    pub last_epoch: u64,
    /// Workers by rank, of the current (or last) epoch.
    pub workers: BTreeMap<u32, Worker>,
    /// The latest progress sample, and how many were reported in all.
    pub progress: Option<ProgressSample>,
    pub progress_samples: u64,
    /// Failed attempts that were retried (at most `spec.max_retries`).
    pub retries: u32,
    /// After a failed attempt: not to be placed before this time (the
    /// retry backoff). Policies pass over the job until then.
    pub not_before_ms: Option<u64>,
    /// Why the job is in its state, when there is something to say.
    pub message: String,
    /// GPU-milliseconds received in allocations that ended (the current
    /// one counts through [`Job::attained_gpu_ms`]).
    pub service_gpu_ms: u64,
    /// When the job last started waiting for GPUs (submission, or the end
    /// of its last allocation).
    pub queued_since_ms: u64,
    /// Loss and speed history for the performance models
    /// ([`crate::perf_history`]).
    pub perf: crate::perf_history::PerfHistory,
    /// Who submitted it: the actor of its `SubmitJob` entry (issue 22),
    /// `None` for a submission without an identity (plaintext). Left out
    /// of the binary form, like a node's gone GPUs: hashed apart when a
    /// job has one, carried by protobuf snapshots.
    #[serde(skip)]
    pub submitted_by: Option<String>,
    /// The trace its submission belongs to ([`crate::command::LogEntry::trace_parent`]),
    /// for the spans of the decision placing it and of its launch. Left out
    /// of the binary form like the submitter: hashed apart when a job has
    /// one, carried by protobuf snapshots.
    #[serde(skip)]
    pub trace_parent: Option<String>,
}

impl Job {
    /// GPU-milliseconds of service up to `now_ms` (least-attained-service
    /// policies order jobs by it).
    pub fn attained_gpu_ms(&self, now_ms: u64) -> u64 {
        self.service_gpu_ms
            + self
                .allocation
                .as_ref()
                .map_or(0, |a| a.service_until(now_ms))
    }

    /// Ends the current allocation at `at_ms`, accounting its service;
    /// returns it.
    pub fn close_allocation(&mut self, at_ms: u64) -> Option<Allocation> {
        let a = self.allocation.take()?;
        self.service_gpu_ms = self.service_gpu_ms.saturating_add(a.service_until(at_ms));
        self.queued_since_ms = at_ms;
        Some(a)
    }

    /// Whether the job is still in its retry backoff at `now_ms`.
    pub fn backing_off(&self, now_ms: u64) -> bool {
        self.not_before_ms.is_some_and(|t| now_ms < t)
    }

    /// Workers in the current allocation (0 when it holds no GPUs).
    pub fn worker_count(&self) -> u32 {
        self.allocation.as_ref().map_or(0, |a| {
            u32::try_from(a.gpus.len()).unwrap_or(u32::MAX) / self.spec.gpus.max(1)
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Alive,
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Alive => "alive",
            NodeState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<NodeState> {
        [NodeState::Alive, NodeState::Lost]
            .into_iter()
            .find(|n| n.as_str() == s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub address: String,
    /// GPU type by index.
    pub gpus: BTreeMap<u32, String>,
    pub state: NodeState,
    pub registered_at_ms: u64,
    pub message: String,
    /// GPUs it had and no longer offers, by index (none of them in
    /// `gpus`). Left out of the binary form, like a job's resources:
    /// hashed apart when a node has any, carried by protobuf snapshots.
    #[serde(skip)]
    pub gone_gpus: BTreeMap<u32, GoneGpu>,
}

/// A state kept by its name in protobuf (`"running"`); an unknown name is
/// refused with the field.
macro_rules! proto_form_by_name {
    ($($t:ty),*) => {$(
        impl crate::proto_form::ProtoForm<String> for $t {
            fn to_proto(&self) -> String {
                self.as_str().to_string()
            }
            fn from_proto(
                p: String,
                field: &'static str,
            ) -> Result<Self, crate::codec::DecodeError> {
                <$t>::parse(&p).ok_or(crate::codec::DecodeError::UnknownName { field, value: p })
            }
        }
        impl crate::proto_form::Versions for $t {
            const NEWEST: u32 = crate::proto_form::FIRST;
        }
    )*};
}

proto_form_by_name!(JobState, WorkerState, NodeState);

/// A job's workers are its record's `WorkerRecord`s, each naming its rank;
/// a rank listed twice is refused.
impl crate::proto_form::ProtoForm<Vec<pb::WorkerRecord>> for BTreeMap<u32, Worker> {
    fn to_proto(&self) -> Vec<pb::WorkerRecord> {
        self.iter()
            .map(|(rank, w)| pb::WorkerRecord {
                rank: *rank,
                epoch: w.epoch,
                node: w.node.clone(),
                state: w.state.to_proto(),
                exit_code: w.exit_code,
            })
            .collect()
    }

    fn from_proto(
        records: Vec<pb::WorkerRecord>,
        field: &'static str,
    ) -> Result<Self, crate::codec::DecodeError> {
        let mut workers = BTreeMap::new();
        for w in records {
            let worker = Worker {
                epoch: w.epoch,
                node: w.node,
                state: WorkerState::from_proto(w.state, "worker_record.state")?,
                exit_code: w.exit_code,
            };
            if workers.insert(w.rank, worker).is_some() {
                return Err(crate::codec::DecodeError::Inconsistent(format!(
                    "{field}: rank {} is listed twice",
                    w.rank
                )));
            }
        }
        Ok(workers)
    }
}

impl crate::proto_form::Versions for BTreeMap<u32, Worker> {
    const NEWEST: u32 = crate::proto_form::FIRST;
}
