//! Finish-time fairness (Themis, as Gavel formulates it):
//! `finish_time_fairness_perf` minimises the largest ratio
//! `ρ_i = (t_i + rem_i / thr_i(X)) / (rem_i / iso_i)` of a job's expected
//! finish time under the allocation to its finish time on an isolated
//! share (`t_i` time since start, `rem_i` steps left, `iso_i` throughput
//! under [`super::isolated`]). `finish_time_fairness` is the agnostic form:
//! every type counted at the job's v100 throughput.
//!
//! `ρ` is quasi-convex in `X`; for a fixed `ρ` the constraint
//! `ρ_i ≤ ρ` is linear (`thr_i ≥ rem_i / (ρ·D_i − t_i)` with
//! `D_i = rem_i / iso_i`), so the smallest feasible `ρ` is found by
//! bisection over LP feasibility. A first solve carries no accumulated
//! isolated time (Gavel's `C_i` starts at 0).

use std::collections::BTreeMap;

use super::lp::feasible;
use super::{isolated, AllocationError, AllocationProblem, PolicyResult, ProblemJobId};

/// Most bisection steps (the search stops once the bracket is within
/// 1e-7 of ρ, far below the 1e-3 the golden vectors are held to).
const BISECTION_STEPS: usize = 60;

pub fn finish_time_fairness_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    solve(problem, &|job, t| problem.throughput(job, t))
}

pub fn finish_time_fairness(problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve(problem, &|job, _| problem.throughput(job, "v100"))
}

fn solve(
    problem: &AllocationProblem,
    throughput: &dyn Fn(ProblemJobId, &str) -> f64,
) -> Result<PolicyResult, AllocationError> {
    // Isolated throughputs, counted the same way.
    let iso_allocation = isolated(problem).allocation;
    let mut jobs: BTreeMap<ProblemJobId, (f64, f64, f64)> = BTreeMap::new();
    for (job, row) in &iso_allocation {
        let iso: f64 = row.iter().map(|(t, x)| throughput(*job, t) * x).sum();
        let rem = problem.num_steps_remaining.get(job).copied().unwrap_or(0.0);
        let since = problem.times_since_start.get(job).copied().unwrap_or(0.0);
        if iso > 0.0 && rem > 0.0 {
            jobs.insert(*job, (rem, since, rem / iso));
        }
    }
    if jobs.is_empty() {
        return Ok(problem.result(iso_allocation, None));
    }
    let bounds_at = |rho: f64| -> Option<BTreeMap<ProblemJobId, f64>> {
        jobs.iter()
            .map(|(job, (rem, since, d))| {
                let room = rho * d - since;
                (room > 0.0).then(|| (*job, rem / room))
            })
            .collect()
    };
    // ρ on the isolated allocation is always reachable.
    let mut hi = jobs
        .values()
        .map(|(_, since, d)| (since + d) / d)
        .fold(0.0f64, f64::max);
    let mut lo = jobs
        .values()
        .map(|(_, since, d)| since / d)
        .fold(0.0f64, f64::max);
    let mut best = match bounds_at(hi) {
        Some(b) => feasible(problem, &b, throughput)?.map(|(a, _)| a),
        None => None,
    };
    for _ in 0..BISECTION_STEPS {
        if hi - lo <= 1e-7 * hi.max(1.0) {
            break;
        }
        let mid = (lo + hi) / 2.0;
        match bounds_at(mid) {
            Some(b) => match feasible(problem, &b, throughput)? {
                Some((a, _)) => {
                    hi = mid;
                    best = Some(a);
                }
                None => lo = mid,
            },
            None => lo = mid,
        }
    }
    let allocation = best.unwrap_or(iso_allocation);
    // The objective: the largest ratio the allocation actually gives.
    let rho = jobs
        .iter()
        .map(|(job, (rem, since, d))| {
            let thr: f64 = allocation
                .get(job)
                .map(|row| row.iter().map(|(t, x)| throughput(*job, t) * x).sum())
                .unwrap_or(0.0);
            if thr > 0.0 {
                (since + rem / thr) / d
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0f64, f64::max);
    Ok(problem.result(allocation, Some(rho)))
}
