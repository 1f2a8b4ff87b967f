//! The leader's loops: scheduling and reconciling (the third, node
//! liveness, is in [`crate::node_liveness`]).
//!
//! Both run on every replica but act only while it leads; both read the
//! applied state and act through log entries (via the [`Proposer`]), never
//! by changing state directly.
//!
//! - **Scheduling**: the driver of a pure engine
//!   ([`keel_scheduling::engine`]) that decides when a round runs (after a
//!   short debounce when the state's supply/demand version moves, else at
//!   the round deadline), which policy runs it, and what it proposes:
//!   `DecideAllocation { based_on: i }` on the state at applied index *i*,
//!   only when the plan differs from the current allocations.
//! - **Reconciling**: the driver of a pure engine
//!   ([`keel_executors::reconcile_engine`]) that compares the workers the
//!   state wants with what the executor reports, and says what to do:
//!   take over or release the workers as leadership comes and goes, record
//!   exits (after the job's pending progress), stop unwanted workers,
//!   launch wanted ones (after a quorum confirms the leadership) and record
//!   their start. Progress samples are batched: at most one
//!   `ReportProgress` per job per progress interval.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use keel_executors::reconcile_engine::{ReconcileEngine, ReconcileTimings, Step};
use keel_executors::{Executor, ExecutorError, WorkerId};
use keel_scheduling::engine::{Notice, SchedulingEngine, SchedulingTimings, Wait};
use keel_scheduling::policy::{Policy, PolicyOptions};
use keel_state::state::limits::PROGRESS_SAMPLES_MAX;
use keel_state::{ClusterState, Command, JobId, ProgressSample};
use openraft::ServerState;
use tokio::sync::watch;

use crate::api::Clock;
use crate::proposer::Proposer;
use crate::raft_node::RaftNode;

/// Timing of the leader's loops.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// The scheduling loop runs at least this often.
    pub round: Duration,
    /// Wait this long after a change before scheduling, so a burst of
    /// submissions is placed in one round.
    pub debounce: Duration,
    /// The reconcile loop runs at least this often (exits are noticed
    /// within this time).
    pub reconcile_every: Duration,
    /// At most one progress entry per job this often.
    pub progress_every: Duration,
    /// SIGTERM → SIGKILL grace period for stopped workers.
    pub stop_grace: Duration,
    /// The longest a server's shutdown may take (workers stopped, loops
    /// ended, Raft flushed) before the process exits anyway, naming the
    /// step it was stuck at. Longer than `stop_grace`.
    pub shutdown_timeout: Duration,
    /// A node not heard from for this long is marked lost.
    pub node_timeout: Duration,
    /// How often a server reports its nodes to the leader.
    pub heartbeat_every: Duration,
    /// The operators' keys: the API seals secrets with them, launches open
    /// them ([`crate::secret_keys`]).
    pub secret_keys: Arc<crate::secret_keys::SecretKeys>,
}

impl Default for LoopSettings {
    fn default() -> Self {
        LoopSettings {
            round: Duration::from_secs(10),
            debounce: Duration::from_millis(50),
            reconcile_every: Duration::from_millis(250),
            progress_every: Duration::from_secs(2),
            stop_grace: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
            node_timeout: Duration::from_secs(10),
            heartbeat_every: Duration::from_secs(1),
            secret_keys: Default::default(),
        }
    }
}

/// Whether a quorum confirms within `timeout` that this replica leads (a
/// read index: one round of heartbeats, and the term's first entry
/// applied).
async fn quorum_confirms(node: &RaftNode, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, node.raft.ensure_linearizable()).await,
        Ok(Ok(_))
    )
}

/// Whether this replica leads, confirmed by a quorum now (within two
/// seconds), not by a term remembered from earlier.
async fn confirm_leadership(node: &RaftNode) -> bool {
    is_leader(node) && quorum_confirms(node, Duration::from_secs(2)).await
}

pub(crate) fn is_leader(node: &RaftNode) -> bool {
    let m = node.raft.metrics();
    let m = m.borrow();
    m.state == ServerState::Leader && m.current_leader == Some(node.id)
}

/// Lets a leader-only loop act only once this replica leads *and* has
/// applied everything up to its term's first entry (so it decides on the
/// whole history, not on what a previous leader had not yet replicated to
/// it).
#[derive(Debug)]
pub(crate) struct LeaderGate {
    /// The loop this gate lets act, for the log.
    name: &'static str,
    ready_term: Option<u64>,
}

impl LeaderGate {
    pub(crate) fn new(name: &'static str) -> LeaderGate {
        LeaderGate {
            name,
            ready_term: None,
        }
    }

    /// The term this gate last let its loop act in.
    pub(crate) fn term(&self) -> Option<u64> {
        self.ready_term
    }

    pub(crate) async fn ready(&mut self, node: &RaftNode) -> bool {
        if !is_leader(node) {
            self.ready_term = None;
            return false;
        }
        let term = node.raft.metrics().borrow().current_term;
        if self.ready_term == Some(term) {
            return true;
        }
        // A read index on the leader commits and applies the term's first
        // entry before it returns.
        if !quorum_confirms(node, Duration::from_secs(5)).await {
            return false;
        }
        tracing::info!(
            term,
            leader_loop = self.name,
            "leading: this loop acts from now on"
        );
        self.ready_term = Some(term);
        true
    }
}

/// What the leader's scheduling loop last did, for `keel cluster status`;
/// empty on a replica that is not leading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulingReport {
    /// The running policy's counters ([`Policy::counters`]).
    pub policy_counters: std::collections::BTreeMap<String, u64>,
    /// The applied index of the state the last round planned on (0 before
    /// the first round of this leadership), published once that round's
    /// entry was applied: a round at or past an entry's index has seen it,
    /// so a client can tell "the scheduler looked and left it" from "the
    /// scheduler has not looked yet".
    pub last_planned_index: u64,
}

/// The [`SchedulingReport`] shared between the loop and the API.
pub type SchedulingReports = Arc<std::sync::RwLock<SchedulingReport>>;

/// Replaces what `reports` holds (a poisoned lock is taken over: the report
/// is rewritten whole).
fn publish(reports: &SchedulingReports, report: SchedulingReport) {
    let mut guard = match reports.write() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    };
    *guard = report;
}

/// What the scheduling loop runs with.
pub struct SchedulingSetup {
    /// The policy when the log names none.
    pub default_policy: Arc<dyn Policy>,
    pub options: PolicyOptions,
    /// Why the executor cannot run space-sharing policies, if it cannot
    /// ([`Executor::cannot_share_gpus`]).
    pub cannot_share_gpus: Option<&'static str>,
    /// The wall clock the entries are stamped with.
    pub clock: Clock,
    pub settings: LoopSettings,
}

impl std::fmt::Debug for SchedulingSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulingSetup")
            .field("default_policy", &self.default_policy.name())
            .field("cannot_share_gpus", &self.cannot_share_gpus)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// The scheduling loop: the async driver of
/// [`keel_scheduling::engine::SchedulingEngine`], which decides when a round
/// runs, which policy runs it and what it proposes; this loop only reads the
/// state and the clocks, waits, proposes and logs. Returns when `stop`
/// turns true.
pub async fn scheduling_loop(
    node: Arc<RaftNode>,
    proposer: Proposer,
    setup: SchedulingSetup,
    reports: SchedulingReports,
    mut stop: watch::Receiver<bool>,
) {
    let SchedulingSetup {
        default_policy,
        options,
        cannot_share_gpus,
        clock,
        settings,
    } = setup;
    let shared = node.state_machine.shared();
    let mut applied = shared.subscribe_state();
    let mut gate = LeaderGate::new("scheduling");
    // The engine's timers run on a monotonic clock: milliseconds since
    // this loop started.
    let origin = tokio::time::Instant::now();
    let monotonic_ms = || u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
    let timings = SchedulingTimings {
        round_ms: u64::try_from(settings.round.as_millis()).unwrap_or(u64::MAX),
        debounce_ms: u64::try_from(settings.debounce.as_millis()).unwrap_or(u64::MAX),
    };
    // Each policy's plan timed (`keel_scheduling_policy_solve_duration_seconds`).
    let default_policy: Arc<dyn keel_scheduling::policy::Policy> = Arc::new(
        crate::metrics::TimedPolicy::new(default_policy, node.metrics.clone()),
    );
    let mut engine = SchedulingEngine::new(
        timings,
        default_policy,
        options,
        cannot_share_gpus,
        monotonic_ms(),
    )
    .wrapping_policies(crate::metrics::TimedPolicy::wrapper(node.metrics.clone()));
    loop {
        let wait = {
            let applied = shared.read();
            let now = clock();
            engine.wait(
                applied.state.supply_demand_version(),
                monotonic_ms(),
                applied
                    .state
                    .next_backoff_end_ms(now)
                    .map(|t| t.saturating_sub(now)),
            )
        };
        match wait {
            Wait::ChangeOrDeadline { deadline_ms } => {
                let deadline = origin + Duration::from_millis(deadline_ms);
                tokio::select! {
                    _ = applied.changed() => continue,
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = stop.changed() => return,
                }
            }
            Wait::Debounce { ms } => {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
        if *stop.borrow() {
            return;
        }
        if !gate.ready(&node).await {
            engine.not_leading();
            publish(&reports, Default::default());
            continue;
        }
        // Read one consistent state at applied index i and plan on it. The
        // policy is a pure function over the borrowed state (FIFO: a few ms
        // at 10,000 waiting jobs); applies wait for the read lock meanwhile.
        let (round, report, _traced) = {
            let applied = shared.read();
            let planning = std::time::Instant::now();
            let round = engine.round(&applied.state, clock(), monotonic_ms());
            node.metrics
                .scheduling_round_duration
                .observe(planning.elapsed().as_secs_f64());
            node.metrics
                .scheduling_rounds
                .get_or_create(&crate::metrics::PolicyLabel {
                    policy: engine.policy_name().to_string(),
                })
                .inc();
            let report = SchedulingReport {
                policy_counters: engine.counters(&applied.state),
                last_planned_index: applied.state.last_index(),
            };
            let traced = decision_spans(&applied.state, round.command.as_ref());
            (round, report, traced)
        };
        for notice in &round.notices {
            match notice {
                Notice::SwitchedPolicy { from, to } => {
                    tracing::info!(from = %from, to = %to, "switching policy");
                }
                Notice::KeptPolicy {
                    wanted,
                    current,
                    reason,
                } => tracing::warn!(
                    wanted = %wanted,
                    current = %current,
                    error = %reason,
                    "keeping the current policy"
                ),
                Notice::NotRunningLoggedPolicy { policy, reason } => tracing::warn!(
                    policy = %policy,
                    reason = %reason,
                    "not running the logged policy"
                ),
            }
        }
        if let Some(command) = round.command {
            if let Command::DecideAllocation {
                based_on,
                round,
                placements,
                ..
            } = &command
            {
                tracing::info!(
                    based_on,
                    round,
                    jobs = placements.len(),
                    "proposing an allocation"
                );
                node.metrics.scheduling_decisions.inc();
                node.metrics
                    .placement_changes
                    .inc_by(placements.len() as u64);
            }
            if let Err(e) = proposer.propose(command).await {
                tracing::warn!(error = %e, "allocation decision not committed");
            }
        }
        // After the round's entry is applied (or refused): a client that
        // sees `last_planned_index` at or past an entry sees what the
        // round made of it.
        publish(&reports, report);
    }
}

/// The reconcile loop: the async driver of
/// [`keel_executors::reconcile_engine::ReconcileEngine`], which decides
/// when the executor takes over or releases the workers, what a pass
/// records, stops and launches, and when progress is proposed; this loop
/// only reads the state, the executor and the clock, waits, and performs
/// the engine's steps. Returns when `stop` turns true, after stopping every
/// worker (with the grace period).
pub async fn reconcile_loop<E: Executor>(
    node: Arc<RaftNode>,
    proposer: Proposer,
    executor: Arc<E>,
    settings: LoopSettings,
    mut stop: watch::Receiver<bool>,
) {
    let shared = node.state_machine.shared();
    let mut applied = shared.subscribe_state();
    let mut gate = LeaderGate::new("reconcile");
    // The engine's timers run on a monotonic clock: milliseconds since
    // this loop started.
    let origin = tokio::time::Instant::now();
    let monotonic_ms = || u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let timings = ReconcileTimings {
        every_ms: ms(settings.reconcile_every),
        coalesce_ms: 10,
        progress_every_ms: ms(settings.progress_every),
    };
    let mut engine = ReconcileEngine::new(timings, monotonic_ms());
    let log = RaftLog {
        node: &node,
        proposer: &proposer,
    };
    let performer = Performer {
        log: &log,
        executor: executor.as_ref(),
        stop_grace: settings.stop_grace,
        confirm: true,
        launches: Some((node.metrics.as_ref(), executor.kind())),
        secret_keys: &settings.secret_keys,
    };
    loop {
        tokio::select! {
            _ = applied.changed() => {
                // Coalesce bursts of entries into one pass.
                tokio::time::sleep(Duration::from_millis(timings.coalesce_ms)).await;
            }
            _ = tokio::time::sleep(Duration::from_millis(timings.every_ms)) => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        let ready_term = if gate.ready(&node).await {
            gate.term()
        } else {
            None
        };
        let (steps, run_passes) = engine.wake(ready_term, is_leader(&node));
        if let Err(e) = performer.perform(steps).await {
            tracing::warn!(error = %e, "reconcile step failed");
        }
        if !run_passes {
            continue;
        }
        loop {
            let observed = match executor.observe().await {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile pass failed");
                    break;
                }
            };
            let pass = {
                let applied = shared.read();
                let owns = |name: &str| executor.owns(name);
                engine.pass(&applied.state, &observed, &owns, monotonic_ms())
            };
            match performer.perform(pass.steps).await {
                Ok(Performed::All) if pass.again => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile pass failed");
                    break;
                }
            }
        }
        let steps = engine.after_passes(monotonic_ms());
        if let Err(e) = performer.perform(steps).await {
            tracing::warn!(error = %e, "reconcile step failed");
        }
    }
    let leader = is_leader(&node);
    let observed = if engine.holding() && leader {
        executor.observe().await.unwrap_or_default()
    } else {
        BTreeMap::new()
    };
    let steps = engine.stop(leader, &observed);
    if let Err(e) = performer.perform(steps).await {
        tracing::warn!(error = %e, "stopping the workers failed");
    }
}

/// Why a proposal was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum NotRecorded {
    /// The state machine refused it (its job was removed, say): retrying
    /// cannot help.
    #[error("refused: {0}")]
    Refused(String),
    /// It may or may not commit (no leader, a timeout): try again later.
    #[error("not committed: {0}")]
    NotCommitted(String),
}

/// What the reconcile driver needs of the replicated log: propose, and
/// confirm with a quorum that this replica leads. The server's is
/// [`RaftLog`]; the deterministic simulation has its own.
pub trait LogPort: Send + Sync {
    /// Proposes `command` and waits until it applied (or was refused).
    fn propose(
        &self,
        command: Command,
    ) -> impl std::future::Future<Output = Result<(), NotRecorded>> + Send;

    /// Whether a quorum confirms now that this replica leads, in `term`.
    fn confirm_leadership(&self, term: u64) -> impl std::future::Future<Output = bool> + Send;
}

/// The server's log: proposals through the [`Proposer`], leadership
/// confirmed by a read index.
struct RaftLog<'a> {
    node: &'a RaftNode,
    proposer: &'a Proposer,
}

impl LogPort for RaftLog<'_> {
    async fn propose(&self, command: Command) -> Result<(), NotRecorded> {
        match self.proposer.propose(command).await {
            Ok(_) => Ok(()),
            Err(crate::grpc_status::ApiError::Refused(e)) => {
                Err(NotRecorded::Refused(e.to_string()))
            }
            Err(e) => Err(NotRecorded::NotCommitted(e.to_string())),
        }
    }

    async fn confirm_leadership(&self, term: u64) -> bool {
        // Chaos builds: the replica freezes itself (SIGSTOP) here, between
        // deciding and launching, where `reconcile-before-side-effects` is
        // set (the test of a stale leader's launches).
        #[cfg(feature = "failpoints")]
        {
            // With an argument, only while that file exists, and only the
            // replica that removes it (keel-chaos arms one pause at a time).
            fail::eval("reconcile-before-side-effects", |trigger| {
                if trigger.is_none_or(|file| std::fs::remove_file(file).is_ok()) {
                    tracing::warn!("failpoint: pausing this replica before its side effects");
                    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
                }
            });
        }
        // A confirmation that finishes in a later term vouches for that
        // term only: the term is read after it.
        confirm_leadership(self.node).await
            && self.node.raft.metrics().borrow().current_term == term
    }
}

/// How far [`Performer::perform`] got.
#[derive(Debug, PartialEq, Eq)]
pub enum Performed {
    All,
    /// A quorum did not confirm this replica's leadership: the rest of the
    /// steps (stops, launches, starts) were skipped.
    NotConfirmed,
}

/// Performs the reconcile engine's steps on an executor and a log: the
/// whole of the reconcile loop's side effects, shared by the server and
/// the deterministic simulation.
pub struct Performer<'a, E: Executor, L: LogPort> {
    pub log: &'a L,
    pub executor: &'a E,
    pub stop_grace: Duration,
    /// Whether `ConfirmLeadership` asks the quorum. Always, but in the
    /// simulation's check of its own checker (which must then catch the
    /// stale leaders' launches).
    pub confirm: bool,
    /// Where each launch is counted and timed, and the executor's name
    /// (`None`: nowhere, as in the simulation).
    pub launches: Option<(&'a crate::metrics::Metrics, &'static str)>,
    /// The keys a launch opens its job's secrets with.
    pub secret_keys: &'a crate::secret_keys::SecretKeys,
}

impl<E: Executor, L: LogPort> std::fmt::Debug for Performer<'_, E, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Performer")
            .field("stop_grace", &self.stop_grace)
            .field("confirm", &self.confirm)
            .finish_non_exhaustive()
    }
}

impl<E: Executor, L: LogPort> Performer<'_, E, L> {
    /// Performs `steps` in order. Consecutive exits, launches and starts go
    /// together (each may be a round trip: a proposal, or a launch on
    /// another host, where the SSH executor bounds how many go to one host
    /// at once).
    pub async fn perform(&self, steps: Vec<Step>) -> Result<Performed, ExecutorError> {
        let mut steps = steps.into_iter().peekable();
        while let Some(step) = steps.next() {
            match step {
                Step::TakeOver => self.executor.take_over().await,
                Step::Release => {
                    tracing::info!("no longer leading: releasing the workers to the next leader");
                    self.executor.release().await;
                }
                Step::FlushProgress => flush_progress(self.log, self.executor).await,
                Step::RecordExit {
                    id,
                    exit_code,
                    reason,
                    not_admitted,
                } => {
                    let mut exits = vec![(id, exit_code, reason, not_admitted)];
                    while let Some(Step::RecordExit { .. }) = steps.peek() {
                        if let Some(Step::RecordExit {
                            id,
                            exit_code,
                            reason,
                            not_admitted,
                        }) = steps.next()
                        {
                            exits.push((id, exit_code, reason, not_admitted));
                        }
                    }
                    record_exits(self.log, self.executor, exits).await;
                }
                Step::ConfirmLeadership { term } => {
                    // A replica paused after it decided (SIGSTOP, a long
                    // stall) still believes it leads when it wakes: before
                    // touching processes, a quorum confirms it does (the
                    // executors' fences catch what slips between this check
                    // and the launch).
                    if self.confirm && !self.log.confirm_leadership(term).await {
                        tracing::info!(
                            "not launching or stopping workers: leadership not confirmed"
                        );
                        return Ok(Performed::NotConfirmed);
                    }
                }
                Step::Stop { id } => self.executor.stop(&id, self.stop_grace).await?,
                Step::Launch(first) => {
                    let mut launches = vec![self.launch(*first)];
                    while let Some(Step::Launch(_) | Step::NotOwned { .. }) = steps.peek() {
                        match steps.next() {
                            Some(Step::Launch(l)) => launches.push(self.launch(*l)),
                            Some(Step::NotOwned { id, node }) => not_owned(&id, &node),
                            _ => {}
                        }
                    }
                    futures::future::join_all(launches)
                        .await
                        .into_iter()
                        .collect::<Result<Vec<()>, _>>()?;
                }
                Step::RecordStart { id, node } => {
                    let mut starts = vec![(id, node)];
                    while let Some(Step::RecordStart { .. }) = steps.peek() {
                        if let Some(Step::RecordStart { id, node }) = steps.next() {
                            starts.push((id, node));
                        }
                    }
                    let proposals = starts.into_iter().map(|(id, node)| {
                        self.log.propose(Command::record_worker_started(
                            id.job_id, id.epoch, id.rank, node,
                        ))
                    });
                    for outcome in futures::future::join_all(proposals).await {
                        if let Err(e) = outcome {
                            tracing::debug!(error = %e, "worker start not recorded");
                        }
                    }
                }
                Step::NotOwned { id, node } => not_owned(&id, &node),
                Step::Shutdown => {
                    tracing::info!("stopping every worker");
                    self.executor.shutdown(self.stop_grace).await;
                }
            }
        }
        Ok(Performed::All)
    }
}

impl<E: Executor, L: LogPort> Performer<'_, E, L> {
    /// Launches one worker, counted and timed where `launches` says.
    async fn launch(
        &self,
        mut launch: keel_executors::contract::WorkerLaunch,
    ) -> Result<(), ExecutorError> {
        // The job's secrets, opened here and nowhere else. One that does
        // not open (no such key here, or gone) is the worker's exit before
        // it started: not admitted, so no retry is spent and the job waits
        // and tries again, here or under a leader that holds the key.
        if let Err(reason) = open_secrets(self.secret_keys, &mut launch) {
            tracing::warn!(worker = %launch.id, %reason, "not launched: a secret does not open");
            let outcome = self
                .log
                .propose(Command::RecordWorkerExited {
                    job_id: launch.id.job_id,
                    epoch: launch.id.epoch,
                    rank: launch.id.rank,
                    exit_code: None,
                    reason,
                    not_admitted: true,
                })
                .await;
            if let Err(e) = outcome {
                tracing::debug!(error = %e, "secret refusal not recorded");
            }
            return Ok(());
        }
        let started = std::time::Instant::now();
        // The launch's span, in the trace of the job's submission.
        let span = tracing::trace_span!(
            target: crate::traces::TARGET,
            "keel.launch",
            keel.job_id = launch.id.job_id,
            keel.rank = launch.id.rank,
            keel.node = %launch.node,
        );
        if let Some(parent) = &launch.trace_parent {
            crate::traces::join(&span, parent);
        }
        let launched = tracing::Instrument::instrument(self.executor.launch(launch), span).await;
        if let Some((metrics, executor)) = self.launches {
            metrics.launched(executor, launched.is_ok(), started.elapsed());
        }
        launched
    }
}

/// Opens every secret `launch` takes ([`crate::secret_keys`]) into its
/// values; why one does not open, in words for the job's record.
fn open_secrets(
    keys: &crate::secret_keys::SecretKeys,
    launch: &mut keel_executors::contract::WorkerLaunch,
) -> Result<(), String> {
    for (variable, secret) in &mut launch.secret_env {
        let reference = &secret.reference;
        let Some(sealed) = &secret.sealed else {
            return Err(format!(
                "env.{variable}: secret {reference} is gone (keel secret list shows the secrets)"
            ));
        };
        let value = keys
            .open(&reference.name, &reference.key, sealed)
            .map_err(|e| format!("env.{variable}: {e}"))?;
        secret.value = Some(value);
    }
    Ok(())
}

/// One span per job the decision places that has a trace (its
/// submission's): from the decision until its entry is applied here. None
/// without `--otlp-endpoint`.
fn decision_spans(state: &ClusterState, decision: Option<&Command>) -> Vec<tracing::Span> {
    let Some(Command::DecideAllocation {
        placements,
        round,
        policy,
        ..
    }) = decision
    else {
        return Vec::new();
    };
    if !tracing::enabled!(target: crate::traces::TARGET, tracing::Level::TRACE) {
        return Vec::new();
    }
    placements
        .iter()
        .filter_map(|p| {
            let parent = state.jobs().get(&p.job_id)?.trace_parent.as_deref()?;
            let span = tracing::trace_span!(
                target: crate::traces::TARGET,
                "keel.decide",
                keel.job_id = p.job_id,
                keel.round = *round,
                keel.policy = %policy,
                keel.gpus = p.gpus.len(),
            );
            crate::traces::join(&span, parent);
            Some(span)
        })
        .collect()
}

fn not_owned(id: &WorkerId, node: &str) {
    tracing::warn!(
        worker = %id,
        node = %node,
        "not launched: no executor of this server owns the node \
         (it is known from heartbeats only)"
    );
}

/// Records `exits` (after the progress that came before them: a job's last
/// progress lines must be in the log before the exit that ends it; the
/// engine puts a progress flush before them), then lets the executor forget
/// them.
async fn record_exits<E: Executor, L: LogPort>(
    log: &L,
    executor: &E,
    exits: Vec<(WorkerId, Option<i32>, String, bool)>,
) {
    let proposals = exits
        .into_iter()
        .map(|(id, exit_code, reason, not_admitted)| async move {
            let outcome = log
                .propose(Command::RecordWorkerExited {
                    job_id: id.job_id,
                    epoch: id.epoch,
                    rank: id.rank,
                    exit_code,
                    reason,
                    not_admitted,
                })
                .await;
            (id, outcome)
        });
    for (id, outcome) in futures::future::join_all(proposals).await {
        match outcome {
            Ok(()) => executor.forget(&id).await,
            // Refused (the job was removed): nothing to record it on.
            Err(NotRecorded::Refused(e)) => {
                tracing::debug!(worker = %id, refusal = %e, "exit not recorded");
                executor.forget(&id).await;
            }
            // Not committed: kept, and recorded again by the next pass.
            Err(e) => tracing::warn!(worker = %id, error = %e, "exit not committed"),
        }
    }
}

/// Proposes one `ReportProgress` per job with samples since the last flush.
async fn flush_progress<E: Executor, L: LogPort>(log: &L, executor: &E) {
    let batches: BTreeMap<JobId, Vec<ProgressSample>> = executor.take_progress().await;
    let proposals = batches.into_iter().map(|(job_id, mut samples)| {
        if samples.len() > PROGRESS_SAMPLES_MAX {
            samples.drain(..samples.len() - PROGRESS_SAMPLES_MAX);
        }
        log.propose(Command::report_progress(job_id, samples))
    });
    for outcome in futures::future::join_all(proposals).await {
        if let Err(e) = outcome {
            tracing::debug!(error = %e, "progress not recorded");
        }
    }
}
