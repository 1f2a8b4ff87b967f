//! `isolated`: every job gets an equal share of every type, `N_j / m`
//! GPUs of type `j` for `m` jobs, as a fraction of time `(N_j/m)/s_i`;
//! a row that sums past 1 is scaled down to 1.

use super::{Allocation, AllocationProblem, PolicyResult};

pub fn isolated(problem: &AllocationProblem) -> PolicyResult {
    let m = problem.throughputs.len().max(1) as f64;
    let mut allocation = Allocation::new();
    for job in problem.throughputs.keys() {
        let s = f64::from(problem.scale_factor(*job));
        let mut row: std::collections::BTreeMap<String, f64> = problem
            .cluster_spec
            .iter()
            .map(|(t, n)| (t.clone(), f64::from(*n) / m / s))
            .collect();
        let total: f64 = row.values().sum();
        if total > 1.0 {
            for x in row.values_mut() {
                *x /= total;
            }
        }
        allocation.insert(*job, row);
    }
    problem.result(allocation, None)
}
