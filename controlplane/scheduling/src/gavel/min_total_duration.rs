//! Makespan minimisation (Gavel's `min_total_duration_perf`): the
//! shortest horizon `H` in which every job can finish, by bisection over
//! the feasibility LP `thr_i(X) ≥ rem_i / H`, exactly as Gavel runs it:
//! `H` starts in [100 s, 10⁶ s] (the top widened ×10 while infeasible) and
//! the search stops once `1.05·H_lo ≥ H_hi`, keeping the last feasible `X`.
//! `min_total_duration` is the agnostic form (every type counted at the
//! job's v100 throughput).

use std::collections::BTreeMap;

use super::lp::feasible;
use super::{AllocationError, AllocationProblem, PolicyResult, ProblemJobId};

/// Widenings of the top of the bracket before giving up.
const WIDENINGS_MAX: usize = 12;

pub fn min_total_duration_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    solve(problem, &|job, t| problem.throughput(job, t))
}

pub fn min_total_duration(problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve(problem, &|job, _| problem.throughput(job, "v100"))
}

fn solve(
    problem: &AllocationProblem,
    throughput: &dyn Fn(ProblemJobId, &str) -> f64,
) -> Result<PolicyResult, AllocationError> {
    let bounds_at = |h: f64| -> BTreeMap<ProblemJobId, f64> {
        problem
            .throughputs
            .keys()
            .map(|job| {
                let rem = problem.num_steps_remaining.get(job).copied().unwrap_or(0.0);
                (*job, rem.max(0.0) / h)
            })
            .collect()
    };
    let (mut lo, mut hi) = (100.0f64, 1e6f64);
    let mut kept = None;
    for _ in 0..=WIDENINGS_MAX {
        if let Some((a, _)) = feasible(problem, &bounds_at(hi), throughput)? {
            kept = Some(a);
            break;
        }
        lo = hi;
        hi *= 10.0;
    }
    let Some(mut best) = kept else {
        return Err(AllocationError::Solver(format!(
            "no horizon up to {hi} s lets every job finish"
        )));
    };
    while 1.05 * lo < hi {
        let mid = (lo + hi) / 2.0;
        match feasible(problem, &bounds_at(mid), throughput)? {
            Some((a, _)) => {
                hi = mid;
                best = a;
            }
            None => lo = mid,
        }
    }
    // The objective: the makespan the kept allocation actually gives.
    let makespan = problem
        .throughputs
        .keys()
        .map(|job| {
            let rem = problem.num_steps_remaining.get(job).copied().unwrap_or(0.0);
            let thr: f64 = best
                .get(job)
                .map(|row| row.iter().map(|(t, x)| throughput(*job, t) * x).sum())
                .unwrap_or(0.0);
            if rem <= 0.0 {
                0.0
            } else if thr > 0.0 {
                rem / thr
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0f64, f64::max);
    Ok(problem.result(best, Some(makespan)))
}
