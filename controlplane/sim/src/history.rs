//! A cluster's recorded history as a workload (issue 27, `keel whatif`).
//!
//! A [`Recorder`] is fed a log's entries in order and applies them to its
//! own [`ClusterState`], as a replica does; from the state before and
//! after each entry it keeps what the simulator needs to replay that
//! history under another policy:
//!
//! - each job's arrival (its submission's time), spec, first start, end
//!   and outcome, and the steps it reached;
//! - each job's measured speed on each GPU type and allocation size: the
//!   steps between two progress samples of one allocation over the time
//!   between them (the first sample of an allocation is not paired with
//!   the one before it, so relaunch time is not counted as speed; of
//!   samples read at one time, the last is paired with the next);
//! - each job's runs: how long each of its allocations held GPUs, on what
//!   type and how many (a job that reports no progress, a plain command,
//!   is timed by them);
//! - the nodes, when they joined, were lost and recovered;
//! - the policies that decided (`DecideAllocation` names its policy);
//! - the GPUs held over time (the recorded utilisation).
//!
//! [`History::workload`] turns it into the simulator's inputs. Pure like
//! the rest of the crate: the caller reads the log.

use std::collections::BTreeMap;

use keel_scheduling::throughput;
use keel_scheduling::topology::allocation_type;
use keel_state::command::{Command, LogEntry};
use keel_state::event::Event;
use keel_state::model::{Gpu, JobId, JobState};
use keel_state::queue::{QueueSpec, DEFAULT_QUEUE};
use keel_state::state::ClusterState;

use super::engine::{NodeChange, SimNode};
use super::workload::MeasuredSpeed;
use super::workload::SimJob;

/// Steps and seconds measured on one GPU type and allocation size.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measured {
    pub steps: f64,
    pub seconds: f64,
}

impl Measured {
    pub fn steps_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.steps / self.seconds
        } else {
            0.0
        }
    }
}

/// How a recorded job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RecordedEnd {
    Succeeded,
    Failed,
    Cancelled,
}

impl RecordedEnd {
    /// How a job in `state` ended (`None`: it has not).
    fn of(state: JobState) -> Option<RecordedEnd> {
        match state {
            JobState::Succeeded => Some(RecordedEnd::Succeeded),
            JobState::Failed => Some(RecordedEnd::Failed),
            JobState::Cancelled => Some(RecordedEnd::Cancelled),
            JobState::Pending | JobState::Running | JobState::Preempted => None,
        }
    }
}

/// One job as the log recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedJob {
    pub job_id: JobId,
    pub name: String,
    pub queue: String,
    pub model: Option<String>,
    pub gpus_per_worker: u32,
    pub workers_min: u32,
    pub workers_max: u32,
    pub priority: i32,
    /// The spec's steps, or the steps its progress samples said in all.
    pub total_steps: Option<u64>,
    pub submitted_ms: u64,
    pub first_start_ms: Option<u64>,
    /// When and how it ended (`None`: it had not when the log ends).
    pub end: Option<(u64, RecordedEnd)>,
    /// The highest step a progress sample reported.
    pub steps_reached: u64,
    /// The stretches its allocations held GPUs between a sample and
    /// something else: from each allocation to its first progress sample
    /// (launch, restore, and the steps made meanwhile), and from its last
    /// sample to its end (the last steps, checkpoint, exit). With the
    /// speeds they give its overhead ([`History::workload`]).
    pub gaps: Vec<Gap>,
    /// Measured speed by (GPU type, GPUs of the allocation).
    pub speeds: BTreeMap<(String, u32), Measured>,
    /// Its allocations in order, each from its decision to its end (or to
    /// the log's end for one it still holds).
    pub runs: Vec<Run>,
    /// GPU-milliseconds it had held before the history's first entry (a
    /// job of the state the entries follow: its record's service), which
    /// `runs` does not hold.
    pub earlier_gpu_ms: u64,
}

/// One allocation of a job: `ms` long on `gpus` GPUs of `gpu_type`.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub gpu_type: String,
    pub gpus: u32,
    pub ms: u64,
}

impl RecordedJob {
    /// GPU-milliseconds it held in all (every run).
    pub fn held_gpu_ms(&self) -> u64 {
        self.earlier_gpu_ms
            + self
                .runs
                .iter()
                .map(|r| u64::from(r.gpus) * r.ms)
                .sum::<u64>()
    }

    /// Its time without progress per start: its gaps' time beyond their
    /// steps at the speed measured on their allocation, over its starts
    /// (`None` when no gap's allocation has a measured speed).
    pub fn overhead_per_start_s(&self) -> Option<f64> {
        let starts = self.gaps.iter().filter(|g| !g.at_end).count();
        let mut overhead = 0.0;
        let mut counted = false;
        for gap in &self.gaps {
            let speed = self
                .speeds
                .get(&(gap.gpu_type.clone(), gap.gpus))
                .map_or(0.0, Measured::steps_per_s);
            if speed > 0.0 {
                overhead += gap.overhead_s(speed);
                counted = true;
            }
        }
        (counted && starts > 0).then(|| overhead / starts as f64)
    }

    /// For a job that reported no progress (a plain command): its work
    /// and its speed, from how long it ran. A job's
    /// last run is taken as its work, since a command without a
    /// checkpoint starts again on each allocation: the run that succeeded
    /// or failed did all of it. For a job cancelled while it ran, or one
    /// that still runs when the log ends, its runs together are the least
    /// it would have needed. The work is its steps (the spec's or the
    /// samples' total, for one that succeeded) or else its seconds, made
    /// at that pace on the last run's GPU type and size. `None` without a
    /// run of a second or more.
    pub fn timed_by_runs(&self) -> Option<(u64, MeasuredSpeed)> {
        let last = self.runs.last()?;
        let ms = match self.end {
            Some((_, RecordedEnd::Succeeded | RecordedEnd::Failed)) => last.ms,
            Some((_, RecordedEnd::Cancelled)) | None => self.runs.iter().map(|r| r.ms).sum(),
        };
        let seconds = ms as f64 / 1000.0;
        if seconds < 1.0 {
            return None;
        }
        let steps = match (self.end, self.total_steps) {
            (Some((_, RecordedEnd::Succeeded)), Some(total)) if total > 0 => total,
            _ => ms / 1000,
        };
        Some((
            steps,
            MeasuredSpeed {
                gpu_type: last.gpu_type.clone(),
                gpus: last.gpus,
                steps_per_s: steps as f64 / seconds,
            },
        ))
    }

    /// Its completion time, for a job that succeeded.
    pub fn jct_s(&self) -> Option<f64> {
        match self.end {
            Some((at, RecordedEnd::Succeeded)) => {
                Some(at.saturating_sub(self.submitted_ms) as f64 / 1000.0)
            }
            _ => None,
        }
    }
}

/// A stretch of one allocation on `gpus` GPUs of `gpu_type`: `ms` long,
/// `steps` made in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gap {
    pub gpu_type: String,
    pub gpus: u32,
    pub ms: u64,
    pub steps: u64,
    /// From the last sample to the job's end (else from an allocation to
    /// its first sample).
    pub at_end: bool,
}

impl Gap {
    /// Its time beyond its steps at `steps_per_s` (0 when none).
    fn overhead_s(&self, steps_per_s: f64) -> f64 {
        (self.ms as f64 / 1000.0 - self.steps as f64 / steps_per_s).max(0.0)
    }
}

/// One node as the log recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedNode {
    pub name: String,
    /// The most GPUs it offered, by index.
    pub gpus: BTreeMap<u32, String>,
    pub registered_ms: u64,
}

/// A policy that decided, from its first decision on.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedPolicy {
    pub from_ms: u64,
    pub name: String,
}

/// What a [`Recorder`] kept.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    pub jobs: Vec<RecordedJob>,
    pub nodes: Vec<RecordedNode>,
    /// Nodes lost and recovered, by time.
    pub node_changes: Vec<(u64, String, bool)>,
    pub policies: Vec<RecordedPolicy>,
    /// Entries read, and the first and last one's index and time.
    pub entries: u64,
    pub first_index: u64,
    pub last_index: u64,
    pub first_ms: u64,
    pub last_ms: u64,
    /// GPU-milliseconds held by all jobs between the first submission and
    /// the last job's end.
    pub held_gpu_ms: u64,
    /// The state's hash after the last entry.
    pub state_hash: String,
    /// Every queue the log defined, as last defined (a deleted one too:
    /// its jobs are in the history).
    pub queues: BTreeMap<String, QueueSpec>,
}

/// Where a job's progress stood at its last sample.
#[derive(Debug, Clone, Copy)]
struct LastSample {
    epoch: u64,
    step: u64,
    at_ms: u64,
}

/// A job's current allocation, as the recorder times it.
#[derive(Debug, Clone, PartialEq)]
struct Holding {
    epoch: u64,
    gpu_type: String,
    gpus: u32,
    since_ms: u64,
}

/// Reads a log's entries into a [`History`].
#[derive(Debug)]
pub struct Recorder {
    state: ClusterState,
    jobs: BTreeMap<JobId, RecordedJob>,
    nodes: BTreeMap<String, RecordedNode>,
    node_changes: Vec<(u64, String, bool)>,
    policies: Vec<RecordedPolicy>,
    last_sample: BTreeMap<JobId, LastSample>,
    /// What each job holds now, and since when.
    holding: BTreeMap<JobId, Holding>,
    queues: BTreeMap<String, QueueSpec>,
    /// Each job's current allocation: its epoch and when it was decided.
    allocated: BTreeMap<JobId, (u64, u64)>,
    /// The allocation of each job's last sample: epoch, GPU type, GPUs.
    held_as: BTreeMap<JobId, (u64, String, u32)>,
    entries: u64,
    first_index: u64,
    last_index: u64,
    first_ms: Option<u64>,
    last_ms: u64,
    /// The speeds the state the entries follow had measured, by job: taken
    /// where the entries measure none for that GPU type and size.
    earlier_speeds: BTreeMap<JobId, Vec<EarlierSpeed>>,
}

/// A speed a job's record kept: (GPU type, GPUs), steps per second.
type EarlierSpeed = ((String, u32), f64);

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder of a log from its first entry.
    pub fn new() -> Recorder {
        Recorder::starting_from(ClusterState::new())
    }

    /// A recorder of a log whose entries follow `state` (a snapshot a
    /// replica installed, or a snapshot file with no entries after it): its
    /// jobs and nodes are known from their records. What their records
    /// keep of the time before is taken too: each job's speeds as its
    /// performance history measured them (by GPU type and size, the mean
    /// of its samples' speeds; a speed the entries measure again is
    /// theirs), the GPU time it had held, the first submission as the
    /// history's start, and as the policy deciding from then the one set
    /// at run time, else the one that made the latest allocation held.
    /// What a record does not keep is not known: its allocations one by
    /// one (a job that reported no progress has no speed), the nodes'
    /// losses before, and earlier policies.
    pub fn starting_from(state: ClusterState) -> Recorder {
        let state_at_ms = state.last_entry_at_ms();
        let mut recorder = Recorder {
            state,
            jobs: BTreeMap::new(),
            nodes: BTreeMap::new(),
            node_changes: Vec::new(),
            policies: Vec::new(),
            last_sample: BTreeMap::new(),
            holding: BTreeMap::new(),
            allocated: BTreeMap::new(),
            held_as: BTreeMap::new(),
            queues: BTreeMap::new(),
            entries: 0,
            first_index: 0,
            last_index: 0,
            first_ms: None,
            last_ms: state_at_ms,
            earlier_speeds: BTreeMap::new(),
        };
        let ids: Vec<JobId> = recorder.state.jobs().keys().copied().collect();
        for id in ids {
            recorder.note_job(id);
            recorder.note_holding(id, state_at_ms);
            recorder.note_earlier(id, state_at_ms);
        }
        if let Some(first_ms) = recorder.jobs.values().map(|j| j.submitted_ms).min() {
            recorder.first_ms = Some(first_ms);
            // The policy set at run time, else the one that made the
            // latest allocation still held.
            let deciding = recorder.state.policy().map(str::to_string).or_else(|| {
                recorder
                    .state
                    .allocated_jobs()
                    .filter_map(|j| j.allocation.as_ref())
                    .max_by_key(|a| a.decided_at_ms)
                    .map(|a| a.policy.clone())
            });
            if let Some(name) = deciding {
                recorder.policies.push(RecordedPolicy {
                    from_ms: first_ms,
                    name,
                });
            }
        }
        let names: Vec<String> = recorder.state.nodes().keys().cloned().collect();
        for name in names {
            recorder.note_node(&name);
        }
        // Queues only where the state before had them: `all` names the
        // default queue always, and a replay given it would run queue
        // admission that the recorded cluster never ran.
        if !recorder.state.queues().is_unset() {
            recorder.queues = recorder.state.queues().all();
        }
        recorder
    }

    /// Applies the entry at `index` and keeps what it tells.
    pub fn record(&mut self, index: u64, entry: &LogEntry) {
        if self.first_index == 0 {
            self.first_index = index;
        }
        self.last_index = index;
        self.entries += 1;
        let at_ms = entry.at_ms;
        self.last_ms = self.last_ms.max(at_ms);
        if let Command::ReportProgress {
            job_id, samples, ..
        } = &entry.command
        {
            self.measure(*job_id, samples);
        }
        let Ok(events) = self.state.apply(index, entry) else {
            return;
        };
        for event in &events {
            match event {
                Event::JobSubmitted { job_id, .. } => {
                    self.first_ms.get_or_insert(at_ms);
                    self.note_job(*job_id);
                }
                Event::JobAllocated {
                    job_id,
                    policy,
                    epoch,
                    ..
                } => {
                    self.allocated.insert(*job_id, (*epoch, at_ms));
                    if self.policies.last().is_none_or(|p| &p.name != policy) {
                        self.policies.push(RecordedPolicy {
                            from_ms: at_ms,
                            name: policy.clone(),
                        });
                    }
                    if let Some(job) = self.jobs.get_mut(job_id) {
                        job.first_start_ms.get_or_insert(at_ms);
                    }
                }
                Event::JobFinished { job_id, state, .. } => {
                    let end = RecordedEnd::of(*state).unwrap_or(RecordedEnd::Failed);
                    let last = self.last_sample.get(job_id).copied();
                    let held = self.held_as.get(job_id).cloned();
                    if let Some(job) = self.jobs.get_mut(job_id) {
                        if job.end.is_none() {
                            job.end = Some((at_ms, end));
                            // The last steps, checkpoint and exit, on the
                            // allocation of the last sample.
                            if let (Some(last), Some((epoch, gpu_type, gpus))) = (last, held) {
                                if last.epoch == epoch && end == RecordedEnd::Succeeded {
                                    let total = job.total_steps.unwrap_or(job.steps_reached);
                                    job.gaps.push(Gap {
                                        gpu_type,
                                        gpus,
                                        ms: at_ms.saturating_sub(last.at_ms),
                                        steps: total.saturating_sub(last.step),
                                        at_end: true,
                                    });
                                }
                            }
                        }
                    }
                }
                Event::JobCancelled { job_id, .. } => {
                    if let Some(job) = self.jobs.get_mut(job_id) {
                        job.end.get_or_insert((at_ms, RecordedEnd::Cancelled));
                    }
                }
                Event::NodeRegistered { name, .. } | Event::NodeInventoryChanged { name, .. } => {
                    self.note_node(name)
                }
                Event::NodeLost { name, .. } => {
                    self.node_changes.push((at_ms, name.clone(), false));
                }
                Event::NodeRecovered { name } => {
                    self.node_changes.push((at_ms, name.clone(), true));
                }
                Event::QueueCreated { name } | Event::QueueUpdated { name } => {
                    if let Some(spec) = self.state.queues().spec(name) {
                        self.queues.insert(name.clone(), spec);
                    }
                    // Once there are queues, the default one's terms count
                    // too.
                    if !self.queues.contains_key(DEFAULT_QUEUE) {
                        if let Some(spec) = self.state.queues().spec(DEFAULT_QUEUE) {
                            self.queues.insert(DEFAULT_QUEUE.to_string(), spec);
                        }
                    }
                }
                _ => {}
            }
            if let Some(job_id) = event.job_id() {
                self.note_holding(job_id, at_ms);
            }
        }
    }

    /// Pairs each sample with the one before it of the same allocation:
    /// the steps between them over the time between them, on the GPUs the
    /// job holds as the entry is applied.
    fn measure(&mut self, job_id: JobId, samples: &[keel_state::model::ProgressSample]) {
        let Some(job) = self.state.job(job_id) else {
            return;
        };
        let Some(allocation) = job.allocation.as_ref() else {
            return;
        };
        let epoch = allocation.epoch;
        let gpus = u32::try_from(allocation.gpus.len()).unwrap_or(u32::MAX);
        let gpu_type = allocation_type(&self.state, &allocation.gpus)
            .unwrap_or_default()
            .to_string();
        let Some(recorded) = self.jobs.get_mut(&job_id) else {
            return;
        };
        for sample in samples {
            recorded.steps_reached = recorded.steps_reached.max(sample.step);
            if sample.total_steps > 0 && recorded.total_steps.is_none() {
                recorded.total_steps = Some(sample.total_steps);
            }
            let now = LastSample {
                epoch,
                step: sample.step,
                at_ms: sample.at_ms,
            };
            let before = self.last_sample.get(&job_id).copied();
            let same_epoch = before.filter(|b| b.epoch == epoch);
            if same_epoch.is_none() {
                // The allocation's first sample: launch and restore, and
                // the steps since the job's last sample (or its start).
                if let Some((_, at)) = self.allocated.get(&job_id).filter(|(e, _)| *e == epoch) {
                    recorded.gaps.push(Gap {
                        gpu_type: gpu_type.clone(),
                        gpus,
                        ms: sample.at_ms.saturating_sub(*at),
                        steps: sample.step.saturating_sub(before.map_or(0, |b| b.step)),
                        at_end: false,
                    });
                }
                self.held_as.insert(job_id, (epoch, gpu_type.clone(), gpus));
            }
            match same_epoch {
                // Lines read together carry the time they were read,
                // nearest the last one's: the next later sample is paired
                // with the last of them.
                Some(b) if sample.at_ms <= b.at_ms => {}
                Some(b) if sample.step >= b.step => {
                    // Time without steps (a checkpoint, a stall) counts.
                    let m = recorded.speeds.entry((gpu_type.clone(), gpus)).or_default();
                    m.steps += (sample.step - b.step) as f64;
                    m.seconds += (sample.at_ms - b.at_ms) as f64 / 1000.0;
                }
                _ => {}
            }
            self.last_sample.insert(job_id, now);
        }
    }

    fn note_job(&mut self, job_id: JobId) {
        let Some(job) = self.state.job(job_id) else {
            return;
        };
        let spec = &job.spec;
        self.jobs.entry(job_id).or_insert_with(|| RecordedJob {
            job_id,
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            model: spec.model.clone(),
            gpus_per_worker: spec.gpus,
            workers_min: spec.workers.min,
            workers_max: spec.workers.max,
            priority: spec.priority,
            total_steps: spec.total_steps,
            submitted_ms: job.submitted_at_ms,
            first_start_ms: job.started_at_ms,
            end: job.finished_at_ms.zip(RecordedEnd::of(job.state)),
            steps_reached: job.progress.as_ref().map_or(0, |p| p.step),
            gaps: Vec::new(),
            speeds: BTreeMap::new(),
            runs: Vec::new(),
            earlier_gpu_ms: 0,
        });
    }

    /// Settles the run `job_id`'s allocation made until `at_ms` when it
    /// has changed, and notes what it holds from now.
    fn note_holding(&mut self, job_id: JobId, at_ms: u64) {
        let now = self
            .state
            .job(job_id)
            .and_then(|j| j.allocation.as_ref())
            .filter(|a| !a.gpus.is_empty());
        if self.holding.get(&job_id).map(|h| h.epoch) == now.map(|a| a.epoch) {
            return;
        }
        let now = now.map(|allocation| Holding {
            epoch: allocation.epoch,
            gpu_type: allocation_type(&self.state, &allocation.gpus)
                .unwrap_or_default()
                .to_string(),
            gpus: u32::try_from(allocation.gpus.len()).unwrap_or(u32::MAX),
            since_ms: at_ms,
        });
        if let Some(held) = self.holding.remove(&job_id) {
            self.settle(job_id, held, at_ms);
        }
        if let Some(holding) = now {
            self.holding.insert(job_id, holding);
        }
    }

    /// What job `job_id`'s record keeps of the time before `at_ms`, the
    /// state's own time: the GPU time it held and its measured speeds.
    fn note_earlier(&mut self, job_id: JobId, at_ms: u64) {
        let (Some(job), Some(recorded)) = (self.state.job(job_id), self.jobs.get_mut(&job_id))
        else {
            return;
        };
        recorded.earlier_gpu_ms = job.attained_gpu_ms(at_ms);
        let mut speeds: BTreeMap<(String, u32), keel_state::perf_history::SpeedStat> =
            BTreeMap::new();
        for (gpu_type, gpus, stat) in job.perf.alone_speeds() {
            speeds
                .entry((gpu_type.to_string(), gpus))
                .or_default()
                .add(stat);
        }
        let measured: Vec<EarlierSpeed> = speeds
            .into_iter()
            .filter(|(_, stat)| stat.mean() > 0.0)
            .map(|(key, stat)| (key, stat.mean()))
            .collect();
        if !measured.is_empty() {
            self.earlier_speeds.insert(job_id, measured);
        }
    }

    /// Counts a run that ended at `at_ms`.
    fn settle(&mut self, job_id: JobId, held: Holding, at_ms: u64) {
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.runs.push(Run {
                gpu_type: held.gpu_type,
                gpus: held.gpus,
                ms: at_ms.saturating_sub(held.since_ms),
            });
        }
    }

    fn note_node(&mut self, name: &str) {
        let Some(node) = self.state.nodes().get(name) else {
            return;
        };
        let recorded = self
            .nodes
            .entry(name.to_string())
            .or_insert_with(|| RecordedNode {
                name: name.to_string(),
                gpus: BTreeMap::new(),
                registered_ms: node.registered_at_ms,
            });
        for (index, gpu_type) in &node.gpus {
            recorded.gpus.insert(*index, gpu_type.clone());
        }
    }

    /// What the entries recorded.
    pub fn finish(mut self) -> History {
        let last_ms = self.last_ms;
        for (job_id, held) in std::mem::take(&mut self.holding) {
            self.settle(job_id, held, last_ms);
        }
        for (job_id, earlier) in std::mem::take(&mut self.earlier_speeds) {
            let Some(job) = self.jobs.get_mut(&job_id) else {
                continue;
            };
            for (key, steps_per_s) in earlier {
                job.speeds.entry(key).or_insert(Measured {
                    steps: steps_per_s,
                    seconds: 1.0,
                });
            }
        }
        let held_gpu_ms = self.jobs.values().map(RecordedJob::held_gpu_ms).sum();
        History {
            jobs: self.jobs.into_values().collect(),
            nodes: self.nodes.into_values().collect(),
            node_changes: self.node_changes,
            policies: self.policies,
            entries: self.entries,
            first_index: self.first_index,
            last_index: self.last_index,
            first_ms: self.first_ms.unwrap_or(last_ms),
            last_ms,
            held_gpu_ms,
            state_hash: self.state.state_hash().to_string(),
            queues: self.queues,
        }
    }
}

/// The simulator's inputs for a [`History`].
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedWorkload {
    pub jobs: Vec<SimJob>,
    pub nodes: Vec<SimNode>,
    pub node_changes: Vec<NodeChange>,
    /// Jobs whose speed was measured on at least one allocation, and the
    /// figures (job × GPU type × size) measured in all.
    pub jobs_measured: usize,
    pub speeds_measured: usize,
    /// The policies that decided, by simulated time (seconds after the
    /// first submission).
    pub policies: Vec<(f64, String)>,
    /// The queues, each as last defined (the default one's terms as
    /// `default`, when set).
    pub queues: Vec<(String, QueueSpec)>,
    /// The median, over the measured figures, of measured speed over the
    /// project table's speed for that model, GPU type and size (1 when
    /// none was measured): what a job never measured runs at, times the
    /// table ([`crate::SimConfig::table_scale`]).
    pub table_scale: f64,
}

/// A job with no model runs at the project table's `generic` speed.
const NO_MODEL: &str = "generic";

impl History {
    /// Keeps the jobs submitted at or after `from_ms`: the history then
    /// starts at the first of them. Jobs submitted before are left out,
    /// even those still running then (the cluster starts empty).
    pub fn keep_submitted_from(&mut self, from_ms: u64) {
        self.jobs.retain(|j| j.submitted_ms >= from_ms);
        self.first_ms = self
            .jobs
            .iter()
            .map(|j| j.submitted_ms)
            .min()
            .unwrap_or(self.last_ms);
        self.held_gpu_ms = self.jobs.iter().map(RecordedJob::held_gpu_ms).sum();
        // The policy in force then, and those after it.
        let in_force = self.policies.iter().rposition(|p| p.from_ms <= from_ms);
        if let Some(i) = in_force {
            self.policies.drain(..i);
            self.policies[0].from_ms = from_ms;
        }
    }

    fn seconds_after_start(&self, at_ms: u64) -> f64 {
        at_ms.saturating_sub(self.first_ms) as f64 / 1000.0
    }

    /// [`RecordedWorkload::table_scale`].
    fn table_scale(&self) -> f64 {
        let mut ratios: Vec<f64> = Vec::new();
        for job in &self.jobs {
            let profile = throughput::profile(job.model.as_deref().unwrap_or(NO_MODEL));
            for ((gpu_type, gpus), m) in &job.speeds {
                let table = profile.steps_per_s(gpu_type, *gpus);
                if table > 0.0 && m.steps_per_s() > 0.0 {
                    ratios.push(m.steps_per_s() / table);
                }
            }
        }
        if ratios.is_empty() {
            return 1.0;
        }
        ratios.sort_by(f64::total_cmp);
        ratios[ratios.len() / 2]
    }

    /// Total GPUs over the nodes the log knew.
    pub fn total_gpus(&self) -> u32 {
        self.nodes
            .iter()
            .map(|n| u32::try_from(n.gpus.len()).unwrap_or(u32::MAX))
            .sum()
    }

    /// When the last job ended, or the log's end if one had not.
    pub fn end_ms(&self) -> u64 {
        if self.jobs.iter().any(|j| j.end.is_none()) {
            return self.last_ms;
        }
        self.jobs
            .iter()
            .filter_map(|j| j.end.map(|(at, _)| at))
            .max()
            .unwrap_or(self.last_ms)
    }

    /// GPU time held over GPU time available, from the first submission to
    /// [`History::end_ms`], on the GPUs the log knew.
    pub fn utilisation(&self) -> f64 {
        let available =
            f64::from(self.total_gpus()) * self.end_ms().saturating_sub(self.first_ms) as f64;
        if available > 0.0 {
            self.held_gpu_ms as f64 / available
        } else {
            0.0
        }
    }

    /// The jobs, nodes and node changes to simulate. A job's work is the
    /// steps it needed: the steps it reached for one that failed, its
    /// total for the others (a cancelled one is cancelled at the time it
    /// was, unless it finished before), at the speeds its samples
    /// measured. A job that reported no progress (a plain command) is
    /// timed by its runs ([`RecordedJob::timed_by_runs`]). One that did
    /// but was never measured (no two samples of one allocation), or
    /// never ran a second, runs at the table's speed (times
    /// [`RecordedWorkload::table_scale`]). Nodes that registered after
    /// the first submission start lost until then.
    pub fn workload(&self) -> RecordedWorkload {
        let mut jobs = Vec::with_capacity(self.jobs.len());
        let (mut jobs_measured, mut speeds_measured) = (0, 0);
        for (position, job) in self.jobs.iter().enumerate() {
            let mut measured: Vec<MeasuredSpeed> = job
                .speeds
                .iter()
                .filter(|(_, m)| m.steps_per_s() > 0.0)
                .map(|((gpu_type, gpus), m)| MeasuredSpeed {
                    gpu_type: gpu_type.clone(),
                    gpus: *gpus,
                    steps_per_s: m.steps_per_s(),
                })
                .collect();
            let failed = matches!(job.end, Some((_, RecordedEnd::Failed)));
            let mut total_steps = if failed {
                job.steps_reached
            } else {
                job.total_steps
                    .unwrap_or(job.steps_reached)
                    .max(job.steps_reached)
            };
            if measured.is_empty() && job.steps_reached == 0 {
                if let Some((steps, speed)) = job.timed_by_runs() {
                    total_steps = steps;
                    measured.push(speed);
                }
            }
            if !measured.is_empty() {
                jobs_measured += 1;
                speeds_measured += measured.len();
            }
            // Its user cancels it at the same time, unless it has
            // finished by then.
            let cancel_at_s = match job.end {
                Some((at, RecordedEnd::Cancelled)) => Some(self.seconds_after_start(at)),
                _ => None,
            };
            let restart_s = job.overhead_per_start_s();
            jobs.push(SimJob {
                id: position as u64,
                arrival_s: self.seconds_after_start(job.submitted_ms),
                model: job.model.clone().unwrap_or_else(|| NO_MODEL.to_string()),
                gpus_per_worker: job.gpus_per_worker.max(1),
                workers_min: job.workers_min.max(1),
                workers_max: job.workers_max.max(job.workers_min).max(1),
                // A job that did nothing still arrives and leaves.
                total_steps: total_steps.max(1),
                priority: job.priority,
                job_type: None,
                queue: job.queue.clone(),
                measured,
                cancel_at_s,
                restart_s,
            });
        }
        let start = self.first_ms;
        let nodes = self
            .nodes
            .iter()
            .map(|n| SimNode {
                name: n.name.clone(),
                gpus: n
                    .gpus
                    .iter()
                    .map(|(index, gpu_type)| Gpu {
                        index: *index,
                        gpu_type: gpu_type.clone(),
                    })
                    .collect(),
            })
            .collect();
        let mut node_changes: Vec<NodeChange> = Vec::new();
        for n in &self.nodes {
            if n.registered_ms > start {
                node_changes.push(NodeChange {
                    at_s: 0.0,
                    node: n.name.clone(),
                    up: false,
                });
                node_changes.push(NodeChange {
                    at_s: self.seconds_after_start(n.registered_ms),
                    node: n.name.clone(),
                    up: true,
                });
            }
        }
        for (at, node, up) in &self.node_changes {
            if *at >= start {
                node_changes.push(NodeChange {
                    at_s: self.seconds_after_start(*at),
                    node: node.clone(),
                    up: *up,
                });
            }
        }
        node_changes.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        let policies = self
            .policies
            .iter()
            .map(|p| (self.seconds_after_start(p.from_ms), p.name.clone()))
            .collect();
        RecordedWorkload {
            table_scale: self.table_scale(),
            jobs,
            nodes,
            node_changes,
            jobs_measured,
            speeds_measured,
            policies,
            queues: self
                .queues
                .iter()
                .map(|(name, spec)| (name.clone(), spec.clone()))
                .collect(),
        }
    }
}
