//! The event loop: a virtual clock, the real state machine, the real
//! policies, and a simulated executor.
//!
//! Everything that happens is an entry applied to a [`ClusterState`], as in
//! the live cluster: nodes register, jobs are submitted when they arrive,
//! the policy's decisions are `DecideAllocation` entries (through the same
//! [`policy::decide`]), workers start (`RecordWorkerStarted`), report
//! progress (`ReportProgress`, at every round) and exit when their job's
//! steps are done (`RecordWorkerExited`). The simulated executor turns an
//! allocation into progress at the throughput table's speed for the
//! allocation's GPU type and size, after a restart cost each time a job's
//! allocation changes (checkpoint and relaunch).
//!
//! Scheduling passes run when a job arrives or finishes and at every round
//! tick, like the live loop's wake-ups. No wall clock, no threads, no
//! randomness but the workload's seed: the same inputs give the same
//! report, state hash included.

use std::collections::{BTreeMap, BTreeSet};

use keel_scheduling::perf::{self, SpeedModel};
use keel_scheduling::policy::{self, Policy};
use keel_scheduling::throughput;
use keel_state::command::{Command, LogEntry};
use keel_state::event::Event;
use keel_state::model::{Gpu, GpuRef, JobId, JobState, ProgressSample};
use keel_state::queue::{QueueSpec, DEFAULT_QUEUE};
use keel_state::spec::{JobSpec, Workers};
use keel_state::state::ClusterState;

use super::workload::SimJob;

/// One simulated node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimNode {
    pub name: String,
    pub gpus: Vec<Gpu>,
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub nodes: Vec<SimNode>,
    pub jobs: Vec<SimJob>,
    /// Seconds between scheduling round ticks.
    pub round_s: f64,
    /// Seconds without progress each time a job (re)starts on a new
    /// allocation: checkpoint, relaunch, warm-up.
    pub restart_s: f64,
    /// Measure only jobs whose workload id is in `[start, end]`; the run
    /// stops once they all finished (later arrivals keep the cluster in
    /// steady state meanwhile).
    pub window: Option<(u64, u64)>,
    /// Stop after this much simulated time even if jobs remain.
    pub max_simulated_s: f64,
    /// A running job reports progress at the first round tick at least
    /// this long after its last report (and when it finishes), like the
    /// live server's `--progress-interval-s`. Policies see progress at most
    /// this stale.
    pub progress_interval_s: f64,
    /// Speeds by job type from Gavel's table; jobs it does not hold run at
    /// the project's table's speed for their model.
    pub throughputs: Option<super::ThroughputTable>,
    /// Finished jobs removed from the state as the live leader removes
    /// them (`--retain-finished-s`, `--retain-finished-max`), checked at
    /// every round tick; `None`: kept.
    pub retention: Option<SimRetention>,
    /// Record the state's size (jobs held, snapshot bytes) this many times
    /// over the run, evenly by submissions, and at its end (0: never; an
    /// encoding of the whole state each time).
    pub state_size_samples: u32,
    /// Queues made before the first job arrives (`default`: the default
    /// queue's terms), as `keel queue create` makes them live.
    pub queues: Vec<(String, QueueSpec)>,
    /// Nodes lost and recovered over the run, by time (a recorded
    /// history's).
    pub node_changes: Vec<NodeChange>,
    /// Keep the run's log in the report ([`SimReport::log`]): what a live
    /// cluster would have recorded.
    pub keep_log: bool,
    /// Speeds from a table are multiplied by this: how a recorded
    /// cluster's measured speeds compare with the table (1: as the table
    /// says).
    pub table_scale: f64,
}

/// A node lost (`up: false`) or back (`up: true`) at `at_s` on the
/// workload's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeChange {
    pub at_s: f64,
    pub node: String,
    pub up: bool,
}

/// Where the speeds of a run's allocations came from, one count per
/// allocation a job started on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeedSources {
    /// Measured on the cluster on that GPU type and size.
    pub measured: u64,
    /// From the job's speeds measured on other types or sizes: Optimus's
    /// speed model fitted to them (three sizes or more), else the closest
    /// one scaled by its model's profile.
    pub modelled: u64,
    /// From a throughput table (Gavel's, or the project's profile).
    pub table: u64,
}

/// Which finished jobs a simulation removes from its state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimRetention {
    /// Finished this many simulated seconds ago.
    pub finished_s: Option<f64>,
    /// The oldest beyond this many finished jobs.
    pub finished_max: Option<usize>,
}

/// The state's size at one point of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateSize {
    pub at_s: f64,
    /// Jobs submitted so far.
    pub submitted: u64,
    /// Jobs the state holds (waiting, running and finished ones kept).
    pub jobs: u64,
    /// Bytes of its snapshot (the protobuf a replica writes).
    pub snapshot_bytes: u64,
}

impl SimConfig {
    pub fn new(nodes: Vec<SimNode>, jobs: Vec<SimJob>) -> SimConfig {
        SimConfig {
            nodes,
            jobs,
            round_s: 360.0,
            restart_s: 0.0,
            window: None,
            max_simulated_s: 10.0 * 365.0 * 86_400.0,
            progress_interval_s: 1800.0,
            throughputs: None,
            retention: None,
            state_size_samples: 0,
            queues: Vec::new(),
            node_changes: Vec::new(),
            keep_log: false,
            table_scale: 1.0,
        }
    }
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobResult {
    /// The job's id in the workload.
    pub id: u64,
    /// Its queue (the default one: `default`).
    pub queue: String,
    /// Whether, when it arrived, its queue had no job waiting and an
    /// unused quota of a type it could use that covered it: such a job
    /// must start within a round, reclaiming what borrowers hold.
    pub within_quota: bool,
    /// The id the state machine gave it.
    pub job_id: JobId,
    pub model: String,
    pub gpus: u32,
    pub arrival_s: f64,
    pub first_start_s: Option<f64>,
    pub finish_s: Option<f64>,
    /// When it was cancelled ([`SimJob::cancel_at_s`]) before it finished.
    pub cancelled_s: Option<f64>,
    /// How many times its allocation changed while it ran (preemptions,
    /// migrations, resizes).
    pub restarts: u32,
}

impl JobResult {
    pub fn jct_s(&self) -> Option<f64> {
        self.finish_s.map(|f| f - self.arrival_s)
    }
}

/// A point of the run's time series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at_s: f64,
    pub busy_gpus: u32,
    pub queued_jobs: u32,
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    pub policy: String,
    pub jobs: Vec<JobResult>,
    pub total_gpus: u32,
    /// Simulated seconds from the first arrival to the last event.
    pub simulated_s: f64,
    /// From the first arrival to the last measured job's finish.
    pub makespan_s: f64,
    /// Busy GPU-seconds over available GPU-seconds, until the last event.
    pub utilisation: f64,
    /// Scheduling passes (policy runs).
    pub rounds: u64,
    /// Passes that changed an allocation.
    pub decisions: u64,
    /// Jobs that lost their GPUs while running (`JobPreempted`).
    pub preemptions: u64,
    /// Running jobs whose allocation changed without ending (resizes and
    /// moves): each is a checkpoint and relaunch.
    pub resizes: u64,
    /// Workers that moved to another node (see [`keel_scheduling::topology::migrations`]).
    pub migrations: u64,
    /// Log entries applied (refused ones included).
    pub entries: u64,
    pub refused_entries: u64,
    /// Solves of a fractional allocation (heterogeneity-aware policies).
    pub solves: u64,
    /// Jobs that kept exactly the same GPUs from one round to the next,
    /// out of those that ran and were still active (the round-based
    /// mechanism's lease extensions).
    pub lease_extensions: u64,
    pub lease_extension_opportunities: u64,
    /// Placements of two jobs sharing GPUs (space-sharing policies).
    pub pairs_placed: u64,
    /// The final state's hash (empty where no state machine ran).
    pub state_hash: String,
    pub samples: Vec<Sample>,
    /// Finished jobs removed from the state ([`SimConfig::retention`]).
    pub jobs_removed: u64,
    /// The state's size over the run ([`SimConfig::state_size_samples`]).
    pub state_sizes: Vec<StateSize>,
    /// Each queue's use of the cluster, by name (with queues configured).
    pub queues: BTreeMap<String, QueueUse>,
    /// Simulated seconds during which two queues or more had jobs waiting.
    pub contended_s: f64,
    /// Where the allocations' speeds came from.
    pub speeds: SpeedSources,
    /// The entries applied, by index ([`SimConfig::keep_log`]), with the
    /// clock at 0 ms for the workload's time 0.
    pub log: Vec<(u64, LogEntry)>,
}

/// What one queue used over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueUse {
    /// GPU-seconds its jobs held.
    pub gpu_s: f64,
    /// GPU-seconds its jobs held while two queues or more had jobs
    /// waiting (the share fair sharing is about).
    pub contended_gpu_s: f64,
}

/// Summary statistics over the measured jobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JctSummary {
    pub finished: usize,
    pub unfinished: usize,
    pub mean_s: f64,
    pub median_s: f64,
    pub p95_s: f64,
    pub p99_s: f64,
}

impl SimReport {
    /// An empty report of `policy` on `total_gpus` GPUs.
    pub fn new(policy: &str, total_gpus: u32) -> SimReport {
        SimReport {
            policy: policy.to_string(),
            jobs: Vec::new(),
            total_gpus,
            simulated_s: 0.0,
            makespan_s: 0.0,
            utilisation: 0.0,
            rounds: 0,
            decisions: 0,
            preemptions: 0,
            resizes: 0,
            migrations: 0,
            entries: 0,
            refused_entries: 0,
            solves: 0,
            lease_extensions: 0,
            lease_extension_opportunities: 0,
            pairs_placed: 0,
            state_hash: String::new(),
            samples: Vec::new(),
            jobs_removed: 0,
            state_sizes: Vec::new(),
            queues: BTreeMap::new(),
            contended_s: 0.0,
            speeds: SpeedSources::default(),
            log: Vec::new(),
        }
    }

    /// JCT statistics over the jobs in `window` (all when `None`).
    pub fn jct(&self, window: Option<(u64, u64)>) -> JctSummary {
        let measured: Vec<&JobResult> = self
            .jobs
            .iter()
            .filter(|j| window.is_none_or(|(a, b)| (a..=b).contains(&j.id)))
            .collect();
        let mut jcts: Vec<f64> = measured.iter().filter_map(|j| j.jct_s()).collect();
        jcts.sort_by(f64::total_cmp);
        let pick = |p: f64| -> f64 {
            if jcts.is_empty() {
                return 0.0;
            }
            jcts[(((jcts.len() - 1) as f64) * p).round() as usize]
        };
        JctSummary {
            finished: jcts.len(),
            unfinished: measured.len() - jcts.len(),
            mean_s: if jcts.is_empty() {
                0.0
            } else {
                jcts.iter().sum::<f64>() / jcts.len() as f64
            },
            median_s: pick(0.5),
            p95_s: pick(0.95),
            p99_s: pick(0.99),
        }
    }
}

/// A job that holds GPUs in the simulation.
#[derive(Debug, Clone)]
struct Running {
    epoch: u64,
    /// Steps per second on the current allocation.
    rate: f64,
    /// No progress before this time (restart cost).
    resumes_at_s: f64,
    gpus: u32,
    placement: Vec<GpuRef>,
    /// When it last reported progress.
    reported_at_s: f64,
    /// Steps done in all, kept here while it runs (the engine's
    /// `steps_done` holds them while it does not): the clock's every move
    /// credits the running jobs without a lookup.
    steps_done: f64,
    total_steps: f64,
}

impl Running {
    fn remaining(&self) -> f64 {
        self.total_steps - self.steps_done
    }
}

#[derive(Debug)]
struct Engine<'a> {
    config: &'a SimConfig,
    policy: &'a dyn Policy,
    state: ClusterState,
    index: u64,
    now_s: f64,
    /// Workload position → state job id, and back.
    job_of: BTreeMap<u64, JobId>,
    sim_of: BTreeMap<JobId, usize>,
    /// Steps done by the jobs not running now (a running job's are in its
    /// [`Running`]).
    steps_done: BTreeMap<JobId, f64>,
    running: BTreeMap<JobId, Running>,
    results: Vec<JobResult>,
    /// State job id → its entry in `results`.
    result_of: BTreeMap<JobId, usize>,
    report: SimReport,
    busy_gpu_s: f64,
    /// Jobs an applied entry may have changed the allocation of (an event
    /// named them) since the executor last followed the state: all it
    /// reads ([`Engine::follow_allocations`]), not every job holding GPUs.
    touched: BTreeSet<JobId>,
    /// Each job's speed model fitted to its measured speeds, once asked
    /// for (`None`: too few sizes measured).
    fits: BTreeMap<JobId, Option<SpeedModel>>,
}

/// Optimus's speed model (`perf::fit_speed`) over `job`'s measured speeds,
/// each normalised to a v100 by its model's type factor.
fn fit_measured(job: &SimJob) -> Option<SpeedModel> {
    let points: Vec<(u32, f64)> = job
        .measured
        .iter()
        .filter_map(|m| {
            let factor = perf::type_factor(&job.model, &m.gpu_type);
            (factor > 0.0).then(|| (m.gpus, m.steps_per_s / factor))
        })
        .collect();
    perf::fit_speed(&points)
}

fn ms(s: f64) -> u64 {
    (s * 1000.0).round().max(0.0) as u64
}

/// Steps left, relative to the total, below which a job is done.
const EPSILON_STEPS: f64 = 1e-9;

impl Engine<'_> {
    fn apply(&mut self, command: Command) -> Option<Vec<Event>> {
        self.index += 1;
        self.report.entries += 1;
        let entry = LogEntry::new(ms(self.now_s), command);
        let applied = self.state.apply(self.index, &entry);
        if self.config.keep_log {
            self.report.log.push((self.index, entry));
        }
        match applied {
            Ok(events) => {
                for e in &events {
                    if matches!(e, Event::JobPreempted { .. }) {
                        self.report.preemptions += 1;
                    }
                    // Progress and a worker's start move no allocation.
                    if !matches!(
                        e,
                        Event::JobProgressReported { .. } | Event::WorkerStarted { .. }
                    ) {
                        if let Some(job_id) = e.job_id() {
                            self.touched.insert(job_id);
                        }
                    }
                }
                Some(events)
            }
            Err(_) => {
                self.report.refused_entries += 1;
                None
            }
        }
    }

    /// Moves the clock to `t`, crediting progress and busy GPU time (each
    /// queue's too, with queues configured).
    fn advance(&mut self, t: f64) {
        let dt = t - self.now_s;
        if dt <= 0.0 {
            return;
        }
        let queues = !self.config.queues.is_empty();
        let contended = queues && self.state.queues_with_waiting_jobs().nth(1).is_some();
        if contended {
            self.report.contended_s += dt;
        }
        for (job_id, r) in self.running.iter_mut() {
            let from = self.now_s.max(r.resumes_at_s);
            if t > from {
                r.steps_done += r.rate * (t - from);
            }
            let gpu_s = f64::from(r.gpus) * dt;
            self.busy_gpu_s += gpu_s;
            if queues {
                let queue = self
                    .sim_of
                    .get(job_id)
                    .map_or("", |i| self.config.jobs[*i].queue.as_str());
                let queue = keel_state::quota::queue_of(queue);
                let used = match self.report.queues.get_mut(queue) {
                    Some(u) => u,
                    None => self.report.queues.entry(queue.to_string()).or_default(),
                };
                used.gpu_s += gpu_s;
                if contended {
                    used.contended_gpu_s += gpu_s;
                }
            }
        }
        self.now_s = t;
    }

    /// Whether job `position` of the workload, arriving now, finds its
    /// queue with no job waiting and enough unused quota of a type it may
    /// use.
    fn within_quota(&self, position: usize) -> bool {
        let job = &self.config.jobs[position];
        let queue = keel_state::quota::queue_of(&job.queue);
        if self.config.queues.is_empty() || self.state.waiting_in_queue(queue).next().is_some() {
            return false;
        }
        let Some(book) = self.state.quota_book() else {
            return false;
        };
        let demand = job.gpus_per_worker.saturating_mul(job.workers_min);
        let fits = book
            .gpu_types()
            .any(|t| book.used(queue, t).saturating_add(demand) <= book.quota(queue, t));
        fits
    }

    fn total_steps(&self, job_id: JobId) -> f64 {
        self.sim_of
            .get(&job_id)
            .map_or(0.0, |i| self.config.jobs[*i].total_steps as f64)
    }

    /// Steps `job_id` has done in all.
    fn steps(&self, job_id: JobId) -> f64 {
        match self.running.get(&job_id) {
            Some(r) => r.steps_done,
            None => self.steps_done.get(&job_id).copied().unwrap_or(0.0),
        }
    }

    /// Takes `job_id` off the running jobs, keeping its steps.
    fn stop_running(&mut self, job_id: JobId) -> Option<Running> {
        let r = self.running.remove(&job_id)?;
        self.steps_done.insert(job_id, r.steps_done);
        Some(r)
    }

    /// When the next running job finishes, at the current rates.
    fn next_finish(&self) -> Option<f64> {
        self.running
            .values()
            .filter(|r| r.rate > 0.0)
            .map(|r| self.now_s.max(r.resumes_at_s) + r.remaining().max(0.0) / r.rate)
            .min_by(f64::total_cmp)
    }

    /// Steps per second of `job_id` on `gpus` GPUs of `gpu_type`: measured
    /// there; else Optimus's speed model fitted to its measured speeds
    /// (three sizes or more); else scaled from its closest measured speed
    /// (the same type first, then the nearest size) by its model's
    /// profile; else from a table. Counts where it came from.
    fn rate(&mut self, job_id: JobId, gpu_type: &str, gpus: u32) -> f64 {
        let config = self.config;
        let Some(job) = self.sim_of.get(&job_id).map(|i| &config.jobs[*i]) else {
            return 0.0;
        };
        if let Some(m) = job
            .measured
            .iter()
            .find(|m| m.gpu_type == gpu_type && m.gpus == gpus)
        {
            self.report.speeds.measured += 1;
            return m.steps_per_s;
        }
        let fitted = *self.fits.entry(job_id).or_insert_with(|| fit_measured(job));
        if let Some(model) = fitted {
            let speed = model.steps_per_s(gpus) * perf::type_factor(&job.model, gpu_type);
            if speed > 0.0 {
                self.report.speeds.modelled += 1;
                return speed;
            }
        }
        let closest = job
            .measured
            .iter()
            .min_by_key(|m| (m.gpu_type != gpu_type, m.gpus.abs_diff(gpus)));
        let profile = throughput::profile(&job.model);
        if let Some(m) = closest {
            let (to, from) = (
                profile.steps_per_s(gpu_type, gpus),
                profile.steps_per_s(&m.gpu_type, m.gpus),
            );
            if to > 0.0 && from > 0.0 {
                self.report.speeds.modelled += 1;
                return m.steps_per_s * to / from;
            }
        }
        self.report.speeds.table += 1;
        let from_table = self
            .config
            .throughputs
            .as_ref()
            .zip(job.job_type.as_deref())
            .and_then(|(table, job_type)| table.steps_per_s(job_type, gpus, gpu_type));
        let table = from_table.unwrap_or_else(|| profile.steps_per_s(gpu_type, gpus));
        table * self.config.table_scale
    }

    /// Cancels job `position` of the workload, unless it has ended.
    fn cancel(&mut self, position: usize) {
        let Some(job_id) = self.job_of.get(&self.config.jobs[position].id).copied() else {
            return;
        };
        if self.state.job(job_id).is_none_or(|j| j.state.is_terminal()) {
            return;
        }
        let cancelled = self.apply(Command::cancel_job(
            job_id,
            "cancelled at its recorded time",
        ));
        let now = self.now_s;
        if cancelled.is_some() {
            if let Some(r) = self.result_mut(job_id) {
                r.cancelled_s = Some(now);
            }
        }
    }

    /// Applies node change `change`.
    fn change_node(&mut self, change: &NodeChange) {
        let name = change.node.clone();
        self.apply(if change.up {
            Command::mark_node_recovered(name)
        } else {
            Command::mark_node_lost(name, "lost at its recorded time")
        });
    }

    fn submit(&mut self, position: usize) {
        let job = &self.config.jobs[position];
        let spec = JobSpec {
            name: format!("sim-{}", job.id),
            user: "sim".into(),
            command: vec!["keel".into(), "trainer".into()],
            image: None,
            env: BTreeMap::new(),
            secret_env: BTreeMap::new(),
            gpus: job.gpus_per_worker,
            workers: Workers {
                min: job.workers_min,
                max: job.workers_max,
            },
            gpu_types: Default::default(),
            model: Some(job.model.clone()),
            total_steps: Some(job.total_steps),
            epochs: None,
            priority: job.priority,
            max_retries: 0,
            retry_backoff_s: 0,
            resources: Default::default(),
            logs: Default::default(),
            queue: job.queue.clone(),
            preemptible: true,
        };
        let within_quota = self.within_quota(position);
        let queue = keel_state::quota::queue_of(&job.queue).to_string();
        let (id, arrival_s, model, gpus) = (
            job.id,
            job.arrival_s,
            job.model.clone(),
            job.gpus_per_worker * job.workers_min,
        );
        let job_id = self.apply(Command::submit_job(spec)).and_then(|events| {
            events.iter().find_map(|e| match e {
                Event::JobSubmitted { job_id, .. } => Some(*job_id),
                _ => None,
            })
        });
        let Some(job_id) = job_id else {
            return;
        };
        self.job_of.insert(id, job_id);
        self.sim_of.insert(job_id, position);
        self.result_of.insert(job_id, self.results.len());
        self.results.push(JobResult {
            id,
            queue,
            within_quota,
            job_id,
            model,
            gpus,
            arrival_s,
            first_start_s: None,
            finish_s: None,
            cancelled_s: None,
            restarts: 0,
        });
    }

    fn result_mut(&mut self, job_id: JobId) -> Option<&mut JobResult> {
        let at = *self.result_of.get(&job_id)?;
        self.results.get_mut(at)
    }

    /// Finishes the jobs whose steps are done by now.
    fn finish_done(&mut self) -> bool {
        // Done: no steps left, up to rounding (progress is a sum of
        // rate × interval terms), or so few that the clock cannot move
        // forward by their time.
        let done: Vec<(JobId, u64)> = self
            .running
            .iter()
            .filter(|(_, r)| {
                let remaining = r.remaining();
                remaining <= EPSILON_STEPS * r.total_steps.max(1.0)
                    || (r.rate > 0.0
                        && self.now_s >= r.resumes_at_s
                        && self.now_s + remaining / r.rate <= self.now_s)
            })
            .map(|(job_id, r)| (*job_id, r.epoch))
            .collect();
        for (job_id, epoch) in &done {
            self.report_progress(*job_id);
            let ranks = self.state.job(*job_id).map_or(0, |j| j.worker_count());
            for rank in 0..ranks {
                self.apply(Command::record_worker_exited(
                    *job_id,
                    *epoch,
                    rank,
                    Some(0),
                    "finished",
                ));
            }
            self.stop_running(*job_id);
            let now = self.now_s;
            if let Some(r) = self.result_mut(*job_id) {
                r.finish_s = Some(now);
            }
        }
        !done.is_empty()
    }

    fn report_progress(&mut self, job_id: JobId) {
        let total = self.total_steps(job_id);
        let step = self.steps(job_id).min(total);
        let now = self.now_s;
        let rate = self.running.get_mut(&job_id).map_or(0.0, |r| {
            r.reported_at_s = now;
            r.rate
        });
        let batch = self.sim_of.get(&job_id).map_or(1, |i| {
            throughput::profile(&self.config.jobs[*i].model).batch_size
        });
        self.apply(Command::report_progress(
            job_id,
            vec![ProgressSample {
                step: step as u64,
                total_steps: total as u64,
                loss: Some(
                    throughput::LossCurve::for_run(2.5, 0.1, total as u64).loss(step as u64),
                ),
                samples_per_s: rate * f64::from(batch),
                at_ms: ms(self.now_s),
            }],
        ));
    }

    /// One scheduling pass, then the simulated executor follows the state.
    fn schedule(&mut self) {
        self.report.rounds += 1;
        if let Some(decision) = policy::decide(self.policy, &self.state, ms(self.now_s)) {
            if self.apply(decision).is_some() {
                self.report.decisions += 1;
            }
        }
        self.follow_allocations();
    }

    /// Starts the workers of new allocations and stops those whose
    /// allocation went away, as the reconciler does: of the jobs whose
    /// allocation may have changed since it last did (`touched`), in id
    /// order.
    fn follow_allocations(&mut self) {
        let touched = std::mem::take(&mut self.touched);
        let stopped: Vec<JobId> = touched
            .iter()
            .filter(|job_id| {
                self.running.get(job_id).is_some_and(|r| {
                    self.state
                        .job(**job_id)
                        .and_then(|j| j.allocation.as_ref())
                        .is_none_or(|a| a.epoch != r.epoch)
                })
            })
            .copied()
            .collect();
        let mut moved_from: BTreeMap<JobId, Vec<GpuRef>> = BTreeMap::new();
        for job_id in stopped {
            // Its progress stays with the simulator (`steps_done`); the
            // state heard of it at the last round.
            if let Some(r) = self.stop_running(job_id) {
                moved_from.insert(job_id, r.placement);
            }
        }
        let started: Vec<(JobId, u64, Vec<GpuRef>, Vec<String>)> = touched
            .iter()
            .filter_map(|job_id| self.state.job(*job_id))
            .filter(|j| j.state == JobState::Running && !self.running.contains_key(&j.id))
            .filter_map(|j| {
                let a = j.allocation.as_ref()?;
                let nodes = a
                    .ranks(j.spec.gpus)
                    .iter()
                    .map(|gpus| gpus.first().map(|g| g.node.clone()).unwrap_or_default())
                    .collect();
                Some((j.id, a.epoch, a.gpus.clone(), nodes))
            })
            .collect();
        for (job_id, epoch, gpus, nodes) in started {
            let gpu_type = keel_scheduling::topology::allocation_type(&self.state, &gpus)
                .unwrap_or_default()
                .to_string();
            let count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
            for (rank, node) in nodes.into_iter().enumerate() {
                self.apply(Command::record_worker_started(
                    job_id,
                    epoch,
                    u32::try_from(rank).unwrap_or(u32::MAX),
                    node,
                ));
            }
            if let Some(before) = moved_from.get(&job_id) {
                let per = self.state.job(job_id).map_or(1, |j| j.spec.gpus);
                self.report.resizes += 1;
                self.report.migrations +=
                    u64::from(keel_scheduling::topology::migrations(before, &gpus, per));
            }
            let rate = self.rate(job_id, &gpu_type, count);
            let restart = self
                .sim_of
                .get(&job_id)
                .and_then(|i| self.config.jobs[*i].restart_s)
                .unwrap_or(self.config.restart_s)
                .max(0.0);
            let now = self.now_s;
            if let Some(r) = self.result_mut(job_id) {
                if r.first_start_s.is_none() {
                    r.first_start_s = Some(now);
                } else {
                    r.restarts += 1;
                }
            }
            self.running.insert(
                job_id,
                Running {
                    epoch,
                    rate,
                    resumes_at_s: now + restart,
                    gpus: count,
                    placement: gpus,
                    reported_at_s: now,
                    steps_done: self.steps(job_id),
                    total_steps: self.total_steps(job_id),
                },
            );
        }
    }

    fn sample(&mut self) {
        let busy_gpus = self.running.values().map(|r| r.gpus).sum();
        let queued_jobs = self.state.queued_count();
        let sample = Sample {
            at_s: self.now_s,
            busy_gpus,
            queued_jobs: u32::try_from(queued_jobs).unwrap_or(u32::MAX),
        };
        if self.report.samples.last().map(|s| s.at_s) == Some(sample.at_s) {
            self.report.samples.pop();
        }
        self.report.samples.push(sample);
    }

    /// Removes the finished jobs [`SimConfig::retention`] says are due, as
    /// the live leader's retention does.
    fn retain(&mut self) {
        let Some(r) = self.config.retention else {
            return;
        };
        let retain_ms = r.finished_s.map_or(u64::MAX, ms);
        let due = self.state.jobs_due_for_removal(
            ms(self.now_s),
            retain_ms,
            r.finished_max.unwrap_or(usize::MAX),
            usize::MAX,
        );
        for job_id in due {
            if self.apply(Command::remove_job(job_id)).is_some() {
                self.report.jobs_removed += 1;
            }
        }
    }

    /// Records the state's size ([`SimConfig::state_size_samples`]).
    fn record_state_size(&mut self, submitted: u64) {
        let size = StateSize {
            at_s: self.now_s,
            submitted,
            jobs: u64::try_from(self.state.jobs().len()).unwrap_or(u64::MAX),
            snapshot_bytes: u64::try_from(self.state.snapshot_len()).unwrap_or(u64::MAX),
        };
        self.report.state_sizes.push(size);
    }

    fn window_done(&self) -> bool {
        let Some((a, b)) = self.config.window else {
            return false;
        };
        self.config
            .jobs
            .iter()
            .filter(|j| (a..=b).contains(&j.id))
            .all(|j| {
                self.job_of.get(&j.id).is_some_and(|id| {
                    // Removed by retention: it had ended.
                    self.state
                        .job(*id)
                        .map_or(self.state.was_removed(*id), |job| job.state.is_terminal())
                })
            })
    }
}

/// Something the run does at a set time besides arrivals.
#[derive(Debug, Clone, Copy)]
enum Timed<'a> {
    /// Cancel job `position` of the workload.
    Cancel(usize),
    /// Apply [`SimConfig::node_changes`]`[i]`.
    Node(usize),
    /// Switch to this policy.
    Policy(&'a dyn Policy),
}

/// Runs the simulation of `config` under `policy`.
pub fn simulate(config: &SimConfig, policy: &dyn Policy) -> SimReport {
    simulate_policies(config, &[(f64::NEG_INFINITY, policy)])
}

/// Runs the simulation of `config` under each policy of `policies` from
/// its time on (seconds on the workload's clock; the first from the
/// start, whatever its time): a recorded history's policy changes. The
/// report is named after the first. An empty schedule runs FIFO.
pub fn simulate_policies(config: &SimConfig, policies: &[(f64, &dyn Policy)]) -> SimReport {
    let fifo = keel_scheduling::policy::Fifo::new(Default::default());
    let policy: &dyn Policy = policies.first().map_or(&fifo, |(_, p)| *p);
    let total_gpus = config
        .nodes
        .iter()
        .map(|n| u32::try_from(n.gpus.len()).unwrap_or(u32::MAX))
        .sum();
    let mut order: Vec<usize> = (0..config.jobs.len()).collect();
    order.sort_by(|a, b| {
        config.jobs[*a]
            .arrival_s
            .total_cmp(&config.jobs[*b].arrival_s)
            .then(a.cmp(b))
    });
    let start_s = order.first().map_or(0.0, |i| config.jobs[*i].arrival_s);
    let mut timed: Vec<(f64, Timed)> = Vec::new();
    for (position, job) in config.jobs.iter().enumerate() {
        if let Some(at) = job.cancel_at_s.filter(|t| t.is_finite()) {
            timed.push((at, Timed::Cancel(position)));
        }
    }
    for (i, change) in config.node_changes.iter().enumerate() {
        if change.at_s.is_finite() {
            timed.push((change.at_s, Timed::Node(i)));
        }
    }
    for (at, p) in policies.iter().skip(1) {
        if at.is_finite() {
            timed.push((*at, Timed::Policy(*p)));
        }
    }
    // By time; at one time, in the order pushed (stable).
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut next_timed = 0;
    let mut engine = Engine {
        config,
        policy,
        state: ClusterState::new(),
        index: 0,
        now_s: start_s,
        job_of: BTreeMap::new(),
        sim_of: BTreeMap::new(),
        steps_done: BTreeMap::new(),
        running: BTreeMap::new(),
        results: Vec::new(),
        result_of: BTreeMap::new(),
        report: SimReport::new(policy.name(), total_gpus),
        busy_gpu_s: 0.0,
        touched: BTreeSet::new(),
        fits: BTreeMap::new(),
    };
    for node in &config.nodes {
        engine.apply(Command::register_node(
            node.name.clone(),
            "10.0.0.1",
            node.gpus.clone(),
        ));
    }
    for (name, spec) in &config.queues {
        let (name, spec) = (name.clone(), spec.clone());
        engine.apply(if name == DEFAULT_QUEUE {
            Command::update_queue(name, spec)
        } else {
            Command::create_queue(name, spec)
        });
    }
    let round_s = if config.round_s.is_finite() && config.round_s > 0.0 {
        config.round_s
    } else {
        360.0
    };
    let mut next_arrival = 0;
    let mut next_tick = start_s;
    let size_every = match config.state_size_samples {
        0 => usize::MAX,
        n => (config.jobs.len() / n as usize).max(1),
    };
    loop {
        let arrival = order.get(next_arrival).map(|i| config.jobs[*i].arrival_s);
        let finish = engine.next_finish();
        let due = timed.get(next_timed).map(|(at, _)| at.max(start_s));
        let idle = engine.running.is_empty();
        if arrival.is_none() && finish.is_none() && due.is_none() && idle {
            // Nothing runs and nothing will arrive or change: what waits
            // now can never be placed.
            break;
        }
        let mut t = next_tick;
        for c in [arrival, finish, due].into_iter().flatten() {
            t = t.min(c);
        }
        if t - start_s > config.max_simulated_s {
            break;
        }
        engine.advance(t);
        let mut changed = engine.finish_done();
        while let Some(i) = order.get(next_arrival) {
            if config.jobs[*i].arrival_s > engine.now_s {
                break;
            }
            engine.submit(*i);
            next_arrival += 1;
            changed = true;
            if next_arrival % size_every == 0 {
                engine.record_state_size(next_arrival as u64);
            }
        }
        while let Some((at, what)) = timed.get(next_timed).copied() {
            if at > engine.now_s {
                break;
            }
            next_timed += 1;
            changed = true;
            match what {
                Timed::Cancel(position) => engine.cancel(position),
                Timed::Node(i) => engine.change_node(&config.node_changes[i]),
                Timed::Policy(p) => engine.policy = p,
            }
        }
        let tick = engine.now_s >= next_tick;
        if tick {
            let due_s = engine.now_s - config.progress_interval_s.max(0.0);
            let running: Vec<JobId> = engine
                .running
                .iter()
                .filter(|(_, r)| r.reported_at_s <= due_s)
                .map(|(job_id, _)| *job_id)
                .collect();
            for job_id in running {
                engine.report_progress(job_id);
            }
            while next_tick <= engine.now_s {
                next_tick += round_s;
            }
        }
        if changed || tick {
            engine.schedule();
            engine.sample();
        }
        if tick {
            engine.retain();
        }
        if engine.window_done() {
            break;
        }
    }
    if config.state_size_samples > 0 {
        engine.record_state_size(next_arrival as u64);
    }
    let end_s = engine.now_s;
    let mut report = engine.report;
    report.jobs = engine.results;
    report.simulated_s = end_s - start_s;
    let last_finish = report
        .jobs
        .iter()
        .filter(|j| config.window.is_none_or(|(a, b)| (a..=b).contains(&j.id)))
        .filter_map(|j| j.finish_s)
        .max_by(f64::total_cmp)
        .unwrap_or(start_s);
    report.makespan_s = last_finish - start_s;
    let available = f64::from(report.total_gpus) * report.simulated_s;
    report.utilisation = if available > 0.0 {
        engine.busy_gpu_s / available
    } else {
        0.0
    };
    report.state_hash = engine.state.state_hash().to_string();
    report
}
