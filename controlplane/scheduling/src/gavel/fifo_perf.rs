//! `fifo_perf`: jobs in arrival (id) order; each takes the type on which
//! it is fastest among those with room for its scale factor (ties: the
//! first type by name), whole (`X = 1`). Strict FIFO: the first job that
//! fits nowhere stops the pass, so no later job jumps ahead of it.
//!
//! Gavel's type-agnostic `fifo` is not offered here: its allocation always
//! names v100, even beyond capacity (a bug noted in
//! `shared/reference/gavel.md`); Keel's own `fifo` policy is the agnostic
//! one.

use std::collections::BTreeMap;

use super::{Allocation, AllocationProblem, PolicyResult};

pub fn fifo_perf(problem: &AllocationProblem) -> PolicyResult {
    let mut free: BTreeMap<&str, u32> = problem
        .cluster_spec
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(t, n)| (t.as_str(), *n))
        .collect();
    let mut allocation: Allocation = problem
        .throughputs
        .keys()
        .map(|job| {
            let row = problem
                .cluster_spec
                .keys()
                .map(|t| (t.clone(), 0.0))
                .collect();
            (*job, row)
        })
        .collect();
    for job in problem.throughputs.keys() {
        if free.is_empty() {
            break;
        }
        let s = problem.scale_factor(*job);
        let mut best: Option<(&str, f64)> = None;
        for (t, n) in &free {
            if *n < s {
                continue;
            }
            let speed = problem.throughput(*job, t);
            if best.is_none_or(|(_, b)| speed > b) {
                best = Some((t, speed));
            }
        }
        let Some((chosen, _)) = best else {
            break;
        };
        if let Some(x) = allocation.get_mut(job).and_then(|row| row.get_mut(chosen)) {
            *x = 1.0;
        }
        if let Some(n) = free.get_mut(chosen) {
            *n -= s;
            if *n == 0 {
                free.remove(chosen);
            }
        }
    }
    problem.result(allocation, None)
}
