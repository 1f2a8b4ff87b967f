//! The round-based mechanism and the round simulator: properties that
//! must hold whatever the cluster, jobs and allocation.

use std::collections::{BTreeMap, BTreeSet};

use keel_scheduling::gavel::mechanism::{Mechanism, MechanismConfig, TypeServers};
use keel_scheduling::gavel::{self, AllocationProblem, GAVEL_POLICY_NAMES};
use keel_sim::{self as sim, Generator, RoundSimConfig, SimJob};
use proptest::prelude::*;

const TYPES: [&str; 3] = ["v100", "p100", "k80"];

fn cluster(servers: &[(usize, u32)]) -> Vec<TypeServers> {
    let mut by_type: Vec<TypeServers> = TYPES
        .iter()
        .map(|t| TypeServers {
            gpu_type: t.to_string(),
            servers: Vec::new(),
        })
        .collect();
    let mut next = 0;
    for (t, gpus) in servers {
        by_type[*t % 3].servers.push((next..next + gpus).collect());
        next += gpus;
    }
    by_type.retain(|t| !t.servers.is_empty());
    by_type
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every round: no GPU used twice, no job placed twice (alone or in a
    /// pair), every GPU of the placement's type, exactly the job's scale
    /// factor, no type over its count, nothing on a type where the job (or
    /// the pair) cannot run, and the solved allocation's jobs only. Space
    /// sharing included: jobs have one of three types, with random pair
    /// figures.
    #[test]
    fn the_mechanism_never_places_more_gpus_than_exist(
        servers in prop::collection::vec((0usize..3, 1u32..5), 1..8),
        jobs in prop::collection::vec((prop::sample::select(vec![1u32, 1, 2, 4]), 0.0f64..10.0, 0.0f64..10.0, 0.0f64..10.0, 0usize..3), 1..24),
        pair_figures in prop::collection::vec((0.0f64..8.0, 0.0f64..8.0), 27),
        policy in prop::sample::select(vec!["max_min_fairness_perf", "max_min_fairness", "max_sum_throughput_perf", "isolated", "fifo_perf", "max_min_fairness_packed", "gandiva"]),
        rounds in 1usize..12,
        shuffle in any::<bool>(),
    ) {
        let types = cluster(&servers);
        let capacity: BTreeMap<String, u32> = types
            .iter()
            .map(|t| (t.gpu_type.clone(), t.servers.iter().map(|s| s.len() as u32).sum()))
            .collect();
        let type_of: BTreeMap<u32, String> = types
            .iter()
            .flat_map(|t| t.servers.iter().flatten().map(move |w| (*w, t.gpu_type.clone())))
            .collect();
        let mut config = MechanismConfig::gavel();
        config.shuffle_seed = shuffle.then_some(5);
        config.skip_zero_priority = policy == "fifo_perf";
        let mut mechanism = Mechanism::new(config, types);
        let mut problem = AllocationProblem::new(capacity.clone());
        // Pair figures by (job type, job type, GPU type index).
        for a in 0..3usize {
            for b in a..3 {
                let by_gpu: BTreeMap<String, [f64; 2]> = TYPES
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| capacity.contains_key(**t))
                    .map(|(g, t)| {
                        let (x, y) = pair_figures[a * 9 + b * 3 + g];
                        (t.to_string(), [x, y])
                    })
                    .collect();
                problem
                    .pair_throughputs
                    .entry(format!("type{a}"))
                    .or_default()
                    .insert(format!("type{b}"), by_gpu);
            }
        }
        for (id, (s, v, p, k, job_type)) in jobs.iter().enumerate() {
            let id = id as u64;
            let row: BTreeMap<String, f64> = TYPES
                .iter()
                .zip([*v, *p, *k])
                .filter(|(t, _)| capacity.contains_key(**t))
                .map(|(t, x)| (t.to_string(), x))
                .collect();
            mechanism.add_job(id, *s, &row);
            problem.throughputs.insert(id, row);
            problem.scale_factors.insert(id, *s);
            problem.job_types.insert(id, format!("type{job_type}"));
            if gavel::shares_gpus(policy) {
                for other in 0..id {
                    let figures: BTreeMap<String, [f64; 2]> = capacity
                        .keys()
                        .filter_map(|t| Some((t.clone(), problem.pair_throughput(other, id, t)?)))
                        .collect();
                    if !figures.is_empty() {
                        mechanism.add_pair(other, id, &figures);
                    }
                }
            }
        }
        let now = 1000.0;
        prop_assert!(mechanism.needs_solve(now));
        let result = gavel::solve(policy, &problem).expect("solves");
        for ((a, b), row) in &result.pair_allocation {
            prop_assert_eq!(problem.scale_factors[a], problem.scale_factors[b]);
            for (t, x) in row {
                if *x > 0.0 {
                    let figures = problem.pair_throughput(*a, *b, t);
                    prop_assert!(figures.is_some(), "pair ({}, {}) on {} has no figures", a, b, t);
                }
            }
        }
        mechanism.install_with_pairs(now, result.allocation.clone(), &result.pair_allocation);
        for round in 0..rounds {
            let plan = mechanism.plan_round();
            let mut used: BTreeSet<u32> = BTreeSet::new();
            let mut placed: BTreeSet<u64> = BTreeSet::new();
            let mut per_type: BTreeMap<String, u32> = BTreeMap::new();
            for (combo, placement) in &plan {
                let gpu_type = mechanism.type_name(placement.type_index).to_string();
                for job in combo.jobs() {
                    prop_assert!(placed.insert(job), "job {} placed twice", job);
                    prop_assert_eq!(placement.workers.len() as u32, problem.scale_factors[&job]);
                    prop_assert!(result.allocation.contains_key(&job));
                }
                for w in &placement.workers {
                    prop_assert!(used.insert(*w), "GPU {} placed twice", w);
                    prop_assert_eq!(&type_of[w], &gpu_type);
                }
                *per_type.entry(gpu_type.clone()).or_default() += placement.workers.len() as u32;
                match combo.as_pair() {
                    None => prop_assert!(problem.throughput(combo.jobs().next().unwrap_or(0), &gpu_type) > 0.0),
                    Some((a, b)) => {
                        let figures = problem.pair_throughput(a, b, &gpu_type).unwrap_or([0.0, 0.0]);
                        prop_assert!(figures.iter().all(|f| *f > 0.0), "pair ({}, {}) on {}: {:?}", a, b, gpu_type, figures);
                    }
                }
                mechanism.record_run(*combo, placement.type_index, 360.0 - round as f64);
            }
            for (t, n) in per_type {
                prop_assert!(n <= capacity[&t], "{} GPUs of {} placed, {} exist", n, t, capacity[&t]);
            }
        }
    }
}

fn small_workload(jobs: usize, rate: f64, seed: u64) -> Vec<SimJob> {
    Generator {
        jobs,
        rate_per_hour: rate,
        seed,
        multi_gpu: true,
        elastic: false,
    }
    .generate()
    .expect("generates")
}

fn round_config(jobs: Vec<SimJob>) -> RoundSimConfig {
    RoundSimConfig {
        nodes: sim::cluster_from_counts("8:8:8", 4).expect("cluster"),
        jobs,
        throughputs: None,
        mechanism: MechanismConfig::gavel(),
        seed: 0,
        window: None,
        max_simulated_s: 10.0 * 365.0 * 86_400.0,
        instance_costs: [("v100".to_string(), 2.48), ("k80".to_string(), 0.45)]
            .into_iter()
            .collect(),
    }
}

/// Every heterogeneity-aware policy finishes every job of a multi-GPU
/// workload, and the same inputs give the same report.
#[test]
fn every_policy_finishes_the_workload_deterministically() {
    let config = round_config(small_workload(24, 2.0, 3));
    for policy in GAVEL_POLICY_NAMES {
        if *policy == "allox" {
            // Single-GPU jobs only: refused up front, not run half-way.
            assert!(sim::simulate_rounds(&config, policy).is_err());
            let mut single = config.clone();
            for job in &mut single.jobs {
                (job.workers_min, job.workers_max) = (1, 1);
            }
            let report = sim::simulate_rounds(&single, policy).expect("runs");
            assert_eq!(report.jct(None).unfinished, 0, "allox");
            continue;
        }
        let report = sim::simulate_rounds(&config, policy).expect("runs");
        let jct = report.jct(None);
        assert_eq!(jct.unfinished, 0, "{policy}: {jct:?}");
        assert_eq!(jct.finished, 24, "{policy}");
        assert!(report.solves > 0 && report.rounds > 0, "{policy}");
        assert!(
            report.utilisation > 0.0 && report.utilisation <= 1.0,
            "{policy}"
        );
        // The seeded type shuffle and the FIFO rule: the same report again.
        if ["max_min_fairness", "fifo_perf"].contains(policy) {
            let again = sim::simulate_rounds(&config, policy).expect("runs");
            assert_eq!(report, again, "{policy}: not deterministic");
        }
    }
    assert!(
        sim::simulate_rounds(&config, "drf").is_err(),
        "not a Gavel policy"
    );
}

/// Heterogeneity-aware LAS beats agnostic LAS on average JCT when the
/// types differ in speed (Gavel's headline result), on the same jobs.
#[test]
fn heterogeneity_aware_las_beats_agnostic_las() {
    let config = round_config(small_workload(150, 3.0, 1));
    let aware = sim::simulate_rounds(&config, "max_min_fairness_perf").expect("runs");
    let agnostic = sim::simulate_rounds(&config, "max_min_fairness").expect("runs");
    let (a, b) = (aware.jct(None).mean_s, agnostic.jct(None).mean_s);
    assert!(a < b, "aware {a} s vs agnostic {b} s");
}

/// A Gavel-layout table with two job types, `A` (10 steps/s on a v100) and
/// `B` (5), on every type at `slower` times the speed of the type before,
/// and pair figures: each keeps 90 % of its speed beside a job of its own
/// type and 80 % beside the other.
fn pair_table(slower: f64) -> sim::ThroughputTable {
    let mut types = serde_json::Map::new();
    for (i, gpu) in ["v100", "p100", "k80"].into_iter().enumerate() {
        let f = slower.powi(i as i32);
        let (a, b) = (10.0 * f, 5.0 * f);
        types.insert(
            gpu.to_string(),
            serde_json::json!({
                "('A', 1)": {"null": a, "('A', 1)": [0.9 * a, 0.9 * a], "('B', 1)": [0.8 * a, 0.8 * b]},
                "('B', 1)": {"null": b, "('B', 1)": [0.9 * b, 0.9 * b], "('A', 1)": [0.8 * b, 0.8 * a]},
            }),
        );
    }
    sim::ThroughputTable::from_gavel_json(&serde_json::Value::Object(types).to_string())
        .expect("table")
}

/// Space sharing on an oversubscribed cluster: both space-sharing
/// policies place pairs and finish every job; since each pair runs at
/// 80–90 % speed each, packing beats taking turns on mean JCT; and Gandiva
/// draws the same pairs from the same seed.
#[test]
fn space_sharing_places_pairs_and_beats_taking_turns_when_pairs_run_fast() {
    let jobs: Vec<SimJob> = (0..24u64)
        .map(|id| SimJob {
            id,
            arrival_s: 60.0 * id as f64,
            model: "resnet18".into(),
            gpus_per_worker: 1,
            workers_min: 1,
            workers_max: 1,
            total_steps: 20_000 + 4_000 * (id % 5),
            priority: 0,
            job_type: Some(if id % 3 == 0 { "B" } else { "A" }.into()),
            queue: String::new(),
            measured: Vec::new(),
            cancel_at_s: None,
            restart_s: None,
        })
        .collect();
    let mut config = round_config(jobs);
    config.nodes = sim::cluster_from_counts("2:2:2", 2).expect("cluster");
    config.throughputs = Some(pair_table(0.5));
    let taking_turns = sim::simulate_rounds(&config, "max_min_fairness_perf").expect("runs");
    assert_eq!(taking_turns.pairs_placed, 0);
    for policy in gavel::SPACE_SHARING_POLICY_NAMES {
        let report = sim::simulate_rounds(&config, policy).expect("runs");
        let jct = report.jct(None);
        assert_eq!(jct.unfinished, 0, "{policy}: {jct:?}");
        assert!(report.pairs_placed > 0, "{policy} placed no pair");
        let turns = taking_turns.jct(None).mean_s;
        assert!(
            jct.mean_s < turns,
            "{policy}: mean JCT {} s, taking turns {turns} s",
            jct.mean_s
        );
        let again = sim::simulate_rounds(&config, policy).expect("runs");
        assert_eq!(report, again, "{policy}: not deterministic");
    }
}
