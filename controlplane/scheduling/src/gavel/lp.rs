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
    /// How many identical jobs each row stands for (see [`Classes`]); 1
    /// when absent.
    pub multiplicity: BTreeMap<ProblemJobId, f64>,
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
        AllocationVars {
            x,
            multiplicity: BTreeMap::new(),
        }
    }

    /// How many jobs the row of `job` stands for.
    pub fn count(&self, job: ProblemJobId) -> f64 {
        self.multiplicity.get(&job).copied().unwrap_or(1.0)
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
                    Some(f64::from(problem.scale_factor(*job)) * self.count(*job) * *v)
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

/// Clarabel's settings for the optimising LPs: ECOS's default tolerances
/// (1e-8, what Gavel solved with) rather than good_lp's tighter
/// feasibility tolerance, and no iterative refinement of the KKT solves
/// (a third of the solve time on these small, well-scaled problems; the
/// golden vectors and the fidelity runs are unchanged without it).
fn tune(model: &mut good_lp::solvers::clarabel::ClarabelProblem) {
    model
        .settings()
        .tol_feas(1e-8)
        .iterative_refinement_enable(false);
}

/// Maximises `objective` over `vars` subject to `constraints`.
pub(crate) fn maximise(
    vars: ProblemVariables,
    objective: Expression,
    constraints: Vec<good_lp::Constraint>,
) -> Result<impl Solution, AllocationError> {
    let mut model = vars.maximise(objective).using(clarabel);
    tune(&mut model);
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

/// Jobs that no policy can tell apart — the same throughputs, scale
/// factor and weight (and no remaining steps or start time in play) — as
/// one row standing for all of them. Active jobs come from a few dozen
/// model templates, so a problem of thousands of jobs has a few dozen
/// classes; the policies whose optimum can be taken the same for every
/// member of a class (max-min fairness, max-sum throughput: averaging an
/// optimum over permutations of identical jobs keeps it optimal) solve the
/// small problem and give every member its class's row. Gavel's own
/// scalable formulation groups jobs by type the same way.
#[derive(Debug, Clone)]
pub(crate) struct Classes {
    /// One representative job (the class's smallest id) per class.
    pub problem: AllocationProblem,
    /// Representative → how many jobs it stands for.
    pub multiplicity: BTreeMap<ProblemJobId, f64>,
    /// Representative → its members (itself included).
    pub members: BTreeMap<ProblemJobId, Vec<ProblemJobId>>,
}

impl Classes {
    /// The classes of `problem`'s jobs: by job type (the throughput row),
    /// scale factor and weight, for the type-agnostic forms too (as Gavel
    /// groups by job type).
    pub fn of(problem: &AllocationProblem) -> Classes {
        let types: Vec<&String> = problem.cluster_spec.keys().collect();
        let mut by_key: BTreeMap<Vec<u64>, ProblemJobId> = BTreeMap::new();
        let mut members: BTreeMap<ProblemJobId, Vec<ProblemJobId>> = BTreeMap::new();
        let mut key: Vec<u64> = Vec::with_capacity(types.len() + 2);
        for (job, row) in &problem.throughputs {
            key.clear();
            key.extend(
                types
                    .iter()
                    .map(|t| row.get(*t).copied().unwrap_or(0.0).to_bits()),
            );
            key.push(u64::from(problem.scale_factor(*job)));
            key.push(problem.weight(*job).to_bits());
            let representative = match by_key.get(&key) {
                Some(r) => *r,
                None => {
                    by_key.insert(key.clone(), *job);
                    *job
                }
            };
            members.entry(representative).or_default().push(*job);
        }
        let mut reduced = AllocationProblem::new(problem.cluster_spec.clone());
        reduced.instance_costs = problem.instance_costs.clone();
        for job in members.keys() {
            let copy = |from: &BTreeMap<ProblemJobId, f64>,
                        to: &mut BTreeMap<ProblemJobId, f64>| {
                if let Some(v) = from.get(job) {
                    to.insert(*job, *v);
                }
            };
            if let Some(row) = problem.throughputs.get(job) {
                reduced.throughputs.insert(*job, row.clone());
            }
            if let Some(s) = problem.scale_factors.get(job) {
                reduced.scale_factors.insert(*job, *s);
            }
            copy(&problem.priority_weights, &mut reduced.priority_weights);
            copy(&problem.times_since_start, &mut reduced.times_since_start);
            copy(
                &problem.num_steps_remaining,
                &mut reduced.num_steps_remaining,
            );
            copy(&problem.slos, &mut reduced.slos);
        }
        let multiplicity = members.iter().map(|(r, m)| (*r, m.len() as f64)).collect();
        Classes {
            problem: reduced,
            multiplicity,
            members,
        }
    }

    /// The classes' allocation given to every member.
    pub fn expand(&self, reduced: Allocation) -> Allocation {
        let mut out = Allocation::new();
        for (representative, row) in reduced {
            for member in self.members.get(&representative).into_iter().flatten() {
                out.insert(*member, row.clone());
            }
        }
        out
    }
}
