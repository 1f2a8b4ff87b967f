//! FfDL's optimizer (as in Voda): jobs by priority, then submission order,
//! get their minimum while GPUs last; the GPUs left are split among them by a
//! dynamic programme that maximises the total speed-up,
//! `P[j][k] = max_g speedup_j(g) + P[j−1][k − g]`, with `g` between the
//! job's minimum and maximum workers (speed-ups from each job's performance
//! model). Ties go to fewer workers, so the result is deterministic.

use crate::perf::JobPerf;

use super::sizing::{candidates_with_minimums, per_worker, plan};
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct FfdlOptimizer;

impl Policy for FfdlOptimizer {
    fn name(&self) -> &'static str {
        "ffdl_optimizer"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let (jobs, mut sizes, spare) = candidates_with_minimums(input);
        // Only jobs that can grow take part in the programme.
        let elastic: Vec<_> = jobs
            .iter()
            .filter(|j| sizes.contains_key(&j.id) && j.spec.workers.max > j.spec.workers.min)
            .collect();
        let spare = spare as usize;
        if elastic.is_empty() || spare == 0 {
            return plan(input, &sizes, &jobs);
        }
        // best[k]: the best total gain with k spare GPUs over the jobs so
        // far; choice[j][k]: extra workers job j takes in that optimum.
        let mut best = vec![0.0f64; spare + 1];
        let mut choice: Vec<Vec<u32>> = Vec::with_capacity(elastic.len());
        for job in &elastic {
            let perf = JobPerf::of(job);
            let per = per_worker(job) as usize;
            let min = job.spec.workers.min;
            let base = perf.speedup(min);
            let most = (job.spec.workers.max - min) as usize;
            let gains: Vec<f64> = (0..=most.min(spare / per))
                .map(|e| perf.speedup(min + e as u32) - base)
                .collect();
            let mut next = vec![0.0f64; spare + 1];
            let mut pick = vec![0u32; spare + 1];
            for k in 0..=spare {
                let mut top = best[k];
                let mut at = 0;
                for (e, gain) in gains.iter().enumerate().skip(1) {
                    let cost = e * per;
                    if cost > k {
                        break;
                    }
                    let value = gain + best[k - cost];
                    if value > top + 1e-12 {
                        top = value;
                        at = e as u32;
                    }
                }
                next[k] = top;
                pick[k] = at;
            }
            best = next;
            choice.push(pick);
        }
        // Walk back from the full spare budget.
        let mut k = spare;
        for (job, pick) in elastic.iter().zip(&choice).rev() {
            let extra = pick[k];
            if extra > 0 {
                if let Some(n) = sizes.get_mut(&job.id) {
                    *n += extra;
                }
                k -= extra as usize * per_worker(job) as usize;
            }
        }
        plan(input, &sizes, &jobs)
    }
}
