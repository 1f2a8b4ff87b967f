//! Shortest remaining job first (Voda's SRJF): jobs ranked by priority
//! (higher first), then by estimated remaining time, preemptively: a shorter job that arrives takes GPUs from
//! the longest running ones. The estimate ([`crate::perf::JobPerf`]) is
//! remaining steps (declared total less the last reported step, or until
//! the fitted loss converges) over the job's speed at its minimum size at a
//! v100's pace: the fitted speed model, else its measured speed scaled
//! along the throughput table's curve, else the table. A job with no
//! estimate goes last.

use std::cmp::Reverse;

use crate::perf::JobPerf;
use keel_state::model::{Job, JobId};

use super::admit::admit_in_order;
use super::{Plan, Policy, SchedulingInput};

#[derive(Debug, Clone, Copy, Default)]
pub struct Srjf;

/// Estimated seconds of work left for `job` (∞ when unknown).
pub fn remaining_s(job: &Job) -> f64 {
    let gpus = job.spec.gpus.saturating_mul(job.spec.workers.min).max(1);
    JobPerf::of(job).remaining_s(gpus)
}

/// Unfinished jobs, higher priority first, then shortest estimated
/// remaining time first (ties: submission order).
pub(crate) fn rank(input: &SchedulingInput<'_>) -> Vec<JobId> {
    let mut ranked: Vec<(Reverse<i32>, f64, u64, JobId)> = input
        .unfinished_jobs()
        .map(|job| {
            (
                Reverse(job.spec.priority),
                remaining_s(job),
                job.submitted_at_ms,
                job.id,
            )
        })
        .collect();
    ranked.sort_unstable_by(|a, b| {
        a.0.cmp(&b.0)
            .then(a.1.total_cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    ranked.into_iter().map(|(_, _, _, id)| id).collect()
}

impl Policy for Srjf {
    fn name(&self) -> &'static str {
        "srjf"
    }

    fn plan<'a>(&self, input: &SchedulingInput<'a>) -> Plan<'a> {
        admit_in_order(
            input,
            rank(input).into_iter().filter_map(|id| input.job(id)),
        )
    }

    fn admission_order(&self, input: &SchedulingInput<'_>) -> Option<Vec<JobId>> {
        Some(rank(input))
    }
}
