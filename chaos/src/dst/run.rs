//! One simulated run: start, workload and faults, heal, check, report.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel::raft_node::RaftSettings;
use keel_state::command::{Command, JobOutcome, JobPlacement, LogEntry, Proposal};
use keel_state::fixtures::{job_spec, SplitMix64};
use keel_state::model::{Gpu, GpuRef, JobState};
use keel_state::ClusterState;
use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};
use serde::Serialize;
use tokio::sync::watch;

use super::net::{Net, Raft};
use super::replica::{Leaders, Replica, Trace};
use super::DstError;

/// How a simulated run goes.
#[derive(Debug, Clone)]
pub struct DstConfig {
    pub seed: u64,
    /// 3 or 5.
    pub replicas: u64,
    /// Fault rounds (each: calm, inject, hold, heal).
    pub rounds: u32,
    pub clients: u32,
    /// Virtual time the cluster may take to commit and converge after the
    /// final heal.
    pub liveness_bound: Duration,
    /// A check of the checker: every disk acknowledges appends before they
    /// are durable, so a crash can lose committed entries, and runs with
    /// crashes must then fail.
    pub lying_disk: bool,
    /// The fault kinds dealt (all by default).
    pub faults: Vec<Fault>,
    /// Every disk slow (50–200 ms flushes) all the time.
    pub slow_disks: bool,
    /// Every replica runs the scheduling and reconcile loops while it
    /// leads (on by default; the runs that test only the Raft layer's
    /// faults may leave them out, as they double a seed's cost).
    pub scheduling: bool,
    /// A check of the checker: the reconcile loops skip the quorum's
    /// confirmation before they launch or stop, so a stale leader acts on
    /// what it decided before it was deposed, and runs with the
    /// `stale_leader` fault must then fail.
    pub unconfirmed: bool,
}

impl DstConfig {
    pub fn new(seed: u64) -> DstConfig {
        DstConfig {
            seed,
            replicas: 3,
            rounds: 12,
            clients: 3,
            liveness_bound: Duration::from_secs(20),
            lying_disk: false,
            faults: Fault::ALL.to_vec(),
            slow_disks: false,
            scheduling: true,
            unconfirmed: false,
        }
    }
}

/// What one run did and found.
#[derive(Debug, Clone, Serialize)]
pub struct DstReport {
    pub seed: u64,
    pub replicas: u64,
    pub rounds: u32,
    /// Simulated (virtual) seconds.
    pub virtual_s: f64,
    /// Real seconds the simulation took.
    pub wall_s: f64,
    pub messages_delivered: u64,
    pub messages_lost: u64,
    pub faults: BTreeMap<String, u64>,
    /// By operation, then outcome: `committed`, `refused_by_state`,
    /// `not_leader`, `indeterminate`.
    pub operations: BTreeMap<String, BTreeMap<String, u64>>,
    pub terms_with_a_leader: usize,
    /// Terms two candidates both won, with different leader ids (openraft's
    /// default mode allows it; see `replica::Leaders`).
    pub terms_with_two_leaders: usize,
    /// Leaderships a restarted replica resumed under its old leader id
    /// (openraft restores a leader whose committed vote is its own).
    pub restored_leaderships: usize,
    pub final_index: u64,
    pub state_hash: String,
    /// Log entries replicas truncated: uncommitted suffixes a new leader
    /// overwrote (the replica then rejoined; the checks say it agrees).
    pub entries_truncated: u64,
    /// Scheduling decisions with a policy memory (distinct log indexes,
    /// over every replica's journal) that were planned again from the log
    /// and matched.
    pub memory_decisions_checked: u64,
    /// Workers the reconcile loops launched and stopped on the simulated
    /// machines.
    pub workers_launched: u64,
    pub workers_stopped: u64,
    /// `stale_leader` faults whose leader was paused after deciding, cut
    /// off until another replica took the workers over, and let go on.
    pub stale_leader_pauses: u64,
    /// Replicas whose Raft core stopped on its own (a server fails stop
    /// then, and its supervisor restarts it; so does the simulation), with
    /// openraft's reason.
    pub core_stops: Vec<String>,
    /// Failed checks; empty when the run passed.
    pub violations: Vec<String>,
    /// blake3 of the run's trace (virtual times, faults, leaders, every
    /// operation and its outcome) and final state: the same seed gives the
    /// same digest.
    pub digest: String,
    /// The trace itself (left out of the JSON report).
    #[serde(skip)]
    pub trace: Vec<String>,
    pub passed: bool,
}

impl DstReport {
    /// One line for a person.
    pub fn line(&self) -> String {
        let ops: u64 = self.operations.values().flat_map(|m| m.values()).sum();
        format!(
            "seed {}: {} — {} replicas, {} rounds, {:.0} s simulated in {:.2} s, {} ops, {} messages ({} lost), {} terms led, index {}, {} entries truncated, {} scheduling decisions replanned from the log, {} workers launched and {} stopped, {} stale leaders woken, {} Raft cores stopped and restarted, digest {}",
            self.seed,
            if self.passed { "ok" } else { "FAILED" },
            self.replicas,
            self.rounds,
            self.virtual_s,
            self.wall_s,
            ops,
            self.messages_delivered + self.messages_lost,
            self.messages_lost,
            self.terms_with_a_leader,
            self.final_index,
            self.entries_truncated,
            self.memory_decisions_checked,
            self.workers_launched,
            self.workers_stopped,
            self.stale_leader_pauses,
            self.core_stops.len(),
            &self.digest[..16.min(self.digest.len())],
        )
    }
}

/// Runs one seed to its report, on a single-threaded runtime with a
/// virtual clock (this thread's Raft randomness seeded for the run).
pub fn run_seed(config: &DstConfig) -> Result<DstReport, DstError> {
    let started = std::time::Instant::now();
    keel_storage::seed_thread_rng(Some(config.seed));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| DstError::Setup(e.to_string()))?;
    let result = runtime.block_on(simulate(config));
    drop(runtime);
    keel_storage::seed_thread_rng(None);
    let mut report = result?;
    report.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Committed {
        index: u64,
        accepted: bool,
    },
    /// Not the leader: never appended.
    NotLeader,
    Indeterminate,
}

#[derive(Debug, Clone)]
pub(crate) struct Op {
    pub(crate) kind: &'static str,
    /// Submissions: the job's unique name.
    pub(crate) name: Option<String>,
    pub(crate) outcome: Outcome,
}

pub(crate) type History = Arc<Mutex<Vec<Op>>>;

pub(crate) fn record(history: &History, op: Op) {
    history.lock().unwrap_or_else(|p| p.into_inner()).push(op);
}

/// Most sends of one submission whose outcome is in doubt.
const SUBMIT_ATTEMPTS: u32 = 3;

/// Stamps of the entries: a fixed epoch plus virtual time.
pub(crate) const EPOCH_MS: u64 = 1_700_000_000_000;

/// Proposes one command on `raft` (member `member`'s), stamped by its log
/// clock as the server's proposer stamps (after catching up at a new
/// term): the outcome, and the leader it named if it was not the leader.
pub(crate) async fn write(
    net: &Net,
    member: u64,
    raft: &Raft,
    command: Command,
    request_id: Option<String>,
) -> (Outcome, Option<u64>) {
    let term = raft.metrics().borrow().current_term;
    if net.clocks.needs_catch_up(member, term) {
        let caught_up = keel::proposer::apply_whole_log(raft, Duration::from_secs(3));
        match tokio::time::timeout(Duration::from_secs(3), caught_up).await {
            Ok(Ok(term)) => {
                let latest = net
                    .shared(member)
                    .map_or(0, |s| s.read().state.last_entry_at_ms());
                net.clocks.caught_up(member, term, latest);
            }
            // Not caught up: nothing is proposed (a stamp now could be
            // earlier than an entry of the terms before).
            Ok(Err(keel::proposer::CatchUpError::NotLeader(RaftError::APIError(
                CheckIsLeaderError::ForwardToLeader(f),
            )))) => return (Outcome::NotLeader, f.leader_id),
            _ => return (Outcome::NotLeader, None),
        }
    }
    // A clock too far ahead of the voters' does not lead (the server's
    // `clock_watch_loop`): it steps down and proposes nothing.
    if !net.clocks.may_lead(member, &super::clocks::voters_of(raft)) {
        raft.runtime_config().elect(false);
        raft.runtime_config().heartbeat(false);
        return (Outcome::NotLeader, None);
    }
    let proposal = Proposal::new(vec![LogEntry {
        request_id,
        ..LogEntry::new(net.clocks.stamp(member), command)
    }]);

    match tokio::time::timeout(Duration::from_secs(3), raft.client_write(proposal)).await {
        Err(_) => (Outcome::Indeterminate, None),
        Ok(Ok(r)) => (
            Outcome::Committed {
                index: r.log_id.index,
                accepted: r.data.outcomes.first().is_some_and(|o| o.is_ok()),
            },
            None,
        ),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
            (Outcome::NotLeader, f.leader_id)
        }
        Ok(Err(_)) => (Outcome::Indeterminate, None),
    }
}

/// A plan for the oldest pending job on free GPUs of one node, decided on
/// `state` as of `based_on` (possibly stale by the time it commits).
fn plan(state: &ClusterState, based_on: u64) -> Option<Command> {
    let job = state
        .jobs()
        .values()
        .find(|j| j.state == JobState::Pending)?;
    let want = job.spec.gpus as usize;
    state.nodes().iter().find_map(|(name, node)| {
        let free: Vec<GpuRef> = node
            .gpus
            .keys()
            .map(|index| GpuRef {
                node: name.clone(),
                index: *index,
            })
            .filter(|g| !state.gpu_holders().contains_key(g))
            .take(want)
            .collect();
        (free.len() == want).then(|| {
            Command::decide_allocation(
                based_on,
                "dst",
                state.last_round() + 1,
                vec![JobPlacement::alone(job.id, free)],
            )
        })
    })
}

/// A job in one of `states`, picked by `roll`.
fn pick_job(state: &ClusterState, states: &[JobState], roll: u64) -> Option<u64> {
    let jobs: Vec<u64> = state
        .jobs()
        .values()
        .filter(|j| states.contains(&j.state))
        .map(|j| j.id)
        .collect();
    (!jobs.is_empty()).then(|| jobs[(roll % jobs.len() as u64) as usize])
}

struct Client {
    id: u32,
    net: Arc<Net>,
    history: History,
    trace: Trace,
    rng: SplitMix64,
    stop: watch::Receiver<bool>,
}

impl Client {
    /// Submits, places, finishes and cancels jobs until told to stop, each
    /// against the replica it believes leads (or, now and then, any).
    async fn run(mut self) {
        let mut guess = 1u64;
        let mut submitted = 0u64;
        while !*self.stop.borrow() {
            tokio::time::sleep(Duration::from_millis(20 + self.rng.below(280))).await;
            let running = self.net.running();
            if running.is_empty() {
                continue;
            }
            let target = if running.contains(&guess) && self.rng.below(8) > 0 {
                guess
            } else {
                running[(self.rng.below(running.len() as u64)) as usize]
            };
            let (Some(raft), Some(shared)) = (self.net.raft(target), self.net.shared(target))
            else {
                continue;
            };
            let roll = self.rng.below(100);
            let pick = self.rng.next_u64();
            let (kind, name, command) = if roll < 55 {
                submitted += 1;
                let name = format!("c{}-{submitted}", self.id);
                let gpus = 1 + u32::from(pick.is_multiple_of(2));
                (
                    "submit",
                    Some(name.clone()),
                    Command::submit_job(job_spec(&name, gpus, 1)),
                )
            } else {
                let command = {
                    let applied = shared.read();
                    let state = &applied.state;
                    let index = applied.last_applied.map_or(0, |l| l.index);
                    if roll < 80 {
                        plan(state, index).map(|c| ("place", c))
                    } else if roll < 92 {
                        pick_job(state, &[JobState::Running], pick).map(|job_id| {
                            (
                                "finish",
                                Command::finish_job(job_id, JobOutcome::Succeeded, "dst"),
                            )
                        })
                    } else {
                        pick_job(state, &[JobState::Pending, JobState::Running], pick)
                            .map(|job_id| ("cancel", Command::cancel_job(job_id, "dst")))
                    }
                };
                let Some((kind, command)) = command else {
                    continue;
                };
                (kind, None, command)
            };
            // A submission carries a request id (its unique name) and is
            // sent again, to another replica, while its outcome is in doubt:
            // it must apply once however often it arrives.
            let request_id = name.clone();
            let (mut outcome, leader) = write(
                &self.net,
                target,
                &raft,
                command.clone(),
                request_id.clone(),
            )
            .await;
            let mut target = target;
            if let Some(l) = leader {
                guess = keel::membership::member_of(l);
            } else if !matches!(outcome, Outcome::Committed { .. }) {
                guess = running[(pick % running.len() as u64) as usize];
            }
            let mut attempts = 1;
            while request_id.is_some()
                && outcome == Outcome::Indeterminate
                && attempts < SUBMIT_ATTEMPTS
                && !*self.stop.borrow()
            {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(50 + self.rng.below(200))).await;
                let running = self.net.running();
                let Some(&retry_at) =
                    running.get(self.rng.below(running.len().max(1) as u64) as usize)
                else {
                    continue;
                };
                let Some(raft) = self.net.raft(retry_at) else {
                    continue;
                };
                target = retry_at;
                let (again, leader) = write(
                    &self.net,
                    retry_at,
                    &raft,
                    command.clone(),
                    request_id.clone(),
                )
                .await;
                if let Some(l) = leader {
                    guess = keel::membership::member_of(l);
                }
                // Not the leader: this send was never appended, but an
                // earlier one may have been.
                if again != Outcome::NotLeader {
                    outcome = again;
                }
            }
            self.trace.note(format_args!(
                "c{} {kind} {} on {target}: {outcome:?}",
                self.id,
                name.as_deref().unwrap_or("-")
            ));
            record(
                &self.history,
                Op {
                    kind,
                    name,
                    outcome,
                },
            );
        }
    }
}

/// The fault kinds of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    CrashLeader,
    /// The leader crashes and its supervisor restarts it at once (10–200 ms).
    RestartLeader,
    CrashFollower,
    CrashMajority,
    IsolateLeader,
    IsolateFollower,
    Partition,
    LeaderCannotSend,
    LeaderCannotHear,
    MessageLoss,
    SlowDisk,
    /// A follower loses its disk and starts again empty.
    WipeFollower,
    /// The composite fault of a lost disk: some followers fall behind (cut
    /// off) while the leader commits with the others, the leader crashes,
    /// one follower that holds the new entries loses its disk and starts
    /// again empty, and the lagging followers come back; the leader stays
    /// down until the round heals. The empty replica and the lagging ones
    /// make a majority that lacks committed entries.
    WipeFollowerThenCrashLeader,
    /// The leader's reconcile loop pauses right after it decided to launch
    /// or stop workers (a SIGSTOP between deciding and acting), the leader
    /// is cut off until another replica leads and has taken the workers
    /// over, then the network heals and the paused loop goes on.
    StaleLeader,
}

impl Fault {
    pub const ALL: [Fault; 14] = [
        Fault::CrashLeader,
        Fault::RestartLeader,
        Fault::CrashFollower,
        Fault::CrashMajority,
        Fault::IsolateLeader,
        Fault::IsolateFollower,
        Fault::Partition,
        Fault::LeaderCannotSend,
        Fault::LeaderCannotHear,
        Fault::MessageLoss,
        Fault::SlowDisk,
        Fault::WipeFollower,
        Fault::WipeFollowerThenCrashLeader,
        Fault::StaleLeader,
    ];

    /// The kind named `name` (as in the report).
    pub fn parse(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::CrashLeader => "crash_leader",
            Fault::RestartLeader => "restart_leader",
            Fault::CrashFollower => "crash_follower",
            Fault::CrashMajority => "crash_majority",
            Fault::IsolateLeader => "isolate_leader",
            Fault::IsolateFollower => "isolate_follower",
            Fault::Partition => "partition",
            Fault::LeaderCannotSend => "leader_cannot_send",
            Fault::LeaderCannotHear => "leader_cannot_hear",
            Fault::MessageLoss => "message_loss",
            Fault::SlowDisk => "slow_disk",
            Fault::WipeFollower => "wipe_follower",
            Fault::WipeFollowerThenCrashLeader => "wipe_follower_then_crash_leader",
            Fault::StaleLeader => "stale_leader",
        }
    }
}

/// The `stale_leader` fault: pauses `leader`'s reconcile loop once it
/// decided to launch or stop (waiting up to 3 virtual seconds for such a
/// pass), cuts it off until another replica took the workers over (up to
/// 8 s), heals, and lets the loop go on. Whether the loop parked.
async fn stale_leader(
    net: &Net,
    machines: &super::reconciler::Machines,
    pause: &super::reconciler::Pause,
    leader: u64,
    others: &[u64],
    trace: &Trace,
) -> bool {
    pause.arm(leader);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while !pause.parked() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !pause.parked() {
        pause.lift();
        trace.note(format_args!(
            "stale_leader: {leader}'s loop decided nothing to launch or stop"
        ));
        return false;
    }
    trace.note(format_args!(
        "stale_leader: {leader}'s loop paused after deciding"
    ));
    net.partition(&[leader], others);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while machines.holder() == Some(leader) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    trace.note(format_args!(
        "stale_leader: workers held by {:?}; healing and waking {leader}'s loop",
        machines.holder()
    ));
    net.heal();
    pause.lift();
    true
}

/// The server's membership repair (`keel::membership::Repairer`), run
/// on every replica every 200 ms (it acts only on the leader) until told
/// to stop.
async fn repair(net: Arc<Net>, trace: Trace, mut stop: watch::Receiver<bool>) {
    // One repairer per running start of each member (a restart gets a new
    // one, as a restarted server does).
    let mut repairers: BTreeMap<u64, keel::membership::Repairer> = BTreeMap::new();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        for member in net.running() {
            let (Some(raft), Some(strangers)) = (net.raft(member), net.strangers(member)) else {
                continue;
            };
            let repairer = repairers
                .entry(member)
                .or_insert_with(|| keel::membership::Repairer::new(strangers.clone()));
            if !repairer.strangers.same(&strangers) {
                *repairer = keel::membership::Repairer::new(strangers);
            }
            match repairer.step(&raft).await {
                Ok(Some(step)) => trace.note(format_args!("repair by {member}: {step:?}")),
                Ok(None) => {}
                Err(e) => trace.note(format_args!("repair by {member} failed: {e}")),
            }
        }
    }
}

/// Whether a member that lost its disk is still being re-admitted: the
/// newest membership any running replica holds does not name every
/// replica's current Raft id as a voter (or is joint). A second lost disk
/// then could leave fewer than a majority of voters with their data, which
/// no Raft cluster survives without an operator, so the faults deal one
/// lost disk at a time.
fn readmission_pending(replicas: &[Replica]) -> bool {
    let newest = replicas
        .iter()
        .filter_map(|r| r.raft())
        .map(|raft| raft.metrics().borrow().membership_config.clone())
        .max_by_key(|m| *m.log_id());
    let Some(newest) = newest else {
        return true;
    };
    let membership = newest.membership();
    let voters: std::collections::BTreeSet<u64> = membership.voter_ids().collect();
    membership.get_joint_config().len() > 1 || replicas.iter().any(|r| !voters.contains(&r.raft_id))
}

/// Restarts every replica whose Raft core stopped on its own, as a
/// server's supervisor restarts a server that failed stop (`keel server`
/// exits when its core stops). Returns what stopped them.
async fn restart_stopped(
    replicas: &mut [Replica],
    net: &Arc<Net>,
    config: &Arc<openraft::Config>,
    leaders: &Leaders,
    trace: &Trace,
) -> Result<Vec<String>, DstError> {
    let mut stops = Vec::new();
    for r in replicas.iter_mut() {
        let Some(raft) = r.raft() else { continue };
        let stopped = match &raft.metrics().borrow().running_state {
            Ok(()) => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = stopped {
            trace.note(format_args!(
                "replica {}'s Raft stopped ({why}); restarted",
                r.id
            ));
            stops.push(format!("replica {} at {} ms: {why}", r.id, trace.now_ms()));
            r.crash(net, trace).await;
            r.start(net, config, leaders, trace).await?;
        }
    }
    Ok(stops)
}

/// The leader with the highest term among the running replicas.
fn leader_of(replicas: &[Replica]) -> Option<u64> {
    replicas
        .iter()
        .filter_map(|r| {
            let raft = r.raft()?;
            let m = raft.metrics();
            let m = m.borrow();
            (m.state == ServerState::Leader).then_some((m.current_term, r.id))
        })
        .max()
        .map(|(_, id)| id)
}

/// Commits a submission of `name` within `bound`, trying the leader the
/// replicas name; records it. Whether it committed.
async fn probe(
    net: &Net,
    replicas: &[Replica],
    history: &History,
    trace: &Trace,
    name: &str,
    bound: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    let mut attempt = 0u32;
    while tokio::time::Instant::now() < deadline {
        let target = leader_of(replicas).or_else(|| net.running().first().copied());
        if let Some((t, raft)) = target.and_then(|t| net.raft(t).map(|r| (t, r))) {
            attempt += 1;
            // Each attempt its own job: one that timed out may still commit.
            let name = format!("{name}-{attempt}");
            let command = Command::submit_job(job_spec(&name, 1, 1));
            let (outcome, _) = write(net, t, &raft, command, None).await;
            trace.note(format_args!("probe {name}: {outcome:?}"));
            let committed = matches!(outcome, Outcome::Committed { accepted: true, .. });
            let definite = matches!(outcome, Outcome::NotLeader);
            record(
                history,
                Op {
                    kind: "submit",
                    name: Some(name),
                    outcome,
                },
            );
            if committed {
                return true;
            }
            if !definite {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Raft's log matching: two replicas' entries with the same log id are the
/// same entry. A violation names the first index where they differ.
fn log_matching(replicas: &[Replica]) -> Vec<String> {
    let logs: Vec<(u64, BTreeMap<u64, keel_storage::Entry>)> =
        replicas.iter().map(|r| (r.id, r.disk.entries())).collect();
    let mut out = Vec::new();
    for (i, (a, log_a)) in logs.iter().enumerate() {
        for (b, log_b) in &logs[i + 1..] {
            let differs = log_a.iter().find(|(index, e)| {
                log_b
                    .get(index)
                    .is_some_and(|f| f.log_id == e.log_id && f.payload != e.payload)
            });
            if let Some((index, e)) = differs {
                out.push(format!(
                    "log matching: replicas {a} and {b} hold different entries under log id {} (index {index})",
                    e.log_id
                ));
            }
        }
    }
    out
}

/// openraft restores a restarted replica whose committed vote is its own
/// as leader under the same leader id. That is safe only if its log holds
/// every entry it sent under that id: one a follower holds beyond the
/// restored log would be written again, differently, under the same log
/// id. A gap found is named.
fn restored_leader_gaps(replicas: &[Replica], member: u64) -> Vec<String> {
    let Some(raft) = replicas[(member - 1) as usize].raft() else {
        return Vec::new();
    };
    let id = replicas[(member - 1) as usize].raft_id;
    let vote = raft.metrics().borrow().vote;
    if !(vote.is_committed() && vote.leader_id().voted_for() == Some(id)) {
        return Vec::new();
    }
    let term = vote.leader_id().term;
    let own_last = replicas[(member - 1) as usize]
        .disk
        .entries()
        .keys()
        .next_back()
        .copied()
        .unwrap_or(0);
    replicas
        .iter()
        .filter(|r| r.id != member)
        .filter_map(|r| {
            let held = r
                .disk
                .entries()
                .into_iter()
                .find(|(index, e)| {
                    *index > own_last
                        && e.log_id.leader_id.term == term
                        && e.log_id.leader_id.node_id == id
                })?;
            Some(format!(
                "restored leader {member} (term {term}) lacks entry {} that replica {} holds under its leader id",
                held.0, r.id
            ))
        })
        .collect()
}

async fn simulate(config: &DstConfig) -> Result<DstReport, DstError> {
    let dir = tempfile::tempdir().map_err(|e| DstError::Setup(e.to_string()))?;
    let trace = Trace::new();
    let leaders = Leaders::default();
    let history: History = Arc::default();
    let net = Net::new(config.seed ^ 0x6e65_7477_6f72_6b00);
    let mut rng = SplitMix64::new(config.seed);
    let settings = RaftSettings {
        // Small, so that snapshots are built, purge the log and are sent to
        // replicas that fell behind.
        snapshot_every_entries: 100,
        keep_log_after_snapshot: 20,
        ..RaftSettings::default()
    };
    let raft_config = Arc::new(
        settings
            .openraft_config()
            .map_err(|e| DstError::Setup(e.to_string()))?,
    );
    let mut replicas: Vec<Replica> = (1..=config.replicas)
        .map(|id| {
            Replica::new(
                id,
                dir.path().join(format!("r{id}")),
                config.seed.wrapping_mul(31).wrapping_add(id),
                config.lying_disk,
            )
        })
        .collect();
    for r in &mut replicas {
        r.disk.set_slow(config.slow_disks);
        r.start(&net, &raft_config, &leaders, &trace).await?;
    }
    let members: BTreeMap<u64, BasicNode> = replicas
        .iter()
        .map(|r| {
            (
                r.raft_id,
                BasicNode {
                    addr: format!("sim-{}", r.id),
                },
            )
        })
        .collect();
    if let Some(raft) = replicas[0].raft() {
        raft.initialize(members)
            .await
            .map_err(|e| DstError::Raft(e.to_string()))?;
    }
    let mut violations = Vec::new();
    // Two GPU nodes for the jobs to land on.
    for n in 0..2u32 {
        let command = Command::register_node(
            format!("n{n}"),
            format!("10.0.0.{n}:7070"),
            (0..4)
                .map(|index| Gpu {
                    index,
                    gpu_type: "v100".into(),
                })
                .collect(),
        );
        let deadline = tokio::time::Instant::now() + config.liveness_bound;
        loop {
            let target = leader_of(&replicas);
            if let Some((t, raft)) = target.and_then(|t| net.raft(t).map(|r| (t, r))) {
                let (outcome, _) = write(&net, t, &raft, command.clone(), None).await;
                trace.note(format_args!("register n{n}: {outcome:?}"));
                if matches!(outcome, Outcome::Committed { .. }) {
                    break;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(DstError::Setup(
                    "the cluster never committed its first entries".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    // The repair runs to the end: a wiped member is re-admitted only by
    // it, also while the cluster converges after the last round.
    let (repair_stop_tx, repair_stop_rx) = watch::channel(false);
    let repairing = tokio::spawn(repair(net.clone(), trace.clone(), repair_stop_rx));
    let clients: Vec<_> = (0..config.clients)
        .map(|id| {
            tokio::spawn(
                Client {
                    id,
                    net: net.clone(),
                    history: history.clone(),
                    trace: trace.clone(),
                    rng: SplitMix64::new(config.seed.wrapping_add(1000 + u64::from(id))),
                    stop: stop_rx.clone(),
                }
                .run(),
            )
        })
        .collect();
    // Every member's reconcile loop (acting while it leads), over the
    // machines they share.
    let machines = super::reconciler::Machines::new(trace.clone());
    let pause = super::reconciler::Pause::new();
    let reconcilers: Vec<_> = (1..=config.replicas)
        .filter(|_| config.scheduling)
        .map(|member| {
            tokio::spawn(super::reconciler::reconcile(
                member,
                net.clone(),
                machines.clone(),
                history.clone(),
                trace.clone(),
                pause.clone(),
                config.unconfirmed,
                stop_rx.clone(),
            ))
        })
        .collect();
    let mut stale_leader_pauses = 0;
    // Every member's scheduling loop (acting while it leads).
    let schedulers: Vec<_> = (1..=config.replicas)
        .filter(|_| config.scheduling)
        .map(|member| {
            tokio::spawn(super::scheduler::schedule(
                member,
                net.clone(),
                history.clone(),
                trace.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();

    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut core_stops = Vec::new();
    for round in 0..config.rounds {
        tokio::time::sleep(Duration::from_millis(300 + rng.below(2_700))).await;
        let Some(&fault) = config
            .faults
            .get((rng.below(config.faults.len().max(1) as u64)) as usize)
        else {
            break;
        };
        // One lost disk at a time (see `readmission_pending`): while one is
        // re-admitted, a wipe is dealt as a crash of the same follower.
        let fault = match fault {
            Fault::WipeFollower | Fault::WipeFollowerThenCrashLeader
                if readmission_pending(&replicas) =>
            {
                trace.note(format_args!(
                    "round {round}: {} dealt as crash_follower: a member is being re-admitted",
                    fault.name()
                ));
                Fault::CrashFollower
            }
            f => f,
        };
        *faults.entry(fault.name().to_string()).or_default() += 1;
        let everyone: Vec<u64> = (1..=config.replicas).collect();
        let running: Vec<u64> = replicas
            .iter()
            .filter(|r| r.is_running())
            .map(|r| r.id)
            .collect();
        let leader =
            leader_of(&replicas).unwrap_or(running[(rng.below(running.len() as u64)) as usize]);
        let others: Vec<u64> = everyone.iter().copied().filter(|r| *r != leader).collect();
        let follower = others[(rng.below(others.len() as u64)) as usize];
        let mut victims = Vec::new();
        match fault {
            Fault::CrashLeader => victims.push(leader),
            Fault::RestartLeader => {
                // Half the time its disk stalls first (a watchdog's
                // restart after a stuck fsync): its followers then hold
                // entries its own disk has not made durable.
                let r = &mut replicas[(leader - 1) as usize];
                if rng.below(2) == 0 {
                    r.disk.set_slow(true);
                    tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
                }
                r.crash(&net, &trace).await;
                r.disk.set_slow(config.slow_disks);
                tokio::time::sleep(Duration::from_millis(10 + rng.below(190))).await;
                r.start(&net, &raft_config, &leaders, &trace).await?;
                violations.extend(restored_leader_gaps(&replicas, leader));
            }
            Fault::CrashFollower => victims.push(follower),
            Fault::CrashMajority => {
                victims.push(leader);
                victims.extend(others.iter().take((config.replicas / 2) as usize));
            }
            Fault::IsolateLeader => net.partition(&[leader], &others),
            Fault::IsolateFollower => {
                let rest: Vec<u64> = everyone
                    .iter()
                    .copied()
                    .filter(|r| *r != follower)
                    .collect();
                net.partition(&[follower], &rest);
            }
            Fault::Partition => {
                let size = 1 + rng.below(config.replicas / 2) as usize;
                let mut shuffled = everyone.clone();
                for i in (1..shuffled.len()).rev() {
                    shuffled.swap(i, (rng.below(i as u64 + 1)) as usize);
                }
                let (a, b) = shuffled.split_at(size);
                net.partition(a, b);
            }
            Fault::LeaderCannotSend => {
                for o in &others {
                    net.cut(leader, *o);
                }
            }
            Fault::LeaderCannotHear => {
                for o in &others {
                    net.cut(*o, leader);
                }
            }
            Fault::MessageLoss => net.set_loss_per_mille(50 + rng.below(250)),
            Fault::SlowDisk => {
                let v = if rng.below(2) == 0 { leader } else { follower };
                replicas[(v - 1) as usize].disk.set_slow(true);
            }
            Fault::WipeFollower => {
                let r = &mut replicas[(follower - 1) as usize];
                r.wipe(&net, &trace).await?;
                tokio::time::sleep(Duration::from_millis(10 + rng.below(490))).await;
                r.start(&net, &raft_config, &leaders, &trace).await?;
            }
            Fault::WipeFollowerThenCrashLeader => {
                // `follower` loses its disk; half the followers besides it
                // lag behind, cut off from everyone.
                let lagging = crate::faults::lagging_followers(&others, follower, config.replicas);
                let rest: Vec<u64> = everyone
                    .iter()
                    .copied()
                    .filter(|r| !lagging.contains(r))
                    .collect();
                net.partition(&lagging, &rest);
                tokio::time::sleep(Duration::from_millis(300 + rng.below(1_200))).await;
                replicas[(leader - 1) as usize].crash(&net, &trace).await;
                let r = &mut replicas[(follower - 1) as usize];
                r.wipe(&net, &trace).await?;
                tokio::time::sleep(Duration::from_millis(10 + rng.below(190))).await;
                r.start(&net, &raft_config, &leaders, &trace).await?;
                net.heal();
                victims.push(leader);
            }
            Fault::StaleLeader => {
                if stale_leader(&net, &machines, &pause, leader, &others, &trace).await {
                    stale_leader_pauses += 1;
                }
            }
        }
        for v in &victims {
            replicas[(*v - 1) as usize].crash(&net, &trace).await;
        }
        trace.note(format_args!(
            "round {round}: {} (leader {leader}, crashed {victims:?})",
            fault.name()
        ));
        tokio::time::sleep(Duration::from_millis(500 + rng.below(4_500))).await;
        net.heal();
        for r in &mut replicas {
            r.disk.set_slow(config.slow_disks);
            r.start(&net, &raft_config, &leaders, &trace).await?;
        }
        core_stops
            .extend(restart_stopped(&mut replicas, &net, &raft_config, &leaders, &trace).await?);
        trace.note(format_args!("round {round}: healed"));
        for v in log_matching(&replicas) {
            trace.note(&v);
            violations.push(format!("round {round}: {v}"));
        }
    }
    let _ = stop_tx.send(true);
    pause.lift();
    for c in clients.into_iter().chain(schedulers).chain(reconcilers) {
        let _ = c.await;
    }

    // Liveness: a write commits, and every replica gets to the same state.
    if !probe(
        &net,
        &replicas,
        &history,
        &trace,
        "probe-final",
        config.liveness_bound,
    )
    .await
    {
        violations.push(format!(
            "liveness: no write committed within {:?} of the heal",
            config.liveness_bound
        ));
    }
    let deadline = tokio::time::Instant::now() + config.liveness_bound;
    let mut converged: Option<(u64, String)> = None;
    let mut last_seen = Vec::new();
    while tokio::time::Instant::now() < deadline {
        core_stops
            .extend(restart_stopped(&mut replicas, &net, &raft_config, &leaders, &trace).await?);
        last_seen = replicas
            .iter()
            .filter_map(|r| {
                let shared = r.shared()?;
                let applied = shared.read();
                Some((
                    applied.last_applied.map_or(0, |l| l.index),
                    applied.state.state_hash().to_string(),
                ))
            })
            .collect();
        if last_seen.len() == replicas.len() && last_seen.iter().all(|s| *s == last_seen[0]) {
            converged = Some(last_seen[0].clone());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (final_index, state_hash) = match converged {
        Some(c) => c,
        None => {
            // What each replica's Raft says of itself.
            let states: Vec<String> = replicas
                .iter()
                .filter_map(|r| {
                    let m = r.raft()?.metrics().borrow().clone();
                    Some(format!(
                        "{}: {:?} term {} leader {:?} last log {:?} applied {:?} {}",
                        r.id,
                        m.state,
                        m.current_term,
                        m.current_leader.map(keel::membership::show),
                        m.last_log_index,
                        m.last_applied.map(|l| l.index),
                        match &m.running_state {
                            Ok(()) => "running".to_string(),
                            Err(e) => format!("stopped: {e}"),
                        }
                    ))
                })
                .collect();
            violations.push(format!(
                "divergent: the replicas did not reach one (index, hash) within {:?}: {last_seen:?}; {}",
                config.liveness_bound,
                states.join("; ")
            ));
            last_seen.first().cloned().unwrap_or_default()
        }
    };

    // Every member that lost its disk was re-admitted: the membership is
    // uniform and names each replica's current Raft id as a voter.
    let deadline = tokio::time::Instant::now() + config.liveness_bound;
    while readmission_pending(&replicas) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if readmission_pending(&replicas) {
        violations.push(format!(
            "liveness: the membership does not name every replica's current incarnation as a voter within {:?} (a wiped member not re-admitted, or a joint change left half done)",
            config.liveness_bound
        ));
    }
    violations.extend(log_matching(&replicas));
    // Leaders, as openraft defines them (see `Leaders`): a leader id led by
    // two starts of its node is a leadership restored after a restart,
    // which openraft does by design; log matching above is what makes it
    // safe or not.
    let by_leader_id = leaders.by_leader_id();
    let restored_leaderships = by_leader_id.values().filter(|s| s.len() > 1).count();
    let mut leaders_per_term: BTreeMap<u64, usize> = BTreeMap::new();
    for (term, _) in by_leader_id.keys() {
        *leaders_per_term.entry(*term).or_default() += 1;
    }

    // Exactly once, on the final state.
    let ops = history.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(shared) = replicas[0].shared() {
        let applied = shared.read();
        let mut count: BTreeMap<&str, usize> = BTreeMap::new();
        for job in applied.state.jobs().values() {
            *count.entry(job.spec.name.as_str()).or_default() += 1;
        }
        for (name, c) in &count {
            if *c > 1 {
                violations.push(format!("duplicated: job {name} is there {c} times"));
            }
        }
        for op in &ops {
            let Some(name) = &op.name else { continue };
            let c = count.get(name.as_str()).copied().unwrap_or(0);
            match op.outcome {
                Outcome::Committed {
                    index,
                    accepted: true,
                } if c != 1 => violations.push(format!(
                    "lost: submission {name}, acknowledged at index {index}, is there {c} times"
                )),
                Outcome::Committed {
                    accepted: false, ..
                } if c != 0 => violations.push(format!(
                    "submission {name} was refused by the state machine yet is there"
                )),
                Outcome::NotLeader if c != 0 => violations.push(format!(
                    "submission {name} was refused (not the leader) yet was committed"
                )),
                _ => {}
            }
        }
    }

    let _ = repair_stop_tx.send(true);
    if let Err(e) = repairing.await {
        violations.push(format!("the membership repair task failed: {e}"));
    }

    // Stop every replica cleanly and replay each journal offline, checking
    // the invariants after every entry.
    let (messages_delivered, messages_lost) = net.counts();
    for r in &mut replicas {
        r.stop(&net).await?;
    }
    for r in &replicas {
        match keel_storage::replay_until_checked(
            &r.state_dir,
            keel_storage::Until::Index(final_index),
        ) {
            Ok(s) => {
                if let Some((index, broken)) = s.invariant_violation {
                    violations.push(format!(
                        "invariant: replica {} after index {index}: {broken}",
                        r.id
                    ));
                }
                if s.state_hash.to_string() != state_hash {
                    violations.push(format!(
                        "divergent: replica {}'s journal replays to {} at index {}, the live state was {state_hash} at {final_index}",
                        r.id, s.state_hash, s.last_index
                    ));
                }
            }
            Err(e) => violations.push(format!("replica {}: replay failed: {e}", r.id)),
        }
    }
    // The scheduler's decisions follow from the log alone.
    let mut memory_decisions_checked = 0;
    let mut checked_indexes = std::collections::BTreeSet::new();
    for r in &replicas {
        let (checked, found) = super::scheduler::memory_decisions_follow_from_the_log(
            &r.state_dir,
            final_index,
            &mut checked_indexes,
        );
        memory_decisions_checked += checked;
        violations.extend(found.into_iter().map(|v| format!("replica {}: {v}", r.id)));
    }

    // No stale leader touched a worker.
    let (workers_launched, workers_stopped, stale) = machines.summary();
    violations.extend(stale);

    let mut operations: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for op in &ops {
        let outcome = match op.outcome {
            Outcome::Committed { accepted: true, .. } => "committed",
            Outcome::Committed {
                accepted: false, ..
            } => "refused_by_state",
            Outcome::NotLeader => "not_leader",
            Outcome::Indeterminate => "indeterminate",
        };
        *operations
            .entry(op.kind.to_string())
            .or_default()
            .entry(outcome.to_string())
            .or_default() += 1;
    }
    let lines = trace.lines();
    let mut hasher = blake3::Hasher::new();
    for line in &lines {
        hasher.update(line.as_bytes());
        hasher.update(b"\n");
    }
    hasher.update(format!("{final_index} {state_hash}").as_bytes());
    Ok(DstReport {
        seed: config.seed,
        replicas: config.replicas,
        rounds: config.rounds,
        virtual_s: trace.now_ms() as f64 / 1000.0,
        wall_s: 0.0,
        messages_delivered,
        messages_lost,
        faults,
        operations,
        terms_with_a_leader: leaders_per_term.len(),
        terms_with_two_leaders: leaders_per_term.values().filter(|n| **n > 1).count(),
        restored_leaderships,
        final_index,
        state_hash,
        entries_truncated: replicas.iter().map(|r| r.disk.truncated()).sum(),
        memory_decisions_checked,
        workers_launched,
        workers_stopped,
        stale_leader_pauses,
        core_stops,
        passed: violations.is_empty(),
        violations,
        digest: hasher.finalize().to_hex().to_string(),
        trace: lines,
    })
}
