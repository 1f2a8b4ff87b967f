//! The leader's scheduling loop in the simulation, and a check of what it
//! logged.
//!
//! Every replica runs the scheduler's pure engine
//! ([`keel_scheduling::engine::SchedulingEngine`]) on its applied state and
//! the virtual clock, with the heterogeneity-aware LAS in one-second rounds
//! (solved again at most every four)
//! (a policy whose memory is in the log), and proposes what the engine
//! decides while it believes it leads — after confirming its leadership
//! with a quorum once per term, as the server's leader gate does. So
//! scheduling decisions race with crashes, partitions, stale leaders and
//! the clients' own stale placements.
//!
//! [`memory_decisions_follow_from_the_log`] then holds every replica's
//! journal to the promise that the log alone determines the scheduler:
//! each decision that carries a policy memory, planned again by a policy
//! instance that knows only the state at its `based_on` index and its
//! round's start, is exactly the logged entry.

use super::leadership::{Leadership, TermGate};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_scheduling::engine::{SchedulingEngine, SchedulingTimings, Wait};
use keel_scheduling::policy::{
    decide, describe_memory, GavelOptions, GavelRounds, Policy, PolicyOptions,
};
use keel_state::{ClusterState, Command};
use tokio::sync::watch;

use super::net::Net;
use super::replica::Trace;
use super::run::{record, write, History, Op};

/// The policy the simulated leaders run.
pub(crate) const POLICY: &str = "max_min_fairness_perf";

fn options() -> PolicyOptions {
    PolicyOptions {
        gavel: GavelOptions {
            round_s: 1.0,
            // The allocation is solved again at most every 4 rounds (the
            // memory carries it in between), which keeps a seed cheap.
            min_resolve_interval_s: 4.0,
            ..GavelOptions::default()
        },
        ..PolicyOptions::default()
    }
}

fn policy() -> GavelRounds {
    GavelRounds::new(POLICY, options().gavel)
}

/// How often the loop looks at its replica, in virtual milliseconds.
const TICK_MS: u64 = 50;

/// Runs member `member`'s scheduling loop until `stop` turns true.
pub(crate) async fn schedule(
    member: u64,
    net: Arc<Net>,
    history: History,
    trace: Trace,
    mut stop: watch::Receiver<bool>,
) {
    let timings = SchedulingTimings {
        round_ms: 500,
        debounce_ms: TICK_MS,
    };
    let policy: Arc<dyn Policy> = Arc::new(policy());
    let mut engine = SchedulingEngine::new(timings, policy, options(), None, trace.now_ms());
    let mut gate = TermGate::default();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(TICK_MS)) => {}
        }
        let (Some(raft), Some(shared)) = (net.raft(member), net.shared(member)) else {
            engine.not_leading();
            gate.reset();
            continue;
        };
        match gate.check(&raft, Duration::from_secs(5)).await {
            Leadership::NotLeading => {
                engine.not_leading();
                continue;
            }
            Leadership::Leading {
                confirmed: false, ..
            } => continue,
            Leadership::Leading { .. } => {}
        }
        let now_ms = trace.now_ms();
        let round = {
            let applied = shared.read();
            let state = &applied.state;
            // Durations in log time, as the server's loops measure them.
            let wall_ms = net.clocks.now_ms(member);
            let due = match engine.wait(
                state.supply_demand_version(),
                now_ms,
                state
                    .next_backoff_end_ms(wall_ms)
                    .map(|t| t.saturating_sub(wall_ms)),
            ) {
                // One tick is the debounce.
                Wait::Debounce { .. } => true,
                Wait::ChangeOrDeadline { deadline_ms } => now_ms >= deadline_ms,
            };
            due.then(|| engine.round(state, wall_ms, now_ms))
        };
        let Some(command) = round.and_then(|r| r.command) else {
            continue;
        };
        let (outcome, _) = write(&net, member, &raft, command, None).await;
        trace.note(format_args!("schedule by {member}: {outcome:?}"));
        record(
            &history,
            Op {
                kind: "schedule",
                name: None,
                outcome,
            },
        );
    }
}

/// Replays the journal in `state_dir` and plans every decision that
/// carries a policy memory again from the state at its `based_on` index:
/// (decisions checked, violations). A decision whose `based_on` state lies
/// before the journal's last checkpoint cannot be rebuilt and is skipped,
/// and so is one at an index in `checked` (committed entries are the same
/// on every replica: another replica's journal had it); the indexes
/// checked here are added to it.
pub(crate) fn memory_decisions_follow_from_the_log(
    state_dir: &Path,
    until: u64,
    checked_indexes: &mut BTreeSet<u64>,
) -> (u64, Vec<String>) {
    let until = keel_storage::Until::Index(until);
    // Pass 1: which states the decisions were planned on.
    let mut wanted = BTreeSet::new();
    let first = keel_storage::replay_until_visiting(state_dir, until, &mut |index, entry, _| {
        if let Command::DecideAllocation {
            based_on,
            memory: Some(_),
            ..
        } = &entry.command
        {
            if !checked_indexes.contains(&index) {
                wanted.insert(*based_on);
            }
        }
    });
    if let Err(e) = first {
        return (0, vec![format!("policy memory: replay failed: {e}")]);
    }
    // Pass 2: keep those states as they go by, and plan each decision again.
    let mut states: BTreeMap<u64, ClusterState> = BTreeMap::new();
    let mut checked = 0;
    let mut violations = Vec::new();
    let second = keel_storage::replay_until_visiting(
        state_dir,
        until,
        &mut |index, entry, state| {
            if wanted.contains(&state.last_index()) && !states.contains_key(&state.last_index()) {
                states.insert(state.last_index(), state.clone());
            }
            let Command::DecideAllocation {
                based_on,
                memory: Some(memory),
                ..
            } = &entry.command
            else {
                return;
            };
            let Some(planned_on) = states.get(based_on) else {
                return;
            };
            let Some(started_ms) =
                describe_memory(memory).and_then(|d| d["round_started_ms"].as_u64())
            else {
                violations.push(format!(
                "policy memory: the decision at index {index} carries a memory this build does not read"
            ));
                return;
            };
            checked += 1;
            let again = decide(&policy(), planned_on, started_ms);
            if again.as_ref() != Some(&entry.command) {
                violations.push(format!(
                "policy memory: the decision at index {index} (based on {based_on}) is not what the log gives: logged {:?}, planned again {again:?}",
                entry.command
            ));
            }
            // States older than this decision's are not needed again.
            states.retain(|i, _| i >= based_on);
        },
    );
    if let Err(e) = second {
        violations.push(format!("policy memory: replay failed: {e}"));
    }
    (checked, violations)
}
