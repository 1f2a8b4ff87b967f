//! Dominant-resource fairness (the baseline Optimus and DL2 compare
//! against): progressive filling from zero, one worker at a time to the
//! job with the smallest dominant share. GPUs are the only resource Keel
//! allocates, so the dominant share is the job's share of the cluster's
//! GPUs and DRF is max-min fairness over GPUs: waiting jobs first get
//! their minimum by priority, then submission order, then the GPUs left go to the jobs
//! holding the fewest, up to their maximum.

use super::sizing::{candidates_with_minimums, greedy, per_worker, plan};
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct Drf;

impl Policy for Drf {
    fn name(&self) -> &'static str {
        "drf"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        let (jobs, mut sizes, left) = candidates_with_minimums(input);
        // Highest gain = smallest share (GPUs held), ties: earlier job.
        greedy(&jobs, &mut sizes, left, |job, n| {
            1.0 / (1.0 + f64::from(n.saturating_mul(per_worker(job))))
        });
        plan(input, &sizes, &jobs)
    }
}
