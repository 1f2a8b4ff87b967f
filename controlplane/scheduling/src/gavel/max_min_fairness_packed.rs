//! `max_min_fairness_packed`: heterogeneity-aware max-min fairness where
//! two jobs of one size may also share the same GPUs (space sharing),
//! each then running at its pair throughput.
//!
//! Besides `X[i][j]` (job `i` alone on type `j`), a pair `(i, k)` gets
//! `Z[i,k][j]`, the time the two share type `j`. Per job, time alone and
//! in every pair sums to at most 1; per type, `s·X` over jobs plus `s·Z`
//! over pairs stays within the GPUs (a pair uses one job's GPUs). Job
//! `i`'s normalised throughput is `(Σ_j T[i][j]·X[i][j] + Σ_k Σ_j
//! P[i|k][j]·Z[i,k][j])·s_i / (w_i·Σ_j T[i][j])`, Gavel's normalisation
//! for its packed policies; the LP maximises the smallest.
//!
//! One variable per pair of jobs is n²/2 of them (Gavel's simulator
//! solves that form: seconds at a few hundred jobs). Jobs of one class —
//! job type, size, weight and throughputs — are interchangeable, so this
//! solves Gavel's job-type form instead: one variable per class alone and
//! per pair of classes, with every pair of members given its classes'
//! value. Averaging an optimum over permutations of interchangeable jobs
//! keeps it feasible and no worse for a max-min objective, so the class
//! form loses nothing.

use std::collections::BTreeMap;

use good_lp::{constraint, variable, Expression, ProblemVariables, Solution, Variable};

use super::lp::maximise;
use super::{
    Allocation, AllocationError, AllocationProblem, PairAllocation, PolicyResult, ProblemJobId,
};

/// Values below this are the solver's noise, read as 0.
const NOISE: f64 = 1e-9;

/// Interchangeable jobs.
struct Class {
    members: Vec<ProblemJobId>,
    representative: ProblemJobId,
    scale_factor: u32,
}

/// What makes jobs interchangeable: job type, scale factor, weight (its
/// bits) and throughputs (their bits, by type).
type ClassKey<'a> = (Option<&'a str>, u32, u64, Vec<u64>);

/// Groups jobs by [`ClassKey`].
fn classes(problem: &AllocationProblem) -> Vec<Class> {
    let types = problem.types();
    let mut by_key: BTreeMap<ClassKey<'_>, usize> = BTreeMap::new();
    let mut out: Vec<Class> = Vec::new();
    for (job, row) in &problem.throughputs {
        let key = (
            problem.job_types.get(job).map(String::as_str),
            problem.scale_factor(*job),
            problem.weight(*job).to_bits(),
            types
                .iter()
                .map(|t| row.get(*t).copied().unwrap_or(0.0).to_bits())
                .collect(),
        );
        match by_key.get(&key) {
            Some(c) => out[*c].members.push(*job),
            None => {
                by_key.insert(key, out.len());
                out.push(Class {
                    members: vec![*job],
                    representative: *job,
                    scale_factor: problem.scale_factor(*job),
                });
            }
        }
    }
    out
}

/// A pair of classes that may share a type: `(c, d, type index, [c's,
/// d's] steps per second)`, `c ≤ d`.
type PairVar = (usize, usize, usize, [f64; 2], Variable);

/// How many partners in class `d` each job of class `c` has.
fn partners(classes: &[Class], c: usize, d: usize) -> f64 {
    let n = classes[d].members.len() as f64;
    if c == d {
        n - 1.0
    } else {
        n
    }
}

pub fn max_min_fairness_packed(
    problem: &AllocationProblem,
) -> Result<PolicyResult, AllocationError> {
    if problem.throughputs.is_empty() {
        return Ok(problem.result(Allocation::new(), None));
    }
    let classes = classes(problem);
    let types = problem.types();
    let mut vars = ProblemVariables::new();
    let floor = vars.add(variable());
    let x: Vec<Vec<Variable>> = classes
        .iter()
        .map(|_| {
            types
                .iter()
                .map(|_| vars.add(variable().min(0.0)))
                .collect()
        })
        .collect();
    let mut z: Vec<PairVar> = Vec::new();
    for c in 0..classes.len() {
        for d in c..classes.len() {
            if classes[c].scale_factor != classes[d].scale_factor || partners(&classes, c, d) < 1.0
            {
                continue;
            }
            // Two distinct jobs: within a class, its first two members.
            let (a, b) = if c == d {
                (classes[c].members[0], classes[c].members[1])
            } else {
                (classes[c].representative, classes[d].representative)
            };
            for (ti, t) in types.iter().enumerate() {
                let Some(mut figures) = problem.pair_throughput(a, b, t) else {
                    continue;
                };
                if c == d {
                    // Two jobs of one class: each is the first of the
                    // pair as often as the second (the table's figures
                    // for a type beside itself are symmetric anyway).
                    let mean = (figures[0] + figures[1]) / 2.0;
                    figures = [mean, mean];
                }
                if figures.iter().all(|f| *f > 0.0) {
                    z.push((c, d, ti, figures, vars.add(variable().min(0.0))));
                }
            }
        }
    }

    let mut constraints = Vec::new();
    // Per job: time alone and in pairs at most 1.
    let mut time: Vec<Expression> = x
        .iter()
        .map(|row| row.iter().copied().sum::<Expression>())
        .collect();
    // Per job: normalised throughput.
    let mut speed: Vec<Expression> = classes
        .iter()
        .zip(&x)
        .map(|(class, row)| {
            types
                .iter()
                .zip(row)
                .map(|(t, v)| problem.throughput(class.representative, t) * *v)
                .sum::<Expression>()
        })
        .collect();
    // Per type: GPUs in use.
    let mut used: Vec<Expression> = types
        .iter()
        .enumerate()
        .map(|(ti, _)| {
            classes
                .iter()
                .zip(&x)
                .map(|(class, row)| {
                    class.members.len() as f64 * f64::from(class.scale_factor) * row[ti]
                })
                .sum::<Expression>()
        })
        .collect();
    for (c, d, ti, [fc, fd], v) in &z {
        let (c, d, ti) = (*c, *d, *ti);
        let s = f64::from(classes[c].scale_factor);
        let nc = classes[c].members.len() as f64;
        let pairs = if c == d {
            nc * (nc - 1.0) / 2.0
        } else {
            nc * classes[d].members.len() as f64
        };
        used[ti] += pairs * s * *v;
        let mc = partners(&classes, c, d);
        time[c] += mc * *v;
        speed[c] += mc * *fc * *v;
        if c != d {
            let md = partners(&classes, d, c);
            time[d] += md * *v;
            speed[d] += md * *fd * *v;
        }
    }
    for t in time {
        constraints.push(constraint!(t <= 1.0));
    }
    for (n, u) in problem.cluster_spec.values().zip(used) {
        constraints.push(constraint!(u <= f64::from(*n)));
    }
    for (class, s) in classes.iter().zip(speed) {
        let alone: f64 = types
            .iter()
            .map(|t| problem.throughput(class.representative, t))
            .sum();
        if alone <= 0.0 {
            // Runs nowhere: no share to be fair about.
            continue;
        }
        let scale = f64::from(class.scale_factor) / (problem.weight(class.representative) * alone);
        constraints.push(constraint!(scale * s >= floor));
    }
    let solution = maximise(vars, floor.into(), constraints)?;
    let objective = solution.value(floor);

    let value = |v: Variable| {
        let x = solution.value(v);
        if x < NOISE {
            0.0
        } else {
            x
        }
    };
    // Per class: the row alone, and the steps per second it gets alone
    // and beside its partners (the same for every member).
    let mut effective: Vec<f64> = vec![0.0; classes.len()];
    let mut allocation = Allocation::new();
    for (c, (class, row)) in classes.iter().zip(&x).enumerate() {
        let values: BTreeMap<String, f64> = types
            .iter()
            .zip(row)
            .map(|(t, v)| (t.to_string(), value(*v).min(1.0)))
            .collect();
        effective[c] = values
            .iter()
            .map(|(t, x)| problem.throughput(class.representative, t) * x)
            .sum();
        for m in &class.members {
            allocation.insert(*m, values.clone());
        }
    }
    // Per pair of classes: the row every pair of members gets.
    let mut class_pairs: BTreeMap<(usize, usize), BTreeMap<String, f64>> = BTreeMap::new();
    for (c, d, ti, [fc, fd], v) in &z {
        let share = value(*v).min(1.0);
        if share == 0.0 {
            continue;
        }
        effective[*c] += partners(&classes, *c, *d) * fc * share;
        if c != d {
            effective[*d] += partners(&classes, *d, *c) * fd * share;
        }
        class_pairs
            .entry((*c, *d))
            .or_insert_with(|| types.iter().map(|t| (t.to_string(), 0.0)).collect())
            .insert(types[*ti].to_string(), share);
    }
    let mut pair_allocation = PairAllocation::new();
    for ((c, d), row) in &class_pairs {
        for (k, a) in classes[*c].members.iter().enumerate() {
            let partners = if c == d {
                &classes[*d].members[k + 1..]
            } else {
                &classes[*d].members[..]
            };
            for b in partners {
                pair_allocation.insert(((*a).min(*b), (*a).max(*b)), row.clone());
            }
        }
    }
    let effective_throughput = classes
        .iter()
        .zip(&effective)
        .flat_map(|(class, e)| class.members.iter().map(move |m| (*m, *e)))
        .collect();
    Ok(PolicyResult {
        allocation,
        pair_allocation,
        effective_throughput,
        objective: Some(objective),
    })
}
