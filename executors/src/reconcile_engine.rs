//! The reconcile loop's decisions as a pure engine, after openraft's
//! engine/runtime split (the scheduling loop's twin is
//! `keel_scheduling::engine`): the leader's async driver (`keel::leader`)
//! reads the applied state, the executor's observations, leadership and a
//! monotonic clock, asks the engine what to do, and only performs the
//! [`Step`]s it returns, in order. Everything that decides is here, with no
//! clock, I/O or async, so it is tested step by step on a virtual clock.
//!
//! The rules:
//! - the executor holds workers only while this replica leads: it takes
//!   them over before the first pass of a leadership (so what runs is
//!   adopted, never launched twice) and releases them as soon as the
//!   replica no longer leads; a leadership of another term found at a wake
//!   (the last one lapsed while the loop was busy, and another replica may
//!   have led in between) is released and taken over again, since what
//!   the executor holds may be stale;
//! - a pass records exits first, each after the progress that came before
//!   it (a job's last progress lines are in the log before the exit that
//!   ends it), then stops and launches, after confirming leadership with a
//!   quorum (a replica paused after deciding may wake believing it leads),
//!   then records the starts it sees;
//! - a worker wanted on a node the executor does not own is not launched;
//!   that is said once while it stays so;
//! - a pass that launched is followed at once by another (the launches'
//!   starts are recorded there), at most [`PASSES_PER_WAKE`] in a row;
//! - progress is proposed at most once per `progress_every_ms` (and before
//!   any exit);
//! - a replica that stops while holding records the exits it saw (if it
//!   still leads) and shuts the executor down; one that does not hold
//!   touches nothing.
//!
//! An exit that is not committed stays observed, so the next pass records
//! it again: retries need no memory here.

use std::collections::{BTreeMap, BTreeSet};

use keel_state::ClusterState;

use crate::contract::WorkerLaunch;
use crate::reconcile::{desired_workers, reconcile, recorded_running, Action, Observed};
use crate::WorkerId;

/// Passes in a row while each one launches something.
pub const PASSES_PER_WAKE: u32 = 3;

/// The engine's timings, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileTimings {
    /// A pass runs at least this often.
    pub every_ms: u64,
    /// After the applied state changed, wait this long so a burst of
    /// entries is reconciled in one pass.
    pub coalesce_ms: u64,
    /// At most one progress entry per job this often.
    pub progress_every_ms: u64,
}

/// One thing for the driver to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The executor takes over the workers (adopting what runs).
    TakeOver,
    /// The executor lets go of every worker, touching none.
    Release,
    /// Propose the progress the executor buffered, one entry per job.
    FlushProgress,
    /// Propose the worker's exit; once committed (or refused: its job is
    /// gone), the executor forgets it.
    RecordExit {
        id: WorkerId,
        exit_code: Option<i32>,
        reason: String,
        /// Its node refused to start it: the attempt spends no retry.
        not_admitted: bool,
    },
    /// Confirm with a quorum that this replica leads, still in `term` (the
    /// leadership the pass was decided in: a confirmation in a later term
    /// does not vouch for it); if it does not, skip the rest of the pass.
    ConfirmLeadership {
        term: u64,
    },
    Stop {
        id: WorkerId,
    },
    Launch(Box<WorkerLaunch>),
    /// Propose that the worker runs.
    RecordStart {
        id: WorkerId,
        node: String,
    },
    /// Say that a wanted worker is not launched: no executor of this server
    /// owns its node (known from heartbeats only).
    NotOwned {
        id: WorkerId,
        node: String,
    },
    /// Stop every worker and wait for them (the server shuts down).
    Shutdown,
}

/// What one pass decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Pass {
    pub steps: Vec<Step>,
    /// Run another pass at once (this one launched, and the wake has passes
    /// left).
    pub again: bool,
}

/// The reconcile loop's memory: whether the executor holds the workers,
/// which nodes were said to be unowned, when progress was last proposed.
#[derive(Debug)]
pub struct ReconcileEngine {
    timings: ReconcileTimings,
    /// The term of the leadership the executor holds the workers for.
    holding: Option<u64>,
    unowned: BTreeSet<String>,
    last_flush_ms: u64,
    passes_this_wake: u32,
}

impl ReconcileEngine {
    /// An engine whose monotonic clock reads `now_ms`.
    pub fn new(timings: ReconcileTimings, now_ms: u64) -> ReconcileEngine {
        ReconcileEngine {
            timings,
            holding: None,
            unowned: BTreeSet::new(),
            last_flush_ms: now_ms,
            passes_this_wake: 0,
        }
    }

    pub fn timings(&self) -> ReconcileTimings {
        self.timings
    }

    /// Whether the executor holds the workers.
    pub fn holding(&self) -> bool {
        self.holding.is_some()
    }

    /// The loop woke up. `ready_term`: the term this replica leads in, once
    /// it has applied the term's first entry (it may act), else `None`;
    /// `leader`: Raft says it leads (perhaps not ready yet). Returns what
    /// to do first, and whether to run passes now.
    pub fn wake(&mut self, ready_term: Option<u64>, leader: bool) -> (Vec<Step>, bool) {
        self.passes_this_wake = 0;
        match (ready_term, self.holding) {
            (None, Some(_)) if !leader => {
                self.holding = None;
                (vec![Step::Release], false)
            }
            (None, _) => (Vec::new(), false),
            (Some(term), Some(held)) if term == held => (Vec::new(), true),
            (Some(term), Some(_)) => {
                // Leadership lapsed and came back between two wakes: another
                // replica may have led and changed the workers meanwhile.
                self.holding = Some(term);
                (vec![Step::Release, Step::TakeOver], true)
            }
            (Some(term), None) => {
                self.holding = Some(term);
                (vec![Step::TakeOver], true)
            }
        }
    }

    /// One pass over the state at some applied index and what the executor
    /// observed; `owns` says which nodes the executor runs workers on.
    pub fn pass(
        &mut self,
        state: &ClusterState,
        observed: &BTreeMap<WorkerId, Observed>,
        owns: &dyn Fn(&str) -> bool,
        now_ms: u64,
    ) -> Pass {
        self.passes_this_wake += 1;
        let actions = reconcile(&desired_workers(state), observed, &recorded_running(state));
        let mut exits = Vec::new();
        let mut touches = Vec::new();
        let mut starts = Vec::new();
        let mut unowned_now = BTreeSet::new();
        let mut launches = 0;
        for action in actions {
            match action {
                Action::RecordExit {
                    id,
                    exit_code,
                    reason,
                    not_admitted,
                } => exits.push(Step::RecordExit {
                    id,
                    exit_code,
                    reason,
                    not_admitted,
                }),
                Action::Stop { id } => touches.push(Step::Stop { id }),
                Action::Launch(launch) if !owns(&launch.node) => {
                    if !self.unowned.contains(&launch.node) {
                        touches.push(Step::NotOwned {
                            id: launch.id.clone(),
                            node: launch.node.clone(),
                        });
                    }
                    unowned_now.insert(launch.node.clone());
                }
                Action::Launch(launch) => {
                    launches += 1;
                    touches.push(Step::Launch(launch));
                }
                Action::RecordStart { id, node } => starts.push(Step::RecordStart { id, node }),
            }
        }
        self.unowned = unowned_now;
        let mut steps = Vec::new();
        if !exits.is_empty() {
            steps.push(Step::FlushProgress);
            self.last_flush_ms = now_ms;
            steps.extend(exits);
        }
        if touches
            .iter()
            .any(|s| matches!(s, Step::Stop { .. } | Step::Launch(_)))
        {
            // Not holding (a pass outside a leadership): term 0 is never
            // confirmed.
            steps.push(Step::ConfirmLeadership {
                term: self.holding.unwrap_or(0),
            });
        }
        steps.extend(touches);
        steps.extend(starts);
        Pass {
            steps,
            again: launches > 0 && self.passes_this_wake < PASSES_PER_WAKE,
        }
    }

    /// After the passes of a wake: progress, when an interval has gone by
    /// since it was last proposed.
    pub fn after_passes(&mut self, now_ms: u64) -> Vec<Step> {
        if now_ms.saturating_sub(self.last_flush_ms) >= self.timings.progress_every_ms {
            self.last_flush_ms = now_ms;
            return vec![Step::FlushProgress];
        }
        Vec::new()
    }

    /// The server stops. `leader`: this replica still leads; `observed`:
    /// what the executor reports now. Exits that happened before the
    /// shutdown are facts to record; the workers the shutdown stops are not
    /// failures and are not recorded (the next leader relaunches them from
    /// their checkpoints).
    pub fn stop(&mut self, leader: bool, observed: &BTreeMap<WorkerId, Observed>) -> Vec<Step> {
        if self.holding.take().is_none() {
            return Vec::new();
        }
        let mut steps = Vec::new();
        if leader {
            let exits: Vec<Step> = observed
                .iter()
                .filter_map(|(id, o)| match o {
                    Observed::Exited { exit_code, reason } => Some(Step::RecordExit {
                        id: id.clone(),
                        exit_code: *exit_code,
                        reason: reason.clone(),
                        not_admitted: false,
                    }),
                    Observed::NotAdmitted { reason } => Some(Step::RecordExit {
                        id: id.clone(),
                        exit_code: None,
                        reason: reason.clone(),
                        not_admitted: true,
                    }),
                    Observed::Running { .. } => None,
                })
                .collect();
            if !exits.is_empty() {
                steps.push(Step::FlushProgress);
                steps.extend(exits);
            }
        }
        steps.push(Step::Shutdown);
        steps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::tests::World;
    use keel_state::GpuRef;

    const TIMINGS: ReconcileTimings = ReconcileTimings {
        every_ms: 250,
        coalesce_ms: 10,
        progress_every_ms: 2_000,
    };

    /// Node n0 (4 GPUs, owned) and n1 (2 GPUs, known from heartbeats).
    fn world() -> World {
        let mut w = World::new();
        w.add_node("n1", "10.0.0.6", 2);
        w
    }

    /// Submits a one-GPU job and places it on `node`'s GPU 0.
    fn place(w: &mut World, name: &str, node: &str) -> u64 {
        let job_id = w.submit(name, 1);
        w.place_on(job_id, node, &[0]);
        job_id
    }

    fn owns_n0(node: &str) -> bool {
        node == "n0"
    }

    fn wid(job_id: u64) -> WorkerId {
        WorkerId {
            job_id,
            epoch: 1,
            rank: 0,
        }
    }

    fn running_on_n0() -> Observed {
        Observed::Running {
            gpus: vec![GpuRef {
                node: "n0".into(),
                index: 0,
            }],
        }
    }

    fn kinds(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                Step::TakeOver => "take over".to_string(),
                Step::Release => "release".to_string(),
                Step::FlushProgress => "flush progress".to_string(),
                Step::RecordExit { id, .. } => format!("record exit {id}"),
                Step::ConfirmLeadership { term } => format!("confirm leadership in term {term}"),
                Step::Stop { id } => format!("stop {id}"),
                Step::Launch(l) => format!("launch {}", l.id),
                Step::RecordStart { id, node } => format!("record start {id} on {node}"),
                Step::NotOwned { id, node } => format!("not owned {id} on {node}"),
                Step::Shutdown => "shutdown".to_string(),
            })
            .collect()
    }

    #[test]
    fn workers_are_taken_over_when_leading_starts_and_released_when_it_ends() {
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        assert_eq!(e.wake(None, false), (vec![], false), "a follower");
        assert_eq!(
            e.wake(None, true),
            (vec![], false),
            "a leader that has not applied its term's first entry waits"
        );
        assert_eq!(e.wake(Some(3), true), (vec![Step::TakeOver], true));
        assert_eq!(e.wake(Some(3), true), (vec![], true), "taken over once");
        assert_eq!(
            e.wake(None, true),
            (vec![], false),
            "still the leader, not ready for a moment: nothing released"
        );
        assert_eq!(e.wake(None, false), (vec![Step::Release], false));
        assert_eq!(e.wake(None, false), (vec![], false), "released once");
        assert_eq!(
            e.wake(Some(5), true),
            (vec![Step::TakeOver], true),
            "a new leadership takes over again"
        );
    }

    /// Found by keel-dst (seed 8 of the stale-leader runs): a loop busy
    /// through a whole other leadership (its proposals timing out while it
    /// was cut off) woke leading again, in a later term, and went on with
    /// the book of the earlier one.
    #[test]
    fn a_leadership_of_another_term_is_taken_over_afresh() {
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        assert_eq!(e.wake(Some(48), true), (vec![Step::TakeOver], true));
        assert_eq!(
            e.wake(Some(50), true),
            (vec![Step::Release, Step::TakeOver], true)
        );
        assert_eq!(e.wake(Some(50), true), (vec![], true));
        // Its stops are confirmed in the term they were decided in.
        let w = world();
        let observed = BTreeMap::from([(wid(9), running_on_n0())]);
        let pass = e.pass(&w.state, &observed, &owns_n0, 0);
        assert_eq!(pass.steps[0], Step::ConfirmLeadership { term: 50 });
    }

    #[test]
    fn a_pass_records_exits_after_progress_then_confirms_before_it_launches() {
        let mut w = world();
        let a = place(&mut w, "a", "n0");
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        e.wake(Some(1), true);
        let pass = e.pass(&w.state, &BTreeMap::new(), &owns_n0, 100);
        assert_eq!(
            kinds(&pass.steps),
            vec![
                "confirm leadership in term 1",
                &format!("launch {}", wid(a))
            ]
        );
        assert!(pass.again, "its start is recorded by the next pass");
        let observed = BTreeMap::from([(wid(a), running_on_n0())]);
        let pass = e.pass(&w.state, &observed, &owns_n0, 100);
        assert_eq!(
            kinds(&pass.steps),
            vec![format!("record start {} on n0", wid(a))],
            "nothing touched: no confirmation"
        );
        assert!(!pass.again);
        // It exits.
        let observed = BTreeMap::from([(
            wid(a),
            Observed::Exited {
                exit_code: Some(1),
                reason: "exited with code 1".into(),
            },
        )]);
        let pass = e.pass(&w.state, &observed, &owns_n0, 200);
        assert_eq!(
            kinds(&pass.steps),
            vec!["flush progress", &format!("record exit {}", wid(a))]
        );
        // An exit not committed is still observed: the next pass records it
        // again.
        let pass = e.pass(&w.state, &observed, &owns_n0, 450);
        assert_eq!(
            kinds(&pass.steps),
            vec!["flush progress", &format!("record exit {}", wid(a))]
        );
    }

    #[test]
    fn an_unwanted_worker_is_stopped_after_a_confirmation() {
        let w = world();
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        e.wake(Some(1), true);
        let observed = BTreeMap::from([(wid(9), running_on_n0())]);
        let pass = e.pass(&w.state, &observed, &owns_n0, 0);
        assert_eq!(
            kinds(&pass.steps),
            vec!["confirm leadership in term 1", &format!("stop {}", wid(9))]
        );
        assert!(!pass.again);
    }

    #[test]
    fn a_worker_on_a_node_not_owned_is_said_once_and_never_launched() {
        let mut w = world();
        let b = place(&mut w, "b", "n1");
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        e.wake(Some(1), true);
        let first = e.pass(&w.state, &BTreeMap::new(), &owns_n0, 0);
        assert_eq!(
            kinds(&first.steps),
            vec![format!("not owned {} on n1", wid(b))]
        );
        assert!(!first.again);
        let second = e.pass(&w.state, &BTreeMap::new(), &owns_n0, 250);
        assert_eq!(second.steps, vec![], "said once while it stays so");
        let owns_all = |_: &str| true;
        let owned = e.pass(&w.state, &BTreeMap::new(), &owns_all, 500);
        assert_eq!(
            kinds(&owned.steps),
            vec![
                "confirm leadership in term 1",
                &format!("launch {}", wid(b))
            ]
        );
        let again = e.pass(&w.state, &BTreeMap::new(), &owns_n0, 750);
        assert_eq!(
            kinds(&again.steps),
            vec![format!("not owned {} on n1", wid(b))],
            "said again once it is unowned anew"
        );
    }

    #[test]
    fn passes_repeat_while_they_launch_at_most_three_times_a_wake() {
        let mut w = world();
        place(&mut w, "a", "n0");
        let mut e = ReconcileEngine::new(TIMINGS, 0);
        e.wake(Some(1), true);
        // The launch is not observed yet (the executor is slow): each pass
        // launches again, which the executor ignores for a known identity.
        let again: Vec<bool> = (0..3)
            .map(|_| e.pass(&w.state, &BTreeMap::new(), &owns_n0, 0).again)
            .collect();
        assert_eq!(again, vec![true, true, false]);
        e.wake(Some(1), true);
        assert!(e.pass(&w.state, &BTreeMap::new(), &owns_n0, 0).again);
    }

    #[test]
    fn progress_is_proposed_once_an_interval_on_the_virtual_clock() {
        let mut w = world();
        let a = place(&mut w, "a", "n0");
        let mut e = ReconcileEngine::new(TIMINGS, 1_000);
        assert_eq!(e.after_passes(1_000), vec![]);
        assert_eq!(e.after_passes(2_999), vec![]);
        assert_eq!(e.after_passes(3_000), vec![Step::FlushProgress]);
        assert_eq!(e.after_passes(4_999), vec![], "once an interval");
        // An exit flushes progress first, and that counts as the interval's.
        e.wake(Some(1), true);
        let observed = BTreeMap::from([(
            wid(a),
            Observed::Exited {
                exit_code: Some(0),
                reason: "exited with code 0".into(),
            },
        )]);
        let pass = e.pass(&w.state, &observed, &owns_n0, 4_500);
        assert_eq!(pass.steps[0], Step::FlushProgress);
        assert_eq!(e.after_passes(6_000), vec![]);
        assert_eq!(e.after_passes(6_500), vec![Step::FlushProgress]);
    }

    #[test]
    fn a_stopping_server_records_seen_exits_only_while_it_holds_and_leads() {
        let exited = BTreeMap::from([
            (
                wid(1),
                Observed::Exited {
                    exit_code: Some(3),
                    reason: "exited with code 3".into(),
                },
            ),
            (wid(2), running_on_n0()),
        ]);
        let mut never_led = ReconcileEngine::new(TIMINGS, 0);
        assert_eq!(never_led.stop(true, &exited), vec![], "touches nothing");
        let mut leader = ReconcileEngine::new(TIMINGS, 0);
        leader.wake(Some(1), true);
        assert_eq!(
            kinds(&leader.stop(true, &exited)),
            vec![
                "flush progress",
                &format!("record exit {}", wid(1)),
                "shutdown"
            ]
        );
        assert!(!leader.holding());
        let mut deposed = ReconcileEngine::new(TIMINGS, 0);
        deposed.wake(Some(1), true);
        assert_eq!(
            deposed.stop(false, &exited),
            vec![Step::Shutdown],
            "a deposed leader records nothing"
        );
    }
}
