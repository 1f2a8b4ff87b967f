//! What a recorded history would have been under another policy (issue 27,
//! `keel whatif`): each run's figures, and the simulator's error on the
//! history itself.
//!
//! [`validate`] compares a run of the policies that really decided (the
//! `recorded` run) with what the log says happened, so an operator knows
//! how far to trust the counterfactual runs; [`summarise`] gives one run's
//! figures for the comparison table.

use std::collections::BTreeMap;

use serde::Serialize;

use super::engine::{JctSummary, SimReport, SpeedSources};
use super::history::History;

/// How far a `recorded` run is from what happened: relative errors
/// (|simulated − recorded| / recorded) of the mean and p95 completion time
/// over the jobs that succeeded in both, and the utilisation's difference
/// in points.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Validation {
    /// Jobs that succeeded on the cluster and finished in the run.
    pub jobs_compared: usize,
    pub mean_jct_recorded_s: f64,
    pub mean_jct_simulated_s: f64,
    pub mean_jct_error: f64,
    pub p95_jct_recorded_s: f64,
    pub p95_jct_simulated_s: f64,
    pub p95_jct_error: f64,
    /// The mean over the compared jobs of each one's relative error.
    pub per_job_mean_error: f64,
    pub utilisation_recorded: f64,
    pub utilisation_simulated: f64,
    /// |simulated − recorded|, in utilisation's own unit (0–1).
    pub utilisation_error: f64,
    pub mean_queueing_recorded_s: f64,
    pub mean_queueing_simulated_s: f64,
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The `p` quantile of `values` (sorted here), as [`SimReport::jct`]
/// picks it.
fn quantile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return 0.0;
    }
    values[(((values.len() - 1) as f64) * p).round() as usize]
}

fn relative_error(simulated: f64, recorded: f64) -> f64 {
    if recorded > 0.0 {
        (simulated - recorded).abs() / recorded
    } else {
        0.0
    }
}

/// Compares `report`, a run of [`History::workload`] (job `i` of the
/// report is the history's job `i`), with `history`.
pub fn validate(history: &History, report: &SimReport) -> Validation {
    let mut recorded = Vec::new();
    let mut simulated = Vec::new();
    let mut per_job = Vec::new();
    let mut queued_recorded = Vec::new();
    let mut queued_simulated = Vec::new();
    for result in &report.jobs {
        let Some(job) = usize::try_from(result.id)
            .ok()
            .and_then(|i| history.jobs.get(i))
        else {
            continue;
        };
        if let (Some(start), Some(sim_start)) = (job.first_start_ms, result.first_start_s) {
            queued_recorded.push(start.saturating_sub(job.submitted_ms) as f64 / 1000.0);
            queued_simulated.push(sim_start - result.arrival_s);
        }
        let (Some(real), Some(sim)) = (job.jct_s(), result.jct_s()) else {
            continue;
        };
        recorded.push(real);
        simulated.push(sim);
        per_job.push(relative_error(sim, real));
    }
    let (mean_recorded, mean_simulated) = (mean(&recorded), mean(&simulated));
    let jobs_compared = recorded.len();
    let p95_recorded = quantile(&mut recorded, 0.95);
    let p95_simulated = quantile(&mut simulated, 0.95);
    let utilisation_recorded = history.utilisation();
    Validation {
        jobs_compared,
        mean_jct_recorded_s: mean_recorded,
        mean_jct_simulated_s: mean_simulated,
        mean_jct_error: relative_error(mean_simulated, mean_recorded),
        p95_jct_recorded_s: p95_recorded,
        p95_jct_simulated_s: p95_simulated,
        p95_jct_error: relative_error(p95_simulated, p95_recorded),
        per_job_mean_error: mean(&per_job),
        utilisation_recorded,
        utilisation_simulated: report.utilisation,
        utilisation_error: (report.utilisation - utilisation_recorded).abs(),
        mean_queueing_recorded_s: mean(&queued_recorded),
        mean_queueing_simulated_s: mean(&queued_simulated),
    }
}

/// One run's figures, as the comparison shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    pub policy: String,
    pub jobs: usize,
    pub finished: usize,
    pub unfinished: usize,
    pub cancelled: usize,
    pub mean_jct_s: f64,
    pub median_jct_s: f64,
    pub p95_jct_s: f64,
    pub p99_jct_s: f64,
    /// From arrival to first start, over the jobs that started.
    pub mean_queueing_s: f64,
    pub makespan_s: f64,
    pub utilisation: f64,
    pub preemptions: u64,
    /// Allocations whose speed was measured, scaled from a measured one,
    /// or from a table.
    pub speeds_measured: u64,
    pub speeds_modelled: u64,
    pub speeds_from_table: u64,
    /// Each queue's part of the GPU time the jobs held (with queues).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub queue_shares: BTreeMap<String, f64>,
}

/// `report`'s figures, named `policy`.
pub fn summarise(policy: &str, report: &SimReport) -> RunSummary {
    let JctSummary {
        finished,
        unfinished,
        mean_s,
        median_s,
        p95_s,
        p99_s,
    } = report.jct(None);
    let cancelled = report
        .jobs
        .iter()
        .filter(|j| j.cancelled_s.is_some())
        .count();
    let queued: Vec<f64> = report
        .jobs
        .iter()
        .filter_map(|j| Some(j.first_start_s? - j.arrival_s))
        .collect();
    let SpeedSources {
        measured,
        modelled,
        table,
    } = report.speeds;
    RunSummary {
        policy: policy.to_string(),
        jobs: report.jobs.len(),
        finished,
        // Cancelled jobs did not finish and are not waiting either.
        unfinished: unfinished.saturating_sub(cancelled),
        cancelled,
        mean_jct_s: mean_s,
        median_jct_s: median_s,
        p95_jct_s: p95_s,
        p99_jct_s: p99_s,
        mean_queueing_s: mean(&queued),
        makespan_s: report.makespan_s,
        utilisation: report.utilisation,
        preemptions: report.preemptions,
        speeds_measured: measured,
        speeds_modelled: modelled,
        speeds_from_table: table,
        queue_shares: {
            let total: f64 = report.queues.values().map(|q| q.gpu_s).sum();
            report
                .queues
                .iter()
                .map(|(name, q)| {
                    let share = if total > 0.0 { q.gpu_s / total } else { 0.0 };
                    (name.clone(), share)
                })
                .collect()
        },
    }
}
