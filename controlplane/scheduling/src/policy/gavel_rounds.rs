//! The heterogeneity-aware policies ([`crate::gavel`]) in the live
//! scheduler: a fractional allocation turned into placements round by
//! round by the shared [`Mechanism`].
//!
//! Every `round_s` the policy credits the round that ended (each placed job
//! ran on its type since the round began), brings the mechanism's job set
//! up to date with the state (unfinished jobs come in; ended ones leave),
//! re-solves the allocation when the mechanism says so, and plans the next
//! round. Between round boundaries it repeats the current round's plan, so
//! a scheduling pass caused by an arrival or a finish changes nothing: a
//! new job waits for the next round, and the allocation is not solved
//! again before `min_resolve_interval_s`, as in Gavel. A job whose
//! placement is the same next round keeps running (no entry changes it);
//! one that moves or sits out a round is checkpointed and relaunched by the
//! usual allocation change.
//!
//! Inputs per job: its scale factor (`gpus × workers.min`; elastic jobs run
//! at their minimum), its speed on each type from the performance model
//! ([`JobPerf`]: measured where the job has run, else the throughput
//! table), 0 on types its spec does not allow, its remaining steps, its
//! time since submission and its priority as the weight.
//!
//! Space sharing (`max_min_fairness_packed`, `gandiva`): a job arriving
//! is paired with every known job of its size; the pair's speeds (each
//! job's steps per second beside the other, by GPU type) come from what
//! jobs of the two models measured while sharing
//! ([`crate::perf::PerfHistory::shared_steps_per_s`]), else from the
//! table's illustrative interference model
//! ([`crate::throughput::ModelProfile::shared_fraction`]) applied to each
//! job's alone speed. A pair the mechanism places becomes two placements
//! on the same GPUs naming each other (`JobPlacement::share_with`).
//!
//! The one policy with memory: the mechanism's times received, deficits,
//! allocation in force and leases, the policy's own memory between solves
//! (Gandiva's pairs and random stream, finish-time fairness's credited
//! time), the current round's plan and when it began ([`Rounds`]). At each
//! round boundary the policy returns its new memory with the plan
//! ([`Plan::memory`]), encoded ([`MEMORY_FORMAT`]), and the leader logs it
//! inside that round's `DecideAllocation`; between boundaries it plans from
//! the memory the state holds. So the memory is replicated state: a new
//! leader plans the next round from exactly what the last one left, and a
//! replay at any index rebuilds it. A memory this build cannot read, of
//! another cluster layout or other round constants, is not used: the
//! mechanism starts afresh (every job credited as if newly arrived).
//! Decoding is memoised, keyed by the logged bytes; it is a cache of a
//! pure function of the state.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::gavel::mechanism::{Combo, Mechanism, MechanismConfig, TypeServers, WorkerId};
use crate::gavel::{self, AllocationProblem, PairThroughputs, PolicyRun, ProblemJobId};
use crate::perf::JobPerf;
use crate::throughput::{self, GENERIC_MODEL};
use keel_state::model::{GpuRef, Job, JobId, NodeState};
use keel_state::policy_memory::{PolicyMemory, POLICY_MEMORY_MAX_BYTES};
use keel_state::state::ClusterState;

use super::{Plan, Policy, SchedulingInput};

/// The round constants of the live heterogeneity-aware policies.
#[derive(Debug, Clone, PartialEq)]
pub struct GavelOptions {
    pub round_s: f64,
    pub min_resolve_interval_s: f64,
    /// Price per hour by GPU type, for the cost-normalised policy.
    pub instance_costs: BTreeMap<String, f64>,
}

impl Default for GavelOptions {
    fn default() -> Self {
        let gavel = MechanismConfig::gavel();
        GavelOptions {
            round_s: gavel.round_s,
            min_resolve_interval_s: gavel.min_resolve_interval_s,
            instance_costs: BTreeMap::new(),
        }
    }
}

impl GavelOptions {
    /// Checks the values, naming the flag and the limit.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.round_s.is_finite() && (1.0..=86_400.0).contains(&self.round_s)) {
            return Err(format!(
                "gavel_round_s {}: must be between 1 and 86400 seconds",
                self.round_s
            ));
        }
        if !(self.min_resolve_interval_s.is_finite()
            && (0.0..=7.0 * 86_400.0).contains(&self.min_resolve_interval_s))
        {
            return Err(format!(
                "resolve_interval_s {}: must be between 0 and 604800 seconds",
                self.min_resolve_interval_s
            ));
        }
        for (t, c) in &self.instance_costs {
            if !(c.is_finite() && *c > 0.0 && *c <= 1e6) {
                return Err(format!(
                    "gpu_prices {t}={c}: a price must be a positive number of dollars per hour up to 1e6"
                ));
            }
        }
        Ok(())
    }
}

/// The format of the memory this policy logs: postcard of [`Rounds`].
/// Bump it when `Rounds` (or anything it holds) changes shape; a memory
/// of another format is not read (the mechanism starts afresh).
pub const MEMORY_FORMAT: u32 = 1;

/// The cluster as the mechanism numbers it, and back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Layout {
    types: Vec<TypeServers>,
    gpus: Vec<GpuRef>,
}

impl Layout {
    /// Live nodes' GPUs, types in name order, one server per node.
    fn of(state: &ClusterState) -> Layout {
        let mut by_type: BTreeMap<&str, Vec<Vec<WorkerId>>> = BTreeMap::new();
        let mut gpus = Vec::new();
        for node in state.nodes().values() {
            if node.state != NodeState::Alive {
                continue;
            }
            let mut here: BTreeMap<&str, Vec<WorkerId>> = BTreeMap::new();
            for (index, gpu_type) in &node.gpus {
                let id = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
                gpus.push(GpuRef {
                    node: node.name.clone(),
                    index: *index,
                });
                here.entry(gpu_type.as_str()).or_default().push(id);
            }
            for (t, ids) in here {
                by_type.entry(t).or_default().push(ids);
            }
        }
        Layout {
            types: by_type
                .into_iter()
                .map(|(t, servers)| TypeServers {
                    gpu_type: t.to_string(),
                    servers,
                })
                .collect(),
            gpus,
        }
    }
}

/// Everything the policy keeps between rounds: its memory, as logged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rounds {
    layout: Layout,
    mechanism: Mechanism,
    /// What the policy keeps between solves (Gandiva's pairs,
    /// finish-time fairness's credited isolated time).
    run: PolicyRun,
    /// When the current round began, on the leader's clock; `None` before
    /// the first.
    round_started_ms: Option<u64>,
    /// The current round's plan.
    plan: BTreeMap<JobId, Vec<GpuRef>>,
    /// The current round's pairs, both ways.
    partners: BTreeMap<JobId, JobId>,
    /// The current round's type index per placed entry (job or pair).
    placed_on: BTreeMap<Combo, usize>,
}

impl Rounds {
    /// The memory in `bytes` ([`MEMORY_FORMAT`]).
    pub fn decode(bytes: &[u8]) -> Result<Rounds, postcard::Error> {
        postcard::from_bytes(bytes)
    }

    /// What operators read of it: when the round began, the mechanism's
    /// counters, and per job the time received and the allocation's share
    /// by GPU type.
    pub fn describe(&self) -> serde_json::Value {
        let stats = self.mechanism.stats();
        serde_json::json!({
            "round_started_ms": self.round_started_ms,
            "gpu_types": self.layout.types.iter().map(|t| &t.gpu_type).collect::<Vec<_>>(),
            "solves": stats.solves,
            "rounds": stats.rounds,
            "lease_extensions": stats.lease_extensions,
            "jobs": self.mechanism.job_ids().map(|id| (id.to_string(), serde_json::json!({
                "time_received_s": self.mechanism.time_received_s(id),
                "allocation": self.mechanism.allocation().get(&id),
                "placed": self.plan.get(&id),
            }))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// The last memory decoded, by its bytes.
#[derive(Debug)]
struct Decoded {
    bytes: Vec<u8>,
    rounds: Rounds,
}

/// A heterogeneity-aware policy run in rounds.
#[derive(Debug)]
pub struct GavelRounds {
    name: &'static str,
    options: GavelOptions,
    decoded: Mutex<Option<Decoded>>,
}

impl GavelRounds {
    /// The policy `name` (one of [`gavel::GAVEL_POLICY_NAMES`]).
    pub fn new(name: &'static str, options: GavelOptions) -> GavelRounds {
        GavelRounds {
            name,
            options,
            decoded: Mutex::new(None),
        }
    }

    fn mechanism_config(&self) -> MechanismConfig {
        MechanismConfig {
            round_s: self.options.round_s,
            min_resolve_interval_s: self.options.min_resolve_interval_s,
            initial_credit_s: self.options.round_s / 2.0,
            skip_zero_priority: self.name.starts_with("fifo"),
            // Live rounds keep the cluster's type order: the shuffle only
            // reproduces Gavel's simulator.
            shuffle_seed: None,
        }
    }

    /// The memoised decoding of the memory `state` holds for this policy
    /// (`None` in the guard: no memory, or one this build cannot read).
    fn logged<'a>(&'a self, state: &ClusterState) -> MutexGuard<'a, Option<Decoded>> {
        let mut guard = self.decoded.lock().unwrap_or_else(|poisoned| {
            // A panic elsewhere while planning: decode afresh.
            let mut g = poisoned.into_inner();
            *g = None;
            g
        });
        let logged = state
            .policy_memory()
            .filter(|m| m.policy == self.name && m.format == MEMORY_FORMAT);
        let hit = matches!((guard.as_ref(), logged), (Some(d), Some(m)) if d.bytes == m.bytes);
        if !hit {
            *guard = logged.and_then(|m| {
                Some(Decoded {
                    bytes: m.bytes.clone(),
                    rounds: Rounds::decode(&m.bytes).ok()?,
                })
            });
        }
        guard
    }

    /// Whether `rounds` was kept for this cluster layout and these round
    /// constants (else the mechanism starts afresh).
    fn usable(&self, rounds: &Rounds, layout: &Layout) -> bool {
        rounds.layout == *layout
            && *rounds.mechanism.config() == self.mechanism_config()
            && rounds.run.name() == self.name
    }

    fn fresh(&self, layout: Layout) -> Option<Rounds> {
        Some(Rounds {
            mechanism: Mechanism::new(self.mechanism_config(), layout.types.clone()),
            run: PolicyRun::new(self.name, 0).ok()?,
            layout,
            round_started_ms: None,
            plan: BTreeMap::new(),
            partners: BTreeMap::new(),
            placed_on: BTreeMap::new(),
        })
    }

    /// Whether the round that began at `rounds.round_started_ms` has ended
    /// at `now_ms` (compared in whole milliseconds, the clock's unit).
    fn due(&self, rounds: &Rounds, now_ms: u64) -> bool {
        rounds.round_started_ms.is_none_or(|start| {
            now_ms.saturating_sub(start) as f64 >= (self.options.round_s * 1000.0).round()
        })
    }
}

/// The allocation problem of the jobs the mechanism knows.
fn problem(
    state: &ClusterState,
    options: &GavelOptions,
    layout: &Layout,
    jobs: &BTreeMap<JobId, BTreeMap<String, f64>>,
    now_ms: u64,
) -> AllocationProblem {
    let cluster_spec = layout
        .types
        .iter()
        .map(|t| {
            let n = t.servers.iter().map(|s| s.len() as u32).sum();
            (t.gpu_type.clone(), n)
        })
        .collect();
    let mut p = AllocationProblem::new(cluster_spec);
    p.instance_costs = options.instance_costs.clone();
    for (id, speeds) in jobs {
        let Some(job) = state.job(*id) else {
            continue;
        };
        let perf = JobPerf::of(job);
        p.throughputs.insert(*id, speeds.clone());
        p.scale_factors.insert(*id, scale_factor(job));
        p.priority_weights
            .insert(*id, f64::from(job.spec.priority.max(1)));
        p.times_since_start.insert(
            *id,
            now_ms.saturating_sub(job.submitted_at_ms) as f64 / 1000.0,
        );
        if let Some(steps) = perf.remaining_steps() {
            p.num_steps_remaining.insert(*id, steps);
        }
    }
    p
}

/// A job's type for space sharing: its model and size (only jobs of one
/// size are paired, and a pair's speeds depend on both).
fn job_type(job: &Job) -> String {
    format!("{}x{}", model_of(job), scale_factor(job))
}

fn model_of(job: &Job) -> &str {
    job.spec.model.as_deref().unwrap_or(GENERIC_MODEL)
}

/// Steps per second of `job` beside a job of `partner` on each type where
/// both may run: the mean of what jobs of `job`'s type measured beside
/// that model, else `job`'s alone speed times the table's shared fraction.
fn shared_speeds(
    job: &Job,
    alone: &BTreeMap<String, f64>,
    partner: &Job,
    partner_alone: &BTreeMap<String, f64>,
    measured: &BTreeMap<(String, String, String), f64>,
) -> BTreeMap<String, f64> {
    let fraction =
        throughput::profile(model_of(job)).shared_fraction(throughput::profile(model_of(partner)));
    alone
        .iter()
        .filter(|(t, speed)| **speed > 0.0 && partner_alone.get(*t).is_some_and(|s| *s > 0.0))
        .map(|(t, speed)| {
            let key = (job_type(job), model_of(partner).to_string(), t.clone());
            let figure = measured.get(&key).copied().unwrap_or(speed * fraction);
            (t.clone(), figure)
        })
        .collect()
}

/// Mean measured speed beside each partner model, by (job type, partner
/// model, GPU type), over `jobs`.
fn measured_shared_speeds<'a>(
    jobs: impl Iterator<Item = &'a Job>,
    layout: &Layout,
) -> BTreeMap<(String, String, String), f64> {
    let mut sums: BTreeMap<(String, String, String), (f64, u32)> = BTreeMap::new();
    for job in jobs {
        let gpus = scale_factor(job);
        let partners: Vec<&String> = job
            .perf
            .shared_speeds
            .keys()
            .chain(&job.perf.epoch_partner)
            .collect();
        for partner in partners {
            for t in &layout.types {
                if let Some(speed) = job.perf.shared_steps_per_s(partner, &t.gpu_type, gpus) {
                    let o = sums
                        .entry((job_type(job), partner.clone(), t.gpu_type.clone()))
                        .or_default();
                    o.0 += speed;
                    o.1 += 1;
                }
            }
        }
    }
    sums.into_iter()
        .map(|(k, (sum, n))| (k, sum / f64::from(n.max(1))))
        .collect()
}

/// Steps per second of two jobs beside each other, by the GPU types both
/// may run on: `[a's, b's]`.
fn pair_figures(
    (job_a, alone_a): (&Job, &BTreeMap<String, f64>),
    (job_b, alone_b): (&Job, &BTreeMap<String, f64>),
    measured: &BTreeMap<(String, String, String), f64>,
) -> BTreeMap<String, [f64; 2]> {
    let sa = shared_speeds(job_a, alone_a, job_b, alone_b, measured);
    let sb = shared_speeds(job_b, alone_b, job_a, alone_a, measured);
    sa.iter()
        .filter_map(|(t, x)| Some((t.clone(), [*x, *sb.get(t)?])))
        .collect()
}

/// The pair figures of the jobs the mechanism knows: job type → other
/// type → GPU type → `[job type's, other's]` steps per second.
fn pair_throughputs(
    jobs: &BTreeMap<JobId, (&Job, BTreeMap<String, f64>)>,
    measured: &BTreeMap<(String, String, String), f64>,
) -> PairThroughputs {
    let mut out = PairThroughputs::new();
    for (a, (job_a, alone_a)) in jobs {
        for (_, (job_b, alone_b)) in jobs.range(a..) {
            if scale_factor(job_a) != scale_factor(job_b) {
                continue;
            }
            let (ta, tb) = (job_type(job_a), job_type(job_b));
            let known = out.get(&ta).is_some_and(|m| m.contains_key(&tb));
            if known {
                continue;
            }
            let row = pair_figures((job_a, alone_a), (job_b, alone_b), measured);
            if row.is_empty() {
                continue;
            }
            let swapped = row
                .iter()
                .map(|(t, [x, y])| (t.clone(), [*y, *x]))
                .collect();
            out.entry(ta.clone()).or_default().insert(tb.clone(), row);
            out.entry(tb).or_default().insert(ta, swapped);
        }
    }
    out
}

fn scale_factor(job: &keel_state::model::Job) -> u32 {
    job.spec
        .gpus
        .max(1)
        .saturating_mul(job.spec.workers.min.max(1))
}

/// Steps per second of `job` on each type, 0 where its spec forbids the
/// type.
fn speeds(job: &keel_state::model::Job, layout: &Layout) -> BTreeMap<String, f64> {
    let perf = JobPerf::of(job);
    let gpus = scale_factor(job);
    layout
        .types
        .iter()
        .map(|t| {
            let allowed = job.spec.gpu_types.allowed.is_empty()
                || job
                    .spec
                    .gpu_types
                    .allowed
                    .iter()
                    .any(|a| a.eq_ignore_ascii_case(&t.gpu_type));
            let speed = if allowed {
                perf.steps_per_s(&t.gpu_type, gpus)
            } else {
                0.0
            };
            (t.gpu_type.clone(), speed)
        })
        .collect()
}

impl GavelRounds {
    /// Ends the current round at `now_ms` and plans the next: credits the
    /// round that ended, brings the job set up to date with `state`,
    /// solves again when the mechanism says so, and places the round.
    fn next_round(&self, rounds: &mut Rounds, state: &ClusterState, now_ms: u64) {
        let now_s = now_ms as f64 / 1000.0;
        // Credit the round that ended.
        if let Some(start) = rounds.round_started_ms {
            let ran_s = now_ms.saturating_sub(start) as f64 / 1000.0;
            for (combo, ti) in &rounds.placed_on {
                rounds.mechanism.record_run(*combo, *ti, ran_s);
            }
        }
        // The job set: unfinished jobs in, ended ones out.
        let unfinished: BTreeMap<JobId, &keel_state::model::Job> =
            state.unfinished_jobs().map(|j| (j.id, j)).collect();
        let known: Vec<ProblemJobId> = rounds.mechanism.job_ids().collect();
        for id in known {
            if !unfinished.contains_key(&id) {
                rounds.mechanism.remove_job(id);
            }
        }
        let packs = gavel::shares_gpus(self.name);
        let measured = if packs {
            measured_shared_speeds(unfinished.values().copied(), &rounds.layout)
        } else {
            BTreeMap::new()
        };
        for (id, job) in &unfinished {
            if rounds.mechanism.contains(*id) || job.backing_off(now_ms) {
                continue;
            }
            let alone = speeds(job, &rounds.layout);
            rounds.mechanism.add_job(*id, scale_factor(job), &alone);
            if !packs {
                continue;
            }
            // As in Gavel: a pair with every job already known of the
            // same size that can share a type with it.
            let others: Vec<JobId> = rounds.mechanism.job_ids().filter(|o| o != id).collect();
            for other_id in others {
                let Some(other) = unfinished.get(&other_id) else {
                    continue;
                };
                if scale_factor(other) != scale_factor(job) {
                    continue;
                }
                let other_alone = speeds(other, &rounds.layout);
                // The mechanism's pairs are smaller id first.
                let (a, b, figures) = if other_id < *id {
                    let f = pair_figures((other, &other_alone), (job, &alone), &measured);
                    (other_id, *id, f)
                } else {
                    let f = pair_figures((job, &alone), (other, &other_alone), &measured);
                    (*id, other_id, f)
                };
                if !figures.is_empty() {
                    rounds.mechanism.add_pair(a, b, &figures);
                }
            }
        }
        if rounds.mechanism.needs_solve(now_s) {
            let jobs: BTreeMap<JobId, (&Job, BTreeMap<String, f64>)> = rounds
                .mechanism
                .job_ids()
                .filter_map(|id| {
                    let job = state.job(id)?;
                    Some((id, (job, speeds(job, &rounds.layout))))
                })
                .collect();
            let alone: BTreeMap<JobId, BTreeMap<String, f64>> =
                jobs.iter().map(|(id, (_, s))| (*id, s.clone())).collect();
            let mut p = problem(state, &self.options, &rounds.layout, &alone, now_ms);
            if packs {
                p.job_types = jobs.iter().map(|(id, (j, _))| (*id, job_type(j))).collect();
                p.pair_throughputs = pair_throughputs(&jobs, &measured);
            }
            // A failed solve must not stop the cluster: equal shares
            // until the next solve.
            let (allocation, pairs) = match rounds.run.solve(&p, rounds.mechanism.allocation()) {
                Ok(r) => (r.allocation, r.pair_allocation),
                Err(_) => (gavel::isolated(&p).allocation, Default::default()),
            };
            rounds
                .mechanism
                .install_with_pairs(now_s, allocation, &pairs);
        }
        let placements = rounds.mechanism.plan_round();
        rounds.plan.clear();
        rounds.partners.clear();
        rounds.placed_on.clear();
        for (combo, placement) in placements {
            let gpus: Vec<GpuRef> = placement
                .workers
                .iter()
                .filter_map(|w| rounds.layout.gpus.get(*w as usize).cloned())
                .collect();
            let jobs: Vec<&Job> = combo.jobs().filter_map(|id| state.job(id)).collect();
            // Every job of the entry known, and each worker's GPUs on
            // one node.
            let whole_workers = jobs.iter().all(|job| {
                let per = job.spec.gpus.max(1) as usize;
                gpus.chunks(per)
                    .all(|rank| rank.iter().all(|g| g.node == rank[0].node))
            });
            if gpus.len() != placement.workers.len()
                || !whole_workers
                || jobs.len() != combo.jobs().count()
            {
                continue;
            }
            rounds.placed_on.insert(combo, placement.type_index);
            for job in &jobs {
                rounds.plan.insert(job.id, gpus.clone());
            }
            if let Some((a, b)) = combo.as_pair() {
                rounds.partners.insert(a, b);
                rounds.partners.insert(b, a);
            }
        }
        rounds.round_started_ms = Some(now_ms);
    }
}

/// The current round's plan for the jobs still unfinished and not waiting
/// out a retry backoff. A pair whose partner left runs on alone until the
/// next round.
fn round_plan(rounds: &Rounds, state: &ClusterState, now_ms: u64) -> Plan<'static> {
    let mut plan = Plan::default();
    for (job_id, gpus) in &rounds.plan {
        if state
            .job(*job_id)
            .is_some_and(|j| !j.state.is_terminal() && !j.backing_off(now_ms))
        {
            plan.placements.insert(*job_id, gpus.clone().into());
        }
    }
    for (a, b) in &rounds.partners {
        if plan.placements.contains_key(a) && plan.placements.contains_key(b) {
            plan.partners.insert(*a, *b);
        }
    }
    plan
}

impl Policy for GavelRounds {
    fn name(&self) -> &'static str {
        self.name
    }

    /// The mechanism's counters in the memory `state` holds (since it last
    /// started afresh).
    fn counters(&self, state: &ClusterState) -> BTreeMap<&'static str, u64> {
        let guard = self.logged(state);
        let Some(decoded) = guard.as_ref() else {
            return BTreeMap::new();
        };
        let stats = decoded.rounds.mechanism.stats();
        [
            ("solves", stats.solves),
            ("rounds", stats.rounds),
            ("lease_extensions", stats.lease_extensions),
            (
                "lease_extension_opportunities",
                stats.lease_extension_opportunities,
            ),
        ]
        .into_iter()
        .collect()
    }

    /// Between round boundaries: the current round's plan, from the memory
    /// the state holds. At a boundary (or with no usable memory): the next
    /// round's plan, with the memory after it to log.
    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let state = input.state;
        let layout = Layout::of(state);
        let mut guard = self.logged(state);
        let current = guard
            .as_ref()
            .map(|d| &d.rounds)
            .filter(|r| self.usable(r, &layout));
        if let Some(rounds) = current.filter(|r| !self.due(r, input.now_ms)) {
            return round_plan(rounds, state, input.now_ms);
        }
        let Some(mut rounds) = current.cloned().or_else(|| self.fresh(layout)) else {
            return Plan::default();
        };
        self.next_round(&mut rounds, state, input.now_ms);
        let mut plan = round_plan(&rounds, state, input.now_ms);
        // A memory over the entry's limit is not logged: the next pass
        // plans this round again from the memory in force, and a new
        // leader starts afresh. Measured (BENCHMARKS.md): ~60 bytes a job
        // alone, so ~35,000 jobs on one GPU type; the packing policy's
        // pairs reach it at ~300 jobs.
        if let Ok(bytes) = postcard::to_stdvec(&rounds) {
            if bytes.len() <= POLICY_MEMORY_MAX_BYTES {
                plan.memory = Some(PolicyMemory {
                    policy: self.name.to_string(),
                    format: MEMORY_FORMAT,
                    bytes: bytes.clone(),
                });
                // Decoded already, for when the decision is applied.
                *guard = Some(Decoded { bytes, rounds });
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::decide;
    use keel_state::fixtures::{job_spec, TestCluster};

    /// `name` with one-minute rounds and a solve whenever the job set
    /// changes.
    fn minute_rounds(name: &'static str) -> GavelRounds {
        GavelRounds::new(
            name,
            GavelOptions {
                round_s: 60.0,
                min_resolve_interval_s: 0.0,
                ..GavelOptions::default()
            },
        )
    }

    fn run_round(
        policy: &GavelRounds,
        cluster: &mut TestCluster,
        now_ms: u64,
    ) -> BTreeMap<JobId, Vec<GpuRef>> {
        if let Some(decision) = decide(policy, &cluster.state, now_ms) {
            cluster.apply(decision);
        }
        cluster
            .state
            .allocated_jobs()
            .filter_map(|j| Some((j.id, j.allocation.as_ref()?.gpus.clone())))
            .collect()
    }

    /// A new leader is a new policy instance that knows only the log: it
    /// plans every next round exactly as the instance that ran so far
    /// would have, because the memory is in the state; with the memory
    /// forgotten (a failover before it was logged) the round differs.
    #[test]
    fn a_new_instance_goes_on_from_the_memory_in_the_state() {
        let mut cluster = TestCluster::v100_nodes(&[2, 1]);
        for (i, gpus) in [1, 2, 1, 1].into_iter().enumerate() {
            cluster.submit(job_spec(&format!("j{i}"), gpus, 1));
        }
        let policy = minute_rounds("max_min_fairness_perf");
        for round in 0..5u64 {
            run_round(&policy, &mut cluster, round * 60_000 + 1);
        }
        assert!(cluster.state.policy_memory().is_some());
        assert_eq!(policy.counters(&cluster.state).get("rounds"), Some(&5));
        let at_five = cluster.clone();
        let mut continued = cluster.clone();
        let new_leader = minute_rounds("max_min_fairness_perf");
        for round in 5..9u64 {
            let now = round * 60_000 + 1;
            let old = decide(&policy, &continued.state, now);
            let new = decide(&new_leader, &cluster.state, now);
            assert_eq!(new, old, "round {round}");
            if let Some(d) = old {
                continued.apply(d);
            }
            if let Some(d) = new {
                cluster.apply(d);
            }
        }
        assert_eq!(new_leader.counters(&cluster.state).get("rounds"), Some(&9));
        // Forgotten: the mechanism starts afresh, crediting every job as
        // new, and plans round 5 otherwise.
        let now = 5 * 60_000 + 1;
        let remembered = decide(&minute_rounds("max_min_fairness_perf"), &at_five.state, now);
        let mut forgotten = at_five;
        forgotten.state.restore_policy_memory(Default::default());
        let afresh = decide(
            &minute_rounds("max_min_fairness_perf"),
            &forgotten.state,
            now,
        );
        assert_ne!(remembered, afresh);
    }

    #[test]
    fn two_jobs_share_one_gpu_round_by_round() {
        let mut cluster = TestCluster::v100_nodes(&[1]);
        let a = cluster.submit(job_spec("a", 1, 1));
        let b = cluster.submit(job_spec("b", 1, 1));
        let policy = minute_rounds("max_min_fairness_perf");
        let mut ran = BTreeMap::<JobId, u32>::new();
        let mut last = BTreeMap::new();
        for round in 0..8u64 {
            let held = run_round(&policy, &mut cluster, round * 60_000 + 1);
            assert_eq!(held.len(), 1, "one GPU: one job per round");
            for job in held.keys() {
                *ran.entry(*job).or_default() += 1;
            }
            // Mid-round passes change nothing.
            assert_eq!(
                decide(&policy, &cluster.state, round * 60_000 + 30_000),
                None
            );
            last = held;
        }
        assert_eq!(ran.get(&a), Some(&4), "{ran:?}");
        assert_eq!(ran.get(&b), Some(&4), "{ran:?}");
        assert_eq!(last.len(), 1);
    }

    #[test]
    fn a_job_that_fits_keeps_its_gpus_across_rounds() {
        let mut cluster = TestCluster::v100_nodes(&[2, 2]);
        let a = cluster.submit(job_spec("a", 2, 1));
        let policy = GavelRounds::new("max_min_fairness", GavelOptions::default());
        let first = run_round(&policy, &mut cluster, 1);
        let epoch = cluster
            .state
            .job(a)
            .and_then(|j| j.allocation.as_ref())
            .map(|x| x.epoch);
        let second = run_round(&policy, &mut cluster, 361_000);
        assert_eq!(first, second);
        assert_eq!(
            cluster
                .state
                .job(a)
                .and_then(|j| j.allocation.as_ref())
                .map(|x| x.epoch),
            epoch,
            "no relaunch"
        );
        assert!(GavelOptions {
            round_s: 0.0,
            ..GavelOptions::default()
        }
        .validate()
        .is_err());
    }

    fn partners(cluster: &TestCluster) -> BTreeMap<JobId, JobId> {
        cluster
            .state
            .allocated_jobs()
            .filter_map(|j| Some((j.id, j.allocation.as_ref()?.shared_with?)))
            .collect()
    }

    #[test]
    fn the_packed_policy_puts_two_light_jobs_on_one_gpu_live() {
        let mut cluster = TestCluster::v100_nodes(&[1]);
        let light = |name: &str| {
            let mut spec = job_spec(name, 1, 1);
            spec.model = Some("resnet18".into());
            spec
        };
        let a = cluster.submit(light("a"));
        let b = cluster.submit(light("b"));
        let policy = minute_rounds("max_min_fairness_packed");
        for round in 0..4u64 {
            let held = run_round(&policy, &mut cluster, round * 60_000 + 1);
            cluster.state.check_invariants().expect("invariants");
            // Both run on the one GPU, each naming the other.
            assert_eq!(held.len(), 2, "round {round}: {held:?}");
            assert_eq!(held.get(&a), held.get(&b));
            assert_eq!(partners(&cluster), BTreeMap::from([(a, b), (b, a)]));
            assert_eq!(
                decide(&policy, &cluster.state, round * 60_000 + 30_000),
                None
            );
        }
        // The pair kept its GPU: one allocation each, no relaunch.
        for j in [a, b] {
            let epoch = cluster
                .state
                .job(j)
                .and_then(|x| x.allocation.as_ref())
                .map(|x| x.epoch);
            assert_eq!(epoch, Some(1), "job {j}");
        }
        // a finishes: b runs on alone and the next round keeps it there.
        cluster.apply(keel_state::command::Command::finish_job(
            a,
            keel_state::command::JobOutcome::Succeeded,
            String::new(),
        ));
        assert!(partners(&cluster).is_empty());
        assert_eq!(
            decide(&policy, &cluster.state, 4 * 60_000 - 1),
            None,
            "mid-round"
        );
        let held = run_round(&policy, &mut cluster, 4 * 60_000 + 1);
        assert_eq!(held.keys().copied().collect::<Vec<_>>(), vec![b]);
    }

    #[test]
    fn measured_pair_speeds_replace_the_tables_and_stop_a_pair_that_does_not_pay() {
        let mut cluster = TestCluster::v100_nodes(&[1]);
        let a = cluster.submit(job_spec("a", 1, 1));
        let b = cluster.submit(job_spec("b", 1, 1));
        let gpu = GpuRef {
            node: "n0".into(),
            index: 0,
        };
        // The two resnet50s shared the GPU and measured a crawl: 0.5 steps/s
        // each, against 11 alone.
        cluster.apply(keel_state::command::Command::decide_allocation(
            cluster.index,
            "test",
            1,
            vec![
                keel_state::command::JobPlacement {
                    job_id: a,
                    gpus: vec![gpu.clone()],
                    share_with: Some(b),
                },
                keel_state::command::JobPlacement {
                    job_id: b,
                    gpus: vec![gpu.clone()],
                    share_with: Some(a),
                },
            ],
        ));
        for (i, step) in [(0u64, 0u64), (1, 10), (2, 20)] {
            for j in [a, b] {
                cluster.apply(keel_state::command::Command::report_progress(
                    j,
                    vec![keel_state::model::ProgressSample {
                        step,
                        total_steps: 10_000,
                        loss: None,
                        samples_per_s: 1.0,
                        at_ms: i * 20_000,
                    }],
                ));
            }
        }
        let measured =
            measured_shared_speeds(cluster.state.unfinished_jobs(), &Layout::of(&cluster.state));
        assert_eq!(
            measured.get(&("resnet50x1".into(), "resnet50".into(), "v100".into())),
            Some(&0.5)
        );
        // The packed policy now takes turns instead of pairing them.
        let policy = minute_rounds("max_min_fairness_packed");
        for round in 0..3u64 {
            let held = run_round(&policy, &mut cluster, 100_000 + round * 60_000);
            assert_eq!(held.len(), 1, "round {round}: {held:?}");
            assert!(partners(&cluster).is_empty());
        }
    }

    /// What the logged memory weighs (one GPU type, 64 GPUs; the jobs
    /// waiting and running in turn): about 60 bytes a job alone, and for
    /// the packing policy, whose entries include every pair of one size,
    /// growing with the square of the jobs. Both stay well under the
    /// entry's limit here; the figures are in BENCHMARKS.md.
    #[test]
    fn the_logged_memory_stays_under_its_limit() {
        let size = |name: &'static str, jobs: usize| {
            let mut cluster = TestCluster::v100_nodes(&[8; 8]);
            for i in 0..jobs {
                let mut spec = job_spec(&format!("j{i}"), 1, 1);
                spec.model = Some(["resnet50", "resnet18", "lm"][i % 3].into());
                cluster.submit(spec);
            }
            let policy = minute_rounds(name);
            for round in 0..3u64 {
                run_round(&policy, &mut cluster, round * 60_000 + 1);
            }
            cluster.state.policy_memory().map_or(0, |m| m.bytes.len())
        };
        let alone = size("max_min_fairness_perf", 1_000);
        assert!(
            alone > 0 && alone < 100 * 1_000,
            "{alone} bytes for 1,000 jobs"
        );
        let packed = size("max_min_fairness_packed", 100);
        assert!(
            packed < POLICY_MEMORY_MAX_BYTES / 4,
            "{packed} bytes for 100 jobs"
        );
    }
}
