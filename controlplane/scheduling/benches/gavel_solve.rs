//! Solve time of the heterogeneity-aware LPs (Clarabel through good_lp)
//! for 32, 256, 2,048 and 10,000 active jobs on a 3-type cluster sized
//! with the jobs (Gavel: ≈ 4 ms, 9 ms and 50 ms for
//! `max_min_fairness_perf` at the first three sizes, reference/gavel.md).
//!
//! Two workloads: `templates`, jobs drawn from 26 model templates (and
//! scale factors 1/2/4), as Gavel's own sweep draws them from its job
//! table — identical jobs are solved as one class; and `distinct`, every
//! job with its own throughputs, the worst case for the class grouping.
//!
//! The space-sharing `max_min_fairness_packed` (Gavel: 2.6 s at 256 jobs)
//! on single-GPU jobs of the 26 templates, every pair of templates with
//! pair figures: each job at 30–90 % of its speed alone.
//!
//! Run: `cargo bench -p keel-state --bench gavel_solve`

use std::collections::BTreeMap;

use criterion::{criterion_group, criterion_main, Criterion};
use keel_scheduling::gavel::{solve, AllocationProblem};
use keel_state::fixtures::SplitMix64;

/// `jobs` jobs; with `templates`, their throughput rows come from that
/// many fixed templates, else each job has its own.
fn problem(jobs: u64, templates: Option<u64>) -> AllocationProblem {
    let mut rng = SplitMix64::new(jobs);
    let per_type = u32::try_from(jobs / 2).unwrap_or(u32::MAX).max(1);
    let mut p = AllocationProblem::new(
        ["v100", "p100", "k80"]
            .into_iter()
            .map(|t| (t.to_string(), per_type))
            .collect(),
    );
    for i in 0..jobs {
        if let Some(n) = templates {
            // Template k's speeds: the same for every job drawn from it.
            let k = rng.below(n);
            let mut t = SplitMix64::new(1000 + k);
            rng = SplitMix64::new(rng.next_u64());
            let v100 = 1.0 + 20.0 * t.unit();
            let row = [
                ("v100", v100),
                ("p100", v100 * (0.4 + 0.4 * t.unit())),
                ("k80", v100 * (0.1 + 0.3 * t.unit())),
            ];
            p.throughputs.insert(
                i,
                row.into_iter().map(|(t, x)| (t.to_string(), x)).collect(),
            );
            p.scale_factors
                .insert(i, [1, 1, 1, 2, 4][rng.below(5) as usize]);
            p.priority_weights.insert(i, 1.0);
            continue;
        }
        let v100 = 1.0 + 20.0 * rng.unit();
        let row = [
            ("v100", v100),
            ("p100", v100 * (0.4 + 0.4 * rng.unit())),
            ("k80", v100 * (0.1 + 0.3 * rng.unit())),
        ];
        p.throughputs.insert(
            i,
            row.into_iter().map(|(t, x)| (t.to_string(), x)).collect(),
        );
        let s = [1, 1, 1, 2, 4][rng.below(5) as usize];
        p.scale_factors.insert(i, s);
        p.priority_weights.insert(i, 1.0);
    }
    p
}

/// `jobs` single-GPU jobs of 26 templates with pair figures for every
/// pair of templates.
fn packed_problem(jobs: u64) -> AllocationProblem {
    let mut p = problem(jobs, Some(26));
    for s in p.scale_factors.values_mut() {
        *s = 1;
    }
    // Each job's template, read back from its v100 speed.
    let mut template_of: BTreeMap<u64, String> = BTreeMap::new();
    for (job, row) in &p.throughputs {
        let key = row.get("v100").copied().unwrap_or(0.0).to_bits();
        let next = template_of.len();
        let name = template_of
            .entry(key)
            .or_insert_with(|| format!("template{next}"))
            .clone();
        p.job_types.insert(*job, name);
    }
    let names: Vec<String> = template_of.values().cloned().collect();
    let mut rng = SplitMix64::new(7);
    for (i, a) in names.iter().enumerate() {
        for b in &names[i..] {
            let figures = ["v100", "p100", "k80"]
                .into_iter()
                .map(|t| {
                    let alone = |name: &str| {
                        p.job_types
                            .iter()
                            .find(|(_, n)| n.as_str() == name)
                            .map_or(0.0, |(job, _)| p.throughput(*job, t))
                    };
                    let fa = alone(a) * (0.3 + 0.6 * rng.unit());
                    let fb = alone(b) * (0.3 + 0.6 * rng.unit());
                    (t.to_string(), [fa, fb])
                })
                .collect();
            p.pair_throughputs
                .entry(a.clone())
                .or_default()
                .insert(b.clone(), figures);
        }
    }
    p
}

fn gavel_solve(c: &mut Criterion) {
    let mut group = c.benchmark_group("gavel_solve");
    group.sample_size(10);
    for jobs in [32u64, 256, 2048, 10_000] {
        let p = problem(jobs, Some(26));
        for policy in ["max_min_fairness_perf", "max_sum_throughput_perf"] {
            group.bench_function(format!("{policy}_{jobs}_jobs_templates"), |b| {
                b.iter(|| solve(policy, &p).expect("solves"))
            });
        }
    }
    for jobs in [32u64, 256, 2048] {
        let p = problem(jobs, None);
        group.bench_function(format!("max_min_fairness_perf_{jobs}_jobs_distinct"), |b| {
            b.iter(|| solve("max_min_fairness_perf", &p).expect("solves"))
        });
    }
    for jobs in [32u64, 256, 2048] {
        let p = packed_problem(jobs);
        group.bench_function(
            format!("max_min_fairness_packed_{jobs}_jobs_templates"),
            |b| b.iter(|| solve("max_min_fairness_packed", &p).expect("solves")),
        );
    }
    group.finish();
}

criterion_group!(benches, gavel_solve);
criterion_main!(benches);
