//! Least attained service over GPU types (Gavel's `max_min_fairness_perf`,
//! heterogeneity-aware) and its agnostic form (`max_min_fairness`, every
//! type counted as equally fast): maximise `min_i Σ_j c_ij·X[i][j]` with
//! `c_ij = T[i][j]·s_i / (w_i·prop_i)` and `prop_i = Σ_j T[i][j]·N_j / Σ_k N_k`
//! (the job's throughput on an equal share of the whole cluster), as one
//! LP with an auxiliary variable `t ≤` every job's normalised throughput.
//! Identical jobs are solved as one class ([`Classes`]).

use good_lp::{constraint, variable, Expression};

use super::lp::{maximise, AllocationVars, Classes};
use super::{AllocationError, AllocationProblem, PolicyResult};

/// The heterogeneity-aware form.
pub fn max_min_fairness_perf(problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve(problem, |job, t| problem.throughput(job, t))
}

/// The agnostic form: every type counted at throughput 1.
pub fn max_min_fairness(problem: &AllocationProblem) -> Result<PolicyResult, AllocationError> {
    solve(problem, |_, _| 1.0)
}

fn solve(
    problem: &AllocationProblem,
    throughput: impl Fn(u64, &str) -> f64,
) -> Result<PolicyResult, AllocationError> {
    if problem.throughputs.is_empty() {
        return Ok(problem.result(Default::default(), None));
    }
    let classes = Classes::of(problem);
    let reduced = &classes.problem;
    let total_gpus: f64 = problem.cluster_spec.values().map(|n| f64::from(*n)).sum();
    let mut vars = good_lp::ProblemVariables::new();
    let mut lp = AllocationVars::new(reduced, &mut vars);
    lp.multiplicity = classes.multiplicity.clone();
    let t = vars.add(variable());
    let mut constraints = lp.shared_constraints(reduced);
    for job in reduced.throughputs.keys() {
        let prop: f64 = reduced
            .cluster_spec
            .iter()
            .map(|(ty, n)| throughput(*job, ty) * f64::from(*n))
            .sum::<f64>()
            / total_gpus.max(1.0);
        let scale = f64::from(reduced.scale_factor(*job)) / (reduced.weight(*job) * prop);
        if !scale.is_finite() {
            // No throughput anywhere: the job cannot be served; leave it
            // out of the minimum.
            continue;
        }
        let normalised: Expression = lp.row_sum(*job, |ty| throughput(*job, ty) * scale);
        constraints.push(constraint!(normalised >= t));
    }
    let solution = maximise(vars, t.into(), constraints)?;
    let objective = good_lp::Solution::value(&solution, t);
    Ok(problem.result(classes.expand(lp.allocation(&solution)), Some(objective)))
}
