//! Finish-time fairness (Themis, as Gavel formulates it):
//! `finish_time_fairness_perf` minimises the largest ratio
//! `ρ_i = (t_i + rem_i / thr_i(X)) / (C_i + rem_i / iso_i)` of a job's
//! expected finish time under the allocation to its finish time on an
//! isolated share (`t_i` time since start, `rem_i` steps left, `iso_i`
//! throughput under [`super::isolated`], `C_i` the isolated time the job
//! has already been credited with: Gavel's accumulator, carried between
//! solves by [`FinishTimeMemory`]; 0 on a first solve).
//! `finish_time_fairness` is the agnostic form: every type counted at the
//! job's v100 throughput. Priority weights are not used (nor by Gavel).
//!
//! The programme is convex and solved in one go as a second-order-cone
//! programme (Clarabel, as Gavel's cvxpy hands its form to ECOS): with
//! `u_i = thr_i(X)/iso_i` and `v_i = (ρ·D_i − t_i)·iso_i/rem_i` (`D_i` the
//! denominator), `ρ_i ≤ ρ` is `u_i·v_i ≥ 1`, the rotated cone
//! `‖(u_i − v_i, 2)‖ ≤ u_i + v_i`; minimise `ρ` subject to it and the
//! shared constraints.

use std::collections::BTreeMap;

use clarabel::algebra::CscMatrix;
use clarabel::solver::{
    DefaultSettingsBuilder, DefaultSolver, IPSolver, SolverStatus, SupportedConeT,
};

use super::{isolated, Allocation, AllocationError, AllocationProblem, PolicyResult, ProblemJobId};

pub fn finish_time_fairness_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    solve(problem, false, &BTreeMap::new())
}

pub fn finish_time_fairness(problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve(problem, true, &BTreeMap::new())
}

/// What Gavel's finish-time fairness carries from one solve to the next:
/// per job, the isolated time credited so far (`C_i`), and the steps left
/// and isolated throughput at the last solve.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FinishTimeMemory {
    credited_s: BTreeMap<ProblemJobId, f64>,
    last: BTreeMap<ProblemJobId, (f64, f64)>,
}

impl FinishTimeMemory {
    /// Solves `problem` (agnostic form when `agnostic`): first credits
    /// each job with the isolated time its progress since the last solve
    /// stands for (`Δrem / iso_prev`), then remembers this solve's figures.
    pub fn solve(
        &mut self,
        problem: &AllocationProblem,
        agnostic: bool,
    ) -> Result<PolicyResult, AllocationError> {
        let iso = isolated_throughputs(problem, agnostic);
        self.credited_s
            .retain(|job, _| problem.throughputs.contains_key(job));
        for job in problem.throughputs.keys() {
            let rem = remaining(problem, *job);
            let credited = self.credited_s.entry(*job).or_insert(0.0);
            if let Some((rem_prev, iso_prev)) = self.last.get(job) {
                if *iso_prev > 0.0 {
                    *credited += (rem_prev - rem) / iso_prev;
                }
            }
        }
        self.last = problem
            .throughputs
            .keys()
            .map(|job| {
                let i = iso.get(job).copied().unwrap_or(0.0);
                (*job, (remaining(problem, *job), i))
            })
            .collect();
        solve(problem, agnostic, &self.credited_s)
    }
}

fn remaining(problem: &AllocationProblem, job: ProblemJobId) -> f64 {
    problem
        .num_steps_remaining
        .get(&job)
        .copied()
        .unwrap_or(0.0)
}

/// The steps per second of `job` on `gpu_type` as the form counts them.
fn speed(problem: &AllocationProblem, agnostic: bool, job: ProblemJobId, gpu_type: &str) -> f64 {
    problem.throughput(job, if agnostic { "v100" } else { gpu_type })
}

/// Each job's throughput on its isolated share.
fn isolated_throughputs(
    problem: &AllocationProblem,
    agnostic: bool,
) -> BTreeMap<ProblemJobId, f64> {
    isolated(problem)
        .allocation
        .iter()
        .map(|(job, row)| {
            let iso = row
                .iter()
                .map(|(t, x)| speed(problem, agnostic, *job, t) * x)
                .sum();
            (*job, iso)
        })
        .collect()
}

/// One job in the cone constraints: `v = a·ρ − c`, `a = D·iso/rem`,
/// `c = t·iso/rem`.
struct Ratio {
    job: ProblemJobId,
    iso: f64,
    a: f64,
    c: f64,
    /// `t`, `rem` and `D`, for the objective's value.
    since_s: f64,
    rem: f64,
    denominator_s: f64,
}

fn solve(
    problem: &AllocationProblem,
    agnostic: bool,
    credited_s: &BTreeMap<ProblemJobId, f64>,
) -> Result<PolicyResult, AllocationError> {
    let iso_allocation = isolated(problem).allocation;
    let iso = isolated_throughputs(problem, agnostic);
    let ratios: Vec<Ratio> = iso
        .iter()
        .filter_map(|(job, i)| {
            let rem = remaining(problem, *job);
            let since_s = problem.times_since_start.get(job).copied().unwrap_or(0.0);
            let credited = credited_s.get(job).copied().unwrap_or(0.0);
            let denominator_s = credited + rem / i;
            (*i > 0.0 && rem > 0.0 && denominator_s > 0.0).then(|| Ratio {
                job: *job,
                iso: *i,
                a: denominator_s * i / rem,
                c: since_s * i / rem,
                since_s,
                rem,
                denominator_s,
            })
        })
        .collect();
    if ratios.is_empty() {
        return Ok(problem.result(iso_allocation, None));
    }

    // Variables: X[i][j] (job-major, the problem's type order), then ρ.
    let types = problem.types();
    let jobs: Vec<ProblemJobId> = problem.throughputs.keys().copied().collect();
    let n_types = types.len();
    let var = |job_index: usize, type_index: usize| job_index * n_types + type_index;
    let rho = jobs.len() * n_types;
    let n = rho + 1;
    let position: BTreeMap<ProblemJobId, usize> =
        jobs.iter().enumerate().map(|(i, j)| (*j, i)).collect();

    // Rows of `A·x + s = b`: nonnegative rows first (X ≥ 0, time per job,
    // GPUs per type), then one 3-row cone per job.
    let (mut rows, mut cols, mut vals) = (Vec::new(), Vec::new(), Vec::new());
    let mut b = Vec::new();
    let mut row = 0usize;
    for v in 0..rho {
        rows.push(row);
        cols.push(v);
        vals.push(-1.0);
        b.push(0.0);
        row += 1;
    }
    for ji in 0..jobs.len() {
        for ti in 0..n_types {
            rows.push(row);
            cols.push(var(ji, ti));
            vals.push(1.0);
        }
        b.push(1.0);
        row += 1;
    }
    for (ti, n_gpus) in problem.cluster_spec.values().enumerate() {
        for (ji, job) in jobs.iter().enumerate() {
            rows.push(row);
            cols.push(var(ji, ti));
            vals.push(f64::from(problem.scale_factor(*job)));
        }
        b.push(f64::from(*n_gpus));
        row += 1;
    }
    let nonnegative = row;
    for r in &ratios {
        let ji = position.get(&r.job).copied().unwrap_or(0);
        // s0 = u + v, s1 = u − v, s2 = 2, with u = Σ_j (T_ij/iso)·X_ij and
        // v = a·ρ − c; `s = b − A·x`.
        for (sign, offset) in [(1.0, 0usize), (-1.0, 1)] {
            for (ti, t) in types.iter().enumerate() {
                let coefficient = speed(problem, agnostic, r.job, t) / r.iso;
                if coefficient != 0.0 {
                    rows.push(row + offset);
                    cols.push(var(ji, ti));
                    vals.push(-coefficient);
                }
            }
            rows.push(row + offset);
            cols.push(rho);
            vals.push(-sign * r.a);
            b.push(-sign * r.c);
        }
        b.push(2.0);
        row += 3;
    }
    let a = CscMatrix::new_from_triplets(row, n, rows, cols, vals);
    let p = CscMatrix::zeros((n, n));
    let mut q = vec![0.0; n];
    q[rho] = 1.0;
    let mut cones = vec![SupportedConeT::NonnegativeConeT(nonnegative)];
    cones.extend(ratios.iter().map(|_| SupportedConeT::SecondOrderConeT(3)));
    let settings = DefaultSettingsBuilder::default()
        .verbose(false)
        .build()
        .map_err(|e| AllocationError::Solver(e.to_string()))?;
    let mut solver = DefaultSolver::new(&p, &q, &a, &b, &cones, settings)
        .map_err(|e| AllocationError::Solver(e.to_string()))?;
    solver.solve();
    let solution = &solver.solution;
    if !matches!(
        solution.status,
        SolverStatus::Solved | SolverStatus::AlmostSolved
    ) {
        // As Gavel: no allocation from the solver, the isolated one.
        return Ok(problem.result(iso_allocation, None));
    }
    let allocation: Allocation = jobs
        .iter()
        .enumerate()
        .map(|(ji, job)| {
            let row = types
                .iter()
                .enumerate()
                .map(|(ti, t)| (t.to_string(), solution.x[var(ji, ti)].max(0.0)))
                .collect();
            (*job, row)
        })
        .collect();
    // The objective: the largest ratio the allocation actually gives.
    let worst = ratios
        .iter()
        .map(|r| {
            let thr: f64 = allocation
                .get(&r.job)
                .map(|row| {
                    row.iter()
                        .map(|(t, x)| speed(problem, agnostic, r.job, t) * x)
                        .sum()
                })
                .unwrap_or(0.0);
            if thr > 0.0 {
                (r.since_s + r.rem / thr) / r.denominator_s
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0f64, f64::max);
    Ok(problem.result(allocation, Some(worst)))
}
