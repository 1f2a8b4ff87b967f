//! The worker book: what an executor knows of its workers, the same for
//! every executor.
//!
//! Each executor keeps one [`WorkerBook`]: its workers (node, GPUs, exit,
//! whether Keel is stopping them, and what the executor itself needs, `X`),
//! the progress samples not yet taken, the newest probe per node, and the
//! leadership generation that fences its background tasks. What differs
//! between executors (how a worker is started, signalled, found and
//! followed) stays in the executor; what they all decide the same way is
//! decided here, once:
//!
//! - **Generation fencing.** [`WorkerBook::release`] (leadership lost)
//!   bumps the generation and clears the book. A task started under an
//!   older generation (a poll, a log follower, a stop's SIGKILL, a launch
//!   retry) records nothing: [`Book::add_progress`] and [`Book::set_probe`]
//!   refuse it, and tasks check [`Book::is_current`] before they act.
//! - **Exit records.** The first exit recorded for a worker is the one
//!   reported; a worker Keel was stopping says so in its reason.
//! - **The progress buffer,** bounded per job
//!   ([`crate::contract::PROGRESS_BUFFER_MAX`]).
//! - **Time** comes from an injected [`Clock`], so what depends on it (a
//!   pending timeout, the time a sample was read) is tested by moving a
//!   [`ManualClock`], not by waiting.
//!
//! The book is plain data behind one `std::sync::Mutex`, never held across
//! an `.await`.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_state::{GpuRef, JobId, ProgressSample};

use crate::contract::buffer_progress;
use crate::executor::NodeProbe;
use crate::reconcile::{exit_reason, Observed};
use crate::WorkerId;

/// Where an executor reads the time.
pub trait Clock: Send + Sync + Debug + 'static {
    /// A monotonic instant, for timeouts and ordering.
    fn now(&self) -> Instant;
    /// Milliseconds since the Unix epoch, for progress samples.
    fn unix_ms(&self) -> u64;
}

/// The machine's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn unix_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to ([`ManualClock::advance`]).
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    start_unix_ms: u64,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    /// A clock standing at `unix_ms`.
    pub fn new(unix_ms: u64) -> ManualClock {
        ManualClock {
            start: Instant::now(),
            start_unix_ms: unix_ms,
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    /// Moves the clock `by` forward.
    pub fn advance(&self, by: Duration) {
        *self.elapsed.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }

    fn elapsed(&self) -> Duration {
        *self.elapsed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn unix_ms(&self) -> u64 {
        self.start_unix_ms
            .saturating_add(u64::try_from(self.elapsed().as_millis()).unwrap_or(u64::MAX))
    }
}

/// How a worker ended: its exit code (none when a signal or a lost record
/// ended it) and why.
pub type Exit = (Option<i32>, String);

/// The marker that ends a reason cut to fit.
const CUT: &str = " [... cut to fit]";

/// `reason` cut to the longest the log accepts
/// ([`keel_state::state::limits::REASON_MAX_LEN`]), at a character
/// boundary, marked as cut: an exit whose reason is too long (a 4 KiB
/// termination message, a long stderr line) is still recorded, never
/// refused and retried.
pub fn fit_reason(mut reason: String) -> String {
    let max = keel_state::state::limits::REASON_MAX_LEN;
    if reason.len() <= max {
        return reason;
    }
    keel_state::state::limits::cut_to(&mut reason, max - CUT.len());
    reason.push_str(CUT);
    reason
}

/// One worker in the book.
#[derive(Debug)]
pub struct Worker<X> {
    pub node: String,
    pub gpus: Vec<GpuRef>,
    /// Set once, by the first exit recorded ([`Book::record_exit`]).
    pub exited: Option<Exit>,
    /// Keel asked it to stop ([`Book::begin_stop`]).
    pub stopping: bool,
    /// Its node refused to start it ([`Book::record_not_admitted`]): its
    /// exit spends none of the job's retries.
    pub not_admitted: bool,
    /// What the executor keeps besides (a pid, a log offset, a Pod's state).
    pub extra: X,
}

impl<X> Worker<X> {
    /// A worker on `node`'s `gpus`, running as far as the book knows.
    pub fn running(node: &str, gpus: Vec<GpuRef>, extra: X) -> Worker<X> {
        Worker {
            node: node.to_string(),
            gpus,
            exited: None,
            stopping: false,
            not_admitted: false,
            extra,
        }
    }

    /// A worker that ended, or never started, with `exit`.
    pub fn ended(node: &str, exit: Exit, extra: X) -> Worker<X> {
        Worker {
            exited: Some(exit),
            ..Worker::running(node, Vec::new(), extra)
        }
    }

    pub fn is_running(&self) -> bool {
        self.exited.is_none()
    }
}

/// The book's data: workers (with per-worker `X`), progress, probes,
/// generation, and `S`, what the executor keeps for all its workers (cleared
/// with them on release).
#[derive(Debug)]
pub struct Book<X, S = ()> {
    pub workers: BTreeMap<WorkerId, Worker<X>>,
    progress: BTreeMap<JobId, Vec<ProgressSample>>,
    probes: BTreeMap<String, NodeProbe>,
    generation: u64,
    leading: bool,
    pub shared: S,
}

impl<X, S: Default> Default for Book<X, S> {
    fn default() -> Self {
        Book {
            workers: BTreeMap::new(),
            progress: BTreeMap::new(),
            probes: BTreeMap::new(),
            generation: 0,
            leading: false,
            shared: S::default(),
        }
    }
}

impl<X, S: Default> Book<X, S> {
    /// The current leadership generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether a task started under `generation` may still act.
    pub fn is_current(&self, generation: u64) -> bool {
        self.generation == generation
    }

    /// Records `exit` for a worker that has none yet; says whether it did.
    /// A worker Keel was stopping has "(stopped by keel)" in its reason.
    pub fn record_exit(&mut self, id: &WorkerId, code: Option<i32>, reason: String) -> bool {
        let Some(w) = self.workers.get_mut(id) else {
            return false;
        };
        if w.exited.is_some() {
            return false;
        }
        let reason = fit_reason(exit_reason(w.stopping, reason));
        tracing::info!(worker = %id, code = ?code, %reason, "worker exited");
        w.exited = Some((code, reason));
        true
    }

    /// Records that the worker's node refused to start it (a kubelet
    /// admission error), unless an exit is recorded already; says whether
    /// it did. Reported as [`Observed::NotAdmitted`], which spends none of
    /// the job's retries.
    pub fn record_not_admitted(&mut self, id: &WorkerId, reason: String) -> bool {
        let Some(w) = self.workers.get_mut(id) else {
            return false;
        };
        if w.exited.is_some() {
            return false;
        }
        let reason = fit_reason(reason);
        tracing::warn!(worker = %id, node = %w.node, %reason, "worker not admitted by its node");
        w.exited = Some((None, reason));
        w.not_admitted = true;
        true
    }

    /// Marks a running worker as stopping. `Some(generation)` when this
    /// call did (the caller signals it); `None` when it is gone, ended or
    /// already stopping.
    pub fn begin_stop(&mut self, id: &WorkerId) -> Option<u64> {
        match self.workers.get_mut(id) {
            Some(w) if w.exited.is_none() && !w.stopping => {
                w.stopping = true;
                Some(self.generation)
            }
            _ => None,
        }
    }

    /// Takes an ended worker out of the book (its exit is in the log now).
    /// A running one stays.
    pub fn forget(&mut self, id: &WorkerId) -> Option<Worker<X>> {
        if self.workers.get(id).is_some_and(|w| w.exited.is_some()) {
            self.workers.remove(id)
        } else {
            None
        }
    }

    /// Buffers `samples` of `job_id` read by a task of `generation`; false
    /// (nothing kept) when that generation has ended.
    pub fn add_progress(
        &mut self,
        generation: u64,
        job_id: JobId,
        samples: impl IntoIterator<Item = ProgressSample>,
    ) -> bool {
        if !self.is_current(generation) {
            return false;
        }
        let mut samples = samples.into_iter().peekable();
        if samples.peek().is_some() {
            buffer_progress(&mut self.progress, job_id, samples);
        }
        true
    }

    /// The progress samples buffered since the last call, per job.
    pub fn take_progress(&mut self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        std::mem::take(&mut self.progress)
    }

    /// Keeps `probe` as `node`'s newest, from a task of `generation`; false
    /// when that generation has ended.
    pub fn set_probe(&mut self, generation: u64, probe: NodeProbe) -> bool {
        if !self.is_current(generation) {
            return false;
        }
        let name = match &probe {
            NodeProbe::Answered(r) => r.name.clone(),
            NodeProbe::Unreachable { name, .. } => name.clone(),
        };
        self.probes.insert(name, probe);
        true
    }

    /// The workers still running.
    pub fn running(&self) -> Vec<WorkerId> {
        self.workers
            .iter()
            .filter(|(_, w)| w.exited.is_none())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// This server starts to lead: `Some(generation)` for the tasks to
    /// start, `None` when it already leads.
    pub fn begin_leading(&mut self) -> Option<u64> {
        if self.leading {
            return None;
        }
        self.leading = true;
        Some(self.generation)
    }

    /// This server stops leading: every task of the generation ends, and
    /// the book forgets everything (the next leader owns it now).
    pub fn release(&mut self) {
        self.end_leading();
        self.workers.clear();
        self.progress.clear();
        self.probes.clear();
        self.shared = S::default();
    }

    /// Ends the generation's tasks but keeps what the book knows (a server
    /// shutting down).
    pub fn end_leading(&mut self) {
        self.generation += 1;
        self.leading = false;
    }
}

/// A [`Book`] behind its lock, with the executor's clock. Cheap to share
/// (`Arc`).
#[derive(Debug)]
pub struct WorkerBook<X, S = ()> {
    book: Mutex<Book<X, S>>,
    clock: Arc<dyn Clock>,
}

impl<X, S: Default> WorkerBook<X, S> {
    pub fn new(clock: Arc<dyn Clock>) -> WorkerBook<X, S> {
        WorkerBook {
            book: Mutex::new(Book::default()),
            clock,
        }
    }

    /// The book, for a change that reads and writes it at once. Never held
    /// across an `.await`.
    pub fn lock(&self) -> MutexGuard<'_, Book<X, S>> {
        // A panic while holding the lock leaves plain data; go on with it.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    pub fn unix_ms(&self) -> u64 {
        self.clock.unix_ms()
    }

    pub fn generation(&self) -> u64 {
        self.lock().generation()
    }

    pub fn is_current(&self, generation: u64) -> bool {
        self.lock().is_current(generation)
    }

    pub fn contains(&self, id: &WorkerId) -> bool {
        self.lock().workers.contains_key(id)
    }

    /// Adds a worker unless one with its identity is there; says whether it
    /// did.
    pub fn insert(&self, id: &WorkerId, worker: Worker<X>) -> bool {
        let mut book = self.lock();
        if book.workers.contains_key(id) {
            return false;
        }
        book.workers.insert(id.clone(), worker);
        true
    }

    /// Records a worker that could not start, with why.
    pub fn insert_not_started(&self, id: &WorkerId, node: &str, exit: Exit, extra: X) {
        let exit = (exit.0, fit_reason(exit.1));
        tracing::warn!(worker = %id, reason = %exit.1, "worker did not start");
        self.lock()
            .workers
            .insert(id.clone(), Worker::ended(node, exit, extra));
    }

    /// Records a worker its node refused to start (a GPU another process
    /// uses): the job waits and is placed again without spending a retry.
    pub fn insert_not_admitted(&self, id: &WorkerId, node: &str, reason: String, extra: X) {
        let reason = fit_reason(reason);
        tracing::warn!(worker = %id, %node, %reason, "worker not admitted by its node");
        let mut worker = Worker::ended(node, (None, reason), extra);
        worker.not_admitted = true;
        self.lock().workers.insert(id.clone(), worker);
    }

    pub fn record_exit(&self, id: &WorkerId, code: Option<i32>, reason: String) -> bool {
        self.lock().record_exit(id, code, reason)
    }

    pub fn begin_stop(&self, id: &WorkerId) -> Option<u64> {
        self.lock().begin_stop(id)
    }

    pub fn forget(&self, id: &WorkerId) -> Option<Worker<X>> {
        self.lock().forget(id)
    }

    /// What [`crate::Executor::observe`] answers.
    pub fn observe(&self) -> BTreeMap<WorkerId, Observed> {
        self.lock()
            .workers
            .iter()
            .map(|(id, w)| {
                let observed = match &w.exited {
                    Some((_, reason)) if w.not_admitted => Observed::NotAdmitted {
                        reason: reason.clone(),
                    },
                    exited => Observed::of(exited, &w.gpus),
                };
                (id.clone(), observed)
            })
            .collect()
    }

    pub fn add_progress(
        &self,
        generation: u64,
        job_id: JobId,
        samples: impl IntoIterator<Item = ProgressSample>,
    ) -> bool {
        self.lock().add_progress(generation, job_id, samples)
    }

    pub fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.lock().take_progress()
    }

    pub fn set_probe(&self, generation: u64, probe: NodeProbe) -> bool {
        self.lock().set_probe(generation, probe)
    }

    pub fn take_probes(&self) -> Vec<NodeProbe> {
        std::mem::take(&mut self.lock().probes)
            .into_values()
            .collect()
    }

    pub fn running(&self) -> Vec<WorkerId> {
        self.lock().running()
    }

    pub fn begin_leading(&self) -> Option<u64> {
        self.lock().begin_leading()
    }

    pub fn release(&self) {
        self.lock().release();
    }

    pub fn end_leading(&self) {
        self.lock().end_leading();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::liveness::NodeReport;

    fn id(job_id: JobId, rank: u32) -> WorkerId {
        WorkerId {
            job_id,
            epoch: 1,
            rank,
        }
    }

    fn sample(step: u64) -> ProgressSample {
        ProgressSample {
            step,
            total_steps: 0,
            loss: None,
            samples_per_s: 0.0,
            at_ms: step,
        }
    }

    fn book() -> WorkerBook<u32> {
        WorkerBook::new(Arc::new(ManualClock::new(1_000)))
    }

    #[test]
    fn the_first_exit_is_the_one_reported_and_a_stop_says_so() {
        let b = book();
        assert!(b.insert(&id(1, 0), Worker::running("n", Vec::new(), 7)));
        assert!(!b.insert(&id(1, 0), Worker::running("m", Vec::new(), 8)));
        assert_eq!(b.lock().workers[&id(1, 0)].extra, 7, "the first stays");
        assert!(b.begin_stop(&id(1, 0)).is_some());
        assert_eq!(b.begin_stop(&id(1, 0)), None, "already stopping");
        assert!(b.record_exit(&id(1, 0), Some(143), "exited with status 143".into()));
        assert!(!b.record_exit(&id(1, 0), Some(0), "later".into()));
        assert_eq!(
            b.observe()[&id(1, 0)],
            Observed::Exited {
                exit_code: Some(143),
                reason: "exited with status 143 (stopped by keel)".into()
            }
        );
        assert_eq!(b.begin_stop(&id(1, 0)), None, "ended");
        assert!(!b.record_exit(&id(9, 0), None, "unknown".into()));
    }

    #[test]
    fn only_ended_workers_are_forgotten() {
        let b = book();
        b.insert(&id(1, 0), Worker::running("n", Vec::new(), 0));
        b.insert_not_started(&id(2, 0), "n", (Some(127), "no".into()), 0);
        assert!(b.forget(&id(1, 0)).is_none());
        assert_eq!(b.running(), vec![id(1, 0)]);
        assert!(b.forget(&id(2, 0)).is_some());
        assert_eq!(b.observe().len(), 1);
    }

    #[test]
    fn a_released_generation_records_nothing() {
        let b: WorkerBook<u32, Vec<u8>> = WorkerBook::new(Arc::new(SystemClock));
        let generation = b.begin_leading().expect("leads");
        assert_eq!(b.begin_leading(), None, "already leading");
        b.lock().shared.push(1);
        b.insert(&id(1, 0), Worker::running("n", Vec::new(), 0));
        assert!(b.add_progress(generation, 1, [sample(1)]));
        let probe = NodeProbe::Unreachable {
            name: "n".into(),
            reason: "down".into(),
        };
        assert!(b.set_probe(generation, probe.clone()));
        assert_eq!(b.take_probes(), vec![probe.clone()]);
        b.release();
        assert!(!b.is_current(generation));
        assert!(b.observe().is_empty());
        assert!(b.lock().shared.is_empty(), "the executor's part is cleared");
        assert!(!b.add_progress(generation, 1, [sample(2)]));
        assert!(!b.set_probe(generation, probe));
        assert!(b.take_progress().is_empty());
        assert!(b.take_probes().is_empty());
        let next = b.begin_leading().expect("leads again");
        assert_ne!(next, generation);
        let answered = NodeProbe::Answered(NodeReport {
            name: "n".into(),
            address: "n".into(),
            gpus: Vec::new(),
            failed: Vec::new(),
            note: String::new(),
        });
        assert!(b.set_probe(next, answered.clone()));
        assert_eq!(b.take_probes(), vec![answered], "newest per node");
    }

    #[test]
    fn shutting_down_ends_the_tasks_but_keeps_the_workers() {
        let b = book();
        let generation = b.begin_leading().expect("leads");
        b.insert(&id(1, 0), Worker::running("n", Vec::new(), 0));
        b.end_leading();
        assert!(!b.is_current(generation));
        assert_eq!(b.running(), vec![id(1, 0)]);
    }

    #[test]
    fn progress_is_buffered_per_job_and_bounded() {
        let b = book();
        let generation = b.generation();
        let max = crate::contract::PROGRESS_BUFFER_MAX as u64;
        assert!(b.add_progress(generation, 1, (0..max + 5).map(sample)));
        assert!(b.add_progress(generation, 2, []));
        let taken = b.take_progress();
        assert_eq!(taken.len(), 1, "no empty buffer for job 2");
        assert_eq!(taken[&1].len() as u64, max);
        assert_eq!(taken[&1][0].step, 5, "the oldest go first");
        assert!(b.take_progress().is_empty());
    }

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(5_000);
        let t0 = clock.now();
        assert_eq!(clock.now(), t0);
        clock.advance(Duration::from_millis(1_500));
        assert_eq!(clock.now() - t0, Duration::from_millis(1_500));
        assert_eq!(clock.unix_ms(), 6_500);
    }
}
