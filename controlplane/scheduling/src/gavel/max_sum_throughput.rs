//! `max_sum_throughput_perf`: maximise the cluster's total throughput
//! `Σ_i Σ_j T[i][j]·X[i][j]` under the shared constraints. Identical jobs
//! are solved as one class ([`Classes`]).

use good_lp::Expression;

use super::lp::{maximise, AllocationVars, Classes};
use super::{AllocationError, AllocationProblem, PolicyResult};

pub fn max_sum_throughput_perf(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    if problem.throughputs.is_empty() {
        return Ok(problem.result(Default::default(), None));
    }
    let classes = Classes::of(problem);
    let reduced = &classes.problem;
    let mut vars = good_lp::ProblemVariables::new();
    let mut lp = AllocationVars::new(reduced, &mut vars);
    lp.multiplicity = classes.multiplicity.clone();
    let constraints = lp.shared_constraints(reduced);
    let objective: Expression = reduced
        .throughputs
        .keys()
        .map(|job| lp.count(*job) * lp.row_sum(*job, |t| reduced.throughput(*job, t)))
        .sum();
    let solution = maximise(vars, objective.clone(), constraints)?;
    let value = objective.eval_with(&solution);
    Ok(problem.result(classes.expand(lp.allocation(&solution)), Some(value)))
}
