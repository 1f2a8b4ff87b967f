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
//! - **Reconciling**: compares the workers the state wants with what the
//!   executor reports ([`keel_executors::reconcile`]), records exits (after
//!   the job's pending progress), stops unwanted workers, launches wanted
//!   ones and records their start. Progress samples are batched: at most
//!   one `ReportProgress` per job per progress interval.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use keel_executors::reconcile::{desired_workers, reconcile, recorded_running, Action};
use keel_executors::{Executor, Observed};
use keel_scheduling::engine::{Notice, SchedulingEngine, SchedulingTimings, Wait};
use keel_scheduling::policy::{Policy, PolicyOptions};
use keel_state::state::limits::PROGRESS_SAMPLES_MAX;
use keel_state::{Command, JobId, ProgressSample};
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

fn is_leader(node: &RaftNode) -> bool {
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

/// The scheduling loop: the async driver of
/// [`keel_scheduling::engine::SchedulingEngine`], which decides when a round
/// runs, which policy runs it and what it proposes; this loop only reads the
/// state and the clocks, waits, proposes and logs. Returns when `stop`
/// turns true.
#[allow(clippy::too_many_arguments)]
pub async fn scheduling_loop(
    node: Arc<RaftNode>,
    proposer: Proposer,
    default_policy: Arc<dyn Policy>,
    options: PolicyOptions,
    cannot_share_gpus: Option<&'static str>,
    clock: Clock,
    settings: LoopSettings,
    reports: SchedulingReports,
    mut stop: watch::Receiver<bool>,
) {
    let shared = node.state_machine.shared();
    let mut applied = shared.subscribe();
    let mut gate = LeaderGate::new("scheduling");
    // The engine's timers run on a monotonic clock: milliseconds since
    // this loop started.
    let origin = tokio::time::Instant::now();
    let monotonic_ms = || u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX);
    let timings = SchedulingTimings {
        round_ms: u64::try_from(settings.round.as_millis()).unwrap_or(u64::MAX),
        debounce_ms: u64::try_from(settings.debounce.as_millis()).unwrap_or(u64::MAX),
    };
    let mut engine = SchedulingEngine::new(
        timings,
        default_policy,
        options,
        cannot_share_gpus,
        monotonic_ms(),
    );
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
        let (round, report) = {
            let applied = shared.read();
            let round = engine.round(&applied.state, clock(), monotonic_ms());
            let report = SchedulingReport {
                policy_counters: engine.counters(&applied.state),
                last_planned_index: applied.state.last_index(),
            };
            (round, report)
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

/// The reconcile loop. Returns when `stop` turns true, after stopping every
/// worker (with the grace period).
pub async fn reconcile_loop<E: Executor>(
    node: Arc<RaftNode>,
    proposer: Proposer,
    executor: Arc<E>,
    settings: LoopSettings,
    mut stop: watch::Receiver<bool>,
) {
    let shared = node.state_machine.shared();
    let mut applied = shared.subscribe();
    let mut last_progress = tokio::time::Instant::now();
    let mut gate = LeaderGate::new("reconcile");
    // Whether the executor holds the workers (taken over at the start of
    // this replica's leadership, released when it ends).
    let mut holding = false;
    // Nodes with workers the executor does not own, as last warned about.
    let mut unowned = BTreeSet::new();
    loop {
        tokio::select! {
            _ = applied.changed() => {
                // Coalesce bursts of entries into one pass.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            _ = tokio::time::sleep(settings.reconcile_every) => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        if !gate.ready(&node).await {
            if holding && !is_leader(&node) {
                tracing::info!("no longer leading: releasing the workers to the next leader");
                executor.release().await;
                holding = false;
            }
            continue;
        }
        if !holding {
            // Before the first pass: what runs already is adopted, not
            // launched a second time.
            executor.take_over().await;
            holding = true;
        }
        // Launches are recorded on the next pass; take it at once.
        for _ in 0..3 {
            match reconcile_pass(&node, &proposer, executor.as_ref(), &settings, &mut unowned).await
            {
                Ok(launched) if launched > 0 => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile pass failed");
                    break;
                }
            }
        }
        if last_progress.elapsed() >= settings.progress_every {
            flush_progress(&proposer, executor.as_ref()).await;
            last_progress = tokio::time::Instant::now();
        }
    }
    // A replica that does not hold the workers leaves them to the leader.
    if !holding {
        return;
    }
    // Exits that happened before the shutdown are facts to record; the
    // workers stopped by the shutdown itself are not failures and are not
    // recorded: the next leader relaunches them from their checkpoints.
    if is_leader(&node) {
        if let Ok(observed) = executor.observe().await {
            let exits: Vec<Action> = observed
                .into_iter()
                .filter_map(|(id, o)| match o {
                    Observed::Exited { exit_code, reason } => Some(Action::RecordExit {
                        id,
                        exit_code,
                        reason,
                    }),
                    Observed::Running { .. } => None,
                })
                .collect();
            record_exits(&proposer, executor.as_ref(), &exits).await;
        }
    }
    tracing::info!("stopping every worker");
    executor.shutdown(settings.stop_grace).await;
}

/// One reconcile pass; returns how many workers it launched. A worker
/// wanted on a node the executor does not own is not launched (warned
/// about once while it stays so; `unowned` holds those nodes).
async fn reconcile_pass<E: Executor>(
    node: &RaftNode,
    proposer: &Proposer,
    executor: &E,
    settings: &LoopSettings,
    unowned: &mut BTreeSet<String>,
) -> Result<usize, keel_executors::ExecutorError> {
    let observed = executor.observe().await?;
    let actions = {
        let shared = node.state_machine.shared();
        let applied = shared.read();
        reconcile(
            &desired_workers(&applied.state),
            &observed,
            &recorded_running(&applied.state),
        )
    };
    record_exits(proposer, executor, &actions).await;
    // A replica paused after it decided (SIGSTOP, a long GC-like stall)
    // still believes it leads when it wakes: before touching processes,
    // confirm with a quorum that it does, for this batch (the executors'
    // fences catch what slips between this check and the launch).
    let touches = actions
        .iter()
        .any(|a| matches!(a, Action::Stop { .. } | Action::Launch(_)));
    // Chaos builds: the replica freezes itself (SIGSTOP) here, between
    // deciding and launching, where `reconcile-before-side-effects` is set
    // (the test of a stale leader's launches).
    #[cfg(feature = "failpoints")]
    if touches {
        // With an argument, only while that file exists, and only the
        // replica that removes it (keel-chaos arms one pause at a time).
        fail::eval("reconcile-before-side-effects", |trigger| {
            if trigger.is_none_or(|file| std::fs::remove_file(file).is_ok()) {
                tracing::warn!("failpoint: pausing this replica before its side effects");
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
            }
        });
    }
    if touches && !confirm_leadership(node).await {
        tracing::info!("not launching or stopping workers: leadership not confirmed");
        return Ok(0);
    }
    let mut launches = Vec::new();
    let mut starts = Vec::new();
    let mut unowned_now = BTreeSet::new();
    for action in actions {
        match action {
            Action::Stop { id } => executor.stop(&id, settings.stop_grace).await?,
            Action::Launch(launch) if !executor.owns(&launch.node) => {
                if !unowned.contains(&launch.node) {
                    tracing::warn!(
                        worker = %launch.id,
                        node = %launch.node,
                        "not launched: no executor of this server owns the node \
                         (it is known from heartbeats only)"
                    );
                }
                unowned_now.insert(launch.node.clone());
            }
            Action::Launch(launch) => launches.push(executor.launch(*launch)),
            Action::RecordStart { id, node } => {
                starts.push(proposer.propose(Command::RecordWorkerStarted {
                    job_id: id.job_id,
                    epoch: id.epoch,
                    rank: id.rank,
                    node,
                }))
            }
            Action::RecordExit { .. } => {}
        }
    }
    *unowned = unowned_now;
    // Launches run together: each may be a round trip to another host
    // (the SSH executor bounds how many go to one host at once).
    let launched = launches.len();
    let launch_results = futures::future::join_all(launches).await;
    for outcome in futures::future::join_all(starts).await {
        if let Err(e) = outcome {
            tracing::debug!(error = %e, "worker start not recorded");
        }
    }
    launch_results.into_iter().collect::<Result<Vec<()>, _>>()?;
    Ok(launched)
}

/// Records the exits among `actions` (after the progress that came before
/// them: a job's last progress lines must be in the log before the exit
/// that ends it), then lets the executor forget them.
async fn record_exits<E: Executor>(proposer: &Proposer, executor: &E, actions: &[Action]) {
    let exits: Vec<&Action> = actions
        .iter()
        .filter(|a| matches!(a, Action::RecordExit { .. }))
        .collect();
    if exits.is_empty() {
        return;
    }
    flush_progress(proposer, executor).await;
    let proposals = exits.iter().filter_map(|a| match a {
        Action::RecordExit {
            id,
            exit_code,
            reason,
        } => Some(async move {
            let outcome = proposer
                .propose(Command::RecordWorkerExited {
                    job_id: id.job_id,
                    epoch: id.epoch,
                    rank: id.rank,
                    exit_code: *exit_code,
                    reason: reason.clone(),
                })
                .await;
            (id, outcome)
        }),
        _ => None,
    });
    for (id, outcome) in futures::future::join_all(proposals).await {
        match outcome {
            Ok(_) => executor.forget(id).await,
            // Refused (the job was removed): nothing to record it on.
            Err(crate::grpc_status::ApiError::Refused(e)) => {
                tracing::debug!(worker = %id, refusal = %e, "exit not recorded");
                executor.forget(id).await;
            }
            // Not committed: keep it and try again next pass.
            Err(e) => tracing::warn!(worker = %id, error = %e, "exit not committed"),
        }
    }
}

/// Proposes one `ReportProgress` per job with samples since the last flush.
async fn flush_progress<E: Executor>(proposer: &Proposer, executor: &E) {
    let batches: BTreeMap<JobId, Vec<ProgressSample>> = executor.take_progress().await;
    let proposals = batches.into_iter().map(|(job_id, mut samples)| {
        if samples.len() > PROGRESS_SAMPLES_MAX {
            samples.drain(..samples.len() - PROGRESS_SAMPLES_MAX);
        }
        proposer.propose(Command::ReportProgress { job_id, samples })
    });
    for outcome in futures::future::join_all(proposals).await {
        if let Err(e) = outcome {
            tracing::debug!(error = %e, "progress not recorded");
        }
    }
}
