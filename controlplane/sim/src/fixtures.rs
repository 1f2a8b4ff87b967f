//! Histories for benchmarks: a simulated cluster's own log at the size
//! issue 27's speed figure names (100,000 jobs, about 5 M entries), shared
//! by the bench that reads it from memory (`keel-sim`'s `whatif_scale`) and
//! the one that writes it into a data directory first (`keel`'s
//! `whatif_journal`), so both time the same history.

use keel_state::LogEntry;

use crate::{SimConfig, WorkloadError};

/// Seconds between the scale history's scheduling rounds.
pub const SCALE_ROUND_S: f64 = 360.0;
/// The longest a running job of the scale history goes without reporting
/// progress, in seconds.
pub const SCALE_PROGRESS_INTERVAL_S: f64 = 2400.0;

/// The log of FIFO scheduling `jobs` generated multi-GPU jobs (seed 27,
/// about 80 % of the cluster's GPU time asked for: a job asks for about
/// 32 GPU-hours on average) on 1,536 GPUs (`512:512:512`, 8 per node),
/// with [`SCALE_ROUND_S`] and [`SCALE_PROGRESS_INTERVAL_S`].
pub fn scale_history(jobs: usize) -> Result<Vec<(u64, LogEntry)>, WorkloadError> {
    let workload = crate::Generator {
        jobs,
        rate_per_hour: 38.8,
        seed: 27,
        multi_gpu: true,
        elastic: false,
    }
    .generate()?;
    let nodes = crate::cluster_from_counts("512:512:512", 8)
        .map_err(|e| WorkloadError::Invalid(e.to_string()))?;
    let mut config = SimConfig::new(nodes, workload);
    config.round_s = SCALE_ROUND_S;
    config.progress_interval_s = SCALE_PROGRESS_INTERVAL_S;
    config.keep_log = true;
    let fifo = keel_scheduling::policy::Fifo::new(Default::default());
    Ok(crate::simulate(&config, &fifo).log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_history_is_the_same_every_time_and_refuses_too_many_jobs() {
        let log = scale_history(40).expect("history");
        assert_eq!(log, scale_history(40).expect("history"));
        let submitted = log
            .iter()
            .filter(|(_, e)| matches!(e.command, keel_state::Command::SubmitJob { .. }))
            .count();
        assert_eq!(submitted, 40);
        assert!(log.windows(2).all(|w| w[0].0 < w[1].0), "indexes ascend");
        assert!(scale_history(usize::MAX).is_err());
    }
}
