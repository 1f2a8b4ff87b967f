//! Hollow nodes (issue 26): workers that are real to the control plane and
//! cost no process, so one machine can drive a control plane managing
//! thousands of GPUs (kubemark's hollow kubelets, nomad-nodesim).
//!
//! The nodes are the server's simulated ones (registered and heartbeating
//! like any other); the leader places, launches, observes, stops and
//! re-adopts their workers through the same reconciler and the same
//! [`WorkerBook`] as the other executors. Only the process layer is
//! replaced: a launch decides the worker's whole run at once, as `keel
//! trainer` would run it (its flags read from the job's command with the
//! same parser, [`TrainerArgs`]; the contract's values given as flags),
//! and one ticker per executor, not a task per worker, reads where every
//! run is at the clock's time:
//!
//! - it advances at its model's speed on its GPUs from the throughput
//!   table (times `--speedup`), rank 0 reporting progress (step, loss on
//!   the trainer's curve with seeded noise, samples/s) every
//!   `--report-every-s`, as the trainer does;
//! - it exits 0 at its last step, or `--exit-code` at `--fail-at-step`
//!   (resuming from the last periodic checkpoint before it, as the trainer
//!   does), or 143 when Keel stops it (checkpointed at the step reached);
//! - a relaunch resumes from the job's checkpoint, the same file, in the
//!   same format, that the real trainer writes
//!   ([`crate::trainer::read_checkpoint`]).
//!
//! Each run is a line in the executor directory's run journal
//! ([`journal`]: launched, stopped, forgotten): a leader that takes over,
//! in this process or another sharing the directory, computes where every
//! run is now, re-adopts the running ones and reports the exits no one
//! saw, as it would for supervised processes. The journal is not synced (a
//! hollow run's durability is not what is measured). A run that asks for
//! `--hold-at-step` is refused: it waits for a file, which a hollow worker
//! does not look for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use clap::Parser;
use keel_scheduling::throughput::{profile, LossCurve};
use keel_state::rng::SplitMix64;
use keel_state::{JobId, ProgressSample};
use serde::{Deserialize, Serialize};

use crate::book::{Book, Clock, SystemClock, Worker, WorkerBook};
use crate::contract::{checkpoint_dir_name, gpu_refs, WorkerLaunch, EXIT_STOPPED};
use crate::declared_nodes::DeclaredNodes;
use crate::executor::{Executor, ExecutorError, WorkerLog};
use crate::reconcile::Observed;
use crate::trainer::{read_checkpoint, write_checkpoint, TrainerArgs};
use crate::WorkerId;

mod journal;

use journal::{Journal, Line};

/// Where a hollow executor keeps its records, and how often it reads its
/// runs (rank 0 reports every `--report-every-s` of its own, as the
/// trainer does; a read more often only finds exits sooner).
#[derive(Debug, Clone)]
pub struct HollowConfig {
    /// The run journal (`runs.jsonl`) and node markers (`nodes/`).
    pub dir: PathBuf,
    /// Checkpoints, one directory per job, as the real trainer keeps them.
    pub checkpoints_dir: PathBuf,
    /// How often the ticker reads every run (progress, exits).
    pub tick_every: Duration,
}

/// A hollow worker's whole run, decided at launch (or changed by a stop).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Run {
    node: String,
    gpus: Vec<u32>,
    model: String,
    /// When it was launched (the clock's Unix milliseconds).
    launched_ms: u64,
    start_step: u64,
    total_steps: u64,
    /// Steps per second of the clock (the speed-up included).
    steps_per_s: f64,
    samples_per_s: f64,
    fail_at_step: Option<u64>,
    exit_code: i32,
    checkpoint_every_steps: u64,
    /// Rank 0 reports progress and writes checkpoints.
    reports: bool,
    /// How often rank 0 reports (the trainer's `--report-every-s`).
    #[serde(default = "default_report_every_ms")]
    report_every_ms: u64,
    seed: u64,
    /// When Keel stopped it.
    stopped_ms: Option<u64>,
}

/// Where a run is at some time.
#[derive(Debug, Clone, PartialEq)]
enum Status {
    Running {
        step: u64,
    },
    Ended {
        step: u64,
        code: i32,
        /// The step its checkpoint holds (`None`: none written, the run
        /// ended at its last step).
        checkpoint: Option<u64>,
    },
}

impl Run {
    /// The record of a launch that did not start (bad flags): ended.
    fn not_started(launch: &WorkerLaunch, now_ms: u64) -> Run {
        Run {
            node: launch.node.clone(),
            gpus: launch.gpus.clone(),
            model: launch.model.clone().unwrap_or_default(),
            launched_ms: now_ms,
            start_step: 0,
            total_steps: 1,
            steps_per_s: 0.0,
            samples_per_s: 0.0,
            fail_at_step: None,
            exit_code: 2,
            checkpoint_every_steps: 1,
            reports: false,
            report_every_ms: default_report_every_ms(),
            seed: 0,
            stopped_ms: Some(now_ms),
        }
    }

    /// The step reached at `at_ms`, before any exit.
    fn step_at(&self, at_ms: u64) -> u64 {
        let ran_s = at_ms.saturating_sub(self.launched_ms) as f64 / 1000.0;
        let steps = (ran_s * self.steps_per_s) as u64;
        self.start_step.saturating_add(steps).min(self.total_steps)
    }

    /// Where the run is at `at_ms`.
    fn status_at(&self, at_ms: u64) -> Status {
        let until = self.stopped_ms.map_or(at_ms, |s| s.min(at_ms));
        let step = self.step_at(until);
        if let Some(fail) = self
            .fail_at_step
            .filter(|f| self.start_step < *f && step >= *f)
        {
            // The trainer checkpoints every `checkpoint_every_steps` from
            // where it started: its last one before the failure.
            let every = self.checkpoint_every_steps.max(1);
            let done = (fail - self.start_step - 1) / every * every;
            return Status::Ended {
                step: fail,
                code: self.exit_code,
                checkpoint: Some(self.start_step + done),
            };
        }
        if step >= self.total_steps {
            return Status::Ended {
                step,
                code: 0,
                checkpoint: None,
            };
        }
        if self.stopped_ms.is_some_and(|s| at_ms >= s) {
            return Status::Ended {
                step,
                code: EXIT_STOPPED,
                checkpoint: Some(step),
            };
        }
        Status::Running { step }
    }

    /// Rank 0's progress line at `step`, read at `at_ms`.
    fn sample(&self, step: u64, at_ms: u64) -> ProgressSample {
        let curve = LossCurve::for_run(2.5, 0.1, self.total_steps);
        let mut rng = SplitMix64::new(self.seed ^ step.rotate_left(17));
        let mut noise = |amplitude: f64| 1.0 + amplitude * (2.0 * rng.unit() - 1.0);
        ProgressSample {
            step,
            total_steps: self.total_steps,
            loss: Some((curve.loss(step) * noise(0.03) * 1e4).round() / 1e4),
            samples_per_s: (self.samples_per_s * noise(0.02) * 10.0).round() / 10.0,
            at_ms,
        }
    }

    /// What `keel logs` shows of it.
    fn log(&self, status: &Status) -> String {
        let mut text = format!(
            "keel trainer (hollow): {} on {}x GPUs {:?} of {} at {:.2} steps/s, from step {} of {}\n",
            self.model,
            self.gpus.len(),
            self.gpus,
            self.node,
            self.steps_per_s,
            self.start_step,
            self.total_steps
        );
        if let Status::Ended { step, code, .. } = status {
            text.push_str(&format!(
                "keel trainer (hollow): exited with code {code} at step {step}\n"
            ));
        }
        text
    }
}

fn default_report_every_ms() -> u64 {
    1000
}

/// What the book keeps of a hollow worker.
#[derive(Debug)]
pub struct Hollow {
    run: Run,
    /// The last step rank 0 reported, and when.
    reported: Option<(u64, u64)>,
}

impl Hollow {
    /// Whether rank 0 reports `step` at `at_ms`: at its first read, then
    /// once every `report_every_ms` when the step moved, and at its end.
    fn reports(&self, step: u64, at_ms: u64, ended: bool) -> bool {
        if !self.run.reports {
            return false;
        }
        match self.reported {
            None => true,
            Some((last, _)) if last == step => false,
            Some((_, when)) => ended || at_ms.saturating_sub(when) >= self.run.report_every_ms,
        }
    }
}

/// The executor whose workers are hollow (see the module's text).
#[derive(Debug, Clone)]
pub struct HollowExecutor {
    config: Arc<HollowConfig>,
    book: Arc<WorkerBook<Hollow>>,
    /// The nodes the servers sharing its directory declared.
    nodes: DeclaredNodes,
    /// Those nodes as last read (when declared, and when it takes over):
    /// `owns` is asked for every wanted worker of every pass.
    owned: Arc<RwLock<BTreeSet<String>>>,
    journal: Arc<Mutex<Journal>>,
}

impl HollowExecutor {
    pub fn new(config: HollowConfig) -> Result<HollowExecutor, ExecutorError> {
        HollowExecutor::with_clock(config, Arc::new(SystemClock))
    }

    /// A hollow executor reading `clock` (tests move a manual one).
    pub fn with_clock(
        config: HollowConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<HollowExecutor, ExecutorError> {
        for dir in [
            &config.dir,
            &config.dir.join("nodes"),
            &config.checkpoints_dir,
        ] {
            std::fs::create_dir_all(dir)
                .map_err(|e| ExecutorError::Other(format!("creating {}: {e}", dir.display())))?;
        }
        let journal = Journal::open(&config.dir.join(JOURNAL)).map_err(|e| {
            ExecutorError::Other(format!(
                "opening {}: {e}",
                config.dir.join(JOURNAL).display()
            ))
        })?;
        let executor = HollowExecutor {
            nodes: DeclaredNodes::new(&config.dir.join("nodes")),
            config: Arc::new(config),
            book: Arc::new(WorkerBook::new(clock)),
            owned: Arc::new(RwLock::new(BTreeSet::new())),
            journal: Arc::new(Mutex::new(journal)),
        };
        executor.read_nodes();
        Ok(executor)
    }

    /// Declares `names` as nodes whose workers this executor (and every one
    /// sharing its directory) runs.
    pub fn declare_nodes<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ExecutorError> {
        self.nodes.declare(names)?;
        self.read_nodes();
        Ok(())
    }

    fn read_nodes(&self) {
        *self.owned.write().unwrap_or_else(|e| e.into_inner()) = self.nodes.all();
    }

    fn checkpoint_dir(&self, job_id: JobId) -> PathBuf {
        self.config
            .checkpoints_dir
            .join(checkpoint_dir_name(job_id))
    }

    /// The run `launch` asks for, starting at `now_ms`, or why it cannot
    /// start (the trainer's exit code 2: bad configuration).
    fn plan(&self, launch: &WorkerLaunch, now_ms: u64) -> Result<Run, String> {
        let args = TrainerArgs::try_parse_from(trainer_argv(launch))
            .map_err(|e| format!("keel trainer (hollow): {}", e.to_string().trim()))?;
        if args.hold_at_step.is_some() {
            return Err(
                "keel trainer (hollow): --hold-at-step is not modelled by hollow workers".into(),
            );
        }
        let opts = args.options();
        opts.check()
            .map_err(|e| format!("keel trainer (hollow): {e}"))?;
        let model = profile(&opts.model);
        let gpus = opts.gpus.max(1);
        let shared = opts
            .shared_with_model
            .as_deref()
            .map_or(1.0, |m| model.shared_fraction(profile(m)));
        let start_step = read_checkpoint(&self.checkpoint_dir(launch.id.job_id))
            .map_err(|e| format!("keel trainer (hollow): {e}"))?
            .min(opts.total_steps);
        Ok(Run {
            node: launch.node.clone(),
            gpus: launch.gpus.clone(),
            model: model.model.to_string(),
            launched_ms: now_ms,
            start_step,
            total_steps: opts.total_steps,
            steps_per_s: opts.steps_per_s() * opts.speedup,
            samples_per_s: model.samples_per_s(&opts.gpu_type, gpus) * shared,
            fail_at_step: opts.fail_at_step,
            exit_code: opts.exit_code,
            checkpoint_every_steps: opts.checkpoint_every_steps,
            reports: opts.rank == 0,
            report_every_ms: (opts.report_every_s.max(0.01) * 1000.0) as u64,
            seed: opts.seed,
            stopped_ms: None,
        })
    }

    /// Appends `line` to the run journal.
    fn log(&self, id: &WorkerId, line: &Line) -> Result<(), ExecutorError> {
        self.journal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .append(line)
            .map_err(|source| ExecutorError::Io {
                id: id.clone(),
                source,
            })
    }

    /// Rewrites the run journal with the runs the book holds, when it has
    /// grown well past them. The journal stays locked from reading the
    /// book to the rewrite: a launch, stop or forget meanwhile (the book
    /// changed first, the journal after) appends after the rewrite, so no
    /// line is lost (at worst a launch is written twice, the same run).
    fn compact_journal(&self) {
        let mut journal = self.journal.lock().unwrap_or_else(|e| e.into_inner());
        let live: Vec<(WorkerId, Run)> = {
            let book = self.book.lock();
            if !journal.wants_compaction(book.workers.len()) {
                return;
            }
            book.workers
                .iter()
                .map(|(id, w)| (id.clone(), w.extra.run.clone()))
                .collect()
        };
        if let Err(e) = journal.compact(live.iter().map(|(id, run)| (id, run))) {
            tracing::warn!(error = %e, "hollow runs' journal not compacted");
        }
    }

    /// Reads every run at the clock's time: rank 0's progress, and the
    /// exits reached (their checkpoints written). The ticker calls it every
    /// [`HollowConfig::tick_every`]; tests call it after moving a manual
    /// clock.
    pub fn tick(&self) {
        let now_ms = self.book.unix_ms();
        let checkpoints: Vec<Checkpoint> = {
            let mut book = self.book.lock();
            let running: Vec<WorkerId> = book.running();
            running
                .iter()
                .filter_map(|id| read_run(&mut book, id, now_ms))
                .collect()
        };
        for c in checkpoints {
            self.checkpoint(c);
        }
    }

    fn checkpoint(
        &self,
        Checkpoint {
            job_id,
            step,
            model,
        }: Checkpoint,
    ) {
        let dir = self.checkpoint_dir(job_id);
        let written = std::fs::create_dir_all(&dir)
            .map_err(|e| e.to_string())
            .and_then(|()| write_checkpoint(&dir, step, &model).map_err(|e| e.to_string()));
        if let Err(e) = written {
            tracing::warn!(job = job_id, step, error = %e, "hollow worker: checkpoint not written");
        }
    }

    /// Finds the runs an earlier leader left: the running ones go on, the
    /// ended ones are reported.
    fn take_over_records(&self) {
        let runs = journal::read(&self.config.dir.join(JOURNAL));
        let now_ms = self.book.unix_ms();
        let mut found = 0usize;
        for (id, run) in runs {
            if self.book.contains(&id) {
                continue;
            }
            let status = run.status_at(now_ms);
            let (node, gpus) = (
                run.node.clone(),
                gpu_refs(&run.node, run.gpus.iter().copied()),
            );
            let mut worker = Worker::running(
                &node,
                gpus,
                Hollow {
                    run,
                    reported: None,
                },
            );
            worker.stopping = worker.extra.run.stopped_ms.is_some();
            self.book.insert(&id, worker);
            if let Status::Ended { code, step, .. } = status {
                self.book
                    .record_exit(&id, Some(code), exit_words(code, step));
            }
            found += 1;
        }
        if found > 0 {
            tracing::info!(workers = found, "hollow runs taken over");
        }
    }
}

/// The run journal's file in [`HollowConfig::dir`].
const JOURNAL: &str = "runs.jsonl";

/// A checkpoint a run's end asks for (written outside the book's lock).
struct Checkpoint {
    job_id: JobId,
    step: u64,
    model: String,
}

/// Reads running worker `id`'s run at `now_ms` into the book: rank 0's
/// progress when due, and its exit when it has ended; the checkpoint that
/// exit asks for, if any.
fn read_run(book: &mut Book<Hollow>, id: &WorkerId, now_ms: u64) -> Option<Checkpoint> {
    let generation = book.generation();
    let hollow = &mut book.workers.get_mut(id)?.extra;
    let status = hollow.run.status_at(now_ms);
    let (step, ended) = match &status {
        Status::Running { step } => (*step, None),
        Status::Ended {
            step,
            code,
            checkpoint,
        } => (*step, Some((*code, *checkpoint))),
    };
    let sample = hollow
        .reports(step, now_ms, ended.is_some())
        .then(|| hollow.run.sample(step, now_ms));
    if sample.is_some() {
        hollow.reported = Some((step, now_ms));
    }
    let checkpoint = ended
        .and_then(|(_, at)| at)
        .filter(|_| hollow.run.reports)
        .map(|step| Checkpoint {
            job_id: id.job_id,
            step,
            model: hollow.run.model.clone(),
        });
    if let Some(sample) = sample {
        book.add_progress(generation, id.job_id, [sample]);
    }
    if let Some((code, _)) = ended {
        book.record_exit(id, Some(code), exit_words(code, step));
    }
    checkpoint
}

/// How a hollow worker's exit reads (the local executor's words).
fn exit_words(code: i32, step: u64) -> String {
    format!("exited with code {code} at step {step}")
}

/// The trainer's command line for `launch`: the contract's values as
/// flags, then the job's own flags when its command is `keel trainer`
/// (which win, as flags win over the contract's environment). Any other
/// command runs as the trainer with the job's model and steps.
fn trainer_argv(launch: &WorkerLaunch) -> Vec<String> {
    let mut argv: Vec<String> = vec!["keel trainer".into()];
    let mut flag = |name: &str, value: String| {
        argv.push(format!("--{name}"));
        argv.push(value);
    };
    flag("gpu-type", launch.gpu_type.clone());
    flag("gpus-per-worker", launch.gpus.len().max(1).to_string());
    flag("world-size", launch.world_size.to_string());
    flag("rank", launch.id.rank.to_string());
    flag("job-id", launch.id.job_id.to_string());
    if let Some(model) = &launch.model {
        flag("model", model.clone());
    }
    if let Some(steps) = launch.total_steps {
        flag("total-steps", steps.to_string());
    }
    if let Some(shared) = &launch.shared_with {
        match &shared.model {
            Some(model) => flag("shared-with-model", model.clone()),
            None => flag("shared-with-job", shared.job_id.to_string()),
        }
    }
    let is_trainer = launch.command.len() >= 2
        && launch.command[1] == "trainer"
        && Path::new(&launch.command[0])
            .file_name()
            .is_some_and(|n| n == "keel");
    if is_trainer {
        argv.extend(launch.command[2..].iter().cloned());
    }
    argv
}

impl Executor for HollowExecutor {
    fn kind(&self) -> &'static str {
        "hollow"
    }

    fn owns(&self, node: &str) -> bool {
        self.owned
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(node)
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.book.contains(&launch.id) {
            return Ok(());
        }
        let now_ms = self.book.unix_ms();
        let run = match self.plan(&launch, now_ms) {
            Ok(run) => run,
            Err(why) => {
                let hollow = Hollow {
                    run: Run::not_started(&launch, now_ms),
                    reported: None,
                };
                self.book
                    .insert_not_started(&launch.id, &launch.node, (Some(2), why), hollow);
                return Ok(());
            }
        };
        self.log(
            &launch.id,
            &Line::Launched {
                worker: launch.id.clone(),
                run: run.clone(),
            },
        )?;
        let gpus = gpu_refs(&launch.node, launch.gpus.iter().copied());
        self.book.insert(
            &launch.id,
            Worker::running(
                &launch.node,
                gpus,
                Hollow {
                    run,
                    reported: None,
                },
            ),
        );
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, _grace: Duration) -> Result<(), ExecutorError> {
        if self.book.begin_stop(id).is_none() {
            return Ok(());
        }
        // A hollow worker checkpoints and exits at once.
        let now_ms = self.book.unix_ms();
        let checkpoint = {
            let mut book = self.book.lock();
            let Some(worker) = book.workers.get_mut(id) else {
                return Ok(());
            };
            worker.extra.run.stopped_ms = Some(now_ms);
            read_run(&mut book, id, now_ms)
        };
        if let Some(c) = checkpoint {
            self.checkpoint(c);
        }
        self.log(
            id,
            &Line::Stopped {
                worker: id.clone(),
                at_ms: now_ms,
            },
        )?;
        Ok(())
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        Ok(self.book.observe())
    }

    async fn forget(&self, id: &WorkerId) {
        if self.book.forget(id).is_some() {
            let forgotten = Line::Forgotten { worker: id.clone() };
            if let Err(e) = self.log(id, &forgotten) {
                tracing::warn!(worker = %id, error = %e, "hollow run's end not journalled");
            }
            self.compact_journal();
        }
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book.take_progress()
    }

    async fn logs(&self, job_id: JobId, tail_bytes: u64) -> Result<Vec<WorkerLog>, ExecutorError> {
        let now_ms = self.book.unix_ms();
        let book = self.book.lock();
        Ok(book
            .workers
            .iter()
            .filter(|(id, _)| id.job_id == job_id)
            .map(|(id, w)| {
                let text = w.extra.run.log(&w.extra.run.status_at(now_ms));
                let bytes = text.into_bytes();
                let keep = bytes
                    .len()
                    .saturating_sub(usize::try_from(tail_bytes).unwrap_or(usize::MAX));
                WorkerLog {
                    id: id.clone(),
                    total_bytes: bytes.len() as u64,
                    content: bytes[keep..].to_vec(),
                    paused: None,
                }
            })
            .collect())
    }

    async fn take_over(&self) {
        let Some(generation) = self.book.begin_leading() else {
            return;
        };
        self.read_nodes();
        self.take_over_records();
        let this = self.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(this.config.tick_every);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if !this.book.is_current(generation) {
                    return;
                }
                this.tick();
            }
        });
    }

    async fn release(&self) {
        self.book.release();
    }

    async fn shutdown(&self, grace: Duration) {
        // As the local executor does: the workers are stopped
        // (checkpointed) and forgotten in the journal, so that the next
        // server launches them again from their checkpoints.
        let running = self.book.running();
        for id in &running {
            let _ = self.stop(id, grace).await;
        }
        self.book.end_leading();
        for id in &running {
            let forgotten = Line::Forgotten { worker: id.clone() };
            let _ = self.log(id, &forgotten);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::ManualClock;

    /// Rank `rank` of job `job_id` (epoch `epoch`) running `command` on one
    /// v100 of node n0, resnet50 for 1,000 steps.
    fn launch(job_id: JobId, epoch: u64, rank: u32, command: &[&str]) -> WorkerLaunch {
        WorkerLaunch {
            world_size: 2,
            local_rank: rank,
            local_world_size: 2,
            model: Some("resnet50".into()),
            total_steps: Some(1000),
            ..WorkerLaunch::for_test(id(job_id, epoch, rank), "n0", vec![rank], command)
        }
    }

    fn id(job_id: JobId, epoch: u64, rank: u32) -> WorkerId {
        WorkerId {
            job_id,
            epoch,
            rank,
        }
    }

    fn executor(dir: &Path, clock: &Arc<ManualClock>) -> HollowExecutor {
        let exec = HollowExecutor::with_clock(
            HollowConfig {
                dir: dir.join("hollow"),
                checkpoints_dir: dir.join("checkpoints"),
                tick_every: Duration::from_secs(1),
            },
            clock.clone(),
        )
        .expect("executor");
        exec.declare_nodes(["n0"]).expect("declared");
        exec
    }

    /// resnet50 on 2 v100s, the table's speed (the job has 2 workers of 1).
    fn steps_per_s() -> f64 {
        profile("resnet50").steps_per_s("v100", 2)
    }

    async fn observed(exec: &HollowExecutor, id: &WorkerId) -> Option<Observed> {
        exec.observe().await.expect("observe").remove(id)
    }

    #[tokio::test]
    async fn a_run_advances_at_its_models_speed_reports_from_rank_0_and_ends_at_its_last_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(1_000_000));
        let exec = executor(dir.path(), &clock);
        let trainer = ["keel", "trainer", "--speedup", "10"];
        exec.launch(launch(7, 1, 0, &trainer))
            .await
            .expect("launch");
        exec.launch(launch(7, 1, 1, &trainer))
            .await
            .expect("launch");
        // Launching again is nothing new.
        exec.launch(launch(7, 1, 0, &trainer))
            .await
            .expect("launch");
        assert_eq!(exec.book.running().len(), 2);

        clock.advance(Duration::from_secs(2));
        exec.tick();
        let progress = exec.take_progress().await;
        let samples = &progress[&7];
        assert_eq!(samples.len(), 1, "one sample, from rank 0: {samples:?}");
        let expected = (2.0 * steps_per_s() * 10.0) as u64;
        assert_eq!(samples[0].step, expected);
        assert_eq!(samples[0].total_steps, 1000);
        assert_eq!(samples[0].at_ms, 1_002_000);
        assert!(samples[0].loss.is_some_and(|l| l > 0.0));
        assert!(matches!(
            observed(&exec, &id(7, 1, 0)).await,
            Some(Observed::Running { .. })
        ));
        // Nothing moved: nothing reported again; then once a second (the
        // trainer's --report-every-s), not at every read.
        exec.tick();
        assert!(exec.take_progress().await.is_empty());
        clock.advance(Duration::from_millis(500));
        exec.tick();
        assert!(exec.take_progress().await.is_empty(), "half a second on");
        clock.advance(Duration::from_millis(500));
        exec.tick();
        assert_eq!(exec.take_progress().await[&7].len(), 1, "a second on");

        clock.advance(Duration::from_secs(60));
        exec.tick();
        assert_eq!(exec.take_progress().await[&7][0].step, 1000);
        for rank in 0..2 {
            assert_eq!(
                observed(&exec, &id(7, 1, rank)).await,
                Some(Observed::Exited {
                    exit_code: Some(0),
                    reason: "exited with code 0 at step 1000".into()
                })
            );
        }
        // The exit is in the log now: forgotten, here and in the journal.
        exec.forget(&id(7, 1, 0)).await;
        assert_eq!(observed(&exec, &id(7, 1, 0)).await, None);
        let journalled = journal::read(&dir.path().join("hollow").join(JOURNAL));
        assert_eq!(journalled.keys().collect::<Vec<_>>(), vec![&id(7, 1, 1)]);
    }

    #[tokio::test]
    async fn a_failure_at_a_step_resumes_from_the_last_periodic_checkpoint_and_fails_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(0));
        let exec = executor(dir.path(), &clock);
        let flaky = [
            "keel",
            "trainer",
            "--fail-at-step",
            "350",
            "--exit-code",
            "3",
        ];
        exec.launch(launch(1, 1, 0, &flaky)).await.expect("launch");
        clock.advance(Duration::from_secs(3600));
        exec.tick();
        assert_eq!(
            observed(&exec, &id(1, 1, 0)).await,
            Some(Observed::Exited {
                exit_code: Some(3),
                reason: "exited with code 3 at step 350".into()
            })
        );
        // Checkpoints every tenth of the run (100 steps): the last before
        // step 350 holds step 300, in the trainer's own file.
        let checkpoints = dir.path().join("checkpoints").join("job-1");
        assert_eq!(read_checkpoint(&checkpoints).expect("checkpoint"), 300);

        exec.launch(launch(1, 2, 0, &flaky))
            .await
            .expect("relaunch");
        exec.tick();
        assert_eq!(
            exec.take_progress().await[&1].last().map(|s| s.step),
            Some(300)
        );
        clock.advance(Duration::from_secs(3600));
        exec.tick();
        assert!(matches!(
            observed(&exec, &id(1, 2, 0)).await,
            Some(Observed::Exited {
                exit_code: Some(3),
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_stopped_run_checkpoints_where_it_is_and_a_relaunch_goes_on_from_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(0));
        let exec = executor(dir.path(), &clock);
        let trainer = ["keel", "trainer"];
        exec.launch(launch(2, 1, 0, &trainer))
            .await
            .expect("launch");
        clock.advance(Duration::from_secs(10));
        exec.stop(&id(2, 1, 0), Duration::from_secs(10))
            .await
            .expect("stop");
        let at = (10.0 * steps_per_s()) as u64;
        assert_eq!(
            observed(&exec, &id(2, 1, 0)).await,
            Some(Observed::Exited {
                exit_code: Some(EXIT_STOPPED),
                reason: format!("exited with code 143 at step {at} (stopped by keel)")
            })
        );
        let checkpoints = dir.path().join("checkpoints").join("job-2");
        assert_eq!(read_checkpoint(&checkpoints).expect("checkpoint"), at);
        assert_eq!(
            exec.take_progress().await[&2].last().map(|s| s.step),
            Some(at)
        );
        // Stopping again does nothing.
        exec.stop(&id(2, 1, 0), Duration::from_secs(10))
            .await
            .expect("stop");

        exec.launch(launch(2, 2, 0, &trainer))
            .await
            .expect("relaunch");
        clock.advance(Duration::from_secs(1));
        exec.tick();
        let step = exec.take_progress().await[&2][0].step;
        assert_eq!(step, at + steps_per_s() as u64);
    }

    #[tokio::test]
    async fn the_next_leader_finds_the_runs_where_the_clock_says_and_reports_the_exits_no_one_saw()
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(0));
        let first = executor(dir.path(), &clock);
        let slow = ["keel", "trainer", "--total-steps", "100000"];
        let quick = ["keel", "trainer", "--total-steps", "10"];
        first.launch(launch(3, 1, 0, &slow)).await.expect("launch");
        first.launch(launch(4, 1, 0, &quick)).await.expect("launch");
        first.launch(launch(5, 1, 0, &slow)).await.expect("launch");
        first
            .stop(&id(5, 1, 0), Duration::from_secs(1))
            .await
            .expect("stop");
        clock.advance(Duration::from_secs(20));

        // Another server sharing the directory (the first one is gone
        // without a word: killed).
        let next = HollowExecutor::with_clock(first.config.as_ref().clone(), clock.clone())
            .expect("executor");
        assert!(next.owns("n0"), "the nodes declared in the directory");
        assert!(!next.owns("n1"));
        next.take_over().await;
        next.tick();
        let seen = next.observe().await.expect("observe");
        assert!(matches!(seen[&id(3, 1, 0)], Observed::Running { .. }));
        assert_eq!(
            seen[&id(4, 1, 0)],
            Observed::Exited {
                exit_code: Some(0),
                reason: "exited with code 0 at step 10".into()
            }
        );
        assert!(matches!(
            &seen[&id(5, 1, 0)],
            Observed::Exited { exit_code: Some(143), reason } if reason.contains("stopped by keel")
        ));
        let step = next.take_progress().await[&3][0].step;
        assert_eq!(step, (20.0 * steps_per_s()) as u64, "where the clock says");
        // Taking over twice finds nothing new.
        next.take_over().await;
        assert_eq!(next.observe().await.expect("observe").len(), 3);
        // Leadership lost: the book forgets, the journal keeps the runs for
        // the next.
        next.release().await;
        assert!(next.observe().await.expect("observe").is_empty());
        let journalled = journal::read(&dir.path().join("hollow").join(JOURNAL));
        assert_eq!(journalled.len(), 3);
    }

    #[tokio::test]
    async fn bad_trainer_flags_are_an_exit_with_code_2_naming_the_flag() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(0));
        let exec = executor(dir.path(), &clock);
        let cases: [(&[&str], &str); 4] = [
            (&["keel", "trainer", "--speedup", "0"], "--speedup"),
            (&["keel", "trainer", "--no-such-flag"], "--no-such-flag"),
            (&["keel", "trainer", "--total-steps", "0"], "--total-steps"),
            (
                &[
                    "keel",
                    "trainer",
                    "--hold-at-step",
                    "5",
                    "--hold-until-file",
                    "/x",
                ],
                "--hold-at-step",
            ),
        ];
        for (job, (command, flag)) in (1..).zip(cases) {
            exec.launch(launch(job, 1, 0, command))
                .await
                .expect("launch");
            match observed(&exec, &id(job, 1, 0)).await {
                Some(Observed::Exited {
                    exit_code: Some(2),
                    reason,
                }) => assert!(reason.contains(flag), "{flag}: {reason}"),
                other => panic!("{flag}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn any_other_command_runs_as_the_trainer_with_the_jobs_model_and_steps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(0));
        let exec = executor(dir.path(), &clock);
        exec.launch(launch(
            1,
            1,
            0,
            &["python", "train.py", "--speedup", "1000"],
        ))
        .await
        .expect("launch");
        clock.advance(Duration::from_secs(1));
        exec.tick();
        // The job's flags are not the trainer's: speed-up 1.
        let step = exec.take_progress().await[&1][0].step;
        assert_eq!(step, steps_per_s() as u64);
        let logs = exec.logs(1, 1 << 10).await.expect("logs");
        let text = String::from_utf8_lossy(&logs[0].content);
        assert!(
            text.contains("resnet50") && text.contains("of 1000"),
            "{text}"
        );
    }
}
