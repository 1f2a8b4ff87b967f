//! Optimus: marginal-gain allocation on fitted performance models. Every
//! job first gets its minimum (higher priority first, then submission
//! order, while GPUs last); then a
//! max-heap repeatedly grants one more worker to the job with the highest
//! utility `(T(n) − T(n+1)) / share`, where `T(n)` is the job's estimated
//! remaining time on `n` workers ([`crate::perf::JobPerf`]: remaining
//! steps over the fitted speed) and `share` the worker's share of the
//! cluster's GPUs (its dominant resource). It stops when no grant helps
//! (utility ≤ 0) or nothing fits.

use std::collections::BTreeMap;

use crate::perf::JobPerf;

use super::sizing::{budget, candidates_with_minimums, greedy, per_worker, plan};
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct Optimus;

impl Policy for Optimus {
    fn name(&self) -> &'static str {
        "optimus"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let total = budget(input.state);
        let (jobs, mut sizes, left) = candidates_with_minimums(input);
        // Models are fitted for the jobs that can grow, when first asked.
        let mut perf: BTreeMap<_, JobPerf<'_>> = BTreeMap::new();
        greedy(&jobs, &mut sizes, left, |job, n| {
            let p = perf.entry(job.id).or_insert_with(|| JobPerf::of(job));
            let per = per_worker(job);
            let now = p.remaining_s(n.saturating_mul(per));
            let more = p.remaining_s((n + 1).saturating_mul(per));
            if !now.is_finite() || !more.is_finite() {
                return 0.0;
            }
            let share = f64::from(per) / f64::from(total.max(1));
            (now - more) / share
        });
        plan(input, &sizes, &jobs)
    }
}
