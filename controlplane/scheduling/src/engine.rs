//! The scheduling loop's decisions as a pure engine, after openraft's
//! engine/runtime split: the leader's async driver (`keel::leader`) reads
//! the applied state and the clocks, asks the engine what to do, and only
//! performs it (waits, proposes, logs). Everything that decides — when a
//! round runs, which policy runs it, what it proposes — is here, with no
//! clock, I/O or async, so it is tested step by step on a virtual clock.
//!
//! The rules:
//! - a change of the state's supply/demand version (jobs arriving or
//!   ending, nodes changing, decisions applied) is planned after a short
//!   debounce, so a burst of submissions is placed in one round;
//! - otherwise the next round is at a deadline, `round_ms` after the last
//!   one: entries that do not change supply or demand (progress reports)
//!   do not postpone it, and a retry's backoff that ends sooner brings it
//!   forward;
//! - a replica that stops leading forgets what it saw, so it plans afresh
//!   when it leads again;
//! - the policy is the one the log names (`SetPolicy`), else the configured
//!   one; a logged policy this version does not know is not run (the
//!   current one is kept), nor is a space-sharing one where the executor
//!   cannot share GPUs (the configured one runs); the driver is told why.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_state::{ClusterState, Command};

use crate::policy::{by_name_with, decide, Policy, PolicyOptions};

/// The engine's timings, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulingTimings {
    /// A round runs at least this often.
    pub round_ms: u64,
    /// Wait this long after a change before planning.
    pub debounce_ms: u64,
}

/// What the driver waits for before it asks again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Something changed since the last round: wait `ms`, then plan.
    Debounce { ms: u64 },
    /// Nothing changed: wait for the applied state to change (then ask
    /// again) or for the monotonic clock to reach `deadline_ms` (then plan).
    ChangeOrDeadline { deadline_ms: u64 },
}

/// What the driver should log about the policy it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The round runs `to` from now on.
    SwitchedPolicy { from: String, to: String },
    /// The log names `wanted`, which cannot be built here: `current` runs on.
    KeptPolicy {
        wanted: String,
        current: String,
        reason: String,
    },
    /// The log names a space-sharing policy this executor cannot run: the
    /// configured one runs instead.
    NotRunningLoggedPolicy { policy: String, reason: String },
}

/// What one round decided.
#[derive(Debug)]
pub struct Round {
    /// The entry to propose, when the plan differs from the current
    /// allocations.
    pub command: Option<Command>,
    pub notices: Vec<Notice>,
}

/// The scheduling loop's memory: what it saw last, when the next round is,
/// which policy runs.
pub struct SchedulingEngine {
    timings: SchedulingTimings,
    default_policy: Arc<dyn Policy>,
    options: PolicyOptions,
    /// Why this executor cannot run space-sharing policies, if it cannot.
    cannot_share_gpus: Option<&'static str>,
    policy: Arc<dyn Policy>,
    /// The supply/demand version the last round planned on (`None`: plan
    /// at the next chance).
    seen_version: Option<u64>,
    /// When the next round is due, on the monotonic clock.
    next_round_ms: u64,
    /// What the runtime puts around each policy the engine makes (none:
    /// the policy as it is): a measurement outside the pure core, such as
    /// the time of each plan.
    wrap: Option<PolicyWrapper>,
}

/// Puts something around a policy (it must plan as the policy does).
pub type PolicyWrapper = Arc<dyn Fn(Box<dyn Policy>) -> Box<dyn Policy> + Send + Sync>;

impl std::fmt::Debug for SchedulingEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulingEngine")
            .field("timings", &self.timings)
            .field("policy", &self.policy.name())
            .field("seen_version", &self.seen_version)
            .field("next_round_ms", &self.next_round_ms)
            .finish_non_exhaustive()
    }
}

impl SchedulingEngine {
    /// An engine that runs `default_policy` until the log names another;
    /// `started_ms` is the monotonic clock now (the first round is due a
    /// round later, or at the first change).
    pub fn new(
        timings: SchedulingTimings,
        default_policy: Arc<dyn Policy>,
        options: PolicyOptions,
        cannot_share_gpus: Option<&'static str>,
        started_ms: u64,
    ) -> SchedulingEngine {
        SchedulingEngine {
            timings,
            policy: default_policy.clone(),
            default_policy,
            options,
            cannot_share_gpus,
            seen_version: None,
            next_round_ms: started_ms.saturating_add(timings.round_ms),
            wrap: None,
        }
    }

    /// The engine with `wrap` put around every policy it makes from now
    /// on (the runtime's default policy it was given is the runtime's to
    /// wrap).
    pub fn wrapping_policies(mut self, wrap: PolicyWrapper) -> SchedulingEngine {
        self.wrap = Some(wrap);
        self
    }

    /// What to wait for, given the state's supply/demand `version`, the
    /// monotonic clock `now_ms` and, if a job waits out a retry backoff,
    /// how long until the first such backoff ends.
    pub fn wait(&self, version: u64, now_ms: u64, backoff_ends_in_ms: Option<u64>) -> Wait {
        if self.seen_version != Some(version) {
            return Wait::Debounce {
                ms: self.timings.debounce_ms,
            };
        }
        let deadline_ms = match backoff_ends_in_ms {
            // Just past its end, so the job is eligible when planned.
            Some(ms) => self
                .next_round_ms
                .min(now_ms.saturating_add(ms).saturating_add(1)),
            None => self.next_round_ms,
        };
        Wait::ChangeOrDeadline { deadline_ms }
    }

    /// This replica does not lead (or not yet): forget what was seen, so
    /// the first round after it leads again plans at once.
    pub fn not_leading(&mut self) {
        self.seen_version = None;
    }

    /// Runs a round on `state` (the applied state, read once) at the
    /// leader's clock `wall_ms` and the monotonic clock `now_ms`.
    pub fn round(&mut self, state: &ClusterState, wall_ms: u64, now_ms: u64) -> Round {
        let mut notices = Vec::new();
        let logged = state.policy().unwrap_or(self.default_policy.name());
        let wanted = match self.cannot_share_gpus {
            Some(why) if crate::gavel::shares_gpus(logged) => {
                // Said once, when the loop turns back to the configured one
                // (not at every round).
                if self.policy.name() != self.default_policy.name() {
                    notices.push(Notice::NotRunningLoggedPolicy {
                        policy: logged.to_string(),
                        reason: why.to_string(),
                    });
                }
                self.default_policy.name()
            }
            _ => logged,
        };
        if self.policy.name() != wanted {
            // A fresh instance, also of the configured policy: what a
            // policy remembered belongs to the period it ran.
            match by_name_with(wanted, &self.options) {
                Ok(p) => {
                    notices.push(Notice::SwitchedPolicy {
                        from: self.policy.name().to_string(),
                        to: wanted.to_string(),
                    });
                    let p = match &self.wrap {
                        Some(wrap) => wrap(p),
                        None => p,
                    };
                    self.policy = Arc::from(p);
                }
                Err(e) => notices.push(Notice::KeptPolicy {
                    wanted: wanted.to_string(),
                    current: self.policy.name().to_string(),
                    reason: e.to_string(),
                }),
            }
        }
        let command = decide(self.policy.as_ref(), state, wall_ms);
        self.seen_version = Some(state.supply_demand_version());
        self.next_round_ms = now_ms.saturating_add(self.timings.round_ms);
        Round { command, notices }
    }

    /// The running policy's counters ([`Policy::counters`]) from its
    /// memory in `state`.
    pub fn counters(&self, state: &ClusterState) -> BTreeMap<String, u64> {
        self.policy
            .counters(state)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// The name of the policy the rounds run.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{by_name, QueueOptions};
    use keel_state::command::JobPlacement;
    use keel_state::fixtures::{job_spec, TestCluster};
    use keel_state::{GpuRef, ProgressSample};

    const TIMINGS: SchedulingTimings = SchedulingTimings {
        round_ms: 10_000,
        debounce_ms: 50,
    };

    fn engine(cannot_share: Option<&'static str>) -> SchedulingEngine {
        let fifo: Arc<dyn Policy> =
            Arc::from(by_name("fifo", QueueOptions::default()).expect("fifo"));
        SchedulingEngine::new(TIMINGS, fifo, PolicyOptions::default(), cannot_share, 0)
    }

    /// Applies a round's command, as the driver's proposal would.
    fn apply(c: &mut TestCluster, round: &Round) {
        if let Some(command) = &round.command {
            c.apply(command.clone());
        }
    }

    #[test]
    fn a_change_is_planned_after_the_debounce_and_a_stable_plan_proposes_nothing() {
        let mut e = engine(None);
        let mut c = TestCluster::v100_nodes(&[1]);
        let job = c.submit(job_spec("a", 1, 1));
        let v = c.state.supply_demand_version();
        assert_eq!(e.wait(v, 0, None), Wait::Debounce { ms: 50 });
        let round = e.round(&c.state, 1, 50);
        match &round.command {
            Some(Command::DecideAllocation {
                based_on,
                placements,
                policy,
                ..
            }) => {
                assert_eq!(*based_on, c.index);
                assert_eq!(policy, "fifo");
                assert_eq!(
                    placements,
                    &vec![JobPlacement::alone(
                        job,
                        vec![GpuRef {
                            node: "n0".into(),
                            index: 0
                        }]
                    )]
                );
            }
            other => panic!("expected a decision, got {other:?}"),
        }
        assert!(round.notices.is_empty());
        // Its own decision, applied, is a change: planned once more, and
        // then nothing is proposed.
        apply(&mut c, &round);
        let v = c.state.supply_demand_version();
        assert_eq!(e.wait(v, 60, None), Wait::Debounce { ms: 50 });
        assert!(e.round(&c.state, 2, 110).command.is_none());
        assert_eq!(
            e.wait(v, 120, None),
            Wait::ChangeOrDeadline {
                deadline_ms: 10_110
            }
        );
    }

    #[test]
    fn progress_reports_do_not_postpone_the_round_deadline() {
        let mut e = engine(None);
        let mut c = TestCluster::v100_nodes(&[1]);
        let job = c.submit(job_spec("a", 1, 1));
        let round = e.round(&c.state, 1, 0);
        apply(&mut c, &round);
        c.apply(Command::record_worker_started(job, 1, 0, "n0"));
        e.round(&c.state, 1, 100);
        let v = c.state.supply_demand_version();
        // Progress arrives every second; the deadline stays where it was.
        for t in 1..=9u64 {
            c.apply(Command::report_progress(
                job,
                vec![ProgressSample {
                    step: t * 10,
                    total_steps: 10_000,
                    loss: None,
                    samples_per_s: 1.0,
                    at_ms: t * 1000,
                }],
            ));
            assert_eq!(c.state.supply_demand_version(), v, "progress is no change");
            assert_eq!(
                e.wait(c.state.supply_demand_version(), 100 + t * 1000, None),
                Wait::ChangeOrDeadline {
                    deadline_ms: 10_100
                }
            );
        }
    }

    #[test]
    fn a_backoff_that_ends_before_the_round_brings_it_forward() {
        let mut e = engine(None);
        let c = TestCluster::v100_nodes(&[1]);
        e.round(&c.state, 1, 0);
        let v = c.state.supply_demand_version();
        assert_eq!(
            e.wait(v, 1_000, Some(2_000)),
            Wait::ChangeOrDeadline { deadline_ms: 3_001 }
        );
        // One that ends after the round changes nothing.
        assert_eq!(
            e.wait(v, 1_000, Some(60_000)),
            Wait::ChangeOrDeadline {
                deadline_ms: 10_000
            }
        );
    }

    #[test]
    fn a_replica_that_stops_leading_plans_afresh_when_it_leads_again() {
        let mut e = engine(None);
        let c = TestCluster::v100_nodes(&[1]);
        e.round(&c.state, 1, 0);
        let v = c.state.supply_demand_version();
        assert!(matches!(e.wait(v, 10, None), Wait::ChangeOrDeadline { .. }));
        e.not_leading();
        assert_eq!(e.wait(v, 20, None), Wait::Debounce { ms: 50 });
    }

    /// A policy that counts its plans (what a runtime's timing wrapper
    /// does with a clock), planning as the policy it wraps.
    #[derive(Debug)]
    struct Counted(Box<dyn Policy>, Arc<std::sync::atomic::AtomicU64>);

    impl Policy for Counted {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn plan<'a>(&self, input: &crate::policy::SchedulingInput<'a>) -> crate::policy::Plan<'a> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.plan(input)
        }
    }

    #[test]
    fn a_policy_the_log_switches_to_gets_the_runtimes_wrapper_and_plans_the_same() {
        let plans = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = plans.clone();
        let mut wrapped = engine(None).wrapping_policies(Arc::new(move |p| {
            Box::new(Counted(p, counter.clone())) as Box<dyn Policy>
        }));
        let mut bare = engine(None);
        let mut c = TestCluster::v100_nodes(&[2]);
        c.apply(Command::set_policy("srjf"));
        c.submit(job_spec("a", 1, 1));
        let (w, b) = (wrapped.round(&c.state, 1, 0), bare.round(&c.state, 1, 0));
        assert_eq!(wrapped.policy_name(), "srjf");
        assert!(w.command.is_some());
        assert_eq!(w.command, b.command, "the wrapper plans as the policy");
        assert_eq!(plans.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn the_logged_policy_runs_unless_unknown_or_unshareable_here() {
        let mut e = engine(None);
        let mut c = TestCluster::v100_nodes(&[1]);
        c.apply(Command::set_policy("srjf"));
        let round = e.round(&c.state, 1, 0);
        assert_eq!(
            round.notices,
            vec![Notice::SwitchedPolicy {
                from: "fifo".into(),
                to: "srjf".into()
            }]
        );
        assert_eq!(e.policy_name(), "srjf");
        assert!(e.round(&c.state, 1, 10).notices.is_empty(), "said once");

        // A name a later version knows: the current policy runs on.
        c.apply(Command::set_policy("a_policy_of_a_later_version"));
        let round = e.round(&c.state, 1, 20);
        assert!(
            matches!(&round.notices[..], [Notice::KeptPolicy { wanted, current, .. }]
                if wanted == "a_policy_of_a_later_version" && current == "srjf"),
            "{:?}",
            round.notices
        );
        assert_eq!(e.policy_name(), "srjf");

        // Space sharing where the executor cannot share GPUs: the
        // configured policy, said once.
        let mut e = engine(Some("the SSH executor cannot share GPUs"));
        c.apply(Command::set_policy("srjf"));
        e.round(&c.state, 1, 30);
        c.apply(Command::set_policy("gandiva"));
        let round = e.round(&c.state, 1, 40);
        assert_eq!(
            round.notices,
            vec![
                Notice::NotRunningLoggedPolicy {
                    policy: "gandiva".into(),
                    reason: "the SSH executor cannot share GPUs".into()
                },
                Notice::SwitchedPolicy {
                    from: "srjf".into(),
                    to: "fifo".into()
                }
            ]
        );
        assert!(e.round(&c.state, 1, 50).notices.is_empty());
        assert_eq!(e.policy_name(), "fifo");
    }
}
