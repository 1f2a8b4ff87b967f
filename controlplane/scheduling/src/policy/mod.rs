//! Scheduling policies: pure functions from a read-only view of the cluster
//! to a plan.
//!
//! A policy never changes state. The leader's scheduling loop runs it on the
//! state at applied index *i*, turns the plan into the placements that differ
//! from the current allocation ([`Plan::changes`]) and proposes them as one
//! `DecideAllocation { based_on: i }` entry, which `apply` validates against
//! the state it meets. One file per policy.

mod admit;
mod afs_l;
mod drf;
mod elastic_fifo;
mod elastic_srjf;
mod elastic_tiresias;
mod ffdl_optimizer;
mod fifo;
mod gavel_rounds;
mod optimus;
mod sizing;
mod srjf;
mod tiresias;

use std::borrow::Cow;
use std::collections::BTreeMap;

pub use afs_l::AfsL;
pub use drf::Drf;
pub use elastic_fifo::ElasticFifo;
pub use elastic_srjf::ElasticSrjf;
pub use elastic_tiresias::ElasticTiresias;
pub use ffdl_optimizer::FfdlOptimizer;
pub use fifo::Fifo;
pub use gavel_rounds::{GavelOptions, GavelRounds};
pub use optimus::Optimus;
pub use srjf::{remaining_s, Srjf};
pub use tiresias::{Tiresias, TiresiasOptions};

use keel_state::command::{Command, JobPlacement};
use keel_state::model::{GpuRef, Job, JobId};
use keel_state::policy_memory::PolicyMemory;
use keel_state::state::ClusterState;

use crate::admission::Admission;
use crate::placement::FreeGpus;

/// `jobs` most important first: higher `priority` first, the given order
/// (submission order, or a policy's ranking) within a priority. Every
/// queue and elastic policy orders by this before its own criterion; the
/// Gavel policies weigh priority in their objective instead.
pub(crate) fn by_priority<'a>(jobs: impl IntoIterator<Item = &'a Job>) -> Vec<&'a Job> {
    let mut jobs: Vec<&Job> = jobs.into_iter().collect();
    // Stable: ties keep their order. Equal priorities (the common case)
    // are one run, which the sort checks in linear time.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.spec.priority));
    jobs
}

/// What a policy sees: the state at one applied index, the time, and the
/// round's admission ([`crate::admission`]). A policy reads jobs through
/// it (`unfinished_jobs`, `allocated_jobs`, `job`, `free_gpus`), so it
/// sees only the admitted waiting jobs (their types narrowed to those
/// their queue may use), and neither the running jobs reclaimed this round
/// nor their GPUs as held.
#[derive(Debug, Clone, Copy)]
pub struct SchedulingInput<'a> {
    pub state: &'a ClusterState,
    /// The leader's clock (the virtual clock in the simulator).
    pub now_ms: u64,
    pub admission: &'a Admission,
}

impl<'a> SchedulingInput<'a> {
    /// Every job admitted (a cluster without queues, and tests).
    pub fn everyone(state: &'a ClusterState, now_ms: u64) -> SchedulingInput<'a> {
        SchedulingInput {
            state,
            now_ms,
            admission: Admission::everyone(),
        }
    }

    /// The unfinished jobs the round may run, by id: the running ones not
    /// reclaimed and the admitted waiting ones.
    pub fn unfinished_jobs(&self) -> Box<dyn Iterator<Item = &'a Job> + 'a> {
        if !self.admission.is_active() {
            return Box::new(self.state.unfinished_jobs());
        }
        let mut jobs: Vec<&'a Job> = self
            .allocated_jobs()
            .chain(self.admission.admitted(self.state))
            .collect();
        jobs.sort_unstable_by_key(|j| j.id);
        Box::new(jobs.into_iter())
    }

    /// The admitted waiting jobs, higher priority first, then by id (the
    /// order [`by_priority`] gives), read lazily where the state's index
    /// gives them in that order (no queues).
    pub fn waiting_jobs_by_priority(&self) -> Box<dyn Iterator<Item = &'a Job> + 'a> {
        if !self.admission.is_active() {
            return Box::new(self.state.waiting_jobs_by_priority());
        }
        // Admitted jobs come in id order.
        Box::new(by_priority(self.admission.admitted(self.state)).into_iter())
    }

    /// The jobs holding GPUs that the round does not reclaim, by id.
    pub fn allocated_jobs(&self) -> impl Iterator<Item = &'a Job> + 'a {
        let reclaimed = self.admission.reclaimed();
        self.state
            .allocated_jobs()
            .filter(move |j| !reclaimed.contains_key(&j.id))
    }

    /// Job `id` as the round sees it (an admitted job's types narrowed).
    pub fn job(&self, id: JobId) -> Option<&'a Job> {
        self.admission.narrowed(id).or_else(|| self.state.job(id))
    }

    /// The free GPUs, with those of the reclaimed jobs among them.
    pub fn free_gpus(&self) -> FreeGpus {
        let mut free = self.state.free_gpus().clone();
        for id in self.admission.reclaimed().keys() {
            if let Some(a) = self.state.job(*id).and_then(|j| j.allocation.as_ref()) {
                free.release(self.state, &a.gpus);
            }
        }
        free
    }
}

/// The GPUs every job should hold after this round. A job that is not in the
/// plan should hold none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan<'a> {
    /// Each job's GPUs: borrowed from the state where the job keeps what
    /// it holds (a round copies no allocation it does not change).
    pub placements: BTreeMap<JobId, Cow<'a, [GpuRef]>>,
    /// Space sharing: each job of a pair, mapped to the other (both
    /// directions). Both are in `placements` with the same GPUs.
    pub partners: BTreeMap<JobId, JobId>,
    /// The policy's memory after this plan, for a policy that keeps one
    /// and changed it ([`keel_state::policy_memory`]): logged with the
    /// decision. `None`: nothing to record.
    pub memory: Option<PolicyMemory>,
    /// Jobs not in `placements` keep what they hold (their GPUs and their
    /// partner): a plan that only adds, as FIFO's, need not list the
    /// thousands of jobs a large cluster runs, and a round costs what it
    /// changes. `false` (the default): a job not in `placements` holds
    /// nothing after the round. [`Plan::list_the_rest`] turns the one
    /// into the other for what reads a plan whole.
    pub keeps_the_rest: bool,
}

impl Plan<'_> {
    /// The placements that differ from the state's current allocations:
    /// jobs that gain, change or lose GPUs. Empty when the plan is what the
    /// cluster already runs (then nothing is proposed).
    pub fn changes(&self, state: &ClusterState) -> Vec<JobPlacement> {
        let mut out = Vec::new();
        if self.keeps_the_rest {
            // Only the jobs the plan names can change.
            for (id, planned) in &self.placements {
                if let Some(job) = state.job(*id) {
                    self.change_of(job, Some(planned), &mut out);
                }
            }
            return out;
        }
        // Only jobs that hold GPUs now or are planned to can change: a merge
        // of the two id-ordered sequences.
        let mut allocated = state.allocated_jobs().peekable();
        let mut planned = self.placements.iter().peekable();
        loop {
            let next_allocated = allocated.peek().map(|j| j.id);
            let next_planned = planned.peek().map(|(id, _)| **id);
            let (job, plan) = match (next_allocated, next_planned) {
                (None, None) => break,
                (Some(a), Some(p)) if a == p => (allocated.next(), planned.next().map(|(_, g)| g)),
                (Some(a), p) if p.is_none_or(|p| a < p) => (allocated.next(), None),
                _ => match planned.next() {
                    Some((id, gpus)) => (state.job(*id), Some(gpus)),
                    None => break,
                },
            };
            if let Some(job) = job {
                self.change_of(job, plan, &mut out);
            }
        }
        out
    }

    /// What changes for `job` if it is to hold `planned` (`None`: nothing),
    /// pushed to `out` unless it is what the job holds now.
    fn change_of(
        &self,
        job: &Job,
        planned: Option<&Cow<'_, [GpuRef]>>,
        out: &mut Vec<JobPlacement>,
    ) {
        let job_id = job.id;
        let current = job
            .allocation
            .as_ref()
            .map(|a| (a.gpus.as_slice(), a.shared_with));
        let partner = self.partners.get(&job_id).copied();
        match (current, planned) {
            // A plan that kept the job's GPUs borrows the state's own
            // list: the same slice needs no comparing.
            (Some((gpus, shared)), Some(planned))
                if std::ptr::eq(gpus, &planned[..]) && shared == partner => {}
            (Some(now), Some(planned)) if now == (&planned[..], partner) => {}
            (None, None) => {}
            (Some(_), None) => out.push(JobPlacement::alone(job_id, Vec::new())),
            (_, Some(planned)) => {
                if planned.is_empty() && current.is_none() {
                    return;
                }
                out.push(JobPlacement {
                    job_id,
                    gpus: planned.to_vec(),
                    share_with: partner.filter(|_| !planned.is_empty()),
                })
            }
        }
    }
}

impl<'a> Plan<'a> {
    /// Names every job the plan keeps: with [`Plan::keeps_the_rest`], the
    /// jobs holding GPUs that the plan does not name are listed with what
    /// they hold (their partner too), and the flag is cleared. The plan
    /// means the same after as before.
    pub fn list_the_rest(&mut self, state: &'a ClusterState) {
        if !self.keeps_the_rest {
            return;
        }
        self.keeps_the_rest = false;
        for job in state.allocated_jobs() {
            let Some(a) = &job.allocation else { continue };
            if let std::collections::btree_map::Entry::Vacant(unnamed) =
                self.placements.entry(job.id)
            {
                unnamed.insert(Cow::Borrowed(&a.gpus));
                if let Some(partner) = a.shared_with {
                    self.partners.insert(job.id, partner);
                }
            }
        }
    }
}

/// A scheduling policy. Implementations are pure: no I/O, no clock but
/// `input.now_ms`, no randomness but a seeded one, ordered maps only.
pub trait Policy: std::fmt::Debug + Send + Sync {
    /// The name used in configuration and recorded in every decision.
    fn name(&self) -> &'static str;
    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a>;
    /// What the policy counts for operators (empty for most), from its
    /// memory in `state`: read after each plan and shown by `keel cluster
    /// status`.
    fn counters(&self, _state: &ClusterState) -> BTreeMap<&'static str, u64> {
        BTreeMap::new()
    }
    /// The order in which admission ([`crate::admission`]) takes each
    /// queue's waiting jobs, most important first, for a policy that ranks
    /// jobs (`None`: priority, then submission order). Called only when
    /// queues are defined.
    fn admission_order(&self, _input: &SchedulingInput<'_>) -> Option<Vec<JobId>> {
        None
    }
}

/// One scheduling round: runs `policy` on `state` and returns the entry to
/// propose, or `None` when the plan is what the cluster already runs and
/// the policy's memory did not change. The decision records the applied
/// index it was based on and the next round number, so `apply` can
/// validate it against the state it meets, and the policy's new memory.
pub fn decide(policy: &dyn Policy, state: &ClusterState, now_ms: u64) -> Option<Command> {
    let order = if state.queues().is_unset() {
        None
    } else {
        policy.admission_order(&SchedulingInput::everyone(state, now_ms))
    };
    let admission = Admission::in_order(state, now_ms, order.as_deref());
    let mut plan = policy.plan(&SchedulingInput {
        state,
        now_ms,
        admission: &admission,
    });
    keep_unpreemptible(state, &mut plan);
    let placements = admission.fit(state, &mut plan);
    let memory = plan.memory.filter(|m| state.policy_memory() != Some(m));
    (!placements.is_empty() || memory.is_some()).then(|| Command::DecideAllocation {
        based_on: state.last_index(),
        policy: policy.name().to_string(),
        round: state.last_round() + 1,
        placements,
        memory,
    })
}

/// Running jobs that may not be preempted (`preemptible: false`, issue
/// 23, item 4) keep their GPUs whatever the policy planned: their
/// placements are put back as they are (a pair's partner with them), and
/// a placement planned on their GPUs is dropped (a running job whose
/// place it was keeps its own GPUs when no one else is planned there).
/// `apply` refuses the same changes, so a plan never meets the refusal.
pub fn keep_unpreemptible<'a>(state: &'a ClusterState, plan: &mut Plan<'a>) {
    let fixed: Vec<&Job> = state.allocated_unpreemptible_jobs().collect();
    if fixed.is_empty() {
        return;
    }
    plan.list_the_rest(state);
    let mut held: BTreeMap<&GpuRef, JobId> = BTreeMap::new();
    let mut kept: Vec<JobId> = Vec::new();
    for job in &fixed {
        let Some(a) = &job.allocation else { continue };
        for g in &a.gpus {
            held.insert(g, job.id);
        }
        kept.push(job.id);
        plan.placements.insert(job.id, Cow::Borrowed(&a.gpus));
        plan.partners.remove(&job.id);
        if let Some(partner) = a.shared_with {
            kept.push(partner);
            plan.placements.insert(partner, Cow::Borrowed(&a.gpus));
            plan.partners.insert(job.id, partner);
            plan.partners.insert(partner, job.id);
        }
    }
    let clashing: Vec<JobId> = plan
        .placements
        .iter()
        .filter(|(id, gpus)| !kept.contains(id) && gpus.iter().any(|g| held.contains_key(g)))
        .map(|(id, _)| *id)
        .collect();
    for id in clashing {
        plan.placements.remove(&id);
        if let Some(partner) = plan.partners.remove(&id) {
            plan.partners.remove(&partner);
        }
        // A running job the plan moved onto them stays where it was,
        // if nothing else is planned there.
        if let Some(a) = state.job(id).and_then(|j| j.allocation.as_ref()) {
            let free = a
                .gpus
                .iter()
                .all(|g| !held.contains_key(g) && !plan.placements.values().any(|p| p.contains(g)));
            if free && a.shared_with.is_none() {
                plan.placements.insert(id, Cow::Borrowed(&a.gpus));
            }
        }
    }
}

/// What an operator reads of a logged policy memory (`keel replay`):
/// `None` when no policy of this build wrote it in a format it reads.
pub fn describe_memory(memory: &PolicyMemory) -> Option<serde_json::Value> {
    let known = crate::gavel::GAVEL_POLICY_NAMES.contains(&memory.policy.as_str());
    if !known || memory.format != gavel_rounds::MEMORY_FORMAT {
        return None;
    }
    gavel_rounds::Rounds::decode(&memory.bytes)
        .ok()
        .map(|r| r.describe())
}

/// Options shared by the queue-based policies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueOptions {
    /// Let jobs behind a blocked head of the queue start when they fit.
    pub backfill: bool,
}

/// Every policy's knobs, as the server and `keel sim` take them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyOptions {
    pub queue: QueueOptions,
    /// For `tiresias` and `elastic_tiresias`.
    pub tiresias: TiresiasOptions,
    /// For the heterogeneity-aware policies ([`crate::gavel`]).
    pub gavel: GavelOptions,
}

/// The policy named `name`, or an error listing the known ones.
pub fn by_name(name: &str, options: QueueOptions) -> Result<Box<dyn Policy>, UnknownPolicy> {
    by_name_with(
        name,
        &PolicyOptions {
            queue: options,
            ..Default::default()
        },
    )
}

/// The policy named `name` with `options`, or an error listing the known
/// ones.
pub fn by_name_with(name: &str, options: &PolicyOptions) -> Result<Box<dyn Policy>, UnknownPolicy> {
    match name {
        "fifo" => Ok(Box::new(Fifo::new(options.queue))),
        "srjf" => Ok(Box::new(Srjf)),
        "tiresias" => Ok(Box::new(Tiresias::new(options.tiresias.clone()))),
        "elastic_fifo" => Ok(Box::new(ElasticFifo)),
        "elastic_srjf" => Ok(Box::new(ElasticSrjf)),
        "elastic_tiresias" => Ok(Box::new(ElasticTiresias::new(options.tiresias.clone()))),
        "ffdl_optimizer" => Ok(Box::new(FfdlOptimizer)),
        "afs_l" => Ok(Box::new(AfsL)),
        "drf" => Ok(Box::new(Drf)),
        "optimus" => Ok(Box::new(Optimus)),
        _ => match crate::gavel::GAVEL_POLICY_NAMES
            .iter()
            .find(|n| **n == name)
        {
            Some(name) => Ok(Box::new(GavelRounds::new(name, options.gavel.clone()))),
            None => Err(UnknownPolicy {
                name: name.to_string(),
            }),
        },
    }
}

/// Every name [`by_name_with`] knows: Keel's policies, then the
/// heterogeneity-aware ones (the space-sharing ones among them).
pub fn all_policy_names() -> Vec<&'static str> {
    POLICY_NAMES
        .iter()
        .chain(crate::gavel::GAVEL_POLICY_NAMES)
        .copied()
        .collect()
}

/// Why the live scheduler cannot run a policy named `name`.
pub fn unknown_policy_reason(name: &str) -> String {
    format!(
        "unknown policy {name:?}; known policies: {}",
        all_policy_names().join(", ")
    )
}

/// Keel's own policy names (see [`all_policy_names`] for every name
/// [`by_name`] knows).
pub const POLICY_NAMES: &[&str] = &[
    "fifo",
    "srjf",
    "tiresias",
    "elastic_fifo",
    "elastic_srjf",
    "elastic_tiresias",
    "ffdl_optimizer",
    "afs_l",
    "drf",
    "optimus",
];

#[cfg(test)]
mod tests {
    use super::*;
    use keel_state::command::LogEntry;
    use keel_state::fixtures::job_spec;
    use keel_state::model::Gpu;

    #[test]
    fn space_sharing_policies_run_live_and_unknown_names_are_refused() {
        for name in crate::gavel::SPACE_SHARING_POLICY_NAMES {
            let policy = by_name(name, QueueOptions::default()).expect("runs live");
            assert_eq!(policy.name(), *name);
            assert!(all_policy_names().contains(name));
        }
        // The registry refuses an unknown name, listing the known ones (the
        // API's check)...
        let refused = by_name("gandiva_plus", QueueOptions::default()).err();
        assert!(
            refused
                .as_ref()
                .is_some_and(|e| e.to_string().contains("max_min_fairness_packed")),
            "{refused:?}"
        );
        // ...while `apply` checks only the form of the name, so the log
        // replays the same whatever policies a version knows.
        let mut state = ClusterState::new();
        let set = |name: &str| LogEntry::new(0, Command::set_policy(name.to_string()));
        state.apply(1, &set("gandiva")).expect("a known policy");
        state
            .apply(2, &set("a_policy_of_a_later_version"))
            .expect("a well-formed name");
        let refused = state.apply(3, &set("Not A Name!"));
        assert!(
            matches!(&refused, Err(keel_state::state::ApplyError::Invalid { field, .. }) if field == "policy"),
            "{refused:?}"
        );
    }

    /// Issue 19, item 10: `priority` is "higher first" under every queue
    /// and elastic policy, not only the Gavel ones.
    #[test]
    fn every_queue_and_elastic_policy_starts_the_higher_priority_job_first() {
        use keel_state::fixtures::TestCluster;
        for name in POLICY_NAMES {
            let policy = by_name(name, QueueOptions::default()).expect("a policy");
            // Two GPUs, two jobs that each need both: the later one matters
            // more.
            let mut c = TestCluster::v100_nodes(&[2]);
            let low = c.submit(job_spec("low", 2, 1));
            let mut spec = job_spec("high", 2, 1);
            spec.priority = 5;
            let high = c.submit(spec);
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            assert_eq!(
                plan.placements.keys().copied().collect::<Vec<_>>(),
                vec![high],
                "{name} started {:?}",
                plan.placements
            );
            // Equal priorities: submission order (or the policy's own
            // criterion) decides, so the first job is not passed over.
            let mut c = TestCluster::v100_nodes(&[2]);
            let first = c.submit(job_spec("first", 2, 1));
            c.submit(job_spec("second", 2, 1));
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            assert_eq!(
                plan.placements.keys().copied().collect::<Vec<_>>(),
                vec![first],
                "{name}"
            );
            assert_ne!(low, high);
        }
    }

    /// The preemptive queue policies give a running job's GPUs to a
    /// higher-priority arrival.
    #[test]
    fn a_higher_priority_arrival_preempts_under_srjf_and_tiresias() {
        use keel_state::fixtures::TestCluster;
        for name in ["srjf", "tiresias", "elastic_srjf", "elastic_tiresias"] {
            let policy = by_name(name, QueueOptions::default()).expect("a policy");
            let mut c = TestCluster::v100_nodes(&[2]);
            let low = c.submit(job_spec("low", 2, 1));
            c.place(
                low,
                (0..2)
                    .map(|index| GpuRef {
                        node: "n0".into(),
                        index,
                    })
                    .collect(),
            );
            let mut spec = job_spec("high", 2, 1);
            spec.priority = 1;
            let high = c.submit(spec);
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            assert_eq!(
                plan.placements.keys().copied().collect::<Vec<_>>(),
                vec![high],
                "{name}"
            );
        }
    }

    /// Admission counts GPUs, not where they are: a running job it leaves
    /// out loses its GPUs only to an admitted job placed on one of them
    /// (issue 27's live day preempted 24 jobs of 27 for nothing, and
    /// started them again a round later), and a job that fits idle GPUs
    /// starts though a more important one cannot be placed (backfill).
    #[test]
    fn a_job_loses_its_gpus_only_to_a_more_important_job_placed_on_them() {
        use keel_state::fixtures::TestCluster;
        let gpu = |node: &str, index| GpuRef {
            node: node.into(),
            index,
        };
        let placed = |c: &mut TestCluster, priority, at: GpuRef| {
            let mut spec = job_spec("running", 1, 1);
            spec.priority = priority;
            let id = c.submit(spec);
            c.place(id, vec![at]);
            id
        };
        let waiting = |c: &mut TestCluster, priority, gpus| {
            let mut spec = job_spec("waiting", gpus, 1);
            spec.priority = priority;
            c.submit(spec)
        };
        let kept = |plan: &Plan<'_>, job| plan.placements.get(&job).map(|g| g.to_vec());
        for name in ["srjf", "tiresias"] {
            let policy = by_name(name, QueueOptions::default()).expect("a policy");
            // Two nodes of two GPUs; on one GPU each, two jobs of priority
            // 3 and one of priority 0. A job of priority 2 needs two GPUs
            // on one node: with the low job's GPU and the free one, no
            // node has two, so the low job keeps its GPU, and a waiting
            // job of one GPU starts on the free one.
            let mut c = TestCluster::v100_nodes(&[2, 2]);
            placed(&mut c, 3, gpu("n0", 0));
            placed(&mut c, 3, gpu("n1", 1));
            let low = placed(&mut c, 0, gpu("n1", 0));
            let high = waiting(&mut c, 2, 2);
            let small = waiting(&mut c, 0, 1);
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            let what = format!("{name}: {:?}", plan.placements);
            assert_eq!(kept(&plan, low), Some(vec![gpu("n1", 0)]), "{what}");
            assert_eq!(kept(&plan, high), None, "{what}");
            assert_eq!(kept(&plan, small), Some(vec![gpu("n0", 1)]), "{what}");
            // Where a node could hold it on the low job's GPU, the low job
            // gives that GPU up.
            let mut c = TestCluster::v100_nodes(&[2, 2]);
            placed(&mut c, 3, gpu("n0", 0));
            placed(&mut c, 3, gpu("n0", 1));
            let low = placed(&mut c, 0, gpu("n1", 0));
            let high = waiting(&mut c, 2, 2);
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            let what = format!("{name}: {:?}", plan.placements);
            assert_eq!(kept(&plan, low), None, "{what}");
            assert_eq!(kept(&plan, high), Some(vec![gpu("n1", 0), gpu("n1", 1)]));
            // A running job admission counted keeps its GPUs, though one
            // of them and the free one would make a node for the more
            // important job: preemption is for the jobs admission leaves
            // out, which is what keeps an overloaded cluster from
            // reshuffling at every round.
            let mut c = TestCluster::v100_nodes(&[2, 2]);
            let mid = placed(&mut c, 1, gpu("n0", 0));
            let other = placed(&mut c, 1, gpu("n1", 1));
            let low = placed(&mut c, 0, gpu("n1", 0));
            let high = waiting(&mut c, 2, 2);
            let plan = policy.plan(&SchedulingInput::everyone(&c.state, 1));
            let what = format!("{name}: {:?}", plan.placements);
            assert_eq!(kept(&plan, high), None, "{what}");
            assert_eq!(kept(&plan, mid), Some(vec![gpu("n0", 0)]), "{what}");
            assert_eq!(kept(&plan, other), Some(vec![gpu("n1", 1)]), "{what}");
            assert_eq!(kept(&plan, low), Some(vec![gpu("n1", 0)]), "{what}");
        }
    }

    #[test]
    fn a_round_proposes_only_changes_based_on_the_index_it_read() {
        let mut state = ClusterState::new();
        let entries = [
            Command::register_node(
                "n0",
                "127.0.0.1",
                vec![Gpu {
                    index: 0,
                    gpu_type: "v100".into(),
                }],
            ),
            Command::submit_job(job_spec("a", 1, 1)),
            Command::submit_job(job_spec("b", 1, 1)),
        ];
        for (i, command) in entries.into_iter().enumerate() {
            state
                .apply(i as u64 + 1, &LogEntry::new(5, command))
                .expect("applies");
        }
        let fifo = Fifo::default();
        let decision = decide(&fifo, &state, 5).expect("job 1 starts");
        assert_eq!(
            decision,
            Command::decide_allocation(
                3,
                "fifo",
                1,
                vec![JobPlacement::alone(
                    1,
                    vec![GpuRef {
                        node: "n0".into(),
                        index: 0
                    }]
                )]
            )
        );
        state
            .apply(4, &LogEntry::new(6, decision))
            .expect("applies");
        assert_eq!(decide(&fifo, &state, 6), None, "nothing changed");
        assert_eq!(state.last_round(), 1);
    }

    #[test]
    fn a_plan_that_keeps_the_rest_changes_only_the_jobs_it_names() {
        use keel_state::fixtures::TestCluster;
        let mut c = TestCluster::v100_nodes(&[2, 2]);
        let a = c.submit(job_spec("a", 2, 1));
        let fifo = Fifo::default();
        let started = decide(&fifo, &c.state, 1).expect("a starts");
        c.apply(started);
        let b = c.submit(job_spec("b", 2, 1));
        let plan = fifo.plan(&SchedulingInput::everyone(&c.state, 1));
        assert!(plan.keeps_the_rest);
        assert_eq!(plan.placements.keys().copied().collect::<Vec<_>>(), vec![b]);
        let changes = plan.changes(&c.state);
        assert_eq!(
            changes.iter().map(|p| p.job_id).collect::<Vec<_>>(),
            vec![b]
        );
        // Listed whole, it names the running job with the state's own GPU
        // list, and means the same.
        let mut whole = plan.clone();
        whole.list_the_rest(&c.state);
        assert!(!whole.keeps_the_rest);
        assert_eq!(
            whole.placements.keys().copied().collect::<Vec<_>>(),
            vec![a, b]
        );
        let held = c
            .state
            .job(a)
            .and_then(|j| j.allocation.as_ref())
            .expect("a runs");
        assert!(std::ptr::eq(&whole.placements[&a][..], &held.gpus[..]));
        assert_eq!(whole.changes(&c.state), changes);
        // A job it names with no GPUs loses them; one it leaves out does
        // not, unless the plan is read whole without the flag.
        let mut preempting = plan.clone();
        preempting.placements.insert(a, Cow::Owned(Vec::new()));
        let lost: Vec<JobId> = preempting
            .changes(&c.state)
            .iter()
            .filter(|p| p.gpus.is_empty())
            .map(|p| p.job_id)
            .collect();
        assert_eq!(lost, vec![a]);
        let mut complete = plan;
        complete.keeps_the_rest = false;
        assert_eq!(complete.changes(&c.state).len(), 2, "a goes, b comes");
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", unknown_policy_reason(.name))]
pub struct UnknownPolicy {
    pub name: String,
}
