//! Elastic Tiresias (Voda): jobs ranked as [`super::Tiresias`] ranks them
//! (discretised 2D-LAS with the starvation guard); each gets its minimum
//! in that order while GPUs last, which shrinks low-priority jobs to their
//! minimum (or preempts them) when many wait; the GPUs left go one worker
//! at a time to the job with the largest marginal speed-up
//! `speedup(n+1) − speedup(n)`, from its performance model.

use std::collections::BTreeMap;

use crate::perf::JobPerf;

use super::sizing::{budget, candidates_in, greedy, minimums, plan};
use super::tiresias::{Tiresias, TiresiasOptions};
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Default)]
pub struct ElasticTiresias {
    ranking: Tiresias,
}

impl ElasticTiresias {
    pub fn new(options: TiresiasOptions) -> Self {
        ElasticTiresias {
            ranking: Tiresias::new(options),
        }
    }
}

impl Policy for ElasticTiresias {
    fn name(&self) -> &'static str {
        "elastic_tiresias"
    }

    fn admission_order(
        &self,
        input: &SchedulingInput<'_>,
    ) -> Option<Vec<keel_state::model::JobId>> {
        Some(self.ranking.rank(input))
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let jobs = candidates_in(input, self.ranking.rank(input));
        let (mut sizes, left) = minimums(&jobs, budget(input.state));
        // Models are fitted for the jobs that can grow, when first asked.
        let mut perf: BTreeMap<_, JobPerf<'_>> = BTreeMap::new();
        greedy(&jobs, &mut sizes, left, |job, n| {
            let p = perf.entry(job.id).or_insert_with(|| JobPerf::of(job));
            p.speedup(n + 1) - p.speedup(n)
        });
        plan(input, &sizes, &jobs)
    }
}
