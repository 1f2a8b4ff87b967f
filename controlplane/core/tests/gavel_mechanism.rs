//! The round-based mechanism and the round simulator: properties that
//! must hold whatever the cluster, jobs and allocation.

use std::collections::{BTreeMap, BTreeSet};

use keel_core::gavel::mechanism::{Mechanism, MechanismConfig, TypeServers};
use keel_core::gavel::{self, AllocationProblem, GAVEL_POLICY_NAMES};
use keel_core::sim::{self, Generator, RoundSimConfig, SimJob};
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

    /// Every round: no GPU used twice, every GPU of the placement's type,
    /// exactly the job's scale factor, no type over its count, and the
    /// solved allocation's jobs only.
    #[test]
    fn the_mechanism_never_places_more_gpus_than_exist(
        servers in prop::collection::vec((0usize..3, 1u32..5), 1..8),
        jobs in prop::collection::vec((prop::sample::select(vec![1u32, 1, 2, 4]), 0.0f64..10.0, 0.0f64..10.0, 0.0f64..10.0), 1..24),
        policy in prop::sample::select(vec!["max_min_fairness_perf", "max_min_fairness", "max_sum_throughput_perf", "isolated", "fifo_perf"]),
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
        for (id, (s, v, p, k)) in jobs.iter().enumerate() {
            let row: BTreeMap<String, f64> = TYPES
                .iter()
                .zip([*v, *p, *k])
                .filter(|(t, _)| capacity.contains_key(**t))
                .map(|(t, x)| (t.to_string(), x))
                .collect();
            mechanism.add_job(id as u64, *s, &row);
            problem.throughputs.insert(id as u64, row);
            problem.scale_factors.insert(id as u64, *s);
        }
        let now = 1000.0;
        prop_assert!(mechanism.needs_solve(now));
        let allocation = gavel::solve(policy, &problem).expect("solves").allocation;
        mechanism.install(now, allocation.clone());
        for round in 0..rounds {
            let plan = mechanism.plan_round();
            let mut used: BTreeSet<u32> = BTreeSet::new();
            let mut per_type: BTreeMap<String, u32> = BTreeMap::new();
            for (job, placement) in &plan {
                let gpu_type = mechanism.type_name(placement.type_index).to_string();
                prop_assert_eq!(placement.workers.len() as u32, problem.scale_factors[job]);
                prop_assert!(allocation.contains_key(job));
                for w in &placement.workers {
                    prop_assert!(used.insert(*w), "GPU {} placed twice", w);
                    prop_assert_eq!(&type_of[w], &gpu_type);
                }
                *per_type.entry(gpu_type.clone()).or_default() += placement.workers.len() as u32;
                prop_assert!(problem.throughputs[job].get(&gpu_type).copied().unwrap_or(0.0) > 0.0);
                mechanism.record_run(*job, placement.type_index, 360.0 - round as f64);
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
