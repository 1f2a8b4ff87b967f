//! Issue 26's simulator figure: the overloaded 10,000-job multi-GPU
//! workload under 5 s.
//!
//! The same run as `keel sim --generate 10000 --rate 3.2 --cluster
//! 36:36:36 --multi-gpu --gpus-per-server 4 --policy P` (its defaults:
//! seed 0, 360 s rounds, progress every 1,800 s), built in the simulator's
//! crate alone so that a change to the core is measured in minutes; the
//! state hash it prints is the one `keel sim -o json` reports for the same
//! run, so the two can be checked against each other.
//!
//! Run: `cargo bench -p keel-sim --bench overloaded` (`KEEL_SIM_POLICIES=
//! tiresias,optimus` by default; `KEEL_SIM_RUNS`, runs of each, 2).

#![allow(clippy::print_stdout)]

use std::time::Instant;

use keel_scheduling::policy::Policy;

fn main() {
    let runs: usize = std::env::var("KEEL_SIM_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let names = std::env::var("KEEL_SIM_POLICIES").unwrap_or_else(|_| "tiresias,optimus".into());
    let jobs = keel_sim::Generator {
        jobs: 10_000,
        rate_per_hour: 3.2,
        seed: 0,
        multi_gpu: true,
        elastic: false,
    }
    .generate()
    .expect("workload");
    let nodes = keel_sim::cluster_from_counts("36:36:36", 4).expect("cluster");
    let mut config = keel_sim::SimConfig::new(nodes, jobs);
    config.round_s = 360.0;
    config.progress_interval_s = 1800.0;
    for name in names.split(',') {
        let policy: Box<dyn Policy> =
            keel_scheduling::policy::by_name(name, Default::default()).expect("policy");
        for _ in 0..runs {
            let started = Instant::now();
            let report = keel_sim::simulate(&config, policy.as_ref());
            let wall_s = started.elapsed().as_secs_f64();
            let jct = report.jct(None);
            println!(
                "{name}: {wall_s:.2} s; {} rounds, avg JCT {:.1} h, {} preemptions, utilisation {:.1} %, state hash {}",
                report.rounds,
                jct.mean_s / 3600.0,
                report.preemptions,
                report.utilisation * 100.0,
                report.state_hash
            );
        }
    }
}
