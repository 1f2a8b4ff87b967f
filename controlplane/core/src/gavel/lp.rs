//! The linear programmes' shared part: one variable `X[i][j]` per job and
//! type in [0, 1], the shared constraints, and solving with Clarabel.

use std::collections::BTreeMap;

use good_lp::{
    clarabel, constraint, variable, Expression, ProblemVariables, Solution, SolverModel, Variable,
};

use super::{Allocation, AllocationError, AllocationProblem, ProblemJobId};

/// The allocation variables of an LP.
pub(crate) struct AllocationVars {
    /// `X[i][j]`, by job then type (the problem's type order).
    pub x: BTreeMap<ProblemJobId, Vec<(String, Variable)>>,
}

impl AllocationVars {
    /// Adds `X[i][j] ≥ 0` to `vars` for every job and type. No upper
    /// bound: `X ≤ 1` follows from each row summing to at most 1, and the
    /// extra rows made the KKT system large enough that Clarabel's AMD
    /// ordering no longer set the dense capacity rows aside (2,048 jobs:
    /// 223 ms with them, 77 ms without).
    pub fn new(problem: &AllocationProblem, vars: &mut ProblemVariables) -> AllocationVars {
        let types = problem.types();
        let x = problem
            .throughputs
            .keys()
            .map(|job| {
                let row = types
                    .iter()
                    .map(|t| (t.to_string(), vars.add(variable().min(0.0))))
                    .collect();
                (*job, row)
            })
            .collect();
        AllocationVars { x }
    }

    /// `Σ_j coefficient(i, j)·X[i][j]` for job `i`.
    pub fn row_sum(&self, job: ProblemJobId, coefficient: impl Fn(&str) -> f64) -> Expression {
        self.x
            .get(&job)
            .map(|row| {
                row.iter()
                    .map(|(t, v)| coefficient(t) * *v)
                    .sum::<Expression>()
            })
            .unwrap_or_default()
    }

    /// The shared constraints: each job's fractions sum to at most 1, and
    /// no type holds more scale-factor-weighted time than it has GPUs.
    pub fn shared_constraints(&self, problem: &AllocationProblem) -> Vec<good_lp::Constraint> {
        let mut out = Vec::new();
        for row in self.x.values() {
            let total: Expression = row.iter().map(|(_, v)| *v).sum();
            out.push(constraint!(total <= 1.0));
        }
        for (j, (gpu_type, n)) in problem.cluster_spec.iter().enumerate() {
            let used: Expression = self
                .x
                .iter()
                .filter_map(|(job, row)| {
                    let (t, v) = row.get(j)?;
                    debug_assert_eq!(t, gpu_type);
                    Some(f64::from(problem.scale_factor(*job)) * *v)
                })
                .sum();
            out.push(constraint!(used <= f64::from(*n)));
        }
        out
    }

    /// Reads `X` from a solution.
    pub fn allocation(&self, solution: &impl Solution) -> Allocation {
        self.x
            .iter()
            .map(|(job, row)| {
                let values = row
                    .iter()
                    .map(|(t, v)| (t.clone(), solution.value(*v)))
                    .collect();
                (*job, values)
            })
            .collect()
    }
}

/// Maximises `objective` over `vars` subject to `constraints`.
pub(crate) fn maximise(
    vars: ProblemVariables,
    objective: Expression,
    constraints: Vec<good_lp::Constraint>,
) -> Result<impl Solution, AllocationError> {
    let mut model = vars.maximise(objective).using(clarabel);
    for c in constraints {
        model = model.with(c);
    }
    model
        .solve()
        .map_err(|e| AllocationError::Solver(e.to_string()))
}

/// An allocation in which every job `i` with a bound gets at least
/// `bound_i` effective throughput (counted with `throughput`), or `None`
/// when there is none. The LP has no objective: the interior-point solver
/// returns a point inside the feasible set. Bisections drive these LPs to
/// the edge of feasibility, where the solver may stop on a numerical
/// error or its iteration limit: that counts as infeasible (the search
/// keeps its last feasible allocation, a little less tight).
pub(crate) fn feasible(
    problem: &AllocationProblem,
    bounds: &BTreeMap<ProblemJobId, f64>,
    throughput: &dyn Fn(ProblemJobId, &str) -> f64,
) -> Result<Option<(Allocation, impl Solution)>, AllocationError> {
    let mut vars = ProblemVariables::new();
    let lp = AllocationVars::new(problem, &mut vars);
    let mut constraints = lp.shared_constraints(problem);
    for (job, bound) in bounds {
        let thr = lp.row_sum(*job, |t| throughput(*job, t));
        constraints.push(constraint!(thr >= *bound));
    }
    let mut model = vars.maximise(Expression::from(0.0)).using(clarabel);
    for c in constraints {
        model = model.with(c);
    }
    match model.solve() {
        Ok(solution) => Ok(Some((lp.allocation(&solution), solution))),
        Err(_) => Ok(None),
    }
}
