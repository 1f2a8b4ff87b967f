//! `allox` (AlloX, as Gavel implements and runs it): single-GPU jobs
//! matched to GPUs by a min-cost bipartite matching.
//!
//! Jobs that hold a whole GPU in the last solve's allocation keep it. The
//! others, oldest first, are matched to slots (a free GPU `g`, position
//! `k` from the end of its queue) at cost `k·remaining/T[i][type(g)] +
//! time_since_start_i`: a job `k`-th from the end delays `k − 1` others by
//! its run time. Each GPU's first job gets `X = 1` on its type; the rest
//! wait for a later solve. Gavel runs AlloX with α = 1: every waiting job
//! is matched (α < 1 would look at only that share of them, and at least
//! as many as there are free GPUs). Solved exactly by Kuhn–Munkres (the
//! `pathfinding` crate) on costs in milliseconds.

use pathfinding::kuhn_munkres::kuhn_munkres_min;
use pathfinding::matrix::Matrix;

use super::{Allocation, AllocationError, AllocationProblem, PolicyResult, ProblemJobId};

/// The share of waiting jobs matched per solve (when more than the free
/// GPUs); Gavel's `get_policy('allox')` sets 1.
const ALPHA: f64 = 1.0;

/// Most cost-matrix entries (`jobs² × free GPUs`) one solve builds; past
/// it, only the oldest waiting jobs are matched.
const MATRIX_MAX: usize = 20_000_000;

/// A cost no real slot reaches (a type the job cannot run on).
const UNREACHABLE_MS: i64 = i64::MAX / 1_000_000;

/// `allox` on `problem`, keeping the jobs that hold a whole GPU in
/// `previous` (the last solve's allocation).
pub fn allox(
    problem: &AllocationProblem,
    previous: &Allocation,
) -> Result<PolicyResult, AllocationError> {
    for (job, s) in &problem.scale_factors {
        if *s != 1 && problem.throughputs.contains_key(job) {
            return Err(AllocationError::Invalid {
                field: "scale_factors".into(),
                reason: format!("allox places single-GPU jobs only; job {job} has {s}"),
            });
        }
    }
    let types: Vec<&String> = problem.cluster_spec.keys().collect();
    let mut allocation: Allocation = problem
        .throughputs
        .keys()
        .map(|job| (*job, types.iter().map(|t| ((*t).clone(), 0.0)).collect()))
        .collect();
    let mut free: Vec<u32> = types.iter().map(|t| problem.cluster_spec[*t]).collect();
    let mut waiting: Vec<ProblemJobId> = Vec::new();
    for job in problem.throughputs.keys() {
        // Gavel's test: the row sums to a whole GPU.
        let held = previous
            .get(job)
            .filter(|row| (row.values().sum::<f64>() - 1.0).abs() < 1e-9);
        let Some(row) = held else {
            waiting.push(*job);
            continue;
        };
        for (ti, t) in types.iter().enumerate() {
            let x = row.get(*t).copied().unwrap_or(0.0);
            if x >= 1.0 - 1e-9 {
                free[ti] = free[ti].saturating_sub(1);
            }
            if let Some(slot) = allocation.get_mut(job).and_then(|r| r.get_mut(*t)) {
                *slot = x.clamp(0.0, 1.0);
            }
        }
    }
    // One column per free GPU, by type.
    let gpu_type: Vec<usize> = free
        .iter()
        .enumerate()
        .flat_map(|(ti, n)| std::iter::repeat_n(ti, *n as usize))
        .collect();
    let n = gpu_type.len();
    if n == 0 || waiting.is_empty() {
        return Ok(problem.result(allocation, None));
    }
    // Oldest first (a stable sort: ties in id order).
    let since = |job: &ProblemJobId| problem.times_since_start.get(job).copied().unwrap_or(0.0);
    waiting.sort_by(|a, b| since(b).total_cmp(&since(a)));
    let mut m = n
        .max((ALPHA * waiting.len() as f64) as usize)
        .min(waiting.len());
    while m > 1 && m * m * n > MATRIX_MAX {
        m -= 1;
    }
    waiting.truncate(m);
    let cost = |row: usize, column: usize| -> i64 {
        let job = waiting[row];
        let (k, g) = (column / n + 1, column % n);
        let speed = problem.throughput(job, types[gpu_type[g]]);
        let remaining = problem
            .num_steps_remaining
            .get(&job)
            .copied()
            .unwrap_or(0.0);
        if speed <= 0.0 {
            return UNREACHABLE_MS;
        }
        let seconds = k as f64 * remaining / speed + since(&job);
        ((seconds * 1000.0).round() as i64).min(UNREACHABLE_MS)
    };
    let weights = Matrix::from_fn(m, m * n, |(row, column)| cost(row, column));
    let (_, assignment) = kuhn_munkres_min(&weights);
    // Per GPU, the job matched to the largest k runs first.
    let mut first: Vec<Option<(usize, ProblemJobId)>> = vec![None; n];
    for (row, column) in assignment.iter().enumerate() {
        let (k, g) = (column / n, column % n);
        if first[g].is_none_or(|(best, _)| k > best) {
            first[g] = Some((k, waiting[row]));
        }
    }
    for (g, chosen) in first.iter().enumerate() {
        let Some((_, job)) = chosen else {
            continue;
        };
        if problem.throughput(*job, types[gpu_type[g]]) <= 0.0 {
            continue;
        }
        if let Some(x) = allocation
            .get_mut(job)
            .and_then(|r| r.get_mut(types[gpu_type[g]]))
        {
            *x = 1.0;
        }
    }
    Ok(problem.result(allocation, None))
}
