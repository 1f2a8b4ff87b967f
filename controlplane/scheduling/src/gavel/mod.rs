//! Heterogeneity-aware allocation (Gavel's policies): what fraction of
//! time each job should spend on each GPU type.
//!
//! An [`Allocation`] `X[i][j]` is the fraction of time job `i` should run
//! on type `j`. Every policy's `X` satisfies the shared constraints: `X ≥ 0`,
//! `Σ_j X[i][j] ≤ 1` per job, and `Σ_i s_i·X[i][j] ≤ N_j` per type (`s_i`
//! the job's scale factor, `N_j` the type's GPU count). A job's effective
//! throughput is `Σ_j T[i][j]·X[i][j]`.
//!
//! The inputs and outputs have the shape of a case in Gavel's
//! `policy_golden.json`, so Keel's policies can be held against Gavel's
//! (`keel policy eval`). Linear programmes are solved by Clarabel (an
//! interior-point solver in pure Rust) through `good_lp`. Gavel used
//! ECOS, also interior-point; where the optimum is not unique the two may
//! return different optimal points (2 of the 8 golden comparisons so far),
//! with the same objective. Pure: no I/O, no clock, ordered maps only.

mod allox;
mod fifo_perf;
mod finish_time_fairness;
mod gandiva;
mod isolated;
mod lp;
mod max_min_fairness;
mod max_min_fairness_packed;
mod max_sum_throughput;
mod max_sum_throughput_normalized_by_cost;
pub mod mechanism;
mod min_total_duration;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use allox::allox;
pub use fifo_perf::fifo_perf;
pub use finish_time_fairness::{finish_time_fairness, finish_time_fairness_perf, FinishTimeMemory};
pub use gandiva::Gandiva;
pub use isolated::isolated;
pub use max_min_fairness::{max_min_fairness, max_min_fairness_perf};
pub use max_min_fairness_packed::max_min_fairness_packed;
pub use max_sum_throughput::max_sum_throughput_perf;
pub use max_sum_throughput_normalized_by_cost::max_sum_throughput_normalized_by_cost_perf;
pub use min_total_duration::{min_total_duration, min_total_duration_perf};

/// A job's id in an allocation problem.
pub type ProblemJobId = u64;

/// What a heterogeneity-aware policy sees (the fields of a case in
/// Gavel's `policy_golden.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocationProblem {
    /// GPUs per type.
    pub cluster_spec: BTreeMap<String, u32>,
    /// Steps per second of each job alone on each type (at its scale
    /// factor).
    pub throughputs: BTreeMap<ProblemJobId, BTreeMap<String, f64>>,
    pub scale_factors: BTreeMap<ProblemJobId, u32>,
    #[serde(default)]
    pub priority_weights: BTreeMap<ProblemJobId, f64>,
    #[serde(default)]
    pub times_since_start: BTreeMap<ProblemJobId, f64>,
    #[serde(default)]
    pub num_steps_remaining: BTreeMap<ProblemJobId, f64>,
    /// Price per hour of each GPU type (cost-normalised policies; 1 where
    /// absent).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub instance_costs: BTreeMap<String, f64>,
    /// Seconds from now to each job's deadline (cost-normalised policies).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub slos: BTreeMap<ProblemJobId, f64>,
    /// Each job's type (its model), for the space-sharing policies: jobs
    /// of one type behave the same beside any other job. Read as Keel's map
    /// (job → type), or as Gavel's list of `[model, scale factor]` by job
    /// position (the type is the model, `model x{N}` for a scale factor N
    /// above 1), or `null`.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "job_types_json::deserialize"
    )]
    pub job_types: BTreeMap<ProblemJobId, String>,
    /// Steps per second of two job types sharing GPUs (space-sharing
    /// policies; a pair without figures is never packed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pair_throughputs: PairThroughputs,
}

/// Fractions of time by job, then GPU type.
pub type Allocation = BTreeMap<ProblemJobId, BTreeMap<String, f64>>;

/// Job type → other job type → GPU type → `[job type's, other's]` steps
/// per second when one job of each shares the same GPUs.
pub type PairThroughputs = BTreeMap<String, BTreeMap<String, BTreeMap<String, [f64; 2]>>>;

/// Fractions of time two jobs (smaller id first) share GPUs, by GPU type.
pub type PairAllocation = BTreeMap<(ProblemJobId, ProblemJobId), BTreeMap<String, f64>>;

/// `job_types` in either shape (see [`AllocationProblem::job_types`]).
mod job_types_json {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer};

    use super::ProblemJobId;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Shape {
        // Keys as text: an untagged enum sees JSON object keys as strings.
        Keel(BTreeMap<String, String>),
        Gavel(Vec<(String, u32)>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<ProblemJobId, String>, D::Error> {
        Ok(match Option::<Shape>::deserialize(d)? {
            None => BTreeMap::new(),
            Some(Shape::Keel(map)) => map
                .into_iter()
                .map(|(job, kind)| {
                    job.parse::<ProblemJobId>()
                        .map(|job| (job, kind))
                        .map_err(|_| {
                            serde::de::Error::custom(format!("job_types: {job:?} is not a job id"))
                        })
                })
                .collect::<Result<_, _>>()?,
            Some(Shape::Gavel(list)) => list
                .into_iter()
                .enumerate()
                .map(|(i, (model, scale_factor))| {
                    let kind = if scale_factor > 1 {
                        format!("{model} x{scale_factor}")
                    } else {
                        model
                    };
                    (i as ProblemJobId, kind)
                })
                .collect(),
        })
    }
}

/// Pair allocations in JSON: a list of `{"jobs": [a, b], "allocation":
/// {type: fraction}}` (JSON object keys cannot be pairs).
mod pair_allocation_json {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{PairAllocation, ProblemJobId};

    #[derive(Serialize, Deserialize)]
    struct Entry {
        jobs: [ProblemJobId; 2],
        allocation: BTreeMap<String, f64>,
    }

    pub fn serialize<S: Serializer>(pairs: &PairAllocation, s: S) -> Result<S::Ok, S::Error> {
        let entries: Vec<Entry> = pairs
            .iter()
            .map(|((a, b), row)| Entry {
                jobs: [*a, *b],
                allocation: row.clone(),
            })
            .collect();
        entries.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PairAllocation, D::Error> {
        let entries = Vec::<Entry>::deserialize(d)?;
        Ok(entries
            .into_iter()
            .map(|e| {
                let [a, b] = e.jobs;
                ((a.min(b), a.max(b)), e.allocation)
            })
            .collect())
    }
}

/// A policy's answer: the allocation, each job's effective throughput and
/// the objective's value where the policy has one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyResult {
    pub allocation: Allocation,
    /// Space-sharing policies: the time pairs of jobs share GPUs (only
    /// pairs with some time are listed).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        with = "pair_allocation_json"
    )]
    pub pair_allocation: PairAllocation,
    /// A job's steps per second over time: alone, plus beside its
    /// partners.
    pub effective_throughput: BTreeMap<ProblemJobId, f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocationError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("the solver failed: {0}")]
    Solver(String),
    #[error("unknown heterogeneity-aware policy {name:?}; known: {}", GAVEL_POLICY_NAMES.join(", "))]
    UnknownPolicy { name: String },
}

/// Most jobs in one problem.
pub const JOBS_MAX: usize = 20_000;
/// Most GPU types in one problem.
pub const TYPES_MAX: usize = 64;
/// Most pair figures (type pairs × GPU types) in one problem.
pub const PAIR_FIGURES_MAX: usize = 200_000;

/// `[a's, b's]` figures of job types `a` and `b` sharing `gpu_type`, read
/// either way round.
fn pair_figures(pairs: &PairThroughputs, a: &str, b: &str, gpu_type: &str) -> Option<[f64; 2]> {
    if let Some(f) = pairs
        .get(a)
        .and_then(|o| o.get(b))
        .and_then(|g| g.get(gpu_type))
    {
        return Some(*f);
    }
    pairs
        .get(b)
        .and_then(|o| o.get(a))
        .and_then(|g| g.get(gpu_type))
        .map(|[x, y]| [*y, *x])
}

/// The policies [`solve`] knows.
pub const GAVEL_POLICY_NAMES: &[&str] = &[
    "isolated",
    "max_min_fairness",
    "max_min_fairness_perf",
    "max_sum_throughput_perf",
    "finish_time_fairness",
    "finish_time_fairness_perf",
    "min_total_duration",
    "min_total_duration_perf",
    "max_sum_throughput_normalized_by_cost_perf",
    "fifo_perf",
    "allox",
    "gandiva",
    "max_min_fairness_packed",
];

/// The policies that may put two jobs on the same GPUs (space sharing):
/// their results have pair allocations, and they need pair throughputs.
pub const SPACE_SHARING_POLICY_NAMES: &[&str] = &["gandiva", "max_min_fairness_packed"];

/// Whether the policy `name` may put two jobs on the same GPUs.
pub fn shares_gpus(name: &str) -> bool {
    SPACE_SHARING_POLICY_NAMES.contains(&name)
}

/// A policy solved again and again, as the round simulator and the live
/// scheduler use it: carries what a policy keeps between solves
/// (Gandiva's pairs and random stream, finish-time fairness's credited
/// isolated time; AlloX reads the last allocation, which the caller
/// passes).
#[derive(Debug, Clone)]
pub struct PolicyRun {
    name: &'static str,
    gandiva: Option<Gandiva>,
    finish_time: FinishTimeMemory,
}

impl PolicyRun {
    /// The policy `name`; `seed` seeds Gandiva's draws (Gavel passes its
    /// run's seed).
    pub fn new(name: &str, seed: u32) -> Result<PolicyRun, AllocationError> {
        let Some(name) = GAVEL_POLICY_NAMES.iter().find(|n| **n == name) else {
            return Err(AllocationError::UnknownPolicy {
                name: name.to_string(),
            });
        };
        Ok(PolicyRun {
            name,
            gandiva: (*name == "gandiva").then(|| Gandiva::new(seed)),
            finish_time: FinishTimeMemory::default(),
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The next solve, `previous` being the allocation in force.
    pub fn solve(
        &mut self,
        problem: &AllocationProblem,
        previous: &Allocation,
    ) -> Result<PolicyResult, AllocationError> {
        if let Some(gandiva) = &mut self.gandiva {
            problem.validate()?;
            return Ok(gandiva.allocate(problem));
        }
        match self.name {
            "finish_time_fairness" | "finish_time_fairness_perf" => {
                problem.validate()?;
                self.finish_time
                    .solve(problem, self.name == "finish_time_fairness")
            }
            _ => solve_after(self.name, problem, previous),
        }
    }
}

/// How a [`PolicyRun`] is encoded: its name as text.
#[derive(serde::Serialize, serde::Deserialize)]
struct EncodedPolicyRun {
    name: String,
    gandiva: Option<Gandiva>,
    finish_time: FinishTimeMemory,
}

impl From<PolicyRun> for EncodedPolicyRun {
    fn from(r: PolicyRun) -> Self {
        EncodedPolicyRun {
            name: r.name.to_string(),
            gandiva: r.gandiva,
            finish_time: r.finish_time,
        }
    }
}

impl serde::Serialize for PolicyRun {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        EncodedPolicyRun::from(self.clone()).serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for PolicyRun {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        PolicyRun::try_from(EncodedPolicyRun::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<EncodedPolicyRun> for PolicyRun {
    type Error = String;

    fn try_from(e: EncodedPolicyRun) -> Result<Self, String> {
        let name = GAVEL_POLICY_NAMES
            .iter()
            .find(|n| **n == e.name)
            .ok_or_else(|| format!("unknown policy {:?}", e.name))?;
        Ok(PolicyRun {
            name,
            gandiva: e.gandiva,
            finish_time: e.finish_time,
        })
    }
}

/// Runs the policy `name` on `problem` (a first solve: policies that
/// keep earlier decisions start from none; see [`solve_after`]).
pub fn solve(name: &str, problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve_after(name, problem, &Allocation::new())
}

/// Runs the policy `name` on `problem`, where `previous` is the last
/// solve's allocation (only `allox` uses it: a job that holds a GPU keeps
/// it).
pub fn solve_after(
    name: &str,
    problem: &AllocationProblem,
    previous: &Allocation,
) -> Result<PolicyResult, AllocationError> {
    problem.validate()?;
    match name {
        "allox" => allox(problem, previous),
        "isolated" => Ok(isolated(problem)),
        "max_min_fairness" => max_min_fairness(problem),
        "max_min_fairness_perf" => max_min_fairness_perf(problem),
        "max_sum_throughput_perf" => max_sum_throughput_perf(problem),
        "finish_time_fairness" => finish_time_fairness(problem),
        "finish_time_fairness_perf" => finish_time_fairness_perf(problem),
        "min_total_duration" => min_total_duration(problem),
        "min_total_duration_perf" => min_total_duration_perf(problem),
        "max_sum_throughput_normalized_by_cost_perf" => {
            max_sum_throughput_normalized_by_cost_perf(problem)
        }
        "fifo_perf" => Ok(fifo_perf(problem)),
        // A first solve: fresh pairs, Gavel's seed 0.
        "gandiva" => Ok(Gandiva::new(0).allocate(problem)),
        "max_min_fairness_packed" => max_min_fairness_packed(problem),
        _ => Err(AllocationError::UnknownPolicy {
            name: name.to_string(),
        }),
    }
}

impl AllocationProblem {
    /// A problem on `cluster_spec` with no jobs yet.
    pub fn new(cluster_spec: BTreeMap<String, u32>) -> AllocationProblem {
        AllocationProblem {
            cluster_spec,
            throughputs: BTreeMap::new(),
            scale_factors: BTreeMap::new(),
            priority_weights: BTreeMap::new(),
            times_since_start: BTreeMap::new(),
            num_steps_remaining: BTreeMap::new(),
            instance_costs: BTreeMap::new(),
            slos: BTreeMap::new(),
            job_types: BTreeMap::new(),
            pair_throughputs: BTreeMap::new(),
        }
    }

    /// `[a's, b's]` steps per second when jobs `a` and `b` share GPUs of
    /// `gpu_type`: `None` unless both have a type, the same scale factor
    /// and figures for the pair.
    pub fn pair_throughput(
        &self,
        a: ProblemJobId,
        b: ProblemJobId,
        gpu_type: &str,
    ) -> Option<[f64; 2]> {
        if a == b || self.scale_factor(a) != self.scale_factor(b) {
            return None;
        }
        let ta = self.job_types.get(&a)?;
        let tb = self.job_types.get(&b)?;
        pair_figures(&self.pair_throughputs, ta, tb, gpu_type)
    }

    /// The GPU types, in name order.
    pub fn types(&self) -> Vec<&str> {
        self.cluster_spec.keys().map(String::as_str).collect()
    }

    /// `T[i][j]` (0 when the table has no figure).
    pub fn throughput(&self, job: ProblemJobId, gpu_type: &str) -> f64 {
        self.throughputs
            .get(&job)
            .and_then(|t| t.get(gpu_type))
            .copied()
            .unwrap_or(0.0)
    }

    pub fn scale_factor(&self, job: ProblemJobId) -> u32 {
        self.scale_factors.get(&job).copied().unwrap_or(1).max(1)
    }

    pub fn weight(&self, job: ProblemJobId) -> f64 {
        self.priority_weights.get(&job).copied().unwrap_or(1.0)
    }

    /// Checks sizes, numbers and that every job has a scale factor.
    pub fn validate(&self) -> Result<(), AllocationError> {
        let invalid = |field: &str, reason: String| AllocationError::Invalid {
            field: field.to_string(),
            reason,
        };
        if self.throughputs.len() > JOBS_MAX {
            return Err(invalid(
                "throughputs",
                format!("{} jobs; the limit is {JOBS_MAX}", self.throughputs.len()),
            ));
        }
        if self.cluster_spec.len() > TYPES_MAX {
            return Err(invalid(
                "cluster_spec",
                format!(
                    "{} GPU types; the limit is {TYPES_MAX}",
                    self.cluster_spec.len()
                ),
            ));
        }
        for (job, row) in &self.throughputs {
            for (t, v) in row {
                if !(v.is_finite() && *v >= 0.0) {
                    return Err(invalid(
                        "throughputs",
                        format!("job {job} on {t}: {v} is not a finite number ≥ 0"),
                    ));
                }
            }
            if !self.scale_factors.contains_key(job) {
                return Err(invalid("scale_factors", format!("job {job} has none")));
            }
        }
        for (t, c) in &self.instance_costs {
            if !(c.is_finite() && *c > 0.0) {
                return Err(invalid(
                    "instance_costs",
                    format!("{t}: {c} is not a positive price"),
                ));
            }
        }
        for (job, s) in &self.slos {
            if !(s.is_finite() && *s > 0.0) {
                return Err(invalid(
                    "slos",
                    format!("job {job}: {s} is not a positive number of seconds"),
                ));
            }
        }
        if self.job_types.len() > JOBS_MAX {
            return Err(invalid(
                "job_types",
                format!("{} jobs; the limit is {JOBS_MAX}", self.job_types.len()),
            ));
        }
        let pair_figures: usize = self
            .pair_throughputs
            .values()
            .flat_map(|others| others.values())
            .map(BTreeMap::len)
            .sum();
        if pair_figures > PAIR_FIGURES_MAX {
            return Err(invalid(
                "pair_throughputs",
                format!("{pair_figures} figures; the limit is {PAIR_FIGURES_MAX}"),
            ));
        }
        for (ta, others) in &self.pair_throughputs {
            for (tb, by_gpu) in others {
                for (gpu, figures) in by_gpu {
                    if figures.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
                        return Err(invalid(
                            "pair_throughputs",
                            format!(
                                "{ta} beside {tb} on {gpu}: {figures:?} are not finite numbers ≥ 0"
                            ),
                        ));
                    }
                }
            }
        }
        for (job, w) in &self.priority_weights {
            if !(w.is_finite() && *w > 0.0) {
                return Err(invalid(
                    "priority_weights",
                    format!("job {job}: {w} is not a positive number"),
                ));
            }
        }
        Ok(())
    }

    /// The result for `allocation`: clipped to [0, 1], with effective
    /// throughputs.
    pub fn result(&self, allocation: Allocation, objective: Option<f64>) -> PolicyResult {
        self.result_with_pairs(allocation, PairAllocation::new(), objective)
    }

    /// The result for an allocation with pairs sharing GPUs: clipped to
    /// [0, 1], pairs with no time dropped, each job's effective throughput
    /// counting its time alone and beside each partner.
    pub fn result_with_pairs(
        &self,
        mut allocation: Allocation,
        mut pair_allocation: PairAllocation,
        objective: Option<f64>,
    ) -> PolicyResult {
        for row in allocation.values_mut().chain(pair_allocation.values_mut()) {
            for x in row.values_mut() {
                *x = x.clamp(0.0, 1.0);
            }
        }
        pair_allocation.retain(|_, row| row.values().any(|x| *x > 0.0));
        let mut effective_throughput: BTreeMap<ProblemJobId, f64> = allocation
            .iter()
            .map(|(job, row)| {
                let e = row.iter().map(|(t, x)| self.throughput(*job, t) * x).sum();
                (*job, e)
            })
            .collect();
        for ((a, b), row) in &pair_allocation {
            for (t, x) in row {
                let [ta, tb] = self.pair_throughput(*a, *b, t).unwrap_or([0.0, 0.0]);
                *effective_throughput.entry(*a).or_default() += ta * x;
                *effective_throughput.entry(*b).or_default() += tb * x;
            }
        }
        PolicyResult {
            allocation,
            pair_allocation,
            effective_throughput,
            objective,
        }
    }
}
