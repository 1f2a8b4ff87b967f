//! Issue 27's speed figure: what `keel whatif` does with a history of
//! 100,000 jobs and about 5 M entries, past reading it.
//!
//! The history is a simulated cluster's own log
//! (`keel_sim::fixtures::scale_history`: 100,000 generated jobs,
//! `KEEL_WHATIF_SCALE_JOBS`, FIFO on 1,536 GPUs). Timed: the recorder
//! reading it (applying every entry to its own state), the workload it
//! gives, and the `recorded` run (more policies on request), with the
//! history in memory. The same history written into a data directory and
//! read back by the `keel` binary is `cargo bench -p keel --bench
//! whatif_journal` (11 minutes to build; this one takes 2).
//!
//! Run: `cargo bench -p keel-sim --bench whatif_scale`

#![allow(clippy::print_stdout)]

use std::time::Instant;

use keel_scheduling::policy::Policy;
use keel_sim::history::Recorder;

/// A count from the environment, or its default.
fn count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let jobs = count("KEEL_WHATIF_SCALE_JOBS", 100_000);
    let started = Instant::now();
    let log = keel_sim::fixtures::scale_history(jobs).expect("history");
    println!(
        "history: {jobs} jobs, {} entries, simulated in {:.1} s",
        log.len(),
        started.elapsed().as_secs_f64()
    );

    let started = Instant::now();
    let mut recorder = Recorder::new();
    for (index, entry) in &log {
        recorder.record(*index, entry);
    }
    let history = recorder.finish();
    let read_s = started.elapsed().as_secs_f64();
    drop(log);
    let workload = history.workload();
    let mut again = keel_sim::SimConfig::new(workload.nodes.clone(), workload.jobs.clone());
    again.round_s = keel_sim::fixtures::SCALE_ROUND_S;
    again.progress_interval_s = keel_sim::fixtures::SCALE_PROGRESS_INTERVAL_S;
    again.node_changes = workload.node_changes.clone();
    again.table_scale = workload.table_scale;
    let workload_s = started.elapsed().as_secs_f64() - read_s;
    println!(
        "recorder: {read_s:.1} s ({:.0} entries/s); workload: {workload_s:.1} s; {} jobs measured",
        history.entries as f64 / read_s,
        workload.jobs_measured
    );
    // The recorded run (FIFO decided); more with
    // `KEEL_WHATIF_SCALE_POLICIES=fifo,srjf,...`.
    let names = std::env::var("KEEL_WHATIF_SCALE_POLICIES").unwrap_or_else(|_| "fifo".into());
    for name in names.split(',') {
        let policy: Box<dyn Policy> =
            keel_scheduling::policy::by_name(name, Default::default()).expect("policy");
        let started = Instant::now();
        let run = keel_sim::simulate(&again, policy.as_ref());
        let v = keel_sim::whatif::validate(&history, &run);
        println!(
            "{name}{}: {:.1} s; mean JCT {:.0} s against {:.0} s recorded",
            if name == "fifo" { " (recorded)" } else { "" },
            started.elapsed().as_secs_f64(),
            v.mean_jct_simulated_s,
            v.mean_jct_recorded_s
        );
    }
}
