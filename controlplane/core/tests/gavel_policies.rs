//! Heterogeneity-aware policies held against Gavel's golden vectors
//! (`tests/fixtures/gavel_golden_small.json`, copied from Gavel's
//! `policy_golden.json`, source noted in the file), and the properties
//! every allocation must have.

use std::collections::BTreeMap;

use keel_core::gavel::{solve, AllocationProblem, GAVEL_POLICY_NAMES};
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
const NOT_IN_GAVELS_GOLDEN_FILE: &[&str] = &["max_sum_throughput_normalized_by_cost_perf"];

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
fn normalised_min(problem: &AllocationProblem, r: &keel_core::gavel::PolicyResult) -> f64 {
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
            ),
            1..12,
        ),
    )
        .prop_map(|((v, p, k), jobs)| {
            let mut problem = AllocationProblem::new(
                [("v100", v), ("p100", p), ("k80", k)]
                    .into_iter()
                    .map(|(t, n)| (t.to_string(), n))
                    .collect(),
            );
            for (i, ((tv, tp, tk), s, w, (rem, since))) in jobs.into_iter().enumerate() {
                let i = i as u64;
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
            problem
        })
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
            for (job, row) in &result.allocation {
                let total: f64 = row.values().sum();
                prop_assert!(total <= 1.0 + 1e-6, "{} job {} sums to {}", policy, job, total);
                for x in row.values() {
                    prop_assert!((0.0..=1.0).contains(x));
                }
            }
            for (gpu_type, n) in &problem.cluster_spec {
                let used: f64 = result
                    .allocation
                    .iter()
                    .map(|(job, row)| f64::from(problem.scale_factors[job]) * row[gpu_type])
                    .sum();
                prop_assert!(used <= f64::from(*n) + 1e-5, "{} uses {} of {} {}", policy, used, n, gpu_type);
            }
        }
    }
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
