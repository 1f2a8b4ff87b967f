//! `max_sum_throughput_perf`: maximise the cluster's total throughput
//! `Σ_i Σ_j T[i][j]·X[i][j]` under the shared constraints.

use good_lp::Expression;

use super::lp::{maximise, AllocationVars};
use super::{AllocationError, AllocationProblem, PolicyResult};

pub fn max_sum_throughput_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    if problem.throughputs.is_empty() {
        return Ok(problem.result(Default::default(), None));
    }
    let mut vars = good_lp::ProblemVariables::new();
    let lp = AllocationVars::new(problem, &mut vars);
    let constraints = lp.shared_constraints(problem);
    let objective: Expression = problem
        .throughputs
        .keys()
        .map(|job| lp.row_sum(*job, |t| problem.throughput(*job, t)))
        .sum();
    let solution = maximise(vars, objective.clone(), constraints)?;
    let value = objective.eval_with(&solution);
    Ok(problem.result(lp.allocation(&solution), Some(value)))
}
