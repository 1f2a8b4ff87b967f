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
//! Run: `cargo bench -p keel-core --bench gavel_solve`

use criterion::{criterion_group, criterion_main, Criterion};
use keel_core::fixtures::SplitMix64;
use keel_core::gavel::{solve, AllocationProblem};

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
    group.finish();
}

criterion_group!(benches, gavel_solve);
criterion_main!(benches);
