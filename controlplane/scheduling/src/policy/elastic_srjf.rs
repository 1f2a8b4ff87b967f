//! Elastic SRJF (Voda): minimum sizes in order of estimated remaining time
//! (shortest first, as [`super::Srjf`] ranks them), then one more worker
//! at a time, round-robin in that order, while any job is below its
//! maximum and GPUs remain. Preemptive: a long running job loses its GPUs
//! when shorter ones need them.

use super::sizing::{budget, candidates_in, minimums, plan, round_robin};
use super::{srjf, Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct ElasticSrjf;

impl Policy for ElasticSrjf {
    fn name(&self) -> &'static str {
        "elastic_srjf"
    }

    fn admission_order(
        &self,
        input: &SchedulingInput<'_>,
    ) -> Option<Vec<keel_state::model::JobId>> {
        Some(srjf::rank(input))
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let jobs = candidates_in(input, srjf::rank(input));
        let (mut sizes, left) = minimums(&jobs, budget(input.state));
        round_robin(&jobs, &mut sizes, left);
        plan(input, &sizes, &jobs)
    }
}
