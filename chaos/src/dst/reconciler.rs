//! The leader's reconcile loop in the simulation, over simulated machines,
//! and a check that no stale leader touched a worker.
//!
//! Every replica runs the reconcile loop's pure engine
//! ([`keel_executors::reconcile_engine::ReconcileEngine`]) and performs its
//! steps with the server's own performer ([`keel::leader::Performer`]),
//! through a log port over its simulated Raft and a [`SimExecutor`] over
//! the cluster's [`Machines`]: the GPU nodes' processes, shared by every
//! replica as real machines are. A worker runs one to four virtual seconds
//! and exits 0; a stopped one exits 143 at once. A launch of an identity
//! the machines already have adopts it (the executors' claims), so what is
//! checked is not "launched twice" but who touched what when:
//!
//! - **No stale side effects.** The machines count take-overs; a replica's
//!   executor remembers the take-over it holds by. A launch or a stop by a
//!   replica whose take-over another replica's superseded is a violation:
//!   a deposed leader that woke up and acted on what it decided before.
//!
//! The fault that provokes it, [`super::Fault::StaleLeader`], pauses the
//! leader's reconcile loop right after it decided a pass that launches or
//! stops, cuts the leader off until another replica leads and has taken
//! the workers over, then heals and lets the paused loop go on. The loop
//! must then confirm its leadership with a quorum, fail to, and touch
//! nothing (a run that skips the confirmation, `DstConfig::unconfirmed`,
//! must fail).

use super::leadership::{Leadership, TermGate};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::leader::{LogPort, NotRecorded, Performer};
use keel_executors::book::{Clock, Exit, Worker, WorkerBook};
use keel_executors::contract::{gpu_refs, WorkerLaunch};
use keel_executors::reconcile_engine::{ReconcileEngine, ReconcileTimings};
use keel_executors::{Executor, ExecutorError, Observed, WorkerId, WorkerLog};
use keel_state::{Command, JobId, ProgressSample};
use tokio::sync::watch;

use super::net::{Net, Raft};
use super::replica::Trace;
use super::run::{record, write, History, Op, Outcome, EPOCH_MS};

/// How often the loop looks at its replica, in virtual milliseconds.
const TICK_MS: u64 = 100;

/// One worker process on the simulated machines.
#[derive(Debug, Clone)]
struct Process {
    node: String,
    gpus: Vec<u32>,
    /// When it ends on its own, in virtual ms.
    ends_ms: u64,
    /// Set when it ended (stopped, or past `ends_ms` when looked at).
    exit: Option<Exit>,
}

#[derive(Debug, Default)]
struct MachinesInner {
    processes: BTreeMap<WorkerId, Process>,
    /// Take-overs so far; the last one's member holds the workers.
    takeovers: u64,
    holder: Option<u64>,
    launches: u64,
    stops: u64,
    violations: Vec<String>,
}

/// The GPU nodes' processes, shared by every replica's executor.
#[derive(Debug, Clone)]
pub(crate) struct Machines {
    inner: Arc<Mutex<MachinesInner>>,
    trace: Trace,
}

impl Machines {
    pub(crate) fn new(trace: Trace) -> Machines {
        Machines {
            inner: Arc::default(),
            trace,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MachinesInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The replica that took the workers over last.
    pub(crate) fn holder(&self) -> Option<u64> {
        self.lock().holder
    }

    /// (launches, stops, violations) so far.
    pub(crate) fn summary(&self) -> (u64, u64, Vec<String>) {
        let m = self.lock();
        (m.launches, m.stops, m.violations.clone())
    }

    /// The process's exit, ending it if its time has come.
    fn settle(process: &mut Process, now_ms: u64) -> Option<Exit> {
        if process.exit.is_none() && now_ms >= process.ends_ms {
            process.exit = Some((Some(0), "exited with code 0".into()));
        }
        process.exit.clone()
    }

    /// Checks that `member`, holding by take-over `held_by`, may still
    /// touch processes; records a violation if another replica took them
    /// over since.
    fn check_holder(m: &mut MachinesInner, member: u64, held_by: u64, what: &str, now_ms: u64) {
        if held_by != m.takeovers {
            let holder = m.holder.map_or("nobody".to_string(), |h| h.to_string());
            m.violations.push(format!(
                "stale leader: replica {member} {what} at {now_ms} ms, after replica {holder} took the workers over (take-over {} > its {held_by})",
                m.takeovers
            ));
        }
    }
}

/// The virtual clock, for the executor's book.
#[derive(Debug)]
struct VirtualClock {
    trace: Trace,
}

impl Clock for VirtualClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn unix_ms(&self) -> u64 {
        EPOCH_MS + self.trace.now_ms()
    }
}

/// One replica's executor over the machines, keeping its workers in the
/// executors' own book.
#[derive(Debug)]
pub(crate) struct SimExecutor {
    member: u64,
    machines: Machines,
    book: WorkerBook<()>,
    /// The take-over this executor holds the workers by.
    held_by: Mutex<u64>,
}

impl SimExecutor {
    fn new(member: u64, machines: Machines) -> SimExecutor {
        let trace = machines.trace.clone();
        SimExecutor {
            member,
            machines,
            book: WorkerBook::new(Arc::new(VirtualClock { trace })),
            held_by: Mutex::new(0),
        }
    }

    fn held_by(&self) -> u64 {
        *self.held_by.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copies what the machines say of `id` into the book.
    fn adopt(&self, id: &WorkerId, process: &Process, exit: Option<Exit>) {
        let gpus = gpu_refs(&process.node, process.gpus.iter().copied());
        let mut book = self.book.lock();
        let worker = book
            .workers
            .entry(id.clone())
            .or_insert_with(|| Worker::running(&process.node, gpus, ()));
        if worker.exited.is_none() {
            worker.exited = exit;
        }
    }
}

impl Executor for SimExecutor {
    fn kind(&self) -> &'static str {
        "simulated"
    }

    async fn launch(&self, launch: WorkerLaunch) -> Result<(), ExecutorError> {
        if self.book.contains(&launch.id) {
            return Ok(());
        }
        let now_ms = self.machines.trace.now_ms();
        let (process, exit) = {
            let mut m = self.machines.lock();
            Machines::check_holder(
                &mut m,
                self.member,
                self.held_by(),
                &format!("launched {}", launch.id),
                now_ms,
            );
            let process = m.processes.entry(launch.id.clone()).or_insert_with(|| {
                // 1 to 4 virtual seconds, from the identity.
                let spread = (launch.id.job_id * 7919
                    + launch.id.epoch * 104_729
                    + u64::from(launch.id.rank) * 31)
                    % 3_000;
                Process {
                    node: launch.node.clone(),
                    gpus: launch.gpus.clone(),
                    ends_ms: now_ms + 1_000 + spread,
                    exit: None,
                }
            });
            let exit = Machines::settle(process, now_ms);
            let process = process.clone();
            m.launches += 1;
            (process, exit)
        };
        self.machines.trace.note(format_args!(
            "replica {} launched {}",
            self.member, launch.id
        ));
        self.adopt(&launch.id, &process, exit);
        Ok(())
    }

    async fn stop(&self, id: &WorkerId, _grace: Duration) -> Result<(), ExecutorError> {
        if self.book.begin_stop(id).is_none() {
            return Ok(());
        }
        let now_ms = self.machines.trace.now_ms();
        let mut m = self.machines.lock();
        Machines::check_holder(
            &mut m,
            self.member,
            self.held_by(),
            &format!("stopped {id}"),
            now_ms,
        );
        m.stops += 1;
        if let Some(p) = m.processes.get_mut(id) {
            if Machines::settle(p, now_ms).is_none() {
                p.exit = Some((Some(143), "exited with code 143".into()));
            }
        }
        drop(m);
        self.machines
            .trace
            .note(format_args!("replica {} stopped {id}", self.member));
        Ok(())
    }

    async fn observe(&self) -> Result<BTreeMap<WorkerId, Observed>, ExecutorError> {
        let now_ms = self.machines.trace.now_ms();
        let mut m = self.machines.lock();
        let running = self.book.running();
        for id in running {
            let exit = m
                .processes
                .get_mut(&id)
                .map(|p| Machines::settle(p, now_ms))
                .unwrap_or_else(|| Some((None, "its records are gone".into())));
            if let Some((code, reason)) = exit {
                self.book.record_exit(&id, code, reason);
            }
        }
        drop(m);
        Ok(self.book.observe())
    }

    async fn forget(&self, id: &WorkerId) {
        if self.book.forget(id).is_some() {
            // Its exit is in the log: the record on the machine goes.
            self.machines.lock().processes.remove(id);
        }
    }

    async fn take_progress(&self) -> BTreeMap<JobId, Vec<ProgressSample>> {
        self.book.take_progress()
    }

    async fn logs(
        &self,
        _job_id: JobId,
        _tail_bytes: u64,
    ) -> Result<Vec<WorkerLog>, ExecutorError> {
        Ok(Vec::new())
    }

    async fn take_over(&self) {
        if self.book.begin_leading().is_none() {
            return;
        }
        let now_ms = self.machines.trace.now_ms();
        let found: Vec<(WorkerId, Process, Option<Exit>)> = {
            let mut m = self.machines.lock();
            m.takeovers += 1;
            m.holder = Some(self.member);
            *self.held_by.lock().unwrap_or_else(|p| p.into_inner()) = m.takeovers;
            m.processes
                .iter_mut()
                .map(|(id, p)| {
                    let exit = Machines::settle(p, now_ms);
                    (id.clone(), p.clone(), exit)
                })
                .collect()
        };
        self.machines.trace.note(format_args!(
            "replica {} took over {} workers",
            self.member,
            found.len()
        ));
        for (id, process, exit) in found {
            self.adopt(&id, &process, exit);
        }
    }

    async fn release(&self) {
        self.book.release();
    }

    fn owns(&self, node: &str) -> bool {
        node.starts_with('n')
    }

    async fn shutdown(&self, _grace: Duration) {
        self.book.end_leading();
    }
}

/// The log port over a simulated replica.
struct SimLog {
    raft: Raft,
    net: Arc<Net>,
    member: u64,
    trace: Trace,
    history: History,
}

impl LogPort for SimLog {
    async fn propose(&self, command: Command) -> Result<(), NotRecorded> {
        let kind = match &command {
            Command::RecordWorkerExited { .. } => "record_exit",
            Command::RecordWorkerStarted { .. } => "record_start",
            _ => "progress",
        };
        let (outcome, _) = write(&self.net, self.member, &self.raft, command, None).await;
        self.trace
            .note(format_args!("{kind} by {}: {outcome:?}", self.member));
        record(
            &self.history,
            Op {
                kind,
                name: None,
                outcome: outcome.clone(),
            },
        );
        match outcome {
            Outcome::Committed { accepted: true, .. } => Ok(()),
            Outcome::Committed {
                accepted: false, ..
            } => Err(NotRecorded::Refused("refused by the state".into())),
            o => Err(NotRecorded::NotCommitted(format!("{o:?}"))),
        }
    }

    async fn confirm_leadership(&self, term: u64) -> bool {
        matches!(
            tokio::time::timeout(Duration::from_secs(2), self.raft.ensure_linearizable()).await,
            Ok(Ok(_))
        ) && self.raft.metrics().borrow().current_term == term
    }
}

/// A pause of one replica's reconcile loop, asked for by the
/// `stale_leader` fault: the loop parks right after it decided a pass that
/// touches workers, says so, and goes on when the pause is lifted.
#[derive(Debug, Clone)]
pub(crate) struct Pause {
    /// The member to pause, while armed.
    armed: watch::Sender<Option<u64>>,
    /// Set by the paused loop.
    parked: watch::Sender<bool>,
}

impl Pause {
    pub(crate) fn new() -> Pause {
        Pause {
            armed: watch::channel(None).0,
            parked: watch::channel(false).0,
        }
    }

    /// Arms the pause for `member`'s next pass that touches workers.
    pub(crate) fn arm(&self, member: u64) {
        self.parked.send_replace(false);
        self.armed.send_replace(Some(member));
    }

    /// Whether the armed loop has parked.
    pub(crate) fn parked(&self) -> bool {
        *self.parked.borrow()
    }

    /// Lifts the pause (parked or not).
    pub(crate) fn lift(&self) {
        self.armed.send_replace(None);
    }

    /// Parks `member`'s loop here while the pause is armed for it.
    async fn park_if_armed(&self, member: u64) {
        if *self.armed.borrow() != Some(member) {
            return;
        }
        self.parked.send_replace(true);
        let mut armed = self.armed.subscribe();
        while *armed.borrow_and_update() == Some(member) {
            if armed.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Runs member `member`'s reconcile loop until `stop` turns true.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn reconcile(
    member: u64,
    net: Arc<Net>,
    machines: Machines,
    history: History,
    trace: Trace,
    pause: Pause,
    unconfirmed: bool,
    mut stop: watch::Receiver<bool>,
) {
    let timings = ReconcileTimings {
        every_ms: TICK_MS,
        coalesce_ms: 0,
        progress_every_ms: 2_000,
    };
    let mut engine = ReconcileEngine::new(timings, trace.now_ms());
    // The executor lives as long as the server process: a crash loses it.
    let mut executor = SimExecutor::new(member, machines.clone());
    let mut gate = TermGate::default();
    let mut incarnation = net.incarnation(member);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(TICK_MS)) => {}
        }
        let (Some(raft), Some(shared)) = (net.raft(member), net.shared(member)) else {
            continue;
        };
        if net.incarnation(member) != incarnation {
            // A new process: its executor and engine start empty.
            incarnation = net.incarnation(member);
            executor = SimExecutor::new(member, machines.clone());
            engine = ReconcileEngine::new(timings, trace.now_ms());
            gate.reset();
        }
        let (leads, ready_term) = match gate.check(&raft, Duration::from_secs(2)).await {
            Leadership::NotLeading => (false, None),
            Leadership::Leading { term, confirmed } => (true, confirmed.then_some(term)),
        };
        let log = SimLog {
            raft: raft.clone(),
            net: net.clone(),
            member,
            trace: trace.clone(),
            history: history.clone(),
        };
        let performer = Performer {
            log: &log,
            executor: &executor,
            stop_grace: Duration::from_secs(1),
            confirm: !unconfirmed,
            launches: None,
            secret_keys: &keel::secret_keys::SecretKeys::default(),
        };
        let (steps, run_passes) = engine.wake(ready_term, leads);
        let _ = performer.perform(steps).await;
        if !run_passes {
            continue;
        }
        loop {
            let Ok(observed) = executor.observe().await else {
                break;
            };
            let pass = {
                let applied = shared.read();
                let owns = |node: &str| executor.owns(node);
                engine.pass(&applied.state, &observed, &owns, trace.now_ms())
            };
            let touches = pass.steps.iter().any(|s| {
                matches!(
                    s,
                    keel_executors::reconcile_engine::Step::Launch(_)
                        | keel_executors::reconcile_engine::Step::Stop { .. }
                )
            });
            if touches {
                pause.park_if_armed(member).await;
            }
            match performer.perform(pass.steps).await {
                Ok(keel::leader::Performed::All) if pass.again => continue,
                _ => break,
            }
        }
        let steps = engine.after_passes(trace.now_ms());
        let _ = performer.perform(steps).await;
    }
}
