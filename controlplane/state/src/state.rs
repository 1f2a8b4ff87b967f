//! `ClusterState` and `apply`: the deterministic state machine.
//!
//! `apply` is a pure function of (state, entry): no clock (time comes from the
//! entry), no randomness, no I/O, ordered maps only. An entry that would make
//! an impossible transition is refused with an [`ApplyError`] and leaves the
//! state exactly as it was. An allocation plan is validated per job against
//! the state it meets: parts that no longer hold are refused
//! ([`Event::PlacementRefused`]), the rest applied.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::acl::Acl;
use crate::command::{Command, JobOutcome, JobPlacement, LogEntry};
use crate::event::Event;
use crate::free_gpus::FreeGpus;
use crate::model::{
    Allocation, FailedGpu, GoneGpu, Gpu, GpuHolders, GpuRef, Job, JobId, JobState, Node, NodeState,
    ProgressSample, Worker, WorkerState,
};
use crate::policy_memory::{PolicyMemory, PolicyMemorySlot, POLICY_MEMORY_MAX_BYTES};
use crate::queue::Queues;
use crate::quota::QuotaBook;
use crate::requests::{RecentRequests, Remembered};
use crate::secret::Secrets;
use crate::spec::SpecError;

mod queue_index;
pub use queue_index::HeldGpus;
mod snapshot;

use queue_index::QueueIndex;

/// Limits on commands, so one entry cannot blow up the state.
pub mod limits {
    pub const NODE_NAME_MAX_LEN: usize = 253;
    pub const NODE_ADDRESS_MAX_LEN: usize = 512;
    pub const NODE_GPUS_MAX: usize = 1024;
    pub const REASON_MAX_LEN: usize = 4096;
    /// A node's note (why it offers fewer GPUs than it has).
    pub const NODE_NOTE_MAX_LEN: usize = 1024;
    /// How long a job whose worker a node refused to start waits before it
    /// is placed again (the executor's next look at the node corrects what
    /// it offers meanwhile), in log time.
    pub const NOT_ADMITTED_WAIT_MS: u64 = 5_000;
    pub const POLICY_NAME_MAX_LEN: usize = 64;
    pub const PROGRESS_SAMPLES_MAX: usize = 4096;

    /// Cuts `text` to at most `max_len` bytes, at a character boundary:
    /// how a text made longer than a limit (a reason with a prefix, a
    /// long message from outside) is brought back under it.
    pub fn cut_to(text: &mut String, max_len: usize) {
        if text.len() <= max_len {
            return;
        }
        let mut end = max_len;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// Why an entry was refused. The state is unchanged after a refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ApplyError {
    #[error("invalid job spec: {0}")]
    InvalidSpec(#[from] SpecError),
    #[error("job {0} does not exist")]
    UnknownJob(JobId),
    #[error("node {0:?} does not exist")]
    UnknownNode(String),
    #[error("job {job_id} has already ended ({state}); it cannot be {action}")]
    JobEnded {
        job_id: JobId,
        state: JobState,
        action: String,
    },
    #[error("job {job_id} is {state}; only ended jobs can be removed")]
    JobNotEnded { job_id: JobId, state: JobState },
    #[error("job {job_id} holds no GPUs ({state}); it cannot {action}")]
    JobNotRunning {
        job_id: JobId,
        state: JobState,
        action: String,
    },
    #[error("job {job_id}: epoch {epoch} is stale; the current allocation epoch is {current}")]
    StaleEpoch {
        job_id: JobId,
        epoch: u64,
        current: u64,
    },
    #[error("job {job_id}: rank {rank} is outside the allocation's {workers} workers")]
    RankOutOfRange {
        job_id: JobId,
        rank: u32,
        workers: u32,
    },
    #[error("GPU {gpu} is held by job {holder}")]
    GpuInUse { gpu: GpuRef, holder: JobId },
    #[error("node {node:?} lists GPU index {index} twice")]
    DuplicateGpu { node: String, index: u32 },
    #[error("node {0:?} is lost")]
    NodeLost(String),
    #[error("node {0:?} is not lost")]
    NodeNotLost(String),
    #[error("node {node:?} holds GPUs of jobs {jobs:?}; cancel them first, or remove the node with force (they go back to the queue)")]
    NodeInUse { node: String, jobs: Vec<JobId> },
    #[error("{field} is {len} {}; the limit is {limit}", size_unit(field))]
    TooLarge {
        field: String,
        len: usize,
        limit: usize,
    },
    #[error("{field} is invalid: {reason}")]
    Invalid { field: String, reason: String },
    #[error("request id {request_id:?} was used at index {first_index} for another command; a retry must repeat its command unchanged")]
    RequestIdReused {
        request_id: String,
        first_index: u64,
    },
    /// Added after the others (issue 22).
    #[error("{0}")]
    Acl(#[from] crate::acl::AclError),
    /// Added after the others (issue 23).
    #[error("{0}")]
    Queue(#[from] crate::queue::QueueError),
    /// Added after the others (issue 35).
    #[error("{0}")]
    Secret(#[from] crate::secret::SecretError),
}

/// The whole scheduler state: a fold of `apply` over the log.
///
/// The encoding (snapshots, the state hash) holds the jobs, nodes and
/// counters; the [`JobIndexes`] are derived from the jobs, left out of it and
/// rebuilt when a state is decoded.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClusterState {
    next_job_id: JobId,
    jobs: JobMap,
    nodes: BTreeMap<String, Node>,
    /// Which job (or declared pair of jobs) holds each GPU. Derived from
    /// the jobs' allocations, kept as an index;
    /// [`ClusterState::check_invariants`] proves the two agree.
    gpu_holders: BTreeMap<GpuRef, GpuHolders>,
    /// Index of the last log entry applied, refused or not.
    last_index: u64,
    /// The latest time on an entry applied, refused or not: a new leader
    /// stamps later ([`crate::log_time`]). Bookkeeping about the log, not
    /// content: nothing `apply` decides reads it, so it is kept out of the
    /// hash and out of equality (snapshots before format 8 did not keep
    /// it), and carried by snapshots.
    #[serde(skip)]
    last_entry_at_ms: EntryTimeFloor,
    /// Bumped by every applied entry that changes what the scheduler must
    /// place or where it can place it (jobs arriving, ending, requeued or
    /// preempted; nodes registered, lost or recovered; allocations decided).
    /// The scheduling loop wakes when it moves.
    supply_demand_version: u64,
    /// The highest scheduling round decided so far, so a new leader goes on
    /// numbering where the last one stopped.
    last_round: u64,
    /// The policy an operator chose at run time (`SetPolicy`); `None`: the
    /// server's configured one.
    policy: Option<String>,
    /// Client requests applied recently, so a retry applies nothing twice.
    requests: RecentRequests,
    /// What the running policy keeps between rounds
    /// ([`crate::policy_memory`]). Encoded apart from the rest (a snapshot
    /// carries it after the state; the hash covers it once set), so a state
    /// that never had one encodes and hashes as before it existed.
    #[serde(skip)]
    policy_memory: PolicyMemorySlot,
    /// The tokens and their roles ([`crate::acl`]). Encoded apart from the
    /// rest (hashed once bootstrapped, a snapshot field), so a cluster that
    /// never turned ACLs on encodes and hashes as before they existed.
    #[serde(skip)]
    acl: Acl,
    /// The queues ([`crate::queue`]). Encoded apart like the tokens: a
    /// state that never had one encodes and hashes as before.
    #[serde(skip)]
    queues: Queues,
    /// The secrets, sealed ([`crate::secret`]). Encoded apart like the
    /// queues: a state that never had one encodes and hashes as before.
    #[serde(skip)]
    secrets: Secrets,
    #[serde(skip)]
    indexes: JobIndexes,
    /// What each queue's jobs hold and wait for, and the quota book, kept
    /// once there are queues ([`queue_index`]).
    #[serde(skip)]
    queue_index: QueueIndex,
    /// Every GPU on a live node, by type and node: derived from `nodes`,
    /// rebuilt when a node registers, is lost or recovers.
    #[serde(skip)]
    capacity: FreeGpus,
    /// The GPUs of `capacity` that no job holds: derived from `nodes` and
    /// `gpu_holders`, built when first read and then kept as GPUs are taken
    /// and given back (a state nobody schedules on never builds it).
    #[serde(skip)]
    free: FreeCache,
}

/// [`ClusterState`]'s latest entry time: any two compare equal (see the
/// field).
#[derive(Debug, Clone, Copy, Default)]
struct EntryTimeFloor(u64);

impl PartialEq for EntryTimeFloor {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A lazily built index of free GPUs. It is derived data: any two compare
/// equal (the state's equality is about what it derives from).
#[derive(Debug, Clone, Default)]
struct FreeCache(std::sync::OnceLock<FreeGpus>);

impl PartialEq for FreeCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Sets of job ids that the loops on the leader walk instead of every job
/// ever submitted (finished jobs pile up; a round must not cost more as they
/// do). Derived from `jobs`: `apply` updates the entries of the jobs an entry
/// touched, [`ClusterState::check_invariants`] proves they agree.
#[derive(Debug, Clone, Default, PartialEq)]
struct JobIndexes {
    /// Jobs not yet in a terminal state.
    unfinished: BTreeSet<JobId>,
    /// Jobs holding an allocation.
    allocated: BTreeSet<JobId>,
    /// Of those, the ones that may not be preempted (a round reads them
    /// without walking every allocated job).
    allocated_unpreemptible: BTreeSet<JobId>,
    /// Jobs with a worker recorded as running (a cancelled job's workers
    /// stay recorded until their exits are).
    with_running_workers: BTreeSet<JobId>,
    /// (`not_before_ms`, job) of waiting jobs that carry a retry backoff,
    /// ended or not.
    backoffs: BTreeSet<(u64, JobId)>,
    /// (`finished_at_ms`, job) of ended jobs with no worker recorded as
    /// running: those a `RemoveJob` may remove, oldest first.
    removable: BTreeSet<(u64, JobId)>,
    /// Unfinished jobs waiting that have had no service yet (no
    /// allocation, no GPU-time), most important first: higher priority,
    /// then earlier submission, then id. Every job in it has attained
    /// nothing, so a least-attained-service ranking takes them in this
    /// order without reading them (Tiresias's, issue 26).
    never_served: BTreeSet<(Reverse<i32>, u64, JobId)>,
    /// The other unfinished jobs: holding GPUs, or waiting after service;
    /// with what a least-attained-service ranking reads of each, so a
    /// ranking pass reads none of the jobs it does not take.
    served: BTreeMap<JobId, Service>,
    /// Unfinished jobs without an allocation, higher priority first, then
    /// by id (submission order): the order FIFO takes them in, read only
    /// as far as a round gets (a long queue costs a round nothing when
    /// its head does not fit).
    waiting: BTreeSet<(Reverse<i32>, JobId)>,
    /// Each job's place in the sets above (a job in none: absent), so an
    /// entry that moves a job in none of them costs one lookup.
    member_of: BTreeMap<JobId, Membership>,
}

/// Which of [`JobIndexes`]' sets hold a job, and under which key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Membership {
    unfinished: bool,
    allocated: bool,
    allocated_unpreemptible: bool,
    with_running_workers: bool,
    backoff: Option<u64>,
    removable: Option<u64>,
    /// In `never_served`, with its priority and submission time.
    never_served: Option<(i32, u64)>,
    served: bool,
    /// In `waiting`, with its priority.
    waiting: Option<i32>,
}

impl Membership {
    fn of(job: Option<&Job>) -> Membership {
        let Some(j) = job else {
            return Membership::default();
        };
        let terminal = j.state.is_terminal();
        let allocated = j.allocation.is_some();
        let with_running_workers = j.workers.values().any(|w| w.state == WorkerState::Running);
        Membership {
            unfinished: !terminal,
            allocated,
            allocated_unpreemptible: allocated && !j.spec.preemptible,
            with_running_workers,
            backoff: j.not_before_ms.filter(|_| !terminal && !allocated),
            removable: (terminal && !with_running_workers)
                .then(|| j.finished_at_ms.unwrap_or(j.submitted_at_ms)),
            never_served: (!terminal && !allocated && j.service_gpu_ms == 0)
                .then_some((j.spec.priority, j.submitted_at_ms)),
            served: !terminal && (allocated || j.service_gpu_ms > 0),
            waiting: (!terminal && !allocated).then_some(j.spec.priority),
        }
    }
}

/// What a least-attained-service ranking (Tiresias's) reads of a job:
/// kept in the state's index of the unfinished jobs that hold GPUs or have
/// had service ([`ClusterState::served_unfinished`]), so that a ranking
/// pass over hundreds of them reads none from the job map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    pub priority: i32,
    /// GPUs of its minimum workers (at least 1).
    pub min_gpus: u64,
    /// [`Job::service_gpu_ms`]: GPU-time of the allocations that ended.
    pub service_gpu_ms: u64,
    pub queued_since_ms: u64,
    pub submitted_at_ms: u64,
    /// While it holds GPUs: how many, and when they were decided.
    pub held: Option<(u64, u64)>,
}

impl Service {
    pub fn of(job: &Job) -> Service {
        Service {
            priority: job.spec.priority,
            min_gpus: u64::from(job.spec.gpus.saturating_mul(job.spec.workers.min).max(1)),
            service_gpu_ms: job.service_gpu_ms,
            queued_since_ms: job.queued_since_ms,
            submitted_at_ms: job.submitted_at_ms,
            held: job.allocation.as_ref().map(|a| {
                (
                    u64::try_from(a.gpus.len()).unwrap_or(u64::MAX),
                    a.decided_at_ms,
                )
            }),
        }
    }

    /// [`Job::attained_gpu_ms`], from this.
    pub fn attained_gpu_ms(&self, now_ms: u64) -> u64 {
        self.service_gpu_ms
            + self.held.map_or(0, |(gpus, decided_at_ms)| {
                gpus.saturating_mul(now_ms.saturating_sub(decided_at_ms))
            })
    }
}

/// GPUs of each type in `gpus`, the type names borrowed from `nodes` (a
/// GPU of a node the state does not know counts as type ""): what a
/// decision's quota check compares, without allocating.
fn type_counts<'a>(nodes: &'a BTreeMap<String, Node>, gpus: &[GpuRef]) -> TypeCounts<'a> {
    let mut counts = TypeCounts::new();
    let mut last: Option<(&str, &'a Node)> = None;
    for g in gpus {
        // Allocations are sorted, so one node lookup per node.
        let node = match last {
            Some((name, node)) if name == g.node => Some(node),
            _ => nodes.get(&g.node),
        };
        if let Some(node) = node {
            last = Some((g.node.as_str(), node));
        }
        let gpu_type = node
            .and_then(|n| n.gpus.get(&g.index))
            .map_or("", String::as_str);
        count_one(&mut counts, gpu_type);
    }
    counts
}

/// Counts one more GPU of `gpu_type` in `counts`.
fn count_one<'n>(counts: &mut TypeCounts<'n>, gpu_type: &'n str) {
    match counts.iter_mut().find(|(t, _)| *t == gpu_type) {
        Some((_, n)) => *n += 1,
        None => counts.push((gpu_type, 1)),
    }
}

/// The jobs by id. Each job is boxed, so the map's nodes hold ids and
/// pointers, not jobs (about 860 bytes each, 9.5 KB a node): a lookup
/// descends through small nodes that stay in cache and then reads the
/// one job it wants (BENCHMARKS, "The overloaded multi-GPU run").
pub type JobMap = BTreeMap<JobId, Box<Job>>;

/// GPUs by type name, the names borrowed from the nodes.
type TypeCounts<'n> = smallvec::SmallVec<[(&'n str, u32); 2]>;

fn count_of(counts: &[(&str, u32)], gpu_type: &str) -> u32 {
    counts
        .iter()
        .find(|(t, _)| *t == gpu_type)
        .map_or(0, |(_, n)| *n)
}

/// [`type_counts`], owned: what a charge keeps and callers outside the
/// state read.
pub(crate) fn gpus_by_type(
    nodes: &BTreeMap<String, Node>,
    gpus: &[GpuRef],
) -> BTreeMap<String, u32> {
    type_counts(nodes, gpus)
        .into_iter()
        .map(|(t, n)| (t.to_string(), n))
        .collect()
}

impl JobIndexes {
    fn of(jobs: &JobMap) -> JobIndexes {
        let mut indexes = JobIndexes::default();
        for (id, job) in jobs {
            indexes.update(*id, Some(job));
        }
        indexes
    }

    /// Puts `id` in exactly the sets that `job` (None: removed) belongs to.
    fn update(&mut self, id: JobId, job: Option<&Job>) {
        let now = Membership::of(job);
        // What a served job has had changes without its sets changing.
        if let (true, Some(job)) = (now.served, job) {
            let service = Service::of(job);
            match self.served.get_mut(&id) {
                Some(kept) if *kept == service => {}
                Some(kept) => *kept = service,
                None => {
                    self.served.insert(id, service);
                }
            }
        }
        let before = if now == Membership::default() {
            self.member_of.remove(&id).unwrap_or_default()
        } else {
            match self.member_of.insert(id, now) {
                Some(before) if before == now => return,
                before => before.unwrap_or_default(),
            }
        };
        let set = |set: &mut BTreeSet<JobId>, was: bool, is: bool| {
            if was != is {
                if is {
                    set.insert(id);
                } else {
                    set.remove(&id);
                }
            }
        };
        set(&mut self.unfinished, before.unfinished, now.unfinished);
        set(&mut self.allocated, before.allocated, now.allocated);
        set(
            &mut self.allocated_unpreemptible,
            before.allocated_unpreemptible,
            now.allocated_unpreemptible,
        );
        set(
            &mut self.with_running_workers,
            before.with_running_workers,
            now.with_running_workers,
        );
        let keyed = |set: &mut BTreeSet<(u64, JobId)>, was: Option<u64>, is: Option<u64>| {
            if was != is {
                if let Some(t) = was {
                    set.remove(&(t, id));
                }
                if let Some(t) = is {
                    set.insert((t, id));
                }
            }
        };
        keyed(&mut self.backoffs, before.backoff, now.backoff);
        keyed(&mut self.removable, before.removable, now.removable);
        if before.served && !now.served {
            self.served.remove(&id);
        }
        if before.waiting != now.waiting {
            if let Some(priority) = before.waiting {
                self.waiting.remove(&(Reverse(priority), id));
            }
            if let Some(priority) = now.waiting {
                self.waiting.insert((Reverse(priority), id));
            }
        }
        if before.never_served != now.never_served {
            if let Some((priority, at_ms)) = before.never_served {
                self.never_served.remove(&(Reverse(priority), at_ms, id));
            }
            if let Some((priority, at_ms)) = now.never_served {
                self.never_served.insert((Reverse(priority), at_ms, id));
            }
        }
    }
}

/// The encoded fields of [`ClusterState`], in order.
#[derive(Deserialize)]
struct EncodedClusterState {
    next_job_id: JobId,
    jobs: JobMap,
    nodes: BTreeMap<String, Node>,
    gpu_holders: BTreeMap<GpuRef, GpuHolders>,
    last_index: u64,
    supply_demand_version: u64,
    last_round: u64,
    policy: Option<String>,
    requests: RecentRequests,
}

impl<'de> Deserialize<'de> for ClusterState {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let e = EncodedClusterState::deserialize(deserializer)?;
        let indexes = JobIndexes::of(&e.jobs);
        let capacity = FreeGpus::of_nodes(&e.nodes);
        Ok(ClusterState {
            next_job_id: e.next_job_id,
            jobs: e.jobs,
            nodes: e.nodes,
            gpu_holders: e.gpu_holders,
            last_index: e.last_index,
            // Postcard snapshots (before format 8) did not keep it.
            last_entry_at_ms: EntryTimeFloor(0),
            supply_demand_version: e.supply_demand_version,
            last_round: e.last_round,
            policy: e.policy,
            requests: e.requests,
            policy_memory: PolicyMemorySlot::default(),
            acl: Acl::default(),
            queues: Queues::default(),
            secrets: Secrets::default(),
            indexes,
            queue_index: QueueIndex::default(),
            capacity,
            free: FreeCache::default(),
        })
    }
}

/// How a [`ApplyError::TooLarge`] size is counted: the lists are counted
/// in entries, every other field is a string counted in bytes.
fn size_unit(field: &str) -> &'static str {
    match field {
        "node gpus" | "node failed gpus" | "progress samples" => "entries",
        _ => "bytes long",
    }
}

fn check_len(field: &'static str, s: &str, limit: usize) -> Result<(), ApplyError> {
    if s.len() > limit {
        return Err(ApplyError::TooLarge {
            field: field.to_string(),
            len: s.len(),
            limit,
        });
    }
    Ok(())
}

/// Checks a node's name, address and GPUs against the limits; returns its
/// GPU types by index.
pub fn validate_node(
    name: &str,
    address: &str,
    gpus: &[Gpu],
) -> Result<BTreeMap<u32, String>, ApplyError> {
    if name.is_empty() {
        return Err(ApplyError::Invalid {
            field: "node name".into(),
            reason: "empty".into(),
        });
    }
    check_len("node name", name, limits::NODE_NAME_MAX_LEN)?;
    check_len("node address", address, limits::NODE_ADDRESS_MAX_LEN)?;
    if gpus.len() > limits::NODE_GPUS_MAX {
        return Err(ApplyError::TooLarge {
            field: "node gpus".into(),
            len: gpus.len(),
            limit: limits::NODE_GPUS_MAX,
        });
    }
    let mut inventory = BTreeMap::new();
    for gpu in gpus {
        check_len(
            "gpu type",
            &gpu.gpu_type,
            crate::spec::limits::GPU_TYPE_MAX_LEN,
        )?;
        if inventory.insert(gpu.index, gpu.gpu_type.clone()).is_some() {
            return Err(ApplyError::DuplicateGpu {
                node: name.to_string(),
                index: gpu.index,
            });
        }
    }
    Ok(inventory)
}

/// Checks the failed GPUs of a node's report: within the inventory's
/// limits, each index once and none also offered (`offered`: what
/// [`validate_node`] returns for the GPUs it offers).
pub fn validate_failed_gpus(
    node: &str,
    offered: &BTreeMap<u32, String>,
    failed: &[FailedGpu],
) -> Result<BTreeMap<u32, FailedGpu>, ApplyError> {
    if failed.len() > limits::NODE_GPUS_MAX {
        return Err(ApplyError::TooLarge {
            field: "node failed gpus".into(),
            len: failed.len(),
            limit: limits::NODE_GPUS_MAX,
        });
    }
    let mut out = BTreeMap::new();
    for f in failed {
        check_len(
            "gpu type",
            &f.gpu_type,
            crate::spec::limits::GPU_TYPE_MAX_LEN,
        )?;
        if f.reason.len() > limits::REASON_MAX_LEN {
            return Err(ApplyError::TooLarge {
                field: format!("node {node} gpu {} failure reason", f.index),
                len: f.reason.len(),
                limit: limits::REASON_MAX_LEN,
            });
        }
        if offered.contains_key(&f.index) || out.insert(f.index, f.clone()).is_some() {
            return Err(ApplyError::DuplicateGpu {
                node: node.to_string(),
                index: f.index,
            });
        }
    }
    Ok(out)
}

impl ClusterState {
    pub fn new() -> Self {
        ClusterState {
            next_job_id: 1,
            ..Default::default()
        }
    }

    /// Jobs ever submitted (ids are given from 1, in submission order;
    /// removed jobs count too).
    pub fn jobs_submitted(&self) -> u64 {
        self.next_job_id.saturating_sub(1)
    }

    pub fn jobs(&self) -> &JobMap {
        &self.jobs
    }

    /// Jobs not yet in a terminal state, in submission order.
    pub fn unfinished_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexed(&self.indexes.unfinished)
    }

    /// The unfinished jobs waiting that have had no service yet (never
    /// allocated, or allocated and released before any GPU-time), most
    /// important first: higher priority, then earlier submission, then
    /// id. With [`Self::served_unfinished_jobs`], every unfinished job,
    /// once.
    pub fn never_served_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexes
            .never_served
            .iter()
            .filter_map(|(_, _, id)| self.job(*id))
    }

    /// The unfinished jobs that hold GPUs or have had service, in
    /// submission order: those [`Self::never_served_jobs`] leaves out.
    pub fn served_unfinished_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexes.served.keys().filter_map(|id| self.job(*id))
    }

    /// The same jobs as [`Self::served_unfinished_jobs`], each as what a
    /// least-attained-service ranking reads of it, without reading the
    /// jobs (the state keeps it up to date with them).
    pub fn served_unfinished(&self) -> impl Iterator<Item = (JobId, &Service)> + '_ {
        self.indexes.served.iter().map(|(id, s)| (*id, s))
    }

    /// The jobs waiting for GPUs (unfinished, without an allocation),
    /// higher priority first, then in submission order.
    pub fn waiting_jobs_by_priority(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexes
            .waiting
            .iter()
            .filter_map(|(_, id)| self.job(*id))
    }

    /// How many jobs wait for GPUs (unfinished, without an allocation).
    pub fn queued_count(&self) -> usize {
        self.indexes.unfinished.len() - self.indexes.allocated.len()
    }

    /// Jobs holding an allocation, in submission order.
    pub fn allocated_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexed(&self.indexes.allocated)
    }

    /// The jobs holding GPUs that may not be preempted
    /// (`preemptible: false`), in submission order.
    pub fn allocated_unpreemptible_jobs(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexed(&self.indexes.allocated_unpreemptible)
    }

    /// Jobs with a worker recorded as running, in submission order.
    pub fn jobs_with_running_workers(&self) -> impl Iterator<Item = &Job> + '_ {
        self.indexed(&self.indexes.with_running_workers)
    }

    /// The ended jobs that retention removes at `now_ms` (issue 23): those
    /// finished at least `retain_ms` ago, and the oldest beyond the newest
    /// `keep_max` ended ones; oldest first, at most `limit`. A job whose
    /// workers are still recorded as running is not among them (its exits
    /// are still to come).
    pub fn jobs_due_for_removal(
        &self,
        now_ms: u64,
        retain_ms: u64,
        keep_max: usize,
        limit: usize,
    ) -> Vec<JobId> {
        let beyond_max = self.ended_job_count().saturating_sub(keep_max);
        self.ended_jobs()
            .enumerate()
            .take_while(|(i, (finished_ms, _))| {
                *i < beyond_max || now_ms.saturating_sub(*finished_ms) >= retain_ms
            })
            .take(limit)
            .map(|(_, (_, id))| id)
            .collect()
    }

    /// The ended jobs whose workers have all exited, as (`finished_at_ms`,
    /// id), oldest first: what retention removes, and whose logs it
    /// removes, read from an index `apply` keeps.
    pub fn ended_jobs(&self) -> impl Iterator<Item = (u64, JobId)> + '_ {
        self.indexes.removable.iter().copied()
    }

    /// How many ended jobs the state holds (those retention may remove).
    pub fn ended_job_count(&self) -> usize {
        self.indexes.removable.len()
    }

    /// Whether job `id` was submitted once and has been removed since.
    pub fn was_removed(&self, id: JobId) -> bool {
        id >= 1 && id < self.next_job_id && !self.jobs.contains_key(&id)
    }

    /// The earliest time after `now_ms` at which a waiting job's retry
    /// backoff ends: the scheduling loop runs a round then, without waiting
    /// for its tick.
    pub fn next_backoff_end_ms(&self, now_ms: u64) -> Option<u64> {
        self.indexes
            .backoffs
            .range((now_ms.saturating_add(1), 0)..)
            .next()
            .map(|(t, _)| *t)
    }

    /// The jobs of an index, in id order. A large index (an eighth of the
    /// jobs or more) is joined with the job map in one ordered walk of
    /// both, seeking past long runs of jobs not in it; a small one looks
    /// each id up.
    fn indexed<'a>(&'a self, ids: &'a BTreeSet<JobId>) -> IndexedJobs<'a> {
        if ids.len().saturating_mul(8) >= self.jobs.len() {
            IndexedJobs::Walk {
                ids: ids.iter(),
                map: &self.jobs,
                jobs: self.jobs.range(..).peekable(),
            }
        } else {
            IndexedJobs::Lookup {
                ids: ids.iter(),
                jobs: &self.jobs,
            }
        }
    }

    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id).map(|j| &**j)
    }

    pub fn nodes(&self) -> &BTreeMap<String, Node> {
        &self.nodes
    }

    pub fn gpu_holders(&self) -> &BTreeMap<GpuRef, GpuHolders> {
        &self.gpu_holders
    }

    /// Index of the last entry applied (0 before any).
    pub fn last_index(&self) -> u64 {
        self.last_index
    }

    /// The latest time on an entry applied (0: none, or a snapshot written
    /// before it was kept): a leader stamps later.
    pub fn last_entry_at_ms(&self) -> u64 {
        self.last_entry_at_ms.0
    }

    /// See the field: moves whenever a scheduling round could decide
    /// something new.
    pub fn supply_demand_version(&self) -> u64 {
        self.supply_demand_version
    }

    /// The highest scheduling round decided so far (0: none).
    pub fn last_round(&self) -> u64 {
        self.last_round
    }

    /// Every GPU on a live node, held or not: what an empty cluster offers.
    pub fn capacity(&self) -> &FreeGpus {
        &self.capacity
    }

    /// Every GPU on a live node that no job holds.
    pub fn free_gpus(&self) -> &FreeGpus {
        self.free
            .0
            .get_or_init(|| FreeGpus::of_holders(&self.nodes, &self.gpu_holders))
    }

    /// The policy chosen at run time with `SetPolicy`, if any.
    pub fn policy(&self) -> Option<&str> {
        self.policy.as_deref()
    }

    /// The running policy's memory, as last recorded by a decision.
    pub fn policy_memory(&self) -> Option<&PolicyMemory> {
        self.policy_memory.memory.as_ref()
    }

    /// Whether its postcard form (snapshot format 7, what the release
    /// before reads) carries it whole: it holds nothing of what is encoded
    /// apart from that form (jobs' resource limits and log rotation,
    /// submitters, nodes' gone GPUs, tokens). A snapshot of a state that
    /// it does not carry is never written in format 7: the reader would
    /// hold another state, and hash to another.
    pub fn postcard_carries_whole(&self) -> bool {
        !self.acl.is_bootstrapped()
            && self.queues.is_unset()
            && self.secrets.is_unset()
            && self.jobs.values().all(|j| {
                j.spec.resources.is_unset()
                    && j.spec.logs.is_unset()
                    && j.spec.queue.is_empty()
                    && j.spec.secret_env.is_empty()
                    && j.spec.preemptible
                    && j.submitted_by.is_none()
                    && j.trace_parent.is_none()
            })
            && self.nodes.values().all(|n| n.gone_gpus.is_empty())
    }

    /// The tokens the cluster knows ([`crate::acl`]).
    pub fn acl(&self) -> &Acl {
        &self.acl
    }

    /// The cluster's queues ([`crate::queue`]).
    pub fn queues(&self) -> &Queues {
        &self.queues
    }

    /// The cluster's secrets, sealed ([`crate::secret`]).
    pub fn secrets(&self) -> &Secrets {
        &self.secrets
    }

    /// GPUs each queue's jobs hold, by queue, then type (a job naming no
    /// queue is the default queue's), summed afresh from the holding jobs.
    pub fn queue_usage(&self) -> BTreeMap<String, BTreeMap<String, u32>> {
        self.queue_index.usage()
    }

    /// GPUs of each type in `gpus` (a GPU the state does not know counts
    /// as type "").
    pub fn gpus_by_type(&self, gpus: &[GpuRef]) -> BTreeMap<String, u32> {
        gpus_by_type(&self.nodes, gpus)
    }

    /// The jobs waiting for GPUs in queue `queue` (unfinished, holding
    /// none), higher priority first, then in submission order.
    pub fn waiting_in_queue<'a>(&'a self, queue: &str) -> impl Iterator<Item = &'a Job> + 'a {
        self.queue_index
            .waiting_in(queue)
            .filter_map(|id| self.job(id))
    }

    /// What each job of queue `queue` holding GPUs holds, by job id,
    /// without looking the jobs up (kept once there are queues).
    pub fn holdings_in_queue<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (JobId, HeldGpus<'a>)> + 'a {
        self.queue_index.holding_in(queue)
    }

    /// What the preemptible jobs of queue `queue` holding GPUs hold, by
    /// type: each size (GPUs of that type one job holds), smallest first,
    /// and how many jobs hold it (what reclaim could free).
    pub fn preemptible_sizes_in_queue<'a>(
        &'a self,
        queue: &str,
    ) -> impl Iterator<Item = (&'a String, &'a BTreeMap<u32, u32>)> + 'a {
        self.queue_index.preemptible_sizes_in(queue)
    }

    /// The queues with jobs waiting for GPUs, by name.
    pub fn queues_with_waiting_jobs(&self) -> impl Iterator<Item = &String> + '_ {
        self.queue_index.queues_with_waiting()
    }

    /// The quotas as they stand ([`crate::quota`]): `None` while no queue
    /// was made or changed, when nothing is limited.
    pub fn quota_book(&self) -> Option<QuotaBook> {
        self.queue_index.book().cloned()
    }

    /// Whether any node (alive or lost) has a GPU of `gpu_type`: the types
    /// a queue's quota may name.
    pub fn knows_gpu_type(&self, gpu_type: &str) -> bool {
        self.nodes
            .values()
            .any(|n| n.gpus.values().any(|t| t == gpu_type))
    }

    /// The policy-memory slot, as a snapshot carries it.
    pub fn policy_memory_slot(&self) -> &PolicyMemorySlot {
        &self.policy_memory
    }

    /// Puts back the slot a snapshot carried ([`Self::policy_memory_slot`]).
    pub fn restore_policy_memory(&mut self, slot: PolicyMemorySlot) {
        self.policy_memory = slot;
    }

    /// A digest of the whole state. Two replicas that applied the same
    /// entries share it; any difference in content changes it.
    pub fn state_hash(&self) -> StateHash {
        let mut hasher = blake3::Hasher::new();
        // postcard over ordered maps is a canonical encoding of the state.
        let mut writer = HashWriter(&mut hasher);
        // Encoding into a hasher cannot fail: every type here is serialisable
        // and the writer never errors.
        let _ = postcard::to_io(self, &mut writer);
        // The policy memory once one was ever recorded: states of logs
        // without one hash as they did before it existed.
        if !self.policy_memory.is_unset() {
            let _ = postcard::to_io(&self.policy_memory, &mut writer);
        }
        // The jobs' resource limits, which the spec's binary form leaves out
        // (see `JobSpec`), once any job has them: states without them hash
        // as they did before they existed.
        let limits: Vec<(JobId, &crate::spec::Resources)> = self
            .jobs
            .iter()
            .filter(|(_, job)| !job.spec.resources.is_unset())
            .map(|(id, job)| (*id, &job.spec.resources))
            .collect();
        if !limits.is_empty() {
            let _ = postcard::to_io(&limits, &mut writer);
        }
        // Likewise their log rotation, once any job asks for one.
        let logs: Vec<(JobId, &crate::spec::LogLimits)> = self
            .jobs
            .iter()
            .filter(|(_, job)| !job.spec.logs.is_unset())
            .map(|(id, job)| (*id, &job.spec.logs))
            .collect();
        if !logs.is_empty() {
            let _ = postcard::to_io(&logs, &mut writer);
        }
        // Likewise the nodes' gone GPUs, once a node has one.
        let gone: Vec<(&String, &BTreeMap<u32, GoneGpu>)> = self
            .nodes
            .iter()
            .filter(|(_, node)| !node.gone_gpus.is_empty())
            .map(|(name, node)| (name, &node.gone_gpus))
            .collect();
        if !gone.is_empty() {
            let _ = postcard::to_io(&gone, &mut writer);
        }
        // Likewise who submitted the jobs, once a job has a submitter.
        let submitters: Vec<(JobId, &String)> = self
            .jobs
            .iter()
            .filter_map(|(id, job)| Some((*id, job.submitted_by.as_ref()?)))
            .collect();
        if !submitters.is_empty() {
            let _ = postcard::to_io(&submitters, &mut writer);
        }
        // Likewise the tokens, once the ACLs are bootstrapped, and the
        // queues tokens are limited to, once one is.
        if self.acl.is_bootstrapped() {
            let _ = postcard::to_io(&self.acl, &mut writer);
            let limited: Vec<(&String, &std::collections::BTreeSet<String>)> = self
                .acl
                .tokens()
                .iter()
                .filter(|(_, t)| !t.queues.is_empty())
                .map(|(name, t)| (name, &t.queues))
                .collect();
            if !limited.is_empty() {
                let _ = postcard::to_io(&limited, &mut writer);
            }
        }
        // Likewise the jobs' queues, once a job names one, and the queues,
        // once there is one.
        let job_queues: Vec<(JobId, &String)> = self
            .jobs
            .iter()
            .filter(|(_, job)| !job.spec.queue.is_empty())
            .map(|(id, job)| (*id, &job.spec.queue))
            .collect();
        if !job_queues.is_empty() {
            let _ = postcard::to_io(&job_queues, &mut writer);
        }
        if !self.queues.is_unset() {
            let _ = postcard::to_io(&self.queues, &mut writer);
        }
        // And the jobs that may not be preempted, once there is one.
        let fixed: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, job)| !job.spec.preemptible)
            .map(|(id, _)| *id)
            .collect();
        if !fixed.is_empty() {
            let _ = postcard::to_io(&fixed, &mut writer);
        }
        // And the jobs' traces, once a job has one.
        let traces: Vec<(JobId, &String)> = self
            .jobs
            .iter()
            .filter_map(|(id, job)| Some((*id, job.trace_parent.as_ref()?)))
            .collect();
        if !traces.is_empty() {
            let _ = postcard::to_io(&traces, &mut writer);
        }
        // And the jobs' secret references and the secrets, once there is
        // one.
        let references: Vec<(JobId, &BTreeMap<String, crate::secret::SecretRef>)> = self
            .jobs
            .iter()
            .filter(|(_, job)| !job.spec.secret_env.is_empty())
            .map(|(id, job)| (*id, &job.spec.secret_env))
            .collect();
        if !references.is_empty() {
            let _ = postcard::to_io(&references, &mut writer);
        }
        if !self.secrets.is_unset() {
            let _ = postcard::to_io(&self.secrets, &mut writer);
        }
        StateHash(*hasher.finalize().as_bytes())
    }

    /// Applies one log entry at `index`. On `Err`, the state is unchanged
    /// except for `last_index`.
    ///
    /// An entry with a client's request id that was applied within the
    /// window with the same command changes nothing and yields
    /// [`Event::RequestRepeated`]; [`ClusterState::answer`] gives its
    /// client the first outcome.
    pub fn apply(&mut self, index: u64, entry: &LogEntry) -> Result<Vec<Event>, ApplyError> {
        self.last_index = index;
        self.last_entry_at_ms.0 = self.last_entry_at_ms.0.max(entry.at_ms);
        let Some(request_id) = &entry.request_id else {
            return self.apply_entry(entry);
        };
        crate::requests::validate_request_id(request_id)?;
        let command_digest = crate::requests::command_digest(&entry.command);
        if let Some(first) = self.requests.get(request_id, entry.at_ms) {
            if first.command_digest != command_digest {
                return Err(ApplyError::RequestIdReused {
                    request_id: request_id.clone(),
                    first_index: first.first_index,
                });
            }
            return Ok(vec![Event::RequestRepeated {
                request_id: request_id.clone(),
                first_index: first.first_index,
            }]);
        }
        let events = self.apply_entry(entry)?;
        self.requests.remember(
            request_id,
            Remembered {
                first_index: index,
                at_ms: entry.at_ms,
                command_digest,
                events: events.clone(),
            },
        );
        Ok(events)
    }

    /// What the client that proposed an entry is told: the entry's outcome,
    /// or for a repeated request (its outcome is [`Event::RequestRepeated`]
    /// alone) the outcome of the first. Call it right after `apply`.
    pub fn answer(
        &self,
        outcome: Result<Vec<Event>, ApplyError>,
    ) -> Result<Vec<Event>, ApplyError> {
        if let Ok([Event::RequestRepeated { request_id, .. }]) = outcome.as_deref() {
            // Just found in the window by `apply`, so remembered still.
            if let Some(first) = self.requests.remembered(request_id) {
                return Ok(first.events.clone());
            }
        }
        outcome
    }

    /// How many client requests are remembered (for metrics and tests).
    pub fn remembered_requests(&self) -> usize {
        self.requests.len()
    }

    /// Applies an entry that is not a repeated request.
    fn apply_entry(&mut self, entry: &LogEntry) -> Result<Vec<Event>, ApplyError> {
        // What a decision's quota pre-check counted is for this entry's
        // charges only.
        self.queue_index.start_entry();
        let events = self.apply_command(entry)?;
        // Every change to a job names it in an event (or in the command);
        // progress changes no index.
        if !matches!(entry.command, Command::ReportProgress { .. }) {
            let mut touched: Vec<JobId> = events
                .iter()
                .filter_map(Event::job_id)
                .chain(entry.command.job_id())
                .collect();
            touched.sort_unstable();
            touched.dedup();
            for id in touched {
                let job = self.jobs.get(&id).map(|j| &**j);
                self.indexes.update(id, job);
                self.queue_index.update(id, job, &self.nodes);
            }
        }
        if let Some(name) = entry.command.node_name() {
            // Only the named node's GPUs change in the indexes (a job
            // preempted on another node already gave its GPUs back there).
            let node = self.nodes.get(name);
            self.capacity.replace_node(name, node, |_| true);
            if let Some(free) = self.free.0.get_mut() {
                let holders = &self.gpu_holders;
                free.replace_node(name, node, |index| {
                    !holders.contains_key(&GpuRef {
                        node: name.to_string(),
                        index,
                    })
                });
            }
            // The pool beyond the quotas moved, and a held GPU's type may
            // have changed under its job.
            self.queue_index
                .recharge(&self.jobs, &self.nodes, &self.queues, &self.capacity);
        }
        if matches!(
            entry.command,
            Command::CreateQueue { .. } | Command::UpdateQueue { .. } | Command::DeleteQueue { .. }
        ) {
            self.queue_index
                .recharge(&self.jobs, &self.nodes, &self.queues, &self.capacity);
        }
        let moves_supply_or_demand = events.iter().any(|e| {
            !matches!(
                e,
                Event::WorkerStarted { .. }
                    | Event::JobProgressReported { .. }
                    | Event::PolicyMemoryRefused { .. }
                    | Event::AclBootstrapped { .. }
                    | Event::TokenCreated { .. }
                    | Event::TokenRevoked { .. }
                    | Event::MembershipChangeRecorded { .. }
                    | Event::SecretPut { .. }
                    | Event::SecretDeleted { .. }
            )
        });
        if moves_supply_or_demand {
            self.supply_demand_version += 1;
        }
        Ok(events)
    }

    fn apply_command(&mut self, entry: &LogEntry) -> Result<Vec<Event>, ApplyError> {
        let at_ms = entry.at_ms;
        match &entry.command {
            Command::RegisterNode {
                name,
                address,
                gpus,
                note,
            } => self.register_node(name, address, gpus, note, at_ms),
            Command::RecordNodeInventory {
                name,
                address,
                gpus,
                failed,
                note,
            } => self.record_node_inventory(name, address, gpus, failed, note, at_ms),
            Command::MarkNodeLost { name, reason } => self.mark_node_lost(name, reason, at_ms),
            Command::MarkNodeRecovered { name } => self.mark_node_recovered(name),
            Command::BootstrapAcl { name, secret_hash } => {
                self.acl
                    .bootstrap(name, *secret_hash, at_ms, entry.actor.as_ref())?;
                Ok(vec![Event::AclBootstrapped { name: name.clone() }])
            }
            Command::CreateToken {
                name,
                role,
                secret_hash,
                ttl_ms,
                queues,
            } => {
                let known = &self.queues;
                let expires_at_ms = self.acl.create(
                    name,
                    *role,
                    *secret_hash,
                    *ttl_ms,
                    queues,
                    |q| known.exists(q),
                    at_ms,
                    entry.actor.as_ref(),
                )?;
                Ok(vec![Event::TokenCreated {
                    name: name.clone(),
                    role: *role,
                    expires_at_ms,
                }])
            }
            Command::RevokeToken { name } => {
                self.acl.revoke(name, at_ms)?;
                Ok(vec![Event::TokenRevoked { name: name.clone() }])
            }
            Command::RecordMembershipChange {
                member,
                change,
                membership_index,
            } => {
                check_len("change", change, limits::REASON_MAX_LEN)?;
                Ok(vec![Event::MembershipChangeRecorded {
                    member: *member,
                    change: change.clone(),
                    membership_index: *membership_index,
                }])
            }
            Command::CreateQueue { name, spec } => {
                spec.validate(|t| self.knows_gpu_type(t))?;
                self.queues
                    .create(name, spec, at_ms, entry.actor.as_ref())?;
                Ok(vec![Event::QueueCreated { name: name.clone() }])
            }
            Command::UpdateQueue { name, spec } => {
                spec.validate(|t| self.knows_gpu_type(t))?;
                self.queues
                    .update(name, spec, at_ms, entry.actor.as_ref())?;
                Ok(vec![Event::QueueUpdated { name: name.clone() }])
            }
            Command::DeleteQueue { name } => {
                let unfinished: Vec<JobId> = self
                    .unfinished_jobs()
                    .filter(|j| j.spec.queue == *name)
                    .map(|j| j.id)
                    .collect();
                self.queues.delete(name, &unfinished)?;
                Ok(vec![Event::QueueDeleted { name: name.clone() }])
            }
            Command::PutSecret {
                name,
                values,
                queue,
                replaces_revision,
            } => {
                if !queue.is_empty() && !self.queues.exists(queue) {
                    return Err(ApplyError::Invalid {
                        field: "queue".into(),
                        reason: format!("no queue is named {queue:?} (keel queue list shows them)"),
                    });
                }
                let revision = self.secrets.put(
                    name,
                    values,
                    queue,
                    *replaces_revision,
                    at_ms,
                    entry.actor.as_ref(),
                )?;
                Ok(vec![Event::SecretPut {
                    name: name.clone(),
                    keys: values.keys().cloned().collect(),
                    revision,
                }])
            }
            Command::DeleteSecret { name } => {
                let users: Vec<JobId> = self
                    .unfinished_jobs()
                    .filter(|j| j.spec.secret_env.values().any(|r| r.name == *name))
                    .map(|j| j.id)
                    .collect();
                self.secrets.delete(name, &users)?;
                Ok(vec![Event::SecretDeleted { name: name.clone() }])
            }
            Command::RemoveNode { name, force } => self.remove_node(name, *force, at_ms),
            Command::SetPolicy { name } => {
                check_len("policy", name, limits::POLICY_NAME_MAX_LEN)?;
                // The name's form only: which policies exist is the
                // scheduler's business (the API refuses an unknown name
                // before it is logged, and the leader keeps its policy if
                // it meets one), so adding or removing a policy never
                // changes how a log replays.
                if name.is_empty()
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                {
                    return Err(ApplyError::Invalid {
                        field: "policy".into(),
                        reason: format!(
                            "{name:?} is not a policy name (lower-case letters, digits and _)"
                        ),
                    });
                }
                let from = self.policy.replace(name.clone()).unwrap_or_default();
                // What a policy remembered belongs to the period it ran.
                if self
                    .policy_memory
                    .memory
                    .as_ref()
                    .is_some_and(|m| m.policy != *name)
                {
                    self.policy_memory = PolicyMemorySlot {
                        memory: None,
                        changed_at: self.last_index,
                    };
                }
                Ok(vec![Event::PolicyChanged {
                    from,
                    to: name.clone(),
                }])
            }
            Command::SubmitJob { spec } => {
                spec.validate()?;
                let job_id = self.next_job_id;
                // Once queues are kept, the index answers from its own
                // numbers and keeps the one for the job's slot.
                let known = match self.queue_index.admit_queue_name(job_id, &spec.queue) {
                    Some(known) => known,
                    None => spec.queue.is_empty() || self.queues.exists(&spec.queue),
                };
                if !known {
                    return Err(ApplyError::Invalid {
                        field: "queue".into(),
                        reason: format!(
                            "no queue is named {:?} (keel queue list shows them)",
                            spec.queue
                        ),
                    });
                }
                for (variable, reference) in &spec.secret_env {
                    self.secrets.check_use(
                        &format!("env.{variable}"),
                        reference,
                        entry.actor.as_ref(),
                        &spec.queue,
                    )?;
                }
                self.next_job_id += 1;
                self.jobs.insert(
                    job_id,
                    Box::new(Job {
                        id: job_id,
                        spec: spec.clone(),
                        state: JobState::Pending,
                        submitted_at_ms: at_ms,
                        started_at_ms: None,
                        finished_at_ms: None,
                        allocation: None,
                        last_epoch: 0,
                        workers: BTreeMap::new(),
                        progress: None,
                        progress_samples: 0,
                        perf: Default::default(),
                        retries: 0,
                        not_before_ms: None,
                        message: String::new(),
                        service_gpu_ms: 0,
                        queued_since_ms: at_ms,
                        submitted_by: entry.actor.clone(),
                        trace_parent: entry.trace_parent.clone(),
                    }),
                );
                Ok(vec![Event::JobSubmitted {
                    job_id,
                    name: spec.name.clone(),
                    user: spec.user.clone(),
                }])
            }
            Command::CancelJob { job_id, reason } => {
                check_len("reason", reason, limits::REASON_MAX_LEN)?;
                let job = self.live_job(*job_id, "cancelled")?;
                let released = job.close_allocation(at_ms);
                job.state = JobState::Cancelled;
                job.finished_at_ms = Some(at_ms);
                job.message = reason.clone();
                self.release(*job_id, released);
                Ok(vec![Event::JobCancelled {
                    job_id: *job_id,
                    reason: reason.clone(),
                }])
            }
            Command::DecideAllocation {
                based_on,
                policy,
                round,
                placements,
                memory,
            } => {
                check_len("policy", policy, limits::POLICY_NAME_MAX_LEN)?;
                if let Some(m) = memory {
                    if m.bytes.len() > POLICY_MEMORY_MAX_BYTES {
                        return Err(ApplyError::TooLarge {
                            field: "policy memory".into(),
                            len: m.bytes.len(),
                            limit: POLICY_MEMORY_MAX_BYTES,
                        });
                    }
                    if m.policy != *policy {
                        return Err(ApplyError::Invalid {
                            field: "policy memory".into(),
                            reason: format!(
                                "written by {:?}, not by the deciding policy {policy:?}",
                                m.policy
                            ),
                        });
                    }
                }
                self.last_round = self.last_round.max(*round);
                let mut events =
                    self.decide_allocation(*based_on, policy, *round, placements, at_ms);
                if let Some(m) = memory {
                    events.extend(self.record_policy_memory(*based_on, m));
                }
                Ok(events)
            }
            Command::RecordWorkerStarted {
                job_id,
                epoch,
                rank,
                node,
            } => {
                let job = self.current_epoch_job(*job_id, *epoch, *rank, "start workers")?;
                job.workers.insert(
                    *rank,
                    Worker {
                        epoch: *epoch,
                        node: node.clone(),
                        state: WorkerState::Running,
                        exit_code: None,
                    },
                );
                Ok(vec![Event::WorkerStarted {
                    job_id: *job_id,
                    epoch: *epoch,
                    rank: *rank,
                    node: node.clone(),
                }])
            }
            Command::RecordWorkerExited {
                job_id,
                epoch,
                rank,
                exit_code,
                reason,
                not_admitted,
            } => {
                check_len("reason", reason, limits::REASON_MAX_LEN)?;
                let job = self
                    .jobs
                    .get_mut(job_id)
                    .ok_or(ApplyError::UnknownJob(*job_id))?;
                // An exit is a fact about a worker that ran; record it even
                // after the job moved on, as long as the epoch was ever issued.
                if *epoch == 0 || *epoch > job.last_epoch {
                    return Err(ApplyError::StaleEpoch {
                        job_id: *job_id,
                        epoch: *epoch,
                        current: job.last_epoch,
                    });
                }
                let mut events = vec![Event::WorkerExited {
                    job_id: *job_id,
                    epoch: *epoch,
                    rank: *rank,
                    exit_code: *exit_code,
                    reason: reason.clone(),
                }];
                if *epoch == job.last_epoch {
                    let node = job
                        .workers
                        .get(rank)
                        .map(|w| w.node.clone())
                        .unwrap_or_default();
                    job.workers.insert(
                        *rank,
                        Worker {
                            epoch: *epoch,
                            node,
                            state: WorkerState::Exited,
                            exit_code: *exit_code,
                        },
                    );
                    let current = job.allocation.as_ref().is_some_and(|a| a.epoch == *epoch);
                    if current && *not_admitted && *exit_code != Some(0) {
                        events.extend(self.requeue_not_admitted(*job_id, *rank, reason, at_ms));
                    } else if current {
                        events.extend(self.settle_attempt(*job_id, *rank, *exit_code, at_ms));
                    }
                }
                Ok(events)
            }
            Command::ReportProgress { job_id, samples } => self.report_progress(*job_id, samples),
            Command::FinishJob {
                job_id,
                outcome,
                reason,
            } => {
                check_len("reason", reason, limits::REASON_MAX_LEN)?;
                let job = self.live_job(*job_id, "finished")?;
                let state = match outcome {
                    JobOutcome::Succeeded => JobState::Succeeded,
                    JobOutcome::Failed => JobState::Failed,
                };
                let released = job.close_allocation(at_ms);
                job.state = state;
                job.finished_at_ms = Some(at_ms);
                job.message = reason.clone();
                self.release(*job_id, released);
                Ok(vec![Event::JobFinished {
                    job_id: *job_id,
                    state,
                    reason: reason.clone(),
                }])
            }
            Command::RemoveJob { job_id } => {
                let job = self
                    .jobs
                    .get(job_id)
                    .ok_or(ApplyError::UnknownJob(*job_id))?;
                if !job.state.is_terminal() {
                    return Err(ApplyError::JobNotEnded {
                        job_id: *job_id,
                        state: job.state,
                    });
                }
                // Its workers' exits are still to be recorded.
                if let Some((rank, _)) = job
                    .workers
                    .iter()
                    .find(|(_, w)| w.state == WorkerState::Running)
                {
                    return Err(ApplyError::Invalid {
                        field: "job_id".into(),
                        reason: format!(
                            "job {job_id} has ended but its worker of rank {rank} is still recorded as running; it can be removed once its exit is"
                        ),
                    });
                }
                self.jobs.remove(job_id);
                Ok(vec![Event::JobRemoved { job_id: *job_id }])
            }
        }
    }

    /// A job that has not ended, for a transition named `action`.
    fn live_job(&mut self, job_id: JobId, action: &'static str) -> Result<&mut Job, ApplyError> {
        let job = self
            .jobs
            .get_mut(&job_id)
            .ok_or(ApplyError::UnknownJob(job_id))?;
        if job.state.is_terminal() {
            return Err(ApplyError::JobEnded {
                job_id,
                state: job.state,
                action: action.to_string(),
            });
        }
        Ok(job)
    }

    /// A job holding GPUs at allocation `epoch`, with `rank` inside it.
    fn current_epoch_job(
        &mut self,
        job_id: JobId,
        epoch: u64,
        rank: u32,
        action: &'static str,
    ) -> Result<&mut Job, ApplyError> {
        let job = self
            .jobs
            .get_mut(&job_id)
            .ok_or(ApplyError::UnknownJob(job_id))?;
        let Some(alloc) = &job.allocation else {
            return Err(ApplyError::JobNotRunning {
                job_id,
                state: job.state,
                action: action.to_string(),
            });
        };
        if alloc.epoch != epoch {
            return Err(ApplyError::StaleEpoch {
                job_id,
                epoch,
                current: alloc.epoch,
            });
        }
        let workers = u32::try_from(alloc.gpus.len()).unwrap_or(u32::MAX) / job.spec.gpus.max(1);
        if rank >= workers {
            return Err(ApplyError::RankOutOfRange {
                job_id,
                rank,
                workers,
            });
        }
        Ok(job)
    }

    /// A GPU no job holds any more is free again if its node is alive.
    fn give_back(&mut self, gpu: &GpuRef) {
        let Some(free) = self.free.0.get_mut() else {
            return;
        };
        let Some(node) = self.nodes.get(&gpu.node) else {
            return;
        };
        if node.state != NodeState::Alive {
            return;
        }
        if let Some(gpu_type) = node.gpus.get(&gpu.index) {
            free.release_one(gpu_type, gpu);
        }
    }

    /// Drops `job_id`'s hold on the GPUs of `allocation` (which the job no
    /// longer carries). A GPU that the same decision already handed to
    /// another job keeps its new holder; one left without holders is free
    /// again. A partner that shared these GPUs runs on alone.
    fn release(&mut self, job_id: JobId, allocation: Option<Allocation>) {
        let Some(a) = allocation else {
            return;
        };
        self.drop_holds(job_id, &a.gpus);
        if let Some(partner) = a.shared_with {
            self.unpair_if_left(partner);
        }
    }

    /// Removes `job_id` from the holders of `gpus`.
    fn drop_holds(&mut self, job_id: JobId, gpus: &[GpuRef]) {
        for gpu in gpus {
            let Some(holders) = self.gpu_holders.get(gpu).copied() else {
                continue;
            };
            if !holders.contains(job_id) {
                continue;
            }
            match holders.without(job_id) {
                Some(rest) => {
                    self.gpu_holders.insert(gpu.clone(), rest);
                }
                None => {
                    self.gpu_holders.remove(gpu);
                    self.give_back(gpu);
                }
            }
        }
    }

    /// Clears `job_id`'s partner when the partner no longer shares its GPUs
    /// (it ended, was preempted or moved): the job runs on alone, in the
    /// same epoch.
    fn unpair_if_left(&mut self, job_id: JobId) {
        let Some(partner) = self
            .jobs
            .get(&job_id)
            .and_then(|j| j.allocation.as_ref())
            .and_then(|a| a.shared_with)
        else {
            return;
        };
        let mine = self
            .jobs
            .get(&job_id)
            .and_then(|j| j.allocation.as_ref())
            .map(|a| &a.gpus);
        let still_shared = self
            .jobs
            .get(&partner)
            .and_then(|p| p.allocation.as_ref())
            .is_some_and(|a| a.shared_with == Some(job_id) && Some(&a.gpus) == mine);
        if !still_shared {
            if let Some(a) = self
                .jobs
                .get_mut(&job_id)
                .and_then(|j| j.allocation.as_mut())
            {
                a.shared_with = None;
            }
        }
    }

    fn register_node(
        &mut self,
        name: &str,
        address: &str,
        gpus: &[Gpu],
        note: &str,
        at_ms: u64,
    ) -> Result<Vec<Event>, ApplyError> {
        let inventory = validate_node(name, address, gpus)?;
        check_len("note", note, limits::NODE_NOTE_MAX_LEN)?;
        // Re-registration may not drop a GPU that a job holds.
        for (gpu, holder) in self.gpus_held_on(name) {
            if !inventory.contains_key(&gpu.index) {
                return Err(ApplyError::GpuInUse { gpu, holder });
            }
        }
        self.nodes.insert(
            name.to_string(),
            Node {
                name: name.to_string(),
                address: address.to_string(),
                gpus: inventory,
                state: NodeState::Alive,
                registered_at_ms: at_ms,
                message: note.to_string(),
                gone_gpus: BTreeMap::new(),
            },
        );
        Ok(vec![Event::NodeRegistered {
            name: name.to_string(),
            gpus: gpus.to_vec(),
        }])
    }

    /// A node's inventory as its agent reports it now (issue 33): see
    /// [`Command::RecordNodeInventory`]. Never refused for what jobs hold:
    /// a GPU that is gone is gone, and the jobs on it go back to the queue
    /// (a gang cannot run on without one worker), spending no retry.
    fn record_node_inventory(
        &mut self,
        name: &str,
        address: &str,
        gpus: &[Gpu],
        failed: &[FailedGpu],
        note: &str,
        at_ms: u64,
    ) -> Result<Vec<Event>, ApplyError> {
        let inventory = validate_node(name, address, gpus)?;
        check_len("note", note, limits::NODE_NOTE_MAX_LEN)?;
        let failed = validate_failed_gpus(name, &inventory, failed)?;
        let known = self.nodes.get(name);
        let mut gone = known.map(|n| n.gone_gpus.clone()).unwrap_or_default();
        let mut gone_now: Vec<FailedGpu> = Vec::new();
        let mut added: Vec<Gpu> = Vec::new();
        if let Some(node) = known {
            for (index, gpu_type) in &node.gpus {
                let now = inventory.get(index);
                if now == Some(gpu_type) {
                    continue;
                }
                let reason = match (failed.get(index), now) {
                    (Some(f), _) => f.reason.clone(),
                    (None, Some(other)) => format!("its type changed from {gpu_type} to {other}"),
                    (None, None) => "no longer in the node's inventory".to_string(),
                };
                gone_now.push(FailedGpu {
                    index: *index,
                    gpu_type: gpu_type.clone(),
                    reason,
                });
            }
            for (index, gpu_type) in &inventory {
                if node.gpus.get(index) != Some(gpu_type) {
                    added.push(Gpu {
                        index: *index,
                        gpu_type: gpu_type.clone(),
                    });
                }
            }
        }
        for g in &gone_now {
            if !inventory.contains_key(&g.index) {
                gone.insert(
                    g.index,
                    GoneGpu {
                        gpu_type: g.gpu_type.clone(),
                        reason: g.reason.clone(),
                        since_ms: at_ms,
                    },
                );
            }
        }
        // Failed GPUs not yet recorded gone (or with a new reason): a GPU
        // that failed before the node first registered, or whose failure
        // was found after it went missing.
        for f in failed.values() {
            match gone.get_mut(&f.index) {
                Some(g) if g.gpu_type == f.gpu_type => g.reason.clone_from(&f.reason),
                _ => {
                    gone.insert(
                        f.index,
                        GoneGpu {
                            gpu_type: f.gpu_type.clone(),
                            reason: f.reason.clone(),
                            since_ms: at_ms,
                        },
                    );
                    if known.is_some() && !gone_now.iter().any(|g| g.index == f.index) {
                        gone_now.push(f.clone());
                    }
                }
            }
        }
        // A GPU offered again is not gone.
        gone.retain(|index, _| !inventory.contains_key(index));
        // Bounded like the inventory: the oldest go first.
        while gone.len() > limits::NODE_GPUS_MAX {
            let oldest = gone
                .iter()
                .min_by_key(|(index, g)| (g.since_ms, **index))
                .map(|(index, _)| *index);
            match oldest {
                Some(index) => gone.remove(&index),
                None => break,
            };
        }
        let mut events = Vec::new();
        // The jobs holding a GPU that is gone, or is another GPU now.
        let lost_gpus: BTreeMap<u32, &FailedGpu> = gone_now.iter().map(|g| (g.index, g)).collect();
        let mut affected: BTreeMap<JobId, String> = BTreeMap::new();
        for (gpu, holder) in self.gpus_held_on(name) {
            if let Some(g) = lost_gpus.get(&gpu.index) {
                affected
                    .entry(holder)
                    .or_insert_with(|| format!("GPU {gpu} gone: {}", g.reason));
            }
        }
        let (state, message, registered_at_ms) = match known {
            // Lost by an operator since the report was made: it stays lost.
            Some(n)
                if n.state == NodeState::Lost
                    && !n.message.starts_with(crate::liveness::LOST_BY_LIVENESS) =>
            {
                (NodeState::Lost, n.message.clone(), n.registered_at_ms)
            }
            _ => (NodeState::Alive, note.to_string(), at_ms),
        };
        self.nodes.insert(
            name.to_string(),
            Node {
                name: name.to_string(),
                address: address.to_string(),
                gpus: inventory,
                state,
                registered_at_ms,
                message,
                gone_gpus: gone,
            },
        );
        for (job_id, mut reason) in affected {
            limits::cut_to(&mut reason, limits::REASON_MAX_LEN);
            self.preempt(job_id, &reason, at_ms);
            events.push(Event::JobPreempted { job_id, reason });
        }
        events.push(Event::NodeRegistered {
            name: name.to_string(),
            gpus: gpus.to_vec(),
        });
        if !added.is_empty() || !gone_now.is_empty() {
            events.push(Event::NodeInventoryChanged {
                name: name.to_string(),
                added,
                gone: gone_now,
            });
        }
        Ok(events)
    }

    /// Every (GPU, holding job) on `node`; a shared GPU appears once per job.
    fn gpus_held_on(&self, node: &str) -> Vec<(GpuRef, JobId)> {
        let from = GpuRef {
            node: node.to_string(),
            index: 0,
        };
        self.gpu_holders
            .range(from..)
            .take_while(|(g, _)| g.node == node)
            .flat_map(|(g, h)| h.jobs().map(move |j| (g.clone(), j)))
            .collect()
    }

    fn mark_node_lost(
        &mut self,
        name: &str,
        reason: &str,
        at_ms: u64,
    ) -> Result<Vec<Event>, ApplyError> {
        check_len("reason", reason, limits::REASON_MAX_LEN)?;
        let node = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| ApplyError::UnknownNode(name.to_string()))?;
        if node.state == NodeState::Lost {
            return Err(ApplyError::NodeLost(name.to_string()));
        }
        node.state = NodeState::Lost;
        node.message = reason.to_string();
        let mut events = vec![Event::NodeLost {
            name: name.to_string(),
            reason: reason.to_string(),
        }];
        // A gang job with a worker on a lost node cannot go on: release all
        // of its GPUs and put it back in the queue.
        let affected: BTreeSet<JobId> = self
            .gpus_held_on(name)
            .into_iter()
            .map(|(_, j)| j)
            .collect();
        for job_id in affected {
            let reason = format!("node {name} lost");
            self.preempt(job_id, &reason, at_ms);
            events.push(Event::JobPreempted { job_id, reason });
        }
        Ok(events)
    }

    fn remove_node(
        &mut self,
        name: &str,
        force: bool,
        at_ms: u64,
    ) -> Result<Vec<Event>, ApplyError> {
        if !self.nodes.contains_key(name) {
            return Err(ApplyError::UnknownNode(name.to_string()));
        }
        let holding: BTreeSet<JobId> = self
            .gpus_held_on(name)
            .into_iter()
            .map(|(_, j)| j)
            .collect();
        if !holding.is_empty() && !force {
            return Err(ApplyError::NodeInUse {
                node: name.to_string(),
                jobs: holding.into_iter().collect(),
            });
        }
        let mut events = Vec::new();
        for job_id in holding {
            let reason = format!("node {name} removed");
            self.preempt(job_id, &reason, at_ms);
            events.push(Event::JobPreempted { job_id, reason });
        }
        self.nodes.remove(name);
        events.push(Event::NodeRemoved {
            name: name.to_string(),
        });
        Ok(events)
    }

    fn preempt(&mut self, job_id: JobId, reason: &str, at_ms: u64) {
        let released = match self.jobs.get_mut(&job_id) {
            Some(job) => {
                job.state = JobState::Preempted;
                job.message = reason.to_string();
                job.close_allocation(at_ms)
            }
            None => None,
        };
        self.release(job_id, released);
    }

    /// A worker of the job's current allocation that its node refused to
    /// start (a kubelet admission error: the device plugin had no free
    /// device): the attempt was the cluster's, not the job's, so the job
    /// goes back to the queue without spending a retry, and waits
    /// [`limits::NOT_ADMITTED_WAIT_MS`] so the node's corrected inventory
    /// is in before it is placed again.
    fn requeue_not_admitted(
        &mut self,
        job_id: JobId,
        rank: u32,
        reason: &str,
        at_ms: u64,
    ) -> Vec<Event> {
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Vec::new();
        };
        let node = job
            .workers
            .get(&rank)
            .map(|w| w.node.clone())
            .unwrap_or_default();
        let released = job.close_allocation(at_ms);
        job.state = JobState::Pending;
        job.not_before_ms = Some(at_ms.saturating_add(limits::NOT_ADMITTED_WAIT_MS));
        let mut message = format!(
            "worker {rank} was not admitted on node {node}; requeued, no retry spent: {reason}"
        );
        limits::cut_to(&mut message, limits::REASON_MAX_LEN);
        job.message = message;
        let event = Event::JobRequeued {
            job_id,
            retries: job.retries,
            reason: job.message.clone(),
        };
        self.release(job_id, released);
        vec![event]
    }

    /// A worker of the job's current allocation exited on its own (the
    /// reconciler stops only workers that are no longer wanted, and their
    /// epoch is then stale). A non-zero exit (or death by signal) ends the
    /// attempt: the job is requeued while retries remain, else it fails.
    /// When every rank has exited 0, the job succeeded.
    fn settle_attempt(
        &mut self,
        job_id: JobId,
        rank: u32,
        exit_code: Option<i32>,
        at_ms: u64,
    ) -> Vec<Event> {
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Vec::new();
        };
        if exit_code == Some(0) {
            let workers = job.worker_count();
            let all_done = (0..workers).all(|r| {
                job.workers
                    .get(&r)
                    .is_some_and(|w| w.state == WorkerState::Exited && w.exit_code == Some(0))
            });
            if !all_done {
                return Vec::new();
            }
            let released = job.close_allocation(at_ms);
            job.state = JobState::Succeeded;
            job.finished_at_ms = Some(at_ms);
            job.message = "every worker exited 0".into();
            let reason = job.message.clone();
            self.release(job_id, released);
            return vec![Event::JobFinished {
                job_id,
                state: JobState::Succeeded,
                reason,
            }];
        }
        let how = match exit_code {
            Some(code) => format!("worker {rank} exited with code {code}"),
            None => format!("worker {rank} was killed by a signal"),
        };
        let released = job.close_allocation(at_ms);
        let event = if job.retries < job.spec.max_retries {
            job.retries += 1;
            job.state = JobState::Pending;
            let wait_ms = job.spec.retry_backoff_ms(job.retries);
            job.not_before_ms = (wait_ms > 0).then_some(at_ms.saturating_add(wait_ms));
            job.message = format!(
                "{how}; retry {} of {} in {} s",
                job.retries,
                job.spec.max_retries,
                wait_ms / 1000
            );
            Event::JobRequeued {
                job_id,
                retries: job.retries,
                reason: job.message.clone(),
            }
        } else {
            job.state = JobState::Failed;
            job.finished_at_ms = Some(at_ms);
            job.message = if job.spec.max_retries == 0 {
                how
            } else {
                format!("{how}; no retries left ({})", job.spec.max_retries)
            };
            Event::JobFinished {
                job_id,
                state: JobState::Failed,
                reason: job.message.clone(),
            }
        };
        self.release(job_id, released);
        vec![event]
    }

    fn mark_node_recovered(&mut self, name: &str) -> Result<Vec<Event>, ApplyError> {
        let node = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| ApplyError::UnknownNode(name.to_string()))?;
        if node.state != NodeState::Lost {
            return Err(ApplyError::NodeNotLost(name.to_string()));
        }
        node.state = NodeState::Alive;
        node.message.clear();
        Ok(vec![Event::NodeRecovered {
            name: name.to_string(),
        }])
    }

    fn report_progress(
        &mut self,
        job_id: JobId,
        samples: &[ProgressSample],
    ) -> Result<Vec<Event>, ApplyError> {
        if samples.len() > limits::PROGRESS_SAMPLES_MAX {
            return Err(ApplyError::TooLarge {
                field: "progress samples".into(),
                len: samples.len(),
                limit: limits::PROGRESS_SAMPLES_MAX,
            });
        }
        // The partner's model, when the job shares its GPUs: its samples
        // are then no measure of its speed alone.
        let partner_model: Option<&str> = self
            .jobs
            .get(&job_id)
            .and_then(|j| j.allocation.as_ref()?.shared_with)
            .and_then(|p| self.jobs.get(&p))
            .map(|p| {
                p.spec
                    .model
                    .as_deref()
                    .unwrap_or(crate::model::GENERIC_MODEL)
            });
        let partner_model = partner_model.map(str::to_string);
        let job = self
            .jobs
            .get_mut(&job_id)
            .ok_or(ApplyError::UnknownJob(job_id))?;
        if job.state != JobState::Running {
            return Err(ApplyError::JobNotRunning {
                job_id,
                state: job.state,
                action: "report progress".into(),
            });
        }
        // The latest sample is the one with the highest step (ties: the last).
        let Some(latest) = samples
            .iter()
            .reduce(|a, b| if b.step >= a.step { b } else { a })
        else {
            return Err(ApplyError::Invalid {
                field: "progress samples".into(),
                reason: "empty batch".into(),
            });
        };
        if job.progress.as_ref().is_none_or(|p| latest.step >= p.step) {
            job.progress = Some(latest.clone());
        }
        job.progress_samples += samples.len() as u64;
        if let Some(a) = &job.allocation {
            // The type is looked up only when the epoch is new to the
            // history (a node lookup per progress entry is not free).
            let gpu_type = if job.perf.knows_epoch(a.epoch)
                && job.perf.knows_partner(partner_model.as_deref())
            {
                ""
            } else {
                a.gpus
                    .first()
                    .and_then(|g| self.nodes.get(&g.node)?.gpus.get(&g.index))
                    .map_or("", String::as_str)
            };
            let gpus = u32::try_from(a.gpus.len()).unwrap_or(u32::MAX);
            let on = crate::perf_history::RunningOn {
                epoch: a.epoch,
                gpu_type,
                gpus,
                partner_model: partner_model.as_deref(),
            };
            // One point per entry, its latest sample: speed is measured
            // between entries (a longer interval than within a batch), and
            // the loss history is thinned anyway.
            job.perf.record(&on, latest.step, latest.loss, latest.at_ms);
        }
        Ok(vec![Event::JobProgressReported {
            job_id,
            latest: latest.clone(),
            samples: u32::try_from(samples.len()).unwrap_or(u32::MAX),
        }])
    }

    /// Checks one job's placement on its own: the job can hold GPUs, the GPU
    /// set has the right shape, and every GPU exists on a live node with an
    /// allowed type. Conflicts with other jobs are checked afterwards.
    /// Gives its GPUs sorted and, when `count_types` (the quota check will
    /// need them), how many of each type they are, found by the same
    /// lookups.
    fn check_placement<'n>(
        jobs: &JobMap,
        nodes: &'n BTreeMap<String, Node>,
        p: &JobPlacement,
        count_types: bool,
    ) -> Result<(Vec<GpuRef>, TypeCounts<'n>), String> {
        let mut counts = TypeCounts::new();
        let job = jobs
            .get(&p.job_id)
            .ok_or_else(|| format!("job {} does not exist", p.job_id))?;
        if job.state.is_terminal() {
            return Err(format!(
                "job {} has already ended ({})",
                p.job_id, job.state
            ));
        }
        let mut gpus = p.gpus.clone();
        gpus.sort();
        if gpus.windows(2).any(|w| w[0] == w[1]) {
            return Err("the plan lists a GPU twice".into());
        }
        if let Some(partner) = p.share_with {
            if partner == p.job_id {
                return Err("share_with names the job itself".into());
            }
            if gpus.is_empty() {
                return Err(format!(
                    "share_with names job {partner} but the placement holds no GPUs"
                ));
            }
        }
        if gpus.is_empty() {
            return Ok((gpus, counts));
        }
        let per_worker = job.spec.gpus.max(1) as usize;
        let workers = gpus.len() / per_worker;
        if !gpus.len().is_multiple_of(per_worker)
            || workers < job.spec.workers.min as usize
            || workers > job.spec.workers.max as usize
        {
            return Err(format!(
                "{} GPUs do not make {}..={} workers of {} GPUs",
                gpus.len(),
                job.spec.workers.min,
                job.spec.workers.max,
                per_worker
            ));
        }
        // A worker is one process on one node: every node gets whole workers.
        // `gpus` is sorted, so each node's GPUs are one run.
        for run in gpus.chunk_by(|a, b| a.node == b.node) {
            if !run.len().is_multiple_of(per_worker) {
                return Err(format!(
                    "{} GPUs on node {:?} do not make whole workers of {per_worker} GPUs",
                    run.len(),
                    run[0].node
                ));
            }
        }
        for gpu in &gpus {
            let node = nodes
                .get(&gpu.node)
                .ok_or_else(|| format!("node {:?} does not exist", gpu.node))?;
            if node.state == NodeState::Lost {
                return Err(format!("node {:?} is lost", gpu.node));
            }
            let gpu_type = node
                .gpus
                .get(&gpu.index)
                .ok_or_else(|| format!("GPU {gpu} does not exist"))?;
            let allowed = &job.spec.gpu_types.allowed;
            if !allowed.is_empty() && !allowed.iter().any(|t| t == gpu_type) {
                return Err(format!("GPU {gpu} is a {gpu_type}, not an allowed type"));
            }
            if count_types {
                count_one(&mut counts, gpu_type);
            }
        }
        Ok((gpus, counts))
    }

    /// Keeps `memory`, from a decision based on the state at `based_on`,
    /// unless that state predates the memory in force (then the decision
    /// was planned from an older memory, and its memory is refused: the
    /// next round plans again from the one in force).
    fn record_policy_memory(&mut self, based_on: u64, memory: &PolicyMemory) -> Option<Event> {
        if based_on < self.policy_memory.changed_at {
            return Some(Event::PolicyMemoryRefused {
                policy: memory.policy.clone(),
                reason: format!(
                    "planned on the state at index {based_on}, before the memory in force (set at index {})",
                    self.policy_memory.changed_at
                ),
            });
        }
        self.policy_memory = PolicyMemorySlot {
            memory: Some(memory.clone()),
            changed_at: self.last_index,
        };
        None
    }

    /// A decision's quota check, tried on `book` and undone (issue 23):
    /// every old hold of the plan's jobs is given back first; then what
    /// shrinks or stays is kept, and what grows is checked in job order.
    /// A placement refused leaves `accepted`, with the reason in `events`.
    fn check_quotas(
        &self,
        book: &mut QuotaBook,
        accepted: &mut BTreeMap<JobId, (Vec<GpuRef>, Option<JobId>)>,
        events: &mut Vec<Event>,
    ) {
        let nodes = &self.nodes;
        book.begin_trial();
        let mut growing = Vec::new();
        for (job_id, (gpus, _)) in accepted.iter() {
            let Some(job) = self.jobs.get(job_id) else {
                continue;
            };
            let queue = crate::quota::queue_of(&job.spec.queue);
            let old = job
                .allocation
                .as_ref()
                .map(|a| type_counts(nodes, &a.gpus))
                .unwrap_or_default();
            for (t, n) in &old {
                book.give_back(queue, t, *n);
            }
            let new = type_counts(nodes, gpus);
            if new.iter().any(|(t, n)| *n > count_of(&old, t)) {
                growing.push((*job_id, queue, old, new));
            } else {
                for (t, n) in &new {
                    book.force(queue, t, *n);
                }
            }
        }
        for (job_id, queue, old, new) in growing {
            let mut taken: Vec<(&str, u32)> = Vec::new();
            let mut refusal = None;
            for (t, n) in &new {
                match book.take(queue, t, *n) {
                    Ok(()) => taken.push((t, *n)),
                    Err(e) => {
                        refusal = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = refusal {
                for (t, n) in taken {
                    book.give_back(queue, t, n);
                }
                for (t, n) in &old {
                    book.force(queue, t, *n);
                }
                accepted.remove(&job_id);
                events.push(Event::PlacementRefused {
                    job_id,
                    reason: format!("over its queue's quota: {e}"),
                });
            }
        }
        book.end_trial();
    }

    fn decide_allocation(
        &mut self,
        based_on: u64,
        policy: &str,
        round: u64,
        placements: &[JobPlacement],
        at_ms: u64,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        // Pass 1: each placement on its own.
        let mut accepted: BTreeMap<JobId, (Vec<GpuRef>, Option<JobId>)> = BTreeMap::new();
        // With queues, each placement's GPUs by type, counted by pass 1's
        // own lookups, for the quota pre-check and the charges after.
        let count_types = self.queue_index.book().is_some();
        for p in placements {
            if accepted.contains_key(&p.job_id) {
                events.push(Event::PlacementRefused {
                    job_id: p.job_id,
                    reason: "the plan places this job twice".into(),
                });
                continue;
            }
            match Self::check_placement(&self.jobs, &self.nodes, p, count_types) {
                Ok((gpus, counts)) => {
                    if count_types {
                        self.queue_index.note_counts(p.job_id, &counts);
                    }
                    accepted.insert(p.job_id, (gpus, p.share_with));
                }
                Err(reason) => events.push(Event::PlacementRefused {
                    job_id: p.job_id,
                    reason,
                }),
            }
        }
        // Pass 0: a running job that may not be preempted (issue 23, item
        // 4) keeps its GPUs: a placement that changes them is refused, and
        // one that takes them meets it as a holder outside the plan
        // (pass 2).
        let fixed: Vec<JobId> = accepted
            .keys()
            .copied()
            .filter(|id| {
                self.jobs
                    .get(id)
                    .is_some_and(|j| !j.spec.preemptible && j.allocation.is_some())
            })
            .collect();
        for job_id in fixed {
            accepted.remove(&job_id);
            events.push(Event::PlacementRefused {
                job_id,
                reason: "it is not preemptible (preemptible: false): its GPUs change only when it ends or loses its node".into(),
            });
        }
        // Pass 1a: quotas (issue 23), once there are queues. A placement
        // that would make its queue hold more of a type than its quota and
        // what it may borrow is refused (the job keeps what it had). Every
        // old hold of the plan's jobs is given back first; then what
        // shrinks or stays is kept, and what grows is checked in job order.
        // The book is the state's own: the pass tries the changes on it
        // and then puts it back as it was (`trial`); the index update after
        // the entry charges what was granted. The common case needs no
        // trial: what the decision adds to each queue, net of what it
        // gives back, stays within its quota (`within_quotas`, read from
        // the index's holdings by number).
        if count_types && !self.queue_index.within_quotas(accepted.keys().copied()) {
            if let Some(mut book) = self.queue_index.take_book() {
                self.check_quotas(&mut book, &mut accepted, &mut events);
                self.queue_index.put_book(book);
            }
        }
        // Pass 1b: a pair is placed whole or not at all. Both placements
        // name each other and list the same GPUs; the check is symmetric,
        // so both members of a broken pair are refused.
        let unpaired: Vec<(JobId, String)> = accepted
            .iter()
            .filter_map(|(job_id, (gpus, partner))| {
                let partner = (*partner)?;
                let matched = accepted
                    .get(&partner)
                    .is_some_and(|(g, p)| g == gpus && *p == Some(*job_id));
                (!matched).then(|| {
                    (
                        *job_id,
                        format!(
                            "it shares GPUs with job {partner}, which this plan does not place \
                             on the same GPUs sharing with it"
                        ),
                    )
                })
            })
            .collect();
        for (job_id, reason) in unpaired {
            accepted.remove(&job_id);
            events.push(Event::PlacementRefused { job_id, reason });
        }
        // Pass 2: conflicts. GPUs held by jobs in the plan are free for the
        // plan to hand out; a job whose placement is refused keeps what it
        // had. `granted_gpus` holds only this plan's grants, so a decision
        // costs O(GPUs in the plan), not O(GPUs in the cluster). A pair is
        // one unit, handled at its smaller id.
        let mut granted_gpus: BTreeMap<GpuRef, JobId> = BTreeMap::new();
        let mut granted: Vec<(JobId, Vec<GpuRef>, Option<JobId>)> = Vec::new();
        let mut refused: Vec<JobId> = Vec::new();
        for (job_id, (gpus, partner)) in &accepted {
            if partner.is_some_and(|p| p < *job_id) {
                continue;
            }
            let unit: Vec<JobId> = std::iter::once(*job_id).chain(*partner).collect();
            let conflict = gpus.iter().find_map(|g| {
                if let Some(h) = granted_gpus.get(g) {
                    return Some(format!("GPU {g} is held by job {h}"));
                }
                let holders = self.gpu_holders.get(g)?;
                holders
                    .jobs()
                    .find(|h| !accepted.contains_key(h))
                    .map(|h| format!("GPU {g} is held by job {h}"))
            });
            if let Some(reason) = conflict {
                for job_id in unit {
                    events.push(Event::PlacementRefused {
                        job_id,
                        reason: reason.clone(),
                    });
                    refused.push(job_id);
                }
                continue;
            }
            for g in gpus {
                granted_gpus.insert(g.clone(), *job_id);
            }
            granted.push((*job_id, gpus.clone(), *partner));
            if let Some(p) = partner {
                granted.push((*p, gpus.clone(), Some(*job_id)));
            }
        }
        // A refused job keeps its old GPUs unless a granted job took one;
        // then it loses all of them (gang semantics) and is preempted.
        for job_id in refused {
            let taken = self
                .jobs
                .get(&job_id)
                .and_then(|j| j.allocation.as_ref())
                .is_some_and(|a| a.gpus.iter().any(|g| granted_gpus.contains_key(g)));
            if taken {
                self.preempt(job_id, "its GPUs went to another job", at_ms);
                events.push(Event::JobPreempted {
                    job_id,
                    reason: "its GPUs went to another job".into(),
                });
            }
        }
        // Commit the granted placements: first every old hold is dropped,
        // then the new ones are taken, so a GPU that moves within the plan
        // (or a pair that forms on one member's old GPUs) is never counted
        // twice.
        granted.sort_by_key(|(job_id, _, _)| *job_id);
        let mut changed: Vec<(JobId, Vec<GpuRef>, Option<JobId>)> = Vec::new();
        let mut old_partners: Vec<JobId> = Vec::new();
        for (job_id, gpus, partner) in granted {
            let Some(job) = self.jobs.get_mut(&job_id) else {
                continue;
            };
            let unchanged = job
                .allocation
                .as_ref()
                .is_some_and(|a| a.gpus == gpus && a.shared_with == partner)
                || (job.allocation.is_none() && gpus.is_empty());
            if unchanged {
                continue;
            }
            let old = job.close_allocation(at_ms);
            if gpus.is_empty() {
                job.state = JobState::Preempted;
                job.message = format!("preempted by {policy} in round {round}");
                let reason = job.message.clone();
                self.release(job_id, old);
                events.push(Event::JobPreempted { job_id, reason });
                continue;
            }
            if let Some(old) = old {
                old_partners.extend(old.shared_with);
                self.drop_holds(job_id, &old.gpus);
            }
            changed.push((job_id, gpus, partner));
        }
        for (job_id, gpus, partner) in changed {
            let Some(job) = self.jobs.get_mut(&job_id) else {
                continue;
            };
            job.last_epoch += 1;
            let epoch = job.last_epoch;
            job.state = JobState::Running;
            job.started_at_ms.get_or_insert(at_ms);
            job.message.clear();
            job.workers.clear();
            job.allocation = Some(Allocation {
                epoch,
                gpus: gpus.clone(),
                based_on,
                policy: policy.to_string(),
                round,
                decided_at_ms: at_ms,
                shared_with: partner,
            });
            for g in &gpus {
                let holders = match self.gpu_holders.get(g) {
                    Some(h) => h.with(job_id),
                    None => GpuHolders::one(job_id),
                };
                self.gpu_holders.insert(g.clone(), holders);
            }
            if let Some(free) = self.free.0.get_mut() {
                free.remove(&gpus);
            }
            events.push(Event::JobAllocated {
                job_id,
                epoch,
                gpus,
                based_on,
                policy: policy.to_string(),
                round,
                shared_with: partner,
            });
        }
        // Partners left behind by a job that moved run on alone.
        for job_id in old_partners {
            self.unpair_if_left(job_id);
        }
        events
    }

    /// Checks the invariants that every reachable state holds. Used by tests
    /// and debug assertions; returns the first broken one.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.capacity != FreeGpus::of_nodes(&self.nodes) {
            return Err("the capacity index does not match the nodes".into());
        }
        if self
            .free
            .0
            .get()
            .is_some_and(|f| *f != FreeGpus::of_holders(&self.nodes, &self.gpu_holders))
        {
            return Err("the free-GPU index does not match the holders".into());
        }
        let mut from_jobs: BTreeMap<&GpuRef, GpuHolders> = BTreeMap::new();
        for (id, job) in &self.jobs {
            if *id != job.id {
                return Err(format!("job {id} is stored under another id"));
            }
            if *id >= self.next_job_id {
                return Err(format!("job {id} is not below next_job_id"));
            }
            if (job.state == JobState::Running) != job.allocation.is_some() {
                return Err(format!(
                    "job {id} is {} but holds allocation {:?}",
                    job.state, job.allocation
                ));
            }
            let Some(a) = &job.allocation else {
                continue;
            };
            // A partner is mutual, on the identical GPUs.
            if let Some(p) = a.shared_with {
                let mutual = self
                    .jobs
                    .get(&p)
                    .and_then(|j| j.allocation.as_ref())
                    .is_some_and(|pa| pa.shared_with == Some(*id) && pa.gpus == a.gpus);
                if p == *id || !mutual {
                    return Err(format!(
                        "job {id} names job {p} as its partner, which does not share its GPUs"
                    ));
                }
            }
            for g in &a.gpus {
                let holders = match from_jobs.get(g) {
                    None => GpuHolders::one(*id),
                    Some(h) if h.sharer.is_none() && a.shared_with == Some(h.job) => h.with(*id),
                    Some(h) => return Err(format!("GPU {g} is held by {h} and job {id}")),
                };
                from_jobs.insert(g, holders);
            }
        }
        let index: BTreeMap<&GpuRef, GpuHolders> =
            self.gpu_holders.iter().map(|(g, h)| (g, *h)).collect();
        if index != from_jobs {
            return Err("the GPU holder index disagrees with the jobs' allocations".into());
        }
        // No job holds a GPU its node does not offer (issue 33: one that
        // is gone), and a gone GPU is not also offered.
        for (g, h) in &self.gpu_holders {
            if !self
                .nodes
                .get(&g.node)
                .is_some_and(|n| n.gpus.contains_key(&g.index))
            {
                return Err(format!(
                    "GPU {g}, held by {h}, is not in its node's inventory"
                ));
            }
        }
        for node in self.nodes.values() {
            if let Some(index) = node.gone_gpus.keys().find(|i| node.gpus.contains_key(i)) {
                return Err(format!(
                    "node {}: GPU {index} is both offered and gone",
                    node.name
                ));
            }
        }
        if self.indexes != JobIndexes::of(&self.jobs) {
            return Err("the job indexes disagree with the jobs".into());
        }
        if self.queue_index != QueueIndex::of(&self.jobs, &self.nodes, &self.queues, &self.capacity)
        {
            return Err("the queue indexes disagree with the jobs and queues".into());
        }
        self.requests.check()
    }
}

/// A state digest (BLAKE3 of the canonical encoding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateHash(pub [u8; 32]);

impl std::fmt::Display for StateHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

struct HashWriter<'a>(&'a mut blake3::Hasher);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The jobs of one of the state's id indexes, in id order
/// (`ClusterState::indexed`).
enum IndexedJobs<'a> {
    Lookup {
        ids: std::collections::btree_set::Iter<'a, JobId>,
        jobs: &'a JobMap,
    },
    Walk {
        ids: std::collections::btree_set::Iter<'a, JobId>,
        map: &'a JobMap,
        jobs: std::iter::Peekable<std::collections::btree_map::Range<'a, JobId, Box<Job>>>,
    },
}

impl IndexedJobs<'_> {
    /// Ids further apart than this are sought in the map, not walked to.
    const WALK_GAP_MAX: u64 = 16;
}

impl<'a> Iterator for IndexedJobs<'a> {
    type Item = &'a Job;

    fn next(&mut self) -> Option<&'a Job> {
        match self {
            IndexedJobs::Lookup { ids, jobs } => ids.find_map(|id| jobs.get(id)).map(|j| &**j),
            IndexedJobs::Walk { ids, map, jobs } => {
                for id in ids.by_ref() {
                    // Both ascend: skip the jobs before `id` (seeking when
                    // they are many); an id with no job (none, by the
                    // indexes' invariant) is passed over.
                    if jobs
                        .peek()
                        .is_some_and(|(job_id, _)| job_id.saturating_add(Self::WALK_GAP_MAX) < *id)
                    {
                        *jobs = map.range(*id..).peekable();
                    }
                    while jobs.next_if(|(job_id, _)| *job_id < id).is_some() {}
                    if let Some((_, job)) = jobs.next_if(|(job_id, _)| *job_id == id) {
                        return Some(job);
                    }
                }
                None
            }
        }
    }

    /// Exact by the indexes' invariant (every id in one has a job), which
    /// lets a collect allocate once.
    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = match self {
            IndexedJobs::Lookup { ids, .. } | IndexedJobs::Walk { ids, .. } => ids.len(),
        };
        (left, Some(left))
    }
}
