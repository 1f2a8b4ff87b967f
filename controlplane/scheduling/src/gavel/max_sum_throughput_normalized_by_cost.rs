//! `max_sum_throughput_normalized_by_cost_perf`: maximise the cluster's
//! throughput per dollar, `Σ_i Σ_j T[i][j]/c_j·X[i][j]` with `c_j` the
//! type's price per hour ([`AllocationProblem::instance_costs`]; 1 where
//! none is given), under the shared constraints. Jobs with a deadline
//! ([`AllocationProblem::slos`], seconds from now) must also get
//! `Σ_j T[i][j]·X[i][j] ≥ remaining_i / deadline_i`; when no allocation
//! meets every deadline, the deadlines are dropped (as Gavel does).
//! Identical jobs are solved as one class when no deadline is in play.

use good_lp::{constraint, Expression};

use super::lp::{maximise, AllocationVars, Classes};
use super::{AllocationError, AllocationProblem, PolicyResult};

pub fn max_sum_throughput_normalized_by_cost_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    if problem.throughputs.is_empty() {
        return Ok(problem.result(Default::default(), None));
    }
    if !problem.slos.is_empty() {
        if let Ok(result) = solve(problem, problem, None, true) {
            return Ok(result);
        }
    }
    let classes = Classes::of(problem);
    solve(problem, &classes.problem, Some(&classes), false)
}

fn price(problem: &AllocationProblem, gpu_type: &str) -> f64 {
    problem
        .instance_costs
        .get(gpu_type)
        .copied()
        .filter(|c| *c > 0.0)
        .unwrap_or(1.0)
}

fn solve(
    problem: &AllocationProblem,
    reduced: &AllocationProblem,
    classes: Option<&Classes>,
    with_slos: bool,
) -> Result<PolicyResult, AllocationError> {
    let mut vars = good_lp::ProblemVariables::new();
    let mut lp = AllocationVars::new(reduced, &mut vars);
    if let Some(c) = classes {
        lp.multiplicity = c.multiplicity.clone();
    }
    let mut constraints = lp.shared_constraints(reduced);
    if with_slos {
        for (job, deadline_s) in &reduced.slos {
            let Some(remaining) = reduced.num_steps_remaining.get(job) else {
                continue;
            };
            let needed = remaining / deadline_s.max(1e-9);
            let thr = lp.row_sum(*job, |t| reduced.throughput(*job, t));
            constraints.push(constraint!(thr >= needed));
        }
    }
    let objective: Expression = reduced
        .throughputs
        .keys()
        .map(|job| {
            lp.count(*job) * lp.row_sum(*job, |t| reduced.throughput(*job, t) / price(reduced, t))
        })
        .sum();
    let solution = maximise(vars, objective.clone(), constraints)?;
    let value = objective.eval_with(&solution);
    let allocation = lp.allocation(&solution);
    let allocation = match classes {
        Some(c) => c.expand(allocation),
        None => allocation,
    };
    Ok(problem.result(allocation, Some(value)))
}
