//! Shortest remaining job first (Voda's SRJF): jobs ranked by estimated
//! remaining time, preemptively: a shorter job that arrives takes GPUs from
//! the longest running ones. The estimate is remaining steps (total minus
//! the last reported step) over the job's speed at its minimum size on a
//! v100 from the throughput table; a job without `total_steps` goes last.

use crate::model::{Job, JobId};
use crate::throughput;

use super::admit::admit_in_order;
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct Srjf;

/// Estimated seconds of work left for `job` (∞ when unknown).
pub fn remaining_s(job: &Job) -> f64 {
    let Some(total) = job.spec.total_steps else {
        return f64::INFINITY;
    };
    let done = job.progress.as_ref().map_or(0, |p| p.step);
    let left = total.saturating_sub(done) as f64;
    let model = job.spec.model.as_deref().unwrap_or("generic");
    let gpus = job.spec.gpus.saturating_mul(job.spec.workers.min).max(1);
    let speed = throughput::profile(model).steps_per_s("v100", gpus);
    if speed > 0.0 {
        left / speed
    } else {
        f64::INFINITY
    }
}

impl Policy for Srjf {
    fn name(&self) -> &'static str {
        "srjf"
    }

    fn plan(&self, input: &SchedulingInput<'_>) -> Plan {
        let mut ranked: Vec<(f64, u64, JobId)> = input
            .state
            .unfinished_jobs()
            .map(|job| (remaining_s(job), job.submitted_at_ms, job.id))
            .collect();
        ranked.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let order: Vec<JobId> = ranked.into_iter().map(|(_, _, id)| id).collect();
        admit_in_order(input.state, &order, input.now_ms)
    }
}
