//! Heterogeneity-aware policies held against Gavel's golden vectors
//! (`tests/fixtures/gavel_golden_small.json`, copied from Gavel's
//! `policy_golden.json`, source noted in the file), and the properties
//! every allocation must have.

use std::collections::BTreeMap;

use keel_scheduling::gavel::{solve, AllocationProblem, GAVEL_POLICY_NAMES};
use proptest::prelude::*;

fn golden() -> serde_json::Value {
    serde_json::from_str(include_str!("fixtures/gavel_golden_small.json")).expect("fixture")
}

/// Policies whose optimum is not unique on a case: Gavel's ECOS and
/// Keel's Clarabel may return different optimal points, so the objective
/// is compared (it must be the same), not the effective throughputs.
const NOT_UNIQUE: &[(&str, &str)] = &[
    // Finish-time fairness fixes only the bottleneck jobs' throughputs;
    // the others have slack (compared by objective below).
    ("tests_2jobs_cluster_1_2_3", "finish_time_fairness"),
    ("oracle_6jobs_sf1_cluster_2_2_2", "finish_time_fairness"),
    (
        "oracle_6jobs_sf1_cluster_2_2_2",
        "finish_time_fairness_perf",
    ),
    // Makespan: any allocation within the horizon the bisection stops at.
    ("tests_2jobs_cluster_1_2_3", "min_total_duration"),
    ("tests_2jobs_cluster_1_2_3", "min_total_duration_perf"),
    ("oracle_6jobs_sf1_cluster_2_2_2", "min_total_duration"),
    ("oracle_6jobs_sf1_cluster_2_2_2", "min_total_duration_perf"),
    // Any split that gives each job a full unit of time is optimal.
    ("tests_2jobs_cluster_1_2_3", "max_min_fairness"),
    // Job 0 on the v100 and job 1 on the p100s, or the reverse: both 4.0.
    ("tests_2jobs_cluster_1_2_3", "max_sum_throughput_perf"),
];

/// Policies `policy_golden.json` has no vectors for (checked by hand
/// below instead).
const NOT_IN_GAVELS_GOLDEN_FILE: &[&str] = &[
    "max_sum_throughput_normalized_by_cost_perf",
    "gandiva",
    "max_min_fairness_packed",
];

/// Issue 19, item 12: a case of Gavel's `policy_golden.json` is read as it
/// is: its `job_types` is a list of `[model, scale factor]` by job position
/// (or `null`), and its other fields (`name`, `results`) are ignored.
#[test]
fn a_case_in_gavels_own_shape_is_read_as_it_is() {
    let case = r#"{
        "name": "oracle_2jobs",
        "cluster_spec": {"v100": 1, "p100": 1, "k80": 1},
        "job_types": [["ResNet-50 (batch size 64)", 1], ["A3C", 2]],
        "throughputs": {"0": {"v100": 4.0, "p100": 2.0, "k80": 1.0},
                        "1": {"v100": 3.0, "p100": 2.0, "k80": 1.0}},
        "scale_factors": {"0": 1, "1": 2},
        "priority_weights": {"0": 1.0, "1": 1.0},
        "times_since_start": {"0": 0.0, "1": 0.0},
        "num_steps_remaining": {"0": 300, "1": 500},
        "results": {}
    }"#;
    let problem: AllocationProblem = serde_json::from_str(case).expect("Gavel's shape");
    assert_eq!(
        problem.job_types,
        BTreeMap::from([
            (0, "ResNet-50 (batch size 64)".to_string()),
            (1, "A3C x2".to_string())
        ])
    );
    let null = case.replace(r#"[["ResNet-50 (batch size 64)", 1], ["A3C", 2]]"#, "null");
    let problem: AllocationProblem = serde_json::from_str(&null).expect("null job types");
    assert!(problem.job_types.is_empty());
    let keel = case.replace(
        r#"[["ResNet-50 (batch size 64)", 1], ["A3C", 2]]"#,
        r#"{"0": "resnet50", "1": "a3c"}"#,
    );
    let problem: AllocationProblem = serde_json::from_str(&keel).expect("Keel's shape");
    assert_eq!(problem.job_types[&1], "a3c");
    // And every case of the golden file parses as it stands.
    for case in golden()["cases"].as_array().expect("cases") {
        serde_json::from_value::<AllocationProblem>(case.clone()).expect("a golden case parses");
    }
}

#[test]
fn the_golden_vectors_match_gavel_to_1e_3() {
    let golden = golden();
    let cases = golden["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let problem: AllocationProblem = serde_json::from_value(case.clone()).expect("problem");
        for policy in GAVEL_POLICY_NAMES {
            let result = solve(policy, &problem).expect("solves");
            if case["expected_effective_throughput"][policy].is_null() {
                assert!(
                    NOT_IN_GAVELS_GOLDEN_FILE.contains(policy),
                    "{name}: no golden vector for {policy}"
                );
                continue;
            }
            let expected: BTreeMap<u64, f64> =
                serde_json::from_value(case["expected_effective_throughput"][policy].clone())
                    .expect("expected");
            if NOT_UNIQUE.contains(&(name, policy)) {
                // The same objective as Gavel's allocation reaches.
                let gavel_total: f64 = expected.values().sum();
                let gavel_objective = case["expected_objective"][policy].as_f64();
                match *policy {
                    "finish_time_fairness" | "finish_time_fairness_perf" => {
                        let ours = result.objective.expect("objective");
                        let theirs = gavel_objective.expect("fixture objective");
                        assert!(
                            (ours - theirs).abs() <= 1e-3 * theirs,
                            "{name} {policy}: largest ratio {ours} vs Gavel's {theirs}"
                        );
                    }
                    "min_total_duration" | "min_total_duration_perf" => {
                        // Both stop bisecting once the bracket is within
                        // 5 %, so the horizons agree only to that.
                        let ours = result.objective.expect("objective");
                        let theirs = gavel_objective.expect("fixture objective");
                        assert!(
                            (ours - theirs).abs() <= 0.05 * theirs,
                            "{name} {policy}: makespan {ours} vs Gavel's {theirs}"
                        );
                    }
                    "max_sum_throughput_perf" => {
                        let ours = result.objective.expect("objective");
                        assert!(
                            (ours - gavel_total).abs() < 1e-3,
                            "{name} {policy}: {ours} vs {gavel_total}"
                        );
                    }
                    _ => {
                        let ours = result.objective.expect("objective");
                        assert!((ours - 1.0).abs() < 1e-3, "{name} {policy}: {ours}");
                    }
                }
                continue;
            }
            assert_eq!(result.effective_throughput.len(), expected.len());
            for (job, e) in &expected {
                let ours = result.effective_throughput[job];
                assert!(
                    (ours - e).abs() < 1e-3,
                    "{name} {policy} job {job}: {ours} vs Gavel's {e}"
                );
            }
        }
    }
}

/// Gavel's normalised throughput: effective throughput × scale factor over
/// (priority weight × the job's throughput on an equal share of the
/// cluster).
fn normalised_min(problem: &AllocationProblem, r: &keel_scheduling::gavel::PolicyResult) -> f64 {
    let total: f64 = problem.cluster_spec.values().map(|n| f64::from(*n)).sum();
    r.effective_throughput
        .iter()
        .map(|(job, e)| {
            let prop: f64 = problem
                .cluster_spec
                .iter()
                .map(|(t, n)| problem.throughput(*job, t) * f64::from(*n))
                .sum::<f64>()
                / total;
            e * f64::from(problem.scale_factor(*job)) / (problem.weight(*job) * prop)
        })
        .fold(f64::INFINITY, f64::min)
}

fn problem_strategy() -> impl Strategy<Value = AllocationProblem> {
    (
        (1u32..5, 0u32..5, 0u32..5),
        prop::collection::vec(
            (
                (0.1f64..10.0, 0.1f64..10.0, 0.1f64..10.0),
                prop::sample::select(vec![1u32, 2, 4]),
                prop::sample::select(vec![1.0f64, 2.0]),
                (100.0f64..100_000.0, 0.0f64..3600.0),
                0usize..3,
            ),
            1..12,
        ),
        // Pair figures: job type a beside b on each GPU type, as fractions
        // of their speeds alone (0: cannot share there).
        prop::collection::vec(
            (
                prop::sample::select(vec![0.0f64, 0.3, 0.5, 0.7, 0.9]),
                prop::sample::select(vec![0.0f64, 0.3, 0.5, 0.7, 0.9]),
            ),
            18,
        ),
    )
        .prop_map(|((v, p, k), jobs, pair_fractions)| {
            let mut problem = AllocationProblem::new(
                [("v100", v), ("p100", p), ("k80", k)]
                    .into_iter()
                    .map(|(t, n)| (t.to_string(), n))
                    .collect(),
            );
            // Jobs of one type share their throughputs (the first one's),
            // so pair figures can be stated per type.
            let mut type_rows: BTreeMap<usize, (f64, f64, f64)> = BTreeMap::new();
            for (i, ((tv, tp, tk), s, w, (rem, since), job_type)) in jobs.into_iter().enumerate() {
                let i = i as u64;
                let (tv, tp, tk) = *type_rows.entry(job_type).or_insert((tv, tp, tk));
                problem.job_types.insert(i, format!("type{job_type}"));
                problem.throughputs.insert(
                    i,
                    [("v100", tv), ("p100", tp), ("k80", tk)]
                        .into_iter()
                        .map(|(t, x)| (t.to_string(), x))
                        .collect(),
                );
                problem.scale_factors.insert(i, s);
                problem.priority_weights.insert(i, w);
                problem.num_steps_remaining.insert(i, rem);
                problem.times_since_start.insert(i, since);
            }
            for (a, row_a) in &type_rows {
                for (b, row_b) in type_rows.range(a..) {
                    let by_gpu = [
                        ("v100", row_a.0, row_b.0),
                        ("p100", row_a.1, row_b.1),
                        ("k80", row_a.2, row_b.2),
                    ]
                    .into_iter()
                    .enumerate()
                    .map(|(g, (t, alone_a, alone_b))| {
                        let (fa, fb) = pair_fractions[(a * 3 + b) * 2 % 18 + g % 2];
                        // A type beside itself: the same for both, as
                        // in Gavel's table.
                        let fb = if a == b { fa } else { fb };
                        (t.to_string(), [alone_a * fa, alone_b * fb])
                    })
                    .collect();
                    problem
                        .pair_throughputs
                        .entry(format!("type{a}"))
                        .or_default()
                        .insert(format!("type{b}"), by_gpu);
                }
            }
            problem
        })
}

/// `max_min_fairness_packed`'s objective solved the long way: one
/// variable per job and per pair of jobs (Gavel's simulator's form).
fn packed_objective_per_job_pair(problem: &AllocationProblem) -> f64 {
    use good_lp::{
        clarabel, constraint, variable, Expression, ProblemVariables, Solution, SolverModel,
    };
    let types: Vec<String> = problem.cluster_spec.keys().cloned().collect();
    let jobs: Vec<u64> = problem.throughputs.keys().copied().collect();
    let mut vars = ProblemVariables::new();
    let floor = vars.add(variable());
    let mut time: BTreeMap<u64, Expression> = BTreeMap::new();
    let mut speed: BTreeMap<u64, Expression> = BTreeMap::new();
    let mut used: Vec<Expression> = types.iter().map(|_| Expression::from(0.0)).collect();
    for job in &jobs {
        for (ti, t) in types.iter().enumerate() {
            let v = vars.add(variable().min(0.0));
            *time.entry(*job).or_default() += v;
            *speed.entry(*job).or_default() += problem.throughput(*job, t) * v;
            used[ti] += f64::from(problem.scale_factor(*job)) * v;
        }
    }
    for (i, a) in jobs.iter().enumerate() {
        for b in &jobs[i + 1..] {
            for (ti, t) in types.iter().enumerate() {
                let Some([fa, fb]) = problem.pair_throughput(*a, *b, t) else {
                    continue;
                };
                if fa <= 0.0 || fb <= 0.0 {
                    continue;
                }
                let v = vars.add(variable().min(0.0));
                *time.entry(*a).or_default() += v;
                *time.entry(*b).or_default() += v;
                *speed.entry(*a).or_default() += fa * v;
                *speed.entry(*b).or_default() += fb * v;
                used[ti] += f64::from(problem.scale_factor(*a)) * v;
            }
        }
    }
    let mut model = vars.maximise(floor).using(clarabel);
    for t in time.into_values() {
        model = model.with(constraint!(t <= 1.0));
    }
    for (u, n) in used.into_iter().zip(problem.cluster_spec.values()) {
        model = model.with(constraint!(u <= f64::from(*n)));
    }
    for (job, s) in speed {
        let alone: f64 = types.iter().map(|t| problem.throughput(job, t)).sum();
        let scale = f64::from(problem.scale_factor(job)) / (problem.weight(job) * alone);
        model = model.with(constraint!(scale * s >= floor));
    }
    model.solve().expect("solves").value(floor)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, .. ProptestConfig::default() })]

    #[test]
    fn heterogeneity_aware_las_never_does_worse_than_agnostic_las_on_its_worst_job(
        problem in problem_strategy(),
    ) {
        prop_assume!(problem.cluster_spec.values().sum::<u32>() > 0);
        let aware = solve("max_min_fairness_perf", &problem).expect("solves");
        let agnostic = solve("max_min_fairness", &problem).expect("solves");
        let (a, b) = (normalised_min(&problem, &aware), normalised_min(&problem, &agnostic));
        prop_assert!(a >= b - 1e-4 * b.abs().max(1.0), "aware {} < agnostic {}", a, b);
    }

    #[test]
    fn every_allocation_satisfies_the_shared_constraints(problem in problem_strategy()) {
        let multi_gpu = problem.scale_factors.values().any(|s| *s > 1);
        for policy in GAVEL_POLICY_NAMES {
            if *policy == "allox" && multi_gpu {
                // AlloX places single-GPU jobs only, and says so.
                prop_assert!(solve(policy, &problem).is_err());
                continue;
            }
            let result = solve(policy, &problem).expect("solves");
            // Time alone and in every pair, per job.
            let mut time: BTreeMap<u64, f64> = BTreeMap::new();
            for (job, row) in &result.allocation {
                *time.entry(*job).or_default() += row.values().sum::<f64>();
                for x in row.values() {
                    prop_assert!((0.0..=1.0).contains(x));
                }
            }
            for ((a, b), row) in &result.pair_allocation {
                prop_assert!(keel_scheduling::gavel::shares_gpus(policy), "{} packed jobs", policy);
                prop_assert_eq!(problem.scale_factors[a], problem.scale_factors[b]);
                for (t, x) in row {
                    prop_assert!((0.0..=1.0).contains(x));
                    // Gandiva gives a pair its share of every type, as
                    // Gavel's does; the rounds skip types where the pair
                    // cannot run.
                    if *x > 0.0 && *policy != "gandiva" {
                        let figures = problem.pair_throughput(*a, *b, t).unwrap_or([0.0, 0.0]);
                        prop_assert!(figures.iter().all(|f| *f > 0.0), "{} packs {} and {} on {}", policy, a, b, t);
                    }
                }
                let total: f64 = row.values().sum();
                *time.entry(*a).or_default() += total;
                *time.entry(*b).or_default() += total;
            }
            for (job, total) in time {
                prop_assert!(total <= 1.0 + 1e-6, "{} job {} sums to {}", policy, job, total);
            }
            for (gpu_type, n) in &problem.cluster_spec {
                let alone: f64 = result
                    .allocation
                    .iter()
                    .map(|(job, row)| f64::from(problem.scale_factors[job]) * row[gpu_type])
                    .sum();
                let shared: f64 = result
                    .pair_allocation
                    .iter()
                    .map(|((a, _), row)| f64::from(problem.scale_factors[a]) * row.get(gpu_type).copied().unwrap_or(0.0))
                    .sum();
                let used = alone + shared;
                prop_assert!(used <= f64::from(*n) + 1e-5, "{} uses {} of {} {}", policy, used, n, gpu_type);
            }
        }
    }

    /// Solving the packed LP by classes of interchangeable jobs reaches
    /// the optimum of the form with one variable per pair of jobs.
    #[test]
    fn packing_by_job_class_loses_nothing_against_packing_by_job_pair(
        problem in problem_strategy(),
    ) {
        prop_assume!(problem.cluster_spec.values().sum::<u32>() > 0);
        let ours = solve("max_min_fairness_packed", &problem)
            .expect("solves")
            .objective
            .expect("objective");
        let long_way = packed_objective_per_job_pair(&problem);
        prop_assert!(
            (ours - long_way).abs() <= 1e-4 * long_way.abs().max(1e-3),
            "by class {} vs by job pair {}", ours, long_way
        );
    }
}

/// Two jobs, one GPU: sharing it at 80 % speed each beats taking turns
/// (50 % each); at 30 % it does not, and they take turns.
#[test]
fn packing_shares_a_gpu_only_when_it_pays() {
    for (fraction, expected) in [(0.8, 0.8), (0.3, 0.5)] {
        let mut problem = AllocationProblem::new([("v100".to_string(), 1)].into_iter().collect());
        for job in [0u64, 1] {
            problem
                .throughputs
                .insert(job, [("v100".to_string(), 2.0)].into_iter().collect());
            problem.scale_factors.insert(job, 1);
            problem.job_types.insert(job, "resnet".into());
        }
        problem.pair_throughputs.insert(
            "resnet".into(),
            [(
                "resnet".to_string(),
                [("v100".to_string(), [2.0 * fraction, 2.0 * fraction])]
                    .into_iter()
                    .collect(),
            )]
            .into_iter()
            .collect(),
        );
        let result = solve("max_min_fairness_packed", &problem).expect("solves");
        let objective = result.objective.expect("objective");
        assert!(
            (objective - expected).abs() < 1e-5,
            "{fraction}: {objective}"
        );
        for job in [0u64, 1] {
            let e = result.effective_throughput[&job];
            assert!(
                (e - 2.0 * expected).abs() < 1e-4,
                "{fraction}: job {job} {e}"
            );
        }
        let shared = result
            .pair_allocation
            .get(&(0, 1))
            .and_then(|row| row.get("v100"))
            .copied()
            .unwrap_or(0.0);
        if fraction > 0.5 {
            assert!((shared - 1.0).abs() < 1e-4, "{shared}");
        } else {
            assert!(shared < 1e-4, "{shared}");
        }
        // And through JSON, as `keel policy eval` prints it.
        let json = serde_json::to_value(&result).expect("json");
        let back: keel_scheduling::gavel::PolicyResult =
            serde_json::from_value(json).expect("back");
        assert_eq!(back.pair_allocation, result.pair_allocation);
    }
}

/// Gandiva: equal shares while the jobs fit; once they do not, random
/// pairs that stay together from one solve to the next until one of the
/// two leaves.
#[test]
fn gandiva_pairs_jobs_only_when_oversubscribed_and_keeps_the_pairs() {
    let mut problem = AllocationProblem::new([("v100".to_string(), 2)].into_iter().collect());
    let add = |problem: &mut AllocationProblem, job: u64| {
        problem
            .throughputs
            .insert(job, [("v100".to_string(), 1.0)].into_iter().collect());
        problem.scale_factors.insert(job, 1);
        problem.job_types.insert(job, "a3c".into());
    };
    problem.pair_throughputs.insert(
        "a3c".into(),
        [(
            "a3c".to_string(),
            [("v100".to_string(), [0.7, 0.7])].into_iter().collect(),
        )]
        .into_iter()
        .collect(),
    );
    for job in 0..2 {
        add(&mut problem, job);
    }
    let mut gandiva = keel_scheduling::gavel::Gandiva::new(0);
    let fits = gandiva.allocate(&problem);
    assert!(
        fits.pair_allocation.is_empty(),
        "two jobs, two GPUs: no packing"
    );
    assert!((fits.allocation[&0]["v100"] - 1.0).abs() < 1e-12);
    for job in 2..6 {
        add(&mut problem, job);
    }
    let packed = gandiva.allocate(&problem);
    assert_eq!(packed.pair_allocation.len(), 3, "six jobs, three pairs");
    let again = gandiva.allocate(&problem);
    assert_eq!(
        again.pair_allocation.keys().collect::<Vec<_>>(),
        packed.pair_allocation.keys().collect::<Vec<_>>(),
        "the pairs are kept"
    );
    // Three entries share two GPUs: 2/3 of the time each.
    for row in packed.pair_allocation.values() {
        assert!((row["v100"] - 2.0 / 3.0).abs() < 1e-12);
    }
    let (&(a, b), _) = packed.pair_allocation.iter().next().expect("a pair");
    problem.throughputs.remove(&a);
    let after = gandiva.allocate(&problem);
    assert!(
        after
            .pair_allocation
            .keys()
            .all(|(x, y)| *x != a && *y != a),
        "a pair with a job that left is dropped"
    );
    assert!(!after.pair_allocation.contains_key(&(a, b)));
}

#[test]
fn bad_input_names_the_field() {
    let mut problem: AllocationProblem =
        serde_json::from_value(golden()["cases"][0].clone()).expect("problem");
    problem.scale_factors.clear();
    let err = solve("max_min_fairness_perf", &problem).expect_err("no scale factors");
    assert!(err.to_string().contains("scale_factors"), "{err}");
    let err = solve("no_such_policy", &golden_problem()).expect_err("unknown");
    assert!(err.to_string().contains("max_min_fairness_perf"), "{err}");
}

fn golden_problem() -> AllocationProblem {
    serde_json::from_value(golden()["cases"][0].clone()).expect("problem")
}

/// Throughput per dollar: a job twice as fast per dollar on the k80 takes
/// the k80s; a deadline it cannot meet there buys v100 time; an
/// impossible deadline is dropped rather than leaving no allocation.
#[test]
fn cost_normalised_max_sum_prefers_cheap_speed_and_meets_deadlines() {
    let mut problem = AllocationProblem {
        cluster_spec: [("v100".to_string(), 1), ("k80".to_string(), 1)]
            .into_iter()
            .collect(),
        throughputs: [(
            0,
            [("v100".to_string(), 3.0), ("k80".to_string(), 2.0)]
                .into_iter()
                .collect(),
        )]
        .into_iter()
        .collect(),
        scale_factors: [(0, 1)].into_iter().collect(),
        priority_weights: BTreeMap::new(),
        times_since_start: BTreeMap::new(),
        num_steps_remaining: [(0, 1000.0)].into_iter().collect(),
        instance_costs: [("v100".to_string(), 3.0), ("k80".to_string(), 1.0)]
            .into_iter()
            .collect(),
        slos: BTreeMap::new(),
        job_types: BTreeMap::new(),
        pair_throughputs: BTreeMap::new(),
    };
    let policy = "max_sum_throughput_normalized_by_cost_perf";
    let cheap = solve(policy, &problem).expect("solves");
    assert!(
        (cheap.allocation[&0]["k80"] - 1.0).abs() < 1e-4,
        "{cheap:?}"
    );
    assert!(cheap.allocation[&0]["v100"] < 1e-4, "{cheap:?}");
    // 1000 steps in 400 s: 2.5 steps/s, more than the k80 alone gives.
    problem.slos.insert(0, 400.0);
    let deadline = solve(policy, &problem).expect("solves");
    assert!(
        deadline.effective_throughput[&0] >= 2.5 - 1e-4,
        "{deadline:?}"
    );
    assert!(deadline.allocation[&0]["v100"] > 0.4, "{deadline:?}");
    // 1000 steps in 100 s: impossible; the deadline is dropped.
    problem.slos.insert(0, 100.0);
    let dropped = solve(policy, &problem).expect("solves");
    assert!(
        (dropped.allocation[&0]["k80"] - 1.0).abs() < 1e-4,
        "{dropped:?}"
    );
    problem.instance_costs.insert("k80".into(), -1.0);
    assert!(
        solve(policy, &problem).is_err(),
        "a negative price is refused"
    );
}

/// Priority weights are honoured: of two identical jobs sharing one GPU,
/// the one weighted 2 gets twice the other's throughput under max-min
/// fairness, aware or agnostic.
#[test]
fn priority_weights_divide_the_share() {
    let mut problem = AllocationProblem::new([("v100".to_string(), 1)].into_iter().collect());
    for job in [0, 1] {
        problem
            .throughputs
            .insert(job, [("v100".to_string(), 4.0)].into_iter().collect());
        problem.scale_factors.insert(job, 1);
    }
    problem.priority_weights.insert(0, 1.0);
    problem.priority_weights.insert(1, 2.0);
    for policy in ["max_min_fairness_perf", "max_min_fairness"] {
        let result = solve(policy, &problem).expect("solves");
        let (light, heavy) = (
            result.effective_throughput[&0],
            result.effective_throughput[&1],
        );
        assert!((heavy - 2.0 * light).abs() < 1e-4, "{policy}: {result:?}");
        assert!(
            (heavy + light - 4.0).abs() < 1e-4,
            "{policy}: the GPU is used whole"
        );
    }
}

/// Finish-time fairness carries Gavel's accumulator between solves: the
/// progress a job made since the last solve counts as the isolated time it
/// stands for, so a job that ran at its isolated speed stays at ρ ≈ 1
/// where a first solve would see it as late.
#[test]
fn finish_time_fairness_credits_isolated_time_between_solves() {
    let mut problem = AllocationProblem::new([("v100".to_string(), 1)].into_iter().collect());
    problem
        .throughputs
        .insert(0, [("v100".to_string(), 2.0)].into_iter().collect());
    problem.scale_factors.insert(0, 1);
    problem.num_steps_remaining.insert(0, 1000.0);
    problem.times_since_start.insert(0, 0.0);
    let mut memory = keel_scheduling::gavel::FinishTimeMemory::default();
    let first = memory.solve(&problem, false).expect("solves");
    assert!((first.objective.expect("ρ") - 1.0).abs() < 1e-4);
    // 400 steps in 250 s (200 s at the isolated 2 steps/s, 50 s waiting).
    problem.num_steps_remaining.insert(0, 600.0);
    problem.times_since_start.insert(0, 250.0);
    let second = memory.solve(&problem, false).expect("solves");
    // (250 + 600/2) / (200 + 600/2)
    assert!(
        (second.objective.expect("ρ") - 1.1).abs() < 1e-4,
        "{second:?}"
    );
    let fresh = solve("finish_time_fairness_perf", &problem).expect("solves");
    // (250 + 300) / 300 without the credit.
    assert!((fresh.objective.expect("ρ") - 550.0 / 300.0).abs() < 1e-4);
}

/// AlloX as Gavel runs it: a job given a GPU keeps it from one solve to
/// the next; a job left without one is matched again at the next solve,
/// with the newcomers, oldest first.
#[test]
fn allox_keeps_held_gpus_and_matches_the_waiting_jobs_again() {
    let mut problem = AllocationProblem::new([("v100".to_string(), 1)].into_iter().collect());
    let add = |problem: &mut AllocationProblem, job: u64, rem: f64, since: f64| {
        problem
            .throughputs
            .insert(job, [("v100".to_string(), 1.0)].into_iter().collect());
        problem.scale_factors.insert(job, 1);
        problem.num_steps_remaining.insert(job, rem);
        problem.times_since_start.insert(job, since);
    };
    add(&mut problem, 0, 100.0, 50.0);
    add(&mut problem, 1, 1000.0, 40.0);
    let first = solve("allox", &problem).expect("solves");
    // One GPU: the short job first (cost 2·100 + 50 + 1·1000 + 40 beats
    // the other order).
    assert_eq!(first.allocation[&0]["v100"], 1.0);
    assert_eq!(first.allocation[&1]["v100"], 0.0);
    // A newcomer while job 0 holds the GPU: nothing moves.
    add(&mut problem, 2, 5000.0, 0.0);
    let second =
        keel_scheduling::gavel::solve_after("allox", &problem, &first.allocation).expect("solves");
    assert_eq!(second.allocation[&0]["v100"], 1.0);
    assert_eq!(second.allocation[&1]["v100"], 0.0);
    assert_eq!(second.allocation[&2]["v100"], 0.0);
    // Job 0 finishes: the waiting jobs are matched again; the shorter job
    // 1 gets the GPU before the longer newcomer.
    problem.throughputs.remove(&0);
    let third =
        keel_scheduling::gavel::solve_after("allox", &problem, &second.allocation).expect("solves");
    assert_eq!(third.allocation[&1]["v100"], 1.0);
    assert_eq!(third.allocation[&2]["v100"], 0.0);
}
