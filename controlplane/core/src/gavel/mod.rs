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
mod isolated;
mod lp;
mod max_min_fairness;
mod max_sum_throughput;
mod max_sum_throughput_normalized_by_cost;
pub mod mechanism;
mod min_total_duration;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use allox::allox;
pub use fifo_perf::fifo_perf;
pub use finish_time_fairness::{finish_time_fairness, finish_time_fairness_perf};
pub use isolated::isolated;
pub use max_min_fairness::{max_min_fairness, max_min_fairness_perf};
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
}

/// Fractions of time by job, then GPU type.
pub type Allocation = BTreeMap<ProblemJobId, BTreeMap<String, f64>>;

/// A policy's answer: the allocation, each job's effective throughput and
/// the objective's value where the policy has one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyResult {
    pub allocation: Allocation,
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
];

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
        }
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
    pub fn result(&self, mut allocation: Allocation, objective: Option<f64>) -> PolicyResult {
        for row in allocation.values_mut() {
            for x in row.values_mut() {
                *x = x.clamp(0.0, 1.0);
            }
        }
        let effective_throughput = allocation
            .iter()
            .map(|(job, row)| {
                let e = row.iter().map(|(t, x)| self.throughput(*job, t) * x).sum();
                (*job, e)
            })
            .collect();
        PolicyResult {
            allocation,
            effective_throughput,
            objective,
        }
    }
}
