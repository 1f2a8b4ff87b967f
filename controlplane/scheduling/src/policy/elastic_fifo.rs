//! Elastic FIFO (Voda): every job that fits gets its minimum by priority
//! (higher first), then in submission order (a job whose minimum does not
//! fit what is left is passed over, not waited for); the GPUs left are
//! handed out one worker at a time, round-robin in that order, while any
//! job is below its maximum.
//! Earlier jobs are never shrunk below their minimum for later ones, but
//! share their extra workers with them.

use super::sizing::{candidates_with_minimums, plan, round_robin};
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct ElasticFifo;

impl Policy for ElasticFifo {
    fn name(&self) -> &'static str {
        "elastic_fifo"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let (jobs, mut sizes, left) = candidates_with_minimums(input);
        round_robin(&jobs, &mut sizes, left);
        plan(input, &sizes, &jobs)
    }
}
